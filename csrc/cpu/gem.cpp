// CPU kernels of GeM pooling (the generalized mean) over dim 1 of the
// contiguous input viewed as [outer, n, inner], built on the shared rules of
// csrc/include/nanfree/gem_math.h: each reduction is scaled by its largest
// clamped entry m, so every ratio r = max(x, eps) / m is in (0, 1].
//
// Layouts. inner == 1 (gem_pool2d: [B * C, H * W, 1]): each reduction is a
// contiguous row; rows go in blocks of one vector's width, so that the
// per-reduction work (the pow of the mean, the stats, p's gradient terms) is
// vectorized across a block's rows. With AVX-512 float accumulation, no mask
// and n <= 256, a block is read as n full vectors, each lane taking its own
// row's constants through a permute (FlatRows), so that short rows (n = 49)
// cost no tail vectors; other rows go one at a time. inner > 1 (tokens
// [B, L, H] reduced over L): a task is one o and up to four vectors of
// consecutive i, its lanes; entry j of every lane is one contiguous load, so
// the loops run over j with vector operations across the lanes (rows asked
// for ahead, compensated sums). A mask that is the same for every lane (the
// token layout's mask [B, L, 1] expanded: stride 0 along inner) drops whole
// rows of a task; any other mask is read per lane.
//
// Forward: one read of the input. The first pass finds each reduction's
// maximum and count; the second (from cache: a block of rows, or a task's
// columns, sized for L2) sums r^p. Backward: one read of the input and one
// write of its gradient (streamed when large), with the divergence terms of
// p's gradient summed in the same pass; p's gradient is the sum of
// per-block partials in block order, the same for any thread count.
//
// Fast path. A reduction whose m is finite and > 0 and whose smallest possible
// ratio eps / m is a normal number, and (backward) whose weight factor
// mean^(1/p - 1) / n is normal too, takes the direct branch of every header
// function; those are computed here with a vector log2 and exp2 (see "the
// fast path's logarithm and power"): r^p = 2^(p log2 r), and in the backward
// one log2 and one exp2 per entry: r^(p-1) = 2^((p-1) log2 r), e^s = r^(p-1) r
// / mean, s = p log r - log(mean), h(s) by the header's series for |s| <= 1
// and its closed form beyond. Every other reduction (NaN, +inf, empty, eps far
// below m, a weight below the normal range, a p whose products could
// overflow) is computed entry by entry with the header's scalar functions, so
// the special values are decided by the shared header only.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "common/gem_op.h"
#include "cpu/large_output.h"
#include "cpu/vec.h"
#include "nanfree/gem_math.h"

namespace nanfree {
namespace {

using namespace cpu;

constexpr int64_t kGrainElements = 32768;  // work per parallel task, in elements
constexpr int64_t kGroupVectors = 4;       // vectors of lanes per inner > 1 task
// The largest p of the vector path: p (e_c - e_m) stays far from overflow.
constexpr double kVectorMaxP = 0x1p100;

// The op's scalars in the accumulation type.
template <typename acc_t>
struct GemScalars {
  acc_t p;      // clamped for a tensor p (gem_clamp_p), as given for a Python p
  acc_t eps;    // effective_eps
  acc_t inv_p;  // 1 / p, as gem_value forms it
  // Whether the vector path may be used at all: p normal and at most 2^100,
  // so that p log2 r and its parts are finite. Otherwise (a Python p beyond,
  // or one that is 0 or inf in the accumulation type) every reduction takes
  // the scalar rules.
  bool vector_p;
};

template <typename acc_t>
GemScalars<acc_t> gem_scalars(const at::Tensor& p_acc, double p_value, double eps) {
  GemScalars<acc_t> k;
  k.p = p_acc.defined() ? gem_clamp_p(p_acc.item<acc_t>()) : static_cast<acc_t>(p_value);
  k.eps = effective_eps(static_cast<acc_t>(eps));
  k.inv_p = acc_t(1) / k.p;
  k.vector_p = k.p >= nf_tiny<acc_t>() && k.p <= acc_t(kVectorMaxP);  // false for NaN
  return k;
}

// b in lanes [0, count), a in the others (Vec::set without its switch).
template <typename acc_t>
inline Vec<acc_t> first_lanes(const Vec<acc_t>& a, const Vec<acc_t>& b, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  const unsigned bits = (1u << count) - 1u;
  if constexpr (std::is_same_v<acc_t, float>) {
    return Vec<acc_t>(_mm512_mask_blend_ps(static_cast<__mmask16>(bits), a, b));
  } else {
    return Vec<acc_t>(_mm512_mask_blend_pd(static_cast<__mmask8>(bits), a, b));
  }
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
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
    const __m128i bytes = _mm_maskz_loadu_epi8(valid, keep);
    const __mmask16 kept = _mm_test_epi8_mask(bytes, bytes);
    if constexpr (std::is_same_v<acc_t, float>) {
      return V(_mm512_castsi512_ps(_mm512_movm_epi32(kept)));
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

// store_vec of `count` entries, with one direct (masked) store of a
// float16 / bfloat16 vector where at::vec would copy through a buffer.
template <typename scalar_t>
inline void store_entries(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
    const __m256i bits = std::is_same_v<scalar_t, at::BFloat16> ? at::vec::cvtfp32_bf16(v)
                                                                 : at::vec::cvtfp32_fp16(v);
    if (count == Vec<float>::size()) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
    } else {
      _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << count) - 1u), bits);
    }
    return;
  }
#endif
  store_vec(v, p, count);
}

// store_entries, streamed (cpu/large_output.h) when `stream` and the vector
// is whole (its address then aligned to its stored size).
template <typename scalar_t>
inline void put_entries(const Vec<at::opmath_type<scalar_t>>& v, scalar_t* p, int64_t count,
                        bool stream) {
  if (stream && count == Vec<at::opmath_type<scalar_t>>::size()) {
    stream_vec(v, p);
  } else {
    store_entries(v, p, count);
  }
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
    out[l] = at::vec::vec_reduce_all<acc_t>([&](V& a, V& b) { return op(a, b); }, V::loadu(v + l * w));
  }
  return V::loadu(out);
}

// ---- the fast path's logarithm and power -------------------------------------
//
// r^p = 2^(p log2 r) for ratios r = c / m of a fast-path reduction (c and m
// normal, c <= m). log2 r is kept as two parts de + dl.
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

// A reduction's maximum as log2_ratio needs it: its exponent and mantissa
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

// log2(c / m) for c in [eps, m] of a fast-path reduction.
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

// r^p of entries c in [eps, m] of a fast-path reduction.
template <typename acc_t>
inline Vec<acc_t> ratio_power_vec(const Vec<acc_t>& c, const RatioBase<acc_t>& base,
                                  const Vec<acc_t>& p) {
  return exp2_product(p, Vec<acc_t>(acc_t(0)), log2_ratio(c, base));
}

// gem_divergence_h's series h(s) = s^2 sum_k c_k s^k, c_k =
// gem_divergence_coefficient(k), k up to 10 (float) or 17 (double): the
// header's Horner polynomial, with fused multiply-adds.
template <typename acc_t>
struct DivergenceSeries {
  static constexpr int kLastTerm = sizeof(acc_t) > 4 ? 17 : 10;
  static constexpr std::array<acc_t, kLastTerm + 1> coefficients() {
    std::array<acc_t, kLastTerm + 1> c{};
    for (int k = 0; k <= kLastTerm; ++k) c[k] = static_cast<acc_t>(gem_divergence_coefficient(k));
    return c;
  }
};

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

