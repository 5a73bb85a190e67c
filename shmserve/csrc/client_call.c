/*
 * client_call.c — ClientCore's common path of a request, in one call (client.h has
 * the state it shares with client.c):
 *
 *   - infer(): checks the caller's arrays against the model's compiled plan, takes a
 *     slot and an arena block, copies the inputs (arrays already in the arena are used
 *     in place), writes the slot, pushes, waits, reads the answer and builds the
 *     output arrays; send(): the same up to the push, for submit();
 *   - finish(): reads an answer, for both paths; results become numpy views of the
 *     request's block, owned by an ArenaBlock (arena.c).
 *
 * Python (client/engine.py) stays the reference for everything else. infer() and
 * send() return None, having changed nothing, for what they do not take: values that
 * are not plain C-contiguous ndarrays of a fixed-size dtype (BYTES, lists,
 * non-contiguous or byte-swapped arrays), unknown names, a model without a compiled
 * plan, a closed client, or no free slot or arena block at this moment. An error
 * status, OUTPUT_TOO_SMALL, or outputs numpy cannot view as they are (BYTES) go back
 * to Python as the raw answer. Every step on shared memory is a procedure of
 * shmserve.h (shms_slot.h, shms_wait.h), as in the C++ client
 * (clients/cpp/include/shmserve/detail/engine.hpp).
 *
 * The GIL is released only around the copy-in, the push and the wait, which touch
 * shared memory alone; the mappings are entered (shms_py_enter) meanwhile so that a
 * close() cannot unmap them underneath.
 */
#include <math.h>

#include "client.h"

static PyObject *s_dtype, *s_copy, *s_check_server, *s_push_failed, *s_plan, *s_wanted, *s_slot,
    *s_generation, *s_block, *s_block_bytes;

int shms_py_client_call_ready(void) {
#define INTERN(var, text) \
  if (!(var = PyUnicode_InternFromString(text))) return -1;
  INTERN(s_dtype, "dtype") INTERN(s_copy, "copy") INTERN(s_check_server, "check_server")
  INTERN(s_push_failed, "_push_failed") INTERN(s_plan, "plan")
  INTERN(s_wanted, "wanted") INTERN(s_slot, "slot") INTERN(s_generation, "generation")
  INTERN(s_block, "block") INTERN(s_block_bytes, "block_bytes")
#undef INTERN
  return 0;
}

/* The compiled plan of `fast` (compile()'s capsule), or NULL for None. */
static client_plan *plan_of(PyObject *fast) {
  if (fast == Py_None) return NULL;
  return PyCapsule_GetPointer(fast, PLAN_CAPSULE);
}

/* plans[model] or plans[(model, version)], as Engine.plan keys them; NULL if none. */
static PyObject *plan_entry(ClientCore *self, PyObject *model, PyObject *version) {
  PyObject *entry;
  if (version == Py_None) {
    entry = PyDict_GetItemWithError(self->plans, model);
  } else {
    if (!PyLong_CheckExact(version)) return NULL;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(version, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return NULL;
    }
    if (v == 0 || v == -1) { /* version_key(): the highest version */
      entry = PyDict_GetItemWithError(self->plans, model);
    } else {
      PyObject *key = PyTuple_Pack(2, model, version);
      entry = key ? PyDict_GetItemWithError(self->plans, key) : NULL;
      Py_XDECREF(key);
    }
  }
  if (!entry || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
    PyErr_Clear(); /* unhashable names and the like: Python says what is wrong */
    return NULL;
  }
  return entry; /* borrowed */
}

/* ---------------------------------------------------------------- one request */

typedef struct {
  uint32_t index, dtype, ndim;
  int64_t shape[SHMS_MAX_DIMS];
  uint64_t nbytes, offset; /* offset in the arena: the array's own, or its place in the block */
  int adopted;             /* the array lies in the arena: used in place, not copied */
  const void *src;
  PyObject *arr; /* borrowed from the caller's inputs */
} call_input;

typedef struct {
  PyObject *entry; /* the plans entry (Plan, compiled), held for the whole call */
  PyObject *plan;  /* the Python Plan, from entry */
  const client_plan *p;
  uint32_t n_in, n_out, n_views;
  call_input in[SHMS_MAX_TENSORS];
  Py_buffer views[SHMS_MAX_TENSORS];
  uint32_t out_k[SHMS_MAX_TENSORS]; /* model output index */
  uint64_t out_offset[SHMS_MAX_TENSORS], out_bytes[SHMS_MAX_TENSORS];
  uint64_t block, block_bytes;
  uint32_t slot, generation;
  /* The request's options (shms_request), from the caller's options tuple: 0 = none. */
  uint32_t flags, priority, params_bytes;
  uint64_t timeout_us, sequence_id, params_offset; /* params_offset: in the block, then the arena */
  const char *params; /* the packed parameters (bytes held by the caller's tuple) */
} call;

