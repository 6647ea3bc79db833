// Every nanfree operator schema, defined once. Kernels are registered per
// device by csrc/cpu, csrc/cuda and (Triton, pure torch) by nanfree/_backends.py;
// autograd once for all backends by csrc/softmax_autograd.cpp; fake kernels by
// nanfree/_softmax_registration.py.
#include <torch/library.h>

TORCH_LIBRARY(nanfree, m) {
  // Softmax family over the last dimension. `mask` is None or a bool tensor of
  // the input's shape (True = keep). Each forward also returns the row
  // statistics the backward uses: shape input.shape[:-1] + [2] holding (max,
  // log(sum(exp(x - max)))), float32 (float64 for float64 input).
  m.def("softmax_lastdim(Tensor input, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("log_softmax_lastdim(Tensor input, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("logsumexp_lastdim(Tensor input, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("softmax_lastdim_backward(Tensor grad_output, Tensor output, Tensor stats) -> Tensor");
  m.def(
      "log_softmax_lastdim_backward(Tensor grad_output, Tensor output, Tensor stats, "
      "Tensor? mask=None) -> Tensor");
  m.def(
      "logsumexp_lastdim_backward(Tensor grad_output, Tensor input, Tensor stats, "
      "Tensor? mask=None) -> Tensor");
}
