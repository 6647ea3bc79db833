// CUDA kernels of the softmax family over the last dimension (a
// ReductionLayout with inner == 1: a row-major [rows, cols] problem with rows =
// outer), and the launchers of softmax_kernels.h, which hand inner > 1 to the
// strided kernels of softmax_strided_kernels.cu. No torch header: only CUDA
// and nanfree/*.h, so this file compiles without ATen. Every special-value
// rule (empty and all -inf rows, +inf rows, NaN, masked entries) comes from
// nanfree/softmax_math.h; the device helpers shared with the strided kernels
// are in softmax_kernels_common.cuh.
//
// Layout. A row is handled by a group of G threads (G a power of two, 1..512);
// a block of max(G, 128) threads holds 128/G rows when G < 128, one row when
// G >= 128, and walks over the rows with a grid stride. Threads read the row
// in vectors of kVec elements (16 bytes when the row pointers are 16-byte
// aligned and cols is a multiple of kVec, else 1 element), vector vi of the
// row going to thread vi % G, so a group reads consecutive 16-byte pieces.
//
// Caching. When the row fits (kIters vectors per thread; at most 32 float or
// 16 double accumulators per thread and 512 threads) it is held in registers
// and read from global memory once: forward rows up to 16K elements (8K for
// double), softmax / log_softmax backward rows up to 8K (4K), which cache two
// operands. Longer rows (kIters == 0) are streamed twice, the second pass
// usually from L2. The logsumexp backward is elementwise and reads once.
//
// Reductions. A thread's online (max, sum) state is the one lse_update gives:
// computed with lse_update per entry when streaming, and from registers as max
// then sum(exp(x - max)) when cached (lse_update again where that max is
// infinite). States are merged with lse_merge across the group's lanes with
// __shfl_xor_sync and, for G > 32, across its warps through shared memory in a
// fixed order. Plain sums (backward) are reduced the same way.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/softmax_kernels.h"
#include "cuda/softmax_kernels_common.cuh"
#include "nanfree/numerics.h"
#include "nanfree/softmax_math.h"

namespace nanfree {
namespace gpu {
using namespace detail;
namespace {

// The values softmax sees at columns col .. col + N - 1: dropped entries are -inf.
template <int N, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_masked(const scalar_t* row, const bool* mask_row,
                                            int64_t col_stride, int64_t col, acc_t (&x)[N]) {
  load_acc<N>(row + col, x);
  if (mask_row != nullptr) {
    bool keep[N];
    load_keep<N>(mask_row, col, col_stride, keep);
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = masked_value(x[i], keep[i]);
  }
}

// ---------------------------------------------------------------------------
// Group reductions. G (the group size) is the same for the whole block, so the
// __syncthreads below are reached by every thread; each call must be made by
// every thread of the block (also those whose row is past the end).

template <typename acc_t>
__device__ __forceinline__ LseState<acc_t> group_merge(LseState<acc_t> state, int G,
                                                       LseState<acc_t>* partial) {
  const int width = G < kWarp ? G : kWarp;
  for (int offset = width / 2; offset > 0; offset /= 2) {
    const LseState<acc_t> other{__shfl_xor_sync(kFullMask, state.max, offset),
                                __shfl_xor_sync(kFullMask, state.sum, offset)};
    state = lse_merge(state, other);
  }
  // Lanes may differ in the last bit (a fused multiply-add rounds a*b + c*d
  // differently from c*d + a*b): every lane takes lane 0's state.
  state.max = __shfl_sync(kFullMask, state.max, 0, width);
  state.sum = __shfl_sync(kFullMask, state.sum, 0, width);
  if (G > kWarp) {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) partial[warp] = state;
    __syncthreads();
    const int per_group = G / kWarp;
    const int first = (threadIdx.x / G) * per_group;
    state = partial[first];
    for (int w = 1; w < per_group; ++w) state = lse_merge(state, partial[first + w]);
    __syncthreads();  // partial is reused by the next row
  }
  return state;
}

template <typename acc_t>
__device__ __forceinline__ acc_t group_sum(acc_t value, int G, acc_t* partial) {
  const int width = G < kWarp ? G : kWarp;
  // a + b == b + a exactly, so every lane ends with the same sum.
  for (int offset = width / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  if (G > kWarp) {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) partial[warp] = value;
    __syncthreads();
    const int per_group = G / kWarp;
    const int first = (threadIdx.x / G) * per_group;
    value = partial[first];
    for (int w = 1; w < per_group; ++w) value += partial[first + w];
    __syncthreads();  // partial is reused by the next row
  }
  return value;
}

// ---------------------------------------------------------------------------
// Forward (cached_state and forward_values are in softmax_kernels_common.cuh).

template <typename scalar_t, int kVec, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    softmax_forward_kernel(const scalar_t* __restrict__ input, scalar_t* __restrict__ output,
                           acc_of_t<scalar_t>* __restrict__ stats, int64_t rows, int64_t cols,
                           MaskView mask, int G, int kind) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ LseState<acc_t> partial[kMaxWarps];
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = cols / kVec;  // the launcher picks kVec > 1 only when kVec divides cols
  constexpr int kCached = kIters > 0 ? kIters : 1;

