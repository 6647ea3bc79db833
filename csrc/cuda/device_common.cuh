// Device helpers shared by the CUDA kernels of every op family
// (<family>_kernels.cu; softmax's two files also through
// softmax_kernels_common.cuh): launch limits, element conversion to and from
// the accumulation type, 16-byte vector access, group reductions, the grid
// stride of reductions over an inner dimension, and host helpers of launch
// planning. Torch-free; included by nvcc (and the emulated CUDA build) only.
// No special-value rule lives here: those are in nanfree/*.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/device_types.h"
#include "cuda/launch_limits.h"
#include "nanfree/numerics.h"

namespace nanfree {
namespace gpu {
namespace detail {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 512;  // largest group and block
constexpr int kMinThreads = 128;  // smallest block
constexpr int kMaxWarps = kMaxThreads / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;
// Blocks of one launch; the kernels loop over the remaining rows (gridDim.x < 2^31).
// The emulated grid_capped variant takes 3, so that every grid-stride loop iterates.
NANFREE_CUDA_LIMIT(kMaxBlocks, 65536);

// The largest finite value of scalar_t, in its accumulation type (the bound of a
// saturated gradient: saturate of nanfree/numerics.h).
template <typename scalar_t>
__device__ __forceinline__ acc_of_t<scalar_t> largest_finite() {
  if constexpr (std::is_same_v<scalar_t, __half>) {
    return static_cast<float>(kFloat16Largest);
  } else if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
    return static_cast<float>(kBFloat16Largest);
  } else {
    return nf_largest<scalar_t>();
  }
}

// Elements of one 16-byte vector.
template <typename scalar_t>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(scalar_t));
}

// Vectors of `vec` elements cached per thread: 32 float or 16 double
// accumulators in all, shared by the cached operands (x in the softmax
// forward; g and y in the softmax backward). 512-thread blocks allow 128
// registers per thread; ptxas -v shows no spill in the hot loops with this budget.
template <typename scalar_t>
constexpr int max_cached_iters(int vec, int operands) {
  return (sizeof(acc_of_t<scalar_t>) == 8 ? 16 : 32) / operands / vec;
}

// ---------------------------------------------------------------------------
// Element conversion and vector access.

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename scalar_t>
struct FromAcc;
template <>
struct FromAcc<float> {
  __device__ __forceinline__ static float cast(float x) { return x; }
};
template <>
struct FromAcc<double> {
  __device__ __forceinline__ static double cast(double x) { return x; }
};
template <>
struct FromAcc<__half> {
  // Round to nearest even; inf and NaN are kept (as torch's Half(float)).
  __device__ __forceinline__ static __half cast(float x) { return __float2half_rn(x); }
};
template <>
struct FromAcc<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 cast(float x) { return __float2bfloat16_rn(x); }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Loads N consecutive elements (one N * sizeof(scalar_t)-byte access) as accumulators.
template <int N, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_acc(const scalar_t* p, acc_t (&out)[N]) {
  const Pack<scalar_t, N> pack = *reinterpret_cast<const Pack<scalar_t, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_acc(pack.v[i]);
}

template <int N, typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_acc(scalar_t* p, const acc_t (&in)[N]) {
  Pack<scalar_t, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = FromAcc<scalar_t>::cast(in[i]);
  *reinterpret_cast<Pack<scalar_t, N>*>(p) = pack;
}

template <int N, typename scalar_t>
__device__ __forceinline__ void store_zeros(scalar_t* p) {
  using acc_t = acc_of_t<scalar_t>;
  acc_t zeros[N];
#pragma unroll
  for (int i = 0; i < N; ++i) zeros[i] = acc_t(0);
  store_acc<N>(p, zeros);
}

// ---------------------------------------------------------------------------
// Group reductions: rows handled by groups of G threads (G a power of two,
// 1 .. kMaxThreads, the same for the whole block; a group wider than a warp
// is made of whole warps, and the block of whole groups).