static void drop_views(call *c) {
  for (uint32_t i = 0; i < c->n_views; i++) PyBuffer_Release(&c->views[i]);
  c->n_views = 0;
}

/* The end of a call take_call() took: the views (if still held) and the plan go. */
static void end_call(call *c) {
  drop_views(c);
  Py_CLEAR(c->entry);
}

static uint64_t aligned(uint64_t n) { return shms_align(n ? n : 1, SHMS_DATA_ALIGN); }

/* One input value: 1 if the C path takes it, 0 if not (nothing held). */
static int take_input(ClientCore *self, call *c, uint32_t index, PyObject *value) {
  if (Py_TYPE(value) != (PyTypeObject *)self->ndarray) return 0;
  PyObject *dtype = PyObject_GetAttr(value, s_dtype);
  if (!dtype) {
    PyErr_Clear();
    return 0;
  }
  uint32_t code = 0;
  for (uint32_t k = 0; k < self->n_in_dtypes && !code; k++)
    if (self->in_dtype[k] == dtype) code = self->in_code[k];
  /* An unpickled array (multiprocessing, a queue) has its own dtype object, equal to
   * numpy's but not the same one: compared by value, once the fast check missed. */
  for (uint32_t k = 0; k < self->n_in_dtypes && !code; k++) {
    int same = PyObject_RichCompareBool(self->in_dtype[k], dtype, Py_EQ);
    if (same < 0) PyErr_Clear();
    if (same > 0) code = self->in_code[k];
  }
  Py_DECREF(dtype);
  if (!code) return 0; /* BYTES, byte-swapped, or a dtype Python words the error for */
  Py_buffer *v = &c->views[c->n_views];
  if (PyObject_GetBuffer(value, v, PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear(); /* not C-contiguous: Python makes the one copy */
    return 0;
  }
  c->n_views++;
  if (v->ndim > SHMS_MAX_DIMS || (uint64_t)v->len > self->alloc->end - self->alloc->begin)
    return 0; /* Python words these errors */
  call_input *t = &c->in[c->n_in++];
  t->index = index;
  t->dtype = code;
  t->ndim = (uint32_t)v->ndim;
  for (int d = 0; d < v->ndim; d++) t->shape[d] = v->shape[d];
  t->nbytes = (uint64_t)v->len;
  t->src = v->buf;
  t->arr = value;
  /* In this arena's data area, aligned: the server reads it where it lies. */
  const char *base = self->arena->base, *p = v->buf;
  t->adopted = p >= base + self->alloc->begin && (uint64_t)(p - base) <= self->arena->size &&
               t->nbytes <= self->arena->size - (uint64_t)(p - base) &&
               (p - base) % SHMS_DATA_ALIGN == 0;
  t->offset = t->adopted ? (uint64_t)(p - base) : 0;
  return 1;
}

/* The options of a call: None (all 0), or the tuple Engine builds (request.options():
 * flags, priority, timeout_us, packed parameters bytes or None, sequence_id). Returns
 * 1, or 0: not for the C path (Python words the error). */
static int take_options(call *c, PyObject *options) {
  c->flags = c->priority = c->params_bytes = 0;
  c->timeout_us = c->sequence_id = c->params_offset = 0;
  c->params = NULL;
  if (options == Py_None) return 1;
  unsigned int flags, priority;
  unsigned long long timeout_us, sequence_id;
  PyObject *params;
  if (!PyTuple_CheckExact(options) ||
      !PyArg_ParseTuple(options, "IIKOK", &flags, &priority, &timeout_us, &params, &sequence_id)) {
    PyErr_Clear();
    return 0;
  }
  c->flags = flags;
  c->priority = priority;
  c->timeout_us = timeout_us;
  c->sequence_id = sequence_id;
  if (params != Py_None) {
    if (!PyBytes_CheckExact(params) || PyBytes_GET_SIZE(params) > SHMS_MAX_PARAMETER_BYTES) return 0;
    c->params = PyBytes_AS_STRING(params);
    c->params_bytes = (uint32_t)PyBytes_GET_SIZE(params);
  }
  return 1;
}

/* The request's inputs, outputs and block size from the caller's arguments, checked
 * against the plan as Python's sources(), wanted() and Engine._prepare would.
 * Returns 1 (views and plan held: end_call), or 0: not for the C path (nothing held). */
static int take_call(ClientCore *self, call *c, PyObject *model, PyObject *inputs,
                     PyObject *outputs, PyObject *version, PyObject *options) {
  if (!take_options(c, options)) return 0;
  PyObject *entry = plan_entry(self, model, version);
  if (!entry) return 0;
  c->plan = PyTuple_GET_ITEM(entry, 0);
  const client_plan *p = c->p = plan_of(PyTuple_GET_ITEM(entry, 1));
  if (!p) {
    PyErr_Clear();
    return 0;
  }
  c->entry = Py_NewRef(entry); /* the GIL is released later: the plan must stay */
  c->n_in = c->n_out = c->n_views = 0;
  if (PyDict_CheckExact(inputs)) {
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(inputs, &pos, &name, &value)) {
      PyObject *index = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(p->input_index, name) : NULL;
      if (!index) goto not_taken;
      if (!take_input(self, c, (uint32_t)PyLong_AsUnsignedLong(index), value)) goto not_taken;
    }
  } else if (PyList_CheckExact(inputs) || PyTuple_CheckExact(inputs)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(inputs);
    if (n > (Py_ssize_t)p->n_inputs) goto not_taken;
    for (Py_ssize_t i = 0; i < n; i++)
      if (!take_input(self, c, (uint32_t)i, PySequence_Fast_GET_ITEM(inputs, i))) goto not_taken;
  } else {
    goto not_taken;
  }
  if (outputs == Py_None) {
    for (uint32_t k = 0; k < p->n_outputs; k++) c->out_k[c->n_out++] = k;
  } else if (PyUnicode_CheckExact(outputs)) {
    PyObject *index = PyDict_GetItemWithError(p->output_index, outputs);
    if (!index) goto not_taken;
    c->out_k[c->n_out++] = (uint32_t)PyLong_AsUnsignedLong(index);
  } else if (PyList_CheckExact(outputs) || PyTuple_CheckExact(outputs)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(outputs);
    if (n > SHMS_MAX_TENSORS) goto not_taken;
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *name = PySequence_Fast_GET_ITEM(outputs, i);
      PyObject *index = PyUnicode_CheckExact(name) ? PyDict_GetItemWithError(p->output_index, name) : NULL;
      if (!index) goto not_taken;
      c->out_k[c->n_out++] = (uint32_t)PyLong_AsUnsignedLong(index);
    }
  } else {
    goto not_taken;
  }
  /* The block: copied inputs, then the output buffers, sized exactly when the config
   * fixes the shape, else guessed (the input size, at least 4 KiB; OUTPUT_TOO_SMALL
   * makes Python resend with the size the server reports). As Engine._prepare. */
  uint64_t rows = 1, size = 0, in_bytes = 0;
  if (p->batched && c->n_in && c->in[0].ndim) rows = (uint64_t)c->in[0].shape[0];
  for (uint32_t i = 0; i < c->n_in; i++) {
    call_input *t = &c->in[i];
    in_bytes += t->nbytes;
    if (t->adopted) continue;
    t->offset = size;
    size += aligned(t->nbytes);
  }
  for (uint32_t j = 0; j < c->n_out; j++) {
    uint32_t k = c->out_k[j];
    uint64_t n = in_bytes > 4096 ? in_bytes : 4096;
    if (p->out_row_elems[k] >= 0 &&
        (__builtin_mul_overflow(rows, (uint64_t)p->out_row_elems[k], &n) ||
         __builtin_mul_overflow(n, p->out_itemsize[k], &n)))
      goto not_taken;
    c->out_offset[j] = size;
    c->out_bytes[j] = n;
    size += aligned(n);
    if (size > self->alloc->end - self->alloc->begin) goto not_taken; /* Python words it */
  }
  if (c->params_bytes) { /* the parameters after the output buffers, as Engine._prepare */
    c->params_offset = size;
    size += aligned(c->params_bytes);
    if (size > self->alloc->end - self->alloc->begin) goto not_taken;
  }
  c->block_bytes = size;
  return 1;
