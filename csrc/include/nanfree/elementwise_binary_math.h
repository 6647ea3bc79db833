// Elementwise ops of two inputs with finite gradients: pow, atan2,
// div_no_nan, xlogy and xlog1py under the rules of DESIGN.md section 2
// ("Elementwise ops with finite gradients"), shared by the CPU and CUDA
// kernels and mirrored by name in nanfree/_triton/elementwise.py and
// nanfree/_torch_backend/elementwise.py. docs/elementwise.md has the tables.
//
// Each op f(a, b) (a is torch's `input`, b its `other` or `exponent`) has its
// value (<op>_value), its partial derivatives <op>_da and <op>_db, and the
// second ones <op>_daa, <op>_dab and <op>_dbb, each already under the rules
// (outside the domain: the op of the nearest point of it, derivatives 0; an
// infinite derivative at a point of the domain counts 0; rule 4's zeros; where
// two infinite inputs make an expression with no limit, the choice of
// docs/elementwise.md). Every function ends in propagate_nan (rule 7: a NaN
// input gives NaN in value and every derivative, also where a rule would give
// a number). A gradient is chain_rule(g, partial) of elementwise_math.h.
//
// The functions are templates written with operators, comparisons, `&`, `|`
// and the nf_* primitives only, as elementwise_math.h's (the CPU kernels
// instantiate them with ATen's vectors).
#pragma once

#include <cmath>
#include <type_traits>

#include "nanfree/elementwise_math.h"
#include "nanfree/numerics.h"

