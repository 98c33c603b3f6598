// The two things distributed autograd needs from libtorch's engine that
// the tch crate does not expose: a backward pass with explicit incoming
// gradients (torch::autograd::grad with grad_outputs) that never touches
// `.grad`, and the leaves (AccumulateGrad variables) a pass reaches; then
// what happens to a leaf's gradient as in PyTorch's distributed engine:
// its AccumulateGrad node's hooks, and libtorch's accumulation rules.
// Tensors cross as `at::Tensor*`, the representation tch uses; returned
// tensors are heap-allocated for tch to own and free.
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/variable.h>

namespace {
char* error_text(const char* what) {
  size_t n = std::strlen(what);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, what, n + 1);
  return out;
}

// Runs `body` (which returns nullptr or an error text), turning any C++
// exception into an error text for the caller to free: the error proper,
// without the backtrace c10's `what()` appends.
template <class F>
char* guarded(const char* name, F&& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    return error_text(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error_text(e.what());
  } catch (...) {
    std::string text = std::string("unknown C++ exception in ") + name;
    return error_text(text.c_str());
  }
}

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
// A counted pointer to a node (std::shared_ptr or c10::intrusive_ptr,
// depending on the libtorch release).
using NodePtr = decltype(Edge{}.function);

// Keeps a copy of the gradients flowing into a node.
struct Capture : torch::autograd::FunctionPreHook {
  explicit Capture(variable_list* out) : out(out) {}
  variable_list operator()(const variable_list& grads) override {
    *out = grads;
    return grads;
  }
  variable_list* out;
};

// Pre-hooks added to nodes, removed again (at the latest) on destruction.
struct Hooks {
  std::vector<std::pair<NodePtr, torch::autograd::FunctionPreHook*>> added;
  void emplace_back(NodePtr node, torch::autograd::FunctionPreHook* hook) {
    added.emplace_back(std::move(node), hook);
  }
  void remove() {
    for (auto& [node, hook] : added) {
      auto& hooks = node->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it)
        if (it->get() == hook) {
          hooks.erase(it);
          break;
        }
    }
    added.clear();
  }
  ~Hooks() { remove(); }
};

// What the input half of a split backward keeps for the weight half: the
// nodes that feed the parameters directly ("weight nodes") and the
// gradients that flowed into each of them.
struct Split {
  std::vector<NodePtr> nodes;
  std::vector<variable_list> grads;
  // The input pass's nodes, whose edges the weight pass cuts. Only
  // compared as addresses: the capture's nodes keep them alive.
  std::unordered_set<Node*> input_path;
};

// All nodes reachable from `roots`.
std::vector<Node*> reachable(const std::vector<at::Tensor>& roots) {
  std::unordered_set<Node*> seen;
  std::vector<Node*> order, stack;
  for (const auto& r : roots)
    if (r.defined() && r.grad_fn() && seen.insert(r.grad_fn().get()).second)
      stack.push_back(r.grad_fn().get());
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    order.push_back(node);
    for (const auto& e : node->next_edges())
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  }
  return order;
}

// Of `nodes`, those from which one of `targets` can be reached.
std::unordered_set<Node*> leading_to(const std::vector<Node*>& nodes,
                                     const std::unordered_set<Node*>& targets) {
  std::unordered_map<Node*, bool> memo;
  std::function<bool(Node*)> leads = [&](Node* n) -> bool {
    if (targets.count(n)) return true;
    auto it = memo.find(n);
    if (it != memo.end()) return it->second;
    memo[n] = false;  // cycles cannot happen; this only stops re-entry
    bool any = false;
    for (const auto& e : n->next_edges())
      if (e.function && leads(e.function.get())) any = true;
    memo[n] = any;
    return any;
  };
  std::unordered_set<Node*> out;
  for (Node* n : nodes)
    if (leads(n)) out.insert(n);
  return out;
}
// Whether `node` runs no hooks of any kind.
bool hookless(Node* node) {
  return node->pre_hooks().empty() && node->post_hooks().empty() &&
         node->tensor_pre_hooks().empty() && node->retains_grad_hooks().empty();
}

