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

}  // namespace cpu
}  // namespace nanfree
