// CUDA kernels of GeM pooling (gem and gem_backward over dim 1 of a
// contiguous [outer, n, inner] view) and the launchers of gem_kernels.h. No
// torch header: only CUDA and nanfree/*.h, so this file compiles without
// ATen. Every rule (eps and the clamp, masks, the empty reduction, +inf, NaN,
// the clamp of a tensor p, the log-domain fallbacks, the saturated
// gradients) comes from nanfree/gem_math.h, whose functions are called per
// entry and per reduction; nanfree/_torch_backend/gem.py mirrors them. The
// generic device helpers are in device_common.cuh.
//
// The stable form (gem_math.h): with m the largest clamped kept entry of a
// reduction, mean = (1/count) sum (c / m)^p and gem = m mean^(1/p). A masked
// entry is held as the clamped value 0, below every kept one (those are >= eps
// > 0, or NaN), so it never becomes m and the sums skip it: 0 marks "no
// entry" in registers and in shared memory.
//
// Cost. Per entry the forward evaluates one gem_ratio_power (a full-accuracy
// pow: about 90 instructions with the division), the backward one pow (the
// input's weight) and, for p's gradient, a log and gem_divergence_h: the
// kernels are bound by arithmetic, not by memory, for every dtype. So the
// per-entry math is kept in rolled loops of one to four copies (a kernel
// that unrolls a pow per cached register reached 270 KB of code, beyond the
// instruction caches), and loads are 16-byte vectors only where they feed no
// pow directly (the row forward's first pass); elsewhere each thread loads
// single elements, consecutive across the lanes of a row's group (inner ==
// 1) or of a warp (inner > 1: 32 consecutive elements, whole sectors).
// ptxas (CUDA 13, sm_80 and sm_90): 32 to 64 registers and no spill for
// every float-accumulated kernel; three float64 kernels (row_backward without
// p's gradient, strided_backward with it, strided_forward on sm_80) keep 12
// to 84 bytes on the stack around their calls of the float64 pow subroutine.
// Recheck with -Xptxas -v after a change.
//
// Layout inner == 1 (rows: gem_pool2d's [B * C, H * W, 1]). A row is handled
// by a group of G threads (G a power of two, 1..512; a block of max(G, 128)
// threads holds 128 / G rows, or one row, and walks over the rows with a grid
// stride, at most kMaxBlocks blocks). G is the smallest group that leaves the
// fewest idle entry slots (G times the entries per thread) within the cache
// budget (n = 49: G = 4, 13 entries per thread; n = 196: G = 16; n = 2048
// bf16: G = 128, two vectors of 8), doubled while no slot is added and the
// rows are too few to fill the GPU.
// - Forward, rows of up to 512 x row_slots() entries (8192 for float
//   accumulation, 4096 for double): pass 1 reads the row once (vector vi of
//   kVec elements to thread vi % G; 16 bytes when n is a multiple of the
//   vector and the input is aligned), writes the clamped entries to the
//   thread's own slots in shared memory (slot s of thread t at s *
//   blockDim.x + t: no bank conflict, no synchronization) and takes their
//   maximum and count; the group's maximum m (gem_max_update, NaN sticky) by
//   group_reduce; pass 2 sums gem_ratio_power(c, m, p) over the thread's
//   slots, reduced the same way: exactly the reference's two passes.
// - Forward, longer rows (e.g. [8, 65536, 1]): a block of 512 threads per row
//   streams it once, each thread keeping an online state (m, s = sum (c /
//   m)^p) updated per batch of kBatch entries (the batch's maximum, one
//   gem_rescale_sum, then its ratio powers); the states are merged with
//   gem_merge, a butterfly in each warp and then the 16 warps' states in warp
//   order by thread 0.
// - Backward: one streamed pass over the row (input and mask read once,
//   grad_input written once); the divergence terms of p's gradient are summed
//   on the side and reduced over the group (group_reduce).
//
// Layout inner > 1 (tokens [B, L, H] reduced over L, mask [B, L, 1] expanded
// to strides (L, 1, 0)). A thread holds one reduction (o, i); a block of 256
// threads is bx x by: threadIdx.x picks one of bx consecutive reductions (a
// warp reads 32 consecutive elements of one entry row j), threadIdx.y one of
// by slices of the n entries (slice s takes j = s, s + by, ...). by is
// doubled while the threads (reductions times slices) are fewer than about
// four times what the GPU holds and every slice keeps at least
// kMinEntriesPerSlice entries, up to 256 / 32 slices when inner >= 32
// (tokens [64, 512, 768]: 49152 reductions, by = 8, bx = 32, 64 entries per
// thread, 1536 blocks). Blocks walk over the tiles of bx reductions with a
// grid stride.
// - Forward: an online state (m, s) per thread, updated per batch of kBatch
//   entries as above; the by states of a reduction are merged with gem_merge
//   in a tree over the slices in shared memory (fixed order).
// - Backward: elementwise given the reduction's stats (one pass: input and
//   mask read once, grad_input written once); the divergence terms are summed
//   per thread and added over the slices by the same tree.
//
// p's gradient (gem_backward with grad_p): each reduction's gem_p_grad, with
// D = gem_mean(sum of gem_divergence_term over its kept entries, count) and
// gem = gem_value(m, mean, p) recomputed from the stats in the accumulation
// type, is written by the thread that holds the reduction's total to
// p_grad_terms[reduction]; the binding adds those terms (in float64, scaled,
// so that the sum cannot overflow). No atomics: results do not depend on
// timing, as every sum of every kernel runs in an order fixed by the launch
// plan.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/gem_kernels.h"
#include "nanfree/gem_math.h"