// A linear layer's weight product recognised in the graph: `node`
// (AddmmBackward0 with a bias, MmBackward0 without) makes, through its
// edge `mat2_index` and a TBackward0, the gradient of the parameter whose
// accumulated gradient is `acc`: `acc += alpha * grad^T mat1`.
struct LinearWeight {
  size_t mat2_index;
  at::Tensor mat1;
  double alpha;
  at::Tensor* acc;
};

// Whether `t` is a plain dense real matrix.
bool dense_matrix(const at::Tensor& t) {
  return t.defined() && t.dim() == 2 && t.layout() == at::kStrided && !t.is_conj() &&
         !t.is_neg() && at::isFloatingType(t.scalar_type());
}

// Recognises `F.linear`'s shape at `node` (AddmmBackward0 or MmBackward0,
// whose second matrix is a parameter transposed, TBackward0 then the
// parameter's AccumulateGrad, all without hooks), for a parameter with an
// accumulated gradient in `accs` of the matching dtype, device and shape.
bool linear_weight(Node* node, const std::unordered_map<const void*, at::Tensor*>& accs,
                   LinearWeight* out) {
  using torch::autograd::generated::AddmmBackward0;
  using torch::autograd::generated::MmBackward0;
  using torch::autograd::generated::TBackward0;
  if (auto* addmm = dynamic_cast<AddmmBackward0*>(node)) {
    if (addmm->alpha.isComplex()) return false;
    out->alpha = addmm->alpha.toDouble();
    out->mat2_index = 2;
    out->mat1 = addmm->mat1_.unpack();
  } else if (auto* mm = dynamic_cast<MmBackward0*>(node)) {
    out->alpha = 1.0;
    out->mat2_index = 1;
    out->mat1 = mm->self_.unpack();
  } else {
    return false;
  }
  if (!hookless(node) || node->next_edges().size() <= out->mat2_index) return false;
  auto* transpose = dynamic_cast<TBackward0*>(node->next_edges()[out->mat2_index].function.get());
  if (transpose == nullptr || !hookless(transpose) || transpose->next_edges().size() != 1)
    return false;
  auto* acc_node =
      dynamic_cast<torch::autograd::AccumulateGrad*>(transpose->next_edges()[0].function.get());
  if (acc_node == nullptr || !hookless(acc_node)) return false;
  auto found = accs.find(acc_node->variable.unsafeGetTensorImpl());
  if (found == accs.end()) return false;
  at::Tensor& acc = *found->second;
  const at::Tensor& mat1 = out->mat1;
  if (!dense_matrix(mat1) || !dense_matrix(acc) || mat1.scalar_type() != acc.scalar_type() ||
      mat1.device() != acc.device() || acc.size(1) != mat1.size(1))
    return false;
  out->acc = &acc;
  return true;
}

// Adds the weight gradient `grad` of a recognised linear product to its
// accumulated gradient with one GEMM and cuts the edge it served, so that
// the node does not compute it again. False (and nothing done) when the
// gradient does not fit the product.
bool fuse_into(Node* node, const LinearWeight& w, const at::Tensor& grad) {
  const at::Tensor& acc = *w.acc;
  if (!dense_matrix(grad) || grad.scalar_type() != acc.scalar_type() ||
      grad.device() != acc.device() || acc.size(0) != grad.size(1) ||
      grad.size(0) != w.mat1.size(0))
    return false;
  at::NoGradGuard no_grad;
  w.acc->addmm_(grad.t(), w.mat1, /*beta=*/1, /*alpha=*/w.alpha);
  // Assigned in place, as the input-path edges are: the node then skips
  // that output (task_should_compute_output sees no edge).
  node->next_edges()[w.mat2_index] = Edge();
  return true;
}

// For a weight node of a split backward's capture (W): fuses its linear
// weight product with the captured gradient.
void fuse_linear_weight(const NodePtr& node, const variable_list& captured,
                        const std::unordered_map<const void*, at::Tensor*>& accs) {
  if (captured.size() != 1 || !captured[0].defined()) return;
  LinearWeight w;
  if (linear_weight(node.get(), accs, &w)) fuse_into(node.get(), w, captured[0]);
}

