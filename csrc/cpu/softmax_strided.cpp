// CPU kernels of the softmax family over a dimension that is not the last:
// the contiguous input viewed as [outer, cols, inner] with inner > 1
// (SoftmaxShape), reduced over cols in place, with no copy of the input or
// the output.
//
// Layout. A task is one o and a block of up to `width` consecutive i, its
// lanes: lane l is the row (o, i0 + l). Column j of a task, the entries
// (o, j, i0 .. i0 + lanes - 1), is contiguous in memory, so every step below
// is a vector operation across the lanes, and a task reads whole cache lines.
// Tasks run in parallel.
//
// Forward. The lanes' online (max, sum) states are built chunk by chunk: a
// chunk of columns (at most kChunkElements entries, which stay in L1, and at
// most kSumColumns columns) gets its max per lane, then its sum of exps per
// lane, and is merged into the state with a vector lse_merge. softmax keeps each chunk's exps (in the output, or
// in a float slab for half types) with the chunk's max and rescales them at
// the end; log_softmax reads its input again. Lanes whose max is not finite
// (NaN, +inf, or nothing but -inf) are recomputed with the shared scalar
// rules of softmax_math.h, entry by entry.
//
// Backward. One pass for each lane's row sum, one for the outputs;
// logsumexp's backward is one elementwise pass. Lanes without gradient are
// zeroed, and lanes holding NaN where exp_u20 would hide it take the shared
// scalar rules.
//
// Block widths: softmax and log_softmax size a task's block of columns (its
// slab) to stay in L2 between the passes; logsumexp, which has no output pass,
// takes the widest block.
#include "cpu/softmax_strided.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/softmax_vec.h"

namespace nanfree {
namespace cpu {
namespace {

constexpr int64_t kMaxWidth = 256;            // lanes per task, at most
constexpr int64_t kSlabBytes = 256 * 1024;    // a task's columns, kept in L2 between passes
constexpr int64_t kChunkElements = 4096;      // a forward chunk, kept in L1
// Columns summed into one partial sum before it joins the lane's total, so a
// long row's sum is not a long sequential sum (error ~ kSumColumns + cols /
// kSumColumns roundings instead of ~ cols).
constexpr int64_t kSumColumns = 64;
constexpr int64_t kGrainElements = 32768;     // work per parallel task group

// Lanes per task: a multiple of the vector width, at most the row count
// `inner`; `operands` tensors of the block are re-read after the first pass
// (0: none, the widest block).
template <typename acc_t>
int64_t lane_width(const SoftmaxShape& s, int operands) {
  const int64_t vec = Vec<acc_t>::size();
  int64_t width = kMaxWidth;
  if (operands > 0) {
    const int64_t fit = kSlabBytes / (operands * std::max<int64_t>(s.cols, 1) * sizeof(acc_t));
    width = std::clamp<int64_t>(fit / vec * vec, vec, kMaxWidth);
  }
  return std::min(width, s.inner);
}

// The lanes of one task: column j of lane l is base[j * stride + l]; the mask
// (when there is one) keeps it when mask[offsets[l] + j * mask_col_stride].
template <typename scalar_t>
struct Lanes {
  const scalar_t* base;
  int64_t stride;
  int64_t count;
  const bool* mask;
  int64_t mask_col_stride;
  const int64_t* mask_offsets;

  const scalar_t* column(int64_t j) const { return base + j * stride; }
  bool keep(int64_t j, int64_t l) const {
    return mask == nullptr || mask[mask_offsets[l] + j * mask_col_stride];
  }
  // keep[l] for column j as bytes (requires a mask).
  void load_keep(int64_t j, uint8_t* keep) const {
    const auto* bytes = reinterpret_cast<const uint8_t*>(mask);
    const int64_t col = j * mask_col_stride;
    for (int64_t l = 0; l < count; ++l) keep[l] = bytes[mask_offsets[l] + col];
  }
};

// The mask row offset of each lane of the task starting at row `first_row`.
inline void fill_mask_offsets(const MaskView& mask, int64_t first_row, int64_t count,
                              int64_t* offsets) {
  if (mask.data == nullptr) return;
  for (int64_t l = 0; l < count; ++l) offsets[l] = mask_row_offset(mask, first_row + l);
}

// The tasks of a strided problem: blocks of `width` lanes, `blocks` per o.
struct Task {
  int64_t o;
  int64_t i0;
  int64_t lanes;      // this block's lane count (the last block of an o may be short)
  int64_t offset;     // element offset of entry (o, 0, i0)
  int64_t first_row;  // row index o * inner + i0 of lane 0
};

struct TaskGrid {
  SoftmaxShape shape;
  int64_t width;
  int64_t blocks;

