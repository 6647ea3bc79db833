// CUDA kernels of the cosine family over the last dimension (a row-major
// [rows, d] problem: normalize and cosine_similarity, forward and backward),
// the clamp of cos_sim_matrix's GEMM output, and the launchers of
// cosine_kernels.h. No torch header: only CUDA and nanfree/*.h, so this file
// compiles without ATen. Every special-value rule (NaN, +-inf, zero and tiny
// vectors, eps, the clamp) comes from nanfree/cosine_math.h; the generic
// device helpers are in device_common.cuh.
//
// Layout. A row (one vector, or the pair of vectors of one similarity) is
// handled by a group of G threads (G a power of two, 1..512); a block of
// max(G, 128) threads holds 128/G rows when G < 128, one row when G >= 128,
// and walks over the rows with a grid stride (at most kMaxBlocks blocks), so
// any number of rows fits. Threads read the row in vectors of kVec elements
// (16 bytes when every row pointer is 16-byte aligned and d is a multiple of
// kVec, else 1 element), vector vi of the row going to thread vi % G, so a
// group reads consecutive 16-byte pieces. Rows of up to 32 vectors get the
// smallest group that covers them (several rows per warp for short rows,
// e.g. a 128-float row takes one warp and a 64-float row half of one).
// The forwards and normalize's backward of many (4096 and more) longer rows
// (33 to 2048 vectors) take the warp-per-row kernels below instead: the
// forwards one pass of unscaled sums, with the scaled passes only for the
// rows the rules need them for.
//
// Caching. When the row fits (kIters vectors per thread; 32 float or 16
// double accumulators per thread in all, shared by the cached operands, and
// 512 threads) it is held in registers and read from global memory once:
// normalize rows of up to 16K elements (8K for double), cosine_similarity
// rows and normalize_backward rows (two operands: x1 and x2; g and y) of up
// to 8K (4K). Longer rows (kIters == 0) are streamed: the second and later
// passes re-read the row, usually from L2 (normalize's forward three times:
// amax, the sum of squares, the output; cosine_similarity's forward and
// normalize's backward twice).
//
// Passes (as nanfree/_torch_backend/cosine.py). Forward: the largest
// magnitude amax of each vector (NaN when an entry is NaN: MaxKeepNanOp),
// reduced over the group; p = norm_scale(amax); then the sum of squares of
// the scaled entries ssq (and for cosine_similarity their dot product),
// reduced over the group; then q, the divisor and grad_factor =
// norm_factors, and the unit_divisor. normalize writes
// normalized_entry(scaled_entry(x, p), unit divisor, q); cosine_similarity
// writes cosine_value(dot, divisor1, divisor2, q1, q2). normalize's backward
// reduces dot = sum(g * y) and writes normalize_grad_value per entry;
// cosine_similarity's backward is elementwise given the row's statistics,
// its incoming gradient and its similarity (cosine_grad_value of the
// recomputed normalized entries), with no reduction.
//
// Reductions (group_reduce in device_common.cuh): a butterfly over the
// group's lanes, then over its warps through shared memory, in an order fixed
// by G; every thread of a group ends with the same value. A thread's own sums
// run over its vectors in order, so results do not depend on timing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/cosine_kernels.h"
#include "cuda/device_common.cuh"
#include "nanfree/cosine_math.h"

namespace nanfree {
namespace gpu {
using namespace detail;
namespace {

// Vectors of `vec` elements a thread caches per operand (kIters at most):
// two operands of max_cached_iters's budget for the cosine_similarity forward
// (x1 and x2) and the normalize backward (g and y), and one operand of the
// same size for the normalize forward, which keeps its x alive across the
// norm's division and square root to write the output (a budget of 32 float
// accumulators there spills); 8 accumulators for scalar loads, whose indexing
// takes more registers. With these budgets ptxas (CUDA 13) spills nothing on
// sm_90; on sm_80 the three normalize_backward kernels of the scalar-load
// fallback (rows whose length is not a multiple of a 16-byte vector) that
// cache 8 vectors spill 4 to 16 bytes. Recheck with -Xptxas -v after a change.
enum class Cached { NormalizeForward, TwoOperands };
template <typename scalar_t>
constexpr int cached_iters(Cached kind, int vec) {
  if (kind == Cached::NormalizeForward && vec == 1) return max_cached_iters<scalar_t>(1, 4);
  return max_cached_iters<scalar_t>(vec, 2);
}

__device__ __forceinline__ float magnitude(float x) { return ::fabsf(x); }
__device__ __forceinline__ double magnitude(double x) { return ::fabs(x); }

// Loads the thread's vectors of a row into registers: vector vi = it * G + t
// for it < kIters. Vectors past the row (or of a row past the end) hold 0,
// which leaves the largest magnitude unchanged; the sums skip them.
template <int kIters, int kVec, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_row(const scalar_t* row, bool active, int G, int t,
                                         int64_t nvec, acc_t (&x)[kIters][kVec]) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int64_t vi = static_cast<int64_t>(it) * G + t;
    if (active && vi < nvec) {
      load_acc<kVec>(row + vi * kVec, x[it]);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) x[it][i] = acc_t(0);
    }
  }
}