// A pre-hook that fuses a linear weight product when the node's gradient
// arrives during a backward pass that releases the graph.
struct FuseHook : torch::autograd::FunctionPreHook {
  FuseHook(Node* node, LinearWeight w) : node(node), w(std::move(w)) {}
  variable_list operator()(const variable_list& grads) override {
    if (grads.size() == 1 && grads[0].defined()) fuse_into(node, w, grads[0]);
    return grads;
  }
  Node* node;
  LinearWeight w;
};
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
  return guarded("ferry_grad", [&]() -> char* {
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
  });
}

// ferry_grad without keeping the graph, for a caller that accumulates the
// gradients: `accs` has one entry per input, its accumulated gradient or
// null. Where an input is a linear layer's weight with an accumulated
// gradient, the layer's product adds its gradient to it in place (a pre-hook
// on the product's node, fuse_into) and `outputs` holds only the rest of
// that input's gradient (undefined when there is none).
char* ferry_grad_accumulating(const at::Tensor* const* roots,
                              const at::Tensor* const* grad_outputs, int n,
                              const at::Tensor* const* inputs, int ninputs,
                              at::Tensor* const* accs, at::Tensor** outputs) {
  // The hooks come off when this scope ends, by return or throw.
  Hooks hooked;
  return guarded("ferry_grad_accumulating", [&]() -> char* {
      std::vector<at::Tensor> r, g, in;
      for (int i = 0; i < n; ++i) {
        r.push_back(*roots[i]);
        g.push_back(*grad_outputs[i]);
      }
      for (int i = 0; i < ninputs; ++i) in.push_back(*inputs[i]);
      std::unordered_map<const void*, at::Tensor*> acc_of;
      for (int i = 0; i < ninputs; ++i)
        if (accs[i] != nullptr && accs[i]->defined())
          acc_of.emplace(inputs[i]->unsafeGetTensorImpl(), accs[i]);
      if (!acc_of.empty())
        for (Node* node : reachable(r)) {
          LinearWeight w;
          if (!linear_weight(node, acc_of, &w)) continue;
          NodePtr ptr = node->getptr();
          auto hook = std::make_unique<FuseHook>(node, std::move(w));
          hooked.emplace_back(ptr, hook.get());
          node->add_pre_hook(std::move(hook));
        }
      auto res = torch::autograd::grad(r, in, g, /*keep_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
      for (int i = 0; i < ninputs; ++i) outputs[i] = new at::Tensor(res[i]);
      return nullptr;
  });
}

// Calls `push(state, leaf)` once for every leaf tensor (one with an
// AccumulateGrad node, i.e. requiring grad and created by the user or
// received) that a backward pass from `roots` reaches, roots that are
// leaves included. Each leaf is a new tensor for the callee to own.
char* ferry_leaves(const at::Tensor* const* roots, int n, void* state,
                   void (*push)(void* state, at::Tensor* leaf)) {
  return guarded("ferry_leaves", [&]() -> char* {
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
  });
}

// The input half of a split backward (zero-bubble schedules' I): writes to
// `outputs` the gradients of `roots` (seeded with `grad_outputs`) with
// respect to `inputs`, keeping the graph, and captures what the weight
// half needs to compute the gradients of `params` without going through
// the input path again, as PyTorch's `stage_backward_input` does. `*split`
// gets the capture, or nullptr when some parameter is fed by a node the
// input pass does not run (the weight half must then start again from the
// roots). Returns nullptr, or an error text.
char* ferry_backward_input(const at::Tensor* const* roots, const at::Tensor* const* grad_outputs,
                           int n, const at::Tensor* const* inputs, int ninputs,
                           const at::Tensor* const* params, int nparams, at::Tensor** outputs,
                           void** split) {
  *split = nullptr;
  // The capture hooks come off when this scope ends, by return or throw.
  Hooks hooked;
  auto state = std::make_unique<Split>();
  return guarded("ferry_backward_input", [&]() -> char* {
      std::vector<at::Tensor> r, g, in;
      for (int i = 0; i < n; ++i) {
        r.push_back(*roots[i]);
        g.push_back(*grad_outputs[i]);
      }
      for (int i = 0; i < ninputs; ++i) in.push_back(*inputs[i]);
      auto nodes = reachable(r);
      // The accumulators of the parameters and of the inputs.
      std::unordered_set<Node*> param_acc, input_acc;
      for (int i = 0; i < nparams; ++i) {
        auto edge = torch::autograd::impl::gradient_edge(*params[i]);
        if (edge.function) param_acc.insert(edge.function.get());
      }
      for (const auto& t : in) {
        auto edge = torch::autograd::impl::gradient_edge(t);
        if (edge.function) input_acc.insert(edge.function.get());
      }
      // The input pass runs exactly the nodes that lead to an input (Q).
      auto on_input_path = leading_to(nodes, input_acc);
      auto to_params = leading_to(nodes, param_acc);
      // Capture nodes: on the input path, with an edge leaving it towards a
      // parameter. Once a path leaves Q it never comes back (a node leading
      // back would lead to an input), so every parameter gradient flows out
      // of Q through these edges, unless a root outside Q reaches a
      // parameter, or a parameter is itself a root or an input.
      bool capturable = true;
      std::vector<Node*> weight_nodes;
      for (Node* node : nodes) {
        if (!on_input_path.count(node)) continue;
        for (const auto& e : node->next_edges())
          if (e.function && !on_input_path.count(e.function.get()) &&
              (param_acc.count(e.function.get()) || to_params.count(e.function.get()))) {
            weight_nodes.push_back(node);
            break;
          }
      }
      for (const auto& root : r) {
        Node* fn = root.grad_fn().get();
        if (fn == nullptr && param_acc.count(torch::autograd::impl::gradient_edge(root).function.get()))
          capturable = false;
        if (fn != nullptr && !on_input_path.count(fn) && (to_params.count(fn) || param_acc.count(fn)))
          capturable = false;
      }
      for (Node* acc : param_acc)
        if (input_acc.count(acc)) capturable = false;
      if (weight_nodes.empty()) capturable = false;
      if (capturable) {
        state->input_path = on_input_path;
        state->grads.resize(weight_nodes.size());
        for (size_t i = 0; i < weight_nodes.size(); ++i) {
          NodePtr node = weight_nodes[i]->getptr();
          auto hook = std::make_unique<Capture>(&state->grads[i]);
          hooked.emplace_back(node, hook.get());
          node->add_pre_hook(std::move(hook));
          state->nodes.push_back(node);
        }
      }
      auto res = torch::autograd::grad(r, in, g, /*retain_graph=*/true, /*create_graph=*/false,
                                       /*allow_unused=*/true);
      hooked.remove();
      for (int i = 0; i < ninputs; ++i) outputs[i] = new at::Tensor(res[i]);
      if (capturable) *split = state.release();
      return nullptr;
  });
}


