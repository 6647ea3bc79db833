// CPU kernels of the softmax family (last dimension), built on the shared
// numerics in csrc/include/nanfree. Rows run in parallel; inside a row the
// finite fast path is vectorized with at::vec and every special value (empty,
// +inf and NaN rows, masked entries) goes through the shared scalar functions.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "common/softmax_op.h"

namespace nanfree {
namespace {

template <typename T>
using Vec = at::vec::Vectorized<T>;

enum class Forward { Softmax, LogSoftmax, LogSumExp };

// Rows of a chunk are summarized with one vectorized max and one vectorized
// exp-sum, then merged into the row's online state with lse_merge.
constexpr int64_t kChunk = 1024;

// Total work per parallel task, in elements.
constexpr int64_t kGrainElements = 32768;

// exp of a shifted (<= 0) argument: ATen's exp_u20 for float (about 20 ulp,
// as PyTorch's own softmax kernels use; results below FLT_MIN flush to 0,
// which a sum that is at least 1 cannot see) and the 1-ulp exp for double.
template <typename acc_t>
inline Vec<acc_t> shifted_exp(const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}

inline int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1));
}

// Reads a row into an accumulation-type buffer: a plain view for float/double
// without a mask, else converted and with dropped entries set to -inf.
template <typename scalar_t, typename acc_t>
const acc_t* load_row(const scalar_t* src, int64_t n, const MaskView& mask, int64_t row,
                      acc_t* buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (mask.data == nullptr) return src;
    std::copy(src, src + n, buffer);
  } else {
    at::vec::convert(src, buffer, n);
  }
  if (mask.data != nullptr) {
    const bool* keep = mask.data + mask_row_offset(mask, row);
    const int64_t stride = mask.col_stride;
    for (int64_t j = 0; j < n; ++j) buffer[j] = masked_value(buffer[j], keep[j * stride]);
  }
  return buffer;
}

