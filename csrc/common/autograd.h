// Autograd plumbing shared by every op family with C++ autograd
// (csrc/<family>.cpp): whether a call records a graph node, and the node and
// Autograd kernel of a backward op, which refuse double backward.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace nanfree {

// Whether a call must record an autograd node for `t`. Without one the op runs
// straight below autograd: building a node costs about a microsecond, a third
// of a small tensor's call.
inline bool needs_graph(const at::Tensor& t) {
  return t.defined() && at::GradMode::is_enabled() && t.requires_grad();
}

// A backward op is differentiable in name only: with create_graph=True it
// records a node whose own backward refuses with a clear error, instead of
// PyTorch's fallback, which only warns and drops the second-order term.
[[noreturn]] inline void refuse_double_backward(const std::string& backward_op,
                                                const char* family) {
  TORCH_CHECK(false, "nanfree: ", backward_op,
              " has no derivative: double backward (differentiating a gradient) of the ", family,
              " family is not implemented");
  __builtin_unreachable();
}

// A saved optional tensor back: an undefined tensor stands for None (what
// save_for_backward is given for an absent one, `t.value_or(at::Tensor())`).
inline std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Whether any tensor argument (optional ones included) needs a graph.
inline bool argument_needs_graph(const at::Tensor& t) { return needs_graph(t); }
inline bool argument_needs_graph(const std::optional<at::Tensor>& t) {
  return t.has_value() && needs_graph(*t);
}
inline bool argument_needs_graph(at::TensorList list) {
  for (const at::Tensor& t : list) {
    if (needs_graph(t)) return true;
  }
  return false;
}
template <typename T>
bool argument_needs_graph(const T& /*not a tensor*/) {
  return false;
}
template <typename... Args>
bool any_needs_graph(const Args&... args) {
  return (argument_needs_graph(args) || ...);
}

// An op's result as autograd's variable list, and back.
inline torch::autograd::variable_list as_variables(const at::Tensor& t) { return {t}; }
inline torch::autograd::variable_list as_variables(const std::tuple<at::Tensor, at::Tensor>& t) {
  return {std::get<0>(t), std::get<1>(t)};
}
template <typename Result>
Result from_variables(const torch::autograd::variable_list& v) {
  if constexpr (std::is_same_v<Result, at::Tensor>) {
    return v[0];
  } else {
    return Result{v[0], v[1]};
  }
}

// The graph node of a backward op called with create_graph=True: it runs the
// op (kOp, which calls it through the dispatcher) below autograd, and its own
// backward refuses. Node names it as torch names its own
// (grad_fn=<NanfreeGemBackwardBackward>) and gives kOpName and kFamily:
//   struct NanfreeGemBackwardBackward final
//       : RefusedDoubleBackward<NanfreeGemBackwardBackward, &call_gem_backward> {
//     static constexpr const char* kOpName = "nanfree::gem_backward";
//     static constexpr const char* kFamily = "gem";
//   };
template <typename Node, auto kOp>
struct RefusedDoubleBackward : torch::autograd::Function<Node> {
  template <typename... Args>
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* /*ctx*/,
                                                const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return as_variables(kOp(args...));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list /*grads*/) {
    refuse_double_backward(Node::kOpName, Node::kFamily);
  }
};

// The Autograd kernel of a backward op: below autograd when no argument needs
// a graph (no node: a node costs about a microsecond), else through Node.
template <typename Node, auto kOp>
struct BackwardOpAutograd;
template <typename Node, typename Result, typename... Args, Result (*kOp)(Args...)>
struct BackwardOpAutograd<Node, kOp> {
  static Result kernel(Args... args) {
    if (!any_needs_graph(args...)) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return kOp(args...);
    }
    return from_variables<Result>(Node::apply(args...));
  }
};

}  // namespace nanfree
