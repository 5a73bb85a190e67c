/*
 * client.c — the Python client's C core, shmserve._core.ClientCore: what one lease
 * holds that every request uses, and the common path of a request in one call.
 *
 *   - the slot table: free slots, generations, the Python path's requests in flight
 *     (for its waiters and the futures' poller), and orphans (a caller stopped
 *     waiting: slot and block come back only once the server answered);
 *   - the models' compiled plans (`plans`: name or (name, version) -> (Plan, plan));
 *   - the waiting policy of every waiter of the lease (shms_spin);
 *   - infer(): checks the caller's arrays against the plan, takes a slot and an arena
 *     block, copies the inputs (arrays already in the arena are used in place),
 *     writes the slot, pushes, waits, reads the answer and builds the output arrays;
 *     send(): the same up to the push, for submit().
 *
 * Python (client/engine.py) stays the reference for everything else. infer() and
 * send() return None, having changed nothing, for what they do not take: values that
 * are not plain C-contiguous ndarrays of a fixed-size dtype (BYTES, lists,
 * non-contiguous or byte-swapped arrays), unknown names, a model without a compiled
 * plan, a closed client, or no free slot or arena block at this moment. infer()
 * returns the raw answer, for Python to finish, on an error status,
 * OUTPUT_TOO_SMALL, or outputs it does not build (BYTES). Every step on shared
 * memory is a procedure of shmserve.h (shms_slot.h, shms_wait.h), as in the C++
 * client (clients/cpp/include/shmserve/detail/engine.hpp).
 *
 * Locking: every method runs with the GIL held and calls no Python code while it
 * changes the slot table or the allocator, so the GIL is their lock. It is released
 * only around the copy-in, the push and the wait, which touch shared memory alone;
 * the mappings are entered (shms_py_enter) meanwhile so that a close() cannot unmap
 * them underneath.
 */
#include <math.h>

#include "core.h"

enum { SLOT_FREE, SLOT_BUSY, SLOT_ORPHAN };

typedef struct {
  uint32_t generation;
  uint8_t state;
  uint8_t has_future;
  PyObject *req;               /* SLOT_BUSY: the Python path's Request while in flight */
  uint64_t block, block_bytes; /* SLOT_ORPHAN: freed once the slot is DONE */
} client_slot;

/* What a request to one (model, version) needs, worked out once (Engine.compile). */
typedef struct {
  PyObject *name, *version;             /* for InferResult */
  PyObject *input_index, *output_index; /* {name: index} (Plan's) */
  PyObject *outputs;                    /* Plan.outputs: `wanted` for all outputs */
  uint32_t model_id, n_inputs, n_outputs;
  int batched;
  PyObject *out_name[SHMS_MAX_TENSORS];
  PyObject *out_spec[SHMS_MAX_TENSORS]; /* Plan.outputs[k] */
  uint64_t out_itemsize[SHMS_MAX_TENSORS];
  int64_t out_row_elems[SHMS_MAX_TENSORS]; /* elements per batch row; -1: not fixed */
} client_plan;

#define PLAN_CAPSULE "shmserve._core.plan"
#define MAX_IN_DTYPES 32

typedef struct {
  PyObject_HEAD
  Mapping *arena, *control;
  PyObject *arena_buffer; /* the arena's mmap: blocks export it (ArenaBlock) */
  ArenaAllocator *alloc;
  shms_ring ring;
  uint32_t client_id, n_slots;
  uint64_t slots_offset;
  int64_t wait_slice_ns;
  client_slot *slots;
  uint32_t *free_stack, n_free;
  SHMS_ATOMIC(uint32_t) slot_bell; /* bumped when a slot comes back (acquire_slot waits) */
  SHMS_ATOMIC(uint32_t) slot_sleepers;
  shms_spin spin;
  PyObject *plans;
  PyObject *ndarray, *result_type, *timeout_error, *dead_error;
  PyObject *in_dtypes;                  /* ((dtype, code), ...) accepted for inputs */
  PyObject *in_dtype[MAX_IN_DTYPES];    /* ... the same, borrowed from in_dtypes */
  uint32_t in_code[MAX_IN_DTYPES], n_in_dtypes;
  PyObject *out_dtypes;                 /* numpy dtype by code, None: Python decodes */
  int closed;
  unsigned long long sent_c, sent_py;   /* slots taken by infer()/send(), by Python */
} ClientCore;

static PyObject *s_dtype, *s_copy, *s_check_server, *s_push_failed, *s_plan, *s_sources,
    *s_wanted, *s_slot, *s_generation, *s_block, *s_block_bytes, *s_id, *s_name, *s_version,
    *s_batched, *s_input_index, *s_output_index, *s_outputs, *s_output_names;