namespace nanfree {
namespace gpu {
using namespace detail;
namespace {

// Threads of a block of the inner > 1 kernels (bx * by).
constexpr int kStridedThreads = 256;
// Threads (rows times group lanes) that keep an H100 busy (132 SMs x 2048
// threads; the pow's latency is hidden by other warps): groups of few rows
// are widened up to it.
constexpr int64_t kTargetThreads = int64_t(1) << 17;
// Threads (reductions times slices) the inner > 1 kernels split their work
// into: about four times what an H100 holds at once, so that the blocks of
// the last wave are a small part of the whole (the kernels are bound by
// arithmetic: an SM left with one block runs at a fraction of its rate).
constexpr int64_t kStridedTargetThreads = int64_t(1) << 19;
// Fewest entries per slice when a reduction is split for parallelism only:
// merging two states costs about one pow.
constexpr int64_t kMinEntriesPerSlice = 16;
// Entries loaded before their use in the streamed forward loops: loads in
// flight, independent pows, and one rescale per batch.
constexpr int kBatch = 4;

// Entries a thread of the row forward keeps in its shared-memory slots: 64
// bytes, so 2048 threads of an SM use 128 KB.
template <typename acc_t>
constexpr int row_slots() {
  return sizeof(acc_t) == 8 ? 8 : 16;
}

// p of the launch: a tensor p clamped (read on the device, no host sync), or
// the Python number as is.
template <typename acc_t>
__device__ __forceinline__ acc_t launch_p(const acc_t* p_tensor, acc_t p_value) {
  return p_tensor != nullptr ? gem_clamp_p(*p_tensor) : p_value;
}

struct GemMaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return gem_max_update(a, b);  // symmetric up to a NaN's payload
  }
};

// keep[k] for N entries `stride` mask elements apart, the first at `first`
// (nullptr: no mask, all kept). Bytes are read as bytes: nonzero = keep.
template <int N>
__device__ __forceinline__ void load_keep(const bool* first, int64_t stride, bool (&keep)[N]) {
  if (first == nullptr) {
#pragma unroll
    for (int k = 0; k < N; ++k) keep[k] = true;
    return;
  }
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(first);
  if (stride == 0) {  // broadcast along these entries
    const bool b = bytes[0] != 0;
#pragma unroll
    for (int k = 0; k < N; ++k) keep[k] = b;
    return;
  }
  if constexpr (N > 1) {
    if (stride == 1 && reinterpret_cast<uintptr_t>(bytes) % N == 0) {
      const Pack<unsigned char, N> pack = *reinterpret_cast<const Pack<unsigned char, N>*>(bytes);
#pragma unroll
      for (int k = 0; k < N; ++k) keep[k] = pack.v[k] != 0;
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) keep[k] = bytes[k * stride] != 0;
}

// Whether the mask keeps the entry at `at` (nullptr: no mask).
__device__ __forceinline__ bool kept_at(const bool* at) {
  return at == nullptr || *reinterpret_cast<const unsigned char*>(at) != 0;
}

// The clamped value the sums see: clamp_to_eps for a kept entry, 0 ("no
// entry") for a masked one, whatever it holds (NaN and inf included).
template <typename acc_t>
__device__ __forceinline__ acc_t clamped_or_none(acc_t x, bool keep, acc_t eps) {
  return keep ? clamp_to_eps(x, eps) : acc_t(0);
}

// Adds U clamped values (0: no entry) to the online state (m, s) of one
// reduction, s = sum (c / m)^p: the values' maximum first, the sum moved to
// the new maximum once (gem_rescale_sum, which keeps it when m is unchanged),
// then their ratio powers. The empty state (m == 0) has s == 0 and is not
// rescaled (0 * (0 / m)^p: the header's power of a 0 ratio is 0, or NaN when
// the new m is NaN, and then the NaN entry's own power makes s NaN anyway).
template <int U, typename acc_t>
__device__ __forceinline__ void push_values(acc_t& m, acc_t& s, const acc_t (&c)[U], acc_t p) {
  acc_t batch_max = acc_t(0);
#pragma unroll
  for (int u = 0; u < U; ++u) batch_max = gem_max_update(batch_max, c[u]);
  const acc_t m_new = gem_max_update(m, batch_max);
  if (m != acc_t(0)) s = gem_rescale_sum(s, m, m_new, p);
  m = m_new;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c[u] != acc_t(0)) s += gem_ratio_power(c[u], m, p);
  }
}

