/*
 * shms_layout.h — part of shmserve.h (include that): every constant, enum and
 * structure shared between processes, declared once.
 *
 * Enums are X-macro lists, X(C name, short name, value): this file expands them into
 * the C enums; the Python extension (core.c) exports them to Python as IntEnums and
 * the C++ client (clients/cpp) as enum classes, so no language types a value by hand.
 * SHMS_LAYOUT_FIELDS lists every struct field the other languages address; core.c
 * exports their offsets and sizes (shmserve._core.layout()).
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
 *   control  (server creates; clients map it read-only): shms_control.
 *   bell     (server creates; clients map read-write): shms_bell, the batcher's doorbell.
 *   arena    (server creates, one per client lease; that client maps read-write):
 *            shms_arena_header + the client's submission ring + request slots + the
 *            client's tensor data.
 *   All three are memfds sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW |
 *   F_SEAL_SEAL), sent with the hello reply (SCM_RIGHTS): no name, and no way to
 *   SIGBUS the server.
 *   server   (server-private; clients never receive its name): client table, model
 *            table, validated request copies, worker mailboxes.
 */
#ifndef SHMS_LAYOUT_H
#define SHMS_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

/* One spelling of atomics for C11 and C++11: the C++ client includes this header too. */
#ifdef __cplusplus
#include <atomic>
#define SHMS_ATOMIC(T) std::atomic<T>
#define SHMS_ALIGNAS(n) alignas(n)
#define SHMS_STATIC_ASSERT static_assert
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
#define SHMS_STATIC_ASSERT _Static_assert
#define shms_load(p, mo) atomic_load_explicit((p), mo)
#define shms_store(p, v, mo) atomic_store_explicit((p), (v), mo)
#define shms_fetch_add(p, v, mo) atomic_fetch_add_explicit((p), (v), mo)
#define shms_cas(p, expp, v) atomic_compare_exchange_strong((p), (expp), (v))
#endif

/* ---------------------------------------------------------------- constants */

#define SHMS_MAGIC_CONTROL 0x314c5443534d4853ULL /* "SHMSCTL1" little-endian */
#define SHMS_MAGIC_ARENA 0x314e5241534d4853ULL   /* "SHMSARN1" */
#define SHMS_MAGIC_SERVER 0x31565253534d4853ULL  /* "SHMSSRV1" */
#define SHMS_PROTOCOL_VERSION 5u

#define SHMS_MAX_TENSORS 16         /* inputs per request, and outputs per request */
#define SHMS_MAX_DIMS 8             /* rank of a tensor, batch dimension included */
#define SHMS_ERROR_BYTES 256        /* NUL-terminated UTF-8 error message */
/* A request's model_id: the entry's index in the low bits, its generation above. */
#define SHMS_MODEL_INDEX_BITS 16
#define SHMS_MODEL_INDEX_MASK ((1u << SHMS_MODEL_INDEX_BITS) - 1u)
#define SHMS_MODEL_HANDLE(index, generation) \
  (((uint32_t)(generation) << SHMS_MODEL_INDEX_BITS) | ((uint32_t)(index) & SHMS_MODEL_INDEX_MASK))
#define SHMS_NAME_BYTES 64          /* NUL-terminated model / tensor / segment name */
#define SHMS_MAX_BATCH_REQUESTS 256 /* requests in one batch handed to a worker */
#define SHMS_DATA_ALIGN 64          /* tensor data offsets are multiples of this */
#define SHMS_BATCH_HIST 65          /* executions by number of requests: 1..64, 65+ in [64] */
#define SHMS_MAILBOX_RETIRED 0xFFFFFFFFu /* shms_mailbox.pid of a retired (crash-looping) instance */
#define SHMS_BATCH_STATS 1024       /* per-batch-size statistics: sizes 1..1023, 1024+ in [1023] */
#define SHMS_LATENCY_BUCKETS 320    /* log-linear duration histogram, shms_latency_bucket() */
#define SHMS_MAX_PARAMETER_BYTES 65536 /* shms_request.parameters_bytes limit (msgpack map) */
#define SHMS_MAX_SEQUENCE_ID_BYTES 256 /* shms_request.sequence_id_bytes limit (string id) */
/* shms_request.flags: Triton's request flags (sequence batching reads them; a model
 * without it ignores them), and STREAM: the caller takes several responses in this
 * slot (docs/protocol.md section 6a; a decoupled model answers only such requests).
 * Any other bit is refused. */
#define SHMS_REQUEST_SEQUENCE_START 1u
#define SHMS_REQUEST_SEQUENCE_END 2u
#define SHMS_REQUEST_STREAM 4u
#define SHMS_REQUEST_FLAGS_KNOWN \
  (SHMS_REQUEST_SEQUENCE_START | SHMS_REQUEST_SEQUENCE_END | SHMS_REQUEST_STREAM)
/* shms_slot.response_flags, written by the server with each response it publishes. */
#define SHMS_RESPONSE_FINAL 1u /* the request's last response: the slot is DONE */
#define SHMS_RESPONSE_EMPTY 2u /* with FINAL: the final flag alone, no response in it */

