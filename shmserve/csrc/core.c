/*
 * shmserve._core — the Python face of shmserve.h.
 *
 * A Mapping wraps a writable buffer (an mmap of a segment) and exposes the
 * protocol's atomic operations, futex waits (with the GIL released), the ring,
 * request encoding/decoding and validation. All offsets passed in from Python are
 * bounds-checked here: a wrong offset raises, it never touches memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <sys/prctl.h>

#include "shmserve.h"

typedef struct {
  PyObject_HEAD
  Py_buffer view;
  char *base;
  uint64_t size;
} Mapping;

static PyTypeObject MappingType;

static int mapping_init(Mapping *self, PyObject *args, PyObject *kw) {
  PyObject *obj;
  if (!PyArg_ParseTuple(args, "O", &obj)) return -1;
  if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) return -1;
  self->base = (char *)self->view.buf;
  self->size = (uint64_t)self->view.len;
  return 0;
}

static void mapping_dealloc(Mapping *self) {
  if (self->base) PyBuffer_Release(&self->view);
  self->base = NULL;
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *mapping_release(Mapping *self, PyObject *unused) {
  if (self->base) PyBuffer_Release(&self->view);
  self->base = NULL;
  self->size = 0;
  Py_RETURN_NONE;
}

/* Pointer to [off, off+len) inside the mapping, aligned to `align`, or NULL with an
 * exception set. */
static void *at(Mapping *m, unsigned long long off, uint64_t len, uint64_t align) {
  if (!m->base) {
    PyErr_SetString(PyExc_ValueError, "mapping is released");
    return NULL;
  }
  if (off > m->size || len > m->size - off || (align && off % align)) {
    PyErr_Format(PyExc_IndexError, "offset %llu (+%llu) outside mapping of %llu bytes",
                 off, (unsigned long long)len, (unsigned long long)m->size);
    return NULL;
  }
  return m->base + off;
}

#define ATOMIC32(m, off) ((SHMS_ATOMIC(uint32_t) *)at((m), (off), 4, 4))
#define ATOMIC64(m, off) ((SHMS_ATOMIC(uint64_t) *)at((m), (off), 8, 8))

static PyObject *m_load32(Mapping *self, PyObject *arg) {
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, PyLong_AsUnsignedLongLong(arg));
  if (!p) return NULL;
  return PyLong_FromUnsignedLong(shms_load(p, memory_order_seq_cst));
}

static PyObject *m_load64(Mapping *self, PyObject *arg) {
  SHMS_ATOMIC(uint64_t) *p = ATOMIC64(self, PyLong_AsUnsignedLongLong(arg));
  if (!p) return NULL;
  return PyLong_FromUnsignedLongLong(shms_load(p, memory_order_acquire));
}