// gem_divergence_h on the fast path, given t = e^s: the series for |s| <= 1,
// else the closed form 1 + (s - 1) t.
template <typename acc_t>
inline Vec<acc_t> divergence_h_vec(const Vec<acc_t>& s, const Vec<acc_t>& t) {
  using V = Vec<acc_t>;
  using Series = DivergenceSeries<acc_t>;
  static constexpr auto c = Series::coefficients();
  V poly(c[Series::kLastTerm]);
  for (int k = Series::kLastTerm - 1; k >= 0; --k) poly = at::vec::fmadd(poly, s, V(c[k]));
  const V series = (s * s) * poly;
  const V closed = at::vec::fmadd(s - V(acc_t(1)), t, V(acc_t(1)));
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __mmask16 inside = _mm512_cmp_ps_mask(s.abs(), _mm512_set1_ps(1.0f), _CMP_LE_OQ);
    return Vec<float>(_mm512_mask_blend_ps(inside, closed, series));
  }
#endif
  return V::blendv(closed, series, s.abs() <= V(acc_t(1)));
}

// Whether a reduction's sums may take the vector path: m finite and > 0
// (neither empty nor NaN nor +inf) and eps / m normal, so that every ratio
// c / m >= eps / m is normal: gem_ratio_power and gem_log_ratio take their
// direct branch.
template <typename acc_t>
inline bool fast_ratios(acc_t m, const GemScalars<acc_t>& k) {
  return k.vector_p && m > acc_t(0) && m <= nf_largest<acc_t>() && k.eps / m >= nf_tiny<acc_t>();
}

// ---- forward ----------------------------------------------------------------

// sum of gem_ratio_power over the kept entries of one reduction (entry j at
// x[j * xs], kept when keep is null or keep[j * ks]): the scalar rules.
template <typename scalar_t, typename acc_t>
acc_t power_sum_scalar(const scalar_t* x, int64_t n, int64_t xs, const bool* keep, int64_t ks,
                       acc_t m, const GemScalars<acc_t>& k) {
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (keep != nullptr && !keep[j * ks]) continue;
    sum += gem_ratio_power(clamp_to_eps(static_cast<acc_t>(x[j * xs]), k.eps), m, k.p);
  }
  return sum;
}

// gem_value from mean^(1/p) = s computed elsewhere (a vector pow): m * s, or
// the header itself where it takes another branch (the empty set, or s below
// the normal range; a NaN s gives m * s there too, as here).
template <typename acc_t>
inline acc_t gem_from_power(acc_t m, acc_t mean, acc_t s, acc_t p) {
  if (mean == acc_t(0) || s < nf_tiny<acc_t>()) return gem_value(m, mean, p);
  return m * s;
}

// The RatioBase parts (e, l) of `count` reductions' maxima (normal numbers),
// one float per reduction, to be broadcast or permuted into lanes.
template <typename acc_t>
void ratio_bases(const acc_t* m, int64_t count, acc_t* e, acc_t* l) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    if constexpr (kMantissaLog2<acc_t>) {
#if defined(CPU_CAPABILITY_AVX512)
      const RatioBase<float> b = mantissa_log2(first_lanes(V(acc_t(1)), V::loadu(m + l0, c), c));
      b.e.store(e + l0, c);
      b.l.store(l + l0, c);
#endif
    } else {
      V(acc_t(0)).store(e + l0, c);
      V::loadu(m + l0, c).store(l + l0, c);
    }
  }
}

// The outputs and stats of `count` consecutive reductions from their maxima,
// power sums and counts.
template <typename scalar_t, typename acc_t>
void finish_forward(const acc_t* m, const acc_t* sum, const acc_t* cnt, int64_t count,
                    const GemScalars<acc_t>& k, scalar_t* out, acc_t* stats) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  acc_t mean[w], s[w], value[w];
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V sumv = V::loadu(sum + l0, c), cntv = V::loadu(cnt + l0, c);
    // gem_mean: sum / count, 0 for the empty set (0 / 0 would be NaN).
    const V meanv = V::blendv(sumv / cntv, V(acc_t(0)), cntv == V(acc_t(0)));
    const V sv = meanv.pow(V(k.inv_p));
    meanv.store(mean);
    sv.store(s);
    for (int64_t l = 0; l < c; ++l) {
      value[l] = gem_from_power(m[l0 + l], mean[l], s[l], k.p);
      acc_t* st = stats + kGemStats * (l0 + l);
      st[0] = m[l0 + l];
      st[1] = mean[l];
      st[2] = cnt[l0 + l];
    }
    store_entries(V::loadu(value), out + l0, c);
  }
}

// -- inner == 1: contiguous rows --

// Flat blocks (AVX-512 float accumulation, no mask, n <= kFlatMaxN): a block
// of 16 rows is 16 n consecutive entries, n vectors; lane l of vector k holds
// entry 16 k + l, of row (16 k + l) / n. A table of those rows per lane lets
// every vector take its lanes' per-row constants with one permute each,
// whatever rows it spans, so the block is processed as full vectors without
// branches; the per-entry results go to a buffer in L1, summed per row after.
constexpr int64_t kFlatMaxN = 256;

#if defined(CPU_CAPABILITY_AVX512)
struct FlatRows {
  int64_t n;
  std::vector<int32_t> row_of;  // 16 per vector, n vectors

  explicit FlatRows(int64_t n_) : n(n_), row_of(16 * n_) {
    for (int64_t i = 0; i < 16 * n; ++i) row_of[i] = static_cast<int32_t>(i / n);
  }
  __m512i index(int64_t k) const { return _mm512_loadu_si512(row_of.data() + 16 * k); }
};

// A per-row constant (lane r: row r's) in each lane of vector k.
inline Vec<float> per_row(const FlatRows& f, int64_t k, const Vec<float>& rows) {
  return Vec<float>(_mm512_permutexvar_ps(f.index(k), rows));
}

// sum of each of `rows` rows of n values in buf, as the lanes of one vector.
inline Vec<float> row_sums(const float* buf, int64_t rows, int64_t n, float* acc) {
  using V = Vec<float>;
  for (int64_t r = 0; r < rows; ++r) {
    V s(0.0f);
    for (int64_t j = 0; j < n; j += 16) s = s + V::loadu(buf + r * n + j, std::min<int64_t>(16, n - j));
    s.store(acc + 16 * r);
  }
  return reduce_each(acc, rows, [](const V& a, const V& b) { return a + b; });
}

// Asks for vector k of the next block (null: none) while this one computes.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* next, int64_t k) {
  if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + 16 * k), _MM_HINT_T0);
}

// The block's entries as float: the input itself, or widened into `scratch`.
template <typename scalar_t>
inline const float* block_floats(const scalar_t* x, int64_t count, float* scratch) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    widen(x, scratch, count);
    return scratch;
  }
}