/* Every constant the other languages need, X(name, value). */
#define SHMS_CONSTANTS(X)                                                              \
  X(MAGIC_CONTROL, SHMS_MAGIC_CONTROL) X(MAGIC_ARENA, SHMS_MAGIC_ARENA)                \
  X(MAGIC_SERVER, SHMS_MAGIC_SERVER) X(PROTOCOL_VERSION, SHMS_PROTOCOL_VERSION)        \
  X(MAX_TENSORS, SHMS_MAX_TENSORS) X(MAX_DIMS, SHMS_MAX_DIMS)                          \
  X(ERROR_BYTES, SHMS_ERROR_BYTES) X(NAME_BYTES, SHMS_NAME_BYTES)                      \
  X(MAX_BATCH_REQUESTS, SHMS_MAX_BATCH_REQUESTS) X(DATA_ALIGN, SHMS_DATA_ALIGN)        \
  X(BATCH_HIST, SHMS_BATCH_HIST) X(MAILBOX_RETIRED, SHMS_MAILBOX_RETIRED)             \
  X(BATCH_STATS, SHMS_BATCH_STATS) X(LATENCY_BUCKETS, SHMS_LATENCY_BUCKETS)            \
  X(MAX_PARAMETER_BYTES, SHMS_MAX_PARAMETER_BYTES)                                     \
  X(MAX_SEQUENCE_ID_BYTES, SHMS_MAX_SEQUENCE_ID_BYTES)                                 \
  X(REQUEST_SEQUENCE_START, SHMS_REQUEST_SEQUENCE_START)                               \
  X(REQUEST_SEQUENCE_END, SHMS_REQUEST_SEQUENCE_END)                                   \
  X(REQUEST_STREAM, SHMS_REQUEST_STREAM) X(RESPONSE_FINAL, SHMS_RESPONSE_FINAL)        \
  X(RESPONSE_EMPTY, SHMS_RESPONSE_EMPTY)

/* ---------------------------------------------------------------- enums */

/* Data types: the numbers of Triton's DataType enum (model_config.proto). */
#define SHMS_DTYPE_LIST(X)                                                             \
  X(SHMS_TYPE_INVALID, INVALID, 0) X(SHMS_TYPE_BOOL, BOOL, 1) X(SHMS_TYPE_UINT8, UINT8, 2) \
  X(SHMS_TYPE_UINT16, UINT16, 3) X(SHMS_TYPE_UINT32, UINT32, 4)                        \
  X(SHMS_TYPE_UINT64, UINT64, 5) X(SHMS_TYPE_INT8, INT8, 6) X(SHMS_TYPE_INT16, INT16, 7) \
  X(SHMS_TYPE_INT32, INT32, 8) X(SHMS_TYPE_INT64, INT64, 9) X(SHMS_TYPE_FP16, FP16, 10) \
  X(SHMS_TYPE_FP32, FP32, 11) X(SHMS_TYPE_FP64, FP64, 12) X(SHMS_TYPE_BYTES, BYTES, 13) \
  X(SHMS_TYPE_BF16, BF16, 14)

/* Request status. 0..7 are written by the server into shms_slot.status (and sent as
 * "code" in control replies); SERVER_DEAD and TIMEOUT are a client's own verdicts,
 * never found in a slot. */
#define SHMS_STATUS_LIST(X)                                                           \
  X(SHMS_OK, OK, 0)                                                                   \
  X(SHMS_ERR_INVALID_ARG, INVALID_ARG, 1)           /* bad tensor name/dtype/shape/size */ \
  X(SHMS_ERR_NOT_FOUND, NOT_FOUND, 2)               /* unknown model id or version */ \
  X(SHMS_ERR_UNAVAILABLE, UNAVAILABLE, 3)           /* model not ready, worker died */ \
  X(SHMS_ERR_OUTPUT_TOO_SMALL, OUTPUT_TOO_SMALL, 4) /* results[i].nbytes = needed */  \
  X(SHMS_ERR_INTERNAL, INTERNAL, 5)                 /* the model raised, the server failed */ \
  X(SHMS_ERR_BUSY, BUSY, 6)                         /* queue or ring full: retry later */ \
  X(SHMS_ERR_BAD_DESCRIPTOR, BAD_DESCRIPTOR, 7)     /* malformed offsets, counts, state */ \
  X(SHMS_ERR_SERVER_DEAD, SERVER_DEAD, 8)   /* client: server stopped or died, lease ended */ \
  X(SHMS_ERR_TIMEOUT, TIMEOUT, 9)           /* client: its deadline passed first */

/* Request slot states. Owner of each transition in brackets. */
#define SHMS_SLOT_STATE_LIST(X)                                                       \
  X(SHMS_SLOT_FREE, FREE, 0)           /* [client] may be filled */                   \
  X(SHMS_SLOT_SUBMITTED, SUBMITTED, 1) /* [client] written, index pushed on the ring */ \
  X(SHMS_SLOT_QUEUED, QUEUED, 2)       /* [batcher] validated and copied, queued */   \
  X(SHMS_SLOT_RUNNING, RUNNING, 3)     /* [worker] in a batch being executed */       \
  X(SHMS_SLOT_DONE, DONE, 4)           /* [worker or batcher] status, results final */ \
  X(SHMS_SLOT_RESPONSE, RESPONSE, 5)   /* [worker] STREAM: one response to read, more to come */

/* Timestamps recorded in shms_slot.t_ns (CLOCK_MONOTONIC, nanoseconds). */
#define SHMS_TIMESTAMP_LIST(X)                                                        \
  X(SHMS_T_CLIENT_WRITE, CLIENT_WRITE, 0) /* client starts writing the request */     \
  X(SHMS_T_ENQUEUE, ENQUEUE, 1)           /* client pushed it on the ring */          \
  X(SHMS_T_DEQUEUE, DEQUEUE, 2)           /* batcher took it from the ring */         \
  X(SHMS_T_BATCHED, BATCHED, 3)           /* batcher handed its batch to a worker */  \
  X(SHMS_T_COMPUTE_START, COMPUTE_START, 4)                                           \
  X(SHMS_T_COMPUTE_END, COMPUTE_END, 5)                                               \
  X(SHMS_T_COMPLETE, COMPLETE, 6)         /* server published DONE */                 \
  X(SHMS_T_CLIENT_WAKE, CLIENT_WAKE, 7)   /* client saw DONE */

