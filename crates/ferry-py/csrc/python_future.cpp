// Completing a torch.futures.Future with an error, as PyTorch's own RPC
// futures hold one: the C++ future (c10::ivalue::Future) is marked with an
// exception_ptr, so that torch.futures.wait_all (c10::collectAll) stops at
// the first error, and done() / then() / add_done_callback see a failed
// future. Python's Future.set_exception only stores the exception as the
// future's value, which collectAll cannot tell from a result.
//
// The exception_ptr holds a FerryPyError, which keeps the Python exception
// object itself; an exception translator registered with pybind11 (whose
// internals torch shares) raises that very object again wherever pybind11
// turns the C++ error back into a Python one (wait(), value()), so its type,
// message and traceback survive, every time the future is read.
//
// Called with the GIL held. Errors are written into `err` (NUL-ended, at
// most `err_len` bytes) and signalled by a non-zero result.
#include <torch/csrc/jit/python/pybind_utils.h>

#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

namespace {

void set_error(char* err, size_t err_len, const char* what) {
  if (err == nullptr || err_len == 0) {
    return;
  }
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}

// Drops a reference to a Python object from any thread, taking the GIL
// (skipped once the interpreter is gone, as torch's PyObject holders do).
struct DecRef {
  void operator()(PyObject* obj) const {
    if (obj == nullptr || !Py_IsInitialized()) {
      return;
    }
    PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(obj);
    PyGILState_Release(state);
  }
};

// A Python exception carried through C++ as an exception_ptr. Copies
// share the object; the last one drops it with the GIL taken.
class FerryPyError : public std::exception {
 public:
  // `exc` is a live exception instance; the GIL is held.
  explicit FerryPyError(PyObject* exc) : exc_((Py_INCREF(exc), exc), DecRef()) {
    what_ = Py_TYPE(exc)->tp_name;
    PyObject* text = PyObject_Str(exc);
    if (text != nullptr) {
      const char* utf8 = PyUnicode_AsUTF8(text);
      if (utf8 != nullptr && utf8[0] != '\0') {
        what_ += ": ";
        what_ += utf8;
      }
      Py_DECREF(text);
    }
    PyErr_Clear();
  }

  const char* what() const noexcept override {
    return what_.c_str();
  }

  PyObject* object() const {
    return exc_.get();
  }

 private:
  std::shared_ptr<PyObject> exc_;
  std::string what_;
};

// Raises the Python exception a FerryPyError carries; leaves any other
// exception to the translators after it.
void translate(std::exception_ptr p) {
  try {
    if (p) {
      std::rethrow_exception(p);
    }
  } catch (const FerryPyError& e) {
    PyObject* exc = e.object();
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  }
}

std::once_flag translator_registered;

}  // namespace

extern "C" {

// Marks the torch.futures.Future `fut` (any torch._C.Future) completed with
// the exception instance `exc`, running its callbacks with the GIL
// released (as Future.set_result does). 0 on success.
int ferry_py_future_set_error(PyObject* fut, PyObject* exc, char* err, size_t err_len) {
  try {
    if (!PyExceptionInstance_Check(exc)) {
      set_error(err, err_len, "set_future_error: not an exception instance");
      return 1;
    }
    std::shared_ptr<torch::jit::PythonFutureWrapper> wrapper;
    try {
      wrapper = py::handle(fut).cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>();
    } catch (const py::cast_error&) {
      set_error(err, err_len, "set_future_error: not a torch.futures.Future");
      return 1;
    }
    std::call_once(translator_registered, [] { py::register_exception_translator(&translate); });
    std::exception_ptr eptr = std::make_exception_ptr(FerryPyError(exc));
    std::string failed;
    PyThreadState* saved = PyEval_SaveThread();
    try {
      wrapper->fut->setError(std::move(eptr));
    } catch (const std::exception& e) {
      failed = e.what();
    } catch (...) {
      failed = "unknown C++ exception";
    }
    PyEval_RestoreThread(saved);
    if (!failed.empty()) {
      set_error(err, err_len, failed.c_str());
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown C++ exception");
  }
  return 1;
}
}