// A flat block of `rows` rows: each row's maximum clamped to eps, m[l] (its
// m unless the block holds NaN or inf: special[l], set for every row then),
// and for the rows on the fast path (fast[l]) its power sum, sum[l]. The
// maxima are plain (the special rows' m are the caller's).
template <typename scalar_t>
NANFREE_HOT_LOOP void flat_block_forward(const scalar_t* x, const scalar_t* next, int64_t rows,
                                         const FlatRows& f, const GemScalars<float>& k,
                                         float* scratch, float* buf, float* m, bool* special,
                                         bool* fast, float* sum) {
  using V = Vec<float>;
  const int64_t n = f.n, total = rows * n;
  const float* xs = block_floats(x, total, scratch);
  const V lowest(-std::numeric_limits<float>::infinity()), zero(0.0f), epsv(k.eps), pv(k.p);
  alignas(64) float row_max[16 * 16];
  V nan = zero;  // x - x summed over the block: NaN when an entry is NaN or infinite
  for (int64_t r = 0; r < rows; ++r) {
    V mx = lowest;
    for (int64_t j = 0; j < n; j += 16) {
      const int64_t count = std::min<int64_t>(16, n - j);
      const V v = V::loadu(xs + r * n + j, count);  // lanes past count read 0
      mx = plain_max(mx, count == 16 ? v : first_lanes(lowest, v, count));
      nan = nan + (v - v);
    }
    mx.store(row_max + 16 * r);
  }
  const V mv = plain_max(reduce_each(row_max, rows, [](const V& a, const V& b) { return plain_max(a, b); }),
                         epsv);  // clamp_to_eps of the maximum
  alignas(64) float base_m[16], base_e[16], base_l[16];
  mv.store(m, rows);
  // A block with NaN or inf: every row is the caller's (a plain maximum does not keep NaN).
  const bool special_block =
      at::vec::vec_reduce_all<float>([](V& a, V& b) { return a + b; }, nan) != 0.0f;
  bool any_fast = false;
  for (int64_t l = 0; l < 16; ++l) {
    if (l < rows) {
      special[l] = special_block;
      fast[l] = !special_block && fast_ratios(m[l], k);
      any_fast = any_fast || fast[l];
    }
    base_m[l] = l < rows && fast[l] ? m[l] : 1.0f;  // finite for every lane (the others are redone)
  }
  if (!any_fast) return;
  ratio_bases(base_m, 16, base_e, base_l);
  const V be = V::loadu(base_e), bl = V::loadu(base_l);
  const int64_t vectors = (total + 15) / 16;
  for (int64_t kv = 0; kv < vectors; ++kv) {
    prefetch_block(next, kv);
    const V c = at::vec::clamp_min(V::loadu(xs + 16 * kv, std::min<int64_t>(16, total - 16 * kv)), epsv);
    const RatioBase<float> base{per_row(f, kv, be), per_row(f, kv, bl)};
    ratio_power_vec(c, base, pv).store(buf + 16 * kv);
  }
  row_sums(buf, rows, n, row_max).store(sum, rows);
}
#endif

// A row's largest entry (NaN if a kept entry is NaN; -inf for none) and its
// number of kept entries (mask entry j at keep[j * ks]; none: all kept).
template <bool kMasked, typename scalar_t>
NANFREE_HOT_LOOP std::pair<at::opmath_type<scalar_t>, at::opmath_type<scalar_t>> row_max_count(
    const scalar_t* x, int64_t n, const bool* keep, int64_t ks) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V lowest(-std::numeric_limits<acc_t>::infinity());
  V mx = lowest, cnt(acc_t(0));
  for (int64_t j = 0; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    V v = load_vec(x + j, count);
    if constexpr (kMasked) {
      const V kv = keep_lanes<acc_t>(keep + j * ks, ks, count);
      v = V::blendv(lowest, v, kv);  // a masked entry, NaN included, is out of the max
      cnt = cnt + (kv & V(acc_t(1)));
    } else {
      v = first_lanes(lowest, v, count);
    }
    mx = at::vec::maximum(mx, v);  // propagates NaN
  }
  const acc_t largest =
      at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); }, mx);
  acc_t count = static_cast<acc_t>(n);
  if constexpr (kMasked) {
    count = at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return a + b; }, cnt);
  }
  return {largest, count};
}

// sum of r^p over a fast-path row's kept entries.
template <bool kMasked, typename scalar_t>
NANFREE_HOT_LOOP at::opmath_type<scalar_t> row_power_sum(
    const scalar_t* x, int64_t n, const bool* keep, int64_t ks, at::opmath_type<scalar_t> m,
    const GemScalars<at::opmath_type<scalar_t>>& k) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V pv(k.p), epsv(k.eps), zero(acc_t(0));
  acc_t be, bl;
  ratio_bases(&m, 1, &be, &bl);
  const RatioBase<acc_t> base{V(be), V(bl)};
  CompensatedSum<acc_t> s;
  for (int64_t j = 0; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    const V rp = ratio_power_vec(at::vec::clamp_min(load_vec(x + j, count), epsv), base, pv);
    if constexpr (kMasked) {
      s.add(V::blendv(zero, rp, keep_lanes<acc_t>(keep + j * ks, ks, count)));
    } else {
      s.add(first_lanes(zero, rp, count));
    }
  }
  return at::vec::vec_reduce_all<acc_t>([](V& a, V& b) { return a + b; }, s.sum);
}

// Whether rows_forward / rows_backward take flat blocks.
template <bool kMasked, typename acc_t>
bool flat_rows_apply(int64_t n) {
  return !kMasked && kMantissaLog2<acc_t> && n <= kFlatMaxN;
}

template <bool kMasked, typename scalar_t>
void rows_forward(const GemArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t B = Vec<acc_t>::size();  // rows per block
  const int64_t rows = args.shape.outer, n = args.shape.n;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const int64_t blocks = (rows + B - 1) / B;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n * B, 1));
  const bool flat = flat_rows_apply<kMasked, acc_t>(n);
#if defined(CPU_CAPABILITY_AVX512)
  const FlatRows table(flat ? n : 0);
#endif

  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    acc_t m[B], sum[B], cnt[B];
    bool special[B] = {}, fast[B] = {};
    const auto buf = scratch_row<float>(16 * n, flat);
    const auto scratch = scratch_row<float>(16 * n, flat && !std::is_same_v<scalar_t, float>);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * B, nr = std::min<int64_t>(B, rows - r0);
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (kMantissaLog2<acc_t>) {
        if (flat) {
          const scalar_t* next = b + 1 < b1 ? in + (r0 + B) * n : nullptr;
          flat_block_forward(in + r0 * n, next, nr, table, k, scratch.get(), buf.get(), m, special,
                             fast, sum);
        }
      }
