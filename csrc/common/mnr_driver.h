// The chunked MNR loss shared by the CPU and CUDA registrations: blocks of
// local rows against every column, through ATen's GEMM, with the per-entry
// math of mnr_math.h in a device's tile kernels (the `Tiles` policy). Only
// one chunk of cosines ([chunk rows, columns], Tiles::kChunkEntries entries per
// row kind) exists at a time; the forward keeps two logsumexps per row.
//
// With `grad`, the gradients are computed in the same pass as the loss (a
// chunk holds whole rows, so each row's logsumexp is known before its
// softmax is needed): three GEMMs per chunk and no recomputation. The
// backward op recomputes the chunk's cosines from the saved logsumexps.
//
// A `Tiles` policy provides (acc_t = float, or double for double inputs):
//   static constexpr int64_t kChunkEntries;
//   static constexpr int64_t kMinChunkRows;
//     cosines held per row kind and chunk: the block of rows is
//     kChunkEntries / columns rows (at least one), and with gradients at
//     least kMinChunkRows (each chunk then adds into the columns' gradient
//     accumulator, which fewer, larger chunks read and write fewer times).
//   static at::Tensor operand(const at::Tensor& matrix);
//     the GEMM operand of an input [n, d] matrix (e.g. the acc dtype on CPU).
//   static at::Tensor scores(const at::Tensor& rows, const at::Tensor& columns,
//                            at::Tensor& buffer);
//     rows @ columns^T as a contiguous acc_t matrix; `buffer` is the row
//     kind's scratch, which the policy may keep the scores in from chunk to
//     chunk (a chunk's scores are not read once the next chunk's are made).
//   static at::Tensor gradient_operand(const at::Tensor& grads, at::ScalarType operand);
//     the GEMM operand form of a chunk's scale * dlogit (acc_t, contiguous,
//     after row_grads) for operand matrices of dtype `operand`: the matrix
//     itself, or its rounding to a half dtype; made once per chunk and row
//     kind, for every gradient GEMM of the chunk. `grads` is not read after
//     it, so the rounding may be written into its storage.
//   static void accumulate(at::Tensor out, const at::Tensor& a, const at::Tensor& b,
//                          float beta);
//     out = beta * out + a @ b (beta 1, or 0: out's entries are not read, NaN
//     included), out acc_t, a a gradient_operand matrix or the transpose of a
//     column slice of it (a view), b an operand matrix.
//   static void row_stats(const at::Tensor& cos, const MnrTile&, const at::Tensor& scale,
//                         double hardness_strength, at::Tensor lse, at::Tensor target);
//     lse[i] = logsumexp of row i's logits relative to its target logit
//     (mnr_relative_lse); target[i] = t (mnr_target_logit of the positive's
//     cosine, column g) is written by Q rows and read by P rows. `scale` is
//     0-d acc_t.
//   static void row_grads(at::Tensor cos, const MnrTile&, const at::Tensor& scale,
//                         double hardness_strength, const at::Tensor& stats,
//                         const at::Tensor& upstream, bool per_direction, bool has_p_row,
//                         at::Tensor scale_grad);
//     cos[i, j] <- scale * dlogit (mnr_logit_grad, from the row's stats
//     [rows, kMnrStats] and upstream [rows]); scale_grad[i] = sum_j dlogit * cos.
//   static constexpr bool kFusedRowPass;
//   static void row_stats_and_grads(at::Tensor cos, const MnrTile&, const at::Tensor& scale,
//                                   double hardness_strength, at::Tensor lse, at::Tensor target,
//                                   const at::Tensor& upstream, bool per_direction,
//                                   at::Tensor scale_grad);
//     with kFusedRowPass: row_stats, then row_grads, of a tile of Q rows that
//     are the only row kind, in one pass (stats[i] = (lse[i], -inf, target[i])).
//   static void row_losses(const at::Tensor& stats, bool per_direction, bool has_p_row,
//                          at::Tensor loss);
//     loss[i] = mnr_row_loss(...).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "common/find_op.h"
#include "common/mnr_op.h"
#include "nanfree/mnr_math.h"

