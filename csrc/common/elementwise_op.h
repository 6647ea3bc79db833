// The elementwise family's argument checks and dtypes, shared by the CPU and
// CUDA registrations (and mirrored with the same words by
// nanfree/_ops/elementwise.py). Unary ops: <op>(input) and
// <op>_backward(grad, input, order) of csrc/registration.cpp, <op> in
// kUnaryOpNames (the order of UnaryOp in nanfree/elementwise_math.h). Binary
// ops: <op>(input, other) and <op>_backward(grad, input, other, order,
// partial) and <op>_gradients(grad, input, other), <op> in kBinaryOpNames (the
// order of BinaryOp in nanfree/elementwise_binary_math.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>
#include <utility>

#include "common/checks.h"
#include "nanfree/elementwise_binary_math.h"
#include "nanfree/elementwise_math.h"

namespace nanfree {

constexpr const char* kUnaryOpNames[] = {"sqrt", "log", "log1p", "acos", "asin"};
constexpr int kUnaryOpCount = 5;

// A floating operand of a dtype the kernels compute in: float8 and float4
// are refused, as torch's own math kernels refuse them (TypeError in Python).
inline void check_elementwise_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(!at::isFloatingType(t.scalar_type()) || is_kernel_float(t.scalar_type()),
                   "nanfree.", op, ": `", name,
                   "` must be float16, bfloat16, float32 or float64 (integer and bool tensors "
                   "are promoted to the default float dtype), got ", t.scalar_type());
}

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
  check_elementwise_float(unary_op_name(op), "input", input);
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

// <op>_out's `out`: the output's shape and dtype, on ref's device (nanfree.ops
// resizes `out` and takes other dtypes by a copy before calling <op>_out).
inline void check_out(const char* op, const at::Tensor& out, at::IntArrayRef shape,
                      at::ScalarType dtype, const at::Tensor& ref) {
  const std::string name = std::string(op) + "_out";
  TORCH_CHECK_VALUE(out.sizes() == shape && out.scalar_type() == dtype, "nanfree.", name,
                    ": `out` must have the output's shape ", shape, " and dtype ", dtype,
                    ", got ", out.sizes(), " ", out.scalar_type());
  check_same_device(name.c_str(), "out", ref, out);
}

// Whether `out` shares memory with the operand t other than element for
// element (a partial overlap, or views of one allocation whose overlap ATen
// does not work out: either is not dense): <op>_out then computes first and
// copies, so every backend writes the op of the operand as it was (torch's
// out= refuses a partial overlap; the Python backends always compute first).
inline bool overlaps_partly(const at::Tensor& out, const at::Tensor& t) {
  const at::MemOverlapStatus status = at::get_overlap_status(out, t);
  if (status == at::MemOverlapStatus::TooHard) return out.storage().is_alias_of(t.storage());
  return status == at::MemOverlapStatus::Partial;
}

// Registers Kernels<op>::forward_out as <op>_out for every unary op (the
// compiled backends, which write into `out`; Python backends compute and copy).
template <template <UnaryOp> class Kernels, int... index>
void register_unary_out_kernels(torch::Library& m, std::integer_sequence<int, index...>) {
  (m.impl((std::string(unary_op_name(static_cast<UnaryOp>(index))) + "_out").c_str(),
          &Kernels<static_cast<UnaryOp>(index)>::forward_out),
   ...);
}

