// CPU kernels of the softmax family over a dimension that is not the last:
// the contiguous input viewed as [outer, cols, inner] with inner > 1
// (ReductionLayout), reduced over cols in place, with no copy of the input or
// the output.
//
// Layout. A task is one o and a block of up to `width` consecutive i, its
// lanes: lane l is the row (o, i0 + l). Column j of a task, the entries
// (o, j, i0 .. i0 + lanes - 1), is contiguous in memory, so every step below
// is a vector operation across the lanes. Tasks run in parallel. Inside a
// task the lanes go in groups of up to four vectors whose states and sums
// stay in registers while the loop runs over the columns.
//
// Forward. The lanes' online (max, sum) states are built chunk by chunk of
// kSumColumns columns (in L1): the chunk's max per lane, then its sum of exps
// per lane, merged into the state with a vector lse_merge. softmax keeps each
// chunk's exps (in the output, or in a float slab for half types) with the
// chunk's max and rescales them at the end; log_softmax reads its input
// again. Lanes whose max is not finite (NaN, +inf, or nothing but -inf) are
// recomputed with the shared scalar rules of softmax_math.h, entry by entry.
//
// Backward. One pass for each lane's row sum, one for the outputs;
// logsumexp's backward is one elementwise pass. Lanes without gradient are
// zeroed, and lanes holding NaN where exp_u20 would hide it take the shared
// scalar rules.
//
// Block widths: softmax and log_softmax forwards size a task's block (cols x
// lanes, its slab) to stay in L2 between their passes; the others take the
// widest block.
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

#include "cpu/lanes.h"
#include "cpu/vec.h"

