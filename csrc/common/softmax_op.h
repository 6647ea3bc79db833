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

// Operator names and C++ signatures of the family's schemas (csrc/registration.cpp).
using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t,
                                                            const std::optional<at::Tensor>&);
using SoftmaxBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, int64_t);
using MaskedBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, int64_t,
                                           const std::optional<at::Tensor>&);

inline std::string forward_name(SoftmaxKind kind) {
  return std::string("nanfree::") + op_name(kind);
}
inline std::string backward_name(SoftmaxKind kind) { return forward_name(kind) + "_backward"; }

// `dim` wrapped into [0, rank) (a 0-d tensor counts as one dimension); IndexError otherwise.
inline int64_t wrap_dim(const char* op, const at::Tensor& input, int64_t dim) {
  return wrap_dim(op, dim, std::max<int64_t>(input.dim(), 1), input.dim());
}

// Whether a tensor of shape `from` broadcasts to `to` without growing it.
inline bool broadcasts_to(at::IntArrayRef from, at::IntArrayRef to) {
  if (from.size() > to.size()) return false;
  const size_t lead = to.size() - from.size();
  for (size_t d = 0; d < from.size(); ++d) {
    if (from[d] != 1 && from[d] != to[lead + d]) return false;
  }
  return true;
}

// The mask as a bool tensor of the input's shape (an expanded view when it
// broadcasts; integer masks become `mask != 0`). TypeError for a float or
// complex mask, ValueError for one on another device or of a shape that does
// not broadcast to the input's.
inline at::Tensor broadcast_mask(const char* op, const at::Tensor& input, const at::Tensor& mask) {
  const at::ScalarType type = mask.scalar_type();
  TORCH_CHECK_TYPE(type == at::kBool || at::isIntegralType(type, /*includeBool=*/false), "nanfree.",
                   op, ": `mask` must be bool or integer (nonzero = keep), got ", type);
  check_same_device(op, "mask", input, mask);
  TORCH_CHECK_VALUE(broadcasts_to(mask.sizes(), input.sizes()), "nanfree.", op, ": `mask` of shape ", mask.sizes(),
                    " does not broadcast to the input's shape ", input.sizes());
  const at::Tensor keep = type == at::kBool ? mask : mask.ne(0);
  return keep.expand(input.sizes());
}

// The [outer, cols, inner] view of a contiguous tensor reduced over `dim`; a
// 0-d tensor is one row of one entry.
inline SoftmaxShape softmax_shape(const at::Tensor& input, int64_t dim) {
  if (input.dim() == 0) return SoftmaxShape{1, 1, 1};
  const auto sizes = input.sizes();
  return SoftmaxShape{c10::multiply_integers(sizes.begin(), sizes.begin() + dim), sizes[dim],
                      c10::multiply_integers(sizes.begin() + dim + 1, sizes.end())};
}

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

// Describes a bool mask of the input's shape (any strides, 0 for broadcast)
// as a MaskView: the reduced dimension moved last (a view), the other
// dimensions collapsed to at most three, or else materialized. `storage`
// keeps whatever `data` points into alive.
inline MaskView make_mask_view(const std::optional<at::Tensor>& mask, int64_t dim,
                               at::Tensor& storage) {
  MaskView view{nullptr, {1, 1, 1}, {0, 0, 0}, 0};
  if (!mask.has_value()) return view;
  storage = mask->dim() == 0 ? *mask : mask->movedim(dim, -1);
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

// A forward's operands after the checks: the input made contiguous, the
// outputs allocated, the mask described as a MaskView. `mask_storage` keeps a
// materialized mask alive for as long as `mask` points into it.
struct ForwardArgs {
  at::Tensor input;
  at::Tensor output;  // the input's shape; without `dim` for logsumexp
  at::Tensor stats;   // (max, log_sum) along `dim`, in the accumulation dtype
  at::Tensor mask_storage;
  MaskView mask;
  SoftmaxShape shape;
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
  args.shape = softmax_shape(args.input, dim);
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
  SoftmaxShape shape;
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
  args.shape = softmax_shape(args.saved, dim);
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
