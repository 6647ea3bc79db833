// The CPU kernels of GeM pooling (gem.cpp: contiguous rows, inner == 1;
// gem_strided.cpp: lanes across an inner dimension, inner > 1): what both
// share, the op's scalars, the fast path's vector math and the per-reduction
// steps of the forward and the backward.
//
// CPU kernels of GeM pooling (the generalized mean) over dim 1 of the
// contiguous input viewed as [outer, n, inner], built on the shared rules of
// csrc/include/nanfree/gem_math.h: each reduction is scaled by its largest
// clamped entry m, so every ratio r = max(x, eps) / m is in (0, 1].
//
// Layouts. inner == 1 (gem_pool2d: [B * C, H * W, 1]): each reduction is a
// contiguous row; rows go in blocks of one vector's width, so that the
// per-reduction work (the pow of the mean, the stats, p's gradient terms) is
// vectorized across a block's rows. With AVX-512 float accumulation, no mask
// and n <= 256, a block is read as n full vectors, each lane taking its own
// row's constants through a permute (FlatRows), so that short rows (n = 49)
// cost no tail vectors; other rows go one at a time. inner > 1 (tokens
// [B, L, H] reduced over L): a task is one o and up to four vectors of
// consecutive i, its lanes; entry j of every lane is one contiguous load, so
// the loops run over j with vector operations across the lanes (rows asked
// for ahead, compensated sums). A mask that is the same for every lane (the
// token layout's mask [B, L, 1] expanded: stride 0 along inner) drops whole
// rows of a task; any other mask is read per lane.
//
// Forward: one read of the input. The first pass finds each reduction's
// maximum and count; the second (from cache: a block of rows, or a task's
// columns, sized for L2) sums r^p. Backward: one read of the input and one
// write of its gradient (streamed when large), with the divergence terms of
// p's gradient summed in the same pass; p's gradient is the sum of
// per-block partials in block order, the same for any thread count.
//
// Fast path. A reduction whose m is finite and > 0 and whose smallest possible
// ratio eps / m is a normal number, and (backward) whose weight factor
// mean^(1/p - 1) / n is normal too, takes the direct branch of every header
// function; those are computed here with a vector log2 and exp2 (see "the
// fast path's logarithm and power"): r^p = 2^(p log2 r), and in the backward
// one log2 and one exp2 per entry: r^(p-1) = 2^((p-1) log2 r), e^s = r^(p-1) r
// / mean, s = p log r - log(mean), h(s) by the header's series for |s| <= 1
// and its closed form beyond. Every other reduction (NaN, +inf, empty, eps far
// below m, a weight below the normal range, a p whose products could
// overflow) is computed entry by entry with the header's scalar functions, so
// the special values are decided by the shared header only.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "common/gem_op.h"
#include "cpu/large_output.h"
#include "cpu/vec.h"
#include "cpu/vec_pow.h"
#include "nanfree/gem_math.h"

