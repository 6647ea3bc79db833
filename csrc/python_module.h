// The Python module nanfree._C: each op family adds its entry points.
#pragma once

#include <pybind11/pybind11.h>

namespace nanfree {

void bind_softmax(pybind11::module_& m);
void bind_cosine(pybind11::module_& m);
void bind_debug(pybind11::module_& m);
void bind_elementwise(pybind11::module_& m);
void bind_elementwise_binary(pybind11::module_& m);
void bind_losses(pybind11::module_& m);

}  // namespace nanfree
