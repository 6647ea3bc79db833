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
}
