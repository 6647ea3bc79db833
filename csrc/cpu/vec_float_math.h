// float functions of the CPU kernels computed in float arithmetic on AVX-512,
// for results that are then rounded to bfloat16 or float16 (float32 results
// take vec_double_math.h's, correctly rounded). log_narrow_vec: C's logf for
// 16 floats within 1.18 ulp of float (all 2^32 inputs checked against double's
// log: 0.06% not the correctly rounded float), far below half an ulp of
// bfloat16 or float16, at about 0.65x the time of vec_double_math.h's log.
// Special values as C's: x < 0 and -inf NaN, +-0 -inf, inf inf, NaN NaN.
//
// x = 2^e m with m in [1, 2); the top four bits of m pick c_i (vec_double_math.h's), and
// ln x = e ln 2 + ln c_i + ln(1 + f), f = m / c_i - 1 (one fma with the stored
// float 1 / c_i; ln c_i is minus the ln of that stored value, split as hi + lo
// floats). c_0 = 1 and c_15 = 2 keep ln x accurate relative to its size next
// to x = 1 (f exact; for c_15, e ln 2 + ln c_15 = 0 exactly at e = -1); the
// other c_i are their interval's midpoints: f in [-1/32, 1/16]. e ln 2 is
// e ln2_hi (exact: ln2_hi has 16 significant bits) + e ln2_lo, and the
// rounding error of e ln2_hi + ln c_i is recovered exactly (Fast2Sum) and
// added to the small part. ln(1 + f) = f + f^2 Q(f), Q: degree 3,
// least-squares fit of (ln(1 + f) - f) / f^2 on Chebyshev nodes of
// [-1/32, 1/16], relative error of ln(1 + f) 6e-9.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <array>
#include <cmath>

#include "cpu/vec.h"
#include "cpu/vec_double_math.h"  // its table of 1 / c_i

namespace nanfree {
namespace cpu {
namespace float_math {

// vec_double_math.h's 1 / c_i rounded to float: the same c_i.
alignas(64) inline constexpr std::array<float, 16> kInverse = [] {
  std::array<float, 16> inverse{};
  for (int i = 0; i < 16; ++i) inverse[i] = static_cast<float>(double_math::kInverse[i]);
  return inverse;
}();
// -ln of kInverse[i] = hi + lo; c_15 = 2: ln2_hi and ln2_lo (the cancellation at e = -1).
alignas(64) inline constexpr float kLnHi[16] = {
    0.0f, 0.08961215615272522f, 0.14518198370933533f, 0.19782572984695435f,
    0.24783620238304138f, 0.2954642176628113f, 0.34092655777931213f, 0.3844117224216461f,
    0.42608442902565f, 0.4660896956920624f, 0.5045560002326965f, 0.541597306728363f,
    0.5773153305053711f, 0.6118015646934509f, 0.6451380252838135f, 0.693145751953125f};
alignas(64) inline constexpr float kLnLo[16] = {
    0.0f, -3.050973473861518e-09f, 1.9207759827111204e-09f, 4.4444958824385594e-10f,
    -1.2255564341145941e-09f, -1.0436851383133217e-09f, 4.976894452113356e-09f, 8.15365375217425e-09f,
    -1.3225653461290676e-08f, -1.157720364020065e-09f, -4.381462304081651e-09f, 7.369349575014894e-09f,
    2.7078872477659388e-08f, -2.5450102469903868e-08f, -8.030872855613325e-09f, 1.4286068202862268e-06f};
inline constexpr float kLnQ[4] = {-0.4999999783308285f, 0.3333417043407121f, -0.2501265920878782f,
                                  0.19028511652164276f};
inline constexpr float kLn2Hi = 0.693145751953125f;
inline constexpr float kLn2Lo = 1.4286068202862268e-06f;

inline __m512 log(const __m512 x) {
  const __m512 e = _mm512_getexp_ps(x);
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero);
  // The index from m's bits, not x's: a subnormal x's top bits are not its mantissa's.
  // permutexvar reads an index's low four bits: the mantissa's top four.
  const __m512i idx = _mm512_srli_epi32(_mm512_castps_si512(m), 19);
  const __m512 inverse = _mm512_permutexvar_ps(idx, _mm512_load_ps(kInverse.data()));
  const __m512 ln_c_hi = _mm512_permutexvar_ps(idx, _mm512_load_ps(kLnHi));
  const __m512 ln_c_lo = _mm512_permutexvar_ps(idx, _mm512_load_ps(kLnLo));
  const __m512 f = _mm512_fmsub_ps(m, inverse, _mm512_set1_ps(1.0f));
  __m512 q = _mm512_set1_ps(kLnQ[3]);
  for (int i = 2; i >= 0; --i) q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(kLnQ[i]));
  const __m512 e_ln2_hi = _mm512_mul_ps(e, _mm512_set1_ps(kLn2Hi));
  const __m512 big = _mm512_add_ps(e_ln2_hi, ln_c_hi);
  // big's rounding error, exact: |e ln2_hi| >= |ln c_hi| unless e = 0, where big is exact.
  const __m512 big_error = _mm512_sub_ps(ln_c_hi, _mm512_sub_ps(big, e_ln2_hi));
  const __m512 small = _mm512_add_ps(_mm512_fmadd_ps(e, _mm512_set1_ps(kLn2Lo), ln_c_lo), big_error);
  const __m512 r = _mm512_add_ps(big, _mm512_fmadd_ps(_mm512_mul_ps(f, f), q, _mm512_add_ps(f, small)));
  // x = 0: -inf; x = inf: inf (getexp and getmant give no finite e and m there).
  const __m512 low = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ), r,
                                          _mm512_set1_ps(-INFINITY));
  const __m512 high = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), low,
                                           _mm512_set1_ps(INFINITY));
  // x < 0, -inf included: no real log (C: NaN).
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), high,
                              _mm512_set1_ps(NAN));
}

}  // namespace float_math

// C's logf of 16 floats whose results are rounded to bfloat16 or float16.
inline Vec<float> log_narrow_vec(const Vec<float>& x) {
  return Vec<float>(float_math::log(x));
}

}  // namespace cpu
}  // namespace nanfree
#endif
