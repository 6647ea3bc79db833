// Vector powers of ratios for the CPU kernels: r^p of r = c / m.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "cpu/vec.h"

namespace nanfree {
namespace cpu {

// r^p = 2^(p log2 r) for ratios r = c / m (c and m normal, c <= m), without a
// division per entry: the power of a ratio to its largest entry, as GeM's
// fast path computes it (csrc/cpu/gem*.cpp). log2 r is kept as two parts
// de + dl.
//
// AVX-512 float (the common case): from the binary exponents e and the log2
// of the mantissas in [1, 2), l: log2 r = (e_c - e_m) + (l_c - l_m), with
// e_c - e_m exact and l from a 16-entry table (log2 of the mantissa's top four
// bits' midpoint) and a degree-4 polynomial of the rest (|f| <= 1/33), to
// about 3e-8 absolute, the size of the rounding of c / m that the header's
// direct branch makes; no division per entry, and m's parts are computed once
// per reduction (so c = m gives exactly 0). 2^y with y = p (de + dl) keeps
// p de as an exact pair, so y is not rounded at large |y|: 2^k (scalef, which
// underflows gradually to 0) times a degree-6 polynomial of the fraction
// |f| <= 1/2 (relative error 1.6e-8). r^p comes out within a few ulp of
// pow(c / m, p), as the header computes it.
//
// Elsewhere (float64, other instruction sets): de = 0, dl = log2(c / m) and
// exp2 from at::vec.
#if defined(CPU_CAPABILITY_AVX512)
template <typename acc_t>
constexpr bool kMantissaLog2 = std::is_same_v<acc_t, float>;
#else
template <typename acc_t>
constexpr bool kMantissaLog2 = false;
#endif

// The maximum m as log2_ratio needs it: its exponent and mantissa
// log2 (kMantissaLog2), else m itself (in `l`).
template <typename acc_t>
struct RatioBase {
  Vec<acc_t> e, l;
};

template <typename acc_t>
struct Log2Ratio {
  Vec<acc_t> de, dl;
  Vec<acc_t> sum() const { return de + dl; }
};

#if defined(CPU_CAPABILITY_AVX512)
// x = 2^e * mantissa for positive normal x: (e, log2 mantissa).
inline RatioBase<float> mantissa_log2(const __m512 x) {
  const __m512 mant = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __m512 e = _mm512_getexp_ps(x);
  // The mantissa's top four bits (permutexvar reads an index's low four).
  const __m512i idx = _mm512_srli_epi32(_mm512_castps_si512(x), 19);
  // 1 / c_i and -log2 of that float, c_i = 1 + (i + 1/2) / 16.
  const __m512 inv_c = _mm512_permutexvar_ps(
      idx, _mm512_setr_ps(0.9696969985961914f, 0.9142857193946838f, 0.8648648858070374f,
                          0.8205128312110901f, 0.7804877758026123f, 0.7441860437393188f,
                          0.7111111283302307f, 0.6808510422706604f, 0.6530612111091614f,
                          0.6274510025978088f, 0.6037735939025879f, 0.581818163394928f,
                          0.5614035129547119f, 0.5423728823661804f, 0.5245901346206665f,
                          0.5079365372657776f));
  const __m512 log2_c = _mm512_permutexvar_ps(
      idx, _mm512_setr_ps(0.044394075870513916f, 0.12928301095962524f, 0.20945332944393158f,
                          0.28540220856666565f, 0.35755205154418945f, 0.42626476287841797f,
                          0.4918530583381653f, 0.5545889139175415f, 0.6147098541259766f,
                          0.6724252700805664f, 0.727920413017273f, 0.7813597321510315f,
                          0.832889974117279f, 0.8826430439949036f, 0.9307374358177185f,
                          0.9772798418998718f));
  // f = mant / c_i - 1 in [-1/33, 1/33]; log2(1 + f) by a degree-4 minimax
  // polynomial (absolute error 2.3e-9 with these float coefficients).
  const __m512 f = _mm512_fmsub_ps(mant, inv_c, _mm512_set1_ps(1.0f));
  __m512 q = _mm512_set1_ps(-0.3610503077507019f);
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.4812391996383667f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(-0.7213473916053772f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.442694902420044f));
  return {Vec<float>(e), Vec<float>(_mm512_fmadd_ps(q, f, log2_c))};
}
#endif

// log2(c / m) for c in (0, m], c / m normal.
template <typename acc_t>
inline Log2Ratio<acc_t> log2_ratio(const Vec<acc_t>& c, const RatioBase<acc_t>& base) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kMantissaLog2<acc_t>) {
    const RatioBase<float> parts = mantissa_log2(c);
    return {parts.e - base.e, parts.l - base.l};
  }
#endif
  return {Vec<acc_t>(acc_t(0)), (c / base.l).log2()};
}

// 2^((p + p_lo) (de + dl)) for a ratio's log2 parts, with p_lo the rounding
// of an exponent p that is not a float itself (p - 1 below): r^p in [0, 1] for
// p > 0, and r^(p-1) <= (m / eps)^(1-p) < 2^127 for p - 1 > -1.
template <typename acc_t>
inline Vec<acc_t> exp2_product(const Vec<acc_t>& p, const Vec<acc_t>& p_lo,
                               const Log2Ratio<acc_t>& lr) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kMantissaLog2<acc_t>) {
    const __m512 yh = _mm512_mul_ps(p, lr.de);
    const __m512 ye = _mm512_fmsub_ps(p, lr.de, yh);  // p de = yh + ye exactly
    const __m512 yl = _mm512_fmadd_ps(p, lr.dl, _mm512_fmadd_ps(p_lo, lr.sum(), ye));
    // 2^-160 is 0 in float: a lower y only needs to give 0 (f is bounded below for it).
    const __m512 y = _mm512_max_ps(_mm512_add_ps(yh, yl), _mm512_set1_ps(-160.0f));
    const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // yh - k is exact (both near y, |y| < 2^24); f in [-1/2, 1/2] but where y was raised.
    const __m512 f =
        _mm512_max_ps(_mm512_add_ps(_mm512_sub_ps(yh, k), yl), _mm512_set1_ps(-1.0f));
    __m512 q = _mm512_set1_ps(0.00015345810970757157f);
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.0013399930903688073f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.009618489071726799f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.05550328642129898f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.24022646248340607f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.6931471824645996f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
    return Vec<float>(_mm512_scalef_ps(q, k));
  }
#endif
  return at::vec::fmadd(p, lr.sum(), p_lo * lr.sum()).exp2();
}

// r^p of entries c in (0, m], c / m normal.
template <typename acc_t>
inline Vec<acc_t> ratio_power_vec(const Vec<acc_t>& c, const RatioBase<acc_t>& base,
                                  const Vec<acc_t>& p) {
  return exp2_product(p, Vec<acc_t>(acc_t(0)), log2_ratio(c, base));
}

}  // namespace cpu
}  // namespace nanfree
