/*
 * core.h — private to the Python extension shmserve._core (core.c, mapping.c,
 * slots.c, stats.c): the Mapping type every segment is operated through, and its helpers.
 * The protocol itself is in shmserve.h; these files only translate it to Python.
 */
#ifndef SHMS_CORE_H
#define SHMS_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

#endif /* SHMS_CORE_H */