namespace nanfree {
namespace cpu {
namespace {

constexpr int64_t kMaxWidth = 256;            // lanes per task, at most
constexpr int64_t kSlabBytes = 256 * 1024;    // a task's columns, kept in L2 between passes
// Columns summed into one partial sum before it joins the lane's total, so a
// long row's sum is not a long sequential sum (error ~ kSumColumns + cols /
// kSumColumns roundings instead of ~ cols).
constexpr int64_t kSumColumns = 64;

// Lanes per task: a multiple of the vector width, at most the row count
// `inner`; `operands` tensors of the block are re-read after the first pass
// (0: none, the widest block).
template <typename acc_t>
int64_t lane_width(const ReductionLayout& s, int operands) {
  const int64_t vec = Vec<acc_t>::size();
  int64_t width = kMaxWidth;
  if (operands > 0) {
    const int64_t fit = kSlabBytes / (operands * std::max<int64_t>(s.n, 1) * sizeof(acc_t));
    width = std::clamp<int64_t>(fit / vec * vec, vec, kMaxWidth);
  }
  return std::min(width, s.inner);
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

// The kernels walk a task's lanes in groups of up to kGroupVectors vectors
// whose running states and sums stay in registers across the columns (kept
// in memory they cost a load and a store per vector and column). The last
// vector of a task may be partial (masked loads and stores).
constexpr int kGroupVectors = 4;

// A group of vectors of a task's lanes: vector v holds lanes
// [first + v * width, first + v * width + lanes(v)).
struct LaneGroup {
  int64_t first;
  int vectors;
  int64_t last_lanes;
  int64_t lanes(int v, int64_t width) const { return v + 1 < vectors ? width : last_lanes; }
};

// Calls body(group) for the task's lanes [0, n), kGroupVectors vectors at a time.
template <typename acc_t, typename Body>
void for_each_group(int64_t n, Body&& body) {
  constexpr int64_t width = Vec<acc_t>::size();
  for (int64_t first = 0; first < n; first += kGroupVectors * width) {
    const int64_t lanes = std::min<int64_t>(kGroupVectors * width, n - first);
    const int vectors = static_cast<int>((lanes + width - 1) / width);
    body(LaneGroup{first, vectors, lanes - (vectors - 1) * width});
  }
}

// keep(j) of the group's lanes as a vector mask (all bits set where kept).
template <typename scalar_t, typename acc_t>
Vec<acc_t> keep_vec(const Lanes<scalar_t>& lanes, int64_t j, int64_t first, int64_t count) {
  acc_t flags[Vec<acc_t>::size()] = {};
  for (int64_t l = 0; l < count; ++l) flags[l] = lanes.keep(j, first + l) ? acc_t(1) : acc_t(0);
  return Vec<acc_t>::loadu(flags) != Vec<acc_t>(acc_t(0));
}

// The entries softmax sees in `count` lanes of column j (first lane `first`):
// dropped entries are -inf.
template <typename scalar_t, typename acc_t>
Vec<acc_t> load_seen(const Lanes<scalar_t>& lanes, int64_t j, int64_t first, int64_t count) {
  const Vec<acc_t> x = load_vec(lanes.column(j) + first, count);
  if (lanes.mask == nullptr) return x;
  return Vec<acc_t>::blendv(Vec<acc_t>(-nf_inf<acc_t>()), x,
                            keep_vec<scalar_t, acc_t>(lanes, j, first, count));
}

template <SoftmaxKind kind, typename scalar_t>
NANFREE_HOT_LOOP void forward_kernel(const ForwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t vw = V::size();
  constexpr bool same_type = std::is_same_v<scalar_t, acc_t>;
  const ReductionLayout s = args.shape;
  const MaskView mask = args.mask;
  const bool masked = mask.data != nullptr;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const TaskGrid grid(s, lane_width<acc_t>(s, kind == SoftmaxKind::LogSumExp ? 0 : 1));
  const int64_t width = grid.width;
  const int64_t chunks = (s.n + kSumColumns - 1) / kSumColumns;

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row_max(width), row_sum(width);
    std::vector<int64_t> mask_offsets(masked ? width : 0);
    std::vector<uint8_t> special(width);
    // softmax: each chunk's max per lane, and (half types) every exp in float.
    std::vector<acc_t> chunk_maxima(kind == SoftmaxKind::Softmax ? chunks * width : 0);
    auto exp_slab = scratch_row<acc_t>(s.n * width, kind == SoftmaxKind::Softmax && !same_type);

    for (int64_t index = begin; index < end; ++index) {
      const Task task = grid.task(index);
      const int64_t n = task.lanes;
      fill_mask_offsets(mask, task.first_row, n, mask_offsets.data());
      const Lanes<scalar_t> lanes = grid.lanes(in, task, mask, mask_offsets.data());
      scalar_t* out_base = out + task.offset;
      // Where the exps of column j, lane l go (softmax): the output itself
      // for float and double, else the float slab.
      const auto exps_at = [&](int64_t j, int64_t l) -> acc_t* {
        if constexpr (same_type) {
          return out_base + j * s.inner + l;
        } else {
          return exp_slab.get() + j * width + l;
        }
      };

      // The lanes' online states, chunk by chunk of kSumColumns columns.
      for_each_group<acc_t>(n, [&](const LaneGroup& group) {
        V m[kGroupVectors], sum[kGroupVectors];
        for (int v = 0; v < kGroupVectors; ++v) {
          m[v] = V(-nf_inf<acc_t>());
          sum[v] = V(acc_t(0));
        }
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t j0 = c * kSumColumns, j1 = std::min(s.n, j0 + kSumColumns);
          V cm[kGroupVectors], cs[kGroupVectors], shift[kGroupVectors];
          for (int v = 0; v < kGroupVectors; ++v) cm[v] = V(-nf_inf<acc_t>());
          // The chunk's max per lane; a NaN propagates (such a lane is special).
          for (int64_t j = j0; j < j1; ++j) {
#pragma GCC unroll 4
            for (int v = 0; v < kGroupVectors; ++v) {
              if (v >= group.vectors) break;
              const V x = load_seen<scalar_t, acc_t>(lanes, j, group.first + v * vw, group.lanes(v, vw));
              cm[v] = at::vec::maximum(cm[v], x);
            }
          }
          for (int v = 0; v < kGroupVectors; ++v) {
            // A lane of nothing but -inf in this chunk adds exp(-inf - 0) = 0
            // instead of exp(-inf - (-inf)) = NaN.
            shift[v] = V::blendv(cm[v], V(acc_t(0)), cm[v] == V(-nf_inf<acc_t>()));
            cs[v] = V(acc_t(0));
          }
          for (int64_t j = j0; j < j1; ++j) {
#pragma GCC unroll 4
            for (int v = 0; v < kGroupVectors; ++v) {
              if (v >= group.vectors) break;
              const int64_t l = group.first + v * vw, k = group.lanes(v, vw);
              const V e = shifted_exp(load_seen<scalar_t, acc_t>(lanes, j, l, k) - shift[v]);
              if constexpr (kind == SoftmaxKind::Softmax) e.store(exps_at(j, l), k);
              cs[v] = cs[v] + e;
            }
          }
          for (int v = 0; v < group.vectors; ++v) {
            if constexpr (kind == SoftmaxKind::Softmax) {
              cm[v].store(chunk_maxima.data() + c * width + group.first + v * vw, group.lanes(v, vw));
            }
            // lse_merge of the lanes' states with the chunk's.
            const V merged = at::vec::maximum(m[v], cm[v]);
            sum[v] = sum[v] * lse_scale_vec(m[v], merged) + cs[v] * lse_scale_vec(cm[v], merged);
            m[v] = merged;
          }
        }
        for (int v = 0; v < group.vectors; ++v) {
          const int64_t l = group.first + v * vw, k = group.lanes(v, vw);
          m[v].store(row_max.data() + l, k);
          sum[v].store(row_sum.data() + l, k);
        }
      });

      // Lanes with a non-finite max: the exact state from the shared update,
      // entry by entry (their vector state may hold NaN from inf - inf).
      bool any_special = false;
      for (int64_t l = 0; l < n; ++l) {
        special[l] = special_lane(row_max[l]);
        if (!special[l]) continue;
        any_special = true;
        LseState<acc_t> state = lse_empty<acc_t>();
        for (int64_t j = 0; j < s.n; ++j) lse_update(state, lane_value<scalar_t, acc_t>(lanes, j, l));
        row_max[l] = state.max;
        row_sum[l] = state.sum;
      }
      for (int64_t l = 0; l < n; ++l) {
        const LseState<acc_t> state{row_max[l], row_sum[l]};
        const RowStats<acc_t> st = row_stats(state);
        stats[stats_offset(s, task.o, 0, task.i0 + l)] = st.max;
        stats[stats_offset(s, task.o, 1, task.i0 + l)] = st.log_sum;
        if constexpr (kind == SoftmaxKind::LogSumExp) {
          out[task.first_row + l] = static_cast<scalar_t>(lse_value(state));
        }
      }
      if constexpr (kind == SoftmaxKind::LogSumExp) continue;

      for_each_group<acc_t>(n, [&](const LaneGroup& group) {
        V m[kGroupVectors], scale[kGroupVectors];
        for (int v = 0; v < group.vectors; ++v) {
          const int64_t l = group.first + v * vw, k = group.lanes(v, vw);
          m[v] = V::loadu(row_max.data() + l, k);
          // softmax: 1 / sum; log_softmax: log(sum). Lanes past k read 0, and
          // the 1 / 0 = inf or log 0 = -inf they give is never stored.
          const V sum = V::loadu(row_sum.data() + l, k);
          scale[v] = kind == SoftmaxKind::Softmax ? V(acc_t(1)) / sum : sum.log();
        }
        if constexpr (kind == SoftmaxKind::Softmax) {
          // exps * lse_scale(chunk max, max) / sum, chunk by chunk; a chunk lane
          // of only -inf has exps 0 and a -inf chunk max, so it stays 0.
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t j0 = c * kSumColumns, j1 = std::min(s.n, j0 + kSumColumns);
            V factor[kGroupVectors];
            for (int v = 0; v < group.vectors; ++v) {
              const V cm = V::loadu(chunk_maxima.data() + c * width + group.first + v * vw,
                                    group.lanes(v, vw));
              factor[v] = lse_scale_vec(cm, m[v]) * scale[v];
            }
            for (int64_t j = j0; j < j1; ++j) {
#pragma GCC unroll 4
              for (int v = 0; v < kGroupVectors; ++v) {
                if (v >= group.vectors) break;
                const int64_t l = group.first + v * vw, k = group.lanes(v, vw);
                store_vec(V::loadu(exps_at(j, l), k) * factor[v], out_base + j * s.inner + l, k);
              }
            }
          }
        } else {
          // (x - max) - log_sum: a -inf entry (dropped or not) stays -inf.
          for (int64_t j = 0; j < s.n; ++j) {
#pragma GCC unroll 4
            for (int v = 0; v < kGroupVectors; ++v) {
              if (v >= group.vectors) break;
              const int64_t l = group.first + v * vw, k = group.lanes(v, vw);
              const V x = load_seen<scalar_t, acc_t>(lanes, j, l, k);
              store_vec((x - m[v]) - scale[v], out_base + j * s.inner + l, k);
            }
          }
        }
      });
      if (!any_special) continue;
      // The shared per-entry rules for the empty, +inf and NaN lanes.
      for (int64_t l = 0; l < n; ++l) {
        if (!special[l]) continue;
        const LseState<acc_t> state{row_max[l], row_sum[l]};
        const acc_t inv_sum = acc_t(1) / state.sum, log_sum = std::log(state.sum);
        for (int64_t j = 0; j < s.n; ++j) {
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
  constexpr int64_t vw = V::size();
  constexpr bool log_softmax = kind == SoftmaxKind::LogSoftmax;
  const ReductionLayout s = args.shape;
  // softmax's backward takes no mask: a dropped entry's output is 0.
  const MaskView mask = log_softmax ? args.mask : MaskView{};
  const bool masked = mask.data != nullptr;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* y_all = args.saved.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const TaskGrid grid(s, lane_width<acc_t>(s, 0));
  const int64_t width = grid.width;
  const acc_t bound = largest_finite<scalar_t>();  // of a saturated gradient
  const V out_max(bound), out_min(-bound);

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> totals(width);
    std::vector<int64_t> mask_offsets(masked ? width : 0);
    for (int64_t index = begin; index < end; ++index) {
      const Task task = grid.task(index);
      const int64_t n = task.lanes;
      fill_mask_offsets(mask, task.first_row, n, mask_offsets.data());
      const Lanes<scalar_t> g_lanes = grid.lanes(g_all, task, mask, mask_offsets.data());
      const scalar_t* g_base = g_all + task.offset;
      const scalar_t* y_base = y_all + task.offset;
      scalar_t* dx_base = dx_all + task.offset;

      for_each_group<acc_t>(n, [&](const LaneGroup& group) {
        V total[kGroupVectors];
        for (int v = 0; v < kGroupVectors; ++v) total[v] = V(acc_t(0));
        // The row sums, in partial sums of kSumColumns columns.
        for (int64_t j0 = 0; j0 < s.n; j0 += kSumColumns) {
          V partial[kGroupVectors];
          for (int v = 0; v < kGroupVectors; ++v) partial[v] = V(acc_t(0));
          for (int64_t j = j0; j < std::min(s.n, j0 + kSumColumns); ++j) {
            const int64_t row = j * s.inner + group.first;
#pragma GCC unroll 4
            for (int v = 0; v < kGroupVectors; ++v) {
              if (v >= group.vectors) break;
              const int64_t k = group.lanes(v, vw);
              const V g = load_vec(g_base + row + v * vw, k);
              if constexpr (log_softmax) {
                // log_softmax sums the kept g only: a dropped entry adds 0.
                partial[v] = partial[v] + (masked ? V::blendv(V(acc_t(0)), g,
                                                              keep_vec<scalar_t, acc_t>(g_lanes, j, group.first + v * vw, k))
                                                  : g);
              } else {
                partial[v] = at::vec::fmadd(g, load_vec(y_base + row + v * vw, k), partial[v]);
              }
            }
          }
          for (int v = 0; v < kGroupVectors; ++v) total[v] = total[v] + partial[v];
        }
        for (int64_t j = 0; j < s.n; ++j) {
          const int64_t row = j * s.inner + group.first;
#pragma GCC unroll 4
          for (int v = 0; v < kGroupVectors; ++v) {
            if (v >= group.vectors) break;
            const int64_t k = group.lanes(v, vw);
            const V g = load_vec(g_base + row + v * vw, k);
            const V y = load_vec(y_base + row + v * vw, k);
            V dx;
            if constexpr (log_softmax) {
              // g - exp(y) * sum, saturated, as log_softmax_grad_value; a dropped
              // entry receives 0 (a lane whose sum overflowed is redone below).
              dx = saturate_vec(g - shifted_exp(y) * total[v], out_max, out_min);
              if (masked) {
                dx = V::blendv(V(acc_t(0)), dx,
                               keep_vec<scalar_t, acc_t>(g_lanes, j, group.first + v * vw, k));
              }
            } else {
              // softmax_grad_value; a NaN row's y and dot carry its NaN.
              dx = softmax_grad_vec(g, y, total[v], out_max, out_min);
            }
            store_vec(dx, dx_base + row + v * vw, k);
          }
        }
        for (int v = 0; v < group.vectors; ++v) {
          total[v].store(totals.data() + group.first + v * vw, group.lanes(v, vw));
        }
      });

      for (int64_t l = 0; l < n; ++l) {
        const RowStats<acc_t> row{stats[stats_offset(s, task.o, 0, task.i0 + l)],
                                  stats[stats_offset(s, task.o, 1, task.i0 + l)]};
        if (!row_has_gradient(row)) {
          // An empty or +inf row passes no gradient.
          for (int64_t j = 0; j < s.n; ++j) dx_base[j * s.inner + l] = scalar_t(0);
        } else if (log_softmax && (std::isnan(row.log_sum) || !std::isfinite(totals[l]))) {
          // exp_u20 would turn the NaN outputs of a NaN row into numbers; a
          // lane whose sum overflowed (g near the largest value) takes the sum
          // again at the scale 2^-64 (GradSum). Both with the shared scalar rule.
          log_softmax_row_by_rule(g_base + l, y_base + l, s.inner, s.n, totals[l],
                                  [&](int64_t j) { return g_lanes.keep(j, l); }, dx_base + l);
        }
      }
    }
  });
}

template <typename scalar_t>
NANFREE_HOT_LOOP void logsumexp_backward_kernel(const BackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t vw = V::size();
  const ReductionLayout s = args.shape;
  const MaskView mask = args.mask;
  const bool masked = mask.data != nullptr;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* x_all = args.saved.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const TaskGrid grid(s, lane_width<acc_t>(s, 0));
  const int64_t width = grid.width;

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> g(width), row_max(width), log_sum(width);
    std::vector<int64_t> mask_offsets(masked ? width : 0);
    for (int64_t index = begin; index < end; ++index) {
      const Task task = grid.task(index);
      const int64_t n = task.lanes;
      fill_mask_offsets(mask, task.first_row, n, mask_offsets.data());
      const Lanes<scalar_t> x_lanes = grid.lanes(x_all, task, mask, mask_offsets.data());
      const scalar_t* x_base = x_all + task.offset;
      scalar_t* dx_base = dx_all + task.offset;
      for (int64_t l = 0; l < n; ++l) {
        g[l] = static_cast<acc_t>(g_all[task.first_row + l]);
        row_max[l] = stats[stats_offset(s, task.o, 0, task.i0 + l)];
        log_sum[l] = stats[stats_offset(s, task.o, 1, task.i0 + l)];
      }
      for_each_group<acc_t>(n, [&](const LaneGroup& group) {
        V gv[kGroupVectors], max_v[kGroupVectors], log_sum_v[kGroupVectors];
        for (int v = 0; v < group.vectors; ++v) {
          const int64_t l = group.first + v * vw, k = group.lanes(v, vw);
          gv[v] = V::loadu(g.data() + l, k);
          max_v[v] = V::loadu(row_max.data() + l, k);
          log_sum_v[v] = V::loadu(log_sum.data() + l, k);
        }
        for (int64_t j = 0; j < s.n; ++j) {
          const int64_t row = j * s.inner + group.first;
#pragma GCC unroll 4
          for (int v = 0; v < kGroupVectors; ++v) {
            if (v >= group.vectors) break;
            const int64_t k = group.lanes(v, vw);
            const V x = load_vec(x_base + row + v * vw, k);
            // g * exp((x - max) - log_sum), as logsumexp_grad_value.
            V dx = gv[v] * shifted_exp((x - max_v[v]) - log_sum_v[v]);
            if (masked) {
              // As logsumexp_grad_value: a dropped entry receives 0, whatever it held.
              dx = V::blendv(V(acc_t(0)), dx,
                             keep_vec<scalar_t, acc_t>(x_lanes, j, group.first + v * vw, k));
            }
            store_vec(dx, dx_base + row + v * vw, k);
          }
        }
      });
      for (int64_t l = 0; l < n; ++l) {
        const RowStats<acc_t> row{row_max[l], log_sum[l]};
        // Rows without gradient get 0; a NaN row takes the shared rule
        // (exp_u20 would turn its NaN into a number).
        if (row_has_gradient(row) && !std::isnan(row.log_sum)) continue;
        for (int64_t j = 0; j < s.n; ++j) {
          const acc_t x = static_cast<acc_t>(x_base[j * s.inner + l]);
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
