/*
 * batcher.c — shmserve._core.BatcherCore: the batcher's per-request work on the common
 * path in one C call each way (docs/architecture.md, "The batcher's hot path in C").
 * drain() pops the live leases' submission rings in turn (each in its client's own
 * arena), claims,
 * copies and validates the request (shms_take_request) and builds its queue entry
 * (scheduling.Pending); hand_over() stamps a batch's requests, records their queue
 * time and assigns the batch to a worker's mailbox. The common policy has its queue in
 * C (batch_queue.c): for such a model, drain() queues its requests with no Python
 * object, dispatch() hands its batches over, and serve() runs the whole loop (sleep,
 * drain, dispatch) while every request is C's. Python keeps the other policies and
 * everything rare (server/intake.py): an arena to map, an invalid request to answer,
 * a stalled or damaged ring head or enqueue_pos, parameters and sequence ids to decode, a draining
 * server. The procedures are shmserve.h's.
 */
#include "core.h"

/* A model whose lone requests go straight to an idle instance (set_direct). */
typedef struct {
  uint32_t n;       /* its instances; 0: not direct now */
  uint64_t *mailbox; /* their mailbox offsets, in the order the batcher prefers them */
} direct_model;

/* A model whose queue is C's (set_queue): drain() queues its requests, dispatch()
 * forms and hands over its batches. */
typedef struct {
  uint32_t valid, rows, n; /* what we placed as an instance's next batch */
  shms_bq_key key;         /* of its first request */
} next_batch;

typedef struct {
  BatchQueue *queue;  /* strong; NULL: the model's queue is Python's */
  uint32_t n;         /* its instances */
  uint64_t *mailbox;  /* their mailbox offsets */
  uint64_t model_off; /* its entry in the server segment */
  int overlap;        /* two batches deep */
  next_batch *next;   /* [n] */
} core_model;

/* A request drain() took, until it is handed over or becomes a Pending. */
typedef struct {
  PyObject *seg; /* its arena's Segment (strong) */
  uint64_t slot_off;
  uint32_t shadow, generation, client_id, model_id, late;
} taken_request;

typedef struct {
  PyObject_HEAD
  Mapping *ctl, *bell, *server;
  PyObject *pending_type; /* scheduling.Pending */
  uint64_t ring_offset, capacity; /* every arena's ring: the server's own geometry */
  uint32_t max_clients, n_models;
  direct_model *direct;   /* [n_models] */
  core_model *queued;     /* [n_models] */
  uint32_t *pass_count;   /* [n_models]: requests of each model taken by this drain() */
  uint8_t *to_python;     /* [n_models]: a request of it went to Python in this drain() */
  taken_request *taken;   /* [max_clients * capacity] */
} BatcherCore;

static PyObject *s_arena, *s_ops, *s_shadow, *s_slot_off, *s_arrived_ns; /* interned names */

/* BatcherCore(control, bell, server, pending_type) */
static int batcher_init(BatcherCore *self, PyObject *args, PyObject *kw) {
  Mapping *ctl, *bell, *server;
  PyObject *pending_type;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &MappingType, &ctl, &MappingType, &bell, &MappingType,
                        &server, &pending_type))
    return -1;
  if (!shms_py_writable(ctl) || !shms_py_writable(bell) || !shms_py_writable(server) ||
      !shms_py_at(ctl, 0, sizeof(shms_control), 64) || !shms_py_at(bell, 0, sizeof(shms_bell), 64) ||
      !shms_py_at(server, 0, sizeof(shms_server_header), 8))
    return -1;
  const shms_server_header *sh = (const shms_server_header *)server->base;
  shms_arena_geometry g = shms_arena_layout(sh->slots_per_client, 0);
  uint64_t cap = g.ring_capacity;
  Py_INCREF(ctl);
  Py_XSETREF(self->ctl, ctl);
  Py_INCREF(bell);
  Py_XSETREF(self->bell, bell);
  Py_INCREF(server);
  Py_XSETREF(self->server, server);
  Py_INCREF(pending_type);
  Py_XSETREF(self->pending_type, pending_type);
  self->ring_offset = g.ring_offset;
  self->capacity = cap;
  self->max_clients = sh->max_clients;
  self->n_models = sh->n_models;
  self->direct = PyMem_Calloc(self->n_models ? self->n_models : 1, sizeof(direct_model));
  self->queued = PyMem_Calloc(self->n_models ? self->n_models : 1, sizeof(core_model));
  self->pass_count = PyMem_Calloc(self->n_models ? self->n_models : 1, sizeof(uint32_t));
  self->to_python = PyMem_Calloc(self->n_models ? self->n_models : 1, 1);
  self->taken = PyMem_Calloc((self->max_clients ? self->max_clients : 1) * cap, sizeof(taken_request));
  if (!self->direct || !self->queued || !self->pass_count || !self->to_python || !self->taken) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

static void clear_queued(core_model *c) {
  for (uint32_t i = 0; c->next && i < c->n; i++) shms_bq_key_clear(&c->next[i].key);
  PyMem_Free(c->next);
  PyMem_Free(c->mailbox);
  Py_CLEAR(c->queue);
  *c = (core_model){0};
}

static void batcher_dealloc(BatcherCore *self) {
  if (self->direct)
    for (uint32_t i = 0; i < self->n_models; i++) PyMem_Free(self->direct[i].mailbox);
  if (self->queued)
    for (uint32_t i = 0; i < self->n_models; i++) clear_queued(&self->queued[i]);
  PyMem_Free(self->direct);
  PyMem_Free(self->queued);
  PyMem_Free(self->pass_count);
  PyMem_Free(self->to_python);
  PyMem_Free(self->taken);
  Py_XDECREF(self->ctl);
  Py_XDECREF(self->bell);
  Py_XDECREF(self->server);
  Py_XDECREF(self->pending_type);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The arena Segment of a live lease from the batcher's {client_id: (lease, Segment,
 * ArenaLayout)} (ServerMaps.arenas), and its Mapping; NULL (no exception) when the
 * lease has no mapping yet or a stale one: Python maps it; the lease's entry with
 * None for the Segment: its arena cannot be mapped (ServerMaps.arena), *ops NULL. */