// gem_merge of the state (m2, s2) into (m, s), where an empty state (m == 0)
// is simply the other one. The same result as gem_merge for the states these
// kernels build (s is 0 whenever m is 0 and NaN whenever m is NaN), without
// the log and exp of its rescale of an empty sum. Symmetric but for the
// last bit (the compiler may fuse one of the two products of gem_merge's sum
// into an fma): a butterfly's lanes may end with states that differ there.
template <typename acc_t>
__device__ __forceinline__ void merge_state(acc_t& m, acc_t& s, acc_t m2, acc_t s2, acc_t p) {
  if (m2 == acc_t(0)) return;
  if (m == acc_t(0)) {
    m = m2;
    s = s2;
    return;
  }
  gem_merge(m, s, m2, s2, p);
}

// The forward's results of reduction r: output and stats (m, mean, count).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void write_reduction(scalar_t* output, acc_t* stats, int64_t r, acc_t m,
                                                acc_t sum, acc_t count, acc_t p) {
  const acc_t mean = gem_mean(sum, count);
  output[r] = FromAcc<scalar_t>::cast(gem_value(m, mean, p));
  acc_t* st = stats + 3 * r;
  st[0] = m;
  st[1] = mean;
  st[2] = count;
}

__device__ __forceinline__ float shfl_xor(float v, int offset) {
  return __shfl_xor_sync(kFullMask, v, offset);
}
__device__ __forceinline__ double shfl_xor(double v, int offset) {
  return __shfl_xor_sync(kFullMask, v, offset);
}

// ---------------------------------------------------------------------------
// Backward per entry.

// The backward's constants of one reduction, from its stats (m, mean, count)
// and incoming gradient g.
template <typename acc_t>
struct BackwardReduction {
  acc_t m;
  acc_t mean;
  acc_t count;
  acc_t g;
  acc_t a;         // pow(mean, 1/p - 1) / count: gem_input_grad_weight's factor
  acc_t log_mean;  // log(mean), for gem_divergence_term
  bool live;       // gem_has_gradient
};

template <typename acc_t>
__device__ __forceinline__ BackwardReduction<acc_t> backward_reduction(const acc_t* st, acc_t g,
                                                                       acc_t p) {
  BackwardReduction<acc_t> b;
  b.m = st[0];
  b.mean = st[1];
  b.count = st[2];
  b.g = g;
  b.live = gem_has_gradient(b.m, b.count);
  // Only a reduction with gradient uses them: an empty one has mean 0 and
  // count 0 (0 / 0 would be NaN), though nothing would read the NaN.
  b.a = b.live ? nf_pow(b.mean, acc_t(1) / p - acc_t(1)) / b.count : acc_t(0);
  b.log_mean = b.live ? nf_log(b.mean) : acc_t(0);
  return b;
}

// A reduction that is past the end of the tile: no gradient, nothing read.
template <typename acc_t>
__device__ __forceinline__ BackwardReduction<acc_t> no_reduction() {
  return BackwardReduction<acc_t>{acc_t(0), acc_t(0), acc_t(0), acc_t(0),
                                  acc_t(0), acc_t(0), false};
}

// gem_input_grad of an entry x of a reduction with gradient: g * w, 0 for a
// clamped entry. gem_input_grad_weight's direct product a * r^(p-1) with the
// reduction's factor a computed once (the same expression); where that
// product is not safe (a or r below the normal range, r^(p-1) beyond the
// type's range, NaN) the header's function computes the whole weight: the
// value the header returns in every case.
template <typename acc_t>
__device__ __forceinline__ acc_t entry_grad(const BackwardReduction<acc_t>& b, acc_t x, acc_t eps,
                                            acc_t p, acc_t pm1) {
  if (!gem_unclamped(x, eps)) return acc_t(0);  // at or below eps: the clamp passes no gradient
  const acc_t c = clamp_to_eps(x, eps);
  const acc_t r = c / b.m;
  const acc_t rp1 = nf_pow(r, pm1);
  acc_t w;
  if (b.a >= nf_tiny<acc_t>() && r >= nf_tiny<acc_t>() && rp1 <= nf_largest<acc_t>()) {
    w = b.a * rp1;
  } else {
    w = gem_input_grad_weight(c, b.m, b.mean, b.count, p);  // the log domain; NaN stays NaN
  }
  w = w > nf_largest<acc_t>() ? nf_largest<acc_t>() : w;  // as the header: a 0 g must not meet inf
  return b.g * w;
}