  TaskGrid(const SoftmaxShape& s, int64_t lanes_per_task)
      : shape(s), width(lanes_per_task), blocks((s.inner + width - 1) / width) {}
  int64_t count() const { return shape.outer * blocks; }
  // Tasks per parallel grain: about kGrainElements entries.
  int64_t grain() const {
    return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, shape.cols * width));
  }
  Task task(int64_t t) const {
    const int64_t o = t / blocks, i0 = (t % blocks) * width;
    return Task{o, i0, std::min(width, shape.inner - i0), entry_offset(shape, o, 0, i0),
                o * shape.inner + i0};
  }
  // The task's lanes of a tensor of the problem's shape starting at `data`.
  template <typename scalar_t>
  Lanes<scalar_t> lanes(const scalar_t* data, const Task& t, const MaskView& mask,
                        const int64_t* mask_offsets) const {
    return Lanes<scalar_t>{data + t.offset, shape.inner, t.lanes, mask.data, mask.col_stride,
                           mask_offsets};
  }
};

// Column j in the accumulation type with dropped entries replaced by
// `dropped`: the input itself for an unmasked float or double column, else
// written into `buffer`.
template <typename scalar_t, typename acc_t>
const acc_t* load_column(const Lanes<scalar_t>& lanes, int64_t j, acc_t* buffer, uint8_t* keep,
                         acc_t dropped) {
  const acc_t* x = as_acc(lanes.column(j), lanes.count, buffer);
  if (lanes.mask == nullptr) return x;
  lanes.load_keep(j, keep);
  for (int64_t l = 0; l < lanes.count; ++l) {
    const acc_t v = x[l];
    buffer[l] = keep[l] != 0 ? v : dropped;  // a plain select the compiler vectorizes
  }
  return buffer;
}

// Stores n accumulation-type values into the output's type.
template <typename scalar_t, typename acc_t>
void store_lanes(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (src != dst) std::copy(src, src + n, dst);
  } else {
    at::vec::map([](Vec<float> v) { return v; }, dst, src, n);
  }
}

// Vector lse_scale(a, b) = exp(a - b) for a <= b: equal arguments (both -inf
// for a lane with nothing yet, or equal maxima) give 1 instead of exp(NaN).
template <typename acc_t>
Vec<acc_t> lse_scale_vec(const Vec<acc_t>& a, const Vec<acc_t>& b) {
  return Vec<acc_t>::blendv(shifted_exp(a - b), Vec<acc_t>(acc_t(1)), a == b);
}

// Whether lane l's max leaves the vector path: NaN, +inf or -inf (empty).
template <typename acc_t>
bool special_lane(acc_t max) {
  return !std::isfinite(max);
}

// The entry softmax sees at column j of lane l, in the accumulation type.
template <typename scalar_t, typename acc_t>
acc_t lane_value(const Lanes<scalar_t>& lanes, int64_t j, int64_t l) {
  return masked_value(static_cast<acc_t>(lanes.column(j)[l]), lanes.keep(j, l));
}

