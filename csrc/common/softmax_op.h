// ATen-side helpers shared by the CPU and CUDA registrations of the softmax
// family: argument checks, output allocation, the [outer, cols, inner] view
// and the mask layout. Each binding calls prepare_forward / prepare_backward
// and then only launches its kernels. The Python backends raise the same
// errors with the same words (nanfree/_ops/softmax.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/layout.h"
#include "nanfree/softmax_math.h"

namespace nanfree {

// The op's name in error messages.
constexpr const char* op_name(SoftmaxKind kind) {
  return kind == SoftmaxKind::Softmax      ? "softmax"
         : kind == SoftmaxKind::LogSoftmax ? "log_softmax"
                                           : "logsumexp";
}
constexpr const char* backward_op_name(SoftmaxKind kind) {
  return kind == SoftmaxKind::Softmax      ? "softmax_backward"
         : kind == SoftmaxKind::LogSoftmax ? "log_softmax_backward"
                                           : "logsumexp_backward";
}

inline std::string forward_name(SoftmaxKind kind) {
  return std::string("nanfree::") + op_name(kind);
}
inline std::string backward_name(SoftmaxKind kind) { return forward_name(kind) + "_backward"; }

// Shape of the per-row results (logsumexp): the input's shape without `dim`.
inline std::vector<int64_t> row_shape(const at::Tensor& input, int64_t dim) {
  std::vector<int64_t> shape = input.sizes().vec();
  if (!shape.empty()) shape.erase(shape.begin() + dim);
  return shape;
}

// Shape of the saved row statistics: the input's shape with `dim` of size 2
// holding (max, log_sum); [2] for a 0-d input.
inline std::vector<int64_t> stats_shape(const at::Tensor& input, int64_t dim) {
  std::vector<int64_t> shape = input.sizes().vec();
  if (shape.empty()) return {2};
  shape[dim] = 2;
  return shape;
}

// A forward's operands after the checks: the input made contiguous, the
// outputs allocated, the mask described as a MaskView. `mask_storage` keeps a
// materialized mask alive for as long as `mask` points into it.
struct ForwardArgs {
  at::Tensor input;
  at::Tensor output;  // the input's shape; without `dim` for logsumexp
  at::Tensor stats;   // (max, log_sum) along `dim`, in the accumulation dtype
  at::Tensor mask_storage;
  MaskView mask;
  ReductionLayout shape;
};

inline ForwardArgs prepare_forward(SoftmaxKind kind, const at::Tensor& input, int64_t dim,
                                   const std::optional<at::Tensor>& mask) {
  const char* op = op_name(kind);
  check_float_input(op, "input", input);
  dim = wrap_dim(op, input, dim);
  std::optional<at::Tensor> keep;
  if (mask.has_value()) keep = broadcast_mask(op, input, *mask);
  ForwardArgs args;
  args.input = input.contiguous();
  args.stats =
      at::empty(stats_shape(input, dim), input.options().dtype(acc_dtype(input.scalar_type())));
  args.output = kind == SoftmaxKind::LogSumExp ? at::empty(row_shape(input, dim), input.options())
                                               : at::empty(input.sizes(), input.options());
  args.mask = make_mask_view(keep, dim, args.mask_storage);
  args.shape = reduction_layout(args.input, dim);
  return args;
}

// A backward's operands after the checks, contiguous, with grad_input allocated.
// `saved` is the forward's output (softmax, log_softmax) or input (logsumexp).
struct BackwardArgs {
  at::Tensor grad;
  at::Tensor saved;
  at::Tensor stats;
  at::Tensor grad_input;
  at::Tensor mask_storage;
  MaskView mask;
  ReductionLayout shape;
};

inline BackwardArgs prepare_backward(SoftmaxKind kind, const at::Tensor& grad,
                                     const at::Tensor& saved, const at::Tensor& stats, int64_t dim,
                                     const std::optional<at::Tensor>& mask) {
  const char* op = backward_op_name(kind);
  check_float_input(op, "grad_output", grad);
  check_float_input(op, "saved", saved);
  dim = wrap_dim(op, saved, dim);
  TORCH_CHECK_TYPE(grad.scalar_type() == saved.scalar_type(), "nanfree.", op,
                   ": `grad_output` dtype ", grad.scalar_type(), " differs from the saved tensor's ",
                   saved.scalar_type());
  const auto expected_grad =
      kind == SoftmaxKind::LogSumExp ? row_shape(saved, dim) : saved.sizes().vec();
  TORCH_CHECK_VALUE(grad.sizes().vec() == expected_grad, "nanfree.", op,
                    ": `grad_output` has shape ", grad.sizes(), ", expected ",
                    at::IntArrayRef(expected_grad));
  TORCH_CHECK_VALUE(stats.sizes().vec() == stats_shape(saved, dim) &&
                        stats.scalar_type() == acc_dtype(saved.scalar_type()),
                    "nanfree.", op, ": `stats` must be the forward's saved row statistics");
  check_same_device(op, "grad_output", saved, grad);
  check_same_device(op, "stats", saved, stats);
  std::optional<at::Tensor> keep;
  if (mask.has_value()) keep = broadcast_mask(op, saved, *mask);
  BackwardArgs args;
  args.grad = grad.contiguous();
  args.saved = saved.contiguous();
  args.stats = stats.contiguous();
  args.grad_input = at::empty(saved.sizes(), saved.options());
  args.mask = make_mask_view(keep, dim, args.mask_storage);
  args.shape = reduction_layout(args.saved, dim);
  return args;
}

// softmax's backward op takes no mask (a dropped entry's output is 0): a
// binding's masked backward serves it with no mask.
using MaskedBackward = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      int64_t, const std::optional<at::Tensor>&);
template <MaskedBackward backward>
at::Tensor backward_without_mask(const at::Tensor& grad, const at::Tensor& output,
                                 const at::Tensor& stats, int64_t dim) {
  return backward(grad, output, stats, dim, std::nullopt);
}

}  // namespace nanfree
