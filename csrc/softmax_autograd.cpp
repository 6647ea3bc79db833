// Autograd of the softmax-family ops, registered once at the Autograd key, so
// it serves every backend (C++, CUDA, Triton, pure torch): the forward runs the
// op below autograd and saves what the backward op needs; the backward calls
// the matching *_backward op through the dispatcher. torch.func transforms
// that differentiate (grad, vjp, jacrev) do not support C++ autograd
// functions; torch.vmap works. Written in
// C++ rather than with torch.library.register_autograd because a Python
// autograd kernel costs tens of microseconds per call.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "common/autograd.h"
#include "common/find_op.h"
#include "common/softmax_op.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Calls the kind's backward op through the dispatcher; softmax's takes no mask
// (a dropped entry's output is 0).
template <SoftmaxKind kind>
at::Tensor call_backward_op(const at::Tensor& grad, const at::Tensor& saved,
                            const at::Tensor& stats, int64_t dim,
                            const std::optional<at::Tensor>& mask) {
  if constexpr (kind == SoftmaxKind::Softmax) {
    static const auto op = find_op<SoftmaxBackwardSignature>(backward_name(kind));
    return op.call(grad, saved, stats, dim);
  } else {
    static const auto op = find_op<MaskedBackwardSignature>(backward_name(kind));
    return op.call(grad, saved, stats, dim, mask);
  }
}

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> call_forward_below_autograd(
    const at::Tensor& input, int64_t dim, const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<ForwardSignature>(forward_name(kind));
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(input, dim, mask);
}

template <SoftmaxKind kind, typename Self>
struct SoftmaxFamilyFunction : public torch::autograd::Function<Self> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, int64_t dim,
                               const std::optional<at::Tensor>& mask) {
    auto [output, stats] = call_forward_below_autograd<kind>(input, dim, mask);
    ctx->saved_data["dim"] = dim;
    // softmax and log_softmax differentiate from their output, logsumexp from
    // its input; an undefined tensor stands for "no mask" (softmax never needs it).
    const bool keeps_mask = kind != SoftmaxKind::Softmax && mask.has_value();
    ctx->save_for_backward({kind == SoftmaxKind::LogSumExp ? input : output, stats,
                            keeps_mask ? *mask : at::Tensor()});
    ctx->mark_non_differentiable({stats});
    // No zero tensor is built for an unused output or for the stats.
    ctx->set_materialize_grads(false);
    return {output, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad_output = grads[0];
    if (!grad_output.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};  // output unused
    const variable_list saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> mask =
        saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {call_backward_op<kind>(grad_output, saved[0], saved[1], dim, mask), at::Tensor(),
            at::Tensor()};
  }
};

// The backward ops are differentiable once more only in name: with
// create_graph=True they record a node whose own backward refuses with a
// clear error, instead of PyTorch's fallback, which only warns and drops the
// second-order term.
template <SoftmaxKind kind, typename Self>
struct BackwardOpFunction : public torch::autograd::Function<Self> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad,
                               const at::Tensor& saved, const at::Tensor& stats, int64_t dim,
                               const std::optional<at::Tensor>& mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return {call_backward_op<kind>(grad, saved, stats, dim, mask)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward(backward_name(kind), "softmax");
  }
};

// The graph nodes, named as torch names its own (grad_fn=<NanfreeSoftmaxBackward>).
struct NanfreeSoftmaxBackward final
    : SoftmaxFamilyFunction<SoftmaxKind::Softmax, NanfreeSoftmaxBackward> {};
struct NanfreeLogSoftmaxBackward final
    : SoftmaxFamilyFunction<SoftmaxKind::LogSoftmax, NanfreeLogSoftmaxBackward> {};
struct NanfreeLogsumexpBackward final
    : SoftmaxFamilyFunction<SoftmaxKind::LogSumExp, NanfreeLogsumexpBackward> {};
struct NanfreeSoftmaxBackwardBackward final
    : BackwardOpFunction<SoftmaxKind::Softmax, NanfreeSoftmaxBackwardBackward> {};
struct NanfreeLogSoftmaxBackwardBackward final
    : BackwardOpFunction<SoftmaxKind::LogSoftmax, NanfreeLogSoftmaxBackwardBackward> {};
struct NanfreeLogsumexpBackwardBackward final
    : BackwardOpFunction<SoftmaxKind::LogSumExp, NanfreeLogsumexpBackwardBackward> {};

template <SoftmaxKind kind>
using ForwardNode = std::conditional_t<
    kind == SoftmaxKind::Softmax, NanfreeSoftmaxBackward,
    std::conditional_t<kind == SoftmaxKind::LogSoftmax, NanfreeLogSoftmaxBackward,
                       NanfreeLogsumexpBackward>>;
template <SoftmaxKind kind>
using BackwardNode = std::conditional_t<
    kind == SoftmaxKind::Softmax, NanfreeSoftmaxBackwardBackward,
    std::conditional_t<kind == SoftmaxKind::LogSoftmax, NanfreeLogSoftmaxBackwardBackward,
                       NanfreeLogsumexpBackwardBackward>>;

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward_with_autograd(const at::Tensor& input, int64_t dim,
                                                         const std::optional<at::Tensor>& mask) {
  if (!needs_graph(input)) return call_forward_below_autograd<kind>(input, dim, mask);
  const variable_list outputs = ForwardNode<kind>::apply(input, dim, mask);
  return {outputs[0], outputs[1]};
}

template <SoftmaxKind kind>
at::Tensor backward_with_autograd(const at::Tensor& grad, const at::Tensor& saved,
                                  const at::Tensor& stats, int64_t dim,
                                  const std::optional<at::Tensor>& mask) {
  if (!needs_graph(grad) && !needs_graph(saved) && !needs_graph(stats)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_backward_op<kind>(grad, saved, stats, dim, mask);
  }
  return BackwardNode<kind>::apply(grad, saved, stats, dim, mask)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("softmax", &forward_with_autograd<SoftmaxKind::Softmax>);
  m.impl("log_softmax", &forward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp", &forward_with_autograd<SoftmaxKind::LogSumExp>);
  m.impl("softmax_backward", &backward_without_mask<&backward_with_autograd<SoftmaxKind::Softmax>>);
  m.impl("log_softmax_backward", &backward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_backward", &backward_with_autograd<SoftmaxKind::LogSumExp>);
}

}  // namespace nanfree