// d input of one entry, as the reference: 0 when masked (even for a NaN or
// inf entry) or in a reduction without gradient, else gem_input_grad
// saturated to scalar_t's range. Adds the entry's gem_divergence_term to
// `term` when kPGrad (kept entries of reductions with gradient, clamped ones
// included).
template <bool kPGrad, typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t entry_backward(const BackwardReduction<acc_t>& b, acc_t x,
                                                bool keep, acc_t eps, acc_t p, acc_t pm1,
                                                acc_t& term) {
  if (!keep || !b.live) return acc_t(0);
  if constexpr (kPGrad) term += gem_divergence_term(clamp_to_eps(x, eps), b.m, b.log_mean, p);
  return saturate(entry_grad(b, x, eps, p, pm1), largest_finite<scalar_t>());
}

// gem_p_grad of one reduction given the sum of its divergence terms; 0 for a
// reduction without gradient, whatever D and gem are there.
template <typename acc_t>
__device__ __forceinline__ acc_t reduction_p_grad(const BackwardReduction<acc_t>& b,
                                                  acc_t term_sum, acc_t p) {
  return gem_p_grad(b.g, gem_value(b.m, b.mean, p), b.m, b.count, gem_mean(term_sum, b.count), p);
}

// ---------------------------------------------------------------------------
// Forward, inner == 1, rows of up to blockDim.x * row_slots() entries: two
// passes, the row kept in the threads' shared-memory slots (`iters` vectors
// of kVec entries per thread; dynamic shared memory of blockDim.x * iters *
// kVec accumulators).

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
    row_forward_kernel(const scalar_t* __restrict__ input, MaskView mask,
                       const acc_of_t<scalar_t>* __restrict__ p_tensor,
                       acc_of_t<scalar_t> p_value, acc_of_t<scalar_t> eps,
                       scalar_t* __restrict__ output, acc_of_t<scalar_t>* __restrict__ stats,
                       int64_t rows, int64_t n, int G, int iters) {
  using acc_t = acc_of_t<scalar_t>;
  extern __shared__ __align__(16) unsigned char slots_bytes[];
  // Slot s of thread tid at slots[s * blockDim.x + tid].
  acc_t* slots = reinterpret_cast<acc_t*>(slots_bytes);
  __shared__ acc_t partial[kMaxWarps];
  __shared__ int partial_count[kMaxWarps];
  const acc_t p = launch_p(p_tensor, p_value);
  const int T = blockDim.x;
  const int groups = T / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t nvec = n / kVec;  // the launcher picks kVec > 1 only when kVec divides n
  const bool masked = mask.data != nullptr;
  acc_t* my_slots = slots + threadIdx.x;

  // `base` is the same for the whole block, so every thread runs every
  // iteration and reaches every shuffle and __syncthreads of group_reduce.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    const scalar_t* x_row = input + (active ? row : 0) * n;
    const bool* mask_row = masked ? mask.data + mask_offset(mask, active ? row : 0, 0) : nullptr;

    // Pass 1: the clamped entries into the slots, their maximum and count.
    // The thread's vectors vi = it * G + t increase with it: the first past
    // the row ends them.
    acc_t mx[1] = {acc_t(0)};
    int kept[1] = {0};
    int filled = 0;  // slots written
    for (int it = 0; it < iters; ++it) {
      const int64_t vi = static_cast<int64_t>(it) * G + t;
      if (!active || vi >= nvec) break;
      acc_t v[kVec];
      bool keep[kVec];
      load_acc<kVec>(x_row + vi * kVec, v);
      load_keep<kVec>(masked ? mask_row + vi * kVec * mask.col_stride : nullptr, mask.col_stride,
                      keep);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const acc_t c = clamped_or_none(v[k], keep[k], eps);
        my_slots[(filled + k) * T] = c;
        mx[0] = gem_max_update(mx[0], c);
        kept[0] += keep[k] ? 1 : 0;
      }
      filled += kVec;
    }
    group_reduce(mx, G, partial, GemMaxOp{});
    if (masked) group_reduce(kept, G, partial_count, SumOp{});  // `masked` is the block's
    const acc_t m = mx[0];

    // Pass 2: the sum of the kept entries' ratio powers, from the slots (the
    // thread's own: no synchronization).
    acc_t sum[1] = {acc_t(0)};
#pragma unroll 2
    for (int s = 0; s < filled; ++s) {
      const acc_t c = my_slots[s * T];
      if (c != acc_t(0)) sum[0] += gem_ratio_power(c, m, p);
    }
    group_reduce(sum, G, partial, SumOp{});
    if (!active || t != 0) continue;  // after the group-wide reductions

    // count: exact in int (n <= 512 * 16 here); n itself rounds as torch's float(n).
    const acc_t count = masked ? static_cast<acc_t>(kept[0]) : static_cast<acc_t>(n);
    write_reduction(output, stats, row, m, sum[0], count, p);
  }
}

