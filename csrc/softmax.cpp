// The softmax family's C++ side shared by every backend (C++, CUDA, Triton,
// pure torch): its autograd, registered once at the Autograd key, and the
// Python entry points of nanfree.ops.
//
// Autograd: the forward runs the op below autograd and saves what the
// backward op needs; the backward calls the matching *_backward op through
// the dispatcher. torch.func transforms that differentiate (grad, vjp, jacrev)
// do not support C++ autograd functions; torch.vmap works. Written in C++
// rather than with torch.library.register_autograd because a Python autograd
// kernel costs tens of microseconds per call.
//
// Python entry points: nanfree.ops.softmax and friends call these (outside
// torch.compile) instead of torch.ops.nanfree.*, whose boxed Python call costs
// about a microsecond more per call, a third of a small tensor's whole call.
// They only handle what the op does not (the dtype= cast, keepdim) and call
// the op through the dispatcher, so autograd, autocast, fake tensors and every
// backend behave exactly as through torch.ops. The op checks every argument.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>

#include "common/autograd.h"
#include "common/find_op.h"
#include "common/softmax_op.h"
#include "python_module.h"

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
    static const auto op = find_op<SoftmaxMaskedBackwardSignature>(backward_name(kind));
    return op.call(grad, saved, stats, dim, mask);
  }
}

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> call_forward_below_autograd(
    const at::Tensor& input, int64_t dim, const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<SoftmaxForwardSignature>(forward_name(kind));
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
    const std::optional<at::Tensor> mask = optional_of(saved[2]);
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {call_backward_op<kind>(grad_output, saved[0], saved[1], dim, mask), at::Tensor(),
            at::Tensor()};
  }
};

// The graph nodes, named as torch names its own (grad_fn=<NanfreeSoftmaxBackward>).
struct NanfreeSoftmaxBackward final
    : SoftmaxFamilyFunction<SoftmaxKind::Softmax, NanfreeSoftmaxBackward> {};
struct NanfreeLogSoftmaxBackward final
    : SoftmaxFamilyFunction<SoftmaxKind::LogSoftmax, NanfreeLogSoftmaxBackward> {};
struct NanfreeLogsumexpBackward final
    : SoftmaxFamilyFunction<SoftmaxKind::LogSumExp, NanfreeLogsumexpBackward> {};

// The backward ops' own nodes (create_graph=True), which refuse double backward.
template <SoftmaxKind kind, typename Self>
struct BackwardOpNode : RefusedDoubleBackward<Self, &call_backward_op<kind>> {
  static constexpr const char* kFamily = "softmax";
};
struct NanfreeSoftmaxBackwardBackward final
    : BackwardOpNode<SoftmaxKind::Softmax, NanfreeSoftmaxBackwardBackward> {
  static constexpr const char* kOpName = "nanfree::softmax_backward";
};
struct NanfreeLogSoftmaxBackwardBackward final
    : BackwardOpNode<SoftmaxKind::LogSoftmax, NanfreeLogSoftmaxBackwardBackward> {
  static constexpr const char* kOpName = "nanfree::log_softmax_backward";
};
struct NanfreeLogsumexpBackwardBackward final
    : BackwardOpNode<SoftmaxKind::LogSumExp, NanfreeLogsumexpBackwardBackward> {
  static constexpr const char* kOpName = "nanfree::logsumexp_backward";
};

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
constexpr auto backward_with_autograd =
    &BackwardOpAutograd<BackwardNode<kind>, &call_backward_op<kind>>::kernel;

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward_with_autograd(const at::Tensor& input, int64_t dim,
                                                         const std::optional<at::Tensor>& mask) {
  if (!needs_graph(input)) return call_forward_below_autograd<kind>(input, dim, mask);
  const variable_list outputs = ForwardNode<kind>::apply(input, dim, mask);
  return {outputs[0], outputs[1]};
}

// --- Python entry points ------------------------------------------------------

template <SoftmaxKind kind>
at::Tensor distribution(const at::Tensor& input, int64_t dim, std::optional<at::ScalarType> dtype,
                        const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<SoftmaxForwardSignature>(forward_name(kind));
  if (!dtype.has_value()) return std::get<0>(op.call(input, dim, mask));
  // As torch: the input is cast to `dtype` first, and an explicit dtype is
  // kept under autocast (the fp32_set_opt_dtype policy leaves it alone).
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return std::get<0>(op.call(input.to(*dtype), dim, mask));
}

at::Tensor logsumexp(const at::Tensor& input, int64_t dim, bool keepdim,
                     const std::optional<at::Tensor>& mask) {
  static const auto op = find_op<SoftmaxForwardSignature>(forward_name(SoftmaxKind::LogSumExp));
  at::Tensor out = std::get<0>(op.call(input, dim, mask));
  // The op has checked dim; a 0-d input keeps its 0-d result.
  if (keepdim && input.dim() > 0) out = out.unsqueeze(dim < 0 ? dim + input.dim() : dim);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("softmax", &forward_with_autograd<SoftmaxKind::Softmax>);
  m.impl("log_softmax", &forward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp", &forward_with_autograd<SoftmaxKind::LogSumExp>);
  m.impl("softmax_backward", &backward_without_mask<backward_with_autograd<SoftmaxKind::Softmax>>);
  m.impl("log_softmax_backward", backward_with_autograd<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_backward", backward_with_autograd<SoftmaxKind::LogSumExp>);
}

void bind_softmax(pybind11::module_& m) {
  namespace py = pybind11;
  // The GIL is released while the op runs, as torch's own bindings do.
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("softmax", &distribution<SoftmaxKind::Softmax>, release);
  m.def("log_softmax", &distribution<SoftmaxKind::LogSoftmax>, release);
  m.def("logsumexp", &logsumexp, release);
}

}  // namespace nanfree
