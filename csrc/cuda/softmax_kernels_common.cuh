// Device helpers shared by the two files of CUDA kernels of the softmax
// family, softmax_kernels.cu (reduction over the last dimension, inner == 1)
// and softmax_strided_kernels.cu (over another dimension, in place,
// inner > 1), and the launchers of the latter, which the launchers of
// softmax_kernels.h call when shape.inner > 1. Torch-free; included by nvcc
// only. Every special-value rule comes from nanfree/softmax_math.h; the
// generic device helpers (launch limits, element conversion, vector access,
// launch planning) are in device_common.cuh, shared with the other families.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/softmax_kernels.h"
#include "nanfree/numerics.h"
#include "nanfree/softmax_math.h"

namespace nanfree {
namespace gpu {
namespace detail {

constexpr int kSoftmax = static_cast<int>(SoftmaxKind::Softmax);
constexpr int kLogSumExp = static_cast<int>(SoftmaxKind::LogSumExp);

// Operands a thread caches (max_cached_iters): x in the forward, g and y in the backward.
constexpr int kForwardOperands = 1;
constexpr int kBackwardOperands = 2;

// keep[i] for columns col .. col + N - 1 of a mask row (nullptr: no mask).
template <int N>
__device__ __forceinline__ void load_keep(const bool* mask_row, int64_t col, int64_t col_stride,
                                          bool (&keep)[N]) {
  if (mask_row == nullptr) {
#pragma unroll
    for (int i = 0; i < N; ++i) keep[i] = true;
    return;
  }
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(mask_row);
  if (col_stride == 0) {  // broadcast over the columns
    const bool k = bytes[0] != 0;
#pragma unroll
    for (int i = 0; i < N; ++i) keep[i] = k;
    return;
  }
  if constexpr (N > 1) {
    const unsigned char* p = bytes + col;
    if (col_stride == 1 && reinterpret_cast<uintptr_t>(p) % N == 0) {
      const Pack<unsigned char, N> pack = *reinterpret_cast<const Pack<unsigned char, N>*>(p);
#pragma unroll
      for (int i = 0; i < N; ++i) keep[i] = pack.v[i] != 0;
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) keep[i] = bytes[(col + i) * col_stride] != 0;
}

// ---------------------------------------------------------------------------
// Forward helpers.

// max(a, b) where b may be NaN: a NaN is skipped, as lse_update never makes
// its max NaN. One instruction (FMNMX).
__device__ __forceinline__ float max_skip_nan(float a, float b) { return ::fmaxf(a, b); }
__device__ __forceinline__ double max_skip_nan(double a, double b) { return ::fmax(a, b); }

// The state lse_update gives for a thread's cached entries (vectors vi =
// it * G + t below nvec; the others hold -inf), computed as the CPU's
// chunk_state does: the max first, then one exp per entry, branch-free. The
// strided kernels pass single entries (kVec 1), G = slices per row, nvec = cols.
template <int kIters, int kVec, typename acc_t>
__device__ __forceinline__ LseState<acc_t> cached_state(const acc_t (&x)[kIters][kVec], int G,
                                                        int t, int64_t nvec) {
  acc_t m = -nf_inf<acc_t>();
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) m = max_skip_nan(m, x[it][i]);
  }
  // Only -inf / NaN entries (max -inf) or a +inf entry: exp(x - max) would be
  // exp(NaN), so the shared online update applies the limits.
  if (nf_isinf(m)) {
    LseState<acc_t> state = lse_empty<acc_t>();
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) lse_update(state, x[it][i]);
    }
    return state;
  }
  acc_t sum = acc_t(0);
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    if (static_cast<int64_t>(it) * G + t < nvec) {  // padding vectors would add exp(-inf) = 0
      // exp(-inf - m) = 0 for a -inf entry; a NaN entry makes the sum NaN, as in lse_update.
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum += nf_exp(x[it][i] - m);
    }
  }
  return LseState<acc_t>{m, sum};
}

