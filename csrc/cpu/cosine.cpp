// CPU kernels of the cosine family (normalize, cosine_similarity, and the GEMM
// of cos_sim) over the last dimension, built on the shared numerics in
// csrc/include/nanfree/cosine_math.h. Rows run in parallel. A row's sums of
// scaled squares and products need its scale, a power of two from its largest
// magnitude; one pass finds that magnitude while it sums the entries scaled by
// a guess (ScaleGuess), and a second pass (from cache) sums again only when
// the guess was wrong, so the sums are always those of the row's own scale. The
// rows whose scale is not a finite power of two (a NaN or an infinite entry)
// take the shared per-entry rules. Outputs larger than the last-level cache
// are written with streaming stores into huge pages (cpu/large_output.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

#include "common/cosine_op.h"
#include "cpu/large_output.h"
#include "cpu/vec.h"
#include "nanfree/cosine_math.h"

namespace nanfree {
namespace {

using namespace cpu;


inline int64_t row_grain(int64_t d) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(d, 1));
}

// Whether a row's scale is a finite, nonzero power of two: the vector path.
// NaN (a NaN entry) and 0 (an infinite vector's mark) take the per-entry rules.
template <typename acc_t>
bool plain_scale(acc_t p) {
  return p > acc_t(0);  // false for NaN and 0
}

// normalized_entry of cosine_math.h over a vector of scaled entries s of a row
// with a plain scale and a positive unit_divisor: s * q, and exactly +-1 where
// |s| equals the divisor.
template <typename acc_t>
Vec<acc_t> normalized_entries(const Vec<acc_t>& s, const Vec<acc_t>& divisor, const Vec<acc_t>& q) {
  const Vec<acc_t> unit = Vec<acc_t>::blendv(Vec<acc_t>(-1), Vec<acc_t>(1), s > Vec<acc_t>(0));
  return Vec<acc_t>::blendv(s * q, unit, s.abs() == divisor);
}

// The sum of squares of a row's scaled entries.
template <typename scalar_t>
at::opmath_type<scalar_t> scaled_sum_of_squares(const scalar_t* x, int64_t n,
                                                at::opmath_type<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  if (!plain_scale(p)) {
    acc_t ssq = 0;
    for (int64_t j = 0; j < n; ++j) {
      const acc_t s = scaled_entry(static_cast<acc_t>(x[j]), p);
      ssq += s * s;
    }
    return ssq;
  }
  const V pv(p);
  return reduce_row<acc_t>(n, acc_t(0), [](const V& a, const V& b) { return a + b; },
                           [&](int64_t j, int64_t count) {
                             const V s = load_vec(x + j, count) * pv;
                             return s * s;
                           });
}

// The guess of a row's scale (norm_scale of its largest magnitude): the scale
// of the previous row, as rows of one tensor tend to share it. Rows are read
// once, summing their entries scaled by the guess while finding their largest
// magnitude; a second pass sums again (from cache) only when the guess was
// wrong, so the sums are always those of the row's own scale.
template <typename acc_t>
struct ScaleGuess {
  // p: a value norm_scale returns (a finite, nonzero power of two 2^-e, e the
  // exponent of the magnitudes it was computed from, clamped to the normal
  // range); [lo, hi) = [2^e, 2^(e+1)), the magnitudes whose norm_scale it is
  // (hi may be +inf).
  acc_t p = 1, lo = 1, hi = 2;

  // norm_scale(amax), without computing it for a magnitude of p's range
  // (amax NaN compares false and gets norm_scale's NaN).
  acc_t scale_of(acc_t amax) const { return amax >= lo && amax < hi ? p : norm_scale(amax); }

  void update(acc_t scale) {
    if (scale != p && plain_scale(scale)) {
      p = scale;
      lo = acc_t(1) / scale;  // exact: scale is a power of two
      hi = acc_t(2) / scale;
    }
  }
};

