// CUDA registration of the losses family (pointwise_loss, pointwise_loss_sum,
// pointwise_loss_backward, cross_entropy and cross_entropy_backward of
// registration.cpp). The argument
// checks are shared with the CPU binding (csrc/common/losses_op.h); the
// kernels live in the torch-free losses_kernels.cu behind the launchers of
// losses_kernels.h, which read flat operands. The output of pointwise_loss and
// pointwise_loss_backward has the input's layout (at::empty_like: dense, as
// torch's elementwise results and the CPU kernels'); the operands are read
// as csrc/cuda/operand_layout.h hands them over (an optional weight,
// pos_weight or grad of one element in place, any other in the output's
// layout). pointwise_loss_sum reads them against the input in its layout.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "common/losses_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/losses_kernels.h"
#include "cuda/operand_layout.h"
#include "nanfree/layout.h"
#include "nanfree/losses_math.h"

namespace nanfree {
namespace {

// An optional operand as the kernels read it against the output: absent
// (step 0, no tensor: read as 1), or as operand_layout.h's flat_operand.
struct FlatOperand {
  at::Tensor tensor;
  int64_t step;
};

FlatOperand optional_operand(const std::optional<at::Tensor>& t, const at::Tensor& out) {
  if (!t.has_value()) return {at::Tensor(), 0};
  auto [tensor, step] = flat_operand(*t, out);
  return {std::move(tensor), step};
}

template <typename scalar_t>
gpu::LossOperand<device_t<scalar_t>> loss_operand(const FlatOperand& op) {
  if (!op.tensor.defined()) return {nullptr, 0};
  return {device_ptr<scalar_t>(op.tensor), op.step};
}

at::Tensor pointwise_loss(const at::Tensor& input_arg, const at::Tensor& target_arg,
                          const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& pos_weight, int64_t kind, double alpha,
                          double gamma) {
  // Not a CUDAGuard: the emulated build runs this on CPU tensors, and with a
  // CPU operand (mixed devices) it would throw before the checks name it.
  const c10::OptionalDeviceGuard device_guard(input_arg.device());
  check_pointwise_loss(input_arg, target_arg, weight, pos_weight, kind, gamma);
  at::Tensor out = at::empty_like(input_arg);  // the input's layout, as torch's
  if (out.numel() == 0) return out;
  const at::Tensor input = in_layout_of(input_arg, out), target = in_layout_of(target_arg, out);
  const FlatOperand w = optional_operand(weight, out), pw = optional_operand(pos_weight, out);
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "nanfree_pointwise_loss_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::pointwise_loss_forward(
        static_cast<PointwiseLoss>(kind), device_ptr<scalar_t>(input), device_ptr<scalar_t>(target),
        loss_operand<scalar_t>(w), loss_operand<scalar_t>(pw), out.numel(),
        static_cast<acc_t>(alpha), static_cast<acc_t>(gamma), mutable_device_ptr<scalar_t>(out),
        stream));
  });
  return out;
}

at::Tensor pointwise_loss_sum(const at::Tensor& input_arg, const at::Tensor& target_arg,
                              const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& pos_weight, int64_t kind,
                              double alpha, double gamma) {
  const c10::OptionalDeviceGuard device_guard(input_arg.device());  // as in pointwise_loss
  check_pointwise_loss(input_arg, target_arg, weight, pos_weight, kind, gamma,
                       "pointwise_loss_sum");
  const auto acc = at::toOpMathType(input_arg.scalar_type());
  if (input_arg.numel() == 0) return at::zeros({}, input_arg.options().dtype(acc));
  // A dense input is summed in its own layout (the order of a sum does not
  // matter to its operands), any other made contiguous.
  const at::Tensor input = input_arg.is_non_overlapping_and_dense() ? input_arg : input_arg.contiguous();
  const at::Tensor target = in_layout_of(target_arg, input);
  const FlatOperand w = optional_operand(weight, input), pw = optional_operand(pos_weight, input);
  // One double per block of the kernel, added here.
  at::Tensor partials = at::empty({gpu::pointwise_loss_sum_partials(input.numel())},
                                  input.options().dtype(at::kDouble));
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "nanfree_pointwise_loss_sum_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::pointwise_loss_sum(
        static_cast<PointwiseLoss>(kind), device_ptr<scalar_t>(input), device_ptr<scalar_t>(target),
        loss_operand<scalar_t>(w), loss_operand<scalar_t>(pw), input.numel(),
        static_cast<acc_t>(alpha), static_cast<acc_t>(gamma), partials.mutable_data_ptr<double>(),
        stream));
  });
  return partials.sum().to(acc);
}

at::Tensor pointwise_loss_backward(const at::Tensor& grad, const at::Tensor& input_arg,
                                   const at::Tensor& target_arg,
                                   const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                   double alpha, double gamma, int64_t partial) {
  const c10::OptionalDeviceGuard device_guard(input_arg.device());  // as in pointwise_loss
  check_pointwise_loss_backward(grad, input_arg, target_arg, weight, pos_weight, kind, gamma,
                                partial);
  at::Tensor out = at::empty_like(input_arg);  // the input's layout, as torch's gradient
  if (out.numel() == 0) return out;
  const at::Tensor input = in_layout_of(input_arg, out), target = in_layout_of(target_arg, out);
  const FlatOperand g = optional_operand(grad, out);
  const FlatOperand w = optional_operand(weight, out), pw = optional_operand(pos_weight, out);
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "nanfree_pointwise_loss_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::pointwise_loss_backward(
        static_cast<PointwiseLoss>(kind), loss_operand<scalar_t>(g), device_ptr<scalar_t>(input),
        device_ptr<scalar_t>(target), loss_operand<scalar_t>(w), loss_operand<scalar_t>(pw),
        out.numel(), static_cast<acc_t>(alpha), static_cast<acc_t>(gamma),
        static_cast<int>(partial), mutable_device_ptr<scalar_t>(out), stream));
  });
  return out;
}

