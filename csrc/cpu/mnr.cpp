// CPU registration of the MNR loss (mnr_loss, mnr_loss_backward): the chunked
// driver of csrc/common/mnr_driver.h with ATen's GEMM (MKL / oneDNN) on
// float or double operands and these tile kernels, which apply mnr_math.h to
// each row of a chunk of cosines.
//
// bfloat16 embeddings, where the MKL that torch links has
// cblas_gemm_bf16bf16f32 (x86 builds; AMX or AVX512-BF16 run it several
// times faster than a float32 GEMM): the operands stay bfloat16 and the GEMMs
// sum their exact products in float32, as the CUDA backend's mm.dtype does;
// the gradient GEMMs take the chunk of scale * dlogit saturated to bfloat16's
// range and rounded to it (csrc/cuda/mnr.cpp says why). Elsewhere, and for
// float16 (MKL's float16 GEMM is no faster than float32's on CPUs without
// AMX-FP16), half operands are converted to float up front.
//
// A row is swept with vectors at its segments' default column kinds
// (mnr_default_kind); its own columns (mnr_own_columns: the positive, the
// query's other docs, itself) are then redone one by one with
// mnr_column_kind. Rows whose logsumexp or normalizer is not finite (NaN or
// infinite embeddings or scale) take the scalar path of numerics.h, which
// keeps NaN where the vector exp would clamp it away.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common/mnr_driver.h"
#include "common/mnr_op.h"
#include "cpu/vec.h"
#include "nanfree/mnr_math.h"
#include "nanfree/numerics.h"

// MKL's bfloat16 GEMM with a float32 result (declared weak: nullptr at run
// time when the linked torch has no MKL). The integer arguments are passed as
// 64-bit, right for MKL's LP64 and ILP64 interfaces alike on x86-64 for values
// below 2^31 (checked by the caller).
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int64_t m, int64_t n,
                                       int64_t k, float alpha, const void* a, int64_t lda,
                                       const void* b, int64_t ldb, float beta, float* c,
                                       int64_t ldc) __attribute__((weak));

namespace nanfree {
namespace {

using cpu::Vec;

// Entries of cosines per parallel task.
constexpr int64_t kGrainEntries = 1 << 15;

int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, kGrainEntries / std::max<int64_t>(cols, 1)); }

constexpr int kCblasRowMajor = 101;
constexpr int kCblasNoTrans = 111;
constexpr int kCblasTrans = 112;

bool has_bf16_gemm() { return &cblas_gemm_bf16bf16f32 != nullptr; }

// The leading dimension of a row-major matrix with unit column stride (its
// row stride; with one row, any value from its width up is valid).
int64_t leading_dimension(const at::Tensor& a) {
  return std::max<int64_t>(a.size(0) > 1 ? a.stride(0) : a.size(1), 1);
}

// c (float [m, n], row stride ldc) = beta * c + a @ b^T (transb) or a @ b,
// a and b bfloat16 with unit column stride; a_transposed: a is stored [k, m].
void bf16_gemm(const at::Tensor& a, bool a_transposed, const at::Tensor& b, bool b_transposed,
               at::Tensor& c, float beta) {
  const int64_t m = c.size(0), n = c.size(1);
  const int64_t k = a_transposed ? a.size(0) : a.size(1);
  TORCH_INTERNAL_ASSERT(a.stride(1) == 1 && b.stride(1) == 1 && c.stride(1) == 1 &&
                        c.scalar_type() == at::kFloat);
  const int64_t limit = std::numeric_limits<int32_t>::max();
  TORCH_INTERNAL_ASSERT(m < limit && n < limit && k < limit && a.stride(0) < limit &&
                        b.stride(0) < limit && c.stride(0) < limit);
  if (m == 0 || n == 0) return;
  cblas_gemm_bf16bf16f32(kCblasRowMajor, a_transposed ? kCblasTrans : kCblasNoTrans,
                         b_transposed ? kCblasTrans : kCblasNoTrans, m, n, k, 1.0f,
                         a.const_data_ptr(), leading_dimension(a), b.const_data_ptr(),
                         leading_dimension(b), beta, c.mutable_data_ptr<float>(),
                         leading_dimension(c));
}

