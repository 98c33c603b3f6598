// The two things distributed autograd needs from libtorch's engine that
// the tch crate does not expose: a backward pass with explicit incoming
// gradients (torch::autograd::grad with grad_outputs) that never touches
// `.grad`, and the leaves (AccumulateGrad variables) a pass reaches.
// Tensors cross as `at::Tensor*`, the representation tch uses; returned
// tensors are heap-allocated for tch to own and free.
#include <cstring>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace {
char* error_text(const char* what) {
  size_t n = std::strlen(what);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, what, n + 1);
  return out;
}
}  // namespace

extern "C" {

// Frees an error returned by the functions below.
void ferry_free_error(char* error) { std::free(error); }

// The identity of a tensor's TensorImpl (shared by all its shallow clones).
const void* ferry_tensor_impl(const at::Tensor* t) { return t->unsafeGetTensorImpl(); }

// Gradients of `roots` (seeded with `grad_outputs`) with respect to
// `inputs`, written to `outputs` (undefined where an input is unreached).
// Returns nullptr, or an error text to free with ferry_free_error.
char* ferry_grad(const at::Tensor* const* roots, const at::Tensor* const* grad_outputs, int n,
                 const at::Tensor* const* inputs, int ninputs, int keep_graph,
                 at::Tensor** outputs) {
  try {
    std::vector<at::Tensor> r, g, in;
    r.reserve(n);
    g.reserve(n);
    in.reserve(ninputs);
    for (int i = 0; i < n; ++i) {
      r.push_back(*roots[i]);
      g.push_back(*grad_outputs[i]);
    }
    for (int i = 0; i < ninputs; ++i) in.push_back(*inputs[i]);
    auto res = torch::autograd::grad(r, in, g, keep_graph != 0, /*create_graph=*/false,
                                     /*allow_unused=*/true);
    for (int i = 0; i < ninputs; ++i) outputs[i] = new at::Tensor(res[i]);
    return nullptr;
  } catch (const c10::Error& e) {
    // The error proper, without the C++ backtrace `what()` appends.
    return error_text(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error_text(e.what());
  } catch (...) {
    return error_text("unknown C++ exception in ferry_grad");
  }
}

// Calls `push(state, leaf)` once for every leaf tensor (one with an
// AccumulateGrad node, i.e. requiring grad and created by the user or
// received) that a backward pass from `roots` reaches, roots that are
// leaves included. Each leaf is a new tensor for the callee to own.
char* ferry_leaves(const at::Tensor* const* roots, int n, void* state,
                   void (*push)(void* state, at::Tensor* leaf)) {
  try {
    std::unordered_set<torch::autograd::Node*> seen;
    std::unordered_set<const void*> leaves;
    std::vector<torch::autograd::Node*> stack;
    auto visit = [&](torch::autograd::Node* node) {
      if (node == nullptr || !seen.insert(node).second) return;
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
        if (leaves.insert(acc->variable.unsafeGetTensorImpl()).second)
          push(state, new at::Tensor(acc->variable));
      } else {
        stack.push_back(node);
      }
    };
    for (int i = 0; i < n; ++i) {
      const at::Tensor& root = *roots[i];
      if (!root.defined() || !root.requires_grad()) continue;
      if (root.grad_fn()) {
        visit(root.grad_fn().get());
      } else if (leaves.insert(root.unsafeGetTensorImpl()).second) {
        push(state, new at::Tensor(root));
      }
    }
    while (!stack.empty()) {
      torch::autograd::Node* node = stack.back();
      stack.pop_back();
      for (const auto& edge : node->next_edges()) visit(edge.function.get());
    }
    return nullptr;
  } catch (const c10::Error& e) {
    // The error proper, without the C++ backtrace `what()` appends.
    return error_text(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error_text(e.what());
  } catch (...) {
    return error_text("unknown C++ exception in ferry_leaves");
  }
}
}