not_taken:
  PyErr_Clear();
  end_call(c);
  return 0;
}

/* A slot and a block for a taken call; 0 when either is not to be had right now
 * (Python's path waits for them). The slot is SLOT_BUSY with its next generation. */
static int place_call(ClientCore *self, call *c) {
  if (!shms_py_slot_take(self, &c->slot)) return 0;
  if (shms_py_alloc(self->alloc, c->block_bytes, &c->block) < 0) {
    shms_py_slot_put(self, c->slot);
    return 0;
  }
  for (uint32_t i = 0; i < c->n_in; i++) {
    if (!c->in[i].adopted) c->in[i].offset += c->block;
    self->inputs_adopted += c->in[i].adopted != 0;
    self->inputs_copied += c->in[i].adopted == 0;
  }
  for (uint32_t j = 0; j < c->n_out; j++) c->out_offset[j] += c->block;
  if (c->params_bytes) c->params_offset += c->block;
  c->generation = shms_py_slot_generation(self, c->slot);
  return 1;
}

/* Without the GIL: the copy-in, the request written into the slot and published
 * (shms_slot_begin/submit). */
static void write_call(ClientCore *self, call *c) {
  char *base = self->arena->base;
  for (uint32_t i = 0; i < c->n_in; i++)
    if (!c->in[i].adopted) memcpy(base + c->in[i].offset, c->in[i].src, c->in[i].nbytes);
  shms_slot *s = slot_at(self, c->slot);
  shms_request *r = shms_slot_begin(s);
  r->model_id = c->p->model_id;
  r->n_inputs = c->n_in;
  r->n_outputs = c->n_out;
  if (c->params_bytes) {
    memcpy(base + c->params_offset, c->params, c->params_bytes);
    r->parameters_offset = c->params_offset;
    r->parameters_bytes = c->params_bytes;
  }
  r->flags = c->flags; /* the rest of the options are 0 from shms_slot_begin */
  r->priority = c->priority;
  r->timeout_us = c->timeout_us;
  r->sequence_id = c->sequence_id;
  for (uint32_t i = 0; i < c->n_in; i++) {
    shms_tensor_ref *t = &r->inputs[i];
    memset(t, 0, sizeof *t);
    t->index = c->in[i].index;
    t->dtype = c->in[i].dtype;
    t->ndim = c->in[i].ndim;
    t->offset = c->in[i].offset;
    t->nbytes = c->in[i].nbytes;
    memcpy(t->shape, c->in[i].shape, sizeof(int64_t) * c->in[i].ndim);
  }
  for (uint32_t j = 0; j < c->n_out; j++) {
    shms_tensor_ref *t = &r->outputs[j];
    memset(t, 0, sizeof *t);
    t->index = c->out_k[j];
    t->offset = c->out_offset[j];
    t->nbytes = c->out_bytes[j];
  }
  shms_slot_submit(s, c->generation);
}

