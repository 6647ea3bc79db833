// Every nanfree operator schema, defined once. Kernels are registered per
// device by csrc/cpu, csrc/cuda and (Triton, pure torch) by nanfree/_backends.py;
// fake kernels and autograd by nanfree/_softmax_registration.py.
#include <torch/library.h>

TORCH_LIBRARY(nanfree, m) {
  // Softmax family over the last dimension. `mask` is None or a bool tensor of
  // the input's shape (True = keep). Each forward also returns the row's
  // logsumexp in float32 (float64 for float64 input), which the backward uses.
  m.def("softmax_lastdim(Tensor input, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("log_softmax_lastdim(Tensor input, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("logsumexp_lastdim(Tensor input, Tensor? mask=None) -> (Tensor, Tensor)");
  m.def("softmax_lastdim_backward(Tensor grad_output, Tensor output, Tensor lse) -> Tensor");
  m.def(
      "log_softmax_lastdim_backward(Tensor grad_output, Tensor output, Tensor lse, "
      "Tensor? mask=None) -> Tensor");
  m.def(
      "logsumexp_lastdim_backward(Tensor grad_output, Tensor input, Tensor lse, "
      "Tensor? mask=None) -> Tensor");
}
