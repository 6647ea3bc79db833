// CUDA kernels of the losses family (launchers declared in losses_kernels.h).
// No torch header: only CUDA and nanfree/*.h. Every special-value rule comes
// from nanfree/losses_math.h; the kernels only read the operands, call the
// header's functions in the accumulation type and store the results, as the
// CPU kernels (csrc/cpu/losses.cpp, losses_cross_entropy.cpp) do.
//
// Pointwise losses: one grid-stride loop per kind, direction (value or one
// partial derivative), vector width and element type over flat arrays; 16-byte
// vector accesses when every pointer of a full-length operand allows them
// (weight, pos_weight and grad may be absent, read as 1, or one element, read
// for every position), the elements after the last whole vector by the first
// threads of the grid.
//
// cross_entropy: a position (o, i) of the [outer, C, inner] logits is handled
// by a group of G threads (G a power of two, 1 .. 512; a block of max(G, 128)
// threads holds 128 / G positions when G < 128) that walks over the positions
// with a grid stride. Positions whose classes are contiguous or a few
// elements apart (inner < 32) take about C / 32 threads (forward_group: a
// power of two, at least a warp, next_pow2(C) below 32 classes, at most 512),
// the threads striding over the classes; positions of inner >= 32 take G = 1, so that the
// lanes of a warp read 32 consecutive positions of one class. Pass 1 finds
// the largest kept logit and the count of the kept classes, pass 2 the sum of
// exp(x - max) (the state lse_update gives, each exp rounded once as in the
// CPU's vector path, not rescaled at every merge of partial states), pass 3,
// where label smoothing or a probability target needs it, sums q_c and the
// terms -q_c log p_c; each pass ends in a group reduction of
// device_common.cuh (a butterfly over the group's lanes, then its warps
// through shared memory in a fixed order). Where the classes are contiguous
// (inner 1) and every row starts 16-byte aligned, each thread reads 16-byte
// vectors of consecutive classes. The backward computes each logit's gradient
// through ce_grad_input / ce_grad_target with the forward's statistics: for
// inner 1 by the forward's groups of threads per row (vectors as there; the
// row's statistics read once), else one thread per logit of the flat array.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/losses_kernels.h"
#include "nanfree/layout.h"
#include "nanfree/losses_math.h"
#include "nanfree/numerics.h"

