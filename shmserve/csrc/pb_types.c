/*
 * pb_types.c — the objects of Triton's python model API (shmserve/pb_utils/) that a
 * model touches once per request, in C: pb_utils.Tensor, InferenceRequest and
 * InferenceResponse, get_input_tensor_by_name, a batch's requests built from the
 * worker's views and its responses turned back into arrays. A Python class costs a
 * model thousands of instructions per object (its __init__ frame, each attribute
 * stored); these cost a few hundred, so the compatibility layer stays within a few
 * microseconds of the numpy-dict API (bench/pb_utils_cost.py, pb_utils_instructions.py).
 *
 * Each type is made at import from a Python class of pb_utils (tensor.py, messages.py)
 * that holds its other methods, the rarely called ones (from_dlpack, exec, ...), and
 * a staticmethod _checked for the constructor's rare cases (conversions, the error
 * messages): the type is that class's subclass adding the fields (members `_name`,
 * `_array`, ...: the Python methods read them as before), the constructor's common case
 * (vectorcall) and the per-request methods. Behaviour is defined once: the common case
 * here, everything else in the Python class.
 */
#include "core.h"

/* The types, made by pb_tensor_type() & co. (strong references); the functions below
 * recognise their objects by these. */
static PyTypeObject *tensor_type, *request_type, *response_type;
static PyObject *ndarray_type; /* numpy.ndarray */
static PyObject *ok_dtype;     /* the last dtype a Tensor was made of: not 'U' nor 'V' */
static PyObject *s_dtype, *s_kind, *s_checked, *s_inputs, *s_name, *s_empty, *k_minus1, *k_zero;

/* ---------------------------------------------------------------- arguments */

/* A vectorcall's arguments, by position or keyword, into out[0..n) (NULL: not given);
 * the first `required` must be given. -1 with TypeError as Python words it. */
static int parse_args(const char *fn, const char *const *names, int n, int required,
                      PyObject *const *args, size_t nargsf, PyObject *kwnames, PyObject **out) {
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs > n) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, n, nargs);
    return -1;
  }
  for (int i = 0; i < n; i++) out[i] = i < nargs ? args[i] : NULL;
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; k++) {
    PyObject *key = PyTuple_GET_ITEM(kwnames, k);
    int i = 0;
    while (i < n && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) i++;
    if (i == n) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, key);
      return -1;
    }
    if (out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, names[i]);
      return -1;
    }
    out[i] = args[nargs + k];
  }
  for (int i = 0; i < required; i++)
    if (!out[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
      return -1;
    }
  return 0;
}

/* tp_new's arguments (a subclass's call, or Type.__new__(Type, ...)) as a vectorcall's. */
static PyObject *call_as_vector(PyTypeObject *type, PyObject *args, PyObject *kw,
                                PyObject *(*make)(PyTypeObject *, PyObject *const *, size_t,
                                                  PyObject *)) {
  Py_ssize_t nargs = PyTuple_GET_SIZE(args), nkw = kw ? PyDict_GET_SIZE(kw) : 0;
  PyObject *stack[8], *kwnames = NULL, *key, *value, *out;
  if (nargs + nkw > 8) {
    PyErr_Format(PyExc_TypeError, "%s() got too many arguments", type->tp_name);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) stack[i] = PyTuple_GET_ITEM(args, i);
  if (nkw) {
    if (!(kwnames = PyTuple_New(nkw))) return NULL;
    Py_ssize_t pos = 0, k = 0;
    while (PyDict_Next(kw, &pos, &key, &value)) {
      PyTuple_SET_ITEM(kwnames, k, Py_NewRef(key));
      stack[nargs + k++] = value;
    }
  }
  out = make(type, stack, (size_t)nargs, kwnames);
  Py_XDECREF(kwnames);
  return out;
}

/* The Python class's _checked(*args): the constructor's rare cases, checked and
 * converted there (or raised). A new reference, or NULL with the exception. */