static PyObject *m_store32(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int v;
  if (!PyArg_ParseTuple(args, "KI", &off, &v)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  shms_store(p, v, memory_order_seq_cst);
  Py_RETURN_NONE;
}

static PyObject *m_store64(Mapping *self, PyObject *args) {
  unsigned long long off, v;
  if (!PyArg_ParseTuple(args, "KK", &off, &v)) return NULL;
  SHMS_ATOMIC(uint64_t) *p = ATOMIC64(self, off);
  if (!p) return NULL;
  shms_store(p, v, memory_order_seq_cst);
  Py_RETURN_NONE;
}

static PyObject *m_add32(Mapping *self, PyObject *args) {
  unsigned long long off;
  int v;
  if (!PyArg_ParseTuple(args, "Ki", &off, &v)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  return PyLong_FromUnsignedLong(shms_fetch_add(p, (uint32_t)v, memory_order_seq_cst));
}

static PyObject *m_add64(Mapping *self, PyObject *args) {
  unsigned long long off, v;
  if (!PyArg_ParseTuple(args, "KK", &off, &v)) return NULL;
  SHMS_ATOMIC(uint64_t) *p = ATOMIC64(self, off);
  if (!p) return NULL;
  return PyLong_FromUnsignedLongLong(shms_fetch_add(p, (uint64_t)v, memory_order_seq_cst));
}

static PyObject *m_cas32(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int expected, desired;
  if (!PyArg_ParseTuple(args, "KII", &off, &expected, &desired)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  uint32_t e = expected;
  return PyBool_FromLong(shms_cas(p, &e, (uint32_t)desired));
}

static PyObject *m_wake(Mapping *self, PyObject *args) {
  unsigned long long off;
  int n = INT32_MAX;
  if (!PyArg_ParseTuple(args, "K|i", &off, &n)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  shms_futex_wake(p, n);
  Py_RETURN_NONE;
}

/* doorbell_ring(word_off, sleeping_off, n=1) */
static PyObject *m_doorbell_ring(Mapping *self, PyObject *args) {
  unsigned long long off, soff;
  int n = 1;
  if (!PyArg_ParseTuple(args, "KK|i", &off, &soff, &n)) return NULL;
  SHMS_ATOMIC(uint32_t) *w = ATOMIC32(self, off), *s = ATOMIC32(self, soff);
  if (!w || !s) return NULL;
  shms_doorbell_ring(w, s, n);
  Py_RETURN_NONE;
}

/* doorbell_wait(word_off, sleeping_off, seen, spin_ns, timeout_ns) -> bool moved */
static PyObject *m_doorbell_wait(Mapping *self, PyObject *args) {
  unsigned long long off, soff;
  unsigned int seen;
  long long spin_ns, timeout_ns;
  if (!PyArg_ParseTuple(args, "KKILL", &off, &soff, &seen, &spin_ns, &timeout_ns)) return NULL;
  SHMS_ATOMIC(uint32_t) *w = ATOMIC32(self, off), *s = ATOMIC32(self, soff);
  if (!w || !s) return NULL;
  int moved;
  Py_BEGIN_ALLOW_THREADS moved = shms_doorbell_wait(w, s, seen, spin_ns, timeout_ns);
  Py_END_ALLOW_THREADS return PyBool_FromLong(moved);
}

/* ---------------------------------------------------------------- ring */
/* Every ring call takes the (offset, capacity) that ring_attach() returned once:
 * the header is client-writable, so it is never read again after attaching. */

static int ring_view(Mapping *self, unsigned long long off, unsigned long long cap,
                     shms_ring *r) {
  if (cap < 2 || (cap & (cap - 1)) || cap > (1u << 30)) {
    PyErr_SetString(PyExc_ValueError, "ring capacity must be a power of two");
    return -1;
  }
  r->ctl = (shms_control *)at(self, 0, sizeof(shms_control), 64);
  r->cells = (shms_ring_cell *)at(self, off, cap * sizeof(shms_ring_cell), 64);
  r->capacity = cap;
  return r->ctl && r->cells ? 0 : -1;
}

/* ring_attach() -> (ring_offset, ring_capacity), checked once. */
static PyObject *m_ring_attach(Mapping *self, PyObject *unused) {
  shms_ring r;
  if (!at(self, 0, 0, 0)) return NULL;
  if (shms_ring_attach(&r, self->base, self->size) != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "not a shmserve control segment (bad magic, version or ring)");
    return NULL;
  }
  return Py_BuildValue("(KK)", (unsigned long long)((char *)r.cells - self->base),
                       (unsigned long long)r.capacity);
}

/* ring_push(offset, capacity, owner, slot, generation) -> shms_ring_result */
static PyObject *m_ring_push(Mapping *self, PyObject *args) {
  unsigned long long off, cap;
  unsigned int owner, slot, gen;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKIII", &off, &cap, &owner, &slot, &gen)) return NULL;
  if (ring_view(self, off, cap, &r) < 0) return NULL;
  return PyLong_FromLong(shms_ring_push(&r, owner, slot, gen));
}

/* ring_pop(offset, capacity, pos) -> None (empty) | (kind, a, b, c):
 *   (SHMS_POP_OK, client, slot, generation): taken; the position is now pos + 1
 *   (SHMS_POP_STALLED, owner, head_seq, 0) | (SHMS_POP_CORRUPT, 0, head_seq, 0) */
static PyObject *m_ring_pop(Mapping *self, PyObject *args) {
  unsigned long long off, cap, pos;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKK", &off, &cap, &pos)) return NULL;
  if (ring_view(self, off, cap, &r) < 0) return NULL;
  uint64_t p = pos, head_seq = 0;
  shms_ring_entry e;
  uint32_t owner = 0;
  int k = shms_ring_pop(&r, &p, &e, &owner, &head_seq);
  if (k == SHMS_POP_OK) return Py_BuildValue("(iIII)", k, e.client_id, e.slot, e.generation);
  if (k == SHMS_POP_EMPTY) Py_RETURN_NONE;
  return Py_BuildValue("(iIKi)", k, owner, (unsigned long long)head_seq, 0);
}

/* ring_skip(offset, capacity, pos, head_seq) -> True if the head was skipped. */
static PyObject *m_ring_skip(Mapping *self, PyObject *args) {
  unsigned long long off, cap, pos, head_seq;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKKK", &off, &cap, &pos, &head_seq)) return NULL;
  if (ring_view(self, off, cap, &r) < 0) return NULL;
  uint64_t p = pos;
  return PyBool_FromLong(shms_ring_skip(&r, &p, head_seq));
}

/* ring_repair(offset, capacity, pos) -> True if enqueue_pos had to be moved back. */
static PyObject *m_ring_repair(Mapping *self, PyObject *args) {
  unsigned long long off, cap, pos;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKK", &off, &cap, &pos)) return NULL;
  if (ring_view(self, off, cap, &r) < 0) return NULL;
  return PyBool_FromLong(shms_ring_repair(&r, pos));
}

/* ring_pending(offset, capacity, pos) -> [(client, slot, generation)] published and
 * not yet consumed from position pos on (a restarted batcher, the sweep). */
static PyObject *m_ring_pending(Mapping *self, PyObject *args) {
  unsigned long long off, cap, pos;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKK", &off, &cap, &pos)) return NULL;
  if (ring_view(self, off, cap, &r) < 0) return NULL;
  /* Only [pos, enqueue_pos): a published-looking cell past enqueue_pos is no entry
   * the consumer will reach soon, so it must not keep the sweep from a request. */
  uint64_t enq = shms_load(&r.ctl->enqueue_pos, memory_order_acquire);
  uint64_t end = enq - pos <= cap ? enq : pos;
  PyObject *out = PyList_New(0);
  for (uint64_t q = pos; out && q < end; q++) {
    shms_ring_cell *c = &r.cells[q & (cap - 1)];
    if (shms_load(&c->seq, memory_order_acquire) != q + 1) continue;
    PyObject *t = Py_BuildValue("(III)", c->client_id, c->slot, c->generation);
    if (!t || PyList_Append(out, t) < 0) Py_CLEAR(out);
    Py_XDECREF(t);
  }
  return out;
}

/* ---------------------------------------------------------------- requests */

static int parse_shape(PyObject *shape, shms_tensor_ref *t) {
  PyObject *seq = PySequence_Fast(shape, "shape must be a sequence");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > SHMS_MAX_DIMS) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError, "tensor has %zd dimensions (limit %d)", n, SHMS_MAX_DIMS);
    return -1;
  }
  t->ndim = (uint32_t)n;
  for (Py_ssize_t i = 0; i < n; i++) {
    t->shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (t->shape[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return -1;
    }
  }
  Py_DECREF(seq);
  return 0;
}

/* Tuples (index, dtype, offset, nbytes, shape) -> refs. Returns count or -1. */
static int parse_refs(PyObject *list, shms_tensor_ref *refs) {
  PyObject *seq = PySequence_Fast(list, "tensors must be a sequence");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > SHMS_MAX_TENSORS) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError, "%zd tensors in one request (limit %d)", n, SHMS_MAX_TENSORS);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    shms_tensor_ref *t = &refs[i];
    PyObject *shape;
    unsigned int index, dtype;
    unsigned long long offset, nbytes;
    memset(t, 0, sizeof *t);
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "IIKKO", &index, &dtype, &offset,
                          &nbytes, &shape)) {
      Py_DECREF(seq);
      return -1;
    }
    t->index = index;
    t->dtype = dtype;
    t->offset = offset;
    t->nbytes = nbytes;
    if (parse_shape(shape, t) < 0) {
      Py_DECREF(seq);
      return -1;
    }
  }
  Py_DECREF(seq);
  return (int)n;
}