namespace nanfree {
namespace cpu {

// The largest p of the vector path: p (e_c - e_m) stays far from overflow.
constexpr double kVectorMaxP = 0x1p100;
// Vectors of lanes per inner > 1 task (gem_strided.cpp); also the most
// reductions whose per-reduction quantities a task holds (ReductionGrads).
constexpr int64_t kGroupVectors = 4;

// The op's scalars in the accumulation type.
template <typename acc_t>
struct GemScalars {
  acc_t p;      // clamped for a tensor p (gem_clamp_p), as given for a Python p
  acc_t eps;    // effective_eps
  acc_t inv_p;  // 1 / p, as gem_value forms it
  // Whether the vector path may be used at all: p normal and at most 2^100,
  // so that p log2 r and its parts are finite. Otherwise (a Python p beyond,
  // or one that is 0 or inf in the accumulation type) every reduction takes
  // the scalar rules.
  bool vector_p;
};

template <typename acc_t>
GemScalars<acc_t> gem_scalars(const at::Tensor& p_acc, double p_value, double eps) {
  GemScalars<acc_t> k;
  k.p = p_acc.defined() ? gem_clamp_p(p_acc.item<acc_t>()) : static_cast<acc_t>(p_value);
  k.eps = effective_eps(static_cast<acc_t>(eps));
  k.inv_p = acc_t(1) / k.p;
  k.vector_p = k.p >= nf_tiny<acc_t>() && k.p <= acc_t(kVectorMaxP);  // false for NaN
  return k;
}

// gem_divergence_h's series h(s) = s^2 sum_k c_k s^k, c_k =
// gem_divergence_coefficient(k), k up to 10 (float) or 17 (double): the
// header's Horner polynomial, with fused multiply-adds.
template <typename acc_t>
struct DivergenceSeries {
  static constexpr int kLastTerm = sizeof(acc_t) > 4 ? 17 : 10;
  static constexpr std::array<acc_t, kLastTerm + 1> coefficients() {
    std::array<acc_t, kLastTerm + 1> c{};
    for (int k = 0; k <= kLastTerm; ++k) c[k] = static_cast<acc_t>(gem_divergence_coefficient(k));
    return c;
  }
};

// gem_divergence_h on the fast path, given t = e^s: the series for |s| <= 1,
// else the closed form 1 + (s - 1) t.
template <typename acc_t>
inline Vec<acc_t> divergence_h_vec(const Vec<acc_t>& s, const Vec<acc_t>& t) {
  using V = Vec<acc_t>;
  using Series = DivergenceSeries<acc_t>;
  static constexpr auto c = Series::coefficients();
  V poly(c[Series::kLastTerm]);
  for (int k = Series::kLastTerm - 1; k >= 0; --k) poly = at::vec::fmadd(poly, s, V(c[k]));
  const V series = (s * s) * poly;
  const V closed = at::vec::fmadd(s - V(acc_t(1)), t, V(acc_t(1)));
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __mmask16 inside = _mm512_cmp_ps_mask(s.abs(), _mm512_set1_ps(1.0f), _CMP_LE_OQ);
    return Vec<float>(_mm512_mask_blend_ps(inside, closed, series));
  }
#endif
  return V::blendv(closed, series, s.abs() <= V(acc_t(1)));
}

// Whether a reduction's sums may take the vector path: m finite and > 0
// (neither empty nor NaN nor +inf) and eps / m normal, so that every ratio
// c / m >= eps / m is normal: gem_ratio_power and gem_log_ratio take their
// direct branch.
template <typename acc_t>
inline bool fast_ratios(acc_t m, const GemScalars<acc_t>& k) {
  return k.vector_p && m > acc_t(0) && m <= nf_largest<acc_t>() && k.eps / m >= nf_tiny<acc_t>();
}

// ---- forward ----------------------------------------------------------------

// sum of gem_ratio_power over the kept entries of one reduction (entry j at
// x[j * xs], kept when keep is null or keep[j * ks]): the scalar rules.
template <typename scalar_t, typename acc_t>
acc_t power_sum_scalar(const scalar_t* x, int64_t n, int64_t xs, const bool* keep, int64_t ks,
                       acc_t m, const GemScalars<acc_t>& k) {
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (keep != nullptr && !keep[j * ks]) continue;
    sum += gem_ratio_power(clamp_to_eps(static_cast<acc_t>(x[j * xs]), k.eps), m, k.p);
  }
  return sum;
}

// gem_value from mean^(1/p) = s computed elsewhere (a vector pow): m * s, or
// the header itself where it takes another branch (the empty set, or s below
// the normal range; a NaN s gives m * s there too, as here).
template <typename acc_t>
inline acc_t gem_from_power(acc_t m, acc_t mean, acc_t s, acc_t p) {
  if (mean == acc_t(0) || s < nf_tiny<acc_t>()) return gem_value(m, mean, p);
  return m * s;
}

// The RatioBase parts (e, l) of `count` reductions' maxima (normal numbers),
// one float per reduction, to be broadcast or permuted into lanes.
template <typename acc_t>
void ratio_bases(const acc_t* m, int64_t count, acc_t* e, acc_t* l) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    if constexpr (kMantissaLog2<acc_t>) {
#if defined(CPU_CAPABILITY_AVX512)
      const RatioBase<float> b = mantissa_log2(first_lanes(V(acc_t(1)), V::loadu(m + l0, c), c));
      b.e.store(e + l0, c);
      b.l.store(l + l0, c);
#endif
    } else {
      V(acc_t(0)).store(e + l0, c);
      V::loadu(m + l0, c).store(l + l0, c);
    }
  }
}