template <SoftmaxKind kind, typename scalar_t>
NANFREE_HOT_LOOP void forward_kernel(const ForwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr bool same_type = std::is_same_v<scalar_t, acc_t>;
  const SoftmaxShape s = args.shape;
  const MaskView mask = args.mask;
  const bool masked = mask.data != nullptr;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const TaskGrid grid(s, lane_width<acc_t>(s, kind == SoftmaxKind::LogSumExp ? 0 : 1));
  const int64_t width = grid.width;
  const int64_t chunk_cols =
      std::clamp<int64_t>(kChunkElements / width, 1, kSumColumns);
  const int64_t chunks = (s.cols + chunk_cols - 1) / chunk_cols;

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row_max(width), row_sum(width), chunk_max(width), chunk_sum(width),
        shift(width), lane_tmp(width), y_buf(width);
    std::vector<int64_t> mask_offsets(masked ? width : 0);
    std::vector<uint8_t> keep(width), special(width);
    std::vector<const acc_t*> cols_ptr(chunk_cols);
    // A chunk's columns in the accumulation type (half types or a mask).
    auto chunk_buffer = scratch_row<acc_t>(chunk_cols * width, !same_type || masked);
    // softmax: each chunk's max per lane, and (half types) every exp in float.
    std::vector<acc_t> chunk_maxima(kind == SoftmaxKind::Softmax ? chunks * width : 0);
    auto exp_slab = scratch_row<acc_t>(s.cols * width, kind == SoftmaxKind::Softmax && !same_type);

    for (int64_t index = begin; index < end; ++index) {
      const Task task = grid.task(index);
      const int64_t o = task.o, i0 = task.i0, n = task.lanes;
      fill_mask_offsets(mask, task.first_row, n, mask_offsets.data());
      const Lanes<scalar_t> lanes = grid.lanes(in, task, mask, mask_offsets.data());
      scalar_t* out_base = out + task.offset;
      // Where the exps of column j go (softmax): the output itself for float
      // and double, else the float slab.
      const auto exps_of = [&](int64_t j) -> acc_t* {
        if constexpr (same_type) {
          return out_base + j * s.inner;
        } else {
          return exp_slab.get() + j * width;
        }
      };
      std::fill_n(row_max.begin(), n, -nf_inf<acc_t>());
      std::fill_n(row_sum.begin(), n, acc_t(0));

      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t j0 = c * chunk_cols, cols_here = std::min(chunk_cols, s.cols - j0);
        for (int64_t jj = 0; jj < cols_here; ++jj) {
          cols_ptr[jj] = load_column(lanes, j0 + jj, chunk_buffer.get() + jj * width, keep.data(),
                                     -nf_inf<acc_t>());
        }
        // The chunk's max per lane; a NaN propagates (such a lane is special).
        std::copy_n(cols_ptr[0], n, chunk_max.begin());
        for (int64_t jj = 1; jj < cols_here; ++jj) {
          at::vec::map2([](V a, V b) { return at::vec::maximum(a, b); }, chunk_max.data(),
                        chunk_max.data(), cols_ptr[jj], n);
        }
        // A lane of nothing but -inf in this chunk adds exp(-inf - 0) = 0
        // instead of exp(-inf - (-inf)) = NaN.
        at::vec::map([](V m) { return V::blendv(m, V(acc_t(0)), m == V(-nf_inf<acc_t>())); },
                     shift.data(), chunk_max.data(), n);
        std::fill_n(chunk_sum.begin(), n, acc_t(0));
        for (int64_t jj = 0; jj < cols_here; ++jj) {
          const acc_t* x = cols_ptr[jj];
          acc_t* exps = kind == SoftmaxKind::Softmax ? exps_of(j0 + jj) : nullptr;
          for (int64_t l = 0; l < n; l += V::size()) {
            const int64_t k = std::min<int64_t>(V::size(), n - l);
            const V e = shifted_exp(V::loadu(x + l, k) - V::loadu(shift.data() + l, k));
            if (exps != nullptr) e.store(exps + l, k);
            (V::loadu(chunk_sum.data() + l, k) + e).store(chunk_sum.data() + l, k);
          }
        }
        if constexpr (kind == SoftmaxKind::Softmax) {
          std::copy_n(chunk_max.begin(), n, chunk_maxima.begin() + c * width);
        }
        // lse_merge of the lanes' states with the chunk's.
        for (int64_t l = 0; l < n; l += V::size()) {
          const int64_t k = std::min<int64_t>(V::size(), n - l);
          const V m = V::loadu(row_max.data() + l, k), cm = V::loadu(chunk_max.data() + l, k);
          const V merged = at::vec::maximum(m, cm);
          const V sum = V::loadu(row_sum.data() + l, k) * lse_scale_vec(m, merged) +
                        V::loadu(chunk_sum.data() + l, k) * lse_scale_vec(cm, merged);
          merged.store(row_max.data() + l, k);
          sum.store(row_sum.data() + l, k);
        }
      }

      // Lanes with a non-finite max: the exact state from the shared update,
      // entry by entry (their vector state may hold NaN from inf - inf).
      bool any_special = false;
      for (int64_t l = 0; l < n; ++l) {
        special[l] = special_lane(row_max[l]);
        if (!special[l]) continue;
        any_special = true;
        LseState<acc_t> state = lse_empty<acc_t>();
        for (int64_t j = 0; j < s.cols; ++j) lse_update(state, lane_value<scalar_t, acc_t>(lanes, j, l));
        row_max[l] = state.max;
        row_sum[l] = state.sum;
      }
      for (int64_t l = 0; l < n; ++l) {
        const LseState<acc_t> state{row_max[l], row_sum[l]};
        const RowStats<acc_t> st = row_stats(state);
        stats[stats_offset(s, o, 0, i0 + l)] = st.max;
        stats[stats_offset(s, o, 1, i0 + l)] = st.log_sum;
        if constexpr (kind == SoftmaxKind::LogSumExp) {
          out[o * s.inner + i0 + l] = static_cast<scalar_t>(lse_value(state));
        }
      }
      if constexpr (kind == SoftmaxKind::LogSumExp) continue;

      if constexpr (kind == SoftmaxKind::Softmax) {
        // exps * lse_scale(chunk max, max) / sum, chunk by chunk; a chunk lane
        // of only -inf has exps 0 and a -inf chunk max, so it stays 0.
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t j0 = c * chunk_cols, cols_here = std::min(chunk_cols, s.cols - j0);
          at::vec::map3(
              [](V cm, V m, V sum) { return lse_scale_vec(cm, m) / sum; }, lane_tmp.data(),
              chunk_maxima.data() + c * width, row_max.data(), row_sum.data(), n);
          for (int64_t jj = 0; jj < cols_here; ++jj) {
            acc_t* exps = exps_of(j0 + jj);
            at::vec::map2([](V e, V factor) { return e * factor; }, exps, exps, lane_tmp.data(), n);
            store_lanes(exps, out_base + (j0 + jj) * s.inner, n);
          }
        }
      } else {
        // (x - max) - log_sum: a -inf entry (dropped or not) stays -inf.
        for (int64_t l = 0; l < n; ++l) lane_tmp[l] = std::log(row_sum[l]);
        for (int64_t j = 0; j < s.cols; ++j) {
          const acc_t* x = load_column(lanes, j, chunk_buffer.get(), keep.data(), -nf_inf<acc_t>());
          acc_t* y = acc_destination(out_base + j * s.inner, y_buf.data());
          at::vec::map3([](V v, V m, V log_sum) { return (v - m) - log_sum; }, y, x,
                        row_max.data(), lane_tmp.data(), n);
          store_lanes(y, out_base + j * s.inner, n);
        }
      }
      if (!any_special) continue;
      // The shared per-entry rules for the empty, +inf and NaN lanes.
      for (int64_t l = 0; l < n; ++l) {
        if (!special[l]) continue;
        const LseState<acc_t> state{row_max[l], row_sum[l]};
        const acc_t inv_sum = acc_t(1) / state.sum, log_sum = std::log(state.sum);
        for (int64_t j = 0; j < s.cols; ++j) {
          const acc_t x = lane_value<scalar_t, acc_t>(lanes, j, l);
          const acc_t y = kind == SoftmaxKind::Softmax ? softmax_value(x, state, inv_sum)
                                                       : log_softmax_value(x, state, log_sum);
          out_base[j * s.inner + l] = static_cast<scalar_t>(y);
        }
      }
    }
  });
}

