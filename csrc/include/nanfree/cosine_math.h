// L2 normalization and cosine similarity of vectors (the last dimension of a
// row-major [rows, d] problem): the special-value rules of DESIGN.md section 2
// (cosine), shared by the CPU and CUDA kernels and mirrored by name in
// nanfree/_triton/cosine.py.
//
// A vector's norm is never formed as sum(x^2), which overflows (fp16 entries
// of 300, fp32 of 1e20) or underflows (fp16 of 1e-4, fp32 of 1e-25). Each
// vector is first scaled by an exact power of two p (norm_scale of its
// largest magnitude), so every scaled entry x * p is below 2 in magnitude and
// the largest is at least 1: the sum of squares of the scaled entries (ssq)
// lies in [1, 4d] for a nonzero vector, and the norm is sqrt(ssq) / p.
// Normalizing multiplies the scaled entry by q (norm_factors):
// x / max(norm, eps) == (x * p) * q, two multiplications that neither
// overflow nor underflow; an entry whose magnitude is the norm is exactly
// +-1 (normalized_entry), as torch's division x / norm gives.
//
// Rules (torch's eps rule applied to the accurate norm):
// - x / max(norm, eps): a zero vector normalizes to 0, a vector below eps to
//   x / eps; cosine similarity is the dot product of the two normalized
//   vectors, clamped to [-1, 1].
// - A vector holding +-inf (and no NaN) is the limit direction: each infinite
//   entry counts as +-1, the finite ones as 0 (normalized: +-1/sqrt(k) on its k
//   infinite entries, 0 elsewhere).
// - A vector holding NaN normalizes to NaN, and its similarities are NaN.
// - Gradients: a vector whose norm is at least eps gets the exact gradient; a
//   vector below eps (zero vectors included) and an infinite one pass no
//   gradient (their grad_factor is 0); a NaN vector's gradient is NaN.
#pragma once

#include "nanfree/numerics.h"