static PyObject *refs_to_list(const shms_tensor_ref *refs, uint32_t n) {
  if (n > SHMS_MAX_TENSORS) n = SHMS_MAX_TENSORS;
  PyObject *out = PyList_New(n);
  if (!out) return NULL;
  for (uint32_t i = 0; i < n; i++) {
    const shms_tensor_ref *t = &refs[i];
    uint32_t nd = t->ndim < SHMS_MAX_DIMS ? t->ndim : SHMS_MAX_DIMS;
    PyObject *shape = PyTuple_New(nd);
    if (!shape) {
      Py_DECREF(out);
      return NULL;
    }
    for (uint32_t d = 0; d < nd; d++) PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(t->shape[d]));
    PyList_SET_ITEM(out, i, Py_BuildValue("(IIKKN)", t->index, t->dtype,
                                          (unsigned long long)t->offset,
                                          (unsigned long long)t->nbytes, shape));
  }
  return out;
}

static shms_slot *slot_at(Mapping *self, unsigned long long off) {
  return (shms_slot *)at(self, off, sizeof(shms_slot), 64);
}

/* Client: write_request(slot_off, generation, model_id, inputs, outputs, client_tag)
 * then mark SUBMITTED. The caller pushes the ring entry afterwards. */
static PyObject *m_write_request(Mapping *self, PyObject *args) {
  unsigned long long off, tag = 0;
  unsigned int gen, model_id;
  PyObject *inputs, *outputs;
  if (!PyArg_ParseTuple(args, "KIIOO|K", &off, &gen, &model_id, &inputs, &outputs, &tag))
    return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s) return NULL;
  uint64_t t0 = shms_now_ns();
  shms_request *r = &s->request;
  int ni = parse_refs(inputs, r->inputs);
  if (ni < 0) return NULL;
  int no = parse_refs(outputs, r->outputs);
  if (no < 0) return NULL;
  r->model_id = model_id;
  r->n_inputs = (uint32_t)ni;
  r->n_outputs = (uint32_t)no;
  r->flags = 0;
  r->client_tag = tag;
  s->generation = gen;
  s->status = -1;
  s->n_results = 0;
  s->error[0] = 0;
  memset(s->t_ns, 0, sizeof s->t_ns);
  s->t_ns[SHMS_T_CLIENT_WRITE] = t0;
  s->t_ns[SHMS_T_ENQUEUE] = shms_now_ns();
  /* SYNC POINT: release pairs with the batcher's CAS SUBMITTED -> QUEUED. */
  shms_store(&s->state, (uint32_t)SHMS_SLOT_SUBMITTED, memory_order_release);
  Py_RETURN_NONE;
}

