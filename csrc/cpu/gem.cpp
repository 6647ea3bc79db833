// CPU kernels of GeM pooling over contiguous rows (inner == 1), the
// dispatch of every layout and the registration; the lanes of inner > 1 are
// in gem_strided.cpp, what both share in gem.h (whose comment describes the
// layouts, passes and fast path).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/flat_rows.h"
#include "cpu/gem.h"

namespace nanfree {
namespace cpu {
namespace {

// Flat blocks (AVX-512 float accumulation, no mask, n <= kFlatMaxN): 16 rows
// at a time as full vectors, each taking its lanes' per-row constants with one
// permute (cpu/flat_rows.h); the per-entry results go to a buffer in L1,
// summed per row after.
constexpr int64_t kFlatMaxN = 256;

#if defined(CPU_CAPABILITY_AVX512)
// sum of each of `rows` rows of n values in buf, as the lanes of one vector.
inline Vec<float> row_sums(const float* buf, int64_t rows, int64_t n, float* acc) {
  using V = Vec<float>;
  for (int64_t r = 0; r < rows; ++r) {
    V s(0.0f);
    for (int64_t j = 0; j < n; j += 16) s = s + V::loadu(buf + r * n + j, std::min<int64_t>(16, n - j));
    s.store(acc + 16 * r);
  }
  return reduce_each(acc, rows, [](const V& a, const V& b) { return a + b; });
}

// Asks for vector k of the next block (null: none) while this one computes.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* next, int64_t k) {
  if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + 16 * k), _MM_HINT_T0);
}

// The block's entries as float: the input itself, or widened into `scratch`.
template <typename scalar_t>
inline const float* block_floats(const scalar_t* x, int64_t count, float* scratch) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    widen(x, scratch, count);
    return scratch;
  }
}

// A flat block of `rows` rows: each row's maximum clamped to eps, m[l] (its
// m unless the block holds NaN or inf: special[l], set for every row then),
// and for the rows on the fast path (fast[l]) its power sum, sum[l]. The
// maxima are plain (the special rows' m are the caller's).
template <typename scalar_t>
NANFREE_HOT_LOOP void flat_block_forward(const scalar_t* x, const scalar_t* next, int64_t rows,
                                         const FlatRows<float>& f, const GemScalars<float>& k,
                                         float* scratch, float* buf, float* m, bool* special,
                                         bool* fast, float* sum) {
  using V = Vec<float>;
  const int64_t n = f.n, total = rows * n;
  const float* xs = block_floats(x, total, scratch);
  const V lowest(-std::numeric_limits<float>::infinity()), zero(0.0f), epsv(k.eps), pv(k.p);
  alignas(64) float row_max[16 * 16];
  V nan = zero;  // x - x summed over the block: NaN when an entry is NaN or infinite
  for (int64_t r = 0; r < rows; ++r) {
    V mx = lowest;
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t count = std::min<int64_t>(16, n - j);
      const V v = V::loadu(xs + r * n + j, count);  // lanes past count read 0
      mx = plain_max(mx, count == 16 ? v : first_lanes(lowest, v, count));
      nan = nan + (v - v);
    }
    mx.store(row_max + 16 * r);
  }
  const V mv = plain_max(reduce_each(row_max, rows, [](const V& a, const V& b) { return plain_max(a, b); }),
                         epsv);  // clamp_to_eps of the maximum
  alignas(64) float base_m[16], base_e[16], base_l[16];
  mv.store(m, rows);
  // A block with NaN or inf: every row is the caller's (a plain maximum does not keep NaN).
  const bool special_block =
      reduce_lanes<float>([](const V& a, const V& b) { return a + b; }, nan) != 0.0f;
  bool any_fast = false;
  for (int64_t l = 0; l < 16; ++l) {
    if (l < rows) {
      special[l] = special_block;
      fast[l] = !special_block && fast_ratios(m[l], k);
      any_fast = any_fast || fast[l];
    }
    base_m[l] = l < rows && fast[l] ? m[l] : 1.0f;  // finite for every lane (the others are redone)
  }
  if (!any_fast) return;
  ratio_bases(base_m, 16, base_e, base_l);
  const V be = V::loadu(base_e), bl = V::loadu(base_l);
  const int64_t vectors = (total + 15) / 16;
  for (int64_t kv = 0; kv < vectors; ++kv) {
    prefetch_block(next, kv);
    const V c = at::vec::clamp_min(V::loadu(xs + 16 * kv, std::min<int64_t>(16, total - 16 * kv)), epsv);
    const RatioBase<float> base{f.per_row(kv, be), f.per_row(kv, bl)};
    ratio_power_vec(c, base, pv).store(buf + 16 * kv);
  }
  row_sums(buf, rows, n, row_max).store(sum, rows);
}
#endif

