/*
 * batch_queue.c — shmserve._core.BatchQueue: the queue of a model with dynamic
 * batching or the default policy (one request a batch: max_requests 1), and the plain
 * queue policy (one priority level, no queue timeout), which is most models.
 * scheduling/core_queue.py holds its policy objects; the batcher's C
 * core (batcher.c) fills it from the ring and forms and hands over its batches with
 * no Python per request. The rules are those of scheduling/fair.py (clients take
 * turns, one request a turn, each client's requests in arrival order) and
 * scheduling/dynamic.py (a batch is the first request in that order and the later
 * ones of its shape key up to max_batch_size rows; it goes when full, when a
 * preferred size can be cut, or once the oldest request waited the queue delay);
 * tests/test_batch_queue.py holds the two to the same answers.
 *
 * Items live in one array, linked per client; clients with requests queued are an
 * array in turn order (a few dozen at most: the server's clients).
 */
#include "core.h"

static PyObject *s_shadow, *s_rows, *s_key, *s_arrived_ns, *s_arena, *s_slot_off,
    *s_generation, *s_priority, *s_timeout_us, *s_client;

void shms_bq_key_clear(shms_bq_key *k) {
  Py_CLEAR(k->bytes);
  k->len = 0;
}

int shms_bq_key_set(shms_bq_key *k, const void *bytes, size_t len) {
  k->len = (uint32_t)len;
  k->bytes = NULL;
  if (len <= SHMS_BQ_KEY_INLINE) {
    memcpy(k->inline_bytes, bytes, len);
    return 0;
  }
  k->bytes = PyBytes_FromStringAndSize(bytes, (Py_ssize_t)len);
  return k->bytes ? 0 : -1;
}

int shms_bq_key_copy(shms_bq_key *dst, const shms_bq_key *src) {
  *dst = *src;
  Py_XINCREF(dst->bytes);
  return 0;
}

static const void *key_data(const shms_bq_key *k) {
  return k->bytes ? (const void *)PyBytes_AS_STRING(k->bytes) : (const void *)k->inline_bytes;
}

static int key_eq(const shms_bq_key *a, const shms_bq_key *b) {
  return a->len == b->len && !memcmp(key_data(a), key_data(b), a->len);
}

static shms_bq_client *client_of(const BatchQueue *q, int64_t client) {
  for (uint32_t c = 0; c < q->n_clients; c++)
    if (q->clients[c].client == client) return &q->clients[c];
  return NULL;
}

int shms_bq_room(const BatchQueue *q, int64_t client) {
  if (q->max_queue_size && q->count >= q->max_queue_size) return 0;
  if (q->max_per_client) {
    const shms_bq_client *c = client_of(q, client);
    if (c && c->count >= q->max_per_client) return 0;
  }
  return 1;
}

static int grow(BatchQueue *q) {
  int32_t cap = q->cap ? 2 * q->cap : 64;
  shms_bq_item *items = PyMem_Realloc(q->items, (size_t)cap * sizeof(shms_bq_item));
  if (!items) goto nomem;
  q->items = items;
  int32_t *order = PyMem_Realloc(q->order, (size_t)cap * sizeof(int32_t));
  if (!order) goto nomem;
  q->order = order;
  for (int32_t i = cap - 1; i >= q->cap; i--) { /* the new items, free */
    items[i].next = q->free_head;
    q->free_head = i;
  }
  q->cap = cap;
  return 0;
nomem:
  PyErr_NoMemory();
  return -1;
}

int shms_bq_push(BatchQueue *q, const shms_bq_item *it) {
  shms_bq_client *c = client_of(q, it->client);
  if (!c) {
    if (q->n_clients == q->cap_clients) {
      uint32_t cap = q->cap_clients ? 2 * q->cap_clients : 8;
      shms_bq_client *clients = PyMem_Realloc(q->clients, cap * sizeof(shms_bq_client));
      int32_t *cursor = clients ? PyMem_Realloc(q->cursor, cap * sizeof(int32_t)) : NULL;
      if (clients) q->clients = clients;
      if (!cursor) {
        PyErr_NoMemory();
        return -1;
      }
      q->cursor = cursor;
      q->cap_clients = cap;
    }
    c = &q->clients[q->n_clients++]; /* a new client joins at the back of the turns */
    *c = (shms_bq_client){it->client, -1, -1, 0};
  }
  if (q->free_head < 0 && grow(q) < 0) {
    if (!c->count) q->n_clients--;
    return -1;
  }
  int32_t i = q->free_head;
  q->free_head = q->items[i].next;
  shms_bq_item *x = &q->items[i];
  *x = *it;
  x->next = -1;
  x->prev = c->tail;
  if (c->tail >= 0) q->items[c->tail].next = i;
  else c->head = i;
  c->tail = i;
  c->count++;
  q->count++;
  return 0;
}

