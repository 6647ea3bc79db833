// CPU kernels of the elementwise family's binary ops: <op>(input, other),
// <op>_backward(grad, input, other, order, partial), <op>_gradients(grad,
// input, other) and <op>_out(input, other, out) of csrc/registration.cpp, one TensorIterator loop per op,
// order and partial (both partials for <op>_gradients, two outputs) that applies
// nanfree/elementwise_binary_math.h to each element. TensorIterator
// broadcasts the operands, gives the output torch's layout and splits the work
// over threads. Runs where the output is contiguous and each input contiguous
// or broadcast along the run (a scalar `other`, a row against a matrix) go
// through the header's functions instantiated with ATen's vectors (float16
// and bfloat16 widened to float), two vectors per step; other runs element by
// element. pow with a one-element exponent of 2, 3, 0.5, -0.5, -1 or -2 (the
// exponents torch's CPU pow computes without pow) takes the header's
// pow_element_at_exponent: products, square roots and divisions.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "cpu/vec_math.h"  // before the headers: their vector primitives
#include "cpu/vec.h"

#include "common/elementwise_op.h"
#include "nanfree/elementwise_binary_math.h"

namespace nanfree {
namespace {

using cpu::Vec;

// Entries [j, j + count) of an input run as accumulation-type lanes: the run's
// vector, or its one entry in every lane when the run is broadcast (stride 0).
template <typename scalar_t>
Vec<at::opmath_type<scalar_t>> load_run(const char* ptr, bool broadcast, int64_t j, int64_t count) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto* p = reinterpret_cast<const scalar_t*>(ptr);
  if (broadcast) return Vec<acc_t>(static_cast<acc_t>(*p));
  return cpu::load_vec(p + j, count);
}

// Stores two accumulation-type vectors at p: float16 / bfloat16 as one full
// vector of scalar_t (two half-width stores would each take the partial-store path).
template <typename scalar_t>
void store_pair(const Vec<at::opmath_type<scalar_t>>& v0, const Vec<at::opmath_type<scalar_t>>& v1,
                scalar_t* p) {
  using V = Vec<at::opmath_type<scalar_t>>;
  if constexpr (std::is_same_v<scalar_t, at::opmath_type<scalar_t>>) {
    v0.store(p);
    v1.store(p + V::size());
  } else {
    cpu::narrow_pair<scalar_t>(v0, v1).store(p);
  }
}

// One element of <op> or <op>_backward: binary_element of the header.
template <BinaryOp op, int order, int partial>
struct BinaryElement {
  template <typename T>
  static T apply(T g, T a, T b, T bound) {
    return binary_element<op, order, partial>(g, a, b, bound);
  }
};

// One element of pow or pow_backward where the exponent is e everywhere.
template <PowExponent e, int order, int partial>
struct PowElementAtExponent {
  template <typename T>
  static T apply(T g, T a, T b, T bound) {
    return pow_element_at_exponent<e, order, partial>(g, a, b, bound);
  }
};

// Runs Elements over iter, one output each: operands (out..., a, b) without
// grad, (out..., grad, a, b) with it.
template <bool kGrad, typename scalar_t, typename... Elements>
void binary_loop(at::TensorIteratorBase& iter) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int kOutputs = static_cast<int>(sizeof...(Elements));
  constexpr int kGradIndex = kOutputs;
  constexpr int kFirst = kOutputs + (kGrad ? 1 : 0);  // the operand index of a (b follows)
  constexpr int kTensors = kFirst + 2;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(scalar_t));
  const acc_t bound = static_cast<acc_t>(largest_finite(iter.dtype(0)));
  const V bound_vec(bound);
  iter.for_each([&](char** data, const int64_t* strides, int64_t n0, int64_t n1) {
    bool vector_run = true;
    for (int t = 0; t < kOutputs; ++t) vector_run = vector_run && strides[t] == kSize;
    for (int t = kOutputs; t < kTensors; ++t) {
      vector_run = vector_run && (strides[t] == kSize || strides[t] == 0);
    }
    for (int64_t i1 = 0; i1 < n1; ++i1) {
      char* ptr[kTensors];
      for (int t = 0; t < kTensors; ++t) ptr[t] = data[t] + i1 * strides[kTensors + t];
      if (vector_run) {
        // The run's pointers and broadcast flags in locals: the stores below cannot
        // alias them, so they stay in registers.
        const char* const a_ptr = ptr[kFirst];
        const char* const b_ptr = ptr[kFirst + 1];
        const char* const g_ptr = ptr[kGradIndex];
        scalar_t* outs[kOutputs];
        for (int t = 0; t < kOutputs; ++t) outs[t] = reinterpret_cast<scalar_t*>(ptr[t]);
        // The run's loop, given whether each input is broadcast: as constants where
        // none is (the common case), so that the loop tests nothing per vector.
        auto run = [&](auto a_scalar, auto b_scalar, auto g_scalar) {
          int64_t j = 0;
          // Two vectors per step: their C library calls (Sleef's pow, log) overlap.
          for (; j + 2 * V::size() <= n0; j += 2 * V::size()) {
            const int64_t k = j + V::size();
            const V a0 = load_run<scalar_t>(a_ptr, a_scalar, j, V::size());
            const V a1 = load_run<scalar_t>(a_ptr, a_scalar, k, V::size());
            const V b0 = load_run<scalar_t>(b_ptr, b_scalar, j, V::size());
            const V b1 = load_run<scalar_t>(b_ptr, b_scalar, k, V::size());
            V g0(acc_t(0)), g1(acc_t(0));
            if constexpr (kGrad) {
              g0 = load_run<scalar_t>(g_ptr, g_scalar, j, V::size());
              g1 = load_run<scalar_t>(g_ptr, g_scalar, k, V::size());
            }
            int t = 0;
            ((store_pair<scalar_t>(Elements::apply(g0, a0, b0, bound_vec), Elements::apply(g1, a1, b1, bound_vec),
                                   outs[t] + j),
              ++t),
             ...);
          }
          for (; j < n0; j += V::size()) {
            const int64_t count = std::min<int64_t>(V::size(), n0 - j);
            const V a = load_run<scalar_t>(a_ptr, a_scalar, j, count);
            const V b = load_run<scalar_t>(b_ptr, b_scalar, j, count);
            const V g = kGrad ? load_run<scalar_t>(g_ptr, g_scalar, j, count) : V(acc_t(0));
            int t = 0;
            ((cpu::store_vec<scalar_t>(Elements::apply(g, a, b, bound_vec), outs[t] + j, count), ++t),
             ...);
          }
        };
        const bool a_scalar = strides[kFirst] == 0, b_scalar = strides[kFirst + 1] == 0;
        const bool g_scalar = kGrad && strides[kGradIndex] == 0;
        if (!a_scalar && !b_scalar && !g_scalar) {
          run(std::false_type{}, std::false_type{}, std::false_type{});
        } else {
          run(a_scalar, b_scalar, g_scalar);
        }
      } else {
        for (int64_t j = 0; j < n0; ++j) {
          auto read = [&](int t) {
            return static_cast<acc_t>(*reinterpret_cast<const scalar_t*>(ptr[t] + j * strides[t]));
          };
          const acc_t a = read(kFirst), b = read(kFirst + 1);
          const acc_t g = kGrad ? read(kGradIndex) : acc_t(0);
          int t = 0;
          ((*reinterpret_cast<scalar_t*>(ptr[t] + j * strides[t]) =
                static_cast<scalar_t>(Elements::apply(g, a, b, bound)),
            ++t),
           ...);
        }
      }
    }
  });
}

