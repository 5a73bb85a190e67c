/*
 * shms_wait.h — part of shmserve.h (include that): the clock of every timestamp,
 * futex waits and doorbells (a counter word plus a "sleeping" word, so that a ring
 * costs a syscall only when somebody may sleep).
 */
#ifndef SHMS_WAIT_H
#define SHMS_WAIT_H

#include "shms_layout.h"

#ifdef __linux__
#include <errno.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

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

/* How many waiters a ring of the batcher's bell wakes: all. The batcher is its only
 * honest waiter, so this costs nothing more; but any client can FUTEX_WAIT on a word
 * it maps, and a wake-up of one waiter (the oldest) would go to such a thief. */
#define SHMS_BELL_WAKE_ALL INT32_MAX

/* Ring the doorbell of a sole waiter (the batcher's: shms_doorbell_wait_x with a
 * token): the first ring after it fell asleep takes its token back to 0 and wakes it;
 * the rings after that find 0 and make no system call, so a burst of pushes costs one
 * FUTEX_WAKE, not one each until the batcher runs.
 * SYNC POINT: pairs with shms_doorbell_wait_x. The ringer that takes the token moves
 * the word once more before it wakes: the sleep it cleared read its `seen` before
 * storing the token, so that move ends it (the futex wait fails or is woken) even
 * when our first move came before that `seen` and the sleep would otherwise go on
 * with no token (and no later push would wake it). A ringer whose CAS fails read the
 * token of a sleep that had ended; the waiter reads the word after our first move
 * before it sleeps again. Tokens differ between sleeps (shms_py_sleep_token), so such
 * a ringer cannot clear a later sleep's. */
static inline void shms_doorbell_ring_sole(SHMS_ATOMIC(uint32_t) * word,
                                           SHMS_ATOMIC(uint32_t) * sleeping) {
  shms_fetch_add(word, 1u, memory_order_seq_cst);
  uint32_t token = shms_load(sleeping, memory_order_seq_cst);
  if (token && shms_cas(sleeping, &token, 0u)) {
    shms_fetch_add(word, 1u, memory_order_seq_cst);
    shms_futex_wake(word, SHMS_BELL_WAKE_ALL);
  }
}

/* A client rings the batcher (docs/protocol.md section 8, "Client: pushing"). The
 * sleep token is in the control block, which clients map read-only, so a client
 * cannot clear it for others; instead each client keeps the last token it woke in
 * its own arena (rang): the first ring of a client after the batcher fell asleep
 * moves the word once more and wakes it, the others of that client's burst find
 * the token theirs already and make no system call.
 * SYNC POINT: pairs with shms_doorbell_wait_x, as shms_doorbell_ring_sole: a ringer
 * that read token T of a sleep moves the word after that sleep stored T, hence after
 * it read its `seen`, which ends it; a ringer that finds T already its own follows
 * one of its client's that did that (or is about to), and the batcher reads the
 * word after this ringer's first move before it sleeps again. Tokens differ from one
 * sleep to the next, so an old `rang` never silences a new sleep. */
static inline void shms_doorbell_ring_client(SHMS_ATOMIC(uint32_t) * word,
                                             SHMS_ATOMIC(uint32_t) * sleeping,
                                             SHMS_ATOMIC(uint32_t) * rang) {
  shms_fetch_add(word, 1u, memory_order_seq_cst);
  uint32_t token = shms_load(sleeping, memory_order_seq_cst);
  if (!token) return;
  uint32_t mine = shms_load(rang, memory_order_relaxed);
  if (mine != token && shms_cas(rang, &mine, token)) {
    shms_fetch_add(word, 1u, memory_order_seq_cst);
    shms_futex_wake(word, SHMS_BELL_WAKE_ALL);
  }
}

/* A yield that kept us off the CPU longer than this: another runnable process had it
 * (on a quiet core sched_yield returns in about a microsecond; with a CPU-bound
 * neighbour it gives away a scheduler slice, a millisecond or more). Spinning then
 * takes CPU from that process, maybe the very one we wait for, and keeps us from the
 * wake-up preemption a sleeper gets: sleep instead. */
#define SHMS_SPIN_PREEMPTED_NS 50000