namespace nanfree {

// One row kind: its row vectors, its columns and where their gradients go.
struct MnrRowKind {
  int kind;
  at::Tensor rows;     // operand [R or M, d]; local row g is row g
  at::Tensor columns;  // operand [cols, d]: the first segment, then the second
  int64_t first_len;
  int first_target;   // 0: gradient of queries, 1: of docs (first segment)
  int second_target;  // the same for the second segment
  int row_target;     // the rows' own gradient
};

template <class Tiles>
class MnrChunked {
 public:
  MnrChunked(const MnrProblem& problem, const at::Tensor& queries, at::TensorList docs,
             const std::optional<at::Tensor>& scale, double scale_value)
      : p_(problem), dtype_(queries.scalar_type()), acc_(acc_dtype(queries.scalar_type())) {
    // The rows are normalized here, by the cosine family's op (as cos_sim
    // normalizes them), so that no normalized copy outlives the call: the
    // gradients are taken back through normalize_backward before returning.
    // Queries that are rows only (never columns) and all local are normalized
    // chunk by chunk (prepare_chunk): no [R, d] normalized copy is held.
    chunk_queries_ = !p_.query_to_query() && !(p_.has_p_row() && p_.doc_to_query()) &&
                     p_.offset == 0 && p_.rows == p_.r;
    static const auto normalize = find_op<NormalizeSignature>("nanfree::normalize");
    at::Tensor q;
    if (chunk_queries_) {
      queries_ = queries.contiguous();
    } else {
      std::tie(normalized_[0], norm_stats_[0]) = normalize.call(queries.contiguous(), kMnrNormalizeEps);
      q = Tiles::operand(normalized_[0]);
    }
    std::tie(normalized_[1], norm_stats_[1]) = normalized_docs(docs);
    const at::Tensor d = Tiles::operand(normalized_[1]);
    scale_ = scale.has_value() ? scale->reshape({}).to(acc_)
                               : at::scalar_tensor(scale_value, queries.options().dtype(acc_));
    // A CPU tensor's value is on the host (no sync); a device scale's is not known here.
    host_scale_ = !scale.has_value()  ? scale_value
                  : scale->is_cpu()   ? scale->item<double>()
                                      : std::numeric_limits<double>::quiet_NaN();
    kinds_.push_back(MnrRowKind{kMnrRowQuery, q,
                                p_.query_to_query() ? at::cat({d, q}) : d, p_.m, 1, 0, 0});
    if (p_.has_p_row()) {
      std::vector<at::Tensor> parts;
      if (p_.doc_to_query()) parts.push_back(q);
      if (p_.doc_to_doc()) parts.push_back(d);
      kinds_.push_back(MnrRowKind{kMnrRowPositive, d,
                                  parts.size() == 1 ? parts[0] : at::cat(parts),
                                  p_.doc_to_query() ? p_.r : 0, 0, 1, 1});
    }
    int64_t cols = 0;
    for (const MnrRowKind& k : kinds_) cols += k.columns.size(0);
    step_ = std::clamp<int64_t>(Tiles::kChunkEntries / std::max<int64_t>(cols, 1), 1, p_.rows);
  }

