// Autograd of the softmax-family forward ops, registered once at the Autograd
// key, so it serves every backend (C++, CUDA, Triton, pure torch): the forward
// runs the op below autograd and saves what the backward op needs; the
// backward calls the matching *_backward op through the dispatcher. Written in
// C++ rather than with torch.library.register_autograd because a Python
// autograd kernel costs tens of microseconds per call.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "nanfree/softmax_math.h"

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

constexpr const char* forward_name(SoftmaxKind kind) {
  return kind == SoftmaxKind::Softmax      ? "nanfree::softmax_lastdim"
         : kind == SoftmaxKind::LogSoftmax ? "nanfree::log_softmax_lastdim"
                                           : "nanfree::logsumexp_lastdim";
}

constexpr const char* backward_name(SoftmaxKind kind) {
  return kind == SoftmaxKind::Softmax      ? "nanfree::softmax_lastdim_backward"
         : kind == SoftmaxKind::LogSoftmax ? "nanfree::log_softmax_lastdim_backward"
                                           : "nanfree::logsumexp_lastdim_backward";
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
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
    // its input; an undefined tensor stands for "no mask".
    ctx->save_for_backward(
        {kind == SoftmaxKind::LogSumExp ? input : output, stats, mask.value_or(at::Tensor())});
    ctx->mark_non_differentiable({stats});
    return {output, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& grad_output = grads[0];
    at::Tensor grad_input;
    if constexpr (kind == SoftmaxKind::Softmax) {
      // A dropped entry's output is 0, so the softmax backward needs no mask.
      static const auto op = find_op<SoftmaxBackwardSignature>(backward_name(kind));
      grad_input = op.call(grad_output, saved[0], saved[1]);
    } else {
      static const auto op = find_op<MaskedBackwardSignature>(backward_name(kind));
      const std::optional<at::Tensor> mask =
          saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
      grad_input = op.call(grad_output, saved[0], saved[1], mask);
    }
    return {grad_input, at::Tensor()};
  }
};

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward_with_autograd(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& mask) {
  const variable_list outputs = SoftmaxFamilyFunction<kind>::apply(input, mask);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("softmax_lastdim", &forward_with_autograd<SoftmaxKind::Softmax>);
  m.impl("log_softmax_lastdim", &forward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_lastdim", &forward_with_autograd<SoftmaxKind::LogSumExp>);
}

}  // namespace nanfree
