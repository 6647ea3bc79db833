// float functions of the CPU kernels computed in double arithmetic on AVX-512:
// C's powf (pow_float_vec), logf (log_float_vec) and log1pf (log1p_float_vec)
// for 16 floats, each the two halves of the vector widened to double. With
// about 1e-12 relative error before the one rounding to float, the results are
// the correctly rounded values but for ties lost in that error (within 0.5 ulp
// plus 1e-9 on 12M random and special pairs, where Sleef's 1-ulp functions,
// ATen's float pow and log1p, reach 0.76 and 1.0 ulp; log: within 0.5000 ulp
// on all 2^31 positive floats, 21 not the correctly rounded float), at 0.6x
// (pow) and 0.75x (log1p) the time of Sleef's AVX-512 functions on one core of
// the CPUs this was measured on (log: 0.55x MKL's vsLn, which ATen's float log calls).
// Special values as C's (pow: a table of 26 values squared; log1p: below -1,
// -1, +-0, inf, NaN, subnormals), NaN included: pow(1, b) = pow(a, 0) = 1.
//
// log2 x: x = 2^e m with m in [1, 2); the top four bits of m pick c_i and
// log2 x = e + log2 c_i + log2(1 + f), f = m / c_i - 1 (one fma with the
// stored 1 / c_i, whose own log2 is the table's), log2(1 + f) = f P(f). c_0 = 1
// and c_15 = 2 make f exact and keep log2 x accurate relative to its size next
// to x = 1 (e = -1, m near 2 gives e + log2 c_15 = 0 exactly); the other c_i
// are their interval's midpoints: f in [-1/32, 1/16]. P: degree 6,
// least-squares fit of log2(1 + f) / f on Chebyshev nodes, relative error 9e-13.
// 2^y: y = k + g, k = round(y), 2^y = 2^k (1 + g Q(g)), Q: degree 8 fit of
// (2^g - 1) / g on [-1/2, 1/2], relative error 8e-14.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu/vec.h"

namespace nanfree {
namespace cpu {
namespace double_math {

alignas(64) inline constexpr double kInverse[16] = {
    1.0, 0.9142857142857143, 0.8648648648648649, 0.8205128205128205,
    0.7804878048780488, 0.7441860465116279, 0.7111111111111111, 0.6808510638297872,
    0.6530612244897959, 0.6274509803921569, 0.6037735849056604, 0.5818181818181818,
    0.5614035087719298, 0.5423728813559322, 0.5245901639344263, 0.5};
// -log2 of kInverse[i], rounded to double.
alignas(64) inline constexpr double kLog2[16] = {
    0.0, 0.1292830169449665, 0.2094533656289497, 0.28540221886224837,
    0.3575520046180836, 0.42626475470209796, 0.49185309632967467, 0.5545888516776374,
    0.6147098441152083, 0.6724253419714956, 0.7279204545631992, 0.7813597135246597,
    0.8328900141647417, 0.8826430493618412, 0.9307373375628862, 1.0};
inline constexpr double kLogP[7] = {1.4426950408898422, -0.7213475202987419, 0.48089833520248215,
                                    -0.36067425644284434, 0.28856685387788766, -0.24026245279300426,
                                    0.18796094397132357};
inline constexpr double kExpQ[9] = {0.6931471805599372, 0.24022650695814296, 0.05550410866584269,
                                    0.009618129158984455, 0.001333355796217901, 0.0001540345618732756,
                                    1.5252825849980902e-05, 1.3255148255377132e-06, 1.017528941647587e-07};
inline constexpr double kLn2 = 0.6931471805599453;

// log2 x for 8 doubles x >= 0 (or NaN) that are not subnormal (from floats).
inline __m512d log2_nonnegative(const __m512d x) {
  const __m512d e = _mm512_getexp_pd(x);
  const __m512d m = _mm512_getmant_pd(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
  // permutex2var reads an index's low four bits: the mantissa's top four.
  const __m512i idx = _mm512_srli_epi64(_mm512_castpd_si512(x), 48);
  const __m512d inverse = _mm512_permutex2var_pd(_mm512_load_pd(kInverse), idx, _mm512_load_pd(kInverse + 8));
  const __m512d log2_c = _mm512_permutex2var_pd(_mm512_load_pd(kLog2), idx, _mm512_load_pd(kLog2 + 8));
  const __m512d f = _mm512_fmsub_pd(m, inverse, _mm512_set1_pd(1.0));
  __m512d p = _mm512_set1_pd(kLogP[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_pd(p, f, _mm512_set1_pd(kLogP[i]));
  const __m512d log2_x = _mm512_fmadd_pd(p, f, _mm512_add_pd(e, log2_c));
  // x = 0 or inf: log2 x = -inf or inf (getmant's value there is no mantissa).
  const __m512d low = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_EQ_OQ), log2_x,
                                           _mm512_set1_pd(-INFINITY));
  return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_set1_pd(INFINITY), _CMP_EQ_OQ), low,
                              _mm512_set1_pd(INFINITY));
}

// 2^y for 8 doubles; y clamped to +-2000 (2^y is then 0 or inf in double, and
// the clamp keeps g finite). min and max return their second operand where one
// is NaN: a NaN y stays NaN.
inline __m512d exp2(const __m512d y_in) {
  const __m512d y = _mm512_max_pd(_mm512_set1_pd(-2000.0), _mm512_min_pd(_mm512_set1_pd(2000.0), y_in));
  const __m512d k = _mm512_roundscale_pd(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512d g = _mm512_sub_pd(y, k);
  __m512d q = _mm512_set1_pd(kExpQ[8]);
  for (int i = 7; i >= 0; --i) q = _mm512_fmadd_pd(q, g, _mm512_set1_pd(kExpQ[i]));
  return _mm512_scalef_pd(_mm512_fmadd_pd(q, g, _mm512_set1_pd(1.0)), k);
}

// |a|^b for 8 doubles, C's pow of |a|.
inline __m512d abs_pow(const __m512d a, const __m512d b) {
  const __m512d log2_x = log2_nonnegative(_mm512_abs_pd(a));
  // y = 0 where log2 x or b is 0: C's pow(1, +-inf) = pow(0 or inf, 0) = 1, not 2^NaN.
  const __mmask8 nonzero = _mm512_cmp_pd_mask(log2_x, _mm512_setzero_pd(), _CMP_NEQ_UQ) &
                           _mm512_cmp_pd_mask(b, _mm512_setzero_pd(), _CMP_NEQ_UQ);
  return exp2(_mm512_maskz_mul_pd(nonzero, b, log2_x));
}

// log1p d for 8 doubles from floats.
inline __m512d log1p(const __m512d d) {
  const __m512d u = _mm512_add_pd(d, _mm512_set1_pd(1.0));
  __m512d ln = _mm512_mul_pd(log2_nonnegative(u), _mm512_set1_pd(kLn2));
  // d < -1: no real log1p (C: NaN; log2_nonnegative would give log2 |1 + d|).
  ln = _mm512_mask_blend_pd(_mm512_cmp_pd_mask(u, _mm512_setzero_pd(), _CMP_LT_OQ), ln, _mm512_set1_pd(NAN));
  // |d| < 2^-29: 1 + d is not exact, and log1p d = d - d^2 / 2 rounds to the float d (-0 kept).
  return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(_mm512_abs_pd(d), _mm512_set1_pd(0x1p-29), _CMP_LT_OQ), ln, d);
}

// ln x for 8 doubles from floats: C's logf (x < 0, -inf included: NaN, where
// log2_nonnegative would give the log of |x|; -0 is 0: -inf).
inline __m512d log(const __m512d x) {
  const __m512d ln = _mm512_mul_pd(log2_nonnegative(x), _mm512_set1_pd(kLn2));
  return _mm512_mask_blend_pd(_mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_LT_OQ), ln, _mm512_set1_pd(NAN));
}

// The low and high halves of a float vector, widened to double.
inline __m512d low_half(const __m512 x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
inline __m512d high_half(const __m512 x) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)); }