namespace nanfree {

NF_HOST_DEVICE float nf_floor(float x) { return ::floorf(x); }
NF_HOST_DEVICE double nf_floor(double x) { return ::floor(x); }
NF_HOST_DEVICE float nf_atan2(float a, float b) { return ::atan2f(a, b); }
NF_HOST_DEVICE double nf_atan2(double a, double b) { return ::atan2(a, b); }
NF_HOST_DEVICE float nf_max(float a, float b) { return ::fmaxf(a, b); }
NF_HOST_DEVICE double nf_max(double a, double b) { return ::fmax(a, b); }

// The binary ops, in the order of the op table of csrc/common/elementwise_op.h.
enum class BinaryOp : int { kPow = 0, kAtan2 = 1, kDivNoNan = 2, kXlogy = 3, kXlog1py = 4 };

// --- shared pieces ----------------------------------------------------------------

// r where neither input is NaN, else NaN (rule 7, before every other rule).
template <typename T>
NF_HOST_DEVICE T propagate_nan(T a, T b, T r) {
  return nf_where(nf_ordered(a, b), r, a + b);
}

// Whether x is +-inf: x - x is NaN only for an infinite or NaN x.
template <typename T>
NF_HOST_DEVICE auto is_infinite(T x) -> decltype((x - x) != (x - x)) {
  return ((x - x) != (x - x)) & (x == x);
}

// a * b with zeros dominant: 0 where a factor is 0 and neither is NaN (a factor
// the rules count 0 stays 0 against an infinite one, where inf * 0 is NaN).
template <typename T>
NF_HOST_DEVICE T zero_dominant_product(T a, T b) {
  return nf_zero_where(((a == T(0)) | (b == T(0))) & nf_ordered(a, b), a * b);
}

// --- pow(a, b): a to the power b -------------------------------------------------

// A negative base has a real power only at an integer exponent (+-inf counts:
// C's pow is defined there). Elsewhere the value and the derivatives are those of
// a base clamped to 0 (rule 2): the functions below put them in where this holds
// (the Triton and torch mirrors also clamp the base first, pow_domain).
template <typename T>
NF_HOST_DEVICE auto pow_outside(T a, T b) -> decltype(a < T(0)) {
  return (a < T(0)) & (nf_floor(b) != b);
}

// pow(0, b) for a non-integer b (the value outside the domain): 0 above 0, +inf below.
template <typename T>
NF_HOST_DEVICE T pow_of_zero(T b) {
  return nf_where(b > T(0), T(0), T(HUGE_VAL));
}

template <typename T>
NF_HOST_DEVICE T pow_value(T a, T b) {
  // C's pow of the inputs as they are, then the rules where it is not the value:
  // outside the domain pow(0, b) (rule 2; C gives NaN, or +-inf at a = -inf), a NaN
  // input NaN (rule 7; C's pow(1, NaN) = pow(NaN, 0) = 1). pow does not wait for
  // the domain test.
  const T r = nf_pow(a, b);
  return propagate_nan(a, b, nf_where(pow_outside(a, b), pow_of_zero(b), r));
}

template <typename T>
NF_HOST_DEVICE T pow_da(T a, T b) {
  // b a^(b-1), torch's formula; b == 0 or a vanishing power is 0 also against an
  // infinite factor (b = inf at 0 < a < 1: the limit). The power of the base as it
  // is: outside the domain C's pow gives NaN, which the where below replaces (the
  // mirrors' clamp of the base first gives the same values, but a blend before the
  // call stalled the CPU's vector loop: 17% of pow's forward+backward at 4M).
  const T d = zero_dominant_product(b, nf_pow(a, b - T(1)));
  // Outside the domain (rule 2); at a == 0 below b = 1 the derivative is infinite (rule 3).
  return propagate_nan(a, b, nf_where(pow_outside(a, b) | ((a == T(0)) & (b < T(1))), T(0), d));
}

template <typename T>
NF_HOST_DEVICE T pow_db(T a, T b) {
  // a^b log(a), torch's formula; a vanishing power is 0 against log(a) = inf (a = inf, b < 0).
  const T d = zero_dominant_product(nf_pow(a, b), nf_log(a));
  // a <= 0: at 0 rule 4, below 0 log(a) has no real value (rule 2).
  return propagate_nan(a, b, nf_where(a <= T(0), T(0), d));
}

template <typename T>
NF_HOST_DEVICE T pow_daa(T a, T b) {
  const T d = zero_dominant_product(b * (b - T(1)), nf_pow(a, b - T(2)));  // as pow_da
  // Outside the domain; at a == 0 below b = 2 the second derivative is infinite or
  // the first was counted 0 (rules 2 and 3).
  return propagate_nan(a, b, nf_where(pow_outside(a, b) | ((a == T(0)) & (b < T(2))), T(0), d));
}

template <typename T>
NF_HOST_DEVICE T pow_dab(T a, T b) {
  // a^(b-1) (1 + b log a); 0 at a <= 0, where the exponent's gradient is (rules 2 and 4).
  const T d = zero_dominant_product(nf_pow(a, b - T(1)), T(1) + zero_dominant_product(b, nf_log(a)));
  return propagate_nan(a, b, nf_where(a <= T(0), T(0), d));
}

template <typename T>
NF_HOST_DEVICE T pow_dbb(T a, T b) {
  const T log_a = nf_log(a);
  const T d = zero_dominant_product(nf_pow(a, b), log_a * log_a);  // a^b log(a)^2
  return propagate_nan(a, b, nf_where(a <= T(0), T(0), d));  // as pow_db (rules 2 and 4)
}

// --- pow at a known exponent ----------------------------------------------------------
//
// The exponents torch's CPU pow computes without pow (2, 3, 0.5, -0.5, -1, -2),
// for a kernel that knows b is one of them for every element (a Python number
// or a 0-d exponent; the CPU kernels read it on the host, the CUDA kernels in
// every thread, the same kind grid-wide): the value and the derivatives in the
// base a, under the same rules as pow_value, pow_da and pow_daa at that b (the
// partials in b need log(a) and take the general functions).

enum class PowExponent : int { kOther, kTwo, kThree, kHalf, kMinusHalf, kMinusOne, kMinusTwo };

NF_HOST_DEVICE PowExponent pow_exponent_kind(double b) {
  if (b == 2.0) return PowExponent::kTwo;
  if (b == 3.0) return PowExponent::kThree;
  if (b == 0.5) return PowExponent::kHalf;
  if (b == -0.5) return PowExponent::kMinusHalf;
  if (b == -1.0) return PowExponent::kMinusOne;
  if (b == -2.0) return PowExponent::kMinusTwo;
  return PowExponent::kOther;
}

// f(std::integral_constant<PowExponent, e>) for the kind e: one instantiation
// of f per kind, for the kernels that take pow_at_exponent's forms.
template <typename F>
NF_HOST_DEVICE void with_pow_exponent(PowExponent kind, F&& f) {
  using K = PowExponent;
  switch (kind) {
    case K::kTwo: f(std::integral_constant<K, K::kTwo>{}); return;
    case K::kThree: f(std::integral_constant<K, K::kThree>{}); return;
    case K::kHalf: f(std::integral_constant<K, K::kHalf>{}); return;
    case K::kMinusHalf: f(std::integral_constant<K, K::kMinusHalf>{}); return;
    case K::kMinusOne: f(std::integral_constant<K, K::kMinusOne>{}); return;
    case K::kMinusTwo: f(std::integral_constant<K, K::kMinusTwo>{}); return;
    default: f(std::integral_constant<K, K::kOther>{});
  }
}

// The value (order 0), d/da (1) or d2/da2 (2) of a^e for the exponent e.
template <PowExponent e, int order, typename T>
NF_HOST_DEVICE T pow_at_exponent(T a) {
  static_assert(e != PowExponent::kOther, "a known exponent");
  if constexpr (e == PowExponent::kTwo) {
    if constexpr (order == 0) return a * a;
    else if constexpr (order == 1) return T(2) * a;
    else return propagate_nan(a, a, T(2));
  } else if constexpr (e == PowExponent::kThree) {
    if constexpr (order == 0) return a * a * a;
    else if constexpr (order == 1) return T(3) * (a * a);
    else return T(6) * a;
  } else if constexpr (e == PowExponent::kMinusOne) {
    // 1 / a: C's pow(-0, -1) = -inf. The derivatives from r = 1 / a (no power of a
    // that overflows where the result is a normal number); infinite at 0 (rule 3).
    const T r = T(1) / a;
    if constexpr (order == 0) return r;
    else if constexpr (order == 1) return nf_where(a == T(0), T(0), -(r * r));
    else return nf_where(a == T(0), T(0), T(2) * (r * r) * r);
  } else if constexpr (e == PowExponent::kMinusTwo) {
    const T r = T(1) / a;
    if constexpr (order == 0) return T(1) / (a * a);  // torch's form of the value
    else if constexpr (order == 1) return nf_where(a == T(0), T(0), T(-2) * (r * r) * r);  // rule 3
    else return nf_where(a == T(0), T(0), T(6) * (r * r) * (r * r));  // rule 3
  } else {
    // a^(+-1/2): a negative base has no real power: clamped to 0 (rule 2), where
    // both derivatives are 0 as at 0 itself (infinite there: rule 3). + 0 makes a
    // base of -0 +0, as C's pow(-0, 0.5) = +0 (sqrt(-0) is -0). The derivatives
    // from s = 1 / sqrt(a), as 1 / a above.
    const T root = nf_sqrt(nf_where(a < T(0), T(0), a) + T(0));
    const T s = T(1) / root;
    const auto edge = a <= T(0);
    if constexpr (e == PowExponent::kHalf) {
      if constexpr (order == 0) return root;
      else if constexpr (order == 1) return nf_where(edge, T(0), T(0.5) * s);
      else return nf_where(edge, T(0), T(-0.25) * (s * s) * s);
    } else {
      if constexpr (order == 0) return s;
      else if constexpr (order == 1) return nf_where(edge, T(0), T(-0.5) * (s * s) * s);
      else return nf_where(edge, T(0), T(0.75) * (s * s) * (s * s) * s);
    }
  }
}

// --- atan2(a, b): the angle of the point (b, a) ------------------------------------

// The derivatives are taken with both inputs divided by s = max(|a|, |b|), so that
// a^2 + b^2 neither overflows nor underflows. At the origin (s == 0) torch's are 0
// (rule 3, kept); at an infinite input (s == inf) their limit is 0.
template <typename T>
NF_HOST_DEVICE T atan2_scale(T a, T b) {
  const T s = nf_max(nf_abs(a), nf_abs(b));
  return nf_where((s == T(0)) | is_infinite(s), T(0), s);  // 0: the derivatives are 0
}

template <typename T>
NF_HOST_DEVICE T atan2_value(T a, T b) {
  return nf_atan2(a, b);  // C's atan2: defined at the origin and at infinities
}

// One derivative of atan2 from the scaled inputs: `which` 0 = d/da = b / r,
// 1 = d/db = -a / r, 2 = d2/da2 = -2ab / r^2, 3 = d2/dadb = (a^2 - b^2) / r^2,
// 4 = d2/db2 = 2ab / r^2 (r = a^2 + b^2), divided by s once or twice.
template <int which, typename T>
NF_HOST_DEVICE T atan2_derivative(T a, T b) {
  const T s = atan2_scale(a, b);
  const T safe = nf_where(s == T(0), T(1), s);  // the origin and infinities: 0 below
  const T x = a / safe, y = b / safe;
  const T r = x * x + y * y;  // in [1, 2]
  T d;
  if constexpr (which == 0) d = y / r / safe;
  else if constexpr (which == 1) d = -x / r / safe;
  else if constexpr (which == 2) d = T(-2) * x * y / (r * r) / safe / safe;
  else if constexpr (which == 3) d = (x - y) * (x + y) / (r * r) / safe / safe;
  else d = T(2) * x * y / (r * r) / safe / safe;
  return propagate_nan(a, b, nf_where(s == T(0), T(0), d));  // origin or infinity: 0
}

template <typename T>
NF_HOST_DEVICE T atan2_da(T a, T b) { return atan2_derivative<0>(a, b); }
template <typename T>
NF_HOST_DEVICE T atan2_db(T a, T b) { return atan2_derivative<1>(a, b); }
template <typename T>
NF_HOST_DEVICE T atan2_daa(T a, T b) { return atan2_derivative<2>(a, b); }
template <typename T>
NF_HOST_DEVICE T atan2_dab(T a, T b) { return atan2_derivative<3>(a, b); }
template <typename T>
NF_HOST_DEVICE T atan2_dbb(T a, T b) { return atan2_derivative<4>(a, b); }

// --- div_no_nan(a, b): a / b, 0 where b == 0 ---------------------------------------

// Where the quotient counts 0 with every derivative: b == 0 (rule 4), and a and b
// both infinite (inf / inf has no limit: the op's own answer for an undefined quotient).
template <typename T>
NF_HOST_DEVICE auto div_no_nan_zero(T a, T b) -> decltype(b == T(0)) {
  return (b == T(0)) | (is_infinite(a) & is_infinite(b));
}

// propagate_nan(a, b, where(div_no_nan_zero(a, b), 0, a / b)) from the quotient:
// with neither input NaN, q is NaN exactly at 0 / 0 (b == 0) and inf / inf, and
// with one NaN q is NaN and stays (rule 7). Fewer compares than the composition.
template <typename T>
NF_HOST_DEVICE T div_no_nan_value(T a, T b) {
  const T q = a / b;
  // A finite quotient is the value (b is not 0, no input NaN): the rule only elsewhere.
  if (!nf_any_non_finite(q)) return q;
  return nf_zero_where(((b == T(0)) | (q != q)) & nf_ordered(a, b), q);  // rule 4
}

template <typename T>
NF_HOST_DEVICE T div_no_nan_da(T a, T b) {
  return propagate_nan(a, b, nf_where(div_no_nan_zero(a, b), T(0), T(1) / b));  // rule 4
}

template <typename T>
NF_HOST_DEVICE T div_no_nan_db(T a, T b) {
  // -a / b^2 as -(a / b) / b: no overflow of b^2 before the division (rule 4 as the value's).
  return propagate_nan(a, b, nf_where(div_no_nan_zero(a, b), T(0), -(a / b) / b));
}

template <typename T>
NF_HOST_DEVICE T div_no_nan_daa(T a, T b) {
  return propagate_nan(a, b, T(0));  // linear in a
}

template <typename T>
NF_HOST_DEVICE T div_no_nan_dab(T a, T b) {
  return propagate_nan(a, b, nf_where(div_no_nan_zero(a, b), T(0), -(T(1) / b) / b));  // -1/b^2
}

template <typename T>
NF_HOST_DEVICE T div_no_nan_dbb(T a, T b) {
  return propagate_nan(a, b, nf_where(div_no_nan_zero(a, b), T(0), T(2) * (a / b) / b / b));
}

// --- xlogy(a, b) = a log(b) and xlog1py(a, b) = a log1p(b) --------------------------
//
// Both are a * L(b) for L = log or log1p (domain b >= 0, resp. b >= -1). `shift`
// is the domain's edge (0 or -1); u = b - shift is the argument of log.

// a L(b): 0 where a == 0 whatever b (rule 4) and where L(b) == 0 (b = 1, resp. 0:
// the value along that line, also for an infinite a); below the domain L of the
// edge, -inf (rule 2).
template <typename T>
NF_HOST_DEVICE T xlog_value(T a, T log_b) {
  return zero_dominant_product(a, log_b);
}

// d/da = L(b); 0 at and below the edge (outside the domain, or L' infinite: rules 2 and 3).
template <typename T>
NF_HOST_DEVICE T xlog_da(T b, T shift, T log_b) {
  return nf_where(b <= shift, T(0), log_b);
}

// a / u: 0 at and below the edge (rules 2 and 3), at a == 0 (rule 4), and where a
// and u are both infinite (no limit, as div_no_nan).
template <typename T>
NF_HOST_DEVICE auto xlog_zero(T a, T b, T shift) -> decltype(b <= shift) {
  return (b <= shift) | (a == T(0)) | (is_infinite(a) & is_infinite(b));
}

template <typename T>
NF_HOST_DEVICE T xlogy_value(T a, T b) {
  // below the domain: log(0) = -inf (rule 2)
  return propagate_nan(a, b, xlog_value(a, nf_log(nf_where(b < T(0), T(0), b))));
}

template <typename T>
NF_HOST_DEVICE T xlogy_da(T a, T b) {
  return propagate_nan(a, b, xlog_da(b, T(0), nf_log(b)));
}

template <typename T>
NF_HOST_DEVICE T xlogy_db(T a, T b) {
  return propagate_nan(a, b, nf_where(xlog_zero(a, b, T(0)), T(0), a / b));
}

template <typename T>
NF_HOST_DEVICE T xlogy_daa(T a, T b) {
  return propagate_nan(a, b, T(0));  // linear in a
}

template <typename T>
NF_HOST_DEVICE T xlogy_dab(T a, T b) {
  return propagate_nan(a, b, nf_where(b <= T(0), T(0), T(1) / b));  // as xlogy_da's edge
}

template <typename T>
NF_HOST_DEVICE T xlogy_dbb(T a, T b) {
  return propagate_nan(a, b, nf_where(xlog_zero(a, b, T(0)), T(0), -(a / b) / b));
}

template <typename T>
NF_HOST_DEVICE T xlog1py_value(T a, T b) {
  // below the domain: log1p(-1) = -inf (rule 2)
  return propagate_nan(a, b, xlog_value(a, nf_log1p(nf_where(b < T(-1), T(-1), b))));
}

template <typename T>
NF_HOST_DEVICE T xlog1py_da(T a, T b) {
  return propagate_nan(a, b, xlog_da(b, T(-1), nf_log1p(b)));
}

template <typename T>
NF_HOST_DEVICE T xlog1py_db(T a, T b) {
  return propagate_nan(a, b, nf_where(xlog_zero(a, b, T(-1)), T(0), a / (b + T(1))));
}

template <typename T>
NF_HOST_DEVICE T xlog1py_daa(T a, T b) {
  return propagate_nan(a, b, T(0));  // linear in a
}

template <typename T>
NF_HOST_DEVICE T xlog1py_dab(T a, T b) {
  return propagate_nan(a, b, nf_where(b <= T(-1), T(0), T(1) / (b + T(1))));  // as xlog1py_da's edge
}

template <typename T>
NF_HOST_DEVICE T xlog1py_dbb(T a, T b) {
  const T u = b + T(1);
  return propagate_nan(a, b, nf_where(xlog_zero(a, b, T(-1)), T(0), -(a / u) / u));
}

// --- dispatch by op, order and partial ----------------------------------------------

#define NANFREE_BINARY_FUNCTION_CASES(OP)           \
  if constexpr (order == 0) return OP##_value(a, b); \
  else if constexpr (order == 1 && partial == 0) return OP##_da(a, b); \
  else if constexpr (order == 1) return OP##_db(a, b); \
  else if constexpr (partial == 0) return OP##_daa(a, b); \
  else if constexpr (partial == 1) return OP##_dab(a, b); \
  else return OP##_dbb(a, b);

// The op's value (order 0), its partial derivative `partial` of order 1 (0: d/da,
// 1: d/db) or of order 2 (0: d2/da2, 1: d2/dadb, 2: d2/db2) at (a, b).
template <BinaryOp op, int order, int partial, typename T>
NF_HOST_DEVICE T binary_function(T a, T b) {
  static_assert(order >= 0 && order <= 2 && partial >= 0 && partial <= order,
                "orders 0, 1 and 2, and a partial of that order");
  if constexpr (op == BinaryOp::kPow) {
    NANFREE_BINARY_FUNCTION_CASES(pow)
  } else if constexpr (op == BinaryOp::kAtan2) {
    NANFREE_BINARY_FUNCTION_CASES(atan2)
  } else if constexpr (op == BinaryOp::kDivNoNan) {
    NANFREE_BINARY_FUNCTION_CASES(div_no_nan)
  } else if constexpr (op == BinaryOp::kXlogy) {
    NANFREE_BINARY_FUNCTION_CASES(xlogy)
  } else {
    NANFREE_BINARY_FUNCTION_CASES(xlog1py)
  }
}

#undef NANFREE_BINARY_FUNCTION_CASES

// One element of <op> (order 0: the value; g is not read) or of <op>_backward
// (order 1 or 2: the chain rule of g and that partial derivative).
template <BinaryOp op, int order, int partial, typename T>
NF_HOST_DEVICE T binary_element(T g, T a, T b, T bound) {
  if constexpr (order == 0) {
    return binary_function<op, 0, 0>(a, b);
  } else {
    return chain_rule(g, binary_function<op, order, partial>(a, b), bound);
  }
}

// Both gradients of <op> at one element, for <op>_gradients (one pass where
// both inputs need theirs): grad_a = g * d/da, grad_b = g * d/db, each as
// binary_element of order 1 gives it.
template <BinaryOp op, typename T>
NF_HOST_DEVICE void binary_gradients(T g, T a, T b, T bound, T& grad_a, T& grad_b) {
  grad_a = binary_element<op, 1, 0>(g, a, b, bound);
  grad_b = binary_element<op, 1, 1>(g, a, b, bound);
}

// binary_element of pow where b is the exponent e for every element: the
// value and the partials in a at that exponent, the others as pow's.
template <PowExponent e, int order, int partial, typename T>
NF_HOST_DEVICE T pow_element_at_exponent(T g, T a, T b, T bound) {
  if constexpr (e == PowExponent::kOther || (order == 1 && partial == 1) ||
                (order == 2 && partial > 0)) {
    return binary_element<BinaryOp::kPow, order, partial>(g, a, b, bound);
  } else if constexpr (order == 0) {
    return pow_at_exponent<e, 0>(a);
  } else {
    return chain_rule(g, pow_at_exponent<e, order>(a), bound);
  }
}

}  // namespace nanfree