/* shms_push_request's lease check: Engine.check_server(), which raises if the server
 * or the lease ended. A ServerDeadError means "not alive"; any other exception is
 * kept for the caller to raise once it has put the slot in order. */
typedef struct {
  PyObject *engine, *dead_error;
  PyObject *exc_type, *exc_value, *exc_tb;
} lease_check;

static int lease_alive(void *ctx) {
  lease_check *lc = ctx;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *r = PyObject_CallMethodNoArgs(lc->engine, s_check_server);
  int alive = r != NULL;
  Py_XDECREF(r);
  if (!alive) {
    if (PyErr_ExceptionMatches(lc->dead_error)) PyErr_Clear();
    else if (!lc->exc_type) PyErr_Fetch(&lc->exc_type, &lc->exc_value, &lc->exc_tb);
    else PyErr_Clear();
  }
  PyGILState_Release(g);
  return alive;
}

enum { WAIT_DONE, WAIT_TIMEOUT, WAIT_SLICE };

/* Without the GIL: waits for slot s to be DONE, at most one liveness slice, and
 * until `started + timeout_ns` (timeout_ns < 0: no limit). As Engine.wait. Spins
 * spin_ns first; *preempted says whether a yield of that spin was preempted (for
 * shms_spin_outcome, which the caller feeds with the GIL held). */
static int wait_done(ClientCore *self, shms_slot *s, uint64_t started, int64_t timeout_ns,
                     int64_t spin_ns, int *preempted) {
  shms_arena_header *h = arena_header(self);
  for (;;) {
    uint32_t seen = shms_load(&h->completions, memory_order_acquire); /* before the check */
    if (shms_slot_is_done(s)) return WAIT_DONE;
    int64_t slice = self->wait_slice_ns;
    if (timeout_ns >= 0) {
      int64_t left = timeout_ns - (int64_t)(shms_now_ns() - started);
      if (left <= 0) return WAIT_TIMEOUT;
      if (left < slice) slice = left;
    }
    /* SYNC POINT: woken by the server's shms_doorbell_ring on arena.completions
     * (shms_slot_complete). */
    int cut = 0;
    int woke = shms_doorbell_wait_x(&h->completions, &h->waiters, seen, spin_ns, slice, &cut, 0);
    *preempted |= cut;
    spin_ns = 0; /* one spin a wait */
    if (!woke) return WAIT_SLICE;
  }
}

