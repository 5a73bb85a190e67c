/*
 * core.c — the Python extension shmserve._core: the Mapping type (its methods are in
 * mapping.c, slots.c and stats.c), the TensorRef named tuple, the client's types
 * (arena.c: ArenaAllocator, ArenaBlock; client.c: ClientCore), Triton's python model
 * API's per-request objects (pb_types.c), and the export of
 * shmserve.h's declarations to Python (layout(), enums()), so that Python never types
 * a size, offset, constant or enum value by hand.
 */
#include <signal.h>
#include <sys/prctl.h>

#include "core.h"

/* ---------------------------------------------------------------- Mapping */

static int mapping_init(Mapping *self, PyObject *args, PyObject *kw) {
  PyObject *obj;
  if (!PyArg_ParseTuple(args, "O", &obj)) return -1;
  self->readonly = 0;
  if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) {
    /* a read-only mmap: loads and waits only (the store methods refuse) */
    PyErr_Clear();
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_SIMPLE) < 0) return -1;
    self->readonly = 1;
  }
  self->base = (char *)self->view.buf;
  self->size = (uint64_t)self->view.len;
  return 0;
}

static void mapping_dealloc(Mapping *self) {
  if (self->base) PyBuffer_Release(&self->view);
  self->base = NULL;
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *mapping_size(Mapping *self, void *c) { return PyLong_FromUnsignedLongLong(self->size); }

static PyObject *mapping_readonly(Mapping *self, void *c) { return PyBool_FromLong(self->readonly); }

static PyGetSetDef mapping_getset[] = {{"size", (getter)mapping_size, NULL, "bytes mapped", NULL},
                                       {"readonly", (getter)mapping_readonly, NULL,
                                        "a read-only mapping (writes raise)", NULL},
                                       {NULL}};

PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Protocol operations on a writable buffer holding a shmserve segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mapping_init,
    .tp_dealloc = (destructor)mapping_dealloc,
    .tp_getset = mapping_getset,
};

/* One method table for the type, from the files that implement them. */
static PyMethodDef *joined_methods(void) {
  PyMethodDef *parts[] = {shms_py_mapping_methods, shms_py_slot_methods, shms_py_stats_methods};
  size_t n[3] = {0, 0, 0}, total = 0;
  for (int p = 0; p < 3; p++) {
    while (parts[p][n[p]].ml_name) n[p]++;
    total += n[p];
  }
  PyMethodDef *all = PyMem_Calloc(total + 1, sizeof(PyMethodDef));
  if (!all) return NULL;
  for (int p = 0, at = 0; p < 3; at += (int)n[p], p++)
    memcpy(all + at, parts[p], n[p] * sizeof(PyMethodDef));
  return all;
}

/* ---------------------------------------------------------------- Spin */

/* AdaptiveSpin(base_ns, max_ns): shms_spin, the waiting policy of shms_wait.h. */

static int spin_init(Spin *self, PyObject *args, PyObject *kw) {
  long long base, max;
  if (!PyArg_ParseTuple(args, "LL", &base, &max)) return -1;
  SHMS_ATOMIC(uint32_t) *crowded = self->spin.crowded; /* __init__ again keeps a watch */
  self->spin = shms_spin_make(base, max);
  self->spin.crowded = crowded;
  return 0;
}

/* watch(mapping, offset): from now on a nonzero u32 at offset means "do not spin"
 * (shms_spin.crowded). The mapping stays mapped while watched: its release waits. */
static PyObject *spin_watch(Spin *self, PyObject *args) {
  PyObject *obj;
  unsigned long long off;
  if (!PyArg_ParseTuple(args, "O!K", &MappingType, &obj, &off)) return NULL;
  Mapping *m = (Mapping *)obj;
  SHMS_ATOMIC(uint32_t) *word = shms_py_at(m, off, 4, 4);
  if (!word) return NULL;
  if (self->watched) {
    shms_py_leave(self->watched);
    Py_CLEAR(self->watched);
  }
  shms_py_enter(m);
  self->watched = (Mapping *)Py_NewRef(m);
  self->spin.crowded = word;
  Py_RETURN_NONE;
}