static PyObject *checked(PyTypeObject *type, PyObject *const *args, size_t n) {
  PyObject *fn = PyObject_GetAttr((PyObject *)type, s_checked);
  if (!fn) return NULL;
  PyObject *out = PyObject_Vectorcall(fn, args, n, NULL);
  Py_DECREF(fn);
  return out;
}

/* ---------------------------------------------------------------- Tensor */

typedef struct {
  PyObject_HEAD
  PyObject *name;  /* str */
  PyObject *array; /* numpy.ndarray */
} PbTensor;

/* A Tensor of a checked name and array (the references are taken). */
static PyObject *tensor_of(PyTypeObject *type, PyObject *name, PyObject *array) {
  PbTensor *t = type == tensor_type ? PyObject_GC_New(PbTensor, type)
                                    : (PbTensor *)type->tp_alloc(type, 0);
  if (!t) {
    Py_DECREF(name);
    Py_DECREF(array);
    return NULL;
  }
  t->name = name;
  t->array = array;
  if (type == tensor_type) PyObject_GC_Track(t);
  return (PyObject *)t;
}

/* Whether a name and array need Tensor._checked: the common case (a str, an ndarray
 * of a dtype the python backend carries) in a pointer compare or two. */
static int tensor_needs_check(PyObject *name, PyObject *array) {
  if (!PyUnicode_Check(name) || (PyObject *)Py_TYPE(array) != ndarray_type) return 1;
  PyObject *dtype = PyObject_GetAttr(array, s_dtype);
  if (!dtype) return -1;
  int rare = 0;
  if (dtype != ok_dtype) {
    PyObject *kind = PyObject_GetAttr(dtype, s_kind);
    if (!kind) {
      Py_DECREF(dtype);
      return -1;
    }
    rare = PyUnicode_CompareWithASCIIString(kind, "U") == 0 ||
           PyUnicode_CompareWithASCIIString(kind, "V") == 0;
    Py_DECREF(kind);
    if (!rare) Py_XSETREF(ok_dtype, Py_NewRef(dtype));
  }
  Py_DECREF(dtype);
  return rare;
}

static const char *const tensor_args[] = {"name", "numpy_array"};

static PyObject *tensor_make(PyTypeObject *type, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
  PyObject *a[2];
  if (parse_args("pb_utils.Tensor", tensor_args, 2, 2, args, nargsf, kwnames, a) < 0) return NULL;
  int rare = tensor_needs_check(a[0], a[1]);
  if (rare < 0) return NULL;
  PyObject *array = rare ? checked(type, a, 2) : Py_NewRef(a[1]);
  if (!array) return NULL;
  return tensor_of(type, Py_NewRef(a[0]), array);
}

static PyObject *tensor_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
  return tensor_make((PyTypeObject *)type, args, nargsf, kwnames);
}

static PyObject *tensor_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  return call_as_vector(type, args, kw, tensor_make);
}

static int tensor_traverse(PbTensor *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->name);
  Py_VISIT(self->array);
  return 0;
}

static int tensor_clear(PbTensor *self) {
  Py_CLEAR(self->name);
  Py_CLEAR(self->array);
  return 0;
}