  // `base` is the same for the whole block, so every thread runs every iteration.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const scalar_t* x_row = input + (active ? row : 0) * cols;
    const bool* mask_row =
        active && mask.data != nullptr ? mask.data + mask_row_offset(mask, row) : nullptr;

    LseState<acc_t> state = lse_empty<acc_t>();
    acc_t x[kCached][kVec];
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t vi = static_cast<int64_t>(it) * G + t;
        if (active && vi < nvec) {
          load_masked<kVec>(x_row, mask_row, mask.col_stride, vi * kVec, x[it]);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) x[it][i] = -nf_inf<acc_t>();  // past the row: no entry
        }
      }
      state = cached_state(x, G, t, nvec);
    } else {
      for (int64_t vi = t; active && vi < nvec; vi += G) {
        acc_t v[kVec];
        load_masked<kVec>(x_row, mask_row, mask.col_stride, vi * kVec, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) lse_update(state, v[i]);
      }
    }

    state = group_merge(state, G, partial);
    if (!active) continue;  // after the block-wide reduction

    const RowStats<acc_t> row_st = row_stats(state);
    if (t == 0) {
      stats[2 * row] = row_st.max;
      stats[2 * row + 1] = row_st.log_sum;
      if (kind == kLogSumExp) output[row] = FromAcc<scalar_t>::cast(lse_value(state));
    }
    if (kind == kLogSumExp) continue;

    // 1/sum is only used by softmax_value, and log(sum) by log_softmax_value,
    // which return before using them for an empty row (sum 0).
    const acc_t inv_sum = kind == kSoftmax ? acc_t(1) / state.sum : acc_t(0);
    const acc_t log_sum = row_st.log_sum;
    // Empty (-inf) and +inf rows take the shared per-entry rules.
    const bool finite_max = !nf_isinf(state.max);
    scalar_t* y_row = output + row * cols;
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t vi = static_cast<int64_t>(it) * G + t;
        if (vi < nvec) {
          acc_t y[kVec];
          forward_values(kind, finite_max, x[it], state, inv_sum, log_sum, y);
          store_acc<kVec>(y_row + vi * kVec, y);
        }
      }
    } else {
      for (int64_t vi = t; vi < nvec; vi += G) {
        acc_t v[kVec], y[kVec];
        load_masked<kVec>(x_row, mask_row, mask.col_stride, vi * kVec, v);
        forward_values(kind, finite_max, v, state, inv_sum, log_sum, y);
        store_acc<kVec>(y_row + vi * kVec, y);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward of softmax (sum_j g_j y_j) and log_softmax (sum of the kept g_j;
// backward_partial is in softmax_kernels_common.cuh).

// Loads g (and y for softmax, keep for log_softmax) at vector vi.
template <int N, typename scalar_t, typename acc_t>
__device__ __forceinline__ void backward_load(int kind, const scalar_t* g_row, const scalar_t* y_row,
                                              const bool* mask_row, int64_t col_stride, int64_t col,
                                              acc_t (&g)[N], acc_t (&y)[N], bool (&keep)[N]) {
  load_acc<N>(g_row + col, g);
  if (kind == kSoftmax) {
    load_acc<N>(y_row + col, y);
  } else {
    load_keep<N>(mask_row, col, col_stride, keep);
  }
}

template <int N, typename scalar_t, typename acc_t>
__device__ __forceinline__ void backward_store(int kind, const acc_t (&g)[N], const acc_t (&y)[N],
                                               const scalar_t* y_row, const bool* mask_row,
                                               int64_t col_stride, int64_t col,
                                               GradSum<acc_t> sums, scalar_t* d_row) {
  acc_t d[N];
  const acc_t bound = largest_finite<scalar_t>();  // of a saturated gradient
  if (kind == kSoftmax) {
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] = softmax_grad_value(g[i], y[i], sums.plain, bound);
  } else {
    // log_softmax reads its output here only: it is not needed for the sum.
    acc_t out[N];
    bool keep[N];
    load_acc<N>(y_row + col, out);
    load_keep<N>(mask_row, col, col_stride, keep);
#pragma unroll
    for (int i = 0; i < N; ++i) d[i] = log_softmax_grad_value(g[i], out[i], sums, keep[i], bound);
  }
  store_acc<N>(d_row + col, d);
}

template <typename scalar_t, int kVec, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    softmax_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ output,
                            const acc_of_t<scalar_t>* __restrict__ stats,
                            scalar_t* __restrict__ grad_input, int64_t rows, int64_t cols,
                            MaskView mask, int G, int kind) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t partial[kMaxWarps];
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = cols / kVec;
  constexpr int kCached = kIters > 0 ? kIters : 1;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const RowStats<acc_t> row_st =
        active ? RowStats<acc_t>{stats[2 * row], stats[2 * row + 1]} : RowStats<acc_t>{0, 0};
    // An empty or +inf row passes no gradient: its reads are skipped.
    const bool live = active && row_has_gradient(row_st);
    const int64_t offset = (live ? row : 0) * cols;
    const scalar_t* g_row = grad + offset;
    const scalar_t* y_row = output + offset;
    const bool* mask_row =
        live && mask.data != nullptr ? mask.data + mask_row_offset(mask, row) : nullptr;

    acc_t partial_sum = acc_t(0), partial_scaled = acc_t(0);
    acc_t g[kCached][kVec], y[kCached][kVec];
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t vi = static_cast<int64_t>(it) * G + t;
        bool keep[kVec];
        if (live && vi < nvec) {
          backward_load(kind, g_row, y_row, mask_row, mask.col_stride, vi * kVec, g[it], y[it], keep);
          partial_sum += backward_partial(kind, g[it], y[it], keep);
          partial_scaled += backward_partial_scaled(kind, g[it], keep);
        }
      }
    } else {
      for (int64_t vi = t; live && vi < nvec; vi += G) {
        acc_t gv[kVec], yv[kVec];
        bool keep[kVec];
        backward_load(kind, g_row, y_row, mask_row, mask.col_stride, vi * kVec, gv, yv, keep);
        partial_sum += backward_partial(kind, gv, yv, keep);
        partial_scaled += backward_partial_scaled(kind, gv, keep);
      }
    }

    const acc_t total = group_sum(partial_sum, G, partial);
    // kind is the block's: every thread takes part in this reduction or none does.
    const GradSum<acc_t> sums{
        total, kind == kSoftmax ? acc_t(0) : group_sum(partial_scaled, G, partial)};
    if (!active) continue;  // after the block-wide reduction

    scalar_t* d_row = grad_input + row * cols;
    if (!live) {
      for (int64_t vi = t; vi < nvec; vi += G) store_zeros<kVec>(d_row + vi * kVec);
      continue;
    }
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t vi = static_cast<int64_t>(it) * G + t;
        if (vi < nvec)
          backward_store(kind, g[it], y[it], y_row, mask_row, mask.col_stride, vi * kVec, sums, d_row);
      }
    } else {
      for (int64_t vi = t; vi < nvec; vi += G) {
        acc_t gv[kVec], yv[kVec];
        bool keep[kVec];
        backward_load(kind, g_row, y_row, mask_row, mask.col_stride, vi * kVec, gv, yv, keep);
        backward_store(kind, gv, yv, y_row, mask_row, mask.col_stride, vi * kVec, sums, d_row);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward of logsumexp: elementwise given the row's statistics, no reduction.

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
    logsumexp_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ input,
                              const acc_of_t<scalar_t>* __restrict__ stats,
                              scalar_t* __restrict__ grad_input, int64_t rows, int64_t cols,
                              MaskView mask, int G) {
  using acc_t = acc_of_t<scalar_t>;
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = cols / kVec;

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * groups + group; row < rows;
       row += static_cast<int64_t>(gridDim.x) * groups) {
    const RowStats<acc_t> row_st{stats[2 * row], stats[2 * row + 1]};
    scalar_t* d_row = grad_input + row * cols;
    // An empty or +inf row passes no gradient.
    if (!row_has_gradient(row_st)) {
      for (int64_t vi = t; vi < nvec; vi += G) store_zeros<kVec>(d_row + vi * kVec);
      continue;
    }
    const acc_t g = to_acc(grad[row]);
    const scalar_t* x_row = input + row * cols;
    const bool* mask_row = mask.data != nullptr ? mask.data + mask_row_offset(mask, row) : nullptr;
    for (int64_t vi = t; vi < nvec; vi += G) {
      acc_t x[kVec], d[kVec];
      bool keep[kVec];
      load_acc<kVec>(x_row + vi * kVec, x);
      load_keep<kVec>(mask_row, vi * kVec, mask.col_stride, keep);
#pragma unroll
      for (int i = 0; i < kVec; ++i) d[i] = logsumexp_grad_value(g, x[i], row_st, keep[i]);
      store_acc<kVec>(d_row + vi * kVec, d);
    }
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t softmax_forward(SoftmaxKind kind, const scalar_t* input, scalar_t* output,
                            acc_of_t<scalar_t>* stats, ReductionLayout shape, MaskView mask,
                            cudaStream_t stream) {
  if (shape.outer <= 0 || shape.inner <= 0) return cudaSuccess;
  if (shape.inner > 1)
    return strided_softmax_forward(kind, input, output, stats, shape, mask, stream);
  const int64_t rows = shape.outer;
  const int64_t cols = shape.n;
  const bool vec = cols % vec_width<scalar_t>() == 0 && aligned16(input) &&
                   (kind == SoftmaxKind::LogSumExp || aligned16(output));
  const Plan p = reduction_plan<scalar_t>(rows, cols, vec, max_cached_iters<scalar_t>(vec ? vec_width<scalar_t>() : 1, kForwardOperands));
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    constexpr int kMaxIters = max_cached_iters<scalar_t>(kVec, kForwardOperands);
    return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
      constexpr int kIters = decltype(iters_c)::value;
      softmax_forward_kernel<scalar_t, kVec, kIters><<<p.blocks, p.threads, 0, stream>>>(
          input, output, stats, rows, cols, mask, p.group, static_cast<int>(kind));
      return cudaGetLastError();
    });
  });
}

