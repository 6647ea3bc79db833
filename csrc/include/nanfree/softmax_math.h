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

// d softmax: y * (g - sum_j g_j y_j); `dot` is that sum over the row.
template <typename T>
NF_HOST_DEVICE T softmax_grad_value(T g, T y, T dot) {
  return y * (g - dot);
}

// d log_softmax: g - exp(y) * sum_j g_j, the sum over the kept entries.
// exp(-inf) = 0, so an unmasked -inf entry receives g; a dropped entry's
// output does not depend on its input, so it receives 0.
template <typename T>
NF_HOST_DEVICE T log_softmax_grad_value(T g, T y, T grad_sum, bool keep) {
  return keep ? g - nf_exp(y) * grad_sum : T(0);
}

// d logsumexp: g * exp(x - max - log_sum), the softmax of x. A dropped entry
// (and an unmasked -inf, through exp(-inf) = 0) receives 0.
template <typename T>
NF_HOST_DEVICE T logsumexp_grad_value(T g, T x, RowStats<T> stats, bool keep) {
  return keep ? g * nf_exp((x - stats.max) - stats.log_sum) : T(0);
}

}  // namespace nanfree