#endif
      for (int64_t l = 0; l < nr; ++l) {
        const int64_t row = r0 + l;
        const scalar_t* x = in + row * n;
        const bool* keep = kMasked ? mask.data + mask_offset(mask, row, 0) : nullptr;
        const int64_t ks = mask.col_stride;
        if (flat) {
          cnt[l] = static_cast<acc_t>(n);
          if (fast[l]) continue;
          // A row with NaN or inf: its m from the NaN-propagating maximum.
          if (special[l]) m[l] = clamp_to_eps(row_max_count<false>(x, n, keep, ks).first, k.eps);
        } else {
          const auto [largest, count] = row_max_count<kMasked>(x, n, keep, ks);
          // The empty set's m is 0 (below every clamped entry); NaN stays NaN.
          m[l] = count == acc_t(0) ? acc_t(0) : clamp_to_eps(largest, k.eps);
          cnt[l] = count;
        }
        sum[l] = fast_ratios(m[l], k) ? row_power_sum<kMasked>(x, n, keep, ks, m[l], k)
                                      : power_sum_scalar(x, n, 1, keep, ks, m[l], k);
      }
      finish_forward(m, sum, cnt, nr, k, out + r0, stats + kGemStats * r0);
    }
  });
}

// -- inner > 1: lanes across the inner dimension --

// How a mask varies within a task: not at all (none), per row j only (stride
// 0 along inner: a row is kept or dropped for every lane), or per lane.
enum class MaskMode { None, Row, Lane };

// The lanes of a task: `count` reductions (o, i0 .. i0 + count - 1) in up to
// kGroupVectors vectors; vector v holds lanes [v w, v w + width(v)).
template <typename acc_t>
struct LaneGroup {
  static constexpr int64_t w = Vec<acc_t>::size();
  int64_t count;
  int64_t vectors() const { return (count + w - 1) / w; }
  int64_t width(int64_t v) const { return std::min<int64_t>(w, count - v * w); }
};

// Lanes per task: four vectors, so a task's n rows stay in L2 between the two
// forward passes for n up to about 1000 (float).
template <typename acc_t>
int64_t lanes_per_task(int64_t inner) {
  return std::min<int64_t>(inner, kGroupVectors * Vec<acc_t>::size());
}

// Rows a lanes task asks for ahead of use: each of its rows is a few cache
// lines inner * sizeof apart, a stride the hardware prefetchers follow badly.
constexpr int64_t kPrefetchRows = 8;

// Asks for row j + kPrefetchRows of a lanes task (`bytes` of it from x_row).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* x_row, int64_t bytes) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const char* p = reinterpret_cast<const char*>(x_row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#else
  (void)x_row, (void)bytes;
#endif
}

template <MaskMode kMode, typename scalar_t>
NANFREE_HOT_LOOP void lanes_forward_task(const scalar_t* x, const bool* keep, int64_t n,
                                         int64_t inner, const MaskView& ms,
                                         const LaneGroup<at::opmath_type<scalar_t>>& g,
                                         const GemScalars<at::opmath_type<scalar_t>>& k,
                                         at::opmath_type<scalar_t>* m_out,
                                         at::opmath_type<scalar_t>* sum_out,
                                         at::opmath_type<scalar_t>* cnt_out) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  constexpr int64_t G = kGroupVectors;
  const int64_t nv = g.vectors();
  const V lowest(-std::numeric_limits<acc_t>::infinity()), zero(acc_t(0)), one(acc_t(1));
  const V epsv(k.eps), pv(k.p);
  const auto lane_keep = [&](int64_t j, int64_t v) {
    return keep_lanes<acc_t>(keep + j * ms.col_stride + v * w * ms.strides[2], ms.strides[2], g.width(v));
  };

  // Pass 1: the maxima and counts.
  V mx[G], cnt[G];
  for (int64_t v = 0; v < G; ++v) mx[v] = lowest, cnt[v] = zero;
  int64_t rows_kept = 0;
  const int64_t row_bytes = g.count * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) prefetch_row(x + (j + kPrefetchRows) * inner, row_bytes);
    if constexpr (kMode == MaskMode::Row) {
      if (!keep[j * ms.col_stride]) continue;
      ++rows_kept;
    }
    const scalar_t* xj = x + j * inner;
    for (int64_t v = 0; v < nv; ++v) {
      V xv = load_vec(xj + v * w, g.width(v));
      if constexpr (kMode == MaskMode::Lane) {
        const V kv = lane_keep(j, v);
        xv = V::blendv(lowest, xv, kv);  // a masked entry, NaN included, is out of the max
        cnt[v] = cnt[v] + (kv & one);
      }
      mx[v] = at::vec::maximum(mx[v], xv);  // propagates NaN
    }
  }
  bool any_fast = false;
  acc_t base_m[G * w], base_e[G * w], base_l[G * w];
  for (int64_t v = 0; v < nv; ++v) {
    if constexpr (kMode == MaskMode::None) cnt[v] = V(static_cast<acc_t>(n));
    if constexpr (kMode == MaskMode::Row) cnt[v] = V(static_cast<acc_t>(rows_kept));
    // clamp_to_eps of the maximum (at::vec::maximum keeps NaN); 0 when empty.
    const V m = V::blendv(at::vec::maximum(mx[v], epsv), zero, cnt[v] == zero);
    m.store(m_out + v * w, g.width(v));
    cnt[v].store(cnt_out + v * w, g.width(v));
  }
  for (int64_t l = 0; l < g.count; ++l) {
    // The lanes off the fast path get the base of m = 1 here (their sums are
    // recomputed below), so that the vector pass stays finite.
    const bool fast = fast_ratios(m_out[l], k);
    base_m[l] = fast ? m_out[l] : acc_t(1);
    any_fast = any_fast || fast;
  }
  ratio_bases(base_m, g.count, base_e, base_l);
  RatioBase<acc_t> base[G];
  for (int64_t v = 0; v < nv; ++v) {
    base[v] = {V::loadu(base_e + v * w, g.width(v)), V::loadu(base_l + v * w, g.width(v))};
  }

  // Pass 2 (from cache): the power sums.
  CompensatedSum<acc_t> total[G];
  for (int64_t j = 0; any_fast && j < n; ++j) {
    if constexpr (kMode == MaskMode::Row) {
      if (!keep[j * ms.col_stride]) continue;
    }
    const scalar_t* xj = x + j * inner;
    for (int64_t v = 0; v < nv; ++v) {
      const V c = at::vec::clamp_min(load_vec(xj + v * w, g.width(v)), epsv);
      const V rp = ratio_power_vec(c, base[v], pv);
      if constexpr (kMode == MaskMode::Lane) {
        total[v].add(V::blendv(zero, rp, lane_keep(j, v)));
      } else {
        total[v].add(rp);
      }
    }
  }
  for (int64_t v = 0; v < nv; ++v) total[v].sum.store(sum_out + v * w, g.width(v));
  // Lanes off the fast path with something to sum: the scalar rules.
  for (int64_t l = 0; l < g.count; ++l) {
    if (fast_ratios(m_out[l], k) || cnt_out[l] == acc_t(0)) continue;
    sum_out[l] = power_sum_scalar(x + l, n, inner,
                                  kMode == MaskMode::None ? nullptr : keep + l * ms.strides[2], ms.col_stride,
                                  m_out[l], k);
  }
}

