/*
 * slots.c — shmserve._core.Mapping's protocol procedures: segment headers, request
 * slots (submit, push, answer, take, complete), shadows, mailboxes and statistics.
 * Each method is a thin translation of a procedure of shmserve.h, which the C++
 * client runs too; no protocol logic lives here.
 */
#include "core.h"

/* ---------------------------------------------------------------- TensorRef */

/* A tensor reference as Python sees one: (index, dtype, offset, nbytes, shape), with
 * memory_kind and device_id as named fields (0 for the host arena). */
PyTypeObject *TensorRefType;

static PyStructSequence_Field tensor_ref_fields[] = {
    {"index", "position in the model's input or output list"},
    {"dtype", "enum shms_dtype (Triton's DataType number)"},
    {"offset", "byte offset of the data in the caller's arena"},
    {"nbytes", "data size in bytes (an output's capacity in a request)"},
    {"shape", "tuple of dimensions"},
    {"memory_kind", "enum shms_memory_kind; 0 = the caller's arena"},
    {"device_id", "GPU ordinal for device memory, else 0"},
    {NULL}};

static PyStructSequence_Desc tensor_ref_desc = {
    "shmserve._core.TensorRef", "A tensor in a caller's arena (shms_tensor_ref).",
    tensor_ref_fields, 5};

int shms_py_add_tensor_ref(PyObject *module) {
  TensorRefType = PyStructSequence_NewType(&tensor_ref_desc);
  if (!TensorRefType) return -1;
  Py_INCREF(TensorRefType);
  return PyModule_AddObject(module, "TensorRef", (PyObject *)TensorRefType);
}

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

/* A TensorRef's named u16 field; None (not given) is 0. */
static int u16_field(PyObject *ref, Py_ssize_t i, const char *name, uint16_t *out) {
  PyObject *v = PyStructSequence_GetItem(ref, i);
  if (v == Py_None) {
    *out = 0;
    return 0;
  }
  unsigned long x = PyLong_AsUnsignedLong(v);
  if (PyErr_Occurred()) return -1;
  if (x > 0xFFFF) {
    PyErr_Format(PyExc_OverflowError, "TensorRef.%s %lu does not fit 16 bits", name, x);
    return -1;
  }
  *out = (uint16_t)x;
  return 0;
}

/* TensorRefs, or plain (index, dtype, offset, nbytes, shape) tuples -> refs.
 * Returns the count or -1. */
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
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *shape;
    unsigned int index, dtype;
    unsigned long long offset, nbytes;
    memset(t, 0, sizeof *t);
    if (!PyArg_ParseTuple(item, "IIKKO", &index, &dtype, &offset, &nbytes, &shape)) goto fail;
    t->index = index;
    t->dtype = dtype;
    t->offset = offset;
    t->nbytes = nbytes;
    if (Py_TYPE(item) == TensorRefType &&
        (u16_field(item, 5, "memory_kind", &t->memory_kind) < 0 ||
         u16_field(item, 6, "device_id", &t->device_id) < 0))
      goto fail;
    if (parse_shape(shape, t) < 0) goto fail;
  }
  Py_DECREF(seq);
  return (int)n;
fail:
  Py_DECREF(seq);
  return -1;
}

static PyObject *tensor_ref(const shms_tensor_ref *t) {
  uint32_t nd = t->ndim < SHMS_MAX_DIMS ? t->ndim : SHMS_MAX_DIMS;
  PyObject *shape = PyTuple_New(nd), *ref = PyStructSequence_New(TensorRefType);
  if (!shape || !ref) {
    Py_XDECREF(shape);
    Py_XDECREF(ref);
    return NULL;
  }
  int failed = 0;
  for (uint32_t d = 0; d < nd; d++) {
    PyObject *v = PyLong_FromLongLong(t->shape[d]);
    failed |= !v;
    PyTuple_SET_ITEM(shape, d, v);
  }
  PyObject *items[7] = {PyLong_FromUnsignedLong(t->index), PyLong_FromUnsignedLong(t->dtype),
                        PyLong_FromUnsignedLongLong(t->offset),
                        PyLong_FromUnsignedLongLong(t->nbytes), shape,
                        PyLong_FromUnsignedLong(t->memory_kind),
                        PyLong_FromUnsignedLong(t->device_id)};
  for (int i = 0; i < 7; i++) {
    failed |= !items[i];
    PyStructSequence_SetItem(ref, i, items[i]); /* steals; NULL items are skipped at dealloc */
  }
  if (failed) Py_CLEAR(ref);
  return ref;
}

