// CUDA tile kernels of the MNR loss and the launchers of mnr_kernels.h. No
// torch header: only CUDA and nanfree/*.h, so this file compiles without
// ATen. Every rule (column kinds, logits, the log partition, the logit
// gradient, the loss, the logsumexp state with its NaN and infinity rules)
// comes from nanfree/mnr_math.h and nanfree/numerics.h, whose functions are
// called per entry and per row (csrc/cpu/mnr.cpp is the CPU side of the
// same tiles).
//
// Layout. A tile row (one local row's logits against every column) is swept
// by a group of G threads (G a power of two, 1..512; a block of max(G, 128)
// threads holds 128 / G rows, or one row) in 16-byte vectors when the row
// length allows it (4 float or 2 double), else element by element: lane l
// takes vectors l, l + G, l + 2G, ... G is the smallest power of two that
// leaves each lane about 64 bytes of the row. Rows too long for 512 threads
// to keep the GPU busy (fewer than kTargetThreads threads in all) are also
// split into `splits` parts of consecutive vectors, one group each; each part
// writes its partial result (a logsumexp state, or a sum) to the workspace
// and a second launch merges the parts of each row in part order. Blocks walk
// over the (row, part) items with a grid stride. Every sum runs in an order
// fixed by the plan, so the results do not depend on timing (no atomics).
//
// Column kinds. Most columns of a row take their segment's default kind
// (mnr_default_kind: one per segment, fixed for the tile). The others are
// the row's own columns (doc g + b r below owned_end in the docs segment,
// query g in the queries segment: the enumeration of mnr_own_columns), at
// most owned_blocks + 1 per row; their kind is mnr_column_kind's. Each lane
// walks its vectors in increasing column order with an OwnCursor, the next
// own column at or after its position: one comparison per vector, and the
// cursor advances by adding r, so no entry takes a division or modulo; the
// header's mnr_column_kind runs only on the own columns themselves.
//
// Per entry, row_stats applies mnr_logit and lse_update (one exp; the lanes'
// states are merged with lse_merge), row_grads mnr_logit and mnr_logit_grad
// (one exp) and writes scale * dlogit in place. The kernels stream their
// rows once (loads of the next vectors issued before the math of the first)
// and are bound by memory.
//
// With the CUDA policy's chunks (64M cosines) a tile has fewer than 512 rows
// only when its rows are longer than 128K columns or the problem has few
// local rows: the split is for those.
//
// ptxas (CUDA 13, sm_80 and sm_90): the row kernels use 46 to 64 registers
// (at most two blocks of 512 threads per SM) and the small kernels 22 to 32,
// no spill and no stack. Recheck with -Xptxas -v after a change.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/mnr_kernels.h"
#include "nanfree/mnr_math.h"
#include "nanfree/numerics.h"

namespace nanfree {
namespace gpu {
using namespace detail;
namespace {

// Bytes of a row each lane is given before the group is widened (4 vectors).
constexpr int64_t kLaneBytes = 64;
// Threads that keep an H100 streaming at full bandwidth (132 SMs x 2048);
// long rows are split over more blocks until a tile has about that many.
constexpr int64_t kTargetThreads = int64_t(1) << 18;
// Threads of the small per-row launches (finishing, losses, casts).
constexpr int kSimpleThreads = 256;
// "No own column left" for OwnCursor.
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

// ---------------------------------------------------------------------------
// Column kinds of a row.

// The row's own columns at or after a lane's position: the next own doc
// (advanced by r, up to the docs' owned end) and the own query, each kNone
// once passed. The same columns as mnr_own_columns, in increasing order
// within each segment.
struct OwnCursor {
  int64_t doc;
  int64_t doc_end;
  int64_t step;
  int64_t query;