template <MaskMode kMode, typename scalar_t>
void lanes_forward(const GemArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k) {
  using acc_t = at::opmath_type<scalar_t>;
  const ReductionLayout s = args.shape;
  const int64_t width = lanes_per_task<acc_t>(s.inner);
  const int64_t per_outer = (s.inner + width - 1) / width;
  const int64_t tasks = s.outer * per_outer;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  scalar_t* out = args.output.mutable_data_ptr<scalar_t>();
  acc_t* stats = args.stats.mutable_data_ptr<acc_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(s.n * width, 1));

  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    constexpr int64_t kMax = kGroupVectors * Vec<acc_t>::size();
    acc_t m[kMax], sum[kMax], cnt[kMax];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / per_outer, i0 = (t % per_outer) * width;
      const LaneGroup<acc_t> g{std::min<int64_t>(width, s.inner - i0)};
      const bool* keep = kMode == MaskMode::None
                             ? nullptr
                             : mask.data + mask_offset(mask, o, i0);
      lanes_forward_task<kMode>(in + o * s.n * s.inner + i0, keep, s.n, s.inner, mask, g, k,
                                m, sum, cnt);
      const int64_t r0 = o * s.inner + i0;
      finish_forward(m, sum, cnt, g.count, k, out + r0, stats + kGemStats * r0);
    }
  });
}

template <typename scalar_t>
void gem_forward_kernel(const GemArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  const GemScalars<acc_t> k = gem_scalars<acc_t>(args.p, args.p_value, args.eps);
  if (args.shape.n == 0) {  // every reduction is empty: gem 0, stats (0, 0, 0)
    args.output.zero_();
    args.stats.zero_();
    return;
  }
  const bool masked = args.mask.defined();
  if (args.shape.inner == 1) {
    if (masked) {
      rows_forward<true, scalar_t>(args, k);
    } else {
      rows_forward<false, scalar_t>(args, k);
    }
  } else if (!masked) {
    lanes_forward<MaskMode::None, scalar_t>(args, k);
  } else if (args.mask.stride(2) == 0) {
    lanes_forward<MaskMode::Row, scalar_t>(args, k);
  } else {
    lanes_forward<MaskMode::Lane, scalar_t>(args, k);
  }
}

// ---- backward ---------------------------------------------------------------

// The per-reduction quantities of the backward, for up to kMax reductions,
// from their stats (m, mean, count) and incoming gradients.
template <typename acc_t>
struct ReductionGrads {
  static constexpr int64_t kMax = kGroupVectors * Vec<acc_t>::size();
  acc_t m[kMax], mean[kMax], cnt[kMax], g[kMax];
  acc_t a[kMax];             // the weight's factor mean^(1/p - 1) / n
  acc_t gem[kMax];           // gem_value (p_grad only)
  acc_t neg_log_mean[kMax];  // -log(mean) (p_grad only)
  acc_t t_scale[kMax];       // 1 / (m mean): e^s = r^(p-1) c / (m mean) (p_grad only)
  acc_t base_e[kMax], base_l[kMax];  // ratio_bases of m
  bool live[kMax];           // gem_has_gradient
  bool fast[kMax];           // the vector path
};

// Fills q for `count` reductions. With p_grad one vector pow gives both
// s = mean^(1/p) (gem = m s) and a = s / (mean n); without, a =
// mean^(1/p - 1) / n as the header forms it. Reductions off the vector path
// get the constants of m = 1 (their vector results are replaced), so that
// the vector pass stays finite.
template <typename scalar_t, typename acc_t>
void load_reduction_grads(const acc_t* stats, const scalar_t* grad, int64_t count, bool p_grad,
                          const GemScalars<acc_t>& k, ReductionGrads<acc_t>& q) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  for (int64_t l = 0; l < count; ++l) {
    const acc_t* st = stats + kGemStats * l;
    q.m[l] = st[0];
    q.mean[l] = st[1];
    q.cnt[l] = st[2];
    q.g[l] = static_cast<acc_t>(grad[l]);
  }
  acc_t s[w];
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V meanv = V::loadu(q.mean + l0, c), cntv = V::loadu(q.cnt + l0, c);
    if (p_grad) {
      const V sv = meanv.pow(V(k.inv_p));
      sv.store(s);
      (sv / (meanv * cntv)).store(q.a + l0, c);
      (V(acc_t(0)) - meanv.log()).store(q.neg_log_mean + l0, c);
      for (int64_t l = 0; l < c; ++l) {
        q.gem[l0 + l] = gem_from_power(q.m[l0 + l], q.mean[l0 + l], s[l], k.p);
      }
    } else {
      (meanv.pow(V(k.inv_p - acc_t(1))) / cntv).store(q.a + l0, c);
    }
  }
  acc_t base_m[kGroupVectors * w], flags[kGroupVectors * w];
  const V zero(acc_t(0)), one(acc_t(1)), tiny(nf_tiny<acc_t>());
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V mv = V::loadu(q.m + l0, c), cntv = V::loadu(q.cnt + l0, c);
    // gem_has_gradient (a NaN m passes), and fast: the weight's direct branch
    // of gem_input_grad_weight, a normal, and the ratios normal (fast_ratios,
    // false for NaN); then r^(p-1) <= max(1, (m / eps)^(1-p)) is finite and
    // a * r^(p-1) <= max(1, big * tiny / n) needs no bound.
    const V live = (cntv > zero) & (mv != V(std::numeric_limits<acc_t>::infinity()));
    V fast = live & (mv > zero) & (mv <= V(nf_largest<acc_t>())) & (V(k.eps) / mv >= tiny) &
             (V::loadu(q.a + l0, c) >= tiny);
    if (!k.vector_p) fast = zero;
    V::blendv(one, mv, fast).store(base_m + l0, c);
    ((live & one) + (fast & one)).store(flags + l0, c);
  }
  for (int64_t l = 0; l < count; ++l) {
    q.live[l] = flags[l] > acc_t(0);
    q.fast[l] = flags[l] > acc_t(1);
    // 1 / (m mean), rounded once (m and mean are normal on the fast path).
    if (p_grad) {
      q.t_scale[l] = q.fast[l] ? static_cast<acc_t>(1.0 / (static_cast<double>(q.m[l]) * q.mean[l]))
                               : acc_t(1);
    }
  }
  ratio_bases(base_m, count, q.base_e, q.base_l);
}

// One reduction by the scalar rules: its gradient entries (entry j at
// x[j * xs] and dx[j * xs]) and, with p_grad, the sum of its divergence terms.
template <typename scalar_t, typename acc_t>
acc_t backward_scalar(const scalar_t* x, scalar_t* dx, int64_t n, int64_t xs, const bool* keep,
                      int64_t ks, acc_t g, acc_t m, acc_t mean, acc_t cnt, bool p_grad,
                      const GemScalars<acc_t>& k, acc_t out_max) {
  const bool live = gem_has_gradient(m, cnt);
  const acc_t log_mean = live ? nf_log(mean) : acc_t(0);  // unused without gradient (mean 0)
  acc_t dsum = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (keep != nullptr && !keep[j * ks]) {
      dx[j * xs] = scalar_t(0);  // a masked entry gets 0, even NaN or inf
      continue;
    }
    const acc_t xv = static_cast<acc_t>(x[j * xs]);
    dx[j * xs] = static_cast<scalar_t>(
        saturate(gem_input_grad(g, xv, k.eps, m, mean, cnt, k.p), out_max));
    if (p_grad && live) dsum += gem_divergence_term(clamp_to_eps(xv, k.eps), m, log_mean, k.p);
  }
  return dsum;
}

