/*
 * shmserve.h — the shared-memory protocol of shmserve, version 2.
 *
 * This header is the single source of the layout, constants and memory ordering
 * of every structure shared between processes. The Python extension
 * (shmserve/csrc/core.c) and the C++ client (clients/cpp) both include it;
 * docs/protocol.md describes the same thing in prose.
 *
 * Rules followed by every structure here:
 *   - C layout, little-endian, naturally aligned; sizes and offsets are pinned by
 *     _Static_asserts at the bottom and checked again from Python (tests/test_layout.py).
 *   - Offsets, never pointers: every reference into a segment is a byte offset from
 *     the start of that segment.
 *   - Every field a client can write is validated by the server before use
 *     (shms_validate_request); the server copies a request before validating it so
 *     that a client cannot change it between the check and the use.
 *   - Atomics are 32- or 64-bit words. "SYNC POINT" comments name the partner of
 *     every release/acquire pair and every futex wait/wake pair.
 *
 * Segments (names in docs/protocol.md):
 *   control  (server creates; clients map read-write): shms_control + request ring.
 *   arena    (server creates, one per client lease; that client maps read-write):
 *            shms_arena_header + request slots + the client's tensor data. A memfd
 *            sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), sent
 *            with the hello reply (SCM_RIGHTS): no name, and no way to SIGBUS the server.
 *   server   (server-private; clients never receive its name): client table, model
 *            table, validated request copies, worker mailboxes.
 */
#ifndef SHMSERVE_H
#define SHMSERVE_H

/* futex and clock_gettime need POSIX/GNU declarations; include this header first
 * or build with -D_GNU_SOURCE. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE 1
#endif

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
#include <atomic>
#define SHMS_ATOMIC(T) std::atomic<T>
#define SHMS_ALIGNAS(n) alignas(n)
namespace shms_detail { using std::memory_order_relaxed; using std::memory_order_acquire;
  using std::memory_order_release; using std::memory_order_seq_cst; }
using namespace shms_detail;
#define shms_load(p, mo) (p)->load(mo)
#define shms_store(p, v, mo) (p)->store((v), mo)
#define shms_fetch_add(p, v, mo) (p)->fetch_add((v), mo)
#define shms_cas(p, expp, v) (p)->compare_exchange_strong(*(expp), (v), memory_order_seq_cst)
#else
#include <stdalign.h>
#include <stdatomic.h>
#define SHMS_ATOMIC(T) _Atomic T
#define SHMS_ALIGNAS(n) _Alignas(n)
#define shms_load(p, mo) atomic_load_explicit((p), mo)
#define shms_store(p, v, mo) atomic_store_explicit((p), (v), mo)
#define shms_fetch_add(p, v, mo) atomic_fetch_add_explicit((p), (v), mo)
#define shms_cas(p, expp, v) atomic_compare_exchange_strong((p), (expp), (v))
#endif

#ifdef __linux__
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

/* ---------------------------------------------------------------- constants */

#define SHMS_MAGIC_CONTROL 0x314c5443534d4853ULL /* "SHMSCTL1" little-endian */
#define SHMS_MAGIC_ARENA 0x314e5241534d4853ULL   /* "SHMSARN1" */
#define SHMS_MAGIC_SERVER 0x31565253534d4853ULL  /* "SHMSSRV1" */
#define SHMS_PROTOCOL_VERSION 2u

#define SHMS_MAX_TENSORS 16         /* inputs per request, and outputs per request */
#define SHMS_MAX_DIMS 8             /* rank of a tensor, batch dimension included */
#define SHMS_ERROR_BYTES 256        /* NUL-terminated UTF-8 error message */
#define SHMS_NAME_BYTES 64          /* NUL-terminated model / tensor / segment name */
#define SHMS_MAX_BATCH_REQUESTS 256 /* requests in one batch handed to a worker */
#define SHMS_DATA_ALIGN 64          /* tensor data offsets are multiples of this */

/* Data types: the numbers of Triton's DataType enum (model_config.proto). */
enum shms_dtype {
  SHMS_TYPE_INVALID = 0, SHMS_TYPE_BOOL = 1, SHMS_TYPE_UINT8 = 2, SHMS_TYPE_UINT16 = 3,
  SHMS_TYPE_UINT32 = 4, SHMS_TYPE_UINT64 = 5, SHMS_TYPE_INT8 = 6, SHMS_TYPE_INT16 = 7,
  SHMS_TYPE_INT32 = 8, SHMS_TYPE_INT64 = 9, SHMS_TYPE_FP16 = 10, SHMS_TYPE_FP32 = 11,
  SHMS_TYPE_FP64 = 12, SHMS_TYPE_BYTES = 13, SHMS_TYPE_BF16 = 14, SHMS_TYPE_COUNT = 15
};