// The largest of the magnitudes accumulated with clamp_min (a plain maximum,
// cheaper than at::vec::maximum, which propagates NaN), or NaN when `sums` (a
// sum of squares of the same entries scaled by a finite factor, NaN exactly
// when an entry is NaN: squares are never negative, so no inf - inf) is NaN:
// the largest magnitude as a NaN-propagating maximum would give it.
template <typename acc_t>
acc_t largest_magnitude(const Vec<acc_t>& m, acc_t sums) {
  using V = Vec<acc_t>;
  if (nf_isnan(sums)) return sums;
  return reduce_lanes<acc_t>([](const V& a, const V& b) { return at::vec::clamp_min(a, b); }, m);
}

// A row's largest magnitude and, in the same pass, the sum of squares of its
// entries scaled by `p` (a finite, nonzero power of two): when p is the row's
// scale, the sum is scaled_sum_of_squares(x, n, p) exactly (the same
// operations in the same order: reduce_row's accumulators).
template <typename scalar_t>
std::pair<at::opmath_type<scalar_t>, at::opmath_type<scalar_t>> abs_max_and_scaled_ssq(
    const scalar_t* x, int64_t n, at::opmath_type<scalar_t> p) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V pv(p);
  V m0(0), m1(0), m2(0), m3(0), s0(0), s1(0), s2(0), s3(0);
  const auto step = [&](V& m, V& s, const V& v) {
    m = at::vec::clamp_min(m, v.abs());
    const V scaled = v * pv;
    s = s + scaled * scaled;
  };
  int64_t j = 0;
  for (; j + 4 * w <= n; j += 4 * w) {
    step(m0, s0, load_vec(x + j, w));
    step(m1, s1, load_vec(x + j + w, w));
    step(m2, s2, load_vec(x + j + 2 * w, w));
    step(m3, s3, load_vec(x + j + 3 * w, w));
  }
  for (; j + w <= n; j += w) step(m0, s0, load_vec(x + j, w));
  if (j < n) {  // lanes past n read 0: nothing to the maximum, and blended to 0 as reduce_row does
    const V v = load_vec(x + j, n - j);
    m1 = at::vec::clamp_min(m1, v.abs());
    const V scaled = v * pv;
    s1 = s1 + V::set(V(acc_t(0)), scaled * scaled, n - j);
  }
  const acc_t ssq = reduce_lanes<acc_t>([](const V& a, const V& b) { return a + b; },
                                                   (s0 + s1) + (s2 + s3));
  const V m = at::vec::clamp_min(at::vec::clamp_min(m0, m1), at::vec::clamp_min(m2, m3));
  return {largest_magnitude(m, ssq), ssq};
}

// A row's largest magnitude, its scale p (norm_scale) and the sum of squares
// of its scaled entries.
template <typename acc_t>
struct RowScale {
  acc_t amax, p, ssq;
};

// RowScale of a row, reading it once when the guess (updated here) is right.
template <typename scalar_t>
RowScale<at::opmath_type<scalar_t>> scale_and_ssq(const scalar_t* x, int64_t n,
                                                   ScaleGuess<at::opmath_type<scalar_t>>& guess) {
  using acc_t = at::opmath_type<scalar_t>;
  if (n == 0) return {acc_t(0), acc_t(1), acc_t(0)};
  auto [amax, ssq] = abs_max_and_scaled_ssq(x, n, guess.p);
  const acc_t p = guess.scale_of(amax);
  if (p != guess.p) {
    ssq = scaled_sum_of_squares(x, n, p);
    guess.update(p);
  }
  return {amax, p, ssq};
}

