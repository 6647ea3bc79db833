// CPU kernels of the softmax family over the last dimension (another dimension:
// softmax_strided.cpp), and the CPU registration of the family, built on the shared
// numerics in csrc/include/nanfree. Rows run in parallel; inside a row the
// finite fast path is vectorized with at::vec, masks are applied as selects
// the compiler vectorizes, and the rows holding a special value (+inf, NaN,
// or nothing but -inf) go through the shared scalar functions.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/softmax_op.h"
#include "cpu/flat_rows.h"
#include "cpu/softmax_strided.h"
#include "cpu/vec.h"

namespace nanfree {
namespace {

using namespace cpu;

// Rows of a chunk are summarized with one vectorized max and one vectorized
// exp-sum, then merged into the row's online state with lse_merge.
constexpr int64_t kChunk = 1024;

// Softmax rows up to this long keep their exps in a scratch row (64 KB of float).
constexpr int64_t kExpBufferCols = 16384;

// Total work per parallel task, in elements.

inline int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1));
}

// One row of a mask: entry j is kept when data[j * stride]; no data means
// every entry is kept. The row offset is computed once per row.
struct MaskRow {
  const bool* data;
  int64_t stride;
  bool keep(int64_t j) const { return data == nullptr || data[j * stride]; }
  // The same mask from entry `start` on.
  MaskRow from(int64_t start) const {
    return MaskRow{data == nullptr ? nullptr : data + start * stride, stride};
  }
};

inline MaskRow mask_row(const MaskView& mask, int64_t row) {
  if (mask.data == nullptr) return MaskRow{nullptr, 0};
  return MaskRow{mask.data + mask_row_offset(mask, row), mask.col_stride};
}

// dst[j] = src[j] where the row's mask keeps entry j, else `dropped` (src may
// be dst). Plain selects over the mask's bytes, which the compiler vectorizes
// for the usual unit column stride (it does not vectorize loads of bool).
// Requires a mask.
template <typename acc_t>
void select_kept(const acc_t* src, acc_t* dst, MaskRow mask, int64_t n, acc_t dropped) {
  const auto* keep = reinterpret_cast<const uint8_t*>(mask.data);
  if (mask.stride == 1) {
    if (src == dst) {
      for (int64_t j = 0; j < n; ++j) {
        const acc_t v = dst[j];
        dst[j] = keep[j] != 0 ? v : dropped;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const acc_t v = src[j];
        dst[j] = keep[j] != 0 ? v : dropped;
      }
    }
  } else if (mask.stride == 0) {  // one flag for the whole row
    if (keep[0] == 0) {
      std::fill(dst, dst + n, dropped);
    } else if (src != dst) {
      std::copy(src, src + n, dst);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = keep[j * mask.stride] != 0 ? src[j] : dropped;
  }
}

// Reads a row in the accumulation type: a plain view for float/double without
// a mask, else converted and masked into `buffer`.
template <typename scalar_t, typename acc_t>
const acc_t* load_row(const scalar_t* src, int64_t n, MaskRow mask, acc_t* buffer) {
  const acc_t* row = as_acc(src, n, buffer);
  if (mask.data == nullptr) return row;
  // As masked_value: a dropped entry is exactly -inf, whatever it held (NaN included).
  select_kept(row, buffer, mask, n, -nf_inf<acc_t>());
  return buffer;
}

// sum(exp(x - max)) over x[0..n) for a finite max; with kStore, also writing
// each exp(x - max) to exps[0..n) in the same pass.
template <bool kStore, typename acc_t>
NANFREE_HOT_LOOP acc_t shifted_exp_sum(const acc_t* x, acc_t max, acc_t* exps, int64_t n) {
  using V = Vec<acc_t>;
  const V shift(max);
  V sum(acc_t(0));
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    const V e = shifted_exp(V::loadu(x + j) - shift);
    if constexpr (kStore) e.store(exps + j);
    sum = sum + e;
  }
  if (j < n) {
    const int64_t tail = n - j;
    // Lanes past the row hold 0 after loadu; keep them out of the sum.
    const V e = V::set(V(acc_t(0)), shifted_exp(V::loadu(x + j, tail) - shift), tail);
    if constexpr (kStore) e.store(exps + j, tail);
    sum = sum + e;
  }
  return reduce_lanes<acc_t>([](const V& a, const V& b) { return a + b; }, sum);
}

