// CPU kernels of the losses family's pointwise losses: pointwise_loss and
// pointwise_loss_backward of csrc/registration.cpp, one TensorIterator loop
// applying nanfree/losses_math.h to each element (eight or sixteen at a time
// where the run allows, see pointwise_loop). TensorIterator broadcasts
// weight, pos_weight and grad (a 0-d 1 stands for an absent weight), reads
// strided operands in place and splits the work over threads; the output is
// contiguous. The cross-entropy kernels are in losses_cross_entropy.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cpu/vec_math.h"  // before the headers: their vector primitives
#include "cpu/vec.h"

#include "common/losses_op.h"
#include "nanfree/losses_math.h"

namespace nanfree {
namespace {

using cpu::Vec;

template <typename scalar_t>
at::opmath_type<scalar_t> read(const char* base, int64_t stride, int64_t i) {
  return static_cast<at::opmath_type<scalar_t>>(
      *reinterpret_cast<const scalar_t*>(base + i * stride));
}

// Operands (out, [grad,] x, t, w, pw): the loss value, or grad times one
// partial. A run whose output is contiguous and whose inputs are contiguous or
// broadcast (stride 0: a scalar weight, a pos_weight row against a matrix, the
// mean's upstream gradient) goes through the header's functions instantiated
// with ATen's vectors (Sleef's exp, log1p, pow), float16 and bfloat16 widened
// to float; other runs element by element.
template <PointwiseLoss kind, bool kGrad, typename scalar_t>
void pointwise_loop(at::TensorIteratorBase& iter, double alpha_d, double gamma_d, int partial) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(scalar_t));
  const acc_t alpha = static_cast<acc_t>(alpha_d), gamma = static_cast<acc_t>(gamma_d);
  const acc_t bound = static_cast<acc_t>(largest_finite(iter.dtype(0)));
  constexpr int first = kGrad ? 2 : 1;
  constexpr int tensors = first + 4;
  iter.for_each([&](char** data, const int64_t* strides, int64_t n) {
    bool vector_run = strides[0] == kSize;
    for (int k = 1; k < tensors; ++k) vector_run = vector_run && (strides[k] == kSize || strides[k] == 0);
    int64_t i = 0;
    if (vector_run) {
      auto load = [&](int k, int64_t j, int64_t count) {
        const auto* p = reinterpret_cast<const scalar_t*>(data[k]);
        return strides[k] == 0 ? V(static_cast<acc_t>(*p)) : cpu::load_vec(p + j, count);
      };
      const V valpha(alpha), vgamma(gamma), vbound(bound);
      auto* out = reinterpret_cast<scalar_t*>(data[0]);
      for (; i < n; i += W) {
        const int64_t count = std::min<int64_t>(W, n - i);
        const PointwiseOperands<V> o{load(first, i, count), load(first + 1, i, count),
                                     load(first + 2, i, count), load(first + 3, i, count)};
        V r;
        if constexpr (kGrad) {
          r = loss_chain_rule(load(1, i, count), pointwise_loss_grad<kind>(o, valpha, vgamma, partial),
                              vbound);
        } else {
          r = pointwise_loss_value<kind>(o, valpha, vgamma);
        }
        cpu::store_vec<scalar_t>(r, out + i, count);
      }
      return;
    }
    for (; i < n; ++i) {
      const PointwiseOperands<acc_t> o{read<scalar_t>(data[first], strides[first], i),
                                       read<scalar_t>(data[first + 1], strides[first + 1], i),
                                       read<scalar_t>(data[first + 2], strides[first + 2], i),
                                       read<scalar_t>(data[first + 3], strides[first + 3], i)};
      acc_t r;
      if constexpr (kGrad) {
        const acc_t g = read<scalar_t>(data[1], strides[1], i);
        r = loss_chain_rule(g, pointwise_loss_grad<kind>(o, alpha, gamma, partial), bound);
      } else {
        r = pointwise_loss_value<kind>(o, alpha, gamma);
      }
      *reinterpret_cast<scalar_t*>(data[0] + i * strides[0]) = static_cast<scalar_t>(r);
    }
  });
}

