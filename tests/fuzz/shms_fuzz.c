/*
 * shms_fuzz.c — libFuzzer harness of the C core's code that reads memory a caller
 * wrote (docs/reliability.md, "libFuzzer campaign of the C core").
 *
 *   build/fuzz/shms_fuzz TARGET [libFuzzer flags] [corpus dirs | inputs]
 *
 * Built and run by scripts/fuzz_core.sh (clang, -fsanitize=fuzzer-no-link,address,undefined,
 * linked with libclang_rt.fuzzer_no_main). It includes shmserve.h, the protocol's one
 * header, so the code under test is the extension's own: shms_take_request,
 * shms_validate_request, shms_shape_key, the ring, shms_slot_read_answer. (The .c files
 * of shmserve/csrc are its Python bindings: argument parsing and bounds checks around
 * these calls.) Kept out of shmserve/ so that no build of the package ever globs it.
 *
 * The input formats below are read the same way by scripts/fuzz_core_inputs.py, which
 * replays a corpus through the gcc-built extension (tests/test_fuzz_core.py, in CI).
 * A field past the end of the input reads as 0.
 *
 * take     the batcher taking a request (Mapping.take, Intake.take), against the model
 *          table of scripts/fuzz_requests.py (SHMS_FUZZ_MODELS: the file that
 *          `fuzz_core_inputs.py models` writes). Arenas of 4 slots, 4 KiB and 64 KiB data.
 *            [0] bit 0: the 64 KiB arena   [1] slot (mod 4)
 *            [2] >= 0xF0: slot state [2] & 7, else SUBMITTED
 *            [3] >= 0xF0: slot generation 8, else 7 (the ring entry's)
 *            [4..] the slot's shms_request (3136 bytes; zeros past the input)
 *
 * ring     a client's submission ring, in its arena of 8 slots and no data (ring of 8,
 *          shms_arena_layout), that the client vandalises, with honest pushes and
 *          the batcher's consumer steps between.
 *            [0] bit 0: the arena header's 192 bytes are [1..192] (raw), then
 *                ring_attach, which must refuse it or give cells between the header
 *                and the header's slots_offset, inside the segment, and enqueue_pos
 *                becomes near(its value); else a fresh arena (shms_arena_init).
 *                Then operations of 1 + 13 bytes each, [op % 5] [13 operands]:
 *            0 push          owner = a[0], slot = a[1], generation = a[2]
 *            1 consume       repair, pop; a STALLED head skipped when a[0] is odd, a
 *                            CORRUPT one always (the batcher skips those after a grace)
 *            2 cell seq      cell a[0]; a[1] % 4 picks the value from u64 v = a[1..8]:
 *                            0 head + near(v), 1 claim(v >> 32, head + near(v)),
 *                            2 v | CLAIMED, 3 v, but no later than head + 4 laps
 *            3 cell payload  cell a[0], client_id/slot/generation = u32 a[1..4], a[5..8], a[9..12]
 *            4 enqueue_pos   head + near(u64 a[0..7])
 *          near(v) = v mod (8 capacity + 1) - 4 capacity: within 4 laps of the consumer.
 *          A seq or enqueue_pos far ahead makes a lone producer help enqueue_pos forward
 *          until it gets there (docs/reliability.md: the batcher's repair ends it); the
 *          vandal's values stay within 4 laps so that a push ends without a batcher.
 *          Checked: pos moves by one per entry taken or skipped; after repair,
 *          enqueue_pos is within a lap of it; pushes answer OK or FULL; and until the
 *          first vandal write, the ring is a FIFO of the pushes, FULL exactly at capacity.
 *
 * answer   a client reading its DONE slot (Mapping.read_result, the C++ client):
 *            [0..] the slot (5056 bytes), state forced to DONE.
 *          Checked: results only for OK and OUTPUT_TOO_SMALL, at most 16; the message
 *          NUL-terminated, a prefix of the slot's error bytes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmserve.h"

int LLVMFuzzerRunDriver(int *argc, char ***argv, int (*cb)(const uint8_t *, size_t));

#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "shms_fuzz: check failed: %s: ", #cond);        \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
      abort();                                                        \
    }                                                                 \
  } while (0)

/* Input reader: bytes past the end read as 0. */
typedef struct {
  const uint8_t *p;
  size_t n, at;
} reader;