template <typename scalar_t>
void normalize_kernel(const NormalizeArgs& args, double eps_arg) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  const int64_t rows = args.shape.rows, d = args.shape.d;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const acc_t eps = effective_eps(static_cast<acc_t>(eps_arg));

  const bool stream = stream_rows<scalar_t>(args.output, d);

  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    ScaleGuess<acc_t> guess;
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x = in + r * d;
      scalar_t* y = out + r * d;
      const auto [amax, p, ssq] = scale_and_ssq(x, d, guess);
      const NormFactors<acc_t> f = norm_factors(p, ssq, eps);
      const acc_t q = f.q;
      const acc_t divisor = unit_divisor(f.divisor, p, amax);
      stats[2 * r] = p;
      stats[2 * r + 1] = f.grad_factor;
      if (plain_scale(p) && divisor == acc_t(0)) {  // normalized_entry is s * q throughout
        const V pv(p), qv(q);
        write_row(y, d, stream, [&](int64_t j, int64_t count) {
          return (load_vec(x + j, count) * pv) * qv;
        });
      } else if (plain_scale(p)) {
        const V pv(p), qv(q), divisor_v(divisor);
        write_row(y, d, stream, [&](int64_t j, int64_t count) {
          return normalized_entries(load_vec(x + j, count) * pv, divisor_v, qv);
        });
      } else {
        for (int64_t j = 0; j < d; ++j)
          y[j] = static_cast<scalar_t>(
              normalized_entry(scaled_entry(static_cast<acc_t>(x[j]), p), divisor, q));
      }
    }
    end_streaming(stream);
  });
}

template <typename scalar_t>
void normalize_backward_kernel(const NormalizeBackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  const int64_t rows = args.shape.rows, d = args.shape.d;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* y_all = args.output.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const bool stream = stream_rows<scalar_t>(args.grad_input, d);
  const V out_max(largest_finite<scalar_t>()), out_min(-largest_finite<scalar_t>());

  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = g_all + r * d;
      const scalar_t* y = y_all + r * d;
      scalar_t* dx = dx_all + r * d;
      const acc_t dot_plain = row_dot(g, y, d);
      if (!std::isfinite(dot_plain)) {
        // dot overflowed (g near the largest value; or a NaN row): the shared
        // scalar rule with dot also at the scale 2^-64 (GradSum). Rare.
        acc_t dot_scaled = 0;
        for (int64_t j = 0; j < d; ++j)
          dot_scaled += (static_cast<acc_t>(g[j]) * grad_sum_scale<acc_t>()) * static_cast<acc_t>(y[j]);
        const GradSum<acc_t> dot{dot_plain, dot_scaled};
        for (int64_t j = 0; j < d; ++j)
          dx[j] = static_cast<scalar_t>(saturate(
              normalize_grad_value(static_cast<acc_t>(g[j]), static_cast<acc_t>(y[j]), dot,
                                   stats[2 * r], stats[2 * r + 1]),
              largest_finite<scalar_t>()));
        continue;
      }
      const V dot(dot_plain), half_dot(dot_plain * acc_t(0.5));
      const V p(stats[2 * r]), grad_factor(stats[2 * r + 1]);
      const V half(acc_t(0.5)), two(acc_t(2)), inf(std::numeric_limits<acc_t>::infinity());
      // saturate(normalize_grad_value): ((g - y * dot) * grad_factor) * p, at
      // half scale where g - y * dot overflowed, saturated.
      write_row(dx, d, stream, [&](int64_t j, int64_t count) {
        const V gv = load_vec(g + j, count), yv = load_vec(y + j, count);
        const V diff = gv - yv * dot;
        const V halved = (((half * gv - yv * half_dot) * grad_factor) * p) * two;
        const V grad = V::blendv((diff * grad_factor) * p, halved, diff.abs() == inf);
        return saturate_vec(grad, out_max, out_min);
      });
    }
    end_streaming(stream);
  });
}

// The sums of a pair of rows: squares and products of their scaled entries
// and, where asked for, the rows' largest magnitudes.
template <typename acc_t>
struct CosineSums {
  acc_t ssq_a = 0, ssq_b = 0, dot = 0;
  acc_t amax_a = 0, amax_b = 0;
};

