/*
 * shms_segments.h — part of shmserve.h (include that): where things are in each
 * segment, and the writers and checkers of the segments' headers. The coordinator
 * writes every header through these; every process that maps a segment checks its
 * magic and version here before trusting any other field.
 */
#ifndef SHMS_SEGMENTS_H
#define SHMS_SEGMENTS_H

#include <string.h>

#include "shms_layout.h"

static inline uint64_t shms_align(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

#define SHMS_PAGE_BYTES 4096
#define SHMS_MAX_SEGMENT_BYTES (1ULL << 48) /* geometry beyond this would overflow */

/* Control segment: the block alone, one page. */
static inline uint64_t shms_control_bytes(void) {
  return shms_align(sizeof(shms_control), SHMS_PAGE_BYTES);
}

/* Bell segment: one page, the doorbell word at offset 0. */
#define SHMS_BELL_BYTES SHMS_PAGE_BYTES

/* Writes a fresh control block into a zeroed segment of `bytes` bytes. Returns 0, or
 * -1 if it does not fit. */
static inline int shms_control_init(void *base, uint64_t bytes, uint32_t server_pid) {
  if (bytes < sizeof(shms_control)) return -1;
  shms_control *c = (shms_control *)base;
  c->magic = SHMS_MAGIC_CONTROL;
  c->version = SHMS_PROTOCOL_VERSION;
  c->header_bytes = sizeof(shms_control);
  c->server_pid = server_pid;
  c->segment_bytes = bytes;
  return 0;
}

/* A client's submission ring holds at most one entry per slot in flight: a power of
 * two at least that large, and at least 2. */
static inline uint32_t shms_ring_capacity_for(uint32_t n_slots) {
  uint32_t cap = 2;
  while (cap < n_slots && cap < (1u << 30)) cap <<= 1;
  return cap;
}

/* Arena geometry: header, the submission ring's cells, slots (both cache-line
 * aligned), then tensor data (page aligned). */
typedef struct shms_arena_geometry {
  uint64_t ring_offset, slots_offset, data_offset, segment_bytes;
  uint32_t ring_capacity;
} shms_arena_geometry;

static inline shms_arena_geometry shms_arena_layout(uint32_t n_slots, uint64_t data_bytes) {
  shms_arena_geometry g;
  g.ring_capacity = shms_ring_capacity_for(n_slots);
  g.ring_offset = shms_align(sizeof(shms_arena_header), 64);
  g.slots_offset = shms_align(g.ring_offset + (uint64_t)g.ring_capacity * sizeof(shms_ring_cell), 64);
  g.data_offset = shms_align(g.slots_offset + (uint64_t)n_slots * sizeof(shms_slot), SHMS_PAGE_BYTES);
  g.segment_bytes = shms_align(g.data_offset + data_bytes, SHMS_PAGE_BYTES);
  return g;
}

static inline void shms_arena_init(void *base, const shms_arena_geometry *g, uint32_t n_slots,
                                   uint32_t client_id, uint32_t generation) {
  shms_arena_header *h = (shms_arena_header *)base;
  h->magic = SHMS_MAGIC_ARENA;
  h->version = SHMS_PROTOCOL_VERSION;
  h->client_id = client_id;
  h->generation = generation;
  h->n_slots = n_slots;
  h->slots_offset = g->slots_offset;
  h->data_offset = g->data_offset;
  h->segment_bytes = g->segment_bytes;
  h->ring_offset = g->ring_offset;
  h->ring_capacity = g->ring_capacity;
  shms_ring_cell *cells = (shms_ring_cell *)((char *)base + g->ring_offset);
  for (uint32_t i = 0; i < g->ring_capacity; i++) /* Vyukov: cell i starts free for position i */
    shms_store(&cells[i].seq, (uint64_t)i, memory_order_relaxed);
}

/* Server segment geometry: header, client table, model table, shadows, mailboxes. */
static inline void shms_server_init(shms_server_header *h, uint32_t max_clients,
                                    uint32_t slots_per_client, uint32_t n_models,
                                    uint32_t n_workers) {
  h->max_clients = max_clients;
  h->slots_per_client = slots_per_client;
  h->n_models = n_models;
  h->n_workers = n_workers;
  h->clients_offset = shms_align(sizeof(shms_server_header), 64);
  h->models_offset = shms_align(h->clients_offset + (uint64_t)max_clients * sizeof(shms_client_entry), 64);
  h->shadows_offset = shms_align(h->models_offset + (uint64_t)(n_models ? n_models : 1) *
                                                        sizeof(shms_model_entry), 64);
  h->mailboxes_offset = shms_align(h->shadows_offset + (uint64_t)max_clients * slots_per_client *
                                                           sizeof(shms_shadow), 64);
  h->segment_bytes = shms_align(h->mailboxes_offset + (uint64_t)(n_workers ? n_workers : 1) *
                                                          sizeof(shms_mailbox), SHMS_PAGE_BYTES);
  h->magic = SHMS_MAGIC_SERVER; /* last: the geometry above is what it vouches for */
  h->version = SHMS_PROTOCOL_VERSION;
}

/* Checks that a mapping of `bytes` bytes starts with a header of this magic and
 * protocol version and is as large as that header says. Returns NULL, or why not. */
static inline const char *shms_check_header(const void *base, uint64_t bytes, uint64_t magic) {
  if (bytes < 16) return "segment is too small for a header";
  uint64_t found;
  uint32_t version;
  memcpy(&found, base, 8);
  memcpy(&version, (const char *)base + 8, 4);
  if (found != magic) return "wrong magic: not this kind of shmserve segment";
  if (version != SHMS_PROTOCOL_VERSION) return "protocol version mismatch";
  uint64_t said = 0;
  if (magic == SHMS_MAGIC_CONTROL && bytes >= sizeof(shms_control)) {
    if (((const shms_control *)base)->header_bytes != sizeof(shms_control))
      return "control block header_bytes is not this version's";
    said = ((const shms_control *)base)->segment_bytes;
  }
  else if (magic == SHMS_MAGIC_ARENA && bytes >= sizeof(shms_arena_header))
    said = ((const shms_arena_header *)base)->segment_bytes;
  else if (magic == SHMS_MAGIC_SERVER && bytes >= sizeof(shms_server_header))
    said = ((const shms_server_header *)base)->segment_bytes;
  else
    return "segment is too small for its header";
  if (said > bytes) return "header says the segment is larger than the mapping";
  return NULL;
}

#endif /* SHMS_SEGMENTS_H */