static PyObject *mapped_arena(PyObject *arenas, uint32_t client_id, uint32_t lease,
                              Mapping **ops) {
  PyObject *key = PyLong_FromUnsignedLong(client_id);
  if (!key) return NULL;
  PyObject *cached = PyDict_GetItemWithError(arenas, key); /* borrowed */
  Py_DECREF(key);
  if (!cached || !PyTuple_Check(cached) || PyTuple_GET_SIZE(cached) < 2) return NULL;
  unsigned long have = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(cached, 0));
  if (have == (unsigned long)-1 && PyErr_Occurred()) return NULL;
  if (have != lease) return NULL;
  PyObject *seg = PyTuple_GET_ITEM(cached, 1);
  if (seg == Py_None) {
    *ops = NULL;
    return seg; /* known unusable: not Python's to try again */
  }
  PyObject *m = PyObject_GetAttr(seg, s_ops);
  if (!m) return NULL;
  Py_DECREF(m); /* the Segment holds it */
  if (Py_TYPE(m) != &MappingType || !((Mapping *)m)->base) return NULL;
  *ops = (Mapping *)m;
  return seg;
}

enum { STOP_POP = 0, STOP_MAP = 1, STOP_INVALID = 2, STOP_RING = 3 };

/* Mailbox offsets from a sequence of ints, each checked, into *out (reallocated). */
static int mailbox_offsets(BatcherCore *self, PyObject *mailboxes, uint64_t **out, uint32_t *n_out) {
  PyObject *seq = PySequence_Fast(mailboxes, "mailboxes must be a sequence of offsets");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  uint64_t *mb = PyMem_Realloc(*out, (n ? n : 1) * sizeof(uint64_t));
  if (!mb) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  *out = mb;
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned long long off = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if ((off == (unsigned long long)-1 && PyErr_Occurred()) ||
        !shms_py_at(self->server, off, sizeof(shms_mailbox), 8)) {
      Py_DECREF(seq);
      return -1;
    }
    mb[i] = off;
  }
  Py_DECREF(seq);
  *n_out = (uint32_t)n;
  return 0;
}

/* set_direct(model_id, mailboxes or None): whether the model's lone requests skip its
 * scheduler. The batcher sets it while the model's policy would send a lone request
 * at once and holds none queued (batcher.py, Model.direct), and clears it as soon as
 * one is queued, so that nothing overtakes a queued request. */
static PyObject *batcher_set_direct(BatcherCore *self, PyObject *args) {
  unsigned int model_id;
  PyObject *mailboxes;
  if (!PyArg_ParseTuple(args, "IO", &model_id, &mailboxes)) return NULL;
  if (model_id >= self->n_models) return PyErr_Format(PyExc_IndexError, "model id %u", model_id);
  direct_model *d = &self->direct[model_id];
  d->n = 0;
  if (mailboxes == Py_None) Py_RETURN_NONE;
  if (mailbox_offsets(self, mailboxes, &d->mailbox, &d->n) < 0) return NULL;
  Py_RETURN_NONE;
}

/* set_queue(model_id, queue or None, mailboxes, model_off, overlap): the model's queue
 * is C's (scheduling/core_queue.py): drain() queues its requests there and
 * dispatch() hands its batches over. None: Python's again. */
static PyObject *batcher_set_queue(BatcherCore *self, PyObject *args) {
  unsigned int model_id;
  PyObject *queue, *mailboxes;
  unsigned long long model_off;
  int overlap;
  if (!PyArg_ParseTuple(args, "IOOKp", &model_id, &queue, &mailboxes, &model_off, &overlap))
    return NULL;
  if (model_id >= self->n_models) return PyErr_Format(PyExc_IndexError, "model id %u", model_id);
  core_model *c = &self->queued[model_id];
  clear_queued(c);
  if (queue == Py_None) Py_RETURN_NONE;
  if (!PyObject_TypeCheck(queue, &BatchQueueType))
    return PyErr_Format(PyExc_TypeError, "set_queue needs a BatchQueue");
  if (!shms_py_at(self->server, model_off, sizeof(shms_model_entry), 8) ||
      mailbox_offsets(self, mailboxes, &c->mailbox, &c->n) < 0)
    return NULL;
  if (!(c->next = PyMem_Calloc(c->n ? c->n : 1, sizeof(next_batch)))) {
    clear_queued(c);
    return PyErr_NoMemory();
  }
  c->model_off = model_off;
  c->overlap = overlap;
  c->queue = (BatchQueue *)Py_NewRef(queue);
  Py_RETURN_NONE;
}

/* The first idle live instance's mailbox of a direct model, or NULL. */
static shms_mailbox *idle_mailbox(BatcherCore *self, const direct_model *d) {
  for (uint32_t i = 0; i < d->n; i++) {
    shms_mailbox *mb = (shms_mailbox *)(self->server->base + d->mailbox[i]);
    uint32_t pid = __atomic_load_n(&mb->pid, __ATOMIC_RELAXED);
    /* SYNC POINT: as dispatch(): the seq_cst load of the state pairs with the
     * worker's store of IDLE; only an idle mailbox may be assigned. */
    if (pid && pid != SHMS_MAILBOX_RETIRED &&
        shms_load(&mb->state, memory_order_seq_cst) == SHMS_MAILBOX_IDLE)
      return mb;
  }
  return NULL;
}

/* The slot of a queued request from its arena Segment: 1 and *slot; 0 when its lease
 * ended while queued (Segment.ops None: nobody to answer); -1 with an exception. */
static int queued_slot(PyObject *seg, uint64_t slot_off, shms_slot **slot) {
  PyObject *ops = PyObject_GetAttr(seg, s_ops);
  if (!ops) return -1;
  Py_DECREF(ops); /* the Segment holds it */
  if (ops == Py_None) return 0;
  if (Py_TYPE(ops) != &MappingType) {
    PyErr_SetString(PyExc_TypeError, "Segment.ops is not a Mapping");
    return -1;
  }
  *slot = (shms_slot *)shms_py_at((Mapping *)ops, slot_off, sizeof(shms_slot), 8);
  return *slot ? 1 : -1;
}

/* Stamps one request BATCHED, records its queue time: hand_over's per request. */
static void batched(shms_slot *s, shms_model_entry *m, uint64_t arrived, uint64_t now) {
  s->t_ns[SHMS_T_BATCHED] = now;
  shms_stats_add(&m->stats, SHMS_DUR_QUEUE, now > arrived ? now - arrived : 0, 1);
}

static void forget_taken(BatcherCore *self, uint32_t n_taken) {
  for (uint32_t i = 0; i < n_taken; i++) {
    self->pass_count[self->taken[i].model_id] = 0;
    self->to_python[self->taken[i].model_id] = 0;
    Py_CLEAR(self->taken[i].seg);
  }
}

/* Client entry c's submission ring, as drain_rings and rings_waiting read it:
 * LEASE_RING (*r, *seg, *arena and *lease set), LEASE_NONE (no live lease, or one whose
 * arena cannot be mapped), LEASE_UNMAPPED (live, its arena not mapped here yet: Python
 * maps it), or -1 with an exception. */