/* A call that does not wait (send) and copies in at most this many bytes keeps the
 * GIL for its copy-in and first push: handing the GIL over for a few microseconds to
 * a thread that wants it (an event loop's I/O thread, in a network front) costs the
 * caller a thread switch to get it back, about 80 us a request in the gRPC front
 * (bench/README.md, "http_vs_triton.py"). A push that does not go through at once
 * retries without the GIL. */
#define GIL_HELD_COPY_BYTES (64u << 10)

static uint64_t copy_in_bytes(const call *c) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < c->n_in; i++)
    if (!c->in[i].adopted) n += c->in[i].nbytes;
  return n;
}

/* Sends a placed call: copy-in, slot, push with the protocol's retries; with
 * `wait`, then waits for the answer as far as it can without the GIL. Returns the
 * push's result; *withdrawn says a failed push put the slot back to FREE (then the
 * request was not sent), *how how the wait ended. */
static int send_call(ClientCore *self, call *c, lease_check *lc, int wait, uint64_t *started,
                     int64_t timeout_ns, int64_t spin_ns, int *preempted, int *withdrawn,
                     int *how) {
  int rc;
  *withdrawn = 0;
  *how = WAIT_SLICE;
  int held = !wait && copy_in_bytes(c) <= GIL_HELD_COPY_BYTES;
  if (held) {
    write_call(self, c);
    rc = shms_push_request_once(&self->sub, self->client_id, c->slot, c->generation);
    if (rc == SHMS_RING_OK) {
      *started = shms_now_ns();
      return rc;
    }
  }
  Py_BEGIN_ALLOW_THREADS
  if (!held) write_call(self, c);
  rc = shms_push_request(&self->sub, self->client_id, c->slot, c->generation, lease_alive, lc);
  /* A failed push takes the request back, unless the batcher took it meanwhile (its
   * sweep takes SUBMITTED requests the ring lost): then it is in flight. */
  if (rc != SHMS_RING_OK) *withdrawn = shms_slot_withdraw(slot_at(self, c->slot));
  *started = shms_now_ns();
  if (wait && !*withdrawn && !lc->exc_type)
    *how = wait_done(self, slot_at(self, c->slot), *started, timeout_ns, spin_ns, preempted);
  Py_END_ALLOW_THREADS
  return rc;
}

/* After a failed push that took the request back: block and slot back, and the
 * error (Engine._push_failed words it). Always NULL. */
static PyObject *unsent(ClientCore *self, call *c, lease_check *lc, int rc) {
  shms_py_free(self->alloc, c->block, c->block_bytes);
  shms_py_slot_put(self, c->slot);
  if (lc->exc_type) {
    PyErr_Restore(lc->exc_type, lc->exc_value, lc->exc_tb);
    return NULL;
  }
  PyObject *code = PyLong_FromLong(rc);
  PyObject *r = code ? PyObject_CallMethodOneArg(lc->engine, s_push_failed, code) : NULL;
  Py_XDECREF(code);
  if (r) {
    Py_DECREF(r);
    PyErr_SetString(PyExc_SystemError, "Engine._push_failed returned");
  }
  return NULL;
}

/* ---------------------------------------------------------------- answers */

/* Can the results be returned as numpy views of the block? Every one inside the
 * buffers given, a dtype numpy holds without decoding, a sane shape; otherwise
 * Python builds (or refuses) them (Engine._outputs). */
static int buildable(ClientCore *self, const client_plan *p, const shms_tensor_ref *res,
                     uint32_t n, uint64_t block, uint64_t block_bytes) {
  uint64_t end = block + block_bytes;
  for (uint32_t k = 0; k < n; k++) {
    const shms_tensor_ref *t = &res[k];
    if (t->index >= p->n_outputs || t->offset < block || t->offset > end ||
        t->nbytes > end - t->offset || t->ndim > SHMS_MAX_DIMS || t->dtype >= SHMS_TYPE_COUNT ||
        PyTuple_GET_ITEM(self->out_dtypes, t->dtype) == Py_None)
      return 0;
    uint64_t bytes = shms_dtype_size(t->dtype);
    for (uint32_t d = 0; d < t->ndim; d++)
      if (t->shape[d] < 0 || __builtin_mul_overflow(bytes, (uint64_t)t->shape[d], &bytes)) return 0;
    if (bytes != t->nbytes) return 0;
  }
  return 1;
}

