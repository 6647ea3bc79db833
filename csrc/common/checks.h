// Argument checks and dtypes shared by the ATen bindings of every op family.
// The Python backends raise the same errors with the same words
// (nanfree/_ops/common.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>

#include "nanfree/numerics.h"

namespace nanfree {

// The floating dtypes nanfree's kernels compute in. at::isFloatingType also
// counts the float8 and float4 dtypes, which torch's own math kernels refuse.
inline bool is_kernel_float(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat ||
         dtype == at::kDouble;
}

// TypeError in Python.
inline void check_float_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_kernel_float(t.scalar_type()), "nanfree.", op, ": `", name,
                   "` must be float16, bfloat16, float32 or float64, got ", t.scalar_type());
}

// ValueError in Python.
inline void check_same_device(const char* op, const char* name, const at::Tensor& ref,
                              const at::Tensor& t, const char* ref_name = "input") {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "nanfree.", op, ": `", name, "` is on ",
                    t.device(), " but `", ref_name, "` is on ", ref.device());
}

// `dim` wrapped into [0, rank), IndexError otherwise; `ndim` is the tensor's
// number of dimensions for the message (rank may differ: softmax counts a 0-d
// tensor as one dimension, the cosine ops, whose vectors need one, do not).
inline int64_t wrap_dim(const char* op, int64_t dim, int64_t rank, int64_t ndim) {
  TORCH_CHECK_INDEX(dim >= -rank && dim < rank, "nanfree.", op, ": `dim` ", dim,
                    " is out of range for a tensor of ", ndim, " dimensions");
  return dim < 0 ? dim + rank : dim;
}

// A positive, finite eps (ValueError in Python).
inline void check_eps(const char* op, double eps) {
  TORCH_CHECK_VALUE(eps > 0 && eps < std::numeric_limits<double>::infinity(), "nanfree.", op,
                    ": `eps` must be positive and finite, got ", eps);
}

// Accumulation dtype, also of the saved statistics: float64 for float64, else float32.
inline at::ScalarType acc_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

// The largest finite value of a floating dtype: the bound of a saturated
// output of that dtype (saturate of nanfree/numerics.h).
inline double largest_finite(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return kFloat16Largest;
    case at::kBFloat16: return kBFloat16Largest;
    case at::kFloat: return nf_largest<float>();
    default: return nf_largest<double>();
  }
}

}  // namespace nanfree
