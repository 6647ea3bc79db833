// Launchers of the CUDA kernels of the elementwise family's binary ops (<op>
// and <op>_backward of registration.cpp): flat arrays of n elements in one
// layout, where an input may instead be one element read for every position
// (step 0: a scalar `other`, a 0-d exponent). The binding passes dense tensors
// of one layout and one-element tensors as they are, contiguous broadcast
// copies otherwise. Torch-free, as elementwise_kernels.h.
//
// out[i] = binary_element<op, order, partial>(grad[i], a[i * a_step],
// b[i * b_step]) of nanfree/elementwise_binary_math.h: the value (order 0;
// grad is not read and may be nullptr) or grad times that partial derivative
// (order 1: partial 0 or 1; order 2: 0, 1 or 2), saturated to scalar_t's
// range. Every pointer is a device pointer; a_step and b_step are 0 or 1.
// Returns cudaGetLastError() after the launch, cudaSuccess without launching
// when n == 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_types.h"
#include "nanfree/elementwise_binary_math.h"

namespace nanfree {
namespace gpu {

template <BinaryOp op, int order, int partial, typename scalar_t>
cudaError_t binary_elementwise(const scalar_t* grad, const scalar_t* a, int64_t a_step,
                               const scalar_t* b, int64_t b_step, int64_t n, scalar_t* out,
                               cudaStream_t stream);

// grad_a[i], grad_b[i] = binary_gradients<op> of the header at (grad[i], a[i * a_step], b[i * b_step]):
// both first-order gradients in one pass (<op>_gradients).
template <BinaryOp op, typename scalar_t>
cudaError_t binary_gradients_elementwise(const scalar_t* grad, const scalar_t* a,
                                         int64_t a_step, const scalar_t* b, int64_t b_step,
                                         int64_t n, scalar_t* grad_a, scalar_t* grad_b,
                                         cudaStream_t stream);

// Defined and instantiated in elementwise_binary_kernels.cu for every op, order,
// partial and element type.
#define NANFREE_BINARY_LAUNCHER(PREFIX, OP, ORDER, PARTIAL, T)                                 \
  PREFIX template cudaError_t binary_elementwise<OP, ORDER, PARTIAL, T>(                       \
      const T*, const T*, int64_t, const T*, int64_t, int64_t, T*, cudaStream_t);
#define NANFREE_BINARY_LAUNCHERS_OF(PREFIX, OP, T)                       \
  PREFIX template cudaError_t binary_gradients_elementwise<OP, T>(         \
      const T*, const T*, int64_t, const T*, int64_t, int64_t, T*, T*,     \
      cudaStream_t);                                                       \
  NANFREE_BINARY_LAUNCHER(PREFIX, OP, 0, 0, T)     \
  NANFREE_BINARY_LAUNCHER(PREFIX, OP, 1, 0, T)     \
  NANFREE_BINARY_LAUNCHER(PREFIX, OP, 1, 1, T)     \
  NANFREE_BINARY_LAUNCHER(PREFIX, OP, 2, 0, T)     \
  NANFREE_BINARY_LAUNCHER(PREFIX, OP, 2, 1, T)     \
  NANFREE_BINARY_LAUNCHER(PREFIX, OP, 2, 2, T)
#define NANFREE_BINARY_LAUNCHERS(PREFIX, T)                       \
  NANFREE_BINARY_LAUNCHERS_OF(PREFIX, BinaryOp::kPow, T)      \
  NANFREE_BINARY_LAUNCHERS_OF(PREFIX, BinaryOp::kAtan2, T)    \
  NANFREE_BINARY_LAUNCHERS_OF(PREFIX, BinaryOp::kDivNoNan, T) \
  NANFREE_BINARY_LAUNCHERS_OF(PREFIX, BinaryOp::kXlogy, T)    \
  NANFREE_BINARY_LAUNCHERS_OF(PREFIX, BinaryOp::kXlog1py, T)
NANFREE_BINARY_LAUNCHERS(extern, float)
NANFREE_BINARY_LAUNCHERS(extern, double)
NANFREE_BINARY_LAUNCHERS(extern, __half)
NANFREE_BINARY_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