template <typename scalar_t, typename acc_t>
void store_row(const acc_t* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (src != dst) std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// Largest value of x[0..n), NaN if any value is NaN.
template <typename acc_t>
acc_t chunk_max(const acc_t* x, int64_t n) {
  return at::vec::reduce_all<acc_t>(
      [](Vec<acc_t>& a, Vec<acc_t>& b) { return at::vec::maximum(a, b); }, x, n);
}

// The logsumexp state of x[0..n). When `exps` is given, it receives
// exp(x - chunk max) for a chunk with a finite max (the caller rescales it).
template <typename acc_t>
LseState<acc_t> chunk_state(const acc_t* x, int64_t n, acc_t* exps) {
  const acc_t m = chunk_max(x, n);
  if (m == -nf_inf<acc_t>()) {
    // All entries -inf: the empty set, and exp(x - m) would be exp(NaN).
    if (exps != nullptr) std::fill(exps, exps + n, acc_t(0));
    return lse_empty<acc_t>();
  }
  if (nf_isnan(m) || m == nf_inf<acc_t>()) {
    // NaN or +inf entries: x - m is NaN somewhere, so the shared scalar update
    // applies the limits. Such a row never takes the vectorized output path.
    LseState<acc_t> state = lse_empty<acc_t>();
    for (int64_t j = 0; j < n; ++j) lse_update(state, x[j]);
    return state;
  }
  const Vec<acc_t> shift(m);
  acc_t sum;
  if (exps != nullptr) {
    at::vec::map([&](Vec<acc_t> v) { return shifted_exp(v - shift); }, exps, x, n);
    sum = at::vec::reduce_all<acc_t>([](Vec<acc_t>& a, Vec<acc_t>& b) { return a + b; }, exps, n);
  } else {
    sum = at::vec::map_reduce_all<acc_t>([&](Vec<acc_t> v) { return shifted_exp(v - shift); },
                                         [](Vec<acc_t>& a, Vec<acc_t>& b) { return a + b; }, x, n);
  }
  return LseState<acc_t>{m, sum};
}

template <Forward kind, typename scalar_t>
void forward_kernel(const at::Tensor& input, const MaskView& mask, at::Tensor& output,
                    at::Tensor& stats) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowsCols shape = rows_cols(input);
  const int64_t rows = shape.rows, cols = shape.cols;
  const scalar_t* in = input.const_data_ptr<scalar_t>();
  scalar_t* out = output.mutable_data_ptr<scalar_t>();
  acc_t* stats_out = stats.mutable_data_ptr<acc_t>();
  const int64_t chunks = (cols + kChunk - 1) / kChunk;

  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    // Uninitialized scratch: every entry used is written first.
    const bool needs_buffer = !std::is_same_v<scalar_t, acc_t> || mask.data != nullptr ||
                              kind == Forward::LogSoftmax;
    std::unique_ptr<acc_t[]> buffer(needs_buffer ? new acc_t[cols] : nullptr);
    // float and double softmax rows write their exps straight into the output.
    std::unique_ptr<acc_t[]> exp_buffer(
        kind == Forward::Softmax && !std::is_same_v<scalar_t, acc_t> ? new acc_t[cols] : nullptr);
    std::vector<acc_t> chunk_maxima(chunks);
    for (int64_t r = begin; r < end; ++r) {
      const acc_t* x = load_row(in + r * cols, cols, mask, r, buffer.get());
      acc_t* exps = nullptr;
      if constexpr (kind == Forward::Softmax) {
        if constexpr (std::is_same_v<scalar_t, acc_t>) {
          exps = out + r * cols;
        } else {
          exps = exp_buffer.get();
        }
      }
      LseState<acc_t> state = lse_empty<acc_t>();
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t start = c * kChunk, n = std::min(kChunk, cols - start);
        const LseState<acc_t> part =
            chunk_state(x + start, n, kind == Forward::Softmax ? exps + start : nullptr);
        chunk_maxima[c] = part.max;
        state = lse_merge(state, part);
      }
      stats_out[2 * r] = state.max;
      stats_out[2 * r + 1] = nf_log(state.sum);
      if constexpr (kind == Forward::LogSumExp) {
        out[r] = static_cast<scalar_t>(lse_value(state));
        continue;
      }
      scalar_t* y = out + r * cols;
      // The vectorized output path is for rows with a finite max and sum; the
      // empty, +inf and NaN rows take the shared per-entry rules.
      const bool finite_row = !nf_isinf(state.max) && !nf_isnan(state.sum);
      if constexpr (kind == Forward::Softmax) {
        const acc_t inv_sum = acc_t(1) / state.sum;
        if (finite_row) {
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t start = c * kChunk, n = std::min(kChunk, cols - start);
            // A chunk of only -inf has exps 0 and a -inf max: lse_scale gives 0.
            const Vec<acc_t> factor(lse_scale(chunk_maxima[c], state.max) * inv_sum);
            acc_t* e = exps + start;
            at::vec::map([&](Vec<acc_t> v) { return v * factor; }, e, e, n);
          }
        } else {
          for (int64_t j = 0; j < cols; ++j) exps[j] = softmax_value(x[j], state, inv_sum);
        }
        store_row(exps, y, cols);
      } else {
        const acc_t log_sum = nf_log(state.sum);
        acc_t* result = buffer.get();
        if (finite_row) {
          const Vec<acc_t> shift(state.max), log_sum_v(log_sum);
          // x - max - log_sum: an unmasked -inf stays -inf, as log_softmax_value.
          at::vec::map([&](Vec<acc_t> v) { return (v - shift) - log_sum_v; }, result, x, cols);
        } else {
          for (int64_t j = 0; j < cols; ++j) result[j] = log_softmax_value(x[j], state, log_sum);
        }
        store_row(result, y, cols);
      }
    }
  });
}

template <Forward kind>
std::tuple<at::Tensor, at::Tensor> forward(const char* op, const at::Tensor& input_,
                                           const std::optional<at::Tensor>& mask) {
  check_float_input(op, "input", input_);
  if (mask.has_value()) check_mask(op, input_, *mask);
  const at::Tensor input = input_.contiguous();
  at::Tensor stats =
      at::empty(stats_shape(input), input.options().dtype(acc_dtype(input.scalar_type())));
  at::Tensor output = kind == Forward::LogSumExp ? at::empty(row_shape(input), input.options())
                                                 : at::empty(input.sizes(), input.options());
  at::Tensor mask_storage;
  const MaskView view = make_mask_view(mask, mask_storage);
  if (stats.numel() == 0) return {output, stats};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "nanfree_softmax_forward", [&] {
    forward_kernel<kind, scalar_t>(input, view, output, stats);
  });
  return {output, stats};
}

