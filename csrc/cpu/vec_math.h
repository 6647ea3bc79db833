// The vector primitives of the shared headers' functions that the CPU kernels
// also instantiate with ATen's vectors (nanfree/elementwise_math.h,
// elementwise_binary_math.h: the elementwise family; losses_math.h: the
// losses' pointwise functions), declared before those headers are included so
// that their templates find them. A comparison of vectors is a lane mask, and
// nf_where blends by it. Sleef's 1-ulp functions (ATen's Vectorized methods).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "cpu/vec.h"
#include "cpu/vec_double_math.h"
#include "cpu/vec_float_math.h"

namespace nanfree {

template <typename T>
at::vec::Vectorized<T> nf_where(const at::vec::Vectorized<T>& mask, const at::vec::Vectorized<T>& a,
                                const at::vec::Vectorized<T>& b) {
  return at::vec::Vectorized<T>::blendv(b, a, mask);
}
// numerics.h's nf_ordered: one ordered compare (false where a lane of a or b is NaN).
template <typename T>
at::vec::Vectorized<T> nf_ordered(const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_castsi512_ps(_mm512_movm_epi32(_mm512_cmp_ps_mask(a, b, _CMP_ORD_Q)));
  } else if constexpr (std::is_same_v<T, double>) {
    return _mm512_castsi512_pd(_mm512_movm_epi64(_mm512_cmp_pd_mask(a, b, _CMP_ORD_Q)));
  }
#endif
  return (a == a) & (b == b);
}
// numerics.h's nf_zero_where: x with the bits of the mask's lanes cleared (+0 there).
template <typename T>
at::vec::Vectorized<T> nf_zero_where(const at::vec::Vectorized<T>& mask, const at::vec::Vectorized<T>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_andnot_ps(mask, x);
  } else if constexpr (std::is_same_v<T, double>) {
    return _mm512_andnot_pd(mask, x);
  }
#endif
  return x ^ (x & mask);
}
// numerics.h's nf_any_non_finite: whether any lane is NaN or +-inf.
template <typename T>
bool nf_any_non_finite(const at::vec::Vectorized<T>& x) {
  return x.has_inf_nan();
}
// numerics.h's nf_saturate: vec.h's saturate_vec (min/max that keep NaN).
template <typename T>
at::vec::Vectorized<T> nf_saturate(const at::vec::Vectorized<T>& x, const at::vec::Vectorized<T>& bound) {
  return cpu::saturate_vec(x, bound, at::vec::Vectorized<T>(T(0)) - bound);
}
// numerics.h's nf_clamp_min: ATen's clamp_min, whose max(lo, x) returns x where x is NaN.
template <typename T>
at::vec::Vectorized<T> nf_clamp_min(const at::vec::Vectorized<T>& x, const at::vec::Vectorized<T>& lo) {
  return at::vec::clamp_min(x, lo);
}
// numerics.h's nf_clamp_max: ATen's clamp_max, min(hi, x), which returns x where x is NaN.
template <typename T>
at::vec::Vectorized<T> nf_clamp_max(const at::vec::Vectorized<T>& x, const at::vec::Vectorized<T>& hi) {
  return at::vec::clamp_max(x, hi);
}
template <typename T>
at::vec::Vectorized<T> nf_sqrt(const at::vec::Vectorized<T>& x) { return x.sqrt(); }
template <typename T>
at::vec::Vectorized<T> nf_log(const at::vec::Vectorized<T>& x) { return x.log(); }
template <typename T>
at::vec::Vectorized<T> nf_exp(const at::vec::Vectorized<T>& x) { return x.exp(); }
template <typename T>
at::vec::Vectorized<T> nf_log1p(const at::vec::Vectorized<T>& x) { return x.log1p(); }
template <typename T>
at::vec::Vectorized<T> nf_acos(const at::vec::Vectorized<T>& x) { return x.acos(); }
template <typename T>
at::vec::Vectorized<T> nf_asin(const at::vec::Vectorized<T>& x) { return x.asin(); }
template <typename T>
at::vec::Vectorized<T> nf_abs(const at::vec::Vectorized<T>& x) { return x.abs(); }
template <typename T>
at::vec::Vectorized<T> nf_floor(const at::vec::Vectorized<T>& x) { return x.floor(); }
template <typename T>
at::vec::Vectorized<T> nf_pow(const at::vec::Vectorized<T>& x, const at::vec::Vectorized<T>& y) {
  return x.pow(y);
}
#if defined(CPU_CAPABILITY_AVX512)
// float pow, log and log1p: vec_double_math.h's, in double arithmetic (correctly
// rounded but for rare ties, faster than Sleef's, which ATen's float pow and
// log1p call, and than MKL's log, which ATen's float log calls).
inline at::vec::Vectorized<float> nf_pow(const at::vec::Vectorized<float>& x, const at::vec::Vectorized<float>& y) {
  return cpu::pow_float_vec(x, y);
}
inline at::vec::Vectorized<float> nf_log(const at::vec::Vectorized<float>& x) {
  return cpu::log_float_vec(x);
}
inline at::vec::Vectorized<float> nf_log1p(const at::vec::Vectorized<float>& x) {
  return cpu::log1p_float_vec(x);
}
#endif
template <typename T>
at::vec::Vectorized<T> nf_atan2(const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b) {
  return a.atan2(b);
}
template <typename T>
at::vec::Vectorized<T> nf_max(const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b) {
  return at::vec::maximum(a, b);  // NaN in a lane gives NaN there (propagate_nan follows anyway)
}

}  // namespace nanfree
