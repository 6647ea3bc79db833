// Python entry points of the cosine family: nanfree.ops.cosine_similarity,
// normalize (p = 2) and cos_sim call these (outside torch.compile). They do
// what torch's functions do around the computation (dtype promotion,
// broadcasting, moving `dim` last, 1-D inputs of cos_sim as one row) with
// views, then call the last-dim ops through the dispatcher, so autograd,
// autocast, fake tensors and every backend behave as through torch.ops.
// nanfree/ops.py holds the same steps for torch.compile to trace.
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/cosine_op.h"
#include "common/find_op.h"
#include "python_module.h"

namespace nanfree {
namespace {

// The dtype two inputs are computed in (torch's promotion); both must be floating.
at::ScalarType common_float_dtype(const char* op, const char* name1, const at::Tensor& t1,
                                  const char* name2, const at::Tensor& t2) {
  check_float_input(op, name1, t1);
  check_float_input(op, name2, t2);
  return at::promote_types(t1.scalar_type(), t2.scalar_type());
}

// The broadcast shape of two shapes; ValueError when they do not broadcast.
std::vector<int64_t> broadcast_shape(const char* op, const at::Tensor& x1, const at::Tensor& x2) {
  const int64_t rank = std::max(x1.dim(), x2.dim());
  std::vector<int64_t> shape(rank);
  for (int64_t i = 0; i < rank; ++i) {
    const int64_t a = i < rank - x1.dim() ? 1 : x1.size(i - (rank - x1.dim()));
    const int64_t b = i < rank - x2.dim() ? 1 : x2.size(i - (rank - x2.dim()));
    TORCH_CHECK_VALUE(a == b || a == 1 || b == 1, "nanfree.", op, ": `x1` of shape ", x1.sizes(),
                      " and `x2` of shape ", x2.sizes(), " do not broadcast");
    shape[i] = a == 1 ? b : a;
  }
  return shape;
}

at::Tensor cosine_similarity(const at::Tensor& x1, const at::Tensor& x2, int64_t dim, double eps) {
  static const auto op = find_op<CosineSignature>("nanfree::cosine_similarity");
  const char* name = "cosine_similarity";
  const at::ScalarType dtype = common_float_dtype(name, "x1", x1, "x2", x2);
  check_same_device(name, "x2", x1, x2, "x1");
  const std::vector<int64_t> shape = broadcast_shape(name, x1, x2);
  const auto rank = static_cast<int64_t>(shape.size());
  dim = wrap_dim(name, dim, rank, rank);
  const auto vectors_last = [&](const at::Tensor& t) {
    return t.to(dtype).expand(shape).movedim(dim, -1);
  };
  return std::get<0>(op.call(vectors_last(x1), vectors_last(x2), eps));
}

at::Tensor normalize(const at::Tensor& input, int64_t dim, double eps) {
  static const auto op = find_op<NormalizeSignature>("nanfree::normalize");
  check_float_input("normalize", "input", input);
  dim = wrap_dim("normalize", dim, input.dim(), input.dim());
  return std::get<0>(op.call(input.movedim(dim, -1), eps)).movedim(-1, dim);
}

// sentence-transformers' cos_sim: 1-D inputs are one row; rows normalized with
// F.normalize's eps, then one GEMM, clamped.
at::Tensor cos_sim(const at::Tensor& a, const at::Tensor& b) {
  static const auto normalize_op = find_op<NormalizeSignature>("nanfree::normalize");
  static const auto matrix_op = find_op<CosSimMatrixSignature>("nanfree::cos_sim_matrix");
  const char* name = "cos_sim";
  const at::ScalarType dtype = common_float_dtype(name, "a", a, "b", b);
  check_same_device(name, "b", a, b, "a");
  const auto rows = [&](const at::Tensor& t, const char* arg) {
    TORCH_CHECK_VALUE(t.dim() == 1 || t.dim() == 2, "nanfree.cos_sim: `", arg,
                      "` must be 1-D or 2-D, got ", t.dim(), " dimensions");
    return t.dim() == 1 ? t.unsqueeze(0) : t;
  };
  // Every check before the first kernel.
  const at::Tensor a_rows = rows(a, "a"), b_rows = rows(b, "b");
  TORCH_CHECK_VALUE(a_rows.size(1) == b_rows.size(1), "nanfree.cos_sim: `a` has vectors of ",
                    a_rows.size(1), " entries but `b` of ", b_rows.size(1));
  const auto normalized = [&](const at::Tensor& t) {
    return std::get<0>(normalize_op.call(t.to(dtype), kCosSimEps));
  };
  return matrix_op.call(normalized(a_rows), normalized(b_rows));
}

}  // namespace

void bind_cosine(pybind11::module_& m) {
  namespace py = pybind11;
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("cosine_similarity", &cosine_similarity, release);
  m.def("normalize", &normalize, release);
  m.def("cos_sim", &cos_sim, release);
  m.attr("COS_SIM_EPS") = kCosSimEps;
}

}  // namespace nanfree
