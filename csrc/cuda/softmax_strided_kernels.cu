// CUDA kernels of the softmax family that reduce over a dimension other than
// the last, in place: a contiguous tensor viewed as [outer, cols, inner] with
// inner > 1 (ReductionLayout in nanfree/softmax_math.h). Row r = o * inner + i
// holds the entries (o, j, i), j in [0, cols), at element offsets
// entry_offset(o, j, i) = (o * cols + j) * inner + i: inner elements apart, so
// nothing is copied to bring the reduced dimension last. The logsumexp output
// and gradient are [outer, inner] (offset r); the statistics of row r are at
// stats_offset(o, 0, i) (max) and stats_offset(o, 1, i) (log_sum). No torch
// header: only CUDA and nanfree/*.h. Every special-value rule comes from
// nanfree/softmax_math.h, directly or through the helpers of
// softmax_kernels_common.cuh shared with the last-dimension kernels.
//
// Layout. A block is a grid of bx x by threads (powers of two, bx * by = 256
// or 512). threadIdx.x picks one of a tile of bx consecutive rows, threadIdx.y
// one of the by slices of a row's columns: thread (x, s) takes j = s, s + by,
// s + 2 by, ... Consecutive rows are consecutive i (except where o steps), so
// for each j the threads of a warp read consecutive elements (a warp holds 32
// consecutive rows of one slice when bx >= 32; with inner < 32 those are runs
// of inner elements, one per o). bx is at least min(32, inner rounded up to a
// power of two); when bx < 32 (rows split over 256 / bx or more slices) a warp
// holds 32 / bx slices of bx rows and, with bx == inner, reads 32 / bx
// consecutive j of those rows: 32 consecutive elements. Blocks walk over the
// ceil(outer * inner / bx) tiles with a grid stride (a 1-D grid of at most
// kMaxBlocks blocks), so any number of rows fits; gridDim.y and z stay 1.
//
// Splitting a row. by (at most 512 / bx_min, bx_min the least bx) meets two
// needs: parallelism (doubled while rows * by < kTargetThreads and each
// slice keeps at least kMinColsPerThread columns) and caching (doubled until
// a slice's share of the row fits in registers, below, if it can). So a
// problem of many short rows runs one thread per row, with no reduction. A
// row is held by one block, so a problem of few rows and very long columns
// uses few blocks (e.g. logsumexp over dim 0 of a [100000, 64] tensor: two).
//
// Caching. When a thread's share of the row fits in registers (kIters
// entries: 32 float or 16 double accumulators per thread in the forward, 16
// or 8 per operand in the softmax / log_softmax backward, which caches g and
// y) it is read from global memory once: rows up to kIters * by entries
// (forward float: 512 for inner >= 32, up to 8192 for inner == 2). Longer rows
// (kIters == 0) are streamed twice, 16 bytes of loads in flight per thread
// (stream_batch), the second pass often from L2. The logsumexp backward is
// elementwise and reads once.
//
// Reductions. A thread's online (max, sum) state is the one lse_update gives
// (per entry when streaming; cached_state, from registers, when cached). The
// by states of a row are merged with lse_merge in a fixed order: a butterfly
// over the slices a warp holds (bx < 32), then a tree in shared memory over
// the warps (bx < 32) or the slices (bx >= 32); every thread of the row then
// reads the one merged state. The backward's plain sums are reduced the same
// way.
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

// Loads a thread issues before using their values, in the streamed passes:
// 16 bytes of accumulators (the forward's output pass takes doubles one by
// one, see there).
template <typename acc_t>
constexpr int stream_batch() {
  return static_cast<int>(16 / sizeof(acc_t));
}
// Threads (rows times slices) that keep a GPU's memory system busy (an H100
// holds 132 x 2048); rows are not split further to reach more.
constexpr int64_t kTargetThreads = int64_t(1) << 17;
// Fewest columns per slice when a row is split for parallelism only: fewer
// would make the merges cost more than the entries.
constexpr int64_t kMinColsPerThread = 16;
// Threads of a block when 512 / bx slices are not needed.
constexpr int kBlockThreads = 256;

// ---------------------------------------------------------------------------
// Rows, entries and the reduction over a row's slices.

