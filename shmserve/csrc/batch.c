/*
 * batch.c — shmserve._core.Batch: a worker's per-request work on the common path in
 * a few C calls per batch (docs/architecture.md, "The worker's batch in C"). begin()
 * takes the mailbox's requests (lease check, shms_slot_set_running), input()/gather()
 * give the model its inputs (a view for one request, one copy per request for more),
 * scatter() copies each output's rows into the callers' buffers, finish() stamps,
 * records the statistics (shms_stats.h) and completes every request
 * (shms_slot_complete). The procedures are shmserve.h's; nothing here re-implements
 * them. Python keeps the model call, output checks and the rare paths (BYTES tensors,
 * Triton's per-request API, traces, a dead worker's batch).
 */
#include "core.h"

typedef struct {
  Mapping *arena; /* strong reference while the batch is held */
  shms_slot *slot;
  const shms_shadow *sh; /* the batcher's validated copy, in the server segment */
  uint32_t row0;         /* first row of this request in the batch */
  uint32_t too_small;    /* bit k: output k did not fit */
  uint32_t filled;       /* bit j: results[j] written (j: position in request outputs) */
  shms_tensor_ref results[SHMS_MAX_TENSORS];
} batch_req;

typedef struct {
  PyObject_HEAD
  Mapping *server;
  shms_model_entry *model;
  shms_mailbox *mailbox;
  uint32_t n, rows;
  batch_req req[SHMS_MAX_BATCH_REQUESTS];
} Batch;

static void batch_clear(Batch *self) {
  for (uint32_t i = 0; i < self->n; i++) Py_CLEAR(self->req[i].arena);
  self->n = self->rows = 0;
}

/* Batch(server, model_off, mailbox_off): one per worker, reused for every batch. */
static int batch_init(Batch *self, PyObject *args, PyObject *kw) {
  Mapping *server;
  unsigned long long model_off, mailbox_off;
  if (!PyArg_ParseTuple(args, "O!KK", &MappingType, &server, &model_off, &mailbox_off)) return -1;
  self->model = (shms_model_entry *)shms_py_at(server, model_off, sizeof(shms_model_entry), 8);
  self->mailbox = (shms_mailbox *)shms_py_at(server, mailbox_off, sizeof(shms_mailbox), 8);
  if (!self->model || !self->mailbox || !shms_py_at(server, 0, sizeof(shms_server_header), 8))
    return -1;
  batch_clear(self);
  Py_INCREF(server);
  Py_XSETREF(self->server, server);
  return 0;
}