PyObject *shms_py_refs_list(const shms_tensor_ref *refs, uint32_t n) {
  if (n > SHMS_MAX_TENSORS) n = SHMS_MAX_TENSORS;
  PyObject *out = PyList_New(n);
  for (uint32_t i = 0; out && i < n; i++) {
    PyObject *ref = tensor_ref(&refs[i]);
    if (!ref) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, ref);
  }
  return out;
}

static shms_slot *slot_at(Mapping *self, unsigned long long off) {
  return (shms_slot *)shms_py_at(self, off, sizeof(shms_slot), 64);
}

/* The server's view of an arena header. Its magic is not re-checked here: the server
 * created the segment and checked it at mapping; its owner may have scribbled over
 * the header since, so only the futex words at fixed offsets are used. */
static shms_arena_header *arena_of(Mapping *self) {
  return (shms_arena_header *)shms_py_at(self, 0, sizeof(shms_arena_header), 64);
}

/* ---------------------------------------------------------------- headers */

static const char *const header_kinds[] = {"control", "arena", "server"};
static const uint64_t header_magics[] = {SHMS_MAGIC_CONTROL, SHMS_MAGIC_ARENA, SHMS_MAGIC_SERVER};

/* check_header(kind): raises ValueError naming the problem unless the mapping holds
 * a segment of this kind ("control", "arena", "server") and protocol version. */
static PyObject *m_check_header(Mapping *self, PyObject *arg) {
  const char *kind = PyUnicode_AsUTF8(arg);
  if (!kind || !shms_py_at(self, 0, 0, 0)) return NULL;
  for (int k = 0; k < 3; k++) {
    if (strcmp(kind, header_kinds[k])) continue;
    const char *why = shms_check_header(self->base, self->size, header_magics[k]);
    if (why) return PyErr_Format(PyExc_ValueError, "not a shmserve protocol %u %s segment: %s",
                                 SHMS_PROTOCOL_VERSION, kind, why);
    Py_RETURN_NONE;
  }
  return PyErr_Format(PyExc_ValueError, "unknown segment kind %R", arg);
}

/* init_control(server_pid) on a zeroed control segment. */
static PyObject *m_init_control(Mapping *self, PyObject *args) {
  unsigned int pid;
  if (!PyArg_ParseTuple(args, "I", &pid) || !shms_py_at(self, 0, 0, 0)) return NULL;
  if (shms_control_init(self->base, self->size, pid) != 0)
    return PyErr_Format(PyExc_ValueError, "a control block does not fit %llu bytes",
                        (unsigned long long)self->size);
  Py_RETURN_NONE;
}

/* init_arena(n_slots, data_bytes, client_id, generation): a fresh arena header. */
static PyObject *m_init_arena(Mapping *self, PyObject *args) {
  unsigned int n_slots, client_id, gen;
  unsigned long long data_bytes;
  if (!PyArg_ParseTuple(args, "IKII", &n_slots, &data_bytes, &client_id, &gen)) return NULL;
  if (data_bytes > SHMS_MAX_SEGMENT_BYTES)
    return PyErr_Format(PyExc_OverflowError, "arena of %llu bytes", data_bytes);
  shms_arena_geometry g = shms_arena_layout(n_slots, data_bytes);
  if (g.segment_bytes < sizeof(shms_arena_header))
    return PyErr_Format(PyExc_ValueError, "arena geometry");
  if (!shms_py_at(self, 0, g.segment_bytes, 0)) return NULL;
  shms_arena_init(self->base, &g, n_slots, client_id, gen);
  Py_RETURN_NONE;
}

/* init_server(max_clients, slots_per_client, n_models, n_workers): the header. */
static PyObject *m_init_server(Mapping *self, PyObject *args) {
  unsigned int clients, slots, models, workers;
  if (!PyArg_ParseTuple(args, "IIII", &clients, &slots, &models, &workers)) return NULL;
  shms_server_header h = {0};
  shms_server_init(&h, clients, slots, models, workers);
  shms_server_header *dst = (shms_server_header *)shms_py_at(self, 0, h.segment_bytes, 64);
  if (!dst) return NULL;
  shms_server_init(dst, clients, slots, models, workers);
  Py_RETURN_NONE;
}

