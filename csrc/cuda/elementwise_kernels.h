// Launchers of the CUDA kernels of the elementwise family (the unary ops
// <op> and <op>_backward of registration.cpp): flat arrays of n elements that
// share one layout (the binding passes dense tensors of equal strides, or
// contiguous copies). Torch-free: plain C++ and CUDA runtime types, so the
// kernel file compiles without ATen, and the ATen binding
// (csrc/cuda/elementwise.cpp, host compiler) only sees these declarations.
//
// out[i] = unary_element<op, order>(grad[i], x[i]) of nanfree/elementwise_math.h:
// the value (order 0; grad is not read and may be nullptr) or grad times the
// order-th derivative (1 or 2), saturated to scalar_t's range. Every pointer
// is a device pointer. Element types: float, double, __half, __nv_bfloat16.
// Returns cudaGetLastError() after the launch, cudaSuccess without launching
// when n == 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_types.h"
#include "nanfree/elementwise_math.h"

namespace nanfree {
namespace gpu {

template <UnaryOp op, int order, typename scalar_t>
cudaError_t unary_elementwise(const scalar_t* grad, const scalar_t* x, int64_t n, scalar_t* out,
                              cudaStream_t stream);

// Defined and instantiated in elementwise_kernels.cu for every op, order and element type.
#define NANFREE_UNARY_LAUNCHER(PREFIX, OP, ORDER, T)                                        \
  PREFIX template cudaError_t unary_elementwise<OP, ORDER, T>(const T*, const T*, int64_t, T*, \
                                                              cudaStream_t);
#define NANFREE_UNARY_LAUNCHERS_OF(PREFIX, OP, T) \
  NANFREE_UNARY_LAUNCHER(PREFIX, OP, 0, T)        \
  NANFREE_UNARY_LAUNCHER(PREFIX, OP, 1, T)        \
  NANFREE_UNARY_LAUNCHER(PREFIX, OP, 2, T)
#define NANFREE_UNARY_LAUNCHERS(PREFIX, T)                    \
  NANFREE_UNARY_LAUNCHERS_OF(PREFIX, UnaryOp::kSqrt, T)   \
  NANFREE_UNARY_LAUNCHERS_OF(PREFIX, UnaryOp::kLog, T)    \
  NANFREE_UNARY_LAUNCHERS_OF(PREFIX, UnaryOp::kLog1p, T)  \
  NANFREE_UNARY_LAUNCHERS_OF(PREFIX, UnaryOp::kAcos, T)   \
  NANFREE_UNARY_LAUNCHERS_OF(PREFIX, UnaryOp::kAsin, T)
NANFREE_UNARY_LAUNCHERS(extern, float)
NANFREE_UNARY_LAUNCHERS(extern, double)
NANFREE_UNARY_LAUNCHERS(extern, __half)
NANFREE_UNARY_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
