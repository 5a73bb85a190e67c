/*
 * arena.c — a client's arena in Python: the allocator of its tensor data area
 * (shmserve._core.ArenaAllocator) and a block's owner (ArenaBlock), the buffer that
 * output arrays and Client.empty() arrays are views of. One allocator serves the C
 * fast path (client.c) and the Python path (client/engine.py) alike.
 *
 * Every method runs with the GIL held and calls no Python code while it changes the
 * free list: the GIL is the allocator's lock.
 */
#include "core.h"

PyObject *shms_py_arena_full; /* shmserve._core.ArenaFull */

static uint64_t block_size(uint64_t nbytes) {
  /* An empty block still takes one unit: every block has its own offset. */
  return nbytes ? shms_align(nbytes, SHMS_DATA_ALIGN) : SHMS_DATA_ALIGN;
}

/* First fit over the free extents, kept sorted by start and coalesced. */
int shms_py_alloc(ArenaAllocator *a, uint64_t nbytes, uint64_t *offset) {
  if (nbytes > a->end - a->begin) return -1;
  uint64_t size = block_size(nbytes);
  for (size_t i = 0; i < a->n_free; i++) {
    shms_extent *e = &a->free[i];
    if (e->size < size) continue;
    *offset = e->start;
    if (e->size == size) {
      memmove(e, e + 1, (a->n_free - i - 1) * sizeof *e);
      a->n_free--;
    } else {
      e->start += size;
      e->size -= size;
    }
    a->used += size;
    return 0;
  }
  return -1;
}

void shms_py_free(ArenaAllocator *a, uint64_t offset, uint64_t nbytes) {
  uint64_t size = block_size(nbytes);
  a->used -= size;
  size_t lo = 0, hi = a->n_free; /* first extent starting after offset */
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (a->free[mid].start < offset) lo = mid + 1;
    else hi = mid;
  }
  int next = lo < a->n_free && a->free[lo].start == offset + size;
  int prev = lo > 0 && a->free[lo - 1].start + a->free[lo - 1].size == offset;
  if (prev && next) {
    a->free[lo - 1].size += size + a->free[lo].size;
    memmove(&a->free[lo], &a->free[lo + 1], (a->n_free - lo - 1) * sizeof(shms_extent));
    a->n_free--;
  } else if (prev) {
    a->free[lo - 1].size += size;
  } else if (next) {
    a->free[lo].start = offset;
    a->free[lo].size += size;
  } else {
    if (a->n_free == a->cap_free) {
      size_t cap = a->cap_free * 2;
      shms_extent *grown = PyMem_Realloc(a->free, cap * sizeof *grown);
      if (!grown) return; /* out of memory: the block is lost to this arena, nothing breaks */
      a->free = grown;
      a->cap_free = cap;
    }
    memmove(&a->free[lo + 1], &a->free[lo], (a->n_free - lo) * sizeof(shms_extent));
    a->free[lo].start = offset;
    a->free[lo].size = size;
    a->n_free++;
  }
}

/* ArenaAllocator(begin, end): offsets in [begin, end), multiples of DATA_ALIGN. */
static int allocator_init(ArenaAllocator *self, PyObject *args, PyObject *kw) {
  unsigned long long begin, end;
  if (!PyArg_ParseTuple(args, "KK", &begin, &end)) return -1;
  if (begin > end || begin % SHMS_DATA_ALIGN) {
    PyErr_Format(PyExc_ValueError, "arena data area [%llu, %llu) is not a %d-aligned range",
                 begin, end, SHMS_DATA_ALIGN);
    return -1;
  }
  PyMem_Free(self->free);
  self->cap_free = 16;
  self->free = PyMem_Malloc(self->cap_free * sizeof(shms_extent));
  if (!self->free) {
    PyErr_NoMemory();
    return -1;
  }
  self->begin = begin;
  self->end = end;
  self->used = 0;
  self->n_free = end > begin;
  self->free[0].start = begin;
  self->free[0].size = end - begin;
  return 0;
}