static uint8_t u8(reader *r) { return r->at < r->n ? r->p[r->at++] : (r->at++, 0); }
static uint64_t le(reader *r, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; i++) v |= (uint64_t)u8(r) << (8 * i);
  return v;
}

/* ---------------------------------------------------------------- take */

enum { N_SLOTS = 4, ENTRY_GEN = 7 };
static const uint64_t DATA_BYTES[2] = {4096, 65536};

typedef struct {
  uint8_t *base;
  shms_arena_geometry g;
} arena;

static arena arenas[2];
static shms_model_entry *models;
static uint32_t n_models;
static shms_shadow *shadow;

static void take_setup(void) {
  const char *path = getenv("SHMS_FUZZ_MODELS");
  FILE *f = path ? fopen(path, "rb") : NULL;
  if (!f) {
    fprintf(stderr, "shms_fuzz: target take needs SHMS_FUZZ_MODELS, the model table "
                    "written by `scripts/fuzz_core_inputs.py models FILE` (%s)\n",
            path ? path : "unset");
    exit(2);
  }
  fseek(f, 0, SEEK_END);
  long bytes = ftell(f);
  rewind(f);
  if (bytes <= 0 || bytes % sizeof(shms_model_entry)) {
    fprintf(stderr, "shms_fuzz: %s holds %ld bytes, not a whole number of %zu-byte model "
                    "entries (stale build? rerun scripts/fuzz_core.sh build)\n",
            path, bytes, sizeof(shms_model_entry));
    exit(2);
  }
  n_models = (uint32_t)(bytes / sizeof(shms_model_entry));
  models = malloc((size_t)bytes);
  if (!models || fread(models, 1, (size_t)bytes, f) != (size_t)bytes) exit(2);
  fclose(f);
  for (int k = 0; k < 2; k++) {
    arenas[k].g = shms_arena_layout(N_SLOTS, DATA_BYTES[k]);
    arenas[k].base = calloc(1, arenas[k].g.segment_bytes); /* ASan: exact bounds */
    shms_arena_init(arenas[k].base, &arenas[k].g, N_SLOTS, 0, 1);
  }
  shadow = malloc(sizeof *shadow);
}

/* An accepted tensor: 64-aligned inside the caller's data, its bytes there (kind 0,
 * device 0), or its CUDA IPC record there for a model that takes device memory. */
static int inside(const shms_tensor_ref *t, const arena *a, const shms_model_entry *m) {
  uint64_t begin = a->g.data_offset, end = a->g.segment_bytes;
  int host = t->memory_kind == SHMS_MEMORY_HOST_ARENA && t->device_id == 0;
  int device = t->memory_kind == SHMS_MEMORY_CUDA_IPC && m->device_memory;
  uint64_t held = device ? sizeof(shms_cuda_ipc) : t->nbytes;
  return t->offset % SHMS_DATA_ALIGN == 0 && t->offset >= begin && t->offset <= end &&
         held <= end - t->offset && (host || device);
}