// The bfloat16 GEMM operand of a contiguous float matrix, written over it:
// saturated to bfloat16's range (saturate_vec, numerics.h's saturate: an inf
// there would meet a 0 embedding entry and make NaN; NaN stays), rounded to
// nearest even. Row i's bfloat16 entries go to the first half of row i's
// bytes (a [rows, cols] bfloat16 view with row stride 2 * cols), so no second
// chunk-sized buffer is held; `a` is overwritten. Each row is rounded into a
// per-thread buffer and copied back, so no store can meet an unread entry.
at::Tensor bf16_operand_in_place(const at::Tensor& a) {
  TORCH_INTERNAL_ASSERT(a.dim() == 2 && a.is_contiguous() && a.scalar_type() == at::kFloat);
  const int64_t cols = a.size(1);
  float* data = a.mutable_data_ptr<float>();
  using V = Vec<float>;
  const V hi(cpu::largest_finite<at::BFloat16>()), lo(-cpu::largest_finite<at::BFloat16>());
  at::parallel_for(0, a.size(0), row_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> rounded(cols);
    for (int64_t i = begin; i < end; ++i) {
      float* row = data + i * cols;
      for (int64_t j = 0; j < cols; j += V::size()) {
        const int64_t count = std::min<int64_t>(V::size(), cols - j);
        cpu::store_vec(cpu::saturate_vec(V::loadu(row + j, count), hi, lo), rounded.data() + j,
                       count);
      }
      std::memcpy(row, rounded.data(), cols * sizeof(at::BFloat16));
    }
  });
  return a.view(at::kBFloat16).narrow(1, 0, cols);
}

// How many own columns a row of the tile can have: one per owned block, and
// the query itself.
int max_own_columns(const MnrTile& tile) {
  return static_cast<int>(tile.owned_end / tile.r) + 1;
}

// Whether each segment's default columns are penalized (mnr_default_kind).
struct SegmentKinds {
  int first;
  int second;
};

SegmentKinds segment_kinds(const MnrTile& tile) {
  const bool docs_first = mnr_first_segment_is_docs(tile.row_kind);
  return SegmentKinds{mnr_default_kind(tile.row_kind, docs_first, tile.hardness_mode),
                      mnr_default_kind(tile.row_kind, !docs_first, tile.hardness_mode)};
}

// A tile's scale, hardness strength and default column kinds in acc_t.
template <typename acc_t>
struct TileConstants {
  TileConstants(const at::Tensor& scale_tensor, double hardness_strength, const MnrTile& tile)
      : scale(scale_tensor.item<acc_t>()),
        strength(static_cast<acc_t>(hardness_strength)),
        kinds(segment_kinds(tile)) {}
  acc_t scale;
  acc_t strength;
  SegmentKinds kinds;
};

// logits[j] = mnr_logit(cos[j]) over the row: vectors at the segments'
// default kinds (the header's formula, written with vectors), then the own
// columns one by one. `own` receives the own columns (see mnr_own_columns).
template <typename acc_t>
NANFREE_HOT_LOOP int row_logits(const acc_t* cos, acc_t* logits, const MnrTile& tile, int64_t g,
                                const TileConstants<acc_t>& h, int64_t* own, int max_own) {
  using V = Vec<acc_t>;
  auto sweep = [&](int64_t begin, int64_t end, int kind) {
    const V s(h.scale), w(h.strength);
    const bool penalized = kind == kMnrColumnPenalized;
    int64_t j = begin;
    if (penalized) {
      for (; j + V::size() <= end; j += V::size()) {
        const V c = V::loadu(cos + j);
        (s * c + w * c).store(logits + j);
      }
    } else {
      for (; j + V::size() <= end; j += V::size()) (s * V::loadu(cos + j)).store(logits + j);
    }
    for (; j < end; ++j) logits[j] = mnr_logit(cos[j], kind, h.scale, h.strength);
  };
  sweep(0, tile.first_len, h.kinds.first);
  sweep(tile.first_len, tile.cols, h.kinds.second);
  const int count = mnr_own_columns(tile, g, own, max_own);
  for (int c = 0; c < count; ++c) {
    const int64_t j = own[c];
    const int kind = mnr_column_kind(tile.row_kind, g, j, tile.first_len, tile.r,
                                     tile.owned_end, tile.hardness_mode);
    logits[j] = mnr_logit(cos[j], kind, h.scale, h.strength);
  }
  return count;
}

