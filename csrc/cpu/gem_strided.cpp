// CPU kernels of GeM pooling over a dimension other than the last (inner > 1
// in the [outer, n, inner] layout): tasks of lanes across the inner dimension
// (cpu/lanes.h), entry j of every lane one contiguous load, the loops over j
// vector operations across the lanes (rows asked for ahead, compensated
// sums). A mask that is the same for every lane (the token layout's mask
// [B, L, 1] expanded: stride 0 along inner) drops whole rows of a task; any
// other mask is read per lane. What the rows of gem.cpp share with these is in
// gem.h.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/gem.h"
#include "cpu/lanes.h"

namespace nanfree {
namespace cpu {
namespace {

// How a mask varies within a task: not at all (none), per row j only (stride
// 0 along inner: a row is kept or dropped for every lane), or per lane.
enum class MaskMode { None, Row, Lane };

// The lanes of a task: `count` reductions (o, i0 .. i0 + count - 1) in up to
// kGroupVectors vectors; vector v holds lanes [v w, v w + width(v)).
template <typename acc_t>
struct LaneGroup {
  static constexpr int64_t w = Vec<acc_t>::size();
  int64_t count;
  int64_t vectors() const { return (count + w - 1) / w; }
  int64_t width(int64_t v) const { return std::min<int64_t>(w, count - v * w); }
};

// Lanes per task: four vectors, so a task's n rows stay in L2 between the two
// forward passes for n up to about 1000 (float).
template <typename acc_t>
int64_t lanes_per_task(int64_t inner) {
  return std::min<int64_t>(inner, kGroupVectors * Vec<acc_t>::size());
}

template <MaskMode kMode, typename scalar_t>
NANFREE_HOT_LOOP void lanes_forward_task(const scalar_t* x, const bool* keep, int64_t n,
                                         int64_t inner, const MaskView& ms,
                                         const LaneGroup<at::opmath_type<scalar_t>>& g,
                                         const GemScalars<at::opmath_type<scalar_t>>& k,
                                         at::opmath_type<scalar_t>* m_out,
                                         at::opmath_type<scalar_t>* sum_out,
                                         at::opmath_type<scalar_t>* cnt_out) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  constexpr int64_t G = kGroupVectors;
  const int64_t nv = g.vectors();
  const V lowest(-std::numeric_limits<acc_t>::infinity()), zero(acc_t(0)), one(acc_t(1));
  const V epsv(k.eps), pv(k.p);
  const auto lane_keep = [&](int64_t j, int64_t v) {
    return keep_lanes<acc_t>(keep + j * ms.col_stride + v * w * ms.strides[2], ms.strides[2],
                             g.width(v));
  };

  // Pass 1: the maxima and counts.
  V mx[G], cnt[G];
  for (int64_t v = 0; v < G; ++v) mx[v] = lowest, cnt[v] = zero;
  int64_t rows_kept = 0;
  const int64_t row_bytes = g.count * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) prefetch_row(x + (j + kPrefetchRows) * inner, row_bytes);
    if constexpr (kMode == MaskMode::Row) {
      if (!keep[j * ms.col_stride]) continue;
      ++rows_kept;
    }
    const scalar_t* xj = x + j * inner;
    for (int64_t v = 0; v < nv; ++v) {
      V xv = load_vec(xj + v * w, g.width(v));
      if constexpr (kMode == MaskMode::Lane) {
        const V kv = lane_keep(j, v);
        xv = V::blendv(lowest, xv, kv);  // a masked entry, NaN included, is out of the max
        cnt[v] = cnt[v] + (kv & one);
      }
      mx[v] = at::vec::maximum(mx[v], xv);  // propagates NaN
    }
  }
  bool any_fast = false;
  acc_t base_m[G * w], base_e[G * w], base_l[G * w];
  for (int64_t v = 0; v < nv; ++v) {
    if constexpr (kMode == MaskMode::None) cnt[v] = V(static_cast<acc_t>(n));
    if constexpr (kMode == MaskMode::Row) cnt[v] = V(static_cast<acc_t>(rows_kept));
    // clamp_to_eps of the maximum (at::vec::maximum keeps NaN); 0 when empty.
    const V m = V::blendv(at::vec::maximum(mx[v], epsv), zero, cnt[v] == zero);
    m.store(m_out + v * w, g.width(v));
    cnt[v].store(cnt_out + v * w, g.width(v));
  }
  for (int64_t l = 0; l < g.count; ++l) {
    // The lanes off the fast path get the base of m = 1 here (their sums are
    // recomputed below), so that the vector pass stays finite.
    const bool fast = fast_ratios(m_out[l], k);
    base_m[l] = fast ? m_out[l] : acc_t(1);
    any_fast = any_fast || fast;
  }
  ratio_bases(base_m, g.count, base_e, base_l);
  RatioBase<acc_t> base[G];
  for (int64_t v = 0; v < nv; ++v) {
    base[v] = {V::loadu(base_e + v * w, g.width(v)), V::loadu(base_l + v * w, g.width(v))};
  }

