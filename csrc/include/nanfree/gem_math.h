// Generalized mean (GeM) pooling: the special-value rules of DESIGN.md
// section 2 (gem), shared by the CPU and CUDA kernels and mirrored by name in
// nanfree/_triton/gem.py and nanfree/_torch_backend/gem.py.
//
// A reduction is the set of kept (unmasked) entries x_i, n of them. With
// c_i = clamp_to_eps(x_i) and m = max c_i (gem_max_update), every ratio
// r_i = c_i / m lies in (0, 1] and the largest is exactly 1, so
//   mean = (1/n) sum r_i^p  lies in [1/n, 1]   and   gem = m * mean^(1/p).
// Nothing overflows (x = 1e4, p = 10: r^p <= 1) and pow(mean, 1/p) and
// log(mean) never see 0. A ratio may still underflow (m / eps beyond the
// type's range, or r^p for large p): gem_ratio_power then works in the log
// domain, and an r^p that is truly below the type's range is 0, which is right.
//
// Rules:
// - Entries below eps (negatives, zeros, -inf) are eps and pass no gradient;
//   neither does x == eps (torch.clamp's gradient is 0 at the bound).
// - An empty reduction (no kept entry): gem 0, every gradient 0.
// - A kept +inf entry: gem +inf (the exact limit), every gradient 0 (the limit
//   is locally constant in x and p).
// - A kept NaN entry: its reduction's gem, its unclamped kept entries'
//   gradients and the gradient of p are NaN; clamped entries (at or below eps,
//   as torch.clamp's) and masked entries always get gradient 0.
// - A tensor p is clamped to [1e-2, 1e2] (gem_clamp_p); its gradient is 0
//   beyond the bounds and passed at them (gem_p_in_range).
//
// Backward, for the stable quantities (r, mean, gem) and incoming g:
//   dgem/dx_i = mean^(1/p - 1) * r_i^(p - 1) / n           (kept, x_i > eps)
//             = gem * r_i^(p-1) / (n * mean * m)
//   dgem/dp   = gem * (T / (p * mean) - log(mean) / p^2),  T = (1/n) sum r_i^p log r_i
//             = gem * D / p^2,   D = (1/n) sum h(s_i),  s_i = p log r_i - log(mean)
// (m cancels from gem, so it is a constant of the differentiation.) The two
// terms of the first form are O(1/p) and cancel to O(1) at small p (p = 0.0125
// lost 2.8e-3 relative in float). D is the same bracket times p^2, rewritten as
// the Kullback-Leibler divergence of the weights w_i = r_i^p / sum r^p from
// uniform: with t_i = r_i^p / mean = e^(s_i) (so mean t = 1),
//   D = E_w[p log r] - log(mean) = (1/n) sum (t_i log t_i - t_i + 1),
// and t log t - t + 1 = h(s) = 1 + (s - 1) e^s >= 0: a mean of nonnegative
// terms, each evaluated without cancellation (gem_divergence_h), so nothing
// cancels between entries. An error delta in log(mean) (the saved mean's
// rounding) changes D by only D * delta + delta^2 / 2, since the sum of
// h'(s_i) = s_i e^(s_i) is n D. The backward needs no stat beyond the
// forward's (m, mean, count): one pass over the entries with log(mean).
#pragma once

#include "nanfree/numerics.h"