static void tensor_dealloc(PbTensor *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  tensor_clear(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

static PyObject *tensor_name(PbTensor *self, PyObject *unused) { return Py_NewRef(self->name); }
static PyObject *tensor_as_numpy(PbTensor *self, PyObject *unused) {
  return Py_NewRef(self->array);
}

static PyMethodDef tensor_methods[] = {
    {"name", (PyCFunction)tensor_name, METH_NOARGS, "The tensor's name."},
    {"as_numpy", (PyCFunction)tensor_as_numpy, METH_NOARGS,
     "The tensor's numpy array (an input's: a view of the caller's shared memory)."},
    {NULL}};

static PyMemberDef tensor_members[] = {
    {"_name", T_OBJECT_EX, offsetof(PbTensor, name), READONLY, NULL},
    {"_array", T_OBJECT_EX, offsetof(PbTensor, array), READONLY, NULL},
    {NULL}};

static PyType_Slot tensor_slots[] = {
    {Py_tp_doc, "pb_utils.Tensor(name, numpy_array)"},
    {Py_tp_new, tensor_new},
    {Py_tp_dealloc, tensor_dealloc},
    {Py_tp_traverse, tensor_traverse},
    {Py_tp_clear, tensor_clear},
    {Py_tp_free, PyObject_GC_Del},
    {Py_tp_methods, tensor_methods},
    {Py_tp_members, tensor_members},
    {0, NULL}};

/* ---------------------------------------------------------------- InferenceResponse */

typedef struct {
  PyObject_HEAD
  PyObject *outputs; /* list of Tensors (whatever the model put in it) */
  PyObject *error;   /* pb_utils.TritonError or None */
} PbResponse;

static const char *const response_args[] = {"output_tensors", "error", "parameters"};

static PyObject *response_make(PyTypeObject *type, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames) {
  PyObject *a[3];
  if (parse_args("pb_utils.InferenceResponse", response_args, 3, 0, args, nargsf, kwnames, a) < 0)
    return NULL;
  PyObject *error = a[1] ? a[1] : Py_None, *outputs;
  int parameters = a[2] ? PyObject_IsTrue(a[2]) : 0;
  if (parameters < 0) return NULL;
  if (a[0] && PyList_CheckExact(a[0]) && error == Py_None && !parameters) {
    outputs = Py_NewRef(a[0]); /* the common case: a list of outputs */
  } else {
    PyObject *all[3] = {a[0] ? a[0] : Py_None, error, a[2] ? a[2] : Py_None};
    if (!(outputs = checked(type, all, 3))) return NULL;
  }
  PbResponse *r = type == response_type ? PyObject_GC_New(PbResponse, type)
                                        : (PbResponse *)type->tp_alloc(type, 0);
  if (!r) {
    Py_DECREF(outputs);
    return NULL;
  }
  r->outputs = outputs;
  r->error = Py_NewRef(error);
  if (type == response_type) PyObject_GC_Track(r);
  return (PyObject *)r;
}

static PyObject *response_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
  return response_make((PyTypeObject *)type, args, nargsf, kwnames);
}

static PyObject *response_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  return call_as_vector(type, args, kw, response_make);
}

static int response_traverse(PbResponse *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(self->outputs);
  Py_VISIT(self->error);
  return 0;
}

static int response_clear(PbResponse *self) {
  Py_CLEAR(self->outputs);
  Py_CLEAR(self->error);
  return 0;
}