// The exponent every element of pow sees when `exponent` has one element (a
// Python number, a 0-d tensor), if it is one pow_at_exponent knows; kOther for
// every other op (its value is not read).
template <BinaryOp op>
PowExponent known_exponent(const at::Tensor& exponent) {
  if (op != BinaryOp::kPow || exponent.numel() != 1) return PowExponent::kOther;
  return pow_exponent_kind(exponent.item<double>());
}

// Calls f(std::integral_constant<PowExponent, e>) with pow's known exponent e
// (kOther for every other op and exponent): one instantiation each.
template <BinaryOp op, typename F>
void dispatch_exponent(PowExponent exponent, F&& f) {
  with_pow_exponent(op == BinaryOp::kPow ? exponent : PowExponent::kOther, f);
}

// The element of an order and partial: pow's at a known exponent, else the header's.
template <BinaryOp op, PowExponent e, int order, int partial>
using ElementOf = std::conditional_t<op == BinaryOp::kPow && e != PowExponent::kOther,
                                     PowElementAtExponent<e, order, partial>,
                                     BinaryElement<op, order, partial>>;

template <BinaryOp op>
void run_binary(at::TensorIteratorBase& iter, int64_t order, int64_t partial,
                PowExponent exponent) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, iter.dtype(0),
                                  "nanfree_elementwise_binary_cpu", [&] {
    dispatch_binary_partial(order, partial, [&](auto order_c, auto partial_c) {
      constexpr int kOrder = decltype(order_c)::value, kPartial = decltype(partial_c)::value;
      dispatch_exponent<op>(exponent, [&](auto e) {
        binary_loop<(kOrder > 0), scalar_t, ElementOf<op, decltype(e)::value, kOrder, kPartial>>(iter);
      });
    });
  });
}