  // (loss, stats, grad_queries, grad_docs, grad_scale) of the mnr_loss op.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
      bool grad, bool scale_grad) {
    const at::TensorOptions acc = scale_.options();
    stats_ = at::full({p_.rows, kMnrStats}, -std::numeric_limits<double>::infinity(), acc);
    at::Tensor upstream;
    if (grad) {
      const double upstream_value = p_.reduction == kMnrReductionMean ? 1.0 / p_.rows : 1.0;
      upstream = at::full({p_.rows}, upstream_value, acc);
      saturate_ = !gradients_within_range(upstream_value);
      start_gradients();
    }
    for (int64_t start = 0; start < p_.rows; start += step_) {
      const int64_t n = std::min(step_, p_.rows - start);
      prepare_chunk(start, n);
      std::vector<at::Tensor> cos = chunk_scores(start, n);
      // Kind 0 (the Q rows) writes each row's target logit, kind 1 reads it.
      at::Tensor target = at::empty({n}, acc);
      // With gradients and the Q rows alone, one pass gives both (row_stats_and_grads).
      at::Tensor scale_grad;
      for (size_t k = 0; k < kinds_.size(); ++k) {
        at::Tensor lse = at::empty({n}, acc);
        if constexpr (Tiles::kFusedRowPass) {
          if (grad && kinds_.size() == 1) {
            scale_grad = at::empty({n}, acc);
            Tiles::row_stats_and_grads(cos[0], tile(0, start, n), scale_, p_.hardness_strength,
                                       lse, target, upstream.narrow(0, start, n),
                                       p_.per_direction, scale_grad);
          }
        }
        if (!scale_grad.defined()) {
          Tiles::row_stats(cos[k], tile(k, start, n), scale_, p_.hardness_strength, lse, target);
        }
        stats_.narrow(0, start, n).select(1, static_cast<int64_t>(k)).copy_(lse);
      }
      stats_.narrow(0, start, n).select(1, kMnrStats - 1).copy_(target);
      if (grad) chunk_gradients(cos, start, n, upstream, scale_grad);
    }
    at::Tensor loss_rows = at::empty({p_.rows}, acc);
    Tiles::row_losses(stats_, p_.per_direction, p_.has_p_row(), loss_rows);
    at::Tensor loss = p_.reduction == kMnrReductionMean ? loss_rows.sum() / p_.rows
                      : p_.reduction == kMnrReductionSum ? loss_rows.sum()
                                                         : loss_rows;
    if (!grad) {
      // Three distinct empty tensors: outputs of an op may not alias.
      return {loss, stats_, at::empty({0}, acc.dtype(dtype_)), at::empty({0}, acc.dtype(dtype_)),
              at::empty({0}, acc)};
    }
    auto [gq, gd, gs] = finish_gradients(scale_grad);
    return {loss, stats_, gq, gd, gs};
  }

