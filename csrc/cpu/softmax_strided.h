// CPU kernels of the softmax family for a reduced dimension that is not the
// last (ReductionLayout with inner > 1), in place: softmax_strided.cpp; and
// the vector form of a shared formula both softmax files use.
#pragma once

#include <limits>

#include "common/softmax_op.h"
#include "cpu/vec.h"

namespace nanfree {
namespace cpu {

// softmax_grad_value on a vector (both files' vector paths): y * (g - dot),
// the halved form where g - dot overflows, saturated to [out_min, out_max].
template <typename acc_t>
inline Vec<acc_t> softmax_grad_vec(const Vec<acc_t>& g, const Vec<acc_t>& y, const Vec<acc_t>& dot,
                                   const Vec<acc_t>& out_max, const Vec<acc_t>& out_min) {
  using V = Vec<acc_t>;
  const V d = g - dot;
  const V halved = V(acc_t(2)) * (y * (V(acc_t(0.5)) * g - V(acc_t(0.5)) * dot));
  const V overflowed = d.abs() == V(std::numeric_limits<acc_t>::infinity());
  return saturate_vec(V::blendv(y * d, halved, overflowed), out_max, out_min);
}

// Forward of softmax / log_softmax / logsumexp: fills args.output and args.stats.
void strided_forward(SoftmaxKind kind, const ForwardArgs& args);

// Backward of the kind's op: fills args.grad_input.
void strided_backward(SoftmaxKind kind, const BackwardArgs& args);

// log_softmax's backward of one row by the shared scalar rule (both files' rare
// paths: a row whose plain sum of the kept g overflowed, g near the largest
// value, or a NaN row): the sum again at the scale 2^-64 (GradSum of
// numerics.h), then log_softmax_grad_value entry by entry. Entry j of the row
// is at g[j * stride] (y, dx likewise); keep(j) says whether it is kept.
template <typename scalar_t, typename acc_t, typename Keep>
void log_softmax_row_by_rule(const scalar_t* g, const scalar_t* y, int64_t stride, int64_t n,
                             acc_t plain, const Keep& keep, scalar_t* dx) {
  acc_t scaled = 0;
  for (int64_t j = 0; j < n; ++j)
    if (keep(j)) scaled += static_cast<acc_t>(g[j * stride]) * grad_sum_scale<acc_t>();
  const GradSum<acc_t> sum{plain, scaled};
  const acc_t bound = largest_finite<scalar_t>();
  for (int64_t j = 0; j < n; ++j)
    dx[j * stride] = static_cast<scalar_t>(log_softmax_grad_value(
        static_cast<acc_t>(g[j * stride]), static_cast<acc_t>(y[j * stride]), sum, keep(j), bound));
}

}  // namespace cpu
}  // namespace nanfree
