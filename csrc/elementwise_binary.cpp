// The autograd of the elementwise family's binary ops (pow, atan2,
// div_no_nan, xlogy, xlog1py), registered once at the Autograd key for every
// backend. <op> saves its two inputs; its node's backward is, per input that
// needs a gradient, <op>_backward(grad, input, other, 1, partial) in the
// broadcast shape, summed to that input's shape and cast to its dtype (torch's
// broadcasting and type promotion, undone). That backward op is itself
// differentiable (DESIGN.md rule 6): in `grad` its derivative is the same op,
// in `input` and `other` it is <op>_backward(gg * grad, input, other, 2, ...),
// the second partial derivatives under the same rules. A third derivative is
// refused clearly. Where both inputs need a gradient and no graph is recorded,
// the node calls <op>_gradients instead: both in one pass over grad and the
// inputs (not differentiable itself: it refuses with a clear error).
#include <pybind11/pybind11.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/autograd.h"
#include "common/elementwise_op.h"
#include "common/find_op.h"
#include "nanfree/elementwise_binary_math.h"
#include "python_module.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using BinarySignature = at::Tensor(const at::Tensor&, const at::Tensor&);
using BinaryBackwardSignature =
    at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using BinaryGradientsSignature =
    std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <BinaryOp op>
const c10::TypedOperatorHandle<BinarySignature>& binary_handle() {
  static const auto handle = find_op<BinarySignature>(std::string("nanfree::") + binary_op_name(op));
  return handle;
}

template <BinaryOp op>
const c10::TypedOperatorHandle<BinaryBackwardSignature>& binary_backward_handle() {
  static const auto handle =
      find_op<BinaryBackwardSignature>(std::string("nanfree::") + binary_backward_name(op));
  return handle;
}

template <BinaryOp op>
const c10::TypedOperatorHandle<BinaryGradientsSignature>& binary_gradients_handle() {
  static const auto handle =
      find_op<BinaryGradientsSignature>(std::string("nanfree::") + binary_gradients_name(op));
  return handle;
}

// The op through the whole dispatcher, autograd included: nanfree.ops' entry
// point for two tensors (nanfree._C.<op>), a call without torch.ops' Python layers.
template <BinaryOp op>
at::Tensor binary_entry(const at::Tensor& input, const at::Tensor& other) {
  return binary_handle<op>().call(input, other);
}

// The entry point for a float32 or float64 tensor and a Python number the
// dtype holds (nanfree.ops checks both; nanfree._C.<op>_number): the number
// as the 0-d tensor of the tensor's dtype and device torch.scalar_tensor
// makes, made here (a third of pow(x, 2.0)'s call when made in Python).
template <BinaryOp op>
at::Tensor binary_number_entry(const at::Tensor& input, double other) {
  return binary_handle<op>().call(input, at::scalar_tensor(other, input.options()));
}

// <op>_gradients through the dispatcher (its Autograd kernel below).
template <BinaryOp op>
std::tuple<at::Tensor, at::Tensor> call_binary_gradients(const at::Tensor& grad,
                                                         const at::Tensor& input,
                                                         const at::Tensor& other) {
  return binary_gradients_handle<op>().call(grad, input, other);
}

template <BinaryOp op>
at::Tensor call_binary_below_autograd(const at::Tensor& input, const at::Tensor& other) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return binary_handle<op>().call(input, other);
}

template <BinaryOp op>
at::Tensor call_binary_backward_below_autograd(const at::Tensor& grad, const at::Tensor& input,
                                               const at::Tensor& other, int64_t order,
                                               int64_t partial) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return binary_backward_handle<op>().call(grad, input, other, order, partial);
}

// Through the whole dispatcher, autograd included: called from a node's
// backward, so that with create_graph=True the gradient records its node.
template <BinaryOp op>
at::Tensor binary_backward_op(const at::Tensor& grad, const at::Tensor& input,
                              const at::Tensor& other, int64_t order, int64_t partial) {
  return binary_backward_handle<op>().call(grad, input, other, order, partial);
}

// A gradient in the broadcast shape and computing dtype, as the gradient of
// `input`: summed over the dimensions broadcasting added or expanded (in
// float64: a sum of saturated entries neither overflows nor meets +inf and
// -inf), saturated to input's dtype (rule 5: a float32 gradient of a float16
// input, a sum of many) and cast to it. NaN entries stay NaN.
at::Tensor gradient_of(const at::Tensor& gradient, const at::Tensor& input) {
  at::Tensor reduced = gradient;
  if (reduced.sizes() != input.sizes()) {
    const int64_t lead = reduced.dim() - input.dim();
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < reduced.dim(); ++d) {
      if (d < lead || (input.size(d - lead) == 1 && reduced.size(d) != 1)) dims.push_back(d);
    }
    reduced = reduced.sum(dims, /*keepdim=*/true, at::kDouble).reshape(input.sizes());
  }
  if (reduced.scalar_type() == input.scalar_type()) return reduced;
  const double bound = largest_finite(input.scalar_type());
  return reduced.clamp(-bound, bound).to(input.scalar_type());
}