  // Pass 2 (from cache): the power sums.
  CompensatedSum<acc_t> total[G];
  for (int64_t j = 0; any_fast && j < n; ++j) {
    if constexpr (kMode == MaskMode::Row) {
      if (!keep[j * ms.col_stride]) continue;
    }
    const scalar_t* xj = x + j * inner;
    for (int64_t v = 0; v < nv; ++v) {
      const V c = at::vec::clamp_min(load_vec(xj + v * w, g.width(v)), epsv);
      const V rp = ratio_power_vec(c, base[v], pv);
      if constexpr (kMode == MaskMode::Lane) {
        total[v].add(V::blendv(zero, rp, lane_keep(j, v)));
      } else {
        total[v].add(rp);
      }
    }
  }
  for (int64_t v = 0; v < nv; ++v) total[v].sum.store(sum_out + v * w, g.width(v));
  // Lanes off the fast path with something to sum: the scalar rules.
  for (int64_t l = 0; l < g.count; ++l) {
    if (fast_ratios(m_out[l], k) || cnt_out[l] == acc_t(0)) continue;
    sum_out[l] = power_sum_scalar(x + l, n, inner,
                                  kMode == MaskMode::None ? nullptr : keep + l * ms.strides[2], ms.col_stride,
                                  m_out[l], k);
  }
}

template <MaskMode kMode, typename scalar_t>
void lanes_forward(const GemArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k) {
  using acc_t = at::opmath_type<scalar_t>;
  const ReductionLayout s = args.shape;
  const TaskGrid grid(s, lanes_per_task<acc_t>(s.inner));
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const MaskView mask = layout_mask_view(args.mask);

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t t0, int64_t t1) {
    constexpr int64_t kMax = kGroupVectors * Vec<acc_t>::size();
    acc_t m[kMax], sum[kMax], cnt[kMax];
    for (int64_t t = t0; t < t1; ++t) {
      const Task task = grid.task(t);
      const LaneGroup<acc_t> g{task.lanes};
      const bool* keep =
          kMode == MaskMode::None ? nullptr : mask.data + mask_offset(mask, task.o, task.i0);
      lanes_forward_task<kMode>(in + task.offset, keep, s.n, s.inner, mask, g, k, m, sum, cnt);
      const int64_t r0 = task.first_row;
      finish_forward(m, sum, cnt, g.count, k, out + r0, stats + kGemStats * r0);
    }
  });
}

// ---- backward ---------------------------------------------------------------

template <MaskMode kMode, bool kPGrad, typename scalar_t>
NANFREE_HOT_LOOP void lanes_backward_task(const scalar_t* x, scalar_t* dx, const bool* keep,
                                          int64_t n, int64_t inner, const MaskView& ms,
                                          const LaneGroup<at::opmath_type<scalar_t>>& g,
                                          const GemScalars<at::opmath_type<scalar_t>>& k,
                                          const ReductionGrads<at::opmath_type<scalar_t>>& q,
                                          const BackwardScalars<at::opmath_type<scalar_t>>& bs,
                                          at::opmath_type<scalar_t> out_max, bool stream,
                                          at::opmath_type<scalar_t>* dsum_out) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  constexpr int64_t G = kGroupVectors;
  const int64_t nv = g.vectors();
  const V zero(acc_t(0));
  const V all = zero == zero;
  const auto lane_keep = [&](int64_t j, int64_t v) {
    return keep_lanes<acc_t>(keep + j * ms.col_stride + v * w * ms.strides[2], ms.strides[2],
                             g.width(v));
  };
  const int64_t row_bytes = g.count * static_cast<int64_t>(sizeof(scalar_t));
  EntryConsts<acc_t> e[G];
  V live[G];
  CompensatedSum<acc_t> total[G];
  bool any_fast = false;
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t c = g.width(v), l0 = v * w;
    e[v] = entry_consts_lanes<kPGrad>(q, l0, c);
    acc_t lv[w];
    for (int64_t l = 0; l < w; ++l) {
      lv[l] = l < c && q.live[l0 + l] ? acc_t(1) : acc_t(0);
      any_fast = any_fast || (l < c && q.fast[l0 + l]);
    }
    live[v] = V::loadu(lv) != zero;
  }
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) prefetch_row(x + (j + kPrefetchRows) * inner, row_bytes);
    const scalar_t* xj = x + j * inner;
    scalar_t* dxj = dx + j * inner;
    bool row_kept = true;
    if constexpr (kMode == MaskMode::Row) row_kept = keep[j * ms.col_stride];
    if (!row_kept || !any_fast) {  // a masked row, or no lane of the vector path: 0 here
      for (int64_t v = 0; v < nv; ++v) put_entries(zero, dxj + v * w, g.width(v), stream);
      continue;
    }
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t c = g.width(v);
      V keep_v = c == w ? all : first_lanes(zero, all, c);
      if constexpr (kMode == MaskMode::Lane) keep_v = lane_keep(j, v);
      V h;
      const V grad = entry_grad<kPGrad>(load_vec(xj + v * w, c), e[v], bs, h);
      if constexpr (kPGrad) total[v].add(V::blendv(zero, h, keep_v));
      // Lanes without gradient, and masked entries, get 0.
      put_entries(V::blendv(zero, grad, keep_v & live[v]), dxj + v * w, c, stream);
    }
  }
  for (int64_t v = 0; v < nv; ++v) total[v].sum.store(dsum_out + v * w, g.width(v));
  // Lanes with gradient off the fast path: the scalar rules, over what the
  // vector pass wrote.
  for (int64_t l = 0; l < g.count; ++l) {
    if (!q.live[l] || q.fast[l]) continue;
    dsum_out[l] = backward_scalar(x + l, dx + l, n, inner,
                                  kMode == MaskMode::None ? nullptr : keep + l * ms.strides[2], ms.col_stride,
                                  q.g[l], q.m[l], q.mean[l], q.cnt[l], kPGrad, k, out_max);
  }
}