/* Every queued item in the order batches take them: round robin over the clients in
 * turn order, each client's in arrival order (fair.py's FairQueue.__iter__). */
static uint32_t fill_order(BatchQueue *q) {
  uint32_t n = 0;
  for (uint32_t c = 0; c < q->n_clients; c++) q->cursor[c] = q->clients[c].head;
  for (int any = 1; any;) {
    any = 0;
    for (uint32_t c = 0; c < q->n_clients; c++) {
      int32_t i = q->cursor[c];
      if (i < 0) continue;
      q->order[n++] = i;
      q->cursor[c] = q->items[i].next;
      any = 1;
    }
  }
  return n;
}

static uint64_t oldest_arrival(const BatchQueue *q) {
  uint64_t oldest = UINT64_MAX;
  for (uint32_t c = 0; c < q->n_clients; c++) {
    uint64_t t = q->items[q->clients[c].head].arrived_ns;
    if (t < oldest) oldest = t;
  }
  return oldest;
}

static int is_preferred(const BatchQueue *q, uint32_t rows) {
  for (uint32_t i = 0; i < q->n_preferred; i++)
    if (q->preferred[i] == rows) return 1;
  return 0;
}

int shms_bq_next(BatchQueue *q, uint64_t now, int32_t out[SHMS_MAX_BATCH_REQUESTS],
                 uint64_t *deadline) {
  *deadline = SHMS_BQ_NO_DEADLINE;
  if (!q->count) return 0;
  uint32_t n = fill_order(q);
  const shms_bq_item *head = &q->items[q->order[0]];
  int picked = 0, preferred_prefix = 0, more = 0;
  uint32_t rows = 0;
  for (uint32_t k = 0; k < n; k++) {
    const shms_bq_item *x = &q->items[q->order[k]];
    if (!key_eq(&x->key, &head->key)) continue; /* other shapes never share a batch */
    if (rows + x->rows > q->max_rows || picked == (int)q->max_requests) {
      more = 1;
      break;
    }
    out[picked++] = q->order[k];
    rows += x->rows;
    if (is_preferred(q, rows)) preferred_prefix = picked;
  }
  int full = more || rows >= q->max_rows;
  /* the delay counts from the model's oldest request, whichever client sent it */
  uint64_t oldest = q->delay_ns ? oldest_arrival(q) : head->arrived_ns;
  /* no delay: at once (the default policy, whatever the clock says) */
  int expired = !q->delay_ns || (int64_t)(now - oldest) >= (int64_t)q->delay_ns;
  if (preferred_prefix &&
      (full || expired || rows >= q->preferred[q->n_preferred - 1]))
    return preferred_prefix;
  if (!(full || expired)) {
    *deadline = oldest + q->delay_ns;
    return 0;
  }
  return picked;
}

int shms_bq_join(BatchQueue *q, const shms_bq_key *key, uint32_t rows, uint32_t n,
                 int32_t out[SHMS_MAX_BATCH_REQUESTS]) {
  if (q->n_preferred || !q->count) return 0; /* batches cut to a preferred size stay so */
  uint32_t total = fill_order(q);
  int picked = 0;
  for (uint32_t k = 0; k < total; k++) {
    const shms_bq_item *x = &q->items[q->order[k]];
    if (!key_eq(&x->key, key)) continue;
    if (rows + x->rows > q->max_rows || n + picked >= q->max_requests) break;
    out[picked++] = q->order[k];
    rows += x->rows;
  }
  return picked;
}

void shms_bq_item_clear(shms_bq_item *x) {
  Py_CLEAR(x->seg);
  Py_CLEAR(x->pending);
  shms_bq_key_clear(&x->key);
}