// The row's logsumexp from its logits, relative to its target logit t
// (mnr_relative_lse). The exponentials are the accurate ones (Vec::exp, not
// the faster shifted_exp): a loss near 0 is log(sum) with sum near 1.
template <typename acc_t>
NANFREE_HOT_LOOP acc_t row_relative_lse(const acc_t* logits, int64_t n, acc_t target) {
  using V = Vec<acc_t>;
  const acc_t m = cpu::row_max(logits, n);
  if (!std::isfinite(m)) {
    // NaN, +inf or an empty row: the scalar state keeps NaN and the infinities' rules.
    LseState<acc_t> state = lse_empty<acc_t>();
    for (int64_t j = 0; j < n; ++j) lse_update(state, logits[j]);
    return mnr_relative_lse(state.max, state.sum, target);
  }
  const V shift(m);
  const acc_t sum = cpu::reduce_row<acc_t>(
      n, acc_t(0), [](const V& a, const V& b) { return a + b; },
      // -inf logits (excluded pairs) give exp(-inf) = 0; tail lanes are blended to 0.
      [&](int64_t j, int64_t count) { return (V::loadu(logits + j, count) - shift).exp(); });
  return mnr_relative_lse(m, sum, target);
}

// A task's per-row scratch: the row's logits and its own columns.
template <typename acc_t>
struct RowBuffers {
  explicit RowBuffers(const MnrTile& tile)
      : max_own(max_own_columns(tile)),
        logits(tile.cols),
        own(max_own),
        own_grad(max_own),
        own_cos(max_own) {}
  int max_own;
  std::vector<acc_t> logits;
  std::vector<int64_t> own;
  std::vector<acc_t> own_grad;
  std::vector<acc_t> own_cos;
};

// Overwrites a row of cosines with scale * dlogit (mnr_logit_grad) from its
// logits (buf.logits, with `count` own columns in buf.own: row_logits) and
// its normalizer; returns sum_j dlogit * cos (the scale's gradient). `weight`
// is the row's upstream gradient times its direction weight.
template <typename acc_t>
NANFREE_HOT_LOOP acc_t row_gradient(acc_t* row, RowBuffers<acc_t>& buf, int count,
                                    const MnrTile& tile, int64_t g, const TileConstants<acc_t>& h,
                                    acc_t normalizer, acc_t weight, acc_t upstream) {
  using V = Vec<acc_t>;
  acc_t* logits = buf.logits.data();
  acc_t dot = 0;
  if (!(std::isfinite(normalizer) && std::isfinite(weight))) {
    // A NaN or infinite normalizer (NaN or infinite logits) or upstream:
    // the header's rules entry by entry, which keep the NaN.
    for (int64_t j = 0; j < tile.cols; ++j) {
      const int kind = mnr_column_kind(tile.row_kind, g, j, tile.first_len, tile.r,
                                       tile.owned_end, tile.hardness_mode);
      const acc_t dl = mnr_logit_grad(logits[j], kind, normalizer, weight, upstream);
      dot += dl * row[j];
      row[j] = h.scale * dl;
    }
    return dot;
  }
  // The own columns' exact gradients; the sweep then sees them as -inf
  // (a gradient of exactly 0) and they are written back after it.
  for (int k = 0; k < count; ++k) {
    const int64_t j = buf.own[k];
    const int kind = mnr_column_kind(tile.row_kind, g, j, tile.first_len, tile.r,
                                     tile.owned_end, tile.hardness_mode);
    buf.own_grad[k] = mnr_logit_grad(logits[j], kind, normalizer, weight, upstream);
    buf.own_cos[k] = row[j];
    logits[j] = -std::numeric_limits<acc_t>::infinity();
  }
  const V shift(normalizer), w(weight), s(h.scale);
  V acc(0);
  int64_t j = 0;
  for (; j + V::size() <= tile.cols; j += V::size()) {
    // Every logit is at most the normalizer, so the shifted exp's
    // argument is <= 0 (-inf for the own columns, whose exp is 0).
    const V dl = w * cpu::shifted_exp(V::loadu(logits + j) - shift);
    acc = acc + dl * V::loadu(row + j);
    (s * dl).store(row + j);
  }
  dot = cpu::reduce_lanes<acc_t>([](const V& a, const V& b) { return a + b; }, acc);
  for (; j < tile.cols; ++j) {
    const acc_t dl = weight * nf_exp(logits[j] - normalizer);
    dot += dl * row[j];
    row[j] = h.scale * dl;
  }
  for (int k = 0; k < count; ++k) {
    row[buf.own[k]] = h.scale * buf.own_grad[k];
    dot += buf.own_grad[k] * buf.own_cos[k];
  }
  return dot;
}