// ---------------------------------------------------------------------------
// Forward, inner == 1, long rows: a block of kMaxThreads threads per row,
// streamed once with online states.

template <typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads)
    long_row_forward_kernel(const scalar_t* __restrict__ input, MaskView mask,
                            const acc_of_t<scalar_t>* __restrict__ p_tensor,
                            acc_of_t<scalar_t> p_value, acc_of_t<scalar_t> eps,
                            scalar_t* __restrict__ output, acc_of_t<scalar_t>* __restrict__ stats,
                            int64_t rows, int64_t n) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t warp_m[kMaxWarps];
  __shared__ acc_t warp_s[kMaxWarps];
  __shared__ long long warp_count[kMaxWarps];
  const acc_t p = launch_p(p_tensor, p_value);
  const int G = blockDim.x;  // the whole block: kMaxThreads
  const int t = threadIdx.x;
  const bool masked = mask.data != nullptr;
  const int64_t mstride = mask.col_stride;

  // `row` is the same for the whole block: every thread reaches every __syncthreads.
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const scalar_t* x_row = input + row * n;
    const bool* mask_row = masked ? mask.data + mask_offset(mask, row, 0) : nullptr;
    acc_t m = acc_t(0), s = acc_t(0);
    long long kept = 0;
    int64_t j = t;
    for (; j + (kBatch - 1) * static_cast<int64_t>(G) < n; j += kBatch * G) {
      acc_t c[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t e = j + u * static_cast<int64_t>(G);
        const bool keep = kept_at(masked ? mask_row + e * mstride : nullptr);
        c[u] = clamped_or_none(to_acc(x_row[e]), keep, eps);
        kept += keep ? 1 : 0;
      }
      push_values(m, s, c, p);
    }
    for (; j < n; j += G) {
      const bool keep = kept_at(masked ? mask_row + j * mstride : nullptr);
      const acc_t c[1] = {clamped_or_none(to_acc(x_row[j]), keep, eps)};
      kept += keep ? 1 : 0;
      push_values(m, s, c, p);
    }

    // The warp's states by a butterfly (lane 0's is the one used), then the
    // warps' in warp order by thread 0.
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
      const acc_t m2 = shfl_xor(m, offset);
      const acc_t s2 = shfl_xor(s, offset);
      kept += __shfl_xor_sync(kFullMask, kept, offset);
      merge_state(m, s, m2, s2, p);
    }
    const int warp = t / kWarp;
    if (t % kWarp == 0) {
      warp_m[warp] = m;
      warp_s[warp] = s;
      warp_count[warp] = kept;
    }
    __syncthreads();
    if (t == 0) {
      for (int w = 1; w < G / kWarp; ++w) {
        merge_state(m, s, warp_m[w], warp_s[w], p);
        kept += warp_count[w];
      }
      // An int64 count rounds to float as torch's float(count) does.
      const acc_t count = masked ? static_cast<acc_t>(kept) : static_cast<acc_t>(n);
      write_reduction(output, stats, row, m, s, count, p);
    }
    __syncthreads();  // warp_* are rewritten for the next row
  }
}

// ---------------------------------------------------------------------------
// inner > 1: one reduction per thread, slices of its n entries.

