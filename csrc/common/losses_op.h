// The losses family's argument checks, shared by the CPU and CUDA
// registrations (and mirrored with the same words by nanfree/_ops/losses.py):
// pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma),
// its backward, cross_entropy and its backward of csrc/registration.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common/checks.h"
#include "common/layout.h"  // broadcasts_to
#include "nanfree/losses_math.h"

namespace nanfree {

inline void check_loss_same(const char* op, const char* name, const at::Tensor& ref,
                            const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes() && t.scalar_type() == ref.scalar_type(), "nanfree.",
                    op, ": `", name, "` must have the input's shape ", ref.sizes(), " and dtype ",
                    ref.scalar_type(), ", got ", t.sizes(), " ", t.scalar_type());
  check_same_device(op, name, ref, t);
}

inline void check_loss_broadcast_operand(const char* op, const char* name, const at::Tensor& ref,
                                         const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->scalar_type() == ref.scalar_type() && broadcasts_to(t->sizes(), ref.sizes()),
                    "nanfree.", op, ": `", name, "` must be of the input's dtype ",
                    ref.scalar_type(), " and broadcast to its shape ", ref.sizes(), ", got ",
                    t->sizes(), " ", t->scalar_type());
  check_same_device(op, name, ref, *t);
}

inline void check_pointwise_loss(const at::Tensor& input, const at::Tensor& target,
                                 const std::optional<at::Tensor>& weight,
                                 const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                 double gamma, const char* op = "pointwise_loss") {
  check_float_input(op, "input", input);
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 4, "nanfree.", op,
                    ": `kind` must be 0 to 4 (PointwiseLoss), got ", kind);
  check_loss_same(op, "target", input, target);
  check_loss_broadcast_operand(op, "weight", input, weight);
  check_loss_broadcast_operand(op, "pos_weight", input, pos_weight);
  TORCH_CHECK_VALUE(kind != static_cast<int64_t>(PointwiseLoss::SigmoidFocal) || gamma >= 0,
                    "nanfree.", op, ": `gamma` must be >= 0, got ", gamma);
}

inline void check_pointwise_loss_backward(const at::Tensor& grad, const at::Tensor& input,
                                          const at::Tensor& target,
                                          const std::optional<at::Tensor>& weight,
                                          const std::optional<at::Tensor>& pos_weight,
                                          int64_t kind, double gamma, int64_t partial) {
  check_pointwise_loss(input, target, weight, pos_weight, kind, gamma);
  const char* op = "pointwise_loss_backward";
  TORCH_CHECK_VALUE(partial == 0 || partial == 1, "nanfree.", op,
                    ": `partial` must be 0 (input) or 1 (target), got ", partial);
  check_loss_broadcast_operand(op, "grad", input, grad);
}

// A tensor of the input's shape from an optional operand that broadcasts to
// it (an expanded view), or a 0-d 1 where it is absent.
inline at::Tensor loss_operand_or_one(const std::optional<at::Tensor>& t, const at::Tensor& input) {
  if (!t.has_value()) return at::ones({}, input.options());
  return t->expand(input.sizes());
}

inline void check_cross_entropy(const at::Tensor& input, const at::Tensor& target,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& mask, double label_smoothing) {
  const char* op = "cross_entropy";
  check_float_input(op, "input", input);
  TORCH_CHECK_VALUE(input.dim() == 3, "nanfree.", op, ": `input` must be [outer, C, inner], got ",
                    input.sizes());
  const int64_t outer = input.size(0), classes = input.size(1), inner = input.size(2);
  if (target.scalar_type() == at::kLong) {
    TORCH_CHECK_VALUE(target.dim() == 2 && target.size(0) == outer && target.size(1) == inner,
                      "nanfree.", op, ": class-index `target` must be [outer, inner] = [", outer,
                      ", ", inner, "], got ", target.sizes());
  } else {
    TORCH_CHECK_VALUE(target.scalar_type() == input.scalar_type() && target.sizes() == input.sizes(),
                      "nanfree.", op,
                      ": `target` must be int64 [outer, inner] (class indices) or of the input's "
                      "shape ",
                      input.sizes(), " and dtype ", input.scalar_type(), " (probabilities), got ",
                      target.sizes(), " ", target.scalar_type());
  }
  check_same_device(op, "target", input, target);
  if (weight.has_value()) {
    TORCH_CHECK_VALUE(weight->scalar_type() == input.scalar_type() && weight->dim() == 1 &&
                          weight->size(0) == classes,
                      "nanfree.", op, ": `weight` must be [C] = [", classes,
                      "] of the input's dtype ", input.scalar_type(), ", got ", weight->sizes(),
                      " ", weight->scalar_type());
    check_same_device(op, "weight", input, *weight);
  }
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool && mask->sizes() == input.sizes(), "nanfree.",
                      op, ": `mask` must be bool of the input's shape ", input.sizes(), ", got ",
                      mask->sizes(), " ", mask->scalar_type());
    check_same_device(op, "mask", input, *mask);
  }
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, "nanfree.", op,
                    ": `label_smoothing` must be in [0, 1], got ", label_smoothing);
}

inline void check_cross_entropy_backward(const at::Tensor& grad, const at::Tensor& input,
                                         const at::Tensor& target,
                                         const std::optional<at::Tensor>& weight,
                                         const std::optional<at::Tensor>& mask,
                                         double label_smoothing, const at::Tensor& stats,
                                         bool target_grad) {
  check_cross_entropy(input, target, weight, mask, label_smoothing);
  const char* op = "cross_entropy_backward";
  const int64_t outer = input.size(0), inner = input.size(2);
  const at::ScalarType acc = acc_dtype(input.scalar_type());
  TORCH_CHECK_VALUE(grad.scalar_type() == acc && grad.dim() == 2 && grad.size(0) == outer &&
                        grad.size(1) == inner,
                    "nanfree.", op, ": `grad` must be [outer, inner] = [", outer, ", ", inner,
                    "] of ", acc, ", got ", grad.sizes(), " ", grad.scalar_type());
  TORCH_CHECK_VALUE(stats.scalar_type() == acc && stats.dim() == 3 && stats.size(0) == outer &&
                        stats.size(1) == inner && stats.size(2) == kCrossEntropyStats,
                    "nanfree.", op, ": `stats` must be [outer, inner, ", kCrossEntropyStats,
                    "] of ", acc, " (cross_entropy's), got ", stats.sizes(), " ",
                    stats.scalar_type());
  check_same_device(op, "grad", input, grad);
  check_same_device(op, "stats", input, stats);
  TORCH_CHECK_VALUE(!target_grad || target.scalar_type() != at::kLong, "nanfree.", op,
                    ": `target_grad` needs a probability target");
}

}  // namespace nanfree