static void batch_dealloc(Batch *self) {
  batch_clear(self);
  Py_XDECREF(self->server);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int server_live(Batch *self) {
  if (self->server && self->server->base) return 1;
  PyErr_SetString(PyExc_ValueError, "Batch: the server mapping is released");
  return 0;
}

/* begin(arenas, again=False, map_missing=True) -> () or ((client_id, lease), ...).
 * arenas: {client_id: (lease, Mapping)}, the worker's mapped arenas. Takes the
 * mailbox's requests whose lease is alive and whose slot is still theirs
 * (shms_slot_set_running). With map_missing, a request whose arena is not mapped yet
 * stops it before any slot is touched: it returns those (client_id, lease) to map,
 * and is called again; without, such a request is skipped (its caller left). */
static PyObject *batch_begin(Batch *self, PyObject *args) {
  PyObject *arenas;
  int again = 0, map_missing = 1;
  if (!PyArg_ParseTuple(args, "O!|pp", &PyDict_Type, &arenas, &again, &map_missing)) return NULL;
  if (!server_live(self)) return NULL;
  batch_clear(self);
  shms_server_header *h = (shms_server_header *)self->server->base;
  uint64_t n_shadows = (uint64_t)h->max_clients * h->slots_per_client;
  uint64_t slots_offset = shms_arena_layout(h->slots_per_client, 0).slots_offset;
  const uint32_t *shadows;
  uint32_t n = shms_mailbox_batch(self->mailbox, &shadows);
  Mapping *found[SHMS_MAX_BATCH_REQUESTS];
  const shms_shadow *shs[SHMS_MAX_BATCH_REQUESTS];
  PyObject *missing = NULL;
  for (uint32_t i = 0; i < n; i++) {
    found[i] = NULL;
    shs[i] = NULL;
    if (shadows[i] >= n_shadows) continue; /* never from an honest batcher: nobody to answer */
    const shms_shadow *sh = (const shms_shadow *)shms_py_at(
        self->server, h->shadows_offset + (uint64_t)shadows[i] * sizeof(shms_shadow),
        sizeof(shms_shadow), 8);
    if (!sh) goto fail;
    shs[i] = sh;
    if (sh->client_id >= h->max_clients || sh->slot >= h->slots_per_client) continue;
    /* SYNC POINT: as ServerMaps.lease_of: the seq_cst load of the state pairs with the
     * coordinator's store of ALIVE (write_client_entry) and of DEAD. */
    shms_client_entry *e = (shms_client_entry *)shms_py_at(
        self->server, h->clients_offset + (uint64_t)sh->client_id * sizeof(shms_client_entry),
        sizeof(shms_client_entry), 8);
    if (!e) goto fail;
    if (shms_load(&e->state, memory_order_seq_cst) != SHMS_CLIENT_ALIVE ||
        __atomic_load_n(&e->generation, __ATOMIC_RELAXED) != sh->lease)
      continue; /* the caller left: nothing to answer */
    PyObject *key = PyLong_FromUnsignedLong(sh->client_id);
    if (!key) goto fail;
    PyObject *cached = PyDict_GetItemWithError(arenas, key); /* borrowed */
    Py_DECREF(key);
    if (!cached && PyErr_Occurred()) goto fail;
    unsigned long lease = 0;
    PyObject *mapping = NULL;
    if (cached && PyTuple_Check(cached) && PyTuple_GET_SIZE(cached) == 2) {
      lease = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(cached, 0));
      if (lease == (unsigned long)-1 && PyErr_Occurred()) goto fail;
      mapping = PyTuple_GET_ITEM(cached, 1);
    } else if (cached) {
      PyErr_SetString(PyExc_TypeError, "Batch.begin: arenas maps client ids to (lease, Mapping)");
      goto fail;
    }
    if (mapping && Py_TYPE(mapping) == &MappingType && lease == sh->lease &&
        ((Mapping *)mapping)->base) {
      found[i] = (Mapping *)mapping;
    } else if (map_missing) {
      if (!missing && !(missing = PyList_New(0))) goto fail;
      PyObject *pair = Py_BuildValue("(II)", sh->client_id, sh->lease);
      if (!pair || PyList_Append(missing, pair) < 0) {
        Py_XDECREF(pair);
        goto fail;
      }
      Py_DECREF(pair);
    }
  }
  if (missing) {
    PyObject *out = PyList_AsTuple(missing);
    Py_DECREF(missing);
    return out;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (!found[i]) continue;
    Mapping *a = found[i];
    const shms_shadow *sh = shs[i];
    shms_slot *s = (shms_slot *)shms_py_at(a, slots_offset + (uint64_t)sh->slot * sizeof(shms_slot),
                                           sizeof(shms_slot), 64);
    if (!s) { /* a client's arena smaller than its slots: it broke it, nobody to answer */
      PyErr_Clear();
      continue;
    }
    if (!shms_slot_set_running(s, sh->generation, again)) continue;
    batch_req *r = &self->req[self->n++];
    Py_INCREF(a);
    r->arena = a;
    r->slot = s;
    r->sh = sh;
    r->row0 = self->rows;
    r->too_small = r->filled = 0;
    self->rows += sh->batch_rows;
  }
  return PyTuple_New(0);
fail:
  Py_XDECREF(missing);
  return NULL;
}

/* The request's reference to model input k, or NULL when it leaves it out. */
static const shms_tensor_ref *input_ref(const batch_req *r, uint32_t k) {
  const shms_request *q = &r->sh->request;
  for (uint32_t i = 0; i < q->n_inputs && i < SHMS_MAX_TENSORS; i++)
    if (q->inputs[i].index == k) return &q->inputs[i];
  return NULL;
}

/* input(k) -> None when the batch leaves input k out, else (buffer, offset, shape):
 * for a batch of one request its caller's arena (a view serves), else buffer is None
 * and shape the whole batch's: allocate it and gather(k, out). */
static PyObject *batch_input(Batch *self, PyObject *arg) {
  unsigned long k = PyLong_AsUnsignedLong(arg);
  if (PyErr_Occurred()) return NULL;
  if (self->n == 0) return PyErr_Format(PyExc_ValueError, "Batch.input: no request in hand");
  const shms_tensor_ref *t = input_ref(&self->req[0], (uint32_t)k);
  if (!t) Py_RETURN_NONE;
  uint32_t nd = t->ndim < SHMS_MAX_DIMS ? t->ndim : SHMS_MAX_DIMS;
  PyObject *shape = PyTuple_New(nd);
  for (uint32_t d = 0; shape && d < nd; d++) {
    int64_t v = d == 0 && self->n > 1 ? (int64_t)self->rows : t->shape[d];
    PyObject *x = PyLong_FromLongLong(v);
    if (!x) Py_CLEAR(shape);
    else PyTuple_SET_ITEM(shape, d, x);
  }
  if (!shape) return NULL;
  if (self->n > 1) return Py_BuildValue("(OKN)", Py_None, 0ULL, shape);
  return Py_BuildValue("(OKN)", self->req[0].arena->view.obj, (unsigned long long)t->offset,
                       shape);
}

