// Typed handles of registered operators, for calling them through the
// dispatcher from C++ (autograd, autocast and the Python entry points).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace nanfree {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Signature>();
}

}  // namespace nanfree