struct CpuMnrTiles {
  // 4M cosines (16 MB of float) per row kind: a block of 1024 rows against
  // 4096 columns, GEMMs large enough for MKL and a block that stays small.
  static constexpr int64_t kChunkEntries = int64_t(1) << 22;
  // With gradients at least 512 rows: each chunk reads and writes the
  // columns' float accumulator once ([columns, d]: 100 MB at 32768 columns of
  // d = 768), which 128-row chunks did 4x as often (bfloat16, B = 16384, d =
  // 768, one hard negative: forward+backward 3.76 -> 3.40 s). Without
  // gradients the smaller chunk is faster (its scores stay in cache).
  static constexpr int64_t kMinChunkRows = 512;

  static at::Tensor operand(const at::Tensor& matrix) {
    if (matrix.scalar_type() == at::kBFloat16 && has_bf16_gemm()) return matrix.contiguous();
    return matrix.to(acc_dtype(matrix.scalar_type())).contiguous();
  }

  // Written into `buffer`, made for the first (largest) chunk and kept: a
  // fresh chunk of 64 MB is mapped and page-faulted anew each time (about 9%
  // of a bfloat16 B = 16384, d = 768, k = 1 step went to the kernel's
  // page-fault handling).
  static at::Tensor scores(const at::Tensor& rows, const at::Tensor& columns, at::Tensor& buffer) {
    const int64_t n = rows.size(0), cols = columns.size(0);
    const bool bf16 = rows.scalar_type() == at::kBFloat16;
    if (!buffer.defined() || buffer.size(0) < n || buffer.size(1) != cols) {
      buffer = at::empty({n, cols}, rows.options().dtype(bf16 ? at::kFloat : rows.scalar_type()));
    }
    at::Tensor out = buffer.narrow(0, 0, n);
    if (bf16) {
      bf16_gemm(rows, false, columns, true, out, 0.0f);
    } else {
      at::mm_out(out, rows, columns.t());
    }
    return out;
  }

  // The chunk's scale * dlogit as the bfloat16 GEMM's operand (rounded once
  // for the chunk's three GEMMs, over the float chunk), or as it is for float
  // and double GEMMs.
  static at::Tensor gradient_operand(const at::Tensor& grads, at::ScalarType operand) {
    return operand == at::kBFloat16 ? bf16_operand_in_place(grads) : grads;
  }

  // out = beta * out + a @ b (beta 0: out not read); a a gradient_operand
  // matrix (or a transposed column slice of it), b an operand matrix.
  static void accumulate(at::Tensor out, const at::Tensor& a, const at::Tensor& b, float beta) {
    if (b.scalar_type() != at::kBFloat16) {
      out.addmm_(a, b, beta);
      return;
    }
    // A transposed slice [cols, n] of the [n, all cols] operand is stored as its transpose.
    const bool transposed = a.stride(1) != 1;
    bf16_gemm(transposed ? a.t() : a, transposed, b, false, out, beta);
  }