// The vector path's per-reduction quantities, one reduction per lane.
template <typename acc_t>
struct EntryConsts {
  RatioBase<acc_t> base;  // of m
  Vec<acc_t> a, g, neg_log_mean, t_scale;
};

// Reduction l's quantities in every lane.
template <bool kPGrad, typename acc_t>
inline EntryConsts<acc_t> entry_consts(const ReductionGrads<acc_t>& q, int64_t l) {
  using V = Vec<acc_t>;
  EntryConsts<acc_t> e;
  e.base = {V(q.base_e[l]), V(q.base_l[l])};
  e.a = V(q.a[l]);
  e.g = V(q.g[l]);
  if constexpr (kPGrad) {
    e.neg_log_mean = V(q.neg_log_mean[l]);
    e.t_scale = V(q.t_scale[l]);
  }
  return e;
}

// Reductions l0 .. l0 + count - 1, one per lane.
template <bool kPGrad, typename acc_t>
inline EntryConsts<acc_t> entry_consts_lanes(const ReductionGrads<acc_t>& q, int64_t l0,
                                             int64_t count) {
  using V = Vec<acc_t>;
  EntryConsts<acc_t> e;
  e.base = {V::loadu(q.base_e + l0, count), V::loadu(q.base_l + l0, count)};
  e.a = V::loadu(q.a + l0, count);
  e.g = V::loadu(q.g + l0, count);
  if constexpr (kPGrad) {
    e.neg_log_mean = V::loadu(q.neg_log_mean + l0, count);
    e.t_scale = V::loadu(q.t_scale + l0, count);
  }
  return e;
}

// Constants of every entry.
template <typename acc_t>
struct BackwardScalars {
  Vec<acc_t> eps, p, out_max;
  // p - 1 as a sum hi + lo: in float, 0.1f - 1 loses 3e-8, which r^(p-1)
  // would raise to |log2 r| times that (and t = e^s below with it).
  Vec<acc_t> pm1_hi, pm1_lo;
  // p ln 2 as a sum hi + lo (lo: the rounding of hi), so that p log r is not
  // rounded twice: s is shared by every clamped entry of a reduction (c = eps),
  // where an error does not average out.
  Vec<acc_t> p_ln2_hi, p_ln2_lo;
};

// One vector of entries x of fast-path reductions: the gradient (0 for a
// clamped entry), and with kPGrad the divergence term h(s) of each lane
// (s = p log r - log(mean); t = e^s = r^p / mean).
template <bool kPGrad, typename acc_t>
[[gnu::always_inline]] inline Vec<acc_t> entry_grad(const Vec<acc_t>& x,
                                                    const EntryConsts<acc_t>& e,
                                                    const BackwardScalars<acc_t>& b,
                                                    Vec<acc_t>& h) {
  using V = Vec<acc_t>;
  const V zero(acc_t(0));
  const V c = at::vec::clamp_min(x, b.eps);
  const Log2Ratio<acc_t> lr = log2_ratio(c, e.base);
  const V rp1 = exp2_product(b.pm1_hi, b.pm1_lo, lr);  // r^(p-1)
  const V grad = e.g * (e.a * rp1);       // g * w, w = a * r^(p-1)
  if constexpr (kPGrad) {
    // s = p ln 2 (de + dl) - log(mean), with de + dl and p ln 2 unrounded.
    const V s = at::vec::fmadd(b.p_ln2_hi, lr.de,
                               at::vec::fmadd(b.p_ln2_hi, lr.dl,
                                              at::vec::fmadd(b.p_ln2_lo, lr.sum(), e.neg_log_mean)));
    h = divergence_h_vec(s, rp1 * (c * e.t_scale));  // t = r^(p-1) c / (m mean)
  }
  // gem_unclamped: x > eps (no NaN on the fast path); then saturate.
  return at::vec::clamp_max(at::vec::clamp_min(where_greater(x, b.eps, grad), zero - b.out_max),
                            b.out_max);
}

template <typename acc_t>
BackwardScalars<acc_t> backward_scalars(const GemScalars<acc_t>& k, acc_t out_max) {
  using V = Vec<acc_t>;
  // p ln 2 in double (exact to 2^-53 relative for a float p), then split.
  const double p_ln2 = static_cast<double>(k.p) * 0.6931471805599453094;
  const acc_t hi = static_cast<acc_t>(p_ln2);
  const acc_t lo = static_cast<acc_t>(p_ln2 - static_cast<double>(hi));
  const double pm1 = static_cast<double>(k.p) - 1.0;  // exact for a float p
  const acc_t pm1_hi = static_cast<acc_t>(pm1);
  const acc_t pm1_lo = static_cast<acc_t>(pm1 - static_cast<double>(pm1_hi));
  return {V(k.eps), V(k.p), V(out_max), V(pm1_hi), V(pm1_lo), V(hi), V(lo)};
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

// p's gradient terms of `count` reductions, gem_p_grad from their divergence
// sums (D = gem_mean(dsum, n)), each scaled by kGemPGradScale and summed in
// order in double, compensated (gem_p_grad_total's input).
template <typename acc_t>
double p_grad_sum(const ReductionGrads<acc_t>& q, const acc_t* dsum, int64_t count,
                  const GemScalars<acc_t>& k) {
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V zero(acc_t(0)), big(nf_largest<acc_t>()), pp(k.p * k.p);
  acc_t term[w];
  NeumaierSum dp;
  for (int64_t l0 = 0; l0 < count; l0 += w) {
    const int64_t c = std::min<int64_t>(w, count - l0);
    const V mv = V::loadu(q.m + l0, c), cntv = V::loadu(q.cnt + l0, c);
    const V live = (cntv > zero) & (mv != V(std::numeric_limits<acc_t>::infinity()));
    // D = dsum / n; a reduction without gradient (n may be 0) gives 0 below.
    const V d = V::loadu(dsum + l0, c) / cntv;
    // gem * (D / p^2) bounded before meeting g; clamp_min/max keep a NaN first operand.
    const V v = at::vec::clamp_max(at::vec::clamp_min(V::loadu(q.gem + l0, c) * (d / pp), zero - big), big);
    // g * v saturated as well (gem_p_grad), so that no term is inf; NaN stays.
    const V gv = at::vec::clamp_max(at::vec::clamp_min(V::loadu(q.g + l0, c) * v, zero - big), big);
    V::blendv(zero, gv, live).store(term);
    // Scaled terms: fewer than 2^64 of them cannot overflow the double sum.
    for (int64_t l = 0; l < c; ++l) dp.add(static_cast<double>(term[l]) * kGemPGradScale);
  }
  return dp.value();
}

// -- inner == 1 --

#if defined(CPU_CAPABILITY_AVX512)
// The gradients and divergence sums of a flat block's rows: right for the
// rows on the fast path, replaced by the caller for the others (whose
// constants are those of m = 1, finite).
template <bool kPGrad, typename scalar_t>
NANFREE_HOT_LOOP void flat_block_backward(const scalar_t* x, const scalar_t* next, scalar_t* dx,
                                          int64_t rows,
                                          const FlatRows& f, const ReductionGrads<float>& q,
                                          const BackwardScalars<float>& b, float* scratch,
                                          float* buf, float* dsum) {
  using V = Vec<float>;
  const int64_t n = f.n, total = rows * n;
  const float* xs = block_floats(x, total, scratch);
  const V be = V::loadu(q.base_e, rows), bl = V::loadu(q.base_l, rows);
  const V a = V::loadu(q.a, rows), g = V::loadu(q.g, rows);
  V nlm, t_scale;
  if constexpr (kPGrad) {
    nlm = V::loadu(q.neg_log_mean, rows);
    t_scale = V::loadu(q.t_scale, rows);
  }
  const int64_t vectors = (total + 15) / 16;
  for (int64_t kv = 0; kv < vectors; ++kv) {
    const int64_t count = std::min<int64_t>(16, total - 16 * kv);
    prefetch_block(next, kv);
    EntryConsts<float> e;
    e.base = {per_row(f, kv, be), per_row(f, kv, bl)};
    e.a = per_row(f, kv, a);
    e.g = per_row(f, kv, g);
    if constexpr (kPGrad) {
      e.neg_log_mean = per_row(f, kv, nlm);
      e.t_scale = per_row(f, kv, t_scale);
    }
    V h;
    store_entries(entry_grad<kPGrad>(V::loadu(xs + 16 * kv, count), e, b, h), dx + 16 * kv, count);
    if constexpr (kPGrad) h.store(buf + 16 * kv);
  }
  if constexpr (kPGrad) {
    alignas(64) float acc[16 * 16];
    row_sums(buf, rows, n, acc).store(dsum, rows);
  }
}
#endif

// A fast-path row's gradient and divergence sum.
template <bool kMasked, bool kPGrad, typename scalar_t>
NANFREE_HOT_LOOP at::opmath_type<scalar_t> row_backward(
    const scalar_t* x, scalar_t* dx, int64_t n, const bool* keep, int64_t ks,
    const EntryConsts<at::opmath_type<scalar_t>>& e,
    const BackwardScalars<at::opmath_type<scalar_t>>& b) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  const V zero(acc_t(0));
  CompensatedSum<acc_t> dsum;
  for (int64_t j = 0; j < n; j += w) {
    const int64_t count = std::min<int64_t>(w, n - j);
    V h;
    V grad = entry_grad<kPGrad>(load_vec(x + j, count), e, b, h);
    if constexpr (kMasked) {
      const V kv = keep_lanes<acc_t>(keep + j * ks, ks, count);
      grad = V::blendv(zero, grad, kv);  // a masked entry gets 0
      if constexpr (kPGrad) dsum.add(V::blendv(zero, h, kv));
    } else if constexpr (kPGrad) {
      dsum.add(first_lanes(zero, h, count));
    }
    store_entries(grad, dx + j, count);
  }
  if constexpr (!kPGrad) return acc_t(0);
  return at::vec::vec_reduce_all<acc_t>([](V& u, V& y) { return u + y; }, dsum.sum);
}