static void fuzz_take(reader *in) {
  arena *a = &arenas[u8(in) & 1];
  uint32_t slot_index = u8(in) % N_SLOTS;
  uint8_t st = u8(in), g = u8(in);
  uint32_t state = st >= 0xF0 ? st & 7u : (uint32_t)SHMS_SLOT_SUBMITTED;
  uint32_t slot_gen = g >= 0xF0 ? ENTRY_GEN + 1 : ENTRY_GEN;
  shms_slot *s = (shms_slot *)(a->base + a->g.slots_offset + slot_index * sizeof(shms_slot));
  memset(s, 0, sizeof *s);
  size_t n = in->n > in->at ? in->n - in->at : 0;
  memcpy(&s->request, in->p + in->at, n < sizeof s->request ? n : sizeof s->request);
  s->state = state;
  s->generation = slot_gen;
  memset(shadow, 0xA5, sizeof *shadow);
  char err[SHMS_ERROR_BYTES];
  memset(err, 0x5A, sizeof err);

  int rc = shms_take_request(s, ENTRY_GEN, shadow, 0, slot_index, 1, models, n_models,
                             a->g.data_offset, a->g.segment_bytes, NULL, err, sizeof err);
  int stale = state != SHMS_SLOT_SUBMITTED || slot_gen != ENTRY_GEN;
  if (rc == SHMS_TAKE_STALE) {
    CHECK(stale, "a SUBMITTED slot of the entry's generation was not taken");
    CHECK(s->state == state, "a stale take changed the slot state to %u", (unsigned)s->state);
    return;
  }
  CHECK(!stale, "took a slot in state %u, generation %u", state, slot_gen);
  CHECK(s->state == SHMS_SLOT_QUEUED, "slot state %u after take", (unsigned)s->state);
  CHECK(!memcmp(&shadow->request, &s->request, sizeof s->request), "shadow is not a copy");
  CHECK(shadow->slot == slot_index && shadow->generation == ENTRY_GEN, "shadow header");
  if (rc != SHMS_OK) {
    CHECK(rc == SHMS_ERR_INVALID_ARG || rc == SHMS_ERR_NOT_FOUND ||
              rc == SHMS_ERR_UNAVAILABLE || rc == SHMS_ERR_BAD_DESCRIPTOR,
          "status %d", rc);
    size_t len = strnlen(err, sizeof err);
    CHECK(len > 0 && len < sizeof err, "message of %zu bytes", len);
    CHECK(shadow->batch_rows == 0, "batch_rows %u on a refusal", shadow->batch_rows);
    return;
  }
  const shms_request *r = &shadow->request;
  CHECK(r->model_id < n_models && models[r->model_id].ready, "accepted model %u", r->model_id);
  const shms_model_entry *m = &models[r->model_id];
  uint32_t batched = m->max_batch_size > 0, rows = shadow->batch_rows;
  CHECK(batched ? rows >= 1 && rows <= m->max_batch_size : rows == 1, "rows %u", rows);
  CHECK(r->n_inputs <= SHMS_MAX_TENSORS && r->n_outputs >= 1 &&
            r->n_outputs <= SHMS_MAX_TENSORS, "counts %u %u", r->n_inputs, r->n_outputs);
  for (uint32_t i = 0; i < r->n_inputs; i++) {
    const shms_tensor_ref *t = &r->inputs[i];
    CHECK(inside(t, a, m), "input %u [%llu, +%llu) accepted outside the data", i,
          (unsigned long long)t->offset, (unsigned long long)t->nbytes);
    CHECK(t->index < m->n_inputs && t->dtype == m->inputs[t->index].dtype &&
              t->ndim == m->inputs[t->index].ndim + batched,
          "input %u does not match the model", i);
    CHECK(!batched || t->shape[0] == (int64_t)rows, "input %u batch dim", i);
  }
  for (uint32_t i = 0; i < r->n_outputs; i++)
    CHECK(inside(&r->outputs[i], a, m) && r->outputs[i].index < m->n_outputs,
          "output %u accepted outside the data or the model", i);
  int64_t *key = malloc(sizeof(int64_t) * SHMS_SHAPE_KEY_MAX); /* ASan: exact bounds */
  size_t nk = shms_shape_key(r, m, key);
  CHECK(nk <= SHMS_SHAPE_KEY_MAX, "shape key of %zu entries", nk);
  free(key);
}

/* ---------------------------------------------------------------- ring */

enum { RING_SLOTS = 8, RING_CAP = 8, MODEL_MAX = 1024 };

static uint8_t *ring_base; /* an arena of RING_SLOTS slots, no data */
static shms_arena_geometry ring_g;

typedef struct {
  uint32_t client_id, slot, generation;
} entry;

static uint64_t near(uint64_t v, uint64_t cap) { return v % (8 * cap + 1) - 4 * cap; }