/* Per-model durations, as Triton's statistics name them (inference_stats). Each is a
 * {count, ns} pair summed over requests plus a latency histogram. SUCCESS and FAIL
 * time a request from the batcher taking it off the ring to its answer; CACHE_* time
 * the response cache's part (server/response_cache.py). */
#define SHMS_DURATION_LIST(X)                                                         \
  X(SHMS_DUR_SUCCESS, SUCCESS, 0) X(SHMS_DUR_FAIL, FAIL, 1) X(SHMS_DUR_QUEUE, QUEUE, 2) \
  X(SHMS_DUR_COMPUTE_INPUT, COMPUTE_INPUT, 3) X(SHMS_DUR_COMPUTE_INFER, COMPUTE_INFER, 4) \
  X(SHMS_DUR_COMPUTE_OUTPUT, COMPUTE_OUTPUT, 5)                                        \
  X(SHMS_DUR_CACHE_HIT, CACHE_HIT, 6) /* lookup and copy out */                        \
  X(SHMS_DUR_CACHE_MISS, CACHE_MISS, 7) /* lookup and insert */                       \
  X(SHMS_DUR_FIRST_RESPONSE, FIRST_RESPONSE, 8) /* decoupled: taken to first response */

/* Why a request failed: the `reason` label of nv_inference_request_failure. */
#define SHMS_FAILURE_LIST(X)                                                          \
  X(SHMS_FAIL_REJECTED, REJECTED, 0) /* queue full, queue timeout, server stopping */  \
  X(SHMS_FAIL_CANCELED, CANCELED, 1) /* the caller withdrew it */                     \
  X(SHMS_FAIL_BACKEND, BACKEND, 2)   /* the model raised or its worker died */         \
  X(SHMS_FAIL_OTHER, OTHER, 3)       /* invalid request, output buffer too small */

/* How a waiting server process woke up (shms_doorbell_wait's return value). */
#define SHMS_WAKE_LIST(X) X(SHMS_WAKE_TIMEOUT, TIMEOUT, 0) X(SHMS_WAKE_SPIN, SPIN, 1) \
  X(SHMS_WAKE_SLEEP, SLEEP, 2)

#define SHMS_SERVER_STATE_LIST(X)                                                     \
  X(SHMS_SERVER_STARTING, STARTING, 0) X(SHMS_SERVER_READY, READY, 1)                 \
  X(SHMS_SERVER_STOPPED, STOPPED, 2)

#define SHMS_CLIENT_STATE_LIST(X)                                                     \
  X(SHMS_CLIENT_FREE, FREE, 0) X(SHMS_CLIENT_ALIVE, ALIVE, 1) X(SHMS_CLIENT_DEAD, DEAD, 2)

/* A mailbox holds the batch its worker runs and, while it runs, may hold the next
 * (the overlap of docs/architecture.md, "Two batches deep"): ASSIGNED_NEXT. Its next
 * batch is written only by whoever holds it EDITING (the batcher, appending) or
 * PROMOTING (the worker, moving it into place); shms_slot.h has the procedures. */
#define SHMS_MAILBOX_STATE_LIST(X)                                                    \
  X(SHMS_MAILBOX_IDLE, IDLE, 0) X(SHMS_MAILBOX_ASSIGNED, ASSIGNED, 1)                 \
  X(SHMS_MAILBOX_ASSIGNED_NEXT, ASSIGNED_NEXT, 2) X(SHMS_MAILBOX_EDITING, EDITING, 3) \
  X(SHMS_MAILBOX_PROMOTING, PROMOTING, 4)

/* Where a tensor's bytes live (shms_tensor_ref.memory_kind). CUDA_IPC: device
 * memory, named by the shms_cuda_ipc record that `offset` points at in the caller's
 * arena; accepted by models whose entry sets device_memory (docs/gpu.md). */
#define SHMS_MEMORY_KIND_LIST(X)                                                      \
  X(SHMS_MEMORY_HOST_ARENA, HOST_ARENA, 0) /* the caller's arena, at `offset` */      \
  X(SHMS_MEMORY_CUDA_IPC, CUDA_IPC, 1)     /* device memory: a shms_cuda_ipc record */

#define SHMS_RING_RESULT_LIST(X)                                                      \
  X(SHMS_RING_OK, OK, 0) X(SHMS_RING_FULL, FULL, 1)                                   \
  X(SHMS_RING_RECLAIMED, RECLAIMED, 2) /* the consumer skipped our claim */

#define SHMS_POP_RESULT_LIST(X)                                                       \
  X(SHMS_POP_EMPTY, EMPTY, 0) X(SHMS_POP_OK, OK, 1)                                   \
  X(SHMS_POP_STALLED, STALLED, 2) /* head claimed, not published yet */               \
  X(SHMS_POP_CORRUPT, CORRUPT, 3) /* head in a state no honest producer leaves */

/* Every enum list, X(list, Python/C++ type name). */
#define SHMS_ENUMS(X)                                                                 \
  X(SHMS_DTYPE_LIST, DataType) X(SHMS_STATUS_LIST, Status)                            \
  X(SHMS_SLOT_STATE_LIST, SlotState) X(SHMS_TIMESTAMP_LIST, Timestamp)                \
  X(SHMS_SERVER_STATE_LIST, ServerState) X(SHMS_CLIENT_STATE_LIST, ClientState)       \
  X(SHMS_MAILBOX_STATE_LIST, MailboxState) X(SHMS_MEMORY_KIND_LIST, MemoryKind)       \
  X(SHMS_RING_RESULT_LIST, RingResult) X(SHMS_POP_RESULT_LIST, PopResult)          \
  X(SHMS_DURATION_LIST, Duration) X(SHMS_FAILURE_LIST, FailureReason)                 \
  X(SHMS_WAKE_LIST, Wake)