// Two halves rounded to float and joined, low first.
inline __m512 join_halves(const __m512d low, const __m512d high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(low)), _mm512_cvtpd_ps(high), 1);
}

}  // namespace double_math

inline Vec<float> pow_float_vec(const Vec<float>& a_vec, const Vec<float>& b_vec) {
  namespace dm = double_math;
  const __m512 a = a_vec, b = b_vec;
  __m512 r = dm::join_halves(dm::abs_pow(dm::low_half(a), dm::low_half(b)),
                             dm::abs_pow(dm::high_half(a), dm::high_half(b)));
  // Integer b (+-inf counts, as in C), and odd among them: below 2^24 a float's half is exact.
  const __m512 half = _mm512_mul_ps(b, _mm512_set1_ps(0.5f));
  constexpr int kTrunc = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
  const __mmask16 integer = _mm512_cmp_ps_mask(_mm512_roundscale_ps(b, kTrunc), b, _CMP_EQ_OQ);
  const __mmask16 odd = integer & _mm512_cmp_ps_mask(_mm512_roundscale_ps(half, kTrunc), half, _CMP_NEQ_UQ);
  // An odd power keeps a's sign (-0 included); a finite negative a has no real
  // power at a non-integer b (C: NaN; pow(-inf, b) is +0 or inf there).
  r = _mm512_mask_xor_ps(r, odd, r, _mm512_and_ps(a, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN))));
  const __mmask16 finite_negative = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ) &
                                    _mm512_cmp_ps_mask(a, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
  return Vec<float>(_mm512_mask_blend_ps(finite_negative & ~integer, r, _mm512_set1_ps(NAN)));
}

// C's logf of 16 floats.
inline Vec<float> log_float_vec(const Vec<float>& x_vec) {
  namespace dm = double_math;
  const __m512 x = x_vec;
  return Vec<float>(dm::join_halves(dm::log(dm::low_half(x)), dm::log(dm::high_half(x))));
}

// C's log1pf of 16 floats.
inline Vec<float> log1p_float_vec(const Vec<float>& d) {
  namespace dm = double_math;
  const __m512 x = d;
  return Vec<float>(dm::join_halves(dm::log1p(dm::low_half(x)), dm::log1p(dm::high_half(x))));
}

}  // namespace cpu
}  // namespace nanfree
#endif