  __device__ __forceinline__ OwnCursor(const MnrTile& tile, int64_t g) {
    const MnrSegments seg = mnr_segments(tile);
    const int64_t owned_docs = tile.owned_end < seg.docs_len ? tile.owned_end : seg.docs_len;
    doc = g < owned_docs ? seg.docs_start + g : kNone;
    doc_end = seg.docs_start + owned_docs;
    step = tile.r;
    query = g < seg.queries_len ? seg.queries_start + g : kNone;
  }

  __device__ __forceinline__ void advance_doc() {
    doc += step;
    if (doc >= doc_end) doc = kNone;
  }

  // Moves past the own columns before column c (other lanes' entries).
  __device__ __forceinline__ void skip_to(int64_t c) {
    while (doc < c) advance_doc();
    if (query < c) query = kNone;
  }

  __device__ __forceinline__ int64_t next() const { return doc < query ? doc : query; }

  // Whether column j is an own column; j must not decrease between calls.
  __device__ __forceinline__ bool take(int64_t j) {
    if (j == doc) {
      advance_doc();
      return true;
    }
    if (j == query) {
      query = kNone;
      return true;
    }
    return false;
  }
};

// The tile's constants every lane needs.
template <typename acc_t>
struct TileMath {
  MnrTile tile;
  acc_t scale;
  acc_t strength;
  int kind0;  // default kind of segment 0 (columns j < first_len)
  int kind1;  // of segment 1

