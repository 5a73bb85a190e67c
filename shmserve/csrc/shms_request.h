/*
 * shms_request.h — part of shmserve.h (include that): the server's side of a
 * request's arrival. The batcher takes a slot (claims it, copies the request out of
 * the client's reach) and validates the copy; nothing a client wrote is trusted.
 */
#ifndef SHMS_REQUEST_H
#define SHMS_REQUEST_H

#include <stdio.h>
#include <string.h>

#include "shms_layout.h"
#include "shms_wait.h"


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

/* Whether a tensor ref's memory kind is one the model takes: the caller's arena
 * (device_id 0), or device memory by a CUDA IPC record where every instance of the
 * model reads device memory (device_id: the caller's ordinal, for messages only). */
static inline int shms_memory_kind_ok(const shms_tensor_ref *t, const shms_model_entry *m) {
  if (t->memory_kind == SHMS_MEMORY_HOST_ARENA) return t->device_id == 0;
  return t->memory_kind == SHMS_MEMORY_CUDA_IPC && m->device_memory;
}

static inline const char *shms_memory_kinds_taken(const shms_model_entry *m) {
  return m->device_memory ? "it takes kind 0 (arena, device 0) or 1 (CUDA IPC)"
                          : "it takes kind 0 (arena, device 0); 1 needs KIND_GPU pytorch";
}