enum { LEASE_NONE = 0, LEASE_UNMAPPED = 1, LEASE_RING = 2 };
static int lease_ring(BatcherCore *self, PyObject *arenas, shms_client_entry *ce, uint32_t c,
                      shms_ring *r, PyObject **seg, Mapping **arena, uint32_t *lease) {
  /* SYNC POINT: as ServerMaps.lease_of: the seq_cst load of the state pairs with the
   * coordinator's store of ALIVE (write_client_entry) and of DEAD. */
  if (shms_load(&ce->state, memory_order_seq_cst) != SHMS_CLIENT_ALIVE) return LEASE_NONE;
  *lease = __atomic_load_n(&ce->generation, __ATOMIC_RELAXED);
  *arena = NULL;
  if (!(*seg = mapped_arena(arenas, c, *lease, arena))) return PyErr_Occurred() ? -1 : LEASE_UNMAPPED;
  if (!*arena) return LEASE_NONE; /* its arena cannot be mapped: nothing of it is served */
  return shms_py_ring_view(*arena, self->ring_offset, self->capacity, r) < 0 ? -1 : LEASE_RING;
}

/* drain(start, count, arenas) -> (visited, [(model_id, Pending, extra)], stop, consumed)
 * Takes every published entry of the submission rings of the live leases start,
 * start + 1, ... (count of them, modulo max_clients), each ring from its position in
 * the server's client table (ring_pos, saved as it goes). A valid request of a direct
 * model (set_direct) that is the only one of its model in this call, with no options
 * for Python to check, goes straight to the model's first idle instance, as its
 * policy would send it. Every other valid request becomes (model_id, Pending,
 * extra): extra is None on the common path, else (parameters_offset,
 * parameters_bytes, flags, sequence_id, sequence_id_offset, sequence_id_bytes, late)
 * for Python to check (late: pushed once the server began to stop). It stops at the
 * first thing only Python handles, in ring start + visited, returned as stop (None:
 * every ring visited):
 *   (STOP_POP, client_id, kind, head_seq): ring_pop's stalled claim or damaged head;
 *   (STOP_MAP, client_id): a live lease whose arena is not mapped here yet;
 *   (STOP_RING, client_id): its enqueue_pos is outside the ring (Python repairs it);
 *   (STOP_INVALID, client_id, slot, generation, status, message, lease): claimed and
 *     refused, for Python to answer.
 * Entries naming another client (a ring is its client's alone), a slot out of range
 * or an ended lease are dropped, as are stale and duplicate ones: the sweep answers
 * a SUBMITTED request whose entry was lost. */
