// CPU kernels of the softmax family for a reduced dimension that is not the
// last (ReductionLayout with inner > 1), in place: softmax_strided.cpp.
#pragma once

#include "common/softmax_op.h"

namespace nanfree {
namespace cpu {

// Forward of softmax / log_softmax / logsumexp: fills args.output and args.stats.
void strided_forward(SoftmaxKind kind, const ForwardArgs& args);

// Backward of the kind's op: fills args.grad_input.
void strided_backward(SoftmaxKind kind, const BackwardArgs& args);

}  // namespace cpu
}  // namespace nanfree
