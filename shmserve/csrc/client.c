/*
 * client.c — the Python client's C core, shmserve._core.ClientCore: what one lease
 * holds that every request uses. Its common path, infer() and send(), is in
 * client_call.c; client/engine.py is the Python side (docs/architecture.md, "The
 * Python client").
 *
 *   - the slot table: free slots, generations, the Python path's requests in flight
 *     (for its waiters and the futures' poller), and orphans (a caller stopped
 *     waiting: slot and block come back only once the server answered);
 *   - the models' compiled plans (`plans`: name or (name, version) -> (Plan, plan));
 *   - the waiting policy of every waiter of the lease (shms_spin);
 *   - the Python path's bookkeeping: acquire_slot, register, claim, collect, abandon.
 *
 * Locking: every method runs with the GIL held and calls no Python code while it
 * changes the slot table or the allocator, so the GIL is their lock.
 */
#include "client.h"

static PyObject *s_id, *s_name, *s_version, *s_batched, *s_input_index, *s_output_index,
    *s_outputs, *s_output_names;

int shms_py_client_ready(void) {
#define INTERN(var, text) \
  if (!(var = PyUnicode_InternFromString(text))) return -1;
  INTERN(s_id, "id") INTERN(s_name, "name") INTERN(s_version, "version")
  INTERN(s_batched, "batched") INTERN(s_input_index, "input_index")
  INTERN(s_output_index, "output_index") INTERN(s_outputs, "outputs")
  INTERN(s_output_names, "output_names")
#undef INTERN
  return shms_py_client_call_ready();
}

/* ---------------------------------------------------------------- slot table */

