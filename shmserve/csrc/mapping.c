/*
 * mapping.c — shmserve._core.Mapping's plain operations: atomics and futex doorbells
 * on words of a segment, the request ring (shms_ring.h), and bulk copies in.
 */
#include "core.h"

static void drop_buffer(Mapping *self) {
  if (self->base) PyBuffer_Release(&self->view);
  self->base = NULL;
  self->size = 0;
}

static PyObject *mapping_release(Mapping *self, PyObject *unused) {
  if (self->in_use) {
    self->release_pending = 1;
    Py_RETURN_NONE;
  }
  drop_buffer(self);
  Py_RETURN_NONE;
}

void shms_py_enter(Mapping *m) { m->in_use++; }

uint32_t shms_py_sleep_token(void) {
  static uint32_t last; /* this process's, shared by every file of the extension */
  uint32_t token;
  /* Start anywhere: a client's arena keeps the last token it woke (rang_token), and a
   * restarted batcher counting from 1 again would meet those old values at once. */
  if (!__atomic_load_n(&last, __ATOMIC_RELAXED)) {
    uint32_t seed = (uint32_t)shms_now_ns() ^ ((uint32_t)getpid() << 16);
    uint32_t zero = 0;
    __atomic_compare_exchange_n(&last, &zero, seed | 1u, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
  do token = __atomic_add_fetch(&last, 1u, __ATOMIC_RELAXED);
  while (!token);
  return token;
}

void shms_py_leave(Mapping *m) {
  if (--m->in_use == 0 && m->release_pending) {
    m->release_pending = 0;
    drop_buffer(m);
  }
}

void *shms_py_at(Mapping *m, unsigned long long off, uint64_t len, uint64_t align) {
  if (!m->base) {
    PyErr_SetString(PyExc_ValueError, "mapping is released");
    return NULL;
  }
  if (off > m->size || len > m->size - off || (align && off % align)) {
    PyErr_Format(PyExc_IndexError, "offset %llu (+%llu) outside mapping of %llu bytes",
                 off, (unsigned long long)len, (unsigned long long)m->size);
    return NULL;
  }
  return m->base + off;
}

#define ATOMIC32(m, off) ((SHMS_ATOMIC(uint32_t) *)shms_py_at((m), (off), 4, 4))
#define ATOMIC64(m, off) ((SHMS_ATOMIC(uint64_t) *)shms_py_at((m), (off), 8, 8))

int shms_py_writable(Mapping *m) {
  if (!m->readonly) return 1;
  PyErr_SetString(PyExc_PermissionError, "read-only mapping: a client's control block is the server's");
  return 0;
}

static PyObject *m_load32(Mapping *self, PyObject *arg) {
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, PyLong_AsUnsignedLongLong(arg));
  if (!p) return NULL;
  return PyLong_FromUnsignedLong(shms_load(p, memory_order_seq_cst));
}

static PyObject *m_load64(Mapping *self, PyObject *arg) {
  SHMS_ATOMIC(uint64_t) *p = ATOMIC64(self, PyLong_AsUnsignedLongLong(arg));
  if (!p) return NULL;
  return PyLong_FromUnsignedLongLong(shms_load(p, memory_order_acquire));
}

static PyObject *m_store32(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off;
  unsigned int v;
  if (!PyArg_ParseTuple(args, "KI", &off, &v)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  shms_store(p, v, memory_order_seq_cst);
  Py_RETURN_NONE;
}

static PyObject *m_store64(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, v;
  if (!PyArg_ParseTuple(args, "KK", &off, &v)) return NULL;
  SHMS_ATOMIC(uint64_t) *p = ATOMIC64(self, off);
  if (!p) return NULL;
  shms_store(p, v, memory_order_seq_cst);
  Py_RETURN_NONE;
}

static PyObject *m_add32(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off;
  int v;
  if (!PyArg_ParseTuple(args, "Ki", &off, &v)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  return PyLong_FromUnsignedLong(shms_fetch_add(p, (uint32_t)v, memory_order_seq_cst));
}

static PyObject *m_add64(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, v;
  if (!PyArg_ParseTuple(args, "KK", &off, &v)) return NULL;
  SHMS_ATOMIC(uint64_t) *p = ATOMIC64(self, off);
  if (!p) return NULL;
  return PyLong_FromUnsignedLongLong(shms_fetch_add(p, (uint64_t)v, memory_order_seq_cst));
}

static PyObject *m_cas32(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off;
  unsigned int expected, desired;
  if (!PyArg_ParseTuple(args, "KII", &off, &expected, &desired)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  uint32_t e = expected;
  return PyBool_FromLong(shms_cas(p, &e, (uint32_t)desired));
}

static PyObject *m_wake(Mapping *self, PyObject *args) {
  unsigned long long off;
  int n = INT32_MAX;
  if (!PyArg_ParseTuple(args, "K|i", &off, &n)) return NULL;
  SHMS_ATOMIC(uint32_t) *p = ATOMIC32(self, off);
  if (!p) return NULL;
  shms_futex_wake(p, n);
  Py_RETURN_NONE;
}

/* doorbell_ring(word_off, sleeping_off, n=1): wakes up to n counted sleepers */
static PyObject *m_doorbell_ring(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, soff;
  int n = 1;
  if (!PyArg_ParseTuple(args, "KK|i", &off, &soff, &n)) return NULL;
  SHMS_ATOMIC(uint32_t) *w = ATOMIC32(self, off), *s = ATOMIC32(self, soff);
  if (!w || !s) return NULL;
  shms_doorbell_ring(w, s, n);
  Py_RETURN_NONE;
}

/* ring_batcher(bell): a server process, on the control segment's (writable) mapping,
 * rings the batcher: bell.doorbell with control.batcher_sleeping's token taken back
 * (shms_doorbell_ring_sole) */
static PyObject *m_ring_batcher(Mapping *self, PyObject *arg) {
  if (!shms_py_writable(self) || (PyObject_TypeCheck(arg, &MappingType) && !shms_py_writable((Mapping *)arg))) return NULL;
  if (!PyObject_TypeCheck(arg, &MappingType)) {
    PyErr_SetString(PyExc_TypeError, "ring_batcher(bell): the bell segment's Mapping");
    return NULL;
  }
  SHMS_ATOMIC(uint32_t) *w = ATOMIC32((Mapping *)arg, offsetof(shms_bell, doorbell)),
                        *s = ATOMIC32(self, offsetof(shms_control, batcher_sleeping));
  if (!w || !s) return NULL;
  shms_doorbell_ring_sole(w, s);
  Py_RETURN_NONE;
}

/* doorbell_wait(word_off, sleeping_off, seen, spin, timeout_ns[, sole[, flags]]) -> how it woke:
 * Wake.SPIN or Wake.SLEEP if the word moved, Wake.TIMEOUT (0, falsy) if not. spin is
 * the nanoseconds to spin, or an AdaptiveSpin: its policy decides and learns from the
 * wait (shms_spin_wait). sole: the caller is the word's only waiter and stores a new
 * token in the flag while it sleeps (shms_doorbell_wait_x, shms_py_sleep_token). flags:
 * the Mapping the sleeping word is in, if not this one (the batcher: the bell's word,
 * its token in the control block). */
static PyObject *m_doorbell_wait(Mapping *self, PyObject *args) {
  unsigned long long off, soff;
  unsigned int seen;
  long long spin_ns = 0, timeout_ns;
  int sole = 0;
  PyObject *spin;
  Mapping *flags = self;
  if (!PyArg_ParseTuple(args, "KKIOL|pO!", &off, &soff, &seen, &spin, &timeout_ns, &sole,
                        &MappingType, &flags))
    return NULL;
  if (flags->readonly) { /* a waiter writes its sleeping word */
    PyErr_SetString(PyExc_PermissionError, "doorbell_wait: the sleeping word is read-only");
    return NULL;
  }
  Spin *policy = Py_TYPE(spin) == &SpinType ? (Spin *)spin : NULL;
  if (!policy && (spin_ns = PyLong_AsLongLong(spin)) == -1 && PyErr_Occurred()) return NULL;
  SHMS_ATOMIC(uint32_t) *w = ATOMIC32(self, off), *s = ATOMIC32(flags, soff);
  if (!w || !s) return NULL;
  int moved;
  shms_py_enter(self);
  shms_py_enter(flags);
  Py_INCREF(spin); /* another thread may drop its last reference while we wait */
  Py_BEGIN_ALLOW_THREADS
  uint32_t token = sole ? shms_py_sleep_token() : 0;
  moved = policy ? shms_spin_wait(&policy->spin, w, s, seen, timeout_ns, token)
                 : shms_doorbell_wait_x(w, s, seen, spin_ns, timeout_ns, NULL, token);
  Py_END_ALLOW_THREADS
  Py_DECREF(spin);
  shms_py_leave(flags);
  shms_py_leave(self);
  return PyLong_FromLong(moved);
}

/* ---------------------------------------------------------------- ring */
/* The submission ring of an arena mapping. Every ring call takes the (offset,
 * capacity) fixed once: the server's own geometry (shms_arena_layout), a client's
 * from ring_attach(); the header is client-writable, so it is never read again. */

int shms_py_ring_view(Mapping *self, unsigned long long off, unsigned long long cap,
                      shms_ring *r) {
  if (cap < 2 || (cap & (cap - 1)) || cap > (1u << 30)) {
    PyErr_SetString(PyExc_ValueError, "ring capacity must be a power of two");
    return -1;
  }
  if (off < sizeof(shms_arena_header)) {
    PyErr_SetString(PyExc_ValueError, "ring cells overlap the arena header");
    return -1;
  }
  if (!shms_py_at(self, 0, sizeof(shms_arena_header), 64) ||
      !shms_py_at(self, off, cap * sizeof(shms_ring_cell), 64))
    return -1;
  shms_ring_view(r, self->base, off, cap);
  return 0;
}

/* ring_attach() -> (ring_offset, ring_capacity) of an arena's ring, checked once. */
static PyObject *m_ring_attach(Mapping *self, PyObject *unused) {
  shms_ring r;
  if (!shms_py_at(self, 0, 0, 0)) return NULL;
  if (shms_ring_attach(&r, self->base, self->size) != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "not a shmserve arena of this version with a sane submission ring");
    return NULL;
  }
  return Py_BuildValue("(KK)", (unsigned long long)((char *)r.cells - self->base),
                       (unsigned long long)r.capacity);
}

/* ring_push(offset, capacity, owner, slot, generation) -> shms_ring_result */
static PyObject *m_ring_push(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, cap;
  unsigned int owner, slot, gen;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKIII", &off, &cap, &owner, &slot, &gen)) return NULL;
  if (shms_py_ring_view(self, off, cap, &r) < 0) return NULL;
  return PyLong_FromLong(shms_ring_push(&r, owner, slot, gen));
}

/* ring_pop(offset, capacity, pos) -> None (empty) | (kind, a, b, c):
 *   (SHMS_POP_OK, client, slot, generation): taken; the position is now pos + 1
 *   (SHMS_POP_STALLED, owner, head_seq, 0) | (SHMS_POP_CORRUPT, 0, head_seq, 0) */
static PyObject *m_ring_pop(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, cap, pos;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKK", &off, &cap, &pos)) return NULL;
  if (shms_py_ring_view(self, off, cap, &r) < 0) return NULL;
  uint64_t p = pos, head_seq = 0;
  shms_ring_entry e;
  uint32_t owner = 0;
  int k = shms_ring_pop(&r, &p, &e, &owner, &head_seq);
  if (k == SHMS_POP_OK) return Py_BuildValue("(iIII)", k, e.client_id, e.slot, e.generation);
  if (k == SHMS_POP_EMPTY) Py_RETURN_NONE;
  return Py_BuildValue("(iIKi)", k, owner, (unsigned long long)head_seq, 0);
}

/* ring_skip(offset, capacity, pos, head_seq) -> True if the head was skipped. */
static PyObject *m_ring_skip(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, cap, pos, head_seq;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKKK", &off, &cap, &pos, &head_seq)) return NULL;
  if (shms_py_ring_view(self, off, cap, &r) < 0) return NULL;
  uint64_t p = pos;
  return PyBool_FromLong(shms_ring_skip(&r, &p, head_seq));
}

/* ring_repair(offset, capacity, pos) -> True if enqueue_pos had to be moved back. */
static PyObject *m_ring_repair(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off, cap, pos;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKK", &off, &cap, &pos)) return NULL;
  if (shms_py_ring_view(self, off, cap, &r) < 0) return NULL;
  return PyBool_FromLong(shms_ring_repair(&r, pos));
}

/* ring_pending(offset, capacity, pos) -> [(client, slot, generation)] published and
 * not yet consumed from position pos on (a restarted batcher, the sweep). */
static PyObject *m_ring_pending(Mapping *self, PyObject *args) {
  unsigned long long off, cap, pos;
  shms_ring r;
  if (!PyArg_ParseTuple(args, "KKK", &off, &cap, &pos)) return NULL;
  if (shms_py_ring_view(self, off, cap, &r) < 0) return NULL;
  /* Only [pos, enqueue_pos): a published-looking cell past enqueue_pos is no entry
   * the consumer will reach soon, so it must not keep the sweep from a request. */
  uint64_t enq = shms_load(r.enqueue_pos, memory_order_acquire);
  uint64_t end = enq - pos <= cap ? enq : pos;
  PyObject *out = PyList_New(0);
  for (uint64_t q = pos; out && q < end; q++) {
    shms_ring_cell *c = &r.cells[q & (cap - 1)];
    if (shms_load(&c->seq, memory_order_acquire) != q + 1) continue;
    PyObject *t = Py_BuildValue("(III)", c->client_id, c->slot, c->generation);
    if (!t || PyList_Append(out, t) < 0) Py_CLEAR(out);
    Py_XDECREF(t);
  }
  return out;
}

/* put(offset, obj): copies a C-contiguous buffer (a numpy array, bytes) into the
 * mapping at offset; the GIL is released for large copies. Returns the byte count. */
static PyObject *m_put(Mapping *self, PyObject *args) {
  if (!shms_py_writable(self)) return NULL;
  unsigned long long off;
  PyObject *obj;
  if (!PyArg_ParseTuple(args, "KO", &off, &obj)) return NULL;
  Py_buffer src;
  if (PyObject_GetBuffer(obj, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  char *dst = (char *)shms_py_at(self, off, (uint64_t)src.len, 0);
  if (dst) {
    if (src.len > (1 << 16)) {
      shms_py_enter(self);
      Py_BEGIN_ALLOW_THREADS memcpy(dst, src.buf, (size_t)src.len);
      Py_END_ALLOW_THREADS
      shms_py_leave(self);
    } else {
      memcpy(dst, src.buf, (size_t)src.len);
    }
  }
  Py_ssize_t n = src.len;
  PyBuffer_Release(&src);
  return dst ? PyLong_FromSsize_t(n) : NULL;
}

/* locate(obj) -> offset of obj's (C-contiguous) memory inside this mapping, or -1. */
static PyObject *m_locate(Mapping *self, PyObject *obj) {
  Py_buffer b;
  if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS) < 0) {
    PyErr_Clear();
    return PyLong_FromLong(-1);
  }
  long long off = -1;
  if (self->base && (char *)b.buf >= self->base &&
      (uint64_t)((char *)b.buf - self->base) + (uint64_t)b.len <= self->size)
    off = (long long)((char *)b.buf - self->base);
  PyBuffer_Release(&b);
  return PyLong_FromLongLong(off);
}


PyMethodDef shms_py_mapping_methods[] = {
    {"release", (PyCFunction)mapping_release, METH_NOARGS, "Drop the buffer (further use raises)."},
    {"load32", (PyCFunction)m_load32, METH_O, "Atomic load of a u32 (seq_cst)."},
    {"load64", (PyCFunction)m_load64, METH_O, "Atomic load of a u64 (acquire)."},
    {"store32", (PyCFunction)m_store32, METH_VARARGS, "Atomic store of a u32 (seq_cst)."},
    {"store64", (PyCFunction)m_store64, METH_VARARGS, "Atomic store of a u64 (seq_cst)."},
    {"add32", (PyCFunction)m_add32, METH_VARARGS, "Atomic fetch-add on a u32; returns the old value."},
    {"add64", (PyCFunction)m_add64, METH_VARARGS, "Atomic fetch-add on a u64; returns the old value."},
    {"cas32", (PyCFunction)m_cas32, METH_VARARGS, "Compare-and-swap a u32; True if swapped."},
    {"wake", (PyCFunction)m_wake, METH_VARARGS, "futex wake on a u32."},
    {"doorbell_ring", (PyCFunction)m_doorbell_ring, METH_VARARGS, "Bump a doorbell, wake sleepers."},
    {"ring_batcher", (PyCFunction)m_ring_batcher, METH_O,
     "On the control segment's mapping: ring the batcher's doorbell (the bell's)."},
    {"doorbell_wait", (PyCFunction)m_doorbell_wait, METH_VARARGS,
     "Spin then sleep until a doorbell moves (GIL released)."},
    {"ring_attach", (PyCFunction)m_ring_attach, METH_NOARGS, "Check an arena's ring once."},
    {"ring_push", (PyCFunction)m_ring_push, METH_VARARGS, "Producer: push one entry."},
    {"ring_pop", (PyCFunction)m_ring_pop, METH_VARARGS, "Consumer: take the head entry."},
    {"ring_skip", (PyCFunction)m_ring_skip, METH_VARARGS, "Consumer: skip the head cell."},
    {"ring_repair", (PyCFunction)m_ring_repair, METH_VARARGS, "Consumer: repair enqueue_pos."},
    {"ring_pending", (PyCFunction)m_ring_pending, METH_VARARGS, "Published, unconsumed entries."},
    {"put", (PyCFunction)m_put, METH_VARARGS, "Copy a contiguous buffer in at offset."},
    {"locate", (PyCFunction)m_locate, METH_O, "Offset of a buffer inside the mapping, or -1."},
    {NULL}};