static void allocator_dealloc(ArenaAllocator *self) {
  PyMem_Free(self->free);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* alloc(nbytes) -> offset; raises ArenaFull when no free block is large enough. */
static PyObject *allocator_alloc(ArenaAllocator *self, PyObject *arg) {
  unsigned long long n = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  uint64_t off;
  if (shms_py_alloc(self, n, &off) == 0) return PyLong_FromUnsignedLongLong(off);
  uint64_t size = n > self->end - self->begin ? n : block_size(n);
  return PyErr_Format(shms_py_arena_full, "no free block of %llu bytes (%llu bytes free in pieces)",
                      (unsigned long long)size,
                      (unsigned long long)(self->end - self->begin - self->used));
}

/* free(offset, nbytes): the block alloc(nbytes) returned. */
static PyObject *allocator_free(ArenaAllocator *self, PyObject *args) {
  unsigned long long off, n;
  if (!PyArg_ParseTuple(args, "KK", &off, &n)) return NULL;
  if (off < self->begin || off % SHMS_DATA_ALIGN || off > self->end ||
      block_size(n) > self->end - off || block_size(n) > self->used)
    return PyErr_Format(PyExc_ValueError, "block [%llu, +%llu) was not allocated here", off, n);
  shms_py_free(self, off, n);
  Py_RETURN_NONE;
}

static PyObject *allocator_capacity(ArenaAllocator *self, void *c) {
  return PyLong_FromUnsignedLongLong(self->end - self->begin);
}

static PyMethodDef allocator_methods[] = {
    {"alloc", (PyCFunction)allocator_alloc, METH_O,
     "alloc(nbytes) -> offset of a free block (first fit); raises ArenaFull."},
    {"free", (PyCFunction)allocator_free, METH_VARARGS, "free(offset, nbytes): give a block back."},
    {NULL}};

static PyMemberDef allocator_members[] = {
    {"begin", T_ULONGLONG, offsetof(ArenaAllocator, begin), READONLY, "first offset"},
    {"end", T_ULONGLONG, offsetof(ArenaAllocator, end), READONLY, "offset past the last"},
    {"used", T_ULONGLONG, offsetof(ArenaAllocator, used), READONLY, "bytes in allocated blocks"},
    {NULL}};

static PyGetSetDef allocator_getset[] = {
    {"capacity", (getter)allocator_capacity, NULL, "end - begin", NULL}, {NULL}};

PyTypeObject ArenaAllocatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.ArenaAllocator",
    .tp_basicsize = sizeof(ArenaAllocator),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A client's arena allocator: first fit over a sorted, coalesced free list; "
              "blocks are DATA_ALIGN-aligned offsets. Only the owning client allocates.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)allocator_init,
    .tp_dealloc = (destructor)allocator_dealloc,
    .tp_methods = allocator_methods,
    .tp_members = allocator_members,
    .tp_getset = allocator_getset,
};

/* ---------------------------------------------------------------- ArenaBlock */

/* A block's bytes as a writable buffer. It holds an export of the arena's mapping
 * (so the memory stays mapped after the client closed, while any view lives) and
 * gives the block back to the allocator when it is released or deallocated: numpy
 * arrays built on it (np.ndarray(..., buffer=block)) keep it alive, so the block
 * returns when the last of them is gone. */
PyObject *shms_py_block_new(ArenaAllocator *a, PyObject *mapping, uint64_t offset,
                            uint64_t nbytes) {
  ArenaBlock *b = PyObject_New(ArenaBlock, &ArenaBlockType);
  if (!b) return NULL;
  b->freed = 1; /* until the export below is held */
  Py_INCREF(a);
  b->arena = a;
  b->offset = offset;
  b->nbytes = nbytes;
  if (PyObject_GetBuffer(mapping, &b->mem, PyBUF_WRITABLE) < 0) {
    b->mem.obj = NULL;
    Py_DECREF(b);
    return NULL;
  }
  if (offset > (uint64_t)b->mem.len || nbytes > (uint64_t)b->mem.len - offset) {
    PyErr_Format(PyExc_IndexError, "block [%llu, +%llu) outside the arena of %zd bytes",
                 (unsigned long long)offset, (unsigned long long)nbytes, b->mem.len);
    Py_DECREF(b);
    return NULL;
  }
  b->freed = 0;
  return (PyObject *)b;
}

static void block_give_back(ArenaBlock *b) {
  if (!b->freed) shms_py_free(b->arena, b->offset, b->nbytes);
  b->freed = 1;
}

static void block_dealloc(ArenaBlock *b) {
  block_give_back(b);
  if (b->mem.obj) PyBuffer_Release(&b->mem);
  Py_XDECREF(b->arena);
  PyObject_Free(b);
}

static int block_getbuffer(ArenaBlock *b, Py_buffer *view, int flags) {
  return PyBuffer_FillInfo(view, (PyObject *)b, (char *)b->mem.buf + b->offset,
                           (Py_ssize_t)b->nbytes, 0, flags);
}

static PyBufferProcs block_as_buffer = {(getbufferproc)block_getbuffer, NULL};

/* release(): the block goes back to the arena now; views of it must not be used. */
static PyObject *block_release(ArenaBlock *b, PyObject *unused) {
  block_give_back(b);
  Py_RETURN_NONE;
}

static PyMethodDef block_methods[] = {
    {"release", (PyCFunction)block_release, METH_NOARGS,
     "Give the block back to the arena now (views of it must not be used afterwards)."},
    {NULL}};

static PyMemberDef block_members[] = {
    {"offset", T_ULONGLONG, offsetof(ArenaBlock, offset), READONLY, "offset in the arena"},
    {"nbytes", T_ULONGLONG, offsetof(ArenaBlock, nbytes), READONLY, "bytes"},
    {NULL}};

PyTypeObject ArenaBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmserve._core.ArenaBlock",
    .tp_basicsize = sizeof(ArenaBlock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block of a client's arena as a buffer; returned to the arena when "
              "released or when the last view of it is gone (ClientCore.block()).",
    .tp_dealloc = (destructor)block_dealloc,
    .tp_as_buffer = &block_as_buffer,
    .tp_methods = block_methods,
    .tp_members = block_members,
};
