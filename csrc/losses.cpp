// The losses family's C++ side shared by every backend (C++, CUDA, Triton,
// pure torch): the autograd of pointwise_loss, pointwise_loss_sum and
// cross_entropy, registered once at the Autograd key, and the nodes of their
// backward ops, which refuse double backward.
//
// Each forward runs its op below autograd and saves the op's inputs (and
// cross_entropy's per-position statistics); the backward calls the matching
// *_backward op through the dispatcher, so that with create_graph=True the
// gradient records the node that refuses. The node is C++ rather than a
// Python one (torch.library.register_autograd): a loss on a small batch cost
// 3x torch's per call forward and backward with the Python node.
//
// Python entry points: nanfree.ops' losses call these first (outside
// torch.compile) for the common call: tensors that need no type promotion,
// broadcasting, cast or conversion (each listed below), no autocast. They
// make the whole call (layout, the op through the dispatcher, the reduction)
// in one C++ crossing, and return None for any other call, which
// nanfree/_ops/losses.py then makes with the same steps (and every error
// message): the Python steps cost a small batch's loss 4-5x torch's call.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/autocast_mode.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/autograd.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/autograd.h"
#include "common/checks.h"  // is_kernel_float
#include "common/find_op.h"
#include "common/layout.h"  // broadcasts_to
#include "nanfree/losses_math.h"  // kCrossEntropyStats
#include "python_module.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <bool kSum>
at::Tensor call_pointwise_loss(const at::Tensor& input, const at::Tensor& target,
                               const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& pos_weight, int64_t kind,
                               double alpha, double gamma) {
  static const auto op =
      find_op<PointwiseLossSignature>(kSum ? "nanfree::pointwise_loss_sum" : "nanfree::pointwise_loss");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(input, target, weight, pos_weight, kind, alpha, gamma);
}

// Through the whole dispatcher, autograd included (see the top).
at::Tensor pointwise_loss_backward_op(const at::Tensor& grad, const at::Tensor& input,
                                      const at::Tensor& target,
                                      const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                      double alpha, double gamma, int64_t partial) {
  static const auto op = find_op<PointwiseLossBackwardSignature>("nanfree::pointwise_loss_backward");
  return op.call(grad, input, target, weight, pos_weight, kind, alpha, gamma, partial);
}

const c10::TypedOperatorHandle<CrossEntropySignature>& cross_entropy_handle() {
  static const auto op = find_op<CrossEntropySignature>("nanfree::cross_entropy");
  return op;
}

std::tuple<at::Tensor, at::Tensor> call_cross_entropy(const at::Tensor& input,
                                                      const at::Tensor& target,
                                                      const std::optional<at::Tensor>& weight,
                                                      const std::optional<at::Tensor>& mask,
                                                      int64_t ignore_index,
                                                      double label_smoothing) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return cross_entropy_handle().call(input, target, weight, mask, ignore_index, label_smoothing);
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_backward_op(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& target,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& mask,
    int64_t ignore_index, double label_smoothing, const at::Tensor& stats, bool target_grad) {
  static const auto op = find_op<CrossEntropyBackwardSignature>("nanfree::cross_entropy_backward");
  return op.call(grad, input, target, weight, mask, ignore_index, label_smoothing, stats,
                 target_grad);
}

// What a pointwise loss's node keeps for its backward.
void save_pointwise_loss(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& target,
                         const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& pos_weight, int64_t kind, double alpha,
                         double gamma) {
  ctx->save_for_backward(
      {input, target, weight.value_or(at::Tensor()), pos_weight.value_or(at::Tensor())});
  ctx->saved_data["kind"] = kind;
  ctx->saved_data["alpha"] = alpha;
  ctx->saved_data["gamma"] = gamma;
}

// A pointwise loss node's gradients (in input and target, where asked) for
// the upstream gradient `grad` of each loss (0-d: the same for every one);
// `arguments`: the node's number of forward arguments.
variable_list pointwise_loss_gradients(AutogradContext* ctx, const variable_list& saved,
                                       const at::Tensor& grad, size_t arguments) {
  variable_list out(arguments);
  for (int64_t partial : {0, 1}) {
    if (!ctx->needs_input_grad(partial)) continue;
    out[partial] = pointwise_loss_backward_op(
        grad, saved[0], saved[1], optional_of(saved[2]), optional_of(saved[3]),
        ctx->saved_data["kind"].toInt(), ctx->saved_data["alpha"].toDouble(),
        ctx->saved_data["gamma"].toDouble(), partial);
  }
  return out;
}