template <bool kMasked, bool kPGrad, typename scalar_t>
void rows_backward(const GemBackwardArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k,
                   double* partial) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t B = Vec<acc_t>::size();
  const int64_t rows = args.shape.outer, n = args.shape.n;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  const scalar_t* grad = args.grad.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const acc_t out_max = largest_finite<scalar_t>();
  const BackwardScalars<acc_t> bs = backward_scalars(k, out_max);
  const int64_t blocks = (rows + B - 1) / B;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n * B, 1));
  const bool flat = flat_rows_apply<kMasked, acc_t>(n);
#if defined(CPU_CAPABILITY_AVX512)
  const FlatRows table(flat ? n : 0);
#endif

  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    ReductionGrads<acc_t> q;
    acc_t dsum[B];
    const auto buf = scratch_row<float>(16 * n, flat && kPGrad);
    const auto scratch = scratch_row<float>(16 * n, flat && !std::is_same_v<scalar_t, float>);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * B, nr = std::min<int64_t>(B, rows - r0);
      load_reduction_grads(stats + kGemStats * r0, grad + r0, nr, kPGrad, k, q);
      bool any_fast = false;
      for (int64_t l = 0; l < nr; ++l) any_fast = any_fast || q.fast[l];
      const bool flat_block = flat && any_fast;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (kMantissaLog2<acc_t>) {
        if (flat_block) {
          const scalar_t* next = b + 1 < b1 ? in + (r0 + B) * n : nullptr;
          flat_block_backward<kPGrad>(in + r0 * n, next, dx_all + r0 * n, nr, table, q, bs,
                                      scratch.get(), buf.get(), dsum);
        }
      }
#endif
      for (int64_t l = 0; l < nr; ++l) {
        if (flat_block && q.fast[l]) continue;
        const int64_t row = r0 + l;
        const scalar_t* x = in + row * n;
        scalar_t* dx = dx_all + row * n;
        const bool* keep = kMasked ? mask.data + mask_offset(mask, row, 0) : nullptr;
        const int64_t ks = mask.col_stride;
        dsum[l] = 0;
        if (!q.live[l]) {  // no gradient: every entry 0, no divergence
          std::fill(dx, dx + n, scalar_t(0));
        } else if (q.fast[l]) {
          dsum[l] = row_backward<kMasked, kPGrad>(x, dx, n, keep, ks, entry_consts<kPGrad>(q, l), bs);
        } else {
          dsum[l] = backward_scalar(x, dx, n, 1, keep, ks, q.g[l], q.m[l], q.mean[l], q.cnt[l],
                                    kPGrad, k, out_max);
        }
      }
      if constexpr (kPGrad) partial[b] = p_grad_sum(q, dsum, nr, k);
    }
  });
}

// -- inner > 1 --