/* gather(k, out): input k of every request, in batch order, into out (a writable
 * C-contiguous buffer of exactly their bytes). One memcpy per request. */
static PyObject *batch_gather(Batch *self, PyObject *args) {
  unsigned int k;
  Py_buffer out;
  if (!PyArg_ParseTuple(args, "Iw*", &k, &out)) return NULL;
  uint64_t total = 0;
  for (uint32_t i = 0; i < self->n; i++) {
    const shms_tensor_ref *t = input_ref(&self->req[i], k);
    if (!t || !self->req[i].arena->base) {
      PyBuffer_Release(&out);
      return PyErr_Format(PyExc_ValueError, "Batch.gather: request %u has no input %u", i, k);
    }
    total += t->nbytes;
  }
  if (total != (uint64_t)out.len) {
    PyBuffer_Release(&out);
    return PyErr_Format(PyExc_ValueError, "Batch.gather: input %u is %llu bytes, out holds %zd",
                        k, (unsigned long long)total, out.len);
  }
  char *dst = out.buf;
  for (uint32_t i = 0; i < self->n; i++) {
    const shms_tensor_ref *t = input_ref(&self->req[i], k);
    /* offset and nbytes were bounded by the arena's size when the batcher took it */
    memcpy(dst, self->req[i].arena->base + t->offset, t->nbytes);
    dst += t->nbytes;
  }
  PyBuffer_Release(&out);
  Py_RETURN_NONE;
}

/* scatter(k, array): output k (a C-contiguous buffer with a shape, rows first when
 * the model batches) cut into each request's rows and copied into the buffer the
 * request gave for it, if it asked for k; one too small is noted (finish() answers
 * OUTPUT_TOO_SMALL, naming it) and its needed size reported. */