template <int kVec, typename acc_t>
__device__ __forceinline__ acc_t vector_amax(acc_t amax, const acc_t (&x)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) amax = max_keep_nan(amax, magnitude(x[i]));
  return amax;
}

// sum(scaled_entry(x, p)^2) over one vector, added to `ssq` (one rounding
// per term: multiply_add, as the warp kernels' unscaled sums).
template <int kVec, typename acc_t>
__device__ __forceinline__ acc_t vector_ssq(acc_t ssq, const acc_t (&x)[kVec], acc_t p) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const acc_t s = scaled_entry(x[i], p);
    ssq = multiply_add(s, s, ssq);
  }
  return ssq;
}

// The three sums of a cosine similarity over one vector of x1 and x2:
// sums[0] += s1^2, sums[1] += s2^2, sums[2] += s1 * s2 (s = scaled_entry).
template <int kVec, typename acc_t>
__device__ __forceinline__ void pair_sums(acc_t (&sums)[3], const acc_t (&a)[kVec],
                                          const acc_t (&b)[kVec], acc_t p1, acc_t p2) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const acc_t s1 = scaled_entry(a[i], p1);
    const acc_t s2 = scaled_entry(b[i], p2);
    sums[0] = multiply_add(s1, s1, sums[0]);
    sums[1] = multiply_add(s2, s2, sums[1]);
    sums[2] = multiply_add(s1, s2, sums[2]);
  }
}

// ---------------------------------------------------------------------------
// normalize forward.

template <int kVec, typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_normalized(scalar_t* y_row, int64_t vi, const acc_t (&x)[kVec],
                                                 acc_t p, acc_t divisor, acc_t q) {
  acc_t y[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) y[i] = normalized_entry(scaled_entry(x[i], p), divisor, q);
  store_acc<kVec>(y_row + vi * kVec, y);
}

