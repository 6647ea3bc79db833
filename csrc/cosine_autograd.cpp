// Autograd of the cosine-family ops, registered once at the Autograd key for
// every backend (C++, CUDA, Triton, pure torch). normalize and
// cosine_similarity save what their hand-written backward ops need (the
// output or inputs and the per-vector statistics); cos_sim_matrix's
// gradient is two matrix products, the clamp passing straight through (it
// only removes rounding past +-1). Double backward through the backward ops
// refuses with a clear error.
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "common/autograd.h"
#include "common/cosine_op.h"
#include "common/find_op.h"

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

at::Tensor call_normalize_backward(const at::Tensor& grad, const at::Tensor& output,
                                   const at::Tensor& stats) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return normalize_backward_op(grad, output, stats);
}

std::tuple<at::Tensor, at::Tensor> call_cosine(const at::Tensor& x1, const at::Tensor& x2,
                                               double eps) {
  static const auto op = find_op<CosineSignature>("nanfree::cosine_similarity");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x1, x2, eps);
}

std::tuple<at::Tensor, at::Tensor> call_cosine_backward(const at::Tensor& grad,
                                                        const at::Tensor& x1,
                                                        const at::Tensor& x2,
                                                        const at::Tensor& output,
                                                        const at::Tensor& stats) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return cosine_backward_op(grad, x1, x2, output, stats);
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
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& grad = grads[0];
    return {ctx->needs_input_grad(0) ? at::mm(grad, saved[1]) : at::Tensor(),
            ctx->needs_input_grad(1) ? at::mm(grad.t(), saved[0]) : at::Tensor()};
  }
};

// The backward ops, differentiable once more only in name.
struct NanfreeNormalizeBackwardBackward final
    : torch::autograd::Function<NanfreeNormalizeBackwardBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad,
                               const at::Tensor& output, const at::Tensor& stats) {
    return {call_normalize_backward(grad, output, stats)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("nanfree::normalize_backward", "cosine");
  }
};

struct NanfreeCosineSimilarityBackwardBackward final
    : torch::autograd::Function<NanfreeCosineSimilarityBackwardBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& x1,
                               const at::Tensor& x2, const at::Tensor& output,
                               const at::Tensor& stats) {
    auto [grad_x1, grad_x2] = call_cosine_backward(grad, x1, x2, output, stats);
    return {grad_x1, grad_x2};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    refuse_double_backward("nanfree::cosine_similarity_backward", "cosine");
  }
};

std::tuple<at::Tensor, at::Tensor> normalize_with_autograd(const at::Tensor& input, double eps) {
  if (!needs_graph(input)) return call_normalize(input, eps);
  const variable_list out = NanfreeNormalizeBackward::apply(input, eps);
  return {out[0], out[1]};
}

at::Tensor normalize_backward_with_autograd(const at::Tensor& grad, const at::Tensor& output,
                                            const at::Tensor& stats) {
  if (!needs_graph(grad) && !needs_graph(output)) {
    return call_normalize_backward(grad, output, stats);
  }
  return NanfreeNormalizeBackwardBackward::apply(grad, output, stats)[0];
}

std::tuple<at::Tensor, at::Tensor> cosine_with_autograd(const at::Tensor& x1, const at::Tensor& x2,
                                                        double eps) {
  if (!needs_graph(x1) && !needs_graph(x2)) return call_cosine(x1, x2, eps);
  const variable_list out = NanfreeCosineSimilarityBackward::apply(x1, x2, eps);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> cosine_backward_with_autograd(
    const at::Tensor& grad, const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& output,
    const at::Tensor& stats) {
  if (!needs_graph(grad) && !needs_graph(x1) && !needs_graph(x2) && !needs_graph(output)) {
    return call_cosine_backward(grad, x1, x2, output, stats);
  }
  const variable_list out =
      NanfreeCosineSimilarityBackwardBackward::apply(grad, x1, x2, output, stats);
  return {out[0], out[1]};
}

at::Tensor cos_sim_matrix_with_autograd(const at::Tensor& a, const at::Tensor& b) {
  if (!needs_graph(a) && !needs_graph(b)) return call_cos_sim_matrix(a, b);
  return NanfreeCosSimMatrixBackward::apply(a, b)[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("normalize", &normalize_with_autograd);
  m.impl("normalize_backward", &normalize_backward_with_autograd);
  m.impl("cosine_similarity", &cosine_with_autograd);
  m.impl("cosine_similarity_backward", &cosine_backward_with_autograd);
  m.impl("cos_sim_matrix", &cos_sim_matrix_with_autograd);
}

}  // namespace nanfree