/* write_client_entry(off, generation, pid, uid, segment_bytes, path): a new lease,
 * published ALIVE last. SYNC POINT: the seq_cst store of ALIVE pairs with the
 * batcher's and workers' loads of the state (lease_of) before they read the rest. */
static PyObject *m_write_client_entry(Mapping *self, PyObject *args) {
  unsigned long long off, bytes;
  unsigned int gen, pid, uid;
  const char *path;
  if (!PyArg_ParseTuple(args, "KIIIKs", &off, &gen, &pid, &uid, &bytes, &path)) return NULL;
  shms_client_entry *e = (shms_client_entry *)shms_py_at(self, off, sizeof *e, 8);
  if (!e) return NULL;
  if (strlen(path) >= sizeof e->segment) return PyErr_Format(PyExc_ValueError, "path too long");
  e->pid = pid;
  e->uid = uid;
  e->segment_bytes = bytes;
  snprintf(e->segment, sizeof e->segment, "%s", path);
  shms_store(&e->ring_pos, 0, memory_order_relaxed); /* the new arena's ring starts at 0 */
  /* The batcher and workers load the generation at any time (lease_of): an atomic
   * store, though only the ALIVE store below publishes it. */
  __atomic_store_n(&e->generation, gen, __ATOMIC_RELAXED);
  shms_store(&e->state, (uint32_t)SHMS_CLIENT_ALIVE, memory_order_seq_cst);
  Py_RETURN_NONE;
}

/* read_client_entry(off) -> (state, generation, segment_bytes, path). */
static PyObject *m_read_client_entry(Mapping *self, PyObject *arg) {
  shms_client_entry *e =
      (shms_client_entry *)shms_py_at(self, PyLong_AsUnsignedLongLong(arg), sizeof *e, 8);
  if (!e) return NULL;
  char path[SHMS_NAME_BYTES];
  shms_copy_name(path, sizeof path, e->segment, sizeof e->segment);
  return Py_BuildValue("(IIKs)", shms_load(&e->state, memory_order_seq_cst), e->generation,
                       (unsigned long long)e->segment_bytes, path);
}

static int parse_specs(PyObject *list, shms_tensor_spec *specs, uint32_t *n) {
  PyObject *seq = PySequence_Fast(list, "tensor specs must be a sequence");
  if (!seq) return -1;
  Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
  if (count > SHMS_MAX_TENSORS) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError, "%zd tensors (limit %d)", count, SHMS_MAX_TENSORS);
    return -1;
  }
  for (Py_ssize_t i = 0; i < count; i++) {
    const char *name;
    unsigned int dtype;
    PyObject *dims;
    shms_tensor_ref shape = {0};
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sIO", &name, &dtype, &dims) ||
        parse_shape(dims, &shape) < 0) {
      Py_DECREF(seq);
      return -1;
    }
    shms_tensor_spec *s = &specs[i];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    s->dtype = dtype;
    s->ndim = shape.ndim;
    memcpy(s->dims, shape.shape, sizeof s->dims);
  }
  *n = (uint32_t)count;
  Py_DECREF(seq);
  return 0;
}

/* write_model_entry(off, name, version, max_batch_size, inputs, outputs[, optional,
 * ragged, device_memory]); inputs and outputs are [(name, dtype, dims)], dims without the batch
 * dimension; optional: bit k set when input k may be left out of a request; ragged:
 * bit k set when input k batches whatever its dims. Not ready. */