#define SHMS_ENUM_MEMBER(cname, name, value) cname = value,
enum shms_dtype { SHMS_DTYPE_LIST(SHMS_ENUM_MEMBER) SHMS_TYPE_COUNT };
enum shms_status { SHMS_STATUS_LIST(SHMS_ENUM_MEMBER) };
enum shms_slot_state { SHMS_SLOT_STATE_LIST(SHMS_ENUM_MEMBER) };
enum shms_timestamp { SHMS_TIMESTAMP_LIST(SHMS_ENUM_MEMBER) SHMS_T_COUNT };
enum shms_server_state { SHMS_SERVER_STATE_LIST(SHMS_ENUM_MEMBER) };
enum shms_duration_kind { SHMS_DURATION_LIST(SHMS_ENUM_MEMBER) SHMS_DUR_COUNT };
enum shms_failure_reason { SHMS_FAILURE_LIST(SHMS_ENUM_MEMBER) SHMS_FAIL_COUNT };
enum shms_wake { SHMS_WAKE_LIST(SHMS_ENUM_MEMBER) };
enum shms_client_state { SHMS_CLIENT_STATE_LIST(SHMS_ENUM_MEMBER) };
enum shms_mailbox_state { SHMS_MAILBOX_STATE_LIST(SHMS_ENUM_MEMBER) };
enum shms_memory_kind { SHMS_MEMORY_KIND_LIST(SHMS_ENUM_MEMBER) };
enum shms_ring_result { SHMS_RING_RESULT_LIST(SHMS_ENUM_MEMBER) };
enum shms_pop_result { SHMS_POP_RESULT_LIST(SHMS_ENUM_MEMBER) };
#undef SHMS_ENUM_MEMBER

/* Element size in bytes; 0 for BYTES (variable: 4-byte little-endian length + bytes
 * per element) and for invalid codes. */
static inline uint32_t shms_dtype_size(uint32_t dtype) {
  static const uint8_t sizes[SHMS_TYPE_COUNT] = {0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 0, 2};
  return dtype < SHMS_TYPE_COUNT ? sizes[dtype] : 0;
}

static inline const char *shms_dtype_name(uint32_t dtype) {
#define SHMS_NAME_OF(cname, name, value) #name,
  static const char *names[SHMS_TYPE_COUNT] = {SHMS_DTYPE_LIST(SHMS_NAME_OF)};
#undef SHMS_NAME_OF
  return dtype < SHMS_TYPE_COUNT ? names[dtype] : "INVALID";
}

/* ------------------------------------------------------------- tensors */

/* A tensor in the caller's arena. In a request's inputs: what the caller sends.
 * In a request's outputs: index + where the caller wants it (offset, nbytes =
 * capacity). In a slot's results: what the server wrote (dtype, shape, nbytes). */
typedef struct shms_tensor_ref {
  uint32_t index;       /* position in the model's input (or output) list */
  uint32_t dtype;       /* enum shms_dtype */
  uint32_t ndim;        /* 0..SHMS_MAX_DIMS */
  uint16_t memory_kind; /* enum shms_memory_kind; HOST_ARENA (0) in version 2 */
  uint16_t device_id;   /* GPU ordinal for device memory kinds, else 0 */
  uint64_t offset;      /* from the start of the arena segment, SHMS_DATA_ALIGN-aligned */
  uint64_t nbytes;
  int64_t shape[SHMS_MAX_DIMS];
} shms_tensor_ref;

/* What a client asks for. Written by the client while the slot is FREE. The options
 * (flags .. reserved) are 0 for "the model's default" / "none": shms_slot_begin
 * zeroes them, a client sets those it uses. A sequence's correlation id is either
 * numeric (sequence_id) or a string (sequence_id_offset/_bytes), never both. */
typedef struct shms_request {
  uint32_t model_id; /* a handle (SHMS_MODEL_HANDLE) of the server's model table, from
                      * the control socket; the batcher's copy holds the index alone */
  uint32_t n_inputs;
  uint32_t n_outputs; /* outputs wanted, 1..SHMS_MAX_TENSORS */
  uint32_t flags;     /* SHMS_REQUEST_SEQUENCE_START | _END; other bits 0 */
  uint32_t priority;  /* 1 = highest; 0 (or above priority_levels): the model's default */
  uint32_t parameters_bytes; /* msgpack map of request parameters, 0..SHMS_MAX_PARAMETER_BYTES */
  uint64_t timeout_us;        /* queue timeout; 0: the model's; used if allow_timeout_override */
  uint64_t parameters_offset; /* arena offset of the parameters (any alignment) */
  uint64_t sequence_id;       /* numeric correlation id for sequence batching; 0: none */
  uint64_t sequence_id_offset; /* arena offset of a string correlation id (any alignment) */
  uint32_t sequence_id_bytes;  /* its UTF-8 bytes, 1..SHMS_MAX_SEQUENCE_ID_BYTES; 0: none */
  uint32_t reserved;           /* 0 */
  shms_tensor_ref inputs[SHMS_MAX_TENSORS];
  shms_tensor_ref outputs[SHMS_MAX_TENSORS]; /* index, offset, nbytes (capacity) */
} shms_request;

/* ------------------------------------------------------------- submission ring */

/* One cell of a client's submission ring (in its arena). seq is the Vyukov sequence word extended with a claim state:
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

/* ------------------------------------------------------------- control and bell */

/* The control block. Clients map it read-only (the hello reply sends a descriptor
 * reopened O_RDONLY): every word here is the server's. */