// Backward of softmax (sum of g * y) and log_softmax (sum of the kept g).
template <SoftmaxKind kind, typename scalar_t>
NANFREE_HOT_LOOP void distribution_backward_kernel(const BackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr bool log_softmax = kind == SoftmaxKind::LogSoftmax;
  const SoftmaxShape s = args.shape;
  // softmax's backward takes no mask: a dropped entry's output is 0.
  const MaskView mask = log_softmax ? args.mask : MaskView{nullptr, {1, 1, 1}, {0, 0, 0}, 0};
  const bool masked = mask.data != nullptr;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* y_all = args.saved.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const TaskGrid grid(s, lane_width<acc_t>(s, 2));
  const int64_t width = grid.width;

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> total(width), partial(width), g_buf(width), y_buf(width), dx_buf(width);
    std::vector<int64_t> mask_offsets(masked ? width : 0);
    std::vector<uint8_t> keep(width);
    for (int64_t index = begin; index < end; ++index) {
      const Task task = grid.task(index);
      const int64_t o = task.o, i0 = task.i0, n = task.lanes;
      fill_mask_offsets(mask, task.first_row, n, mask_offsets.data());
      const Lanes<scalar_t> g_lanes = grid.lanes(g_all, task, mask, mask_offsets.data());
      const Lanes<scalar_t> y_lanes = grid.lanes(y_all, task, MaskView{}, nullptr);
      scalar_t* dx_base = dx_all + task.offset;

      std::fill_n(total.begin(), n, acc_t(0));
      for (int64_t j0 = 0; j0 < s.cols; j0 += kSumColumns) {
        std::fill_n(partial.begin(), n, acc_t(0));
        for (int64_t j = j0; j < std::min(s.cols, j0 + kSumColumns); ++j) {
          // log_softmax sums the kept g only: a dropped entry adds 0.
          const acc_t* g = load_column(g_lanes, j, g_buf.data(), keep.data(), acc_t(0));
          if constexpr (log_softmax) {
            at::vec::map2([](V t, V gv) { return t + gv; }, partial.data(), partial.data(), g, n);
          } else {
            const acc_t* y = as_acc(y_lanes.column(j), n, y_buf.data());
            at::vec::map3([](V t, V gv, V yv) { return t + gv * yv; }, partial.data(),
                          partial.data(), g, y, n);
          }
        }
        at::vec::map2([](V t, V p) { return t + p; }, total.data(), total.data(), partial.data(), n);
      }
      for (int64_t j = 0; j < s.cols; ++j) {
        const acc_t* g = as_acc(g_lanes.column(j), n, g_buf.data());
        const acc_t* y = as_acc(y_lanes.column(j), n, y_buf.data());
        acc_t* dx = acc_destination(dx_base + j * s.inner, dx_buf.data());
        if constexpr (log_softmax) {
          // g - exp(y) * sum, as log_softmax_grad_value.
          at::vec::map3([](V gv, V yv, V t) { return gv - shifted_exp(yv) * t; }, dx, g, y,
                        total.data(), n);
          if (masked) {
            g_lanes.load_keep(j, keep.data());
            // As log_softmax_grad_value: a dropped entry receives 0.
            for (int64_t l = 0; l < n; ++l) {
              const acc_t v = dx[l];
              dx[l] = keep[l] != 0 ? v : acc_t(0);
            }
          }
        } else {
          // y * (g - dot), as softmax_grad_value; a NaN row's y and dot carry its NaN.
          at::vec::map3([](V gv, V yv, V t) { return yv * (gv - t); }, dx, g, y, total.data(), n);
        }
        store_lanes(dx, dx_base + j * s.inner, n);
      }
      for (int64_t l = 0; l < n; ++l) {
        const RowStats<acc_t> row{stats[stats_offset(s, o, 0, i0 + l)],
                                  stats[stats_offset(s, o, 1, i0 + l)]};
        if (!row_has_gradient(row)) {
          // An empty or +inf row passes no gradient.
          for (int64_t j = 0; j < s.cols; ++j) dx_base[j * s.inner + l] = scalar_t(0);
        } else if (log_softmax && std::isnan(row.log_sum)) {
          // exp_u20 would turn the NaN outputs of a NaN row into numbers.
          for (int64_t j = 0; j < s.cols; ++j) {
            const acc_t g = static_cast<acc_t>(g_lanes.column(j)[l]);
            const acc_t y = static_cast<acc_t>(y_lanes.column(j)[l]);
            dx_base[j * s.inner + l] =
                static_cast<scalar_t>(log_softmax_grad_value(g, y, total[l], g_lanes.keep(j, l)));
          }
        }
      }
    }
  });
}