template <typename scalar_t, int kVec, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    normalize_forward_kernel(const scalar_t* __restrict__ input, scalar_t* __restrict__ output,
                             acc_of_t<scalar_t>* __restrict__ stats, int64_t rows, int64_t d,
                             acc_of_t<scalar_t> eps, int G) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t partial[kMaxWarps];
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = d / kVec;  // the launcher picks kVec > 1 only when kVec divides d
  constexpr int kCached = kIters > 0 ? kIters : 1;

  // `base` is the same for the whole block, so every thread runs every
  // iteration and reaches every __syncthreads of group_reduce.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const scalar_t* x_row = input + (active ? row : 0) * d;

    // Pass 1: the largest magnitude.
    acc_t x[kCached][kVec];
    acc_t amax[1] = {acc_t(0)};
    if constexpr (kIters > 0) {
      load_row(x_row, active, G, t, nvec, x);
#pragma unroll
      for (int it = 0; it < kIters; ++it) amax[0] = vector_amax(amax[0], x[it]);
    } else {
      for (int64_t vi = t; active && vi < nvec; vi += G) {
        load_acc<kVec>(x_row + vi * kVec, x[0]);
        amax[0] = vector_amax(amax[0], x[0]);
      }
    }
    group_reduce(amax, G, partial, MaxKeepNanOp{});
    const acc_t p = norm_scale(amax[0]);

    // Pass 2: the sum of squares of the scaled entries.
    acc_t ssq[1] = {acc_t(0)};
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        if (static_cast<int64_t>(it) * G + t < nvec) ssq[0] = vector_ssq(ssq[0], x[it], p);
      }
    } else {
      for (int64_t vi = t; active && vi < nvec; vi += G) {
        load_acc<kVec>(x_row + vi * kVec, x[0]);
        ssq[0] = vector_ssq(ssq[0], x[0], p);
      }
    }
    group_reduce(ssq, G, partial, SumOp{});
    if (!active) continue;  // after the block-wide reductions

    const NormFactors<acc_t> f = norm_factors(p, ssq[0], eps);
    const acc_t q = f.q;
    const acc_t divisor = unit_divisor(f.divisor, p, amax[0]);
    if (t == 0) {
      stats[2 * row] = p;
      stats[2 * row + 1] = f.grad_factor;
    }
    scalar_t* y_row = output + row * d;
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t vi = static_cast<int64_t>(it) * G + t;
        if (vi < nvec) store_normalized(y_row, vi, x[it], p, divisor, q);
      }
    } else {
      for (int64_t vi = t; vi < nvec; vi += G) {
        load_acc<kVec>(x_row + vi * kVec, x[0]);
        store_normalized(y_row, vi, x[0], p, divisor, q);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// normalize backward: dot = sum(g * y) per row, then normalize_grad_value.

template <int kVec, typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_normalize_grad(scalar_t* d_row, int64_t vi,
                                                     const acc_t (&g)[kVec], const acc_t (&y)[kVec],
                                                     GradSum<acc_t> dot, acc_t p,
                                                     acc_t grad_factor) {
  acc_t dx[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    dx[i] = saturate(normalize_grad_value(g[i], y[i], dot, p, grad_factor),
                              largest_finite<scalar_t>());
  }
  store_acc<kVec>(d_row + vi * kVec, dx);
}

// dot[0] += sum(g * y) and dot[1] += the same at the scale 2^-64 (GradSum).
template <int kVec, typename acc_t>
__device__ __forceinline__ void accumulate_dots(acc_t (&dot)[2], const acc_t (&g)[kVec],
                                                const acc_t (&y)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    dot[0] += g[i] * y[i];
    dot[1] += (g[i] * grad_sum_scale<acc_t>()) * y[i];
  }
}

template <typename scalar_t, int kVec, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    normalize_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ output,
                              const acc_of_t<scalar_t>* __restrict__ stats,
                              scalar_t* __restrict__ grad_input, int64_t rows, int64_t d, int G) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t partial[kMaxWarps * 2];
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = d / kVec;
  constexpr int kCached = kIters > 0 ? kIters : 1;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const int64_t offset = (active ? row : 0) * d;
    const scalar_t* g_row = grad + offset;
    const scalar_t* y_row = output + offset;

    acc_t g[kCached][kVec], y[kCached][kVec];
    // dot = sum(g * y), and at the scale 2^-64 (a GradSum: the plain one may
    // overflow for g near the largest value).
    acc_t dot[2] = {acc_t(0), acc_t(0)};
    if constexpr (kIters > 0) {
      load_row(g_row, active, G, t, nvec, g);
      load_row(y_row, active, G, t, nvec, y);
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        if (static_cast<int64_t>(it) * G + t < nvec) accumulate_dots(dot, g[it], y[it]);
      }
    } else {
      for (int64_t vi = t; active && vi < nvec; vi += G) {
        load_acc<kVec>(g_row + vi * kVec, g[0]);
        load_acc<kVec>(y_row + vi * kVec, y[0]);
        accumulate_dots(dot, g[0], y[0]);
      }
    }
    group_reduce(dot, G, partial, SumOp{});
    if (!active) continue;  // after the block-wide reduction

    const GradSum<acc_t> dots{dot[0], dot[1]};
    const acc_t p = stats[2 * row];
    const acc_t grad_factor = stats[2 * row + 1];
    scalar_t* d_row = grad_input + row * d;
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int64_t vi = static_cast<int64_t>(it) * G + t;
        if (vi < nvec) store_normalize_grad(d_row, vi, g[it], y[it], dots, p, grad_factor);
      }
    } else {
      for (int64_t vi = t; vi < nvec; vi += G) {
        load_acc<kVec>(g_row + vi * kVec, g[0]);
        load_acc<kVec>(y_row + vi * kVec, y[0]);
        store_normalize_grad(d_row, vi, g[0], y[0], dots, p, grad_factor);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// cosine_similarity forward.

// A row's similarity and its kCosineStats statistics (p, q, unit_divisor,
// grad_factor of each vector) from its largest magnitudes, scales and scaled
// sums (ssq1, ssq2, dot).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void write_similarity(scalar_t* output, acc_t* stats, int64_t row,
                                                 acc_t amax1, acc_t amax2, acc_t p1, acc_t p2,
                                                 const acc_t (&sums)[3], acc_t eps) {
  output[row] = FromAcc<scalar_t>::cast(cosine_row(sums[2], p1, sums[0], amax1, p2, sums[1], amax2,
                                                   eps, stats + kCosineStats * row));
}

template <typename scalar_t, int kVec, int kIters>
__global__ void __launch_bounds__(kMaxThreads)
    cosine_forward_kernel(const scalar_t* __restrict__ x1, const scalar_t* __restrict__ x2,
                          scalar_t* __restrict__ output, acc_of_t<scalar_t>* __restrict__ stats,
                          int64_t rows, int64_t d, acc_of_t<scalar_t> eps, int G) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t partial[kMaxWarps * 3];
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = d / kVec;
  constexpr int kCached = kIters > 0 ? kIters : 1;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const int64_t offset = (active ? row : 0) * d;
    const scalar_t* a_row = x1 + offset;
    const scalar_t* b_row = x2 + offset;

    // Pass 1: the largest magnitudes of both vectors.
    acc_t a[kCached][kVec], b[kCached][kVec];
    acc_t amax[2] = {acc_t(0), acc_t(0)};
    if constexpr (kIters > 0) {
      load_row(a_row, active, G, t, nvec, a);
      load_row(b_row, active, G, t, nvec, b);
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        amax[0] = vector_amax(amax[0], a[it]);
        amax[1] = vector_amax(amax[1], b[it]);
      }
    } else {
      for (int64_t vi = t; active && vi < nvec; vi += G) {
        load_acc<kVec>(a_row + vi * kVec, a[0]);
        load_acc<kVec>(b_row + vi * kVec, b[0]);
        amax[0] = vector_amax(amax[0], a[0]);
        amax[1] = vector_amax(amax[1], b[0]);
      }
    }
    group_reduce(amax, G, partial, MaxKeepNanOp{});
    const acc_t p1 = norm_scale(amax[0]);
    const acc_t p2 = norm_scale(amax[1]);

    // Pass 2: ssq1, ssq2 and the scaled dot product.
    acc_t sums[3] = {acc_t(0), acc_t(0), acc_t(0)};
    if constexpr (kIters > 0) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        if (static_cast<int64_t>(it) * G + t < nvec) pair_sums(sums, a[it], b[it], p1, p2);
      }
    } else {
      for (int64_t vi = t; active && vi < nvec; vi += G) {
        load_acc<kVec>(a_row + vi * kVec, a[0]);
        load_acc<kVec>(b_row + vi * kVec, b[0]);
        pair_sums(sums, a[0], b[0], p1, p2);
      }
    }
    group_reduce(sums, G, partial, SumOp{});

    if (active && t == 0) write_similarity(output, stats, row, amax[0], amax[1], p1, p2, sums, eps);
  }
}