/* A yield that kept us off the CPU this long lost a whole scheduler slice to a
 * neighbour (slices are 0.7 ms and more): spinning does not pay on this CPU, and the
 * waiter's policy stops it for a while (shms_spin_outcome). Shorter preemptions are
 * mostly the server's own processes doing a request's work on a small machine, which
 * cut one spin but are no reason to stop spinning. */
#define SHMS_SPIN_LOST_SLICE_NS 250000

/* Wait until *word != seen: spin spin_ns first, then sleep on the futex (at most
 * timeout_ns in all, <0 forever). The spin ends early when a yield was preempted
 * (SHMS_SPIN_PREEMPTED_NS); *preempted (if not NULL) says whether a yield lost a
 * whole slice (SHMS_SPIN_LOST_SLICE_NS).
 * Returns SHMS_WAKE_SPIN (1) if the word moved while spinning, SHMS_WAKE_SLEEP (2) if
 * after sleeping (for a sole waiter also when woken with the word back where it was),
 * SHMS_WAKE_TIMEOUT (0) on timeout.
 * *sleeping counts the sleepers (a client's threads on its arena); with a nonzero
 * sole token, the caller is the word's only waiter (the batcher on bell.doorbell, its
 * token in control.batcher_sleeping) and stores the token there while it sleeps,
 * then 0. The token must differ from the last sleep's (shms_doorbell_ring_sole,
 * shms_doorbell_ring_client). */
static inline int shms_doorbell_wait_x(SHMS_ATOMIC(uint32_t) * word,
                                       SHMS_ATOMIC(uint32_t) * sleeping, uint32_t seen,
                                       int64_t spin_ns, int64_t timeout_ns, int *preempted,
                                       uint32_t sole) {
  uint64_t start = shms_now_ns(), last = start;
  if (preempted) *preempted = 0;
  for (;;) {
    uint64_t now = shms_now_ns();
    int64_t off = (int64_t)(now - last); /* how long the last yield kept us off the CPU */
    /* judged before the word: a yield that lost a slice counts even when the word
     * moved meanwhile (an answer arriving while a neighbour ran is the common case) */
    if (off > SHMS_SPIN_LOST_SLICE_NS && preempted) *preempted = 1;
    if (shms_load(word, memory_order_acquire) != seen) return 1;
    if (off > SHMS_SPIN_PREEMPTED_NS || (int64_t)(now - start) >= spin_ns) break;
    /* Yield rather than pause: on a machine with few cores the process we wait for
     * may need this very CPU. */
    sched_yield();
    last = now;
  }
  /* A sole waiter's token stays for the whole wait, spurious wake-ups included: the
   * ringer that clears it moves the word after clearing, which ends the wait. */
  if (sole) shms_store(sleeping, sole, memory_order_seq_cst);
  int rung = 0;
  for (;;) {
    int64_t left = -1;
    if (timeout_ns >= 0) {
      left = timeout_ns - (int64_t)(shms_now_ns() - start);
      if (left <= 0) break;
    }
    if (!sole) shms_fetch_add(sleeping, 1u, memory_order_seq_cst);
    int woken = shms_load(word, memory_order_seq_cst) == seen &&
                shms_futex_wait(word, seen, left) == 0;
    if (!sole) shms_fetch_add(sleeping, (uint32_t)-1, memory_order_seq_cst);
    if (shms_load(word, memory_order_acquire) != seen) break;
    /* A sole waiter woken (or its word moved at the call) and the word back at `seen`:
     * a ring whose moves somebody undid (the batcher's word is on a page every client
     * writes). Go and look rather than sleep through the pushes that rang. */
    if (sole && woken) {
      rung = 1;
      break;
    }
  }
  if (sole) shms_store(sleeping, 0u, memory_order_seq_cst);
  return rung || shms_load(word, memory_order_acquire) != seen ? 2 : 0;
}

static inline int shms_doorbell_wait(SHMS_ATOMIC(uint32_t) * word,
                                     SHMS_ATOMIC(uint32_t) * sleeping, uint32_t seen,
                                     int64_t spin_ns, int64_t timeout_ns) {
  return shms_doorbell_wait_x(word, sleeping, seen, spin_ns, timeout_ns, NULL, 0);
}
#endif /* __linux__ */