static void response_dealloc(PbResponse *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  response_clear(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

static PyMemberDef response_members[] = {
    {"_outputs", T_OBJECT_EX, offsetof(PbResponse, outputs), READONLY, NULL},
    {"_error", T_OBJECT_EX, offsetof(PbResponse, error), READONLY, NULL},
    {NULL}};

static PyType_Slot response_slots[] = {
    {Py_tp_doc, "pb_utils.InferenceResponse(output_tensors=[Tensor...], error=None)"},
    {Py_tp_new, response_new},
    {Py_tp_dealloc, response_dealloc},
    {Py_tp_traverse, response_traverse},
    {Py_tp_clear, response_clear},
    {Py_tp_free, PyObject_GC_Del},
    {Py_tp_members, response_members},
    {0, NULL}};

/* ---------------------------------------------------------------- InferenceRequest */

/* Its fields, as members of the same names: the Python class's __init__ (a BLS request
 * a model builds) sets them all; pb_received() those of the requests execute() gets. */
#define REQUEST_FIELDS(X)                                                                  \
  X(model_name) X(inputs) X(by_name) X(requested) X(model_version) X(request_id)           \
      X(correlation_id) X(flags) X(timeout_us) X(parameters) X(stream) X(sender)

typedef struct {
  PyObject_HEAD
#define FIELD(f) PyObject *f;
  REQUEST_FIELDS(FIELD)
#undef FIELD
} PbRequest;

static int request_traverse(PbRequest *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
#define VISIT(f) Py_VISIT(self->f);
  REQUEST_FIELDS(VISIT)
#undef VISIT
  return 0;
}

static int request_clear(PbRequest *self) {
#define CLEAR(f) Py_CLEAR(self->f);
  REQUEST_FIELDS(CLEAR)
#undef CLEAR
  return 0;
}

static void request_dealloc(PbRequest *self) {
  PyTypeObject *tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  request_clear(self);
  tp->tp_free(self);
  Py_DECREF(tp);
}

static PyMemberDef request_members[] = {
#define MEMBER(f) {"_" #f, T_OBJECT_EX, offsetof(PbRequest, f), 0, NULL},
    REQUEST_FIELDS(MEMBER)
#undef MEMBER
    {NULL}};

static PyType_Slot request_slots[] = {
    {Py_tp_doc, "pb_utils.InferenceRequest(model_name=..., inputs=[Tensor...], "
                "requested_output_names=[...], model_version=-1, ...).exec()"},
    {Py_tp_dealloc, request_dealloc},
    {Py_tp_traverse, request_traverse},
    {Py_tp_clear, request_clear},
    {Py_tp_free, PyObject_GC_Del},
    {Py_tp_members, request_members},
    {0, NULL}};

/* by_name[name] = a Tensor of (name, array), unchecked. */
static int add_input(PyObject *by_name, PyObject *name, PyObject *array) {
  PyObject *t = tensor_of(tensor_type, Py_NewRef(name), Py_NewRef(array));
  int err = !t || PyDict_SetItem(by_name, name, t) < 0;
  Py_XDECREF(t);
  return err ? -1 : 0;
}

/* One received request: inputs {name: array view} or an iterable of (name, array view)
 * pairs, requested its requested output names, parameters its parameters dict. */
static PyObject *request_received(PyObject *inputs, PyObject *requested, PyObject *parameters) {
  PyObject *by_name = PyDict_New(), *it = NULL, *name, *array, *pair;
  if (!by_name) return NULL;
  if (PyDict_CheckExact(inputs)) {
    for (Py_ssize_t pos = 0; PyDict_Next(inputs, &pos, &name, &array);)
      if (add_input(by_name, name, array) < 0) goto fail;
  } else {
    if (!(it = PyObject_GetIter(inputs))) goto fail;
    while ((pair = PyIter_Next(it))) {
      int err = !PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2;
      if (err)
        PyErr_SetString(PyExc_TypeError, "pb_received: an input is not a (name, array) pair");
      else
        err = add_input(by_name, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
      Py_DECREF(pair);
      if (err) goto fail;
    }
    if (PyErr_Occurred()) goto fail;
    Py_CLEAR(it);
  }
  PbRequest *r = PyObject_GC_New(PbRequest, request_type);
  if (!r) {
    Py_DECREF(by_name);
    return NULL;
  }
  r->by_name = by_name;
  r->requested = Py_NewRef(requested);
  r->parameters = Py_NewRef(parameters);
  r->model_name = Py_NewRef(s_empty);
  r->request_id = Py_NewRef(s_empty);
  r->model_version = Py_NewRef(k_minus1);
  r->correlation_id = Py_NewRef(k_zero);
  r->flags = Py_NewRef(k_zero);
  r->timeout_us = Py_NewRef(k_zero);
  r->inputs = Py_NewRef(Py_None);
  r->stream = Py_NewRef(Py_None);
  r->sender = Py_NewRef(Py_None);
  PyObject_GC_Track(r);
  return (PyObject *)r;
fail:
  Py_XDECREF(it);
  Py_XDECREF(by_name);
  return NULL;
}

/* ---------------------------------------------------------------- module functions */

static PyObject *f_received(PyObject *m, PyObject *requests) {
  if (!request_type || !tensor_type) {
    PyErr_SetString(PyExc_RuntimeError, "pb_received: shmserve.pb_utils is not imported");
    return NULL;
  }
  PyObject *seq = PySequence_Fast(requests, "pb_received: requests must be a sequence");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject *out = PyList_New(n);
  for (Py_ssize_t i = 0; out && i < n; i++) {
    PyObject *req = PySequence_Fast_GET_ITEM(seq, i), *r = NULL;
    if (!PyTuple_Check(req) || PyTuple_GET_SIZE(req) != 3)
      PyErr_SetString(PyExc_TypeError, "pb_received: a request is not (inputs, requested "
                                       "output names, parameters)");
    else
      r = request_received(PyTuple_GET_ITEM(req, 0), PyTuple_GET_ITEM(req, 1),
                           PyTuple_GET_ITEM(req, 2));
    if (!r) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, r);
  }
  Py_DECREF(seq);
  return out;
}

static PyObject *f_get_input_tensor_by_name(PyObject *m, PyObject *const *args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_Format(PyExc_TypeError, "get_input_tensor_by_name() takes 2 arguments "
                                  "(inference_request, name), %zd given", n);
    return NULL;
  }
  PyObject *request = args[0], *name = args[1];
  if (request_type && PyObject_TypeCheck(request, request_type)) {
    PyObject *by_name = ((PbRequest *)request)->by_name; /* a received request's */
    if (by_name && PyDict_CheckExact(by_name)) {
      PyObject *t = PyDict_GetItemWithError(by_name, name);
      return t ? Py_NewRef(t) : PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
  }
  /* any other object with inputs(): the first whose name() is `name` */
  PyObject *inputs = PyObject_CallMethodNoArgs(request, s_inputs), *it, *t;
  if (!inputs) return NULL;
  it = PyObject_GetIter(inputs);
  Py_DECREF(inputs);
  if (!it) return NULL;
  while ((t = PyIter_Next(it))) {
    PyObject *its = PyObject_CallMethodNoArgs(t, s_name);
    int same = its ? PyObject_RichCompareBool(its, name, Py_EQ) : -1;
    Py_XDECREF(its);
    if (same) {
      Py_DECREF(it);
      if (same > 0) return t;
      Py_DECREF(t);
      return NULL;
    }
    Py_DECREF(t);
  }
  Py_DECREF(it);
  return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

/* {output name: array} of a plain response (an InferenceResponse without error whose
 * outputs are all Tensors), None for any other: the caller says why. */
static PyObject *response_arrays(PyObject *response) {
  if (Py_TYPE(response) != response_type) Py_RETURN_NONE;
  PbResponse *r = (PbResponse *)response;
  if (r->error != Py_None || !PyList_Check(r->outputs)) Py_RETURN_NONE;
  PyObject *out = PyDict_New();
  for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(r->outputs); i++) {
    PyObject *t = PyList_GET_ITEM(r->outputs, i);
    if (Py_TYPE(t) != tensor_type) {
      Py_DECREF(out);
      Py_RETURN_NONE;
    }
    if (PyDict_SetItem(out, ((PbTensor *)t)->name, ((PbTensor *)t)->array) < 0) Py_CLEAR(out);
  }
  return out;
}

static PyObject *f_response_arrays(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
  Py_ssize_t n;
  if (nargs != 2 || (n = PyLong_AsSsize_t(args[1])) < 0) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "pb_response_arrays(responses, n) takes 2 arguments");
    return NULL;
  }
  PyObject *responses = args[0];
  if (!(PyList_Check(responses) || PyTuple_Check(responses)) ||
      PySequence_Fast_GET_SIZE(responses) != n)
    Py_RETURN_NONE;
  PyObject *out = PyList_New(n);
  for (Py_ssize_t i = 0; out && i < n; i++) {
    PyObject *arrays = response_arrays(PySequence_Fast_GET_ITEM(responses, i));
    if (!arrays) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, arrays);
  }
  return out;
}