template <MaskMode kMode, bool kPGrad, typename scalar_t>
void lanes_backward(const GemBackwardArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k,
                    double* partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const ReductionLayout s = args.shape;
  const TaskGrid grid(s, lanes_per_task<acc_t>(s.inner));
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  const scalar_t* grad = args.grad.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const acc_t out_max = largest_finite<scalar_t>();
  const BackwardScalars<acc_t> bs = backward_scalars(k, out_max);
  // Streaming stores when the gradient is larger than the cache and every
  // task's row of vectors starts on a whole vector's stored size.
  const bool stream =
      stream_rows<scalar_t>(args.grad_input, s.inner) && grid.width % Vec<acc_t>::size() == 0;

  at::parallel_for(0, grid.count(), grid.grain(), [&](int64_t t0, int64_t t1) {
    ReductionGrads<acc_t> q;
    acc_t dsum[ReductionGrads<acc_t>::kMax];
    for (int64_t t = t0; t < t1; ++t) {
      const Task task = grid.task(t);
      const LaneGroup<acc_t> g{task.lanes};
      const int64_t r0 = task.first_row;
      load_reduction_grads(stats + kGemStats * r0, grad + r0, g.count, kPGrad, k, q);
      const bool* keep =
          kMode == MaskMode::None ? nullptr : mask.data + mask_offset(mask, task.o, task.i0);
      lanes_backward_task<kMode, kPGrad>(in + task.offset, dx_all + task.offset, keep, s.n,
                                         s.inner, mask, g, k, q, bs, out_max, stream, dsum);
      if constexpr (kPGrad) partial[t] = p_grad_sum(q, dsum, g.count, k);
    }
    end_streaming(stream);
  });
}

// The mask mode of a masked problem: per row when the mask does not vary
// along inner (stride 0), else per lane.
bool rows_masked(const at::Tensor& mask) { return mask.stride(2) == 0; }

}  // namespace

void gem_strided_forward(const GemArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_gem_strided", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const GemScalars<acc_t> k = gem_scalars<acc_t>(args.p, args.p_value, args.eps);
    if (!args.mask.defined()) {
      lanes_forward<MaskMode::None, scalar_t>(args, k);
    } else if (rows_masked(args.mask)) {
      lanes_forward<MaskMode::Row, scalar_t>(args, k);
    } else {
      lanes_forward<MaskMode::Lane, scalar_t>(args, k);
    }
  });
}

void gem_strided_backward(const GemBackwardArgs& args, std::vector<double>& partial) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_gem_strided_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const GemScalars<acc_t> k = gem_scalars<acc_t>(args.p, args.p_value, args.eps);
    const TaskGrid grid(args.shape, lanes_per_task<acc_t>(args.shape.inner));
    partial.assign(grid.count(), 0.0);
    auto run = [&](auto p_grad) {
      constexpr bool kPGrad = decltype(p_grad)::value;
      if (!args.mask.defined()) {
        lanes_backward<MaskMode::None, kPGrad, scalar_t>(args, k, partial.data());
      } else if (rows_masked(args.mask)) {
        lanes_backward<MaskMode::Row, kPGrad, scalar_t>(args, k, partial.data());
      } else {
        lanes_backward<MaskMode::Lane, kPGrad, scalar_t>(args, k, partial.data());
      }
    };
    if (args.p_grad) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
}

}  // namespace cpu
}  // namespace nanfree