template <typename scalar_t>
__global__ void __launch_bounds__(kStridedThreads)
    strided_forward_kernel(const scalar_t* __restrict__ input, MaskView mask,
                           const acc_of_t<scalar_t>* __restrict__ p_tensor,
                           acc_of_t<scalar_t> p_value, acc_of_t<scalar_t> eps,
                           scalar_t* __restrict__ output, acc_of_t<scalar_t>* __restrict__ stats,
                           ReductionLayout layout, GridStride stride) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t slot_m[kStridedThreads];
  __shared__ acc_t slot_s[kStridedThreads];
  __shared__ long long slot_count[kStridedThreads];
  const acc_t p = launch_p(p_tensor, p_value);
  const int bx = blockDim.x;
  const int by = blockDim.y;
  const int slice = threadIdx.y;
  const int me = slice * bx + threadIdx.x;
  const int64_t n = layout.n;
  const int64_t inner = layout.inner;
  const int64_t reductions = layout.outer * inner;
  const bool masked = mask.data != nullptr;
  const int64_t x_step = by * inner;  // between a slice's consecutive entries
  const int64_t mask_step = by * mask.col_stride;

  // `first` (the tile's first reduction) is the same for the whole block, so
  // every thread runs every iteration and reaches every __syncthreads.
  ReductionCursor cur = first_reduction(inner);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * bx; first < reductions;
       first += stride.reductions, next_reduction(cur, stride, inner)) {
    const bool active = cur.r < reductions;
    acc_t m = acc_t(0), s = acc_t(0);
    long long kept = 0;
    if (active) {
      // The slice's entries j = slice, slice + by, ...: x_step elements
      // apart, their mask bytes mask_step apart.
      const scalar_t* x = input + (cur.o * n + slice) * inner + cur.i;
      const bool* mk = masked ? mask.data + mask_offset(mask, cur.o, cur.i) +
                                    slice * mask.col_stride
                              : nullptr;
      int64_t j = slice;
      for (; j + (kBatch - 1) * static_cast<int64_t>(by) < n; j += kBatch * by) {
        acc_t c[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const bool keep = kept_at(mk);
          c[u] = clamped_or_none(to_acc(*x), keep, eps);
          kept += keep ? 1 : 0;
          x += x_step;
          if (masked) mk += mask_step;
        }
        push_values(m, s, c, p);
      }
      for (; j < n; j += by) {
        const bool keep = kept_at(mk);
        const acc_t c[1] = {clamped_or_none(to_acc(*x), keep, eps)};
        kept += keep ? 1 : 0;
        x += x_step;
        if (masked) mk += mask_step;
        push_values(m, s, c, p);
      }
    }

    if (by > 1) {
      // The slices' states merged in a tree (fixed order): slice 0 ends with the reduction's.
      slot_m[me] = m;
      slot_s[me] = s;
      slot_count[me] = kept;
      __syncthreads();
      for (int half = by / 2; half > 0; half /= 2) {
        if (slice < half) {
          const int other = me + half * bx;
          merge_state(m, s, slot_m[other], slot_s[other], p);
          kept += slot_count[other];
          slot_m[me] = m;
          slot_s[me] = s;
          slot_count[me] = kept;
        }
        __syncthreads();
      }
    }

    if (active && slice == 0) {
      // An int64 count rounds to float as torch's float(count) does.
      const acc_t count = masked ? static_cast<acc_t>(kept) : static_cast<acc_t>(n);
      write_reduction(output, stats, cur.r, m, s, count, p);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, inner == 1: a group of G threads per row, one streamed pass.

template <typename scalar_t, bool kPGrad>
__global__ void __launch_bounds__(kMaxThreads)
    row_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ input,
                        MaskView mask, const acc_of_t<scalar_t>* __restrict__ p_tensor,
                        acc_of_t<scalar_t> p_value, const acc_of_t<scalar_t>* __restrict__ stats,
                        acc_of_t<scalar_t> eps, scalar_t* __restrict__ grad_input,
                        acc_of_t<scalar_t>* __restrict__ p_grad_terms, int64_t rows, int64_t n, int G) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t partial[kMaxWarps];
  const acc_t p = launch_p(p_tensor, p_value);
  const acc_t pm1 = p - acc_t(1);
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const bool masked = mask.data != nullptr;
  const int64_t mstride = mask.col_stride;

  // `base` is the same for the whole block (group_reduce, below).
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + group;
    const bool active = row < rows;
    acc_t term = acc_t(0);  // the sum of gem_divergence_term over the thread's entries
    const BackwardReduction<acc_t> b =
        active ? backward_reduction(stats + 3 * row, to_acc(grad[row]), p) : no_reduction<acc_t>();
    if (active) {
      const scalar_t* x_row = input + row * n;
      scalar_t* d_row = grad_input + row * n;
      const bool* mask_row = masked ? mask.data + mask_offset(mask, row, 0) : nullptr;
      if (b.live) {
#pragma unroll 2
        for (int64_t j = t; j < n; j += G) {
          const bool keep = kept_at(masked ? mask_row + j * mstride : nullptr);
          const acc_t d =
              entry_backward<kPGrad, scalar_t>(b, to_acc(x_row[j]), keep, eps, p, pm1, term);
          d_row[j] = FromAcc<scalar_t>::cast(d);
        }
      } else {
        // An empty reduction or one with a +inf entry passes no gradient: zeros, nothing read.
        for (int64_t j = t; j < n; j += G) d_row[j] = FromAcc<scalar_t>::cast(acc_t(0));
      }
    }
    if constexpr (kPGrad) {
      acc_t total[1] = {term};
      group_reduce(total, G, partial, SumOp{});
      if (active && t == 0) p_grad_terms[row] = reduction_p_grad(b, total[0], p);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward, inner > 1: elementwise over the block's reductions and slices.

template <typename scalar_t, bool kPGrad>
__global__ void __launch_bounds__(kStridedThreads)
    strided_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ input,
                            MaskView mask, const acc_of_t<scalar_t>* __restrict__ p_tensor,
                            acc_of_t<scalar_t> p_value,
                            const acc_of_t<scalar_t>* __restrict__ stats, acc_of_t<scalar_t> eps,
                            scalar_t* __restrict__ grad_input,
                            acc_of_t<scalar_t>* __restrict__ p_grad_terms, ReductionLayout layout,
                            GridStride stride) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t slot[kPGrad ? kStridedThreads : 1];
  const acc_t p = launch_p(p_tensor, p_value);
  const acc_t pm1 = p - acc_t(1);
  const int bx = blockDim.x;
  const int by = blockDim.y;
  const int slice = threadIdx.y;
  const int me = slice * bx + threadIdx.x;
  const int64_t n = layout.n;
  const int64_t inner = layout.inner;
  const int64_t reductions = layout.outer * inner;
  const bool masked = mask.data != nullptr;
  const int64_t x_step = by * inner;
  const int64_t mask_step = by * mask.col_stride;

  // `first` is the same for the whole block (the slices' tree synchronizes it).
  ReductionCursor cur = first_reduction(inner);
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * bx; first < reductions;
       first += stride.reductions, next_reduction(cur, stride, inner)) {
    const bool active = cur.r < reductions;
    const BackwardReduction<acc_t> b = active
                                           ? backward_reduction(stats + 3 * cur.r,
                                                                to_acc(grad[cur.r]), p)
                                           : no_reduction<acc_t>();
    acc_t term = acc_t(0);
    if (active) {
      const int64_t offset = (cur.o * n + slice) * inner + cur.i;  // the slice's first entry
      const scalar_t* x = input + offset;
      scalar_t* d = grad_input + offset;
      if (b.live) {
        const bool* mk = masked ? mask.data + mask_offset(mask, cur.o, cur.i) +
                                      slice * mask.col_stride
                                : nullptr;
#pragma unroll 2
        for (int64_t j = slice; j < n; j += by) {
          const acc_t v = entry_backward<kPGrad, scalar_t>(b, to_acc(*x), kept_at(mk), eps, p,
                                                           pm1, term);
          *d = FromAcc<scalar_t>::cast(v);
          x += x_step;
          d += x_step;
          if (masked) mk += mask_step;
        }
      } else {
        // An empty reduction or one with a +inf entry passes no gradient: zeros, nothing read.
        for (int64_t j = slice; j < n; j += by, d += x_step) *d = FromAcc<scalar_t>::cast(acc_t(0));
      }
    }
    if constexpr (kPGrad) {
      if (by > 1) {
        // The slices' sums added in a tree (fixed order): slice 0 ends with the total.
        slot[me] = term;
        __syncthreads();
        for (int half = by / 2; half > 0; half /= 2) {
          if (slice < half) {
            term += slot[me + half * bx];
            slot[me] = term;
          }
          __syncthreads();
        }
      }
      if (active && slice == 0) p_grad_terms[cur.r] = reduction_p_grad(b, term, p);
    }
  }
}

