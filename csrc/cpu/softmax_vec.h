// Vector helpers shared by the CPU kernels of the softmax family (last-dim
// rows in softmax.cpp, strided rows in softmax_strided.cpp): at::vec types,
// the shifted exp, conversions between the stored and accumulation types.
// Both files are compiled with the same vector ISA (setup.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace nanfree {
namespace cpu {

// Hot loops are flattened: GCC keeps ATen's exp_u20 out of line otherwise,
// and a call per vector costs about a third of a short row's time.
#define NANFREE_HOT_LOOP [[gnu::flatten]]

template <typename T>
using Vec = at::vec::Vectorized<T>;

// exp of a shifted (<= 0) argument: ATen's exp_u20 for float (about 20 ulp,
// as PyTorch's own softmax kernels use; results below FLT_MIN flush to 0,
// which a sum that is at least 1 cannot see) and the 1-ulp exp for double.
// exp_u20 clamps its argument and so turns NaN into a number: a result that
// must stay NaN never goes through it (a dropped entry may, as its result is
// then replaced by 0).
template <typename acc_t>
inline Vec<acc_t> shifted_exp(const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}

template <typename acc_t>
inline acc_t vec_sum(const acc_t* a, int64_t n) {
  return at::vec::reduce_all<acc_t>([](Vec<acc_t>& x, Vec<acc_t>& y) { return x + y; }, a, n);
}

template <typename acc_t>
inline acc_t vec_dot(const acc_t* a, const acc_t* b, int64_t n) {
  return at::vec::map2_reduce_all<acc_t>([](Vec<acc_t> x, Vec<acc_t> y) { return x * y; },
                                         [](Vec<acc_t>& x, Vec<acc_t>& y) { return x + y; }, a, b, n);
}

// A per-task row of scratch in the accumulation type, left uninitialized:
// every entry used is written first. Null when not needed.
template <typename acc_t>
inline std::unique_ptr<acc_t[]> scratch_row(int64_t n, bool needed) {
  return std::unique_ptr<acc_t[]>(needed ? new acc_t[n] : nullptr);
}

// Where a row's result in the accumulation type goes: straight into the
// output when the types agree, else into `buffer` (then store_row converts).
template <typename scalar_t, typename acc_t>
inline acc_t* acc_destination(scalar_t* dst, acc_t* buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return dst;
  } else {
    return buffer;
  }
}

template <typename scalar_t, typename acc_t>
inline void store_row(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (src != dst) std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// float16 / bfloat16 to float with vector loads (ATen's at::vec::convert
// widens them one element at a time).
template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
  using V = Vec<float>;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V v;
    at::vec::load_to_float<scalar_t>(src + j, v);
    v.store(dst + j);
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

// A row of the source in the accumulation type: the row itself for float and
// double, else converted into `buffer`.
template <typename scalar_t, typename acc_t>
inline const acc_t* as_acc(const scalar_t* src, int64_t n, acc_t* buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    widen(src, buffer, n);
    return buffer;
  }
}

}  // namespace cpu
}  // namespace nanfree
