// Vector helpers shared by the CPU kernels of every op family: at::vec types,
// the shifted exp, conversions between the stored and accumulation types, row
// reductions over several accumulators, lane masks and blends, compensated
// sums, horizontal reductions of several vectors at once, and the work of a
// parallel task. Every file of csrc/cpu is compiled with the same vector ISA
// (setup.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/functional_bfloat16.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace nanfree {
namespace cpu {

// Work of one parallel task (at::parallel_for's grain), in entries.
constexpr int64_t kGrainElements = 32768;

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

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// Whether a lane holds a float denormal (exponent bits 0, mantissa bits not).
inline __mmask16 denormal_lanes(const Vec<float>& v) {
  const __m512i bits = _mm512_castps_si512(v);
  return _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000)) &
         _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007fffff));
}
#endif

// Float vectors rounded to nearest even into float16 or bfloat16: ATen's
// conversions, or for bfloat16 where the build machine has AVX512-BF16 one
// vcvtne(2)ps2bf16 (a few times fewer instructions than ATen's integer
// rounding, which bounds the bfloat16 loops of simple ops). That instruction
// reads float denormals as 0; vectors holding one take ATen's conversion,
// which keeps them as torch does. NaN stays NaN in both (the payload may
// differ).
//
// narrow_pair: two float vectors into one vector of scalar_t, a then b.
template <typename scalar_t>
inline Vec<scalar_t> narrow_pair(const Vec<float>& a, const Vec<float>& b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (__builtin_expect((denormal_lanes(a) | denormal_lanes(b)) == 0, 1)) {
      // The instruction's second operand fills the low half.
      return Vec<scalar_t>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
#endif
  return at::vec::convert_from_float<scalar_t>(a, b);
}

#if defined(CPU_CAPABILITY_AVX512)
// narrow_one: one float vector into the bits of 16 float16 / bfloat16 values.
template <typename scalar_t>
inline __m256i narrow_one(const Vec<float>& v) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
#if defined(__AVX512BF16__)
    if (__builtin_expect(denormal_lanes(v) == 0, 1)) {
      return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    }
#endif
    return at::vec::cvtfp32_bf16(v);
  } else {
    return at::vec::cvtfp32_fp16(v);
  }
}
#endif

template <typename scalar_t>
inline void store_vec(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count) {
  if constexpr (std::is_same_v<scalar_t, at::opmath_type<scalar_t>>) {
    v.store(p, count);
  } else {
    narrow_pair<scalar_t>(v, v).store(p, count);
  }
}

// op over the lanes of v (a horizontal reduction). float: ATen's vec_reduce_all,
// a tree of shuffles. double: three swaps in registers, where ATen's generic
// version stores and reloads the vector once per lane (a store-forwarding stall
// each, about a hundred cycles a reduction: the whole cost of a softmax row of a
// few doubles).
template <typename acc_t, typename Op>
[[gnu::always_inline]] inline acc_t reduce_lanes(const Op& op, const Vec<acc_t>& v) {
  using V = Vec<acc_t>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, double>) {
    const __m512d a = v;
    const V halves = op(v, V(_mm512_shuffle_f64x2(a, a, 0x4E)));  // swap the 256-bit halves
    const __m512d b = halves;
    const V quarters = op(halves, V(_mm512_shuffle_f64x2(b, b, 0xB1)));  // swap 128-bit lanes
    const __m512d c = quarters;
    return _mm512_cvtsd_f64(op(quarters, V(_mm512_permute_pd(c, 0x55))));  // swap the pairs
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<acc_t, double>) {
    const __m256d a = v;
    const V halves = op(v, V(_mm256_permute2f128_pd(a, a, 1)));
    const __m256d b = halves;
    return _mm256_cvtsd_f64(op(halves, V(_mm256_permute_pd(b, 5))));
  }
#endif
  return at::vec::vec_reduce_all<acc_t>([&](V& a, V& b) { return op(a, b); }, v);
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
  return reduce_lanes<acc_t>(op, total);
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

#if defined(CPU_CAPABILITY_AVX512)
// b in the lanes whose bit is set in `bits`, a in the others: one masked blend.
template <typename acc_t>
inline Vec<acc_t> blend_bits(const Vec<acc_t>& a, const Vec<acc_t>& b, uint32_t bits) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return Vec<acc_t>(_mm512_mask_blend_ps(static_cast<__mmask16>(bits), a, b));
  } else {
    return Vec<acc_t>(_mm512_mask_blend_pd(static_cast<__mmask8>(bits), a, b));
  }
}