// ---------------------------------------------------------------------------
// cosine_similarity backward: elementwise given the row's statistics, its
// incoming gradient and its similarity; no reduction, so no block-wide sync.

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
    cosine_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ x1,
                           const scalar_t* __restrict__ x2, const scalar_t* __restrict__ output,
                           const acc_of_t<scalar_t>* __restrict__ stats,
                           scalar_t* __restrict__ grad_x1, scalar_t* __restrict__ grad_x2,
                           int64_t rows, int64_t d, int G) {
  using acc_t = acc_of_t<scalar_t>;
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = d / kVec;

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * groups + group; row < rows;
       row += static_cast<int64_t>(gridDim.x) * groups) {
    const acc_t* st = stats + kCosineStats * row;
    const acc_t p1 = st[0], q1 = st[1], divisor1 = st[2], gf1 = st[3];
    const acc_t p2 = st[4], q2 = st[5], divisor2 = st[6], gf2 = st[7];
    const acc_t g = to_acc(grad[row]);
    const acc_t c = to_acc(output[row]);
    const int64_t offset = row * d;
    for (int64_t vi = t; vi < nvec; vi += G) {
      acc_t a[kVec], b[kVec], da[kVec], db[kVec];
      load_acc<kVec>(x1 + offset + vi * kVec, a);
      load_acc<kVec>(x2 + offset + vi * kVec, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const acc_t v1 = normalized_entry(scaled_entry(a[i], p1), divisor1, q1);
        const acc_t v2 = normalized_entry(scaled_entry(b[i], p2), divisor2, q2);
        da[i] = saturate(cosine_grad_value(g, v1, v2, c, p1, gf1),
                                  largest_finite<scalar_t>());
        db[i] = saturate(cosine_grad_value(g, v2, v1, c, p2, gf2),
                                  largest_finite<scalar_t>());
      }
      store_acc<kVec>(grad_x1 + offset + vi * kVec, da);
      store_acc<kVec>(grad_x2 + offset + vi * kVec, db);
    }
  }
}