/* Bytes of the caller's arena a tensor ref occupies: its data, or its CUDA IPC record. */
static inline uint64_t shms_ref_arena_bytes(const shms_tensor_ref *t) {
  return t->memory_kind == SHMS_MEMORY_CUDA_IPC ? sizeof(shms_cuda_ipc) : t->nbytes;
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
  /* Every input not marked optional must be given; an optional one may be left out.
   * An index out of range or given twice is left to the loop below, which names it. */
  {
    uint32_t seen_mask = 0, well_formed = 1;
    for (uint32_t i = 0; i < r->n_inputs; i++) {
      uint32_t index = r->inputs[i].index;
      if (index >= m->n_inputs || (seen_mask & (1u << index))) well_formed = 0;
      else seen_mask |= 1u << index;
    }
    for (uint32_t k = 0; well_formed && k < m->n_inputs; k++)
      if (!(seen_mask & (1u << k)) && !(m->optional_inputs & (1u << k))) {
        if (m->optional_inputs)
          SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': missing input '%s' (it is not optional)",
                    model, m->inputs[k].name);
        SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': missing input '%s' (expects %u inputs, got %u)",
                  model, m->inputs[k].name, m->n_inputs, r->n_inputs);
      }
    if (batched && r->n_inputs == 0)
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': request gives no input (each is optional, but "
                "one is needed for the batch size)", model);
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
    if (!shms_memory_kind_ok(t, m))
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': input '%s' is in memory kind %u device %u; %s",
                model, s->name, t->memory_kind, t->device_id, shms_memory_kinds_taken(m));
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
    /* Misalignment has its own words: a caller must tell it from out-of-range. */
    if (t->offset % SHMS_DATA_ALIGN)
      SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
                "model '%s': input '%s' data offset %llu is not a multiple of %d", model,
                s->name, (unsigned long long)t->offset, SHMS_DATA_ALIGN);
    if (t->offset < data_begin || t->offset > data_end ||
        shms_ref_arena_bytes(t) > data_end - t->offset)
      SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
                "model '%s': input '%s' %s [%llu, +%llu) is outside the caller's arena", model,
                s->name, t->memory_kind ? "CUDA IPC record" : "data",
                (unsigned long long)t->offset, (unsigned long long)shms_ref_arena_bytes(t));
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
    if (!shms_memory_kind_ok(t, m))
      SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': output '%s' is in memory kind %u device %u; %s",
                model, m->outputs[t->index].name, t->memory_kind, t->device_id,
                shms_memory_kinds_taken(m));
    if (t->offset % SHMS_DATA_ALIGN)
      SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
                "model '%s': output '%s' buffer offset %llu is not a multiple of %d", model,
                m->outputs[t->index].name, (unsigned long long)t->offset, SHMS_DATA_ALIGN);
    if (t->offset < data_begin || t->offset > data_end ||
        shms_ref_arena_bytes(t) > data_end - t->offset)
      SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
                "model '%s': output '%s' %s [%llu, +%llu) is outside the caller's arena",
                model, m->outputs[t->index].name, t->memory_kind ? "CUDA IPC record" : "buffer",
                (unsigned long long)t->offset, (unsigned long long)shms_ref_arena_bytes(t));
  }
  if (r->n_outputs == 0)
    SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': request names no output buffer", model);
  if (r->flags & ~SHMS_REQUEST_FLAGS_KNOWN)
    SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR, "model '%s': request flags 0x%x set unknown bits "
              "(known: SEQUENCE_START 0x1, SEQUENCE_END 0x2, STREAM 0x4)", model, r->flags);
  if (r->parameters_bytes > SHMS_MAX_PARAMETER_BYTES)
    SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': request parameters hold %u bytes (limit %d)",
              model, r->parameters_bytes, SHMS_MAX_PARAMETER_BYTES);
  if (r->parameters_bytes && (r->parameters_offset < data_begin || r->parameters_offset > data_end ||
                              r->parameters_bytes > data_end - r->parameters_offset))
    SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
              "model '%s': request parameters [%llu, +%u) are outside the caller's arena", model,
              (unsigned long long)r->parameters_offset, r->parameters_bytes);
  if (r->sequence_id_bytes > SHMS_MAX_SEQUENCE_ID_BYTES)
    SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': the string correlation id holds %u bytes (limit %d)",
              model, r->sequence_id_bytes, SHMS_MAX_SEQUENCE_ID_BYTES);
  if (r->sequence_id_bytes && r->sequence_id)
    SHMS_FAIL(SHMS_ERR_INVALID_ARG, "model '%s': the request carries both a numeric and a string "
              "correlation id", model);
  if (r->sequence_id_bytes && (r->sequence_id_offset < data_begin || r->sequence_id_offset > data_end ||
                               r->sequence_id_bytes > data_end - r->sequence_id_offset))
    SHMS_FAIL(SHMS_ERR_BAD_DESCRIPTOR,
              "model '%s': the string correlation id [%llu, +%u) is outside the caller's arena", model,
              (unsigned long long)r->sequence_id_offset, r->sequence_id_bytes);
  *batch_rows = batched ? (uint32_t)rows : 1u;
  return SHMS_OK;
#undef SHMS_FAIL
}

/* shms_take_request's answer when the slot no longer holds that request. */
#define SHMS_TAKE_STALE (-1)

/* Batcher: claims the SUBMITTED request of generation `gen` in slot s (SUBMITTED ->
 * QUEUED), copies it into the server-private shadow sh and validates the copy
 * against the model table. Returns SHMS_OK (sh->batch_rows set), an error status
 * with err filled (the caller answers the client), or SHMS_TAKE_STALE: the entry
 * was stale or a duplicate, nothing to answer. data_begin/data_end bound the
 * caller's tensor data in its arena. honoured (NULL: none) holds, by model index, a
 * withdrawn handle still accepted: a restarted batcher taking again the requests its
 * predecessor had accepted for a model that drains (unload), which must finish.
 * SYNC POINT: the CAS (seq_cst) pairs with the client's release store of SUBMITTED
 * in shms_slot_submit. */
