// CUDA registration of the elementwise family (the unary ops <op>,
// <op>_backward and <op>_out of registration.cpp). The checks and dtypes are shared with
// the CPU binding (csrc/common/elementwise_op.h); the kernels live in the
// torch-free elementwise_kernels.cu behind elementwise_kernels.h, which read
// flat arrays: dense tensors of one layout are passed as they are (the output
// takes their strides, as torch's), others as contiguous copies.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common/elementwise_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/elementwise_kernels.h"
#include "nanfree/elementwise_math.h"

namespace nanfree {
namespace {

// Whether t and ref are dense with the same strides (one flat layout).
bool same_dense_layout(const at::Tensor& t, const at::Tensor& ref) {
  return t.is_non_overlapping_and_dense() && t.strides() == ref.strides();
}

template <UnaryOp op, int order>
void run_unary(const at::Tensor& grad, const at::Tensor& x, at::Tensor& out) {
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "nanfree_elementwise_unary_cuda", [&] {
    const cudaError_t status = gpu::unary_elementwise<op, order>(
        order > 0 ? device_ptr<scalar_t>(grad) : nullptr, device_ptr<scalar_t>(x), x.numel(),
        mutable_device_ptr<scalar_t>(out), stream);
    NANFREE_CUDA_CHECK(status);
  });
}

template <UnaryOp op>
struct CudaUnaryKernels {
  static at::Tensor forward(const at::Tensor& input) {
    // Not a CUDAGuard: the emulated build runs this on CPU tensors.
    const c10::OptionalDeviceGuard device_guard(input.device());
    at::Tensor x = unary_operand(op, input);
    if (!x.is_non_overlapping_and_dense()) x = x.contiguous();
    at::Tensor out = at::empty_like(x);  // x's strides (dense)
    run_unary<op, 0>(at::Tensor(), x, out);
    return out;
  }

  // Into `out` when it is dense in the (dense) input's layout, the kernel's
  // flat order; else (or where it overlaps the input partly) computed, then
  // copied. An `out` that overlaps itself is refused, as torch's out= does.
  static void forward_out(const at::Tensor& input, const at::Tensor& out) {
    const c10::OptionalDeviceGuard device_guard(input.device());
    at::Tensor x = unary_operand(op, input);
    check_out(unary_op_name(op), out, x.sizes(), x.scalar_type(), x);
    at::assert_no_internal_overlap(out);
    if (!x.is_non_overlapping_and_dense()) x = x.contiguous();
    if (!same_dense_layout(out, x) || overlaps_partly(out, x)) {
      out.copy_(forward(input));
      return;
    }
    at::Tensor written = out;
    run_unary<op, 0>(at::Tensor(), x, written);
  }

  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& input, int64_t order) {
    const c10::OptionalDeviceGuard device_guard(input.device());
    check_unary_backward(op, grad, input, order);
    at::Tensor x = input, g = grad;
    if (!(x.is_non_overlapping_and_dense() && same_dense_layout(g, x))) {
      x = x.contiguous();
      g = g.contiguous();
    }
    at::Tensor out = at::empty_like(x);
    if (order == 1) {
      run_unary<op, 1>(g, x, out);
    } else {
      run_unary<op, 2>(g, x, out);
    }
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  register_unary_kernels<CudaUnaryKernels>(m);
  register_unary_out_kernels<CudaUnaryKernels>(m);
}

}  // namespace nanfree