// ---------------------------------------------------------------------------
// Warp-per-row forwards (many rows of more than 32 vectors). A warp reads its
// row once, taking each vector's largest magnitude (as magnitude_bits) and
// the unscaled sums at the same time. When unscaled_sums_exact holds for the
// row's vectors (the usual case), the scaled sums are those times p^2 (p1 *
// p2 for the dot product), exactly; otherwise (NaN, infinite, zero, tiny or
// huge vectors) the row is read again and its scaled entries summed, as in
// the group kernels. After the butterfly every lane holds the row's totals,
// so the branch is uniform over the warp and no block-wide sync is needed.
// Against the group kernels: one reduction instead of two, no scaled_entry
// per element, and a row's fixed costs (its scales, factors, statistics)
// spread over a warp's 32 lanes only; those kernels were bound by issued
// instructions, not by memory (Nsight Compute, H200: 81-85% of issue slots
// busy at 31-42% of DRAM bandwidth).

constexpr int kWarpRowThreads = 256;

// A warp's rows: the first, then every `stride`-th (the grid's warp count).
// A row is the same for the whole warp, so every lane runs every iteration
// and the warp's shuffles see all 32 lanes.
struct WarpRows {
  int lane;
  int64_t first;
  int64_t stride;
};

__device__ __forceinline__ WarpRows warp_rows_of_thread() {
  const int64_t warps_per_block = blockDim.x / kWarp;
  return WarpRows{static_cast<int>(threadIdx.x % kWarp),
                  static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / kWarp,
                  static_cast<int64_t>(gridDim.x) * warps_per_block};
}

