// CPU kernels of cross_entropy and cross_entropy_backward (csrc/registration.cpp;
// every rule in nanfree/losses_math.h). One task per block of positions
// (at::parallel_for). A position of contiguous classes (inner == 1) without a
// mask whose largest logit is finite takes the vector path: the row widened
// once with its max, then one pass for the exp sum and the label-smoothing or
// probability-target sums (-inf classes blended out), and in the backward one
// pass writing each class's gradient. Every other position (a mask, classes
// `inner` apart, a NaN or +inf logit, an empty row) goes class by class
// through the header's functions.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "common/losses_op.h"
#include "cpu/vec.h"
#include "nanfree/losses_math.h"

namespace nanfree {
namespace {

using cpu::Vec;

// Vectors a lane sums before its sum joins the row's double total.
constexpr int64_t kFlush = 32;

template <typename scalar_t>
struct CrossEntropyCpu {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x;       // [outer, C, inner]
  const int64_t* index;    // [outer, inner], or null (probability targets)
  const scalar_t* prob;    // [outer, C, inner], or null (class indices)
  const scalar_t* weight;  // [C], or null
  const bool* mask;        // or null; element (o, c, i) at o * mask_s0 + c * mask_s1 + i * mask_s2
  int64_t mask_s0, mask_s1, mask_s2;
  int64_t outer, classes, inner;
  int64_t ignore_index;
  acc_t eps;

  acc_t w(int64_t c) const { return weight ? static_cast<acc_t>(weight[c]) : acc_t(1); }
  int64_t at(int64_t o, int64_t c, int64_t i) const { return (o * classes + c) * inner + i; }
  acc_t logit(int64_t o, int64_t c, int64_t i) const { return static_cast<acc_t>(x[at(o, c, i)]); }
  bool kept(int64_t o, int64_t c, int64_t i) const {
    const bool keep = !mask || mask[o * mask_s0 + c * mask_s1 + i * mask_s2];
    return ce_class_kept(logit(o, c, i), keep);
  }
  // The target class of a class-index position, or -1 when it is left out
  // (ignore_index, out of range: nanfree.ops refuses those of CPU tensors).
  int64_t target_class(int64_t o, int64_t i) const {
    const int64_t y = index[o * inner + i];
    return (y == ignore_index || y < 0 || y >= classes) ? -1 : y;
  }
  acc_t q(int64_t o, int64_t c, int64_t i, int64_t y, acc_t s) const {
    if (index) return ce_index_weight(c == y, w(c), y >= 0 ? w(y) : acc_t(0), eps, s);
    return ce_probability_weight(static_cast<acc_t>(prob[at(o, c, i)]), w(c), eps, s);
  }

  // Class by class: the loss of position (o, i) and its statistics. The
  // logsumexp state and the sums run in double: this path takes whole rows (a
  // mask, a +inf logit) of up to C classes, where a float sum of C terms
  // drifts by C roundings (5x torch's error at C = 32000).
  acc_t forward_scalar(int64_t o, int64_t i, CrossEntropyStats<acc_t>& st) const {
    int64_t y = -1;
    if (index) {
      y = target_class(o, i);
      if (y < 0 || !kept(o, y, i)) {
        st = ce_left_out<acc_t>();
        return acc_t(0);
      }
    }
    LseState<double> lse = lse_empty<double>();
    int64_t count = 0;
    for (int64_t c = 0; c < classes; ++c) {
      if (!kept(o, c, i)) continue;
      lse_update(lse, static_cast<double>(logit(o, c, i)));
      ++count;
    }
    if (count == 0) {
      st = ce_left_out<acc_t>();
      return acc_t(0);
    }
    const acc_t s = ce_smoothing(eps, count);
    st = CrossEntropyStats<acc_t>{static_cast<acc_t>(lse.max), static_cast<acc_t>(nf_log(lse.sum)),
                                  acc_t(0), s, acc_t(1)};
    double loss = 0, total = 0;
    if (index) {
      // The target's own share once, the smoothing's over every kept class.
      const acc_t target_q = (acc_t(1) - eps) * w(y);
      loss = ce_term(target_q, ce_log_probability(logit(o, y, i), st));
      total = target_q;
      st.denominator = w(y);
    }
    if (!index || s != acc_t(0)) {
      for (int64_t c = 0; c < classes; ++c) {
        if (!kept(o, c, i)) continue;
        const acc_t qc = index ? s * w(c) : q(o, c, i, y, s);
        total += qc;
        loss += ce_term(qc, ce_log_probability(logit(o, c, i), st));
      }
    }
    st.total = static_cast<acc_t>(total);
    // A NaN logit (NaN log_sum) makes the loss NaN: every term carries it
    // already (loss_product passes NaN on); stated here for the row as a whole.
    return nf_isnan(st.log_sum) ? st.log_sum : static_cast<acc_t>(loss);
  }

