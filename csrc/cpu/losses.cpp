// CPU kernels of the losses family's pointwise losses: pointwise_loss and
// pointwise_loss_backward of csrc/registration.cpp, one TensorIterator loop
// applying nanfree/losses_math.h to each element (eight or sixteen at a time
// where the run allows, see pointwise_loop). TensorIterator broadcasts
// weight, pos_weight and grad (a 0-d 1 stands for an absent weight), reads
// strided operands in place and splits the work over threads; the output has
// the input's layout (at::empty_like, as torch's). pointwise_loss_sum adds the
// losses up in the same loop instead of storing them (the mean and sum
// reductions read the logits once, write nothing of their size). The
// cross-entropy kernels are in losses_cross_entropy.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

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

// The operands of one iterator run from data[first] on (x, t, w, pw; grad at
// first - 1 where there is one), read as the loops below read them: in
// vectors where every one of them is contiguous or broadcast (stride 0: a
// scalar weight, a pos_weight row against a matrix, the mean's upstream
// gradient), float16 and bfloat16 widened to float; else element by element.
template <typename scalar_t, int first>
struct RunOperands {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  static constexpr int64_t kSize = static_cast<int64_t>(sizeof(scalar_t));
  char** data;
  const int64_t* strides;

  // Whether tensors [begin, first + 4) are contiguous or broadcast.
  bool vectors_from(int begin) const {
    for (int k = begin; k < first + 4; ++k) {
      if (strides[k] != kSize && strides[k] != 0) return false;
    }
    return true;
  }
  V vector(int k, int64_t i, int64_t count) const {
    const auto* p = reinterpret_cast<const scalar_t*>(data[k]);
    return strides[k] == 0 ? V(static_cast<acc_t>(*p)) : cpu::load_vec(p + i, count);
  }
  PointwiseOperands<V> vectors(int64_t i, int64_t count) const {
    return {vector(first, i, count), vector(first + 1, i, count), vector(first + 2, i, count),
            vector(first + 3, i, count)};
  }
  acc_t element(int k, int64_t i) const { return read<scalar_t>(data[k], strides[k], i); }
  PointwiseOperands<acc_t> elements(int64_t i) const {
    return {element(first, i), element(first + 1, i), element(first + 2, i),
            element(first + 3, i)};
  }
};

// Operands (out, [grad,] x, t, w, pw): the loss value, or grad times one
// partial. A run whose output is contiguous and whose inputs are contiguous or
// broadcast goes through the header's functions instantiated with ATen's
// vectors (Sleef's exp, log1p, pow); other runs element by element.
template <PointwiseLoss kind, bool kGrad, typename scalar_t>
void pointwise_run(char** data, const int64_t* strides, int64_t n, double alpha_d, double gamma_d,
                   int partial) {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(scalar_t));
  const acc_t alpha = static_cast<acc_t>(alpha_d), gamma = static_cast<acc_t>(gamma_d);
  const acc_t bound = static_cast<acc_t>(largest_finite(c10::CppTypeToScalarType<scalar_t>::value));
  constexpr int first = kGrad ? 2 : 1;
  {
    const RunOperands<scalar_t, first> run{data, strides};
    if (strides[0] == kSize && run.vectors_from(1)) {
      const V valpha(alpha), vgamma(gamma), vbound(bound);
      auto* out = reinterpret_cast<scalar_t*>(data[0]);
      for (int64_t i = 0; i < n; i += W) {
        const int64_t count = std::min<int64_t>(W, n - i);
        const PointwiseOperands<V> o = run.vectors(i, count);
        V r;
        if constexpr (kGrad) {
          r = loss_chain_rule(run.vector(1, i, count),
                              pointwise_loss_grad<kind>(o, valpha, vgamma, partial), vbound);
        } else {
          r = pointwise_loss_value<kind>(o, valpha, vgamma);
        }
        cpu::store_vec<scalar_t>(r, out + i, count);
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      const PointwiseOperands<acc_t> o = run.elements(i);
      acc_t r;
      if constexpr (kGrad) {
        r = loss_chain_rule(run.element(1, i), pointwise_loss_grad<kind>(o, alpha, gamma, partial),
                            bound);
      } else {
        r = pointwise_loss_value<kind>(o, alpha, gamma);
      }
      *reinterpret_cast<scalar_t*>(data[0] + i * strides[0]) = static_cast<scalar_t>(r);
    }
  }
}