/* Unlinks item i; served: its client's turn is used (to the back of the turns). */
static void unlink_item(BatchQueue *q, int32_t i, int served) {
  shms_bq_item *x = &q->items[i];
  shms_bq_client *c = client_of(q, x->client);
  if (x->prev >= 0) q->items[x->prev].next = x->next;
  else c->head = x->next;
  if (x->next >= 0) q->items[x->next].prev = x->prev;
  else c->tail = x->prev;
  c->count--;
  q->count--;
  uint32_t at = (uint32_t)(c - q->clients);
  if (!c->count || served) {
    shms_bq_client moved = *c;
    memmove(c, c + 1, (q->n_clients - at - 1) * sizeof(shms_bq_client));
    if (moved.count) q->clients[q->n_clients - 1] = moved;
    else q->n_clients--;
  }
  shms_bq_item_clear(x);
  x->next = q->free_head;
  q->free_head = i;
}

void shms_bq_take(BatchQueue *q, const int32_t *picked, int n) {
  for (int k = 0; k < n; k++) unlink_item(q, picked[k], 1);
}

/* ------------------------------------------------------------- the Python type */

PyObject *shms_bq_pending(PyObject *pending_type, shms_bq_item *x) {
  if (!x->pending) {
    PyObject *key = x->key.bytes ? Py_NewRef(x->key.bytes)
                                 : PyBytes_FromStringAndSize((const char *)x->key.inline_bytes,
                                                             x->key.len);
    if (!key) return NULL;
    /* Pending(shadow, rows, key, arrived_ns, arena, slot_off, generation, priority,
     *         timeout_us, queue_index, client) */
    x->pending = PyObject_CallFunction(pending_type, "IINKOKIIKiL", x->shadow, x->rows, key,
                                       (unsigned long long)x->arrived_ns,
                                       x->seg ? x->seg : Py_None,
                                       (unsigned long long)x->slot_off, x->generation,
                                       x->priority, (unsigned long long)x->timeout_us, -1,
                                       (long long)x->client);
    if (!x->pending) return NULL;
  }
  return Py_NewRef(x->pending);
}

/* The Pendings of items picked (then taken, when take), as a list. */
static PyObject *pendings(BatchQueue *q, const int32_t *picked, int n, int take) {
  PyObject *list = PyList_New(n);
  if (!list) return NULL;
  for (int k = 0; k < n; k++) {
    PyObject *p = shms_bq_pending(q->pending_type, &q->items[picked[k]]);
    if (!p) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, k, p);
  }
  if (take) shms_bq_take(q, picked, n);
  return list;
}

int shms_py_attr_u64(PyObject *o, PyObject *name, uint64_t *out) {
  PyObject *v = PyObject_GetAttr(o, name);
  if (!v) return -1;
  unsigned long long x = PyLong_AsUnsignedLongLong(v);
  Py_DECREF(v);
  if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = x;
  return 0;
}

/* BatchQueue(pending_type, max_rows, delay_us, preferred, max_queue_size,
 *            max_requests=MAX_BATCH_REQUESTS) */
static int bq_init(BatchQueue *self, PyObject *args, PyObject *kw) {
  PyObject *pending_type, *preferred;
  unsigned int max_rows, max_queue_size, max_requests = SHMS_MAX_BATCH_REQUESTS;
  unsigned long long delay_us;
  if (!PyArg_ParseTuple(args, "OIKOI|I", &pending_type, &max_rows, &delay_us, &preferred,
                        &max_queue_size, &max_requests))
    return -1;
  if (!max_requests || max_requests > SHMS_MAX_BATCH_REQUESTS) {
    PyErr_Format(PyExc_ValueError, "max_requests must lie in 1..%d", SHMS_MAX_BATCH_REQUESTS);
    return -1;
  }
  if (self->pending_type) {
    PyErr_SetString(PyExc_RuntimeError, "a BatchQueue is initialized once");
    return -1;
  }
  PyObject *seq = PySequence_Fast(preferred, "preferred must be a sequence of ints");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > SHMS_MAX_BATCH_REQUESTS) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError, "at most %d preferred batch sizes, not %zd",
                 SHMS_MAX_BATCH_REQUESTS, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      return -1;
    }
    self->preferred[i] = (uint32_t)v;
  }
  Py_DECREF(seq);
  self->n_preferred = (uint32_t)n;
  Py_XSETREF(self->pending_type, Py_NewRef(pending_type));
  self->max_rows = max_rows ? max_rows : 1;
  self->delay_ns = delay_us * 1000;
  self->max_queue_size = max_queue_size;
  self->max_requests = max_requests;
  return 0;
}

