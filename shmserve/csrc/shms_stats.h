/*
 * shms_stats.h — a model's statistics in the server segment (shms_model_stats):
 * what the batcher and the workers add as they go, in Triton's terms (durations
 * summed over requests, per-batch-size compute times, failures by reason), plus a
 * latency histogram per duration from which the coordinator reads quantiles.
 * Every update is a relaxed atomic add: a few per request, none on the client path.
 */
#ifndef SHMS_STATS_H
#define SHMS_STATS_H

#include "shms_layout.h"
#include "shms_wait.h"

/* Log-linear histogram bucket of a duration: exact below 8 ns, then 8 buckets per
 * power of two (a bucket is at most 1/8 of its lower bound wide, so a quantile read
 * from it is within 6 % of the true value), up to ~2^40 ns (18 min) in the last.
 * Lower bound of bucket b >= 8: (8 + b % 8) << (b / 8 - 1); width 1 << (b / 8 - 1). */
static inline uint32_t shms_latency_bucket(uint64_t ns) {
  if (ns < 8) return (uint32_t)ns;
  uint32_t e = 63u - (uint32_t)__builtin_clzll(ns); /* ns in [2^e, 2^(e+1)), e >= 3 */
  uint32_t b = (e - 2u) * 8u + (uint32_t)((ns >> (e - 3u)) & 7u);
  return b < SHMS_LATENCY_BUCKETS ? b : SHMS_LATENCY_BUCKETS - 1;
}

static inline uint64_t shms_wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* n requests that each took ns (a batch's compute stage counts once per request). */
static inline void shms_stats_add(shms_model_stats *st, uint32_t kind, uint64_t ns, uint64_t n) {
  if (kind >= SHMS_DUR_COUNT || n == 0) return;
  shms_fetch_add(&st->durations[kind].count, n, memory_order_relaxed);
  shms_fetch_add(&st->durations[kind].ns, ns * n, memory_order_relaxed);
  shms_fetch_add(&st->latency[kind][shms_latency_bucket(ns)], n, memory_order_relaxed);
}

/* Why a request answered with this status failed (nv_inference_request_failure). */
static inline uint32_t shms_failure_reason(int32_t status) {
  switch (status) {
    case SHMS_ERR_BUSY: return SHMS_FAIL_REJECTED;
    case SHMS_ERR_INTERNAL: return SHMS_FAIL_BACKEND;
    case SHMS_ERR_UNAVAILABLE: return SHMS_FAIL_BACKEND; /* the instance died or retired */
    default: return SHMS_FAIL_OTHER;
  }
}

/* A request answered after took_ns (from the batcher taking it off the ring). */
static inline void shms_stats_answered(shms_model_stats *st, int32_t status, uint32_t reason,
                                       uint64_t took_ns) {
  if (status == SHMS_OK) {
    shms_stats_add(st, SHMS_DUR_SUCCESS, took_ns, 1);
    return;
  }
  if (reason >= SHMS_FAIL_COUNT) reason = shms_failure_reason(status);
  shms_fetch_add(&st->failures[reason], 1u, memory_order_relaxed);
  shms_stats_add(st, SHMS_DUR_FAIL, took_ns, 1);
}

/* One model execution of n requests and rows rows, timed in three stages. */
static inline void shms_stats_execution(shms_model_stats *st, uint32_t n, uint32_t rows,
                                        uint64_t input_ns, uint64_t infer_ns,
                                        uint64_t output_ns) {
  shms_fetch_add(&st->execution_count, 1u, memory_order_relaxed);
  shms_fetch_add(&st->inference_count, rows, memory_order_relaxed);
  if (n > 0)
    shms_fetch_add(&st->batch_requests[(n < SHMS_BATCH_HIST ? n : SHMS_BATCH_HIST) - 1], 1u,
                   memory_order_relaxed);
  shms_stats_add(st, SHMS_DUR_COMPUTE_INPUT, input_ns, n);
  shms_stats_add(st, SHMS_DUR_COMPUTE_INFER, infer_ns, n);
  shms_stats_add(st, SHMS_DUR_COMPUTE_OUTPUT, output_ns, n);
  if (rows > 0) {
    shms_batch_stat *b = &st->batch_stats[(rows < SHMS_BATCH_STATS ? rows : SHMS_BATCH_STATS) - 1];
    shms_duration *stage[3] = {&b->compute_input, &b->compute_infer, &b->compute_output};
    uint64_t took[3] = {input_ns, infer_ns, output_ns};
    for (int i = 0; i < 3; i++) {
      shms_fetch_add(&stage[i]->count, 1u, memory_order_relaxed);
      shms_fetch_add(&stage[i]->ns, took[i], memory_order_relaxed);
    }
  }
  shms_store(&st->last_inference_ms, shms_wall_ms(), memory_order_relaxed);
}

#endif /* SHMS_STATS_H */
