// CUDA registration of the cosine family. The argument checks, output
// allocation and [rows, d] view are shared with the CPU binding
// (csrc/common/cosine_op.h); the kernels live in the torch-free
// cosine_kernels.cu behind the launchers of cosine_kernels.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>

#include "common/cosine_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/cosine_kernels.h"

namespace nanfree {
namespace {

std::tuple<at::Tensor, at::Tensor> normalize(const at::Tensor& input, double eps) {
  // Not a CUDAGuard: with a CPU input (mixed devices) it would throw before
  // the checks of prepare_* can name the argument.
  const c10::OptionalDeviceGuard device_guard(input.device());
  NormalizeArgs args = prepare_normalize(input, eps);
  if (args.shape.rows == 0) return {args.output, args.stats};
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_normalize_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::normalize_forward(device_ptr<scalar_t>(args.input),
                                              mutable_device_ptr<scalar_t>(args.output),
                                              args.stats.mutable_data_ptr<acc_t>(), args.shape.rows,
                                              args.shape.d, eps, stream));
  });
  return {args.output, args.stats};
}

at::Tensor normalize_backward(const at::Tensor& grad, const at::Tensor& output,
                              const at::Tensor& stats) {
  const c10::OptionalDeviceGuard device_guard(output.device());  // as in normalize
  NormalizeBackwardArgs args = prepare_normalize_backward(grad, output, stats);
  if (args.grad_input.numel() == 0) return args.grad_input;
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.output.scalar_type(),
                                  "nanfree_normalize_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::normalize_backward(
        device_ptr<scalar_t>(args.grad), device_ptr<scalar_t>(args.output),
        args.stats.const_data_ptr<acc_t>(), mutable_device_ptr<scalar_t>(args.grad_input),
        args.shape.rows, args.shape.d, stream));
  });
  return args.grad_input;
}

std::tuple<at::Tensor, at::Tensor> cosine_similarity(const at::Tensor& x1, const at::Tensor& x2,
                                                     double eps) {
  const c10::OptionalDeviceGuard device_guard(x1.device());  // as in normalize
  CosineArgs args = prepare_cosine(x1, x2, eps);
  if (args.shape.rows == 0) return {args.output, args.stats};
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.x1.scalar_type(),
                                  "nanfree_cosine_similarity_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::cosine_forward(device_ptr<scalar_t>(args.x1),
                                           device_ptr<scalar_t>(args.x2),
                                           mutable_device_ptr<scalar_t>(args.output),
                                           args.stats.mutable_data_ptr<acc_t>(), args.shape.rows,
                                           args.shape.d, eps, stream));
  });
  return {args.output, args.stats};
}

std::tuple<at::Tensor, at::Tensor> cosine_similarity_backward(const at::Tensor& grad,
                                                              const at::Tensor& x1,
                                                              const at::Tensor& x2,
                                                              const at::Tensor& output,
                                                              const at::Tensor& stats) {
  const c10::OptionalDeviceGuard device_guard(x1.device());  // as in normalize
  CosineBackwardArgs args = prepare_cosine_backward(grad, x1, x2, output, stats);
  if (args.grad_x1.numel() == 0) return {args.grad_x1, args.grad_x2};
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.x1.scalar_type(),
                                  "nanfree_cosine_similarity_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::cosine_backward(
        device_ptr<scalar_t>(args.grad), device_ptr<scalar_t>(args.x1),
        device_ptr<scalar_t>(args.x2), device_ptr<scalar_t>(args.output),
        args.stats.const_data_ptr<acc_t>(), mutable_device_ptr<scalar_t>(args.grad_x1),
        mutable_device_ptr<scalar_t>(args.grad_x2), args.shape.rows, args.shape.d, stream));
  });
  return {args.grad_x1, args.grad_x2};
}

// clamp(a @ b.T, -1, 1): cuBLAS through ATen's mm, then cosine_clamp in place.
at::Tensor cos_sim_matrix(const at::Tensor& a, const at::Tensor& b) {
  const c10::OptionalDeviceGuard device_guard(a.device());  // as in normalize
  check_cos_sim_matrix(a, b);
  at::Tensor out = at::mm(a, b.t());
  if (out.numel() == 0) return out;
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "nanfree_cos_sim_matrix_cuda", [&] {
    NANFREE_CUDA_CHECK(gpu::clamp_cosines(mutable_device_ptr<scalar_t>(out), out.numel(), stream));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  m.impl("normalize", &normalize);
  m.impl("normalize_backward", &normalize_backward);
  m.impl("cosine_similarity", &cosine_similarity);
  m.impl("cosine_similarity_backward", &cosine_similarity_backward);
  m.impl("cos_sim_matrix", &cos_sim_matrix);
}

}  // namespace nanfree