typedef struct shms_control {
  uint64_t magic; /* SHMS_MAGIC_CONTROL */
  uint32_t version; /* SHMS_PROTOCOL_VERSION */
  uint32_t header_bytes; /* sizeof(shms_control) */
  uint32_t server_pid;   /* coordinator's pid, for liveness checks */
  uint32_t reserved;
  uint64_t segment_bytes;
  SHMS_ATOMIC(uint32_t) server_state; /* enum shms_server_state */
  /* Coordinator: nonzero while other work leaves this machine no CPU to spin on
   * (shmserve/server/cpu_watch.py); every waiter then sleeps at once. A hint only. */
  SHMS_ATOMIC(uint32_t) crowded;
  /* Batcher: its sleep's token while it sleeps on bell.doorbell, 0 awake
   * (shms_doorbell_ring_client). */
  SHMS_ATOMIC(uint32_t) batcher_sleeping;
  uint32_t reserved2;
  uint8_t pad[16];
} shms_control;

/* The bell: the one shared page every client maps read-write (its own sealed memfd),
 * holding only the batcher's futex word. All a client can do with it is ring; the
 * batcher's doorbell defence bounds that (server/batcher.py, NOISE_RINGS). */
typedef struct shms_bell {
  SHMS_ATOMIC(uint32_t) doorbell; /* futex: the batcher's wake-up word */
  uint32_t reserved;
  uint8_t pad[56];
} shms_bell;

/* ------------------------------------------------------------- arena segment */

typedef struct shms_slot {
  SHMS_ATOMIC(uint32_t) state; /* enum shms_slot_state */
  uint32_t generation;         /* client bumps it for every new request in this slot */
  int32_t status;              /* enum shms_status, valid once DONE */
  uint32_t n_results;
  uint64_t t_ns[SHMS_T_COUNT];
  char error[SHMS_ERROR_BYTES];
#ifdef SHMS_LAYOUT_PROBE
  uint8_t layout_probe[64]; /* a scratch build moves what follows (tests/test_layout.py) */
#endif
  shms_request request;
  shms_tensor_ref results[SHMS_MAX_TENSORS];
  /* STREAM requests (docs/protocol.md section 6a). The server writes response_index
   * and response_flags with every response it publishes (RESPONSE or DONE); the client
   * zeroes all four at submit and may set cancel while the request is in flight. */
  uint32_t response_index;                /* 0, 1, ...: which response this is */
  uint32_t response_flags;                /* SHMS_RESPONSE_FINAL | SHMS_RESPONSE_EMPTY */
  SHMS_ATOMIC(uint32_t) cancel;           /* client: nonzero asks the model to stop */
  SHMS_ATOMIC(uint32_t) stream_sleeping;  /* worker: may sleep on state until hand-back */
  uint8_t pad[32];
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
  uint64_t ring_offset;   /* this client's submission ring: its first shms_ring_cell */
  uint32_t ring_capacity; /* power of two, at least n_slots */
  /* Client: the batcher's sleep token it last woke (shms_doorbell_ring_client). */
  SHMS_ATOMIC(uint32_t) rang_token;
  SHMS_ALIGNAS(64) SHMS_ATOMIC(uint32_t) completions; /* futex: bumped after each DONE */
  SHMS_ATOMIC(uint32_t) waiters; /* client threads that may sleep on completions */
  uint8_t pad[56];
  SHMS_ALIGNAS(64) SHMS_ATOMIC(uint64_t) enqueue_pos; /* the ring's producers (this client) */
  uint8_t pad2[56];
} shms_arena_header;

/* ------------------------------------------------------------- server segment */

typedef struct shms_client_entry {
  SHMS_ATOMIC(uint32_t) state; /* enum shms_client_state; coordinator writes */
  uint32_t generation;         /* lease generation, bumped at every new lease */
  uint32_t pid;
  uint32_t uid;
  uint64_t segment_bytes;
  char segment[SHMS_NAME_BYTES]; /* how server processes open the arena: /proc/<coordinator>/fd/<memfd> */
  /* Batcher: its position in this lease's submission ring (0 at a new lease); private
   * to the server, so a restarted batcher goes on where its predecessor stopped. */
  SHMS_ATOMIC(uint64_t) ring_pos;
} shms_client_entry;

typedef struct shms_tensor_spec {
  char name[SHMS_NAME_BYTES];
  uint32_t dtype;
  uint32_t ndim; /* without the batch dimension when max_batch_size > 0 */
  int64_t dims[SHMS_MAX_DIMS]; /* -1 = any size */
} shms_tensor_spec;

/* A model's statistics (shms_stats.h records them), in the server segment: the
 * batcher and the workers add with relaxed atomics, the coordinator reads. */
typedef struct shms_duration {
  SHMS_ATOMIC(uint64_t) count; /* requests (or executions, in batch_stats) */
  SHMS_ATOMIC(uint64_t) ns;    /* their summed duration */
} shms_duration;

typedef struct shms_batch_stat { /* executions of one batch size (rows) */
  shms_duration compute_input, compute_infer, compute_output;
} shms_batch_stat;

typedef struct shms_model_stats {
  SHMS_ATOMIC(uint64_t) inference_count;   /* rows: sum of batch dims */
  SHMS_ATOMIC(uint64_t) execution_count;   /* model executions (batches) */
  SHMS_ATOMIC(uint64_t) last_inference_ms; /* CLOCK_REALTIME ms of the last execution */
  SHMS_ATOMIC(uint64_t) pending;           /* batcher: requests queued for this model now */
  SHMS_ATOMIC(uint64_t) failures[SHMS_FAIL_COUNT]; /* by enum shms_failure_reason */
  shms_duration durations[SHMS_DUR_COUNT];          /* by enum shms_duration_kind */
  SHMS_ATOMIC(uint64_t) batch_requests[SHMS_BATCH_HIST]; /* index n-1: batches of n requests */
  shms_batch_stat batch_stats[SHMS_BATCH_STATS];        /* index rows-1 */
  SHMS_ATOMIC(uint64_t) latency[SHMS_DUR_COUNT][SHMS_LATENCY_BUCKETS]; /* per request */
} shms_model_stats;