namespace nanfree {
namespace gpu {
namespace {

using namespace detail;

constexpr int kFlatThreads = 256;  // threads per block of the flat (elementwise) kernels

// kernel<<<blocks, threads, 0, stream>>>(args): every launch of this file.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int64_t blocks, int threads, cudaStream_t stream,
                   Args... args) {
  const int64_t capped = blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks;
  kernel<<<static_cast<unsigned>(capped), threads, 0, stream>>>(static_cast<Params>(args)...);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------
// Pointwise losses.

// N entries of an operand from element j: 1 when it is absent, its one element
// in every entry (step 0), or N consecutive elements.
template <int N, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_operand(LossOperand<scalar_t> op, int64_t j, acc_t (&out)[N]) {
  if (op.data == nullptr || op.step == 0) {
    const acc_t v = op.data == nullptr ? acc_t(1) : to_acc(op.data[0]);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = v;
  } else {
    load_acc<N>(op.data + j, out);
  }
}

// Elements j .. j + N - 1 into ys: the loss value (kGrad false) or grad times
// one partial derivative, saturated to scalar_t's range.
template <PointwiseLoss kind, bool kGrad, int N, typename scalar_t>
__device__ __forceinline__ void pointwise_values(LossOperand<scalar_t> grad,
                                                 const scalar_t* __restrict__ x,
                                                 const scalar_t* __restrict__ t,
                                                 LossOperand<scalar_t> w, LossOperand<scalar_t> pw,
                                                 int64_t j, acc_of_t<scalar_t> alpha,
                                                 acc_of_t<scalar_t> gamma, int partial,
                                                 acc_of_t<scalar_t> (&ys)[N]) {
  using acc_t = acc_of_t<scalar_t>;
  acc_t xs[N], ts[N], ws[N], pws[N];
  load_acc<N>(x + j, xs);
  load_acc<N>(t + j, ts);
  load_operand<N>(w, j, ws);
  load_operand<N>(pw, j, pws);
  if constexpr (kGrad) {
    acc_t gs[N];
    load_operand<N>(grad, j, gs);
    const acc_t bound = largest_finite<scalar_t>();
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const PointwiseOperands<acc_t> o{xs[k], ts[k], ws[k], pws[k]};
      ys[k] = loss_chain_rule(gs[k], pointwise_loss_grad<kind>(o, alpha, gamma, partial), bound);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const PointwiseOperands<acc_t> o{xs[k], ts[k], ws[k], pws[k]};
      ys[k] = pointwise_loss_value<kind>(o, alpha, gamma);
    }
  }
}

// pointwise_values of elements j .. j + N - 1, stored at out + j.
template <PointwiseLoss kind, bool kGrad, int N, typename scalar_t>
__device__ __forceinline__ void pointwise_elements(LossOperand<scalar_t> grad,
                                                   const scalar_t* __restrict__ x,
                                                   const scalar_t* __restrict__ t,
                                                   LossOperand<scalar_t> w,
                                                   LossOperand<scalar_t> pw, int64_t j,
                                                   acc_of_t<scalar_t> alpha,
                                                   acc_of_t<scalar_t> gamma, int partial,
                                                   scalar_t* __restrict__ out) {
  acc_of_t<scalar_t> ys[N];
  pointwise_values<kind, kGrad, N>(grad, x, t, w, pw, j, alpha, gamma, partial, ys);
  store_acc<N>(out + j, ys);
}

// Elements [0, n): whole vectors of kVec with a grid stride, then (kVec > 1)
// the n % kVec elements after them, one per thread of the grid's first threads.
template <PointwiseLoss kind, bool kGrad, int kVec, typename scalar_t>
__global__ void __launch_bounds__(kFlatThreads)
    pointwise_loss_kernel(LossOperand<scalar_t> grad, const scalar_t* __restrict__ x,
                          const scalar_t* __restrict__ t, LossOperand<scalar_t> w,
                          LossOperand<scalar_t> pw, int64_t n, acc_of_t<scalar_t> alpha,
                          acc_of_t<scalar_t> gamma, int partial, scalar_t* __restrict__ out) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nvec = n / kVec;
  for (int64_t vi = first; vi < nvec; vi += stride) {
    pointwise_elements<kind, kGrad, kVec>(grad, x, t, w, pw, vi * kVec, alpha, gamma, partial, out);
  }
  if constexpr (kVec > 1) {
    const int64_t j = nvec * kVec + first;
    if (j < n) pointwise_elements<kind, kGrad, 1>(grad, x, t, w, pw, j, alpha, gamma, partial, out);
  }
}

// The sum of the losses of elements [0, n), as pointwise_loss_kernel visits
// them: each thread adds its values in double (a float sum of many losses
// would lose their low bits, and overflow where the mean does not), the
// block's threads' sums are added by group_reduce, and block b writes its sum
// to partials[b].
template <PointwiseLoss kind, int kVec, typename scalar_t>
__global__ void __launch_bounds__(kFlatThreads)
    pointwise_loss_sum_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ t,
                              LossOperand<scalar_t> w, LossOperand<scalar_t> pw, int64_t n,
                              acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                              double* __restrict__ partials) {
  __shared__ double partial[kMaxWarps];
  const LossOperand<scalar_t> no_grad{nullptr, 0};
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nvec = n / kVec;
  double sum[1] = {0.0};
  for (int64_t vi = first; vi < nvec; vi += stride) {
    acc_of_t<scalar_t> ys[kVec];
    pointwise_values<kind, false, kVec>(no_grad, x, t, w, pw, vi * kVec, alpha, gamma, 0, ys);
#pragma unroll
    for (int k = 0; k < kVec; ++k) sum[0] += static_cast<double>(ys[k]);
  }
  if constexpr (kVec > 1) {
    const int64_t j = nvec * kVec + first;
    if (j < n) {
      acc_of_t<scalar_t> ys[1];
      pointwise_values<kind, false, 1>(no_grad, x, t, w, pw, j, alpha, gamma, 0, ys);
      sum[0] += static_cast<double>(ys[0]);
    }
  }
  group_reduce<1>(sum, kFlatThreads, partial, SumOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = sum[0];
}

// Whether an operand allows 16-byte vector accesses: absent, one element, or aligned.
template <typename scalar_t>
bool operand_aligned(LossOperand<scalar_t> op) {
  return op.data == nullptr || op.step == 0 || aligned16(op.data);
}

// f(std::integral_constant<PointwiseLoss, kind>).
template <typename F>
cudaError_t dispatch_kind(PointwiseLoss kind, F&& f) {
  switch (kind) {
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
  return cudaErrorInvalidValue;
}

template <bool kGrad, typename scalar_t>
cudaError_t launch_pointwise(PointwiseLoss kind, LossOperand<scalar_t> grad, const scalar_t* x,
                             const scalar_t* t, LossOperand<scalar_t> w, LossOperand<scalar_t> pw,
                             int64_t n, acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                             int partial, scalar_t* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kWidth = vec_width<scalar_t>();
  const bool vec = n >= kWidth && aligned16(x) && aligned16(t) && aligned16(out) &&
                   operand_aligned(w) && operand_aligned(pw) && (!kGrad || operand_aligned(grad));
  return dispatch_kind(kind, [&](auto kind_c) {
    return dispatch_vec<scalar_t>(vec, [&](auto vec_c) {
      constexpr int kVec = decltype(vec_c)::value;
      const int64_t nvec = n / kVec;
      const int64_t tail = n - nvec * kVec;
      const int64_t work = nvec > tail ? nvec : tail;
      return launch(pointwise_loss_kernel<decltype(kind_c)::value, kGrad, kVec, scalar_t>,
                    ceil_div(work, kFlatThreads), kFlatThreads, stream, grad, x, t, w, pw, n,
                    alpha, gamma, partial, out);
    });
  });
}

// ---------------------------------------------------------------------------
// cross_entropy: reading a position's classes.

template <typename scalar_t>
__device__ __forceinline__ acc_of_t<scalar_t> class_weight(const scalar_t* weight, int64_t c) {
  return weight != nullptr ? to_acc(weight[c]) : acc_of_t<scalar_t>(1);
}

// The target class of a class-index position, or -1 when it is left out
// (ignore_index, or out of range: nanfree.ops refuses those of CPU tensors).
__device__ __forceinline__ int64_t target_class(int64_t y, int64_t ignore_index, int64_t classes) {
  return (y == ignore_index || y < 0 || y >= classes) ? -1 : y;
}

// Position (o, i): its logits (class c at x[c * inner]) and mask entries
// (class c at mask[c * mask_step]; mask nullptr: every class exists).
template <typename scalar_t>
struct CrossEntropyPosition {
  const scalar_t* x;
  const bool* mask;
  int64_t inner;
  int64_t mask_step;

  __device__ __forceinline__ acc_of_t<scalar_t> logit(int64_t c) const { return to_acc(x[c * inner]); }
  __device__ __forceinline__ bool kept(int64_t c, acc_of_t<scalar_t> xc) const {
    return ce_class_kept(xc, mask == nullptr || mask[c * mask_step]);
  }
};

template <typename scalar_t>
__device__ __forceinline__ CrossEntropyPosition<scalar_t> position_of(
    const CrossEntropyProblem<scalar_t>& p, int64_t o, int64_t i) {
  const int64_t inner = p.layout.inner;
  const bool* mask = p.mask.data != nullptr ? p.mask.data + mask_offset(p.mask, o, i) : nullptr;
  return CrossEntropyPosition<scalar_t>{p.input + o * p.layout.n * inner + i, mask, inner,
                                        p.mask.col_stride};
}

// Logits c0 .. c0 + kVec - 1 of a position: one 16-byte load where kVec > 1
// (the launcher passes kVec > 1 only for contiguous classes, inner 1, whose
// rows all start 16-byte aligned), else the one logit c0.
template <int kVec, typename scalar_t>
__device__ __forceinline__ void load_logits(const CrossEntropyPosition<scalar_t>& pos, int64_t c0,
                                            acc_of_t<scalar_t> (&xs)[kVec]) {
  if constexpr (kVec == 1) {
    xs[0] = pos.logit(c0);
  } else {
    load_acc<kVec>(pos.x + c0, xs);
  }
}

// f(c, x_c) for the classes of thread t of a group of G, kVec consecutive ones per
// load_logits: classes [c0, c0 + kVec) for c0 = (t + j G) kVec.
template <int kVec, typename scalar_t, typename F>
__device__ __forceinline__ void for_each_class(const CrossEntropyPosition<scalar_t>& pos,
                                               int64_t classes, int t, int G, F&& f) {
  for (int64_t c0 = static_cast<int64_t>(t) * kVec; c0 < classes;
       c0 += static_cast<int64_t>(G) * kVec) {
    acc_of_t<scalar_t> xs[kVec];
    load_logits<kVec>(pos, c0, xs);
#pragma unroll
    for (int k = 0; k < kVec; ++k) f(c0 + k, xs[k]);
  }
}

// q_c of class c (losses_math.h): the index target's (y the target class, or
// -1 where the position is left out) or the probability target's.
template <typename scalar_t>
__device__ __forceinline__ acc_of_t<scalar_t> class_q(const CrossEntropyProblem<scalar_t>& p,
                                                      const scalar_t* prob_position, int64_t c,
                                                      int64_t y, acc_of_t<scalar_t> smoothing) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t w_c = class_weight(p.weight, c);
  if (p.index != nullptr) {
    return ce_index_weight(c == y, w_c, y >= 0 ? class_weight(p.weight, y) : acc_t(0), p.eps,
                           smoothing);
  }
  return ce_probability_weight(to_acc(prob_position[c * p.layout.inner]), w_c, p.eps, smoothing);
}

// ---------------------------------------------------------------------------
// cross_entropy: the kernels.

// Loss and statistics of every position (o, i), with the rules of the CPU's
// forward_scalar: a left-out position (ignored target, target class not kept,
// no kept class) gets loss 0 and ce_left_out().
// Thread t of a group reads its classes kVec at a time (for_each_class).
template <int kVec, typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_forward_kernel(CrossEntropyProblem<scalar_t> p,
                                 acc_of_t<scalar_t>* __restrict__ loss,
                                 acc_of_t<scalar_t>* __restrict__ stats, int G) {
  using acc_t = acc_of_t<scalar_t>;
  __shared__ acc_t partial_acc[kMaxWarps * 2];
  __shared__ long long partial_count[kMaxWarps];
  const int groups = blockDim.x / G;
  const int group = threadIdx.x / G;
  const int t = threadIdx.x % G;
  const int64_t classes = p.layout.n, inner = p.layout.inner;
  const int64_t positions = p.layout.reductions();
  // Index targets without smoothing read the target class alone after pass 2.
  const bool sums = p.index == nullptr || p.eps != acc_t(0);

  // `base` is the same for the whole block, so every thread runs every iteration.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < positions;
       base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t r = base + group;
    const bool active = r < positions;
    const int64_t o = active ? r / inner : 0;
    const int64_t i = active ? r - o * inner : 0;
    const CrossEntropyPosition<scalar_t> pos = position_of(p, o, i);

    // An index target whose class is ignored or not kept leaves the position out.
    int64_t y = -1;
    bool live = active;
    if (active && p.index != nullptr) {
      y = target_class(p.index[r], p.ignore_index, classes);
      live = y >= 0 && pos.kept(y, pos.logit(y));
    }

    // Pass 1: the largest kept logit and the count of the kept classes. A NaN
    // logit is skipped by the max (xc > max is false), as lse_update skips it.
    acc_t row_max[1] = {-nf_inf<acc_t>()};
    long long count[1] = {0};
    if (live) {
      for_each_class<kVec>(pos, classes, t, G, [&](int64_t c, acc_t xc) {
        if (!pos.kept(c, xc)) return;
        if (xc > row_max[0]) row_max[0] = xc;
        ++count[0];
      });
    }
    group_reduce<1>(row_max, G, partial_acc, MaxOp());
    group_reduce<1>(count, G, partial_count, SumOp());
    live = live && count[0] > 0;  // no kept class: left out

    // Pass 2: the sum lse_update would give, sum of lse_scale(x_c, max) over
    // the kept classes (the number of +inf classes when the max is +inf, NaN
    // with a NaN logit), one exp per class as the CPU's vector path: no
    // rescaling of partial sums at each merge.
    acc_t exp_sum[1] = {acc_t(0)};
    if (live) {
      for_each_class<kVec>(pos, classes, t, G, [&](int64_t c, acc_t xc) {
        if (pos.kept(c, xc)) exp_sum[0] += lse_scale(xc, row_max[0]);
      });
    }
    group_reduce<1>(exp_sum, G, partial_acc, SumOp());

    CrossEntropyStats<acc_t> st{row_max[0], nf_log(exp_sum[0]), acc_t(0),
                                ce_smoothing(p.eps, count[0]), acc_t(1)};
    // Pass 3: q_c and the terms -q_c log p_c summed over the kept classes;
    // of an index target's q_y only the smoothing share s w_y (class_q with
    // no target class), its own share (1 - eps) w_y is added once after the
    // reduction: a term of the loss's size is not rounded into every partial sum.
    acc_t sum[2] = {acc_t(0), acc_t(0)};  // total, loss
    if (sums) {
      const scalar_t* prob_position =
          p.prob != nullptr ? p.prob + o * classes * inner + i : nullptr;
      if (live) {
        for_each_class<kVec>(pos, classes, t, G, [&](int64_t c, acc_t xc) {
          if (!pos.kept(c, xc)) return;
          const acc_t qc = class_q(p, prob_position, c, int64_t(-1), st.smoothing);
          sum[0] += qc;
          sum[1] += ce_term(qc, ce_log_probability(xc, st));
        });
      }
      group_reduce<2>(sum, G, partial_acc, SumOp());
    }
    if (!active || t != 0) continue;  // after the block-wide reductions

    acc_t value = acc_t(0);
    if (!live) {
      st = ce_left_out<acc_t>();
    } else {
      st.total = sum[0];
      value = sum[1];
      if (p.index != nullptr) {
        const acc_t w_y = class_weight(p.weight, y);
        // (1 - eps) w_y: q_y of a class of weight 0 without smoothing.
        const acc_t q_target = ce_index_weight(true, acc_t(0), w_y, p.eps, acc_t(0));
        st.total += q_target;
        value += ce_term(q_target, ce_log_probability(pos.logit(y), st));
        st.denominator = w_y;
      }
      // A NaN logit makes the sum NaN; the terms of weight 0 would hide it.
      if (nf_isnan(st.log_sum)) value = st.log_sum;
    }
    loss[r] = value;
    acc_t* out = stats + r * kCrossEntropyStats;
    out[0] = st.max;
    out[1] = st.log_sum;
    out[2] = st.total;
    out[3] = st.smoothing;
    out[4] = st.denominator;
  }
}

