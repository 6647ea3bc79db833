// CUDA registration of the softmax family (last dimension). The argument
// checks, output allocation, contiguity handling and mask view are those of
// csrc/cpu/softmax.cpp (the reference behaviour); the kernels live in the
// torch-free softmax_kernels.cu behind the launchers of softmax_kernels.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "common/softmax_op.h"
#include "cuda/softmax_kernels.h"

namespace nanfree {
namespace {

// ATen element type -> the CUDA type the launchers take (same bits).
template <typename scalar_t>
struct DeviceType {
  using type = scalar_t;
};
template <>
struct DeviceType<at::Half> {
  using type = __half;
};
template <>
struct DeviceType<at::BFloat16> {
  using type = __nv_bfloat16;
};
static_assert(sizeof(at::Half) == sizeof(__half) && alignof(at::Half) == alignof(__half));
static_assert(sizeof(at::BFloat16) == sizeof(__nv_bfloat16) &&
              alignof(at::BFloat16) == alignof(__nv_bfloat16));

template <typename scalar_t>
using device_t = typename DeviceType<scalar_t>::type;

template <typename scalar_t>
const device_t<scalar_t>* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const device_t<scalar_t>*>(t.const_data_ptr<scalar_t>());
}

template <typename scalar_t>
device_t<scalar_t>* mutable_device_ptr(at::Tensor& t) {
  return reinterpret_cast<device_t<scalar_t>*>(t.mutable_data_ptr<scalar_t>());
}

template <gpu::SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward(const char* op, const at::Tensor& input_,
                                           const std::optional<at::Tensor>& mask) {
  check_float_input(op, "input", input_);
  if (mask.has_value()) check_mask(op, input_, *mask);
  const c10::cuda::CUDAGuard device_guard(input_.device());
  const at::Tensor input = input_.contiguous();
  at::Tensor stats =
      at::empty(stats_shape(input), input.options().dtype(acc_dtype(input.scalar_type())));
  at::Tensor output = kind == gpu::SoftmaxKind::LogSumExp
                          ? at::empty(row_shape(input), input.options())
                          : at::empty(input.sizes(), input.options());
  at::Tensor mask_storage;
  const MaskView view = make_mask_view(mask, mask_storage);
  if (stats.numel() == 0) return {output, stats};
  const RowsCols shape = rows_cols(input);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "nanfree_softmax_forward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    C10_CUDA_CHECK(gpu::softmax_forward(kind, device_ptr<scalar_t>(input),
                                        mutable_device_ptr<scalar_t>(output),
                                        stats.mutable_data_ptr<acc_t>(), shape.rows, shape.cols,
                                        view, stream));
  });
  return {output, stats};
}

template <gpu::SoftmaxKind kind>
at::Tensor backward(const char* op, const at::Tensor& grad_, const at::Tensor& saved_,
                    const at::Tensor& stats_, const std::optional<at::Tensor>& mask) {
  check_float_input(op, "grad_output", grad_);
  check_float_input(op, "saved", saved_);
  TORCH_CHECK(grad_.scalar_type() == saved_.scalar_type(), "nanfree.", op,
              ": `grad_output` dtype ", grad_.scalar_type(), " differs from the saved tensor's ",
              saved_.scalar_type());
  const auto expected_grad = kind == gpu::SoftmaxKind::LogSumExp ? row_shape(saved_)
                                                                 : saved_.sizes().vec();
  TORCH_CHECK(grad_.sizes().vec() == expected_grad, "nanfree.", op, ": `grad_output` has shape ",
              grad_.sizes(), ", expected ", at::IntArrayRef(expected_grad));
  TORCH_CHECK(stats_.sizes().vec() == stats_shape(saved_) &&
                  stats_.scalar_type() == acc_dtype(saved_.scalar_type()),
              "nanfree.", op, ": `stats` must be the forward's saved row statistics");
  check_same_device(op, "grad_output", saved_, grad_);
  check_same_device(op, "stats", saved_, stats_);
  if (mask.has_value()) check_mask(op, saved_, *mask);
  const c10::cuda::CUDAGuard device_guard(saved_.device());
  const at::Tensor grad = grad_.contiguous(), saved = saved_.contiguous(),
                   stats = stats_.contiguous();
  at::Tensor grad_input = at::empty(saved.sizes(), saved.options());
  at::Tensor mask_storage;
  const MaskView view = make_mask_view(mask, mask_storage);
  if (grad_input.numel() == 0) return grad_input;
  const RowsCols shape = rows_cols(saved);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, saved.scalar_type(),
                                  "nanfree_softmax_backward_cuda", [&] {
    using acc_t = gpu::acc_of_t<device_t<scalar_t>>;
    if constexpr (kind == gpu::SoftmaxKind::LogSumExp) {
      C10_CUDA_CHECK(gpu::logsumexp_backward(
          device_ptr<scalar_t>(grad), device_ptr<scalar_t>(saved), stats.const_data_ptr<acc_t>(),
          mutable_device_ptr<scalar_t>(grad_input), shape.rows, shape.cols, view, stream));
    } else {
      C10_CUDA_CHECK(gpu::softmax_backward(
          kind, device_ptr<scalar_t>(grad), device_ptr<scalar_t>(saved),
          stats.const_data_ptr<acc_t>(), mutable_device_ptr<scalar_t>(grad_input), shape.rows,
          shape.cols, view, stream));
    }
  });
  return grad_input;
}

std::tuple<at::Tensor, at::Tensor> softmax_lastdim(const at::Tensor& input,
                                                   const std::optional<at::Tensor>& mask) {
  return forward<gpu::SoftmaxKind::Softmax>("softmax", input, mask);
}
std::tuple<at::Tensor, at::Tensor> log_softmax_lastdim(const at::Tensor& input,
                                                       const std::optional<at::Tensor>& mask) {
  return forward<gpu::SoftmaxKind::LogSoftmax>("log_softmax", input, mask);
}
std::tuple<at::Tensor, at::Tensor> logsumexp_lastdim(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& mask) {
  return forward<gpu::SoftmaxKind::LogSumExp>("logsumexp", input, mask);
}
at::Tensor softmax_lastdim_backward(const at::Tensor& grad, const at::Tensor& output,
                                    const at::Tensor& stats) {
  return backward<gpu::SoftmaxKind::Softmax>("softmax_backward", grad, output, stats,
                                             std::nullopt);
}
at::Tensor log_softmax_lastdim_backward(const at::Tensor& grad, const at::Tensor& output,
                                        const at::Tensor& stats,
                                        const std::optional<at::Tensor>& mask) {
  return backward<gpu::SoftmaxKind::LogSoftmax>("log_softmax_backward", grad, output, stats,
                                                mask);
}
at::Tensor logsumexp_lastdim_backward(const at::Tensor& grad, const at::Tensor& input,
                                      const at::Tensor& stats,
                                      const std::optional<at::Tensor>& mask) {
  return backward<gpu::SoftmaxKind::LogSumExp>("logsumexp_backward", grad, input, stats, mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CUDA, m) {
  m.impl("softmax_lastdim", &softmax_lastdim);
  m.impl("log_softmax_lastdim", &log_softmax_lastdim);
  m.impl("logsumexp_lastdim", &logsumexp_lastdim);
  m.impl("softmax_lastdim_backward", &softmax_lastdim_backward);
  m.impl("log_softmax_lastdim_backward", &log_softmax_lastdim_backward);
  m.impl("logsumexp_lastdim_backward", &logsumexp_lastdim_backward);
}

}  // namespace nanfree
