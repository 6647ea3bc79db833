// Launchers of the CUDA kernels of the cosine family (normalize,
// cosine_similarity and the clamp of cos_sim_matrix): vectors along the last
// dimension of a contiguous tensor viewed as a row-major [rows, d] problem.
// Torch-free: plain C++ and CUDA runtime types, so the kernel file compiles
// without ATen, and the ATen binding (csrc/cuda/cosine.cpp, host compiler)
// only sees these declarations.
//
// Every pointer is a device pointer to contiguous data. The statistics are
// those of nanfree/cosine_math.h, in acc_of_t<scalar_t>
// (float; double for double input): normalize's are [rows, kNormalizeStats],
// (p, grad_factor); cosine_similarity's [rows, kCosineStats], (p, q, divisor,
// grad_factor of x1, then of x2). `eps` is the op's (positive): the kernels use
// effective_eps of it in the accumulation type. Element types: float, double,
// __half, __nv_bfloat16. Each launcher returns cudaGetLastError() after its
// launch, and cudaSuccess without launching when there is nothing to compute.
// d == 0 is a valid problem for the forwards: each vector is empty (largest
// magnitude 0), so the statistics are p = 1, q = 0, divisor = 0,
// grad_factor = 0 and each similarity 0, from the same functions of
// cosine_math.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_types.h"

namespace nanfree {
namespace gpu {

// y = x / max(norm, eps) per row (output [rows, d]) and the rows' (p, grad_factor).
template <typename scalar_t>
cudaError_t normalize_forward(const scalar_t* input, scalar_t* output, acc_of_t<scalar_t>* stats,
                              int64_t rows, int64_t d, double eps, cudaStream_t stream);

// The gradient of normalize: grad, output and grad_input are [rows, d],
// stats the forward's [rows, kNormalizeStats].
template <typename scalar_t>
cudaError_t normalize_backward(const scalar_t* grad, const scalar_t* output,
                               const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                               int64_t rows, int64_t d, cudaStream_t stream);

// The cosine similarity of rows of x1 and x2 ([rows, d] each): output [rows]
// and the stats [rows, kCosineStats].
template <typename scalar_t>
cudaError_t cosine_forward(const scalar_t* x1, const scalar_t* x2, scalar_t* output,
                           acc_of_t<scalar_t>* stats, int64_t rows, int64_t d, double eps,
                           cudaStream_t stream);

// The gradients of cosine_similarity: grad and output (the forward's
// similarities) are [rows]; x1, x2, grad_x1 and grad_x2 [rows, d]; stats the
// forward's [rows, kCosineStats].
template <typename scalar_t>
cudaError_t cosine_backward(const scalar_t* grad, const scalar_t* x1, const scalar_t* x2,
                            const scalar_t* output, const acc_of_t<scalar_t>* stats,
                            scalar_t* grad_x1, scalar_t* grad_x2, int64_t rows, int64_t d,
                            cudaStream_t stream);

// cosine_clamp of each of the n elements of `data`, in place (cos_sim_matrix's GEMM output).
template <typename scalar_t>
cudaError_t clamp_cosines(scalar_t* data, int64_t n, cudaStream_t stream);

// Defined and instantiated in cosine_kernels.cu for these element types.
#define NANFREE_COSINE_LAUNCHERS(PREFIX, T)                                                      \
  PREFIX template cudaError_t normalize_forward<T>(const T*, T*, acc_of_t<T>*, int64_t, int64_t, \
                                                   double, cudaStream_t);                        \
  PREFIX template cudaError_t normalize_backward<T>(const T*, const T*, const acc_of_t<T>*, T*,  \
                                                    int64_t, int64_t, cudaStream_t);             \
  PREFIX template cudaError_t cosine_forward<T>(const T*, const T*, T*, acc_of_t<T>*, int64_t,   \
                                                int64_t, double, cudaStream_t);                  \
  PREFIX template cudaError_t cosine_backward<T>(const T*, const T*, const T*, const T*,         \
                                                 const acc_of_t<T>*, T*, T*, int64_t, int64_t,   \
                                                 cudaStream_t);                                  \
  PREFIX template cudaError_t clamp_cosines<T>(T*, int64_t, cudaStream_t);
NANFREE_COSINE_LAUNCHERS(extern, float)
NANFREE_COSINE_LAUNCHERS(extern, double)
NANFREE_COSINE_LAUNCHERS(extern, __half)
NANFREE_COSINE_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
