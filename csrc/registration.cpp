// Every nanfree operator schema, defined once. Kernels are registered per
// device by csrc/cpu, csrc/cuda and (Triton, pure torch) by nanfree/_backends.py;
// autograd and autocast once for all backends by csrc/softmax_autograd.cpp and
// csrc/softmax_autocast.cpp; fake kernels by nanfree/_softmax_registration.py.
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
}