// pointwise_loss (kSum false) and pointwise_loss_sum (true). weight and
// pos_weight are constants of the loss: nanfree.ops refuses one that needs a
// gradient before the op runs, so none is given here.
template <bool kSum, typename Self>
struct PointwiseLossFunction : torch::autograd::Function<Self> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& target, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& pos_weight, int64_t kind,
                               double alpha, double gamma) {
    at::Tensor loss = call_pointwise_loss<kSum>(input, target, weight, pos_weight, kind, alpha, gamma);
    save_pointwise_loss(ctx, input, target, weight, pos_weight, kind, alpha, gamma);
    return {loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    // The sum's d / d loss_i is 1: its upstream gradient in the input's dtype
    // (as torch's mean and sum backward give it), a 0-d tensor the backward op
    // broadcasts itself (no tensor of the input's size is formed for it).
    const at::Tensor grad = kSum ? grads[0].to(input.scalar_type()) : grads[0];
    return pointwise_loss_gradients(ctx, saved, grad, 7);
  }
};

// The graph nodes, named as torch names its own (grad_fn=<NanfreePointwiseLossBackward>).
struct NanfreePointwiseLossBackward final
    : PointwiseLossFunction<false, NanfreePointwiseLossBackward> {};
struct NanfreePointwiseLossSumBackward final
    : PointwiseLossFunction<true, NanfreePointwiseLossSumBackward> {};

template <bool kSum>
at::Tensor pointwise_loss_with_autograd(const at::Tensor& input, const at::Tensor& target,
                                        const std::optional<at::Tensor>& weight,
                                        const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                        double alpha, double gamma) {
  if (!any_needs_graph(input, target, weight, pos_weight)) {
    return call_pointwise_loss<kSum>(input, target, weight, pos_weight, kind, alpha, gamma);
  }
  using Node = std::conditional_t<kSum, NanfreePointwiseLossSumBackward, NanfreePointwiseLossBackward>;
  return Node::apply(input, target, weight, pos_weight, kind, alpha, gamma)[0];
}

struct NanfreeCrossEntropyBackward final : torch::autograd::Function<NanfreeCrossEntropyBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& target, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& mask, int64_t ignore_index,
                               double label_smoothing) {
    auto [loss, stats] =
        call_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing);
    ctx->save_for_backward(
        {input, target, weight.value_or(at::Tensor()), mask.value_or(at::Tensor()), stats});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->mark_non_differentiable({stats});
    // No zero tensor is built for an unused loss or for the stats.
    ctx->set_materialize_grads(false);
    return {loss, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(6);
    if (!grads[0].defined()) return out;  // the loss unused
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& target = saved[1];
    const bool target_grad = ctx->needs_input_grad(1) && target.scalar_type() != at::kLong;
    auto [grad_input, grad_target] = cross_entropy_backward_op(
        grads[0].contiguous(), saved[0], target, optional_of(saved[2]), optional_of(saved[3]),
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["label_smoothing"].toDouble(),
        saved[4], target_grad);
    if (ctx->needs_input_grad(0)) out[0] = grad_input;
    if (target_grad) out[1] = grad_target;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor> cross_entropy_with_autograd(
    const at::Tensor& input, const at::Tensor& target, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& mask, int64_t ignore_index, double label_smoothing) {
  if (!any_needs_graph(input, target, weight)) {
    return call_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing);
  }
  const variable_list out =
      NanfreeCrossEntropyBackward::apply(input, target, weight, mask, ignore_index, label_smoothing);
  return {out[0], out[1]};
}

// The backward ops' own nodes (create_graph=True), which refuse double backward.
struct NanfreePointwiseLossBackwardBackward final
    : RefusedDoubleBackward<NanfreePointwiseLossBackwardBackward, &pointwise_loss_backward_op> {
  static constexpr const char* kOpName = "nanfree::pointwise_loss_backward";
  static constexpr const char* kFamily = "losses";
};
struct NanfreeCrossEntropyBackwardBackward final
    : RefusedDoubleBackward<NanfreeCrossEntropyBackwardBackward, &cross_entropy_backward_op> {
  static constexpr const char* kOpName = "nanfree::cross_entropy_backward";
  static constexpr const char* kFamily = "losses";
};


// --- Python entry points ------------------------------------------------------

