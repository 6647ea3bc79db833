// CUDA registration of GeM pooling (the ops gem and gem_backward of
// registration.cpp). The argument checks, output allocation and
// [outer, n, inner] view are shared with the CPU binding
// (csrc/common/gem_op.h); the kernels live in the torch-free gem_kernels.cu
// behind the launchers of gem_kernels.h. A tensor p stays on the device (the
// kernels read and clamp it), so nothing here waits for the GPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/gem_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/gem_kernels.h"
#include "nanfree/gem_math.h"

namespace nanfree {
namespace {

// The tensor p (accumulation dtype, 0-d) as a device pointer, nullptr for a Python p.
template <typename acc_t>
const acc_t* p_pointer(const at::Tensor& p) {
  return p.defined() ? p.const_data_ptr<acc_t>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> gem(const at::Tensor& input, const std::optional<at::Tensor>& p,
                                       double p_value, double eps,
                                       const std::optional<at::Tensor>& mask) {
  // Not a CUDAGuard: with a CPU input (mixed devices) it would throw before
  // the checks of prepare_gem can name the argument.
  const c10::OptionalDeviceGuard device_guard(input.device());
  GemArgs args = prepare_gem(input, p, p_value, eps, mask);
  if (args.shape.reductions() == 0) return {args.output, args.stats};
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_gem_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::gem_forward(device_ptr<scalar_t>(args.input), args.shape,
                                        layout_mask_view(args.mask), p_pointer<acc_t>(args.p),
                                        args.p_value, args.eps,
                                        mutable_device_ptr<scalar_t>(args.output),
                                        args.stats.mutable_data_ptr<acc_t>(), stream));
  });
  return {args.output, args.stats};
}

std::tuple<at::Tensor, at::Tensor> gem_backward(const at::Tensor& grad, const at::Tensor& input,
                                                const std::optional<at::Tensor>& p,
                                                double p_value, const at::Tensor& stats,
                                                double eps, const std::optional<at::Tensor>& mask,
                                                bool p_grad) {
  const c10::OptionalDeviceGuard device_guard(input.device());  // as in gem
  GemBackwardArgs args = prepare_gem_backward(grad, input, p, p_value, stats, eps, mask, p_grad);
  // One term of p's gradient per reduction (gem_p_grad), written by the
  // kernels; all 0 when there is no entry (nothing is launched then).
  const int64_t reductions = args.shape.reductions();
  const at::Tensor terms =
      !args.p_grad ? at::Tensor()
      : args.shape.n > 0 ? at::empty({reductions}, args.grad_p.options())
                         : at::zeros({reductions}, args.grad_p.options());
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_gem_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    acc_t* p_grad_terms = args.p_grad ? terms.mutable_data_ptr<acc_t>() : nullptr;
    NANFREE_CUDA_CHECK(gpu::gem_backward(
        device_ptr<scalar_t>(args.grad), device_ptr<scalar_t>(args.input), args.shape,
        layout_mask_view(args.mask), p_pointer<acc_t>(args.p), args.p_value,
        args.stats.const_data_ptr<acc_t>(), args.eps,
        mutable_device_ptr<scalar_t>(args.grad_input), p_grad_terms, stream));
    if (args.p_grad) {
      // gem_p_grad_total: the terms (each within acc's range) summed in
      // float64 scaled by 2^-64, so that the sum cannot overflow (no inf - inf),
      // then clamped to acc's range and scaled back. NaN (a NaN term) stays.
      const double bound = static_cast<double>(nf_largest<acc_t>()) * kGemPGradScale;
      args.grad_p.copy_((terms.to(at::kDouble) * kGemPGradScale).sum().clamp(-bound, bound) /
                        kGemPGradScale);
    }
  });
  return {args.grad_input, args.grad_p};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  m.impl("gem", &gem);
  m.impl("gem_backward", &gem_backward);
}

}  // namespace nanfree