// The value softmax sees at entry j of a row (x_row: its entry 0): a dropped
// entry is -inf, whatever it holds.
template <typename scalar_t>
__device__ __forceinline__ acc_of_t<scalar_t> load_entry(const scalar_t* x_row, int64_t inner,
                                                         const bool* mask_row, int64_t col_stride,
                                                         int64_t j) {
  bool keep[1];
  load_keep<1>(mask_row, j, col_stride, keep);
  return masked_value(to_acc(x_row[j * inner]), keep[0]);
}

__device__ __forceinline__ float shfl_xor(float v, int offset) {
  return __shfl_xor_sync(kFullMask, v, offset);
}
__device__ __forceinline__ double shfl_xor(double v, int offset) {
  return __shfl_xor_sync(kFullMask, v, offset);
}
template <typename acc_t>
__device__ __forceinline__ LseState<acc_t> shfl_xor(LseState<acc_t> s, int offset) {
  return LseState<acc_t>{shfl_xor(s.max, offset), shfl_xor(s.sum, offset)};
}

struct MergeStates {
  template <typename acc_t>
  __device__ __forceinline__ LseState<acc_t> operator()(LseState<acc_t> a,
                                                        LseState<acc_t> b) const {
    return lse_merge(a, b);
  }
};

struct AddSums {
  template <typename acc_t>
  __device__ __forceinline__ acc_t operator()(acc_t a, acc_t b) const {
    return a + b;
  }
};

// Combines the values of the blockDim.y threads that share threadIdx.x (the
// slices of one row) in a fixed order, and gives every one of them the
// result. Synchronizes the block: every thread must call it (also those whose
// row is past the end). blockDim.x * blockDim.y is a multiple of 32 and at
// most kMaxThreads, the size of `slots`.
template <typename T, typename Combine>
__device__ __forceinline__ T combine_slices(T value, T* slots, Combine combine) {
  const int bx = blockDim.x;
  const int tid = threadIdx.y * bx + threadIdx.x;
  // bx < 32: the warp's lanes bx, 2 bx, ... apart hold the other slices of
  // the same row; a butterfly combines them (no step when bx >= 32). Lanes may
  // differ in the last bit (lse_merge(a, b) and lse_merge(b, a) round
  // differently); only the first slice of each warp is kept.
  for (int offset = kWarp / 2; offset >= bx; offset /= 2)
    value = combine(value, shfl_xor(value, offset));
  // One value per warp (bx < 32) or per slice (bx >= 32): value k of row x at
  // slots[k * bx + x], then a tree over k.
  const int span = bx < kWarp ? kWarp : bx;  // threads per value
  const int count = bx * static_cast<int>(blockDim.y) / span;
  if (tid % span < bx) slots[(tid / span) * bx + threadIdx.x] = value;
  __syncthreads();
  for (int half = count / 2; half > 0; half /= 2) {
    if (tid < half * bx) slots[tid] = combine(slots[tid], slots[tid + half * bx]);
    __syncthreads();
  }
  value = slots[threadIdx.x];
  __syncthreads();  // slots are rewritten by the next tile
  return value;
}

// ---------------------------------------------------------------------------
// Forward: softmax / log_softmax (outputs of the input's shape) and logsumexp
// (one output per row); every kind writes the rows' statistics.