// The outputs and stats of `count` consecutive reductions from their maxima,
// power sums and counts.
template <typename scalar_t, typename acc_t>
void finish_forward(const acc_t* m, const acc_t* sum, const acc_t* cnt, int64_t count,
                    const GemScalars<acc_t>& k, scalar_t* out, acc_t* stats) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  acc_t mean[w], s[w], value[w];
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V sumv = V::loadu(sum + l0, c), cntv = V::loadu(cnt + l0, c);
    // gem_mean: sum / count, 0 for the empty set (0 / 0 would be NaN).
    const V meanv = V::blendv(sumv / cntv, V(acc_t(0)), cntv == V(acc_t(0)));
    const V sv = meanv.pow(V(k.inv_p));
    meanv.store(mean);
    sv.store(s);
    for (int64_t l = 0; l < c; ++l) {
      value[l] = gem_from_power(m[l0 + l], mean[l], s[l], k.p);
      acc_t* st = stats + kGemStats * (l0 + l);
      st[0] = m[l0 + l];
      st[1] = mean[l];
      st[2] = cnt[l0 + l];
    }
    store_entries(V::loadu(value), out + l0, c);
  }
}

// ---- backward ---------------------------------------------------------------

// The per-reduction quantities of the backward, for up to kMax reductions,
// from their stats (m, mean, count) and incoming gradients.
template <typename acc_t>
struct ReductionGrads {
  static constexpr int64_t kMax = kGroupVectors * Vec<acc_t>::size();
  acc_t m[kMax], mean[kMax], cnt[kMax], g[kMax];
  acc_t a[kMax];             // the weight's factor mean^(1/p - 1) / n
  acc_t gem[kMax];           // gem_value (p_grad only)
  acc_t neg_log_mean[kMax];  // -log(mean) (p_grad only)
  acc_t t_scale[kMax];       // 1 / (m mean): e^s = r^(p-1) c / (m mean) (p_grad only)
  acc_t base_e[kMax], base_l[kMax];  // ratio_bases of m
  bool live[kMax];           // gem_has_gradient
  bool fast[kMax];           // the vector path
};

// Fills q for `count` reductions. With p_grad one vector pow gives both
// s = mean^(1/p) (gem = m s) and a = s / (mean n); without, a =
// mean^(1/p - 1) / n as the header forms it. Reductions off the vector path
// get the constants of m = 1 (their vector results are replaced), so that
// the vector pass stays finite.
template <typename scalar_t, typename acc_t>
void load_reduction_grads(const acc_t* stats, const scalar_t* grad, int64_t count, bool p_grad,
                          const GemScalars<acc_t>& k, ReductionGrads<acc_t>& q) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  for (int64_t l = 0; l < count; ++l) {
    const acc_t* st = stats + kGemStats * l;
    q.m[l] = st[0];
    q.mean[l] = st[1];
    q.cnt[l] = st[2];
    q.g[l] = static_cast<acc_t>(grad[l]);
  }
  acc_t s[w];
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V meanv = V::loadu(q.mean + l0, c), cntv = V::loadu(q.cnt + l0, c);
    if (p_grad) {
      const V sv = meanv.pow(V(k.inv_p));
      sv.store(s);
      (sv / (meanv * cntv)).store(q.a + l0, c);
      (V(acc_t(0)) - meanv.log()).store(q.neg_log_mean + l0, c);
      for (int64_t l = 0; l < c; ++l) {
        q.gem[l0 + l] = gem_from_power(q.m[l0 + l], q.mean[l0 + l], s[l], k.p);
      }
    } else {
      (meanv.pow(V(k.inv_p - acc_t(1))) / cntv).store(q.a + l0, c);
    }
  }
  acc_t base_m[kGroupVectors * w], flags[kGroupVectors * w];
  const V zero(acc_t(0)), one(acc_t(1)), tiny(nf_tiny<acc_t>());
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V mv = V::loadu(q.m + l0, c), cntv = V::loadu(q.cnt + l0, c);
    // gem_has_gradient (a NaN m passes), and fast: the weight's direct branch
    // of gem_input_grad_weight, a normal, and the ratios normal (fast_ratios,
    // false for NaN); then r^(p-1) <= max(1, (m / eps)^(1-p)) is finite and
    // a * r^(p-1) <= max(1, big * tiny / n) needs no bound.
    const V live = (cntv > zero) & (mv != V(std::numeric_limits<acc_t>::infinity()));
    V fast = live & (mv > zero) & (mv <= V(nf_largest<acc_t>())) & (V(k.eps) / mv >= tiny) &
             (V::loadu(q.a + l0, c) >= tiny);
    if (!k.vector_p) fast = zero;
    V::blendv(one, mv, fast).store(base_m + l0, c);
    ((live & one) + (fast & one)).store(flags + l0, c);
  }
  for (int64_t l = 0; l < count; ++l) {
    q.live[l] = flags[l] > acc_t(0);
    q.fast[l] = flags[l] > acc_t(1);
    // 1 / (m mean), rounded once (m and mean are normal on the fast path).
    if (p_grad) {
      q.t_scale[l] = q.fast[l] ? static_cast<acc_t>(1.0 / (static_cast<double>(q.m[l]) * q.mean[l]))
                               : acc_t(1);
    }
  }
  ratio_bases(base_m, count, q.base_e, q.base_l);
}