/* Element size in bytes; 0 for BYTES (variable: 4-byte little-endian length + bytes
 * per element) and for invalid codes. */
static inline uint32_t shms_dtype_size(uint32_t dtype) {
  static const uint8_t sizes[SHMS_TYPE_COUNT] = {0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 0, 2};
  return dtype < SHMS_TYPE_COUNT ? sizes[dtype] : 0;
}

static inline const char *shms_dtype_name(uint32_t dtype) {
  static const char *names[SHMS_TYPE_COUNT] = {"INVALID", "BOOL", "UINT8", "UINT16", "UINT32",
                                               "UINT64", "INT8", "INT16", "INT32", "INT64",
                                               "FP16", "FP32", "FP64", "BYTES", "BF16"};
  return dtype < SHMS_TYPE_COUNT ? names[dtype] : "INVALID";
}

/* Request status, written by the server into shms_slot.status. */
enum shms_status {
  SHMS_OK = 0,
  SHMS_ERR_INVALID_ARG = 1,      /* bad tensor name/dtype/shape/size in the request */
  SHMS_ERR_NOT_FOUND = 2,        /* unknown model id or version */
  SHMS_ERR_UNAVAILABLE = 3,      /* model not ready, worker died */
  SHMS_ERR_OUTPUT_TOO_SMALL = 4, /* an output did not fit; results[i].nbytes = needed */
  SHMS_ERR_INTERNAL = 5,         /* the model raised or the server failed */
  SHMS_ERR_BUSY = 6,             /* queue full: retry later */
  SHMS_ERR_BAD_DESCRIPTOR = 7    /* malformed descriptor (offsets, counts, state) */
};

/* Request slot states. Owner of each transition in brackets. */
enum shms_slot_state {
  SHMS_SLOT_FREE = 0,      /* [client] may be filled                            */
  SHMS_SLOT_SUBMITTED = 1, /* [client] request written, index pushed on the ring */
  SHMS_SLOT_QUEUED = 2,    /* [batcher] validated and copied, waiting in a queue */
  SHMS_SLOT_RUNNING = 3,   /* [worker] in a batch being executed                 */
  SHMS_SLOT_DONE = 4       /* [worker or batcher] status and results are final   */
};

/* Timestamps recorded in shms_slot.t_ns (CLOCK_MONOTONIC, nanoseconds). */
enum shms_timestamp {
  SHMS_T_CLIENT_WRITE = 0, /* client starts writing the request */
  SHMS_T_ENQUEUE = 1,      /* client pushed it on the ring */
  SHMS_T_DEQUEUE = 2,      /* batcher took it from the ring */
  SHMS_T_BATCHED = 3,      /* batcher handed its batch to a worker */
  SHMS_T_COMPUTE_START = 4,
  SHMS_T_COMPUTE_END = 5,
  SHMS_T_COMPLETE = 6,     /* worker published DONE */
  SHMS_T_CLIENT_WAKE = 7,  /* client saw DONE */
  SHMS_T_COUNT = 8
};

/* ------------------------------------------------------------- tensors */

/* A tensor in the caller's arena. In a request's inputs: what the caller sends.
 * In a request's outputs: index + where the caller wants it (offset, nbytes =
 * capacity). In a slot's results: what the server wrote (dtype, shape, nbytes). */
typedef struct shms_tensor_ref {
  uint32_t index; /* position in the model's input (or output) list */
  uint32_t dtype; /* enum shms_dtype */
  uint32_t ndim;  /* 0..SHMS_MAX_DIMS */
  uint32_t reserved;
  uint64_t offset; /* from the start of the arena segment, SHMS_DATA_ALIGN-aligned */
  uint64_t nbytes;
  int64_t shape[SHMS_MAX_DIMS];
} shms_tensor_ref;

/* What a client asks for. Written by the client while the slot is FREE. */
typedef struct shms_request {
  uint32_t model_id; /* index in the server's model table (from the control socket) */
  uint32_t n_inputs;
  uint32_t n_outputs; /* outputs wanted, 1..SHMS_MAX_TENSORS */
  uint32_t flags;     /* reserved, 0 */
  uint64_t client_tag; /* opaque to the server */
  uint64_t reserved;
  shms_tensor_ref inputs[SHMS_MAX_TENSORS];
  shms_tensor_ref outputs[SHMS_MAX_TENSORS]; /* index, offset, nbytes (capacity) */
} shms_request;

/* ------------------------------------------------------------- control segment */

/* One ring cell. seq is the Vyukov sequence word extended with a claim state:
 *   seq == pos                 free for the producer of position pos
 *   seq == CLAIM(owner, pos)   claimed by client `owner`, payload being written
 *   seq == pos + 1             published: payload valid for the consumer
 *   seq == pos + capacity      consumed: free for position pos + capacity */
