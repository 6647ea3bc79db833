// Launchers of the CUDA kernels of GeM pooling (the ops gem and gem_backward
// of registration.cpp): a contiguous input viewed as [outer, n, inner],
// reduced over n (entry j of reduction (o, i) at o * n * inner + j * inner + i;
// reduction (o, i) is number o * inner + i of the output [outer, inner] and of
// the statistics [outer, inner, 3]). Torch-free: plain C++ and CUDA runtime
// types, so the kernel file compiles without ATen, and the ATen binding
// (csrc/cuda/gem.cpp, host compiler) only sees these declarations.
//
// Every pointer is a device pointer; input, output, stats, grad, grad_input
// are contiguous. The statistics are those of nanfree/gem_math.h, (m, mean,
// count) per reduction, in acc_of_t<scalar_t> (float; double for double
// input). p is either a tensor (`p_tensor`: one acc_of_t<scalar_t> value, not
// yet clamped: the kernels clamp it with gem_clamp_p, so the host never reads
// it) or, when p_tensor is nullptr, the Python number `p_value` (finite, > 0,
// used as is). `eps` is the op's: the kernels raise it with effective_eps
// in the accumulation type. Element types: float, double, __half,
// __nv_bfloat16. Each launcher returns cudaGetLastError() after its last
// launch, and cudaSuccess without launching when there is nothing to compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_types.h"
#include "nanfree/layout.h"

namespace nanfree {
namespace gpu {

// output [outer, inner] (the input's type) and stats [outer, inner, 3].
// n == 0 is valid: every reduction is empty (output 0, stats (0, 0, 0)).
template <typename scalar_t>
cudaError_t gem_forward(const scalar_t* input, ReductionLayout layout, MaskView mask,
                        const acc_of_t<scalar_t>* p_tensor, double p_value, double eps,
                        scalar_t* output, acc_of_t<scalar_t>* stats, cudaStream_t stream);

// grad_input (the input's shape and type) from grad [outer, inner] and the
// forward's stats; masked entries get 0. When p_grad_terms is not nullptr
// (then p_tensor is given), also p_grad_terms[r] = reduction r's d gem / d p
// (gem_p_grad) for each of the outer * inner reductions; p's gradient is
// their sum, which the caller takes (gem_p_grad_total). With n == 0 nothing
// is launched and p_grad_terms is left as it is (every term is 0 then).
template <typename scalar_t>
cudaError_t gem_backward(const scalar_t* grad, const scalar_t* input, ReductionLayout layout,
                         MaskView mask, const acc_of_t<scalar_t>* p_tensor, double p_value,
                         const acc_of_t<scalar_t>* stats, double eps, scalar_t* grad_input,
                         acc_of_t<scalar_t>* p_grad_terms, cudaStream_t stream);

// Defined and instantiated in gem_kernels.cu for these element types.
#define NANFREE_GEM_LAUNCHERS(PREFIX, T)                                                          \
  PREFIX template cudaError_t gem_forward<T>(const T*, ReductionLayout, MaskView,                    \
                                             const acc_of_t<T>*, double, double, T*, acc_of_t<T>*, \
                                             cudaStream_t);                                       \
  PREFIX template cudaError_t gem_backward<T>(const T*, const T*, ReductionLayout, MaskView,         \
                                              const acc_of_t<T>*, double, const acc_of_t<T>*,     \
                                              double, T*, acc_of_t<T>*, cudaStream_t);
NANFREE_GEM_LAUNCHERS(extern, float)
NANFREE_GEM_LAUNCHERS(extern, double)
NANFREE_GEM_LAUNCHERS(extern, __half)
NANFREE_GEM_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