// The reductions, by their index in kLossReductions (nanfree/_ops/losses.py
// passes a reduction string's index).
enum LossReduction : int64_t { kReduceNone = 0, kReduceMean = 1, kReduceSum = 2, kReduceBatchMean = 3 };
constexpr const char* kLossReductions[] = {"none", "mean", "sum", "batchmean"};

// Whether the entries may take an input: a real tensor on the CPU or CUDA. A
// meta tensor, a fake one (FakeTensorMode) or another Python tensor subclass
// has no data the entries may read or write on the host (a CPU mean's divisor
// and division, the class indices' range check), and autocast knows no meta
// device: the Python steps, whose torch operations those tensors take, serve them.
bool entry_takes(const at::Tensor& input, const at::Tensor& target) {
  const c10::DeviceType type = input.device().type();
  return (type == at::kCPU || type == at::kCUDA) && !input.unsafeGetTensorImpl()->is_python_dispatch() &&
         !target.unsafeGetTensorImpl()->is_python_dispatch();
}

// A loss's constant operand (weight, pos_weight) the fast call takes as it is:
// absent, or of the input's dtype and device, and not asking for a gradient
// (nanfree.ops refuses that, in Python).
bool plain_operand(const std::optional<at::Tensor>& t, const at::Tensor& input) {
  return !t.has_value() || (t->scalar_type() == input.scalar_type() &&
                            t->device() == input.device() && !needs_graph(*t));
}

// Whether every class index of a CPU target is a class or ignore_index (an
// out-of-range one is the Python call's IndexError).
bool indices_in_range(const at::Tensor& target, int64_t classes, int64_t ignore_index) {
  if (target.device().type() != at::kCPU) return true;  // read there without a host sync: left out
  const int64_t* index = target.const_data_ptr<int64_t>();
  bool ok = true;
  for (int64_t i = 0, n = target.numel(); i < n; ++i) {
    ok &= index[i] == ignore_index || (index[i] >= 0 && index[i] < classes);
  }
  return ok;
}

// A fresh 0-d sum divided by a count, as `sum / count` gives it (at::div by a
// number: the count rounded to the sum's dtype, then one division). On the
// CPU in place, without at::div's dispatch (a microsecond, a fifth of a small
// batch's loss).
at::Tensor divide_sum(at::Tensor sum, double count) {
  if (!sum.device().is_cpu()) return sum / count;
  AT_DISPATCH_FLOATING_TYPES(sum.scalar_type(), "loss_mean", [&] {
    scalar_t* value = sum.mutable_data_ptr<scalar_t>();
    *value = *value / static_cast<scalar_t>(count);
  });
  return sum;
}

// The mean's divisor from the op's statistics: the sum of the counted
// positions' weights, read on the CPU without a host sync (a double sum, as
// nanfree/_ops/losses.py's), else a 0-d tensor on the device. No position
// counted (all ignored or masked): the mean of nothing is 0, not 0 / 0, so
// the divisor is then 1.
struct MeanDivisor {
  double count = 1.0;
  at::Tensor tensor;  // defined on other devices than the CPU

  MeanDivisor() = default;
  explicit MeanDivisor(const at::Tensor& stats) {
    if (stats.device().type() != at::kCPU) {
      const at::Tensor total = stats.select(-1, 4).sum();
      tensor = at::where(total > 0, total, at::ones_like(total));
      return;
    }
    double sum = 0.0;
    const at::Tensor dense = stats.contiguous();  // every backend's is: no copy
    AT_DISPATCH_FLOATING_TYPES(dense.scalar_type(), "cross_entropy_mean", [&] {
      const scalar_t* s = dense.const_data_ptr<scalar_t>();
      for (int64_t i = 0, n = dense.numel(); i < n; i += kCrossEntropyStats) sum += s[i + 4];
    });
    if (sum > 0) count = sum;
  }
  // A fresh 0-d sum divided (divide_sum on the CPU).
  at::Tensor divide(at::Tensor sum) const {
    return tensor.defined() ? sum / tensor : divide_sum(std::move(sum), count);
  }
};

// A call of the entry in the op's layout.
struct CrossEntropyCall {
  int64_t outer, classes, inner;
  at::Tensor input;   // [outer, C, inner], contiguous (laid out by `with`)
  // Class indices [outer, inner] (int64, contiguous), laid out by the entry;
  // probabilities [outer, C, inner] (contiguous), laid out by `with`.
  at::Tensor target;
  std::optional<at::Tensor> weight, keep;
  int64_t ignore_index;
  double label_smoothing;