template <PointwiseLoss kind, bool kGrad, typename scalar_t>
void pointwise_loop(at::TensorIteratorBase& iter, double alpha, double gamma, int partial) {
  iter.for_each([&](char** data, const int64_t* strides, int64_t n) {
    pointwise_run<kind, kGrad, scalar_t>(data, strides, n, alpha, gamma, partial);
  });
}

// pointwise_loss_sum: the losses are summed over fixed chunks of the flat
// index (the same chunks whatever the thread count, so the total is the same
// bit for bit), each chunk in double lanes, and the chunks' sums are added in
// order. Double lanes: a float sum of many losses would lose their low bits
// and overflow where the mean does not.
constexpr int64_t kSumChunk = int64_t{1} << 15;

// The losses of one run added into a chunk's sum: in W double lanes where
// the run reads vectors, else into `rest`.
template <PointwiseLoss kind, typename scalar_t>
struct ChunkSum {
  using acc_t = at::opmath_type<scalar_t>;
  using V = Vec<acc_t>;
  static constexpr int64_t W = V::size();
  acc_t alpha, gamma;
  std::array<double, W> lanes{};
  double rest = 0.0;

  void add_run(char** data, const int64_t* strides, int64_t m) {
    const RunOperands<scalar_t, 0> run{data, strides};
    if (run.vectors_from(0)) {
      const V valpha(alpha), vgamma(gamma);
      alignas(64) acc_t values[W];
      for (int64_t i = 0; i < m; i += W) {
        const int64_t count = std::min<int64_t>(W, m - i);
        V r = pointwise_loss_value<kind>(run.vectors(i, count), valpha, vgamma);
        // The lanes past the run's end hold the loss of padding: left out.
        if (count < W) r = V::set(V(acc_t(0)), r, count);
        r.store(values);
        for (int64_t k = 0; k < W; ++k) lanes[k] += static_cast<double>(values[k]);
      }
      return;
    }
    for (int64_t i = 0; i < m; ++i) {
      rest += static_cast<double>(pointwise_loss_value<kind>(run.elements(i), alpha, gamma));
    }
  }
  double total() const {
    double sum = rest;
    for (int64_t k = 0; k < W; ++k) sum += lanes[k];
    return sum;
  }
};

template <PointwiseLoss kind, typename scalar_t>
double pointwise_sum(at::TensorIteratorBase& iter, double alpha_d, double gamma_d) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t alpha = static_cast<acc_t>(alpha_d), gamma = static_cast<acc_t>(gamma_d);
  const int64_t n = iter.numel();
  std::vector<double> chunk_sums((n + kSumChunk - 1) / kSumChunk, 0.0);
  at::parallel_for(0, static_cast<int64_t>(chunk_sums.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      ChunkSum<kind, scalar_t> chunk{alpha, gamma};
      iter.serial_for_each(
          [&](char** data, const int64_t* strides, int64_t m) { chunk.add_run(data, strides, m); },
          {c * kSumChunk, std::min(n, (c + 1) * kSumChunk)});
      chunk_sums[c] = chunk.total();
    }
  });
  double total = 0.0;
  for (const double s : chunk_sums) total += s;
  return total;
}