  static void row_stats(const at::Tensor& cos, const MnrTile& tile, const at::Tensor& scale,
                        double hardness_strength, at::Tensor lse, at::Tensor target) {
    AT_DISPATCH_FLOATING_TYPES(cos.scalar_type(), "nanfree_mnr_row_stats_cpu", [&] {
      const TileConstants<scalar_t> h(scale, hardness_strength, tile);
      const scalar_t* c = cos.const_data_ptr<scalar_t>();
      scalar_t* out = lse.mutable_data_ptr<scalar_t>();
      scalar_t* t = target.mutable_data_ptr<scalar_t>();
      const bool query_row = tile.row_kind == kMnrRowQuery;
      at::parallel_for(0, tile.rows, row_grain(tile.cols), [&](int64_t begin, int64_t end) {
        RowBuffers<scalar_t> buf(tile);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t g = tile.g0 + i;
          const scalar_t* row = c + i * tile.cols;
          row_logits(row, buf.logits.data(), tile, g, h, buf.own.data(), buf.max_own);
          // The positive is doc g, column g of the query row's first segment.
          if (query_row) t[i] = mnr_target_logit(row[g], h.scale);
          out[i] = row_relative_lse(buf.logits.data(), tile.cols, t[i]);
        }
      });
    });
  }

  static void row_grads(at::Tensor cos, const MnrTile& tile, const at::Tensor& scale,
                        double hardness_strength, const at::Tensor& stats,
                        const at::Tensor& upstream, bool per_direction, bool has_p_row,
                        at::Tensor scale_grad) {
    AT_DISPATCH_FLOATING_TYPES(cos.scalar_type(), "nanfree_mnr_row_grads_cpu", [&] {
      const TileConstants<scalar_t> h(scale, hardness_strength, tile);
      scalar_t* c = cos.mutable_data_ptr<scalar_t>();
      const scalar_t* st = stats.const_data_ptr<scalar_t>();
      const scalar_t* up = upstream.const_data_ptr<scalar_t>();
      scalar_t* sg = scale_grad.mutable_data_ptr<scalar_t>();
      const bool query_row = tile.row_kind == kMnrRowQuery;
      const scalar_t direction = mnr_direction_weight<scalar_t>(per_direction, has_p_row);
      at::parallel_for(0, tile.rows, row_grain(tile.cols), [&](int64_t begin, int64_t end) {
        RowBuffers<scalar_t> buf(tile);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t g = tile.g0 + i;
          scalar_t* row = c + i * tile.cols;
          const scalar_t* row_stats = st + kMnrStatsPerRow * i;
          const scalar_t normalizer = mnr_row_normalizer(row_stats[0], row_stats[1], row_stats[2],
                                                         query_row, per_direction, has_p_row);
          const int count = row_logits(row, buf.logits.data(), tile, g, h, buf.own.data(),
                                       buf.max_own);
          sg[i] = row_gradient(row, buf, count, tile, g, h, normalizer, up[i] * direction, up[i]);
        }
      });
    });
  }

  // row_stats and then row_grads of a tile of Q rows when they are the only
  // row kind (no P rows: a row's normalizer is its own logsumexp), in one pass:
  // each row's logits are made once and the row is read while it is in cache
  // (separate passes read a 16 MB chunk twice).
  static constexpr bool kFusedRowPass = true;
  static void row_stats_and_grads(at::Tensor cos, const MnrTile& tile, const at::Tensor& scale,
                                  double hardness_strength, at::Tensor lse, at::Tensor target,
                                  const at::Tensor& upstream, bool per_direction,
                                  at::Tensor scale_grad) {
    TORCH_INTERNAL_ASSERT(tile.row_kind == kMnrRowQuery);
    AT_DISPATCH_FLOATING_TYPES(cos.scalar_type(), "nanfree_mnr_row_stats_and_grads_cpu", [&] {
      const TileConstants<scalar_t> h(scale, hardness_strength, tile);
      scalar_t* c = cos.mutable_data_ptr<scalar_t>();
      scalar_t* out = lse.mutable_data_ptr<scalar_t>();
      scalar_t* t = target.mutable_data_ptr<scalar_t>();
      const scalar_t* up = upstream.const_data_ptr<scalar_t>();
      scalar_t* sg = scale_grad.mutable_data_ptr<scalar_t>();
      const scalar_t direction = mnr_direction_weight<scalar_t>(per_direction, false);
      const scalar_t no_p_row = -std::numeric_limits<scalar_t>::infinity();
      at::parallel_for(0, tile.rows, row_grain(tile.cols), [&](int64_t begin, int64_t end) {
        RowBuffers<scalar_t> buf(tile);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t g = tile.g0 + i;
          scalar_t* row = c + i * tile.cols;
          const int count = row_logits(row, buf.logits.data(), tile, g, h, buf.own.data(),
                                       buf.max_own);
          // The positive is doc g, column g of the query row's first segment.
          t[i] = mnr_target_logit(row[g], h.scale);
          out[i] = row_relative_lse(buf.logits.data(), tile.cols, t[i]);
          const scalar_t normalizer =
              mnr_row_normalizer(out[i], no_p_row, t[i], true, per_direction, false);
          sg[i] = row_gradient(row, buf, count, tile, g, h, normalizer, up[i] * direction, up[i]);
        }
      });
    });
  }

  static void row_losses(const at::Tensor& stats, bool per_direction, bool has_p_row,
                         at::Tensor loss) {
    AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "nanfree_mnr_row_losses_cpu", [&] {
      const scalar_t* st = stats.const_data_ptr<scalar_t>();
      scalar_t* out = loss.mutable_data_ptr<scalar_t>();
      for (int64_t i = 0; i < loss.numel(); ++i) {
        out[i] = mnr_row_loss(st[kMnrStatsPerRow * i], st[kMnrStatsPerRow * i + 1], per_direction,
                              has_p_row);
      }
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("mnr_loss", &mnr_loss_kernel<CpuMnrTiles>);
  m.impl("mnr_loss_backward", &mnr_loss_backward_kernel<CpuMnrTiles>);
}

}  // namespace nanfree
