// The GeM family's C++ side shared by every backend (C++, CUDA, Triton, pure
// torch): its autograd, registered once at the Autograd key. (nanfree.ops.gem
// views its input as the op's [outer, n, inner] in Python and calls the op
// through torch.ops: a reduction over images or tokens is not a per-call
// latency path.) gem saves its input, mask and
// per-reduction statistics; the hand-written backward op gives the input's
// gradient and, for a tensor p that needs one, p's (summed over reductions in
// the backward op). Here p's gradient gets torch.clamp's mask (0 at and beyond
// [1e-2, 1e2]) and p's dtype and shape. Double backward refuses clearly.
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "common/autograd.h"
#include "common/find_op.h"
#include "common/gem_op.h"
#include "nanfree/gem_math.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> call_gem(const at::Tensor& input,
                                            const std::optional<at::Tensor>& p, double p_value,
                                            double eps, const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<GemSignature>("nanfree::gem");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(input, p, p_value, eps, mask);
}

// Through the whole dispatcher, autograd included: called from a node's
// backward, so that with create_graph=True the gradient records the node that
// refuses double backward.
std::tuple<at::Tensor, at::Tensor> gem_backward_op(const at::Tensor& grad, const at::Tensor& input,
                                                   const std::optional<at::Tensor>& p,
                                                   double p_value, const at::Tensor& stats,
                                                   double eps,
                                                   const std::optional<at::Tensor>& mask,
                                                   bool p_grad) {
  static const auto op = find_op<GemBackwardSignature>("nanfree::gem_backward");
  return op.call(grad, input, p, p_value, stats, eps, mask, p_grad);
}

// d gem / d p summed over reductions, as p's gradient: 0 beyond [1e-2, 1e2]
// (compared in the accumulation dtype the kernels clamp in) and passed at the
// bounds, as torch.clamp's gradient up to torch 2.13 (so that a p initialised
// at a bound can learn), bounded by p's dtype (a sum of many large terms may
// pass it), in p's dtype and shape. No host sync: all on p's device.
at::Tensor p_gradient(const at::Tensor& dp_sum, const at::Tensor& p) {
  const at::Tensor p_acc = p.detach().reshape({}).to(dp_sum.scalar_type());
  const at::Tensor in_range = at::logical_and(p_acc >= kGemMinP, p_acc <= kGemMaxP);
  at::Tensor grad = at::where(in_range, dp_sum, at::zeros_like(dp_sum));
  // The smaller of the two ranges: a float32 sum cannot be clamped with float64's bounds.
  const double big = std::min(largest_finite(p.scalar_type()), largest_finite(dp_sum.scalar_type()));
  grad = at::clamp(grad, -big, big);  // an out-of-range sum saturates; NaN stays
  return grad.to(p.scalar_type()).reshape(p.sizes());
}

struct NanfreeGemBackward final : torch::autograd::Function<NanfreeGemBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const std::optional<at::Tensor>& p, double p_value, double eps,
                               const std::optional<at::Tensor>& mask) {
    auto [output, stats] = call_gem(input, p, p_value, eps, mask);
    ctx->save_for_backward({input, p.value_or(at::Tensor()), stats, mask.value_or(at::Tensor())});
    ctx->saved_data["p_value"] = p_value;
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({stats});
    ctx->set_materialize_grads(false);
    return {output, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& p = saved[1];
    const bool p_grad = p.defined() && ctx->needs_input_grad(1);
    auto [grad_input, dp] = gem_backward_op(
        grads[0], saved[0], optional_of(p), ctx->saved_data["p_value"].toDouble(), saved[2],
        ctx->saved_data["eps"].toDouble(), optional_of(saved[3]), p_grad);
    return {ctx->needs_input_grad(0) ? grad_input : at::Tensor(),
            p_grad ? p_gradient(dp, p) : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// gem_backward's own node (create_graph=True), which refuses double backward.
struct NanfreeGemBackwardBackward final
    : RefusedDoubleBackward<NanfreeGemBackwardBackward, &gem_backward_op> {
  static constexpr const char* kOpName = "nanfree::gem_backward";
  static constexpr const char* kFamily = "gem";
};

std::tuple<at::Tensor, at::Tensor> gem_with_autograd(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& p,
                                                     double p_value, double eps,
                                                     const std::optional<at::Tensor>& mask) {
  if (!any_needs_graph(input, p)) return call_gem(input, p, p_value, eps, mask);
  const variable_list out = NanfreeGemBackward::apply(input, p, p_value, eps, mask);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("gem", &gem_with_autograd);
  m.impl("gem_backward", &BackwardOpAutograd<NanfreeGemBackwardBackward, &gem_backward_op>::kernel);
}

}  // namespace nanfree