// The unscaled sums of one vector of x1 and x2 and their largest magnitudes.
template <int kVec, typename acc_t, typename bits_t>
__device__ __forceinline__ void unscaled_pair_sums(acc_t (&sums)[3], bits_t (&amax)[2],
                                                   const acc_t (&a)[kVec],
                                                   const acc_t (&b)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    amax[0] = MaxOp{}(amax[0], magnitude_bits(a[i]));
    amax[1] = MaxOp{}(amax[1], magnitude_bits(b[i]));
    sums[0] = multiply_add(a[i], a[i], sums[0]);
    sums[1] = multiply_add(b[i], b[i], sums[1]);
    sums[2] = multiply_add(a[i], b[i], sums[2]);
  }
}

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kWarpRowThreads)
    cosine_forward_warp_kernel(const scalar_t* __restrict__ x1, const scalar_t* __restrict__ x2,
                               scalar_t* __restrict__ output,
                               acc_of_t<scalar_t>* __restrict__ stats, int64_t rows, int64_t d,
                               acc_of_t<scalar_t> eps) {
  using acc_t = acc_of_t<scalar_t>;
  using bits_t = magnitude_bits_t<acc_t>;
  const WarpRows w = warp_rows_of_thread();
  const int lane = w.lane;
  const int64_t nvec = d / kVec;
  for (int64_t row = w.first; row < rows; row += w.stride) {
    const scalar_t* a_row = x1 + row * d;
    const scalar_t* b_row = x2 + row * d;
    acc_t sums[3] = {acc_t(0), acc_t(0), acc_t(0)};
    bits_t amax_bits[2] = {0, 0};
#pragma unroll 4
    for (int64_t vi = lane; vi < nvec; vi += kWarp) {
      acc_t a[kVec], b[kVec];
      load_acc<kVec>(a_row + vi * kVec, a);
      load_acc<kVec>(b_row + vi * kVec, b);
      unscaled_pair_sums(sums, amax_bits, a, b);
    }
    group_reduce(amax_bits, kWarp, static_cast<bits_t*>(nullptr), MaxOp{});
    group_reduce(sums, kWarp, static_cast<acc_t*>(nullptr), SumOp{});
    const acc_t amax1 = magnitude_from_bits(amax_bits[0]);
    const acc_t amax2 = magnitude_from_bits(amax_bits[1]);
    const acc_t p1 = norm_scale(amax1);
    const acc_t p2 = norm_scale(amax2);
    if (unscaled_sums_exact(amax1) && unscaled_sums_exact(amax2)) {
      sums[0] *= p1 * p1;
      sums[1] *= p2 * p2;
      sums[2] *= p1 * p2;
    } else {  // the rules' vectors: the scaled sums (scaled_entry), read again
      sums[0] = sums[1] = sums[2] = acc_t(0);
      for (int64_t vi = lane; vi < nvec; vi += kWarp) {
        acc_t a[kVec], b[kVec];
        load_acc<kVec>(a_row + vi * kVec, a);
        load_acc<kVec>(b_row + vi * kVec, b);
        pair_sums(sums, a, b, p1, p2);
      }
      group_reduce(sums, kWarp, static_cast<acc_t*>(nullptr), SumOp{});
    }
    if (lane == 0) write_similarity(output, stats, row, amax1, amax2, p1, p2, sums, eps);
  }
}

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kWarpRowThreads)
    normalize_forward_warp_kernel(const scalar_t* __restrict__ input,
                                  scalar_t* __restrict__ output,
                                  acc_of_t<scalar_t>* __restrict__ stats, int64_t rows, int64_t d,
                                  acc_of_t<scalar_t> eps) {
  using acc_t = acc_of_t<scalar_t>;
  using bits_t = magnitude_bits_t<acc_t>;
  const WarpRows w = warp_rows_of_thread();
  const int lane = w.lane;
  const int64_t nvec = d / kVec;
  for (int64_t row = w.first; row < rows; row += w.stride) {
    const scalar_t* x_row = input + row * d;
    acc_t ssq[1] = {acc_t(0)};
    bits_t amax_bits[1] = {0};
#pragma unroll 4
    for (int64_t vi = lane; vi < nvec; vi += kWarp) {
      acc_t x[kVec];
      load_acc<kVec>(x_row + vi * kVec, x);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        amax_bits[0] = MaxOp{}(amax_bits[0], magnitude_bits(x[i]));
        ssq[0] = multiply_add(x[i], x[i], ssq[0]);
      }
    }
    group_reduce(amax_bits, kWarp, static_cast<bits_t*>(nullptr), MaxOp{});
    group_reduce(ssq, kWarp, static_cast<acc_t*>(nullptr), SumOp{});
    const acc_t amax = magnitude_from_bits(amax_bits[0]);
    const acc_t p = norm_scale(amax);
    const bool exact = unscaled_sums_exact(amax);
    if (exact) {
      ssq[0] *= p * p;
    } else {  // the rules' vectors: the scaled sum (scaled_entry), read again
      ssq[0] = acc_t(0);
      for (int64_t vi = lane; vi < nvec; vi += kWarp) {
        acc_t x[kVec];
        load_acc<kVec>(x_row + vi * kVec, x);
        ssq[0] = vector_ssq(ssq[0], x, p);
      }
      group_reduce(ssq, kWarp, static_cast<acc_t*>(nullptr), SumOp{});
    }
    const NormFactors<acc_t> f = norm_factors(p, ssq[0], eps);
    const acc_t q = f.q;
    const acc_t divisor = unit_divisor(f.divisor, p, amax);
    if (lane == 0) {
      stats[2 * row] = p;
      stats[2 * row + 1] = f.grad_factor;
    }
    // The row again (from cache: the warp has just read it).
    scalar_t* y_row = output + row * d;
    if (exact) {
      // scaled_entry(x, p) == x * p for these vectors (p is finite and nonzero).
#pragma unroll 4
      for (int64_t vi = lane; vi < nvec; vi += kWarp) {
        acc_t x[kVec];
        load_acc<kVec>(x_row + vi * kVec, x);
#pragma unroll
        for (int i = 0; i < kVec; ++i) x[i] = normalized_entry(x[i] * p, divisor, q);
        store_acc<kVec>(y_row + vi * kVec, x);
      }
    } else {
      for (int64_t vi = lane; vi < nvec; vi += kWarp) {
        acc_t x[kVec];
        load_acc<kVec>(x_row + vi * kVec, x);
        store_normalized(y_row, vi, x, p, divisor, q);
      }
    }
  }
}

// normalize backward, a warp per row: dot = sum(g * y) (and at the scale
// 2^-64: a GradSum) in one pass, one warp reduction, then the row again (from
// cache) for normalize_grad_value per entry; no block-wide sync.
template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kWarpRowThreads)
    normalize_backward_warp_kernel(const scalar_t* __restrict__ grad,
                                   const scalar_t* __restrict__ output,
                                   const acc_of_t<scalar_t>* __restrict__ stats,
                                   scalar_t* __restrict__ grad_input, int64_t rows, int64_t d) {
  using acc_t = acc_of_t<scalar_t>;
  const WarpRows w = warp_rows_of_thread();
  const int64_t nvec = d / kVec;
  for (int64_t row = w.first; row < rows; row += w.stride) {
    const scalar_t* g_row = grad + row * d;
    const scalar_t* y_row = output + row * d;
    acc_t dot[2] = {acc_t(0), acc_t(0)};
#pragma unroll 4
    for (int64_t vi = w.lane; vi < nvec; vi += kWarp) {
      acc_t g[kVec], y[kVec];
      load_acc<kVec>(g_row + vi * kVec, g);
      load_acc<kVec>(y_row + vi * kVec, y);
      accumulate_dots(dot, g, y);
    }
    group_reduce(dot, kWarp, static_cast<acc_t*>(nullptr), SumOp{});
    const GradSum<acc_t> dots{dot[0], dot[1]};
    const acc_t p = stats[2 * row];
    const acc_t grad_factor = stats[2 * row + 1];
    scalar_t* d_row = grad_input + row * d;
#pragma unroll 4
    for (int64_t vi = w.lane; vi < nvec; vi += kWarp) {
      acc_t g[kVec], y[kVec];
      load_acc<kVec>(g_row + vi * kVec, g);
      load_acc<kVec>(y_row + vi * kVec, y);
      store_normalize_grad(d_row, vi, g, y, dots, p, grad_factor);
    }
  }
}