/* InferResult of the results, views of the block (owned by an ArenaBlock, freed
 * with the last view), or copies with the block freed at once. Frees the block on
 * failure. */
static PyObject *build_result(ClientCore *self, const client_plan *p, const shms_tensor_ref *res,
                              uint32_t n, uint64_t block, uint64_t block_bytes, int copy,
                              const uint64_t *t_ns) {
  PyObject *owner = shms_py_block_new(self->alloc, self->arena_buffer, block, block_bytes);
  if (!owner) {
    shms_py_free(self->alloc, block, block_bytes);
    return NULL;
  }
  PyObject *arrays = PyDict_New(), *stamps = PyTuple_New(SHMS_T_COUNT), *blocks = NULL,
           *result = NULL;
  if (!arrays || !stamps) goto out;
  for (int i = 0; i < SHMS_T_COUNT; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong(t_ns[i]);
    if (!v) goto out;
    PyTuple_SET_ITEM(stamps, i, v);
  }
  for (uint32_t k = 0; k < n; k++) {
    const shms_tensor_ref *t = &res[k];
    PyObject *shape = PyTuple_New(t->ndim), *offset = NULL, *arr = NULL;
    for (uint32_t d = 0; shape && d < t->ndim; d++) {
      PyObject *v = PyLong_FromLongLong(t->shape[d]);
      if (!v) Py_CLEAR(shape);
      else PyTuple_SET_ITEM(shape, d, v);
    }
    if (shape && (offset = PyLong_FromUnsignedLongLong(t->offset - block))) {
      PyObject *args[4] = {shape, PyTuple_GET_ITEM(self->out_dtypes, t->dtype), owner, offset};
      arr = PyObject_Vectorcall(self->ndarray, args, 4, NULL); /* ndarray(shape, dtype, buffer, offset) */
    }
    Py_XDECREF(shape);
    Py_XDECREF(offset);
    if (arr && copy) Py_SETREF(arr, PyObject_CallMethodNoArgs(arr, s_copy));
    int rc = arr ? PyDict_SetItem(arrays, p->out_name[t->index], arr) : -1;
    Py_XDECREF(arr);
    if (rc < 0) goto out;
  }
  if (copy) { /* nothing refers to the block now: it goes back with `owner` below */
    blocks = PyList_New(0);
  } else {
    blocks = PyList_New(1);
    if (blocks) PyList_SET_ITEM(blocks, 0, Py_NewRef(owner));
  }
  if (blocks) {
    PyObject *args[5] = {arrays, stamps, p->name, p->version, blocks};
    result = PyObject_Vectorcall(self->result_type, args, 5, NULL);
  }
out:
  Py_XDECREF(arrays);
  Py_XDECREF(stamps);
  Py_XDECREF(blocks);
  Py_DECREF(owner); /* the views (if any) hold it; else the block goes back here */
  return result;
}

/* Reads DONE slot `slot`'s answer and puts the slot back. Returns an InferResult when
 * the plan is known and the answer is OK with outputs numpy holds as they are; else
 * the answer (status, message, results, stamps) for Python, the block untouched. */
static PyObject *finish_slot(ClientCore *self, uint32_t slot, uint64_t block,
                             uint64_t block_bytes, const client_plan *p, int copy) {
  shms_slot *s = slot_at(self, slot);
  shms_answer a;
  if (!shms_slot_read_answer(s, &a)) {
    PyErr_Format(PyExc_RuntimeError, "slot %u has no answer yet", slot);
    return NULL;
  }
  shms_tensor_ref res[SHMS_MAX_TENSORS];
  memcpy(res, a.results, sizeof(shms_tensor_ref) * a.n_results); /* the slot is reused next */
  shms_slot_release(s);
  shms_py_slot_put(self, slot);
  if (a.status == SHMS_OK && p && buildable(self, p, res, a.n_results, block, block_bytes))
    return build_result(self, p, res, a.n_results, block, block_bytes, copy, a.t_ns);
  PyObject *msg = PyUnicode_DecodeUTF8(a.error, (Py_ssize_t)strlen(a.error), "replace");
  PyObject *results = shms_py_refs_list(res, a.n_results);
  PyObject *stamps = PyTuple_New(SHMS_T_COUNT);
  for (int i = 0; stamps && i < SHMS_T_COUNT; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong(a.t_ns[i]);
    if (!v) Py_CLEAR(stamps);
    else PyTuple_SET_ITEM(stamps, i, v);
  }
  if (!msg || !results || !stamps) {
    Py_XDECREF(msg);
    Py_XDECREF(results);
    Py_XDECREF(stamps);
    return NULL;
  }
  return Py_BuildValue("(iNNN)", a.status, msg, results, stamps);
}