  void backward_scalar(int64_t o, int64_t i, acc_t g, const CrossEntropyStats<acc_t>& st,
                       scalar_t* grad_x, scalar_t* grad_t, acc_t bound) const {
    const int64_t y = index ? target_class(o, i) : -1;
    for (int64_t c = 0; c < classes; ++c) {
      const bool keep = kept(o, c, i);
      const acc_t xc = logit(o, c, i);
      const acc_t qc = keep ? q(o, c, i, y, st.smoothing) : acc_t(0);
      grad_x[at(o, c, i)] = static_cast<scalar_t>(ce_grad_input(g, xc, qc, keep, st, bound));
      if (grad_t) {
        grad_t[at(o, c, i)] = static_cast<scalar_t>(ce_grad_target(g, xc, w(c), eps, keep, st, bound));
      }
    }
  }

  bool vector_path() const { return inner == 1 && mask == nullptr; }

  // The vector forward of row r (inner == 1, no mask); false where the row
  // needs the scalar path (its max is not finite).
  NANFREE_HOT_LOOP bool forward_row(int64_t r, acc_t* buffer, acc_t& loss,
                                    CrossEntropyStats<acc_t>& st) const {
    using V = Vec<acc_t>;
    constexpr int64_t W = V::size();
    const int64_t n = classes;
    int64_t y = -1;
    if (index) {
      y = target_class(r, 0);
      if (y < 0 || !kept(r, y, 0)) return false;
    }
    const scalar_t* src = x + r * n;
    acc_t m;
    const acc_t* row;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      row = src;
      m = cpu::row_max(row, n);
    } else {
      m = cpu::widen_max(src, buffer, n);
      row = buffer;
    }
    if (!nf_isfinite(m)) return false;  // NaN, +inf or an empty row: the scalar rules
    const V vm(m), neg_inf(-nf_inf<acc_t>()), zero(acc_t(0)), one(acc_t(1));
    const bool sums = eps != acc_t(0) || prob != nullptr;
    // Pass over the row: exp sum; with smoothing or a probability target also
    // the kept count, the kept weight and the weighted sum of x - max. Lanes
    // sum kFlush vectors, then flush into double totals: a float lane summing
    // a whole row of 32000 classes drifts past 2x torch's error.
    V sum_v(0), count_v(0), weight_v(0), wx_v(0);
    double sum = 0, count_d = 0, kept_weight = 0, weighted_x = 0;
    auto flush = [&] {
      sum += total_of(sum_v);
      count_d += total_of(count_v);
      kept_weight += total_of(weight_v);
      weighted_x += total_of(wx_v);
      sum_v = count_v = weight_v = wx_v = zero;
    };
    auto step = [&](int64_t j0, int64_t count) {
      V v = V::loadu(row + j0, count);
      if (count < W) v = V::set(neg_inf, v, count);
      sum_v += cpu::shifted_exp(v - vm);
      if (sums) {
        const V keep = v != neg_inf;  // all-ones lanes where the class is kept
        V wc = weight ? cpu::load_vec(weight + j0, count) : one;
        count_v += V::blendv(zero, one, keep);
        wc = V::blendv(zero, wc, keep);
        weight_v += wc;
        // A zero weight contributes 0 also where x - max overflows to -inf.
        wx_v += V::blendv(zero, wc * (v - vm), keep & (wc != zero));
      }
    };
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      step(j, W);
      if ((j / W) % kFlush == kFlush - 1) flush();
    }
    if (j < n) step(j, n - j);
    flush();
    st = CrossEntropyStats<acc_t>{m, nf_log(static_cast<acc_t>(sum)), 0, 0, 1};
    const acc_t s = ce_smoothing(eps, static_cast<int64_t>(count_d));
    if (index) {
      const acc_t wy = w(y);
      st.denominator = wy;
      const acc_t target_q = (acc_t(1) - eps) * wy;
      const acc_t target_term = ce_term(target_q, ce_log_probability(logit(r, y, 0), st));
      if (!sums) {
        st.total = wy;
        loss = target_term;
        return true;
      }
      st.smoothing = s;
      st.total = static_cast<acc_t>(target_q + s * kept_weight);
      // sum over kept c of w_c (-log p_c) = kept_weight log_sum - sum w_c (x_c - max),
      // two terms >= 0 (x_c <= max).
      loss = static_cast<acc_t>(target_term + s * (kept_weight * st.log_sum - weighted_x));
      return true;
    }
    // Probability target: q-weighted sums, with s from the kept count.
    st.smoothing = s;
    const scalar_t* t = prob + r * n;
    V total_v(0), qx_v(0);
    double total = 0, qx = 0;
    const V vs(s), keep_eps(acc_t(1) - eps);
    auto qstep = [&](int64_t j0, int64_t count) {
      V v = V::loadu(row + j0, count);
      if (count < W) v = V::set(neg_inf, v, count);
      const V keep = v != neg_inf;
      const V wc = weight ? cpu::load_vec(weight + j0, count) : one;
      const V qc = V::blendv(zero, wc * (keep_eps * cpu::load_vec(t + j0, count) + vs), keep);
      total_v += qc;
      // A zero q contributes 0 also where x - max overflows to -inf.
      qx_v += V::blendv(zero, qc * (v - vm), keep & (qc != zero));
    };
    auto qflush = [&] {
      total += total_of(total_v);
      qx += total_of(qx_v);
      total_v = qx_v = zero;
    };
    for (j = 0; j + W <= n; j += W) {
      qstep(j, W);
      if ((j / W) % kFlush == kFlush - 1) qflush();
    }
    if (j < n) qstep(j, n - j);
    qflush();
    st.total = static_cast<acc_t>(total);
    // Q log_sum - sum q_c (x_c - max): two terms >= 0 for q >= 0.
    loss = static_cast<acc_t>(total * st.log_sum - qx);
    return true;
  }