// The weight half (W) from a capture of ferry_backward_input: writes the
// gradients of `params` to `outputs` (undefined where unreached) and frees
// the capture. The weight nodes run only their parameter outputs: their
// edges towards the input path are cut, since the captured gradients
// already hold everything that flowed in (the graph is released here).
//
// `accs` (may be null) has one entry per parameter: its accumulated
// gradient, or null. Where one is given, the part of that parameter's
// gradient that a linear layer's GEMM makes is added to it in place
// (fuse_linear_weight), and `outputs` holds only the rest (undefined when
// there is none): the caller adds `outputs` to `accs` as before.
char* ferry_backward_weight(void* split, const at::Tensor* const* params, int nparams,
                            at::Tensor* const* accs, at::Tensor** outputs) {
  std::unique_ptr<Split> state(static_cast<Split*>(split));
  return guarded("ferry_backward_weight", [&]() -> char* {
      torch::autograd::edge_list outs;
      for (int i = 0; i < nparams; ++i) outs.push_back(torch::autograd::impl::gradient_edge(*params[i]));
      std::unordered_map<const void*, at::Tensor*> acc_of;
      if (accs != nullptr)
        for (int i = 0; i < nparams; ++i)
          if (accs[i] != nullptr && accs[i]->defined())
            acc_of.emplace(params[i]->unsafeGetTensorImpl(), accs[i]);
      torch::autograd::edge_list roots;
      variable_list grads;
      for (size_t i = 0; i < state->nodes.size(); ++i) {
        auto& node = state->nodes[i];
        if (!acc_of.empty()) fuse_linear_weight(node, state->grads[i], acc_of);
        // Assigned in place: `set_next_edge` would re-check topological
        // numbers, which an emptied edge does not change.
        for (auto& e : node->next_edges())
          if (e.function && state->input_path.count(e.function.get())) e = Edge();
        const auto& captured = state->grads[i];
        for (size_t k = 0; k < captured.size(); ++k)
          if (captured[k].defined()) {
            roots.emplace_back(node, static_cast<uint32_t>(k));
            grads.push_back(captured[k]);
          }
      }
      variable_list res;
      if (!roots.empty())
        res = torch::autograd::Engine::get_default_engine().execute(
            roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/false,
            outs);
      for (int i = 0; i < nparams; ++i)
        outputs[i] = new at::Tensor(res.empty() ? at::Tensor() : res[i]);
      return nullptr;
  });
}