typedef struct shms_ring_cell {
  SHMS_ATOMIC(uint64_t) seq;
  uint32_t client_id;
  uint32_t slot;
  uint32_t generation;
  uint32_t reserved;
  uint64_t reserved2;
} shms_ring_cell;

#define SHMS_CELL_CLAIMED (1ULL << 63)
static inline uint64_t shms_claim_word(uint32_t owner, uint64_t pos) {
  return SHMS_CELL_CLAIMED | ((uint64_t)(owner & 0x7fffffffu) << 32) | (pos & 0xffffffffu);
}

enum shms_server_state { SHMS_SERVER_STARTING = 0, SHMS_SERVER_READY = 1, SHMS_SERVER_STOPPED = 2 };

typedef struct shms_control {
  uint64_t magic; /* SHMS_MAGIC_CONTROL */
  uint32_t version; /* SHMS_PROTOCOL_VERSION */
  uint32_t header_bytes; /* sizeof(shms_control) */
  uint32_t ring_offset;  /* offset of the first shms_ring_cell */
  uint32_t ring_capacity; /* power of two */
  uint32_t server_pid;   /* coordinator's pid, for liveness checks */
  uint32_t reserved;
  uint64_t segment_bytes;
  SHMS_ATOMIC(uint32_t) server_state; /* enum shms_server_state */
  uint32_t reserved2;
  SHMS_ALIGNAS(64) SHMS_ATOMIC(uint64_t) enqueue_pos; /* producers (clients) */
  SHMS_ALIGNAS(64) SHMS_ATOMIC(uint64_t) dequeue_pos; /* the batcher only */
  SHMS_ALIGNAS(64) SHMS_ATOMIC(uint32_t) doorbell;    /* futex: batcher's wake-up word */
  SHMS_ATOMIC(uint32_t) batcher_sleeping;             /* nonzero while it may sleep */
  uint8_t pad[56];
} shms_control;

/* ------------------------------------------------------------- arena segment */

typedef struct shms_slot {
  SHMS_ATOMIC(uint32_t) state; /* enum shms_slot_state */
  uint32_t generation;         /* client bumps it for every new request in this slot */
  int32_t status;              /* enum shms_status, valid once DONE */
  uint32_t n_results;
  uint64_t t_ns[SHMS_T_COUNT];
  char error[SHMS_ERROR_BYTES];
  shms_request request;
  shms_tensor_ref results[SHMS_MAX_TENSORS];
  uint8_t pad[16];
} shms_slot;

typedef struct shms_arena_header {
  uint64_t magic; /* SHMS_MAGIC_ARENA */
  uint32_t version;
  uint32_t client_id;
  uint32_t generation; /* of this lease */
  uint32_t n_slots;
  uint64_t slots_offset;
  uint64_t data_offset; /* tensor data lives in [data_offset, segment_bytes) */
  uint64_t segment_bytes;
  uint8_t pad0[16];
  SHMS_ALIGNAS(64) SHMS_ATOMIC(uint32_t) completions; /* futex: bumped after each DONE */
  SHMS_ATOMIC(uint32_t) waiters; /* client threads that may sleep on completions */
  uint8_t pad[56];
} shms_arena_header;

/* ------------------------------------------------------------- server segment */

enum shms_client_state { SHMS_CLIENT_FREE = 0, SHMS_CLIENT_ALIVE = 1, SHMS_CLIENT_DEAD = 2 };

typedef struct shms_client_entry {
  SHMS_ATOMIC(uint32_t) state; /* enum shms_client_state; coordinator writes */
  uint32_t generation;         /* lease generation, bumped at every new lease */
  uint32_t pid;
  uint32_t uid;
  uint64_t segment_bytes;
  char segment[SHMS_NAME_BYTES]; /* how server processes open the arena: /proc/<coordinator>/fd/<memfd> */
} shms_client_entry;

typedef struct shms_tensor_spec {
  char name[SHMS_NAME_BYTES];
  uint32_t dtype;
  uint32_t ndim; /* without the batch dimension when max_batch_size > 0 */
  int64_t dims[SHMS_MAX_DIMS]; /* -1 = any size */
} shms_tensor_spec;

#define SHMS_BATCH_HIST 65 /* executions by number of requests: 1..64, 65+ in [64] */