// grad_input (and, with_target, grad_target) of logit c of a position with
// the forward's statistics st, upstream g, target class y (-1: none or left
// out), whether the class takes part (ce_class_kept) and probability target
// prob_position (nullptr: index target), with the rules of the CPU's backward_scalar.
template <typename scalar_t>
__device__ __forceinline__ void ce_backward_element(const CrossEntropyProblem<scalar_t>& p,
                                                    const CrossEntropyStats<acc_of_t<scalar_t>>& st,
                                                    acc_of_t<scalar_t> g, int64_t y, bool kept,
                                                    const scalar_t* prob_position, int64_t c,
                                                    acc_of_t<scalar_t> xc, acc_of_t<scalar_t> bound,
                                                    bool with_target, acc_of_t<scalar_t>& grad_x,
                                                    acc_of_t<scalar_t>& grad_t) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t qc = kept ? class_q(p, prob_position, c, y, st.smoothing) : acc_t(0);
  grad_x = ce_grad_input(g, xc, qc, kept, st, bound);
  if (with_target) grad_t = ce_grad_target(g, xc, class_weight(p.weight, c), p.eps, kept, st, bound);
}

// The forward's statistics of position r.
template <typename acc_t>
__device__ __forceinline__ CrossEntropyStats<acc_t> position_stats(const acc_t* stats, int64_t r) {
  const acc_t* s = stats + r * kCrossEntropyStats;
  return CrossEntropyStats<acc_t>{s[0], s[1], s[2], s[3], s[4]};
}