/* A tensor in device memory (memory_kind CUDA_IPC): the record a tensor ref's
 * `offset` points at in the caller's arena, in place of the tensor's bytes. The
 * server opens mem_handle (cuIpcOpenMemHandle), checks [offset, offset + nbytes)
 * against the allocation's real size, and, for an input with SHMS_CUDA_IPC_EVENT,
 * makes its stream wait for the event before reading. Nothing here is trusted. */
typedef struct shms_cuda_ipc {
  uint8_t mem_handle[64];   /* cuIpcGetMemHandle of the allocation holding the tensor */
  uint8_t event_handle[64]; /* cuIpcGetEventHandle of an event recorded after its writes */
  uint64_t offset;          /* the tensor's first byte, from the allocation's base */
  uint8_t device_uuid[16];  /* cuDeviceGetUuid of the GPU holding it */
  uint32_t flags;           /* SHMS_CUDA_IPC_EVENT: wait for event_handle first */
  uint32_t reserved;        /* 0 */
} shms_cuda_ipc;
#define SHMS_CUDA_IPC_EVENT 1u

typedef struct shms_model_entry {
  char name[SHMS_NAME_BYTES];
  int64_t version;
  uint32_t max_batch_size;
  uint32_t n_inputs;
  uint32_t n_outputs;
  SHMS_ATOMIC(uint32_t) ready; /* 1 once every instance has loaded */
  uint32_t optional_inputs;    /* bit k: input k may be left out (config `optional: true`) */
  /* Bumped by the coordinator each time this entry stops naming the model it named
   * (unload, reload) and when it is given to another: a request's model_id is a handle,
   * SHMS_MODEL_HANDLE(index, generation), and one of an older generation is refused. */
  SHMS_ATOMIC(uint32_t) generation;
  SHMS_ATOMIC(uint32_t) answer_turn; /* preserve_ordering: the last batch ticket answered */
  uint32_t ragged_inputs; /* bit k: input k batches whatever its dims (allow_ragged_batch) */
  uint32_t device_memory; /* 1: tensors may be CUDA_IPC (every instance reads device memory) */
  uint32_t reserved_model;
  shms_tensor_spec inputs[SHMS_MAX_TENSORS];
  shms_tensor_spec outputs[SHMS_MAX_TENSORS];
  shms_model_stats stats;
} shms_model_entry;

/* A request as the batcher validated it, copied out of the client's reach. */
typedef struct shms_shadow {
  uint32_t client_id;
  uint32_t slot;
  uint32_t generation; /* the slot's request generation */
  uint32_t lease;      /* the client's lease generation (shms_client_entry.generation) */
  uint32_t batch_rows; /* first dimension of the inputs, 1 for unbatched models */
  uint32_t sequence_slot; /* batcher, at hand-over: a sequence's batch slot + 1; 0: none */
  uint64_t taken_ns;   /* when the batcher took it off the ring: request durations start */
  shms_request request;
} shms_shadow;

/* The batcher hands one batch at a time to each worker through its mailbox. */
typedef struct shms_mailbox {
  SHMS_ATOMIC(uint32_t) state; /* futex: enum shms_mailbox_state */
  SHMS_ATOMIC(uint32_t) worker_sleeping;
  SHMS_ATOMIC(uint32_t) order_waiting; /* worker: may sleep on its model's answer_turn */
  uint32_t n;   /* requests in shadow[], written before state becomes ASSIGNED */
  uint32_t pid; /* worker's pid, 0 until it started, SHMS_MAILBOX_RETIRED once retired */
  SHMS_ATOMIC(uint32_t) batcher_waiting; /* batcher has work for this model: ring when idle */
  uint64_t ticket; /* preserve_ordering: the batch's ticket, 1..2^32-1 (0: answer at once) */
  uint32_t attempt; /* 0 when handed over; 1 while a successor re-runs it (retry_on_worker_crash) */
  uint32_t reserved2;
  SHMS_ATOMIC(uint64_t) wakeups[3]; /* worker: its waits by enum shms_wake */
  SHMS_ATOMIC(uint64_t) executions; /* worker: batches this instance ran */
  uint32_t shadow[SHMS_MAX_BATCH_REQUESTS]; /* indices into the shadow table */
  uint32_t next_n;      /* requests in next_shadow[]: the batch waiting (ASSIGNED_NEXT) */
  uint32_t reserved3;
  uint32_t next_shadow[SHMS_MAX_BATCH_REQUESTS];
} shms_mailbox;

typedef struct shms_server_header {
  uint64_t magic; /* SHMS_MAGIC_SERVER */
  uint32_t version;
  uint32_t max_clients;
  uint32_t slots_per_client;
  uint32_t n_models;
  uint32_t n_workers;
  /* Coordinator: bumped after each change of the model table it tells the batcher of
   * (a model added or withdrawn while serving); the batcher compares it once a loop. */
  SHMS_ATOMIC(uint32_t) table_epoch;
  uint64_t clients_offset; /* shms_client_entry[max_clients] */
  uint64_t models_offset;  /* shms_model_entry[n_models] */
  uint64_t shadows_offset; /* shms_shadow[max_clients * slots_per_client] */
  uint64_t mailboxes_offset; /* shms_mailbox[n_workers] */
  uint64_t segment_bytes;
  /* Coordinator: CLOCK_MONOTONIC ns when the server began to stop, 0 while serving. A
   * request pushed (slot t_ns[ENQUEUE]) at or after it is refused; earlier ones drain. */
  SHMS_ATOMIC(uint64_t) drain_since_ns;
  SHMS_ATOMIC(uint64_t) batcher_wakeups[3]; /* the batcher's waits by enum shms_wake */
} shms_server_header;

/* ------------------------------------------------------------- layout checks */