static PyObject *bq_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  BatchQueue *self = (BatchQueue *)type->tp_alloc(type, 0);
  if (self) {
    self->free_head = -1; /* no item yet, free or not */
    self->max_rows = 1;
    self->max_requests = SHMS_MAX_BATCH_REQUESTS;
  }
  return (PyObject *)self;
}

static void bq_dealloc(BatchQueue *self) {
  for (uint32_t c = 0; c < self->n_clients; c++)
    for (int32_t i = self->clients[c].head; i >= 0; i = self->items[i].next)
      shms_bq_item_clear(&self->items[i]);
  PyMem_Free(self->items);
  PyMem_Free(self->order);
  PyMem_Free(self->clients);
  PyMem_Free(self->cursor);
  Py_XDECREF(self->pending_type);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t bq_len(BatchQueue *self) { return self->count; }

/* room(client) -> bool */
static PyObject *bq_room(BatchQueue *self, PyObject *client) {
  long long c = PyLong_AsLongLong(client);
  if (c == -1 && PyErr_Occurred()) return NULL;
  return PyBool_FromLong(shms_bq_room(self, c));
}

/* client_count(client) -> requests of that client queued */
static PyObject *bq_client_count(BatchQueue *self, PyObject *client) {
  long long c = PyLong_AsLongLong(client);
  if (c == -1 && PyErr_Occurred()) return NULL;
  const shms_bq_client *e = client_of(self, c);
  return PyLong_FromUnsignedLong(e ? e->count : 0);
}

/* push(pending): queues a Pending (intake's path for requests Python took). */
static PyObject *bq_push(BatchQueue *self, PyObject *p) {
  shms_bq_item it = {0};
  if (!self->pending_type)
    return PyErr_Format(PyExc_RuntimeError, "BatchQueue.__init__ was not called");
  uint64_t shadow, rows, generation, priority;
  PyObject *key = PyObject_GetAttr(p, s_key);
  if (!key) return NULL;
  if (!PyBytes_Check(key)) {
    Py_DECREF(key);
    return PyErr_Format(PyExc_TypeError, "Pending.key must be bytes");
  }
  int bad = shms_bq_key_set(&it.key, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key));
  Py_DECREF(key);
  PyObject *client = bad ? NULL : PyObject_GetAttr(p, s_client);
  if (!client) goto fail;
  it.client = PyLong_AsLongLong(client);
  Py_DECREF(client);
  if ((it.client == -1 && PyErr_Occurred()) || shms_py_attr_u64(p, s_shadow, &shadow) < 0 ||
      shms_py_attr_u64(p, s_rows, &rows) < 0 ||
      shms_py_attr_u64(p, s_arrived_ns, &it.arrived_ns) < 0 ||
      shms_py_attr_u64(p, s_slot_off, &it.slot_off) < 0 ||
      shms_py_attr_u64(p, s_generation, &generation) < 0 ||
      shms_py_attr_u64(p, s_priority, &priority) < 0 ||
      shms_py_attr_u64(p, s_timeout_us, &it.timeout_us) < 0)
    goto fail;
  it.shadow = (uint32_t)shadow;
  it.rows = (uint32_t)rows;
  it.generation = (uint32_t)generation;
  it.priority = (uint32_t)priority;
  if (!(it.seg = PyObject_GetAttr(p, s_arena))) goto fail;
  if (it.seg == Py_None) Py_CLEAR(it.seg);
  it.pending = Py_NewRef(p);
  if (shms_bq_push(self, &it) < 0) {
    shms_bq_item_clear(&it);
    return NULL;
  }
  Py_RETURN_NONE;
fail:
  shms_bq_key_clear(&it.key);
  return NULL;
}