// Whether the warp-per-row kernels (the forwards, normalize's backward) take a problem: rows of more than a
// warp's vectors (shorter rows share a warp in the group kernels), up to 64
// vectors per lane (longer rows want more threads per row), and enough rows
// to give every SM many warps. The emulated plain and grid_capped variants
// lower the row count (to 1 and 64), so that both kernels run under the suite.
NANFREE_CUDA_LIMIT(kWarpRowsMin, 4096);
inline bool warp_rows(int64_t rows, int64_t nvec) {
  return nvec > kWarp && nvec <= 64 * kWarp && rows >= kWarpRowsMin;
}

inline int warp_row_blocks(int64_t rows) {
  const int64_t blocks = ceil_div(rows, kWarpRowThreads / kWarp);
  return static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// ---------------------------------------------------------------------------
// cos_sim_matrix: cosine_clamp of each element, in place (NaN stays NaN).

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
    clamp_cosines_kernel(scalar_t* __restrict__ data, int64_t n) {
  using acc_t = acc_of_t<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / kVec;
  for (int64_t vi = first; vi < nvec; vi += stride) {
    acc_t v[kVec];
    load_acc<kVec>(data + vi * kVec, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = cosine_clamp(v[i]);
    store_acc<kVec>(data + vi * kVec, v);
  }
  // The n % kVec elements past the last whole vector, one per thread.
  for (int64_t i = nvec * kVec + first; i < n; i += stride) {
    acc_t v[1];
    load_acc<1>(data + i, v);
    v[0] = cosine_clamp(v[0]);
    store_acc<1>(data + i, v);
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t normalize_forward(const scalar_t* input, scalar_t* output, acc_of_t<scalar_t>* stats,
                              int64_t rows, int64_t d, double eps, cudaStream_t stream) {
  using acc_t = acc_of_t<scalar_t>;
  // d == 0 still launches: the statistics of empty vectors are written.
  if (rows <= 0 || d < 0) return cudaSuccess;
  const acc_t eps_acc = effective_eps(static_cast<acc_t>(eps));
  const bool vec = d % vec_width<scalar_t>() == 0 && aligned16(input) && aligned16(output);
  if (warp_rows(rows, d / (vec ? vec_width<scalar_t>() : 1))) {
    return dispatch_vec<scalar_t>(vec, [&](auto vec_c) {
      constexpr int kVec = decltype(vec_c)::value;
      normalize_forward_warp_kernel<scalar_t, kVec>
          <<<warp_row_blocks(rows), kWarpRowThreads, 0, stream>>>(input, output, stats, rows, d,
                                                                 eps_acc);
      return cudaGetLastError();
    });
  }
  const Plan p = reduction_plan<scalar_t>(rows, d, vec, cached_iters<scalar_t>(Cached::NormalizeForward, vec ? vec_width<scalar_t>() : 1));
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    constexpr int kMaxIters = cached_iters<scalar_t>(Cached::NormalizeForward, kVec);
    return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
      constexpr int kIters = decltype(iters_c)::value;
      normalize_forward_kernel<scalar_t, kVec, kIters><<<p.blocks, p.threads, 0, stream>>>(
          input, output, stats, rows, d, eps_acc, p.group);
      return cudaGetLastError();
    });
  });
}