typedef struct shms_model_entry {
  char name[SHMS_NAME_BYTES];
  int64_t version;
  uint32_t max_batch_size;
  uint32_t n_inputs;
  uint32_t n_outputs;
  SHMS_ATOMIC(uint32_t) ready; /* 1 once every instance has loaded */
  shms_tensor_spec inputs[SHMS_MAX_TENSORS];
  shms_tensor_spec outputs[SHMS_MAX_TENSORS];
  /* statistics, updated by workers and the batcher */
  SHMS_ATOMIC(uint64_t) request_success;
  SHMS_ATOMIC(uint64_t) request_failure;
  SHMS_ATOMIC(uint64_t) inference_count; /* rows: sum of batch dims */
  SHMS_ATOMIC(uint64_t) execution_count; /* model executions (batches) */
  SHMS_ATOMIC(uint64_t) compute_ns;
  SHMS_ATOMIC(uint64_t) queue_ns;
  SHMS_ATOMIC(uint64_t) batch_requests[SHMS_BATCH_HIST]; /* index n-1: batches of n requests */
} shms_model_entry;

/* A request as the batcher validated it, copied out of the client's reach. */
typedef struct shms_shadow {
  uint32_t client_id;
  uint32_t slot;
  uint32_t generation; /* the slot's request generation */
  uint32_t lease;      /* the client's lease generation (shms_client_entry.generation) */
  uint32_t batch_rows; /* first dimension of the inputs, 1 for unbatched models */
  uint32_t reserved;
  shms_request request;
} shms_shadow;

enum shms_mailbox_state { SHMS_MAILBOX_IDLE = 0, SHMS_MAILBOX_ASSIGNED = 1 };
/* shms_mailbox.pid of an instance the coordinator retired (it crash-looped). */
#define SHMS_MAILBOX_RETIRED 0xFFFFFFFFu

/* The batcher hands one batch at a time to each worker through its mailbox. */
typedef struct shms_mailbox {
  SHMS_ATOMIC(uint32_t) state; /* futex: IDLE <-> ASSIGNED */
  SHMS_ATOMIC(uint32_t) worker_sleeping;
  uint32_t model_id;
  uint32_t n;
  uint32_t pid; /* worker's pid, 0 until it started */
  SHMS_ATOMIC(uint32_t) batcher_waiting; /* batcher has work for this model: ring when idle */
  uint64_t batches_done;
  uint32_t attempt; /* 0 when handed over; 1 while a successor re-runs it (retry_on_worker_crash) */
  uint32_t reserved;
  uint32_t shadow[SHMS_MAX_BATCH_REQUESTS]; /* indices into the shadow table */
} shms_mailbox;

typedef struct shms_server_header {
  uint64_t magic; /* SHMS_MAGIC_SERVER */
  uint32_t version;
  uint32_t max_clients;
  uint32_t slots_per_client;
  uint32_t n_models;
  uint32_t n_workers;
  uint32_t reserved;
  uint64_t clients_offset; /* shms_client_entry[max_clients] */
  uint64_t models_offset;  /* shms_model_entry[n_models] */
  uint64_t shadows_offset; /* shms_shadow[max_clients * slots_per_client] */
  uint64_t mailboxes_offset; /* shms_mailbox[n_workers] */
  uint64_t segment_bytes;
  SHMS_ATOMIC(uint64_t) ring_pos; /* the batcher's ring position, for its successor */
} shms_server_header;

/* ------------------------------------------------------------- layout checks */

#ifndef __cplusplus
#define SHMS_STATIC_ASSERT _Static_assert
#else
#define SHMS_STATIC_ASSERT static_assert
#endif
SHMS_STATIC_ASSERT(sizeof(shms_tensor_ref) == 96, "shms_tensor_ref size");
SHMS_STATIC_ASSERT(sizeof(shms_request) == 32 + 2 * SHMS_MAX_TENSORS * 96, "shms_request size");
SHMS_STATIC_ASSERT(sizeof(shms_ring_cell) == 32, "shms_ring_cell size");
SHMS_STATIC_ASSERT(sizeof(shms_control) == 256, "shms_control size");
SHMS_STATIC_ASSERT(offsetof(shms_control, enqueue_pos) == 64, "enqueue_pos offset");
SHMS_STATIC_ASSERT(offsetof(shms_control, dequeue_pos) == 128, "dequeue_pos offset");
SHMS_STATIC_ASSERT(offsetof(shms_control, doorbell) == 192, "doorbell offset");
SHMS_STATIC_ASSERT(sizeof(shms_slot) == 4992, "shms_slot size");
SHMS_STATIC_ASSERT(sizeof(shms_slot) % 64 == 0, "slots are cache-line aligned");
SHMS_STATIC_ASSERT(offsetof(shms_slot, request) == 336, "shms_slot.request offset");
SHMS_STATIC_ASSERT(offsetof(shms_slot, results) == 3440, "shms_slot.results offset");
SHMS_STATIC_ASSERT(sizeof(shms_arena_header) == 128, "shms_arena_header size");
SHMS_STATIC_ASSERT(offsetof(shms_arena_header, completions) == 64, "completions offset");
SHMS_STATIC_ASSERT(sizeof(shms_client_entry) == 88, "shms_client_entry size");
SHMS_STATIC_ASSERT(sizeof(shms_tensor_spec) == 136, "shms_tensor_spec size");
SHMS_STATIC_ASSERT(sizeof(shms_shadow) == 24 + sizeof(shms_request), "shms_shadow size");
SHMS_STATIC_ASSERT(sizeof(shms_mailbox) == 40 + 4 * SHMS_MAX_BATCH_REQUESTS, "mailbox size");
SHMS_STATIC_ASSERT(sizeof(shms_server_header) == 80, "shms_server_header size");