// The contiguous operands of cross_entropy and its backward (kept alive while
// the kernels read them).
struct CrossEntropyOperands {
  at::Tensor input, target, weight;
};

CrossEntropyOperands cross_entropy_operands(const at::Tensor& input, const at::Tensor& target,
                                            const std::optional<at::Tensor>& weight) {
  return {input.contiguous(), target.contiguous(),
          weight.has_value() ? weight->contiguous() : at::Tensor()};
}

// The mask as a view of the [outer, C, inner] problem itself (MaskView of
// layout.h: sizes {1, outer, inner}, read through its three strides).
MaskView cross_entropy_mask(const std::optional<at::Tensor>& mask) {
  MaskView view{nullptr, {1, 1, 1}, {0, 0, 0}, 0};
  if (!mask.has_value()) return view;
  view.data = mask->const_data_ptr<bool>();
  view.sizes[1] = mask->size(0);
  view.sizes[2] = mask->size(2);
  view.strides[1] = mask->stride(0);
  view.strides[2] = mask->stride(2);
  view.col_stride = mask->stride(1);
  return view;
}

template <typename scalar_t>
gpu::CrossEntropyProblem<device_t<scalar_t>> cross_entropy_problem(
    const CrossEntropyOperands& t, const std::optional<at::Tensor>& mask, int64_t ignore_index,
    double label_smoothing) {
  using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
  const bool indices = t.target.scalar_type() == at::kLong;
  gpu::CrossEntropyProblem<device_t<scalar_t>> p{};
  p.input = device_ptr<scalar_t>(t.input);
  p.index = indices ? t.target.const_data_ptr<int64_t>() : nullptr;
  p.prob = indices ? nullptr : device_ptr<scalar_t>(t.target);
  p.weight = t.weight.defined() ? device_ptr<scalar_t>(t.weight) : nullptr;
  p.mask = cross_entropy_mask(mask);
  p.layout = ReductionLayout{t.input.size(0), t.input.size(1), t.input.size(2)};
  p.ignore_index = ignore_index;
  p.eps = static_cast<acc_t>(label_smoothing);
  return p;
}

std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor& input,
                                                 const at::Tensor& target,
                                                 const std::optional<at::Tensor>& weight,
                                                 const std::optional<at::Tensor>& mask,
                                                 int64_t ignore_index, double label_smoothing) {
  const c10::OptionalDeviceGuard device_guard(input.device());  // as in pointwise_loss
  check_cross_entropy(input, target, weight, mask, label_smoothing);
  const int64_t outer = input.size(0), inner = input.size(2);
  const auto acc_options = input.options().dtype(acc_dtype(input.scalar_type()));
  at::Tensor loss = at::empty({outer, inner}, acc_options);
  at::Tensor stats = at::empty({outer, inner, kCrossEntropyStats}, acc_options);
  if (loss.numel() == 0) return {loss, stats};
  const CrossEntropyOperands operands = cross_entropy_operands(input, target, weight);
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "nanfree_cross_entropy_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::cross_entropy_forward(
        cross_entropy_problem<scalar_t>(operands, mask, ignore_index, label_smoothing),
        loss.mutable_data_ptr<acc_t>(), stats.mutable_data_ptr<acc_t>(), stream));
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_backward(
    const at::Tensor& grad_arg, const at::Tensor& input, const at::Tensor& target,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& mask,
    int64_t ignore_index, double label_smoothing, const at::Tensor& stats_arg, bool target_grad) {
  const c10::OptionalDeviceGuard device_guard(input.device());  // as in pointwise_loss
  check_cross_entropy_backward(grad_arg, input, target, weight, mask, label_smoothing, stats_arg,
                               target_grad);
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  at::Tensor grad_target = target_grad ? at::empty(target.sizes(), target.options())
                                       : at::empty({0}, input.options());
  if (grad_input.numel() == 0) return {grad_input, grad_target};
  const CrossEntropyOperands operands = cross_entropy_operands(input, target, weight);
  const at::Tensor grad = grad_arg.contiguous(), stats = stats_arg.contiguous();
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "nanfree_cross_entropy_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::cross_entropy_backward(
        cross_entropy_problem<scalar_t>(operands, mask, ignore_index, label_smoothing),
        grad.const_data_ptr<acc_t>(), stats.const_data_ptr<acc_t>(),
        mutable_device_ptr<scalar_t>(grad_input),
        target_grad ? mutable_device_ptr<scalar_t>(grad_target) : nullptr, stream));
  });
  return {grad_input, grad_target};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  m.impl("pointwise_loss", &pointwise_loss);
  m.impl("pointwise_loss_sum", &pointwise_loss_sum);
  m.impl("pointwise_loss_backward", &pointwise_loss_backward);
  m.impl("cross_entropy", &cross_entropy);
  m.impl("cross_entropy_backward", &cross_entropy_backward);
}

}  // namespace nanfree