// A row's largest entry (NaN if a kept entry is NaN; -inf for none) and its
// number of kept entries (mask entry j at keep[j * ks]; none: all kept).
template <bool kMasked, typename scalar_t>
NANFREE_HOT_LOOP std::pair<at::opmath_type<scalar_t>, at::opmath_type<scalar_t>> row_max_count(
    const scalar_t* x, int64_t n, const bool* keep, int64_t ks) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V lowest(-std::numeric_limits<acc_t>::infinity());
  V mx = lowest, cnt(acc_t(0));
  for (int64_t j = 0; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    V v = load_vec(x + j, count);
    if constexpr (kMasked) {
      const V kv = keep_lanes<acc_t>(keep + j * ks, ks, count);
      v = V::blendv(lowest, v, kv);  // a masked entry, NaN included, is out of the max
      cnt = cnt + (kv & V(acc_t(1)));
    } else {
      v = first_lanes(lowest, v, count);
    }
    mx = at::vec::maximum(mx, v);  // propagates NaN
  }
  const acc_t largest =
      reduce_lanes<acc_t>([](const V& a, const V& b) { return at::vec::maximum(a, b); }, mx);
  acc_t count = static_cast<acc_t>(n);
  if constexpr (kMasked) {
    count = reduce_lanes<acc_t>([](const V& a, const V& b) { return a + b; }, cnt);
  }
  return {largest, count};
}

// sum of r^p over a fast-path row's kept entries.
template <bool kMasked, typename scalar_t>
NANFREE_HOT_LOOP at::opmath_type<scalar_t> row_power_sum(
    const scalar_t* x, int64_t n, const bool* keep, int64_t ks, at::opmath_type<scalar_t> m,
    const GemScalars<at::opmath_type<scalar_t>>& k) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V pv(k.p), epsv(k.eps), zero(acc_t(0));
  acc_t be, bl;
  ratio_bases(&m, 1, &be, &bl);
  const RatioBase<acc_t> base{V(be), V(bl)};
  CompensatedSum<acc_t> s;
  for (int64_t j = 0; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    const V rp = ratio_power_vec(at::vec::clamp_min(load_vec(x + j, count), epsv), base, pv);
    if constexpr (kMasked) {
      s.add(V::blendv(zero, rp, keep_lanes<acc_t>(keep + j * ks, ks, count)));
    } else {
      s.add(first_lanes(zero, rp, count));
    }
  }
  return reduce_lanes<acc_t>([](const V& a, const V& b) { return a + b; }, s.sum);
}

// Whether rows_forward / rows_backward take flat blocks.
template <bool kMasked, typename acc_t>
bool flat_rows_apply(int64_t n) {
  return !kMasked && kMantissaLog2<acc_t> && n <= kFlatMaxN;
}

template <bool kMasked, typename scalar_t>
void rows_forward(const GemArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t B = Vec<acc_t>::size();  // rows per block
  const int64_t rows = args.shape.outer, n = args.shape.n;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const int64_t blocks = (rows + B - 1) / B;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n * B, 1));
  const bool flat = flat_rows_apply<kMasked, acc_t>(n);