// Both rows' squares and their products in one pass, two accumulators each,
// with the rows scaled by pa and pb (finite, nonzero powers of two). With
// kAbsMax, the rows' largest magnitudes too, in the same pass: the sums are
// the same operations in the same order either way, so when pa and pb (the
// guesses) turn out to be the rows' own scales, the rows were read once.
template <bool kAbsMax, typename scalar_t>
CosineSums<at::opmath_type<scalar_t>> cosine_sums(const scalar_t* a, const scalar_t* b, int64_t d,
                                                  at::opmath_type<scalar_t> pa,
                                                  at::opmath_type<scalar_t> pb) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  const V pav(pa), pbv(pb);
  V sa0(0), sa1(0), sb0(0), sb1(0), ab0(0), ab1(0);
  V ma0(0), ma1(0), mb0(0), mb1(0);
  int64_t j = 0;
  for (; j + 2 * V::size() <= d; j += 2 * V::size()) {
    const V ra0 = load_vec(a + j, V::size()), rb0 = load_vec(b + j, V::size());
    const V ra1 = load_vec(a + j + V::size(), V::size());
    const V rb1 = load_vec(b + j + V::size(), V::size());
    if constexpr (kAbsMax) {  // NaN: see largest_magnitude
      ma0 = at::vec::clamp_min(ma0, ra0.abs());
      mb0 = at::vec::clamp_min(mb0, rb0.abs());
      ma1 = at::vec::clamp_min(ma1, ra1.abs());
      mb1 = at::vec::clamp_min(mb1, rb1.abs());
    }
    const V a0 = ra0 * pav, b0 = rb0 * pbv, a1 = ra1 * pav, b1 = rb1 * pbv;
    sa0 = at::vec::fmadd(a0, a0, sa0);
    sb0 = at::vec::fmadd(b0, b0, sb0);
    ab0 = at::vec::fmadd(a0, b0, ab0);
    sa1 = at::vec::fmadd(a1, a1, sa1);
    sb1 = at::vec::fmadd(b1, b1, sb1);
    ab1 = at::vec::fmadd(a1, b1, ab1);
  }
  for (; j < d; j += V::size()) {
    const int64_t count = std::min<int64_t>(V::size(), d - j);  // lanes past it read 0
    const V ra0 = load_vec(a + j, count), rb0 = load_vec(b + j, count);
    if constexpr (kAbsMax) {
      ma0 = at::vec::clamp_min(ma0, ra0.abs());
      mb0 = at::vec::clamp_min(mb0, rb0.abs());
    }
    const V a0 = ra0 * pav, b0 = rb0 * pbv;
    sa0 = at::vec::fmadd(a0, a0, sa0);
    sb0 = at::vec::fmadd(b0, b0, sb0);
    ab0 = at::vec::fmadd(a0, b0, ab0);
  }
  const auto total = [](const V& x, const V& y) {
    return reduce_lanes<acc_t>([](const V& u, const V& v) { return u + v; }, x + y);
  };
  CosineSums<acc_t> sums;
  sums.ssq_a = total(sa0, sa1);
  sums.ssq_b = total(sb0, sb1);
  sums.dot = total(ab0, ab1);
  if constexpr (kAbsMax) {
    sums.amax_a = largest_magnitude(at::vec::clamp_min(ma0, ma1), sums.ssq_a);
    sums.amax_b = largest_magnitude(at::vec::clamp_min(mb0, mb1), sums.ssq_b);
  }
  return sums;
}

// The sums of a pair whose scales are not both plain (a NaN or an infinite
// entry): the shared per-entry rules.
template <typename scalar_t>
CosineSums<at::opmath_type<scalar_t>> cosine_sums_per_entry(const scalar_t* a, const scalar_t* b,
                                                            int64_t d,
                                                            at::opmath_type<scalar_t> pa,
                                                            at::opmath_type<scalar_t> pb) {
  using acc_t = at::opmath_type<scalar_t>;
  CosineSums<acc_t> sums;
  for (int64_t j = 0; j < d; ++j) {
    const acc_t sa = scaled_entry(static_cast<acc_t>(a[j]), pa);
    const acc_t sb = scaled_entry(static_cast<acc_t>(b[j]), pb);
    sums.ssq_a += sa * sa;
    sums.ssq_b += sb * sb;
    sums.dot += sa * sb;
  }
  return sums;
}

