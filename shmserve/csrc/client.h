/*
 * client.h — private to client.c (the lease: ClientCore, its slot table and plans) and
 * client_call.c (one request on the C path, and reading answers): their shared state.
 * Everything here runs with the GIL held, which is the lock of the slot table.
 */
#ifndef SHMS_CLIENT_H
#define SHMS_CLIENT_H

#include "core.h"

enum { SLOT_FREE, SLOT_BUSY, SLOT_ORPHAN };

typedef struct {
  uint32_t generation;
  uint8_t state;
  uint8_t has_future;
  PyObject *req;               /* SLOT_BUSY: the Python path's Request while in flight */
  uint64_t block, block_bytes; /* SLOT_ORPHAN: freed once the slot is DONE */
} client_slot;

/* What a request to one (model, version) needs, worked out once (ClientCore.compile). */
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
  Mapping *arena, *control, *bell;
  PyObject *arena_buffer; /* the arena's mmap: blocks export it (ArenaBlock) */
  ArenaAllocator *alloc;
  shms_submitter sub; /* its ring (in the arena) and the batcher's doorbell */
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
  unsigned long long inputs_copied, inputs_adopted; /* C path: copied in, used in place */
} ClientCore;

static inline shms_slot *slot_at(ClientCore *self, uint32_t i) {
  return (shms_slot *)(self->arena->base + self->slots_offset + (uint64_t)i * sizeof(shms_slot));
}

static inline shms_arena_header *arena_header(ClientCore *self) {
  return (shms_arena_header *)self->arena->base;
}

/* Shared memory is usable: the client is open and neither mapping was released. */
static inline int mapped(ClientCore *self) {
  return !self->closed && self->arena->base && self->control->base && self->bell->base;
}

static inline int need_mapped(ClientCore *self) {
  if (mapped(self)) return 0;
  PyErr_SetString(self->dead_error, "client is closed");
  return -1;
}

static inline void enter(ClientCore *self) {
  shms_py_enter(self->arena);
  shms_py_enter(self->control);
  shms_py_enter(self->bell);
}

static inline void leave(ClientCore *self) {
  shms_py_leave(self->arena);
  shms_py_leave(self->control);
  shms_py_leave(self->bell);
}

/* client.c: the slot table. */
void shms_py_slot_put(ClientCore *self, uint32_t i);
void shms_py_slot_orphan(ClientCore *self, uint32_t i, uint64_t block, uint64_t block_bytes);
int shms_py_slot_take(ClientCore *self, uint32_t *out);
uint32_t shms_py_slot_generation(ClientCore *self, uint32_t i);
int shms_py_check_slot(ClientCore *self, unsigned int slot, int state);
int shms_py_reap(ClientCore *self);

/* client_call.c: ClientCore's infer(), send() and finish(); its interned names. */
int shms_py_client_call_ready(void);
PyObject *shms_py_client_infer(ClientCore *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *shms_py_client_send(ClientCore *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *shms_py_client_finish(ClientCore *self, PyObject *const *args, Py_ssize_t nargs);

#endif /* SHMS_CLIENT_H */
