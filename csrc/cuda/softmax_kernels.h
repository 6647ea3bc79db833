// Launchers of the CUDA kernels of the softmax family (last dimension of a
// row-major [rows, cols] problem). Torch-free: plain C++ and CUDA runtime
// types, so csrc/cuda/softmax_kernels.cu compiles without ATen, and the ATen
// binding (csrc/cuda/softmax.cpp, host compiler) only sees these declarations.
//
// Every pointer is a device pointer to contiguous data. `stats` is [rows, 2]:
// each row's (max, log(sum(exp(x - max)))) as nanfree::row_stats gives them,
// float (double for double input); the logsumexp's `output` and `grad` hold one
// value per row. Element types: float, double, __half, __nv_bfloat16. Each
// launcher returns cudaGetLastError() after its launch, and cudaSuccess
// without launching when there is nothing to compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "nanfree/softmax_math.h"

namespace nanfree {
namespace gpu {

// Accumulation type: fp16/bf16/float accumulate in float, double in double.
template <typename scalar_t>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename scalar_t>
using acc_of_t = typename AccOf<scalar_t>::type;

// Forward of softmax / log_softmax (output [rows, cols]) or logsumexp (output
// [rows], the logsumexp cast to scalar_t). stats always receives the row's
// statistics; a row of zero columns is empty: max -inf, logsumexp -inf.
template <typename scalar_t>
cudaError_t softmax_forward(SoftmaxKind kind, const scalar_t* input, scalar_t* output,
                            acc_of_t<scalar_t>* stats, int64_t rows, int64_t cols, MaskView mask,
                            cudaStream_t stream);

// Backward of softmax (kind Softmax; the mask is ignored, as dropped entries
// have output 0) or log_softmax (kind LogSoftmax): grad, output and
// grad_input are [rows, cols].
template <typename scalar_t>
cudaError_t softmax_backward(SoftmaxKind kind, const scalar_t* grad, const scalar_t* output,
                             const acc_of_t<scalar_t>* stats, scalar_t* grad_input, int64_t rows,
                             int64_t cols, MaskView mask, cudaStream_t stream);

// Backward of logsumexp: grad is [rows], input and grad_input are [rows, cols].
template <typename scalar_t>
cudaError_t logsumexp_backward(const scalar_t* grad, const scalar_t* input,
                               const acc_of_t<scalar_t>* stats, scalar_t* grad_input, int64_t rows,
                               int64_t cols, MaskView mask, cudaStream_t stream);

// Defined and instantiated in softmax_kernels.cu for these element types.
#define NANFREE_SOFTMAX_LAUNCHERS(PREFIX, T)                                                   \
  PREFIX template cudaError_t softmax_forward<T>(SoftmaxKind, const T*, T*, acc_of_t<T>*,      \
                                                 int64_t, int64_t, MaskView, cudaStream_t);    \
  PREFIX template cudaError_t softmax_backward<T>(SoftmaxKind, const T*, const T*,             \
                                                  const acc_of_t<T>*, T*, int64_t, int64_t,    \
                                                  MaskView, cudaStream_t);                     \
  PREFIX template cudaError_t logsumexp_backward<T>(const T*, const T*, const acc_of_t<T>*,    \
                                                    T*, int64_t, int64_t, MaskView,            \
                                                    cudaStream_t);
NANFREE_SOFTMAX_LAUNCHERS(extern, float)
NANFREE_SOFTMAX_LAUNCHERS(extern, double)
NANFREE_SOFTMAX_LAUNCHERS(extern, __half)
NANFREE_SOFTMAX_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
