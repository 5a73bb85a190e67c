/*
 * shms_ring.h — part of shmserve.h (include that): the request ring.
 */
#ifndef SHMS_RING_H
#define SHMS_RING_H

#include "shms_layout.h"

/*
 * A client's submission ring, in its own arena: a bounded multi-producer (that
 * client's threads), single-consumer (the batcher) ring of (client, slot, generation)
 * entries, after Dmitry Vyukov's bounded MPMC queue, changed so that a producer that
 * dies half-way never blocks it:
 *
 *   - A producer claims a cell by CAS on the cell's seq (pos -> CLAIM(owner, pos))
 *     before it moves enqueue_pos, so the claimed cell names its owner. Anyone who
 *     sees position pos taken helps move enqueue_pos past it.
 *   - It then writes the payload and publishes with a CAS CLAIM -> pos + 1.
 *   - The consumer takes cells strictly in order. It may skip the head cell with a
 *     CAS (its seq -> pos + capacity): a claim that stayed unpublished too long, or a
 *     cell no honest producer leaves that way. A late publish by the owner then fails
 *     its CAS (SHMS_RING_RECLAIMED): a live owner pushes again.
 *
 * Only its client and the server map an arena, so whatever is written into a ring
 * was written by its client (or by the server): a forged claim, a garbage cell or a
 * vandalised enqueue_pos stalls or loses that client's own entries, nobody else's
 * (docs/protocol.md section 5). Still, the consumer trusts nothing it reads here:
 * the capacity and cell address are fixed by the server's own geometry
 * (shms_arena_layout), its position is private (the server's client table), it
 * repairs an enqueue_pos outside [head, head + capacity] (shms_ring_repair), and
 * the batcher's sweep of SUBMITTED slots answers requests whose entries were lost.
 *
 * ABA: positions are 64-bit and never wrap in practice; a claim word carries the
 * low 32 bits of its position, so a stale claim from an older lap (capacity <
 * 2^31) never matches the current position.
 */

typedef struct shms_ring {
  SHMS_ATOMIC(uint64_t) *enqueue_pos; /* in the arena header */
  shms_ring_cell *cells;
  uint64_t capacity; /* power of two, fixed at attach */
} shms_ring;

/* The ring of the arena at base, with the geometry given (the server's own). */
static inline void shms_ring_view(shms_ring *r, void *base, uint64_t ring_offset,
                                  uint64_t capacity) {
  r->enqueue_pos = &((shms_arena_header *)base)->enqueue_pos;
  r->cells = (shms_ring_cell *)((char *)base + ring_offset);
  r->capacity = capacity;
}

/* Client: checks its arena's header once and fixes the view. Returns 0, or -1 if
 * the segment is not an arena of this protocol version, segment_bytes long, with a
 * sane ring before its slots. */
static inline int shms_ring_attach(shms_ring *r, void *base, uint64_t segment_bytes) {
  shms_arena_header *h = (shms_arena_header *)base;
  if (segment_bytes < sizeof(shms_arena_header) || h->magic != SHMS_MAGIC_ARENA ||
      h->version != SHMS_PROTOCOL_VERSION)
    return -1;
  uint64_t cap = h->ring_capacity, off = h->ring_offset;
  /* compared by differences: off is a u64 the client wrote, off + size may wrap */
  if (cap < 2 || (cap & (cap - 1)) || cap > (1u << 30) || cap < h->n_slots ||
      off < sizeof(shms_arena_header) || off % 64 || h->slots_offset > segment_bytes ||
      off > h->slots_offset || cap * sizeof(shms_ring_cell) > h->slots_offset - off)
    return -1;
  shms_ring_view(r, base, off, cap);
  return 0;
}

static inline int shms_ring_push(const shms_ring *r, uint32_t owner, uint32_t slot,
                                 uint32_t generation) {
  SHMS_ATOMIC(uint64_t) *enqueue_pos = r->enqueue_pos;
  shms_ring_cell *cells = r->cells;
  const uint64_t mask = r->capacity - 1;
  for (;;) {
    uint64_t pos = shms_load(enqueue_pos, memory_order_relaxed);
    shms_ring_cell *c = &cells[pos & mask];
    uint64_t seq = shms_load(&c->seq, memory_order_acquire);
    int taken; /* position pos already belongs to some producer */
    if (seq == pos) {
      uint64_t claim = shms_claim_word(owner, pos);
      uint64_t expected = pos;
      if (!shms_cas(&c->seq, &expected, claim)) continue;
      uint64_t p = pos;
      shms_cas(enqueue_pos, &p, pos + 1);
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
      shms_cas(enqueue_pos, &p, pos + 1); /* help a producer that stalled */
      continue;
    }
    /* The cell still holds an entry of an older lap: full, unless pos was stale. */
    if (shms_load(enqueue_pos, memory_order_relaxed) == pos) return SHMS_RING_FULL;
  }
}

typedef struct shms_ring_entry {
  uint32_t client_id, slot, generation;
} shms_ring_entry;

/* Single consumer; *pos is the consumer's private position. On STALLED and
 * CORRUPT, *head_seq is the head cell's seq, to pass to shms_ring_skip. */
static inline int shms_ring_pop(const shms_ring *r, uint64_t *pos, shms_ring_entry *out,
                                uint32_t *stalled_owner, uint64_t *head_seq) {
  const uint64_t p = *pos;
  shms_ring_cell *c = &r->cells[p & (r->capacity - 1)];
  /* enqueue_pos first: if it was already past p, position p had been claimed by then,
   * so a free seq read afterwards is a forged enqueue_pos, not a race. */
  uint64_t enq = shms_load(r->enqueue_pos, memory_order_acquire);
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
  shms_cas(r->enqueue_pos, &e, p + 1);
  *pos = p + 1;
  return 1;
}

/* Consumer only: honest producers keep enqueue_pos within [pos, pos + capacity].
 * If it is outside (a client wrote it), move it back to the first position at or
 * after pos whose cell is free for it. Returns 1 if it was repaired. */
static inline int shms_ring_repair(const shms_ring *r, uint64_t pos) {
  uint64_t enq = shms_load(r->enqueue_pos, memory_order_acquire);
  if (enq - pos <= r->capacity) return 0;
  uint64_t q = pos;
  while (q < pos + r->capacity &&
         shms_load(&r->cells[q & (r->capacity - 1)].seq, memory_order_acquire) != q)
    q++;
  return shms_cas(r->enqueue_pos, &enq, q) ? 1 : 0;
}

#endif /* SHMS_RING_H */