  __device__ __forceinline__ TileMath(const MnrTile& t, const acc_t* scale_ptr, acc_t s)
      : tile(t), scale(*scale_ptr), strength(s) {
    const bool docs_first = mnr_first_segment_is_docs(t.row_kind);
    kind0 = mnr_default_kind(t.row_kind, docs_first, t.hardness_mode);
    kind1 = mnr_default_kind(t.row_kind, !docs_first, t.hardness_mode);
  }
};

// Calls f(x, kind) for every entry of the vectors [v_begin, v_end) of row
// `row` (local row g) that lane `lane` of a group of `group` lanes takes,
// in increasing column order, with x the cosine and kind its column kind;
// kStore: f's result replaces the entry.
template <int V, bool kStore, typename acc_t, typename Ptr, typename F>
__device__ __forceinline__ void sweep(Ptr row, const TileMath<acc_t>& m, int64_t g,
                                      int64_t v_begin, int64_t v_end, int lane, int group,
                                      F&& f) {
  constexpr int U = V == 1 ? 4 : 2;  // vectors loaded before their math
  OwnCursor own(m.tile, g);
  const int64_t first_len = m.tile.first_len;
  for (int64_t v = v_begin + lane; v < v_end; v += int64_t(U) * group) {
    acc_t x[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t vu = v + int64_t(u) * group;
      if (vu < v_end) load_acc<V>(row + vu * V, x[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t vu = v + int64_t(u) * group;
      if (vu >= v_end) break;
      const int64_t c = vu * V;
      own.skip_to(c);
      const bool has_own = own.next() < c + V;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t j = c + k;
        int kind = j < first_len ? m.kind0 : m.kind1;
        if (has_own && own.take(j)) {
          kind = mnr_column_kind(m.tile.row_kind, g, j, first_len, m.tile.r, m.tile.owned_end,
                                 m.tile.hardness_mode);
        }
        x[u][k] = f(x[u][k], kind);
      }
      if constexpr (kStore) store_acc<V>(row + c, x[u]);
    }
  }
}

// lse_merge of the states of every lane of each group of G lanes (G as in
// group_reduce of device_common.cuh; `partial` holds 2 * kMaxWarps values).
// The group's first lane ends with the merged state, in an order fixed by G.
// Every thread of the block must call it.
template <typename acc_t>
__device__ __forceinline__ LseState<acc_t> group_merge(LseState<acc_t> s, int G,
                                                       acc_t* partial) {
  const int width = G < kWarp ? G : kWarp;
  for (int offset = width / 2; offset > 0; offset /= 2) {
    const LseState<acc_t> other{__shfl_xor_sync(kFullMask, s.max, offset),
                                __shfl_xor_sync(kFullMask, s.sum, offset)};
    s = lse_merge(s, other);
  }
  if (G > kWarp) {
    const int warp = threadIdx.x / kWarp;
    if (threadIdx.x % kWarp == 0) {
      partial[2 * warp] = s.max;
      partial[2 * warp + 1] = s.sum;
    }
    __syncthreads();
    const int per_group = G / kWarp;
    const int first = (threadIdx.x / G) * per_group;
    s = LseState<acc_t>{partial[2 * first], partial[2 * first + 1]};
    for (int w = 1; w < per_group; ++w) {
      s = lse_merge(s, LseState<acc_t>{partial[2 * (first + w)], partial[2 * (first + w) + 1]});
    }
    __syncthreads();  // partial is reused by the next item
  }
  return s;
}

// (row, part) items of a tile: `count` parts of `part_vecs` vectors per row.
struct Split {
  int64_t items;
  int64_t count;
  int64_t part_vecs;
  int64_t nvec;
};

// The vectors [begin, end) of an item and its row.
struct ItemRange {
  int64_t row;
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ ItemRange item_range(const Split& split, int64_t item) {
  const int64_t row = split.count == 1 ? item : item / split.count;
  const int64_t begin = (item - row * split.count) * split.part_vecs;
  const int64_t end = begin + split.part_vecs < split.nvec ? begin + split.part_vecs : split.nvec;
  return ItemRange{row, begin, end};
}

// The target logit of tile row i: a Q row's from its positive (doc g, column
// g of its first segment), written to target[i]; a P row's read from there.
template <typename acc_t>
__device__ __forceinline__ acc_t row_target(const acc_t* cos, const MnrTile& tile, acc_t scale,
                                            acc_t* target, int64_t i) {
  if (tile.row_kind != kMnrRowQuery) return target[i];
  const acc_t t = mnr_target_logit(cos[i * tile.cols + tile.g0 + i], scale);
  target[i] = t;
  return t;
}

// ---------------------------------------------------------------------------
// Kernels.

template <typename acc_t, int V>
__global__ void __launch_bounds__(kMaxThreads)
    row_stats_kernel(const acc_t* __restrict__ cos, MnrTile tile, const acc_t* scale,
                     acc_t strength, acc_t* __restrict__ lse, acc_t* __restrict__ target,
                     acc_t* __restrict__ parts, Split split, int group) {
  __shared__ acc_t partial[2 * kMaxWarps];
  const TileMath<acc_t> m(tile, scale, strength);
  const int lane = threadIdx.x & (group - 1);
  const int per_block = blockDim.x / group;
  for (int64_t base = int64_t(blockIdx.x) * per_block; base < split.items;
       base += int64_t(gridDim.x) * per_block) {
    const int64_t item = base + threadIdx.x / group;
    const bool active = item < split.items;
    LseState<acc_t> state = lse_empty<acc_t>();
    ItemRange r{0, 0, 0};
    if (active) {
      r = item_range(split, item);
      sweep<V, false>(cos + r.row * tile.cols, m, tile.g0 + r.row, r.begin, r.end, lane, group,
                      [&](acc_t x, int kind) {
                        lse_update(state, mnr_logit(x, kind, m.scale, m.strength));
                        return x;
                      });
    }
    state = group_merge(state, group, partial);
    if (active && lane == 0) {
      if (split.count == 1) {
        lse[r.row] = mnr_relative_lse(state.max, state.sum, row_target(cos, tile, m.scale, target,
                                                                       r.row));
      } else {
        parts[2 * item] = state.max;
        parts[2 * item + 1] = state.sum;
      }
    }
  }
}

// Merges the parts of each split row (in part order) into its logsumexp.
template <typename acc_t>
__global__ void __launch_bounds__(kSimpleThreads)
    row_stats_finish_kernel(const acc_t* __restrict__ cos, MnrTile tile, const acc_t* scale,
                            acc_t* __restrict__ lse, acc_t* __restrict__ target,
                            const acc_t* __restrict__ parts, int64_t count) {
  const acc_t s = *scale;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < tile.rows;
       i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t* p = parts + 2 * i * count;
    LseState<acc_t> state{p[0], p[1]};
    for (int64_t k = 1; k < count; ++k) state = lse_merge(state, LseState<acc_t>{p[2 * k], p[2 * k + 1]});
    lse[i] = mnr_relative_lse(state.max, state.sum, row_target(cos, tile, s, target, i));
  }
}

template <typename acc_t, int V>
__global__ void __launch_bounds__(kMaxThreads)
    row_grads_kernel(acc_t* __restrict__ cos, MnrTile tile, const acc_t* scale, acc_t strength,
                     const acc_t* __restrict__ stats, const acc_t* __restrict__ upstream,
                     bool per_direction, bool has_p_row, acc_t* __restrict__ scale_grad,
                     acc_t* __restrict__ parts, Split split, int group) {
  __shared__ acc_t partial[kMaxWarps];
  const TileMath<acc_t> m(tile, scale, strength);
  const int lane = threadIdx.x & (group - 1);
  const int per_block = blockDim.x / group;
  const bool query_row = tile.row_kind == kMnrRowQuery;
  const acc_t direction = mnr_direction_weight<acc_t>(per_direction, has_p_row);
  for (int64_t base = int64_t(blockIdx.x) * per_block; base < split.items;
       base += int64_t(gridDim.x) * per_block) {
    const int64_t item = base + threadIdx.x / group;
    const bool active = item < split.items;
    acc_t dot[1] = {acc_t(0)};
    ItemRange r{0, 0, 0};
    if (active) {
      r = item_range(split, item);
      const acc_t* row_stats = stats + kMnrStatsPerRow * r.row;
      const acc_t normalizer = mnr_row_normalizer(row_stats[0], row_stats[1], row_stats[2],
                                                  query_row, per_direction, has_p_row);
      const acc_t up = upstream[r.row];
      const acc_t weight = up * direction;
      sweep<V, true>(cos + r.row * tile.cols, m, tile.g0 + r.row, r.begin, r.end, lane, group,
                     [&](acc_t x, int kind) {
                       const acc_t logit = mnr_logit(x, kind, m.scale, m.strength);
                       const acc_t dl = mnr_logit_grad(logit, kind, normalizer, weight, up);
                       dot[0] += dl * x;
                       return m.scale * dl;
                     });
    }
    group_reduce<1>(dot, group, partial, SumOp());
    if (active && lane == 0) {
      if (split.count == 1) {
        scale_grad[r.row] = dot[0];
      } else {
        parts[item] = dot[0];
      }
    }
  }
}

// Adds the parts of each split row (in part order).
template <typename acc_t>
__global__ void __launch_bounds__(kSimpleThreads)
    row_grads_finish_kernel(int64_t rows, acc_t* __restrict__ scale_grad,
                            const acc_t* __restrict__ parts, int64_t count) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t* p = parts + i * count;
    acc_t sum = p[0];
    for (int64_t k = 1; k < count; ++k) sum += p[k];
    scale_grad[i] = sum;
  }
}

template <typename acc_t>
__global__ void __launch_bounds__(kSimpleThreads)
    row_losses_kernel(const acc_t* __restrict__ stats, bool per_direction, bool has_p_row,
                      int64_t rows, acc_t* __restrict__ loss) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += int64_t(gridDim.x) * blockDim.x) {
    loss[i] = mnr_row_loss(stats[kMnrStatsPerRow * i], stats[kMnrStatsPerRow * i + 1],
                           per_direction, has_p_row);
  }
}

