// ATen-side helpers shared by the CPU and CUDA registrations of the softmax
// family: argument checks, output allocation, the [rows, cols] view and the
// mask layout. Each binding calls prepare_forward / prepare_backward and then
// only launches its kernels.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "nanfree/softmax_math.h"

namespace nanfree {

inline void check_float_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "nanfree.", op, ": `", name,
              "` must be float16, bfloat16, float32 or float64, got ", t.scalar_type());
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& ref,
                              const at::Tensor& t) {
  TORCH_CHECK(t.device() == ref.device(), "nanfree.", op, ": `", name, "` is on ", t.device(),
              " but the input is on ", ref.device());
}

inline void check_mask(const char* op, const at::Tensor& input, const at::Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, "nanfree.", op,
              ": `mask` must be bool at the op level (nanfree.ops converts integer masks), got ",
              mask.scalar_type());
  TORCH_CHECK(mask.sizes() == input.sizes(), "nanfree.", op, ": `mask` must have the input's shape ",
              input.sizes(), " (nanfree.ops broadcasts it), got ", mask.sizes());
  check_same_device(op, "mask", input, mask);
}

// Accumulation dtype, also of the saved row statistics: float64 for float64, else float32.
inline at::ScalarType acc_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

// The last dimension is the reduced one: cols = its size, rows = the product of the others.
struct RowsCols {
  int64_t rows;
  int64_t cols;
};

inline RowsCols rows_cols(const at::Tensor& input) {
  if (input.dim() == 0) return RowsCols{1, 1};
  const auto sizes = input.sizes();
  return RowsCols{c10::multiply_integers(sizes.begin(), sizes.end() - 1), sizes.back()};
}

// Shape of the per-row results (logsumexp): the input's shape without its last dim.
inline std::vector<int64_t> row_shape(const at::Tensor& input) {
  if (input.dim() == 0) return {};
  return std::vector<int64_t>(input.sizes().begin(), input.sizes().end() - 1);
}

// Describes a bool mask of the input's shape (any strides, 0 for broadcast) as
// a MaskView: leading dims collapsed to at most three, or else materialized.
// `storage` keeps a materialized copy alive.
inline MaskView make_mask_view(const std::optional<at::Tensor>& mask, at::Tensor& storage) {
  MaskView view{nullptr, {1, 1, 1}, {0, 0, 0}, 0};
  if (!mask.has_value()) return view;
  storage = *mask;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int64_t ndim = storage.dim();
    view.col_stride = ndim == 0 ? 0 : storage.stride(-1);
    std::vector<int64_t> sizes, strides;
    for (int64_t d = 0; d + 1 < ndim; ++d) {
      if (storage.size(d) == 1) continue;
      if (!sizes.empty() && strides.back() == storage.stride(d) * storage.size(d)) {
        sizes.back() *= storage.size(d);
        strides.back() = storage.stride(d);
      } else {
        sizes.push_back(storage.size(d));
        strides.push_back(storage.stride(d));
      }
    }
    if (sizes.size() <= 3) {
      const size_t pad = 3 - sizes.size();
      for (size_t i = 0; i < 3; ++i) {
        view.sizes[i] = i < pad ? 1 : sizes[i - pad];
        view.strides[i] = i < pad ? 0 : strides[i - pad];
      }
      view.data = storage.const_data_ptr<bool>();
      return view;
    }
    storage = storage.contiguous();
  }
  TORCH_INTERNAL_ASSERT(false, "a contiguous mask always collapses");
  return view;
}

// Shape of the saved row statistics (max, log_sum): the row shape plus a last dim of 2.
inline std::vector<int64_t> stats_shape(const at::Tensor& input) {
  std::vector<int64_t> shape = row_shape(input);
  shape.push_back(2);
  return shape;
}

// A forward's operands after the checks: the input made contiguous, the
// outputs allocated, the mask described as a MaskView. `mask_storage` keeps a
// materialized mask alive for as long as `mask` points into it.
struct ForwardArgs {
  at::Tensor input;
  at::Tensor output;  // the input's shape; the row shape for logsumexp
  at::Tensor stats;   // per-row (max, log_sum), in the accumulation dtype
  at::Tensor mask_storage;
  MaskView mask;
  RowsCols shape;
};

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

inline ForwardArgs prepare_forward(SoftmaxKind kind, const at::Tensor& input,
                                   const std::optional<at::Tensor>& mask) {
  const char* op = op_name(kind);
  check_float_input(op, "input", input);
  if (mask.has_value()) check_mask(op, input, *mask);
  ForwardArgs args;
  args.input = input.contiguous();
  args.stats = at::empty(stats_shape(input), input.options().dtype(acc_dtype(input.scalar_type())));
  args.output = kind == SoftmaxKind::LogSumExp ? at::empty(row_shape(input), input.options())
                                               : at::empty(input.sizes(), input.options());
  args.mask = make_mask_view(mask, args.mask_storage);
  args.shape = rows_cols(args.input);
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
  RowsCols shape;
};

inline BackwardArgs prepare_backward(SoftmaxKind kind, const at::Tensor& grad,
                                     const at::Tensor& saved, const at::Tensor& stats,
                                     const std::optional<at::Tensor>& mask) {
  const char* op = backward_op_name(kind);
  check_float_input(op, "grad_output", grad);
  check_float_input(op, "saved", saved);
  TORCH_CHECK(grad.scalar_type() == saved.scalar_type(), "nanfree.", op, ": `grad_output` dtype ",
              grad.scalar_type(), " differs from the saved tensor's ", saved.scalar_type());
  const auto expected_grad =
      kind == SoftmaxKind::LogSumExp ? row_shape(saved) : saved.sizes().vec();
  TORCH_CHECK(grad.sizes().vec() == expected_grad, "nanfree.", op, ": `grad_output` has shape ",
              grad.sizes(), ", expected ", at::IntArrayRef(expected_grad));
  TORCH_CHECK(stats.sizes().vec() == stats_shape(saved) &&
                  stats.scalar_type() == acc_dtype(saved.scalar_type()),
              "nanfree.", op, ": `stats` must be the forward's saved row statistics");
  check_same_device(op, "grad_output", saved, grad);
  check_same_device(op, "stats", saved, stats);
  if (mask.has_value()) check_mask(op, saved, *mask);
  BackwardArgs args;
  args.grad = grad.contiguous();
  args.saved = saved.contiguous();
  args.stats = stats.contiguous();
  args.grad_input = at::empty(saved.sizes(), saved.options());
  args.mask = make_mask_view(mask, args.mask_storage);
  args.shape = rows_cols(args.saved);
  return args;
}

// softmax's backward op takes no mask (a dropped entry's output is 0): a
// binding's masked backward serves it with no mask.
using MaskedBackward = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&);
template <MaskedBackward backward>
at::Tensor backward_without_mask(const at::Tensor& grad, const at::Tensor& output,
                                 const at::Tensor& stats) {
  return backward(grad, output, stats, std::nullopt);
}

}  // namespace nanfree
