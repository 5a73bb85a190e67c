/*
 * stats.c — Mapping methods over a model's statistics (shms_stats.h): the batcher
 * and the workers record, the coordinator reads a snapshot. Offsets are a model
 * entry's (ServerLayout.model(i)); every one is bounds-checked like the rest.
 */
#include "core.h"

static shms_model_stats *stats_at(Mapping *self, unsigned long long model_off) {
  shms_model_entry *m =
      (shms_model_entry *)shms_py_at(self, model_off, sizeof(shms_model_entry), 8);
  return m ? &m->stats : NULL;
}

#define LOAD(p) ((unsigned long long)shms_load((p), memory_order_relaxed))

static PyObject *duration_tuple(shms_duration *d) {
  return Py_BuildValue("(KK)", LOAD(&d->count), LOAD(&d->ns));
}

/* model_stats(model_off) -> dict: inference_count, execution_count,
 * last_inference_ms, pending, failures [by FailureReason], durations [(count, ns) by
 * Duration], batch_requests {requests: executions}, batch_stats {rows: ((count, ns)
 * of compute_input, compute_infer, compute_output)}, latency (bytes: u64
 * [Duration][LATENCY_BUCKETS], for numpy). A snapshot of relaxed loads: counters
 * move meanwhile, each is read once. */
static PyObject *m_model_stats(Mapping *self, PyObject *arg) {
  unsigned long long off = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  shms_model_stats *st = stats_at(self, off);
  if (!st) return NULL;
  PyObject *failures = PyList_New(SHMS_FAIL_COUNT), *durations = PyList_New(SHMS_DUR_COUNT);
  PyObject *requests = PyDict_New(), *batches = PyDict_New();
  PyObject *latency = PyBytes_FromStringAndSize(NULL, sizeof st->latency);
  if (!failures || !durations || !requests || !batches || !latency) goto fail;
  for (int i = 0; i < SHMS_FAIL_COUNT; i++)
    PyList_SET_ITEM(failures, i, PyLong_FromUnsignedLongLong(LOAD(&st->failures[i])));
  for (int i = 0; i < SHMS_DUR_COUNT; i++)
    PyList_SET_ITEM(durations, i, duration_tuple(&st->durations[i]));
  for (int n = 0; n < SHMS_BATCH_HIST; n++) {
    unsigned long long v = LOAD(&st->batch_requests[n]);
    if (!v) continue;
    PyObject *k = PyLong_FromLong(n + 1), *val = PyLong_FromUnsignedLongLong(v);
    int bad = !k || !val || PyDict_SetItem(requests, k, val) < 0;
    Py_XDECREF(k);
    Py_XDECREF(val);
    if (bad) goto fail;
  }
  for (int n = 0; n < SHMS_BATCH_STATS; n++) {
    shms_batch_stat *b = &st->batch_stats[n];
    if (!LOAD(&b->compute_infer.count)) continue;
    PyObject *k = PyLong_FromLong(n + 1);
    PyObject *val = Py_BuildValue("(NNN)", duration_tuple(&b->compute_input),
                                  duration_tuple(&b->compute_infer),
                                  duration_tuple(&b->compute_output));
    int bad = !k || !val || PyDict_SetItem(batches, k, val) < 0;
    Py_XDECREF(k);
    Py_XDECREF(val);
    if (bad) goto fail;
  }
  uint64_t *buckets = (uint64_t *)PyBytes_AS_STRING(latency);
  for (int d = 0; d < SHMS_DUR_COUNT; d++)
    for (int b = 0; b < SHMS_LATENCY_BUCKETS; b++)
      buckets[d * SHMS_LATENCY_BUCKETS + b] = LOAD(&st->latency[d][b]);
  return Py_BuildValue("{sKsKsKsKsNsNsNsNsN}", "inference_count", LOAD(&st->inference_count),
                       "execution_count", LOAD(&st->execution_count), "last_inference_ms",
                       LOAD(&st->last_inference_ms), "pending", LOAD(&st->pending),
                       "failures", failures, "durations", durations, "batch_requests",
                       requests, "batch_stats", batches, "latency", latency);
fail:
  Py_XDECREF(failures);
  Py_XDECREF(durations);
  Py_XDECREF(requests);
  Py_XDECREF(batches);
  Py_XDECREF(latency);
  return NULL;
}

