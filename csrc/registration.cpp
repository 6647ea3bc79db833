// Every nanfree operator schema, defined once. Kernels are registered per
// device by csrc/cpu/<family>*.cpp, csrc/cuda/<family>.cpp and (Triton, pure
// torch) by nanfree/_backends.py; once for every backend, the autograd by
// csrc/<family>.cpp (the losses family's by nanfree/_ops/losses.py), the autocast by
// csrc/autocast.cpp and the fake kernels by nanfree/_ops/<family>.py.
#include <torch/library.h>

#include <string>

TORCH_LIBRARY(nanfree, m) {
  // Softmax family over dimension `dim` (negative counts from the end; a 0-d
  // input is one row of one entry). `mask` is None or a bool or integer
  // tensor that broadcasts to the input (True / nonzero = keep). Each forward
  // also returns the row statistics the backward uses: the input's shape with
  // `dim` of size 2 holding (max, log(sum(exp(x - max)))), float32 (float64
  // for float64 input). logsumexp's output drops `dim`.
  m.def("softmax(Tensor input, int dim, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("log_softmax(Tensor input, int dim, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("logsumexp(Tensor input, int dim, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("softmax_backward(Tensor grad_output, Tensor output, Tensor stats, int dim) -> Tensor");
  m.def(
      "log_softmax_backward(Tensor grad_output, Tensor output, Tensor stats, int dim, "
      "Tensor? mask=None) -> Tensor");
  m.def(
      "logsumexp_backward(Tensor grad_output, Tensor input, Tensor stats, int dim, "
      "Tensor? mask=None) -> Tensor");

  // Cosine family over the last dimension (nanfree.ops moves another dim last
  // and broadcasts). eps > 0. `stats` holds per vector what the backward uses
  // (cosine_math.h), in float32 (float64 for float64 input): normalize's is
  // input.shape[:-1] + [2], (p, grad_factor); cosine_similarity's is
  // x1.shape[:-1] + [6], (p1, q1, grad_factor1, p2, q2, grad_factor2), with x1
  // and x2 of one shape and the output x1.shape[:-1].
  m.def("normalize(Tensor input, float eps) -> (Tensor, Tensor)");
  m.def("normalize_backward(Tensor grad_output, Tensor output, Tensor stats) -> Tensor");
  m.def("cosine_similarity(Tensor x1, Tensor x2, float eps) -> (Tensor, Tensor)");
  m.def(
      "cosine_similarity_backward(Tensor grad_output, Tensor x1, Tensor x2, Tensor output, "
      "Tensor stats) -> (Tensor, Tensor)");
  // clamp(a @ b.T, -1, 1) of row-normalized a [N, d] and b [M, d] (cos_sim's
  // GEMM); its gradient passes the clamp straight through.
  m.def("cos_sim_matrix(Tensor a, Tensor b) -> Tensor");

  // GeM pooling over dim 1 of a 3-D input [outer, n, inner] (nanfree.ops
  // views any dim or tuple of dims as the middle one): the output is
  // [outer, inner], mean(max(x, eps) ** p) ** (1/p) over the kept entries.
  // `p` is None (then `p_value`, finite and > 0, is used as is) or a floating
  // tensor of one element, clamped to [1e-2, 1e2] in the accumulation dtype.
  // `mask` is None or a bool tensor of the input's shape (any strides; True =
  // keep). `stats` is [outer, inner, 3] of the accumulation dtype (float32,
  // float64 for float64 input): (m, mean, count) of gem_math.h. The backward
  // returns (grad_input, grad_p): grad_p is, when `p_grad` (p given), the 0-d
  // sum over reductions of d gem / d p (before the clamp's mask; autograd
  // applies it and casts to p's dtype), else an empty [0] tensor.
  m.def(
      "gem(Tensor input, Tensor? p, float p_value, float eps, Tensor? mask=None) -> "
      "(Tensor, Tensor)");
  m.def(
      "gem_backward(Tensor grad_output, Tensor input, Tensor? p, float p_value, Tensor stats, "
      "float eps, Tensor? mask, bool p_grad) -> (Tensor, Tensor)");

  // Multiple negatives ranking (InfoNCE) loss of row-normalized `queries`
  // [R, d] and documents `docs` (one floating dtype; mnr_math.h gives the
  // layout and every rule): a list of blocks read in place, each [n, d] (its
  // n rows, in order) or [R', k, d] (k blocks of R' rows, block j = [:, j]),
  // M docs in all; the gradient of the docs is one [M, d] tensor in that order. Local rows g in [offset, offset + rows) are
  // scored; `directions` is a bit set (1 query_to_doc, always; 2
  // query_to_query; 4 doc_to_query; 8 doc_to_doc); hardness_mode 0 none, 1
  // in_batch_negatives, 2 hard_negatives, 3 all_negatives; reduction 0 none
  // ([rows]), 1 mean, 2 sum (0-d). `scale` is None (then `scale_value` > 0
  // is used) or a floating tensor of one element. Returns (loss, stats,
  // grad_queries, grad_docs, grad_scale): loss in float32 (float64 for
  // float64 docs); stats [rows, 3] of that dtype, each local row's two
  // logsumexps (its query row, its positive's row: -inf without
  // doc_to_query / doc_to_doc) relative to its target logit t = scale *
  // cos(query, positive), then t; with `grad`, the gradients of the loss for
  // an upstream gradient of 1 (ones for reduction none), in the inputs'
  // dtype and, for a tensor scale, a 0-d accumulation-dtype scale gradient;
  // else empty [0] tensors.
  m.def(
      "mnr_loss(Tensor queries, Tensor[] docs, Tensor? scale, float scale_value, int offset, "
      "int rows, int owned_blocks, int directions, bool per_direction, int hardness_mode, "
      "float hardness_strength, int reduction, bool grad) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The gradients for an upstream gradient `grad_loss` (the loss's shape and
  // dtype), recomputing the logits from `stats`: (grad_queries, grad_docs,
  // grad_scale), grad_scale empty [0] when `scale` is None.
  m.def(
      "mnr_loss_backward(Tensor grad_loss, Tensor queries, Tensor[] docs, Tensor? scale, "
      "float scale_value, Tensor stats, int offset, int rows, int owned_blocks, int directions, "
      "bool per_direction, int hardness_mode, float hardness_strength, int reduction) -> "
      "(Tensor, Tensor, Tensor)");

  // Elementwise family, unary ops (torch's sqrt, log, log1p, acos, asin with
  // the rules of elementwise_math.h). `input` of any dtype but complex
  // (integer and bool promote to the default float dtype), any shape and
  // strides; the output has torch's dtype and layout. <op>_backward gives
  // grad * the order-th derivative at `input` (order 1 or 2; `grad` of the
  // input's shape and floating dtype), saturated to the dtype's range; it is
  // differentiable once (order 1 through order 2), as double backward needs.
  // <op>_out writes <op>(input) into `out`, which has the output's shape, dtype
  // and device (nanfree.ops resizes it and takes other dtypes by a copy); it is
  // not differentiable, as torch's out= forms are not.
  for (const char* op : {"sqrt", "log", "log1p", "acos", "asin"}) {
    m.def((std::string(op) + "(Tensor input) -> Tensor").c_str());
    m.def((std::string(op) + "_out(Tensor input, Tensor(a!) out) -> ()").c_str());
    m.def((std::string(op) + "_backward(Tensor grad, Tensor input, int order=1) -> Tensor").c_str());
  }

  // Elementwise family, binary ops (torch's pow, atan2, xlogy, special.xlog1py,
  // and div_no_nan = input / other, 0 where other == 0, with the rules of
  // elementwise_binary_math.h). `input` and `other` broadcast, of any dtypes
  // but complex, promoted as torch's (at::result_type; integer results to the
  // default float dtype); a 0-d CPU `other` or `input` joins the other's
  // device. <op>_backward gives grad * one partial derivative at (input, other)
  // in the broadcast shape (the autograd sums it to each input's shape):
  // order 1, partial 0 = d/d input, 1 = d/d other; order 2, partial 0, 1, 2 =
  // d2/d input2, d2/d input d other, d2/d other2. `grad`, `input` and `other`
  // share one floating dtype, `grad` has the broadcast shape. Differentiable
  // once (order 1 through order 2), as double backward needs. <op>_gradients
  // gives both first-order ones, (grad * d/d input, grad * d/d other), in one
  // pass (the backward when both inputs need a gradient and no graph is
  // recorded); it refuses to be differentiated. <op>_out as the unary ops'.
  for (const char* op : {"pow", "atan2", "div_no_nan", "xlogy", "xlog1py"}) {
    m.def((std::string(op) + "(Tensor input, Tensor other) -> Tensor").c_str());
    m.def((std::string(op) + "_out(Tensor input, Tensor other, Tensor(a!) out) -> ()").c_str());
    m.def((std::string(op) +
           "_backward(Tensor grad, Tensor input, Tensor other, int order=1, int partial=0) -> Tensor")
              .c_str());
    m.def((std::string(op) + "_gradients(Tensor grad, Tensor input, Tensor other) -> (Tensor, Tensor)")
              .c_str());
  }

  // Losses family (losses_math.h has every rule). pointwise_loss is the
  // unreduced loss of binary_cross_entropy_with_logits (kind 0),
  // binary_cross_entropy (1), kl_div (2), kl_div with log_target (3) and
  // sigmoid_focal_loss (4; alpha, gamma): `input` and `target` of one shape and
  // floating dtype, `weight` and `pos_weight` None or of that dtype and
  // broadcasting to the input (read as 1 when None; kinds 2-4 take neither);
  // the output has the input's shape and dtype (contiguous).
  // pointwise_loss_sum is the sum of that loss over every element (the mean
  // and sum reductions without the unreduced tensor): a 0-d tensor of the
  // accumulation dtype (float32; float64 for float64 input).
  // pointwise_loss_backward gives grad * d loss / d input (partial 0) or
  // d / d target (partial 1), saturated to the dtype's range; `grad` of that
  // dtype broadcasts to the input.
  m.def(
      "pointwise_loss(Tensor input, Tensor target, Tensor? weight, Tensor? pos_weight, int kind, "
      "float alpha, float gamma) -> Tensor");
  m.def(
      "pointwise_loss_sum(Tensor input, Tensor target, Tensor? weight, Tensor? pos_weight, "
      "int kind, float alpha, float gamma) -> Tensor");
  m.def(
      "pointwise_loss_backward(Tensor grad, Tensor input, Tensor target, Tensor? weight, "
      "Tensor? pos_weight, int kind, float alpha, float gamma, int partial) -> Tensor");
  // cross_entropy of logits `input` [outer, C, inner] (contiguous, floating)
  // against class indices `target` [outer, inner] (int64, contiguous) or
  // probabilities of the input's shape and dtype (contiguous). `weight` None
  // or [C] of the input's dtype; `mask` None or bool [outer, C, inner], any
  // strides (True = the class exists); ignore_index as torch's (class-index
  // targets); label_smoothing in [0, 1]. Returns (loss, stats): the weighted
  // loss per position [outer, inner] and stats [outer, inner, 5] (max,
  // log_sum, total weight, smoothing, denominator of losses_math.h), both
  // float32 (float64 for float64 input). The backward takes the upstream
  // gradient per position ([outer, inner], the loss's dtype) and returns
  // (grad_input, grad_target): grad_target of a probability target when
  // `target_grad`, else an empty [0] tensor.
  m.def(
      "cross_entropy(Tensor input, Tensor target, Tensor? weight, Tensor? mask, int ignore_index, "
      "float label_smoothing) -> (Tensor, Tensor)");
  m.def(
      "cross_entropy_backward(Tensor grad, Tensor input, Tensor target, Tensor? weight, "
      "Tensor? mask, int ignore_index, float label_smoothing, Tensor stats, bool target_grad) -> "
      "(Tensor, Tensor)");
}