/* Client: read_result(slot_off) -> (status, error, results, t_ns tuple) */
static PyObject *m_read_result(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  /* SYNC POINT: acquire pairs with the worker's release store of DONE. */
  if (shms_load(&s->state, memory_order_acquire) != SHMS_SLOT_DONE) Py_RETURN_NONE;
  char err[SHMS_ERROR_BYTES];
  shms_copy_name(err, sizeof err, s->error, sizeof s->error);
  PyObject *msg = PyUnicode_DecodeUTF8(err, (Py_ssize_t)strlen(err), "replace");
  if (!msg) return NULL;
  PyObject *results = refs_to_list(s->results, s->status == SHMS_OK ||
                                   s->status == SHMS_ERR_OUTPUT_TOO_SMALL ? s->n_results : 0);
  if (!results) return NULL;
  PyObject *ts = PyTuple_New(SHMS_T_COUNT);
  for (int i = 0; i < SHMS_T_COUNT; i++)
    PyTuple_SET_ITEM(ts, i, PyLong_FromUnsignedLongLong(s->t_ns[i]));
  return Py_BuildValue("(iNNN)", s->status, msg, results, ts);
}

static void finish_slot(shms_slot *s, SHMS_ATOMIC(uint32_t) * completions,
                        SHMS_ATOMIC(uint32_t) * waiters) {
  s->t_ns[SHMS_T_COMPLETE] = shms_now_ns();
  /* SYNC POINT: release pairs with the client's acquire load in read_result. */
  shms_store(&s->state, (uint32_t)SHMS_SLOT_DONE, memory_order_release);
  /* SYNC POINT: futex wake pairs with the client's doorbell_wait on completions. */
  shms_doorbell_ring(completions, waiters, INT32_MAX);
}

/* The server's view of an arena header. Its magic is not checked: the server created
 * the segment, and its owner may have scribbled over the header; only the futex words
 * at fixed offsets are used. */
static shms_arena_header *arena_of(Mapping *self) {
  return (shms_arena_header *)at(self, 0, sizeof(shms_arena_header), 64);
}

/* Server: complete(slot_off, generation, status, error, results) on an arena
 * mapping. Writes only if the slot still holds that generation and is not DONE.
 * Returns True if the client was answered. */
static PyObject *m_complete(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int gen;
  int status;
  const char *msg;
  PyObject *results;
  if (!PyArg_ParseTuple(args, "KIisO", &off, &gen, &status, &msg, &results)) return NULL;
  shms_arena_header *h = arena_of(self);
  if (!h) return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s) return NULL;
  shms_tensor_ref refs[SHMS_MAX_TENSORS];
  int n = parse_refs(results, refs);
  if (n < 0) return NULL;
  uint32_t st = shms_load(&s->state, memory_order_acquire);
  if (s->generation != gen || st == SHMS_SLOT_DONE || st == SHMS_SLOT_FREE) Py_RETURN_FALSE;
  memcpy(s->results, refs, sizeof(shms_tensor_ref) * (size_t)n);
  s->n_results = (uint32_t)n;
  s->status = status;
  snprintf(s->error, sizeof s->error, "%s", msg);
  finish_slot(s, &h->completions, &h->waiters);
  Py_RETURN_TRUE;
}

/* Batcher: arena.take(slot_off, slot_index, generation, client_id, lease, server,
 * shadow_off, models_off, n_models, data_begin) copies the request into the shadow at shadow_off (server mapping),
 * claims the slot (SUBMITTED -> QUEUED) and validates the copy.
 * -> (model_id, batch_rows, shape_key) on success,
 *    (status, message) when invalid (the caller answers the client),
 *    None when the slot was not SUBMITTED with that generation (stale entry). */
static PyObject *m_take(Mapping *arena, PyObject *args) {
  Mapping *server;
  unsigned long long slot_off, shadow_off, models_off, data_begin;
  unsigned int gen, n_models, client_id, slot_index, lease;
  if (!PyArg_ParseTuple(args, "KIIIIO!KKIK", &slot_off, &slot_index, &gen, &client_id, &lease,
                        &MappingType, &server, &shadow_off, &models_off, &n_models, &data_begin))
    return NULL;
  shms_arena_header *h = arena_of(arena);
  if (!h) return NULL;
  shms_slot *s = slot_at(arena, slot_off);
  shms_shadow *sh = (shms_shadow *)at(server, shadow_off, sizeof(shms_shadow), 8);
  shms_model_entry *models =
      (shms_model_entry *)at(server, models_off, (uint64_t)n_models * sizeof(shms_model_entry), 8);
  if (!s || !sh || !models) return NULL;
  uint32_t expected = SHMS_SLOT_SUBMITTED;
  if (s->generation != gen || !shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_QUEUED))
    Py_RETURN_NONE;
  if (s->generation != gen) {
    /* The client reused the slot between our check and the CAS: that newer request is
     * not this entry's. Give it back; its own entry (or the sweep) brings it. */
    expected = SHMS_SLOT_QUEUED;
    shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_SUBMITTED);
    Py_RETURN_NONE;
  }
  s->t_ns[SHMS_T_DEQUEUE] = shms_now_ns();
  /* Copy first, then validate the copy: the client cannot change what we check. */
  memcpy(&sh->request, &s->request, sizeof(shms_request));
  sh->client_id = client_id;
  sh->slot = slot_index;
  sh->generation = gen;
  sh->lease = lease;
  sh->batch_rows = 0;
  char err[SHMS_ERROR_BYTES];
  uint32_t model_id = sh->request.model_id;
  if (model_id >= n_models)
    return Py_BuildValue("(is)", SHMS_ERR_NOT_FOUND, "request names an unknown model id");
  shms_model_entry *m = &models[model_id];
  if (!shms_load(&m->ready, memory_order_acquire)) {
    snprintf(err, sizeof err, "model '%s' version %lld is not available (it failed to load; "
             "see `shmserve models`)", m->name, (long long)m->version);
    return Py_BuildValue("(is)", SHMS_ERR_UNAVAILABLE, err);
  }
  uint32_t rows = 0;
  int st = shms_validate_request(&sh->request, m, data_begin, arena->size, &rows, err, sizeof err);
  if (st != SHMS_OK) return Py_BuildValue("(is)", st, err);
  sh->batch_rows = rows;
  /* Shape key: requests batch together only when every input has the same dtype
   * and the same non-batch dimensions. */
  int64_t key[SHMS_MAX_TENSORS * (SHMS_MAX_DIMS + 1)]; /* per input: (index, ndim), dims */
  size_t nk = 0;
  uint32_t skip = m->max_batch_size > 0;
  for (uint32_t k = 0; k < m->n_inputs; k++) /* in model order, whatever the request's */
    for (uint32_t i = 0; i < sh->request.n_inputs; i++) {
      shms_tensor_ref *t = &sh->request.inputs[i];
      if (t->index != k) continue;
      key[nk++] = ((int64_t)t->index << 32) | t->ndim;
      for (uint32_t d = skip; d < t->ndim; d++) key[nk++] = t->shape[d];
    }
  return Py_BuildValue("(IIy#)", model_id, rows, (const char *)key, (Py_ssize_t)(nk * sizeof(int64_t)));
}