int shms_py_client_ready(void) {
#define INTERN(var, text) \
  if (!(var = PyUnicode_InternFromString(text))) return -1;
  INTERN(s_dtype, "dtype") INTERN(s_copy, "copy") INTERN(s_check_server, "check_server")
  INTERN(s_push_failed, "_push_failed") INTERN(s_plan, "plan") INTERN(s_sources, "sources")
  INTERN(s_wanted, "wanted") INTERN(s_slot, "slot") INTERN(s_generation, "generation")
  INTERN(s_block, "block") INTERN(s_block_bytes, "block_bytes") INTERN(s_id, "id")
  INTERN(s_name, "name") INTERN(s_version, "version") INTERN(s_batched, "batched")
  INTERN(s_input_index, "input_index") INTERN(s_output_index, "output_index")
  INTERN(s_outputs, "outputs") INTERN(s_output_names, "output_names")
#undef INTERN
  return 0;
}

static shms_slot *slot_at(ClientCore *self, uint32_t i) {
  return (shms_slot *)(self->arena->base + self->slots_offset + (uint64_t)i * sizeof(shms_slot));
}

static shms_arena_header *header(ClientCore *self) {
  return (shms_arena_header *)self->arena->base;
}

/* Shared memory is usable: the client is open and neither mapping was released. */
static int mapped(ClientCore *self) {
  return !self->closed && self->arena->base && self->control->base;
}

static int need_mapped(ClientCore *self) {
  if (mapped(self)) return 0;
  PyErr_SetString(self->dead_error, "client is closed");
  return -1;
}

static void enter(ClientCore *self) {
  shms_py_enter(self->arena);
  shms_py_enter(self->control);
}

static void leave(ClientCore *self) {
  shms_py_leave(self->arena);
  shms_py_leave(self->control);
}

/* ---------------------------------------------------------------- slot table */

/* A slot back to the free list. The caller has read or withdrawn its request. */
static void slot_put(ClientCore *self, uint32_t i) {
  client_slot *e = &self->slots[i];
  PyObject *req = e->req;
  e->req = NULL;
  e->has_future = 0;
  e->state = SLOT_FREE;
  self->free_stack[self->n_free++] = i;
  shms_doorbell_ring(&self->slot_bell, &self->slot_sleepers, 1);
  Py_XDECREF(req); /* last: may run Python code */
}

/* The caller stopped waiting: slot and block stay reserved until the answer. */
static void slot_orphan(ClientCore *self, uint32_t i, uint64_t block, uint64_t block_bytes) {
  client_slot *e = &self->slots[i];
  PyObject *req = e->req;
  e->req = NULL;
  e->has_future = 0;
  e->state = SLOT_ORPHAN;
  e->block = block;
  e->block_bytes = block_bytes;
  Py_XDECREF(req);
}

/* Orphans whose answer came: DONE -> FREE, block and slot back. Returns how many. */
static int reap(ClientCore *self) {
  int n = 0;
  for (uint32_t i = 0; i < self->n_slots; i++) {
    client_slot *e = &self->slots[i];
    if (e->state != SLOT_ORPHAN || !shms_slot_is_done(slot_at(self, i))) continue;
    shms_slot_release(slot_at(self, i));
    shms_py_free(self->alloc, e->block, e->block_bytes);
    slot_put(self, i);
    n++;
  }
  return n;
}

/* A free slot, without waiting: 1 and *out, or 0. */
static int slot_take(ClientCore *self, uint32_t *out) {
  if (!self->n_free) reap(self);
  if (!self->n_free) return 0;
  uint32_t i = self->free_stack[--self->n_free];
  self->slots[i].state = SLOT_BUSY;
  *out = i;
  return 1;
}

/* The next generation of a taken slot (protocol section 6: previous + 1). */
static uint32_t slot_generation(ClientCore *self, uint32_t i) {
  return ++self->slots[i].generation;
}

static int check_slot(ClientCore *self, unsigned int slot, int state) {
  if (slot < self->n_slots && self->slots[slot].state == state) return 0;
  PyErr_Format(PyExc_ValueError, "slot %u is not %s", slot,
               state == SLOT_BUSY ? "in use" : "free");
  return -1;
}

/* ---------------------------------------------------------------- plans */

static void plan_destroy(PyObject *capsule) {
  client_plan *p = PyCapsule_GetPointer(capsule, PLAN_CAPSULE);
  if (!p) return;
  Py_XDECREF(p->name);
  Py_XDECREF(p->version);
  Py_XDECREF(p->input_index);
  Py_XDECREF(p->output_index);
  Py_XDECREF(p->outputs);
  for (uint32_t k = 0; k < SHMS_MAX_TENSORS; k++) {
    Py_XDECREF(p->out_name[k]);
    Py_XDECREF(p->out_spec[k]);
  }
  PyMem_Free(p);
}

/* compile(plan) -> the plan as infer() and send() use it, or None when this model
 * takes the Python path only (more tensors than a request carries). The caller
 * registers it: plans[key] = (plan, compiled). */