// Any layout: one thread per logit (o, c, i), found from its flat index by two
// divisions.
template <typename scalar_t>
__global__ void __launch_bounds__(kFlatThreads)
    cross_entropy_backward_kernel(CrossEntropyProblem<scalar_t> p,
                                  const acc_of_t<scalar_t>* __restrict__ grad,
                                  const acc_of_t<scalar_t>* __restrict__ stats,
                                  scalar_t* __restrict__ grad_input,
                                  scalar_t* __restrict__ grad_target) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t bound = largest_finite<scalar_t>();
  const int64_t classes = p.layout.n, inner = p.layout.inner;
  const int64_t n = p.layout.outer * classes * inner;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t oc = e / inner;
    const int64_t i = e - oc * inner;
    const int64_t o = oc / classes;
    const int64_t c = oc - o * classes;
    const int64_t r = o * inner + i;
    const bool keep = p.mask.data == nullptr ||
                      p.mask.data[mask_offset(p.mask, o, i) + c * p.mask.col_stride];
    const int64_t y = p.index != nullptr ? target_class(p.index[r], p.ignore_index, classes) : -1;
    const scalar_t* prob_position = p.prob != nullptr ? p.prob + (e - c * inner) : nullptr;
    const acc_t xc = to_acc(p.input[e]);
    acc_t grad_x, grad_t = acc_t(0);
    ce_backward_element(p, position_stats(stats, r), grad[r], y, ce_class_kept(xc, keep),
                        prob_position, c, xc, bound, grad_target != nullptr, grad_x, grad_t);
    grad_input[e] = FromAcc<scalar_t>::cast(grad_x);
    if (grad_target != nullptr) grad_target[e] = FromAcc<scalar_t>::cast(grad_t);
  }
}

