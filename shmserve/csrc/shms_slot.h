/*
 * shms_slot.h — part of shmserve.h (include that): the life of a request slot, as
 * every language runs it. A client fills and submits a slot and pushes its entry on
 * the ring (shms_push_request), then reads the answer; a worker (or the batcher, for
 * an error) completes it; the batcher hands batches to workers through mailboxes.
 * The Python extension and the C++ client both call these; nobody re-implements them.
 */
#ifndef SHMS_SLOT_H
#define SHMS_SLOT_H

#include <stdio.h>
#include <string.h>

#include "shms_layout.h"
#include "shms_request.h" /* shms_copy_name */
#include "shms_ring.h"
#include "shms_wait.h"

/* ------------------------------------------------------------- client side */

/* A push whose claim the batcher skipped (RECLAIMED) is retried up to this many
 * times; a FULL ring (a client's ring holds an entry for each of its slots, so it is
 * full only if the client itself broke it) is retried for up to
 * SHMS_PUSH_FULL_WAIT_NS while the batcher repairs it. */
#define SHMS_PUSH_MAX_TRIES 100
#define SHMS_PUSH_FULL_WAIT_NS 100000000LL
#define SHMS_PUSH_LEASE_CHECK_EVERY 8 /* RECLAIMED pushes between lease checks */

/* Client: starts a request in a FREE slot and returns the request to fill in place
 * (model_id, counts and tensor refs; options, zeroed here, if it uses any). */
static inline shms_request *shms_slot_begin(shms_slot *s) {
  s->t_ns[SHMS_T_CLIENT_WRITE] = shms_now_ns();
  /* The options default to 0 ("the model's default", "none"): the rest of the header. */
  memset(&s->request.flags, 0, offsetof(shms_request, inputs) - offsetof(shms_request, flags));
  return &s->request;
}

/* Client: publishes the request filled since shms_slot_begin as generation gen.
 * The caller pushes its ring entry next (shms_push_request).
 * SYNC POINT: the release store of SUBMITTED pairs with the batcher's CAS
 * SUBMITTED -> QUEUED in shms_take_request. */
static inline void shms_slot_submit(shms_slot *s, uint32_t gen) {
  uint64_t t0 = s->t_ns[SHMS_T_CLIENT_WRITE];
  s->request.reserved = 0;
  s->generation = gen;
  s->status = -1;
  s->n_results = 0;
  s->error[0] = 0;
  s->response_index = 0;
  s->response_flags = 0;
  shms_store(&s->cancel, 0u, memory_order_relaxed);
  shms_store(&s->stream_sleeping, 0u, memory_order_relaxed);
  memset(s->t_ns, 0, sizeof s->t_ns);
  s->t_ns[SHMS_T_CLIENT_WRITE] = t0;
  s->t_ns[SHMS_T_ENQUEUE] = shms_now_ns();
  shms_store(&s->state, (uint32_t)SHMS_SLOT_SUBMITTED, memory_order_release);
}

/* What a client pushes with: its submission ring (in its arena), and what it rings
 * the batcher with. */
typedef struct shms_submitter {
  shms_ring ring;
  SHMS_ATOMIC(uint32_t) *doorbell;         /* bell.doorbell */
  SHMS_ATOMIC(uint32_t) *batcher_sleeping; /* control.batcher_sleeping (read-only) */
  SHMS_ATOMIC(uint32_t) *rang_token;       /* arena.rang_token */
} shms_submitter;

/* Client: fixes a submitter from its three mappings (the arena already checked by
 * shms_ring_attach into sub->ring). */
static inline void shms_submitter_bells(shms_submitter *sub, void *control, void *bell,
                                        void *arena) {
  sub->doorbell = &((shms_bell *)bell)->doorbell;
  sub->batcher_sleeping = &((shms_control *)control)->batcher_sleeping;
  sub->rang_token = &((shms_arena_header *)arena)->rang_token;
}

/* Client: one attempt of shms_push_request: pushes (owner, slot, gen) on its ring and
 * rings the batcher. A caller that must not block may try this first, and call
 * shms_push_request (the retries) only when it did not return SHMS_RING_OK. */