static PyObject *m_write_model_entry(Mapping *self, PyObject *args) {
  unsigned long long off;
  const char *name;
  long long version;
  unsigned int max_batch, optional = 0, ragged = 0, device_memory = 0;
  PyObject *inputs, *outputs;
  if (!PyArg_ParseTuple(args, "KsLIOO|III", &off, &name, &version, &max_batch, &inputs, &outputs,
                        &optional, &ragged, &device_memory))
    return NULL;
  shms_model_entry *m = (shms_model_entry *)shms_py_at(self, off, sizeof *m, 8);
  if (!m) return NULL;
  snprintf(m->name, sizeof m->name, "%s", name);
  m->version = version;
  m->max_batch_size = max_batch;
  if (parse_specs(inputs, m->inputs, &m->n_inputs) < 0 ||
      parse_specs(outputs, m->outputs, &m->n_outputs) < 0)
    return NULL;
  m->optional_inputs = optional & ((m->n_inputs < 32 ? 1u << m->n_inputs : 0u) - 1u);
  m->ragged_inputs = ragged & ((m->n_inputs < 32 ? 1u << m->n_inputs : 0u) - 1u);
  m->device_memory = device_memory != 0;
  Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- client side */

/* Client: write_request(slot_off, generation, model_id, inputs, outputs[, flags,
 * priority, timeout_us, parameters_offset, parameters_bytes, sequence_id,
 * sequence_id_offset, sequence_id_bytes]) fills a
 * FREE slot in place and publishes it SUBMITTED (shms_slot_begin/submit). The caller
 * pushes the ring entry afterwards (push_request). */
static PyObject *m_write_request(Mapping *self, PyObject *args) {
  unsigned long long off, timeout_us = 0, params_off = 0, sequence_id = 0, sid_off = 0;
  unsigned int gen, model_id, flags = 0, priority = 0, params_bytes = 0, sid_bytes = 0;
  PyObject *inputs, *outputs;
  if (!PyArg_ParseTuple(args, "KIIOO|IIKKIKKI", &off, &gen, &model_id, &inputs, &outputs, &flags,
                        &priority, &timeout_us, &params_off, &params_bytes, &sequence_id,
                        &sid_off, &sid_bytes))
    return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s) return NULL;
  shms_request *r = shms_slot_begin(s);
  r->flags = flags;
  r->priority = priority;
  r->timeout_us = timeout_us;
  r->parameters_offset = params_off;
  r->parameters_bytes = params_bytes;
  r->sequence_id = sequence_id;
  r->sequence_id_offset = sid_off;
  r->sequence_id_bytes = sid_bytes;
  int ni = parse_refs(inputs, r->inputs);
  if (ni < 0) return NULL;
  int no = parse_refs(outputs, r->outputs);
  if (no < 0) return NULL;
  r->model_id = model_id;
  r->n_inputs = (uint32_t)ni;
  r->n_outputs = (uint32_t)no;
  shms_slot_submit(s, gen);
  Py_RETURN_NONE;
}

/* lease_alive callback of push_request, called without the GIL: takes it, calls the
 * Python check, which raises if the lease or the server ended (the exception then
 * propagates from push_request). */
static int call_lease_alive(void *callable) {
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject *r = PyObject_CallNoArgs((PyObject *)callable);
  Py_XDECREF(r);
  PyGILState_Release(g);
  return r != NULL;
}

/* Client, on its arena's mapping: push_request(ring_offset, capacity, control, bell,
 * owner, slot, generation, check) -> shms_ring_result (shms_push_request's retries);
 * control and bell: the lease's Mappings of those segments; check() is called now
 * and then while the claim keeps being skipped and raises if the lease ended. */
static PyObject *m_push_request(Mapping *self, PyObject *args) {
  unsigned long long off, cap;
  unsigned int owner, slot, gen;
  Mapping *control, *bell;
  PyObject *check;
  if (!PyArg_ParseTuple(args, "KKO!O!IIIO", &off, &cap, &MappingType, &control, &MappingType,
                        &bell, &owner, &slot, &gen, &check))
    return NULL;
  shms_submitter sub;
  if (!shms_py_writable(self) || !shms_py_writable(bell) ||
      shms_py_ring_view(self, off, cap, &sub.ring) < 0 ||
      !shms_py_at(control, 0, sizeof(shms_control), 64) ||
      !shms_py_at(bell, 0, sizeof(shms_bell), 64))
    return NULL;
  shms_submitter_bells(&sub, control->base, bell->base, self->base);
  int rc;
  /* Retries sleep (a full ring): other threads of the caller go on meanwhile. */
  shms_py_enter(self);
  shms_py_enter(control);
  shms_py_enter(bell);
  Py_BEGIN_ALLOW_THREADS rc = shms_push_request(&sub, owner, slot, gen, call_lease_alive, check);
  Py_END_ALLOW_THREADS
  shms_py_leave(bell);
  shms_py_leave(control);
  shms_py_leave(self);
  if (rc < 0) return NULL; /* check() raised */
  return PyLong_FromLong(rc);
}