static int drain_rings(BatcherCore *self, uint32_t start, uint32_t count, PyObject *arenas,
                       uint32_t *visited_out, PyObject **items_out, PyObject **stop_out,
                       uint64_t *consumed_out) {
  if (!shms_py_at(self->server, 0, sizeof(shms_server_header), 8)) return -1;
  shms_server_header *h = (shms_server_header *)self->server->base;
  if (h->n_models != self->n_models || h->max_clients != self->max_clients) {
    PyErr_Format(PyExc_ValueError, "the server header's model or client count changed");
    return -1;
  }
  shms_model_entry *models = (shms_model_entry *)shms_py_at(
      self->server, h->models_offset, (uint64_t)h->n_models * sizeof(shms_model_entry), 8);
  shms_client_entry *clients = (shms_client_entry *)shms_py_at(
      self->server, h->clients_offset, (uint64_t)h->max_clients * sizeof(shms_client_entry), 8);
  if (!models || !clients) return -1;
  const shms_arena_geometry geo = shms_arena_layout(h->slots_per_client, 0);
  const uint64_t slots_offset = geo.slots_offset, data_offset = geo.data_offset;
  /* SYNC POINT: pairs with the coordinator's store of drain_since_ns (drain()). */
  const uint64_t drain_since = shms_load(&h->drain_since_ns, memory_order_seq_cst);
  PyObject *items = NULL, *stop = NULL;
  uint32_t n_taken = 0, visited = 0;
  uint64_t consumed = 0;
  if (count > self->max_clients) count = self->max_clients;
  /* 1. take: claim, copy and validate every published request, ring by ring */
  for (; visited < count && !stop; visited++) {
    const uint32_t c = (uint32_t)(((uint64_t)start + visited) % self->max_clients);
    shms_client_entry *ce = &clients[c];
    shms_ring r;
    PyObject *seg;
    Mapping *arena;
    uint32_t lease;
    int has = lease_ring(self, arenas, ce, c, &r, &seg, &arena, &lease);
    if (has < 0) goto fail;
    if (has == LEASE_NONE) continue;
    if (has == LEASE_UNMAPPED) {
      stop = Py_BuildValue("(iI)", STOP_MAP, c);
      break;
    }
    const uint64_t p0 = shms_load(&ce->ring_pos, memory_order_relaxed);
    uint64_t p = p0;
    if (shms_load(r.enqueue_pos, memory_order_acquire) - p > r.capacity) {
      stop = Py_BuildValue("(iI)", STOP_RING, c);
      break;
    }
    int failed = 0;
    for (uint64_t n = 0; n < self->capacity; n++) {
      shms_ring_entry e;
      uint32_t owner = 0;
      uint64_t head_seq = 0;
      int k = shms_ring_pop(&r, &p, &e, &owner, &head_seq);
      if (k == SHMS_POP_EMPTY) break;
      if (k != SHMS_POP_OK) {
        stop = Py_BuildValue("(iIiK)", STOP_POP, c, k, (unsigned long long)head_seq);
        break;
      }
      if (e.client_id != c || e.slot >= h->slots_per_client) continue;
      uint64_t slot_off = slots_offset + (uint64_t)e.slot * sizeof(shms_slot);
      shms_slot *s = (shms_slot *)shms_py_at(arena, slot_off, sizeof(shms_slot), 8);
      uint32_t shadow_index = c * h->slots_per_client + e.slot;
      shms_shadow *sh = (shms_shadow *)shms_py_at(
          self->server, h->shadows_offset + (uint64_t)shadow_index * sizeof(shms_shadow),
          sizeof(shms_shadow), 8);
      if (!s || !sh) {
        failed = 1;
        break;
      }
      char err[SHMS_ERROR_BYTES];
      int st = shms_take_request(s, e.generation, sh, c, e.slot, lease, models, h->n_models,
                                 data_offset, arena->size, NULL, err, sizeof err);
      if (st == SHMS_TAKE_STALE) continue;
      if (st != SHMS_OK) {
        stop = Py_BuildValue("(iIIIisI)", STOP_INVALID, c, e.slot, e.generation, st, err, lease);
        break;
      }
      taken_request *t = &self->taken[n_taken++];
      t->seg = Py_NewRef(seg);
      t->slot_off = slot_off;
      t->shadow = shadow_index;
      t->generation = e.generation;
      t->client_id = c;
      t->late = drain_since && s->t_ns[SHMS_T_ENQUEUE] >= drain_since;
      t->model_id = sh->request.model_id; /* < n_models: validated */
      self->pass_count[t->model_id]++;
    }
    if (p != p0) { /* saved before anything else: the entries are taken. A CAS: a new
                    * lease of this client id (after the coordinator's quarantine) may
                    * have reset it meanwhile, and its ring starts at 0 */
      uint64_t expected = p0;
      shms_cas(&ce->ring_pos, &expected, p);
      consumed += p - p0;
    }
    if (failed || (stop == NULL && PyErr_Occurred())) goto fail;
    if (stop) break;
  }
  /* 2. hand lone requests of direct models over; queue entries for the rest. The
   * shadows are the server's own copies: nothing a client writes changes them now. */
  if (!(items = PyList_New(0))) goto fail;
  uint64_t now = shms_now_ns();
  for (uint32_t i = 0; i < n_taken; i++) {
    taken_request *t = &self->taken[i];
    const shms_shadow *sh = (const shms_shadow *)(self->server->base + h->shadows_offset +
                                                  (uint64_t)t->shadow * sizeof(shms_shadow));
    const shms_request *rq = &sh->request;
    int plain = !rq->parameters_bytes && !rq->flags && !rq->sequence_id &&
                !rq->sequence_id_bytes && !t->late;
    const direct_model *d = &self->direct[t->model_id];
    BatchQueue *queue = self->queued[t->model_id].queue;
    shms_mailbox *mb = plain && d->n && self->pass_count[t->model_id] == 1 &&
                               !(queue && queue->count)
                           ? idle_mailbox(self, d) : NULL;
    if (mb) {
      shms_slot *slot;
      int found = queued_slot(t->seg, t->slot_off, &slot);
      if (found < 0) goto fail;
      if (!found) continue; /* its lease ended this moment: nobody to answer */
      batched(slot, &models[rq->model_id], sh->taken_ns, now);
      /* SYNC POINT (in shms_mailbox_assign): the store of ASSIGNED pairs with the
       * worker's doorbell_wait on its mailbox state. */
      shms_mailbox_assign(mb, &t->shadow, 1);
      continue;
    }
    int64_t key[SHMS_SHAPE_KEY_MAX];
    size_t nk = shms_shape_key(rq, &models[rq->model_id], key);
    shms_bq_item it = {.shadow = t->shadow, .rows = sh->batch_rows,
                       .generation = t->generation, .priority = rq->priority,
                       .client = t->client_id, .arrived_ns = sh->taken_ns,
                       .slot_off = t->slot_off, .timeout_us = rq->timeout_us};
    if (shms_bq_key_set(&it.key, key, nk * sizeof(int64_t)) < 0) goto fail;
    it.seg = Py_NewRef(t->seg);
    /* C's queue, no Pending; but once a request of the model went to Python in this
     * drain, its later ones follow it there, so that each client's keep their order. */
    if (plain && queue && !self->to_python[t->model_id] && shms_bq_room(queue, t->client_id)) {
      if (shms_bq_push(queue, &it) < 0) {
        shms_bq_item_clear(&it);
        goto fail;
      }
      continue;
    }
    /* Python's: its options to check, or a refusal (full queue) to word */
    self->to_python[t->model_id] = 1;
    PyObject *pending = shms_bq_pending(self->pending_type, &it);
    shms_bq_item_clear(&it);
    if (!pending) goto fail;
    PyObject *item;
    if (plain) {
      item = Py_BuildValue("(INO)", rq->model_id, pending, Py_None);
    } else {
      item = Py_BuildValue("(IN(KIIKKIO))", rq->model_id, pending,
                           (unsigned long long)rq->parameters_offset, rq->parameters_bytes,
                           rq->flags, (unsigned long long)rq->sequence_id,
                           (unsigned long long)rq->sequence_id_offset, rq->sequence_id_bytes,
                           t->late ? Py_True : Py_False);
    }
    if (!item || PyList_Append(items, item) < 0) {
      Py_XDECREF(item);
      goto fail;
    }
    Py_DECREF(item);
  }
  forget_taken(self, n_taken);
  if (!stop) {
    if (PyErr_Occurred()) goto fail;
    stop = Py_NewRef(Py_None);
  }
  *visited_out = visited;
  *items_out = items;
  *stop_out = stop;
  *consumed_out = consumed;
  return 0;
fail:
  /* The requests taken stay QUEUED in their slots: the sweep finds none of them (it
   * looks for SUBMITTED), so this is fatal to the batcher, as any exception in its
   * loop is; its successor recovers them (Intake.recover). */
  forget_taken(self, n_taken);
  Py_XDECREF(items);
  Py_XDECREF(stop);
  return -1;
}

/* Whether a live lease's ring has a published entry at the batcher's position: after
 * a sleep that ran its course, a push that did not wake us (somebody undid the bell's
 * moves, or stole its wake-up). 1, 0, or -1 with an exception. */
static int rings_waiting(BatcherCore *self, PyObject *arenas) {
  shms_server_header *h = (shms_server_header *)self->server->base;
  shms_client_entry *clients = (shms_client_entry *)shms_py_at(
      self->server, h->clients_offset, (uint64_t)self->max_clients * sizeof(shms_client_entry), 8);
  if (!clients) return -1;
  for (uint32_t c = 0; c < self->max_clients; c++) {
    shms_client_entry *ce = &clients[c];
    shms_ring r;
    PyObject *seg;
    Mapping *arena;
    uint32_t lease;
    int has = lease_ring(self, arenas, ce, c, &r, &seg, &arena, &lease);
    if (has < 0) return -1;
    if (has != LEASE_RING) continue; /* one not mapped yet: the next drain maps it */
    /* a published head: a claim still being written (or stalled) rang nobody yet */
    uint64_t pos = shms_load(&ce->ring_pos, memory_order_relaxed);
    if (shms_load(&r.cells[pos & (r.capacity - 1)].seq, memory_order_acquire) == pos + 1) return 1;
  }
  return 0;
}

/* waiting(arenas) -> whether a live lease's ring has a published entry not taken. */
static PyObject *batcher_waiting(BatcherCore *self, PyObject *arenas) {
  if (!PyDict_Check(arenas)) {
    PyErr_SetString(PyExc_TypeError, "waiting(arenas): a dict");
    return NULL;
  }
  int w = rings_waiting(self, arenas);
  return w < 0 ? NULL : PyBool_FromLong(w);
}

