// Autograd plumbing shared by every op family (csrc/<family>_autograd.cpp):
// whether a call records a graph node, and the node that refuses double
// backward through a backward op.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <string>

namespace nanfree {

// Whether a call must record an autograd node for `t`. Without one the op runs
// straight below autograd: building a node costs about a microsecond, a third
// of a small tensor's call.
inline bool needs_graph(const at::Tensor& t) {
  return t.defined() && at::GradMode::is_enabled() && t.requires_grad();
}

// A backward op is differentiable in name only: with create_graph=True it
// records a node whose own backward refuses with a clear error, instead of
// PyTorch's fallback, which only warns and drops the second-order term.
[[noreturn]] inline void refuse_double_backward(const std::string& backward_op,
                                                const char* family) {
  TORCH_CHECK(false, "nanfree: ", backward_op,
              " has no derivative: double backward (differentiating a gradient) of the ", family,
              " family is not implemented");
  __builtin_unreachable();
}

}  // namespace nanfree