static inline int shms_push_request_once(const shms_submitter *sub, uint32_t owner,
                                         uint32_t slot, uint32_t gen) {
  int rc = shms_ring_push(&sub->ring, owner, slot, gen);
  /* SYNC POINT: wakes the batcher sleeping in shms_doorbell_wait_x on bell.doorbell. */
  shms_doorbell_ring_client(sub->doorbell, sub->batcher_sleeping, sub->rang_token);
  return rc;
}

/* Client: pushes (owner, slot, gen) on its ring and rings the batcher, retrying as
 * docs/protocol.md section 5.1 says. lease_alive(ctx) is asked every
 * SHMS_PUSH_LEASE_CHECK_EVERY skipped pushes; when it returns 0 the push stops.
 * Returns SHMS_RING_OK, SHMS_RING_FULL (still full after the wait),
 * SHMS_RING_RECLAIMED (skipped SHMS_PUSH_MAX_TRIES times), or -1 (lease ended). */
static inline int shms_push_request(const shms_submitter *sub, uint32_t owner, uint32_t slot,
                                    uint32_t gen, int (*lease_alive)(void *), void *ctx) {
  uint64_t full_since = 0;
  int rc = SHMS_RING_FULL;
  for (int attempt = 0; attempt < SHMS_PUSH_MAX_TRIES; attempt++) {
    rc = shms_push_request_once(sub, owner, slot, gen);
    if (rc == SHMS_RING_OK) return rc;
    if (rc == SHMS_RING_RECLAIMED && attempt % SHMS_PUSH_LEASE_CHECK_EVERY ==
                                         SHMS_PUSH_LEASE_CHECK_EVERY - 1 &&
        lease_alive && !lease_alive(ctx))
      return -1;
    if (rc == SHMS_RING_FULL) {
      uint64_t now = shms_now_ns();
      if (!full_since) full_since = now;
      if ((int64_t)(now - full_since) >= SHMS_PUSH_FULL_WAIT_NS) return rc;
      struct timespec ms = {0, 1000000};
      nanosleep(&ms, NULL);
    }
  }
  return rc;
}

/* Client: takes back a request whose push failed. Returns 1 if the slot is FREE
 * again; 0 if the batcher took it meanwhile (its sweep takes SUBMITTED requests the
 * ring lost): then it is in flight and will be answered. */
static inline int shms_slot_withdraw(shms_slot *s) {
  uint32_t expected = SHMS_SLOT_SUBMITTED;
  return shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_FREE) ? 1 : 0;
}

/* A DONE slot's answer as the client reads it: status, message, results. */
typedef struct shms_answer {
  int32_t status;
  uint32_t response_index; /* STREAM: which response (0, 1, ...) */
  uint32_t response_flags; /* SHMS_RESPONSE_FINAL (always, once DONE) | SHMS_RESPONSE_EMPTY */
  uint32_t n_results; /* 0 unless OK or OUTPUT_TOO_SMALL; at most SHMS_MAX_TENSORS */
  const shms_tensor_ref *results;
  char error[SHMS_ERROR_BYTES]; /* NUL-terminated */
  uint64_t t_ns[SHMS_T_COUNT];  /* the slot's timestamps; CLIENT_WAKE is the reader's */
} shms_answer;

static inline int shms_slot_is_done(shms_slot *s) {
  return shms_load(&s->state, memory_order_acquire) == SHMS_SLOT_DONE;
}

/* Client: reads a DONE slot's answer; returns 0 if the slot is not DONE yet.
 * SYNC POINT: the acquire load pairs with the release store of DONE in
 * shms_slot_complete. */
static inline void shms_slot_copy_answer(shms_slot *s, shms_answer *a);

static inline int shms_slot_read_answer(shms_slot *s, shms_answer *a) {
  if (!shms_slot_is_done(s)) return 0;
  shms_slot_copy_answer(s, a);
  return 1;
}

/* The answer (or response) the slot holds now; the caller's acquire load of the state
 * came first. */
static inline void shms_slot_copy_answer(shms_slot *s, shms_answer *a) {
  a->status = s->status;
  a->response_index = s->response_index;
  a->response_flags = s->response_flags;
  a->n_results = s->status == SHMS_OK || s->status == SHMS_ERR_OUTPUT_TOO_SMALL
                     ? (s->n_results < SHMS_MAX_TENSORS ? s->n_results : SHMS_MAX_TENSORS)
                     : 0;
  a->results = s->results;
  shms_copy_name(a->error, sizeof a->error, s->error, sizeof s->error);
  memcpy(a->t_ns, s->t_ns, sizeof a->t_ns);
  a->t_ns[SHMS_T_CLIENT_WAKE] = shms_now_ns();
}