/* ------------------------------------------------------------- adaptive spinning */

/* How long a waiter spins before it sleeps. A futex wake-up costs 10-30 us on small
 * virtual machines (the hypervisor must wake an idle vCPU), more than a whole round
 * trip. A waiter therefore spins (yielding, see shms_doorbell_wait) for about as long
 * as its recent waits lasted, so a steady stream of requests never pays for a
 * wake-up, and falls back to the base spin when waits grow long, so an idle process
 * sleeps at once and uses no CPU. On a contended machine spinning costs others their
 * CPU and gains nothing (the spinner is not running when the word moves): a wait whose
 * spin was preempted turns spinning off for the next SHMS_SPIN_BACKOFF_WAITS waits,
 * after which one spin probes again. That detection sees only a spinner that loses
 * the CPU; one in its own scheduling group (a server started in its own session)
 * rarely does and takes the CPU from the others instead. So the coordinator also
 * watches the machine (shmserve/server/cpu_watch.py) and raises a `crowded` word
 * while other work leaves no CPU idle: a waiter that watches it does not spin then.
 * Every waiter of every language uses this one policy (shms_spin_wait). */
#define SHMS_SPIN_BACKOFF_WAITS 256

typedef struct shms_spin {
  int64_t base_ns;    /* spin at least this long (0: never spin) */
  int64_t max_ns;     /* ... and at most this long */
  int64_t typical_ns; /* exponential average of recent waits */
  int64_t backoff;    /* waits left without spinning: the last spin was preempted */
  uint64_t preempted; /* spins cut short by preemption, ever (for statistics) */
  /* control.crowded, NULL: not watched. Nonzero: do not spin. */
  SHMS_ATOMIC(uint32_t) * crowded;
} shms_spin;

static inline shms_spin shms_spin_make(int64_t base_ns, int64_t max_ns) {
  shms_spin s;
  s.base_ns = base_ns > 0 ? base_ns : 0;
  s.max_ns = s.base_ns && max_ns > s.base_ns ? max_ns : s.base_ns;
  s.typical_ns = s.base_ns;
  s.backoff = 0;
  s.preempted = 0;
  s.crowded = NULL;
  return s;
}

/* The spin to use for the next wait. */
static inline int64_t shms_spin_budget(const shms_spin *s) {
  if (s->backoff > 0) return 0;
  if (s->crowded && shms_load(s->crowded, memory_order_relaxed)) return 0;
  if (s->base_ns == 0 || s->typical_ns > s->max_ns) return s->base_ns;
  int64_t b = s->typical_ns * 3 / 2;
  return b < s->base_ns ? s->base_ns : b > s->max_ns ? s->max_ns : b;
}

/* Feeds one observed wait (1/8 weight). */
static inline void shms_spin_record(shms_spin *s, int64_t waited_ns) {
  s->typical_ns += (waited_ns - s->typical_ns) / 8;
}

/* Feeds how the last wait's spin went: preempted, spinning stops for a while. */
static inline void shms_spin_outcome(shms_spin *s, int preempted) {
  if (preempted) {
    s->backoff = SHMS_SPIN_BACKOFF_WAITS;
    s->preempted++;
  } else if (s->backoff > 0) {
    s->backoff--;
  }
}

#ifdef __linux__
/* One wait under the policy: spin its budget, sleep, learn from it. A wait that
 * spun nothing (budget 0) counts down the backoff. Returns as shms_doorbell_wait. */
static inline int shms_spin_wait(shms_spin *s, SHMS_ATOMIC(uint32_t) * word,
                                 SHMS_ATOMIC(uint32_t) * sleeping, uint32_t seen,
                                 int64_t timeout_ns, uint32_t sole) {
  uint64_t start = shms_now_ns();
  int preempted = 0;
  int how = shms_doorbell_wait_x(word, sleeping, seen, shms_spin_budget(s), timeout_ns,
                                 &preempted, sole);
  if (how) shms_spin_record(s, (int64_t)(shms_now_ns() - start));
  shms_spin_outcome(s, preempted);
  return how;
}
#endif

#endif /* SHMS_WAIT_H */