#if defined(CPU_CAPABILITY_AVX512)
  const FlatRows<float> table(flat ? n : 0);
#endif

  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    acc_t m[B], sum[B], cnt[B];
    bool special[B] = {}, fast[B] = {};
    const auto buf = scratch_row<float>(16 * n, flat);
    const auto scratch = scratch_row<float>(16 * n, flat && !std::is_same_v<scalar_t, float>);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * B, nr = std::min<int64_t>(B, rows - r0);
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (kMantissaLog2<acc_t>) {
        if (flat) {
          const scalar_t* next = b + 1 < b1 ? in + (r0 + B) * n : nullptr;
          flat_block_forward(in + r0 * n, next, nr, table, k, scratch.get(), buf.get(), m, special,
                             fast, sum);
        }
      }
#endif
      for (int64_t l = 0; l < nr; ++l) {
        const int64_t row = r0 + l;
        const scalar_t* x = in + row * n;
        const bool* keep = kMasked ? mask.data + mask_offset(mask, row, 0) : nullptr;
        const int64_t ks = mask.col_stride;
        if (flat) {
          cnt[l] = static_cast<acc_t>(n);
          if (fast[l]) continue;
          // A row with NaN or inf: its m from the NaN-propagating maximum.
          if (special[l]) m[l] = clamp_to_eps(row_max_count<false>(x, n, keep, ks).first, k.eps);
        } else {
          const auto [largest, count] = row_max_count<kMasked>(x, n, keep, ks);
          // The empty set's m is 0 (below every clamped entry); NaN stays NaN.
          m[l] = count == acc_t(0) ? acc_t(0) : clamp_to_eps(largest, k.eps);
          cnt[l] = count;
        }
        sum[l] = fast_ratios(m[l], k) ? row_power_sum<kMasked>(x, n, keep, ks, m[l], k)
                                      : power_sum_scalar(x, n, 1, keep, ks, m[l], k);
      }
      finish_forward(m, sum, cnt, nr, k, out + r0, stats + kGemStats * r0);
    }
  });
}

template <typename scalar_t>
void gem_forward_kernel(const GemArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  const GemScalars<acc_t> k = gem_scalars<acc_t>(args.p, args.p_value, args.eps);
  if (args.shape.n == 0) {  // every reduction is empty: gem 0, stats (0, 0, 0)
    args.output.zero_();
    args.stats.zero_();
    return;
  }
  const bool masked = args.mask.defined();
  if (args.shape.inner == 1) {
    if (masked) {
      rows_forward<true, scalar_t>(args, k);
    } else {
      rows_forward<false, scalar_t>(args, k);
    }
  } else {
    gem_strided_forward(args);
  }
}

// ---- backward ---------------------------------------------------------------

#if defined(CPU_CAPABILITY_AVX512)
// The gradients and divergence sums of a flat block's rows: right for the
// rows on the fast path, replaced by the caller for the others (whose
// constants are those of m = 1, finite).
template <bool kPGrad, typename scalar_t>
NANFREE_HOT_LOOP void flat_block_backward(const scalar_t* x, const scalar_t* next, scalar_t* dx,
                                          int64_t rows,
                                          const FlatRows<float>& f, const ReductionGrads<float>& q,
                                          const BackwardScalars<float>& b, float* scratch,
                                          float* buf, float* dsum) {
  using V = Vec<float>;
  const int64_t n = f.n, total = rows * n;
  const float* xs = block_floats(x, total, scratch);
  const V be = V::loadu(q.base_e, rows), bl = V::loadu(q.base_l, rows);
  const V a = V::loadu(q.a, rows), g = V::loadu(q.g, rows);
  V nlm, t_scale;
  if constexpr (kPGrad) {
    nlm = V::loadu(q.neg_log_mean, rows);
    t_scale = V::loadu(q.t_scale, rows);
  }
  const int64_t vectors = (total + 15) / 16;
  for (int64_t kv = 0; kv < vectors; ++kv) {
    const int64_t count = std::min<int64_t>(16, total - 16 * kv);
    prefetch_block(next, kv);
    EntryConsts<float> e;
    e.base = {f.per_row(kv, be), f.per_row(kv, bl)};
    e.a = f.per_row(kv, a);
    e.g = f.per_row(kv, g);
    if constexpr (kPGrad) {
      e.neg_log_mean = f.per_row(kv, nlm);
      e.t_scale = f.per_row(kv, t_scale);
    }
    V h;
    store_entries(entry_grad<kPGrad>(V::loadu(xs + 16 * kv, count), e, b, h), dx + 16 * kv, count);
    if constexpr (kPGrad) h.store(buf + 16 * kv);
  }
  if constexpr (kPGrad) {
    alignas(64) float acc[16 * 16];
    row_sums(buf, rows, n, acc).store(dsum, rows);
  }
}
#endif