namespace nanfree {

// Bounds of a tensor p (DESIGN.md: a learnable p drifting to 0 or below).
constexpr double kGemMinP = 1e-2;
constexpr double kGemMaxP = 1e2;

// A tensor p clamped to [1e-2, 1e2] in the accumulation type (float32 for
// fp16/bf16/fp32 inputs, float64 for float64 ones, where a float32 p of
// 0.01f = 0.0099999998 is below the bound). NaN stays NaN.
template <typename T>
NF_HOST_DEVICE T gem_clamp_p(T p) {
  return p < T(kGemMinP) ? T(kGemMinP) : (p > T(kGemMaxP) ? T(kGemMaxP) : p);
}

// Whether a tensor p passes its gradient: inside the clamp or at a bound, as
// torch.clamp's gradient mask up to torch 2.13 (2.14 passes none at the
// bounds; a p initialised at 100 could then never move). Beyond, 0.
// csrc/gem.cpp's p_gradient applies it to the tensor p.
template <typename T>
NF_HOST_DEVICE bool gem_p_in_range(T p) {
  return p >= T(kGemMinP) && p <= T(kGemMaxP);
}

// max(x, eps) as torch.clamp(x, min=eps): negatives, zeros and -inf become
// eps; NaN stays NaN (x < eps is false for it), +inf stays +inf.
template <typename T>
NF_HOST_DEVICE T clamp_to_eps(T x, T eps) {
  return x < eps ? eps : x;
}

// Whether an entry passes a gradient through the clamp: x > eps (torch.clamp's
// gradient is 0 at the bound), and NaN too (written !(x <= eps)), so a NaN
// entry's gradient is NaN like its row's.
template <typename T>
NF_HOST_DEVICE bool gem_unclamped(T x, T eps) {
  return !(x <= eps);
}

// The running maximum m of the clamped entries, 0 for the empty set (every
// clamped entry is >= eps > 0). NaN is sticky: once m is NaN no c is greater,
// and a NaN c replaces m (c > m alone is false for it and would drop it).
template <typename T>
NF_HOST_DEVICE T gem_max_update(T m, T c) {
  return (c > m || nf_isnan(c)) ? c : m;
}

// r = c / m in (0, 1] (0 only when the quotient underflows). With m = +inf
// the limit: 1 at a +inf entry (inf / inf would be NaN), 0 elsewhere.
template <typename T>
NF_HOST_DEVICE T gem_ratio(T c, T m) {
  if (m == nf_inf<T>()) return c == m ? T(1) : T(0);  // inf / inf is NaN
  return c / m;
}

// log r for c, m > 0 finite. A ratio below the normal range has lost bits or
// underflowed to 0 (log 0 = -inf): there log c - log m, each finite since
// c >= eps >= the smallest normal.
template <typename T>
NF_HOST_DEVICE T gem_log_ratio(T c, T m) {
  const T r = c / m;
  return r < nf_tiny<T>() ? nf_log(c) - nf_log(m) : nf_log(r);
}

// r^p for p > 0, in [0, 1]: pow(r, p) for a normal ratio; in the log domain
// below it (a ratio that underflowed to 0 would give 0 even for p = 0.01,
// where (1e-50)^0.01 = 0.3). An r^p beyond the type's range underflows to 0,
// which is the right limit. NaN (c or m) stays NaN. For m = +inf the limit
// ratio's power: 1 or 0.
template <typename T>
NF_HOST_DEVICE T gem_ratio_power(T c, T m, T p) {
  if (m == nf_inf<T>()) return gem_ratio(c, m);  // 1^p or 0^p
  const T r = c / m;
  if (!(r < nf_tiny<T>())) return nf_pow(r, p);  // also NaN
  return nf_exp(p * (nf_log(c) - nf_log(m)));
}

// The sum of ratio powers S = sum (c_i / m_old)^p re-expressed against a new,
// larger maximum m_new: S * (m_old / m_new)^p, for kernels that keep a running
// (maximum, sum) state in one pass or merge partial states. m_old = 0 (the
// empty state) gives 0; m_old = m_new gives S; m_new = +inf gives 0 unless
// m_old is +inf too (the limit ratio's power); a NaN maximum stays NaN.
template <typename T>
NF_HOST_DEVICE T gem_rescale_sum(T sum, T m_old, T m_new, T p) {
  if (m_old == m_new) return sum;  // also both +inf (inf / inf would be NaN)
  return sum * gem_ratio_power(m_old, m_new, p);
}

// Two partial states (m1, s1) and (m2, s2) of one reduction merged into
// (m, s) = (max(m1, m2), s1 (m1/m)^p + s2 (m2/m)^p); NaN is sticky.
template <typename T>
NF_HOST_DEVICE void gem_merge(T& m1, T& s1, T m2, T s2, T p) {
  const T m = gem_max_update(m1, m2);
  s1 = gem_rescale_sum(s1, m1, m, p) + gem_rescale_sum(s2, m2, m, p);
  m1 = m;
}

// mean = sum / n; 0 for the empty set (0 / 0 would be NaN). Otherwise in
// [1/n, 1] (the maximum contributes exactly 1), or NaN.
template <typename T>
NF_HOST_DEVICE T gem_mean(T sum, T count) {
  return count == T(0) ? T(0) : sum / count;
}

// gem = m * mean^(1/p); 0 for the empty set. mean^(1/p) <= 1, so the product
// never overflows; it may underflow (p = 0.01 and mean = 0.4 give 1e-40),
// and then the product is formed in the log domain so that a gem within
// range is not lost. m = +inf gives +inf (mean >= 1/n > 0 there).
template <typename T>
NF_HOST_DEVICE T gem_value(T m, T mean, T p) {
  if (mean == T(0)) return T(0);  // the empty set (m is 0 too)
  const T s = nf_pow(mean, T(1) / p);
  if (!(s < nf_tiny<T>())) return m * s;  // also NaN and m = +inf
  return nf_exp(nf_log(m) + nf_log(mean) / p);
}

// Whether a reduction passes gradients: not empty and without a +inf entry
// (whose limit is locally constant). A NaN m passes, so NaN reaches the grads.
template <typename T>
NF_HOST_DEVICE bool gem_has_gradient(T m, T count) {
  return count > T(0) && m != nf_inf<T>();
}

// The weight w of an unclamped kept entry: dgem/dx = w = mean^(1/p-1) *
// r^(p-1) / n, for a reduction that has a gradient. For p >= 1 both factors
// are tame (r^(p-1) <= 1, mean^(1/p-1) in [1, n]). For p < 1 and a tiny r,
// r^(p-1) is huge (up to (m/eps)^(1-p), inf for an underflowed r) while
// mean^(1/p-1) / n may underflow to 0, and inf * 0 would be NaN: then the
// product is formed in the log domain (also for a ratio below the normal
// range, which has lost bits). The result is bounded by the type's
// largest value, so a 0 incoming gradient gives 0, not inf * 0.
template <typename T>
NF_HOST_DEVICE T gem_input_grad_weight(T c, T m, T mean, T count, T p) {
  const T a = nf_pow(mean, T(1) / p - T(1)) / count;
  const T r = c / m;
  const T rp1 = nf_pow(r, p - T(1));
  T w;
  // A ratio below the normal range has lost bits (or is 0, and 0^(p-1) = inf
  // for p < 1): the log domain, as in gem_ratio_power.
  if (a >= nf_tiny<T>() && r >= nf_tiny<T>() && rp1 <= nf_largest<T>()) {
    w = a * rp1;
  } else {
    // NaN (c, m or mean) fails the test above and stays NaN here.
    w = nf_exp((T(1) / p - T(1)) * nf_log(mean) - nf_log(count) +
               (p - T(1)) * gem_log_ratio(c, m));
  }
  return saturate(w, nf_largest<T>());  // inf * 0 must not meet a 0 g; NaN stays
}

// d gem / d x for one kept entry: g * w, 0 for a clamped entry and in a
// reduction without gradient (empty or +inf). The weight is computed only
// where it is used: a clamped entry's log ratio would be finite, but an empty
// reduction has count 0 and m 0 (0 / 0 = NaN).
template <typename T>
NF_HOST_DEVICE T gem_input_grad(T g, T x, T eps, T m, T mean, T count, T p) {
  if (!gem_has_gradient(m, count) || !gem_unclamped(x, eps)) return T(0);
  return g * gem_input_grad_weight(clamp_to_eps(x, eps), m, mean, count, p);
}

// The coefficient c_k = 1 / (k! (k + 2)) of the series of h below.
NF_HOST_DEVICE constexpr double gem_divergence_coefficient(int k) {
  double factorial = 1.0;
  for (int i = 2; i <= k; ++i) factorial *= i;
  return 1.0 / (factorial * (k + 2));
}

// sum_{k=J..K} c_k s^(k-J) by Horner's rule: c_J + s * (c_(J+1) + s * (...)),
// each coefficient a compile-time constant rounded once to T.
template <typename T, int J, int K>
NF_HOST_DEVICE T gem_divergence_horner(T s) {
  constexpr double c = gem_divergence_coefficient(J);
  if constexpr (J == K) {
    return T(c);
  } else {
    return T(c) + s * gem_divergence_horner<T, J + 1, K>(s);
  }
}

// h(s) = 1 + (s - 1) e^s = t log t - t + 1 at t = e^s: >= 0, 0 only at s = 0,
// and s^2 / 2 + O(s^3) near it (the integral of t e^t from 0 to s). For
// |s| <= 1 the series s^2 * sum_k c_k s^k, c_k = 1 / (k! (k + 2)), by Horner's
// rule, truncated where the first omitted term is below half an ulp of h
// (h(+-1) >= 1 - 2/e = 0.26): its terms fall like 1/k!, and for s < 0 they
// alternate from 1/2 down to a sum >= 0.26, so at most about one bit is lost.
// Beyond, the closed form, whose terms (1 and |s - 1| e^s) exceed h by at most
// 1.73 / 0.26 (s = -1).
template <typename T>
NF_HOST_DEVICE T gem_divergence_h(T s) {
  if (s >= T(-1) && s <= T(1)) {
    constexpr int kLastTerm = sizeof(T) > 4 ? 17 : 10;
    return s * s * gem_divergence_horner<T, 0, kLastTerm>(s);
  }
  // A NaN s fails the test above and stays NaN here; s <= log n (t <= n), so
  // e^s is finite, and for a very negative s it underflows to 0: h = 1, the limit.
  return T(1) + (s - T(1)) * nf_exp(s);
}

// One kept entry's term h(s) of D = (1/n) sum h(s_i), s = p log r - log(mean),
// summed over the kept entries (clamped ones included: eps^p depends on p;
// masked ones left out, as from n). For a reduction with gradient only
// (gem_has_gradient: n > 0, m finite), where log r is finite (c >= eps >= the
// smallest normal, gem_log_ratio) and log(mean) is too (mean >= 1/n): s is
// finite. An entry whose r^p is below the type's range (e^s = 0) contributes
// 1, the limit of t log t - t + 1 at t = 0, not 0. `log_mean` is log(mean),
// taken once per reduction. A NaN c or m gives NaN.
template <typename T>
NF_HOST_DEVICE T gem_divergence_term(T c, T m, T log_mean, T p) {
  return gem_divergence_h(p * gem_log_ratio(c, m) - log_mean);
}

// d gem / d p of one reduction for incoming g, given D = (1/n) sum of
// gem_divergence_term: g * gem * D / p^2. D lies in [0, log n] (a divergence
// from uniform), so D / p^2 <= 1e4 log n is finite. 0 for a reduction without
// gradient. gem times D / p^2 may pass the type's range (gem near the largest
// value, p near 1e-2): it is bounded first, so that g = 0 gives 0.
template <typename T>
NF_HOST_DEVICE T gem_p_grad(T g, T gem, T m, T count, T divergence, T p) {
  if (!gem_has_gradient(m, count)) return T(0);
  const T v = saturate(gem * (divergence / (p * p)), nf_largest<T>());
  // g * v may pass the type's range too: saturated, so that summing the terms
  // of many reductions (gem_p_grad_total) never meets inf - inf. NaN stays.
  return saturate(g * v, nf_largest<T>());
}

// p's gradient is the sum of every reduction's gem_p_grad, each within the
// type's range, taken in double with every term scaled by 2^-64 (a sum of
// fewer than 2^64 terms cannot overflow then, even in float64), then clamped
// to the type's range and scaled back: gem_p_grad_scale is that factor, and
// gem_p_grad_total the last step, from the scaled double sum.
constexpr double kGemPGradScale = 0x1p-64;

template <typename T>
NF_HOST_DEVICE T gem_p_grad_total(double scaled_sum) {
  // Beyond the type's range the sum saturates; NaN (a NaN reduction) stays.
  const double bound = static_cast<double>(nf_largest<T>()) * kGemPGradScale;
  return static_cast<T>(saturate(scaled_sum, bound) / kGemPGradScale);
}

}  // namespace nanfree