static void fuzz_ring(reader *in) {
  const uint64_t bytes = ring_g.segment_bytes;
  memset(ring_base, 0, bytes);
  shms_arena_init(ring_base, &ring_g, RING_SLOTS, 1, 1);
  shms_ring r;
  int honest = 1; /* no vandal write yet: the ring must behave as a FIFO */
  if (u8(in) & 1) {
    for (size_t i = 0; i < sizeof(shms_arena_header); i++) ring_base[i] = u8(in);
    if (shms_ring_attach(&r, ring_base, bytes) != 0) return;
    uint8_t *cells = (uint8_t *)r.cells;
    uint64_t slots_offset = ((shms_arena_header *)ring_base)->slots_offset;
    CHECK(cells >= ring_base + sizeof(shms_arena_header) && r.capacity >= 2 &&
              !(r.capacity & (r.capacity - 1)) &&
              r.capacity <= (bytes - sizeof(shms_arena_header)) / sizeof(shms_ring_cell) &&
              slots_offset <= bytes &&
              cells + r.capacity * sizeof(shms_ring_cell) <= ring_base + slots_offset &&
              (uint8_t *)r.enqueue_pos == ring_base + offsetof(shms_arena_header, enqueue_pos),
          "attached a ring of %llu cells at offset %lld (slots at %llu)",
          (unsigned long long)r.capacity, (long long)(cells - ring_base),
          (unsigned long long)slots_offset);
    /* The header's enqueue_pos within 4 laps too (see above). */
    shms_store(r.enqueue_pos, near(shms_load(r.enqueue_pos, memory_order_relaxed), r.capacity),
               memory_order_relaxed);
    honest = 0;
  } else {
    CHECK(shms_ring_attach(&r, ring_base, bytes) == 0, "attach a fresh ring");
    CHECK(r.capacity == RING_CAP && (uint8_t *)r.cells == ring_base + ring_g.ring_offset,
          "fresh ring of %llu cells", (unsigned long long)r.capacity);
  }
  const uint64_t cap = r.capacity;
  uint64_t pos = 0; /* the consumer's private position */
  static entry fifo[MODEL_MAX];
  uint64_t pushed = 0, popped = 0; /* honest model: fifo[popped..pushed) */
  for (int ops = 0; in->at < in->n && ops < 4096; ops++) {
    uint8_t op = u8(in) % 5;
    uint8_t a[13];
    for (int i = 0; i < 13; i++) a[i] = u8(in);
    reader ar = {a, sizeof a, 0};
    if (op == 0) {
      entry e = {a[0], a[1], a[2]};
      int rc = shms_ring_push(&r, e.client_id, e.slot, e.generation);
      CHECK(rc == SHMS_RING_OK || rc == SHMS_RING_FULL, "push answered %d", rc);
      if (honest) {
        CHECK(rc == (pushed - popped < cap ? SHMS_RING_OK : SHMS_RING_FULL),
              "push answered %d with %llu of %llu cells in use", rc,
              (unsigned long long)(pushed - popped), (unsigned long long)cap);
        if (rc == SHMS_RING_OK) fifo[pushed++ % MODEL_MAX] = e;
      }
    } else if (op == 1) {
      int repaired = shms_ring_repair(&r, pos);
      CHECK(!honest || !repaired, "repaired an honest ring");
      uint64_t enq = shms_load(r.enqueue_pos, memory_order_relaxed);
      CHECK(enq - pos <= cap, "enqueue_pos %llu is %lld from the head after repair",
            (unsigned long long)enq, (long long)(enq - pos));
      uint64_t p = pos, head_seq = 0;
      shms_ring_entry e;
      uint32_t owner = 0;
      int k = shms_ring_pop(&r, &p, &e, &owner, &head_seq);
      if (k == SHMS_POP_OK) {
        CHECK(p == pos + 1, "pop moved the head by %lld", (long long)(p - pos));
        if (honest) {
          CHECK(popped < pushed, "popped an entry nobody pushed");
          entry want = fifo[popped++ % MODEL_MAX];
          CHECK(e.client_id == want.client_id && e.slot == want.slot &&
                    e.generation == want.generation, "popped another entry than pushed");
        }
      } else {
        CHECK(p == pos, "pop %d moved the head", k);
        CHECK(!honest || (k == SHMS_POP_EMPTY && popped == pushed),
              "honest ring: pop answered %d with %llu entries pushed", k,
              (unsigned long long)(pushed - popped));
        if (k == SHMS_POP_CORRUPT || (k == SHMS_POP_STALLED && (a[0] & 1))) {
          if (shms_ring_skip(&r, &p, head_seq)) CHECK(p == pos + 1, "skip moved the head");
        }
      }
      pos = p;
    } else if (op == 2) {
      shms_ring_cell *c = &r.cells[a[0] & (cap - 1)];
      ar.at = 1;
      uint64_t v = le(&ar, 8), head = pos, seq;
      switch (a[1] % 4) {
      case 0: seq = head + near(v, cap); break;
      case 1: seq = shms_claim_word((uint32_t)(v >> 32), head + near(v, cap)); break;
      case 2: seq = v | SHMS_CELL_CLAIMED; break;
      default: seq = (int64_t)(v - head) > (int64_t)(4 * cap) ? head + 4 * cap : v;
      }
      shms_store(&c->seq, seq, memory_order_relaxed);
      honest = 0;
    } else if (op == 3) {
      shms_ring_cell *c = &r.cells[a[0] & (cap - 1)];
      ar.at = 1;
      c->client_id = (uint32_t)le(&ar, 4);
      c->slot = (uint32_t)le(&ar, 4);
      c->generation = (uint32_t)le(&ar, 4);
      honest = 0;
    } else {
      shms_store(r.enqueue_pos, pos + near(le(&ar, 8), cap), memory_order_relaxed);
      honest = 0;
    }
  }
}