template <MaskMode kMode, bool kPGrad, typename scalar_t>
NANFREE_HOT_LOOP void lanes_backward_task(const scalar_t* x, scalar_t* dx, const bool* keep,
                                          int64_t n, int64_t inner, const MaskView& ms,
                                          const LaneGroup<at::opmath_type<scalar_t>>& g,
                                          const GemScalars<at::opmath_type<scalar_t>>& k,
                                          const ReductionGrads<at::opmath_type<scalar_t>>& q,
                                          const BackwardScalars<at::opmath_type<scalar_t>>& bs,
                                          at::opmath_type<scalar_t> out_max, bool stream,
                                          at::opmath_type<scalar_t>* dsum_out) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t w = V::size();
  constexpr int64_t G = kGroupVectors;
  const int64_t nv = g.vectors();
  const V zero(acc_t(0));
  const V all = zero == zero;
  const auto lane_keep = [&](int64_t j, int64_t v) {
    return keep_lanes<acc_t>(keep + j * ms.col_stride + v * w * ms.strides[2], ms.strides[2], g.width(v));
  };
  const int64_t row_bytes = g.count * static_cast<int64_t>(sizeof(scalar_t));
  EntryConsts<acc_t> e[G];
  V live[G];
  CompensatedSum<acc_t> total[G];
  bool any_fast = false;
  for (int64_t v = 0; v < nv; ++v) {
    const int64_t c = g.width(v), l0 = v * w;
    e[v] = entry_consts_lanes<kPGrad>(q, l0, c);
    acc_t lv[w];
    for (int64_t l = 0; l < w; ++l) {
      lv[l] = l < c && q.live[l0 + l] ? acc_t(1) : acc_t(0);
      any_fast = any_fast || (l < c && q.fast[l0 + l]);
    }
    live[v] = V::loadu(lv) != zero;
  }
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) prefetch_row(x + (j + kPrefetchRows) * inner, row_bytes);
    const scalar_t* xj = x + j * inner;
    scalar_t* dxj = dx + j * inner;
    bool row_kept = true;
    if constexpr (kMode == MaskMode::Row) row_kept = keep[j * ms.col_stride];
    if (!row_kept || !any_fast) {  // a masked row, or no lane of the vector path: 0 here
      for (int64_t v = 0; v < nv; ++v) put_entries(zero, dxj + v * w, g.width(v), stream);
      continue;
    }
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t c = g.width(v);
      V keep_v = c == w ? all : first_lanes(zero, all, c);
      if constexpr (kMode == MaskMode::Lane) keep_v = lane_keep(j, v);
      V h;
      const V grad = entry_grad<kPGrad>(load_vec(xj + v * w, c), e[v], bs, h);
      if constexpr (kPGrad) total[v].add(V::blendv(zero, h, keep_v));
      // Lanes without gradient, and masked entries, get 0.
      put_entries(V::blendv(zero, grad, keep_v & live[v]), dxj + v * w, c, stream);
    }
  }
  for (int64_t v = 0; v < nv; ++v) total[v].sum.store(dsum_out + v * w, g.width(v));
  // Lanes with gradient off the fast path: the scalar rules, over what the
  // vector pass wrote.
  for (int64_t l = 0; l < g.count; ++l) {
    if (!q.live[l] || q.fast[l]) continue;
    dsum_out[l] = backward_scalar(x + l, dx + l, n, inner,
                                  kMode == MaskMode::None ? nullptr : keep + l * ms.strides[2], ms.col_stride,
                                  q.g[l], q.m[l], q.mean[l], q.cnt[l], kPGrad, k, out_max);
  }
}

template <MaskMode kMode, bool kPGrad, typename scalar_t>
void lanes_backward(const GemBackwardArgs& args, const GemScalars<at::opmath_type<scalar_t>>& k,
                    double* partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const ReductionLayout s = args.shape;
  const int64_t width = lanes_per_task<acc_t>(s.inner);
  const int64_t per_outer = (s.inner + width - 1) / width;
  const int64_t tasks = s.outer * per_outer;
  const scalar_t* in = args.input.const_data_ptr<scalar_t>();
  const scalar_t* grad = args.grad.const_data_ptr<scalar_t>();
  const acc_t* stats = args.stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = args.grad_input.mutable_data_ptr<scalar_t>();
  const MaskView mask = layout_mask_view(args.mask);
  const acc_t out_max = largest_finite<scalar_t>();
  const BackwardScalars<acc_t> bs = backward_scalars(k, out_max);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(s.n * width, 1));
  // Streaming stores when the gradient is larger than the cache and every
  // task's row of vectors starts on a whole vector's stored size.
  const bool stream = stream_rows<scalar_t>(args.grad_input, s.inner) && width % Vec<acc_t>::size() == 0;

  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    ReductionGrads<acc_t> q;
    acc_t dsum[ReductionGrads<acc_t>::kMax];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / per_outer, i0 = (t % per_outer) * width;
      const LaneGroup<acc_t> g{std::min<int64_t>(width, s.inner - i0)};
      const int64_t r0 = o * s.inner + i0;
      load_reduction_grads(stats + kGemStats * r0, grad + r0, g.count, kPGrad, k, q);
      const bool* keep = kMode == MaskMode::None
                             ? nullptr
                             : mask.data + mask_offset(mask, o, i0);
      const int64_t offset = o * s.n * s.inner + i0;
      lanes_backward_task<kMode, kPGrad>(in + offset, dx_all + offset, keep, s.n, s.inner,
                                         mask, g, k, q, bs, out_max, stream, dsum);
      if constexpr (kPGrad) partial[t] = p_grad_sum(q, dsum, g.count, k);
    }
    end_streaming(stream);
  });
}

template <bool kPGrad, typename scalar_t>
void gem_backward_dispatch(const GemBackwardArgs& args,
                           const GemScalars<at::opmath_type<scalar_t>>& k,
                           std::vector<double>& partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const ReductionLayout s = args.shape;
  const bool masked = args.mask.defined();
  if (s.inner == 1) {
    partial.assign((s.outer + Vec<acc_t>::size() - 1) / Vec<acc_t>::size(), 0.0);
    if (masked) {
      rows_backward<true, kPGrad, scalar_t>(args, k, partial.data());
    } else {
      rows_backward<false, kPGrad, scalar_t>(args, k, partial.data());
    }
    return;
  }
  const int64_t width = lanes_per_task<acc_t>(s.inner);
  partial.assign(s.outer * ((s.inner + width - 1) / width), 0.0);
  if (!masked) {
    lanes_backward<MaskMode::None, kPGrad, scalar_t>(args, k, partial.data());
  } else if (args.mask.stride(2) == 0) {
    lanes_backward<MaskMode::Row, kPGrad, scalar_t>(args, k, partial.data());
  } else {
    lanes_backward<MaskMode::Lane, kPGrad, scalar_t>(args, k, partial.data());
  }
}

template <typename scalar_t>
void gem_backward_kernel(GemBackwardArgs& args) {
  using acc_t = at::opmath_type<scalar_t>;
  const GemScalars<acc_t> k = gem_scalars<acc_t>(args.p, args.p_value, args.eps);
  std::vector<double> partial;
  if (args.shape.n > 0) {
    if (args.p_grad) {
      gem_backward_dispatch<true, scalar_t>(args, k, partial);
    } else {
      gem_backward_dispatch<false, scalar_t>(args, k, partial);
    }
  }
  if (args.p_grad) {
    // Per-block partials (scaled sums) in block order: the same sum for any
    // thread count; gem_p_grad_total clamps it to the accumulation type's
    // range and scales it back.
    NeumaierSum dp;
    for (const double v : partial) dp.add(v);
    args.grad_p.fill_(gem_p_grad_total<acc_t>(dp.value()));
  }
}

std::tuple<at::Tensor, at::Tensor> gem(const at::Tensor& input, const std::optional<at::Tensor>& p,
                                       double p_value, double eps,
                                       const std::optional<at::Tensor>& mask) {
  const GemArgs args = prepare_gem(input, p, p_value, eps, mask);
  if (args.output.numel() == 0) return {args.output, args.stats};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(), "nanfree_gem",
                                  [&] { gem_forward_kernel<scalar_t>(args); });
  return {args.output, args.stats};
}

std::tuple<at::Tensor, at::Tensor> gem_backward(const at::Tensor& grad, const at::Tensor& input,
                                                const std::optional<at::Tensor>& p, double p_value,
                                                const at::Tensor& stats, double eps,
                                                const std::optional<at::Tensor>& mask, bool p_grad) {
  GemBackwardArgs args = prepare_gem_backward(grad, input, p, p_value, stats, eps, mask, p_grad);
  prefer_huge_pages(args.grad_input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, args.input.scalar_type(),
                                  "nanfree_gem_backward", [&] { gem_backward_kernel<scalar_t>(args); });
  return {args.grad_input, args.grad_p};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("gem", &gem);
  m.impl("gem_backward", &gem_backward);
}

}  // namespace nanfree