// Classes contiguous (inner 1): a group of G threads per row, as the forward's,
// each thread kVec consecutive logits per 16-byte access (kVec > 1 only where
// every row starts aligned), the row's statistics read once; no division per logit.
template <int kVec, typename scalar_t>
__global__ void __launch_bounds__(kMaxThreads)
    cross_entropy_backward_rows_kernel(CrossEntropyProblem<scalar_t> p,
                                       const acc_of_t<scalar_t>* __restrict__ grad,
                                       const acc_of_t<scalar_t>* __restrict__ stats,
                                       scalar_t* __restrict__ grad_input,
                                       scalar_t* __restrict__ grad_target, int G) {
  using acc_t = acc_of_t<scalar_t>;
  const acc_t bound = largest_finite<scalar_t>();
  const int groups = blockDim.x / G;
  const int t = threadIdx.x % G;
  const int64_t classes = p.layout.n, rows = p.layout.outer;
  const bool with_target = grad_target != nullptr;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * groups + threadIdx.x / G; r < rows;
       r += static_cast<int64_t>(gridDim.x) * groups) {
    const CrossEntropyStats<acc_t> st = position_stats(stats, r);
    const acc_t g = grad[r];
    const int64_t y = p.index != nullptr ? target_class(p.index[r], p.ignore_index, classes) : -1;
    const scalar_t* prob_position = p.prob != nullptr ? p.prob + r * classes : nullptr;
    const CrossEntropyPosition<scalar_t> pos = position_of(p, r, 0);  // inner 1: position (r, 0)
    for (int64_t c0 = static_cast<int64_t>(t) * kVec; c0 < classes;
         c0 += static_cast<int64_t>(G) * kVec) {
      acc_t xs[kVec], grad_x[kVec], grad_t[kVec];
      load_logits<kVec>(pos, c0, xs);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const int64_t c = c0 + k;
        grad_t[k] = acc_t(0);
        ce_backward_element(p, st, g, y, pos.kept(c, xs[k]), prob_position, c, xs[k], bound,
                            with_target, grad_x[k], grad_t[k]);
      }
      store_acc<kVec>(grad_input + r * classes + c0, grad_x);
      if (with_target) store_acc<kVec>(grad_target + r * classes + c0, grad_t);
    }
  }
}