/* stamp(slot_off, which): record a timestamp in a slot (server side). */
static PyObject *m_stamp(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int which;
  if (!PyArg_ParseTuple(args, "KI", &off, &which)) return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s || which >= SHMS_T_COUNT) {
    if (s) PyErr_SetString(PyExc_IndexError, "timestamp index");
    return NULL;
  }
  s->t_ns[which] = shms_now_ns();
  Py_RETURN_NONE;
}

/* Worker: set_running(slot_off, generation): QUEUED -> RUNNING. */
static PyObject *m_set_running(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int gen;
  int again = 0; /* a successor re-running its predecessor's batch: RUNNING -> RUNNING */
  if (!PyArg_ParseTuple(args, "KI|p", &off, &gen, &again)) return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s) return NULL;
  uint32_t expected = SHMS_SLOT_QUEUED;
  if (s->generation != gen) Py_RETURN_FALSE;
  int ok = shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_RUNNING);
  if (!ok && again) { /* the predecessor may have died before or after its set_running */
    expected = SHMS_SLOT_RUNNING;
    ok = shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_RUNNING);
  }
  if (ok) s->t_ns[SHMS_T_COMPUTE_START] = shms_now_ns(); /* only a slot that is ours */
  return PyBool_FromLong(ok);
}

/* put(offset, obj): copies a C-contiguous buffer (a numpy array, bytes) into the
 * mapping at offset; the GIL is released for large copies. Returns the byte count. */
