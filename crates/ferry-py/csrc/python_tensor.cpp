// Python tensors <-> libtorch tensors for ferry-py, with no copy of their
// bytes. A tensor going out is a detached alias of the Python tensor (its
// storage and view, a TensorImpl of its own) unless its autograd identity
// must be kept (a distributed autograd context records it): then it is the
// tensor itself (the same TensorImpl: storage, view and autograd history).
// A tensor coming in is handed to Python as it is. Every function is called
// with the GIL held. A tensor crosses as an owned `at::Tensor*` (tch's C_tensor layout:
// tch frees it with `delete`). Errors are written into `err` (NUL-ended,
// at most `err_len` bytes) and signalled by a null result.
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <exception>

namespace {
void set_error(char* err, size_t err_len, const char* what) {
  if (err == nullptr || err_len == 0) {
    return;
  }
  std::strncpy(err, what, err_len - 1);
  err[err_len - 1] = '\0';
}
}  // namespace

extern "C" {

// Whether `obj` is a torch.Tensor (or a subclass).
int ferry_py_is_tensor(PyObject* obj) {
  return THPVariable_Check(obj) ? 1 : 0;
}

// A new `at::Tensor*` for the torch.Tensor `obj`: its own TensorImpl when
// `keep_identity` is 1, it requires grad and grad mode is on (as PyTorch
// records a send function only then), or when `keep_identity` is 2; a
// detached alias of it otherwise.
void* ferry_py_unpack(PyObject* obj, int keep_identity, char* err, size_t err_len) {
  try {
    if (!THPVariable_Check(obj)) {
      set_error(err, err_len, "not a torch.Tensor");
      return nullptr;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (keep_identity == 2 ||
        (keep_identity == 1 && t.requires_grad() && c10::GradMode::is_enabled())) {
      return new at::Tensor(t);
    }
    return new at::Tensor(t.detach());
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown C++ exception");
  }
  return nullptr;
}

// A new reference to the torch.Tensor of `*tensor` (the same TensorImpl).
PyObject* ferry_py_wrap(const void* tensor, char* err, size_t err_len) {
  try {
    const auto* t = static_cast<const at::Tensor*>(tensor);
    PyObject* obj = THPVariable_Wrap(*t);
    if (obj == nullptr) {
      set_error(err, err_len, "THPVariable_Wrap returned null");
    }
    return obj;
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown C++ exception");
  }
  return nullptr;
}
}