/* Client: gives a slot whose answer it has read back to itself (DONE -> FREE).
 * SYNC POINT: release, so the server's next view of the slot follows our reads. */
static inline void shms_slot_release(shms_slot *s) {
  shms_store(&s->state, (uint32_t)SHMS_SLOT_FREE, memory_order_release);
}

/* Client, STREAM: reads a RESPONSE the worker published (returns 0 if the slot holds
 * none); the caller copies its outputs out, then hands the slot back
 * (shms_slot_hand_back) so the worker may write the next one.
 * SYNC POINT: the acquire load pairs with the release store of RESPONSE in
 * shms_slot_respond. */
static inline int shms_slot_read_response(shms_slot *s, shms_answer *a) {
  if (shms_load(&s->state, memory_order_acquire) != SHMS_SLOT_RESPONSE) return 0;
  shms_slot_copy_answer(s, a);
  return 1;
}

/* Client, STREAM: RESPONSE -> RUNNING once the response is read, waking the worker
 * that waits to write the next. Returns 0 if the slot was not RESPONSE.
 * SYNC POINT: the CAS (seq_cst) pairs with the worker's doorbell wait on state; the
 * load of stream_sleeping after it with the worker's store before it sleeps. */
static inline int shms_slot_hand_back(shms_slot *s) {
  uint32_t expected = SHMS_SLOT_RESPONSE;
  if (!shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_RUNNING)) return 0;
  if (shms_load(&s->stream_sleeping, memory_order_seq_cst)) shms_futex_wake(&s->state, 1);
  return 1;
}

/* Client, STREAM: asks the model to stop (its is_cancelled() reads the word) and hands
 * back a response it will not read. The request stays in flight until its final
 * response (DONE): the caller keeps slot and buffers until then. */
static inline void shms_slot_cancel(shms_slot *s) {
  shms_store(&s->cancel, 1u, memory_order_seq_cst);
  if (!shms_slot_hand_back(s) && shms_load(&s->stream_sleeping, memory_order_seq_cst))
    shms_futex_wake(&s->state, 1); /* a worker waiting for a hand-back looks again */
}

/* ------------------------------------------------------------- server side */

/* Worker: QUEUED -> RUNNING if the slot still holds generation gen. With again (a
 * successor re-running its dead predecessor's batch), RUNNING -> RUNNING too: the
 * predecessor may have died before or after its own transition. Returns 1 if the
 * request is ours to run. */
static inline int shms_slot_set_running(shms_slot *s, uint32_t gen, int again) {
  if (s->generation != gen) return 0;
  uint32_t expected = SHMS_SLOT_QUEUED;
  int ok = shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_RUNNING);
  if (!ok && again) {
    expected = SHMS_SLOT_RUNNING;
    ok = shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_RUNNING);
  }
  if (ok) s->t_ns[SHMS_T_COMPUTE_START] = shms_now_ns(); /* only a slot that is ours */
  return ok;
}

/* Server: answers the request of generation gen in slot s, unless the slot moved on
 * (another generation, already DONE, or FREE). Returns 1 if the client was answered.
 * SYNC POINT: the release store of DONE pairs with the client's acquire load in
 * shms_slot_read_answer; the doorbell pairs with the client's wait on completions. */
static inline void shms_slot_write_answer(shms_slot *s, int32_t status, const char *message,
                                          const shms_tensor_ref *results, uint32_t n_results,
                                          uint32_t index, uint32_t flags) {
  if (n_results > SHMS_MAX_TENSORS) n_results = SHMS_MAX_TENSORS;
  if (n_results) memcpy(s->results, results, sizeof(shms_tensor_ref) * n_results);
  s->n_results = n_results;
  s->status = status;
  s->response_index = index;
  s->response_flags = flags;
  snprintf(s->error, sizeof s->error, "%s", message ? message : "");
  s->t_ns[SHMS_T_COMPLETE] = shms_now_ns();
}