/* ------------------------------------------------------------- futex and clock */

#ifdef __linux__
static inline uint64_t shms_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Sleep while *word == expected, at most timeout_ns (<0: forever). Shared (not
 * FUTEX_PRIVATE) because the word lives in memory mapped by several processes.
 * Returns 0 when woken or the value differed, ETIMEDOUT, or EINTR. */
static inline int shms_futex_wait(SHMS_ATOMIC(uint32_t) * word, uint32_t expected,
                                  int64_t timeout_ns) {
  struct timespec ts, *tsp = NULL;
  if (timeout_ns >= 0) {
    ts.tv_sec = (time_t)(timeout_ns / 1000000000);
    ts.tv_nsec = (long)(timeout_ns % 1000000000);
    tsp = &ts;
  }
  long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, tsp, NULL, 0);
  if (rc == 0) return 0;
  if (errno == EAGAIN) return 0;
  return errno;
}

static inline void shms_futex_wake(SHMS_ATOMIC(uint32_t) * word, int n) {
  syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* Ring a doorbell: bump the word, wake a sleeper if there may be one.
 * SYNC POINT: pairs with shms_doorbell_wait (seq_cst on both sides so that
 * either the waiter sees the new value or the ringer sees the sleeping flag). */
static inline void shms_doorbell_ring(SHMS_ATOMIC(uint32_t) * word,
                                      SHMS_ATOMIC(uint32_t) * sleeping, int n) {
  shms_fetch_add(word, 1u, memory_order_seq_cst);
  if (shms_load(sleeping, memory_order_seq_cst)) shms_futex_wake(word, n);
}

/* Wait until *word != seen: spin spin_ns first, then sleep on the futex (at most
 * timeout_ns in all, <0 forever). Returns 1 if the word moved, 0 on timeout. */
static inline int shms_doorbell_wait(SHMS_ATOMIC(uint32_t) * word,
                                     SHMS_ATOMIC(uint32_t) * sleeping, uint32_t seen,
                                     int64_t spin_ns, int64_t timeout_ns) {
  uint64_t start = shms_now_ns();
  for (;;) {
    if (shms_load(word, memory_order_acquire) != seen) return 1;
    int64_t elapsed = (int64_t)(shms_now_ns() - start);
    if (elapsed >= spin_ns) break;
    /* Yield rather than pause: on a machine with few cores the process we wait for
     * may need this very CPU. */
    sched_yield();
  }
  for (;;) {
    int64_t left = -1;
    if (timeout_ns >= 0) {
      left = timeout_ns - (int64_t)(shms_now_ns() - start);
      if (left <= 0) return shms_load(word, memory_order_acquire) != seen;
    }
    shms_fetch_add(sleeping, 1u, memory_order_seq_cst);
    if (shms_load(word, memory_order_seq_cst) == seen) shms_futex_wait(word, seen, left);
    shms_fetch_add(sleeping, (uint32_t)-1, memory_order_seq_cst);
    if (shms_load(word, memory_order_acquire) != seen) return 1;
  }
}
#endif /* __linux__ */

/* ------------------------------------------------------------- the request ring */
/*
 * A bounded multi-producer, single-consumer ring of (client, slot, generation)
 * entries, after Dmitry Vyukov's bounded MPMC queue, changed so that a producer
 * that dies half-way never blocks it:
 *
 *   - A producer claims a cell by CAS on the cell's seq (pos -> CLAIM(owner, pos))
 *     before it moves enqueue_pos, so the claimed cell names its owner. Anyone who
 *     sees position pos taken helps move enqueue_pos past it.
 *   - It then writes the payload and publishes with a CAS CLAIM -> pos + 1.
 *   - The consumer takes cells strictly in order. It may skip the head cell with a
 *     CAS (its seq -> pos + capacity): a claim whose owner's lease is dead, or that
 *     stayed unpublished too long, or a cell no honest producer leaves that way. A
 *     late publish by the owner then fails its CAS (SHMS_RING_RECLAIMED): a live
 *     owner pushes again, a dead lease learns it was dropped.
 *
 * Every client maps the ring read-write, so one client can write anything into it.
 * Hence nobody trusts the shared header after attaching: the capacity and cell
 * address are fixed in a private shms_ring view, the consumer's position is private
 * (control.dequeue_pos is only a mirror for observers), and the consumer repairs
 * an enqueue_pos outside [head, head + capacity] (shms_ring_repair). What a vandal
 * can still do is delay others (a claim held up to the batcher's grace period) or
 * drop ring entries; the batcher's sweep of SUBMITTED slots answers those.
 *
 * ABA: positions are 64-bit and never wrap in practice; a claim word carries the
 * low 32 bits of its position, so a stale claim from an older lap (capacity <
 * 2^31) never matches the current position.
 */

enum shms_ring_result { SHMS_RING_OK = 0, SHMS_RING_FULL = 1, SHMS_RING_RECLAIMED = 2 };

typedef struct shms_ring {
  shms_control *ctl;
  shms_ring_cell *cells;
  uint64_t capacity; /* power of two, fixed at attach */
} shms_ring;

/* Checks the control header once and fixes the view. Returns 0, or -1 if the
 * segment is not a control segment of this protocol version, segment_bytes long, with a sane ring. */
static inline int shms_ring_attach(shms_ring *r, void *base, uint64_t segment_bytes) {
  shms_control *ctl = (shms_control *)base;
  if (segment_bytes < sizeof(shms_control) || ctl->magic != SHMS_MAGIC_CONTROL ||
      ctl->version != SHMS_PROTOCOL_VERSION)
    return -1;
  uint64_t cap = ctl->ring_capacity, off = ctl->ring_offset;
  if (cap < 2 || (cap & (cap - 1)) || cap > (1u << 30) || off < sizeof(shms_control) ||
      off % 64 || off + cap * sizeof(shms_ring_cell) > segment_bytes)
    return -1;
  r->ctl = ctl;
  r->cells = (shms_ring_cell *)((char *)base + off);
  r->capacity = cap;
  return 0;
}

static inline int shms_ring_push(const shms_ring *r, uint32_t owner, uint32_t slot,
                                 uint32_t generation) {
  shms_control *ctl = r->ctl;
  shms_ring_cell *cells = r->cells;
  const uint64_t mask = r->capacity - 1;
  for (;;) {
    uint64_t pos = shms_load(&ctl->enqueue_pos, memory_order_relaxed);
    shms_ring_cell *c = &cells[pos & mask];
    uint64_t seq = shms_load(&c->seq, memory_order_acquire);
    int taken; /* position pos already belongs to some producer */
    if (seq == pos) {
      uint64_t claim = shms_claim_word(owner, pos);
      uint64_t expected = pos;
      if (!shms_cas(&c->seq, &expected, claim)) continue;
      uint64_t p = pos;
      shms_cas(&ctl->enqueue_pos, &p, pos + 1);
      c->client_id = owner;
      c->slot = slot;
      c->generation = generation;
      /* SYNC POINT: this publish pairs with the acquire load of seq in shms_ring_pop. */
      expected = claim;
      if (shms_cas(&c->seq, &expected, pos + 1)) return SHMS_RING_OK;
      return SHMS_RING_RECLAIMED;
    }
    if (seq & SHMS_CELL_CLAIMED)
      taken = (seq & 0xffffffffu) == (pos & 0xffffffffu);
    else
      taken = (int64_t)(seq - pos) > 0;
    if (taken) {
      uint64_t p = pos;
      shms_cas(&ctl->enqueue_pos, &p, pos + 1); /* help a producer that stalled */
      continue;
    }
    /* The cell still holds an entry of an older lap: full, unless pos was stale. */
    if (shms_load(&ctl->enqueue_pos, memory_order_relaxed) == pos) return SHMS_RING_FULL;
  }
}

typedef struct shms_ring_entry {
  uint32_t client_id, slot, generation;
} shms_ring_entry;

enum shms_pop_result {
  SHMS_POP_EMPTY = 0,
  SHMS_POP_OK = 1,
  SHMS_POP_STALLED = 2, /* head claimed by *stalled_owner, not published yet */
  SHMS_POP_CORRUPT = 3  /* head in a state no honest producer leaves: skip it */
};

/* Single consumer; *pos is the consumer's private position. On STALLED and
 * CORRUPT, *head_seq is the head cell's seq, to pass to shms_ring_skip. */
static inline int shms_ring_pop(const shms_ring *r, uint64_t *pos, shms_ring_entry *out,
                                uint32_t *stalled_owner, uint64_t *head_seq) {
  const uint64_t p = *pos;
  shms_ring_cell *c = &r->cells[p & (r->capacity - 1)];
  /* enqueue_pos first: if it was already past p, position p had been claimed by then,
   * so a free seq read afterwards is a forged enqueue_pos, not a race. */
  uint64_t enq = shms_load(&r->ctl->enqueue_pos, memory_order_acquire);
  /* SYNC POINT: acquire pairs with the publishing CAS in shms_ring_push. */
  uint64_t seq = shms_load(&c->seq, memory_order_acquire);
  *head_seq = seq;
  if (seq == p + 1) {
    out->client_id = c->client_id;
    out->slot = c->slot;
    out->generation = c->generation;
    /* SYNC POINT: release pairs with the producer's acquire load of seq. */
    shms_store(&c->seq, p + r->capacity, memory_order_release);
    *pos = p + 1;
    shms_store(&r->ctl->dequeue_pos, p + 1, memory_order_relaxed); /* mirror */
    return SHMS_POP_OK;
  }
  /* Free head: empty, unless enqueue_pos is already past it (then nobody will ever
   * publish p). enqueue_pos behind p is honest: a claim skipped before its owner
   * moved enqueue_pos; shms_ring_repair moves it up. */
  if (seq == p) return (int64_t)(enq - p) <= 0 ? SHMS_POP_EMPTY : SHMS_POP_CORRUPT;
  if ((seq & SHMS_CELL_CLAIMED) && (seq & 0xffffffffu) == (p & 0xffffffffu)) {
    *stalled_owner = (uint32_t)((seq >> 32) & 0x7fffffffu);
    return SHMS_POP_STALLED;
  }
  return SHMS_POP_CORRUPT;
}

/* Consumer only: skip the head cell if its seq is still head_seq (as returned by
 * shms_ring_pop). Returns 1 if skipped. */
static inline int shms_ring_skip(const shms_ring *r, uint64_t *pos, uint64_t head_seq) {
  const uint64_t p = *pos;
  uint64_t expected = head_seq;
  if (!shms_cas(&r->cells[p & (r->capacity - 1)].seq, &expected, p + r->capacity)) return 0;
  uint64_t e = p; /* a skipped claim's owner may not have moved enqueue_pos past it yet */
  shms_cas(&r->ctl->enqueue_pos, &e, p + 1);
  *pos = p + 1;
  shms_store(&r->ctl->dequeue_pos, p + 1, memory_order_relaxed); /* mirror */
  return 1;
}

/* Consumer only: honest producers keep enqueue_pos within [pos, pos + capacity].
 * If it is outside (a client wrote it), move it back to the first position at or
 * after pos whose cell is free for it. Returns 1 if it was repaired. */
static inline int shms_ring_repair(const shms_ring *r, uint64_t pos) {
  uint64_t enq = shms_load(&r->ctl->enqueue_pos, memory_order_acquire);
  if (enq - pos <= r->capacity) return 0;
  uint64_t q = pos;
  while (q < pos + r->capacity &&
         shms_load(&r->cells[q & (r->capacity - 1)].seq, memory_order_acquire) != q)
    q++;
  return shms_cas(&r->ctl->enqueue_pos, &enq, q) ? 1 : 0;
}

/* ------------------------------------------------------------- validation */

/* Copy of a string field that a peer may have left without NUL. */
static inline void shms_copy_name(char *dst, size_t dst_bytes, const char *src,
                                  size_t src_bytes) {
  size_t n = 0;
  while (n < src_bytes && n + 1 < dst_bytes && src[n]) n++;
  memcpy(dst, src, n);
  dst[n] = 0;
}

/* Bytes a tensor of this dtype and (non-negative) shape needs: exactly, for the
 * fixed-size types; at least, for BYTES (4 per element: its length prefix).
 * UINT64_MAX on overflow. */
static inline uint64_t shms_tensor_bytes(uint32_t dtype, uint32_t ndim, const int64_t *shape) {
  uint64_t n = dtype == SHMS_TYPE_BYTES ? 4 : shms_dtype_size(dtype);
  for (uint32_t i = 0; i < ndim; i++) {
    uint64_t d = (uint64_t)shape[i];
    if (d != 0 && n > UINT64_MAX / d) return UINT64_MAX;
    n *= d;
  }
  return n;
}

/* Checks a request copied out of shared memory against the model it names and
 * the bounds of the caller's arena. Never trusts a field. On failure writes a
 * message naming the model, tensor and problem into err and returns a status.
 * On success stores the batch size (first dimension, or 1) in *batch_rows. */
static inline int shms_validate_request(const shms_request *r, const shms_model_entry *m,
                                        uint64_t data_begin, uint64_t data_end,
                                        uint32_t *batch_rows, char *err, size_t err_bytes) {
#define SHMS_FAIL(code, ...)                        \
  do {                                             \
    snprintf(err, err_bytes, __VA_ARGS__);         \
    return code;                                   \
  } while (0)
  const char *model = m->name;
  uint32_t batched = m->max_batch_size > 0;
  if (r->n_inputs > SHMS_MAX_TENSORS || r->n_outputs > SHMS_MAX_TENSORS)
    SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR, "model '%s': request has %u inputs and %u outputs (limit %d)",
              model, r->n_inputs, r->n_outputs, SHMS_MAX_TENSORS);
  if (r->n_inputs != m->n_inputs) {
    uint32_t seen_mask = 0;
    for (uint32_t i = 0; i < r->n_inputs; i++)
      if (r->inputs[i].index < m->n_inputs) seen_mask |= 1u << r->inputs[i].index;
    for (uint32_t k = 0; k < m->n_inputs; k++)
      if (!(seen_mask & (1u << k)))
        SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': missing input '%s' (expects %u inputs, got %u)",
                  model, m->inputs[k].name, m->n_inputs, r->n_inputs);
    SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': expects %u inputs, got %u", model, m->n_inputs,
              r->n_inputs);
  }
  uint32_t seen = 0;
  int64_t rows = -1;
  for (uint32_t i = 0; i < r->n_inputs; i++) {
    const shms_tensor_ref *t = &r->inputs[i];
    if (t->index >= m->n_inputs)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input index %u out of range (model has %u inputs)",
                model, t->index, m->n_inputs);
    const shms_tensor_spec *s = &m->inputs[t->index];
    if (seen & (1u << t->index))
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' given twice", model, s->name);
    seen |= 1u << t->index;
    if (t->dtype != s->dtype)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' has data type %s, expected %s",
                model, s->name, shms_dtype_name(t->dtype), shms_dtype_name(s->dtype));
    uint32_t want_ndim = s->ndim + batched;
    if (t->ndim != want_ndim)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' has %u dimensions, expected %u%s",
                model, s->name, t->ndim, want_ndim, batched ? " (batch dimension first)" : "");
    for (uint32_t d = 0; d < t->ndim; d++)
      if (t->shape[d] < 0)
        SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' has negative dimension %lld",
                  model, s->name, (long long)t->shape[d]);
    if (batched) {
      if (t->shape[0] < 1 || t->shape[0] > (int64_t)m->max_batch_size)
        SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' batch size %lld outside 1..%u",
                  model, s->name, (long long)t->shape[0], m->max_batch_size);
      if (rows >= 0 && t->shape[0] != rows)
        SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' batch size %lld differs from %lld",
                  model, s->name, (long long)t->shape[0], (long long)rows);
      rows = t->shape[0];
    }
    for (uint32_t d = 0; d < s->ndim; d++) {
      int64_t want = s->dims[d], got = t->shape[d + batched];
      if (want >= 0 && got != want)
        SHMS_FAIL(SHMS_ERR_INVALID_ARG,
                  "model '%s': input '%s' dimension %u is %lld, expected %lld", model,
                  s->name, d + batched, (long long)got, (long long)want);
    }
    if (t->offset % SHMS_DATA_ALIGN || t->offset < data_begin || t->offset > data_end ||
        t->nbytes > data_end - t->offset)
      SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
                "model '%s': input '%s' data [%llu, +%llu) is outside the caller's arena", model,
                s->name, (unsigned long long)t->offset, (unsigned long long)t->nbytes);
    uint64_t need = shms_tensor_bytes(t->dtype, t->ndim, t->shape);
    if (need == UINT64_MAX)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' shape overflows", model, s->name);
    if (t->dtype == SHMS_TYPE_BYTES ? t->nbytes < need : t->nbytes != need)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' holds %llu bytes, its shape needs %s%llu",
                model, s->name, (unsigned long long)t->nbytes,
                t->dtype == SHMS_TYPE_BYTES ? "at least " : "", (unsigned long long)need);
  }
  uint32_t out_seen = 0;
  for (uint32_t i = 0; i < r->n_outputs; i++) {
    const shms_tensor_ref *t = &r->outputs[i];
    if (t->index >= m->n_outputs)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': output index %u out of range (model has %u outputs)",
                model, t->index, m->n_outputs);
    if (out_seen & (1u << t->index))
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': output '%s' requested twice", model,
                m->outputs[t->index].name);
    out_seen |= 1u << t->index;
    if (t->offset % SHMS_DATA_ALIGN || t->offset < data_begin || t->offset > data_end ||
        t->nbytes > data_end - t->offset)
      SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
                "model '%s': output '%s' buffer [%llu, +%llu) is outside the caller's arena",
                model, m->outputs[t->index].name, (unsigned long long)t->offset,
                (unsigned long long)t->nbytes);
  }
  if (r->n_outputs == 0)
    SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': request names no output buffer", model);
  *batch_rows = batched ? (uint32_t)rows : 1u;
  return SHMS_OK;
#undef SHMS_FAIL
}

#endif /* SHMSERVE_H */