template <typename acc_t>
acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  return at::vec::map2_reduce_all<acc_t>([](Vec<acc_t> x, Vec<acc_t> y) { return x * y; },
                                         [](Vec<acc_t>& x, Vec<acc_t>& y) { return x + y; }, a, b, n);
}

template <typename acc_t>
acc_t masked_sum(const acc_t* a, int64_t n, const MaskView& mask, int64_t row) {
  if (mask.data == nullptr) {
    return at::vec::reduce_all<acc_t>([](Vec<acc_t>& x, Vec<acc_t>& y) { return x + y; }, a, n);
  }
  const bool* keep = mask.data + mask_row_offset(mask, row);
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += keep[j * mask.col_stride] ? a[j] : acc_t(0);
  return sum;
}

// Converted views of one row of each operand, reusing per-task buffers.
template <typename scalar_t, typename acc_t>
const acc_t* as_acc(const scalar_t* src, int64_t n, std::vector<acc_t>& buffer) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    at::vec::convert(src, buffer.data(), n);
    return buffer.data();
  }
}

enum class Backward { Softmax, LogSoftmax, LogSumExp };

inline bool kept(const MaskView& mask, int64_t row, int64_t col) {
  return mask.data == nullptr || mask.data[mask_row_offset(mask, row) + col * mask.col_stride];
}

template <Backward kind, typename scalar_t>
void backward_kernel(const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& stats,
                     const MaskView& mask, at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowsCols shape = rows_cols(saved);
  const int64_t rows = shape.rows, cols = shape.cols;
  const scalar_t* g_all = grad.const_data_ptr<scalar_t>();
  const scalar_t* s_all = saved.const_data_ptr<scalar_t>();
  const acc_t* stats_all = stats.const_data_ptr<acc_t>();
  scalar_t* dx_all = grad_input.mutable_data_ptr<scalar_t>();

  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> g_buf(cols), s_buf(cols), dx(cols);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* dx_row = dx_all + r * cols;
      const RowStats<acc_t> row{stats_all[2 * r], stats_all[2 * r + 1]};
      if (!row_has_gradient(row)) {
        std::fill(dx_row, dx_row + cols, scalar_t(0));
        continue;
      }
      const acc_t* s = as_acc(s_all + r * cols, cols, s_buf);
      if constexpr (kind == Backward::LogSumExp) {
        const acc_t g = static_cast<acc_t>(g_all[r]);
        // A NaN row takes the scalar path: exp_u20 clamps its argument and
        // would turn NaN into a number.
        if (mask.data == nullptr && !nf_isnan(row.log_sum)) {
          const Vec<acc_t> gv(g), max_v(row.max), log_sum_v(row.log_sum);
          // g * exp(x - max - log_sum), as logsumexp_grad_value with every entry kept.
          at::vec::map([&](Vec<acc_t> x) { return gv * shifted_exp((x - max_v) - log_sum_v); },
                       dx.data(), s, cols);
        } else {
          for (int64_t j = 0; j < cols; ++j)
            dx[j] = logsumexp_grad_value(g, s[j], row, kept(mask, r, j));
        }
      } else {
        const acc_t* g = as_acc(g_all + r * cols, cols, g_buf);
        if constexpr (kind == Backward::Softmax) {
          const Vec<acc_t> d(dot(g, s, cols));
          // y * (g - dot), as softmax_grad_value; dropped entries have y = 0.
          at::vec::map2([&](Vec<acc_t> gv, Vec<acc_t> y) { return y * (gv - d); }, dx.data(), g, s,
                        cols);
        } else {
          const acc_t grad_sum = masked_sum(g, cols, mask, r);
          if (mask.data == nullptr && !nf_isnan(row.log_sum)) {  // NaN rows: see above
            const Vec<acc_t> sum_v(grad_sum);
            // g - exp(y) * sum, as log_softmax_grad_value with every entry kept.
            at::vec::map2([&](Vec<acc_t> gv, Vec<acc_t> y) { return gv - shifted_exp(y) * sum_v; },
                          dx.data(), g, s, cols);
          } else {
            for (int64_t j = 0; j < cols; ++j)
              dx[j] = log_softmax_grad_value(g[j], s[j], grad_sum, kept(mask, r, j));
          }
        }
      }
      store_row(dx.data(), dx_row, cols);
    }
  });
}

