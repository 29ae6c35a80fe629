// The XLA FFI target "collectives_call" of collectives.integrations.jax_ffi.
//
// Every output holds its input (the same buffer where XLA aliases them, a
// copy otherwise); the outputs, as memoryviews, go to one Python function set
// by CollectivesJaxSetDispatch: dispatch(key, outputs). The library's
// collectives then run in place on the buffers XLA gave, without JAX's
// Python callback machinery. Tokens (the ordered effect
// that keeps every rank's calls in one order) are passed over. A Python
// exception becomes the call's error, its text intact.
#include <Python.h>

#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static PyObject *g_dispatch = nullptr;  // a strong reference, set with the GIL held

extern "C" int CollectivesJaxSetDispatch(PyObject *fn) {
  Py_XINCREF(fn);
  Py_XSETREF(g_dispatch, fn);
  return 0;
}

static PyObject *views(std::vector<std::pair<char *, size_t>> &bufs, int flags) {
  PyObject *t = PyTuple_New(static_cast<Py_ssize_t>(bufs.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < bufs.size(); ++i) {
    PyObject *v = PyMemoryView_FromMemory(bufs[i].first, static_cast<Py_ssize_t>(bufs[i].second), flags);
    if (v == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), v);
  }
  return t;
}

static std::string fetch_error() {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  std::string text = "collectives: the call raised";
  if (value != nullptr) {
    PyObject *name = type != nullptr ? PyObject_GetAttrString(type, "__name__") : nullptr;
    PyObject *s = PyObject_Str(value);
    if (s != nullptr) {
      const char *c = PyUnicode_AsUTF8(s);
      const char *n = name != nullptr ? PyUnicode_AsUTF8(name) : nullptr;
      if (c != nullptr) text = std::string(n != nullptr ? n : "Error") + ": " + c;
    }
    Py_XDECREF(s);
    Py_XDECREF(name);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

// The interpreter's lock, taken on the thread XLA runs the call on (often
// one of its workers). PyGILState_Ensure alone makes a thread state for a
// thread that has none and frees it at the matching release, on every call.
// So the first call on a thread that does not hold the lock keeps one count
// of its own: the state then lives as long as the thread, and later calls
// only take and give back the lock.
static PyGILState_STATE EnsureGil() {
  static thread_local bool kept = false;
  if (!kept && !PyGILState_Check()) {
    kept = true;
    PyGILState_Ensure();  // never released: it keeps this thread's state
    PyEval_SaveThread();  // but not the lock
  }
  return PyGILState_Ensure();
}

static ffi::Error Call(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t key) {
  std::vector<std::pair<char *, size_t>> ins, outs;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    if (b->element_type() == ffi::DataType::TOKEN) continue;
    ins.emplace_back(static_cast<char *>(b->untyped_data()), b->size_bytes());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    if ((*b)->element_type() == ffi::DataType::TOKEN) continue;
    outs.emplace_back(static_cast<char *>((*b)->untyped_data()), (*b)->size_bytes());
  }
  if (ins.size() != outs.size()) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "inputs and outputs differ in number");
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i].second != outs[i].second)
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "an output differs in size from its input");
    if (ins[i].first != outs[i].first && ins[i].second > 0) std::memcpy(outs[i].first, ins[i].first, ins[i].second);
  }
  PyGILState_STATE gil = EnsureGil();
  std::string error;
  if (g_dispatch == nullptr) {
    error = "collectives: no dispatch function is set";
  } else {
    PyObject *out_views = views(outs, PyBUF_WRITE);
    PyObject *res = nullptr;
    if (out_views != nullptr) {
      PyObject *k = PyLong_FromLongLong(key);
      if (k != nullptr) {
        res = PyObject_CallFunctionObjArgs(g_dispatch, k, out_views, nullptr);
        Py_DECREF(k);
      }
    }
    if (res == nullptr) error = fetch_error();
    Py_XDECREF(res);
    Py_XDECREF(out_views);
  }
  PyGILState_Release(gil);
  if (!error.empty()) return ffi::Error(ffi::ErrorCode::kInternal, error);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CollectivesJaxCall, Call,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("key"));