// The logsumexp state of x[0..n), given m = row_max(x, n). When `exps` is
// given, it receives exp(x - chunk max) for a chunk with a finite max (the
// caller rescales it).
template <typename acc_t>
NANFREE_HOT_LOOP LseState<acc_t> chunk_state(const acc_t* x, int64_t n, acc_t m, acc_t* exps) {
  if (m == -nf_inf<acc_t>()) {
    // All entries -inf: the empty set, and exp(x - m) would be exp(NaN).
    if (exps != nullptr) std::fill(exps, exps + n, acc_t(0));
    return lse_empty<acc_t>();
  }
  if (nf_isnan(m) || m == nf_inf<acc_t>()) {
    // NaN or +inf entries: x - m is NaN somewhere, so the shared scalar update
    // applies the limits. Such a row never takes the vectorized output path.
    LseState<acc_t> state = lse_empty<acc_t>();
    for (int64_t j = 0; j < n; ++j) lse_update(state, x[j]);
    return state;
  }
  if (exps != nullptr) return LseState<acc_t>{m, shifted_exp_sum<true>(x, m, exps, n)};
  return LseState<acc_t>{m, shifted_exp_sum<false>(x, m, exps, n)};
}

// Whether rows of n entries are narrow: one vector at most, taken a vector's
// width of rows at a time by narrow_rows_forward / narrow_rows_backward (AVX-512).
inline bool narrow_width(int64_t n, int64_t vector_width) {
#if defined(CPU_CAPABILITY_AVX512)
  return n <= vector_width;
#else
  return false;
#endif
}

// The log of a one-chunk row's sum of exps, as every path of the forward takes
// it for rows of n entries, so that a row gets the same bits on each: for
// narrow rows (narrow_width), ATen's vector log (1 ulp;
// log(0) = -inf, log(+inf) = +inf, NaN stays NaN, as libm's), which it takes
// for W rows at once (a libm log per row was a fifth of its time); libm's for
// longer rows (a vector log per row would cost them up to 1.7x).
template <typename acc_t>
inline acc_t log_of_sum(acc_t sum, int64_t n) {
  if (narrow_width(n, Vec<acc_t>::size())) {
    acc_t out;
    Vec<acc_t>(sum).log().store(&out, 1);
    return out;
  }
  return nf_log(sum);
}

// Rows this short (one chunk) of float or double without a mask go through
// short_rows_forward, a block of them at a time.
constexpr int64_t kShortRowBlock = 4;

// softmax or log_softmax of the leading rows of x (rows of n <= kChunk entries,
// unmasked, float or double) in blocks of kShortRowBlock, each phase over the
// block's rows before the next, so that the rows' dependency chains (a max, a
// sum of exps, a log, each ending in a horizontal reduction) overlap: up to 2x
// faster than a row at a time on rows of 32 to 128 floats. The values are the
// general path's for a row whose max is finite. Stops before the first block
// holding a row whose max is not finite (NaN, +inf or an empty row: the shared
// per-entry rules) or a partial block; returns how many rows it wrote.
template <SoftmaxKind kind, typename acc_t>
NANFREE_HOT_LOOP int64_t short_rows_forward(const acc_t* x, int64_t rows, int64_t n, acc_t* y,
                                            acc_t* stats) {
  using V = Vec<acc_t>;
  int64_t done = 0;
  for (; done + kShortRowBlock <= rows; done += kShortRowBlock) {
    const acc_t* xb = x + done * n;
    acc_t* yb = y + done * n;
    acc_t m[kShortRowBlock], sum[kShortRowBlock];
    bool finite = true;
    for (int64_t i = 0; i < kShortRowBlock; ++i) {
      m[i] = row_max(xb + i * n, n);
      finite = finite && !nf_isinf(m[i]) && !nf_isnan(m[i]);
    }
    if (!finite) break;  // a NaN, +inf or empty row: the general path's rules
    for (int64_t i = 0; i < kShortRowBlock; ++i) {
      if constexpr (kind == SoftmaxKind::Softmax) {
        sum[i] = shifted_exp_sum<true>(xb + i * n, m[i], yb + i * n, n);
      } else {
        sum[i] = shifted_exp_sum<false, acc_t>(xb + i * n, m[i], nullptr, n);
      }
    }
    for (int64_t i = 0; i < kShortRowBlock; ++i) {
      // One chunk: the log of its sum in acc_t, as the general path takes it.
      const acc_t log_sum = log_of_sum(sum[i], n);
      stats[2 * (done + i)] = m[i];
      stats[2 * (done + i) + 1] = log_sum;
      if constexpr (kind == SoftmaxKind::Softmax) {
        const V inv_sum(acc_t(1) / sum[i]);
        at::vec::map([&](V e) { return e * inv_sum; }, yb + i * n, yb + i * n, n);
      } else {
        const V shift(m[i]), log_sum_v(log_sum);
        at::vec::map([&](V v) { return (v - shift) - log_sum_v; }, yb + i * n, xb + i * n, n);
      }
    }
  }
  return done;
}