  // (grad_queries, grad_docs, grad_scale) of the mnr_loss_backward op.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_loss,
                                                          const at::Tensor& stats,
                                                          bool scale_grad) {
    stats_ = stats.contiguous();
    const at::Tensor g = grad_loss.to(acc_);
    const at::Tensor upstream = p_.reduction == kMnrReductionMean ? (g / p_.rows).expand({p_.rows})
                                : p_.reduction == kMnrReductionSum ? g.expand({p_.rows})
                                                                   : g;
    const at::Tensor up = scale_upstream(upstream);
    start_gradients();
    for (int64_t start = 0; start < p_.rows; start += step_) {
      const int64_t n = std::min(step_, p_.rows - start);
      prepare_chunk(start, n);
      chunk_gradients(chunk_scores(start, n), start, n, up);
    }
    return finish_gradients(scale_grad);
  }

 private:
  // upstream / 2^e, with 2^e (upstream_factor_) from the largest finite
  // |upstream| (at most 2 after the division), a normal power of two of acc_t
  // whose inverse is normal too, computed on the device (no host sync): no
  // logit gradient times the scale can overflow in the tiles. The gradients
  // are multiplied by 2^e at the end (finish_gradients), saturating.
  at::Tensor scale_upstream(const at::Tensor& upstream) {
    // A non-finite upstream gradient (NaN stays NaN in its rows) does not set the scale.
    const at::Tensor finite =
        at::where(at::isfinite(upstream), upstream.abs(), at::zeros_like(upstream));
    const bool dbl = acc_ == at::kDouble;
    const int64_t bias = dbl ? 1023 : 127;
    const int64_t mantissa = dbl ? 52 : 23;
    const at::Tensor exponent =
        std::get<1>(at::frexp(finite.amax())).to(at::kLong).clamp(2 - bias, bias);
    // 2^e built from its bits: exact.
    upstream_factor_ = at::bitwise_left_shift(exponent + bias, mantissa)
                           .to(dbl ? at::kLong : at::kInt)
                           .view(acc_);
    return (upstream / upstream_factor_).contiguous();
  }

  // Whether every entry of the gradients' float accumulators, for upstream
  // gradients of magnitude at most `upstream`, is provably below a quarter of
  // the largest finite value of the inputs' dtype (NaN or in range), so that
  // saturating them (finish_gradient) would change nothing. An entry adds
  // (scale * dlogit) times a normalized entry (magnitude at most 1) over the
  // pairs of its row: per row kind at most |scale| * 2 * upstream (its
  // softmax's weights sum to 1, plus the positive's -upstream), and as a
  // column of every local row at most that per row. A huge scale (or a sum
  // over many rows in float16) keeps the saturating pass; NaN (a device
  // scale tensor) too.
  bool gradients_within_range(double upstream) const {
    const double per_pair = (std::abs(host_scale_) + std::abs(p_.hardness_strength)) * 2.0 * upstream;
    const double bound = per_pair * static_cast<double>(kinds_.size()) * (p_.rows + 1);
    return bound < largest_finite(dtype_) / 4;  // false for NaN
  }

  MnrTile tile(size_t k, int64_t start, int64_t n) const {
    const MnrRowKind& kind = kinds_[k];
    return MnrTile{n,          kind.columns.size(0), kind.first_len, p_.r,
                   p_.owned_end, p_.offset + start,  kind.kind,      p_.hardness_mode};
  }

  // With chunk_queries_, normalizes the chunk's queries (kind 0's rows).
  void prepare_chunk(int64_t start, int64_t n) {
    if (!chunk_queries_) return;
    static const auto normalize = find_op<NormalizeSignature>("nanfree::normalize");
    // The previous chunk's go before the next are made.
    chunk_rows_ = normalized_[0] = norm_stats_[0] = at::Tensor();
    std::tie(normalized_[0], norm_stats_[0]) =
        normalize.call(queries_.narrow(0, start, n), kMnrNormalizeEps);
    chunk_rows_ = Tiles::operand(normalized_[0]);
  }

  // Kind k's operand rows of the chunk [start, start + n).
  at::Tensor chunk_rows(size_t k, int64_t start, int64_t n) const {
    if (k == 0 && chunk_queries_) return chunk_rows_;
    return kinds_[k].rows.narrow(0, p_.offset + start, n);
  }

  // The normalized rows [start, start + n) of input i and their statistics.
  std::pair<at::Tensor, at::Tensor> normalized_rows(int i, int64_t start, int64_t n) const {
    if (i == 0 && chunk_queries_) return {normalized_[0], norm_stats_[0]};
    return {normalized_[i].narrow(0, start, n), norm_stats_[i].narrow(0, start, n)};
  }

  std::vector<at::Tensor> chunk_scores(int64_t start, int64_t n) {
    std::vector<at::Tensor> cos;
    score_buffers_.resize(kinds_.size());
    for (size_t k = 0; k < kinds_.size(); ++k) {
      cos.push_back(Tiles::scores(chunk_rows(k, start, n), kinds_[k].columns, score_buffers_[k]));
    }
    return cos;
  }

  void start_gradients() {
    step_ = std::clamp<int64_t>(std::max(step_, Tiles::kMinChunkRows), 1, p_.rows);
    // When the queries are rows only (never columns) and every row is local,
    // a chunk's rows get their whole gradient in that chunk: it is finished
    // there (streamed into the output) from the chunk's normalized queries,
    // and no [R, d] float accumulator is held, only chunk-sized temporaries.
    stream_query_grads_ = chunk_queries_;
    const at::TensorOptions acc = scale_.options();
    // The accumulators are not zero-filled: their first write, where it covers
    // them whole, overwrites (accumulate's beta 0; a B = 1024 float32 step
    // spent 0.2 ms in fills).
    if (stream_query_grads_) {
      // A single chunk's finished gradient becomes the output itself.
      if (step_ < p_.rows) query_grad_out_ = at::empty({p_.r, p_.d}, acc.dtype(dtype_));
    } else {
      grads_[0] = at::empty({p_.r, p_.d}, acc);
      unwritten_[0] = true;
    }
    grads_[1] = at::empty({p_.m, p_.d}, acc);
    unwritten_[1] = true;
    scale_grad_rows_ = at::zeros({p_.rows}, acc);
  }

  // Overwrites the chunk's cosines with scale * dlogit and adds the chunk's
  // share of every gradient. `fused_scale_grad` defined: the single row kind's
  // cosines hold scale * dlogit already, with these rows' scale gradients
  // (row_stats_and_grads).
  void chunk_gradients(const std::vector<at::Tensor>& cos, int64_t start, int64_t n,
                       const at::Tensor& upstream, const at::Tensor& fused_scale_grad = {}) {
    const at::Tensor stats = stats_.narrow(0, start, n);
    const at::Tensor up = upstream.narrow(0, start, n);
    // The chunk's rows' gradient when streamed (only the Q rows add to it).
    // Written by the Q rows' one product (beta 0), never read before.
    const at::Tensor query_rows =
        stream_query_grads_ ? at::empty({n, p_.d}, scale_.options()) : at::Tensor();
    for (size_t k = 0; k < kinds_.size(); ++k) {
      const MnrRowKind& kind = kinds_[k];
      at::Tensor scale_grad = fused_scale_grad;
      if (!scale_grad.defined()) {
        scale_grad = at::empty({n}, scale_.options());
        Tiles::row_grads(cos[k], tile(k, start, n), scale_, p_.hardness_strength, stats, up,
                         p_.per_direction, p_.has_p_row(), scale_grad);
      }
      scale_grad_rows_.narrow(0, start, n).add_(scale_grad);
      const at::Tensor rows = chunk_rows(k, start, n);
      // One operand (one half rounding) serves the chunk's three GEMMs.
      const at::Tensor dlogit = Tiles::gradient_operand(cos[k], kind.columns.scalar_type());
      if (kind.row_target == 0 && stream_query_grads_) {
        Tiles::accumulate(query_rows, dlogit, kind.columns, 0.0f);
      } else {
        add_product(kind.row_target, p_.offset + start, n, dlogit, kind.columns);
      }
      const int64_t cols = kind.columns.size(0);
      if (kind.first_len > 0) {
        add_product(kind.first_target, 0, kind.first_len, dlogit.narrow(1, 0, kind.first_len).t(),
                    rows);
      }
      if (cols > kind.first_len) {
        add_product(kind.second_target, 0, cols - kind.first_len,
                    dlogit.narrow(1, kind.first_len, cols - kind.first_len).t(), rows);
      }
    }
    if (stream_query_grads_) {
      if (query_grad_out_.defined()) {
        query_grad_out_.narrow(0, start, n).copy_(finish_gradient(query_rows, 0, start, n));
      } else {  // the only chunk
        query_grad_out_ = finish_gradient(query_rows, 0, start, n);
      }
    }
  }

  // grads_[t] rows [start, start + n) += a @ b. An accumulator's first write
  // overwrites when it covers the accumulator whole; otherwise it is zeroed first.
  void add_product(int t, int64_t start, int64_t n, const at::Tensor& a, const at::Tensor& b) {
    float beta = 1.0f;
    if (unwritten_[t]) {
      unwritten_[t] = false;
      if (start == 0 && n == grads_[t].size(0)) {
        beta = 0.0f;
      } else {
        grads_[t].zero_();
      }
    }
    Tiles::accumulate(grads_[t].narrow(0, start, n), a, b, beta);
  }

  // The docs' blocks normalized into one [M, d] tensor in the docs' order (a
  // [R', k, d] block as its k blocks [:, j] of R' rows) and their statistics
  // [M, 2]: the working copy of the kernels, made from the blocks where they
  // lie (a single [n, d] block is normalized as it is, with no copy).
  std::tuple<at::Tensor, at::Tensor> normalized_docs(at::TensorList docs) const {
    static const auto normalize = find_op<NormalizeSignature>("nanfree::normalize");
    if (docs.size() == 1 && docs[0].dim() == 2) {
      return normalize.call(docs[0].contiguous(), kMnrNormalizeEps);
    }
    at::Tensor out, stats;
    int64_t start = 0;
    for (const at::Tensor& block : docs) {
      const int64_t n = mnr_block_rows(block);
      auto [hat, st] = normalize.call(block.contiguous(), kMnrNormalizeEps);
      if (!out.defined()) {
        out = at::empty({p_.m, p_.d}, hat.options());
        stats = at::empty({p_.m, st.size(-1)}, st.options());
      }
      at::Tensor rows = out.narrow(0, start, n);
      at::Tensor row_stats = stats.narrow(0, start, n);
      if (block.dim() == 3) {  // rows [j * R' + i] = block[i, j]
        const int64_t r = block.size(0), k = block.size(1);
        rows.view({k, r, block.size(2)}).copy_(hat.transpose(0, 1));
        row_stats.view({k, r, st.size(-1)}).copy_(st.reshape({r, k, st.size(-1)}).transpose(0, 1));
      } else {
        rows.copy_(hat);
        row_stats.copy_(st.reshape({n, st.size(-1)}));
      }
      start += n;
    }
    return {out, stats};
  }

  // The gradient of input i (0 queries, 1 docs) for its rows [start, start + n)
  // from their accumulated float gradient g (modified in place): times the
  // upstream factor, saturated at the largest finite value of the inputs'
  // dtype (a true gradient past its range, or a half one, as the cosine
  // family's; NaN stays NaN through clamp), then through the normalization.
  at::Tensor finish_gradient(at::Tensor g, int i, int64_t start, int64_t n) const {
    static const auto normalize_backward =
        find_op<NormalizeBackwardSignature>("nanfree::normalize_backward");
    const double big = largest_finite(dtype_);
    if (upstream_factor_.defined()) g.mul_(upstream_factor_);
    // A pass over the gradient, skipped where it is provably a no-op (saturate_).
    if (saturate_) g.clamp_(-big, big);
    auto [hat, stats] = normalized_rows(i, start, n);
    return normalize_backward.call(g.to(dtype_), hat, stats);
  }

  // finish_gradient of all rows of input i, into one output, in blocks of at
  // most Tiles::kChunkEntries entries: the dtype rounding and
  // normalize_backward's result are block-sized, not a second and third [n, d].
  at::Tensor finish_whole_gradient(at::Tensor g, int i) const {
    const int64_t n = g.size(0);
    const int64_t block = std::max<int64_t>(Tiles::kChunkEntries / std::max<int64_t>(p_.d, 1), 1);
    if (n <= block) return finish_gradient(std::move(g), i, 0, n);
    at::Tensor out = at::empty({n, p_.d}, g.options().dtype(dtype_));
    for (int64_t start = 0; start < n; start += block) {
      const int64_t rows = std::min(block, n - start);
      out.narrow(0, start, rows).copy_(finish_gradient(g.narrow(0, start, rows), i, start, rows));
    }
    return out;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> finish_gradients(bool scale_grad) {
    kinds_.clear();  // the operands (copies for half inputs) are no longer needed
    score_buffers_.clear();
    const double acc_big = largest_finite(acc_);
    at::Tensor out[2];
    for (int i = 0; i < 2; ++i) {
      if (i == 0 && stream_query_grads_) {
        // Finished chunk by chunk (no chunk: no rows).
        out[0] = query_grad_out_.defined() ? std::move(query_grad_out_)
                                           : at::zeros({p_.r, p_.d}, scale_.options().dtype(dtype_));
      } else {
        // Never written (no product reached it): its gradient is 0.
        if (unwritten_[i]) grads_[i].zero_();
        // Moved: in place from here, no second copy is held.
        out[i] = finish_whole_gradient(std::move(grads_[i]), i);
      }
      normalized_[i] = at::Tensor();
      norm_stats_[i] = at::Tensor();
    }
    chunk_rows_ = at::Tensor();
    at::Tensor gs = at::empty({0}, scale_.options());
    if (scale_grad) {
      gs = scale_grad_rows_.sum();
      if (upstream_factor_.defined()) gs = (gs * upstream_factor_).clamp(-acc_big, acc_big);
    }
    return {out[0], out[1], gs};
  }

  MnrProblem p_;
  bool chunk_queries_ = false;  // see the constructor
  at::Tensor queries_;          // the input queries, with chunk_queries_
  at::Tensor normalized_[2];    // queries (the chunk's, with chunk_queries_), docs
  at::Tensor norm_stats_[2];
  at::Tensor chunk_rows_;       // the chunk's query operand, with chunk_queries_
  at::ScalarType dtype_;
  at::ScalarType acc_;
  at::Tensor scale_;
  double host_scale_;  // the scale's value, NaN when only the device has it
  bool saturate_ = true;  // whether finish_gradient saturates (see gradients_within_range)
  std::vector<MnrRowKind> kinds_;
  std::vector<at::Tensor> score_buffers_;  // Tiles::scores' scratch, per row kind
  int64_t step_;
  at::Tensor stats_;
  at::Tensor grads_[2];      // float accumulators (grads_[0] unused when streamed)
  bool unwritten_[2] = {false, false};  // an accumulator not written yet (not zeroed)
  bool stream_query_grads_ = false;  // see start_gradients
  at::Tensor query_grad_out_;  // the queries' gradient, when streamed
  at::Tensor scale_grad_rows_;
  at::Tensor upstream_factor_;  // 2^e of scale_upstream; undefined: 1
};