// Bit l set where keep[l * stride] is true, for l < count (at most 16): one
// masked byte load and test for a unit stride.
inline uint32_t keep_bits(const bool* keep, int64_t stride, int64_t count) {
  if (stride == 1) {
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
    const __m128i bytes = _mm_maskz_loadu_epi8(valid, keep);
    return _mm_test_epi8_mask(bytes, bytes);
  }
  uint32_t bits = 0;
  for (int64_t l = 0; l < count; ++l) bits |= (keep[l * stride] ? 1u : 0u) << l;
  return bits;
}
#endif

// b in lanes [0, count), a in the others (Vec::set without its switch).
template <typename acc_t>
inline Vec<acc_t> first_lanes(const Vec<acc_t>& a, const Vec<acc_t>& b, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  return blend_bits(a, b, (1u << count) - 1u);
#else
  return Vec<acc_t>::set(a, b, count);
#endif
}

// A running sum of vectors with Kahan's compensation: a lane's error stays
// about one rounding however many terms it adds (a plain running sum of n
// terms carries up to n / 2), as accurate as torch's cascade sums. Used where
// a lane sums a long part of a reduction (inner > 1, and rows beyond flat
// blocks).
template <typename acc_t>
struct CompensatedSum {
  Vec<acc_t> sum{acc_t(0)}, carry{acc_t(0)};
  void add(const Vec<acc_t>& v) {
    const Vec<acc_t> y = v - carry;
    const Vec<acc_t> t = sum + y;
    carry = (t - sum) - y;
    sum = t;
  }
};

// A lane mask (every bit set where kept) of `count` mask entries at keep,
// keep + stride, ...; lanes past count are cleared.
template <typename acc_t>
inline Vec<acc_t> keep_lanes(const bool* keep, int64_t stride, int64_t count) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
#if defined(CPU_CAPABILITY_AVX512)
  if (stride == 1) {  // one masked byte load
    const uint32_t kept = keep_bits(keep, 1, count);
    if constexpr (std::is_same_v<acc_t, float>) {
      return V(_mm512_castsi512_ps(_mm512_movm_epi32(static_cast<__mmask16>(kept))));
    } else {
      return V(_mm512_castsi512_pd(_mm512_movm_epi64(static_cast<__mmask8>(kept))));
    }
  }
#endif
  acc_t lanes[w];
  for (int64_t l = 0; l < w; ++l) lanes[l] = l < count && keep[l * stride] ? acc_t(1) : acc_t(0);
  return V::loadu(lanes) != V(acc_t(0));
}

// The larger of a and b for data without NaN (a block holding NaN is redone
// by the caller): one instruction, where at::vec::maximum also keeps NaN.
template <typename acc_t>
inline Vec<acc_t> plain_max(const Vec<acc_t>& a, const Vec<acc_t>& b) {
  return at::vec::clamp_min(a, b);
}

// Horizontal reductions of `count` (at most one vector's width) vectors at
// once: lane l of the result reduces the vector at v + l * width (lanes past
// count are unspecified). With AVX-512 float, four levels of pairwise
// two-source permutes: about three instructions per vector instead of ten.
template <typename acc_t, typename Op>
inline Vec<acc_t> reduce_each(const acc_t* v, int64_t count, Op op) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    __m512 r[w];  // (a V array would be zeroed first)
    for (int64_t l = 0; l < w; ++l) r[l] = _mm512_loadu_ps(v + (l < count ? l : 0) * w);  // filler past count
    for (int64_t len = w; len > 1; len /= 2) {
      for (int64_t i = 0; i < len / 2; ++i) {
        r[i] = op(V(_mm512_permutex2var_ps(r[2 * i], even, r[2 * i + 1])),
                  V(_mm512_permutex2var_ps(r[2 * i], odd, r[2 * i + 1])));
      }
    }
    return V(r[0]);
  }
#endif
  acc_t out[w] = {};
  for (int64_t l = 0; l < count; ++l) {
    out[l] = reduce_lanes<acc_t>(op, V::loadu(v + l * w));
  }
  return V::loadu(out);
}

// x where a > b, else 0.
template <typename acc_t>
inline Vec<acc_t> where_greater(const Vec<acc_t>& a, const Vec<acc_t>& b, const Vec<acc_t>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    return Vec<float>(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), x));
  }
#endif
  return Vec<acc_t>::blendv(Vec<acc_t>(acc_t(0)), x, a > b);
}

// A double sum with Neumaier's compensation: each addition's rounding error is
// kept (exactly) and added at the end, so that terms of both signs near the
// largest value cancel to about one rounding of the result, not of the
// largest partial sum.
struct NeumaierSum {
  double sum = 0, carry = 0;
  void add(double v) {
    const double t = sum + v;
    carry += std::abs(sum) >= std::abs(v) ? (sum - t) + v : (v - t) + sum;
    sum = t;
  }
  double value() const { return sum + carry; }
};

}  // namespace cpu
}  // namespace nanfree
