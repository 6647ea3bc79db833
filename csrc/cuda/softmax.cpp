// CUDA registration of the softmax family. The argument
// checks, output allocation, contiguity handling and mask view are shared with
// the CPU binding (csrc/common/softmax_op.h); the kernels live in the
// torch-free softmax_kernels.cu behind the launchers of softmax_kernels.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/softmax_op.h"
#include "cuda/aten_device_types.h"
#include "cuda/cuda_binding.h"
#include "cuda/softmax_kernels.h"

namespace nanfree {
namespace {

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& input, int64_t dim,
                                           const std::optional<at::Tensor>& mask) {
  // Not a CUDAGuard: with a CPU input (mixed devices) it would throw before
  // the checks of prepare_forward can name the argument.
  const c10::OptionalDeviceGuard device_guard(input.device());
  ForwardArgs args = prepare_forward(kind, input, dim, mask);
  if (args.stats.numel() == 0) return {args.output, args.stats};
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_softmax_forward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    NANFREE_CUDA_CHECK(gpu::softmax_forward(kind, device_ptr<scalar_t>(args.input),
                                            mutable_device_ptr<scalar_t>(args.output),
                                            args.stats.mutable_data_ptr<acc_t>(), args.shape,
                                            args.mask, stream));
  });
  return {args.output, args.stats};
}

template <SoftmaxKind kind>
at::Tensor backward(const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& stats,
                    int64_t dim, const std::optional<at::Tensor>& mask) {
  const c10::OptionalDeviceGuard device_guard(saved.device());  // as in forward
  BackwardArgs args = prepare_backward(kind, grad, saved, stats, dim, mask);
  if (args.grad_input.numel() == 0) return args.grad_input;
  const cudaStream_t stream = current_cuda_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.saved.scalar_type(),
                                  "nanfree_softmax_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    const acc_t* row_stats = args.stats.const_data_ptr<acc_t>();
    if constexpr (kind == SoftmaxKind::LogSumExp) {
      NANFREE_CUDA_CHECK(gpu::logsumexp_backward(
          device_ptr<scalar_t>(args.grad), device_ptr<scalar_t>(args.saved), row_stats,
          mutable_device_ptr<scalar_t>(args.grad_input), args.shape, args.mask, stream));
    } else {
      NANFREE_CUDA_CHECK(gpu::softmax_backward(
          kind, device_ptr<scalar_t>(args.grad), device_ptr<scalar_t>(args.saved), row_stats,
          mutable_device_ptr<scalar_t>(args.grad_input), args.shape, args.mask, stream));
    }
  });
  return args.grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, NANFREE_CUDA_DISPATCH_KEY, m) {
  m.impl("softmax", &forward<SoftmaxKind::Softmax>);
  m.impl("log_softmax", &forward<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp", &forward<SoftmaxKind::LogSumExp>);
  m.impl("softmax_backward", &backward_without_mask<&backward<SoftmaxKind::Softmax>>);
  m.impl("log_softmax_backward", &backward<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_backward", &backward<SoftmaxKind::LogSumExp>);
}

}  // namespace nanfree