/* ---------------------------------------------------------------- Python methods */

/* infer(engine, model, inputs, outputs, version, timeout, copy[, options]): one
 * request on the
 * common path, from the caller's arrays to an InferResult. Returns None, having done
 * nothing, when the request is not for the C path (Engine.start takes it from the
 * beginning); or (status, message, results, stamps, block, block_bytes, started_ns)
 * when the answer is one Python finishes (Engine.infer); raises ServerTimeoutError,
 * the errors of Engine.check_server and of Engine._push_failed as the Python path. */
PyObject *shms_py_client_infer(ClientCore *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 7 && nargs != 8) return PyErr_Format(PyExc_TypeError, "infer() takes 7 or 8 arguments");
  PyObject *engine = args[0], *timeout = args[5];
  int64_t timeout_ns = -1;
  if (timeout != Py_None) {
    double t = PyFloat_AsDouble(timeout);
    if ((t == -1.0 && PyErr_Occurred()) || !isfinite(t) || fabs(t) > 9e9) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    timeout_ns = (int64_t)(t * 1e9);
    if (timeout_ns < 0) timeout_ns = 0;
  }
  int copy = PyObject_IsTrue(args[6]);
  if (copy < 0) return NULL;
  if (!mapped(self) ||
      shms_load(&((shms_control *)self->control->base)->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED)
    Py_RETURN_NONE; /* Python checks and says why */
  call c;
  if (!take_call(self, &c, args[1], args[2], args[3], args[4], nargs == 8 ? args[7] : Py_None))
    Py_RETURN_NONE;
  if (!place_call(self, &c)) {
    end_call(&c);
    Py_RETURN_NONE;
  }
  self->sent_c++;
  lease_check lc = {engine, self->dead_error, NULL, NULL, NULL};
  int64_t spin_ns = shms_spin_budget(&self->spin);
  uint64_t started;
  int withdrawn, how, preempted = 0;
  PyObject *out = NULL;
  enter(self);
  int rc = send_call(self, &c, &lc, 1, &started, timeout_ns, spin_ns, &preempted, &withdrawn,
                     &how);
  /* a spin a neighbour preempted turns the lease's spinning off for a while */
  shms_spin_outcome(&self->spin, preempted);
  drop_views(&c); /* copied, or in the arena and held by the caller */
  if (rc != SHMS_RING_OK && withdrawn) {
    out = unsent(self, &c, &lc, rc);
    goto done;
  }
  if (lc.exc_type) { /* the lease check raised: in flight, nobody waits for it */
    shms_py_slot_orphan(self, c.slot, c.block, c.block_bytes);
    PyErr_Restore(lc.exc_type, lc.exc_value, lc.exc_tb);
    goto done;
  }
  while (how == WAIT_SLICE) { /* a liveness slice passed without the answer */
    PyObject *r = PyObject_CallMethodNoArgs(engine, s_check_server);
    Py_XDECREF(r);
    if (!r || PyErr_CheckSignals() < 0) {
      shms_py_slot_orphan(self, c.slot, c.block, c.block_bytes);
      goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    how = wait_done(self, slot_at(self, c.slot), started, timeout_ns, 0, &preempted);
    Py_END_ALLOW_THREADS
  }
  if (how == WAIT_TIMEOUT) {
    shms_py_slot_orphan(self, c.slot, c.block, c.block_bytes);
    PyObject *msg = PyUnicode_FromFormat("model '%U': no answer within %S s", c.p->name, timeout);
    if (msg) {
      PyErr_SetObject(self->timeout_error, msg);
      Py_DECREF(msg);
    }
    goto done;
  }
  shms_spin_record(&self->spin, (int64_t)(shms_now_ns() - started));
  out = finish_slot(self, c.slot, c.block, c.block_bytes, c.p, copy);
  if (out && PyTuple_CheckExact(out)) { /* Python finishes it: hand it the block */
    PyObject *more = Py_BuildValue("(KKK)", (unsigned long long)c.block,
                                   (unsigned long long)c.block_bytes, (unsigned long long)started);
    Py_SETREF(out, more ? PySequence_Concat(out, more) : NULL);
    Py_XDECREF(more);
  }
done:
  leave(self);
  end_call(&c);
  return out;
}

/* send(engine, req, model, inputs, outputs, version[, options]): submit()'s send on the common
 * path. Fills req (plan, wanted, slot, generation, block, block_bytes; not sources,
 * which Python works out from req.call if it must send it again), registers it in
 * flight with its future and pushes it; True. None, having done
 * nothing, when the request is not for the C path; raises as Engine._send. */
PyObject *shms_py_client_send(ClientCore *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 6 && nargs != 7) return PyErr_Format(PyExc_TypeError, "send() takes 6 or 7 arguments");
  PyObject *engine = args[0], *req = args[1];
  if (!mapped(self) ||
      shms_load(&((shms_control *)self->control->base)->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED)
    Py_RETURN_NONE;
  call c;
  if (!take_call(self, &c, args[2], args[3], args[4], args[5], nargs == 7 ? args[6] : Py_None))
    Py_RETURN_NONE;
  PyObject *wanted = NULL;
  if (args[4] == Py_None) {
    wanted = Py_NewRef(c.p->outputs);
  } else if ((wanted = PyList_New(c.n_out))) {
    for (uint32_t j = 0; j < c.n_out; j++) PyList_SET_ITEM(wanted, j, Py_NewRef(c.p->out_spec[c.out_k[j]]));
  }
  if (!wanted) goto fail_views;
  if (!place_call(self, &c)) {
    Py_DECREF(wanted);
    end_call(&c);
    Py_RETURN_NONE;
  }
  /* Everything the poller needs is in req before the answer can come. */
  PyObject *vals[5] = {PyLong_FromUnsignedLong(c.slot), PyLong_FromUnsignedLong(c.generation),
                       PyLong_FromUnsignedLongLong(c.block),
                       PyLong_FromUnsignedLongLong(c.block_bytes), NULL};
  PyObject *names[5] = {s_slot, s_generation, s_block, s_block_bytes, NULL};
  int failed = PyObject_SetAttr(req, s_plan, c.plan) < 0 ||
               PyObject_SetAttr(req, s_wanted, wanted) < 0;
  for (int i = 0; i < 4; i++) {
    failed = failed || !vals[i] || PyObject_SetAttr(req, names[i], vals[i]) < 0;
    Py_XDECREF(vals[i]);
  }
  Py_DECREF(wanted);
  if (failed) {
    shms_py_free(self->alloc, c.block, c.block_bytes);
    shms_py_slot_put(self, c.slot);
    end_call(&c);
    return NULL;
  }
  self->slots[c.slot].req = Py_NewRef(req);
  self->slots[c.slot].has_future = 1;
  self->sent_c++;
  lease_check lc = {engine, self->dead_error, NULL, NULL, NULL};
  uint64_t started;
  int withdrawn, how;
  PyObject *out = NULL;
  enter(self);
  int rc = send_call(self, &c, &lc, 0, &started, -1, 0, NULL, &withdrawn, &how);
  end_call(&c);
  if (rc != SHMS_RING_OK && withdrawn) {
    out = unsent(self, &c, &lc, rc);
  } else if (lc.exc_type) { /* in flight: the poller answers its future */
    PyErr_Restore(lc.exc_type, lc.exc_value, lc.exc_tb);
  } else {
    out = Py_NewRef(Py_True);
  }
  leave(self);
  return out;
fail_views:
  end_call(&c);
  return NULL;
}

/* finish(slot, block, block_bytes, compiled plan or None, copy): reads the DONE slot
 * of a request the Python path sent, as infer() reads its own: an InferResult, or
 * (status, message, results, stamps) for Python to finish. The slot is free after. */
PyObject *shms_py_client_finish(ClientCore *self, PyObject *const *args, Py_ssize_t nargs) {
  unsigned long long block, block_bytes;
  unsigned int slot;
  int copy;
  if (nargs != 5 || !PyArg_Parse(args[0], "I", &slot) || !PyArg_Parse(args[1], "K", &block) ||
      !PyArg_Parse(args[2], "K", &block_bytes) || (copy = PyObject_IsTrue(args[4])) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "finish() takes 5 arguments");
    return NULL;
  }
  const client_plan *p = plan_of(args[3]);
  if ((!p && PyErr_Occurred()) || need_mapped(self) < 0 || shms_py_check_slot(self, slot, SLOT_BUSY) < 0)
    return NULL;
  enter(self);
  PyObject *out = finish_slot(self, slot, block, block_bytes, p, copy);
  leave(self);
  return out;
}