static PyObject *batcher_drain(BatcherCore *self, PyObject *args) {
  unsigned int start, count;
  PyObject *arenas, *items, *stop;
  if (!PyArg_ParseTuple(args, "IIO!", &start, &count, &PyDict_Type, &arenas)) return NULL;
  uint32_t visited;
  uint64_t consumed;
  if (drain_rings(self, start, count, arenas, &visited, &items, &stop, &consumed) < 0) return NULL;
  return Py_BuildValue("(INNK)", visited, items, stop, (unsigned long long)consumed);
}

/* The shadows of a batch's Pendings, each stamped BATCHED with its queue time recorded
 * in the model's statistics; those whose lease ended while queued (arena unmapped:
 * Segment.ops None) are left out. Returns how many, or -1 with an exception. */
static Py_ssize_t stamp_batch(BatcherCore *self, shms_model_entry *m, PyObject *batch,
                              uint32_t shadows[SHMS_MAX_BATCH_REQUESTS]) {
  Py_ssize_t size = PyList_GET_SIZE(batch), n = 0;
  if (size > SHMS_MAX_BATCH_REQUESTS) {
    PyErr_Format(PyExc_ValueError, "a batch holds at most %d requests, not %zd",
                 SHMS_MAX_BATCH_REQUESTS, size);
    return -1;
  }
  uint64_t now = shms_now_ns();
  for (Py_ssize_t i = 0; i < size; i++) {
    PyObject *p = PyList_GET_ITEM(batch, i);
    uint64_t shadow, slot_off, arrived;
    if (shms_py_attr_u64(p, s_shadow, &shadow) < 0 ||
        shms_py_attr_u64(p, s_slot_off, &slot_off) < 0 ||
        shms_py_attr_u64(p, s_arrived_ns, &arrived) < 0)
      return -1;
    PyObject *arena = PyObject_GetAttr(p, s_arena);
    if (!arena) return -1;
    shms_slot *s;
    int found = queued_slot(arena, slot_off, &s);
    Py_DECREF(arena);
    if (found < 0) return -1;
    if (!found) continue; /* its lease ended while queued: nobody to answer */
    batched(s, m, arrived, now);
    shadows[n++] = (uint32_t)shadow;
  }
  return n;
}

/* stamp_batch for the model entry at model_off, and the mailbox at mb_off (*mb). */
static Py_ssize_t stamp_for(BatcherCore *self, unsigned long long mb_off,
                            unsigned long long model_off, PyObject *batch, shms_mailbox **mb,
                            uint32_t shadows[SHMS_MAX_BATCH_REQUESTS]) {
  *mb = (shms_mailbox *)shms_py_at(self->server, mb_off, sizeof(shms_mailbox), 8);
  shms_model_entry *m =
      (shms_model_entry *)shms_py_at(self->server, model_off, sizeof(shms_model_entry), 8);
  if (!*mb || !m) return -1;
  return stamp_batch(self, m, batch, shadows);
}

/* hand_over(mailbox_off, model_off, batch) -> how many were handed over. batch: the
 * Pendings a scheduler gave for an idle instance (stamp_batch). Assigned to the
 * mailbox (shms_mailbox_assign, which wakes a sleeping worker); none left: nothing is
 * assigned. */
static PyObject *batcher_hand_over(BatcherCore *self, PyObject *args) {
  unsigned long long mb_off, model_off;
  PyObject *batch;
  if (!PyArg_ParseTuple(args, "KKO!", &mb_off, &model_off, &PyList_Type, &batch)) return NULL;
  shms_mailbox *mb;
  uint32_t shadows[SHMS_MAX_BATCH_REQUESTS];
  Py_ssize_t n = stamp_for(self, mb_off, model_off, batch, &mb, shadows);
  if (n < 0) return NULL;
  /* SYNC POINT (in shms_mailbox_assign): the store of ASSIGNED pairs with the worker's
   * doorbell_wait on its mailbox state; what the caller stored before (ticket,
   * sequence slots) is visible to the worker with it. */
  if (n) shms_mailbox_assign(mb, shadows, (uint32_t)n);
  return PyLong_FromSsize_t(n);
}

/* place(mailbox_off, model_off, batch, append) -> (n, where): hand_over for an
 * instance that may be busy (shms_mailbox_put): where is 0 (it was idle: its batch),
 * 1 (its next batch) or 2 (joined the next batch there, append true); n as
 * hand_over's (where is 0 and nothing happened when n is 0). */
static PyObject *batcher_place(BatcherCore *self, PyObject *args) {
  unsigned long long mb_off, model_off;
  PyObject *batch;
  int append;
  if (!PyArg_ParseTuple(args, "KKO!p", &mb_off, &model_off, &PyList_Type, &batch, &append))
    return NULL;
  shms_mailbox *mb;
  uint32_t shadows[SHMS_MAX_BATCH_REQUESTS];
  Py_ssize_t n = stamp_for(self, mb_off, model_off, batch, &mb, shadows);
  if (n < 0) return NULL;
  int where = n ? shms_mailbox_put(mb, shadows, (uint32_t)n, append) : 0;
  if (where < 0)
    return PyErr_Format(PyExc_RuntimeError, "mailbox at %llu: no room for %zd requests %s",
                        mb_off, n, append ? "in its next batch" : "(it holds a next batch)");
  return Py_BuildValue("(ni)", n, where);
}

/* Stamps the items picked from a core-queued model's queue BATCHED, records their
 * queue time, and gives their shadows and rows; those whose lease ended while queued
 * (Segment.ops None) are left out. Returns how many, or -1 with an exception. */
static int stamp_items(BatcherCore *self, core_model *c, const int32_t *picked, int n,
                       uint64_t now, uint32_t shadows[SHMS_MAX_BATCH_REQUESTS], uint32_t *rows) {
  shms_model_entry *m =
      (shms_model_entry *)shms_py_at(self->server, c->model_off, sizeof(shms_model_entry), 8);
  if (!m) return -1;
  int k = 0;
  *rows = 0;
  for (int i = 0; i < n; i++) {
    const shms_bq_item *x = &c->queue->items[picked[i]];
    if (!x->seg) continue; /* no arena: nobody to answer */
    shms_slot *s;
    int found = queued_slot(x->seg, x->slot_off, &s);
    if (found < 0) return -1;
    if (!found) continue; /* its lease ended while queued */
    batched(s, m, x->arrived_ns, now);
    shadows[k++] = x->shadow;
    *rows += x->rows;
  }
  return k;
}