// Threads per position of the forward: about kWarp classes per thread and
// pass, so rows up to 1024 classes get a warp (reductions by shuffles alone,
// several rows per block) and longer rows more threads, up to kMaxThreads. A
// block of 512 threads per row of 1000 classes (two classes per thread, four
// block-wide reductions per row) ran its forward at 3-6% of copy bandwidth on an H200.
int forward_group(ReductionLayout layout) {
  if (layout.inner >= kWarp) return 1;
  const int64_t threads = ceil_div(layout.n, int64_t{kWarp});  // kWarp classes each
  const int by_work = next_pow2(threads < kMaxThreads ? threads : kMaxThreads);
  const int least = layout.n < kWarp ? next_pow2(layout.n) : kWarp;
  return by_work > least ? by_work : least;  // both at most kMaxThreads
}

// The launch of a kernel by groups of forward_group threads per position.
Plan group_plan(ReductionLayout layout, int64_t positions) {
  return finish_plan(Plan{false, 0, forward_group(layout), 0, 0}, positions);
}

// Whether every row of the [outer, C] arrays (inner 1) can be read in 16-byte
// vectors: C a multiple of the vector width and each array (nullptr: absent)
// 16-byte aligned.
template <typename scalar_t>
bool rows_vectorizable(const CrossEntropyProblem<scalar_t>& p,
                       std::initializer_list<const scalar_t*> arrays) {
  if (p.layout.inner != 1 || p.layout.n % vec_width<scalar_t>() != 0) return false;
  for (const scalar_t* a : arrays) {
    if (a != nullptr && !aligned16(a)) return false;
  }
  return true;
}

}  // namespace