/* shms_slot_complete with the stream words: the final response is number `index`;
 * flags SHMS_RESPONSE_EMPTY when the final flag came without a response. A RESPONSE
 * the caller has not handed back is replaced (it cancelled, or left). */
static inline int shms_slot_complete_x(shms_slot *s, shms_arena_header *h, uint32_t gen,
                                       int32_t status, const char *message,
                                       const shms_tensor_ref *results, uint32_t n_results,
                                       uint32_t index, uint32_t flags) {
  uint32_t st = shms_load(&s->state, memory_order_acquire);
  if (s->generation != gen || st == SHMS_SLOT_DONE || st == SHMS_SLOT_FREE) return 0;
  shms_slot_write_answer(s, status, message, results, n_results, index,
                         SHMS_RESPONSE_FINAL | (flags & SHMS_RESPONSE_EMPTY));
  shms_store(&s->state, (uint32_t)SHMS_SLOT_DONE, memory_order_release);
  shms_doorbell_ring(&h->completions, &h->waiters, INT32_MAX);
  return 1;
}

static inline int shms_slot_complete(shms_slot *s, shms_arena_header *h, uint32_t gen,
                                     int32_t status, const char *message,
                                     const shms_tensor_ref *results, uint32_t n_results) {
  return shms_slot_complete_x(s, h, gen, status, message, results, n_results, 0, 0);
}

/* Worker, STREAM: publishes response number `index` (not the final one) of the request
 * of generation gen: RUNNING -> RESPONSE. Returns 1 if published; 0 if the slot is not
 * RUNNING with that generation (the previous response is not handed back yet, or the
 * caller left): the worker waits for the hand-back (doorbell wait on state, with
 * stream_sleeping) before it writes outputs for the next response.
 * SYNC POINT: the release store of RESPONSE pairs with the client's acquire load in
 * shms_slot_read_response; the doorbell wakes it as for DONE. */
static inline int shms_slot_respond(shms_slot *s, shms_arena_header *h, uint32_t gen,
                                    int32_t status, const char *message,
                                    const shms_tensor_ref *results, uint32_t n_results,
                                    uint32_t index) {
  if (s->generation != gen || shms_load(&s->state, memory_order_acquire) != SHMS_SLOT_RUNNING)
    return 0;
  shms_slot_write_answer(s, status, message, results, n_results, index, 0);
  shms_store(&s->state, (uint32_t)SHMS_SLOT_RESPONSE, memory_order_release);
  shms_doorbell_ring(&h->completions, &h->waiters, INT32_MAX);
  return 1;
}

/* Batcher: hands a batch (shadow indices) to an IDLE worker's mailbox and wakes it.
 * SYNC POINT: the seq_cst store of ASSIGNED pairs with the worker's doorbell_wait
 * on mailbox.state; n, attempt and shadow[] are written before it. */
static inline void shms_mailbox_assign(shms_mailbox *mb, const uint32_t *shadows, uint32_t n) {
  if (n > SHMS_MAX_BATCH_REQUESTS) n = SHMS_MAX_BATCH_REQUESTS;
  memcpy(mb->shadow, shadows, sizeof(uint32_t) * n);
  mb->n = n;
  mb->attempt = 0;
  shms_store(&mb->state, (uint32_t)SHMS_MAILBOX_ASSIGNED, memory_order_seq_cst);
  if (shms_load(&mb->worker_sleeping, memory_order_seq_cst)) shms_futex_wake(&mb->state, 1);
}

/* Two batches deep (docs/architecture.md): while a worker runs its batch, the batcher
 * may give it the next (ASSIGNED_NEXT) and add requests to that one until the worker
 * takes it (EDITING, held by the batcher for the append); the worker moves it into
 * place when done (PROMOTING, held by the worker). Only the batcher leaves IDLE or
 * ASSIGNED for a busier state; only the worker goes back. */

/* Worker, holding PROMOTING: the next batch becomes its batch. next_n is left as it is,
 * so that a successor of a worker that died here can do it again. */
static inline void shms_mailbox_promote(shms_mailbox *mb) {
  uint32_t n = mb->next_n < SHMS_MAX_BATCH_REQUESTS ? mb->next_n : SHMS_MAX_BATCH_REQUESTS;
  memcpy(mb->shadow, mb->next_shadow, sizeof(uint32_t) * n);
  mb->n = n;
  mb->attempt = 0;
  mb->ticket = 0;
  /* SYNC POINT: the seq_cst store of ASSIGNED pairs with the batcher's loads of the
   * state (shms_mailbox_put, dispatch): the next batch's area is free again. */
  shms_store(&mb->state, (uint32_t)SHMS_MAILBOX_ASSIGNED, memory_order_seq_cst);
}