/* Client: withdraw(slot_off) -> True if a SUBMITTED slot whose push failed is FREE
 * again, False if the batcher took it meanwhile (it will be answered). */
static PyObject *m_withdraw(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  return PyBool_FromLong(shms_slot_withdraw(s));
}

/* Client: is_done(slot_off) -> True once the slot is DONE (acquire). */
static PyObject *m_is_done(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  return PyBool_FromLong(shms_slot_is_done(s));
}

/* Client: read_result(slot_off) -> None if not DONE, else (status, error, results,
 * t_ns tuple), and the slot goes back to FREE (shms_slot_release). */
static PyObject *m_read_result(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  shms_answer a;
  if (!shms_slot_read_answer(s, &a)) Py_RETURN_NONE;
  PyObject *msg = PyUnicode_DecodeUTF8(a.error, (Py_ssize_t)strlen(a.error), "replace");
  PyObject *results = shms_py_refs_list(a.results, a.n_results);
  PyObject *ts = PyTuple_New(SHMS_T_COUNT);
  for (int i = 0; ts && i < SHMS_T_COUNT; i++)
    PyTuple_SET_ITEM(ts, i, PyLong_FromUnsignedLongLong(a.t_ns[i]));
  if (!msg || !results || !ts) {
    Py_XDECREF(msg);
    Py_XDECREF(results);
    Py_XDECREF(ts);
    return NULL;
  }
  PyObject *answer = Py_BuildValue("(iNNN)", a.status, msg, results, ts);
  if (answer) shms_slot_release(s); /* only once the answer is in hand */
  return answer;
}

/* ---------------------------------------------------------------- server side */

/* Batcher, on an arena mapping: take(slot_off, slot_index, generation, client_id,
 * lease, server, shadow_off, models_off, n_models, data_begin[, honoured]) claims the
 * slot's request into the shadow at shadow_off (server mapping) and validates the copy
 * (shms_take_request). honoured: n_models native u32 (bytes), a withdrawn handle by
 * model index that is still accepted (a restarted batcher's recovered requests of a
 * draining model), or None.
 * -> (model_id, batch_rows, shape_key, priority, timeout_us, parameters_offset,
 *     parameters_bytes, flags, sequence_id, sequence_id_offset, sequence_id_bytes) on
 *     success (the server copy's options),
 *    (status, message) when invalid (the caller answers the client),
 *    None when the slot was not SUBMITTED with that generation (stale entry). */
static PyObject *m_take(Mapping *arena, PyObject *args) {
  Mapping *server;
  unsigned long long slot_off, shadow_off, models_off, data_begin;
  unsigned int gen, n_models, client_id, slot_index, lease;
  Py_buffer honoured = {0};
  if (!PyArg_ParseTuple(args, "KIIIIO!KKIK|z*", &slot_off, &slot_index, &gen, &client_id, &lease,
                        &MappingType, &server, &shadow_off, &models_off, &n_models, &data_begin,
                        &honoured))
    return NULL;
  if (honoured.buf && honoured.len != (Py_ssize_t)((uint64_t)n_models * sizeof(uint32_t))) {
    PyBuffer_Release(&honoured);
    PyErr_SetString(PyExc_ValueError, "take: honoured must hold one u32 per model");
    return NULL;
  }
  shms_slot *s = arena_of(arena) ? slot_at(arena, slot_off) : NULL;
  shms_shadow *sh = s ? (shms_shadow *)shms_py_at(server, shadow_off, sizeof(shms_shadow), 8)
                      : NULL;
  shms_model_entry *models = sh ? (shms_model_entry *)shms_py_at(
      server, models_off, (uint64_t)n_models * sizeof(shms_model_entry), 8) : NULL;
  if (!s || !sh || !models) {
    PyBuffer_Release(&honoured);
    return NULL;
  }
  char err[SHMS_ERROR_BYTES];
  int st = shms_take_request(s, gen, sh, client_id, slot_index, lease, models, n_models,
                             data_begin, arena->size, (const uint32_t *)honoured.buf, err,
                             sizeof err);
  PyBuffer_Release(&honoured);
  if (st == SHMS_TAKE_STALE) Py_RETURN_NONE;
  if (st != SHMS_OK) return Py_BuildValue("(is)", st, err);
  int64_t key[SHMS_SHAPE_KEY_MAX];
  size_t nk = shms_shape_key(&sh->request, &models[sh->request.model_id], key);
  const shms_request *r = &sh->request;
  return Py_BuildValue("(IIy#IKKIIKKI)", r->model_id, sh->batch_rows, (const char *)key,
                       (Py_ssize_t)(nk * sizeof(int64_t)), r->priority,
                       (unsigned long long)r->timeout_us, (unsigned long long)r->parameters_offset,
                       r->parameters_bytes, r->flags, (unsigned long long)r->sequence_id,
                       (unsigned long long)r->sequence_id_offset, r->sequence_id_bytes);
}