template <typename scalar_t>
void cosine_kernel(const CosineArgs& args, double eps_arg) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = args.shape.rows, d = args.shape.d;
  const scalar_t* a_all = args.x1.const_data_ptr<scalar_t>();
  const scalar_t* b_all = args.x2.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const acc_t eps = effective_eps(static_cast<acc_t>(eps_arg));

  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    ScaleGuess<acc_t> guess_a, guess_b;
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* a = a_all + r * d;
      const scalar_t* b = b_all + r * d;
      acc_t pa = 1, pb = 1, amax_a = 0, amax_b = 0;
      CosineSums<acc_t> sums;
      if (d > 0) {
        sums = cosine_sums<true>(a, b, d, guess_a.p, guess_b.p);
        amax_a = sums.amax_a;
        amax_b = sums.amax_b;
        pa = guess_a.scale_of(amax_a);
        pb = guess_b.scale_of(amax_b);
        if (pa != guess_a.p || pb != guess_b.p) {  // the rescan leaves its amax fields 0
          sums = plain_scale(pa) && plain_scale(pb) ? cosine_sums<false>(a, b, d, pa, pb)
                                                    : cosine_sums_per_entry(a, b, d, pa, pb);
          guess_a.update(pa);
          guess_b.update(pb);
        }
      }
      out[r] = static_cast<scalar_t>(cosine_row(sums.dot, pa, sums.ssq_a, amax_a, pb, sums.ssq_b,
                                                amax_b, eps, stats + kCosineStats * r));
    }
  });
}

template <typename scalar_t>
void cosine_backward_kernel(const CosineBackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  const int64_t rows = args.shape.rows, d = args.shape.d;
  const scalar_t* g_all = args.grad.const_data_ptr<scalar_t>();
  const scalar_t* a_all = args.x1.const_data_ptr<scalar_t>();
  const scalar_t* b_all = args.x2.const_data_ptr<scalar_t>();
  const scalar_t* c_all = args.output.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* da_all = args.grad_x1.mutable_data_ptr<scalar_t>();
  scalar_t* db_all = args.grad_x2.mutable_data_ptr<scalar_t>();
  const bool stream = stream_rows<scalar_t>(args.grad_x1, d) && stream_rows<scalar_t>(args.grad_x2, d);
  const acc_t largest = largest_finite<scalar_t>();
  const V out_max(largest), out_min(-largest);

  at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* a = a_all + r * d;
      const scalar_t* b = b_all + r * d;
      scalar_t* da = da_all + r * d;
      scalar_t* db = db_all + r * d;
      const acc_t* st = stats + kCosineStats * r;
      const acc_t pa = st[0], qa = st[1], divisor_a = st[2], gfa = st[3];
      const acc_t pb = st[4], qb = st[5], divisor_b = st[6], gfb = st[7];
      const acc_t g = static_cast<acc_t>(g_all[r]), c = static_cast<acc_t>(c_all[r]);
      // Rows without a unit entry (unit_divisor 0), the usual case: normalized_entry is s * q.
      if (plain_scale(pa) && plain_scale(pb) && divisor_a == acc_t(0) && divisor_b == acc_t(0)) {
        const V pav(pa), qav(qa), pbv(pb), qbv(qb), gv(g), cv(c);
        // saturate(cosine_grad_value):
        // g * (((v_other - c * v_self) * grad_factor_self) * p_self), saturated.
        const V ka(gfa), kb(gfb);
        write_rows(da, db, d, stream, [&](int64_t j, int64_t count) {
          const V va = (load_vec(a + j, count) * pav) * qav;
          const V vb = (load_vec(b + j, count) * pbv) * qbv;
          return std::pair<V, V>(
              saturate_vec(gv * (((vb - cv * va) * ka) * pav), out_max, out_min),
              saturate_vec(gv * (((va - cv * vb) * kb) * pbv), out_max, out_min));
        });
      } else {
        for (int64_t j = 0; j < d; ++j) {
          const acc_t va = normalized_entry(scaled_entry(static_cast<acc_t>(a[j]), pa), divisor_a, qa);
          const acc_t vb = normalized_entry(scaled_entry(static_cast<acc_t>(b[j]), pb), divisor_b, qb);
          da[j] = static_cast<scalar_t>(saturate(cosine_grad_value(g, va, vb, c, pa, gfa), largest));
          db[j] = static_cast<scalar_t>(saturate(cosine_grad_value(g, vb, va, c, pb, gfb), largest));
        }
      }
    }
    end_streaming(stream);
  });
}