template <typename scalar_t>
cudaError_t normalize_backward(const scalar_t* grad, const scalar_t* output,
                               const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                               int64_t rows, int64_t d, cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  const bool vec = d % vec_width<scalar_t>() == 0 && aligned16(grad) && aligned16(output) &&
                   aligned16(grad_input);
  if (warp_rows(rows, d / (vec ? vec_width<scalar_t>() : 1))) {
    return dispatch_vec<scalar_t>(vec, [&](auto vec_c) {
      constexpr int kVec = decltype(vec_c)::value;
      normalize_backward_warp_kernel<scalar_t, kVec>
          <<<warp_row_blocks(rows), kWarpRowThreads, 0, stream>>>(grad, output, stats,
                                                                 grad_input, rows, d);
      return cudaGetLastError();
    });
  }
  const Plan p = reduction_plan<scalar_t>(rows, d, vec, cached_iters<scalar_t>(Cached::TwoOperands, vec ? vec_width<scalar_t>() : 1));
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    constexpr int kMaxIters = cached_iters<scalar_t>(Cached::TwoOperands, kVec);
    return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
      constexpr int kIters = decltype(iters_c)::value;
      normalize_backward_kernel<scalar_t, kVec, kIters><<<p.blocks, p.threads, 0, stream>>>(
          grad, output, stats, grad_input, rows, d, p.group);
      return cudaGetLastError();
    });
  });
}

template <typename scalar_t>
cudaError_t cosine_forward(const scalar_t* x1, const scalar_t* x2, scalar_t* output,
                           acc_of_t<scalar_t>* stats, int64_t rows, int64_t d, double eps,
                           cudaStream_t stream) {
  using acc_t = acc_of_t<scalar_t>;
  // d == 0 still launches: similarities 0 and the statistics of empty vectors.
  if (rows <= 0 || d < 0) return cudaSuccess;
  const acc_t eps_acc = effective_eps(static_cast<acc_t>(eps));
  const bool vec = d % vec_width<scalar_t>() == 0 && aligned16(x1) && aligned16(x2);
  if (warp_rows(rows, d / (vec ? vec_width<scalar_t>() : 1))) {
    return dispatch_vec<scalar_t>(vec, [&](auto vec_c) {
      constexpr int kVec = decltype(vec_c)::value;
      cosine_forward_warp_kernel<scalar_t, kVec>
          <<<warp_row_blocks(rows), kWarpRowThreads, 0, stream>>>(x1, x2, output, stats, rows, d,
                                                                 eps_acc);
      return cudaGetLastError();
    });
  }
  const Plan p = reduction_plan<scalar_t>(rows, d, vec, cached_iters<scalar_t>(Cached::TwoOperands, vec ? vec_width<scalar_t>() : 1));
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    constexpr int kMaxIters = cached_iters<scalar_t>(Cached::TwoOperands, kVec);
    return dispatch_iters<kMaxIters>(p.iters, [&](auto iters_c) {
      constexpr int kIters = decltype(iters_c)::value;
      cosine_forward_kernel<scalar_t, kVec, kIters><<<p.blocks, p.threads, 0, stream>>>(
          x1, x2, output, stats, rows, d, eps_acc, p.group);
      return cudaGetLastError();
    });
  });
}

template <typename scalar_t>
cudaError_t cosine_backward(const scalar_t* grad, const scalar_t* x1, const scalar_t* x2,
                            const scalar_t* output, const acc_of_t<scalar_t>* stats,
                            scalar_t* grad_x1, scalar_t* grad_x2, int64_t rows, int64_t d,
                            cudaStream_t stream) {
  if (rows <= 0 || d <= 0) return cudaSuccess;
  const bool vec = d % vec_width<scalar_t>() == 0 && aligned16(x1) && aligned16(x2) &&
                   aligned16(grad_x1) && aligned16(grad_x2);
  const Plan p = elementwise_plan<scalar_t>(rows, d, vec);
  return dispatch_vec<scalar_t>(p.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    cosine_backward_kernel<scalar_t, kVec><<<p.blocks, p.threads, 0, stream>>>(
        grad, x1, x2, output, stats, grad_x1, grad_x2, rows, d, p.group);
    return cudaGetLastError();
  });
}

template <typename scalar_t>
cudaError_t clamp_cosines(scalar_t* data, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  return dispatch_vec<scalar_t>(aligned16(data), [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    const int64_t work = n / kVec > 0 ? n / kVec : 1;  // whole vectors, or the tail alone
    const int64_t blocks = ceil_div(work, kThreads);
    clamp_cosines_kernel<scalar_t, kVec>
        <<<static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks), kThreads, 0, stream>>>(
            data, n);
    return cudaGetLastError();
  });
}

NANFREE_COSINE_LAUNCHERS(, float)
NANFREE_COSINE_LAUNCHERS(, double)
NANFREE_COSINE_LAUNCHERS(, __half)
NANFREE_COSINE_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