// The ops' kernels of a device: m.impl("mnr_loss", &mnr_loss_kernel<Tiles>).
// Not a CUDAGuard: with a CPU argument (mixed devices) it would throw before
// the checks can name the argument.
template <class Tiles>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mnr_loss_kernel(
    const at::Tensor& queries, at::TensorList docs, const std::optional<at::Tensor>& scale,
    double scale_value, int64_t offset, int64_t rows, int64_t owned_blocks, int64_t directions,
    bool per_direction, int64_t hardness_mode, double hardness_strength, int64_t reduction,
    bool grad) {
  const c10::OptionalDeviceGuard device_guard(queries.device());
  const MnrProblem problem =
      check_mnr_loss("mnr_loss", queries, docs, scale, scale_value, offset, rows, owned_blocks,
                     directions, per_direction, hardness_mode, hardness_strength, reduction);
  return MnrChunked<Tiles>(problem, queries, docs, scale, scale_value)
      .forward(grad, scale.has_value());
}

template <class Tiles>
std::tuple<at::Tensor, at::Tensor, at::Tensor> mnr_loss_backward_kernel(
    const at::Tensor& grad_loss, const at::Tensor& queries, at::TensorList docs,
    const std::optional<at::Tensor>& scale, double scale_value, const at::Tensor& stats,
    int64_t offset, int64_t rows, int64_t owned_blocks, int64_t directions, bool per_direction,
    int64_t hardness_mode, double hardness_strength, int64_t reduction) {
  const c10::OptionalDeviceGuard device_guard(queries.device());
  const MnrProblem problem = check_mnr_loss_backward(
      grad_loss, queries, docs, scale, scale_value, stats, offset, rows, owned_blocks,
      directions, per_direction, hardness_mode, hardness_strength, reduction);
  return MnrChunked<Tiles>(problem, queries, docs, scale, scale_value)
      .backward(grad_loss, stats, scale.has_value());
}

}  // namespace nanfree