/* The type `spec` as a subclass of `methods` (a Python class with __slots__ = (): it
 * adds no field, so the C fields follow the object header), kept in *slot. */
static PyObject *make_type(PyType_Spec *spec, PyObject *methods, PyTypeObject **slot,
                           vectorcallfunc call) {
  if (!PyType_Check(methods) ||
      ((PyTypeObject *)methods)->tp_basicsize != (Py_ssize_t)sizeof(PyObject) ||
      ((PyTypeObject *)methods)->tp_dictoffset != 0) {
    PyErr_Format(PyExc_TypeError, "%s: the methods' class must have __slots__ = ()", spec->name);
    return NULL;
  }
  PyObject *type = PyType_FromSpecWithBases(spec, methods);
  if (!type) return NULL;
  ((PyTypeObject *)type)->tp_vectorcall = call; /* Type(...): no tuple, no __init__ */
  Py_XSETREF(*slot, (PyTypeObject *)Py_NewRef(type));
  return type;
}

#define FLAGS \
  (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE)

static PyType_Spec tensor_spec = {"shmserve.pb_utils.Tensor", sizeof(PbTensor), 0, FLAGS,
                                  tensor_slots};
static PyType_Spec response_spec = {"shmserve.pb_utils.InferenceResponse", sizeof(PbResponse), 0,
                                    FLAGS, response_slots};