template <typename scalar_t>
cudaError_t softmax_backward(SoftmaxKind kind, const scalar_t* grad, const scalar_t* output,
                             const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                             ReductionLayout shape, MaskView mask, cudaStream_t stream) {
  if (kind == SoftmaxKind::LogSumExp) return cudaErrorInvalidValue;
  if (shape.outer <= 0 || shape.inner <= 0 || shape.n <= 0) return cudaSuccess;
  if (shape.inner > 1)
    return strided_softmax_backward(kind, grad, output, stats, grad_input, shape, mask, stream);
  const int64_t rows = shape.outer;
  const int64_t cols = shape.n;
  // The softmax backward has no mask: dropped entries have output 0.
  if (kind == SoftmaxKind::Softmax) mask.data = nullptr;
  const bool vec = cols % vec_width<scalar_t>() == 0 && aligned16(grad) && aligned16(output) &&
                   aligned16(grad_input);
  const Plan p = reduction_plan<scalar_t>(rows, cols, vec, max_cached_iters<scalar_t>(vec ? vec_width<scalar_t>() : 1, kBackwardOperands));
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    constexpr int kMaxIters = max_cached_iters<scalar_t>(kVec, kBackwardOperands);
    return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
      constexpr int kIters = decltype(iters_c)::value;
      softmax_backward_kernel<scalar_t, kVec, kIters><<<p.blocks, p.threads, 0, stream>>>(
          grad, output, stats, grad_input, rows, cols, mask, p.group, static_cast<int>(kind));
      return cudaGetLastError();
    });
  });
}

template <typename scalar_t>
cudaError_t logsumexp_backward(const scalar_t* grad, const scalar_t* input,
                               const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                               ReductionLayout shape, MaskView mask, cudaStream_t stream) {
  if (shape.outer <= 0 || shape.inner <= 0 || shape.n <= 0) return cudaSuccess;
  if (shape.inner > 1)
    return strided_logsumexp_backward(grad, input, stats, grad_input, shape, mask, stream);
  const int64_t rows = shape.outer;
  const int64_t cols = shape.n;
  const bool vec =
      cols % vec_width<scalar_t>() == 0 && aligned16(input) && aligned16(grad_input);
  const Plan p = elementwise_plan<scalar_t>(rows, cols, vec);
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    logsumexp_backward_kernel<scalar_t, kVec><<<p.blocks, p.threads, 0, stream>>>(
        grad, input, stats, grad_input, rows, cols, mask, p.group);
    return cudaGetLastError();
  });
}

NANFREE_SOFTMAX_LAUNCHERS(, float)
NANFREE_SOFTMAX_LAUNCHERS(, double)
NANFREE_SOFTMAX_LAUNCHERS(, __half)
NANFREE_SOFTMAX_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
