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
    // its input; an undefined tensor stands for "no mask" (softmax never needs
    // it: a dropped entry's output is 0).
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
    at::Tensor grad_input;
    if constexpr (kind == SoftmaxKind::Softmax) {
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

// The backward ops are differentiable once more only in name: with
// create_graph=True they record a node whose own backward refuses with a
// clear error, instead of PyTorch's fallback, which only warns and drops the
// second-order term.
template <SoftmaxKind kind>
struct BackwardOpFunction : public torch::autograd::Function<BackwardOpFunction<kind>> {
  template <typename... Args>
  static variable_list forward(AutogradContext* ctx, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if constexpr (kind == SoftmaxKind::Softmax) {
      static const auto op = find_op<SoftmaxBackwardSignature>(backward_name(kind));
      return {op.call(args...)};
    } else {
      static const auto op = find_op<MaskedBackwardSignature>(backward_name(kind));
      return {op.call(args...)};
    }
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

at::Tensor softmax_backward_with_autograd(const at::Tensor& grad, const at::Tensor& output,
                                          const at::Tensor& stats) {
  return BackwardOpFunction<SoftmaxKind::Softmax>::apply(grad, output, stats)[0];
}

template <SoftmaxKind kind>
at::Tensor masked_backward_with_autograd(const at::Tensor& grad, const at::Tensor& saved,
                                         const at::Tensor& stats,
                                         const std::optional<at::Tensor>& mask) {
  return BackwardOpFunction<kind>::apply(grad, saved, stats, mask)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("softmax_lastdim", &forward_with_autograd<SoftmaxKind::Softmax>);
  m.impl("log_softmax_lastdim", &forward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_lastdim", &forward_with_autograd<SoftmaxKind::LogSumExp>);
  m.impl("softmax_lastdim_backward", &softmax_backward_with_autograd);
  m.impl("log_softmax_lastdim_backward",
         &masked_backward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_lastdim_backward", &masked_backward_with_autograd<SoftmaxKind::LogSumExp>);
}

}  // namespace nanfree