/* A scratch build with -DSHMS_LAYOUT_PROBE moves fields on purpose (tests/test_layout.py
 * shows that Python follows the header); these pins hold for every real build. */
#ifndef SHMS_LAYOUT_PROBE
SHMS_STATIC_ASSERT(sizeof(shms_tensor_ref) == 96, "shms_tensor_ref size");
SHMS_STATIC_ASSERT(sizeof(shms_request) == 64 + 2 * SHMS_MAX_TENSORS * 96, "shms_request size");
SHMS_STATIC_ASSERT(offsetof(shms_request, inputs) == 64, "shms_request.inputs offset");
SHMS_STATIC_ASSERT(offsetof(shms_request, sequence_id_offset) == 48, "shms_request.sequence_id_offset offset");
SHMS_STATIC_ASSERT(offsetof(shms_request, sequence_id_bytes) == 56, "shms_request.sequence_id_bytes offset");
SHMS_STATIC_ASSERT(sizeof(shms_ring_cell) == 32, "shms_ring_cell size");
SHMS_STATIC_ASSERT(sizeof(shms_control) == 64, "shms_control size");
SHMS_STATIC_ASSERT(offsetof(shms_control, batcher_sleeping) == 40, "batcher_sleeping offset");
SHMS_STATIC_ASSERT(sizeof(shms_bell) == 64, "shms_bell size");
SHMS_STATIC_ASSERT(sizeof(shms_slot) == 5056, "shms_slot size");
SHMS_STATIC_ASSERT(sizeof(shms_slot) % 64 == 0, "slots are cache-line aligned");
SHMS_STATIC_ASSERT(offsetof(shms_slot, request) == 336, "shms_slot.request offset");
SHMS_STATIC_ASSERT(offsetof(shms_slot, results) == 3472, "shms_slot.results offset");
SHMS_STATIC_ASSERT(offsetof(shms_slot, response_index) == 5008, "shms_slot.response_index offset");
SHMS_STATIC_ASSERT(offsetof(shms_slot, cancel) == 5016, "shms_slot.cancel offset");
SHMS_STATIC_ASSERT(sizeof(shms_arena_header) == 192, "shms_arena_header size");
SHMS_STATIC_ASSERT(offsetof(shms_arena_header, ring_offset) == 48, "ring_offset offset");
SHMS_STATIC_ASSERT(offsetof(shms_arena_header, rang_token) == 60, "rang_token offset");
SHMS_STATIC_ASSERT(offsetof(shms_arena_header, completions) == 64, "completions offset");
SHMS_STATIC_ASSERT(offsetof(shms_arena_header, enqueue_pos) == 128, "enqueue_pos offset");
SHMS_STATIC_ASSERT(sizeof(shms_client_entry) == 96, "shms_client_entry size");
SHMS_STATIC_ASSERT(sizeof(shms_tensor_spec) == 136, "shms_tensor_spec size");
SHMS_STATIC_ASSERT(sizeof(shms_shadow) == 32 + sizeof(shms_request), "shms_shadow size");
SHMS_STATIC_ASSERT(sizeof(shms_mailbox) == 80 + 8 * SHMS_MAX_BATCH_REQUESTS, "mailbox size");
SHMS_STATIC_ASSERT(sizeof(shms_server_header) == 104, "shms_server_header size");
SHMS_STATIC_ASSERT(sizeof(shms_cuda_ipc) == 160, "shms_cuda_ipc size");
#endif

/* ------------------------------------------------------------- the field table */

/* Every shared struct S(short name, type) and the fields F(short name, type, field)
 * that other languages address; core.c exports offset and size of each
 * ("slot.state", "slot.state.bytes", "slot.size") as shmserve._core.layout(). */
