// The cosine family's C++ side shared by every backend (C++, CUDA, Triton,
// pure torch): its autograd, registered once at the Autograd key, and the
// Python entry points of nanfree.ops.
//
// Autograd: normalize and cosine_similarity save what their hand-written
// backward ops need (the output or inputs and the per-vector statistics);
// cos_sim_matrix's gradient is two matrix products, the clamp passing straight
// through (it only removes rounding past +-1). Double backward through the
// backward ops refuses with a clear error.
//
// Python entry points: nanfree.ops.cosine_similarity, normalize (p = 2) and
// cos_sim call these (outside torch.compile). They do what torch's functions
// do around the computation (dtype promotion, broadcasting, moving `dim`
// last, 1-D inputs of cos_sim as one row) with views, then call the last-dim
// ops through the dispatcher, so autograd, autocast, fake tensors and every
// backend behave as through torch.ops. nanfree/ops.py holds the same steps
// for torch.compile to trace.
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>
#include <pybind11/pybind11.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "common/autograd.h"
#include "common/checks.h"
#include "common/cosine_op.h"
#include "common/find_op.h"
#include "python_module.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> call_normalize(const at::Tensor& input, double eps) {
  static const auto op = find_op<NormalizeSignature>("nanfree::normalize");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(input, eps);
}

// The backward ops through the whole dispatcher, autograd included: called from
// a node's backward, so that with create_graph=True the gradient records the
// node that refuses double backward (below autograd it would record nothing,
// and a second derivative would silently lose this op's term).
at::Tensor normalize_backward_op(const at::Tensor& grad, const at::Tensor& output,
                                 const at::Tensor& stats) {
  static const auto op = find_op<NormalizeBackwardSignature>("nanfree::normalize_backward");
  return op.call(grad, output, stats);
}

std::tuple<at::Tensor, at::Tensor> cosine_backward_op(const at::Tensor& grad, const at::Tensor& x1,
                                                      const at::Tensor& x2,
                                                      const at::Tensor& output,
                                                      const at::Tensor& stats) {
  static const auto op =
      find_op<CosineBackwardSignature>("nanfree::cosine_similarity_backward");
  return op.call(grad, x1, x2, output, stats);
}

std::tuple<at::Tensor, at::Tensor> call_cosine(const at::Tensor& x1, const at::Tensor& x2,
                                               double eps) {
  static const auto op = find_op<CosineSignature>("nanfree::cosine_similarity");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x1, x2, eps);
}

at::Tensor call_cos_sim_matrix(const at::Tensor& a, const at::Tensor& b) {
  static const auto op = find_op<CosSimMatrixSignature>("nanfree::cos_sim_matrix");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(a, b);
}

// Graph nodes, named as torch names its own (grad_fn=<NanfreeNormalizeBackward>).
struct NanfreeNormalizeBackward final : torch::autograd::Function<NanfreeNormalizeBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, double eps) {
    auto [output, stats] = call_normalize(input, eps);
    ctx->save_for_backward({output, stats});
    ctx->mark_non_differentiable({stats});
    ctx->set_materialize_grads(false);  // no zero tensor for an unused output
    return {output, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    return {normalize_backward_op(grads[0], saved[0], saved[1]), at::Tensor()};
  }
};

struct NanfreeCosineSimilarityBackward final
    : torch::autograd::Function<NanfreeCosineSimilarityBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x1, const at::Tensor& x2,
                               double eps) {
    auto [output, stats] = call_cosine(x1, x2, eps);
    ctx->save_for_backward({x1, x2, output, stats});
    ctx->mark_non_differentiable({stats});
    ctx->set_materialize_grads(false);
    return {output, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    auto [grad_x1, grad_x2] = cosine_backward_op(grads[0], saved[0], saved[1], saved[2], saved[3]);
    // One kernel gives both gradients; an input that needs none gets none.
    return {ctx->needs_input_grad(0) ? grad_x1 : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_x2 : at::Tensor(), at::Tensor()};
  }
};