/* What we placed as instance i's next batch (where: shms_mailbox_put's answer). */
static void note_next(next_batch *nb, int where, const shms_bq_key *key, uint32_t rows,
                      uint32_t n) {
  if (where == 2) { /* joined the one there */
    nb->rows += rows;
    nb->n += n;
    return;
  }
  shms_bq_key_clear(&nb->key);
  nb->valid = where == 1;
  if (nb->valid) {
    shms_bq_key_copy(&nb->key, key);
    nb->rows = rows;
    nb->n = n;
  }
}

/* Picked items: stamped, taken from the queue and placed in mailbox i (placed: 0 assign
 * to an idle instance, else shms_mailbox_put with append = placed - 1). Returns how many
 * were placed (and *where), or -1 with an exception. */
static int place_picked(BatcherCore *self, core_model *c, uint32_t i, const int32_t *picked,
                        int n, uint64_t now, int placed, int *where) {
  uint32_t shadows[SHMS_MAX_BATCH_REQUESTS], rows;
  shms_bq_key key;
  shms_bq_key_copy(&key, &c->queue->items[picked[0]].key);
  int h = stamp_items(self, c, picked, n, now, shadows, &rows);
  if (h < 0) {
    shms_bq_key_clear(&key);
    return -1;
  }
  shms_bq_take(c->queue, picked, n);
  shms_mailbox *mb = (shms_mailbox *)(self->server->base + c->mailbox[i]);
  *where = 0;
  if (h && !placed) {
    /* SYNC POINT (in shms_mailbox_assign): the store of ASSIGNED pairs with the
     * worker's doorbell_wait on its mailbox state. */
    shms_mailbox_assign(mb, shadows, (uint32_t)h);
  } else if (h) {
    /* SYNC POINT (in shms_mailbox_put): its CAS pairs with the worker's in
     * shms_mailbox_finish. */
    *where = shms_mailbox_put(mb, shadows, (uint32_t)h, placed - 1);
    if (*where < 0) {
      shms_bq_key_clear(&key);
      PyErr_Format(PyExc_RuntimeError, "mailbox of instance %u: no room for %d requests", i, h);
      return -1;
    }
  }
  if (c->overlap) {
    if (!placed) note_next(&c->next[i], 0, &key, 0, 0);
    else if (h) note_next(&c->next[i], *where, &key, rows, (uint32_t)h);
  }
  shms_bq_key_clear(&key);
  return h;
}

/* Two batches deep, for a core-queued model (batcher.py's fill_next): a busy
 * instance's next batch waits in its mailbox; requests join the one there, or form
 * one for an instance without. *wait_until: the policy's deadline when it holds
 * requests back, else SHMS_BQ_NO_DEADLINE. Returns 0, or -1 with an exception. */
static int fill_next(BatcherCore *self, core_model *c, uint64_t now, int *handed,
                     uint64_t *wait_until) {
  BatchQueue *q = c->queue;
  int32_t picked[SHMS_MAX_BATCH_REQUESTS];
  uint32_t free_n = 0, free_mb[c->n ? c->n : 1];
  int where;
  for (uint32_t i = 0; i < c->n; i++) {
    shms_mailbox *mb = (shms_mailbox *)(self->server->base + c->mailbox[i]);
    uint32_t state = shms_load(&mb->state, memory_order_seq_cst);
    next_batch *nb = &c->next[i];
    if (state == SHMS_MAILBOX_ASSIGNED_NEXT && nb->valid) {
      int n = q->count ? shms_bq_join(q, &nb->key, nb->rows, nb->n, picked) : 0;
      if (n && place_picked(self, c, i, picked, n, now, 2, &where) < 0) return -1;
      continue;
    }
    note_next(nb, 0, NULL, 0, 0); /* taken by its worker, or never there */
    uint32_t pid = __atomic_load_n(&mb->pid, __ATOMIC_RELAXED);
    if (state == SHMS_MAILBOX_ASSIGNED && pid && pid != SHMS_MAILBOX_RETIRED) free_mb[free_n++] = i;
  }
  *wait_until = SHMS_BQ_NO_DEADLINE;
  for (uint32_t k = 0; k < free_n && q->count;) {
    int n = shms_bq_next(q, now, picked, wait_until);
    if (!n) return 0;
    int h = place_picked(self, c, free_mb[k], picked, n, now, 1, &where);
    if (h < 0) return -1;
    if (h) {
      k++;
      (*handed)++;
    }
  }
  return 0;
}

/* dispatch(model_id, now_ns) -> (deadline or None, batches handed over): batcher.py's
 * dispatch() of one model whose queue is C's (set_queue), with no Python per request:
 * batches for its idle instances (Triton's greedy rule: one instance or greedy
 * balancing), next batches for its busy ones when two deep, and the instances asked
 * to ring when they go idle while requests wait. The deadline: when the policy holds
 * requests back, or now when an instance went idle while we looked. */
static int dispatch_model(BatcherCore *self, core_model *c, uint64_t now, uint64_t *deadline_out,
                          int *handed_out) {
  BatchQueue *q = c->queue;
  uint64_t deadline = SHMS_BQ_NO_DEADLINE;
  int handed = 0, waiting_for_more = 0, where;
  uint32_t busy_n = 0, idle_n = 0, busy[c->n ? c->n : 1], idle[c->n ? c->n : 1];
  int32_t picked[SHMS_MAX_BATCH_REQUESTS];
  *deadline_out = SHMS_BQ_NO_DEADLINE;
  *handed_out = 0;
  if (!q->count) return 0;
  for (uint32_t i = 0; i < c->n; i++) {
    shms_mailbox *mb = (shms_mailbox *)(self->server->base + c->mailbox[i]);
    uint32_t pid = __atomic_load_n(&mb->pid, __ATOMIC_RELAXED);
    if (pid == SHMS_MAILBOX_RETIRED) continue; /* fail_retired_batches answers its batch */
    /* SYNC POINT: as batcher.py's dispatch: the seq_cst load pairs with the worker's
     * store of IDLE. */
    if (!pid || shms_load(&mb->state, memory_order_seq_cst) != SHMS_MAILBOX_IDLE)
      busy[busy_n++] = i;
    else
      idle[idle_n++] = i;
  }
  for (uint32_t k = 0; k < idle_n && q->count;) {
    uint64_t wait_until;
    int n = shms_bq_next(q, now, picked, &wait_until);
    if (!n) {
      deadline = wait_until;
      waiting_for_more = wait_until != SHMS_BQ_NO_DEADLINE;
      break;
    }
    int h = place_picked(self, c, idle[k], picked, n, now, 0, &where);
    if (h < 0) return -1;
    if (h) { /* busy now: it must ring us when done */
      busy[busy_n++] = idle[k++];
      handed++;
    }
  }
  if (c->overlap && q->count && !waiting_for_more) {
    uint64_t wait_until;
    if (fill_next(self, c, now, &handed, &wait_until) < 0) return -1;
    if (wait_until < deadline) deadline = wait_until;
  }
  if (q->count && busy_n && !waiting_for_more) {
    /* SYNC POINT: as batcher.py's dispatch: pairs with the worker's store of IDLE then
     * load of batcher_waiting: either it rings us, or we see it idle here. */
    for (uint32_t k = 0; k < busy_n; k++) {
      shms_mailbox *mb = (shms_mailbox *)(self->server->base + c->mailbox[busy[k]]);
      shms_store(&mb->batcher_waiting, 1u, memory_order_seq_cst);
    }
    for (uint32_t k = 0; k < busy_n; k++) { /* one starting rings when it is up */
      shms_mailbox *mb = (shms_mailbox *)(self->server->base + c->mailbox[busy[k]]);
      if (shms_load(&mb->state, memory_order_seq_cst) == SHMS_MAILBOX_IDLE &&
          __atomic_load_n(&mb->pid, __ATOMIC_RELAXED))
        deadline = now;
    }
  }
  *deadline_out = deadline;
  *handed_out = handed;
  return 0;
}