template <typename scalar_t>
NANFREE_HOT_LOOP void logsumexp_backward_kernel(const BackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  const SoftmaxShape s = args.shape;
  const MaskView mask = args.mask;
  const bool masked = mask.data != nullptr;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* x_all = args.saved.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const TaskGrid grid(s, lane_width<acc_t>(s, 0));
  const int64_t width = grid.width;

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> g(width), row_max(width), log_sum(width), x_buf(width), dx_buf(width);
    std::vector<int64_t> mask_offsets(masked ? width : 0);
    std::vector<uint8_t> keep(width);
    for (int64_t index = begin; index < end; ++index) {
      const Task task = grid.task(index);
      const int64_t o = task.o, i0 = task.i0, n = task.lanes;
      fill_mask_offsets(mask, task.first_row, n, mask_offsets.data());
      const Lanes<scalar_t> x_lanes = grid.lanes(x_all, task, mask, mask_offsets.data());
      scalar_t* dx_base = dx_all + task.offset;
      for (int64_t l = 0; l < n; ++l) {
        g[l] = static_cast<acc_t>(g_all[task.first_row + l]);
        row_max[l] = stats[stats_offset(s, o, 0, i0 + l)];
        log_sum[l] = stats[stats_offset(s, o, 1, i0 + l)];
      }
      for (int64_t j = 0; j < s.cols; ++j) {
        const acc_t* x = as_acc(x_lanes.column(j), n, x_buf.data());
        acc_t* dx = acc_destination(dx_base + j * s.inner, dx_buf.data());
        // g * exp(x - max - log_sum), as logsumexp_grad_value.
        at::vec::map3([](V xv, V m, V ls) { return shifted_exp((xv - m) - ls); }, dx, x,
                      row_max.data(), log_sum.data(), n);
        at::vec::map2([](V e, V gv) { return e * gv; }, dx, dx, g.data(), n);
        if (masked) {
          x_lanes.load_keep(j, keep.data());
          // As logsumexp_grad_value: a dropped entry receives 0, whatever it held.
          for (int64_t l = 0; l < n; ++l) {
            const acc_t v = dx[l];
            dx[l] = keep[l] != 0 ? v : acc_t(0);
          }
        }
        store_lanes(dx, dx_base + j * s.inner, n);
      }
      for (int64_t l = 0; l < n; ++l) {
        const RowStats<acc_t> row{row_max[l], log_sum[l]};
        // Rows without gradient get 0; a NaN row takes the shared rule
        // (exp_u20 would turn its NaN into a number).
        if (row_has_gradient(row) && !std::isnan(row.log_sum)) continue;
        for (int64_t j = 0; j < s.cols; ++j) {
          const acc_t x = static_cast<acc_t>(x_lanes.column(j)[l]);
          const acc_t d = row_has_gradient(row)
                              ? logsumexp_grad_value(g[l], x, row, x_lanes.keep(j, l))
                              : acc_t(0);
          dx_base[j * s.inner + l] = static_cast<scalar_t>(d);
        }
      }
    }
  });
}

}  // namespace

void strided_forward(SoftmaxKind kind, const ForwardArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_softmax_strided_forward", [&] {
    switch (kind) {
      case SoftmaxKind::Softmax: return forward_kernel<SoftmaxKind::Softmax, scalar_t>(args);
      case SoftmaxKind::LogSoftmax: return forward_kernel<SoftmaxKind::LogSoftmax, scalar_t>(args);
      case SoftmaxKind::LogSumExp: return forward_kernel<SoftmaxKind::LogSumExp, scalar_t>(args);
    }
  });
}

void strided_backward(SoftmaxKind kind, const BackwardArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.saved.scalar_type(),
                                  "nanfree_softmax_strided_backward", [&] {
    switch (kind) {
      case SoftmaxKind::Softmax:
        return distribution_backward_kernel<SoftmaxKind::Softmax, scalar_t>(args);
      case SoftmaxKind::LogSoftmax:
        return distribution_backward_kernel<SoftmaxKind::LogSoftmax, scalar_t>(args);
      case SoftmaxKind::LogSumExp: return logsumexp_backward_kernel<scalar_t>(args);
    }
  });
}

}  // namespace cpu
}  // namespace nanfree