template <template <UnaryOp> class Kernels>
void register_unary_out_kernels(torch::Library& m) {
  register_unary_out_kernels<Kernels>(m, std::make_integer_sequence<int, kUnaryOpCount>{});
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

// gg * grad, the weight of a double backward's order-2 call, with zeros
// dominant as chain_rule's: a zero factor against an infinite one is 0, not
// NaN (NaN factors stay NaN). Differentiable (a where of a product).
inline at::Tensor zero_dominant_weight(const at::Tensor& gg, const at::Tensor& grad) {
  const at::Tensor zero = (gg.eq(0) | grad.eq(0)) & gg.eq(gg) & grad.eq(grad);
  return at::where(zero, at::zeros({}, gg.options()), gg * grad);
}

// --- binary ops -------------------------------------------------------------------

constexpr const char* kBinaryOpNames[] = {"pow", "atan2", "div_no_nan", "xlogy", "xlog1py"};
constexpr int kBinaryOpCount = 5;

constexpr const char* binary_op_name(BinaryOp op) { return kBinaryOpNames[static_cast<int>(op)]; }

inline std::string binary_backward_name(BinaryOp op) {
  return std::string(binary_op_name(op)) + "_backward";
}

// The floating dtype a binary op computes in, as torch's type promotion
// (at::result_type: a 0-d tensor does not widen a dimensioned one of its
// category); integer and bool results promote to the default float dtype
// (torch.xlogy(int, int) is float32); complex is refused (TypeError).
inline at::ScalarType binary_dtype(BinaryOp op, const at::Tensor& input, const at::Tensor& other) {
  for (const at::Tensor* t : {&input, &other}) {
    TORCH_CHECK_TYPE(!at::isComplexType(t->scalar_type()), "nanfree.", binary_op_name(op),
                     ": complex `", t == &input ? "input" : "other",
                     "` is not supported (got ", t->scalar_type(),
                     "); nanfree's elementwise ops are real-valued");
    check_elementwise_float(binary_op_name(op), t == &input ? "input" : "other", *t);
  }
  const at::ScalarType dtype = at::result_type(input, other);
  if (at::isFloatingType(dtype)) return dtype;
  return c10::typeMetaToScalarType(c10::get_default_dtype());
}

// The shape of the op's output: input's and other's broadcast (torch's rule),
// or a ValueError naming the op when they do not broadcast.
inline std::vector<int64_t> binary_shape(BinaryOp op, at::IntArrayRef input, at::IntArrayRef other) {
  const int64_t ndim = static_cast<int64_t>(std::max(input.size(), other.size()));
  std::vector<int64_t> shape(ndim);
  for (int64_t i = 0; i < ndim; ++i) {
    const int64_t ia = i - ndim + static_cast<int64_t>(input.size());
    const int64_t ib = i - ndim + static_cast<int64_t>(other.size());
    const int64_t sa = ia >= 0 ? input[ia] : 1, sb = ib >= 0 ? other[ib] : 1;
    TORCH_CHECK_VALUE(sa == sb || sa == 1 || sb == 1, "nanfree.", binary_op_name(op),
                      ": the size of `input` (", sa, ") must match the size of `other` (", sb,
                      ") at non-singleton dimension ", i, " (shapes ", input, " and ", other,
                      " do not broadcast)");
    shape[i] = sa == 1 ? sb : sa;
  }
  return shape;
}

// input and other in the op's dtype, on one device (a 0-d CPU tensor joins the
// other's device, as torch's binary ops take CPU scalars), with shapes that
// broadcast (torch's words when they do not).
inline std::pair<at::Tensor, at::Tensor> binary_operands(BinaryOp op, const at::Tensor& input,
                                                         const at::Tensor& other) {
  const at::ScalarType dtype = binary_dtype(op, input, other);
  at::Tensor a = input, b = other;
  if (a.device() != b.device()) {
    if (b.dim() == 0 && b.is_cpu()) b = b.to(a.device());
    else if (a.dim() == 0 && a.is_cpu()) a = a.to(b.device());
  }
  check_same_device(binary_op_name(op), "other", a, b);
  binary_shape(op, a.sizes(), b.sizes());
  return {a.to(dtype), b.to(dtype)};
}

// The arguments of a binary op's backward op `name` (<op>_backward or
// <op>_gradients): input and other of one floating dtype and device that
// broadcast to grad's shape, grad of that dtype.
inline void check_binary_gradient_operands(BinaryOp op, const std::string& name,
                                           const at::Tensor& grad, const at::Tensor& input,
                                           const at::Tensor& other) {
  check_float_input(name.c_str(), "input", input);
  TORCH_CHECK_VALUE(other.scalar_type() == input.scalar_type() &&
                        grad.scalar_type() == input.scalar_type(),
                    "nanfree.", name, ": `grad`, `input` and `other` must have one dtype, got ",
                    grad.scalar_type(), ", ", input.scalar_type(), ", ", other.scalar_type());
  const std::vector<int64_t> shape = binary_shape(op, input.sizes(), other.sizes());
  TORCH_CHECK_VALUE(grad.sizes() == at::IntArrayRef(shape), "nanfree.", name,
                    ": `grad` must have the broadcast shape ", at::IntArrayRef(shape), ", got ",
                    grad.sizes());
  check_same_device(name.c_str(), "other", input, other);
  check_same_device(name.c_str(), "grad", input, grad);
}

// <op>_backward's arguments: those above, order 1 (partial 0 = d/d input, 1 =
// d/d other) or 2 (partial 0, 1, 2 = d2/d input2, d2/d input d other, d2/d other2).
inline void check_binary_backward(BinaryOp op, const at::Tensor& grad, const at::Tensor& input,
                                  const at::Tensor& other, int64_t order, int64_t partial) {
  const std::string name = binary_backward_name(op);
  TORCH_CHECK_VALUE(order == 1 || order == 2, "nanfree.", name,
                    ": `order` must be 1 (the derivative) or 2 (the second derivative), got ",
                    order);
  TORCH_CHECK_VALUE(partial >= 0 && partial <= order, "nanfree.", name, ": `partial` must be in [0, ",
                    order, "] for order ", order, ", got ", partial);
  check_binary_gradient_operands(op, name, grad, input, other);
}

inline std::string binary_gradients_name(BinaryOp op) {
  return std::string(binary_op_name(op)) + "_gradients";
}

// Calls f(std::integral_constant<int, order>, std::integral_constant<int, partial>)
// for the runtime order (0, 1 or 2) and partial: one kernel instantiation each.
template <typename F>
void dispatch_binary_partial(int64_t order, int64_t partial, F&& f) {
  using std::integral_constant;
  if (order == 0) {
    f(integral_constant<int, 0>{}, integral_constant<int, 0>{});
  } else if (order == 1) {
    if (partial == 0) f(integral_constant<int, 1>{}, integral_constant<int, 0>{});
    else f(integral_constant<int, 1>{}, integral_constant<int, 1>{});
  } else {
    if (partial == 0) f(integral_constant<int, 2>{}, integral_constant<int, 0>{});
    else if (partial == 1) f(integral_constant<int, 2>{}, integral_constant<int, 1>{});
    else f(integral_constant<int, 2>{}, integral_constant<int, 2>{});
  }
}

// Registers Kernels<op>::forward as <op>, Kernels<op>::backward as
// <op>_backward and Kernels<op>::gradients as <op>_gradients for every binary op.
template <template <BinaryOp> class Kernels, int... index>
void register_binary_kernels(torch::Library& m, std::integer_sequence<int, index...>) {
  (m.impl(binary_op_name(static_cast<BinaryOp>(index)),
          &Kernels<static_cast<BinaryOp>(index)>::forward),
   ...);
  (m.impl(binary_backward_name(static_cast<BinaryOp>(index)).c_str(),
          &Kernels<static_cast<BinaryOp>(index)>::backward),
   ...);
  (m.impl(binary_gradients_name(static_cast<BinaryOp>(index)).c_str(),
          &Kernels<static_cast<BinaryOp>(index)>::gradients),
   ...);
}

template <template <BinaryOp> class Kernels>
void register_binary_kernels(torch::Library& m) {
  register_binary_kernels<Kernels>(m, std::make_integer_sequence<int, kBinaryOpCount>{});
}

// f(name) for the name of every <op>_out, unary and binary.
template <typename F>
void for_each_out_op(F&& f) {
  for (const char* op : kUnaryOpNames) f(std::string(op) + "_out");
  for (const char* op : kBinaryOpNames) f(std::string(op) + "_out");
}

// Registers Kernels<op>::forward_out as <op>_out for every binary op.
template <template <BinaryOp> class Kernels, int... index>
void register_binary_out_kernels(torch::Library& m, std::integer_sequence<int, index...>) {
  (m.impl((std::string(binary_op_name(static_cast<BinaryOp>(index))) + "_out").c_str(),
          &Kernels<static_cast<BinaryOp>(index)>::forward_out),
   ...);
}

template <template <BinaryOp> class Kernels>
void register_binary_out_kernels(torch::Library& m) {
  register_binary_out_kernels<Kernels>(m, std::make_integer_sequence<int, kBinaryOpCount>{});
}

}  // namespace nanfree