  // Through the whole dispatcher (reduce() calls it below autograd).
  std::tuple<at::Tensor, at::Tensor> run() const {
    return cross_entropy_handle().call(input, target, weight, keep, ignore_index, label_smoothing);
  }

  // The logits (and probabilities) of the user's shape in the op's layout.
  CrossEntropyCall with(const at::Tensor& user_input, const at::Tensor& user_target) const {
    CrossEntropyCall c = *this;
    c.input = user_input.reshape({outer, classes, inner}).contiguous();
    if (!target.defined()) {  // probabilities
      c.target = user_target.reshape({outer, classes, inner}).contiguous();
    }
    return c;
  }
};

// cross_entropy reduced to a scalar ('mean' or 'sum') as one graph node: the
// op's loss per position summed and divided below autograd, and in the
// backward the upstream gradient divided and spread over the positions for
// cross_entropy_backward. The same values as the op's node followed by sum
// and division (nanfree/_ops/losses.py's steps, which torch.compile traces),
// without their two nodes and views (a third of a small batch's call).
struct NanfreeCrossEntropyLossBackward final
    : torch::autograd::Function<NanfreeCrossEntropyLossBackward> {
  static at::Tensor reduce(const CrossEntropyCall& call, bool mean, at::ScalarType dtype,
                           at::Tensor* stats_out, MeanDivisor* divisor_out) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [loss, stats] = call.run();
    at::Tensor total = loss.sum();
    if (mean) {
      MeanDivisor divisor(stats);
      total = divisor.divide(total);
      if (divisor_out != nullptr) *divisor_out = std::move(divisor);
    }
    if (stats_out != nullptr) *stats_out = stats;
    return total.to(dtype);
  }

  // `layout` holds the call's class indices in the op's layout (an int64
  // target) and its other arguments; the logits (and probabilities) are laid
  // out here, where autograd records nothing, and again in the backward from
  // the saved inputs (views, unless an input is not contiguous), where
  // create_graph=True records the backward op's node that refuses.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& target, const CrossEntropyCall& layout,
                               bool mean) {
    const CrossEntropyCall call = layout.with(input, target);
    at::Tensor stats;
    MeanDivisor divisor;
    at::Tensor value = reduce(call, mean, input.scalar_type(), &stats, &divisor);
    ctx->save_for_backward({input, target, layout.target, call.weight.value_or(at::Tensor()),
                            call.keep.value_or(at::Tensor()), stats, divisor.tensor});
    ctx->saved_data["ignore_index"] = call.ignore_index;
    ctx->saved_data["label_smoothing"] = call.label_smoothing;
    ctx->saved_data["count"] = divisor.count;
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["layout"] = std::vector<int64_t>{call.outer, call.classes, call.inner};
    return {value};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &target = saved[1], &stats = saved[5], &divisor = saved[6];
    const std::vector<int64_t> shape = ctx->saved_data["layout"].toIntVector();
    const CrossEntropyCall call =
        CrossEntropyCall{shape[0], shape[1], shape[2], at::Tensor(), saved[2],
                         optional_of(saved[3]), optional_of(saved[4]),
                         ctx->saved_data["ignore_index"].toInt(),
                         ctx->saved_data["label_smoothing"].toDouble()}
            .with(input, target);
    const bool target_grad = ctx->needs_input_grad(1) && target.scalar_type() != at::kLong;
    const bool mean = ctx->saved_data["mean"].toBool();
    const double count = ctx->saved_data["count"].toDouble();
    const std::vector<int64_t> positions{call.outer, call.inner};
    at::Tensor grad;
    if (grads[0].device().is_cpu() && !divisor.defined() && !needs_graph(grads[0])) {
      // The same numbers as the tensor steps below (the gradient in the
      // accumulation dtype, divided by the count in that dtype), made as one
      // filled tensor: a CPU value is read without waiting.
      AT_DISPATCH_FLOATING_TYPES(stats.scalar_type(), "cross_entropy_mean_backward", [&] {
        scalar_t value = static_cast<scalar_t>(grads[0].item<double>());
        if (mean) value = value / static_cast<scalar_t>(count);
        grad = at::full(positions, static_cast<double>(value), stats.options());
      });
    } else {
      grad = grads[0].to(stats.scalar_type());
      if (mean) grad = divisor.defined() ? grad / divisor : grad / count;
      grad = grad.expand(positions).contiguous();
    }
    auto [grad_input, grad_target] = cross_entropy_backward_op(
        grad, call.input, call.target, call.weight, call.keep, call.ignore_index,
        call.label_smoothing, stats, target_grad);
    variable_list out(4);
    if (ctx->needs_input_grad(0)) out[0] = grad_input.reshape(input.sizes());
    if (target_grad) out[1] = grad_target.reshape(target.sizes());
    return out;
  }
};