static void spin_dealloc(Spin *self) {
  if (self->watched) {
    shms_py_leave(self->watched);
    Py_CLEAR(self->watched);
  }
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *spin_budget(Spin *self, PyObject *unused) {
  return PyLong_FromLongLong(shms_spin_budget(&self->spin));
}

static PyObject *spin_record(Spin *self, PyObject *arg) {
  long long waited = PyLong_AsLongLong(arg);
  if (waited == -1 && PyErr_Occurred()) return NULL;
  shms_spin_record(&self->spin, waited);
  Py_RETURN_NONE;
}

static PyObject *spin_typical(Spin *self, void *c) { return PyLong_FromLongLong(self->spin.typical_ns); }
static PyObject *spin_backoff(Spin *self, void *c) { return PyLong_FromLongLong(self->spin.backoff); }
static PyObject *spin_preempted(Spin *self, void *c) {
  return PyLong_FromUnsignedLongLong(self->spin.preempted);
}
static PyObject *spin_base(Spin *self, void *c) { return PyLong_FromLongLong(self->spin.base_ns); }

static PyMethodDef spin_methods[] = {
    {"budget_ns", (PyCFunction)spin_budget, METH_NOARGS, "The spin for the next wait (ns)."},
    {"record", (PyCFunction)spin_record, METH_O, "Feed one observed wait (ns)."},
    {"watch", (PyCFunction)spin_watch, METH_VARARGS,
     "watch(mapping, offset): do not spin while the u32 there is nonzero."},
    {NULL}};

static PyGetSetDef spin_getset[] = {
    {"typical_ns", (getter)spin_typical, NULL, "average of recent waits", NULL},
    {"base_ns", (getter)spin_base, NULL, "the least spin", NULL},
    {"backoff", (getter)spin_backoff, NULL, "waits left without spinning (a spin was preempted)", NULL},
    {"preempted", (getter)spin_preempted, NULL, "spins cut short by preemption, ever", NULL},
    {NULL}};

PyTypeObject SpinType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.AdaptiveSpin",
    .tp_basicsize = sizeof(Spin),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "How long a waiter spins before it sleeps (shms_spin in shms_wait.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)spin_init,
    .tp_dealloc = (destructor)spin_dealloc,
    .tp_methods = spin_methods,
    .tp_getset = spin_getset,
};

/* ---------------------------------------------------------------- declarations */

static int put(PyObject *d, const char *name, unsigned long long value) {
  PyObject *v = PyLong_FromUnsignedLongLong(value);
  int rc = v ? PyDict_SetItemString(d, name, v) : -1;
  Py_XDECREF(v);
  return rc;
}

/* layout() -> {name: value}: every constant ("MAX_TENSORS"), every shared struct's
 * size ("slot.size") and each listed field's offset and size ("slot.state",
 * "slot.state.bytes"), from shms_layout.h's tables. */