#if defined(CPU_CAPABILITY_AVX512)
// The sum of W vectors' lanes e[0..W) in the order of reduce_lanes' tree (lane
// i with lane i + W/2, then i + W/4, ... 1), so that a row summed down a lane
// of the e[j] gets the same bits as that row's vector summed across its lanes.
template <typename acc_t>
inline Vec<acc_t> tree_sum(Vec<acc_t>* e) {
  for (int64_t step = Vec<acc_t>::size() / 2; step >= 1; step /= 2) {
    for (int64_t i = 0; i < step; ++i) e[i] = e[i] + e[i + step];
  }
  return e[0];
}

// A block's mask as lane bits (narrow_rows_forward / narrow_rows_backward):
// bit l of vectors[k] is set when the block's flat entry W k + l is kept. The
// block's mask rows are copied end to end (a masked byte load and store per
// row for the usual unit column stride), then read a vector at a time (keep_bits).
// `first_row` is the block's first row in the problem (its mask row).
template <typename acc_t>
struct BlockMask {
  static constexpr int64_t W = Vec<acc_t>::size();
  uint32_t vectors[W];

  BlockMask(const MaskView& mask, int64_t first_row, int64_t n) {
    alignas(64) bool flat[W * W];  // n <= W rows of n entries
    const __mmask16 first_n = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t r = 0; r < W; ++r) {
      const bool* keep = mask.data + mask_row_offset(mask, first_row + r);
      if (mask.col_stride == 1) {
        _mm_mask_storeu_epi8(flat + r * n, first_n, _mm_maskz_loadu_epi8(first_n, keep));
      } else {
        for (int64_t j = 0; j < n; ++j) flat[r * n + j] = keep[j * mask.col_stride];
      }
    }
    for (int64_t k = 0; k < n; ++k) vectors[k] = keep_bits(flat + W * k, 1, W);
  }
};

// softmax or log_softmax of the leading rows of x, rows of n <= W entries
// (one vector; float or double, masked or not), W rows at a time with the rows
// across the lanes (cpu/flat_rows.h): the max and the sum of exps of W rows
// are vertical operations over n columns and their W logs one batch, instead
// of two horizontal reductions and a log per row, which bound such rows at
// several times torch's time. x's row 0 is the problem's row `first_row` (its
// mask row). The values are the per-row paths' (short_rows_forward, and the
// general path for a masked row), bit for bit: the same entries (a dropped one
// is -inf, whatever it held), the same exps, the sum in reduce_lanes' order,
// the same log. Stops before the first block holding a row whose max is not
// finite (a NaN, +inf, all -inf or all dropped row) or a partial block;
// returns how many rows it wrote.
template <SoftmaxKind kind, typename acc_t>
NANFREE_HOT_LOOP int64_t narrow_rows_forward(const acc_t* x, int64_t rows, const FlatRows<acc_t>& f,
                                             const MaskView& mask, int64_t first_row, acc_t* y,
                                             acc_t* stats) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const int64_t n = f.n;
  alignas(64) acc_t m[W], sum[W], log_sum[W];
  int64_t done = 0;
  for (; done + W <= rows; done += W) {
    const acc_t* xb = x + done * n;
    acc_t* yb = y + done * n;
    // With a mask, the block's entries with each dropped one -inf (as masked_value).
    alignas(64) acc_t seen[W * W];
    const acc_t* entries = xb;
    if (mask.data != nullptr) {
      const BlockMask<acc_t> keep(mask, first_row + done, n);
      for (int64_t k = 0; k < n; ++k) {
        blend_bits(V(-nf_inf<acc_t>()), V::loadu(xb + W * k), keep.vectors[k]).store(seen + W * k);
      }
      entries = seen;
    }
    V e[W];  // the columns, then their exps
    f.columns(entries, e);
    V mx(-nf_inf<acc_t>());
    for (int64_t j = 0; j < n; ++j) mx = at::vec::maximum(mx, e[j]);  // propagates NaN
    if (mx.has_inf_nan()) break;  // a NaN, +inf or empty row: the general path's rules
    for (int64_t j = n; j < W; ++j) e[j] = V(acc_t(0));  // the lanes past a row's end
    if constexpr (kind == SoftmaxKind::Softmax) {
      // The exps in place, each row's stored once, then read down the columns.
      for (int64_t k = 0; k < n; ++k) shifted_exp(V::loadu(entries + W * k) - f.per_row(k, mx)).store(yb + W * k);
      f.columns(yb, e);
    } else {
      for (int64_t j = 0; j < n; ++j) e[j] = shifted_exp(e[j] - mx);
    }
    const V total = tree_sum(e);
    mx.store(m);
    total.store(sum);
    // One chunk: the log of its sum in acc_t, as the general path takes it.
    total.log().store(log_sum);
    for (int64_t i = 0; i < W; ++i) {
      stats[2 * (done + i)] = m[i];
      stats[2 * (done + i) + 1] = log_sum[i];
    }
    if constexpr (kind == SoftmaxKind::Softmax) {
      const V inv_sum = V(acc_t(1)) / total;
      for (int64_t k = 0; k < n; ++k) {
        (V::loadu(yb + W * k) * f.per_row(k, inv_sum)).store(yb + W * k);
      }
    } else {
      const V ls = V::loadu(log_sum);
      for (int64_t k = 0; k < n; ++k) {
        ((V::loadu(entries + W * k) - f.per_row(k, mx)) - f.per_row(k, ls)).store(yb + W * k);
      }
    }
  }
  return done;
}
#endif

