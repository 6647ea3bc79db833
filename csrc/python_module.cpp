// nanfree._C as a Python module. Loading it also registers every operator
// schema (registration.cpp), autograd and autocast kernel it is linked with.
#include <torch/extension.h>

#include "python_module.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "nanfree's operator schemas, autograd, autocast and fast Python entry points";
  nanfree::bind_softmax(m);
  nanfree::bind_cosine(m);
  nanfree::bind_debug(m);
  nanfree::bind_elementwise(m);
  nanfree::bind_elementwise_binary(m);
  nanfree::bind_losses(m);
}
