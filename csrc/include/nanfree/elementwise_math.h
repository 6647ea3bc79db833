// Elementwise ops with finite gradients: the rules of DESIGN.md section 2
// ("Elementwise ops with finite gradients"), shared by the CPU and CUDA kernels
// and mirrored by name in nanfree/_triton/elementwise.py and
// nanfree/_torch_backend/elementwise.py. docs/elementwise.md has the table.
//
// Each unary op f has three functions of x: its value (<op>_value: the C
// library's function of <op>_domain(x), the point of the domain it is taken
// at), its derivative (<op>_derivative) and its second derivative
// (<op>_second_derivative), each already under the rules:
// - outside the real domain the op is the op of the nearest point of the
//   domain (clamp, then the op), and both derivatives are 0 there (rule 2);
// - where the derivative is infinite at a point of the domain (sqrt at 0, log
//   at 0, log1p at -1, acos and asin at +-1) both derivatives are 0 (rule 3);
// - NaN in gives NaN in value and derivatives (rule 7): every domain test is
//   written so that NaN fails it (x <= 0 is false for NaN) and reaches the
//   formula, which passes it on.
// A gradient is then chain_rule(g, derivative) (rule 5: saturated to the
// output dtype's range).
//
// The functions are templates written with operators, comparisons, `&`, `|`
// and the nf_* primitives only, so the CPU kernels instantiate them with
// ATen's vector types as well as with float and double (csrc/cpu/
// elementwise.cpp declares the vector primitives before including this
// header; a comparison of vectors is a lane mask there, and nf_where blends).
#pragma once

#include "nanfree/numerics.h"