static PyObject *core_compile(ClientCore *self, PyObject *plan) {
  client_plan *p = PyMem_Calloc(1, sizeof *p);
  if (!p) return PyErr_NoMemory();
  PyObject *capsule = PyCapsule_New(p, PLAN_CAPSULE, plan_destroy);
  if (!capsule) {
    PyMem_Free(p);
    return NULL;
  }
  PyObject *id = NULL, *batched = NULL, *names = NULL;
  if (!(id = PyObject_GetAttr(plan, s_id)) || !(batched = PyObject_GetAttr(plan, s_batched)) ||
      !(names = PyObject_GetAttr(plan, s_output_names)) ||
      !(p->name = PyObject_GetAttr(plan, s_name)) ||
      !(p->version = PyObject_GetAttr(plan, s_version)) ||
      !(p->input_index = PyObject_GetAttr(plan, s_input_index)) ||
      !(p->output_index = PyObject_GetAttr(plan, s_output_index)) ||
      !(p->outputs = PyObject_GetAttr(plan, s_outputs)))
    goto fail;
  unsigned long model_id = PyLong_AsUnsignedLong(id);
  if (PyErr_Occurred()) goto fail;
  p->model_id = (uint32_t)model_id;
  p->batched = PyObject_IsTrue(batched);
  if (p->batched < 0 || !PyDict_Check(p->input_index) || !PyDict_Check(p->output_index) ||
      !PyList_Check(p->outputs) || !PyList_Check(names)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "not a client Plan");
    goto fail;
  }
  Py_ssize_t n_in = PyDict_GET_SIZE(p->input_index), n_out = PyList_GET_SIZE(p->outputs);
  if (n_in > SHMS_MAX_TENSORS || n_out > SHMS_MAX_TENSORS || n_out != PyList_GET_SIZE(names) ||
      model_id > UINT32_MAX) {
    Py_DECREF(capsule);
    capsule = Py_NewRef(Py_None);
    goto done;
  }
  p->n_inputs = (uint32_t)n_in;
  p->n_outputs = (uint32_t)n_out;
  for (Py_ssize_t k = 0; k < n_out; k++) {
    /* (index, name, itemsize or 0 for BYTES, dims without batch or None) */
    PyObject *spec = PyList_GET_ITEM(p->outputs, k), *dims;
    unsigned long long itemsize;
    Py_ssize_t index;
    PyObject *name;
    if (!PyArg_ParseTuple(spec, "nOKO", &index, &name, &itemsize, &dims)) goto fail;
    p->out_spec[k] = Py_NewRef(spec);
    p->out_name[k] = Py_NewRef(PyList_GET_ITEM(names, k));
    p->out_itemsize[k] = itemsize;
    p->out_row_elems[k] = -1;
    if (dims == Py_None || itemsize == 0) continue;
    PyObject *seq = PySequence_Fast(dims, "output dims must be a sequence");
    if (!seq) goto fail;
    int64_t elems = 1;
    for (Py_ssize_t d = 0; d < PySequence_Fast_GET_SIZE(seq) && elems >= 0; d++) {
      long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, d));
      if (v < 0 || __builtin_mul_overflow(elems, (int64_t)v, &elems)) elems = -1;
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) goto fail;
    p->out_row_elems[k] = elems;
  }
done:
  Py_DECREF(id);
  Py_DECREF(batched);
  Py_DECREF(names);
  return capsule;
fail:
  Py_XDECREF(id);
  Py_XDECREF(batched);
  Py_XDECREF(names);
  Py_DECREF(capsule);
  return NULL;
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
  PyObject *plan; /* the Python Plan (borrowed from the plans entry) */
  const client_plan *p;
  uint32_t n_in, n_out, n_views;
  call_input in[SHMS_MAX_TENSORS];
  Py_buffer views[SHMS_MAX_TENSORS];
  uint32_t out_k[SHMS_MAX_TENSORS]; /* model output index */
  uint64_t out_offset[SHMS_MAX_TENSORS], out_bytes[SHMS_MAX_TENSORS];
  uint64_t block, block_bytes;
  uint32_t slot, generation;
} call;