/* record_answers(model_off, [(status, taken_ns), ...], reason=-1): requests answered
 * now, each timed from taken_ns (the batcher's take). A failure counts under reason
 * when given (a FailureReason), else under the reason of its status. */
static PyObject *m_record_answers(Mapping *self, PyObject *args) {
  unsigned long long off;
  PyObject *items;
  int reason = -1;
  if (!PyArg_ParseTuple(args, "KO|i", &off, &items, &reason)) return NULL;
  shms_model_stats *st = stats_at(self, off);
  PyObject *seq = st ? PySequence_Fast(items, "answers must be a sequence") : NULL;
  if (!seq) return NULL;
  uint64_t now = shms_now_ns();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    int status;
    unsigned long long taken;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iK", &status, &taken)) {
      Py_DECREF(seq);
      return NULL;
    }
    shms_stats_answered(st, status, reason < 0 ? SHMS_FAIL_COUNT : (uint32_t)reason,
                        now > taken ? now - taken : 0);
  }
  Py_DECREF(seq);
  Py_RETURN_NONE;
}

/* record_waits(model_off, kind, [start_ns, ...]): requests that each waited from
 * start_ns until now in stage kind (a Duration; the batcher's queue). */
static PyObject *m_record_waits(Mapping *self, PyObject *args) {
  unsigned long long off;
  unsigned int kind;
  PyObject *starts;
  if (!PyArg_ParseTuple(args, "KIO", &off, &kind, &starts)) return NULL;
  if (kind >= SHMS_DUR_COUNT) return PyErr_Format(PyExc_ValueError, "duration kind %u", kind);
  shms_model_stats *st = stats_at(self, off);
  PyObject *seq = st ? PySequence_Fast(starts, "start times must be a sequence") : NULL;
  if (!seq) return NULL;
  uint64_t now = shms_now_ns();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    unsigned long long t = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (PyErr_Occurred()) {
      Py_DECREF(seq);
      return NULL;
    }
    shms_stats_add(st, kind, now > t ? now - t : 0, 1);
  }
  Py_DECREF(seq);
  Py_RETURN_NONE;
}

/* record_execution(model_off, n_requests, rows, input_ns, infer_ns, output_ns). */
static PyObject *m_record_execution(Mapping *self, PyObject *args) {
  unsigned long long off, input_ns, infer_ns, output_ns;
  unsigned int n, rows;
  if (!PyArg_ParseTuple(args, "KIIKKK", &off, &n, &rows, &input_ns, &infer_ns, &output_ns))
    return NULL;
  shms_model_stats *st = stats_at(self, off);
  if (!st) return NULL;
  shms_stats_execution(st, n, rows, input_ns, infer_ns, output_ns);
  Py_RETURN_NONE;
}

/* set_pending(model_off, n): the batcher's count of requests queued for the model. */
static PyObject *m_set_pending(Mapping *self, PyObject *args) {
  unsigned long long off, n;
  if (!PyArg_ParseTuple(args, "KK", &off, &n)) return NULL;
  shms_model_stats *st = stats_at(self, off);
  if (!st) return NULL;
  shms_store(&st->pending, (uint64_t)n, memory_order_relaxed);
  Py_RETURN_NONE;
}

PyMethodDef shms_py_stats_methods[] = {
    {"model_stats", (PyCFunction)m_model_stats, METH_O, "Snapshot of a model's statistics."},
    {"record_answers", (PyCFunction)m_record_answers, METH_VARARGS,
     "Requests answered now: success/failure counts, durations, histogram."},
    {"record_waits", (PyCFunction)m_record_waits, METH_VARARGS,
     "Requests that waited until now in one stage (queue)."},
    {"record_execution", (PyCFunction)m_record_execution, METH_VARARGS,
     "One model execution: counts, compute stages, batch-size statistics."},
    {"set_pending", (PyCFunction)m_set_pending, METH_VARARGS, "Requests queued for a model."},
    {NULL}};
