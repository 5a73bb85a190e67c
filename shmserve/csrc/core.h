/*
 * core.h — private to the Python extension shmserve._core (core.c, mapping.c, slots.c,
 * stats.c, arena.c, client.c, client_call.c, batch.c, batcher.c, pb_types.c): the Mapping type
 * every segment is operated through, a client's arena allocator and blocks, the client's
 * C core, and their helpers. The protocol itself is in shmserve.h; these files only
 * translate it to Python (client_call.c runs a whole request with its procedures).
 */
#ifndef SHMS_CORE_H
#define SHMS_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "shmserve.h"

/* A writable buffer (an mmap of a segment) and the protocol operations on it. Every
 * offset that comes from Python is bounds-checked (shms_py_at): a wrong offset raises,
 * it never touches memory. */
typedef struct {
  PyObject_HEAD
  Py_buffer view;
  char *base;
  uint64_t size;
  int in_use;          /* calls running on the memory without the GIL */
  int release_pending; /* release() came while in_use: done by the last of them */
} Mapping;

/* Around a call that uses the mapping's memory with the GIL released (a futex wait, a
 * push with retries, a large copy): a release() meanwhile (another thread closing the
 * client) is deferred until the call is out, so the memory is never unmapped under it. */
void shms_py_enter(Mapping *m);
void shms_py_leave(Mapping *m);

extern PyTypeObject MappingType;

/* shmserve._core.AdaptiveSpin: a waiter's shms_spin (core.c) */
typedef struct {
  PyObject_HEAD
  shms_spin spin;
  Mapping *watched; /* holds spin.crowded, kept mapped while watched (AdaptiveSpin.watch) */
} Spin;
extern PyTypeObject SpinType;
extern PyTypeObject *TensorRefType; /* shmserve._core.TensorRef, a named tuple */

/* Pointer to [off, off+len) inside the mapping, aligned to `align`, or NULL with an
 * exception set. */
void *shms_py_at(Mapping *m, unsigned long long off, uint64_t len, uint64_t align);

/* The ring view of a control mapping from the (offset, capacity) fixed at attach:
 * capacity a power of two up to 2^30, cells inside the mapping; or -1, exception set. */
int shms_py_ring_view(Mapping *self, unsigned long long off, unsigned long long cap,
                      shms_ring *r);

extern PyMethodDef shms_py_mapping_methods[]; /* mapping.c: atomics, doorbells, ring, bytes */
extern PyMethodDef shms_py_slot_methods[];    /* slots.c: headers, requests, slots, mailboxes */
extern PyMethodDef shms_py_stats_methods[];   /* stats.c: a model's statistics */

int shms_py_add_tensor_ref(PyObject *module);

/* slots.c: results as a list of TensorRefs (at most SHMS_MAX_TENSORS). */
PyObject *shms_py_refs_list(const shms_tensor_ref *refs, uint32_t n);

/* ---------------------------------------------------------------- arena.c */

typedef struct {
  uint64_t start, size;
} shms_extent;

/* shmserve._core.ArenaAllocator: first fit over [begin, end), DATA_ALIGN units. */
typedef struct {
  PyObject_HEAD
  uint64_t begin, end, used;
  shms_extent *free; /* free extents, sorted by start, never adjacent */
  size_t n_free, cap_free;
} ArenaAllocator;

/* A block of an arena as a buffer; gives the block back when released or freed. */
typedef struct {
  PyObject_HEAD
  ArenaAllocator *arena;
  Py_buffer mem; /* an export of the whole arena mapping: keeps it mapped */
  uint64_t offset, nbytes;
  int freed;
} ArenaBlock;

extern PyTypeObject ArenaAllocatorType, ArenaBlockType;
extern PyObject *shms_py_arena_full; /* shmserve._core.ArenaFull */

/* 0 and *offset, or -1 when no free block holds nbytes (no exception set). */
int shms_py_alloc(ArenaAllocator *a, uint64_t nbytes, uint64_t *offset);
void shms_py_free(ArenaAllocator *a, uint64_t offset, uint64_t nbytes);
/* An ArenaBlock owning [offset, +nbytes) of `mapping` (an object exporting the arena). */
PyObject *shms_py_block_new(ArenaAllocator *a, PyObject *mapping, uint64_t offset,
                            uint64_t nbytes);

/* ---------------------------------------------------------------- client.c */

extern PyTypeObject ClientCoreType;

/* ---------------------------------------------------------------- batch.c */

extern PyTypeObject BatchType; /* shmserve._core.Batch: a worker's batch in C */

/* ---------------------------------------------------------------- batcher.c */

extern PyTypeObject BatcherCoreType; /* shmserve._core.BatcherCore: the batcher's hot path */
int shms_py_batcher_ready(void); /* interned names; -1 with an exception */
int shms_py_client_ready(void); /* interned names; -1 with an exception */

/* ---------------------------------------------------------------- pb_types.c */

/* Triton's python model API's per-request objects (pb_utils.Tensor, InferenceRequest,
 * InferenceResponse) and the functions around them, as module functions pb_*. */
extern PyMethodDef shms_py_pb_methods[];
int shms_py_pb_ready(void); /* interned names and constants; -1 with an exception */

#endif /* SHMS_CORE_H */
