// ATen-side helpers shared by the CPU and CUDA registrations of the cosine
// family (normalize, cosine_similarity, cos_sim_matrix): argument checks,
// output allocation and the [rows, d] view of the last dimension. The Python
// backends raise the same errors (nanfree/_ops/cosine.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <tuple>
#include <vector>

#include "common/checks.h"
#include "nanfree/cosine_math.h"

namespace nanfree {

// The eps of cos_sim's normalization: F.normalize's default, which
// sentence-transformers' cos_sim uses.
constexpr double kCosSimEps = 1e-12;

// The last dimension holds the vectors: d entries each, rows = the product of the others.
struct VectorRows {
  int64_t rows;
  int64_t d;
};

inline void check_has_vectors(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 1, "nanfree.", op, ": `", name,
                    "` must have at least one dimension (the vectors' last), got a 0-d tensor");
}

inline VectorRows vector_rows(const at::Tensor& t) {
  const auto sizes = t.sizes();
  return VectorRows{c10::multiply_integers(sizes.begin(), sizes.end() - 1), sizes.back()};
}

// The shape of per-vector results: the input's without its last dimension,
// plus `extra` trailing entries when extra > 0.
inline std::vector<int64_t> per_vector_shape(const at::Tensor& t, int64_t extra = 0) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end() - 1);
  if (extra > 0) shape.push_back(extra);
  return shape;
}

inline at::Tensor empty_stats(const at::Tensor& t, int64_t count) {
  return at::empty(per_vector_shape(t, count), t.options().dtype(acc_dtype(t.scalar_type())));
}

inline void check_stats(const char* op, const at::Tensor& ref, const char* ref_name,
                        const at::Tensor& stats, int64_t count) {
  TORCH_CHECK_VALUE(stats.sizes().vec() == per_vector_shape(ref, count) &&
                        stats.scalar_type() == acc_dtype(ref.scalar_type()),
                    "nanfree.", op, ": `stats` must be the forward's saved statistics");
  check_same_device(op, "stats", ref, stats, ref_name);
}

// Two tensors of one shape and dtype on one device (nanfree.ops broadcasts and promotes).
inline void check_pair(const char* op, const char* name, const at::Tensor& ref,
                       const char* ref_name, const at::Tensor& t) {
  check_float_input(op, name, t);
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "nanfree.", op, ": `", name,
                   "` dtype ", t.scalar_type(), " differs from `", ref_name, "`'s ",
                   ref.scalar_type(), " (nanfree.ops promotes them)");
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), "nanfree.", op, ": `", name, "` has shape ",
                    t.sizes(), " but `", ref_name, "` has ", ref.sizes(),
                    " (nanfree.ops broadcasts them)");
  check_same_device(op, name, ref, t, ref_name);
}

struct NormalizeArgs {
  at::Tensor input;   // contiguous
  at::Tensor output;  // the input's shape
  at::Tensor stats;   // [..., 2]
  VectorRows shape;
};

inline NormalizeArgs prepare_normalize(const at::Tensor& input, double eps) {
  check_float_input("normalize", "input", input);
  check_has_vectors("normalize", "input", input);
  check_eps("normalize", eps);
  NormalizeArgs args;
  args.input = input.contiguous();
  args.output = at::empty(input.sizes(), input.options());
  args.stats = empty_stats(input, kNormalizeStats);
  args.shape = vector_rows(input);
  return args;
}

struct NormalizeBackwardArgs {
  at::Tensor grad;
  at::Tensor output;
  at::Tensor stats;
  at::Tensor grad_input;
  VectorRows shape;
};

inline NormalizeBackwardArgs prepare_normalize_backward(const at::Tensor& grad,
                                                       const at::Tensor& output,
                                                       const at::Tensor& stats) {
  const char* op = "normalize_backward";
  check_float_input(op, "output", output);
  check_has_vectors(op, "output", output);
  check_pair(op, "grad_output", output, "output", grad);
  check_stats(op, output, "output", stats, kNormalizeStats);
  NormalizeBackwardArgs args;
  args.grad = grad.contiguous();
  args.output = output.contiguous();
  args.stats = stats.contiguous();
  args.grad_input = at::empty(output.sizes(), output.options());
  args.shape = vector_rows(output);
  return args;
}

struct CosineArgs {
  at::Tensor x1;      // contiguous
  at::Tensor x2;      // contiguous
  at::Tensor output;  // x1.shape[:-1]
  at::Tensor stats;   // [..., 6]
  VectorRows shape;
};

inline CosineArgs prepare_cosine(const at::Tensor& x1, const at::Tensor& x2, double eps) {
  const char* op = "cosine_similarity";
  check_float_input(op, "x1", x1);
  check_has_vectors(op, "x1", x1);
  check_pair(op, "x2", x1, "x1", x2);
  check_eps(op, eps);
  CosineArgs args;
  args.x1 = x1.contiguous();
  args.x2 = x2.contiguous();
  args.output = at::empty(per_vector_shape(x1), x1.options());
  args.stats = empty_stats(x1, kCosineStats);
  args.shape = vector_rows(x1);
  return args;
}

struct CosineBackwardArgs {
  at::Tensor grad;    // x1.shape[:-1]
  at::Tensor x1;
  at::Tensor x2;
  at::Tensor output;  // the forward's similarities, x1.shape[:-1]
  at::Tensor stats;
  at::Tensor grad_x1;
  at::Tensor grad_x2;
  VectorRows shape;
};

inline CosineBackwardArgs prepare_cosine_backward(const at::Tensor& grad, const at::Tensor& x1,
                                                  const at::Tensor& x2, const at::Tensor& output,
                                                  const at::Tensor& stats) {
  const char* op = "cosine_similarity_backward";
  check_float_input(op, "x1", x1);
  check_has_vectors(op, "x1", x1);
  check_pair(op, "x2", x1, "x1", x2);
  check_float_input(op, "output", output);
  check_pair(op, "grad_output", output, "output", grad);
  TORCH_CHECK_VALUE(output.sizes().vec() == per_vector_shape(x1) &&
                        output.scalar_type() == x1.scalar_type(),
                    "nanfree.", op, ": `output` must be the forward's output");
  check_same_device(op, "output", x1, output, "x1");
  check_stats(op, x1, "x1", stats, kCosineStats);
  CosineBackwardArgs args;
  args.grad = grad.contiguous();
  args.x1 = x1.contiguous();
  args.x2 = x2.contiguous();
  args.output = output.contiguous();
  args.stats = stats.contiguous();
  args.grad_x1 = at::empty(x1.sizes(), x1.options());
  args.grad_x2 = at::empty(x2.sizes(), x2.options());
  args.shape = vector_rows(x1);
  return args;
}

// cos_sim_matrix's operands: a [N, d] and b [M, d] of one dtype and device.
inline void check_cos_sim_matrix(const at::Tensor& a, const at::Tensor& b) {
  const char* op = "cos_sim_matrix";
  check_float_input(op, "a", a);
  check_float_input(op, "b", b);
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "nanfree.", op,
                    ": `a` and `b` must be [N, d] and [M, d], got ", a.sizes(), " and ",
                    b.sizes());
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "nanfree.", op, ": `b` dtype ",
                   b.scalar_type(), " differs from `a`'s ", a.scalar_type());
  check_same_device(op, "b", a, b, "a");
}

}  // namespace nanfree
