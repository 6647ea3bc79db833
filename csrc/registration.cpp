// Every nanfree operator schema, defined once. Kernels are registered per
// device by csrc/cpu, csrc/cuda and (Triton, pure torch) by nanfree/_backends.py;
// autograd and autocast once for all backends by csrc/<family>_autograd.cpp and
// csrc/<family>_autocast.cpp; fake kernels by nanfree/_<family>_registration.py.
#include <torch/library.h>

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
}
