// CUDA registration of the elementwise family's binary ops (<op>,
// <op>_backward, <op>_gradients and <op>_out of registration.cpp). The checks, dtypes and broadcast shape
// are shared with the CPU binding (csrc/common/elementwise_op.h); the kernels
// live in the torch-free elementwise_binary_kernels.cu, which reads flat
// arrays. The output takes torch's layout for the operands (TensorIterator's,
// as on the CPU); the operands are read as csrc/cuda/operand_layout.h hands
// them over (one element in place, any other in the output's layout).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "common/elementwise_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/elementwise_binary_kernels.h"
#include "cuda/operand_layout.h"
#include "nanfree/elementwise_binary_math.h"

namespace nanfree {
namespace {

// The output of the operands' broadcast shape in torch's layout for them
// (TensorIterator's, as the CPU kernels' outputs and the fake kernels' have),
// allocated without running anything.
at::Tensor binary_output(std::initializer_list<const at::Tensor*> operands) {
  const at::Tensor undefined_output;  // allocated by the iterator (borrowed until build())
  at::TensorIteratorConfig config;
  config.add_output(undefined_output);
  for (const at::Tensor* t : operands) config.add_const_input(*t);
  return config.build().output();
}

template <BinaryOp op>
void run_binary(int64_t order, int64_t partial, const at::Tensor& grad, const at::Tensor& a,
                const at::Tensor& b, at::Tensor& out) {
  const cudaStream_t stream = current_cuda_stream();
  const auto [fa, a_step] = flat_operand(a, out);
  const auto [fb, b_step] = flat_operand(b, out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(),
                                  "nanfree_elementwise_binary_cuda", [&] {
    dispatch_binary_partial(order, partial, [&](auto order_c, auto partial_c) {
      constexpr int kOrder = decltype(order_c)::value;
      const cudaError_t status = gpu::binary_elementwise<op, kOrder, decltype(partial_c)::value>(
          kOrder > 0 ? device_ptr<scalar_t>(grad) : nullptr, device_ptr<scalar_t>(fa), a_step,
          device_ptr<scalar_t>(fb), b_step, out.numel(), mutable_device_ptr<scalar_t>(out), stream);
      NANFREE_CUDA_CHECK(status);
    });
  });
}

template <BinaryOp op>
struct CudaBinaryKernels {
  static at::Tensor forward(const at::Tensor& input, const at::Tensor& other) {
    const auto [a, b] = binary_operands(op, input, other);
    // Not a CUDAGuard: the emulated build runs this on CPU tensors. a's device, not
    // input's: a 0-d CPU input has joined other's device.
    const c10::OptionalDeviceGuard device_guard(a.device());
    binary_shape(op, a.sizes(), b.sizes());  // torch's words when they do not broadcast
    at::Tensor out = binary_output({&a, &b});
    run_binary<op>(0, 0, at::Tensor(), a, b, out);
    return out;
  }

  // Into `out` when it is dense (the operands are read in its layout); else
  // (or where it overlaps an operand partly) computed, then copied. An `out`
  // that overlaps itself is refused, as torch's out= does.
  static void forward_out(const at::Tensor& input, const at::Tensor& other, const at::Tensor& out) {
    const auto [a, b] = binary_operands(op, input, other);
    const c10::OptionalDeviceGuard device_guard(a.device());
    check_out(binary_op_name(op), out, binary_shape(op, a.sizes(), b.sizes()), a.scalar_type(), a);
    at::assert_no_internal_overlap(out);
    if (!out.is_non_overlapping_and_dense() || overlaps_partly(out, a) || overlaps_partly(out, b)) {
      out.copy_(forward(input, other));
      return;
    }
    at::Tensor written = out;
    run_binary<op>(0, 0, at::Tensor(), a, b, written);
  }

  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& input,
                             const at::Tensor& other, int64_t order, int64_t partial) {
    const c10::OptionalDeviceGuard device_guard(input.device());
    check_binary_backward(op, grad, input, other, order, partial);
    at::Tensor out = binary_output({&grad, &input, &other});
    // grad is read in out's layout (a copy when it is not dense in it).
    const at::Tensor g = in_layout_of(grad, out);
    run_binary<op>(order, partial, g, input, other, out);
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> gradients(const at::Tensor& grad, const at::Tensor& input,
                                                      const at::Tensor& other) {
    const c10::OptionalDeviceGuard device_guard(input.device());
    check_binary_gradient_operands(op, binary_gradients_name(op), grad, input, other);
    at::Tensor grad_a = binary_output({&grad, &input, &other});
    at::Tensor grad_b = at::empty_like(grad_a);
    const at::Tensor g = in_layout_of(grad, grad_a);
    const auto [fa, a_step] = flat_operand(input, grad_a);
    const auto [fb, b_step] = flat_operand(other, grad_a);
    const cudaStream_t stream = current_cuda_stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                    "nanfree_elementwise_binary_gradients_cuda", [&] {
      const cudaError_t status = gpu::binary_gradients_elementwise<op>(
          device_ptr<scalar_t>(g), device_ptr<scalar_t>(fa), a_step, device_ptr<scalar_t>(fb),
          b_step, grad_a.numel(), mutable_device_ptr<scalar_t>(grad_a),
          mutable_device_ptr<scalar_t>(grad_b), stream);
      NANFREE_CUDA_CHECK(status);
    });
    return {grad_a, grad_b};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  register_binary_kernels<CudaBinaryKernels>(m);
  register_binary_out_kernels<CudaBinaryKernels>(m);
}

}  // namespace nanfree