/* ---------------------------------------------------------------- answer */

static shms_slot *answer_slot;

static void fuzz_answer(reader *in) {
  shms_slot *s = answer_slot;
  memset(s, 0, sizeof *s);
  memcpy(s, in->p, in->n < sizeof *s ? in->n : sizeof *s);
  s->state = SHMS_SLOT_DONE;
  shms_answer ans;
  CHECK(shms_slot_read_answer(s, &ans) == 1, "a DONE slot read as not done");
  CHECK(ans.status == s->status, "status");
  CHECK(ans.n_results <= SHMS_MAX_TENSORS, "%u results", ans.n_results);
  CHECK(ans.n_results == 0 || ans.status == SHMS_OK || ans.status == SHMS_ERR_OUTPUT_TOO_SMALL,
        "results with status %d", ans.status);
  CHECK(ans.results == s->results, "results not the slot's");
  size_t len = strnlen(ans.error, sizeof ans.error);
  CHECK(len < sizeof ans.error && !memcmp(ans.error, s->error, len), "message");
}

/* ---------------------------------------------------------------- driver */

static void (*target)(reader *);

static int one_input(const uint8_t *data, size_t size) {
  reader in = {data, size, 0};
  target(&in);
  return 0;
}

int main(int argc, char **argv) {
  /* The target is argv[1]; libFuzzer's own child processes (-merge=1, -fork) get
   * only its flags, so they find it in SHMS_FUZZ_TARGET, set here. */
  const char *env = getenv("SHMS_FUZZ_TARGET");
  int named = argc > 1 && (!strcmp(argv[1], "take") || !strcmp(argv[1], "ring") ||
                           !strcmp(argv[1], "answer"));
  const char *name = named ? argv[1] : env ? env : "";
  if (!strcmp(name, "take")) {
    take_setup();
    target = fuzz_take;
  } else if (!strcmp(name, "ring")) {
    ring_g = shms_arena_layout(RING_SLOTS, 0);
    ring_base = malloc(ring_g.segment_bytes); /* ASan: exact bounds */
    target = fuzz_ring;
  } else if (!strcmp(name, "answer")) {
    answer_slot = malloc(sizeof *answer_slot);
    target = fuzz_answer;
  } else {
    fprintf(stderr, "usage: %s take|ring|answer [libFuzzer flags] [corpus dirs | inputs]\n"
                    "  (scripts/fuzz_core.sh builds and runs it; see docs/reliability.md)\n",
            argv[0]);
    return 2;
  }
  setenv("SHMS_FUZZ_TARGET", name, 1);
  int n = argc - named;
  char **args = argv + named;
  if (named) argv[1] = argv[0]; /* libFuzzer sees the program name, then its own flags */
  return LLVMFuzzerRunDriver(&n, &args, one_input);
}
