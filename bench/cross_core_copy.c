/*
 * cross_core_copy: what a 1 MiB copy costs when it reads lines another core just
 * wrote, as shmserve's two copies of a 1 MiB identity request do (caller -> arena,
 * worker: arena input -> arena output), against the same copies on one core
 * (docs/architecture.md, "One request").
 *
 *   gcc -O2 -mavx2 bench/cross_core_copy.c -o /tmp/cross_core_copy
 *   /tmp/cross_core_copy            # memcpy everywhere
 *   /tmp/cross_core_copy 1 1        # non-temporal stores for the copy in / the copy out
 *
 * Process A (CPU 0) copies a private 1 MiB buffer into shared "in", process B (CPU 1)
 * copies "in" to shared "out", A copies "out" back into a private buffer: three
 * copies per round, each reading what the other core wrote. Needs 2 CPUs.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define N (1 << 20)
#define ROUNDS 2000

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* memcpy with non-temporal stores; both buffers 32-byte aligned, n a multiple of 128 */
static void stream_copy(void *dst, const void *src, size_t n) {
  __m256i *d = dst;
  const __m256i *s = src;
  for (size_t i = 0; i < n / 32; i++) _mm256_stream_si256(d + i, _mm256_load_si256(s + i));
  _mm_sfence();
}

static void copy(int streaming, void *dst, const void *src) {
  if (streaming) stream_copy(dst, src, N);
  else memcpy(dst, src, N);
}

static void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

static int by_value(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  int stream_in = argc > 1 && atoi(argv[1]), stream_out = argc > 2 && atoi(argv[2]);
  char *shared = mmap(NULL, 2 * N + 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return 1;
  char *in = shared, *out = shared + N;
  atomic_int *turn = (atomic_int *)(shared + 2 * N); /* 1: B copies, 2: A reads back */
  memset(shared, 1, 2 * N);
  pid_t b = fork();
  if (b == 0) {
    pin(1);
    for (int i = 0; i < ROUNDS; i++) {
      while (atomic_load(turn) != 1) {}
      copy(stream_out, out, in);
      atomic_store(turn, 2);
    }
    _exit(0);
  }
  pin(0);
  char *src = aligned_alloc(64, N), *dst = aligned_alloc(64, N);
  memset(src, 2, N);
  memset(dst, 3, N);
  uint64_t *round_ns = malloc(ROUNDS * sizeof *round_ns), in_ns = 0, back_ns = 0;
  for (int i = 0; i < ROUNDS; i++) {
    uint64_t t0 = now_ns();
    copy(stream_in, in, src);
    uint64_t t1 = now_ns();
    atomic_store(turn, 1);
    while (atomic_load(turn) != 2) {}
    uint64_t t2 = now_ns();
    memcpy(dst, out, N);
    uint64_t t3 = now_ns();
    round_ns[i] = t3 - t0;
    in_ns += t1 - t0;
    back_ns += t3 - t2;
  }
  waitpid(b, NULL, 0);
  qsort(round_ns, ROUNDS, sizeof *round_ns, by_value);
  uint64_t t0 = now_ns();
  for (int i = 0; i < 200; i++) {
    memcpy(dst, src, N);
    memcpy(src, dst, N);
  }
  double local = (now_ns() - t0) / 1e3 / 400;
  printf("copy in %s, copy out %s: three cross-core copies p50 %.1f us; copy in %.1f us, "
         "read back %.1f us (means); one 1 MiB copy on one core %.1f us\n",
         stream_in ? "streaming" : "memcpy", stream_out ? "streaming" : "memcpy",
         round_ns[ROUNDS / 2] / 1e3, in_ns / 1e3 / ROUNDS, back_ns / 1e3 / ROUNDS, local);
  return 0;
}