// Both gradients over iter (operands grad_a, grad_b, grad, a, b).
template <BinaryOp op>
void run_gradients(at::TensorIteratorBase& iter, PowExponent exponent) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, iter.dtype(0),
                                  "nanfree_elementwise_binary_gradients_cpu", [&] {
    dispatch_exponent<op>(exponent, [&](auto e) {
      constexpr PowExponent kExponent = decltype(e)::value;
      binary_loop<true, scalar_t, ElementOf<op, kExponent, 1, 0>, ElementOf<op, kExponent, 1, 1>>(iter);
    });
  });
}

template <BinaryOp op>
struct CpuBinaryKernels {
  static at::Tensor forward(const at::Tensor& input, const at::Tensor& other) {
    const auto [a, b] = binary_operands(op, input, other);
    const at::Tensor undefined_output;  // allocated by the iterator, in torch's layout
    at::TensorIterator iter = at::TensorIteratorConfig()
                                  .add_output(undefined_output)
                                  .add_const_input(a)
                                  .add_const_input(b)
                                  .build();
    run_binary<op>(iter, 0, 0, known_exponent<op>(b));
    return iter.output();
  }

  // Into `out`, of any strides (the iterator refuses one that overlaps itself,
  // as torch's out= does); computed first where it overlaps an operand partly.
  static void forward_out(const at::Tensor& input, const at::Tensor& other, const at::Tensor& out) {
    const auto [a, b] = binary_operands(op, input, other);
    check_out(binary_op_name(op), out, binary_shape(op, a.sizes(), b.sizes()), a.scalar_type(), a);
    if (overlaps_partly(out, a) || overlaps_partly(out, b)) {
      out.copy_(forward(input, other));
      return;
    }
    at::TensorIterator iter =
        at::TensorIteratorConfig().add_output(out).add_const_input(a).add_const_input(b).build();
    run_binary<op>(iter, 0, 0, known_exponent<op>(b));
  }

  static at::Tensor backward(const at::Tensor& grad, const at::Tensor& input,
                             const at::Tensor& other, int64_t order, int64_t partial) {
    check_binary_backward(op, grad, input, other, order, partial);
    const at::Tensor undefined_output;
    at::TensorIterator iter = at::TensorIteratorConfig()
                                  .add_output(undefined_output)
                                  .add_const_input(grad)
                                  .add_const_input(input)
                                  .add_const_input(other)
                                  .build();
    run_binary<op>(iter, order, partial, known_exponent<op>(other));
    return iter.output();
  }

  static std::tuple<at::Tensor, at::Tensor> gradients(const at::Tensor& grad, const at::Tensor& input,
                                                      const at::Tensor& other) {
    check_binary_gradient_operands(op, binary_gradients_name(op), grad, input, other);
    const at::Tensor undefined_output;
    at::TensorIterator iter = at::TensorIteratorConfig()
                                  .add_output(undefined_output)
                                  .add_output(undefined_output)
                                  .add_const_input(grad)
                                  .add_const_input(input)
                                  .add_const_input(other)
                                  .build();
    run_gradients<op>(iter, known_exponent<op>(other));
    return {iter.output(0), iter.output(1)};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  register_binary_kernels<CpuBinaryKernels>(m);
  register_binary_out_kernels<CpuBinaryKernels>(m);
}

}  // namespace nanfree