// ---------------------------------------------------------------------------
// Launch planning (host).

// inner == 1: a group of `group` threads per row; the forward caches `iters`
// vectors per thread in shared memory, or (iters == 0) streams the row with a
// block of kMaxThreads threads. The backward streams its rows with the group
// of the plan for scalar loads.
struct RowPlan {
  bool vec;
  int iters;
  int group;
  int threads;
  int blocks;
};

template <typename scalar_t>
RowPlan row_plan(int64_t rows, int64_t n, bool vec) {
  const int width = vec ? vec_width<scalar_t>() : 1;
  const int cap = row_slots<acc_of_t<scalar_t>>() / width;  // vectors per thread
  const int64_t nvec = n / width;
  RowPlan p{vec, 0, kMaxThreads, 0, 0};
  if (nvec == 0) {
    p.group = 1;  // empty rows: the forward writes their results, one thread each
  } else if (nvec <= static_cast<int64_t>(cap) * kMaxThreads) {
    // The smallest group with the fewest idle vector slots (group times the
    // vectors per thread) within the cache budget.
    int best = 0;
    int64_t best_slots = 0;
    for (int g = 1; g <= kMaxThreads; g *= 2) {
      const int64_t need = ceil_div(nvec, g);
      if (need > cap) continue;
      if (best == 0 || need * g < best_slots) {
        best = g;
        best_slots = need * g;
      }
    }
    // Wider groups where the rows are too few to fill the GPU, while no slot is added.
    while (best < kMaxThreads && rows * best < kTargetThreads &&
           ceil_div(nvec, 2 * best) * 2 * best <= best_slots)
      best *= 2;
    p.group = best;
    p.iters = static_cast<int>(ceil_div(nvec, best));
  }
  p.threads = p.group > kMinThreads ? p.group : kMinThreads;
  const int64_t blocks = ceil_div(rows, p.threads / p.group);
  p.blocks = static_cast<int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
  return p;
}

// inner > 1: blocks of bx reductions x by slices (bx * by == kStridedThreads).
struct StridedPlan {
  int bx;
  int by;
  StridedGrid grid;
};