// One reduction by the scalar rules: its gradient entries (entry j at
// x[j * xs] and dx[j * xs]) and, with p_grad, the sum of its divergence terms.
template <typename scalar_t, typename acc_t>
acc_t backward_scalar(const scalar_t* x, scalar_t* dx, int64_t n, int64_t xs, const bool* keep,
                      int64_t ks, acc_t g, acc_t m, acc_t mean, acc_t cnt, bool p_grad,
                      const GemScalars<acc_t>& k, acc_t out_max) {
  const bool live = gem_has_gradient(m, cnt);
  const acc_t log_mean = live ? nf_log(mean) : acc_t(0);  // unused without gradient (mean 0)
  acc_t dsum = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (keep != nullptr && !keep[j * ks]) {
      dx[j * xs] = scalar_t(0);  // a masked entry gets 0, even NaN or inf
      continue;
    }
    const acc_t xv = static_cast<acc_t>(x[j * xs]);
    dx[j * xs] = static_cast<scalar_t>(
        saturate(gem_input_grad(g, xv, k.eps, m, mean, cnt, k.p), out_max));
    if (p_grad && live) dsum += gem_divergence_term(clamp_to_eps(xv, k.eps), m, log_mean, k.p);
  }
  return dsum;
}

// The vector path's per-reduction quantities, one reduction per lane.
template <typename acc_t>
struct EntryConsts {
  RatioBase<acc_t> base;  // of m
  Vec<acc_t> a, g, neg_log_mean, t_scale;
};

// Reduction l's quantities in every lane.
template <bool kPGrad, typename acc_t>
inline EntryConsts<acc_t> entry_consts(const ReductionGrads<acc_t>& q, int64_t l) {
  using V = Vec<acc_t>;
  EntryConsts<acc_t> e;
  e.base = {V(q.base_e[l]), V(q.base_l[l])};
  e.a = V(q.a[l]);
  e.g = V(q.g[l]);
  if constexpr (kPGrad) {
    e.neg_log_mean = V(q.neg_log_mean[l]);
    e.t_scale = V(q.t_scale[l]);
  }
  return e;
}

// Reductions l0 .. l0 + count - 1, one per lane.
template <bool kPGrad, typename acc_t>
inline EntryConsts<acc_t> entry_consts_lanes(const ReductionGrads<acc_t>& q, int64_t l0,
                                             int64_t count) {
  using V = Vec<acc_t>;
  EntryConsts<acc_t> e;
  e.base = {V::loadu(q.base_e + l0, count), V::loadu(q.base_l + l0, count)};
  e.a = V::loadu(q.a + l0, count);
  e.g = V::loadu(q.g + l0, count);
  if constexpr (kPGrad) {
    e.neg_log_mean = V::loadu(q.neg_log_mean + l0, count);
    e.t_scale = V::loadu(q.t_scale + l0, count);
  }
  return e;
}

// Constants of every entry.
template <typename acc_t>
struct BackwardScalars {
  Vec<acc_t> eps, p, out_max;
  // p - 1 as a sum hi + lo: in float, 0.1f - 1 loses 3e-8, which r^(p-1)
  // would raise to |log2 r| times that (and t = e^s below with it).
  Vec<acc_t> pm1_hi, pm1_lo;
  // p ln 2 as a sum hi + lo (lo: the rounding of hi), so that p log r is not
  // rounded twice: s is shared by every clamped entry of a reduction (c = eps),
  // where an error does not average out.
  Vec<acc_t> p_ln2_hi, p_ln2_lo;
};