static void drop_views(call *c) {
  for (uint32_t i = 0; i < c->n_views; i++) PyBuffer_Release(&c->views[i]);
  c->n_views = 0;
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

/* The request's inputs, outputs and block size from the caller's arguments, checked
 * against the plan as Python's sources(), wanted() and Engine._prepare would.
 * Returns 1 (views held: drop_views), or 0: not for the C path (nothing held). */
static int take_call(ClientCore *self, call *c, PyObject *model, PyObject *inputs,
                     PyObject *outputs, PyObject *version) {
  PyObject *entry = plan_entry(self, model, version);
  if (!entry) return 0;
  c->plan = PyTuple_GET_ITEM(entry, 0);
  const client_plan *p = c->p = plan_of(PyTuple_GET_ITEM(entry, 1));
  if (!p) {
    PyErr_Clear();
    return 0;
  }
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
  c->block_bytes = size;
  return 1;
not_taken:
  PyErr_Clear();
  drop_views(c);
  return 0;
}

/* A slot and a block for a taken call; 0 when either is not to be had right now
 * (Python's path waits for them). The slot is SLOT_BUSY with its next generation. */
static int place_call(ClientCore *self, call *c) {
  if (!slot_take(self, &c->slot)) return 0;
  if (shms_py_alloc(self->alloc, c->block_bytes, &c->block) < 0) {
    slot_put(self, c->slot);
    return 0;
  }
  for (uint32_t i = 0; i < c->n_in; i++)
    if (!c->in[i].adopted) c->in[i].offset += c->block;
  for (uint32_t j = 0; j < c->n_out; j++) c->out_offset[j] += c->block;
  c->generation = slot_generation(self, c->slot);
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
 * until `started + timeout_ns` (timeout_ns < 0: no limit). As Engine.wait. */
static int wait_done(ClientCore *self, shms_slot *s, uint64_t started, int64_t timeout_ns,
                     int64_t spin_ns) {
  shms_arena_header *h = header(self);
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
    if (!shms_doorbell_wait(&h->completions, &h->waiters, seen, spin_ns, slice)) return WAIT_SLICE;
  }
}

/* Sends a placed call: copy-in, slot, push with the protocol's retries; with
 * `wait`, then waits for the answer as far as it can without the GIL. Returns the
 * push's result; *withdrawn says a failed push put the slot back to FREE (then the
 * request was not sent), *how how the wait ended. */
static int send_call(ClientCore *self, call *c, lease_check *lc, int wait, uint64_t *started,
                     int64_t timeout_ns, int64_t spin_ns, int *withdrawn, int *how) {
  int rc;
  *withdrawn = 0;
  *how = WAIT_SLICE;
  Py_BEGIN_ALLOW_THREADS
  write_call(self, c);
  rc = shms_push_request(&self->ring, self->client_id, c->slot, c->generation, lease_alive, lc);
  /* A failed push takes the request back, unless the batcher took it meanwhile (its
   * sweep takes SUBMITTED requests the ring lost): then it is in flight. */
  if (rc != SHMS_RING_OK) *withdrawn = shms_slot_withdraw(slot_at(self, c->slot));
  *started = shms_now_ns();
  if (wait && !*withdrawn && !lc->exc_type)
    *how = wait_done(self, slot_at(self, c->slot), *started, timeout_ns, spin_ns);
  Py_END_ALLOW_THREADS
  return rc;
}

/* After a failed push that took the request back: block and slot back, and the
 * error (Engine._push_failed words it). Always NULL. */
static PyObject *unsent(ClientCore *self, call *c, lease_check *lc, int rc) {
  shms_py_free(self->alloc, c->block, c->block_bytes);
  slot_put(self, c->slot);
  if (lc->exc_type) {
    PyErr_Restore(lc->exc_type, lc->exc_value, lc->exc_tb);
    return NULL;
  }
  PyObject *r = PyObject_CallMethod(lc->engine, "_push_failed", "i", rc);
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
  slot_put(self, slot);
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

/* infer(engine, model, inputs, outputs, version, timeout, copy): one request on the
 * common path, from the caller's arrays to an InferResult. Returns None, having done
 * nothing, when the request is not for the C path (Engine.start takes it from the
 * beginning); or (status, message, results, stamps, block, block_bytes, started_ns)
 * when the answer is one Python finishes (Engine.infer); raises ServerTimeoutError,
 * the errors of Engine.check_server and of Engine._push_failed as the Python path. */
static PyObject *core_infer(ClientCore *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 7) return PyErr_Format(PyExc_TypeError, "infer() takes 7 arguments");
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
      shms_load(&self->ring.ctl->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED)
    Py_RETURN_NONE; /* Python checks and says why */
  call c;
  if (!take_call(self, &c, args[1], args[2], args[3], args[4])) Py_RETURN_NONE;
  if (!place_call(self, &c)) {
    drop_views(&c);
    Py_RETURN_NONE;
  }
  self->sent_c++;
  lease_check lc = {engine, self->dead_error, NULL, NULL, NULL};
  int64_t spin_ns = shms_spin_budget(&self->spin);
  uint64_t started;
  int withdrawn, how;
  PyObject *out = NULL;
  enter(self);
  int rc = send_call(self, &c, &lc, 1, &started, timeout_ns, spin_ns, &withdrawn, &how);
  drop_views(&c); /* copied, or in the arena and held by the caller */
  if (rc != SHMS_RING_OK && withdrawn) {
    out = unsent(self, &c, &lc, rc);
    goto done;
  }
  if (lc.exc_type) { /* the lease check raised: in flight, nobody waits for it */
    slot_orphan(self, c.slot, c.block, c.block_bytes);
    PyErr_Restore(lc.exc_type, lc.exc_value, lc.exc_tb);
    goto done;
  }
  while (how == WAIT_SLICE) { /* a liveness slice passed without the answer */
    PyObject *r = PyObject_CallMethodNoArgs(engine, s_check_server);
    Py_XDECREF(r);
    if (!r || PyErr_CheckSignals() < 0) {
      slot_orphan(self, c.slot, c.block, c.block_bytes);
      goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    how = wait_done(self, slot_at(self, c.slot), started, timeout_ns, spin_ns);
    Py_END_ALLOW_THREADS
  }
  if (how == WAIT_TIMEOUT) {
    slot_orphan(self, c.slot, c.block, c.block_bytes);
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
  return out;
}

/* A list like request.sources(): (index, dtype code, array, arena offset or -1, shape). */
static PyObject *sources_of(const call *c) {
  PyObject *list = PyList_New(c->n_in);
  for (uint32_t i = 0; list && i < c->n_in; i++) {
    const call_input *t = &c->in[i];
    PyObject *shape = PyTuple_New(t->ndim);
    for (uint32_t d = 0; shape && d < t->ndim; d++) {
      PyObject *v = PyLong_FromLongLong(t->shape[d]);
      if (!v) Py_CLEAR(shape);
      else PyTuple_SET_ITEM(shape, d, v);
    }
    PyObject *item = shape ? Py_BuildValue("(IIOLN)", t->index, t->dtype, t->arr,
                                           t->adopted ? (long long)t->offset : -1LL, shape)
                           : NULL;
    if (!item) Py_CLEAR(list);
    else PyList_SET_ITEM(list, i, item);
  }
  return list;
}

/* send(engine, req, model, inputs, outputs, version): submit()'s send on the common
 * path. Fills req (plan, sources, wanted, slot, generation, block, block_bytes),
 * registers it in flight with its future and pushes it; True. None, having done
 * nothing, when the request is not for the C path; raises as Engine._send. */
static PyObject *core_send(ClientCore *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 6) return PyErr_Format(PyExc_TypeError, "send() takes 6 arguments");
  PyObject *engine = args[0], *req = args[1];
  if (!mapped(self) ||
      shms_load(&self->ring.ctl->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED)
    Py_RETURN_NONE;
  call c;
  if (!take_call(self, &c, args[2], args[3], args[4], args[5])) Py_RETURN_NONE;
  PyObject *sources = sources_of(&c), *wanted = NULL;
  if (!sources) goto fail_views;
  if (args[4] == Py_None) {
    wanted = Py_NewRef(c.p->outputs);
  } else if ((wanted = PyList_New(c.n_out))) {
    for (uint32_t j = 0; j < c.n_out; j++) PyList_SET_ITEM(wanted, j, Py_NewRef(c.p->out_spec[c.out_k[j]]));
  }
  if (!wanted) goto fail_views;
  if (!place_call(self, &c)) {
    Py_DECREF(sources);
    Py_DECREF(wanted);
    drop_views(&c);
    Py_RETURN_NONE;
  }
  /* Everything the poller needs is in req before the answer can come. */
  PyObject *vals[5] = {PyLong_FromUnsignedLong(c.slot), PyLong_FromUnsignedLong(c.generation),
                       PyLong_FromUnsignedLongLong(c.block),
                       PyLong_FromUnsignedLongLong(c.block_bytes), NULL};
  PyObject *names[5] = {s_slot, s_generation, s_block, s_block_bytes, NULL};
  int failed = PyObject_SetAttr(req, s_plan, c.plan) < 0 ||
               PyObject_SetAttr(req, s_sources, sources) < 0 ||
               PyObject_SetAttr(req, s_wanted, wanted) < 0;
  for (int i = 0; i < 4; i++) {
    failed = failed || !vals[i] || PyObject_SetAttr(req, names[i], vals[i]) < 0;
    Py_XDECREF(vals[i]);
  }
  Py_DECREF(sources);
  Py_DECREF(wanted);
  if (failed) {
    shms_py_free(self->alloc, c.block, c.block_bytes);
    slot_put(self, c.slot);
    drop_views(&c);
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
  int rc = send_call(self, &c, &lc, 0, &started, -1, 0, &withdrawn, &how);
  drop_views(&c);
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
  Py_XDECREF(sources);
  drop_views(&c);
  return NULL;
}

/* finish(slot, block, block_bytes, compiled plan or None, copy): reads the DONE slot
 * of a request the Python path sent, as infer() reads its own: an InferResult, or
 * (status, message, results, stamps) for Python to finish. The slot is free after. */
static PyObject *core_finish(ClientCore *self, PyObject *const *args, Py_ssize_t nargs) {
  unsigned long long block, block_bytes;
  unsigned int slot;
  int copy;
  if (nargs != 5 || !PyArg_Parse(args[0], "I", &slot) || !PyArg_Parse(args[1], "K", &block) ||
      !PyArg_Parse(args[2], "K", &block_bytes) || (copy = PyObject_IsTrue(args[4])) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "finish() takes 5 arguments");
    return NULL;
  }
  const client_plan *p = plan_of(args[3]);
  if ((!p && PyErr_Occurred()) || need_mapped(self) < 0 || check_slot(self, slot, SLOT_BUSY) < 0)
    return NULL;
  enter(self);
  PyObject *out = finish_slot(self, slot, block, block_bytes, p, copy);
  leave(self);
  return out;
}

/* acquire_slot(wait_ns) -> a free slot, or None if none came back within wait_ns. */
static PyObject *core_acquire_slot(ClientCore *self, PyObject *arg) {
  long long wait_ns = PyLong_AsLongLong(arg);
  if (wait_ns == -1 && PyErr_Occurred()) return NULL;
  if (need_mapped(self) < 0) return NULL;
  uint32_t slot, seen = shms_load(&self->slot_bell, memory_order_acquire);
  if (slot_take(self, &slot)) return PyLong_FromUnsignedLong(slot);
  if (wait_ns > 0) {
    /* SYNC POINT: woken by slot_put's ring of slot_bell (any thread of this client). */
    Py_BEGIN_ALLOW_THREADS
    shms_doorbell_wait(&self->slot_bell, &self->slot_sleepers, seen, 0, wait_ns);
    Py_END_ALLOW_THREADS
    if (need_mapped(self) < 0) return NULL;
    if (slot_take(self, &slot)) return PyLong_FromUnsignedLong(slot);
  }
  Py_RETURN_NONE;
}

/* register(slot, req, has_future) -> the slot's next generation; req is in flight. */
static PyObject *core_register(ClientCore *self, PyObject *args) {
  unsigned int slot;
  PyObject *req;
  int has_future;
  if (!PyArg_ParseTuple(args, "IOp", &slot, &req, &has_future) || check_slot(self, slot, SLOT_BUSY) < 0)
    return NULL;
  client_slot *e = &self->slots[slot];
  Py_XSETREF(e->req, Py_NewRef(req));
  e->has_future = (uint8_t)has_future;
  self->sent_py++;
  return PyLong_FromUnsignedLong(slot_generation(self, slot));
}

/* release_slot(slot): back to the free list (a request that was not sent). */
static PyObject *core_release_slot(ClientCore *self, PyObject *arg) {
  unsigned long slot = PyLong_AsUnsignedLong(arg);
  if (PyErr_Occurred() || check_slot(self, (unsigned int)slot, SLOT_BUSY) < 0) return NULL;
  slot_put(self, (uint32_t)slot);
  Py_RETURN_NONE;
}

/* claim(slot, req) -> True if req is in flight in slot and DONE; then it is no longer
 * in flight, and the caller alone finishes it. */
static PyObject *core_claim(ClientCore *self, PyObject *args) {
  unsigned int slot;
  PyObject *req;
  if (!PyArg_ParseTuple(args, "IO", &slot, &req) || need_mapped(self) < 0) return NULL;
  if (slot >= self->n_slots || self->slots[slot].req != req ||
      !shms_slot_is_done(slot_at(self, slot)))
    Py_RETURN_FALSE;
  Py_CLEAR(self->slots[slot].req);
  Py_RETURN_TRUE;
}

/* collect() -> the requests with futures that are DONE, no longer in flight. */
static PyObject *core_collect(ClientCore *self, PyObject *unused) {
  PyObject *out = PyList_New(0);
  if (!out || !mapped(self)) return out;
  for (uint32_t i = 0; i < self->n_slots; i++) {
    client_slot *e = &self->slots[i];
    if (!e->req || !e->has_future || !shms_slot_is_done(slot_at(self, i))) continue;
    if (PyList_Append(out, e->req) < 0) {
      Py_DECREF(out);
      return NULL;
    }
    Py_CLEAR(e->req);
  }
  return out;
}

/* futures() -> the requests with futures in flight. */
static PyObject *core_futures(ClientCore *self, PyObject *unused) {
  PyObject *out = PyList_New(0);
  for (uint32_t i = 0; out && i < self->n_slots; i++)
    if (self->slots[i].req && self->slots[i].has_future && PyList_Append(out, self->slots[i].req) < 0)
      Py_CLEAR(out);
  return out;
}

/* abandon(slot, block, block_bytes): the caller stopped waiting; slot and block come
 * back once the server answered (reap). */
static PyObject *core_abandon(ClientCore *self, PyObject *args) {
  unsigned int slot;
  unsigned long long block, block_bytes;
  if (!PyArg_ParseTuple(args, "IKK", &slot, &block, &block_bytes) ||
      check_slot(self, slot, SLOT_BUSY) < 0)
    return NULL;
  slot_orphan(self, slot, block, block_bytes);
  Py_RETURN_NONE;
}

/* reap() -> how many orphans were answered and given back. */
static PyObject *core_reap(ClientCore *self, PyObject *unused) {
  return PyLong_FromLong(mapped(self) ? reap(self) : 0);
}

/* block(offset, nbytes) -> an ArenaBlock owning that allocated block. */
static PyObject *core_block(ClientCore *self, PyObject *args) {
  unsigned long long off, n;
  if (!PyArg_ParseTuple(args, "KK", &off, &n)) return NULL;
  return shms_py_block_new(self->alloc, self->arena_buffer, off, n);
}

static PyObject *core_spin_budget(ClientCore *self, PyObject *unused) {
  return PyLong_FromLongLong(shms_spin_budget(&self->spin));
}

static PyObject *core_spin_record(ClientCore *self, PyObject *arg) {
  long long waited = PyLong_AsLongLong(arg);
  if (waited == -1 && PyErr_Occurred()) return NULL;
  shms_spin_record(&self->spin, waited);
  Py_RETURN_NONE;
}

static PyObject *core_close(ClientCore *self, PyObject *unused) {
  self->closed = 1;
  Py_RETURN_NONE;
}

static PyObject *core_busy(ClientCore *self, void *c) {
  return PyLong_FromUnsignedLong(self->n_slots - self->n_free);
}

static PyObject *core_n_futures(ClientCore *self, void *c) {
  unsigned long n = 0;
  for (uint32_t i = 0; i < self->n_slots; i++) n += self->slots[i].req && self->slots[i].has_future;
  return PyLong_FromUnsignedLong(n);
}

static PyObject *core_counts(ClientCore *self, void *c) {
  return Py_BuildValue("{sKsK}", "c", self->sent_c, "python", self->sent_py);
}

/* ---------------------------------------------------------------- the type */

/* ClientCore(arena, arena_buffer, control, ring_offset, ring_capacity, client_id,
 *            slots_offset, n_slots, allocator, spin_ns, max_spin_ns, wait_slice_ns, types)
 * arena, control: the lease's Mappings; arena_buffer: the arena's mmap (blocks export
 * it); allocator: the ArenaAllocator of its data area; types: (numpy.ndarray,
 * InferResult, ServerTimeoutError, ServerDeadError, ((input dtype, code), ...),
 * (numpy dtype or None by code, ...)). */
static int core_init(ClientCore *self, PyObject *args, PyObject *kw) {
  Mapping *arena, *control;
  PyObject *arena_buffer, *types;
  ArenaAllocator *alloc;
  unsigned long long ring_off, ring_cap, slots_offset;
  unsigned int client_id, n_slots;
  long long spin_ns, max_spin_ns, slice_ns;
  if (self->slots) {
    PyErr_SetString(PyExc_TypeError, "ClientCore is initialized once");
    return -1;
  }
  if (!PyArg_ParseTuple(args, "O!OO!KKIKIO!LLLO!", &MappingType, &arena, &arena_buffer,
                        &MappingType, &control, &ring_off, &ring_cap, &client_id, &slots_offset,
                        &n_slots, &ArenaAllocatorType, &alloc, &spin_ns, &max_spin_ns, &slice_ns,
                        &PyTuple_Type, &types))
    return -1;
  PyObject *ndarray, *result_type, *timeout_error, *dead_error, *in_dtypes, *out_dtypes;
  if (!PyArg_ParseTuple(types, "O!OOOO!O!", &PyType_Type, &ndarray, &result_type, &timeout_error,
                        &dead_error, &PyTuple_Type, &in_dtypes, &PyTuple_Type, &out_dtypes))
    return -1;
  if (PyTuple_GET_SIZE(out_dtypes) != SHMS_TYPE_COUNT) {
    PyErr_Format(PyExc_ValueError, "output dtypes: %d entries, one per data type code", SHMS_TYPE_COUNT);
    return -1;
  }
  if (PyTuple_GET_SIZE(in_dtypes) > MAX_IN_DTYPES) {
    PyErr_Format(PyExc_ValueError, "more than %d input dtypes", MAX_IN_DTYPES);
    return -1;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(in_dtypes); k++) {
    PyObject *pair = PyTuple_GET_ITEM(in_dtypes, k);
    unsigned int code;
    if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "OI", &self->in_dtype[k], &code) ||
        code == 0 || code >= SHMS_TYPE_COUNT) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "input dtypes: (dtype, code) pairs");
      return -1;
    }
    self->in_code[k] = code;
  }
  self->n_in_dtypes = (uint32_t)PyTuple_GET_SIZE(in_dtypes);
  /* The geometry the hello reply announced, checked once against the mapping. */
  if (!shms_py_at(arena, 0, sizeof(shms_arena_header), 64) ||
      !shms_py_at(arena, slots_offset, (uint64_t)n_slots * sizeof(shms_slot), 64) ||
      shms_py_ring_view(control, ring_off, ring_cap, &self->ring) < 0)
    return -1;
  if (n_slots == 0 || alloc->end > arena->size ||
      alloc->begin < slots_offset + (uint64_t)n_slots * sizeof(shms_slot)) {
    PyErr_SetString(PyExc_ValueError, "arena layout: no slots, or data overlapping them");
    return -1;
  }
  self->slots = PyMem_Calloc(n_slots, sizeof(client_slot));
  self->free_stack = PyMem_Calloc(n_slots, sizeof(uint32_t));
  self->plans = PyDict_New();
  if (!self->slots || !self->free_stack || !self->plans) {
    PyErr_NoMemory();
    return -1;
  }
  for (uint32_t i = 0; i < n_slots; i++) self->free_stack[i] = n_slots - 1 - i; /* slot 0 first */
  self->n_free = self->n_slots = n_slots;
  self->arena = (Mapping *)Py_NewRef(arena);
  self->control = (Mapping *)Py_NewRef(control);
  self->arena_buffer = Py_NewRef(arena_buffer);
  self->alloc = (ArenaAllocator *)Py_NewRef(alloc);
  self->client_id = client_id;
  self->slots_offset = slots_offset;
  self->wait_slice_ns = slice_ns > 0 ? slice_ns : 50000000;
  self->spin = shms_spin_make(spin_ns, max_spin_ns);
  self->ndarray = Py_NewRef(ndarray);
  self->result_type = Py_NewRef(result_type);
  self->timeout_error = Py_NewRef(timeout_error);
  self->dead_error = Py_NewRef(dead_error);
  self->in_dtypes = Py_NewRef(in_dtypes);
  self->out_dtypes = Py_NewRef(out_dtypes);
  return 0;
}