// Output entries of softmax / log_softmax. `finite_max`: the row's max is
// finite, where softmax_value is exp(x - max) * inv_sum (expf(0) == 1 exactly,
// and exp(-inf) == 0) and log_softmax_value is (x - max) - log_sum (0 - a ==
// -a): the same formulas without the per-entry special-case tests. A NaN sum
// gives NaN in both forms.
template <int N, typename acc_t>
__device__ __forceinline__ void forward_values(int kind, bool finite_max, const acc_t (&x)[N],
                                               LseState<acc_t> row, acc_t inv_sum, acc_t log_sum,
                                               acc_t (&y)[N]) {
  if (kind == kSoftmax) {
    if (finite_max) {
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = nf_exp(x[i] - row.max) * inv_sum;
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = softmax_value(x[i], row, inv_sum);
    }
  } else {
    if (finite_max) {
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = (x[i] - row.max) - log_sum;
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = log_softmax_value(x[i], row, log_sum);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward helper: the row sum of softmax (sum_j g_j y_j) and log_softmax
// (sum of the kept g_j).

template <int N, typename acc_t>
__device__ __forceinline__ acc_t backward_partial(int kind, const acc_t (&g)[N], const acc_t (&y)[N],
                                                  const bool (&keep)[N]) {
  acc_t sum = acc_t(0);
  if (kind == kSoftmax) {
#pragma unroll
    for (int i = 0; i < N; ++i) sum += g[i] * y[i];
  } else {
    // A dropped entry's gradient (NaN included) is left out of the sum.
#pragma unroll
    for (int i = 0; i < N; ++i) sum += keep[i] ? g[i] : acc_t(0);
  }
  return sum;
}

// log_softmax's row sum at the scale 2^-64 (GradSum of softmax_math.h, read
// where the plain sum overflowed); softmax needs none.
template <int N, typename acc_t>
__device__ __forceinline__ acc_t backward_partial_scaled(int kind, const acc_t (&g)[N],
                                                         const bool (&keep)[N]) {
  acc_t sum = acc_t(0);
  if (kind != kSoftmax) {
#pragma unroll
    for (int i = 0; i < N; ++i) sum += keep[i] ? g[i] * grad_sum_scale<acc_t>() : acc_t(0);
  }
  return sum;
}

}  // namespace detail

// Launchers of the strided kernels (softmax_strided_kernels.cu) for
// shape.inner > 1, with the contracts of softmax_forward, softmax_backward and
// logsumexp_backward in softmax_kernels.h (which call them).
template <typename scalar_t>
cudaError_t strided_softmax_forward(SoftmaxKind kind, const scalar_t* input, scalar_t* output,
                                    acc_of_t<scalar_t>* stats, ReductionLayout shape, MaskView mask,
                                    cudaStream_t stream);

template <typename scalar_t>
cudaError_t strided_softmax_backward(SoftmaxKind kind, const scalar_t* grad,
                                     const scalar_t* output, const acc_of_t<scalar_t>* stats,
                                     scalar_t* grad_input, ReductionLayout shape, MaskView mask,
                                     cudaStream_t stream);

template <typename scalar_t>
cudaError_t strided_logsumexp_backward(const scalar_t* grad, const scalar_t* input,
                                       const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                                       ReductionLayout shape, MaskView mask, cudaStream_t stream);

#define NANFREE_STRIDED_SOFTMAX_LAUNCHERS(PREFIX, T)                                              \
  PREFIX template cudaError_t strided_softmax_forward<T>(SoftmaxKind, const T*, T*,               \
                                                         acc_of_t<T>*, ReductionLayout, MaskView,    \
                                                         cudaStream_t);                           \
  PREFIX template cudaError_t strided_softmax_backward<T>(SoftmaxKind, const T*, const T*,        \
                                                          const acc_of_t<T>*, T*, ReductionLayout,   \
                                                          MaskView, cudaStream_t);                \
  PREFIX template cudaError_t strided_logsumexp_backward<T>(const T*, const T*,                   \
                                                            const acc_of_t<T>*, T*, ReductionLayout, \
                                                            MaskView, cudaStream_t);
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(extern, float)
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(extern, double)
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(extern, __half)
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(extern, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
