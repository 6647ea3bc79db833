// Vector helpers shared by the CPU kernels of every op family: at::vec types,
// the shifted exp, conversions between the stored and accumulation types, row
// reductions over several accumulators. Every file of csrc/cpu is compiled
// with the same vector ISA (setup.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
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

// `count` stored values (at most a vector) from p, in the accumulation type;
// lanes past `count` read 0.
template <typename scalar_t>
inline Vec<at::opmath_type<scalar_t>> load_vec(const scalar_t* p, int64_t count) {
  using acc_t = at::opmath_type<scalar_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return Vec<acc_t>::loadu(p, count);
  } else if (count == Vec<acc_t>::size()) {  // one plain half-width load
    Vec<acc_t> v;
    at::vec::load_to_float<scalar_t>(p, v);
    return v;
  } else {  // the first half of a masked float16 / bfloat16 vector
    return std::get<0>(at::vec::convert_to_float<scalar_t>(Vec<scalar_t>::loadu(p, count)));
  }
}

template <typename scalar_t>
inline void store_vec(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, at::opmath_type<scalar_t>>) {
    v.store(p, count);
  } else {
    at::vec::convert_from_float<scalar_t>(v, v).store(p, count);
  }
}

// Reductions of a row over four independent accumulators. With one, every
// vector operation waits for the previous one's result, which bounds a row in
// cache well below the load throughput (ATen's reduce_all keeps one).
// load(j, count) gives the accumulation-type vector of entries [j, j + count);
// lanes past count must hold `identity` (a tail is blended in).
template <typename acc_t, typename Op, typename Load>
[[gnu::always_inline]] inline acc_t reduce_row(int64_t n, acc_t identity, Op op, Load load) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  V acc0(identity), acc1(identity), acc2(identity), acc3(identity);
  int64_t j = 0;
  for (; j + 4 * w <= n; j += 4 * w) {
    acc0 = op(acc0, load(j, w));
    acc1 = op(acc1, load(j + w, w));
    acc2 = op(acc2, load(j + 2 * w, w));
    acc3 = op(acc3, load(j + 3 * w, w));
  }
  for (; j + w <= n; j += w) acc0 = op(acc0, load(j, w));
  if (j < n) acc1 = op(acc1, V::set(V(identity), load(j, n - j), n - j));
  const V total = op(op(acc0, acc1), op(acc2, acc3));
  return at::vec::vec_reduce_all<acc_t>([&](V& a, V& b) { return op(a, b); }, total);
}

// Largest value of x[0..n) (-inf for none), NaN if any value is NaN.
template <typename acc_t>
inline acc_t row_max(const acc_t* x, int64_t n) {
  using V = Vec<acc_t>;
  return reduce_row<acc_t>(
      n, -std::numeric_limits<acc_t>::infinity(),
      [](const V& a, const V& b) { return at::vec::maximum(a, b); },  // propagates NaN
      [&](int64_t j, int64_t count) { return V::loadu(x + j, count); });
}

// widen, also returning the largest value (NaN if any value is NaN), in one pass.
template <typename scalar_t>
inline float widen_max(const scalar_t* src, float* dst, int64_t n) {
  using V = Vec<float>;
  return reduce_row<float>(
      n, -std::numeric_limits<float>::infinity(),
      [](const V& a, const V& b) { return at::vec::maximum(a, b); },  // propagates NaN
      [&](int64_t j, int64_t count) {
        const V v = load_vec(src + j, count);
        v.store(dst + j, count);
        return v;
      });
}

// sum(a[j] * b[j]) over n stored values, in the accumulation type.
template <typename scalar_t>
inline at::opmath_type<scalar_t> row_dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  return reduce_row<acc_t>(n, acc_t(0), [](const V& x, const V& y) { return x + y; },
                           [&](int64_t j, int64_t count) {
                             return load_vec(a + j, count) * load_vec(b + j, count);
                           });
}

// sum(a[j]) over n stored values, in the accumulation type.
template <typename scalar_t>
inline at::opmath_type<scalar_t> row_sum(const scalar_t* a, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  return reduce_row<acc_t>(n, acc_t(0), [](const V& x, const V& y) { return x + y; },
                           [&](int64_t j, int64_t count) { return load_vec(a + j, count); });
}

// The largest finite value of scalar_t, in its accumulation type: the bound of
// a saturated gradient (saturate of nanfree/numerics.h).
template <typename scalar_t>
at::opmath_type<scalar_t> largest_finite() {
  return static_cast<at::opmath_type<scalar_t>>(std::numeric_limits<scalar_t>::max());
}

// saturate (nanfree/numerics.h) of a vector, between out_min = -out_max and
// out_max: clamp_min and clamp_max return a NaN first operand unchanged, as
// saturate keeps NaN.
template <typename acc_t>
Vec<acc_t> saturate_vec(const Vec<acc_t>& x, const Vec<acc_t>& out_max, const Vec<acc_t>& out_min) {
  return at::vec::clamp_max(at::vec::clamp_min(x, out_min), out_max);
}

}  // namespace cpu
}  // namespace nanfree