namespace nanfree {

NF_HOST_DEVICE float nf_acos(float x) { return ::acosf(x); }
NF_HOST_DEVICE double nf_acos(double x) { return ::acos(x); }
NF_HOST_DEVICE float nf_asin(float x) { return ::asinf(x); }
NF_HOST_DEVICE double nf_asin(double x) { return ::asin(x); }

// The unary ops, in the order of the op table of csrc/common/elementwise_op.h.
enum class UnaryOp : int { kSqrt = 0, kLog = 1, kLog1p = 2, kAcos = 3, kAsin = 4 };

// --- sqrt: domain [0, inf) ---------------------------------------------------

// The point of the domain the op is evaluated at (rule 2: the nearest one).
template <typename T>
NF_HOST_DEVICE T sqrt_domain(T x) {
  return nf_clamp_min(x, T(0));  // below the domain: sqrt(0) (rule 2)
}

template <typename T>
NF_HOST_DEVICE T sqrt_value(T x) {
  return nf_sqrt(sqrt_domain(x));
}

template <typename T>
NF_HOST_DEVICE T sqrt_derivative(T x) {
  // x < 0: outside the domain (rule 2); x == 0: 1 / (2 sqrt(0)) is infinite (rule 3).
  return nf_where(x <= T(0), T(0), T(0.5) / nf_sqrt(x));
}

template <typename T>
NF_HOST_DEVICE T sqrt_second_derivative(T x) {
  // -1 / (4 x sqrt(x)); 0 where the derivative is (rules 2 and 3).
  return nf_where(x <= T(0), T(0), T(-0.25) / (x * nf_sqrt(x)));
}

// --- log: domain [0, inf), log(0) = -inf ---------------------------------------

template <typename T>
NF_HOST_DEVICE T log_domain(T x) {
  return nf_clamp_min(x, T(0));  // below the domain: log(0) = -inf (rule 2)
}

template <typename T>
NF_HOST_DEVICE T log_value(T x) {
  return nf_log(log_domain(x));
}

template <typename T>
NF_HOST_DEVICE T log_derivative(T x) {
  // x < 0: outside the domain; x == 0: 1/x is infinite (rules 2 and 3).
  return nf_where(x <= T(0), T(0), T(1) / x);
}

template <typename T>
NF_HOST_DEVICE T log_second_derivative(T x) {
  return nf_where(x <= T(0), T(0), T(-1) / (x * x));  // 0 where the derivative is
}

// --- log1p: domain [-1, inf) ------------------------------------------------------

template <typename T>
NF_HOST_DEVICE T log1p_domain(T x) {
  return nf_clamp_min(x, T(-1));  // below the domain: log1p(-1) = -inf (rule 2)
}

template <typename T>
NF_HOST_DEVICE T log1p_value(T x) {
  return nf_log1p(log1p_domain(x));
}

template <typename T>
NF_HOST_DEVICE T log1p_derivative(T x) {
  // x < -1: outside the domain; x == -1: 1 / (1 + x) is infinite (rules 2 and 3).
  return nf_where(x <= T(-1), T(0), T(1) / (x + T(1)));
}

template <typename T>
NF_HOST_DEVICE T log1p_second_derivative(T x) {
  const T u = x + T(1);
  return nf_where(x <= T(-1), T(0), T(-1) / (u * u));  // 0 where the derivative is
}

// --- acos and asin: domain [-1, 1] ------------------------------------------------

// x clamped to [-1, 1]; NaN stays NaN (nf_clamp_min and nf_clamp_max keep it).
template <typename T>
NF_HOST_DEVICE T unit_clamp(T x) {
  return nf_clamp_max(nf_clamp_min(x, T(-1)), T(1));
}

// 1 / sqrt(1 - x^2) inside (-1, 1), with 1 - x^2 as (1 - x)(1 + x): near +-1
// the difference 1 -+ x is exact, where 1 - x * x (torch's acos/asin backward)
// cancels to the rounding of x * x (x = 1 - 2^-8 in float: the second
// derivative off by 2.8 units of 1e-6).
template <typename T>
NF_HOST_DEVICE T unit_rsqrt(T x) {
  return T(1) / nf_sqrt((T(1) - x) * (T(1) + x));
}

template <typename T>
NF_HOST_DEVICE T acos_domain(T x) {
  return unit_clamp(x);  // beyond +-1 (infinities included): acos of +-1 (rule 2)
}

template <typename T>
NF_HOST_DEVICE T acos_value(T x) {
  return nf_acos(acos_domain(x));
}

template <typename T>
NF_HOST_DEVICE T acos_derivative(T x) {
  // |x| > 1: outside the domain; |x| == 1: -1 / sqrt(0) is infinite (rules 2 and 3).
  return nf_where(nf_abs(x) >= T(1), T(0), -unit_rsqrt(x));
}

template <typename T>
NF_HOST_DEVICE T acos_second_derivative(T x) {
  // -x / (1 - x^2)^(3/2); 0 where the derivative is.
  const T r = unit_rsqrt(nf_where(nf_abs(x) >= T(1), T(0), x));
  return nf_where(nf_abs(x) >= T(1), T(0), -x * r * r * r);
}

template <typename T>
NF_HOST_DEVICE T asin_domain(T x) {
  return unit_clamp(x);  // beyond +-1: asin of +-1 (rule 2)
}

template <typename T>
NF_HOST_DEVICE T asin_value(T x) {
  return nf_asin(asin_domain(x));
}

template <typename T>
NF_HOST_DEVICE T asin_derivative(T x) {
  return nf_where(nf_abs(x) >= T(1), T(0), unit_rsqrt(x));  // as acos's (rules 2 and 3)
}

template <typename T>
NF_HOST_DEVICE T asin_second_derivative(T x) {
  // x / (1 - x^2)^(3/2); 0 where the derivative is.
  const T r = unit_rsqrt(nf_where(nf_abs(x) >= T(1), T(0), x));
  return nf_where(nf_abs(x) >= T(1), T(0), x * r * r * r);
}

// --- dispatch by op and order -------------------------------------------------

// The op's domain clamp: its value is the C library function of this point.
template <UnaryOp op, typename T>
NF_HOST_DEVICE T unary_domain(T x) {
  if constexpr (op == UnaryOp::kSqrt) return sqrt_domain(x);
  else if constexpr (op == UnaryOp::kLog) return log_domain(x);
  else if constexpr (op == UnaryOp::kLog1p) return log1p_domain(x);
  else if constexpr (op == UnaryOp::kAcos) return acos_domain(x);
  else return asin_domain(x);
}

// The op's value (order 0), derivative (1) or second derivative (2) at x.
template <UnaryOp op, int order, typename T>
NF_HOST_DEVICE T unary_function(T x) {
  static_assert(order >= 0 && order <= 2, "orders 0, 1 and 2");
  if constexpr (op == UnaryOp::kSqrt) {
    if constexpr (order == 0) return sqrt_value(x);
    else if constexpr (order == 1) return sqrt_derivative(x);
    else return sqrt_second_derivative(x);
  } else if constexpr (op == UnaryOp::kLog) {
    if constexpr (order == 0) return log_value(x);
    else if constexpr (order == 1) return log_derivative(x);
    else return log_second_derivative(x);
  } else if constexpr (op == UnaryOp::kLog1p) {
    if constexpr (order == 0) return log1p_value(x);
    else if constexpr (order == 1) return log1p_derivative(x);
    else return log1p_second_derivative(x);
  } else if constexpr (op == UnaryOp::kAcos) {
    if constexpr (order == 0) return acos_value(x);
    else if constexpr (order == 1) return acos_derivative(x);
    else return acos_second_derivative(x);
  } else {
    if constexpr (order == 0) return asin_value(x);
    else if constexpr (order == 1) return asin_derivative(x);
    else return asin_second_derivative(x);
  }
}

// --- the chain rule -------------------------------------------------------------

// g * d, an upstream gradient times a derivative, into a dtype whose largest
// finite value is `bound`:
// - 0 where d is 0 (a derivative the rules count 0 stays 0 against an infinite
//   g, where inf * 0 would be NaN) or g is 0 (a zero upstream against an
//   infinite d, a second derivative beyond the type's range), both not NaN;
// - else g * d saturated to +-bound (rule 5: 1/x at x = 1e-45 is beyond float);
// - NaN g or d gives NaN (rule 7).
template <typename T>
NF_HOST_DEVICE T chain_rule(T g, T d, T bound) {
  const T masked = nf_where(((d == T(0)) | (g == T(0))) & (d == d) & (g == g), T(0), g * d);
  // beyond the range (an infinite d or g): +-bound; NaN stays.
  return nf_saturate(masked, bound);
}

// log's gradient: chain_rule(g, log_derivative(x), bound) with g * (1 / x)
// computed as g / x (one rounding and one division, as torch's log backward):
// 0 where the derivative is 0 (x <= 0: outside the domain or at 0, rules 2
// and 3; x beyond `bound`, the largest finite value of x's dtype, is +inf,
// where 1/x is 0) unless g is NaN, else g / x saturated to +-bound (rule 5);
// NaN g or x gives NaN (rule 7).
template <typename T>
NF_HOST_DEVICE T log_gradient(T g, T x, T bound) {
  // A zero derivative keeps a zero gradient against an infinite g (inf / inf is NaN).
  const T q = nf_where(((x <= T(0)) | (x > bound)) & (g == g), T(0), g / x);
  return nf_saturate(q, bound);  // beyond the range: +-bound; NaN stays
}

// One element of <op> (order 0: the value at x; g is not read) or of
// <op>_backward (order 1 or 2: the chain rule of g and that derivative;
// log's first order by log_gradient). `bound` is the largest finite value of
// x's dtype.
template <UnaryOp op, int order, typename T>
NF_HOST_DEVICE T unary_element(T g, T x, T bound) {
  if constexpr (order == 0) {
    return unary_function<op, 0>(x);
  } else if constexpr (op == UnaryOp::kLog && order == 1) {
    return log_gradient(g, x, bound);
  } else {
    return chain_rule(g, unary_function<op, order>(x), bound);
  }
}

}  // namespace nanfree
