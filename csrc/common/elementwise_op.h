// The elementwise family's argument checks and dtypes, shared by the CPU and
// CUDA registrations (and mirrored with the same words by
// nanfree/_ops/elementwise.py). Unary ops: <op>(input) and
// <op>_backward(grad, input, order) of csrc/registration.cpp, <op> in
// kUnaryOpNames (the order of UnaryOp in nanfree/elementwise_math.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <utility>

#include "common/checks.h"
#include "nanfree/elementwise_math.h"

namespace nanfree {

constexpr const char* kUnaryOpNames[] = {"sqrt", "log", "log1p", "acos", "asin"};
constexpr int kUnaryOpCount = 5;

constexpr const char* unary_op_name(UnaryOp op) { return kUnaryOpNames[static_cast<int>(op)]; }

inline std::string unary_backward_name(UnaryOp op) {
  return std::string(unary_op_name(op)) + "_backward";
}

// The floating input an op computes on, as torch's: integer and bool inputs
// are promoted to the default float dtype (torch.sqrt(int) is float32);
// complex input is refused (TypeError in Python).
inline at::Tensor unary_operand(UnaryOp op, const at::Tensor& input) {
  TORCH_CHECK_TYPE(!at::isComplexType(input.scalar_type()), "nanfree.", unary_op_name(op),
                   ": complex `input` is not supported (got ", input.scalar_type(),
                   "); nanfree's elementwise ops are real-valued");
  if (at::isFloatingType(input.scalar_type())) return input;
  return input.to(c10::typeMetaToScalarType(c10::get_default_dtype()));
}

// <op>_backward's arguments: a floating input, a gradient of its dtype,
// shape and device, order 1 (the derivative) or 2 (the second derivative).
inline void check_unary_backward(UnaryOp op, const at::Tensor& grad, const at::Tensor& input,
                                 int64_t order) {
  const std::string name = unary_backward_name(op);
  check_float_input(name.c_str(), "input", input);
  TORCH_CHECK_VALUE(order == 1 || order == 2, "nanfree.", name,
                    ": `order` must be 1 (the derivative) or 2 (the second derivative), got ",
                    order);
  TORCH_CHECK_VALUE(grad.scalar_type() == input.scalar_type() && grad.sizes() == input.sizes(),
                    "nanfree.", name, ": `grad` must have the input's shape ", input.sizes(),
                    " and dtype ", input.scalar_type(), ", got ", grad.sizes(), " ",
                    grad.scalar_type());
  check_same_device(name.c_str(), "grad", input, grad);
}

// Registers Kernels<op>::forward as <op> and Kernels<op>::backward as
// <op>_backward for every unary op (a backend's TORCH_LIBRARY_IMPL block).
template <template <UnaryOp> class Kernels, int... index>
void register_unary_kernels(torch::Library& m, std::integer_sequence<int, index...>) {
  (m.impl(unary_op_name(static_cast<UnaryOp>(index)), &Kernels<static_cast<UnaryOp>(index)>::forward),
   ...);
  (m.impl(unary_backward_name(static_cast<UnaryOp>(index)).c_str(),
          &Kernels<static_cast<UnaryOp>(index)>::backward),
   ...);
}

template <template <UnaryOp> class Kernels>
void register_unary_kernels(torch::Library& m) {
  register_unary_kernels<Kernels>(m, std::make_integer_sequence<int, kUnaryOpCount>{});
}

}  // namespace nanfree
