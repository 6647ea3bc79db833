// Launchers of the CUDA kernels of the losses family (pointwise_loss,
// pointwise_loss_backward, cross_entropy and cross_entropy_backward of
// registration.cpp; every rule in nanfree/losses_math.h). Torch-free: plain
// C++ and CUDA runtime types, so the kernel file compiles without ATen, and
// the ATen binding (csrc/cuda/losses.cpp, host compiler) only sees these
// declarations.
//
// Every pointer is a device pointer. Element types: float, double, __half,
// __nv_bfloat16; values are computed in acc_of_t<scalar_t> (float; double for
// double). Each launcher returns cudaGetLastError() after its launch, and
// cudaSuccess without launching when there is nothing to compute.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/device_types.h"
#include "nanfree/layout.h"
#include "nanfree/losses_math.h"

namespace nanfree {
namespace gpu {

// One operand of a pointwise loss besides input and target: `data` nullptr
// (absent: read as 1), or `step` 0 (one element read for every position), or
// step 1 (n contiguous elements).
template <typename scalar_t>
struct LossOperand {
  const scalar_t* data;
  int64_t step;
};

// out[j] = pointwise_loss_value<kind>(input[j], target[j], weight, pos_weight)
// over n contiguous elements (kind: PointwiseLoss; alpha and gamma are read by
// SigmoidFocal only).
template <typename scalar_t>
cudaError_t pointwise_loss_forward(PointwiseLoss kind, const scalar_t* input,
                                   const scalar_t* target, LossOperand<scalar_t> weight,
                                   LossOperand<scalar_t> pos_weight, int64_t n,
                                   acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                                   scalar_t* out, cudaStream_t stream);

// The number of partial sums pointwise_loss_sum writes for n elements (one
// per block of its launch, at least 1).
int64_t pointwise_loss_sum_partials(int64_t n);

// partials[b] = the sum, in double, of pointwise_loss_value<kind> over the
// elements block b visits; partials holds pointwise_loss_sum_partials(n)
// entries, whose sum (in any order) is the loss summed over n elements.
template <typename scalar_t>
cudaError_t pointwise_loss_sum(PointwiseLoss kind, const scalar_t* input, const scalar_t* target,
                               LossOperand<scalar_t> weight, LossOperand<scalar_t> pos_weight,
                               int64_t n, acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                               double* partials, cudaStream_t stream);

// out[j] = loss_chain_rule(grad[j], pointwise_loss_grad<kind>(..., partial),
// scalar_t's largest finite value): partial 0 is d / d input, 1 d / d target.
template <typename scalar_t>
cudaError_t pointwise_loss_backward(PointwiseLoss kind, LossOperand<scalar_t> grad,
                                    const scalar_t* input, const scalar_t* target,
                                    LossOperand<scalar_t> weight,
                                    LossOperand<scalar_t> pos_weight, int64_t n,
                                    acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                                    int partial, scalar_t* out, cudaStream_t stream);

// The operands of cross_entropy: logits `input` [outer, C, inner] contiguous
// (layout.n == C); exactly one of `index` (int64 class indices [outer, inner],
// contiguous) and `prob` (probabilities of the input's shape, contiguous);
// `weight` [C] or nullptr; `mask` a view of the [outer, C, inner] problem
// itself (sizes {1, outer, inner}, strides {0, outer stride, inner stride},
// col_stride its C stride; strides may be 0), data nullptr without a mask.
template <typename scalar_t>
struct CrossEntropyProblem {
  const scalar_t* input;
  const int64_t* index;
  const scalar_t* prob;
  const scalar_t* weight;
  MaskView mask;
  ReductionLayout layout;
  int64_t ignore_index;
  acc_of_t<scalar_t> eps;  // label smoothing
};

// loss [outer, inner] and stats [outer, inner, kCrossEntropyStats] (the
// CrossEntropyStats of losses_math.h), both acc_of_t<scalar_t>, contiguous.
template <typename scalar_t>
cudaError_t cross_entropy_forward(CrossEntropyProblem<scalar_t> problem, acc_of_t<scalar_t>* loss,
                                  acc_of_t<scalar_t>* stats, cudaStream_t stream);

// grad_input (the input's shape and type, contiguous) from grad [outer,
// inner] and the forward's stats (both acc_of_t<scalar_t>); grad_target (of
// the probability target's shape and type) too when not nullptr.
template <typename scalar_t>
cudaError_t cross_entropy_backward(CrossEntropyProblem<scalar_t> problem,
                                   const acc_of_t<scalar_t>* grad,
                                   const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                                   scalar_t* grad_target, cudaStream_t stream);

// Defined and instantiated in losses_kernels.cu for these element types.
#define NANFREE_LOSSES_LAUNCHERS(PREFIX, T)                                                     \
  PREFIX template cudaError_t pointwise_loss_forward<T>(                                        \
      PointwiseLoss, const T*, const T*, LossOperand<T>, LossOperand<T>, int64_t, acc_of_t<T>,  \
      acc_of_t<T>, T*, cudaStream_t);                                                           \
  PREFIX template cudaError_t pointwise_loss_sum<T>(                                            \
      PointwiseLoss, const T*, const T*, LossOperand<T>, LossOperand<T>, int64_t, acc_of_t<T>,  \
      acc_of_t<T>, double*, cudaStream_t);                                                      \
  PREFIX template cudaError_t pointwise_loss_backward<T>(                                       \
      PointwiseLoss, LossOperand<T>, const T*, const T*, LossOperand<T>, LossOperand<T>,        \
      int64_t, acc_of_t<T>, acc_of_t<T>, int, T*, cudaStream_t);                                \
  PREFIX template cudaError_t cross_entropy_forward<T>(CrossEntropyProblem<T>, acc_of_t<T>*,    \
                                                       acc_of_t<T>*, cudaStream_t);             \
  PREFIX template cudaError_t cross_entropy_backward<T>(                                        \
      CrossEntropyProblem<T>, const acc_of_t<T>*, const acc_of_t<T>*, T*, T*, cudaStream_t);
NANFREE_LOSSES_LAUNCHERS(extern, float)
NANFREE_LOSSES_LAUNCHERS(extern, double)
NANFREE_LOSSES_LAUNCHERS(extern, __half)
NANFREE_LOSSES_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