static int core_traverse(ClientCore *self, visitproc visit, void *arg) {
  Py_VISIT(self->arena);
  Py_VISIT(self->control);
  Py_VISIT(self->arena_buffer);
  Py_VISIT(self->alloc);
  Py_VISIT(self->plans);
  Py_VISIT(self->ndarray);
  Py_VISIT(self->result_type);
  Py_VISIT(self->timeout_error);
  Py_VISIT(self->dead_error);
  Py_VISIT(self->in_dtypes);
  Py_VISIT(self->out_dtypes);
  for (uint32_t i = 0; self->slots && i < self->n_slots; i++) Py_VISIT(self->slots[i].req);
  return 0;
}

static int core_clear(ClientCore *self) {
  for (uint32_t i = 0; self->slots && i < self->n_slots; i++) Py_CLEAR(self->slots[i].req);
  Py_CLEAR(self->plans);
  Py_CLEAR(self->arena_buffer);
  Py_CLEAR(self->ndarray);
  Py_CLEAR(self->result_type);
  Py_CLEAR(self->timeout_error);
  Py_CLEAR(self->dead_error);
  Py_CLEAR(self->in_dtypes);
  Py_CLEAR(self->out_dtypes);
  return 0;
}

static void core_dealloc(ClientCore *self) {
  PyObject_GC_UnTrack(self);
  core_clear(self);
  Py_CLEAR(self->arena);
  Py_CLEAR(self->control);
  Py_CLEAR(self->alloc);
  PyMem_Free(self->slots);
  PyMem_Free(self->free_stack);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef core_methods[] = {
    {"infer", (PyCFunction)(void (*)(void))core_infer, METH_FASTCALL,
     "infer(engine, model, inputs, outputs, version, timeout, copy): one request on the C path."},
    {"send", (PyCFunction)(void (*)(void))core_send, METH_FASTCALL,
     "send(engine, req, model, inputs, outputs, version): submit()'s send on the C path."},
    {"finish", (PyCFunction)(void (*)(void))core_finish, METH_FASTCALL,
     "finish(slot, block, block_bytes, compiled, copy): read a DONE slot's answer."},
    {"compile", (PyCFunction)core_compile, METH_O, "compile(plan) -> compiled plan or None."},
    {"acquire_slot", (PyCFunction)core_acquire_slot, METH_O,
     "acquire_slot(wait_ns) -> a free slot or None (GIL released while waiting)."},
    {"register", (PyCFunction)core_register, METH_VARARGS,
     "register(slot, req, has_future) -> generation: req is in flight in slot."},
    {"release_slot", (PyCFunction)core_release_slot, METH_O, "Put a slot back (not sent)."},
    {"claim", (PyCFunction)core_claim, METH_VARARGS, "claim(slot, req) -> True if DONE and now ours."},
    {"collect", (PyCFunction)core_collect, METH_NOARGS, "DONE requests with futures, claimed."},
    {"futures", (PyCFunction)core_futures, METH_NOARGS, "Requests with futures in flight."},
    {"abandon", (PyCFunction)core_abandon, METH_VARARGS,
     "abandon(slot, block, block_bytes): an orphan until the server answers."},
    {"reap", (PyCFunction)core_reap, METH_NOARGS, "Give back answered orphans; how many."},
    {"block", (PyCFunction)core_block, METH_VARARGS, "block(offset, nbytes) -> ArenaBlock."},
    {"spin_budget", (PyCFunction)core_spin_budget, METH_NOARGS, "The spin for the next wait (ns)."},
    {"spin_record", (PyCFunction)core_spin_record, METH_O, "Feed one observed wait (ns)."},
    {"close", (PyCFunction)core_close, METH_NOARGS, "No more requests (infer/send return None)."},
    {NULL}};

static PyMemberDef core_members[] = {
    {"plans", T_OBJECT, offsetof(ClientCore, plans), READONLY,
     "{model name or (name, version): (Plan, compiled)} for infer() and send()"},
    {NULL}};

static PyGetSetDef core_getset[] = {
    {"busy", (getter)core_busy, NULL, "slots not free (in flight, orphaned, being sent)", NULL},
    {"n_futures", (getter)core_n_futures, NULL, "requests with futures in flight", NULL},
    {"counts", (getter)core_counts, NULL,
     "requests given a slot: {'c': by infer()/send(), 'python': by the Python path}", NULL},
    {NULL}};

PyTypeObject ClientCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.ClientCore",
    .tp_basicsize = sizeof(ClientCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A client lease's slot table, plans and waiting policy, and the common path "
              "of a request in C (client.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
    .tp_getset = core_getset,
};