// A fast-path row's gradient and divergence sum.
template <bool kMasked, bool kPGrad, typename scalar_t>
NANFREE_HOT_LOOP at::opmath_type<scalar_t> row_backward(
    const scalar_t* x, scalar_t* dx, int64_t n, const bool* keep, int64_t ks,
    const EntryConsts<at::opmath_type<scalar_t>>& e,
    const BackwardScalars<at::opmath_type<scalar_t>>& b) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V zero(acc_t(0));
  CompensatedSum<acc_t> dsum;
  for (int64_t j = 0; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    V h;
    V grad = entry_grad<kPGrad>(load_vec(x + j, count), e, b, h);
    if constexpr (kMasked) {
      const V kv = keep_lanes<acc_t>(keep + j * ks, ks, count);
      grad = V::blendv(zero, grad, kv);  // a masked entry gets 0
      if constexpr (kPGrad) dsum.add(V::blendv(zero, h, kv));
    } else if constexpr (kPGrad) {
      dsum.add(first_lanes(zero, h, count));
    }
    store_entries(grad, dx + j, count);
  }
  if constexpr (!kPGrad) return acc_t(0);
  return reduce_lanes<acc_t>([](const V& u, const V& y) { return u + y; }, dsum.sum);
}

template <bool kMasked, bool kPGrad, typename scalar_t>
void rows_backward(const GemBackwardArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k,
                   double* partial) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t B = Vec<acc_t>::size();
  const int64_t rows = args.shape.outer, n = args.shape.n;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  const scalar_t* grad = args.grad.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const acc_t out_max = largest_finite<scalar_t>();
  const BackwardScalars<acc_t> bs = backward_scalars(k, out_max);
  const int64_t blocks = (rows + B - 1) / B;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n * B, 1));
  const bool flat = flat_rows_apply<kMasked, acc_t>(n);
#if defined(CPU_CAPABILITY_AVX512)
  const FlatRows<float> table(flat ? n : 0);
#endif

  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    ReductionGrads<acc_t> q;
    acc_t dsum[B];
    const auto buf = scratch_row<float>(16 * n, flat && kPGrad);
    const auto scratch = scratch_row<float>(16 * n, flat && !std::is_same_v<scalar_t, float>);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * B, nr = std::min<int64_t>(B, rows - r0);
      load_reduction_grads(stats + kGemStats * r0, grad + r0, nr, kPGrad, k, q);
      bool any_fast = false;
      for (int64_t l = 0; l < nr; ++l) any_fast = any_fast || q.fast[l];
      const bool flat_block = flat && any_fast;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (kMantissaLog2<acc_t>) {
        if (flat_block) {
          const scalar_t* next = b + 1 < b1 ? in + (r0 + B) * n : nullptr;
          flat_block_backward<kPGrad>(in + r0 * n, next, dx_all + r0 * n, nr, table, q, bs,
                                      scratch.get(), buf.get(), dsum);
        }
      }
