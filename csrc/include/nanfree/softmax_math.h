// softmax / log_softmax / logsumexp over one dimension of a contiguous tensor:
// the special-value rules of DESIGN.md section 2, shared by the CPU and CUDA
// kernels and mirrored by name in nanfree/_triton/softmax.py.
#pragma once

#include "nanfree/layout.h"
#include "nanfree/numerics.h"

namespace nanfree {

// The three ops of the family; they share the forward row statistics.
enum class SoftmaxKind : int { Softmax = 0, LogSoftmax = 1, LogSumExp = 2 };

// The problem: a contiguous tensor viewed as [outer, n, inner]
// (ReductionLayout of layout.h), reduced over n: one row per reduction, its n
// entries the row's columns.

// The saved statistics of row (o, i) lie where the reduced dimension of the
// input has size 2: its max at stats_offset(s, o, 0, i), its log_sum at
// stats_offset(s, o, 1, i). With inner == 1 that is a [rows, 2] array.
NF_HOST_DEVICE int64_t stats_offset(const ReductionLayout& s, int64_t o, int k, int64_t i) {
  return (o * 2 + k) * s.inner + i;
}

// The value softmax sees: a dropped entry is exactly -inf, whatever it held
// (NaN included), as input.masked_fill(~mask, -inf).
template <typename T>
NF_HOST_DEVICE T masked_value(T x, bool keep) {
  return keep ? x : -nf_inf<T>();
}

// Softmax of one entry given its row's state and inv_sum = 1 / state.sum.
template <typename T>
NF_HOST_DEVICE T softmax_value(T x, LseState<T> row, T inv_sum) {
  // An empty row (all -inf or all masked) is the empty distribution: 0, not
  // 0/0. A row of NaN and -inf also has max -inf, but its NaN sum passes on.
  if (row.max == -nf_inf<T>() && !nf_isnan(row.sum)) return T(0);
  // lse_scale gives 1 for x == max, so a row with k entries +inf gives 1/k
  // there and exp(-inf) = 0 elsewhere.
  return lse_scale(x, row.max) * inv_sum;
}

// log_softmax of one entry given log_sum = log(state.sum).
template <typename T>
NF_HOST_DEVICE T log_softmax_value(T x, LseState<T> row, T log_sum) {
  // An empty row has log-probability -inf everywhere instead of -inf - (-inf)
  // (a row of NaN and -inf has a NaN sum and stays NaN).
  if (row.max == -nf_inf<T>() && !nf_isnan(row.sum)) return -nf_inf<T>();
  // x == max also covers +inf entries of a +inf row, where x - max is NaN:
  // the limit is -log k.
  if (x == row.max) return -log_sum;
  return (x - row.max) - log_sum;
}

// The statistics a forward saves per row for the backward: the row's max and
// log(sum(exp(x - max))). Kept apart rather than as one logsumexp, which can
// overflow (a row of two finfo.max) while the row itself is finite.
template <typename T>
struct RowStats {
  T max;
  T log_sum;
};

template <typename T>
NF_HOST_DEVICE RowStats<T> row_stats(LseState<T> state) {
  return RowStats<T>{state.max, nf_log(state.sum)};
}

// Whether a row passes any gradient: an empty row (max -inf) is an empty
// distribution and a row holding +inf (max +inf) is locally constant, so both
// have gradient 0. A row holding NaN (NaN log_sum) passes its NaN on, also
// when it holds +inf too.
template <typename T>
NF_HOST_DEVICE bool row_has_gradient(RowStats<T> stats) {
  return !nf_isinf(stats.max) || nf_isnan(stats.log_sum);
}

// Huge upstream gradients (DESIGN.md 1.2: a finite input and a finite upstream
// gradient give a finite gradient). Each gradient below is saturated to
// `bound`, the largest finite value of the output's dtype (in the accumulation
// type): an exact gradient past the range is that value with its sign. Where
// an intermediate overflows although the gradient need not, it is formed at a
// power-of-two scale (exact for normal numbers) and scaled back.

// d softmax: y * (g - dot); `dot` is sum_j g_j y_j over the row.
template <typename T>
NF_HOST_DEVICE T softmax_grad_value(T g, T y, T dot, T bound) {
  const T d = g - dot;
  // g - dot past the range (g = -3e38, dot = 3e38 in float): y * (g - dot)
  // may be small or 0 (y = 0 would give 0 * inf = NaN). Where g or dot is
  // infinite itself, the halved form gives the same value as the plain one.
  if (nf_isinf(d)) return saturate(T(2) * (y * (T(0.5) * g - T(0.5) * dot)), bound);
  return saturate(y * d, bound);
}

// log_softmax's row sum of the kept g_j is a GradSum (numerics.h): the plain
// sum overflows when a few entries are near the largest value (two of 3e38 in
// float) while each gradient g - exp(y) * sum may be small (0 for x = [0, 0],
// g = [3e38, 3e38]).
// d log_softmax: g - exp(y) * sum_j g_j, the sum over the kept entries.
// exp(-inf) = 0, so an unmasked -inf entry receives g; a dropped entry's
// output does not depend on its input, so it receives 0.
template <typename T>
NF_HOST_DEVICE T log_softmax_grad_value(T g, T y, GradSum<T> sum, bool keep, T bound) {
  if (!keep) return T(0);
  const T p = nf_exp(y);
  if (grad_sum_overflowed(sum)) {
    const T ps = p * sum.scaled;
    // p = 0 (a -inf entry) receives g itself (0 * inf would be NaN; at the
    // scale a small g would round away).
    if (ps == T(0)) return saturate(g, bound);
    return saturate((g * grad_sum_scale<T>() - ps) * grad_sum_unscale<T>(), bound);
  }
  // Two finite terms whose difference passes the range: the exact gradient
  // does too, and saturates.
  return saturate(g - p * sum.plain, bound);
}

// d logsumexp: g * exp(x - max - log_sum), the softmax of x. A dropped entry
// (and an unmasked -inf, through exp(-inf) = 0) receives 0.
template <typename T>
NF_HOST_DEVICE T logsumexp_grad_value(T g, T x, RowStats<T> stats, bool keep) {
  return keep ? g * nf_exp((x - stats.max) - stats.log_sum) : T(0);
}

}  // namespace nanfree