/* A slot back to the free list. The caller has read or withdrawn its request. */
void shms_py_slot_put(ClientCore *self, uint32_t i) {
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
void shms_py_slot_orphan(ClientCore *self, uint32_t i, uint64_t block, uint64_t block_bytes) {
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
int shms_py_reap(ClientCore *self) {
  int n = 0;
  for (uint32_t i = 0; i < self->n_slots; i++) {
    client_slot *e = &self->slots[i];
    if (e->state != SLOT_ORPHAN || !shms_slot_is_done(slot_at(self, i))) continue;
    shms_slot_release(slot_at(self, i));
    shms_py_free(self->alloc, e->block, e->block_bytes);
    shms_py_slot_put(self, i);
    n++;
  }
  return n;
}

/* A free slot, without waiting: 1 and *out, or 0. */
int shms_py_slot_take(ClientCore *self, uint32_t *out) {
  if (!self->n_free) shms_py_reap(self);
  if (!self->n_free) return 0;
  uint32_t i = self->free_stack[--self->n_free];
  self->slots[i].state = SLOT_BUSY;
  *out = i;
  return 1;
}

/* The next generation of a taken slot (protocol section 6: previous + 1). */
uint32_t shms_py_slot_generation(ClientCore *self, uint32_t i) {
  return ++self->slots[i].generation;
}

int shms_py_check_slot(ClientCore *self, unsigned int slot, int state) {
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

/* acquire_slot(wait_ns) -> a free slot, or None if none came back within wait_ns. */
static PyObject *core_acquire_slot(ClientCore *self, PyObject *arg) {
  long long wait_ns = PyLong_AsLongLong(arg);
  if (wait_ns == -1 && PyErr_Occurred()) return NULL;
  if (need_mapped(self) < 0) return NULL;
  uint32_t slot, seen = shms_load(&self->slot_bell, memory_order_acquire);
  if (shms_py_slot_take(self, &slot)) return PyLong_FromUnsignedLong(slot);
  if (wait_ns > 0) {
    /* SYNC POINT: woken by slot_put's ring of slot_bell (any thread of this client). */
    Py_BEGIN_ALLOW_THREADS
    shms_doorbell_wait(&self->slot_bell, &self->slot_sleepers, seen, 0, wait_ns);
    Py_END_ALLOW_THREADS
    if (need_mapped(self) < 0) return NULL;
    if (shms_py_slot_take(self, &slot)) return PyLong_FromUnsignedLong(slot);
  }
  Py_RETURN_NONE;
}

/* register(slot, req, has_future) -> the slot's next generation; req is in flight. */
static PyObject *core_register(ClientCore *self, PyObject *args) {
  unsigned int slot;
  PyObject *req;
  int has_future;
  if (!PyArg_ParseTuple(args, "IOp", &slot, &req, &has_future) || shms_py_check_slot(self, slot, SLOT_BUSY) < 0)
    return NULL;
  client_slot *e = &self->slots[slot];
  Py_XSETREF(e->req, Py_NewRef(req));
  e->has_future = (uint8_t)has_future;
  self->sent_py++;
  return PyLong_FromUnsignedLong(shms_py_slot_generation(self, slot));
}

/* release_slot(slot): back to the free list (a request that was not sent). */
static PyObject *core_release_slot(ClientCore *self, PyObject *arg) {
  unsigned long slot = PyLong_AsUnsignedLong(arg);
  if (PyErr_Occurred() || shms_py_check_slot(self, (unsigned int)slot, SLOT_BUSY) < 0) return NULL;
  shms_py_slot_put(self, (uint32_t)slot);
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
      shms_py_check_slot(self, slot, SLOT_BUSY) < 0)
    return NULL;
  shms_py_slot_orphan(self, slot, block, block_bytes);
  Py_RETURN_NONE;
}

/* reap() -> how many orphans were answered and given back. */
static PyObject *core_reap(ClientCore *self, PyObject *unused) {
  return PyLong_FromLong(mapped(self) ? shms_py_reap(self) : 0);
}

/* block(offset, nbytes) -> an ArenaBlock owning that allocated block. */
static PyObject *core_block(ClientCore *self, PyObject *args) {
  unsigned long long off, n;
  if (!PyArg_ParseTuple(args, "KK", &off, &n)) return NULL;
  return shms_py_block_new(self->alloc, self->arena_buffer, off, n);
}

static PyObject *core_spin_budget(ClientCore *self, PyObject *unused) {
  if (!self->control->base) self->spin.crowded = NULL; /* released by close(): no hint */
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
  return Py_BuildValue("{sKsKsKsK}", "c", self->sent_c, "python", self->sent_py,
                       "inputs_copied", self->inputs_copied, "inputs_adopted",
                       self->inputs_adopted);
}

/* ---------------------------------------------------------------- the type */

/* ClientCore(arena, arena_buffer, control, bell, client_id, slots_offset, n_slots,
 *            allocator, spin_ns, max_spin_ns, wait_slice_ns, types)
 * arena, control, bell: the lease's Mappings; arena_buffer: the arena's mmap (blocks export
 * it); allocator: the ArenaAllocator of its data area; types: (numpy.ndarray,
 * InferResult, ServerTimeoutError, ServerDeadError, ((input dtype, code), ...),
 * (numpy dtype or None by code, ...)). */
static int core_init(ClientCore *self, PyObject *args, PyObject *kw) {
  Mapping *arena, *control, *bell;
  PyObject *arena_buffer, *types;
  ArenaAllocator *alloc;
  unsigned long long slots_offset;
  unsigned int client_id, n_slots;
  long long spin_ns, max_spin_ns, slice_ns;
  if (self->slots) {
    PyErr_SetString(PyExc_TypeError, "ClientCore is initialized once");
    return -1;
  }
  if (!PyArg_ParseTuple(args, "O!OO!O!IKIO!LLLO!", &MappingType, &arena, &arena_buffer,
                        &MappingType, &control, &MappingType, &bell, &client_id, &slots_offset,
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
  if (!shms_py_writable(arena) || !shms_py_writable(bell) ||
      !shms_py_at(arena, 0, sizeof(shms_arena_header), 64) ||
      !shms_py_at(arena, slots_offset, (uint64_t)n_slots * sizeof(shms_slot), 64) ||
      !shms_py_at(control, 0, sizeof(shms_control), 64) ||
      !shms_py_at(bell, 0, sizeof(shms_bell), 64))
    return -1;
  if (shms_ring_attach(&self->sub.ring, arena->base, arena->size) != 0) {
    PyErr_SetString(PyExc_ValueError, "arena: no sane submission ring");
    return -1;
  }
  shms_submitter_bells(&self->sub, control->base, bell->base, arena->base);
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
  self->bell = (Mapping *)Py_NewRef(bell);
  self->arena_buffer = Py_NewRef(arena_buffer);
  self->alloc = (ArenaAllocator *)Py_NewRef(alloc);
  self->client_id = client_id;
  self->slots_offset = slots_offset;
  self->wait_slice_ns = slice_ns > 0 ? slice_ns : 50000000;
  self->spin = shms_spin_make(spin_ns, max_spin_ns);
  self->spin.crowded = &((shms_control *)control->base)->crowded; /* the server's hint */
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
  Py_VISIT(self->bell);
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
  Py_CLEAR(self->bell);
  Py_CLEAR(self->alloc);
  PyMem_Free(self->slots);
  PyMem_Free(self->free_stack);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef core_methods[] = {
    {"infer", (PyCFunction)(void (*)(void))shms_py_client_infer, METH_FASTCALL,
     "infer(engine, model, inputs, outputs, version, timeout, copy): one request on the C path."},
    {"send", (PyCFunction)(void (*)(void))shms_py_client_send, METH_FASTCALL,
     "send(engine, req, model, inputs, outputs, version): submit()'s send on the C path."},
    {"finish", (PyCFunction)(void (*)(void))shms_py_client_finish, METH_FASTCALL,
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