template <SoftmaxKind kind, typename scalar_t>
void forward_kernel(const ForwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr bool same_type = std::is_same_v<scalar_t, acc_t>;
  const int64_t rows = args.shape.outer, cols = args.shape.n;
  const MaskView mask = args.mask;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats_out = args.stats.mutable_data_ptr<acc_t>();
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
#if defined(CPU_CAPABILITY_AVX512)
  // Rows of one vector at most go W at a time across the lanes (narrow_rows_forward).
  const bool narrow = same_type && kind != SoftmaxKind::LogSumExp && narrow_width(cols, V::size());
  const FlatRows<acc_t> narrow_table(narrow ? cols : 0);
#endif

  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    // One chunk of a row, converted or masked, in the accumulation type (an
    // unmasked float or double row is read in place).
    auto chunk_buffer = scratch_row<acc_t>(std::min(cols, kChunk), !same_type || mask.data != nullptr);
    // Softmax exps of a whole row, kept in cache until the output is written
    // once from them: the output is touched by one streaming pass (for a large
    // tensor each first touch of a page is a page fault, and interleaving
    // those with the reads of x made the forward 10% slower than torch's).
    // Rows too long for the cache keep them in the output itself (float and double).
    const bool buffered = kind == SoftmaxKind::Softmax && (!same_type || cols <= kExpBufferCols);
    auto exp_buffer = scratch_row<acc_t>(cols, buffered);
    std::vector<acc_t> chunk_maxima(chunks);
    int64_t next_narrow = begin;  // the first row narrow_rows_forward is tried at
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x_row = in + r * cols;
      if constexpr (same_type && kind != SoftmaxKind::LogSumExp) {
        if (chunks == 1) {
          int64_t written = 0, short_rows = mask.data == nullptr ? end - r : 0;
#if defined(CPU_CAPABILITY_AVX512)
          if (narrow && r >= next_narrow) {
            written = narrow_rows_forward<kind>(x_row, end - r, narrow_table, mask, r, out + r * cols,
                                                stats_out + 2 * r);
            // Past a block narrow_rows_forward leaves, back to it at the next block.
            next_narrow = r + written + V::size();
            short_rows = std::min<int64_t>(short_rows, V::size());
          }
#endif
          if (written == 0 && short_rows > 0) {
            written = short_rows_forward<kind>(x_row, short_rows, cols, out + r * cols,
                                               stats_out + 2 * r);
          }
          if (written > 0) {
            r += written - 1;
            continue;
          }
        }
      }
      const MaskRow keep = mask_row(mask, r);
      // The values softmax sees in x_row[start, start + n), in the accumulation type.
      const auto load = [&](int64_t start, int64_t n) {
        return load_row(x_row + start, n, keep.from(start), chunk_buffer.get());
      };
      // The same values and their max (NaN if one is NaN); float16 / bfloat16
      // rows without a mask are widened and maxed in one pass.
      const auto load_with_max = [&](int64_t start, int64_t n) -> std::pair<const acc_t*, acc_t> {
        if constexpr (!same_type) {
          if (keep.data == nullptr) {
            const acc_t m = widen_max(x_row + start, chunk_buffer.get(), n);
            return {chunk_buffer.get(), m};
          }
        }
        const acc_t* x = load(start, n);
        return {x, row_max(x, n)};
      };
      acc_t* exps = kind != SoftmaxKind::Softmax ? nullptr
                     : buffered                     ? exp_buffer.get()
                                                    : acc_destination(out + r * cols, exp_buffer.get());
      // The chunks' states merged in double: a float running sum over
      // thousands of chunks loses digits (2^23 columns: up to 1e-7 relative in the
      // logsumexp, six times torch's cascade sum).
      LseState<double> wide = lse_empty<double>();
      const acc_t* last_loaded = nullptr;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t start = c * kChunk, n = std::min(kChunk, cols - start);
        const auto [x, m] = load_with_max(start, n);
        const LseState<acc_t> part = chunk_state(x, n, m, exps == nullptr ? nullptr : exps + start);
        chunk_maxima[c] = part.max;
        const LseState<double> part_wide{part.max, part.sum};
        wide = c == 0 ? part_wide : lse_merge(wide, part_wide);
        last_loaded = x;
      }
      const LseState<acc_t> state{static_cast<acc_t>(wide.max), static_cast<acc_t>(wide.sum)};
      // The output pass reads the values again: a single chunk's are still loaded.
      const auto reload = [&](int64_t start, int64_t n) {
        return chunks == 1 ? last_loaded : load(start, n);
      };
      // One chunk: its sum is the row's, exact in acc_t, whose log takes less time
      // than double's (which was a fifth of the forward of rows of 64 floats); the
      // merged sum of several chunks keeps its double log.
      const acc_t log_sum = chunks == 1 ? log_of_sum(state.sum, cols) : static_cast<acc_t>(nf_log(wide.sum));
      stats_out[2 * r] = state.max;
      stats_out[2 * r + 1] = log_sum;
      if constexpr (kind == SoftmaxKind::LogSumExp) {
        out[r] = static_cast<scalar_t>(lse_value(wide));
        continue;
      }
      scalar_t* y = out + r * cols;
      // The vectorized output path is for rows with a finite max and sum; the
      // empty, +inf and NaN rows take the shared per-entry rules.
      const bool finite_row = !nf_isinf(state.max) && !nf_isnan(state.sum);
      const acc_t inv_sum = acc_t(1) / state.sum;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t start = c * kChunk, n = std::min(kChunk, cols - start);
        if constexpr (kind == SoftmaxKind::Softmax) {
          if (finite_row) {
            // A chunk of only -inf has exps 0 and a -inf max: lse_scale gives 0.
            const V factor(lse_scale(chunk_maxima[c], state.max) * inv_sum);
            // Scaled and stored (converted for half types) in one pass.
            at::vec::map([&](V e) { return e * factor; }, y + start, exps + start, n);
          } else {
            const acc_t* x = reload(start, n);
            for (int64_t j = 0; j < n; ++j) exps[start + j] = softmax_value(x[j], state, inv_sum);
            store_row(exps + start, y + start, n);
          }
        } else {
          const acc_t* x = reload(start, n);
          if (finite_row) {
            const V shift(state.max), log_sum_v(log_sum);
            // x - max - log_sum: a -inf entry (dropped or not) stays -inf, as log_softmax_value.
            at::vec::map([&](V v) { return (v - shift) - log_sum_v; }, y + start, x, n);
          } else {
            // In place over the chunk buffer for half types (x may be that buffer).
            acc_t* result = acc_destination(y + start, chunk_buffer.get());
            for (int64_t j = 0; j < n; ++j) result[j] = log_softmax_value(x[j], state, log_sum);
            store_row(result, y + start, n);
          }
        }
      }
    }
  });
}