// nanfree.ops.cross_entropy for input of a floating dtype with the classes in
// dim 1 (dim 0 unbatched), class indices of int64 or probabilities of the
// input's dtype and shape, weight [C] (plain_operand), a bool or integer mask
// broadcasting to the input; None otherwise.
std::optional<at::Tensor> cross_entropy_entry(const at::Tensor& input, const at::Tensor& target,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& mask,
                                              int64_t ignore_index, double label_smoothing,
                                              int64_t reduction) {
  if (!entry_takes(input, target) || !is_kernel_float(input.scalar_type()) || input.dim() == 0 ||
      at::autocast::is_autocast_enabled(input.device().type()) ||
      !(label_smoothing >= 0.0 && label_smoothing <= 1.0) || target.device() != input.device() ||
      !plain_operand(weight, input) || reduction < kReduceNone || reduction > kReduceSum) {
    return std::nullopt;
  }
  const bool unbatched = input.dim() == 1;
  const int64_t outer = unbatched ? 1 : input.size(0), classes = input.size(unbatched ? 0 : 1);
  std::vector<int64_t> loss_shape;
  if (!unbatched) loss_shape.push_back(outer);
  int64_t inner = 1;
  for (int64_t d = 2; d < input.dim(); ++d) {
    loss_shape.push_back(input.size(d));
    inner *= input.size(d);
  }
  if (weight.has_value() && (weight->dim() != 1 || weight->size(0) != classes)) return std::nullopt;
  const bool indices = target.scalar_type() == at::kLong;
  if (indices ? target.sizes() != at::IntArrayRef(loss_shape)
              : target.scalar_type() != input.scalar_type() || target.sizes() != input.sizes() ||
                    ignore_index >= 0) {  // probabilities with an ignore_index: Python's error
    return std::nullopt;
  }
  CrossEntropyCall layout{outer,  classes, inner, at::Tensor(),
                          indices ? target.reshape({outer, inner}).contiguous() : at::Tensor(),
                          weight, std::nullopt,  ignore_index, label_smoothing};
  if (indices && !indices_in_range(layout.target, classes, ignore_index)) return std::nullopt;
  if (mask.has_value()) {
    const at::ScalarType m = mask->scalar_type();
    if (!(m == at::kBool || at::isIntegralType(m, /*includeBool=*/false)) ||
        mask->device() != input.device() || !broadcasts_to(mask->sizes(), input.sizes())) {
      return std::nullopt;
    }
    layout.keep = (m == at::kBool ? *mask : mask->ne(0))
                      .expand(input.sizes())
                      .reshape({outer, classes, inner});
  }
  const bool mean = reduction == kReduceMean;
  if (reduction != kReduceNone && any_needs_graph(input, target)) {
    return NanfreeCrossEntropyLossBackward::apply(input, target, layout, mean)[0];
  }
  // Through autograd (the op's own node) when the loss is not reduced.
  const CrossEntropyCall call = layout.with(input, target);
  if (reduction == kReduceNone) {
    return std::get<0>(call.run()).reshape(loss_shape).to(input.scalar_type());
  }
  return NanfreeCrossEntropyLossBackward::reduce(call, mean, input.scalar_type(), nullptr, nullptr);
}