/* dispatch(model_id, now_ns) -> (deadline or None, batches handed over) */
static PyObject *batcher_dispatch(BatcherCore *self, PyObject *args) {
  unsigned int model_id;
  unsigned long long now;
  if (!PyArg_ParseTuple(args, "IK", &model_id, &now)) return NULL;
  if (model_id >= self->n_models || !self->queued[model_id].queue)
    return PyErr_Format(PyExc_ValueError, "model id %u has no queue in C", model_id);
  uint64_t deadline;
  int handed;
  if (dispatch_model(self, &self->queued[model_id], now, &deadline, &handed) < 0) return NULL;
  if (deadline == SHMS_BQ_NO_DEADLINE) return Py_BuildValue("(Oi)", Py_None, handed);
  return Py_BuildValue("(Ki)", (unsigned long long)deadline, handed);
}

/* Why serve() gave the loop back to Python (batcher.py, Batcher.serve_in_c). */
enum {
  SERVE_DRAINED = 1,   /* drain() left items or a stop for Python */
  SERVE_TIME = 2,      /* until_ns came: Python's own timers */
  SERVE_IDLE = 3,      /* an idle check's sleep ended with nothing to do */
  SERVE_LOST_RING = 4, /* a sleep ran its whole course: a push did not wake us */
  SERVE_TABLE = 5,     /* the model table changed */
  SERVE_NOT_READY = 7, /* a model with requests queued here is not ready */
};

/* serve(rotor, arenas, seen, deadline, until_ns, woken_until_ns, epoch, spin, idle_check_ns,
 *       states) -> (rotor, why, items, stop, handed, consumed, start, left)
 * The batcher's loop (batcher.py's serve_forever) while every request is C's: sleep
 * until rung or the deadline, take the rings (drain_rings, from ring `rotor` on, one
 * further each pass), hand batches over
 * (dispatch_model per queued model), and again, with no Python per pass. Python
 * calls it after a pass of its own found nothing of its own to do (no request in a
 * Python queue, no defence on, no stalled claim, no damage, no drain), with that
 * pass's doorbell value (seen) and deadline; it gets the loop back (why) as soon as
 * anything is Python's, at until_ns (its sweep), and on the first wake-up from
 * woken_until_ns on (its timers that only matter when something happens: retired
 * instances, the doorbell's noise window). states: every mailbox's state offset (spin only while
 * no worker computes). items and stop: drain()'s, for Python to finish, and the
 * rings that drain did not visit: `left` of them from `start` on. */