/* Batcher: places a batch with a worker that may be busy. append: the batcher saw a
 * next batch there, which these requests join (same shape key, room checked). Returns
 * 0: the mailbox was idle and this is its batch (shms_mailbox_assign, which wakes the
 * worker); 1: this is its next batch; 2: joined the next batch; -1: not placed (a
 * next batch the caller did not know of, or no room: the caller's bug). */
static inline int shms_mailbox_put(shms_mailbox *mb, const uint32_t *shadows, uint32_t n,
                                   int append) {
  if (n > SHMS_MAX_BATCH_REQUESTS) return -1;
  for (;;) {
    uint32_t seen = shms_load(&mb->state, memory_order_seq_cst);
    if (seen == SHMS_MAILBOX_IDLE) {
      shms_mailbox_assign(mb, shadows, n);
      return 0;
    }
    if (seen == SHMS_MAILBOX_ASSIGNED) {
      memcpy(mb->next_shadow, shadows, sizeof(uint32_t) * n);
      mb->next_n = n;
      /* SYNC POINT: the CAS pairs with the worker's CAS in shms_mailbox_finish: either
       * the worker sees the next batch, or we see it idle and assign. */
      if (shms_cas(&mb->state, &seen, (uint32_t)SHMS_MAILBOX_ASSIGNED_NEXT)) return 1;
      continue;
    }
    if (seen == SHMS_MAILBOX_ASSIGNED_NEXT) {
      if (!append) return -1;
      if (!shms_cas(&mb->state, &seen, (uint32_t)SHMS_MAILBOX_EDITING)) continue;
      uint32_t have = mb->next_n;
      int placed = have + n <= SHMS_MAX_BATCH_REQUESTS;
      if (placed) {
        memcpy(mb->next_shadow + have, shadows, sizeof(uint32_t) * n);
        mb->next_n = have + n;
      }
      shms_store(&mb->state, (uint32_t)SHMS_MAILBOX_ASSIGNED_NEXT, memory_order_seq_cst);
      return placed ? 2 : -1;
    }
    /* PROMOTING: the worker is moving the next batch into place (a few stores; a
     * successor repeats it if the worker died there). EDITING here is a batcher that
     * died mid-append (this one's recovery repairs it before serving). */
    sched_yield();
  }
}

/* Worker: its batch is done. Returns 1 when a next batch waited and is now its batch
 * (run it at once), 0 when the mailbox went IDLE. */
static inline int shms_mailbox_finish(shms_mailbox *mb) {
  for (;;) {
    uint32_t seen = SHMS_MAILBOX_ASSIGNED;
    /* SYNC POINT: pairs with the batcher's CAS in shms_mailbox_put, and the store of
     * IDLE with its seq_cst loads of the state (dispatch). */
    if (shms_cas(&mb->state, &seen, (uint32_t)SHMS_MAILBOX_IDLE) ||
        seen == SHMS_MAILBOX_IDLE)
      return 0;
    if (seen == SHMS_MAILBOX_ASSIGNED_NEXT &&
        !shms_cas(&mb->state, &seen, (uint32_t)SHMS_MAILBOX_PROMOTING))
      continue;
    if (seen == SHMS_MAILBOX_ASSIGNED_NEXT || seen == SHMS_MAILBOX_PROMOTING) {
      shms_mailbox_promote(mb); /* PROMOTING seen: a predecessor died promoting */
      return 1;
    }
    sched_yield(); /* EDITING: the batcher is adding requests to the next batch */
  }
}

/* Worker: the shadow indices of the batch in its mailbox (at most
 * SHMS_MAX_BATCH_REQUESTS, whatever n says). */
static inline uint32_t shms_mailbox_batch(const shms_mailbox *mb, const uint32_t **shadows) {
  *shadows = mb->shadow;
  return mb->n < SHMS_MAX_BATCH_REQUESTS ? mb->n : SHMS_MAX_BATCH_REQUESTS;
}

#endif /* SHMS_SLOT_H */