/* read_shadow(off) -> (client_id, slot, generation, lease, batch_rows, inputs, outputs,
 * taken_ns, parameters_offset, parameters_bytes, flags, sequence_id, sequence_id_offset,
 * sequence_id_bytes, sequence_slot) from a validated shms_shadow in the server segment. */
static PyObject *m_read_shadow(Mapping *self, PyObject *arg) {
  shms_shadow *sh =
      (shms_shadow *)shms_py_at(self, PyLong_AsUnsignedLongLong(arg), sizeof(shms_shadow), 8);
  if (!sh) return NULL;
  const shms_request *r = &sh->request;
  return Py_BuildValue("(IIIIINNKKIIKKII)", sh->client_id, sh->slot, sh->generation, sh->lease,
                       sh->batch_rows, shms_py_refs_list(r->inputs, r->n_inputs),
                       shms_py_refs_list(r->outputs, r->n_outputs), (unsigned long long)sh->taken_ns,
                       (unsigned long long)r->parameters_offset, r->parameters_bytes, r->flags,
                       (unsigned long long)r->sequence_id, (unsigned long long)r->sequence_id_offset,
                       r->sequence_id_bytes, sh->sequence_slot);
}

/* stamp(slot_off, which): record a timestamp in a slot (server side). */
static PyObject *m_stamp(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int which;
  if (!PyArg_ParseTuple(args, "KI", &off, &which)) return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s) return NULL;
  if (which >= SHMS_T_COUNT) return PyErr_Format(PyExc_IndexError, "timestamp %u", which);
  s->t_ns[which] = shms_now_ns();
  Py_RETURN_NONE;
}

/* Worker: set_running(slot_off, generation, again=False) -> True if ours to run. */
static PyObject *m_set_running(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int gen;
  int again = 0;
  if (!PyArg_ParseTuple(args, "KI|p", &off, &gen, &again)) return NULL;
  shms_slot *s = slot_at(self, off);
  if (!s) return NULL;
  return PyBool_FromLong(shms_slot_set_running(s, gen, again));
}

/* Server: complete(slot_off, generation, status, error, results[, index, flags]) on an
 * arena mapping -> True if the client was answered (shms_slot_complete_x): the final
 * response; index and flags (RESPONSE_EMPTY) for a STREAM request. */
static PyObject *m_complete(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int gen, index = 0, flags = 0;
  int status;
  const char *msg;
  PyObject *results;
  if (!PyArg_ParseTuple(args, "KIisO|II", &off, &gen, &status, &msg, &results, &index, &flags))
    return NULL;
  shms_arena_header *h = arena_of(self);
  shms_slot *s = slot_at(self, off);
  if (!h || !s) return NULL;
  shms_tensor_ref refs[SHMS_MAX_TENSORS];
  int n = parse_refs(results, refs);
  if (n < 0) return NULL;
  return PyBool_FromLong(
      shms_slot_complete_x(s, h, gen, status, msg, refs, (uint32_t)n, index, flags));
}

/* Worker, STREAM: respond(slot_off, generation, status, error, results, index) -> True
 * if response `index` was published (RUNNING -> RESPONSE, shms_slot_respond); False if
 * the slot is not RUNNING with that generation (not handed back yet, or gone). */
static PyObject *m_respond(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int gen, index;
  int status;
  const char *msg;
  PyObject *results;
  if (!PyArg_ParseTuple(args, "KIisOI", &off, &gen, &status, &msg, &results, &index))
    return NULL;
  shms_arena_header *h = arena_of(self);
  shms_slot *s = slot_at(self, off);
  if (!h || !s) return NULL;
  shms_tensor_ref refs[SHMS_MAX_TENSORS];
  int n = parse_refs(results, refs);
  if (n < 0) return NULL;
  return PyBool_FromLong(shms_slot_respond(s, h, gen, status, msg, refs, (uint32_t)n, index));
}

