/*
 * core.h — private to the Python extension shmserve._core (core.c, mapping.c, slots.c,
 * stats.c, arena.c, client.c, client_call.c, batch.c, batcher.c, batch_queue.c, pb_types.c):
 * the Mapping type every segment is operated through, a client's arena allocator and
 * blocks, the client's C core, and their helpers. The protocol itself is in shmserve.h;
 * these files only translate it to Python (client_call.c runs a whole request with its
 * procedures).
 */
#ifndef SHMS_CORE_H
#define SHMS_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "shmserve.h"

/* A buffer (an mmap of a segment, writable unless readonly) and the protocol operations on it. Every
 * offset that comes from Python is bounds-checked (shms_py_at): a wrong offset raises,
 * it never touches memory. */
typedef struct {
  PyObject_HEAD
  Py_buffer view;
  char *base;
  uint64_t size;
  int readonly;        /* a read-only mapping (a client's control block): writes raise */
  int in_use;          /* calls running on the memory without the GIL */
  int release_pending; /* release() came while in_use: done by the last of them */
} Mapping;

/* Around a call that uses the mapping's memory with the GIL released (a futex wait, a
 * push with retries, a large copy): a release() meanwhile (another thread closing the
 * client) is deferred until the call is out, so the memory is never unmapped under it. */
void shms_py_enter(Mapping *m);
void shms_py_leave(Mapping *m);

/* A new nonzero token for the batcher's next sleep on bell.doorbell, never the last
 * one, and counting from anywhere (shms_doorbell_wait_x, shms_doorbell_ring_sole,
 * shms_doorbell_ring_client). */
uint32_t shms_py_sleep_token(void);

extern PyTypeObject MappingType;

/* shmserve._core.AdaptiveSpin: a waiter's shms_spin (core.c) */
typedef struct {
  PyObject_HEAD
  shms_spin spin;
  Mapping *watched; /* holds spin.crowded, kept mapped while watched (AdaptiveSpin.watch) */
} Spin;
extern PyTypeObject SpinType;
extern PyTypeObject *TensorRefType; /* shmserve._core.TensorRef, a named tuple */

/* 1, or 0 with PermissionError for a read-only mapping (a write would fault). */
int shms_py_writable(Mapping *m);

/* Pointer to [off, off+len) inside the mapping, aligned to `align`, or NULL with an
 * exception set. */
void *shms_py_at(Mapping *m, unsigned long long off, uint64_t len, uint64_t align);

/* The submission ring of an arena mapping from the (offset, capacity) fixed once:
 * capacity a power of two up to 2^30, cells inside the mapping past the header; or
 * -1, exception set. */
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

/* ---------------------------------------------------------------- batch_queue.c */

/* A request's shape key (scheduling.Pending.key): inline when short, else a bytes. */
#define SHMS_BQ_KEY_INLINE 32
typedef struct {
  uint32_t len;
  uint8_t inline_bytes[SHMS_BQ_KEY_INLINE];
  PyObject *bytes; /* strong, when len > SHMS_BQ_KEY_INLINE */
} shms_bq_key;

/* One queued request: a Pending's fields, linked in its client's FIFO. */
typedef struct {
  int32_t next, prev; /* in its client's FIFO (-1: none); free items chain by next */
  uint32_t shadow, rows, generation, priority;
  int64_t client;
  uint64_t arrived_ns, slot_off, timeout_us;
  PyObject *seg;     /* its arena Segment (strong; None in unit tests) */
  PyObject *pending; /* its Pending once one exists (strong), else NULL */
  shms_bq_key key;
} shms_bq_item;

typedef struct {
  int64_t client;
  int32_t head, tail;
  uint32_t count;
} shms_bq_client;

/* shmserve._core.BatchQueue: a model's queue under the common policies, dynamic
 * batching or the default policy, with the plain queue policy (scheduling/core_queue.py):
 * clients in turns, Triton's batch rule. */
typedef struct {
  PyObject_HEAD
  PyObject *pending_type; /* scheduling.Pending */
  uint32_t max_rows, max_requests, max_queue_size, max_per_client, n_preferred;
  uint32_t preferred[SHMS_MAX_BATCH_REQUESTS]; /* sorted */
  uint64_t delay_ns;
  shms_bq_item *items;
  int32_t cap, free_head;
  uint32_t count;
  shms_bq_client *clients; /* with requests queued, in turn order */
  uint32_t n_clients, cap_clients;
  int32_t *order, *cursor; /* scratch: [cap], [cap_clients] */
} BatchQueue;
extern PyTypeObject BatchQueueType;
int shms_py_batch_queue_ready(void); /* interned names; -1 with an exception */
/* An unsigned int attribute (of a Pending): 0, or -1 with an exception. */
int shms_py_attr_u64(PyObject *o, PyObject *name, uint64_t *out);

#define SHMS_BQ_NO_DEADLINE UINT64_MAX
/* Whether one more request of this client fits (max_queue_size, max_per_client). */
int shms_bq_room(const BatchQueue *q, int64_t client);
/* Queues a request; the queue takes over the references in *it. -1: no memory (set). */
int shms_bq_push(BatchQueue *q, const shms_bq_item *it);
/* The next batch: its items' indices in out and their count, or 0 with *deadline (the
 * latest time to look again; SHMS_BQ_NO_DEADLINE when nothing can go before something
 * new happens). Nothing leaves the queue until shms_bq_take. */
int shms_bq_next(BatchQueue *q, uint64_t now, int32_t out[SHMS_MAX_BATCH_REQUESTS],
                 uint64_t *deadline);
/* The requests that may join a next batch of `n` requests, `rows` rows and this key. */
int shms_bq_join(BatchQueue *q, const shms_bq_key *key, uint32_t rows, uint32_t n,
                 int32_t out[SHMS_MAX_BATCH_REQUESTS]);
/* Removes the items picked (in pick order: each uses its client's turn). */
void shms_bq_take(BatchQueue *q, const int32_t *picked, int n);
int shms_bq_key_copy(shms_bq_key *dst, const shms_bq_key *src); /* dst empty */
void shms_bq_key_clear(shms_bq_key *k);
/* A key from raw bytes; -1: no memory (set). */
int shms_bq_key_set(shms_bq_key *k, const void *bytes, size_t len);
void shms_bq_item_clear(shms_bq_item *x); /* its references */
/* The item's scheduling.Pending, made once from its fields (kept in x->pending). New
 * reference, or NULL with an exception. */
PyObject *shms_bq_pending(PyObject *pending_type, shms_bq_item *x);
int shms_py_batcher_ready(void); /* interned names; -1 with an exception */
int shms_py_client_ready(void); /* interned names; -1 with an exception */

/* ---------------------------------------------------------------- pb_types.c */

/* Triton's python model API's per-request objects (pb_utils.Tensor, InferenceRequest,
 * InferenceResponse) and the functions around them, as module functions pb_*. */
extern PyMethodDef shms_py_pb_methods[];
int shms_py_pb_ready(void); /* interned names and constants; -1 with an exception */

#endif /* SHMS_CORE_H */