inline StridedPlan strided_plan(const ReductionLayout& layout) {
  const int by = strided_slices(layout.reductions(), layout.n, layout.inner, kStridedThreads,
                                kStridedTargetThreads, kMinEntriesPerSlice);
  const int bx = kStridedThreads / by;
  return StridedPlan{bx, by, strided_grid(layout.reductions(), layout.inner, bx)};
}

template <typename F>
cudaError_t dispatch_bool(bool flag, F&& launch) {
  if (flag) return launch(std::true_type{});
  return launch(std::false_type{});
}

}  // namespace

template <typename scalar_t>
cudaError_t gem_forward(const scalar_t* input, ReductionLayout layout, MaskView mask,
                        const acc_of_t<scalar_t>* p_tensor, double p_value, double eps,
                        scalar_t* output, acc_of_t<scalar_t>* stats, cudaStream_t stream) {
  using acc_t = acc_of_t<scalar_t>;
  // n == 0 still launches: the empty reductions' outputs and stats are written.
  if (layout.outer <= 0 || layout.inner <= 0 || layout.n < 0) return cudaSuccess;
  const acc_t eps_acc = effective_eps(static_cast<acc_t>(eps));
  const acc_t p_acc = static_cast<acc_t>(p_value);
  if (layout.inner > 1) {
    const StridedPlan plan = strided_plan(layout);
    strided_forward_kernel<scalar_t><<<plan.grid.blocks, dim3(plan.bx, plan.by), 0, stream>>>(
        input, mask, p_tensor, p_acc, eps_acc, output, stats, layout, plan.grid.stride);
    return cudaGetLastError();
  }
  const bool vec = layout.n % vec_width<scalar_t>() == 0 && aligned16(input);
  const RowPlan plan = row_plan<scalar_t>(layout.outer, layout.n, vec);
  if (plan.iters == 0 && layout.n > 0) {
    long_row_forward_kernel<scalar_t><<<plan.blocks, plan.threads, 0, stream>>>(
        input, mask, p_tensor, p_acc, eps_acc, output, stats, layout.outer, layout.n);
    return cudaGetLastError();
  }
  return dispatch_vec<scalar_t>(plan.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    // At most 512 threads x 64 bytes: within the 48 KB of dynamic shared
    // memory a launch gets without opting in.
    const size_t slot_bytes =
        static_cast<size_t>(plan.threads) * plan.iters * kVec * sizeof(acc_t);
    row_forward_kernel<scalar_t, kVec><<<plan.blocks, plan.threads, slot_bytes, stream>>>(
        input, mask, p_tensor, p_acc, eps_acc, output, stats, layout.outer, layout.n, plan.group,
        plan.iters);
    return cudaGetLastError();
  });
}

template <typename scalar_t>
cudaError_t gem_backward(const scalar_t* grad, const scalar_t* input, ReductionLayout layout,
                         MaskView mask, const acc_of_t<scalar_t>* p_tensor, double p_value,
                         const acc_of_t<scalar_t>* stats, double eps, scalar_t* grad_input,
                         acc_of_t<scalar_t>* p_grad_terms, cudaStream_t stream) {
  using acc_t = acc_of_t<scalar_t>;
  const bool p_grad = p_grad_terms != nullptr;
  const acc_t eps_acc = effective_eps(static_cast<acc_t>(eps));
  const acc_t p_acc = static_cast<acc_t>(p_value);
  // Nothing to read or write when there is no entry (no term written then).
  if (layout.outer <= 0 || layout.inner <= 0 || layout.n <= 0) return cudaSuccess;
  return dispatch_bool(p_grad, [&](auto p_grad_c) {
    constexpr bool kPGrad = decltype(p_grad_c)::value;
    if (layout.inner > 1) {
      const StridedPlan plan = strided_plan(layout);
      strided_backward_kernel<scalar_t, kPGrad>
          <<<plan.grid.blocks, dim3(plan.bx, plan.by), 0, stream>>>(
              grad, input, mask, p_tensor, p_acc, stats, eps_acc, grad_input, p_grad_terms, layout,
              plan.grid.stride);
    } else {
      // The group of the forward's plan for scalar loads (the backward streams).
      const RowPlan plan = row_plan<scalar_t>(layout.outer, layout.n, false);
      row_backward_kernel<scalar_t, kPGrad><<<plan.blocks, plan.threads, 0, stream>>>(
          grad, input, mask, p_tensor, p_acc, stats, eps_acc, grad_input, p_grad_terms,
          layout.outer, layout.n, plan.group);
    }
    return cudaGetLastError();
  });
}

NANFREE_GEM_LAUNCHERS(, float)
NANFREE_GEM_LAUNCHERS(, double)
NANFREE_GEM_LAUNCHERS(, __half)
NANFREE_GEM_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
