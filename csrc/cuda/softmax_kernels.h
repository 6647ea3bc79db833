// Launchers of the CUDA kernels of the softmax family (one dimension of a
// contiguous tensor viewed as [outer, cols, inner]: ReductionLayout in
// nanfree/softmax_math.h; inner == 1 is the last dimension, inner > 1 is
// reduced in place by the strided kernels of softmax_strided_kernels.cu).
// Torch-free: plain C++ and CUDA runtime types, so the kernel files compile
// without ATen, and the ATen binding (csrc/cuda/softmax.cpp, host compiler)
// only sees these declarations.
//
// Every pointer is a device pointer to contiguous data. `stats` is
// [outer, 2, inner] (stats_offset): each row's (max, log(sum(exp(x - max)))) as
// nanfree::row_stats gives them, float (double for double input); the
// logsumexp's `output` and `grad` hold one value per row, [outer, inner].
// Element types: float, double, __half, __nv_bfloat16. Each launcher returns
// cudaGetLastError() after its launch, and cudaSuccess without launching when
// there is nothing to compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_types.h"
#include "nanfree/softmax_math.h"

namespace nanfree {
namespace gpu {

// Forward of softmax / log_softmax (output of the input's shape) or logsumexp
// (output [outer, inner], the logsumexp cast to scalar_t). stats always
// receives the rows' statistics; a row of zero columns is empty: max -inf,
// logsumexp -inf.
template <typename scalar_t>
cudaError_t softmax_forward(SoftmaxKind kind, const scalar_t* input, scalar_t* output,
                            acc_of_t<scalar_t>* stats, ReductionLayout shape, MaskView mask,
                            cudaStream_t stream);

// Backward of softmax (kind Softmax; the mask is ignored, as dropped entries
// have output 0) or log_softmax (kind LogSoftmax): grad, output and
// grad_input have the input's shape.
template <typename scalar_t>
cudaError_t softmax_backward(SoftmaxKind kind, const scalar_t* grad, const scalar_t* output,
                             const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                             ReductionLayout shape, MaskView mask, cudaStream_t stream);

// Backward of logsumexp: grad is [outer, inner], input and grad_input have the
// input's shape.
template <typename scalar_t>
cudaError_t logsumexp_backward(const scalar_t* grad, const scalar_t* input,
                               const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                               ReductionLayout shape, MaskView mask, cudaStream_t stream);

// Defined and instantiated in softmax_kernels.cu for these element types.
#define NANFREE_SOFTMAX_LAUNCHERS(PREFIX, T)                                                    \
  PREFIX template cudaError_t softmax_forward<T>(SoftmaxKind, const T*, T*, acc_of_t<T>*,       \
                                                 ReductionLayout, MaskView, cudaStream_t);         \
  PREFIX template cudaError_t softmax_backward<T>(SoftmaxKind, const T*, const T*,              \
                                                  const acc_of_t<T>*, T*, ReductionLayout,         \
                                                  MaskView, cudaStream_t);                      \
  PREFIX template cudaError_t logsumexp_backward<T>(const T*, const T*, const acc_of_t<T>*, T*, \
                                                    ReductionLayout, MaskView, cudaStream_t);
NANFREE_SOFTMAX_LAUNCHERS(extern, float)
NANFREE_SOFTMAX_LAUNCHERS(extern, double)
NANFREE_SOFTMAX_LAUNCHERS(extern, __half)
NANFREE_SOFTMAX_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