#define SHMS_LAYOUT_FIELDS(S, F)                                                        \
  S(tensor_ref, shms_tensor_ref)                                                        \
  F(tensor_ref, shms_tensor_ref, index) F(tensor_ref, shms_tensor_ref, dtype)           \
  F(tensor_ref, shms_tensor_ref, ndim) F(tensor_ref, shms_tensor_ref, memory_kind)      \
  F(tensor_ref, shms_tensor_ref, device_id) F(tensor_ref, shms_tensor_ref, offset)      \
  F(tensor_ref, shms_tensor_ref, nbytes) F(tensor_ref, shms_tensor_ref, shape)          \
  S(request, shms_request)                                                              \
  F(request, shms_request, model_id) F(request, shms_request, n_inputs)                 \
  F(request, shms_request, n_outputs) F(request, shms_request, flags)                   \
  F(request, shms_request, priority) F(request, shms_request, parameters_bytes)         \
  F(request, shms_request, timeout_us) F(request, shms_request, parameters_offset)      \
  F(request, shms_request, sequence_id) F(request, shms_request, sequence_id_offset)    \
  F(request, shms_request, sequence_id_bytes)                                           \
  F(request, shms_request, inputs) F(request, shms_request, outputs)                    \
  S(ring_cell, shms_ring_cell)                                                          \
  F(ring_cell, shms_ring_cell, seq) F(ring_cell, shms_ring_cell, client_id)             \
  F(ring_cell, shms_ring_cell, slot) F(ring_cell, shms_ring_cell, generation)           \
  S(control, shms_control)                                                              \
  F(control, shms_control, magic) F(control, shms_control, version)                     \
  F(control, shms_control, header_bytes) F(control, shms_control, server_pid)           \
  F(control, shms_control, segment_bytes) F(control, shms_control, server_state)        \
  F(control, shms_control, crowded) F(control, shms_control, batcher_sleeping)          \
  S(bell, shms_bell) F(bell, shms_bell, doorbell)                                       \
  S(slot, shms_slot)                                                                    \
  F(slot, shms_slot, state) F(slot, shms_slot, generation) F(slot, shms_slot, status)   \
  F(slot, shms_slot, n_results) F(slot, shms_slot, t_ns) F(slot, shms_slot, error)      \
  F(slot, shms_slot, request) F(slot, shms_slot, results)                               \
  F(slot, shms_slot, response_index) F(slot, shms_slot, response_flags)                 \
  F(slot, shms_slot, cancel) F(slot, shms_slot, stream_sleeping)                        \
  S(arena, shms_arena_header)                                                           \
  F(arena, shms_arena_header, magic) F(arena, shms_arena_header, version)               \
  F(arena, shms_arena_header, client_id) F(arena, shms_arena_header, generation)        \
  F(arena, shms_arena_header, n_slots) F(arena, shms_arena_header, slots_offset)        \
  F(arena, shms_arena_header, data_offset) F(arena, shms_arena_header, segment_bytes)   \
  F(arena, shms_arena_header, ring_offset) F(arena, shms_arena_header, ring_capacity)   \
  F(arena, shms_arena_header, rang_token) F(arena, shms_arena_header, enqueue_pos)      \
  F(arena, shms_arena_header, completions) F(arena, shms_arena_header, waiters)         \
  S(client_entry, shms_client_entry)                                                    \
  F(client_entry, shms_client_entry, state)                                             \
  F(client_entry, shms_client_entry, generation)                                        \
  F(client_entry, shms_client_entry, pid) F(client_entry, shms_client_entry, uid)       \
  F(client_entry, shms_client_entry, segment_bytes)                                     \
  F(client_entry, shms_client_entry, segment) F(client_entry, shms_client_entry, ring_pos) \
  S(tensor_spec, shms_tensor_spec)                                                      \
  F(tensor_spec, shms_tensor_spec, name) F(tensor_spec, shms_tensor_spec, dtype)        \
  F(tensor_spec, shms_tensor_spec, ndim) F(tensor_spec, shms_tensor_spec, dims)         \
  S(model, shms_model_entry)                                                            \
  F(model, shms_model_entry, name) F(model, shms_model_entry, version)                  \
  F(model, shms_model_entry, max_batch_size) F(model, shms_model_entry, n_inputs)       \
  F(model, shms_model_entry, n_outputs) F(model, shms_model_entry, ready)               \
  F(model, shms_model_entry, optional_inputs) F(model, shms_model_entry, generation)   \
  F(model, shms_model_entry, answer_turn) F(model, shms_model_entry, ragged_inputs)     \
  F(model, shms_model_entry, device_memory)                                             \
  S(cuda_ipc, shms_cuda_ipc)                                                            \
  F(cuda_ipc, shms_cuda_ipc, mem_handle) F(cuda_ipc, shms_cuda_ipc, event_handle)       \
  F(cuda_ipc, shms_cuda_ipc, offset) F(cuda_ipc, shms_cuda_ipc, device_uuid)            \
  F(cuda_ipc, shms_cuda_ipc, flags)                                                     \
  F(model, shms_model_entry, inputs) F(model, shms_model_entry, outputs)                \
  F(model, shms_model_entry, stats)                                                     \
  S(model_stats, shms_model_stats)                                                      \
  F(model_stats, shms_model_stats, inference_count)                                     \
  F(model_stats, shms_model_stats, execution_count)                                     \
  F(model_stats, shms_model_stats, last_inference_ms)                                   \
  F(model_stats, shms_model_stats, pending) F(model_stats, shms_model_stats, failures)  \
  F(model_stats, shms_model_stats, durations)                                           \
  F(model_stats, shms_model_stats, batch_requests)                                      \
  F(model_stats, shms_model_stats, batch_stats) F(model_stats, shms_model_stats, latency) \
  S(shadow, shms_shadow)                                                                \
  F(shadow, shms_shadow, client_id) F(shadow, shms_shadow, slot)                        \
  F(shadow, shms_shadow, generation) F(shadow, shms_shadow, lease)                      \
  F(shadow, shms_shadow, batch_rows) F(shadow, shms_shadow, taken_ns)                   \
  F(shadow, shms_shadow, sequence_slot)                                                 \
  F(shadow, shms_shadow, request)                                                       \
  S(mailbox, shms_mailbox)                                                              \
  F(mailbox, shms_mailbox, state) F(mailbox, shms_mailbox, worker_sleeping)             \
  F(mailbox, shms_mailbox, n) F(mailbox, shms_mailbox, pid)                             \
  F(mailbox, shms_mailbox, batcher_waiting) F(mailbox, shms_mailbox, attempt)           \
  F(mailbox, shms_mailbox, ticket) F(mailbox, shms_mailbox, order_waiting)              \
  F(mailbox, shms_mailbox, wakeups) F(mailbox, shms_mailbox, executions)                \
  F(mailbox, shms_mailbox, shadow) F(mailbox, shms_mailbox, next_n)                    \
  F(mailbox, shms_mailbox, next_shadow)                                                 \
  S(server, shms_server_header)                                                         \
  F(server, shms_server_header, magic) F(server, shms_server_header, version)           \
  F(server, shms_server_header, max_clients)                                            \
  F(server, shms_server_header, slots_per_client)                                       \
  F(server, shms_server_header, n_models) F(server, shms_server_header, n_workers)      \
  F(server, shms_server_header, table_epoch)                                            \
  F(server, shms_server_header, clients_offset)                                         \
  F(server, shms_server_header, models_offset)                                          \
  F(server, shms_server_header, shadows_offset)                                         \
  F(server, shms_server_header, mailboxes_offset)                                       \
  F(server, shms_server_header, segment_bytes)                                          \
  F(server, shms_server_header, drain_since_ns)                                         \
  F(server, shms_server_header, batcher_wakeups)

#endif /* SHMS_LAYOUT_H */