  static acc_t total_of(const Vec<acc_t>& v) {
    return cpu::reduce_lanes<acc_t>([](const Vec<acc_t>& a, const Vec<acc_t>& b) { return a + b; }, v);
  }

  // The vector backward of row r (inner == 1, no mask, finite max).
  NANFREE_HOT_LOOP void backward_row(int64_t r, acc_t g, const CrossEntropyStats<acc_t>& st,
                                     scalar_t* grad_x, scalar_t* grad_t, acc_t bound) const {
    using V = Vec<acc_t>;
    constexpr int64_t W = V::size();
    const int64_t n = classes;
    const scalar_t* src = x + r * n;
    const scalar_t* t = prob ? prob + r * n : nullptr;
    const V vg(g), vtotal(st.total), vs(st.smoothing);
    const V zero(acc_t(0)), one(acc_t(1)), neg_inf(-nf_inf<acc_t>()), keep_eps(acc_t(1) - eps);
    const V hi(bound), lo(-bound), vmax(st.max), vlog(st.log_sum);
    const V target_scale(-g * (acc_t(1) - eps));
    auto step = [&](int64_t j0, int64_t count) {
      const V v = cpu::load_vec(src + j0, count);
      const V keep = v != neg_inf;
      const V wc = weight ? cpu::load_vec(weight + j0, count) : one;
      // (x - max) - log_sum as the header's: x - (max + log_sum) would round
      // max + log_sum at max's magnitude first (5 ulp of p at max = 10).
      const V p = cpu::shifted_exp((v - vmax) - vlog);
      V qc = t ? wc * (keep_eps * cpu::load_vec(t + j0, count) + vs) : wc * vs;
      V d = vg * (vtotal * p - qc);
      d = V::blendv(zero, at::vec::minimum(at::vec::maximum(d, lo), hi), keep);
      cpu::store_vec<scalar_t>(d, grad_x + r * n + j0, count);
      if (grad_t) {
        const V factor = target_scale * wc;
        V dt = factor * ((v - vmax) - vlog);
        // A zero factor gives 0 also where log p overflows to -inf (ce_grad_target).
        dt = V::blendv(zero, at::vec::minimum(at::vec::maximum(dt, lo), hi), keep & (factor != zero));
        cpu::store_vec<scalar_t>(dt, grad_t + r * n + j0, count);
      }
    };
    int64_t j = 0;
    for (; j + W <= n; j += W) step(j, W);
    if (j < n) step(j, n - j);
    if (index) {
      // The target class's own share, -(1 - eps) w_y, on top of the smoothing's.
      const int64_t y = target_class(r, 0);
      const acc_t xy = logit(r, y, 0);
      const acc_t qy = ce_index_weight(true, w(y), w(y), eps, st.smoothing);
      grad_x[r * n + y] = static_cast<scalar_t>(ce_grad_input(g, xy, qy, true, st, bound));
    }
  }
};

template <typename scalar_t>
CrossEntropyCpu<scalar_t> make_problem(const at::Tensor& input, const at::Tensor& target,
                                       const std::optional<at::Tensor>& weight,
                                       const std::optional<at::Tensor>& mask,
                                       int64_t ignore_index, double label_smoothing) {
  using acc_t = at::opmath_type<scalar_t>;
  CrossEntropyCpu<scalar_t> p{};
  p.x = input.const_data_ptr<scalar_t>();
  const bool indices = target.scalar_type() == at::kLong;
  p.index = indices ? target.const_data_ptr<int64_t>() : nullptr;
  p.prob = indices ? nullptr : target.const_data_ptr<scalar_t>();
  p.weight = weight.has_value() ? weight->const_data_ptr<scalar_t>() : nullptr;
  p.mask = mask.has_value() ? mask->const_data_ptr<bool>() : nullptr;
  if (mask.has_value()) {
    p.mask_s0 = mask->stride(0);
    p.mask_s1 = mask->stride(1);
    p.mask_s2 = mask->stride(2);
  }
  p.outer = input.size(0);
  p.classes = input.size(1);
  p.inner = input.size(2);
  p.ignore_index = ignore_index;
  p.eps = static_cast<acc_t>(label_smoothing);
  return p;
}