namespace nanfree {

// The statistics a forward saves per row for its backward (in the
// accumulation type): normalize's (p, grad_factor); cosine_similarity's
// (p, q, unit_divisor, grad_factor) of x1, then the same of x2.
constexpr int64_t kNormalizeStats = 2;
constexpr int64_t kCosineStats = 8;

// The power of two p = 2^-e that scales a vector whose largest magnitude is
// `amax` so that the largest scaled entry lies in [1, 2). e is clamped to the
// normal exponents, so p is exact and finite (a vector of subnormals scales to
// entries below 1, still far from underflow once squared). Marks:
// - amax NaN (a NaN entry): p is NaN, so every scaled entry and the state are NaN;
// - amax +inf (an infinite entry, no NaN): p is 0, which scaled_entry reads as
//   "take the limit direction";
// - amax 0 (a zero vector): any p; every scaled entry is 0.
template <typename T>
NF_HOST_DEVICE T norm_scale(T amax) {
  if (nf_isnan(amax)) return amax;             // NaN reaches every scaled entry
  if (amax == nf_inf<T>()) return T(0);        // the infinite-vector mark
  int e = amax > T(0) ? nf_ilogb(amax) : 0;    // ilogb(0) is a sentinel, not an exponent
  e = e < min_normal_exponent<T>() ? min_normal_exponent<T>() : e;
  e = e > max_normal_exponent<T>() ? max_normal_exponent<T>() : e;
  return nf_ldexp(T(1), -e);
}

// One entry scaled by p (exact). For an infinite vector (p == 0) the limit:
// +-1 at an infinite entry, 0 at a finite one (x * 0 would be NaN at +-inf).
template <typename T>
NF_HOST_DEVICE T scaled_entry(T x, T p) {
  if (p == T(0)) return nf_isinf(x) ? (x > T(0) ? T(1) : T(-1)) : T(0);
  return x * p;
}

// Whether a vector's sums of squares and products may be taken unscaled and
// scaled afterwards (a kernel's one-pass fast path): for a largest magnitude
// in [2^-40, 2^40] no square or product of its entries overflows, so
// sum(x^2) * p^2 (p^2 a power of two: exact) is the sum of the scaled
// squares with the same roundings, except for products below 2^-126 (under
// 2^-46 of the largest square, rounded to a multiple of 2^-149 instead of
// relatively), which can move the rounded sum only at an exact tie. False for
// NaN, infinite, zero and extreme vectors: they take the scaled sums.
template <typename T>
NF_HOST_DEVICE bool unscaled_sums_exact(T amax) {
  return amax >= T(0x1p-40) && amax <= T(0x1p40);  // false for NaN
}

// The per-vector factors a kernel needs once it has a vector's scale p and
// the sum of squares ssq of its scaled entries (one square root and one
// division per vector):
// - q, the clamped norm factor: x / max(norm, eps) == scaled_entry(x, p) * q;
// - divisor, the scaled norm sqrt(ssq) where q is 1 / sqrt(ssq) (a norm of at
//   least eps, or an infinite vector's limit direction), else 0;
// - grad_factor: d(x / norm)/dx carries 1 / norm == p * grad_factor; 0 where
//   the vector passes no gradient.
template <typename T>
struct NormFactors {
  T q;
  T divisor;
  T grad_factor;
};

template <typename T>
NF_HOST_DEVICE NormFactors<T> norm_factors(T p, T ssq, T eps) {
  // A NaN vector: NaN throughout (the comparisons below would be false and hide it).
  if (nf_isnan(ssq)) return {ssq, ssq, ssq};
  // A zero vector normalizes to 0 (0 / eps; 1 / (eps * p) may overflow), has
  // no norm to divide by and passes no gradient.
  if (ssq == T(0)) return {T(0), T(0), T(0)};
  const T root = nf_sqrt(ssq);
  // An infinite vector's limit direction (scaled entries +-1 and 0) is locally
  // constant: no gradient.
  if (p == T(0)) return {T(1) / root, root, T(0)};
  // The norm (root / p) is at least eps, compared as root >= eps * p; when
  // eps * p overflows to +inf the vector is tiny next to eps and fails, as it should.
  if (root >= eps * p) {
    const T q = T(1) / root;
    return {q, root, q};
  }
  // Below eps: x / eps = (x * p) * ((1 / eps) / p); dividing by p (a power of
  // two, at most 2^-min_exponent) rather than multiplying by eps * p keeps it
  // finite. The vector has no direction to differentiate: gradient 0.
  return {(T(1) / eps) / p, T(0), T(0)};
}

// A vector's divisor (norm_factors) where the vector holds an entry of the
// norm's magnitude, which normalized_entry makes exactly +-1; else 0. Only a
// largest entry can, and only if the divisor equals it (the rounded norm is
// never smaller), so normalized_entry gives the same with either divisor, and
// a kernel may multiply every entry of a row whose unit divisor is 0 by q. `amax` is the vector's largest magnitude (NaN and +inf
// as in norm_scale).
template <typename T>
NF_HOST_DEVICE T unit_divisor(T divisor, T p, T amax) {
  // A NaN divisor fails the test: 0, and q is NaN.
  return divisor > T(0) && divisor == scaled_entry(amax, p) ? divisor : T(0);
}

// The normalized entry x / max(norm, eps) of a scaled entry s, given its
// vector's divisor (or unit_divisor) and its q (norm_factors): s * q,
// within a rounding of the quotient, except an entry whose magnitude is the
// (positive) divisor itself, which is exactly +-1 as the quotient is. Such an
// entry is the vector's only nonzero one, or one beside which the others
// vanish in the rounded norm; s * q, with q = 1 / divisor rounded, can give
// 1 - 2^-24 there (a one-hot vector that does not normalize to itself, and a
// similarity of parallel one-hot vectors that is not 1). Dividing every
// entry instead would cost up to 1.3x on rows in cache (measured on the CPU).
template <typename T>
NF_HOST_DEVICE T normalized_entry(T s, T divisor, T q) {
  if (divisor > T(0) && nf_abs(s) == divisor) return s > T(0) ? T(1) : T(-1);
  return s * q;  // NaN for a NaN vector: q is NaN
}

// A cosine similarity clamped to [-1, 1] (rounding can carry a dot product of
// unit vectors past 1, and acos of that is NaN); NaN stays NaN.
template <typename T>
NF_HOST_DEVICE T cosine_clamp(T c) {
  return c > T(1) ? T(1) : (c < T(-1) ? T(-1) : c);
}

// The cosine similarity of two vectors from the dot product of their scaled
// entries, their divisors and their factors q (norm_factors), clamped. Where both
// divisors are positive: scaled_dot / (divisor1 * divisor2), one rounding
// fewer than multiplying by q1 and q2, and exactly +-1 for two vectors with
// one nonzero entry at the same index (the dot product and the divisors'
// product are then the same rounded product), as torch's. Otherwise (a zero,
// below-eps or NaN vector) (scaled_dot * q1) * q2.
template <typename T>
NF_HOST_DEVICE T cosine_value(T scaled_dot, T divisor1, T divisor2, T q1, T q2) {
  if (divisor1 > T(0) && divisor2 > T(0)) return cosine_clamp(scaled_dot / (divisor1 * divisor2));
  return cosine_clamp((scaled_dot * q1) * q2);
}

// A row's cosine similarity from the dot product of its vectors' scaled
// entries and each vector's scale p, sum of squares ssq and largest magnitude
// amax; writes the row's kCosineStats statistics (p, q, unit_divisor,
// grad_factor of x1, then of x2) to `stats`.
template <typename T>
NF_HOST_DEVICE T cosine_row(T scaled_dot, T p1, T ssq1, T amax1, T p2, T ssq2, T amax2, T eps,
                            T* stats) {
  const NormFactors<T> f1 = norm_factors(p1, ssq1, eps);
  const NormFactors<T> f2 = norm_factors(p2, ssq2, eps);
  stats[0] = p1;
  stats[1] = f1.q;
  stats[2] = unit_divisor(f1.divisor, p1, amax1);
  stats[3] = f1.grad_factor;
  stats[4] = p2;
  stats[5] = f2.q;
  stats[6] = unit_divisor(f2.divisor, p2, amax2);
  stats[7] = f2.grad_factor;
  return cosine_value(scaled_dot, f1.divisor, f2.divisor, f1.q, f2.q);
}

// d normalize: the gradient of y = x / norm for an incoming g, given
// dot = sum(g * y) over the vector (a GradSum of numerics.h) and grad_factor =
// norm_factors' grad_factor: (g - y * dot) / norm, with 1 / norm applied as
// grad_factor, then p. In that order a grad_factor of 0 gives 0 even where p
// (up to 2^126 for a vector of subnormals) would overflow the product first
// and make it inf * 0 = NaN. The caller saturates the result.
// Upstream gradients near the largest value: dot (up to the norm of g) may
// overflow, then the difference is formed at dot's scale 2^-64; g - y * dot may
// overflow although (g - y * dot) / norm need not, then it is formed at half
// scale (and a grad_factor of 0 must not meet it as inf).
template <typename T>
NF_HOST_DEVICE T normalize_grad_value(T g, T y, GradSum<T> dot, T p, T grad_factor) {
  if (grad_sum_overflowed(dot))
    return (((g * grad_sum_scale<T>() - y * dot.scaled) * grad_factor) * p) * grad_sum_unscale<T>();
  const T d = g - y * dot.plain;
  if (nf_isinf(d)) return (((T(0.5) * g - y * (T(0.5) * dot.plain)) * grad_factor) * p) * T(2);
  return (d * grad_factor) * p;
}

// d cosine_similarity with respect to x1 (swap the roles for x2): with
// v = x / max(norm, eps) the normalized entries (normalized_entry) and c the
// similarity,
// dc/dx1 = (v2 - c * v1) / norm1 (grad_factor before p, as in normalize_grad_value).
template <typename T>
NF_HOST_DEVICE T cosine_grad_value(T g, T v_self, T v_other, T c, T p_self, T grad_factor_self) {
  return g * (((v_other - c * v_self) * grad_factor_self) * p_self);
}

}  // namespace nanfree