template <typename scalar_t, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    strided_forward_kernel(const scalar_t* __restrict__ input, scalar_t* __restrict__ output,
                           acc_of_t<scalar_t>* __restrict__ stats, ReductionLayout shape,
                           GridStride stride, MaskView mask, int kind) {
  using acc_t = acc_of_t<scalar_t>;
  constexpr int kBatch = stream_batch<acc_t>();
  __shared__ LseState<acc_t> slots[kMaxThreads];
  const int slices = blockDim.y;
  const int slice = threadIdx.y;
  const int64_t cols = shape.n;
  const int64_t inner = shape.inner;
  const int64_t rows = shape.outer * inner;
  constexpr int kCached = kIters > 0 ? kIters : 1;

  // `first` (the tile's first row) is the same for the whole block, so every
  // thread runs every iteration.
  ReductionCursor r = first_reduction(inner);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x; first < rows;
       first += stride.reductions, next_reduction(r, stride, inner)) {
    const bool active = r.r < rows;
    const int64_t base = active ? entry_offset(shape, r.o, 0, r.i) : 0;
    const scalar_t* x_row = input + base;
    const bool* mask_row =
        active && mask.data != nullptr ? mask.data + mask_row_offset(mask, r.r) : nullptr;

    LseState<acc_t> state = lse_empty<acc_t>();
    acc_t x[kCached][1];
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t j = static_cast<int64_t>(it) * slices + slice;
        x[it][0] = active && j < cols ? load_entry(x_row, inner, mask_row, mask.col_stride, j)
                                        : -nf_inf<acc_t>();  // past the row: no entry
      }
      state = cached_state(x, slices, slice, cols);
    } else if (active) {
      int64_t j = slice;
      for (; j + (kBatch - 1) * slices < cols; j += kBatch * slices) {
        acc_t v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          v[u] = load_entry(x_row, inner, mask_row, mask.col_stride, j + u * slices);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) lse_update(state, v[u]);
      }
      for (; j < cols; j += slices)
        lse_update(state, load_entry(x_row, inner, mask_row, mask.col_stride, j));
    }

    if (slices > 1) state = combine_slices(state, slots, MergeStates{});
    if (!active) continue;  // after the block-wide reduction

    const RowStats<acc_t> row_st = row_stats(state);
    if (slice == 0) {
      stats[stats_offset(shape, r.o, 0, r.i)] = row_st.max;
      stats[stats_offset(shape, r.o, 1, r.i)] = row_st.log_sum;
      if (kind == kLogSumExp) output[r.r] = FromAcc<scalar_t>::cast(lse_value(state));
    }
    if (kind == kLogSumExp) continue;

    // 1/sum is only used by softmax_value, and log(sum) by log_softmax_value,
    // which return before using them for an empty row (sum 0).
    const acc_t inv_sum = kind == kSoftmax ? acc_t(1) / state.sum : acc_t(0);
    const acc_t log_sum = row_st.log_sum;
    // Empty (-inf) and +inf rows take the shared per-entry rules.
    const bool finite_max = !nf_isinf(state.max);
    scalar_t* y_row = output + base;
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t j = static_cast<int64_t>(it) * slices + slice;
        if (j < cols) {
          acc_t y[1];
          forward_values(kind, finite_max, x[it], state, inv_sum, log_sum, y);
          y_row[j * inner] = FromAcc<scalar_t>::cast(y[0]);
        }
      }
    } else {
      // One double at a time: two double exps at once make ptxas spill on sm_90.
      constexpr int kOutBatch = sizeof(acc_t) == 8 ? 1 : kBatch;
      int64_t j = slice;
      for (; j + (kOutBatch - 1) * slices < cols; j += kOutBatch * slices) {
        acc_t v[kOutBatch], y[kOutBatch];
#pragma unroll
        for (int u = 0; u < kOutBatch; ++u)
          v[u] = load_entry(x_row, inner, mask_row, mask.col_stride, j + u * slices);
        forward_values(kind, finite_max, v, state, inv_sum, log_sum, y);
#pragma unroll
        for (int u = 0; u < kOutBatch; ++u)
          y_row[(j + u * slices) * inner] = FromAcc<scalar_t>::cast(y[u]);
      }
      for (; j < cols; j += slices) {
        acc_t v[1] = {load_entry(x_row, inner, mask_row, mask.col_stride, j)};
        acc_t y[1];
        forward_values(kind, finite_max, v, state, inv_sum, log_sum, y);
        y_row[j * inner] = FromAcc<scalar_t>::cast(y[0]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward of softmax (row sum of g * y) and log_softmax (row sum of the kept
// g). The softmax launcher clears the mask, so keep is true for softmax.

// The operands of entry j: g and keep, and y (the forward's output) when
// `with_y` (softmax always needs it; log_softmax only for its gradient, not
// for its sum).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_grad_entry(const scalar_t* g_row, const scalar_t* y_row,
                                                int64_t inner, const bool* mask_row,
                                                int64_t col_stride, int64_t j, bool with_y,
                                                acc_t& g, acc_t& y, bool& keep) {
  g = to_acc(g_row[j * inner]);
  y = with_y ? to_acc(y_row[j * inner]) : acc_t(0);
  bool k[1];
  load_keep<1>(mask_row, j, col_stride, k);
  keep = k[0];
}

// d input of one entry given the row's sums, saturated to `bound`.
template <typename acc_t>
__device__ __forceinline__ acc_t grad_entry(int kind, acc_t g, acc_t y, bool keep,
                                            GradSum<acc_t> sums, acc_t bound) {
  return kind == kSoftmax ? softmax_grad_value(g, y, sums.plain, bound)
                          : log_softmax_grad_value(g, y, sums, keep, bound);
}

template <typename scalar_t, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    strided_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ output,
                            const acc_of_t<scalar_t>* __restrict__ stats,
                            scalar_t* __restrict__ grad_input, ReductionLayout shape,
                            GridStride stride, MaskView mask, int kind) {
  using acc_t = acc_of_t<scalar_t>;
  constexpr int kBatch = stream_batch<acc_t>();
  __shared__ acc_t slots[kMaxThreads];
  const int slices = blockDim.y;
  const int slice = threadIdx.y;
  const int64_t cols = shape.n;
  const int64_t inner = shape.inner;
  const int64_t rows = shape.outer * inner;
  const bool sum_needs_y = kind == kSoftmax;
  constexpr int kCached = kIters > 0 ? kIters : 1;

  // `first` (the tile's first row) is the same for the whole block, so every
  // thread runs every iteration.
  ReductionCursor r = first_reduction(inner);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x; first < rows;
       first += stride.reductions, next_reduction(r, stride, inner)) {
    const bool active = r.r < rows;
    const RowStats<acc_t> row_st =
        active ? RowStats<acc_t>{stats[stats_offset(shape, r.o, 0, r.i)],
                                   stats[stats_offset(shape, r.o, 1, r.i)]}
                 : RowStats<acc_t>{0, 0};
    // An empty or +inf row passes no gradient: its reads are skipped.
    const bool live = active && row_has_gradient(row_st);
    const int64_t base = active ? entry_offset(shape, r.o, 0, r.i) : 0;
    const scalar_t* g_row = grad + base;
    const scalar_t* y_row = output + base;
    const bool* mask_row =
        live && mask.data != nullptr ? mask.data + mask_row_offset(mask, r.r) : nullptr;

    acc_t partial_sum = acc_t(0), partial_scaled = acc_t(0);
    acc_t g[kCached][1], y[kCached][1];
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t j = static_cast<int64_t>(it) * slices + slice;
        if (live && j < cols) {
          bool keep[1];
          load_grad_entry(g_row, y_row, inner, mask_row, mask.col_stride, j, sum_needs_y,
                          g[it][0], y[it][0], keep[0]);
          partial_sum += backward_partial(kind, g[it], y[it], keep);
          partial_scaled += backward_partial_scaled(kind, g[it], keep);
        }
      }
    } else if (live) {
      int64_t j = slice;
      for (; j + (kBatch - 1) * slices < cols; j += kBatch * slices) {
        acc_t gv[kBatch], yv[kBatch];
        bool keep[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          load_grad_entry(g_row, y_row, inner, mask_row, mask.col_stride, j + u * slices,
                          sum_needs_y, gv[u], yv[u], keep[u]);
        partial_sum += backward_partial(kind, gv, yv, keep);
        partial_scaled += backward_partial_scaled(kind, gv, keep);
      }
      for (; j < cols; j += slices) {
        acc_t gv[1], yv[1];
        bool keep[1];
        load_grad_entry(g_row, y_row, inner, mask_row, mask.col_stride, j, sum_needs_y, gv[0],
                        yv[0], keep[0]);
        partial_sum += backward_partial(kind, gv, yv, keep);
        partial_scaled += backward_partial_scaled(kind, gv, keep);
      }
    }

    const acc_t total =
        slices > 1 ? combine_slices(partial_sum, slots, AddSums{}) : partial_sum;
    // kind is the block's: every thread takes part in this reduction or none does.
    const acc_t total_scaled =
        kind == kSoftmax ? acc_t(0)
                         : (slices > 1 ? combine_slices(partial_scaled, slots, AddSums{})
                                       : partial_scaled);
    const GradSum<acc_t> sums{total, total_scaled};
    const acc_t bound = largest_finite<scalar_t>();  // of a saturated gradient
    if (!active) continue;  // after the block-wide reduction

    scalar_t* d_row = grad_input + base;
    if (!live) {
      for (int64_t j = slice; j < cols; j += slices)
        d_row[j * inner] = FromAcc<scalar_t>::cast(acc_t(0));
      continue;
    }
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t j = static_cast<int64_t>(it) * slices + slice;
        if (j < cols) {
          acc_t out = y[it][0];
          bool keep = true;
          if (kind != kSoftmax) {
            // log_softmax reads its output and mask here only: the sum did not need them.
            bool k[1];
            load_keep<1>(mask_row, j, mask.col_stride, k);
            keep = k[0];
            out = to_acc(y_row[j * inner]);
          }
          d_row[j * inner] = FromAcc<scalar_t>::cast(grad_entry(kind, g[it][0], out, keep, sums, bound));
        }
      }
    } else {
      int64_t j = slice;
      for (; j + (kBatch - 1) * slices < cols; j += kBatch * slices) {
        acc_t gv[kBatch], yv[kBatch];
        bool keep[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          load_grad_entry(g_row, y_row, inner, mask_row, mask.col_stride, j + u * slices, true,
                          gv[u], yv[u], keep[u]);
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          d_row[(j + u * slices) * inner] =
              FromAcc<scalar_t>::cast(grad_entry(kind, gv[u], yv[u], keep[u], sums, bound));
      }
      for (; j < cols; j += slices) {
        acc_t gv, yv;
        bool keep;
        load_grad_entry(g_row, y_row, inner, mask_row, mask.col_stride, j, true, gv, yv, keep);
        d_row[j * inner] = FromAcc<scalar_t>::cast(grad_entry(kind, gv, yv, keep, sums, bound));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward of logsumexp: elementwise given the row's statistics, no reduction
// (so a thread whose row is past the end may leave at once).

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads)
    strided_logsumexp_backward_kernel(const scalar_t* __restrict__ grad,
                                      const scalar_t* __restrict__ input,
                                      const acc_of_t<scalar_t>* __restrict__ stats,
                                      scalar_t* __restrict__ grad_input, ReductionLayout shape,
                                      GridStride stride, MaskView mask) {
  using acc_t = acc_of_t<scalar_t>;
  constexpr int kBatch = stream_batch<acc_t>();
  const int slices = blockDim.y;
  const int slice = threadIdx.y;
  const int64_t cols = shape.n;
  const int64_t inner = shape.inner;
  const int64_t rows = shape.outer * inner;

  ReductionCursor r = first_reduction(inner);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x; first < rows;
       first += stride.reductions, next_reduction(r, stride, inner)) {
    if (r.r >= rows) continue;
    const RowStats<acc_t> row_st{stats[stats_offset(shape, r.o, 0, r.i)],
                                 stats[stats_offset(shape, r.o, 1, r.i)]};
    const int64_t base = entry_offset(shape, r.o, 0, r.i);
    scalar_t* d_row = grad_input + base;
    // An empty or +inf row passes no gradient.
    if (!row_has_gradient(row_st)) {
      for (int64_t j = slice; j < cols; j += slices)
        d_row[j * inner] = FromAcc<scalar_t>::cast(acc_t(0));
      continue;
    }
    const acc_t g = to_acc(grad[r.r]);
    const scalar_t* x_row = input + base;
    const bool* mask_row =
        mask.data != nullptr ? mask.data + mask_row_offset(mask, r.r) : nullptr;
    int64_t j = slice;
    for (; j + (kBatch - 1) * slices < cols; j += kBatch * slices) {
      acc_t x[kBatch];
      bool keep[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        bool k[1];
        load_keep<1>(mask_row, j + u * slices, mask.col_stride, k);
        keep[u] = k[0];
        x[u] = to_acc(x_row[(j + u * slices) * inner]);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        d_row[(j + u * slices) * inner] =
            FromAcc<scalar_t>::cast(logsumexp_grad_value(g, x[u], row_st, keep[u]));
    }
    for (; j < cols; j += slices) {
      bool keep[1];
      load_keep<1>(mask_row, j, mask.col_stride, keep);
      const acc_t x = to_acc(x_row[j * inner]);
      d_row[j * inner] = FromAcc<scalar_t>::cast(logsumexp_grad_value(g, x, row_st, keep[0]));
    }
  }
}

// ---------------------------------------------------------------------------
// Launch planning (host).

struct StridedPlan {
  int iters;         // entries cached per thread; 0: streamed
  int bx;            // rows per tile (blockDim.x)
  int by;            // slices per row (blockDim.y)
  StridedGrid grid;  // blocks, and their stride of blocks * bx rows
};

// `operands`: the operands a reducing kernel caches (kForwardOperands,
// kBackwardOperands), or 0 for the elementwise logsumexp backward.
template <typename scalar_t>
StridedPlan strided_plan(const ReductionLayout& shape, int operands) {
  const int64_t rows = shape.reductions();
  const int64_t cols = shape.n;
  const int bx_min = strided_min_width(shape.inner);
  const int by_max = kMaxThreads / bx_min;
  int by = strided_slices(rows, cols, shape.inner, kMaxThreads, kTargetThreads, kMinColsPerThread);
  int iters = 0;
  if (operands > 0) {
    const int max_iters = max_cached_iters<scalar_t>(1, operands);
    while (by < by_max && ceil_div(cols, by) > max_iters) by *= 2;
    const int64_t need = ceil_div(cols, by);
    iters = need <= max_iters ? next_pow2(need) : 0;
  }
  // by <= 256 (inner >= 2), so bx * by is 256, or 512 where bx_min * by is.
  const int bx = kBlockThreads / by > bx_min ? kBlockThreads / by : bx_min;
  return StridedPlan{iters, bx, by, strided_grid(rows, shape.inner, bx)};
}

}  // namespace

template <typename scalar_t>
cudaError_t strided_softmax_forward(SoftmaxKind kind, const scalar_t* input, scalar_t* output,
                                    acc_of_t<scalar_t>* stats, ReductionLayout shape, MaskView mask,
                                    cudaStream_t stream) {
  if (shape.outer <= 0 || shape.inner <= 0) return cudaSuccess;
  const StridedPlan p = strided_plan<scalar_t>(shape, kForwardOperands);
  constexpr int kMaxIters = max_cached_iters<scalar_t>(1, kForwardOperands);
  return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
    constexpr int kIters = decltype(iters_c)::value;
    strided_forward_kernel<scalar_t, kIters><<<p.grid.blocks, dim3(p.bx, p.by), 0, stream>>>(
        input, output, stats, shape, p.grid.stride, mask, static_cast<int>(kind));
    return cudaGetLastError();
  });
}