static inline int shms_take_request(shms_slot *s, uint32_t gen, shms_shadow *sh,
                                    uint32_t client_id, uint32_t slot_index, uint32_t lease,
                                    const shms_model_entry *models, uint32_t n_models,
                                    uint64_t data_begin, uint64_t data_end,
                                    const uint32_t *honoured, char *err, size_t err_bytes) {
  uint32_t expected = SHMS_SLOT_SUBMITTED;
  if (s->generation != gen || !shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_QUEUED))
    return SHMS_TAKE_STALE;
  if (s->generation != gen) {
    /* The client reused the slot between our check and the CAS: that newer request is
     * not this entry's. Give it back; its own entry (or the sweep) brings it. */
    expected = SHMS_SLOT_QUEUED;
    shms_cas(&s->state, &expected, (uint32_t)SHMS_SLOT_SUBMITTED);
    return SHMS_TAKE_STALE;
  }
  uint64_t taken = shms_now_ns();
  s->t_ns[SHMS_T_DEQUEUE] = taken;
  /* Copy first, then validate the copy: the client cannot change what we check. */
  memcpy(&sh->request, &s->request, sizeof(shms_request));
  sh->taken_ns = taken;
  sh->client_id = client_id;
  sh->slot = slot_index;
  sh->generation = gen;
  sh->lease = lease;
  sh->batch_rows = 0;
  sh->sequence_slot = 0;
  uint32_t handle = sh->request.model_id;
  uint32_t model_id = handle & SHMS_MODEL_INDEX_MASK;
  if (model_id >= n_models) {
    snprintf(err, err_bytes, "request names an unknown model id %u", handle);
    return SHMS_ERR_NOT_FOUND;
  }
  const shms_model_entry *m = &models[model_id];
  /* A handle resolved before the entry was withdrawn (unload, reload) or given to
   * another model: refused, the shadow keeps the handle (the batcher words the error). */
  if (handle >> SHMS_MODEL_INDEX_BITS !=
          (shms_load(&m->generation, memory_order_acquire) & (UINT32_MAX >> SHMS_MODEL_INDEX_BITS)) &&
      !(honoured && honoured[model_id] == handle)) {
    snprintf(err, err_bytes, "stale model id %#x: its model was unloaded or reloaded; "
             "resolve the model name again", handle);
    return SHMS_ERR_UNAVAILABLE;
  }
  sh->request.model_id = model_id; /* from here on the server's copy names the entry */
  if (!shms_load(&m->ready, memory_order_acquire)) {
    snprintf(err, err_bytes, "model '%s' version %lld is not ready (it is loading, or "
             "failed to load: see `shmserve models`)", m->name, (long long)m->version);
    return SHMS_ERR_UNAVAILABLE;
  }
  uint32_t rows = 0;
  int st = shms_validate_request(&sh->request, m, data_begin, data_end, &rows, err, err_bytes);
  if (st == SHMS_OK) sh->batch_rows = rows;
  return st;
}

/* Longest shape key: per input (index, ndim) and its dims. */
#define SHMS_SHAPE_KEY_MAX (SHMS_MAX_TENSORS * (SHMS_MAX_DIMS + 1))

/* Shape key of a validated request: requests batch together only when every input
 * has the same dtype and the same non-batch dimensions, except a ragged input's
 * (allow_ragged_batch: the worker concatenates it). Inputs in model order, whatever
 * the request's order. Returns the number of words written to key. */
static inline size_t shms_shape_key(const shms_request *r, const shms_model_entry *m,
                                    int64_t key[SHMS_SHAPE_KEY_MAX]) {
  size_t nk = 0;
  uint32_t skip = m->max_batch_size > 0;
  for (uint32_t k = 0; k < m->n_inputs; k++)
    for (uint32_t i = 0; i < r->n_inputs; i++) {
      const shms_tensor_ref *t = &r->inputs[i];
      if (t->index != k) continue;
      key[nk++] = ((int64_t)t->index << 32) | t->ndim;
      if (m->ragged_inputs & (1u << k)) continue;
      for (uint32_t d = skip; d < t->ndim; d++) key[nk++] = t->shape[d];
    }
  return nk;
}

#endif /* SHMS_REQUEST_H */