// The larger of two magnitudes (>= 0 or NaN), NaN when either is NaN: a NaN
// entry must reach the row's statistics (fmax would drop it).
template <typename T>
__device__ __forceinline__ T max_keep_nan(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// |x|'s bits as an unsigned integer: ordered as the magnitudes, every NaN
// above +inf, so an unsigned max keeps NaN (max_keep_nan's rule) in two
// instructions instead of two comparisons and a select.
__device__ __forceinline__ uint32_t magnitude_bits(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}
__device__ __forceinline__ unsigned long long magnitude_bits(double x) {
  return static_cast<unsigned long long>(__double_as_longlong(x)) & 0x7fffffffffffffffull;
}
__device__ __forceinline__ float magnitude_from_bits(uint32_t bits) { return __uint_as_float(bits); }
__device__ __forceinline__ double magnitude_from_bits(unsigned long long bits) {
  return __longlong_as_double(static_cast<long long>(bits));
}
template <typename acc_t>
using magnitude_bits_t = decltype(magnitude_bits(acc_t(0)));

// a * b + c rounded once (the sums of squares and products: nvcc runs with
// --fmad=false, so a contraction is written where one is meant).
__device__ __forceinline__ float multiply_add(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double multiply_add(double a, double b, double c) { return __fma_rn(a, b, c); }

struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxKeepNanOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return max_keep_nan(a, b);
  }
};

// Reduces each of the N values over the G threads of every group, with a
// commutative `op` (SumOp, MaxKeepNanOp): a butterfly over the group's lanes
// (__shfl_xor_sync), then, for G > kWarp, the warps' results in shared memory
// (`partial`: kMaxWarps * N entries) combined in warp order. The order is
// fixed by G, and op(a, b) == op(b, a) bit for bit, so every thread of a
// group ends with the same values. Every thread of the block must call it
// (rows past the end too): it synchronizes the whole block when G > kWarp.
template <int N, typename T, typename Op>
__device__ __forceinline__ void group_reduce(T (&v)[N], int G, T* partial, Op op) {
  const int width = G < kWarp ? G : kWarp;
  for (int offset = width / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = op(v[k], __shfl_xor_sync(kFullMask, v[k], offset));
  }
  if (G > kWarp) {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) {
#pragma unroll
      for (int k = 0; k < N; ++k) partial[warp * N + k] = v[k];
    }
    __syncthreads();
    const int per_group = G / kWarp;
    const int first = (threadIdx.x / G) * per_group;
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = partial[first * N + k];
    for (int w = 1; w < per_group; ++w) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = op(v[k], partial[(first + w) * N + k]);
    }
    __syncthreads();  // partial is reused by the next reduction
  }
}

// ---------------------------------------------------------------------------
// Reductions over a dimension other than the last (inner > 1 in the
// [outer, n, inner] layout of nanfree/layout.h): a block holds bx consecutive
// reductions (threadIdx.x, coalesced along inner) times by slices of each
// (threadIdx.y), and walks over tiles of bx reductions with a grid stride.

// A grid stride of reductions (gridDim.x * blockDim.x) and its (o, i) steps:
// reductions == o * inner + i with i < inner. Computed on the host
// (strided_grid), so that a thread moves from tile to tile without a 64-bit
// division (a subroutine call, around which registers are spilled).
struct GridStride {
  int64_t reductions;
  int64_t o;
  int64_t i;
};

// The reduction a thread holds in the current tile: r = tile * blockDim.x +
// threadIdx.x = o * inner + i. Past the last reduction (the last tile may
// reach beyond outer * inner), o and i are meaningless and never used.
struct ReductionCursor {
  int64_t r;
  int64_t o;
  int64_t i;
};

__device__ __forceinline__ ReductionCursor first_reduction(int64_t inner) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t o = r / inner;
  return ReductionCursor{r, o, r - o * inner};
}

__device__ __forceinline__ void next_reduction(ReductionCursor& c, const GridStride& stride,
                                               int64_t inner) {
  c.r += stride.reductions;
  c.o += stride.o;
  c.i += stride.i;
  if (c.i >= inner) {  // i + stride.i < 2 inner: one carry at most
    c.i -= inner;
    ++c.o;
  }
}