static PyObject *m_put(Mapping *self, PyObject *args) {
  unsigned long long off;
  PyObject *obj;
  if (!PyArg_ParseTuple(args, "KO", &off, &obj)) return NULL;
  Py_buffer src;
  if (PyObject_GetBuffer(obj, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  char *dst = (char *)at(self, off, (uint64_t)src.len, 0);
  if (dst) {
    if (src.len > (1 << 16)) {
      Py_BEGIN_ALLOW_THREADS memcpy(dst, src.buf, (size_t)src.len);
      Py_END_ALLOW_THREADS
    } else {
      memcpy(dst, src.buf, (size_t)src.len);
    }
  }
  Py_ssize_t n = src.len;
  PyBuffer_Release(&src);
  return dst ? PyLong_FromSsize_t(n) : NULL;
}

/* locate(obj) -> offset of obj's (C-contiguous) memory inside this mapping, or -1. */
static PyObject *m_locate(Mapping *self, PyObject *obj) {
  Py_buffer b;
  if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear();
    return PyLong_FromLong(-1);
  }
  long long off = -1;
  if (self->base && (char *)b.buf >= self->base &&
      (uint64_t)((char *)b.buf - self->base) + (uint64_t)b.len <= self->size)
    off = (long long)((char *)b.buf - self->base);
  PyBuffer_Release(&b);
  return PyLong_FromLongLong(off);
}

/* read_shadow(off) -> (client_id, slot, generation, lease, batch_rows, inputs, outputs)
 * from a validated shms_shadow in the server segment. */
static PyObject *m_read_shadow(Mapping *self, PyObject *arg) {
  shms_shadow *sh = (shms_shadow *)at(self, PyLong_AsUnsignedLongLong(arg), sizeof(shms_shadow), 8);
  if (!sh) return NULL;
  const shms_request *r = &sh->request;
  return Py_BuildValue("(IIIIINN)", sh->client_id, sh->slot, sh->generation, sh->lease,
                       sh->batch_rows, refs_to_list(r->inputs, r->n_inputs),
                       refs_to_list(r->outputs, r->n_outputs));
}

/* store32_many(offset, [u32...]): plain stores of consecutive u32s; publish them
 * afterwards with a seq_cst store32 of the word that guards them. */
static PyObject *m_store32_many(Mapping *self, PyObject *args) {
  unsigned long long off;
  PyObject *list;
  if (!PyArg_ParseTuple(args, "KO", &off, &list)) return NULL;
  PyObject *seq = PySequence_Fast(list, "expected a sequence of ints");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  uint32_t *dst = (uint32_t *)at(self, off, (uint64_t)n * 4, 4);
  for (Py_ssize_t i = 0; dst && i < n; i++) {
    dst[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    if (PyErr_Occurred()) dst = NULL;
  }
  Py_DECREF(seq);
  if (!dst) return NULL;
  Py_RETURN_NONE;
}

/* record_batch(model_off, n_requests, rows, n_ok, compute_ns): a worker's statistics
 * for one execution, on the server mapping. */
static PyObject *m_record_batch(Mapping *self, PyObject *args) {
  unsigned long long off, compute_ns;
  unsigned int n, rows, ok;
  if (!PyArg_ParseTuple(args, "KIIIK", &off, &n, &rows, &ok, &compute_ns)) return NULL;
  shms_model_entry *m = (shms_model_entry *)at(self, off, sizeof(shms_model_entry), 8);
  if (!m) return NULL;
  shms_fetch_add(&m->execution_count, 1u, memory_order_relaxed);
  shms_fetch_add(&m->compute_ns, compute_ns, memory_order_relaxed);
  shms_fetch_add(&m->inference_count, rows, memory_order_relaxed);
  shms_fetch_add(&m->request_success, ok, memory_order_relaxed);
  shms_fetch_add(&m->request_failure, n - ok, memory_order_relaxed);
  if (n > 0) shms_fetch_add(&m->batch_requests[(n < SHMS_BATCH_HIST ? n : SHMS_BATCH_HIST) - 1], 1u,
                            memory_order_relaxed);
  Py_RETURN_NONE;
}

static PyMethodDef mapping_methods[] = {
    {"record_batch", (PyCFunction)m_record_batch, METH_VARARGS, "Worker statistics of a batch."},
    {"put", (PyCFunction)m_put, METH_VARARGS, "Copy a contiguous buffer in at offset."},
    {"locate", (PyCFunction)m_locate, METH_O, "Offset of a buffer inside the mapping, or -1."},
    {"read_shadow", (PyCFunction)m_read_shadow, METH_O, "Decode a validated request copy."},
    {"store32_many", (PyCFunction)m_store32_many, METH_VARARGS, "Store consecutive u32s."},
    {"release", (PyCFunction)mapping_release, METH_NOARGS, "Release the buffer."},
    {"load32", (PyCFunction)m_load32, METH_O, "Atomic acquire load of a u32 at offset."},
    {"load64", (PyCFunction)m_load64, METH_O, "Atomic acquire load of a u64 at offset."},
    {"store32", (PyCFunction)m_store32, METH_VARARGS, "Atomic release store of a u32."},
    {"store64", (PyCFunction)m_store64, METH_VARARGS, "Atomic release store of a u64."},
    {"add32", (PyCFunction)m_add32, METH_VARARGS, "Atomic fetch-add on a u32; returns old."},
    {"add64", (PyCFunction)m_add64, METH_VARARGS, "Atomic fetch-add on a u64; returns old."},
    {"cas32", (PyCFunction)m_cas32, METH_VARARGS, "Compare-and-swap a u32; returns success."},
    {"wake", (PyCFunction)m_wake, METH_VARARGS, "futex wake on the u32 at offset."},
    {"doorbell_ring", (PyCFunction)m_doorbell_ring, METH_VARARGS, "Bump a doorbell and wake."},
    {"doorbell_wait", (PyCFunction)m_doorbell_wait, METH_VARARGS,
     "Spin then sleep until a doorbell moves past `seen`; GIL released."},
    {"ring_attach", (PyCFunction)m_ring_attach, METH_NOARGS, "Check the ring once: (offset, capacity)."},
    {"ring_push", (PyCFunction)m_ring_push, METH_VARARGS, "Push (client, slot, generation)."},
    {"ring_pop", (PyCFunction)m_ring_pop, METH_VARARGS, "Pop the ring head (consumer only)."},
    {"ring_skip", (PyCFunction)m_ring_skip, METH_VARARGS, "Skip the head cell (consumer only)."},
    {"ring_repair", (PyCFunction)m_ring_repair, METH_VARARGS, "Fix a forged enqueue_pos."},
    {"ring_pending", (PyCFunction)m_ring_pending, METH_VARARGS, "Published, unconsumed entries."},
    {"write_request", (PyCFunction)m_write_request, METH_VARARGS, "Client: fill a slot."},
    {"read_result", (PyCFunction)m_read_result, METH_O, "Client: read a DONE slot."},
    {"take", (PyCFunction)m_take, METH_VARARGS, "Batcher: claim, copy and validate."},
    {"set_running", (PyCFunction)m_set_running, METH_VARARGS,
     "Worker: QUEUED -> RUNNING (RUNNING again when re-running a dead worker's batch)."},
    {"complete", (PyCFunction)m_complete, METH_VARARGS, "Server: answer a slot."},
    {"stamp", (PyCFunction)m_stamp, METH_VARARGS, "Record a timestamp in a slot."},
    {NULL}};

static PyObject *mapping_size(Mapping *self, void *c) { return PyLong_FromUnsignedLongLong(self->size); }
static PyGetSetDef mapping_getset[] = {
    {"size", (getter)mapping_size, NULL, "bytes mapped", NULL},
    {NULL}};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Protocol operations on a writable buffer holding a shmserve segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mapping_init,
    .tp_dealloc = (destructor)mapping_dealloc,
    .tp_methods = mapping_methods,
    .tp_getset = mapping_getset,
};

/* ---------------------------------------------------------------- module */

static PyObject *f_now_ns(PyObject *m, PyObject *unused) {
  return PyLong_FromUnsignedLongLong(shms_now_ns());
}

static PyObject *f_set_parent_death_signal(PyObject *m, PyObject *arg) {
  if (prctl(PR_SET_PDEATHSIG, (unsigned long)PyLong_AsLong(arg)) != 0)
    return PyErr_SetFromErrno(PyExc_OSError);
  Py_RETURN_NONE;
}

static PyObject *f_set_timer_slack(PyObject *m, PyObject *arg) {
  if (prctl(PR_SET_TIMERSLACK, (unsigned long)PyLong_AsUnsignedLong(arg)) != 0)
    return PyErr_SetFromErrno(PyExc_OSError);
  Py_RETURN_NONE;
}

#define ADD(d, name, value)                                         \
  do {                                                              \
    PyObject *v_ = PyLong_FromUnsignedLongLong((unsigned long long)(value)); \
    if (!v_ || PyDict_SetItemString(d, name, v_) < 0) return NULL;  \
    Py_DECREF(v_);                                                  \
  } while (0)

/* layout() -> dict of every size, offset and constant the Python side uses. */
static PyObject *f_layout(PyObject *m, PyObject *unused) {
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  ADD(d, "PROTOCOL_VERSION", SHMS_PROTOCOL_VERSION);
  ADD(d, "MAGIC_CONTROL", SHMS_MAGIC_CONTROL);
  ADD(d, "MAGIC_ARENA", SHMS_MAGIC_ARENA);
  ADD(d, "MAGIC_SERVER", SHMS_MAGIC_SERVER);
  ADD(d, "MAX_TENSORS", SHMS_MAX_TENSORS);
  ADD(d, "MAX_DIMS", SHMS_MAX_DIMS);
  ADD(d, "ERROR_BYTES", SHMS_ERROR_BYTES);
  ADD(d, "NAME_BYTES", SHMS_NAME_BYTES);
  ADD(d, "MAX_BATCH_REQUESTS", SHMS_MAX_BATCH_REQUESTS);
  ADD(d, "DATA_ALIGN", SHMS_DATA_ALIGN);
  ADD(d, "BATCH_HIST", SHMS_BATCH_HIST);
  ADD(d, "MAILBOX_RETIRED", SHMS_MAILBOX_RETIRED);
  ADD(d, "tensor_ref.size", sizeof(shms_tensor_ref));
  ADD(d, "request.size", sizeof(shms_request));
  ADD(d, "ring_cell.size", sizeof(shms_ring_cell));
  ADD(d, "control.size", sizeof(shms_control));
  ADD(d, "control.ring_offset", offsetof(shms_control, ring_offset));
  ADD(d, "control.ring_capacity", offsetof(shms_control, ring_capacity));
  ADD(d, "control.server_pid", offsetof(shms_control, server_pid));
  ADD(d, "control.segment_bytes", offsetof(shms_control, segment_bytes));
  ADD(d, "control.server_state", offsetof(shms_control, server_state));
  ADD(d, "control.enqueue_pos", offsetof(shms_control, enqueue_pos));
  ADD(d, "control.dequeue_pos", offsetof(shms_control, dequeue_pos));
  ADD(d, "control.doorbell", offsetof(shms_control, doorbell));
  ADD(d, "control.batcher_sleeping", offsetof(shms_control, batcher_sleeping));
  ADD(d, "slot.size", sizeof(shms_slot));
  ADD(d, "slot.state", offsetof(shms_slot, state));
  ADD(d, "slot.generation", offsetof(shms_slot, generation));
  ADD(d, "slot.status", offsetof(shms_slot, status));
  ADD(d, "slot.t_ns", offsetof(shms_slot, t_ns));
  ADD(d, "slot.error", offsetof(shms_slot, error));
  ADD(d, "slot.request", offsetof(shms_slot, request));
  ADD(d, "slot.results", offsetof(shms_slot, results));
  ADD(d, "arena.size", sizeof(shms_arena_header));
  ADD(d, "arena.client_id", offsetof(shms_arena_header, client_id));
  ADD(d, "arena.generation", offsetof(shms_arena_header, generation));
  ADD(d, "arena.n_slots", offsetof(shms_arena_header, n_slots));
  ADD(d, "arena.slots_offset", offsetof(shms_arena_header, slots_offset));
  ADD(d, "arena.data_offset", offsetof(shms_arena_header, data_offset));
  ADD(d, "arena.segment_bytes", offsetof(shms_arena_header, segment_bytes));
  ADD(d, "arena.completions", offsetof(shms_arena_header, completions));
  ADD(d, "arena.waiters", offsetof(shms_arena_header, waiters));
  ADD(d, "client_entry.size", sizeof(shms_client_entry));
  ADD(d, "client_entry.state", offsetof(shms_client_entry, state));
  ADD(d, "client_entry.generation", offsetof(shms_client_entry, generation));
  ADD(d, "client_entry.segment", offsetof(shms_client_entry, segment));
  ADD(d, "client_entry.segment_bytes", offsetof(shms_client_entry, segment_bytes));
  ADD(d, "client_entry.pid", offsetof(shms_client_entry, pid));
  ADD(d, "client_entry.uid", offsetof(shms_client_entry, uid));
  ADD(d, "tensor_spec.size", sizeof(shms_tensor_spec));
  ADD(d, "model.size", sizeof(shms_model_entry));
  ADD(d, "model.version", offsetof(shms_model_entry, version));
  ADD(d, "model.max_batch_size", offsetof(shms_model_entry, max_batch_size));
  ADD(d, "model.ready", offsetof(shms_model_entry, ready));
  ADD(d, "model.inputs", offsetof(shms_model_entry, inputs));
  ADD(d, "model.outputs", offsetof(shms_model_entry, outputs));
  ADD(d, "model.request_success", offsetof(shms_model_entry, request_success));
  ADD(d, "model.request_failure", offsetof(shms_model_entry, request_failure));
  ADD(d, "model.inference_count", offsetof(shms_model_entry, inference_count));
  ADD(d, "model.execution_count", offsetof(shms_model_entry, execution_count));
  ADD(d, "model.compute_ns", offsetof(shms_model_entry, compute_ns));
  ADD(d, "model.queue_ns", offsetof(shms_model_entry, queue_ns));
  ADD(d, "model.batch_requests", offsetof(shms_model_entry, batch_requests));
  ADD(d, "shadow.size", sizeof(shms_shadow));
  ADD(d, "shadow.client_id", offsetof(shms_shadow, client_id));
  ADD(d, "shadow.slot", offsetof(shms_shadow, slot));
  ADD(d, "shadow.generation", offsetof(shms_shadow, generation));
  ADD(d, "shadow.lease", offsetof(shms_shadow, lease));
  ADD(d, "shadow.batch_rows", offsetof(shms_shadow, batch_rows));
  ADD(d, "shadow.request", offsetof(shms_shadow, request));
  ADD(d, "mailbox.size", sizeof(shms_mailbox));
  ADD(d, "mailbox.state", offsetof(shms_mailbox, state));
  ADD(d, "mailbox.worker_sleeping", offsetof(shms_mailbox, worker_sleeping));
  ADD(d, "mailbox.model_id", offsetof(shms_mailbox, model_id));
  ADD(d, "mailbox.n", offsetof(shms_mailbox, n));
  ADD(d, "mailbox.pid", offsetof(shms_mailbox, pid));
  ADD(d, "mailbox.batcher_waiting", offsetof(shms_mailbox, batcher_waiting));
  ADD(d, "mailbox.batches_done", offsetof(shms_mailbox, batches_done));
  ADD(d, "mailbox.attempt", offsetof(shms_mailbox, attempt));
  ADD(d, "mailbox.shadow", offsetof(shms_mailbox, shadow));
  ADD(d, "server.size", sizeof(shms_server_header));
  ADD(d, "server.clients_offset", offsetof(shms_server_header, clients_offset));
  ADD(d, "server.models_offset", offsetof(shms_server_header, models_offset));
  ADD(d, "server.shadows_offset", offsetof(shms_server_header, shadows_offset));
  ADD(d, "server.mailboxes_offset", offsetof(shms_server_header, mailboxes_offset));
  ADD(d, "server.ring_pos", offsetof(shms_server_header, ring_pos));
  return d;
}

static PyMethodDef module_methods[] = {
    {"now_ns", f_now_ns, METH_NOARGS, "CLOCK_MONOTONIC in nanoseconds."},
    {"set_parent_death_signal", f_set_parent_death_signal, METH_O,
     "prctl(PR_SET_PDEATHSIG): get this signal when the parent dies."},
    {"layout", f_layout, METH_NOARGS, "Sizes, offsets and constants of shmserve.h."},
    {"set_timer_slack", f_set_timer_slack, METH_O,
     "prctl(PR_SET_TIMERSLACK, ns): how late a timed futex wait may wake (default 50 us)."},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "shmserve._core",
                                       "shmserve's C core (see shmserve/csrc/shmserve.h).", -1,
                                       module_methods};

PyMODINIT_FUNC PyInit__core(void) {
  if (PyType_Ready(&MappingType) < 0) return NULL;
  PyObject *m = PyModule_Create(&moduledef);
  if (!m) return NULL;
  Py_INCREF(&MappingType);
  PyModule_AddObject(m, "Mapping", (PyObject *)&MappingType);
  return m;
}