// Frees a capture of ferry_backward_input that will not be used.
void ferry_free_split(void* split) { delete static_cast<Split*>(split); }

// What PyTorch's distributed engine does with a gradient that reached a
// leaf (DistAccumulateGradCaptureHook), in three steps so that the caller
// holds its context's lock only for the second:
//
// 1. ferry_leaf_pre_hooks: runs the pre hooks of `leaf`'s AccumulateGrad
//    node on `grad`. Writes the gradient they give to `*out` and returns
//    1, or returns 0 (nothing written) when the node has none.
// 2. ferry_accumulate_grad: libtorch's own AccumulateGrad::accumulateGrad
//    with grad mode off: `new_grad` is kept as it is (no copy) when
//    nothing but the caller's `expected_refs` references hold it and it
//    obeys the gradient layout contract (sparse: contiguous indices and
//    values), cloned otherwise; added to `old` (null: none yet) in place
//    where libtorch can. Writes the leaf's gradient to `*out`.
// 3. ferry_leaf_post_hooks: runs the node's post hooks with no outputs and
//    `grad` as the input, as PyTorch's distributed engine does.
//
// Each returns nullptr or an error text to free with ferry_free_error.
char* ferry_leaf_pre_hooks(const at::Tensor* leaf, const at::Tensor* grad, at::Tensor** out,
                           int* changed) {
  return guarded("ferry_leaf_pre_hooks", [&]() -> char* {
      *changed = 0;
      auto node = torch::autograd::impl::try_get_grad_accumulator(*leaf);
      if (!node || node->pre_hooks().empty()) return nullptr;
      variable_list grads{*grad};
      for (const auto& hook : node->pre_hooks()) grads = (*hook)(grads);
      *out = new at::Tensor(grads.empty() ? at::Tensor() : grads[0]);
      *changed = 1;
      return nullptr;
  });
}

char* ferry_accumulate_grad(const at::Tensor* leaf, const at::Tensor* old,
                            const at::Tensor* new_grad, int expected_refs, at::Tensor** out) {
  return guarded("ferry_accumulate_grad", [&]() -> char* {
      c10::AutoGradMode grad_mode(false);
      at::Tensor acc = old != nullptr ? *old : at::Tensor();
      at::Tensor updated;
      torch::autograd::AccumulateGrad::accumulateGrad(
          *leaf, acc, *new_grad, static_cast<size_t>(expected_refs),
          [&](at::Tensor&& g) { updated = std::move(g); });
      *out = new at::Tensor(updated.defined() ? updated : acc);
      return nullptr;
  });
}

char* ferry_leaf_post_hooks(const at::Tensor* leaf, const at::Tensor* grad) {
  return guarded("ferry_leaf_post_hooks", [&]() -> char* {
      auto node = torch::autograd::impl::try_get_grad_accumulator(*leaf);
      if (!node) return nullptr;
      const variable_list no_outputs;
      variable_list grads{*grad};
      for (const auto& hook : node->post_hooks()) (*hook)(no_outputs, grads);
      return nullptr;
  });
}
}