std::tuple<at::Tensor, at::Tensor> normalize(const at::Tensor& input, double eps) {
  const NormalizeArgs args = prepare_normalize(input, eps);
  if (args.shape.rows == 0) return {args.output, args.stats};
  prefer_huge_pages(args.output);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_normalize", [&] { normalize_kernel<scalar_t>(args, eps); });
  return {args.output, args.stats};
}

at::Tensor normalize_backward(const at::Tensor& grad, const at::Tensor& output,
                              const at::Tensor& stats) {
  const NormalizeBackwardArgs args = prepare_normalize_backward(grad, output, stats);
  if (args.grad_input.numel() == 0) return args.grad_input;
  prefer_huge_pages(args.grad_input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.output.scalar_type(),
                                  "nanfree_normalize_backward",
                                  [&] { normalize_backward_kernel<scalar_t>(args); });
  return args.grad_input;
}

std::tuple<at::Tensor, at::Tensor> cosine_similarity(const at::Tensor& x1, const at::Tensor& x2,
                                                     double eps) {
  const CosineArgs args = prepare_cosine(x1, x2, eps);
  if (args.shape.rows == 0) return {args.output, args.stats};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.x1.scalar_type(),
                                  "nanfree_cosine_similarity",
                                  [&] { cosine_kernel<scalar_t>(args, eps); });
  return {args.output, args.stats};
}

std::tuple<at::Tensor, at::Tensor> cosine_similarity_backward(const at::Tensor& grad,
                                                              const at::Tensor& x1,
                                                              const at::Tensor& x2,
                                                              const at::Tensor& output,
                                                              const at::Tensor& stats) {
  const CosineBackwardArgs args = prepare_cosine_backward(grad, x1, x2, output, stats);
  if (args.grad_x1.numel() == 0) return {args.grad_x1, args.grad_x2};
  prefer_huge_pages(args.grad_x1);
  prefer_huge_pages(args.grad_x2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.x1.scalar_type(),
                                  "nanfree_cosine_similarity_backward",
                                  [&] { cosine_backward_kernel<scalar_t>(args); });
  return {args.grad_x1, args.grad_x2};
}

// cosine_clamp of every entry of a contiguous tensor, in place: clamp_min and
// clamp_max return a NaN first operand unchanged, as cosine_clamp keeps NaN.
// (ATen's clamp_ converts float16 / bfloat16 a vector at a time, several times
// slower.)
template <typename scalar_t>
void clamp_cosines(at::Tensor& t) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  scalar_t* data = t.mutable_data_ptr<scalar_t>();
  const V one(1), minus_one(-1);
  at::parallel_for(0, t.numel(), 4 * kGrainElements, [&](int64_t begin, int64_t end) {
    scalar_t* chunk = data + begin;
    write_row(chunk, end - begin, false, [&](int64_t j, int64_t count) {
      return at::vec::clamp_max(at::vec::clamp_min(load_vec(chunk + j, count), minus_one), one);
    });
  });
}

// clamp(a @ b.T, -1, 1): ATen's matmul, then the clamp in place.
at::Tensor cos_sim_matrix(const at::Tensor& a, const at::Tensor& b) {
  check_cos_sim_matrix(a, b);
  at::Tensor out = at::empty({a.size(0), b.size(0)}, a.options());
  prefer_huge_pages(out);
  at::mm_out(out, a, b.t());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "nanfree_cos_sim_matrix",
                                  [&] { clamp_cosines<scalar_t>(out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("normalize", &normalize);
  m.impl("normalize_backward", &normalize_backward);
  m.impl("cosine_similarity", &cosine_similarity);
  m.impl("cosine_similarity_backward", &cosine_similarity_backward);
  m.impl("cos_sim_matrix", &cos_sim_matrix);
}

}  // namespace nanfree