static PyObject *batcher_serve(BatcherCore *self, PyObject *args) {
  unsigned long long until, woken_until, idle_check;
  unsigned int rotor, seen, epoch;
  PyObject *arenas, *deadline_obj, *spin, *states;
  if (!PyArg_ParseTuple(args, "IO!IOKKIOKO!", &rotor, &PyDict_Type, &arenas, &seen, &deadline_obj,
                        &until, &woken_until, &epoch, &spin, &idle_check, &PyTuple_Type,
                        &states))
    return NULL;
  uint64_t deadline = SHMS_BQ_NO_DEADLINE;
  if (deadline_obj != Py_None) {
    deadline = PyLong_AsUnsignedLongLong(deadline_obj);
    if (deadline == (uint64_t)-1 && PyErr_Occurred()) return NULL;
  }
  Spin *policy = Py_TYPE(spin) == &SpinType ? (Spin *)spin : NULL;
  long long spin_ns = 0;
  if (!policy && (spin_ns = PyLong_AsLongLong(spin)) == -1 && PyErr_Occurred()) return NULL;
  if (!shms_py_at(self->ctl, 0, sizeof(shms_control), 64) ||
      !shms_py_at(self->bell, 0, sizeof(shms_bell), 64) ||
      !shms_py_at(self->server, 0, sizeof(shms_server_header), 8))
    return NULL;
  shms_control *ctl = (shms_control *)self->ctl->base;
  SHMS_ATOMIC(uint32_t) *doorbell = &((shms_bell *)self->bell->base)->doorbell;
  shms_server_header *h = (shms_server_header *)self->server->base;
  Py_ssize_t n_states = PyTuple_GET_SIZE(states);
  SHMS_ATOMIC(uint32_t) *state[n_states ? n_states : 1];
  for (Py_ssize_t i = 0; i < n_states; i++) {
    unsigned long long off = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(states, i));
    if (off == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!(state[i] = (SHMS_ATOMIC(uint32_t) *)shms_py_at(self->server, off, 4, 4))) return NULL;
  }
  uint64_t consumed = 0;
  uint32_t start = 0, left = 0;
  int why = 0, handed = 0;
  PyObject *items = NULL, *stop = NULL;
  Py_INCREF(spin); /* the settings thread may change the policy while we wait */
  for (;;) {
    /* 4. sleep until rung, or until the deadline (batcher.py's step 4) */
    uint64_t now = shms_now_ns();
    if (now >= until) {
      why = SERVE_TIME;
      break;
    }
    uint64_t timeout = deadline == SHMS_BQ_NO_DEADLINE ? idle_check
                       : deadline > now                ? deadline - now
                                                       : 0;
    int idle = deadline == SHMS_BQ_NO_DEADLINE, capped = timeout > until - now;
    if (capped) { /* our timer's end, not the loop's: no evidence of anything */
      timeout = until - now;
      idle = 0;
    }
    int busy = 0;
    for (Py_ssize_t i = 0; i < n_states && !busy; i++)
      busy = shms_load(state[i], memory_order_relaxed) != 0;
    int woke;
    uint32_t token = shms_py_sleep_token(); /* this sleep's (shms_doorbell_ring_sole) */
    shms_py_enter(self->ctl);
    shms_py_enter(self->bell);
    Py_BEGIN_ALLOW_THREADS
    /* SYNC POINT: as batcher.py's wait: clients (ring_push + doorbell_ring) and
     * workers (idle) ring us; sole: we are the doorbell's one sleeper. */
    woke = policy && !busy
               ? shms_spin_wait(&policy->spin, doorbell, &ctl->batcher_sleeping, seen,
                                (int64_t)timeout, token)
               : shms_doorbell_wait_x(doorbell, &ctl->batcher_sleeping, seen,
                                      busy ? 0 : spin_ns, (int64_t)timeout, NULL, token);
    Py_END_ALLOW_THREADS
    shms_py_leave(self->bell);
    shms_py_leave(self->ctl);
    if (woke > 0 && woke < 3) shms_fetch_add(&h->batcher_wakeups[woke], 1, memory_order_relaxed);
    if (PyErr_CheckSignals() < 0) goto fail; /* as Python's loop: a handler may raise */
    if (!woke && idle) { /* pushes left waiting by a whole sleep did not wake us */
      int waiting = rings_waiting(self, arenas);
      if (waiting < 0) goto fail;
      why = waiting ? SERVE_LOST_RING : SERVE_IDLE;
      break;
    }
    if (woke == SHMS_WAKE_SLEEP && !capped && timeout >= 1000000 &&
        shms_now_ns() - now >= timeout) {
      why = SERVE_LOST_RING;
      break;
    }
    if (woke && shms_now_ns() >= woken_until) {
      why = SERVE_TIME;
      break;
    }
    /* 0.-3. a pass: the table, the rings, the batches */
    seen = shms_load(doorbell, memory_order_seq_cst);
    if (shms_load(&h->table_epoch, memory_order_seq_cst) != epoch) {
      why = SERVE_TABLE;
      break;
    }
    uint32_t visited;
    uint64_t took;
    start = rotor % (self->max_clients ? self->max_clients : 1);
    rotor = start + 1; /* fair: each pass begins one ring further */
    if (drain_rings(self, start, self->max_clients, arenas, &visited, &items, &stop, &took) < 0)
      goto fail;
    consumed += took;
    if (PyList_GET_SIZE(items) || stop != Py_None) {
      /* Python goes on from the stop's ring round every ring: those drained before it
       * were drained before Python's pass loads the doorbell, and a push to them
       * meanwhile may not have rung (we were awake) */
      start += visited;
      left = self->max_clients;
      why = SERVE_DRAINED;
      break;
    }
    Py_CLEAR(items);
    Py_CLEAR(stop);
    now = shms_now_ns();
    deadline = SHMS_BQ_NO_DEADLINE;
    for (uint32_t m = 0; m < self->n_models; m++) {
      core_model *c = &self->queued[m];
      if (!c->queue || !c->queue->count) continue;
      shms_model_entry *entry = (shms_model_entry *)(self->server->base + c->model_off);
      if (!shms_load(&entry->ready, memory_order_seq_cst)) {
        why = SERVE_NOT_READY;
        break;
      }
      uint64_t d;
      int n;
      if (dispatch_model(self, c, now, &d, &n) < 0) goto fail;
      handed += n;
      if (d < deadline) deadline = d;
      shms_store(&entry->stats.pending, (uint64_t)c->queue->count, memory_order_relaxed);
    }
    if (why) break;
  }
  Py_DECREF(spin);
  if (!items) items = PyList_New(0);
  if (!stop) stop = Py_NewRef(Py_None);
  return Py_BuildValue("(IiNNiKII)", rotor, why, items, stop, handed,
                       (unsigned long long)consumed, start, left);
fail:
  Py_DECREF(spin);
  Py_XDECREF(items);
  Py_XDECREF(stop);
  return NULL;
}

static PyMethodDef batcher_methods[] = {
    {"drain", (PyCFunction)batcher_drain, METH_VARARGS,
     "drain(start, count, arenas) -> (visited, [(model_id, Pending, extra)], stop, consumed): "
     "take the published requests of the live leases' rings (see csrc/batcher.c)."},
    {"waiting", (PyCFunction)batcher_waiting, METH_O,
     "waiting(arenas) -> whether a live lease's ring has a published entry not taken."},
    {"set_queue", (PyCFunction)batcher_set_queue, METH_VARARGS,
     "set_queue(model_id, queue or None, mailboxes, model_off, overlap): the model's queue "
     "is C's: drain() fills it, dispatch() empties it."},
    {"dispatch", (PyCFunction)batcher_dispatch, METH_VARARGS,
     "dispatch(model_id, now_ns) -> (deadline or None, batches handed over): batches of a "
     "model whose queue is C's."},
    {"serve", (PyCFunction)batcher_serve, METH_VARARGS,
     "serve(rotor, arenas, seen, deadline, until_ns, woken_until_ns, epoch, spin, idle_check_ns, "
     "states) -> (rotor, why, items, stop, handed, consumed, start, left): the loop while "
     "every request is C's."},
    {"set_direct", (PyCFunction)batcher_set_direct, METH_VARARGS,
     "set_direct(model_id, mailboxes or None): lone requests skip the scheduler."},
    {"hand_over", (PyCFunction)batcher_hand_over, METH_VARARGS,
     "hand_over(mailbox_off, model_off, batch) -> n: stamp, record and assign a batch."},
    {"place", (PyCFunction)batcher_place, METH_VARARGS,
     "place(mailbox_off, model_off, batch, append) -> (n, where): hand_over to an instance "
     "that may be busy: its batch (0), its next batch (1), joined to its next batch (2)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject BatcherCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.BatcherCore",
    .tp_basicsize = sizeof(BatcherCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The batcher's per-request work on the common path (csrc/batcher.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)batcher_init,
    .tp_dealloc = (destructor)batcher_dealloc,
    .tp_methods = batcher_methods,
};

int shms_py_batcher_ready(void) {
  s_arena = PyUnicode_InternFromString("arena");
  s_ops = PyUnicode_InternFromString("ops");
  s_shadow = PyUnicode_InternFromString("shadow");
  s_slot_off = PyUnicode_InternFromString("slot_off");
  s_arrived_ns = PyUnicode_InternFromString("arrived_ns");
  return s_arena && s_ops && s_shadow && s_slot_off && s_arrived_ns ? 0 : -1;
}
