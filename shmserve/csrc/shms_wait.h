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

#endif /* SHMS_WAIT_H */