// Entries of a row that one block of the cast converts (4 per thread).
constexpr int64_t kCastTile = 4 * kSimpleThreads;

// Blocks take tiles of kCastTile entries of one row (tile t: row t / col_tiles).
template <typename half_t>
__global__ void __launch_bounds__(kSimpleThreads)
    saturate_cast_kernel(const float* __restrict__ in, int64_t rows, int64_t cols,
                         int64_t in_stride, int64_t col_tiles, half_t* __restrict__ out) {
  const float big = largest_finite<half_t>();
  for (int64_t t = blockIdx.x; t < rows * col_tiles; t += gridDim.x) {
    const int64_t i = t / col_tiles;
    const int64_t j0 = (t - i * col_tiles) * kCastTile;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t j = j0 + k * kSimpleThreads + threadIdx.x;
      if (j < cols) {
        const float x = in[i * in_stride + j];
        // Beyond the largest finite half the cast would give inf, and inf *
        // 0 in the GEMM NaN; comparisons leave NaN as it is.
        out[i * cols + j] = FromAcc<half_t>::cast(x > big ? big : x < -big ? -big : x);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Launch planning (host).

// Launches `kernel` with `blocks` blocks of `threads` threads on `stream`.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int64_t blocks, int threads, cudaStream_t stream,
                   Args... args) {
  kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<Params>(args)...);
  return cudaGetLastError();
}

int64_t simple_blocks(int64_t n) {
  const int64_t blocks = ceil_div(n, kSimpleThreads);
  return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

// Lanes per row part: about kLaneBytes of the row each, up to kMaxThreads.
template <typename acc_t>
int tile_group(int64_t cols) {
  const int64_t want = ceil_div(cols, kLaneBytes / static_cast<int64_t>(sizeof(acc_t)));
  return want >= kMaxThreads ? kMaxThreads : next_pow2(want < 1 ? 1 : want);
}

// Parts per row (at most; the vector width may merge the last ones): more
// than 1 only when full groups of kMaxThreads lanes leave the GPU short of
// kTargetThreads, each part keeping kLaneBytes per lane.
template <typename acc_t>
int64_t tile_splits(const MnrTile& tile) {
  const int group = tile_group<acc_t>(tile.cols);
  if (group < kMaxThreads || tile.rows <= 0) return 1;
  const int64_t by_threads = ceil_div(kTargetThreads, tile.rows * group);
  const int64_t by_length =
      tile.cols / (int64_t(group) * (kLaneBytes / static_cast<int64_t>(sizeof(acc_t))));
  const int64_t s = by_threads < by_length ? by_threads : by_length;
  return s > 1 ? s : 1;
}

struct TilePlan {
  bool vec;
  int group;
  int threads;
  int64_t blocks;
  Split split;
};

template <typename acc_t>
TilePlan tile_plan(const MnrTile& tile, const void* cos) {
  constexpr int kVec = vec_width<acc_t>();
  TilePlan p;
  p.vec = tile.cols % kVec == 0 && aligned16(cos);
  p.group = tile_group<acc_t>(tile.cols);
  p.threads = p.group > kMinThreads ? p.group : kMinThreads;
  const int64_t nvec = tile.cols / (p.vec ? kVec : 1);
  const int64_t splits = tile_splits<acc_t>(tile);
  const int64_t part_vecs = nvec > 0 ? ceil_div(nvec, splits) : 0;
  const int64_t count = nvec > 0 ? ceil_div(nvec, part_vecs) : 1;  // no empty part
  p.split = Split{tile.rows * count, count, part_vecs, nvec};
  const int64_t blocks = ceil_div(p.split.items, p.threads / p.group);
  p.blocks = blocks < kMaxBlocks ? blocks : kMaxBlocks;
  return p;
}

}  // namespace

template <typename acc_t>
int64_t mnr_workspace_size(const MnrTile& tile) {
  const int64_t splits = tile_splits<acc_t>(tile);
  return splits > 1 ? 2 * tile.rows * splits : 0;
}

template <typename acc_t>
cudaError_t mnr_row_stats(const acc_t* cos, const MnrTile& tile, const acc_t* scale,
                          double hardness_strength, acc_t* lse, acc_t* target,
                          acc_t* workspace, cudaStream_t stream) {
  if (tile.rows <= 0) return cudaSuccess;
  // A Q row's positive is column g0 + i of its row.
  if (tile.row_kind == kMnrRowQuery && tile.g0 + tile.rows > tile.cols) return cudaErrorInvalidValue;
  const TilePlan plan = tile_plan<acc_t>(tile, cos);
  if (plan.split.count > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const acc_t strength = static_cast<acc_t>(hardness_strength);
  const cudaError_t err = dispatch_vec<acc_t>(plan.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    return launch(row_stats_kernel<acc_t, kVec>, plan.blocks, plan.threads, stream, cos, tile,
                  scale, strength, lse, target, workspace, plan.split, plan.group);
  });
  if (err != cudaSuccess || plan.split.count == 1) return err;
  return launch(row_stats_finish_kernel<acc_t>, simple_blocks(tile.rows), kSimpleThreads, stream,
                cos, tile, scale, lse, target, workspace, plan.split.count);
}

template <typename acc_t>
cudaError_t mnr_row_grads(acc_t* cos, const MnrTile& tile, const acc_t* scale,
                          double hardness_strength, const acc_t* stats, const acc_t* upstream,
                          bool per_direction, bool has_p_row, acc_t* scale_grad,
                          acc_t* workspace, cudaStream_t stream) {
  if (tile.rows <= 0) return cudaSuccess;
  const TilePlan plan = tile_plan<acc_t>(tile, cos);
  if (plan.split.count > 1 && workspace == nullptr) return cudaErrorInvalidValue;
  const acc_t strength = static_cast<acc_t>(hardness_strength);
  const cudaError_t err = dispatch_vec<acc_t>(plan.vec, [&](auto vec_c) {
    constexpr int kVec = decltype(vec_c)::value;
    return launch(row_grads_kernel<acc_t, kVec>, plan.blocks, plan.threads, stream, cos, tile,
                  scale, strength, stats, upstream, per_direction, has_p_row, scale_grad,
                  workspace, plan.split, plan.group);
  });
  if (err != cudaSuccess || plan.split.count == 1) return err;
  return launch(row_grads_finish_kernel<acc_t>, simple_blocks(tile.rows), kSimpleThreads, stream,
                tile.rows, scale_grad, workspace, plan.split.count);
}

template <typename acc_t>
cudaError_t mnr_row_losses(const acc_t* stats, bool per_direction, bool has_p_row, int64_t rows,
                           acc_t* loss, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  return launch(row_losses_kernel<acc_t>, simple_blocks(rows), kSimpleThreads, stream, stats,
                per_direction, has_p_row, rows, loss);
}

template <typename half_t>
cudaError_t mnr_saturate_cast(const float* in, int64_t rows, int64_t cols, int64_t in_stride,
                              half_t* out, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t col_tiles = ceil_div(cols, kCastTile);
  const int64_t tiles = rows * col_tiles;
  return launch(saturate_cast_kernel<half_t>, tiles < kMaxBlocks ? tiles : kMaxBlocks,
                kSimpleThreads, stream, in, rows, cols, in_stride, col_tiles, out);
}

NANFREE_MNR_LAUNCHERS(, float)
NANFREE_MNR_LAUNCHERS(, double)
template cudaError_t mnr_saturate_cast<__half>(const float*, int64_t, int64_t, int64_t, __half*,
                                               cudaStream_t);
template cudaError_t mnr_saturate_cast<__nv_bfloat16>(const float*, int64_t, int64_t, int64_t,
                                                      __nv_bfloat16*, cudaStream_t);

}  // namespace gpu
}  // namespace nanfree