#endif
      for (int64_t l = 0; l < nr; ++l) {
        if (flat_block && q.fast[l]) continue;
        const int64_t row = r0 + l;
        const scalar_t* x = in + row * n;
        scalar_t* dx = dx_all + row * n;
        const bool* keep = kMasked ? mask.data + mask_offset(mask, row, 0) : nullptr;
        const int64_t ks = mask.col_stride;
        dsum[l] = 0;
        if (!q.live[l]) {  // no gradient: every entry 0, no divergence
          std::fill(dx, dx + n, scalar_t(0));
        } else if (q.fast[l]) {
          dsum[l] = row_backward<kMasked, kPGrad>(x, dx, n, keep, ks, entry_consts<kPGrad>(q, l), bs);
        } else {
          dsum[l] = backward_scalar(x, dx, n, 1, keep, ks, q.g[l], q.m[l], q.mean[l], q.cnt[l],
                                    kPGrad, k, out_max);
        }
      }
      if constexpr (kPGrad) partial[b] = p_grad_sum(q, dsum, nr, k);
    }
  });
}

template <bool kPGrad, typename scalar_t>
void gem_backward_dispatch(const GemBackwardArgs& args,
                           const GemScalars<at::opmath_type<scalar_t>>& k,
                           std::vector<double>& partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const ReductionLayout s = args.shape;
  const bool masked = args.mask.defined();
  if (s.inner == 1) {
    partial.assign((s.outer + Vec<acc_t>::size() - 1) / Vec<acc_t>::size(), 0.0);
    if (masked) {
      rows_backward<true, kPGrad, scalar_t>(args, k, partial.data());
    } else {
      rows_backward<false, kPGrad, scalar_t>(args, k, partial.data());
    }
    return;
  }
  gem_strided_backward(args, partial);
}

template <typename scalar_t>
void gem_backward_kernel(GemBackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  const GemScalars<acc_t> k = gem_scalars<acc_t>(args.p, args.p_value, args.eps);
  std::vector<double> partial;
  if (args.shape.n > 0) {
    if (args.p_grad) {
      gem_backward_dispatch<true, scalar_t>(args, k, partial);
    } else {
      gem_backward_dispatch<false, scalar_t>(args, k, partial);
    }
  }
  if (args.p_grad) {
    // Per-block partials (scaled sums) in block order: the same sum for any
    // thread count; gem_p_grad_total clamps it to the accumulation type's
    // range and scales it back.
    NeumaierSum dp;
    for (const double v : partial) dp.add(v);
    args.grad_p.fill_(gem_p_grad_total<acc_t>(dp.value()));
  }
}

std::tuple<at::Tensor, at::Tensor> gem(const at::Tensor& input, const std::optional<at::Tensor>& p,
                                       double p_value, double eps,
                                       const std::optional<at::Tensor>& mask) {
  const GemArgs args = prepare_gem(input, p, p_value, eps, mask);
  if (args.output.numel() == 0) return {args.output, args.stats};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(), "nanfree_gem",
                                  [&] { gem_forward_kernel<scalar_t>(args); });
  return {args.output, args.stats};
}

std::tuple<at::Tensor, at::Tensor> gem_backward(const at::Tensor& grad, const at::Tensor& input,
                                                const std::optional<at::Tensor>& p, double p_value,
                                                const at::Tensor& stats, double eps,
                                                const std::optional<at::Tensor>& mask, bool p_grad) {
  GemBackwardArgs args = prepare_gem_backward(grad, input, p, p_value, stats, eps, mask, p_grad);
  prefer_huge_pages(args.grad_input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_gem_backward", [&] { gem_backward_kernel<scalar_t>(args); });
  return {args.grad_input, args.grad_p};
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("gem", &cpu::gem);
  m.impl("gem_backward", &cpu::gem_backward);
}

}  // namespace nanfree
