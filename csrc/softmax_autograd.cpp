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

#include "common/softmax_op.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                            const std::optional<at::Tensor>&);
using SoftmaxBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&);
using MaskedBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, const std::optional<at::Tensor>&);

// Schema names: "nanfree::<op>_lastdim" and "nanfree::<op>_lastdim_backward".
std::string forward_name(SoftmaxKind kind) {
  return std::string("nanfree::") + op_name(kind) + "_lastdim";
}

std::string backward_name(SoftmaxKind kind) { return forward_name(kind) + "_backward"; }

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Signature>();
}

// Calls the kind's backward op through the dispatcher; softmax's takes no mask
// (a dropped entry's output is 0).
template <SoftmaxKind kind>
at::Tensor call_backward_op(const at::Tensor& grad, const at::Tensor& saved,
                            const at::Tensor& stats, const std::optional<at::Tensor>& mask) {
  if constexpr (kind == SoftmaxKind::Softmax) {
    static const auto op = find_op<SoftmaxBackwardSignature>(backward_name(kind));
    return op.call(grad, saved, stats);
  } else {
    static const auto op = find_op<MaskedBackwardSignature>(backward_name(kind));
    return op.call(grad, saved, stats, mask);
  }
}

template <SoftmaxKind kind>
struct SoftmaxFamilyFunction : public torch::autograd::Function<SoftmaxFamilyFunction<kind>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const std::optional<at::Tensor>& mask) {
    static const auto op = find_op<ForwardSignature>(forward_name(kind));
    at::Tensor output, stats;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(output, stats) = op.call(input, mask);
    }
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
    if (!grad_output.defined()) return {at::Tensor(), at::Tensor()};  // output unused
    const variable_list saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> mask =
        saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    return {call_backward_op<kind>(grad_output, saved[0], saved[1], mask), at::Tensor()};
  }
};

// The backward ops are differentiable once more only in name: with
// create_graph=True they record a node whose own backward refuses with a
// clear error, instead of PyTorch's fallback, which only warns and drops the
// second-order term.
template <SoftmaxKind kind>
struct BackwardOpFunction : public torch::autograd::Function<BackwardOpFunction<kind>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad,
                               const at::Tensor& saved, const at::Tensor& stats,
                               const std::optional<at::Tensor>& mask) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return {call_backward_op<kind>(grad, saved, stats, mask)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(false, "nanfree: ", backward_name(kind),
                " has no derivative: double backward (differentiating a gradient) of the "
                "softmax family is not implemented");
    return {};
  }
};

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward_with_autograd(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& mask) {
  const variable_list outputs = SoftmaxFamilyFunction<kind>::apply(input, mask);
  return {outputs[0], outputs[1]};
}

template <SoftmaxKind kind>
at::Tensor backward_with_autograd(const at::Tensor& grad, const at::Tensor& saved,
                                  const at::Tensor& stats, const std::optional<at::Tensor>& mask) {
  return BackwardOpFunction<kind>::apply(grad, saved, stats, mask)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("softmax_lastdim", &forward_with_autograd<SoftmaxKind::Softmax>);
  m.impl("log_softmax_lastdim", &forward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_lastdim", &forward_with_autograd<SoftmaxKind::LogSumExp>);
  m.impl("softmax_lastdim_backward",
         &backward_without_mask<&backward_with_autograd<SoftmaxKind::Softmax>>);
  m.impl("log_softmax_lastdim_backward", &backward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_lastdim_backward", &backward_with_autograd<SoftmaxKind::LogSumExp>);
}

}  // namespace nanfree