std::optional<at::Tensor> contiguous_weight(const std::optional<at::Tensor>& weight) {
  if (!weight.has_value()) return weight;
  return weight->contiguous();
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_cpu(const at::Tensor& input_arg,
                                                     const at::Tensor& target_arg,
                                                     const std::optional<at::Tensor>& weight_arg,
                                                     const std::optional<at::Tensor>& mask,
                                                     int64_t ignore_index, double label_smoothing) {
  check_cross_entropy(input_arg, target_arg, weight_arg, mask, label_smoothing);
  const at::Tensor input = input_arg.contiguous(), target = target_arg.contiguous();
  const std::optional<at::Tensor> weight = contiguous_weight(weight_arg);
  const int64_t outer = input.size(0), inner = input.size(2);
  const auto acc_options = input.options().dtype(acc_dtype(input.scalar_type()));
  at::Tensor loss = at::empty({outer, inner}, acc_options);
  at::Tensor stats = at::empty({outer, inner, kCrossEntropyStats}, acc_options);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "cross_entropy", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_problem<scalar_t>(input, target, weight, mask, ignore_index, label_smoothing);
    acc_t* loss_out = loss.mutable_data_ptr<acc_t>();
    auto* stats_out = reinterpret_cast<CrossEntropyStats<acc_t>*>(stats.mutable_data_ptr<acc_t>());
    const int64_t positions = outer * inner;
    const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(1, p.classes));
    at::parallel_for(0, positions, grain, [&](int64_t begin, int64_t end) {
      auto buffer = cpu::scratch_row<acc_t>(p.classes, !std::is_same_v<scalar_t, acc_t>);
      for (int64_t r = begin; r < end; ++r) {
        if (p.vector_path() && p.forward_row(r, buffer.get(), loss_out[r], stats_out[r])) continue;
        loss_out[r] = p.forward_scalar(r / inner, r % inner, stats_out[r]);
      }
    });
  });
  return {loss, stats};
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_backward_cpu(
    const at::Tensor& grad_arg, const at::Tensor& input_arg, const at::Tensor& target_arg,
    const std::optional<at::Tensor>& weight_arg, const std::optional<at::Tensor>& mask,
    int64_t ignore_index, double label_smoothing, const at::Tensor& stats_arg, bool target_grad) {
  check_cross_entropy_backward(grad_arg, input_arg, target_arg, weight_arg, mask, label_smoothing,
                               stats_arg, target_grad);
  const at::Tensor input = input_arg.contiguous(), target = target_arg.contiguous();
  const at::Tensor grad = grad_arg.contiguous(), stats = stats_arg.contiguous();
  const std::optional<at::Tensor> weight = contiguous_weight(weight_arg);
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  at::Tensor grad_target = target_grad ? at::empty(target.sizes(), target.options())
                                       : at::empty({0}, input.options());
  const int64_t inner = input.size(2), positions = input.size(0) * inner;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(),
                                  "cross_entropy_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto p = make_problem<scalar_t>(input, target, weight, mask, ignore_index, label_smoothing);
    const acc_t* g = grad.const_data_ptr<acc_t>();
    const auto* st = reinterpret_cast<const CrossEntropyStats<acc_t>*>(stats.const_data_ptr<acc_t>());
    scalar_t* gx = grad_input.mutable_data_ptr<scalar_t>();
    scalar_t* gt = target_grad ? grad_target.mutable_data_ptr<scalar_t>() : nullptr;
    const acc_t bound = static_cast<acc_t>(largest_finite(input.scalar_type()));
    const int64_t grain = std::max<int64_t>(1, cpu::kGrainElements / std::max<int64_t>(1, p.classes));
    at::parallel_for(0, positions, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        // A left-out position (max -inf) and the non-finite rows take the scalar rules.
        const bool live = nf_isfinite(st[r].max) && nf_isfinite(st[r].log_sum);
        if (p.vector_path() && live) {
          p.backward_row(r, g[r], st[r], gx, gt, bound);
        } else {
          p.backward_scalar(r / inner, r % inner, g[r], st[r], gx, gt, bound);
        }
      }
    });
  });
  return {grad_input, grad_target};
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("cross_entropy", &cross_entropy_cpu);
  m.impl("cross_entropy_backward", &cross_entropy_backward_cpu);
}

}  // namespace nanfree