template <BinaryOp op>
struct NanfreeBinaryBackward final : torch::autograd::Function<NanfreeBinaryBackward<op>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& other) {
    ctx->save_for_backward({input, other});
    ctx->set_materialize_grads(false);
    return {call_binary_below_autograd<op>(input, other)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    // The operands as the op computed on them (dtype and device; differentiable).
    const auto [a, b] = binary_operands(op, saved[0], saved[1]);
    at::Tensor grad = grads[0];
    if (grad.scalar_type() != a.scalar_type()) grad = grad.to(a.scalar_type());
    variable_list result(2);
    if (ctx->needs_input_grad(0) && ctx->needs_input_grad(1) && !at::GradMode::is_enabled()) {
      // Both, and no graph to record (create_graph=False): one pass for the two.
      const auto [grad_a, grad_b] = call_binary_gradients<op>(grad, a, b);
      return {gradient_of(grad_a, saved[0]), gradient_of(grad_b, saved[1])};
    }
    for (int64_t partial = 0; partial < 2; ++partial) {
      if (ctx->needs_input_grad(partial)) {
        result[partial] = gradient_of(binary_backward_op<op>(grad, a, b, 1, partial), saved[partial]);
      }
    }
    return result;
  }
};

// The node of <op>_backward (recorded with create_graph=True).
template <BinaryOp op>
struct NanfreeBinaryBackwardBackward final
    : torch::autograd::Function<NanfreeBinaryBackwardBackward<op>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad,
                               const at::Tensor& input, const at::Tensor& other, int64_t order,
                               int64_t partial) {
    ctx->save_for_backward({grad, input, other});
    ctx->saved_data["order"] = order;
    ctx->saved_data["partial"] = partial;
    ctx->set_materialize_grads(false);
    return {call_binary_backward_below_autograd<op>(grad, input, other, order, partial)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& gg = grads[0];
    variable_list result(5);
    if (!gg.defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    const int64_t order = ctx->saved_data["order"].toInt();
    const int64_t partial = ctx->saved_data["partial"].toInt();
    if (ctx->needs_input_grad(0)) result[0] = binary_backward_op<op>(gg, saved[1], saved[2], order, partial);
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      TORCH_CHECK(order == 1, "nanfree: ", binary_backward_name(op),
                  "(order=2) has no derivative in `input` or `other`: the third derivative of "
                  "the elementwise family is not implemented");
      const at::Tensor weight = zero_dominant_weight(gg, saved[0]);
      // d/d input of grad * f_partial is grad * f_{partial, input}: the second partials
      // (input, input) and (input, other) for partial 0, (input, other) and (other, other) for 1.
      for (int64_t which = 0; which < 2; ++which) {
        if (ctx->needs_input_grad(1 + which)) {
          result[1 + which] = gradient_of(
              binary_backward_op<op>(weight, saved[1], saved[2], 2, partial + which), saved[1 + which]);
        }
      }
    }
    return result;
  }
};

// The node of <op>_gradients called with create_graph=True: refuses to be
// differentiated (the autograd above calls it only when no graph is recorded).
template <BinaryOp op>
struct NanfreeBinaryGradientsBackward final
    : RefusedDoubleBackward<NanfreeBinaryGradientsBackward<op>, &call_binary_gradients<op>> {
  static inline const std::string kOpName = "nanfree::" + binary_gradients_name(op);
  static constexpr const char* kFamily = "elementwise";
};

template <BinaryOp op>
struct BinaryAutograd {
  static at::Tensor forward(const at::Tensor& input, const at::Tensor& other) {
    if (!any_needs_graph(input, other)) return call_binary_below_autograd<op>(input, other);
    return NanfreeBinaryBackward<op>::apply(input, other)[0];
  }

  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& input,
                             const at::Tensor& other, int64_t order, int64_t partial) {
    if (!any_needs_graph(grad, input, other)) {
      return call_binary_backward_below_autograd<op>(grad, input, other, order, partial);
    }
    return NanfreeBinaryBackwardBackward<op>::apply(grad, input, other, order, partial)[0];
  }

  static std::tuple<at::Tensor, at::Tensor> gradients(const at::Tensor& grad,
                                                      const at::Tensor& input,
                                                      const at::Tensor& other) {
    return BackwardOpAutograd<NanfreeBinaryGradientsBackward<op>,
                              &call_binary_gradients<op>>::kernel(grad, input, other);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) { register_binary_kernels<BinaryAutograd>(m); }

void bind_elementwise_binary(pybind11::module_& m) {
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("pow", &binary_entry<BinaryOp::kPow>, release);
  m.def("atan2", &binary_entry<BinaryOp::kAtan2>, release);
  m.def("div_no_nan", &binary_entry<BinaryOp::kDivNoNan>, release);
  m.def("xlogy", &binary_entry<BinaryOp::kXlogy>, release);
  m.def("xlog1py", &binary_entry<BinaryOp::kXlog1py>, release);
  m.def("pow_number", &binary_number_entry<BinaryOp::kPow>, release);
  m.def("atan2_number", &binary_number_entry<BinaryOp::kAtan2>, release);
  m.def("div_no_nan_number", &binary_number_entry<BinaryOp::kDivNoNan>, release);
  m.def("xlogy_number", &binary_number_entry<BinaryOp::kXlogy>, release);
  m.def("xlog1py_number", &binary_number_entry<BinaryOp::kXlog1py>, release);
}

}  // namespace nanfree