template <typename scalar_t>
cudaError_t pointwise_loss_forward(PointwiseLoss kind, const scalar_t* input,
                                   const scalar_t* target, LossOperand<scalar_t> weight,
                                   LossOperand<scalar_t> pos_weight, int64_t n,
                                   acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                                   scalar_t* out, cudaStream_t stream) {
  return launch_pointwise<false>(kind, LossOperand<scalar_t>{nullptr, 0}, input, target, weight,
                                 pos_weight, n, alpha, gamma, 0, out, stream);
}

int64_t pointwise_loss_sum_partials(int64_t n) {
  // A few vectors per thread at least; a grid-stride loop covers the rest.
  const int64_t blocks = ceil_div(n, int64_t{4} * kFlatThreads);
  return blocks < 1 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

template <typename scalar_t>
cudaError_t pointwise_loss_sum(PointwiseLoss kind, const scalar_t* input, const scalar_t* target,
                               LossOperand<scalar_t> weight, LossOperand<scalar_t> pos_weight,
                               int64_t n, acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                               double* partials, cudaStream_t stream) {
  constexpr int kWidth = vec_width<scalar_t>();
  const bool vec = n >= kWidth && aligned16(input) && aligned16(target) &&
                   operand_aligned(weight) && operand_aligned(pos_weight);
  const int64_t blocks = pointwise_loss_sum_partials(n);
  return dispatch_kind(kind, [&](auto kind_c) {
    return dispatch_vec<scalar_t>(vec, [&](auto vec_c) {
      constexpr int kVec = decltype(vec_c)::value;
      return launch(pointwise_loss_sum_kernel<decltype(kind_c)::value, kVec, scalar_t>, blocks,
                    kFlatThreads, stream, input, target, weight, pos_weight, n, alpha, gamma,
                    partials);
    });
  });
}

template <typename scalar_t>
cudaError_t pointwise_loss_backward(PointwiseLoss kind, LossOperand<scalar_t> grad,
                                    const scalar_t* input, const scalar_t* target,
                                    LossOperand<scalar_t> weight,
                                    LossOperand<scalar_t> pos_weight, int64_t n,
                                    acc_of_t<scalar_t> alpha, acc_of_t<scalar_t> gamma,
                                    int partial, scalar_t* out, cudaStream_t stream) {
  return launch_pointwise<true>(kind, grad, input, target, weight, pos_weight, n, alpha, gamma,
                                partial, out, stream);
}

template <typename scalar_t>
cudaError_t cross_entropy_forward(CrossEntropyProblem<scalar_t> problem, acc_of_t<scalar_t>* loss,
                                  acc_of_t<scalar_t>* stats, cudaStream_t stream) {
  const int64_t positions = problem.layout.reductions();
  if (positions <= 0) return cudaSuccess;
  const Plan plan = group_plan(problem.layout, positions);
  return dispatch_vec<scalar_t>(rows_vectorizable(problem, {problem.input}), [&](auto vec_c) {
    return launch(cross_entropy_forward_kernel<decltype(vec_c)::value, scalar_t>, plan.blocks,
                  plan.threads, stream, problem, loss, stats, plan.group);
  });
}

template <typename scalar_t>
cudaError_t cross_entropy_backward(CrossEntropyProblem<scalar_t> problem,
                                   const acc_of_t<scalar_t>* grad,
                                   const acc_of_t<scalar_t>* stats, scalar_t* grad_input,
                                   scalar_t* grad_target, cudaStream_t stream) {
  const int64_t n = problem.layout.outer * problem.layout.n * problem.layout.inner;
  if (n <= 0) return cudaSuccess;
  if (problem.layout.inner != 1) {
    return launch(cross_entropy_backward_kernel<scalar_t>, ceil_div(n, kFlatThreads), kFlatThreads,
                  stream, problem, grad, stats, grad_input, grad_target);
  }
  const Plan plan = group_plan(problem.layout, problem.layout.outer);
  const bool vec = rows_vectorizable(problem, {problem.input, grad_input, grad_target});
  return dispatch_vec<scalar_t>(vec, [&](auto vec_c) {
    return launch(cross_entropy_backward_rows_kernel<decltype(vec_c)::value, scalar_t>, plan.blocks,
                  plan.threads, stream, problem, grad, stats, grad_input, grad_target, plan.group);
  });
}

NANFREE_LOSSES_LAUNCHERS(, float)
NANFREE_LOSSES_LAUNCHERS(, double)
NANFREE_LOSSES_LAUNCHERS(, __half)
NANFREE_LOSSES_LAUNCHERS(, __nv_bfloat16)

}  // namespace gpu
}  // namespace nanfree