/* next_batch(now_ns) -> (batch or None, deadline or None): dynamic.py's next_batch */
static PyObject *bq_next_batch(BatchQueue *self, PyObject *arg) {
  unsigned long long now = PyLong_AsUnsignedLongLong(arg);
  if (now == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  int32_t picked[SHMS_MAX_BATCH_REQUESTS];
  uint64_t deadline;
  int n = shms_bq_next(self, now, picked, &deadline);
  if (n) return Py_BuildValue("(NO)", pendings(self, picked, n, 1), Py_None);
  if (deadline == SHMS_BQ_NO_DEADLINE) return Py_BuildValue("(OO)", Py_None, Py_None);
  return Py_BuildValue("(OK)", Py_None, (unsigned long long)deadline);
}

/* join(batch) -> the Pendings that join it, taken (dynamic.py's join) */
static PyObject *bq_join(BatchQueue *self, PyObject *batch) {
  if (!PyList_Check(batch) || !PyList_GET_SIZE(batch))
    return PyErr_Format(PyExc_TypeError, "join needs a non-empty list of Pendings");
  uint64_t rows = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(batch); i++) {
    uint64_t r;
    if (shms_py_attr_u64(PyList_GET_ITEM(batch, i), s_rows, &r) < 0) return NULL;
    rows += r;
  }
  PyObject *key = PyObject_GetAttr(PyList_GET_ITEM(batch, 0), s_key);
  if (!key) return NULL;
  shms_bq_key k;
  int bad = !PyBytes_Check(key) ||
            shms_bq_key_set(&k, PyBytes_AS_STRING(key), (size_t)PyBytes_GET_SIZE(key)) < 0;
  Py_DECREF(key);
  if (bad) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_TypeError, "key must be bytes");
  int32_t picked[SHMS_MAX_BATCH_REQUESTS];
  int n = shms_bq_join(self, &k, (uint32_t)rows, (uint32_t)PyList_GET_SIZE(batch), picked);
  shms_bq_key_clear(&k);
  return pendings(self, picked, n, 1);
}

/* ordered() -> every Pending held, in the order batches take them */
static PyObject *bq_ordered(BatchQueue *self, PyObject *unused) {
  return pendings(self, self->order, (int)fill_order(self), 0);
}

/* drain() -> every Pending held, removed (the model became unavailable) */
static PyObject *bq_drain(BatchQueue *self, PyObject *unused) {
  uint32_t n = fill_order(self);
  PyObject *list = pendings(self, self->order, (int)n, 0);
  if (!list) return NULL;
  while (self->count) unlink_item(self, self->clients[0].head, 0);
  return list;
}

static PyMethodDef bq_methods[] = {
    {"room", (PyCFunction)bq_room, METH_O,
     "room(client) -> whether one more request of the client fits (max_queue_size, "
     "max_per_client)."},
    {"client_count", (PyCFunction)bq_client_count, METH_O,
     "client_count(client) -> that client's requests queued."},
    {"push", (PyCFunction)bq_push, METH_O, "push(pending): queue a Pending."},
    {"next_batch", (PyCFunction)bq_next_batch, METH_O,
     "next_batch(now_ns) -> (batch or None, deadline or None), taken."},
    {"join", (PyCFunction)bq_join, METH_O,
     "join(batch) -> the queued Pendings that join a next batch, taken."},
    {"ordered", (PyCFunction)bq_ordered, METH_NOARGS,
     "ordered() -> the Pendings held, in the order batches take them."},
    {"drain", (PyCFunction)bq_drain, METH_NOARGS, "drain() -> the Pendings held, removed."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef bq_members[] = {
    {"max_per_client", T_UINT, offsetof(BatchQueue, max_per_client), 0,
     "requests of one client queued at most (0: no limit)"},
    {NULL},
};

static PySequenceMethods bq_as_sequence = {.sq_length = (lenfunc)bq_len};

PyTypeObject BatchQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.BatchQueue",
    .tp_basicsize = sizeof(BatchQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A model's queue under dynamic batching, plain queue policy (batch_queue.c).",
    .tp_new = bq_new,
    .tp_init = (initproc)bq_init,
    .tp_dealloc = (destructor)bq_dealloc,
    .tp_methods = bq_methods,
    .tp_members = bq_members,
    .tp_as_sequence = &bq_as_sequence,
};

int shms_py_batch_queue_ready(void) {
  s_shadow = PyUnicode_InternFromString("shadow");
  s_rows = PyUnicode_InternFromString("rows");
  s_key = PyUnicode_InternFromString("key");
  s_arrived_ns = PyUnicode_InternFromString("arrived_ns");
  s_arena = PyUnicode_InternFromString("arena");
  s_slot_off = PyUnicode_InternFromString("slot_off");
  s_generation = PyUnicode_InternFromString("generation");
  s_priority = PyUnicode_InternFromString("priority");
  s_timeout_us = PyUnicode_InternFromString("timeout_us");
  s_client = PyUnicode_InternFromString("client");
  return s_shadow && s_rows && s_key && s_arrived_ns && s_arena && s_slot_off && s_generation &&
                 s_priority && s_timeout_us && s_client
             ? 0
             : -1;
}
