// Shared numerics of nanfree: plain C++ compiled by both g++ and nvcc.
// No torch header may be included here. The Triton kernels in nanfree/_triton
// mirror these functions under the same names.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define NF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NF_HOST_DEVICE inline
#endif

namespace nanfree {

template <typename T>
NF_HOST_DEVICE T nf_inf() {
  return std::numeric_limits<T>::infinity();
}

NF_HOST_DEVICE float nf_exp(float x) { return ::expf(x); }
NF_HOST_DEVICE double nf_exp(double x) { return ::exp(x); }
NF_HOST_DEVICE float nf_log(float x) { return ::logf(x); }
NF_HOST_DEVICE double nf_log(double x) { return ::log(x); }
NF_HOST_DEVICE float nf_log1p(float x) { return ::log1pf(x); }
NF_HOST_DEVICE double nf_log1p(double x) { return ::log1p(x); }
NF_HOST_DEVICE float nf_abs(float x) { return ::fabsf(x); }
NF_HOST_DEVICE double nf_abs(double x) { return ::fabs(x); }

// a where cond, else b: a select on scalars. The headers whose functions are
// also instantiated with CPU vectors (elementwise, losses) select through it;
// csrc/cpu/vec_math.h gives the lane blend of vectors.
template <typename T>
NF_HOST_DEVICE T nf_where(bool cond, T a, T b) {
  return cond ? a : b;
}
// Whether neither a nor b is NaN; 0 where cond, else x. For the templates that
// the CPU kernels also instantiate with ATen vectors (there, csrc/cpu/vec_math.h:
// one ordered compare instead of two; an and-not of the lane mask instead of a
// blend).
template <typename T>
NF_HOST_DEVICE bool nf_ordered(T a, T b) {
  return (a == a) && (b == b);
}
template <typename T>
NF_HOST_DEVICE T nf_zero_where(bool cond, T x) {
  return cond ? T(0) : x;
}
// Whether x is NaN or +-inf (a vector: whether any lane is; csrc/cpu/vec_math.h),
// for a test that spares the finite case a rule's compares.
template <typename T>
NF_HOST_DEVICE bool nf_any_non_finite(T x) {
  return (x - x) != (x - x);
}
NF_HOST_DEVICE float nf_pow(float x, float y) { return ::powf(x, y); }
NF_HOST_DEVICE double nf_pow(double x, double y) { return ::pow(x, y); }
NF_HOST_DEVICE float nf_sqrt(float x) { return ::sqrtf(x); }
NF_HOST_DEVICE double nf_sqrt(double x) { return ::sqrt(x); }
NF_HOST_DEVICE int nf_ilogb(float x) { return ::ilogbf(x); }
NF_HOST_DEVICE int nf_ilogb(double x) { return ::ilogb(x); }
NF_HOST_DEVICE float nf_ldexp(float x, int e) { return ::ldexpf(x, e); }
NF_HOST_DEVICE double nf_ldexp(double x, int e) { return ::ldexp(x, e); }

// The smallest positive normal and the largest finite value of T.
template <typename T>
NF_HOST_DEVICE T nf_tiny() {
  return std::numeric_limits<T>::min();
}
template <typename T>
NF_HOST_DEVICE T nf_largest() {
  return std::numeric_limits<T>::max();
}

// The largest finite values of the half storage types (in their accumulation
// type, float): the bounds of a saturated float16 or bfloat16 output.
constexpr double kFloat16Largest = 65504.0;
constexpr double kBFloat16Largest = 3.3895313892515355e38;  // 0x7f7f

// Exponent range of the normal numbers of T: 2^e is normal for e in [min, max].
template <typename T>
NF_HOST_DEVICE int min_normal_exponent() {
  return std::numeric_limits<T>::min_exponent - 1;  // -126 for float, -1022 for double
}
template <typename T>
NF_HOST_DEVICE int max_normal_exponent() {
  return std::numeric_limits<T>::max_exponent - 1;  // 127, 1023
}

// x on its way to a type whose largest finite value is `bound`: beyond it,
// +-bound (a gradient must stay finite: an inf would meet a 0 downstream and
// make NaN, and a gradient scaler would skip the step). NaN stays NaN.
template <typename T>
NF_HOST_DEVICE T saturate(T x, T bound) {
  return x > bound ? bound : (x < -bound ? -bound : x);
}

// saturate for the templates that the CPU kernels also instantiate with ATen
// vectors (there: csrc/cpu/vec_math.h's overload, two min/max instructions
// that keep NaN).
template <typename T>
NF_HOST_DEVICE T nf_saturate(T x, T bound) {
  return saturate(x, bound);
}

// x below lo raised to lo; NaN stays NaN: a domain's clamp. For the templates
// that the CPU kernels also instantiate with ATen vectors (there:
// csrc/cpu/vec_math.h's overload, one max instruction, where ATen's compare and
// blend of lane masks made the AVX-512 loops after them up to 2x slower:
// docs/elementwise.md).
template <typename T>
NF_HOST_DEVICE T nf_clamp_min(T x, T lo) {
  return x < lo ? lo : x;
}
// x above hi lowered to hi; NaN stays NaN (nf_clamp_min's mirror; vectors: one min).
template <typename T>
NF_HOST_DEVICE T nf_clamp_max(T x, T hi) {
  return x > hi ? hi : x;
}

// The eps the accumulation type works with: one below its smallest normal
// (even one the caller passes, say 1e-45 in float) is raised to it, so 1/eps,
// log(eps) and m / eps stay finite.
template <typename T>
NF_HOST_DEVICE T effective_eps(T eps) {
  return eps < nf_tiny<T>() ? nf_tiny<T>() : eps;
}

template <typename T>
NF_HOST_DEVICE bool nf_isnan(T x) {
  return x != x;
}

template <typename T>
NF_HOST_DEVICE bool nf_isinf(T x) {
  return x == nf_inf<T>() || x == -nf_inf<T>();
}

template <typename T>
NF_HOST_DEVICE bool nf_isfinite(T x) {
  return !nf_isnan(x) && !nf_isinf(x);
}

// A row sum of upstream gradients g_j (log_softmax's sum of g, normalize's
// dot of g and y), also taken at the scale 2^-kGradSumShift. The plain sum
// overflows when g is near the largest value while the gradient formed from
// it need not; the scaled sum holds 2^64 entries of the largest value. A
// backend takes `scaled` only where `plain` is not finite (in the same pass
// or in a second one); where both are fine the plain one keeps full precision
// for small g (at the scale, g below 2^-62 in float would round).
constexpr int kGradSumShift = 64;

template <typename T>
NF_HOST_DEVICE T grad_sum_scale() {
  return nf_ldexp(T(1), -kGradSumShift);  // 2^-64, exact in float and double
}

template <typename T>
NF_HOST_DEVICE T grad_sum_unscale() {
  return nf_ldexp(T(1), kGradSumShift);
}

template <typename T>
struct GradSum {
  T plain;
  T scaled;  // the sum of the terms times grad_sum_scale(); read only where plain is not finite
};

// Whether the plain sum overflowed (to +-inf, or to NaN once partial sums of
// both signs overflowed) while the scaled one holds the row's sum. A NaN or
// infinite g makes both non-finite: the plain rule then passes it on.
template <typename T>
NF_HOST_DEVICE bool grad_sum_overflowed(GradSum<T> sum) {
  return !nf_isfinite(sum.plain) && nf_isfinite(sum.scaled);
}

// exp(a - b) for a <= b. Equal arguments give exactly 1, which is also the
// limit when both are +inf: a - b would be inf - inf = NaN there.
template <typename T>
NF_HOST_DEVICE T lse_scale(T a, T b) {
  return a == b ? T(1) : nf_exp(a - b);
}

// Online logsumexp state of a set of values: `max` is the largest value seen
// (-inf for the empty set) and `sum` is sum(exp(v - max)). When max is +inf,
// `sum` counts the +inf entries. A NaN value makes `sum` NaN; `max` is never NaN.
template <typename T>
struct LseState {
  T max;
  T sum;
};

template <typename T>
NF_HOST_DEVICE LseState<T> lse_empty() {
  return LseState<T>{-nf_inf<T>(), T(0)};
}

// Adds one value to the state.
template <typename T>
NF_HOST_DEVICE void lse_update(LseState<T>& state, T x) {
  // -inf adds exp(-inf) = 0; comparing it with an empty state's max would
  // otherwise count it as an equal (maximal) element.
  if (x == -nf_inf<T>()) return;
  if (x > state.max) {
    state.sum = state.sum * lse_scale(state.max, x) + T(1);
    state.max = x;
  } else {
    // A NaN x lands here (every comparison is false) and makes sum NaN.
    state.sum += lse_scale(x, state.max);
  }
}

// Combines the states of two disjoint sets.
template <typename T>
NF_HOST_DEVICE LseState<T> lse_merge(LseState<T> a, LseState<T> b) {
  const T m = a.max > b.max ? a.max : b.max;
  // lse_scale keeps equal maxima (both -inf when both sets are empty, or both
  // +inf) at a factor 1 instead of exp(NaN).
  return LseState<T>{m, a.sum * lse_scale(a.max, m) + b.sum * lse_scale(b.max, m)};
}

// log(sum(exp(v))): -inf for the empty set (max + log 0), +inf when a value
// is +inf, NaN when a value is NaN.
template <typename T>
NF_HOST_DEVICE T lse_value(LseState<T> state) {
  return state.max + nf_log(state.sum);
}

}  // namespace nanfree