struct NanfreeCosSimMatrixBackward final : torch::autograd::Function<NanfreeCosSimMatrixBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    return {call_cos_sim_matrix(a, b)};
  }

  // S = clamp(a @ b.T): dA = G @ b, dB = G.T @ a (the clamp passes straight through).
  // The rows of a and b are unit vectors, so |dA_ij| <= the sum over a row of
  // |G|: with G near the dtype's largest value that sum overflows (inf, then
  // NaN in normalize's backward) where the gradient need not. The products are
  // taken with the other operand scaled by s = 2^-k, the power of two that
  // keeps max|G| * (terms summed) below a quarter of the range (s = 1 for any
  // ordinary G), then scaled back with saturation: exact, and on the device
  // (no host sync, so CUDA graphs capture it). On the CPU the plain products
  // are tried first.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& grad = grads[0];
    const bool want_a = ctx->needs_input_grad(0), want_b = ctx->needs_input_grad(1);
    if (!want_a && !want_b) return {at::Tensor(), at::Tensor()};
    auto plain = [&]() -> variable_list {
      return {want_a ? at::mm(grad, saved[1]) : at::Tensor(),
              want_b ? at::mm(grad.t(), saved[0]) : at::Tensor()};
    };
    // No sum to overflow (and no max to take). A symbolic size (torch.compile)
    // is compared with a guard.
    if (grad.sym_numel() == 0) return plain();
    // A traced tensor (fake, functional: the Python key) has no values to check.
    if (grad.device().is_cpu() && !grad.key_set().has(c10::DispatchKey::Python)) {
      // On the CPU a host check is free: the plain products, kept unless one
      // holds inf or NaN (a sum that overflowed stays so), which costs a pass
      // over the [N, d] and [M, d] results instead of one over G.
      const variable_list products = plain();
      const bool finite = std::all_of(products.begin(), products.end(), [](const at::Tensor& t) {
        return !t.defined() || at::isfinite(t).all().item<bool>();
      });
      if (finite) return products;
    }
    const double largest = largest_finite(grad.scalar_type());
    const at::ScalarType acc = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const int64_t terms = std::max<int64_t>(std::max(grad.size(0), grad.size(1)), 1);
    // In logarithms: max|G| * terms itself may overflow.
    const double log2_room = std::log2(static_cast<double>(terms)) - std::log2(largest / 4);
    // A NaN or infinite G passes through unscaled (its NaN is the caller's): k = 0.
    // max|G| from one pass of aminmax (abs() would write a copy of G first).
    const auto [low, high] = at::aminmax(grad);
    const at::Tensor amax = at::maximum(high, -low).to(acc);
    const at::Tensor k = at::ceil(at::log2(amax) + log2_room)
                             .clamp_min(0)
                             .nan_to_num(0, 0, 0);
    const at::Tensor scale = at::exp2(-k).to(grad.scalar_type());
    const at::Tensor unscale = at::exp2(k);
    auto product = [&](const at::Tensor& g, const at::Tensor& other) {
      const at::Tensor scaled = at::mm(g, other * scale);
      // Saturated: a gradient past the range is its largest finite value.
      return (scaled.to(acc) * unscale).clamp(-largest, largest).to(scaled.scalar_type());
    };
    return {want_a ? product(grad, saved[1]) : at::Tensor(),
            want_b ? product(grad.t(), saved[0]) : at::Tensor()};
  }
};

// The backward ops' own nodes (create_graph=True), which refuse double backward.
struct NanfreeNormalizeBackwardBackward final
    : RefusedDoubleBackward<NanfreeNormalizeBackwardBackward, &normalize_backward_op> {
  static constexpr const char* kOpName = "nanfree::normalize_backward";
  static constexpr const char* kFamily = "cosine";
};
struct NanfreeCosineSimilarityBackwardBackward final
    : RefusedDoubleBackward<NanfreeCosineSimilarityBackwardBackward, &cosine_backward_op> {
  static constexpr const char* kOpName = "nanfree::cosine_similarity_backward";
  static constexpr const char* kFamily = "cosine";
};

std::tuple<at::Tensor, at::Tensor> normalize_with_autograd(const at::Tensor& input, double eps) {
  if (!needs_graph(input)) return call_normalize(input, eps);
  const variable_list out = NanfreeNormalizeBackward::apply(input, eps);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> cosine_with_autograd(const at::Tensor& x1, const at::Tensor& x2,
                                                        double eps) {
  if (!needs_graph(x1) && !needs_graph(x2)) return call_cosine(x1, x2, eps);
  const variable_list out = NanfreeCosineSimilarityBackward::apply(x1, x2, eps);
  return {out[0], out[1]};
}

at::Tensor cos_sim_matrix_with_autograd(const at::Tensor& a, const at::Tensor& b) {
  if (!needs_graph(a) && !needs_graph(b)) return call_cos_sim_matrix(a, b);
  return NanfreeCosSimMatrixBackward::apply(a, b)[0];
}

// --- Python entry points ------------------------------------------------------

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

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("normalize", &normalize_with_autograd);
  m.impl("normalize_backward",
         &BackwardOpAutograd<NanfreeNormalizeBackwardBackward, &normalize_backward_op>::kernel);
  m.impl("cosine_similarity", &cosine_with_autograd);
  m.impl("cosine_similarity_backward",
         &BackwardOpAutograd<NanfreeCosineSimilarityBackwardBackward, &cosine_backward_op>::kernel);
  m.impl("cos_sim_matrix", &cos_sim_matrix_with_autograd);
}

void bind_cosine(pybind11::module_& m) {
  namespace py = pybind11;
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("cosine_similarity", &cosine_similarity, release);
  m.def("normalize", &normalize, release);
  m.def("cos_sim", &cos_sim, release);
  m.attr("COS_SIM_EPS") = kCosSimEps;
}

}  // namespace nanfree