/* Client, STREAM: read_response(slot_off) -> None unless the slot holds a RESPONSE, else
 * (status, error, results, t_ns tuple, index); hand_back(slot_off) after copying the
 * outputs out. */
static PyObject *m_read_response(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  shms_answer a;
  if (!shms_slot_read_response(s, &a)) Py_RETURN_NONE;
  PyObject *ts = PyTuple_New(SHMS_T_COUNT);
  for (int i = 0; ts && i < SHMS_T_COUNT; i++)
    PyTuple_SET_ITEM(ts, i, PyLong_FromUnsignedLongLong(a.t_ns[i]));
  if (!ts) return NULL;
  return Py_BuildValue("(iNNNI)", a.status,
                       PyUnicode_DecodeUTF8(a.error, (Py_ssize_t)strlen(a.error), "replace"),
                       shms_py_refs_list(a.results, a.n_results), ts, a.response_index);
}

/* Client, STREAM: hand_back(slot_off) -> True if a RESPONSE went back to RUNNING. */
static PyObject *m_hand_back(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  return PyBool_FromLong(shms_slot_hand_back(s));
}

/* Client, STREAM: cancel(slot_off) asks the model to stop (shms_slot_cancel). */
static PyObject *m_cancel(Mapping *self, PyObject *arg) {
  shms_slot *s = slot_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!s) return NULL;
  shms_slot_cancel(s);
  Py_RETURN_NONE;
}

static shms_mailbox *mailbox_at(Mapping *self, unsigned long long off) {
  return (shms_mailbox *)shms_py_at(self, off, sizeof(shms_mailbox), 8);
}

/* Batcher: mailbox_assign(mailbox_off, [shadow index...]) hands a batch over. */
static PyObject *m_mailbox_assign(Mapping *self, PyObject *args) {
  unsigned long long off;
  PyObject *list;
  if (!PyArg_ParseTuple(args, "KO", &off, &list)) return NULL;
  shms_mailbox *mb = mailbox_at(self, off);
  PyObject *seq = mb ? PySequence_Fast(list, "shadow indices must be a sequence") : NULL;
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  uint32_t shadows[SHMS_MAX_BATCH_REQUESTS];
  if (n < 1 || n > SHMS_MAX_BATCH_REQUESTS) {
    Py_DECREF(seq);
    return PyErr_Format(PyExc_ValueError, "a batch holds 1..%d requests, not %zd",
                        SHMS_MAX_BATCH_REQUESTS, n);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
    if (PyErr_Occurred() || v > UINT32_MAX) {
      Py_DECREF(seq);
      return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_OverflowError, "shadow index %lu", v);
    }
    shadows[i] = (uint32_t)v;
  }
  Py_DECREF(seq);
  shms_mailbox_assign(mb, shadows, (uint32_t)n);
  Py_RETURN_NONE;
}

/* Worker: mailbox_batch(mailbox_off) -> [shadow index...] of the batch it holds. */
static PyObject *m_mailbox_batch(Mapping *self, PyObject *arg) {
  shms_mailbox *mb = mailbox_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!mb) return NULL;
  const uint32_t *shadows;
  uint32_t n = shms_mailbox_batch(mb, &shadows);
  PyObject *out = PyList_New(n);
  for (uint32_t i = 0; out && i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromUnsignedLong(shadows[i]));
  return out;
}

/* Worker: mailbox_finish(mailbox_off) -> True when the next batch waiting became the
 * mailbox's batch (run it now), False when the mailbox went IDLE. */
static PyObject *m_mailbox_finish(Mapping *self, PyObject *arg) {
  shms_mailbox *mb = mailbox_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!mb) return NULL;
  int promoted;
  Py_BEGIN_ALLOW_THREADS /* it may yield while the batcher appends */
  promoted = shms_mailbox_finish(mb);
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(promoted);
}

/* Batcher's recovery: mailbox_next(mailbox_off) -> [shadow index...] of the next batch
 * a mailbox holds ([] when none), after repairing an append its predecessor died in
 * (EDITING -> ASSIGNED_NEXT: next_n counts only the requests it finished adding). */