static PyType_Spec request_spec = {"shmserve.pb_utils.InferenceRequest", sizeof(PbRequest), 0,
                                   FLAGS, request_slots};

static PyObject *f_tensor_type(PyObject *m, PyObject *methods) {
  PyObject *numpy = PyImport_ImportModule("numpy");
  if (!numpy) return NULL;
  Py_XSETREF(ndarray_type, PyObject_GetAttrString(numpy, "ndarray"));
  Py_DECREF(numpy);
  if (!ndarray_type) return NULL;
  return make_type(&tensor_spec, methods, &tensor_type, tensor_vectorcall);
}

static PyObject *f_response_type(PyObject *m, PyObject *methods) {
  return make_type(&response_spec, methods, &response_type, response_vectorcall);
}

static PyObject *f_request_type(PyObject *m, PyObject *methods) {
  return make_type(&request_spec, methods, &request_type, NULL); /* its __init__ is Python's */
}

PyMethodDef shms_py_pb_methods[] = {
    {"pb_tensor_type", f_tensor_type, METH_O,
     "pb_utils.Tensor, made from the class of its Python methods (pb_types.c)."},
    {"pb_request_type", f_request_type, METH_O,
     "pb_utils.InferenceRequest, made from the class of its Python methods."},
    {"pb_response_type", f_response_type, METH_O,
     "pb_utils.InferenceResponse, made from the class of its Python methods."},
    {"pb_received", f_received, METH_O,
     "The InferenceRequests of [(inputs as {name: array} or (name, array) pairs, requested "
     "output names, parameters dict)...]: tensors and requests built as they are, unchecked."},
    {"pb_get_input_tensor_by_name", (PyCFunction)(void (*)(void))f_get_input_tensor_by_name,
     METH_FASTCALL, "get_input_tensor_by_name(inference_request, name): the request's input "
                    "Tensor called `name`, or None."},
    {"pb_response_arrays", (PyCFunction)(void (*)(void))f_response_arrays, METH_FASTCALL,
     "pb_response_arrays(responses, n): per response, {output name: array}, or None for one "
     "that is not an InferenceResponse without error holding only Tensors; None if "
     "responses is not a list or tuple of n."},
    {NULL}};

int shms_py_pb_ready(void) {
  s_dtype = PyUnicode_InternFromString("dtype");
  s_kind = PyUnicode_InternFromString("kind");
  s_checked = PyUnicode_InternFromString("_checked");
  s_inputs = PyUnicode_InternFromString("inputs");
  s_name = PyUnicode_InternFromString("name");
  s_empty = PyUnicode_New(0, 0);
  k_minus1 = PyLong_FromLong(-1);
  k_zero = PyLong_FromLong(0);
  return s_dtype && s_kind && s_checked && s_inputs && s_name && s_empty && k_minus1 && k_zero
             ? 0 : -1;
}