template <bool kGrad, typename scalar_t>
void pointwise_by_kind(at::TensorIteratorBase& iter, int64_t kind, double alpha, double gamma,
                       int partial) {
  switch (static_cast<PointwiseLoss>(kind)) {
    case PointwiseLoss::BceWithLogits:
      return pointwise_loop<PointwiseLoss::BceWithLogits, kGrad, scalar_t>(iter, alpha, gamma, partial);
    case PointwiseLoss::Bce:
      return pointwise_loop<PointwiseLoss::Bce, kGrad, scalar_t>(iter, alpha, gamma, partial);
    case PointwiseLoss::KlDiv:
      return pointwise_loop<PointwiseLoss::KlDiv, kGrad, scalar_t>(iter, alpha, gamma, partial);
    case PointwiseLoss::KlDivLogTarget:
      return pointwise_loop<PointwiseLoss::KlDivLogTarget, kGrad, scalar_t>(iter, alpha, gamma,
                                                                             partial);
    case PointwiseLoss::SigmoidFocal:
      return pointwise_loop<PointwiseLoss::SigmoidFocal, kGrad, scalar_t>(iter, alpha, gamma,
                                                                           partial);
  }
}

// The iterator's operands, kept alive while it runs (it borrows them).
struct PointwiseOperandTensors {
  at::Tensor grad, weight, pos_weight;
};

at::TensorIterator pointwise_iterator(const at::Tensor& out, const at::Tensor& input,
                                      const at::Tensor& target, const PointwiseOperandTensors& o) {
  at::TensorIteratorConfig config;
  config.add_output(out).check_all_same_dtype(false).resize_outputs(false);
  if (o.grad.defined()) config.add_const_input(o.grad);
  config.add_const_input(input).add_const_input(target).add_const_input(o.weight).add_const_input(
      o.pos_weight);
  return config.build();
}

PointwiseOperandTensors pointwise_operands(const std::optional<at::Tensor>& grad,
                                           const at::Tensor& input,
                                           const std::optional<at::Tensor>& weight,
                                           const std::optional<at::Tensor>& pos_weight) {
  return {grad.has_value() ? grad->expand(input.sizes()) : at::Tensor(),
          loss_operand_or_one(weight, input), loss_operand_or_one(pos_weight, input)};
}

at::Tensor pointwise_loss_cpu(const at::Tensor& input, const at::Tensor& target,
                              const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& pos_weight, int64_t kind,
                              double alpha, double gamma) {
  check_pointwise_loss(input, target, weight, pos_weight, kind, gamma);
  at::Tensor out = at::empty(input.sizes(), input.options());
  if (out.numel() == 0) return out;
  const PointwiseOperandTensors operands = pointwise_operands(std::nullopt, input, weight, pos_weight);
  at::TensorIterator iter = pointwise_iterator(out, input, target, operands);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss",
                                  [&] { pointwise_by_kind<false, scalar_t>(iter, kind, alpha, gamma, 0); });
  return out;
}

at::Tensor pointwise_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& input,
                                       const at::Tensor& target,
                                       const std::optional<at::Tensor>& weight,
                                       const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                       double alpha, double gamma, int64_t partial) {
  check_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, gamma, partial);
  at::Tensor out = at::empty(input.sizes(), input.options());
  if (out.numel() == 0) return out;
  const PointwiseOperandTensors operands = pointwise_operands(grad, input, weight, pos_weight);
  at::TensorIterator iter = pointwise_iterator(out, input, target, operands);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss_backward", [&] {
        pointwise_by_kind<true, scalar_t>(iter, kind, alpha, gamma, static_cast<int>(partial));
      });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("pointwise_loss", &pointwise_loss_cpu);
  m.impl("pointwise_loss_backward", &pointwise_loss_backward_cpu);
}

}  // namespace nanfree