static PyObject *batch_scatter(Batch *self, PyObject *args) {
  unsigned int k;
  PyObject *array;
  Py_buffer b;
  if (!PyArg_ParseTuple(args, "IO", &k, &array)) return NULL;
  if (!server_live(self)) return NULL;
  if (k >= self->model->n_outputs || k >= SHMS_MAX_TENSORS)
    return PyErr_Format(PyExc_IndexError, "Batch.scatter: output %u of %u", k, self->model->n_outputs);
  if (PyObject_GetBuffer(array, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  int batched = self->model->max_batch_size > 0;
  if (b.ndim > SHMS_MAX_DIMS || (batched && (b.ndim < 1 || b.shape[0] != (Py_ssize_t)self->rows)) ||
      (!batched && self->n != 1)) {
    PyBuffer_Release(&b);
    return PyErr_Format(PyExc_ValueError, "Batch.scatter: output %u does not have the batch's "
                        "%u rows first", k, self->rows);
  }
  uint64_t row_bytes = (uint64_t)b.itemsize;
  for (int d = 1; d < b.ndim; d++) row_bytes *= (uint64_t)b.shape[d];
  for (uint32_t i = 0; i < self->n; i++) {
    batch_req *r = &self->req[i];
    const shms_request *q = &r->sh->request;
    for (uint32_t j = 0; j < q->n_outputs && j < SHMS_MAX_TENSORS; j++) {
      const shms_tensor_ref *want = &q->outputs[j];
      if (want->index != k) continue;
      shms_tensor_ref *res = &r->results[j];
      memset(res, 0, sizeof *res);
      res->index = k;
      res->dtype = self->model->outputs[k].dtype;
      res->offset = want->offset;
      res->ndim = (uint32_t)b.ndim;
      for (int d = 0; d < b.ndim; d++) res->shape[d] = b.shape[d];
      uint64_t need = (uint64_t)b.len, from = 0;
      if (batched) {
        res->shape[0] = r->sh->batch_rows;
        need = row_bytes * r->sh->batch_rows;
        from = row_bytes * r->row0;
      }
      res->nbytes = need;
      r->filled |= 1u << j;
      if (need > want->nbytes) r->too_small |= 1u << k;
      else if (r->arena->base) memcpy(r->arena->base + want->offset, (char *)b.buf + from, need);
    }
  }
  PyBuffer_Release(&b);
  Py_RETURN_NONE;
}

/* finish(status, message, t_input, t_infer, t_output) -> requests answered. Stamps
 * COMPUTE_END (t_output), records the execution and every request's answer (before
 * answering: a caller that reads the statistics after its answer sees its request),
 * counts the execution in the mailbox, then completes each slot: status and message
 * when not OK, else OK with the results scatter() wrote (OUTPUT_TOO_SMALL naming the
 * outputs that did not fit). The batch is empty afterwards. */
static PyObject *batch_finish(Batch *self, PyObject *args) {
  int status;
  const char *message;
  unsigned long long t_input, t_infer, t_output;
  if (!PyArg_ParseTuple(args, "isKKK", &status, &message, &t_input, &t_infer, &t_output))
    return NULL;
  if (!server_live(self)) return NULL;
  shms_model_stats *st = &self->model->stats;
  uint64_t now = shms_now_ns();
  shms_stats_execution(st, self->n, self->rows, t_infer - t_input, t_output - t_infer,
                       now > t_output ? now - t_output : 0);
  for (uint32_t i = 0; i < self->n; i++) {
    batch_req *r = &self->req[i];
    int32_t s = status == SHMS_OK && r->too_small ? SHMS_ERR_OUTPUT_TOO_SMALL : status;
    shms_stats_answered(st, s, SHMS_FAIL_COUNT, now > r->sh->taken_ns ? now - r->sh->taken_ns : 0);
  }
  shms_fetch_add(&self->mailbox->executions, 1u, memory_order_relaxed);
  uint32_t answered = 0;
  for (uint32_t i = 0; i < self->n; i++) {
    batch_req *r = &self->req[i];
    if (!r->arena->base) continue; /* never between begin and finish: released between batches */
    r->slot->t_ns[SHMS_T_COMPUTE_END] = t_output;
    shms_tensor_ref results[SHMS_MAX_TENSORS];
    uint32_t nr = 0;
    int32_t s = status;
    char msg[SHMS_ERROR_BYTES];
    snprintf(msg, sizeof msg, "%s", message);
    if (status == SHMS_OK) {
      for (uint32_t j = 0; j < r->sh->request.n_outputs && j < SHMS_MAX_TENSORS; j++)
        if (r->filled & (1u << j)) results[nr++] = r->results[j];
      if (r->too_small) {
        s = SHMS_ERR_OUTPUT_TOO_SMALL;
        int at = snprintf(msg, sizeof msg, "model '%s': output buffer too small for ",
                          self->model->name);
        for (uint32_t k = 0, first = 1; k < self->model->n_outputs && at < (int)sizeof msg; k++)
          if (r->too_small & (1u << k)) {
            at += snprintf(msg + at, sizeof msg - at, "%s%s", first ? "" : ", ",
                           self->model->outputs[k].name);
            first = 0;
          }
      }
    }
    shms_arena_header *h = (shms_arena_header *)r->arena->base;
    answered += (uint32_t)shms_slot_complete(r->slot, h, r->sh->generation, s, msg, results, nr);
  }
  batch_clear(self);
  return PyLong_FromUnsignedLong(answered);
}

static Py_ssize_t batch_len(Batch *self) { return self->n; }

static PyObject *batch_rows(Batch *self, void *c) { return PyLong_FromUnsignedLong(self->rows); }

static PyMethodDef batch_methods[] = {
    {"begin", (PyCFunction)batch_begin, METH_VARARGS,
     "Take the mailbox's requests: () or the (client_id, lease) arenas to map first."},
    {"input", (PyCFunction)batch_input, METH_O,
     "None, or (buffer, offset, shape) of one model input (buffer None: gather it)."},
    {"gather", (PyCFunction)batch_gather, METH_VARARGS, "Copy input k of every request into out."},
    {"scatter", (PyCFunction)batch_scatter, METH_VARARGS,
     "Copy output k's rows into each request's buffer."},
    {"finish", (PyCFunction)batch_finish, METH_VARARGS,
     "Stamp, record statistics and answer every request; returns how many were answered."},
    {NULL}};

static PyGetSetDef batch_getset[] = {
    {"rows", (getter)batch_rows, NULL, "rows of the batch (sum of its requests' batch sizes)", NULL},
    {NULL}};

static PySequenceMethods batch_as_sequence = {.sq_length = (lenfunc)batch_len};

PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A worker's batch on the common path: begin, input/gather, scatter, finish.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)batch_init,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_methods = batch_methods,
    .tp_getset = batch_getset,
    .tp_as_sequence = &batch_as_sequence,
};