template <typename scalar_t>
cudaError_t strided_softmax_backward(SoftmaxKind kind, const scalar_t* grad,
                                     const scalar_t* output, const acc_of_t<scalar_t>* stats,
                                     scalar_t* grad_input, ReductionLayout shape, MaskView mask,
                                     cudaStream_t stream) {
  if (kind == SoftmaxKind::LogSumExp) return cudaErrorInvalidValue;
  if (shape.outer <= 0 || shape.inner <= 0 || shape.n <= 0) return cudaSuccess;
  // The softmax backward has no mask: dropped entries have output 0.
  if (kind == SoftmaxKind::Softmax) mask.data = nullptr;
  const StridedPlan p = strided_plan<scalar_t>(shape, kBackwardOperands);
  constexpr int kMaxIters = max_cached_iters<scalar_t>(1, kBackwardOperands);
  return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
    constexpr int kIters = decltype(iters_c)::value;
    strided_backward_kernel<scalar_t, kIters><<<p.grid.blocks, dim3(p.bx, p.by), 0, stream>>>(
        grad, output, stats, grad_input, shape, p.grid.stride, mask, static_cast<int>(kind));
    return cudaGetLastError();
  });
}

template <typename scalar_t>
cudaError_t strided_logsumexp_backward(const scalar_t* grad, const scalar_t* input,
                                       const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                                       ReductionLayout shape, MaskView mask, cudaStream_t stream) {
  if (shape.outer <= 0 || shape.inner <= 0 || shape.n <= 0) return cudaSuccess;
  const StridedPlan p = strided_plan<scalar_t>(shape, 0);
  strided_logsumexp_backward_kernel<scalar_t><<<p.grid.blocks, dim3(p.bx, p.by), 0, stream>>>(
      grad, input, stats, grad_input, shape, p.grid.stride, mask);
  return cudaGetLastError();
}

NANFREE_STRIDED_SOFTMAX_LAUNCHERS(, float)
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(, double)
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(, __half)
NANFREE_STRIDED_SOFTMAX_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