// f(std::integral_constant<PointwiseLoss, kind>) for a runtime kind.
template <typename F>
void dispatch_pointwise_kind(int64_t kind, F&& f) {
  switch (static_cast<PointwiseLoss>(kind)) {
    case PointwiseLoss::BceWithLogits:
      return f(std::integral_constant<PointwiseLoss, PointwiseLoss::BceWithLogits>{});
    case PointwiseLoss::Bce:
      return f(std::integral_constant<PointwiseLoss, PointwiseLoss::Bce>{});
    case PointwiseLoss::KlDiv:
      return f(std::integral_constant<PointwiseLoss, PointwiseLoss::KlDiv>{});
    case PointwiseLoss::KlDivLogTarget:
      return f(std::integral_constant<PointwiseLoss, PointwiseLoss::KlDivLogTarget>{});
    case PointwiseLoss::SigmoidFocal:
      return f(std::integral_constant<PointwiseLoss, PointwiseLoss::SigmoidFocal>{});
  }
}

template <bool kGrad, typename scalar_t>
void pointwise_by_kind(at::TensorIteratorBase& iter, int64_t kind, double alpha, double gamma,
                       int partial) {
  dispatch_pointwise_kind(kind, [&](auto kind_c) {
    pointwise_loop<decltype(kind_c)::value, kGrad, scalar_t>(iter, alpha, gamma, partial);
  });
}

// The one run of a small call in the common layout: input and target
// contiguous and of one shape, weight and pos_weight absent or so, grad (the
// backward's) 0-d or so, fewer elements than a thread's grain (the iterator
// would not split them). Its data pointers and strides are made here, as the
// iterator would coalesce them (operands (out, [grad,] x, t, w, pw); without
// `out` for the sum): building a TensorIterator and the 0-d ones standing for
// absent operands costs a few microseconds, most of a small batch's loss.
struct FlatRun {
  std::array<char*, 6> data{};
  std::array<int64_t, 6> strides{};
  int count = 0;
};

template <typename scalar_t>
char* one_of_type() {
  static scalar_t one(1);  // read only: an absent weight's value
  return reinterpret_cast<char*>(&one);
}

std::optional<FlatRun> flat_run(const at::Tensor& out, const std::optional<at::Tensor>& grad,
                                const at::Tensor& input, const at::Tensor& target,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& pos_weight) {
  const int64_t size = static_cast<int64_t>(input.element_size());
  auto full = [&](const at::Tensor& t) { return t.is_contiguous() && t.sizes() == input.sizes(); };
  if (input.numel() >= at::internal::GRAIN_SIZE || !full(input) || !full(target)) return std::nullopt;
  FlatRun run;
  auto add = [&](char* data, int64_t stride) {
    run.data[run.count] = data;
    run.strides[run.count++] = stride;
  };
  if (out.defined()) add(static_cast<char*>(out.data_ptr()), size);
  if (grad.has_value()) {
    if (grad->dim() != 0 && !full(*grad)) return std::nullopt;
    add(static_cast<char*>(const_cast<void*>(grad->const_data_ptr())), grad->dim() == 0 ? 0 : size);
  }
  add(static_cast<char*>(const_cast<void*>(input.const_data_ptr())), size);
  add(static_cast<char*>(const_cast<void*>(target.const_data_ptr())), size);
  for (const std::optional<at::Tensor>* t : {&weight, &pos_weight}) {
    if (!t->has_value()) {
      char* one = nullptr;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "loss_one",
                                      [&] { one = one_of_type<scalar_t>(); });
      add(one, 0);
    } else if (full(**t)) {
      add(static_cast<char*>(const_cast<void*>((*t)->const_data_ptr())), size);
    } else {
      return std::nullopt;
    }
  }
  return run;
}

// pointwise_run over a flat run of n elements (pointwise_loss, or with kGrad
// pointwise_loss_backward) for a runtime dtype and kind.
template <bool kGrad>
void run_flat(FlatRun run, at::ScalarType dtype, int64_t n, int64_t kind, double alpha,
              double gamma, int64_t partial) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "pointwise_loss_flat", [&] {
    dispatch_pointwise_kind(kind, [&](auto kind_c) {
      pointwise_run<decltype(kind_c)::value, kGrad, scalar_t>(run.data.data(), run.strides.data(), n,
                                                              alpha, gamma, static_cast<int>(partial));
    });
  });
}