// ---------------------------------------------------------------------------
// Host helpers of launch planning and template dispatch.

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// A launch over rows handled by groups of threads (the row kernels of every family).
struct Plan {
  bool vec;     // 16-byte vectors
  int iters;    // vectors cached per thread; 0: streamed
  int group;    // threads per row
  int threads;  // per block
  int blocks;
};

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline Plan finish_plan(Plan p, int64_t rows) {
  p.threads = p.group > kMinThreads ? p.group : kMinThreads;
  const int64_t blocks = ceil_div(rows, p.threads / p.group);
  p.blocks = static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
  return p;
}

// A row reduction whose threads cache at most `max_iters` vectors each: rows
// of up to 32 vectors get the smallest power-of-two group that covers them
// (several rows per warp, one vector per thread); longer rows a warp, or the
// smallest group up to 512 threads that can cache the row in registers;
// longer still, 512 threads that stream the row (iters 0).
template <typename scalar_t>
Plan reduction_plan(int64_t rows, int64_t cols, bool vec, int max_iters) {
  const int width = vec ? vec_width<scalar_t>() : 1;
  const int64_t nvec = cols / width;
  Plan p{vec, 1, 1, 0, 0};
  if (nvec <= kWarp) {
    p.group = next_pow2(nvec);
  } else {
    int group = kWarp;
    while (group < kMaxThreads && ceil_div(nvec, group) > max_iters) group *= 2;
    const int64_t need = ceil_div(nvec, group);
    p.group = group;
    p.iters = need <= max_iters ? next_pow2(need) : 0;
  }
  return finish_plan(p, rows);
}

// One pass, no reduction: a group of up to 512 threads per row.
template <typename scalar_t>
Plan elementwise_plan(int64_t rows, int64_t cols, bool vec) {
  const int64_t nvec = cols / (vec ? vec_width<scalar_t>() : 1);
  Plan p{vec, 0, 1, 0, 0};
  p.group = nvec >= kMaxThreads ? kMaxThreads : next_pow2(nvec);
  return finish_plan(p, rows);
}

// The fewest reductions a strided block holds: a warp's lanes cover at least
// one run of the inner consecutive reductions.
inline int strided_min_width(int64_t inner) { return inner < kWarp ? next_pow2(inner) : kWarp; }

// Slices per reduction (blockDim.y) of a strided launch of at most
// `block_threads` threads per block: doubled while the reductions times the
// slices leave the GPU short of `target_threads` and each slice keeps at least
// `min_entries` of the n entries (fewer would make the merges cost more than
// the entries).
inline int strided_slices(int64_t reductions, int64_t n, int64_t inner, int block_threads,
                          int64_t target_threads, int64_t min_entries) {
  const int by_max = block_threads / strided_min_width(inner);
  int by = 1;
  while (by < by_max && reductions * by < target_threads && n >= 2 * by * min_entries) by *= 2;
  return by;
}

// The blocks of a strided launch of tiles of bx reductions, and its grid stride.
struct StridedGrid {
  int blocks;
  GridStride stride;
};

inline StridedGrid strided_grid(int64_t reductions, int64_t inner, int bx) {
  const int64_t tiles = ceil_div(reductions, bx);
  const int blocks = static_cast<int>(tiles < kMaxBlocks ? tiles : kMaxBlocks);
  const int64_t step = static_cast<int64_t>(blocks) * bx;
  return StridedGrid{blocks, GridStride{step, step / inner, step % inner}};
}

// launch(std::integral_constant<int, kVec>) with kVec the 16-byte vector width, or 1.
template <typename scalar_t, typename F>
cudaError_t dispatch_vec(bool vec, F&& launch) {
  if (vec) return launch(std::integral_constant<int, vec_width<scalar_t>()>{});
  return launch(std::integral_constant<int, 1>{});
}

template <int kMax, int I = 1, typename F>
cudaError_t dispatch_iters(int iters, F&& launch) {
  if (iters == 0) return launch(std::integral_constant<int, 0>{});
  if (iters == I) return launch(std::integral_constant<int, I>{});
  if constexpr (I * 2 <= kMax) {
    return dispatch_iters<kMax, I * 2>(iters, launch);
  } else {
    return cudaErrorInvalidValue;
  }
}

}  // namespace detail
}  // namespace gpu
}  // namespace nanfree
