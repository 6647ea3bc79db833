// ATen-side helpers shared by the CPU and CUDA registrations of the GeM
// family: argument checks and output allocation; the input is the
// [outer, n, inner] view of common/layout.h, reduced over n (csrc/registration.cpp). The Python backends and the fake
// kernels raise the same errors (nanfree/_ops/gem.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "common/checks.h"
#include "common/layout.h"

namespace nanfree {

// Per-reduction statistics saved for the backward (gem_math.h): m, mean, count.
constexpr int64_t kGemStats = 3;

inline void check_gem_p(const char* op, const at::Tensor& input,
                        const std::optional<at::Tensor>& p, double p_value) {
  if (p.has_value()) {
    check_float_input(op, "p", *p);
    TORCH_CHECK_VALUE(p->numel() == 1 && p->dim() <= 1, "nanfree.", op,
                      ": a tensor `p` must have shape [] or [1], got ", p->sizes());
    check_same_device(op, "p", input, *p);
  } else {
    // A Python p is used as is: pow(mean, 1/p) needs a finite p > 0.
    TORCH_CHECK_VALUE(std::isfinite(p_value) && p_value > 0, "nanfree.", op,
                      ": `p` must be finite and > 0, got ", p_value);
  }
}

inline void check_gem_input(const char* op, const at::Tensor& input, double eps,
                            const std::optional<at::Tensor>& mask) {
  check_float_input(op, "input", input);
  TORCH_CHECK_VALUE(input.dim() == 3, "nanfree.", op,
                    ": `input` must be 3-D [outer, n, inner] (nanfree.ops.gem views any dims "
                    "so), got ",
                    input.dim(), " dimensions");
  check_eps(op, eps);
  if (mask.has_value()) {
    TORCH_CHECK_TYPE(mask->scalar_type() == at::kBool, "nanfree.", op,
                     ": `mask` must be bool here (nanfree.ops.gem converts integer masks), got ",
                     mask->scalar_type());
    TORCH_CHECK_VALUE(mask->sizes() == input.sizes(), "nanfree.", op, ": `mask` has shape ",
                      mask->sizes(), " but `input` has ", input.sizes());
    check_same_device(op, "mask", input, *mask);
  }
}

// A tensor p in the accumulation dtype as a 0-d tensor on the input's device
// (the kernels clamp it, gem_clamp_p); undefined for a Python p.
inline at::Tensor gem_p_acc(const at::Tensor& input, const std::optional<at::Tensor>& p) {
  if (!p.has_value()) return at::Tensor();
  return p->reshape({}).to(acc_dtype(input.scalar_type())).contiguous();
}

struct GemArgs {
  at::Tensor input;   // contiguous [outer, n, inner]
  at::Tensor p;       // 0-d, accumulation dtype, unclamped; undefined for a Python p
  double p_value;     // the Python p (when p is undefined)
  double eps;
  at::Tensor mask;    // bool, the input's shape, any strides; undefined for none
  at::Tensor output;  // [outer, inner], the input's dtype
  at::Tensor stats;   // [outer, inner, 3], accumulation dtype
  ReductionLayout shape;
};

inline GemArgs prepare_gem(const at::Tensor& input, const std::optional<at::Tensor>& p,
                           double p_value, double eps, const std::optional<at::Tensor>& mask) {
  const char* op = "gem";
  check_gem_input(op, input, eps, mask);
  check_gem_p(op, input, p, p_value);
  GemArgs args;
  args.input = input.contiguous();
  args.p = gem_p_acc(input, p);
  args.p_value = p_value;
  args.eps = eps;
  args.mask = mask.has_value() ? *mask : at::Tensor();
  args.shape = reduction_layout(input, 1);
  args.output = at::empty({args.shape.outer, args.shape.inner}, input.options());
  args.stats = at::empty({args.shape.outer, args.shape.inner, kGemStats},
                         input.options().dtype(acc_dtype(input.scalar_type())));
  return args;
}

struct GemBackwardArgs {
  at::Tensor grad;        // contiguous [outer, inner]
  at::Tensor input;       // contiguous [outer, n, inner]
  at::Tensor p;           // as GemArgs::p
  double p_value;
  at::Tensor stats;       // contiguous [outer, inner, 3]
  double eps;
  at::Tensor mask;
  bool p_grad;            // whether grad_p is wanted (then p is defined)
  at::Tensor grad_input;  // the input's shape and dtype
  at::Tensor grad_p;      // 0-d accumulation dtype when p_grad, else empty [0]
  ReductionLayout shape;
};

inline GemBackwardArgs prepare_gem_backward(const at::Tensor& grad, const at::Tensor& input,
                                            const std::optional<at::Tensor>& p, double p_value,
                                            const at::Tensor& stats, double eps,
                                            const std::optional<at::Tensor>& mask, bool p_grad) {
  const char* op = "gem_backward";
  check_gem_input(op, input, eps, mask);
  check_gem_p(op, input, p, p_value);
  TORCH_CHECK_VALUE(!p_grad || p.has_value(), "nanfree.", op,
                    ": `p_grad` needs a tensor `p` (a Python p has no gradient)");
  const ReductionLayout shape = reduction_layout(input, 1);
  TORCH_CHECK_VALUE(grad.dim() == 2 && grad.size(0) == shape.outer && grad.size(1) == shape.inner &&
                        grad.scalar_type() == input.scalar_type(),
                    "nanfree.", op, ": `grad_output` must be [outer, inner] = [", shape.outer,
                    ", ", shape.inner, "] of the input's dtype, got ", grad.sizes(), " ",
                    grad.scalar_type());
  check_same_device(op, "grad_output", input, grad);
  TORCH_CHECK_VALUE(stats.dim() == 3 && stats.size(0) == shape.outer &&
                        stats.size(1) == shape.inner && stats.size(2) == kGemStats &&
                        stats.scalar_type() == acc_dtype(input.scalar_type()),
                    "nanfree.", op, ": `stats` must be the forward's saved statistics");
  check_same_device(op, "stats", input, stats);
  GemBackwardArgs args;
  args.grad = grad.contiguous();
  args.input = input.contiguous();
  args.p = gem_p_acc(input, p);
  args.p_value = p_value;
  args.stats = stats.contiguous();
  args.eps = eps;
  args.mask = mask.has_value() ? *mask : at::Tensor();
  args.p_grad = p_grad;
  args.shape = shape;
  args.grad_input = at::empty(input.sizes(), input.options());
  const auto acc = input.options().dtype(acc_dtype(input.scalar_type()));
  args.grad_p = p_grad ? at::empty({}, acc) : at::empty({0}, acc);
  return args;
}

}  // namespace nanfree