// The iterator's operands, kept alive while it runs (it borrows them).
struct PointwiseOperandTensors {
  at::Tensor grad, weight, pos_weight;
};

// The iterator over (out, [grad,] input, target, weight, pos_weight); without
// `out` (undefined: pointwise_loss_sum) over the inputs alone.
at::TensorIterator pointwise_iterator(const at::Tensor& out, const at::Tensor& input,
                                      const at::Tensor& target, const PointwiseOperandTensors& o) {
  at::TensorIteratorConfig config;
  config.check_all_same_dtype(false).resize_outputs(false);
  if (out.defined()) config.add_output(out);
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
  at::Tensor out = at::empty_like(input);  // the input's layout, as torch's
  if (out.numel() == 0) return out;
  if (const std::optional<FlatRun> run = flat_run(out, std::nullopt, input, target, weight, pos_weight)) {
    run_flat<false>(*run, input.scalar_type(), input.numel(), kind, alpha, gamma, 0);
    return out;
  }
  const PointwiseOperandTensors operands = pointwise_operands(std::nullopt, input, weight, pos_weight);
  at::TensorIterator iter = pointwise_iterator(out, input, target, operands);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss",
                                  [&] { pointwise_by_kind<false, scalar_t>(iter, kind, alpha, gamma, 0); });
  return out;
}

at::Tensor pointwise_loss_sum_cpu(const at::Tensor& input, const at::Tensor& target,
                                  const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                  double alpha, double gamma) {
  check_pointwise_loss(input, target, weight, pos_weight, kind, gamma, "pointwise_loss_sum");
  const at::ScalarType acc = at::toOpMathType(input.scalar_type());
  double total = 0.0;
  if (input.numel() == 0) {
    // The sum of nothing.
  } else if (std::optional<FlatRun> run =
                 flat_run(at::Tensor(), std::nullopt, input, target, weight, pos_weight)) {
    // One chunk (kSumChunk >= the grain), summed as pointwise_sum sums one.
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss_sum", [&] {
      dispatch_pointwise_kind(kind, [&](auto kind_c) {
        using acc_t = at::opmath_type<scalar_t>;
        ChunkSum<decltype(kind_c)::value, scalar_t> chunk{static_cast<acc_t>(alpha), static_cast<acc_t>(gamma)};
        chunk.add_run(run->data.data(), run->strides.data(), input.numel());
        total = chunk.total();
      });
    });
  } else {
    const PointwiseOperandTensors operands = pointwise_operands(std::nullopt, input, weight, pos_weight);
    at::TensorIterator iter = pointwise_iterator(at::Tensor(), input, target, operands);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss_sum",
                                    [&] {
      dispatch_pointwise_kind(kind, [&](auto kind_c) {
        total = pointwise_sum<decltype(kind_c)::value, scalar_t>(iter, alpha, gamma);
      });
    });
  }
  // The double total rounded to the accumulation dtype, as fill_ rounds it.
  at::Tensor out = at::empty({}, input.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "pointwise_loss_sum", [&] {
    *out.mutable_data_ptr<scalar_t>() = static_cast<scalar_t>(total);
  });
  return out;
}

at::Tensor pointwise_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& input,
                                       const at::Tensor& target,
                                       const std::optional<at::Tensor>& weight,
                                       const std::optional<at::Tensor>& pos_weight, int64_t kind,
                                       double alpha, double gamma, int64_t partial) {
  check_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, gamma, partial);
  at::Tensor out = at::empty_like(input);  // the input's layout, as torch's gradient
  if (out.numel() == 0) return out;
  if (const std::optional<FlatRun> run = flat_run(out, grad, input, target, weight, pos_weight)) {
    run_flat<true>(*run, input.scalar_type(), input.numel(), kind, alpha, gamma, partial);
    return out;
  }
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
  m.impl("pointwise_loss_sum", &pointwise_loss_sum_cpu);
  m.impl("pointwise_loss_backward", &pointwise_loss_backward_cpu);
}

}  // namespace nanfree