// One vector of entries x of fast-path reductions: the gradient (0 for a
// clamped entry), and with kPGrad the divergence term h(s) of each lane
// (s = p log r - log(mean); t = e^s = r^p / mean).
template <bool kPGrad, typename acc_t>
[[gnu::always_inline]] inline Vec<acc_t> entry_grad(const Vec<acc_t>& x,
                                                    const EntryConsts<acc_t>& e,
                                                    const BackwardScalars<acc_t>& b,
                                                    Vec<acc_t>& h) {
  using V = Vec<acc_t>;
  const V zero(acc_t(0));
  const V c = at::vec::clamp_min(x, b.eps);
  const Log2Ratio<acc_t> lr = log2_ratio(c, e.base);
  const V rp1 = exp2_product(b.pm1_hi, b.pm1_lo, lr);  // r^(p-1)
  const V grad = e.g * (e.a * rp1);       // g * w, w = a * r^(p-1)
  if constexpr (kPGrad) {
    // s = p ln 2 (de + dl) - log(mean), with de + dl and p ln 2 unrounded.
    const V s = at::vec::fmadd(b.p_ln2_hi, lr.de,
                               at::vec::fmadd(b.p_ln2_hi, lr.dl,
                                              at::vec::fmadd(b.p_ln2_lo, lr.sum(), e.neg_log_mean)));
    h = divergence_h_vec(s, rp1 * (c * e.t_scale));  // t = r^(p-1) c / (m mean)
  }
  // gem_unclamped: x > eps (no NaN on the fast path); then saturate.
  return saturate_vec(where_greater(x, b.eps, grad), b.out_max, zero - b.out_max);
}

template <typename acc_t>
BackwardScalars<acc_t> backward_scalars(const GemScalars<acc_t>& k, acc_t out_max) {
  using V = Vec<acc_t>;
  // p ln 2 in double (exact to 2^-53 relative for a float p), then split.
  const double p_ln2 = static_cast<double>(k.p) * 0.6931471805599453094;
  const acc_t hi = static_cast<acc_t>(p_ln2);
  const acc_t lo = static_cast<acc_t>(p_ln2 - static_cast<double>(hi));
  const double pm1 = static_cast<double>(k.p) - 1.0;  // exact for a float p
  const acc_t pm1_hi = static_cast<acc_t>(pm1);
  const acc_t pm1_lo = static_cast<acc_t>(pm1 - static_cast<double>(pm1_hi));
  return {V(k.eps), V(k.p), V(out_max), V(pm1_hi), V(pm1_lo), V(hi), V(lo)};
}

// p's gradient terms of `count` reductions, gem_p_grad from their divergence
// sums (D = gem_mean(dsum, n)), each scaled by kGemPGradScale and summed in
// order in double, compensated (gem_p_grad_total's input).
template <typename acc_t>
double p_grad_sum(const ReductionGrads<acc_t>& q, const acc_t* dsum, int64_t count,
                  const GemScalars<acc_t>& k) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V zero(acc_t(0)), big(nf_largest<acc_t>()), pp(k.p * k.p);
  acc_t term[w];
  NeumaierSum dp;
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V mv = V::loadu(q.m + l0, c), cntv = V::loadu(q.cnt + l0, c);
    const V live = (cntv > zero) & (mv != V(std::numeric_limits<acc_t>::infinity()));
    // D = dsum / n; a reduction without gradient (n may be 0) gives 0 below.
    const V d = V::loadu(dsum + l0, c) / cntv;
    // gem * (D / p^2) bounded before meeting g (saturate_vec keeps NaN).
    const V v = saturate_vec(V::loadu(q.gem + l0, c) * (d / pp), big, zero - big);
    // g * v saturated as well (gem_p_grad), so that no term is inf; NaN stays.
    const V gv = saturate_vec(V::loadu(q.g + l0, c) * v, big, zero - big);
    V::blendv(zero, gv, live).store(term);
    // Scaled terms: fewer than 2^64 of them cannot overflow the double sum.
    for (int64_t l = 0; l < c; ++l) dp.add(static_cast<double>(term[l]) * kGemPGradScale);
  }
  return dp.value();
}

// inner > 1 and n > 0 (gem_strided.cpp): the forward fills args.output and
// args.stats; the backward fills args.grad_input and, with args.p_grad, one
// partial sum of p's gradient terms per task in `partial` (scaled by
// kGemPGradScale, in task order: gem_p_grad_total's input).
void gem_strided_forward(const GemArgs& args);
void gem_strided_backward(const GemBackwardArgs& args, std::vector<double>& partial);

}  // namespace cpu
}  // namespace nanfree
