// The vector primitives of the shared headers' functions that the CPU kernels
// also instantiate with ATen's vectors (nanfree/elementwise_math.h,
// elementwise_binary_math.h: the elementwise family; losses_math.h: the
// losses' pointwise functions), declared before those headers are included so
// that their templates find them. A comparison of vectors is a lane mask, and
// nf_where blends by it. Sleef's 1-ulp functions (ATen's Vectorized methods).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "cpu/vec.h"

namespace nanfree {

template <typename T>
at::vec::Vectorized<T> nf_where(const at::vec::Vectorized<T>& mask, const at::vec::Vectorized<T>& a,
                                const at::vec::Vectorized<T>& b) {
  return at::vec::Vectorized<T>::blendv(b, a, mask);
}
// numerics.h's nf_saturate: vec.h's saturate_vec (min/max that keep NaN).
template <typename T>
at::vec::Vectorized<T> nf_saturate(const at::vec::Vectorized<T>& x, const at::vec::Vectorized<T>& bound) {
  return cpu::saturate_vec(x, bound, at::vec::Vectorized<T>(T(0)) - bound);
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
template <typename T>
at::vec::Vectorized<T> nf_atan2(const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b) {
  return a.atan2(b);
}
template <typename T>
at::vec::Vectorized<T> nf_max(const at::vec::Vectorized<T>& a, const at::vec::Vectorized<T>& b) {
  return at::vec::maximum(a, b);  // NaN in a lane gives NaN there (propagate_nan follows anyway)
}

}  // namespace nanfree
