// ATen-side argument checks of the MNR ops (mnr_loss, mnr_loss_backward of
// csrc/registration.cpp), shared by the CPU and CUDA registrations. The
// Python backends and the fake kernels raise the same errors
// (nanfree/_ops/mnr.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "common/checks.h"
#include "nanfree/mnr_math.h"

namespace nanfree {

// The problem's sizes and options (mnr_math.h).
struct MnrProblem {
  int64_t r;  // queries, every rank's
  int64_t m;  // docs, every rank's
  int64_t d;
  int64_t offset;
  int64_t rows;  // local rows
  int64_t owned_end;
  int directions;
  bool per_direction;
  int hardness_mode;
  double hardness_strength;
  int reduction;

  bool query_to_query() const { return directions & kMnrQueryToQuery; }
  bool doc_to_query() const { return directions & kMnrDocToQuery; }
  bool doc_to_doc() const { return directions & kMnrDocToDoc; }
  bool has_p_row() const { return doc_to_query() || doc_to_doc(); }
};

constexpr int64_t kMnrStats = kMnrStatsPerRow;  // (rel_q, rel_p, t): mnr_math.h

// The rows of one block of the docs: [n, d] holds n, [R', k, d] k * R'.
inline int64_t mnr_block_rows(const at::Tensor& block) {
  return block.dim() == 2 ? block.size(0) : block.size(0) * block.size(1);
}

// The docs' blocks: at least one, each [n, d] or [R', k, d] of the queries'
// dtype, device and width. Returns M, the docs in all.
inline int64_t check_mnr_docs(const char* op, const at::Tensor& queries, at::TensorList docs) {
  TORCH_CHECK_VALUE(!docs.empty(), "nanfree.", op, ": `docs` must hold at least one block");
  int64_t m = 0;
  for (const at::Tensor& block : docs) {
    check_float_input(op, "docs", block);
    check_same_device(op, "docs", queries, block, "queries");
    TORCH_CHECK_VALUE(block.dim() == 2 || block.dim() == 3, "nanfree.", op,
                      ": each block of `docs` must be [n, d] or [R, k, d], got ", block.dim(),
                      " dimensions");
    TORCH_CHECK_TYPE(queries.scalar_type() == block.scalar_type(), "nanfree.", op,
                     ": `queries` is ", queries.scalar_type(), " but `docs` is ",
                     block.scalar_type());
    TORCH_CHECK_VALUE(queries.size(1) == block.size(-1), "nanfree.", op,
                      ": `queries` has rows of ", queries.size(1), " entries but `docs` of ",
                      block.size(-1));
    m += mnr_block_rows(block);
  }
  return m;
}

inline MnrProblem check_mnr_loss(const char* op, const at::Tensor& queries, at::TensorList docs,
                                 const std::optional<at::Tensor>& scale, double scale_value,
                                 int64_t offset, int64_t rows, int64_t owned_blocks,
                                 int64_t directions, bool per_direction, int64_t hardness_mode,
                                 double hardness_strength, int64_t reduction) {
  check_float_input(op, "queries", queries);
  TORCH_CHECK_VALUE(queries.dim() == 2, "nanfree.", op, ": `queries` must be 2-D, got ",
                    queries.dim(), " dimensions");
  const int64_t m = check_mnr_docs(op, queries, docs);
  const int64_t r = queries.size(0);
  if (scale.has_value()) {
    check_float_input(op, "scale", *scale);
    TORCH_CHECK_VALUE(scale->numel() == 1, "nanfree.", op,
                      ": a tensor `scale` must have one element, got shape ", scale->sizes());
    check_same_device(op, "scale", queries, *scale, "queries");
  } else {
    TORCH_CHECK_VALUE(std::isfinite(scale_value) && scale_value > 0, "nanfree.", op,
                      ": `scale` must be positive and finite, got ", scale_value);
  }
  TORCH_CHECK_VALUE(rows >= 1 && offset >= 0 && offset + rows <= r, "nanfree.", op,
                    ": local rows [", offset, ", ", offset + rows, ") are not within the ", r,
                    " queries");
  TORCH_CHECK_VALUE(owned_blocks >= 1 && owned_blocks * r <= m, "nanfree.", op, ": ",
                    owned_blocks, " blocks of ", r, " docs do not fit in the ", m, " docs");
  TORCH_CHECK_VALUE(directions >= 0 && directions < 16 && (directions & kMnrQueryToDoc),
                    "nanfree.", op, ": `directions` ", directions,
                    " must hold query_to_doc (1)");
  TORCH_CHECK_VALUE(!(per_direction && (directions & (kMnrQueryToQuery | kMnrDocToDoc))),
                    "nanfree.", op,
                    ": partition_mode 'per_direction' does not allow query_to_query or "
                    "doc_to_doc");
  TORCH_CHECK_VALUE(hardness_mode >= 0 && hardness_mode <= 3, "nanfree.", op,
                    ": `hardness_mode` ", hardness_mode, " is not 0-3");
  TORCH_CHECK_VALUE(std::isfinite(hardness_strength) && hardness_strength >= 0, "nanfree.", op,
                    ": `hardness_strength` must be finite and >= 0, got ", hardness_strength);
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, "nanfree.", op, ": `reduction` ",
                    reduction, " is not 0-2");
  return MnrProblem{r,
                    m,
                    queries.size(1),
                    offset,
                    rows,
                    owned_blocks * r,
                    static_cast<int>(directions),
                    per_direction,
                    static_cast<int>(hardness_mode),
                    hardness_strength,
                    static_cast<int>(reduction)};
}

inline std::vector<int64_t> mnr_loss_shape(const MnrProblem& problem) {
  if (problem.reduction == kMnrReductionNone) return {problem.rows};
  return {};
}

inline MnrProblem check_mnr_loss_backward(
    const at::Tensor& grad_loss, const at::Tensor& queries, at::TensorList docs,
    const std::optional<at::Tensor>& scale, double scale_value, const at::Tensor& stats,
    int64_t offset, int64_t rows, int64_t owned_blocks, int64_t directions, bool per_direction,
    int64_t hardness_mode, double hardness_strength, int64_t reduction) {
  const char* op = "mnr_loss_backward";
  const MnrProblem problem =
      check_mnr_loss(op, queries, docs, scale, scale_value, offset, rows, owned_blocks,
                     directions, per_direction, hardness_mode, hardness_strength, reduction);
  const at::ScalarType acc = acc_dtype(queries.scalar_type());
  TORCH_CHECK_VALUE(grad_loss.sizes() == at::IntArrayRef(mnr_loss_shape(problem)) &&
                        grad_loss.scalar_type() == acc,
                    "nanfree.", op, ": `grad_loss` must be ", at::IntArrayRef(mnr_loss_shape(problem)),
                    " of ", acc, ", got ", grad_loss.sizes(), " ", grad_loss.scalar_type());
  check_same_device(op, "grad_loss", queries, grad_loss, "queries");
  TORCH_CHECK_VALUE(stats.dim() == 2 && stats.size(0) == rows && stats.size(1) == kMnrStats &&
                        stats.scalar_type() == acc,
                    "nanfree.", op, ": `stats` must be the forward's saved statistics");
  check_same_device(op, "stats", queries, stats, "queries");
  return problem;
}

}  // namespace nanfree
