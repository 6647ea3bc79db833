// The losses family (binary_cross_entropy_with_logits, binary_cross_entropy,
// kl_div, sigmoid_focal_loss, cross_entropy): the special-value rules of
// DESIGN.md section 2, "NaN-safe losses", shared by the CPU and CUDA kernels
// and mirrored by name in nanfree/_triton/losses.py and
// nanfree/_torch_backend/losses.py. docs/losses.md has the tables.
//
// Every function takes values in the accumulation type T (float for
// float16, bfloat16 and float32 data, double for float64). A NaN operand gives
// NaN (value and gradients), in that element or row only. The loss values are
// the limits of the formulas where torch's composition meets inf - inf or
// 0 * inf; a gradient is finite where the loss is, and a gradient that is
// infinite in the limit is saturated by the caller to the largest finite
// value of the output's dtype (saturate in numerics.h).
#pragma once

#include "nanfree/layout.h"
#include "nanfree/numerics.h"

namespace nanfree {

// The pointwise functions below are templates written with operators,
// comparisons, `&`, `|`, nf_where and the nf_* primitives only, without
// branches: T is float or double (CPU scalars, CUDA) or an ATen CPU vector of
// them (csrc/cpu/vec_math.h declares the vector primitives; a comparison is
// then a lane mask). Constants that are per call (alpha, gamma, the bound)
// come in as T.

template <typename T>
NF_HOST_DEVICE auto loss_is_nan(T x) -> decltype(x != x) {
  return x != x;
}

// Whether x is +-inf: x - x is NaN only for an infinite or NaN x.
template <typename T>
NF_HOST_DEVICE auto loss_is_infinite(T x) -> decltype(x != x) {
  return ((x - x) != (x - x)) & (x == x);
}

// a * b where a factor that is exactly 0 wins against an infinite one (a term
// whose weight is 0 contributes 0 even where its log is infinite); NaN stays NaN.
template <typename T>
NF_HOST_DEVICE T loss_product(T a, T b) {
  return nf_where(((a == T(0)) | (b == T(0))) & (a == a) & (b == b), T(0), a * b);
}

// softplus(x) and softplus(-x) from one exp and one log1p: both are
// max(+-x, 0) + log1p(exp(-|x|)).
template <typename T>
struct SoftplusPair {
  T pos;  // softplus(x)
  T neg;  // softplus(-x)
};

template <typename T>
NF_HOST_DEVICE SoftplusPair<T> softplus_pair(T x) {
  const T l = nf_log1p(nf_exp(T(0) - nf_abs(x)));
  return SoftplusPair<T>{nf_where(x > T(0), x, T(0)) + l, nf_where(x < T(0), T(0) - x, T(0)) + l};
}

// sigmoid(x) and sigmoid(-x) from one exp: with e = exp(-|x|) in [0, 1],
// sigmoid(|x|) = 1 / (1 + e) and sigmoid(-|x|) = e / (1 + e) (0 and 1 at +-inf).
template <typename T>
struct SigmoidPair {
  T pos;  // sigmoid(x)
  T neg;  // sigmoid(-x)
};

template <typename T>
NF_HOST_DEVICE SigmoidPair<T> sigmoid_pair(T x) {
  const T e = nf_exp(T(0) - nf_abs(x));
  const T big = T(1) / (T(1) + e), small = e * big;
  return SigmoidPair<T>{nf_where(x < T(0), small, big), nf_where(x < T(0), big, small)};
}

// The pointwise losses. Each has a value and its derivatives in the input x
// (logit, probability or log-probability) and in the target t.
enum class PointwiseLoss : int {
  BceWithLogits = 0,   // w * (pw t softplus(-x) + (1 - t) softplus(x))
  Bce = 1,             // -w * (t log p + (1 - t) log(1 - p))
  KlDiv = 2,           // t (log t - x)
  KlDivLogTarget = 3,  // exp(t) (t - x)
  SigmoidFocal = 4,    // alpha_t * bce_with_logits(x, t) * (1 - p_t)^gamma
};

// The numbers a pointwise loss reads besides x and t: `weight` (w) and
// `pos_weight` (pw) per element (1 where not given); alpha and gamma per call
// (sigmoid_focal_loss).
template <typename T>
struct PointwiseOperands {
  T x;
  T t;
  T w;
  T pw;
};

// --- binary_cross_entropy_with_logits ------------------------------------------

// torch's (1 - t) x + (1 + (pw - 1) t) softplus(-x) rewritten as a sum of two
// terms each weighted by its own coefficient: at x = +-inf the term of a
// coefficient 0 (the target agrees) is 0 instead of 0 * inf = NaN, and the
// other is the exact +inf.
template <typename T>
NF_HOST_DEVICE T bce_with_logits_value(PointwiseOperands<T> o) {
  const SoftplusPair<T> sp = softplus_pair(o.x);
  const T loss = loss_product(o.pw * o.t, sp.neg) + loss_product(T(1) - o.t, sp.pos);
  return loss_product(o.w, loss);
}

// d/dx: w ((1 - t) sigmoid(x) - pw t sigmoid(-x)); sigmoid(x) - t for w = pw = 1,
// finite at x = +-inf.
template <typename T>
NF_HOST_DEVICE T bce_with_logits_grad_input(PointwiseOperands<T> o) {
  const SigmoidPair<T> s = sigmoid_pair(o.x);
  const T d = (T(1) - o.t) * s.pos - o.pw * o.t * s.neg;
  return loss_product(o.w, d);
}

// d/dt: w (pw softplus(-x) - softplus(x)), -w x for pw = 1: infinite at x = +-inf
// (the caller saturates it).
template <typename T>
NF_HOST_DEVICE T bce_with_logits_grad_target(PointwiseOperands<T> o) {
  // A weight pw of 0 contributes 0 against softplus(-x) = inf at x = -inf.
  const SoftplusPair<T> sp = softplus_pair(o.x);
  const T d = loss_product(o.w, loss_product(o.pw, sp.neg) - sp.pos);
  // The derivative does not read t; a NaN target still makes it NaN (rule: NaN in, NaN out).
  return nf_where(loss_is_nan(o.t), o.t, d);
}

// --- binary_cross_entropy ------------------------------------------------------

// A probability outside [0, 1] is read at the nearest bound (DESIGN.md's
// domain rule of the elementwise ops; torch raises on CPU and asserts on CUDA).
template <typename T>
NF_HOST_DEVICE T probability_in_domain(T p) {
  return nf_where(p < T(0), T(0), nf_where(p > T(1), T(1), p));
}

// -w (t log p + (1 - t) log1p(-p)), not clamped (torch clamps each log at -100):
// exact down to the smallest probability; p = 0 or 1 against a target that
// disagrees is +inf, where a target that agrees gives 0 (0 log 0 = 0).
template <typename T>
NF_HOST_DEVICE T bce_value(PointwiseOperands<T> o) {
  const T p = probability_in_domain(o.x);
  const T loss = loss_product(o.t, T(0) - nf_log(p)) + loss_product(T(1) - o.t, T(0) - nf_log1p(T(0) - p));
  return loss_product(o.w, loss);
}

// d/dp: w (-t / p + (1 - t) / (1 - p)); each term is 0 where its coefficient is
// (0 / 0 at p = 0, t = 0 is the limit 0 of its term), -inf at p = 0 with t > 0.
// Outside [0, 1] the loss is constant: 0.
template <typename T>
NF_HOST_DEVICE T bce_grad_input(PointwiseOperands<T> o) {
  const T p = o.x;
  const T low = nf_where(o.t == T(0), T(0), (T(0) - o.t) / p);
  const T high = nf_where(o.t == T(1), T(0), (T(1) - o.t) / (T(1) - p));
  // Outside the domain the loss does not move.
  return nf_where((p < T(0)) | (p > T(1)), T(0), loss_product(o.w, low + high));
}

// d/dt: w (log1p(-p) - log p): +inf at p = 0, -inf at p = 1 (saturated by the caller).
template <typename T>
NF_HOST_DEVICE T bce_grad_target(PointwiseOperands<T> o) {
  const T p = probability_in_domain(o.x);
  const T d = loss_product(o.w, nf_log1p(T(0) - p) - nf_log(p));
  return nf_where(loss_is_nan(o.t), o.t, d);  // not read, but NaN in gives NaN out
}

// --- kl_div --------------------------------------------------------------------

// A target below 0 (log_target false) is read as 0 (the domain rule).
template <typename T>
NF_HOST_DEVICE T target_in_domain(T t) {
  return nf_where(t < T(0), T(0), t);
}

// log t - x where log t and x are the same infinity: the input matches the
// target there, so the difference is 0 (inf - inf would be NaN).
template <typename T>
NF_HOST_DEVICE T log_ratio(T log_t, T x) {
  return nf_where(log_t == x, T(0), log_t - x);
}

// NaN where x or t is (value and both derivatives), else r.
template <typename T>
NF_HOST_DEVICE T kl_propagate_nan(T x, T t, T r) {
  return nf_where(loss_is_nan(x) | loss_is_nan(t), x + t, r);
}

// t (log t - x): a zero target contributes 0 whatever x (-inf included; torch:
// 0 * -inf = NaN); x = -inf under a positive target is the exact +inf.
template <typename T>
NF_HOST_DEVICE T kl_div_value(PointwiseOperands<T> o) {
  const T t = target_in_domain(o.t);
  // t = x = +inf: a match (log_ratio 0), and inf * 0 is 0 there; t == 0:
  // 0 log 0 = 0 and 0 * x = 0 for every x.
  const T r = nf_where(t == T(0), T(0), loss_product(t, log_ratio(nf_log(t), o.x)));
  return kl_propagate_nan(o.x, o.t, r);
}

template <typename T>
NF_HOST_DEVICE T kl_div_grad_input(PointwiseOperands<T> o) {
  return nf_where(loss_is_nan(o.x), o.x, T(0) - target_in_domain(o.t));
}

// d/dt: log t + 1 - x, -inf at t = 0 (saturated by the caller); 0 below 0, where
// the loss does not move.
template <typename T>
NF_HOST_DEVICE T kl_div_grad_target(PointwiseOperands<T> o) {
  const T d = nf_where(o.t < T(0), T(0), log_ratio(nf_log(o.t), o.x) + T(1));
  return kl_propagate_nan(o.x, o.t, d);
}

// exp(t) (t - x), t a log-probability: t = -inf (a zero target) contributes 0.
template <typename T>
NF_HOST_DEVICE T kl_div_log_target_value(PointwiseOperands<T> o) {
  return kl_propagate_nan(o.x, o.t, loss_product(nf_exp(o.t), log_ratio(o.t, o.x)));
}

template <typename T>
NF_HOST_DEVICE T kl_div_log_target_grad_input(PointwiseOperands<T> o) {
  return nf_where(loss_is_nan(o.x), o.x, T(0) - nf_exp(o.t));
}

// d/dt: exp(t) (t - x + 1): 0 at t = -inf.
template <typename T>
NF_HOST_DEVICE T kl_div_log_target_grad_target(PointwiseOperands<T> o) {
  return kl_propagate_nan(o.x, o.t, loss_product(nf_exp(o.t), log_ratio(o.t, o.x) + T(1)));
}

// --- sigmoid_focal_loss (torchvision's) ----------------------------------------

// alpha t + (1 - alpha) (1 - t) for alpha >= 0, else 1 (torchvision's rule).
template <typename T>
NF_HOST_DEVICE T focal_alpha_t(T t, T alpha) {
  return nf_where(alpha >= T(0), alpha * t + (T(1) - alpha) * (T(1) - t), T(1));
}

// The focal parts: ce = bce_with_logits(x, t); m = 1 - p_t = sigmoid(x) (1 - t)
// + sigmoid(-x) t, formed from both sigmoids so that it is not 1 - 1 = 0
// where it is small; m^gamma (0^0 = 1 at gamma = 0).
template <typename T>
struct FocalParts {
  T ce;
  T m;
  T m_gamma;
  T sig;      // sigmoid(x)
  T sig_neg;  // sigmoid(-x)
};

template <typename T>
NF_HOST_DEVICE FocalParts<T> focal_parts(T x, T t, T gamma) {
  FocalParts<T> f;
  const SoftplusPair<T> sp = softplus_pair(x);
  const SigmoidPair<T> s = sigmoid_pair(x);
  f.ce = loss_product(t, sp.neg) + loss_product(T(1) - t, sp.pos);
  f.sig = s.pos;
  f.sig_neg = s.neg;
  f.m = f.sig * (T(1) - t) + f.sig_neg * t;
  f.m_gamma = nf_pow(f.m, gamma);
  return f;
}

template <typename T>
NF_HOST_DEVICE T sigmoid_focal_value(PointwiseOperands<T> o, T alpha, T gamma) {
  const FocalParts<T> f = focal_parts(o.x, o.t, gamma);
  // ce = +inf (a saturated logit against its target) meets m^gamma = 1 there;
  // ce = 0 meets m^gamma = 0: the product is 0.
  return focal_alpha_t(o.t, alpha) * loss_product(f.ce, f.m_gamma);
}

// d/dx of alpha_t ce m^g: alpha_t m^g (ce' + g ce m'/m), with ce' = sigmoid(x) - t
// and m'/m = sigmoid(x) sigmoid(-x) (1 - 2t) / m, a number in [-1, 1]. Written so,
// the factor m^(g - 1) (infinite at m = 0 for g < 1, torchvision's NaN) never forms.
template <typename T>
NF_HOST_DEVICE T sigmoid_focal_grad_input(PointwiseOperands<T> o, T alpha, T gamma) {
  const FocalParts<T> f = focal_parts(o.x, o.t, gamma);
  const T slope = T(1) - T(2) * o.t;
  // m = 0 only where the logit is saturated toward its target (t in {0, 1}):
  // the limit of m'/m there is 1 - 2t.
  const T ratio = nf_where(f.m == T(0), slope, f.sig * f.sig_neg * slope / f.m);
  // ce' = sigmoid(x) - t, formed as bce_with_logits_grad_input's two terms: no
  // 1 - 1 where sigmoid(x) rounds to 1 (x = 20 in float).
  const T ce_slope = (T(1) - o.t) * f.sig - o.t * f.sig_neg;
  // ce = +inf (the other saturation) meets ratio = 0 there: the term is 0.
  const T d = ce_slope + loss_product(gamma, loss_product(f.ce, ratio));
  const T r = focal_alpha_t(o.t, alpha) * loss_product(f.m_gamma, d);
  return nf_where(loss_is_nan(f.ce), f.ce, r);  // NaN in, NaN out
}

// d/dt: m^g (alpha_t' ce + alpha_t (-x + g (ce / m) m_t)), alpha_t' = 2 alpha - 1
// (0 for alpha < 0), m_t = sigmoid(-x) - sigmoid(x).
template <typename T>
NF_HOST_DEVICE T sigmoid_focal_grad_target(PointwiseOperands<T> o, T alpha, T gamma) {
  const FocalParts<T> f = focal_parts(o.x, o.t, gamma);
  const T alpha_slope = nf_where(alpha >= T(0), T(2) * alpha - T(1), T(0));
  // ce and m vanish together where the logit saturates toward its target; ce/m
  // tends to 1 there (0 / 0 otherwise).
  const T ce_over_m = nf_where(f.m == T(0), T(1), f.ce / f.m);
  // gamma = 0 against ce / m = inf (a logit saturated against its target): 0.
  const T inner = (T(0) - o.x) + loss_product(gamma, loss_product(ce_over_m, f.sig_neg - f.sig));
  const T d = loss_product(alpha_slope, f.ce) + loss_product(focal_alpha_t(o.t, alpha), inner);
  // At x = +-inf, ce, -x and ce / m are infinite together (inf - inf above):
  // the limit is m^g times S (alpha_t' m + s alpha_t (1 + g)), S = |x| -> inf,
  // with m the weight of the infinite softplus in ce and s = +1 at -inf, -1 at +inf.
  const T m_at_infinity = nf_where(o.x < T(0), o.t, T(1) - o.t);
  const T side = nf_where(o.x < T(0), T(1), T(-1));
  const T coefficient =
      alpha_slope * m_at_infinity + side * focal_alpha_t(o.t, alpha) * (T(1) + gamma);
  const T limit = loss_product(coefficient, T(HUGE_VAL));
  // m^g = 0 (saturated toward the target, g > 0) against an infinite d: 0.
  const T r = loss_product(f.m_gamma, nf_where(loss_is_infinite(o.x), limit, d));
  return nf_where(loss_is_nan(f.ce), f.ce, r);  // NaN in, NaN out
}

// The dispatch of the pointwise losses by kind: value, d/dx (partial 0), d/dt (partial 1).
template <PointwiseLoss kind, typename T>
NF_HOST_DEVICE T pointwise_loss_value(PointwiseOperands<T> o, T alpha, T gamma) {
  if constexpr (kind == PointwiseLoss::BceWithLogits) return bce_with_logits_value(o);
  if constexpr (kind == PointwiseLoss::Bce) return bce_value(o);
  if constexpr (kind == PointwiseLoss::KlDiv) return kl_div_value(o);
  if constexpr (kind == PointwiseLoss::KlDivLogTarget) return kl_div_log_target_value(o);
  if constexpr (kind == PointwiseLoss::SigmoidFocal) return sigmoid_focal_value(o, alpha, gamma);
}

template <PointwiseLoss kind, typename T>
NF_HOST_DEVICE T pointwise_loss_grad(PointwiseOperands<T> o, T alpha, T gamma, int partial) {
  if constexpr (kind == PointwiseLoss::BceWithLogits) {
    return partial == 0 ? bce_with_logits_grad_input(o) : bce_with_logits_grad_target(o);
  }
  if constexpr (kind == PointwiseLoss::Bce) {
    return partial == 0 ? bce_grad_input(o) : bce_grad_target(o);
  }
  if constexpr (kind == PointwiseLoss::KlDiv) {
    return partial == 0 ? kl_div_grad_input(o) : kl_div_grad_target(o);
  }
  if constexpr (kind == PointwiseLoss::KlDivLogTarget) {
    return partial == 0 ? kl_div_log_target_grad_input(o) : kl_div_log_target_grad_target(o);
  }
  if constexpr (kind == PointwiseLoss::SigmoidFocal) {
    return partial == 0 ? sigmoid_focal_grad_input(o, alpha, gamma)
                        : sigmoid_focal_grad_target(o, alpha, gamma);
  }
}

// g times a partial derivative, saturated to `bound` (the output dtype's
// largest finite value): a zero upstream gradient gives 0 also against an
// infinite partial (the loss of an element that is not used).
template <typename T>
NF_HOST_DEVICE T loss_chain_rule(T g, T partial, T bound) {
  const T r = loss_product(g, partial);
  // Past the dtype's range: its largest value with the sign (NaN stays NaN).
  return nf_saturate(r, bound);
}

// --- cross_entropy -------------------------------------------------------------
//
// Logits viewed as [outer, C, inner] (ReductionLayout of layout.h, n = C), one
// position per (o, i). A class c of a position is kept when the mask keeps it
// and its logit is not -inf (a class that does not exist). Per position the
// loss is -sum_c q_c log p_c over the kept classes, p the softmax over the kept
// classes, with class weights q_c:
//   class-index target y:  q_c = (1 - eps) w_y [c == y] + s w_c
//   probability target t:  q_c = w_c ((1 - eps) t_c + s)
// where w is the class weight (1 without one), eps the label smoothing and
// s = eps / (number of kept classes): label smoothing spreads its mass over the
// kept classes only. A position whose target is ignore_index, whose target
// class is not kept, or with no kept class at all has loss 0 and gradient 0,
// and is left out of the mean. The gradient in logit c is Q p_c - q_c, Q the
// sum of the q_c.

// The statistics a position's forward saves for the backward and the mean
// (kCrossEntropyStats numbers per position, in this order).
constexpr int kCrossEntropyStats = 5;
template <typename T>
struct CrossEntropyStats {
  T max;          // the largest kept logit (-inf when none is kept)
  T log_sum;      // log(sum over kept c of exp(x_c - max))
  T total;        // Q = sum of the q_c
  T smoothing;    // s = eps / kept classes (0 when none is kept)
  T denominator;  // the position's share of the mean's denominator: w_y (index
                  // targets), 1 (probability targets), 0 when left out
};

// The statistics of a position left out (ignored target, target class not
// kept, no kept class): no loss, no gradient, no share of the mean.
template <typename T>
NF_HOST_DEVICE CrossEntropyStats<T> ce_left_out() {
  return CrossEntropyStats<T>{-nf_inf<T>(), T(0), T(0), T(0), T(0)};
}

// Whether class c takes part: kept by the mask and its logit not -inf. A NaN
// logit is kept (it makes the position's loss NaN).
template <typename T>
NF_HOST_DEVICE bool ce_class_kept(T x, bool keep) {
  return keep && x != -nf_inf<T>();
}

template <typename T>
NF_HOST_DEVICE T ce_smoothing(T eps, int64_t kept_classes) {
  // No kept class: no smoothing mass to spread (and no division by 0).
  return kept_classes == 0 ? T(0) : eps / T(kept_classes);
}

// q_c of a class-index target (is_target: c == y).
template <typename T>
NF_HOST_DEVICE T ce_index_weight(bool is_target, T w_c, T w_y, T eps, T smoothing) {
  return (is_target ? (T(1) - eps) * w_y : T(0)) + smoothing * w_c;
}

// q_c of a probability target.
template <typename T>
NF_HOST_DEVICE T ce_probability_weight(T t_c, T w_c, T eps, T smoothing) {
  return w_c * ((T(1) - eps) * t_c + smoothing);
}

// log p_c of a kept class.
template <typename T>
NF_HOST_DEVICE T ce_log_probability(T x, CrossEntropyStats<T> s) {
  // A position whose largest logit is +inf: the +inf classes share the mass
  // (log p = -log k), x == max covering them where x - max is NaN; the others
  // have p = 0.
  if (x == s.max) return -s.log_sum;
  return (x - s.max) - s.log_sum;
}

// One kept class's term -q_c log p_c: a class of weight 0 contributes 0, also
// where its log-probability is -inf (0 log 0 = 0).
template <typename T>
NF_HOST_DEVICE T ce_term(T q, T log_p) {
  return loss_product(q, -log_p);
}

// Whether a position passes a gradient to its logits: one with no kept class
// (max -inf, Q = 0) or holding a +inf logit (locally constant) has gradient 0;
// a NaN logit (NaN log_sum) passes its NaN on.
template <typename T>
NF_HOST_DEVICE bool ce_has_gradient(CrossEntropyStats<T> s) {
  return !nf_isinf(s.max) || nf_isnan(s.log_sum);
}

// d loss / d x_c for upstream g: g (Q p_c - q_c) on a kept class, 0 elsewhere
// (an excluded class's logit does not enter the loss).
template <typename T>
NF_HOST_DEVICE T ce_grad_input(T g, T x, T q, bool kept, CrossEntropyStats<T> s, T bound) {
  if (!kept || !ce_has_gradient(s)) return T(0);
  const T p = nf_exp((x - s.max) - s.log_sum);
  return saturate(g * (s.total * p - q), bound);
}

// d loss / d t_c of a probability target: -g w_c (1 - eps) log p_c on a kept
// class (+inf where p_c = 0: saturated), 0 on an excluded one.
template <typename T>
NF_HOST_DEVICE T ce_grad_target(T g, T x, T w_c, T eps, bool kept, CrossEntropyStats<T> s,
                                T bound) {
  if (!kept || s.max == -nf_inf<T>()) return T(0);
  return saturate(loss_product(g * w_c * (T(1) - eps), -ce_log_probability(x, s)), bound);
}

}  // namespace nanfree