template <SoftmaxKind kind>
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& input, int64_t dim,
                                           const std::optional<at::Tensor>& mask) {
  const ForwardArgs args = prepare_forward(kind, input, dim, mask);
  if (args.stats.numel() == 0) return {args.output, args.stats};
  if (args.shape.inner > 1) {
    strided_forward(kind, args);
    return {args.output, args.stats};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_softmax_forward", [&] {
    forward_kernel<kind, scalar_t>(args);
  });
  return {args.output, args.stats};
}

// The backward of an unmasked row with a finite max and log_sum, the common
// case, straight on the stored type: ATen's maps convert float16 / bfloat16
// to float in registers, so no row is copied. The formulas are those of the
// shared *_grad_value functions.
template <SoftmaxKind kind, typename scalar_t, typename acc_t>
[[gnu::always_inline]] NANFREE_HOT_LOOP inline void unmasked_finite_row_backward(const scalar_t* g_all, const scalar_t* s_row,
                                  RowStats<acc_t> row, scalar_t* dx_row, int64_t r, int64_t cols) {
  using V = Vec<acc_t>;
  if constexpr (kind == SoftmaxKind::LogSumExp) {
    const V g(static_cast<acc_t>(g_all[r])), max_v(row.max), log_sum_v(row.log_sum);
    // g * exp(x - max - log_sum), as logsumexp_grad_value.
    at::vec::map([&](V x) { return g * shifted_exp((x - max_v) - log_sum_v); }, dx_row, s_row,
                 cols);
  } else if constexpr (kind == SoftmaxKind::Softmax) {
    const scalar_t* g_row = g_all + r * cols;
    const V dot(row_dot(g_row, s_row, cols));
    const V out_max(largest_finite<scalar_t>()), out_min(-largest_finite<scalar_t>());
    // softmax_grad_vec without its compare and blend, which stalled this loop (0.75-0.89x
    // torch's backward on rows of 4 MB, AMD EPYC): y (g - dot), saturated, keeping the
    // largest |g - dot| of each lane aside; a row where a difference overflowed to inf
    // (g and dot near the largest value) is computed again by softmax_grad_vec, which
    // halves g and dot there. A NaN g or y makes dot NaN, and every difference with it.
    V largest_difference(acc_t(0));
    at::vec::map2([&](V g, V y) {
      const V d = g - dot;
      largest_difference = at::vec::clamp_min(d.abs(), largest_difference);
      return saturate_vec(y * d, out_max, out_min);
    }, dx_row, g_row, s_row, cols);
    const int all_lanes = (1 << V::size()) - 1;
    // Some lane saw g - dot overflow: y (g - dot) is not the gradient there.
    if ((largest_difference == V(std::numeric_limits<acc_t>::infinity())).zero_mask() != all_lanes) {
      at::vec::map2([&](V g, V y) { return softmax_grad_vec(g, y, dot, out_max, out_min); }, dx_row,
                    g_row, s_row, cols);
    }
  } else {
    const scalar_t* g_row = g_all + r * cols;
    const acc_t sum = row_sum(g_row, cols);
    if (!std::isfinite(sum)) {
      // The sum overflowed (g near the largest value), or g holds NaN: the shared scalar rule
      // with the row's sum at the scale 2^-64 (rare; a second pass).
      log_softmax_row_by_rule(g_row, s_row, 1, cols, sum, [](int64_t) { return true; }, dx_row);
      return;
    }
    const V sum_v(sum), out_max(largest_finite<scalar_t>()), out_min(-largest_finite<scalar_t>());
    // g - exp(y) * sum, saturated, as log_softmax_grad_value.
    at::vec::map2([&](V g, V y) { return saturate_vec(g - shifted_exp(y) * sum_v, out_max, out_min); },
                  dx_row, g_row, s_row, cols);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The backward of the leading rows of y and g (rows of n <= W entries, float or
// double; softmax unmasked, log_softmax masked or not), W rows at a time with
// the rows across the lanes, as narrow_rows_forward: each row's reduction
// (sum(g y) for softmax, the sum of the kept g for log_softmax) a vertical sum
// in the per-row path's order (reduce_row's, or for a masked row ATen's
// reduce_all's: lane by lane below a full vector), the gradient by the per-row
// paths' formulas over the block's vectors, so the values are their bits (a
// dropped entry receives 0). y's row 0 is the problem's row `first_row` (its
// mask row). Stops before the first block holding a row without a gradient, a
// NaN row, a log_softmax row whose sum is not finite or a softmax row where
// g - dot overflowed (the per-row paths' rules), or a partial block; returns
// how many rows it wrote.
template <SoftmaxKind kind, typename acc_t>
NANFREE_HOT_LOOP int64_t narrow_rows_backward(const acc_t* g, const acc_t* y, const acc_t* stats,
                                              int64_t rows, const FlatRows<acc_t>& f,
                                              const MaskView& mask, int64_t first_row, acc_t* dx) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const int64_t n = f.n;
  const V zero(acc_t(0)), out_max(largest_finite<acc_t>()), out_min(-largest_finite<acc_t>());
  int64_t done = 0;
  for (; done + W <= rows; done += W) {
    // Every row's max and log_sum finite (a row with a finite max has a finite log_sum):
    // else an empty, +inf or NaN row, the per-row paths' rules.
    if (V::loadu(stats + 2 * done).has_inf_nan() || V::loadu(stats + 2 * done + W).has_inf_nan()) break;
    const acc_t* gb = g + done * n;
    const acc_t* yb = y + done * n;
    acc_t* db = dx + done * n;
    V c[W];
    V reduction;
    const std::optional<BlockMask<acc_t>> keep =
        mask.data == nullptr ? std::nullopt : std::optional<BlockMask<acc_t>>(std::in_place, mask, first_row + done, n);
    if constexpr (kind == SoftmaxKind::Softmax) {
      // The products g y, then their columns: one transpose instead of one of g and one of y.
      alignas(64) acc_t products[W * W];
      for (int64_t k = 0; k < n; ++k) (V::loadu(gb + W * k) * V::loadu(yb + W * k)).store(products + W * k);
      f.columns(products, c);
    } else if (keep) {
      // The kept g: a dropped one adds 0, whatever it held.
      alignas(64) acc_t kept_g[W * W];
      for (int64_t k = 0; k < n; ++k) blend_bits(zero, V::loadu(gb + W * k), keep->vectors[k]).store(kept_g + W * k);
      f.columns(kept_g, c);
    } else {
      f.columns(gb, c);
    }
    if (keep) {
      // Summed as vec_sum: lane by lane below a full vector, reduce_lanes' tree for a
      // full one; then 0 + sum.
      if (n < W) {
        reduction = c[0];
        for (int64_t j = 1; j < n; ++j) reduction = reduction + c[j];
      } else {
        reduction = tree_sum(c);
      }
      reduction = zero + reduction;
    } else {
      for (int64_t j = 0; j < n; ++j) c[j] = zero + c[j];  // 0 + v: reduce_row's -0 -> +0
      for (int64_t j = n; j < W; ++j) c[j] = zero;
      reduction = tree_sum(c);
    }
    if constexpr (kind == SoftmaxKind::Softmax) {
      V largest_difference = zero;
      for (int64_t k = 0; k < n; ++k) {
        const V d = V::loadu(gb + W * k) - f.per_row(k, reduction);
        largest_difference = at::vec::clamp_min(d.abs(), largest_difference);
        saturate_vec(V::loadu(yb + W * k) * d, out_max, out_min).store(db + W * k);
      }
      // Some g - dot overflowed: those rows are the per-row path's (it halves g and dot).
      if ((largest_difference == V(nf_inf<acc_t>())).zero_mask() != (1 << W) - 1) break;
    } else {
      if (reduction.has_inf_nan()) break;  // the sum overflowed or holds NaN: the shared rule
      for (int64_t k = 0; k < n; ++k) {
        const V sum = f.per_row(k, reduction);
        const V d = saturate_vec(V::loadu(gb + W * k) - shifted_exp(V::loadu(yb + W * k)) * sum, out_max, out_min);
        (keep ? blend_bits(zero, d, keep->vectors[k]) : d).store(db + W * k);  // dropped: 0
      }
    }
  }
  return done;
}
#endif

template <SoftmaxKind kind, typename scalar_t>
void backward_kernel(const BackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool same_type = std::is_same_v<scalar_t, acc_t>;
  const int64_t rows = args.shape.outer, cols = args.shape.n;
  const MaskView mask = args.mask;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* s_all = args.saved.const_data_ptr<scalar_t>();
  const acc_t* stats_all = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const acc_t bound = largest_finite<scalar_t>();  // of a saturated gradient
#if defined(CPU_CAPABILITY_AVX512)
  // Rows of one vector at most go W at a time across the lanes (narrow_rows_backward).
  // (A masked softmax backward stays per row: it measured 3.9x torch's at [65536, 16].)
  const bool narrow = same_type && narrow_width(cols, Vec<acc_t>::size()) &&
                      (kind == SoftmaxKind::LogSoftmax || (kind == SoftmaxKind::Softmax && mask.data == nullptr));
  const FlatRows<acc_t> narrow_table(narrow ? cols : 0);
#endif

  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    // Chunks of a row in the accumulation type (half types only): the row is
    // converted one chunk at a time, in cache, instead of whole rows at once.
    const int64_t width = std::min(cols, kChunk);
    auto g_buf = scratch_row<acc_t>(width, !same_type && kind != SoftmaxKind::LogSumExp);
    auto s_buf = scratch_row<acc_t>(width, !same_type);
    auto dx_buf = scratch_row<acc_t>(width, !same_type);
    // The gradient with dropped entries zeroed, for the masked log_softmax sum.
    auto kept_g = scratch_row<acc_t>(width, kind == SoftmaxKind::LogSoftmax && mask.data != nullptr);
    // The next row narrow_rows_backward is tried at (past a block it leaves, the next one).
    int64_t next_narrow = begin;
    for (int64_t r = begin; r < end; ++r) {
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (same_type) {
        if (narrow && r >= next_narrow) {
          const int64_t written = narrow_rows_backward<kind>(
              g_all + r * cols, s_all + r * cols, stats_all + 2 * r, end - r, narrow_table, mask, r,
              dx_all + r * cols);
          next_narrow = r + written + Vec<acc_t>::size();
          if (written > 0) {
            r += written - 1;
            continue;
          }
        }
      }
#endif
      scalar_t* dx_row = dx_all + r * cols;
      const RowStats<acc_t> row{stats_all[2 * r], stats_all[2 * r + 1]};
      if (!row_has_gradient(row)) {
        std::fill(dx_row, dx_row + cols, scalar_t(0));
        continue;
      }
      const MaskRow keep = mask_row(mask, r);
      // g_all holds one value per row for logsumexp, a row per row otherwise.
      const scalar_t* g_row = kind == SoftmaxKind::LogSumExp ? g_all + r : g_all + r * cols;
      const scalar_t* s_row = s_all + r * cols;
      // A NaN row (NaN log_sum) takes the shared scalar rules: exp_u20 would
      // turn its NaN into a number. Rows reaching the vector paths below hold
      // a finite max, so each kept entry is finite or -inf.
      const bool nan_row = nf_isnan(row.log_sum);
      if (keep.data == nullptr && !nan_row) {
        unmasked_finite_row_backward<kind>(g_all, s_row, row, dx_row, r, cols);
        continue;
      }
      // Masked and NaN rows: chunk by chunk in the accumulation type.
      // The row's reduction: sum(g * y) for softmax, the sum of the kept g for log_softmax.
      acc_t reduction = 0;
      if constexpr (kind != SoftmaxKind::LogSumExp) {
        for (int64_t start = 0; start < cols; start += kChunk) {
          const int64_t n = std::min(kChunk, cols - start);
          const acc_t* g = as_acc(g_row + start, n, g_buf.get());
          if constexpr (kind == SoftmaxKind::Softmax) {
            reduction += vec_dot(g, as_acc(s_row + start, n, s_buf.get()), n);
          } else if (keep.data == nullptr) {
            reduction += vec_sum(g, n);
          } else {
            select_kept(g, kept_g.get(), keep.from(start), n, acc_t(0));  // dropped entries add nothing
            reduction += vec_sum(kept_g.get(), n);
          }
        }
      }
      if constexpr (kind == SoftmaxKind::LogSoftmax) {
        // A NaN row (exp_u20 would turn its NaN outputs into numbers) and a row
        // whose sum overflowed: the shared scalar rule.
        if (nan_row || !std::isfinite(reduction)) {
          log_softmax_row_by_rule(g_row, s_row, 1, cols, reduction,
                                  [&](int64_t j) { return keep.keep(j); }, dx_row);
          continue;
        }
      }
      for (int64_t start = 0; start < cols; start += kChunk) {
        const int64_t n = std::min(kChunk, cols - start);
        const MaskRow chunk_keep = keep.from(start);
        const acc_t* s = as_acc(s_row + start, n, s_buf.get());
        acc_t* dx = acc_destination(dx_row + start, dx_buf.get());
        if constexpr (kind == SoftmaxKind::LogSumExp) {
          const acc_t g = static_cast<acc_t>(g_all[r]);
          if (nan_row) {
            for (int64_t j = 0; j < n; ++j)
              dx[j] = logsumexp_grad_value(g, s[j], row, chunk_keep.keep(j));
          } else {
            const Vec<acc_t> gv(g), max_v(row.max), log_sum_v(row.log_sum);
            // g * exp(x - max - log_sum), as logsumexp_grad_value.
            at::vec::map([&](Vec<acc_t> x) { return gv * shifted_exp((x - max_v) - log_sum_v); },
                         dx, s, n);
            // As logsumexp_grad_value: a dropped entry receives 0, whatever it held.
            if (keep.data != nullptr) select_kept(dx, dx, chunk_keep, n, acc_t(0));
          }
        } else if constexpr (kind == SoftmaxKind::Softmax) {
          const acc_t* g = as_acc(g_row + start, n, g_buf.get());
          const Vec<acc_t> dot(reduction), out_max(bound), out_min(-bound);
          // softmax_grad_value; dropped entries have y = 0.
          at::vec::map2([&](Vec<acc_t> gv, Vec<acc_t> y) {
            return softmax_grad_vec(gv, y, dot, out_max, out_min);
          }, dx, g, s, n);
        } else {
          const acc_t* g = as_acc(g_row + start, n, g_buf.get());
          const Vec<acc_t> sum_v(reduction), out_max(bound), out_min(-bound);
          // g - exp(y) * sum, saturated, as log_softmax_grad_value.
          at::vec::map2([&](Vec<acc_t> gv, Vec<acc_t> y) {
            return saturate_vec(gv - shifted_exp(y) * sum_v, out_max, out_min);
          }, dx, g, s, n);
          // As log_softmax_grad_value: a dropped entry receives 0.
          if (keep.data != nullptr) select_kept(dx, dx, chunk_keep, n, acc_t(0));
        }
        store_row(dx, dx_row + start, n);
      }
    }
  });
}

template <SoftmaxKind kind>
at::Tensor backward(const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& stats,
                    int64_t dim, const std::optional<at::Tensor>& mask) {
  const BackwardArgs args = prepare_backward(kind, grad, saved, stats, dim, mask);
  if (args.grad_input.numel() == 0) return args.grad_input;
  if (args.shape.inner > 1) {
    strided_backward(kind, args);
    return args.grad_input;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.saved.scalar_type(),
                                  "nanfree_softmax_backward", [&] {
    backward_kernel<kind, scalar_t>(args);
  });
  return args.grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("softmax", &forward<SoftmaxKind::Softmax>);
  m.impl("log_softmax", &forward<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp", &forward<SoftmaxKind::LogSumExp>);
  m.impl("softmax_backward", &backward_without_mask<&backward<SoftmaxKind::Softmax>>);
  m.impl("log_softmax_backward", &backward<SoftmaxKind::LogSoftmax>);
  m.impl("logsumexp_backward", &backward<SoftmaxKind::LogSumExp>);
}

}  // namespace nanfree
