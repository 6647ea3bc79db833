// The elementwise family's C++ side shared by every backend (C++, CUDA,
// Triton, pure torch): the autograd of the unary ops, registered once at the
// Autograd key. <op> saves its input; its node's backward is
// <op>_backward(grad, input, 1), grad times the derivative of
// elementwise_math.h. That backward op is itself differentiable (DESIGN.md
// rule 6, gradient penalties): in `grad` its derivative is the same op, in
// `input` it is <op>_backward(gg * grad, input, 2), the second derivative
// under the same rules. A third derivative is refused clearly. Also the
// autograd of every <op>_out, unary and binary (none), and the ops' fast
// Python entry points (nanfree._C.<op>).
#include <pybind11/pybind11.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "common/autograd.h"
#include "common/elementwise_op.h"
#include "common/find_op.h"
#include "nanfree/elementwise_math.h"
#include "python_module.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using UnarySignature = at::Tensor(const at::Tensor&);
using UnaryBackwardSignature = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);

// The ops' dispatcher handles, found once per op.
template <UnaryOp op>
const c10::TypedOperatorHandle<UnarySignature>& unary_handle() {
  static const auto handle = find_op<UnarySignature>(std::string("nanfree::") + unary_op_name(op));
  return handle;
}

template <UnaryOp op>
const c10::TypedOperatorHandle<UnaryBackwardSignature>& unary_backward_handle() {
  static const auto handle =
      find_op<UnaryBackwardSignature>(std::string("nanfree::") + unary_backward_name(op));
  return handle;
}

template <UnaryOp op>
at::Tensor call_unary(const at::Tensor& input) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return unary_handle<op>().call(input);
}

template <UnaryOp op>
at::Tensor call_unary_backward_below_autograd(const at::Tensor& grad, const at::Tensor& input,
                                              int64_t order) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return unary_backward_handle<op>().call(grad, input, order);
}

// The op through the whole dispatcher, autograd included: nanfree.ops' entry
// point (nanfree._C.<op>), a call without torch.ops' Python layers.
template <UnaryOp op>
at::Tensor unary_entry(const at::Tensor& input) {
  return unary_handle<op>().call(input);
}

// Through the whole dispatcher, autograd included: called from a node's
// backward, so that with create_graph=True the gradient records its node.
template <UnaryOp op>
at::Tensor unary_backward_op(const at::Tensor& grad, const at::Tensor& input, int64_t order) {
  return unary_backward_handle<op>().call(grad, input, order);
}

template <UnaryOp op>
struct NanfreeUnaryBackward final : torch::autograd::Function<NanfreeUnaryBackward<op>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input) {
    ctx->save_for_backward({input});
    ctx->set_materialize_grads(false);
    return {call_unary<op>(input)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor()};
    return {unary_backward_op<op>(grads[0], ctx->get_saved_variables()[0], 1)};
  }
};

// The node of <op>_backward (recorded with create_graph=True).
template <UnaryOp op>
struct NanfreeUnaryBackwardBackward final
    : torch::autograd::Function<NanfreeUnaryBackwardBackward<op>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad,
                               const at::Tensor& input, int64_t order) {
    ctx->save_for_backward({grad, input});
    ctx->saved_data["order"] = order;
    ctx->set_materialize_grads(false);
    return {call_unary_backward_below_autograd<op>(grad, input, order)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& gg = grads[0];
    if (!gg.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const int64_t order = ctx->saved_data["order"].toInt();
    at::Tensor d_grad, d_input;
    if (ctx->needs_input_grad(0)) d_grad = unary_backward_op<op>(gg, saved[1], order);
    if (ctx->needs_input_grad(1)) {
      TORCH_CHECK(order == 1, "nanfree: ", unary_backward_name(op),
                  "(order=2) has no derivative in `input`: the third derivative of the "
                  "elementwise family is not implemented");
      d_input = unary_backward_op<op>(zero_dominant_weight(gg, saved[0]), saved[1], 2);
    }
    return {d_grad, d_input, at::Tensor()};
  }
};

template <UnaryOp op>
struct UnaryAutograd {
  static at::Tensor forward(const at::Tensor& input) {
    if (!needs_graph(input)) return call_unary<op>(input);
    return NanfreeUnaryBackward<op>::apply(input)[0];
  }

  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& input, int64_t order) {
    if (!any_needs_graph(grad, input)) {
      return call_unary_backward_below_autograd<op>(grad, input, order);
    }
    return NanfreeUnaryBackwardBackward<op>::apply(grad, input, order)[0];
  }
};

// The Autograd kernel of an op that writes into its `Tensor(a!)` arguments and
// returns nothing (<op>_out): not differentiable, as torch's out= forms are
// not, so an argument that requires grad is refused with torch's words while
// grad mode is on; after the write each written tensor's version counter is
// bumped, as torch's out= forms bump it, so autograd refuses a graph that saved
// the tensor before. (ATen's fallbacks bump only returned tensors.)
void write_without_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                            torch::jit::Stack* stack) {
  const std::string& full_name = op.schema().name();
  const std::string name = full_name.substr(full_name.find("::") + 2);  // nanfree::<op>_out
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK(!(at::GradMode::is_enabled() && t.defined() && t.requires_grad()), "nanfree.", name,
                ": functions with out=... arguments don't support automatic "
                "differentiation, but one of the arguments requires grad");
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias != nullptr && alias->isWrite()) written.push_back(t);
  }
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  register_unary_kernels<UnaryAutograd>(m);
  for_each_out_op([&](const std::string& name) {
    m.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&write_without_autograd>());
  });
}

void bind_elementwise(pybind11::module_& m) {
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("sqrt", &unary_entry<UnaryOp::kSqrt>, release);
  m.def("log", &unary_entry<UnaryOp::kLog>, release);
  m.def("log1p", &unary_entry<UnaryOp::kLog1p>, release);
  m.def("acos", &unary_entry<UnaryOp::kAcos>, release);
  m.def("asin", &unary_entry<UnaryOp::kAsin>, release);
}

}  // namespace nanfree