// A pointwise loss reduced to a scalar ('mean', 'sum', 'batchmean') as one
// graph node: pointwise_loss_sum, divided by the count and cast to the
// input's dtype below autograd; in the backward the upstream gradient cast to
// the sum's dtype, divided by the same count, cast back and given 0-d to
// pointwise_loss_backward, which broadcasts it. The same values as the sum's
// node followed by a division and a cast (nanfree/_ops/losses.py's steps,
// which torch.compile traces), without those two nodes (a third of a small
// batch's forward and backward).
struct NanfreePointwiseLossReducedBackward final
    : torch::autograd::Function<NanfreePointwiseLossReducedBackward> {
  static at::Tensor reduce(const at::Tensor& input, const at::Tensor& target,
                           const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& pos_weight, int64_t kind, double alpha,
                           double gamma, int64_t count) {
    static const auto sum_op = find_op<PointwiseLossSignature>("nanfree::pointwise_loss_sum");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor total = sum_op.call(input, target, weight, pos_weight, kind, alpha, gamma);
    // A mean over nothing is 0 (as cross_entropy's), not 0 / 0.
    if (count > 1) total = divide_sum(std::move(total), static_cast<double>(count));
    return total.to(input.scalar_type());
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& target, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& pos_weight, int64_t kind,
                               double alpha, double gamma, int64_t count) {
    save_pointwise_loss(ctx, input, target, weight, pos_weight, kind, alpha, gamma);
    ctx->saved_data["count"] = count;
    return {reduce(input, target, weight, pos_weight, kind, alpha, gamma, count)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const int64_t count = ctx->saved_data["count"].toInt();
    at::Tensor grad;
    if (grads[0].device().is_cpu() && !needs_graph(grads[0])) {
      // The tensor steps below on numbers (a CPU value is read without waiting).
      grad = at::empty({}, input.options());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                      "pointwise_loss_reduced_backward", [&] {
        using acc_t = at::opmath_type<scalar_t>;  // the sum's dtype
        acc_t value = static_cast<acc_t>(grads[0].item<scalar_t>());
        if (count > 1) value = value / static_cast<acc_t>(count);
        *grad.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(value);
      });
    } else {
      grad = grads[0].to(at::toOpMathType(input.scalar_type()));
      if (count > 1) grad = grad / count;
      grad = grad.to(input.scalar_type());
    }
    return pointwise_loss_gradients(ctx, saved, grad, 8);
  }
};

// nanfree.ops' pointwise losses for input and target of one floating dtype,
// device and shape, weight and pos_weight broadcasting to it (plain_operand);
// None otherwise.
std::optional<at::Tensor> pointwise_loss_entry(const at::Tensor& input, const at::Tensor& target,
                                               const std::optional<at::Tensor>& weight,
                                               const std::optional<at::Tensor>& pos_weight,
                                               int64_t kind, double alpha, double gamma,
                                               int64_t reduction) {
  static const auto loss_op = find_op<PointwiseLossSignature>("nanfree::pointwise_loss");
  if (!entry_takes(input, target) || !is_kernel_float(input.scalar_type()) ||
      target.scalar_type() != input.scalar_type() || target.sizes() != input.sizes() ||
      target.device() != input.device() || at::autocast::is_autocast_enabled(input.device().type()) ||
      reduction < kReduceNone || reduction > kReduceBatchMean) {
    return std::nullopt;
  }
  for (const std::optional<at::Tensor>* t : {&weight, &pos_weight}) {
    if (!plain_operand(*t, input) || (t->has_value() && !broadcasts_to((*t)->sizes(), input.sizes()))) {
      return std::nullopt;
    }
  }
  if (reduction == kReduceNone) return loss_op.call(input, target, weight, pos_weight, kind, alpha, gamma);
  const int64_t count = reduction == kReduceSum        ? 1
                        : reduction == kReduceMean     ? input.numel()
                        : input.dim() > 0              ? input.size(0)
                                                       : 1;
  if (any_needs_graph(input, target)) {
    return NanfreePointwiseLossReducedBackward::apply(input, target, weight, pos_weight, kind, alpha,
                                                      gamma, count)[0];
  }
  return NanfreePointwiseLossReducedBackward::reduce(input, target, weight, pos_weight, kind, alpha,
                                                     gamma, count);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) {
  m.impl("pointwise_loss", &pointwise_loss_with_autograd<false>);
  m.impl("pointwise_loss_sum", &pointwise_loss_with_autograd<true>);
  m.impl("cross_entropy", &cross_entropy_with_autograd);
  m.impl("pointwise_loss_backward",
         &BackwardOpAutograd<NanfreePointwiseLossBackwardBackward, &pointwise_loss_backward_op>::kernel);
  m.impl("cross_entropy_backward",
         &BackwardOpAutograd<NanfreeCrossEntropyBackwardBackward, &cross_entropy_backward_op>::kernel);
}

void bind_losses(pybind11::module_& m) {
  namespace py = pybind11;
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("cross_entropy", &cross_entropy_entry, release);
  m.def("pointwise_loss", &pointwise_loss_entry, release);
  py::tuple reductions(std::size(kLossReductions));
  for (std::size_t i = 0; i < std::size(kLossReductions); ++i) reductions[i] = kLossReductions[i];
  m.attr("LOSS_REDUCTIONS") = reductions;
}

}  // namespace nanfree