static PyObject *f_layout(PyObject *m, PyObject *unused) {
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  int rc = 0;
#define SHMS_PUT_CONSTANT(name, value) rc |= put(d, #name, (unsigned long long)(value));
  SHMS_CONSTANTS(SHMS_PUT_CONSTANT)
#undef SHMS_PUT_CONSTANT
#define SHMS_PUT_STRUCT(name, type) rc |= put(d, #name ".size", sizeof(type));
#define SHMS_PUT_FIELD(name, type, field)                          \
  rc |= put(d, #name "." #field, offsetof(type, field));           \
  rc |= put(d, #name "." #field ".bytes", sizeof(((type *)0)->field));
  SHMS_LAYOUT_FIELDS(SHMS_PUT_STRUCT, SHMS_PUT_FIELD)
#undef SHMS_PUT_STRUCT
#undef SHMS_PUT_FIELD
  if (rc) Py_CLEAR(d);
  return d;
}

/* enums() -> {type name: {member name: value}}, from the X-macro lists. */
static PyObject *f_enums(PyObject *m, PyObject *unused) {
  PyObject *d = PyDict_New(), *members = NULL;
  int rc = d ? 0 : -1;
#define SHMS_PUT_MEMBER(cname, name, value) rc |= put(members, #name, (unsigned long long)(value));
#define SHMS_PUT_ENUM(list, type)                                   \
  members = PyDict_New();                                           \
  rc |= members ? 0 : -1;                                           \
  if (members) {                                                    \
    list(SHMS_PUT_MEMBER)                                           \
    rc |= PyDict_SetItemString(d, #type, members);                  \
    Py_DECREF(members);                                             \
  }
  if (d) {
    SHMS_ENUMS(SHMS_PUT_ENUM)
  }
#undef SHMS_PUT_ENUM
#undef SHMS_PUT_MEMBER
  if (rc) Py_CLEAR(d);
  return d;
}

/* server_layout(max_clients, slots_per_client, n_models, n_workers) -> the offsets
 * and size of a server segment (shms_server_init). */
static PyObject *f_server_layout(PyObject *m, PyObject *args) {
  unsigned int clients, slots, models, workers;
  if (!PyArg_ParseTuple(args, "IIII", &clients, &slots, &models, &workers)) return NULL;
  shms_server_header h = {0};
  shms_server_init(&h, clients, slots, models, workers);
  return Py_BuildValue("{sKsKsKsKsK}", "clients_offset", (unsigned long long)h.clients_offset,
                       "models_offset", (unsigned long long)h.models_offset, "shadows_offset",
                       (unsigned long long)h.shadows_offset, "mailboxes_offset",
                       (unsigned long long)h.mailboxes_offset, "segment_bytes",
                       (unsigned long long)h.segment_bytes);
}

/* arena_layout(n_slots, data_bytes) -> (slots_offset, data_offset, segment_bytes,
 * ring_offset, ring_capacity). */
static PyObject *f_arena_layout(PyObject *m, PyObject *args) {
  unsigned int n_slots;
  unsigned long long data_bytes;
  if (!PyArg_ParseTuple(args, "IK", &n_slots, &data_bytes)) return NULL;
  if (data_bytes > SHMS_MAX_SEGMENT_BYTES)
    return PyErr_Format(PyExc_OverflowError, "arena of %llu bytes", data_bytes);
  shms_arena_geometry g = shms_arena_layout(n_slots, data_bytes);
  return Py_BuildValue("(KKKKI)", (unsigned long long)g.slots_offset,
                       (unsigned long long)g.data_offset, (unsigned long long)g.segment_bytes,
                       (unsigned long long)g.ring_offset, g.ring_capacity);
}

/* control_bytes() -> size of a control segment; bell_bytes() -> of the bell. */
static PyObject *f_control_bytes(PyObject *m, PyObject *unused) {
  return PyLong_FromUnsignedLongLong(shms_control_bytes());
}

static PyObject *f_bell_bytes(PyObject *m, PyObject *unused) {
  return PyLong_FromUnsignedLongLong(SHMS_BELL_BYTES);
}

/* ---------------------------------------------------------------- process helpers */

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

static PyObject *f_latency_bucket(PyObject *m, PyObject *arg) {
  unsigned long long ns = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromUnsignedLong(shms_latency_bucket(ns));
}

static PyMethodDef module_methods[] = {
    {"layout", f_layout, METH_NOARGS, "Constants, struct sizes, field offsets of shmserve.h."},
    {"enums", f_enums, METH_NOARGS, "Every enum of shmserve.h: {type: {member: value}}."},
    {"server_layout", f_server_layout, METH_VARARGS, "Offsets of a server segment."},
    {"arena_layout", f_arena_layout, METH_VARARGS, "(slots_offset, data_offset, segment_bytes)."},
    {"control_bytes", f_control_bytes, METH_NOARGS, "Size of a control segment."},
    {"bell_bytes", f_bell_bytes, METH_NOARGS, "Size of the bell segment."},
    {"now_ns", f_now_ns, METH_NOARGS, "CLOCK_MONOTONIC in nanoseconds."},
    {"latency_bucket", f_latency_bucket, METH_O, "Histogram bucket of a duration (shms_stats.h)."},
    {"set_parent_death_signal", f_set_parent_death_signal, METH_O,
     "prctl(PR_SET_PDEATHSIG): get this signal when the parent dies."},
    {"set_timer_slack", f_set_timer_slack, METH_O,
     "prctl(PR_SET_TIMERSLACK, ns): how late a timed futex wait may wake (default 50 us)."},
    {NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "shmserve._core",
                                       "shmserve's C core (see shmserve/csrc/shmserve.h).", -1,
                                       module_methods};

PyMODINIT_FUNC PyInit__core(void) {
  MappingType.tp_methods = joined_methods();
  if (!MappingType.tp_methods || PyType_Ready(&MappingType) < 0 || PyType_Ready(&SpinType) < 0 ||
      PyType_Ready(&ArenaAllocatorType) < 0 || PyType_Ready(&ArenaBlockType) < 0 ||
      PyType_Ready(&ClientCoreType) < 0 || PyType_Ready(&BatchType) < 0 ||
      PyType_Ready(&BatcherCoreType) < 0 || PyType_Ready(&BatchQueueType) < 0 ||
      shms_py_client_ready() < 0 || shms_py_batch_queue_ready() < 0 ||
      shms_py_batcher_ready() < 0 ||
      shms_py_pb_ready() < 0)
    return NULL;
  shms_py_arena_full = PyErr_NewExceptionWithDoc(
      "shmserve._core.ArenaFull", "No free block of the arena is large enough.", NULL, NULL);
  if (!shms_py_arena_full) return NULL;
  PyObject *m = PyModule_Create(&moduledef);
  if (!m) return NULL;
  if (PyModule_AddObjectRef(m, "Mapping", (PyObject *)&MappingType) < 0 ||
      PyModule_AddObjectRef(m, "AdaptiveSpin", (PyObject *)&SpinType) < 0 ||
      PyModule_AddObjectRef(m, "ArenaAllocator", (PyObject *)&ArenaAllocatorType) < 0 ||
      PyModule_AddObjectRef(m, "ArenaBlock", (PyObject *)&ArenaBlockType) < 0 ||
      PyModule_AddObjectRef(m, "ArenaFull", shms_py_arena_full) < 0 ||
      PyModule_AddObjectRef(m, "ClientCore", (PyObject *)&ClientCoreType) < 0 ||
      PyModule_AddObjectRef(m, "Batch", (PyObject *)&BatchType) < 0 ||
      PyModule_AddObjectRef(m, "BatcherCore", (PyObject *)&BatcherCoreType) < 0 ||
      PyModule_AddObjectRef(m, "BatchQueue", (PyObject *)&BatchQueueType) < 0 ||
      shms_py_add_tensor_ref(m) < 0 || PyModule_AddFunctions(m, shms_py_pb_methods) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