static PyObject *m_mailbox_next(Mapping *self, PyObject *arg) {
  shms_mailbox *mb = mailbox_at(self, PyLong_AsUnsignedLongLong(arg));
  if (!mb) return NULL;
  uint32_t editing = SHMS_MAILBOX_EDITING;
  shms_cas(&mb->state, &editing, (uint32_t)SHMS_MAILBOX_ASSIGNED_NEXT);
  uint32_t state = shms_load(&mb->state, memory_order_seq_cst);
  uint32_t n = state == SHMS_MAILBOX_ASSIGNED_NEXT || state == SHMS_MAILBOX_PROMOTING
                   ? (mb->next_n < SHMS_MAX_BATCH_REQUESTS ? mb->next_n : SHMS_MAX_BATCH_REQUESTS)
                   : 0;
  PyObject *out = PyList_New(n);
  for (uint32_t i = 0; out && i < n; i++)
    PyList_SET_ITEM(out, i, PyLong_FromUnsignedLong(mb->next_shadow[i]));
  return out;
}

PyMethodDef shms_py_slot_methods[] = {
    {"check_header", (PyCFunction)m_check_header, METH_O,
     "Raise ValueError unless this is a 'control', 'arena' or 'server' segment of this version."},
    {"init_control", (PyCFunction)m_init_control, METH_VARARGS, "Coordinator: a fresh control block."},
    {"init_arena", (PyCFunction)m_init_arena, METH_VARARGS, "Coordinator: a fresh arena header."},
    {"init_server", (PyCFunction)m_init_server, METH_VARARGS, "Coordinator: the server header."},
    {"write_client_entry", (PyCFunction)m_write_client_entry, METH_VARARGS,
     "Coordinator: open a lease in the client table."},
    {"read_client_entry", (PyCFunction)m_read_client_entry, METH_O,
     "(state, generation, segment_bytes, path) of a client table entry."},
    {"write_model_entry", (PyCFunction)m_write_model_entry, METH_VARARGS,
     "Coordinator: a model table entry."},
    {"write_request", (PyCFunction)m_write_request, METH_VARARGS, "Client: fill and submit a slot."},
    {"push_request", (PyCFunction)m_push_request, METH_VARARGS,
     "Client: push a slot's ring entry with the protocol's retries."},
    {"withdraw", (PyCFunction)m_withdraw, METH_O, "Client: take back a slot whose push failed."},
    {"is_done", (PyCFunction)m_is_done, METH_O, "Client: is the slot DONE."},
    {"read_result", (PyCFunction)m_read_result, METH_O, "Client: read a DONE slot and free it."},
    {"take", (PyCFunction)m_take, METH_VARARGS, "Batcher: claim, copy and validate."},
    {"read_shadow", (PyCFunction)m_read_shadow, METH_O, "Decode a validated request copy."},
    {"stamp", (PyCFunction)m_stamp, METH_VARARGS, "Record a timestamp in a slot."},
    {"set_running", (PyCFunction)m_set_running, METH_VARARGS,
     "Worker: QUEUED -> RUNNING (RUNNING again when re-running a dead worker's batch)."},
    {"complete", (PyCFunction)m_complete, METH_VARARGS, "Server: answer a slot."},
    {"respond", (PyCFunction)m_respond, METH_VARARGS, "Worker: publish one response of a stream."},
    {"read_response", (PyCFunction)m_read_response, METH_O, "Client: a stream's RESPONSE, or None."},
    {"hand_back", (PyCFunction)m_hand_back, METH_O, "Client: RESPONSE read, back to RUNNING."},
    {"cancel", (PyCFunction)m_cancel, METH_O, "Client: ask a stream's model to stop."},
    {"mailbox_assign", (PyCFunction)m_mailbox_assign, METH_VARARGS, "Batcher: hand a batch over."},
    {"mailbox_batch", (PyCFunction)m_mailbox_batch, METH_O, "Worker: the batch in a mailbox."},
    {"mailbox_finish", (PyCFunction)m_mailbox_finish, METH_O,
     "Worker: batch done; True when the next batch waiting is now the mailbox's."},
    {"mailbox_next", (PyCFunction)m_mailbox_next, METH_O,
     "Batcher's recovery: the next batch a mailbox holds (repairs a dead batcher's append)."},
    {NULL}};