template <Backward kind>
at::Tensor backward(const char* op, const at::Tensor& grad_, const at::Tensor& saved_,
                    const at::Tensor& stats_, const std::optional<at::Tensor>& mask) {
  check_float_input(op, "grad_output", grad_);
  check_float_input(op, "saved", saved_);
  TORCH_CHECK(grad_.scalar_type() == saved_.scalar_type(), "nanfree.", op,
              ": `grad_output` dtype ", grad_.scalar_type(), " differs from the saved tensor's ",
              saved_.scalar_type());
  const auto expected_grad = kind == Backward::LogSumExp ? row_shape(saved_)
                                                         : saved_.sizes().vec();
  TORCH_CHECK(grad_.sizes().vec() == expected_grad, "nanfree.", op, ": `grad_output` has shape ",
              grad_.sizes(), ", expected ", at::IntArrayRef(expected_grad));
  TORCH_CHECK(stats_.sizes().vec() == stats_shape(saved_) &&
                  stats_.scalar_type() == acc_dtype(saved_.scalar_type()),
              "nanfree.", op, ": `stats` must be the forward's saved row statistics");
  check_same_device(op, "grad_output", saved_, grad_);
  check_same_device(op, "stats", saved_, stats_);
  if (mask.has_value()) check_mask(op, saved_, *mask);
  const at::Tensor grad = grad_.contiguous(), saved = saved_.contiguous(),
                   stats = stats_.contiguous();
  at::Tensor grad_input = at::empty(saved.sizes(), saved.options());
  at::Tensor mask_storage;
  const MaskView view = make_mask_view(mask, mask_storage);
  if (grad_input.numel() == 0) return grad_input;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, saved.scalar_type(), "nanfree_softmax_backward", [&] {
    backward_kernel<kind, scalar_t>(grad, saved, stats, view, grad_input);
  });
  return grad_input;
}

std::tuple<at::Tensor, at::Tensor> softmax_lastdim(const at::Tensor& input,
                                                   const std::optional<at::Tensor>& mask) {
  return forward<Forward::Softmax>("softmax", input, mask);
}
std::tuple<at::Tensor, at::Tensor> log_softmax_lastdim(const at::Tensor& input,
                                                       const std::optional<at::Tensor>& mask) {
  return forward<Forward::LogSoftmax>("log_softmax", input, mask);
}
std::tuple<at::Tensor, at::Tensor> logsumexp_lastdim(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& mask) {
  return forward<Forward::LogSumExp>("logsumexp", input, mask);
}
at::Tensor softmax_lastdim_backward(const at::Tensor& grad, const at::Tensor& output,
                                    const at::Tensor& stats) {
  return backward<Backward::Softmax>("softmax_backward", grad, output, stats, std::nullopt);
}
at::Tensor log_softmax_lastdim_backward(const at::Tensor& grad, const at::Tensor& output,
                                        const at::Tensor& stats,
                                        const std::optional<at::Tensor>& mask) {
  return backward<Backward::LogSoftmax>("log_softmax_backward", grad, output, stats, mask);
}
at::Tensor logsumexp_lastdim_backward(const at::Tensor& grad, const at::Tensor& input,
                                      const at::Tensor& stats,
                                      const std::optional<at::Tensor>& mask) {
  return backward<Backward::LogSumExp>("logsumexp_backward", grad, input, stats, mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(nanfree, CPU, m) {
  m.impl("softmax_lastdim", &softmax_lastdim);
  m.impl("log_softmax_lastdim", &log_softmax_lastdim);
  m.impl("logsumexp_lastdim", &logsumexp_lastdim);
  m.impl("softmax_lastdim_backward", &softmax_lastdim_backward);
  m.impl("log_softmax_lastdim_backward", &log_softmax_lastdim_backward);
  m.impl("logsumexp_lastdim_backward", &logsumexp_lastdim_backward);
}

}  // namespace nanfree
