// The MNR family's C++ side shared by every backend (C++, CUDA, Triton, pure
// torch): the autograd of mnr_loss, registered once at the Autograd key.
//
// mnr_loss called with `grad` and a reduced loss (nanfree.ops.mnr_loss does so
// when the loss is reduced to a scalar and a gradient is wanted) has computed
// the gradients for an upstream gradient of 1 in the same pass as the loss (no
// logit is recomputed): the node saves them and its backward scales them by
// the incoming gradient, saturating. Otherwise (reduction 'none', or called
// without `grad`) it saves the inputs and the row statistics, and its backward
// calls mnr_loss_backward, which recomputes the logits tile by tile. The
// docs' gradient is one [M, d] tensor; each block's is a view of it. Double
// backward is refused.
//
// The node is C++ (as every family's) rather than Python: a Python autograd
// node (torch.library.register_autograd) cost about 0.14 ms forward and as
// much backward per call, 3-8% of a B = 1024 training step's loss.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/autograd.h"
#include "common/checks.h"
#include "common/find_op.h"
#include "common/mnr_op.h"

namespace nanfree {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// mnr_loss's arguments after the tensors (queries, docs, scale).
struct MnrConfig {
  double scale_value;
  int64_t offset;
  int64_t rows;
  int64_t owned_blocks;
  int64_t directions;
  bool per_direction;
  int64_t hardness_mode;
  double hardness_strength;
  int64_t reduction;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_mnr_loss(
    const at::Tensor& queries, at::TensorList docs, const std::optional<at::Tensor>& scale,
    const MnrConfig& c, bool grad) {
  static const auto op = find_op<MnrLossSignature>("nanfree::mnr_loss");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(queries, docs, scale, c.scale_value, c.offset, c.rows, c.owned_blocks,
                 c.directions, c.per_direction, c.hardness_mode, c.hardness_strength, c.reduction,
                 grad);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_mnr_loss_backward(
    const at::Tensor& grad_loss, const at::Tensor& queries, at::TensorList docs,
    const std::optional<at::Tensor>& scale, const at::Tensor& stats, const MnrConfig& c) {
  static const auto op = find_op<MnrLossBackwardSignature>("nanfree::mnr_loss_backward");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(grad_loss, queries, docs, scale, c.scale_value, stats, c.offset, c.rows,
                 c.owned_blocks, c.directions, c.per_direction, c.hardness_mode,
                 c.hardness_strength, c.reduction);
}

// grad * factor (an upstream gradient, or 1) in `dtype`, saturated at that
// dtype's largest finite value (a true gradient past its range); NaN stays NaN
// through clamp. The product is taken in the wider of grad's dtype and `dtype`.
template <typename Factor>
at::Tensor unscaled(const at::Tensor& grad, const Factor& factor, at::ScalarType dtype) {
  const double big = largest_finite(dtype);
  const at::ScalarType wide = at::promote_types(grad.scalar_type(), dtype);
  // The product is a fresh tensor: clamped in place, no second copy is held.
  return (grad.to(wide) * factor).clamp_(-big, big).to(dtype);
}

// A gradient computed for an upstream 1, in the embeddings' dtype, times the
// upstream gradient `factor` (0-d, in the accumulation dtype), saturated in
// that dtype: the exact product rounded once. On CPU a half tensor times a 0-d
// float32 tensor is that product (ATen multiplies by the unrounded factor in
// float32), so no float32 copy is made; on a GPU the factor would be rounded
// to the half dtype first, so a half gradient goes through float32.
at::Tensor scaled_saved_gradient(const at::Tensor& grad, const at::Tensor& factor) {
  if (grad.scalar_type() == factor.scalar_type() || grad.is_cpu()) {
    const double big = largest_finite(grad.scalar_type());
    return (grad * factor).clamp_(-big, big);
  }
  return unscaled(grad.to(factor.scalar_type()), factor, grad.scalar_type());
}

// Whether an upstream gradient is exactly 1 and a CPU tensor, whose value is
// read on the host at no cost (no device sync); false for a tensor being traced
// (fake, functional or torch.func tensors), whose value is not known.
bool is_one_on_host(const at::Tensor& t) {
  if (!t.device().is_cpu() || t.layout() != at::kStrided || t.numel() != 1) return false;
  const c10::DispatchKeySet keys = t.key_set();
  if (keys.has_any(c10::python_ks) || keys.has(c10::DispatchKey::Functionalize) ||
      keys.has_any(c10::functorch_transforms_ks)) {
    return false;
  }
  return t.item<double>() == 1.0;
}

// What the node keeps besides its saved tensors.
const char* const kPrecomputed = "precomputed";  // bool: saved gradients, else inputs
const char* const kDocShapes = "doc_shapes";     // ints: per block its dim, then its sizes
const char* const kScaleShape = "scale_shape";   // ints; absent without a scale tensor
const char* const kScaleDtype = "scale_dtype";

void save_config(AutogradContext* ctx, const MnrConfig& c) {
  ctx->saved_data["scale_value"] = c.scale_value;
  ctx->saved_data["ints"] = std::vector<int64_t>{c.offset, c.rows, c.owned_blocks, c.directions,
                                                 c.per_direction, c.hardness_mode, c.reduction};
  ctx->saved_data["hardness_strength"] = c.hardness_strength;
}

MnrConfig saved_config(AutogradContext* ctx) {
  const std::vector<int64_t> i = ctx->saved_data.at("ints").toIntVector();
  return MnrConfig{ctx->saved_data.at("scale_value").toDouble(),
                   i[0],
                   i[1],
                   i[2],
                   i[3],
                   i[4] != 0,
                   i[5],
                   ctx->saved_data.at("hardness_strength").toDouble(),
                   i[6]};
}

// The gradient of each block of the docs from the [M, d] gradient of all:
// views, no copy (a [R', k, d] block's is a transposed view).
void split_doc_grads(const at::Tensor& grad_docs, const std::vector<int64_t>& shapes,
                     variable_list& out, size_t first) {
  int64_t start = 0;
  for (size_t at = 0; at < shapes.size(); at += 1 + shapes[at], ++first) {
    const int64_t dim = shapes[at];
    const int64_t n = dim == 2 ? shapes[at + 1] : shapes[at + 1] * shapes[at + 2];
    at::Tensor g = grad_docs.narrow(0, start, n);
    if (dim == 3) g = g.view({shapes[at + 2], shapes[at + 1], shapes[at + 3]}).transpose(0, 1);
    out[first] = g;
    start += n;
  }
}

// (grad_queries, grad_docs [M, d], grad_scale or undefined) for `grad_loss`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> mnr_gradients(AutogradContext* ctx,
                                                             const at::Tensor& grad_loss) {
  const variable_list saved = ctx->get_saved_variables();
  at::Tensor gq, gd, gs;
  if (ctx->saved_data.at(kPrecomputed).toBool()) {
    // The gradients of an upstream 1 (a scalar loss): scaled, not recomputed.
    // A product past the dtype's range saturates, as the recomputing path's.
    if (is_one_on_host(grad_loss)) {
      // The gradients themselves (a loss's backward() on CPU): no pass over them.
      // Without retain_graph the node lets go of them now, so they are the
      // caller's alone; with it, modifying one in place and differentiating
      // again fails autograd's version check, as for any saved tensor.
      gq = saved[0], gd = saved[1], gs = saved[2];
    } else {
      const at::Tensor factor = grad_loss.to(saved[2].scalar_type());
      gq = scaled_saved_gradient(saved[0], factor);
      gd = scaled_saved_gradient(saved[1], factor);
      gs = unscaled(saved[2], factor, saved[2].scalar_type());
    }
  } else {
    const std::vector<at::Tensor> docs(saved.begin() + 4, saved.end());
    const std::optional<at::Tensor> scale = optional_of(saved[1]);
    std::tie(gq, gd, gs) = call_mnr_loss_backward(grad_loss.contiguous(), saved[0], docs, scale,
                                                  saved[2], saved_config(ctx));
  }
  if (ctx->saved_data.count(kScaleShape)) {
    // In the scale's dtype, saturating (a float32 scale of float64 embeddings).
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data.at(kScaleDtype).toInt());
    gs = unscaled(gs.reshape(ctx->saved_data.at(kScaleShape).toIntVector()), 1.0, dtype);
  } else {
    gs = at::Tensor();
  }
  return {gq, gd, gs};
}

// The loss's backward with create_graph=True: the gradients, computed below
// autograd, on a node hanging off the loss whose own backward refuses, so that
// differentiating them reaches it (and refuses) whatever else requires grad.
struct NanfreeMnrLossBackwardBackward final
    : torch::autograd::Function<NanfreeMnrLossBackwardBackward> {
  static variable_list forward(AutogradContext* /*ctx*/, AutogradContext* outer,
                               const at::Tensor& grad_loss, const at::Tensor& /*loss*/) {
    auto [gq, gd, gs] = mnr_gradients(outer, grad_loss);
    return {gq, gd, gs};
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    refuse_double_backward("nanfree::mnr_loss_backward", "mnr");
  }
};

// The graph node, named as torch names its own (grad_fn=<NanfreeMnrLossBackward>).
struct NanfreeMnrLossBackward final : torch::autograd::Function<NanfreeMnrLossBackward> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& queries,
                               at::TensorList docs, const std::optional<at::Tensor>& scale,
                               const MnrConfig& config, bool grad) {
    auto [loss, stats, gq, gd, gs] = call_mnr_loss(queries, docs, scale, config, grad);
    // Gradients computed for an upstream 1 can be scaled by a scalar upstream
    // gradient only; with reduction 'none' (0) the backward recomputes.
    const bool precomputed = grad && config.reduction != 0;
    ctx->saved_data[kPrecomputed] = precomputed;
    std::vector<int64_t> shapes;
    for (const at::Tensor& block : docs) {
      shapes.push_back(block.dim());
      shapes.insert(shapes.end(), block.sizes().begin(), block.sizes().end());
    }
    ctx->saved_data[kDocShapes] = shapes;
    if (scale.has_value()) {
      ctx->saved_data[kScaleShape] = scale->sizes().vec();
      ctx->saved_data[kScaleDtype] = static_cast<int64_t>(scale->scalar_type());
    }
    // The loss itself is saved too (a scalar or [B]): with create_graph=True
    // the refusing node of the gradients hangs off it.
    if (precomputed) {
      ctx->save_for_backward({gq, gd, gs, loss});
    } else {
      save_config(ctx, config);
      std::vector<at::Tensor> to_save{queries, scale.value_or(at::Tensor()), stats, loss};
      to_save.insert(to_save.end(), docs.begin(), docs.end());
      ctx->save_for_backward(to_save);
    }
    ctx->mark_non_differentiable({stats, gq, gd, gs});
    // The other outputs never receive a gradient: no zero tensors of their sizes.
    ctx->set_materialize_grads(false);
    return {loss, stats, gq, gd, gs};
  }

  // One gradient per input entry: queries, each doc block, scale, config, grad.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::vector<int64_t> shapes = ctx->saved_data.at(kDocShapes).toIntVector();
    size_t blocks = 0;
    for (size_t at = 0; at < shapes.size(); at += 1 + shapes[at]) ++blocks;
    variable_list out(blocks + 4);
    // No gradient reached the loss (only its unmaterialized siblings'): none flows back.
    if (!grads[0].defined()) return out;
    at::Tensor gq, gd, gs;
    if (at::GradMode::is_enabled()) {
      // The loss is the fourth saved tensor either way (see forward).
      const at::Tensor loss = ctx->get_saved_variables()[3];
      const variable_list g = NanfreeMnrLossBackwardBackward::apply(ctx, grads[0], loss);
      gq = g[0], gd = g[1], gs = g[2];
    } else {
      std::tie(gq, gd, gs) = mnr_gradients(ctx, grads[0]);
    }
    out[0] = gq;
    if (gd.defined()) split_doc_grads(gd, shapes, out, 1);
    out[1 + blocks] = gs;
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mnr_loss_with_autograd(
    const at::Tensor& queries, at::TensorList docs, const std::optional<at::Tensor>& scale,
    double scale_value, int64_t offset, int64_t rows, int64_t owned_blocks, int64_t directions,
    bool per_direction, int64_t hardness_mode, double hardness_strength, int64_t reduction,
    bool grad) {
  const MnrConfig config{scale_value, offset,        rows,           owned_blocks, directions,
                         per_direction, hardness_mode, hardness_strength, reduction};
  if (!any_needs_graph(queries, docs, scale)) {
    return call_mnr_loss(queries, docs, scale, config, grad);
  }
  const variable_list v = NanfreeMnrLossBackward::apply(queries, docs, scale, config, grad);
  return {v[0], v[1], v[2], v[3], v[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, Autograd, m) { m.impl("mnr_loss", &mnr_loss_with_autograd); }

}  // namespace nanfree
