// Multiple negatives ranking (InfoNCE) loss: the rules of DESIGN.md section 2
// (mnr_loss), shared by the CPU and CUDA kernels and mirrored by name in
// nanfree/_triton/mnr.py and nanfree/_torch_backend/mnr.py.
//
// The problem the kernels see (nanfree.ops.mnr_loss builds it):
// - `queries` [R, d] and `docs` [M, d] (the op's blocks in order, normalized into
//   one working copy by the ops, kMnrNormalizeEps), R = world
//   rows (W ranks of B rows each; W = 1 without gathering). The docs are the
//   owned blocks first, `owned_blocks` blocks of R rows (block 0 the
//   positives, block b >= 1 hard negative b - 1): doc j < owned_blocks * R
//   belongs to query j % R. Docs from owned_blocks * R on are shared
//   candidates, owned by no query (they act as another query's documents).
// - This rank scores its local rows g in [offset, offset + B). Each has two
//   rows of logits, each with one logsumexp state:
//   * its query row (kind Q): the docs (query_to_doc), then, with
//     query_to_query, every query;
//   * its positive's row (kind P): with doc_to_query every query, then, with
//     doc_to_doc, every doc.
// - logit = scale * cos, plus hardness_strength * cos (no gradient through
//   it) on the query_to_doc negatives the hardness mode selects; an excluded
//   pair (a query with itself, a positive with its own query's docs) is -inf.
// - loss_g = log_z - t with t = scale * cos(q_g, doc_g) (the target logit),
//   log_z the logsumexp of both rows (joint) or the mean of the two rows'
//   (per_direction, which only allows query_to_doc and doc_to_query, so each
//   row is one direction). Each row's logsumexp is kept relative to t,
//   (max - t) + log(sum) of its (max, sum) state, and the loss is formed from
//   those: a loss near 0 (the positive far above every negative) is then
//   log(1 + tiny), not the difference of two numbers near t (log_z - t lost
//   the digits below t's last bit: 1e-6 instead of 1e-11 at scale 100). The
//   saved statistics of a row are (rel_q, rel_p, t): kMnrStatsPerRow values.
// - d loss_g / d logit = weight * exp(logit - normalizer), minus 1 at the
//   positive; normalizer = log_z (joint) or the row's own logsumexp
//   (per_direction), weight = 1 (joint) or 1 / directions (per_direction).
// - The upstream gradients are first divided by a power of two 2^e that
//   brings the largest finite one to at most 2 (so no logit gradient times
//   the scale overflows), and the gradients multiplied by 2^e at the end,
//   saturating at the largest finite value of the gradient's dtype (a true
//   gradient past the range): mnr_driver.h and nanfree/_ops/mnr.py.
#pragma once

#include "nanfree/numerics.h"

namespace nanfree {

// The rows are normalized as cos_sim normalizes them: x / max(|x|, 1e-12)
// (F.normalize's default eps; cosine_math.h).
constexpr double kMnrNormalizeEps = 1e-12;

// Bits of the `directions` argument; query_to_doc is always on.
constexpr int kMnrQueryToDoc = 1;
constexpr int kMnrQueryToQuery = 2;
constexpr int kMnrDocToQuery = 4;
constexpr int kMnrDocToDoc = 8;

// hardness_mode
constexpr int kMnrHardnessNone = 0;
constexpr int kMnrHardnessInBatch = 1;  // other queries' docs (and shared docs)
constexpr int kMnrHardnessHard = 2;     // the query's own hard negatives
constexpr int kMnrHardnessAll = 3;      // every doc but the positive

// reduction
constexpr int kMnrReductionNone = 0;
constexpr int kMnrReductionMean = 1;
constexpr int kMnrReductionSum = 2;

// Row kinds and the column segments of each row: a Q row's columns are the
// docs then (query_to_query) the queries; a P row's the queries
// (doc_to_query) then (doc_to_doc) the docs.
constexpr int kMnrRowQuery = 0;
constexpr int kMnrRowPositive = 1;

// What a column is to a row.
constexpr int kMnrColumnPlain = 0;      // logit = scale * cos
constexpr int kMnrColumnPenalized = 1;  // logit = (scale + hardness) * cos
constexpr int kMnrColumnExcluded = 2;   // logit = -inf
constexpr int kMnrColumnPositive = 3;   // logit = scale * cos, the target

// Whether doc j of the query_to_doc row of query g gets the hardness term.
// r = rows per block (R), owned_end = owned_blocks * R.
NF_HOST_DEVICE bool mnr_doc_penalized(int mode, int64_t g, int64_t j, int64_t r,
                                      int64_t owned_end) {
  const bool own = j < owned_end && j % r == g;
  switch (mode) {
    case kMnrHardnessInBatch:
      return !own;
    case kMnrHardnessHard:
      return own && j >= r;
    case kMnrHardnessAll:
      return j != g;
    default:
      return false;
  }
}

// What column j of a row's concatenated columns is to local row g.
// `docs_first`: the row's first segment is the docs (Q rows) or the queries
// (P rows); `first_len` the first segment's length (M or R).
NF_HOST_DEVICE int mnr_column_kind(int row_kind, int64_t g, int64_t j, int64_t first_len,
                                   int64_t r, int64_t owned_end, int hardness_mode) {
  if (row_kind == kMnrRowQuery) {
    if (j < first_len) {  // query_to_doc
      if (j == g) return kMnrColumnPositive;
      return mnr_doc_penalized(hardness_mode, g, j, r, owned_end) ? kMnrColumnPenalized
                                                                   : kMnrColumnPlain;
    }
    // query_to_query: a query is not its own negative.
    return j - first_len == g ? kMnrColumnExcluded : kMnrColumnPlain;
  }
  if (j < first_len) return kMnrColumnPlain;  // doc_to_query
  // doc_to_doc: the docs of the positive's own query are not its negatives.
  const int64_t doc = j - first_len;
  return doc < owned_end && doc % r == g ? kMnrColumnExcluded : kMnrColumnPlain;
}

// The logit of a pair of cosine `cos` (an accumulation-type value).
template <typename T>
NF_HOST_DEVICE T mnr_logit(T cos, int column_kind, T scale, T hardness_strength) {
  // An excluded pair takes no part in its row's logsumexp (exp(-inf) = 0).
  if (column_kind == kMnrColumnExcluded) return -nf_inf<T>();
  const T logit = scale * cos;
  return column_kind == kMnrColumnPenalized ? logit + hardness_strength * cos : logit;
}

// Values of a row's saved statistics: rel_q, rel_p (its Q and P rows'
// logsumexps relative to t; rel_p -inf without a P row) and t.
constexpr int kMnrStatsPerRow = 3;

// a * b rounded once and never contracted into a following add or subtract
// (nvcc contracts by default, host compilers may too): t must be the very
// number the row's maximum holds when the positive is its largest logit, so
// that max - t is exactly 0 there. Used once per row, off the hot loops.
template <typename T>
NF_HOST_DEVICE T mnr_rounded_product(T a, T b) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(T) == sizeof(float)) {
    return __fmul_rn(a, b);
  } else {
    return __dmul_rn(a, b);
  }
#else
  const volatile T product = a * b;
  return product;
#endif
}

// The target logit t of a row from its positive's cosine: mnr_logit of a
// kMnrColumnPositive pair, rounded as the tile kernels round it.
template <typename T>
NF_HOST_DEVICE T mnr_target_logit(T positive_cos, T scale) {
  return mnr_rounded_product(scale, positive_cos);
}

// A row's logsumexp relative to t from its (max, sum) state: (max - t) +
// log(sum). The empty state gives -inf (-inf - t + log 0); NaN stays NaN.
template <typename T>
NF_HOST_DEVICE T mnr_relative_lse(T max, T sum, T target) {
  return (max - target) + nf_log(sum);
}

// log_z of a local row from its two rows' logsumexps (absolute, or both
// relative to t: then it is log_z - t). `lse_p` is -inf when
// the row has no P directions (joint) and is ignored then (per_direction).
template <typename T>
NF_HOST_DEVICE T mnr_log_partition(T lse_q, T lse_p, bool per_direction, bool has_p_row) {
  if (per_direction) return has_p_row ? (lse_q + lse_p) / T(2) : lse_q;
  const T m = lse_q > lse_p ? lse_q : lse_p;
  // logaddexp; lse_scale keeps two equal (or two infinite) values at exp(0).
  return m + nf_log(lse_scale(lse_q, m) + lse_scale(lse_p, m));
}

// The normalizer of a row's softmax in the gradient (see the header comment).
template <typename T>
NF_HOST_DEVICE T mnr_normalizer(T log_z, T row_lse, bool per_direction) {
  return per_direction ? row_lse : log_z;
}

// Weight of a row's softmax in d loss / d logit, before the upstream gradient.
template <typename T>
NF_HOST_DEVICE T mnr_direction_weight(bool per_direction, bool has_p_row) {
  return per_direction && has_p_row ? T(0.5) : T(1);
}

// d loss / d logit of one pair: `weight` is the row's upstream gradient times
// its direction weight, `upstream` the row's upstream gradient alone (the
// positive's -1 is not split between directions).
template <typename T>
NF_HOST_DEVICE T mnr_logit_grad(T logit, int column_kind, T normalizer, T weight, T upstream) {
  // An excluded pair has no gradient; exp(-inf - normalizer) would be NaN for
  // a row whose every pair is excluded (normalizer -inf).
  if (column_kind == kMnrColumnExcluded) return T(0);
  const T p = weight * lse_scale(logit, normalizer);
  return column_kind == kMnrColumnPositive ? p - upstream : p;
}

// One chunk of rows of one row kind, as a [rows, cols] tile of cosines: the
// rows are the local rows g0 .. g0 + rows - 1, the columns the row kind's
// concatenated segments (the first `first_len` long).
struct MnrTile {
  int64_t rows;
  int64_t cols;
  int64_t first_len;
  int64_t r;
  int64_t owned_end;
  int64_t g0;
  int row_kind;
  int hardness_mode;
};

// The kind of every column of a row that is not one of the row's own
// columns (in the docs: j % r == g below owned_end; in the queries: j == g).
// mnr_column_kind gives the same for those columns; kernels that sweep a row
// fast use this and then visit the own columns (mnr_own_column) one by one.
NF_HOST_DEVICE int mnr_default_kind(int row_kind, bool docs_segment, int hardness_mode) {
  if (row_kind == kMnrRowQuery && docs_segment &&
      (hardness_mode == kMnrHardnessInBatch || hardness_mode == kMnrHardnessAll)) {
    return kMnrColumnPenalized;
  }
  return kMnrColumnPlain;
}

// Whether segment 0 (the first) of a row kind's columns holds the docs.
NF_HOST_DEVICE bool mnr_first_segment_is_docs(int row_kind) { return row_kind == kMnrRowQuery; }

// Where a tile's docs and queries segments lie among its columns (a
// segment the row kind does not have is empty).
struct MnrSegments {
  int64_t docs_start;
  int64_t docs_len;
  int64_t queries_start;
  int64_t queries_len;
};

NF_HOST_DEVICE MnrSegments mnr_segments(const MnrTile& tile) {
  const bool docs_first = mnr_first_segment_is_docs(tile.row_kind);
  const int64_t second_len = tile.cols - tile.first_len;
  return MnrSegments{docs_first ? 0 : tile.first_len, docs_first ? tile.first_len : second_len,
                     docs_first ? tile.first_len : 0, docs_first ? second_len : tile.first_len};
}

// The own columns of local row g in a tile: in the docs segment
// j = g + b * r for b < owned_end / r, in the queries segment j = g. Returns
// how many (at most owned_end / r + 1) and writes their column indices in
// the tile (with the segment offsets applied) to `out`, nothing past `max_out`.
NF_HOST_DEVICE int mnr_own_columns(const MnrTile& tile, int64_t g, int64_t* out, int max_out) {
  int count = 0;
  const MnrSegments seg = mnr_segments(tile);
  for (int64_t j = g; j < tile.owned_end && j < seg.docs_len && count < max_out; j += tile.r) {
    out[count++] = seg.docs_start + j;
  }
  if (g < seg.queries_len && count < max_out) out[count++] = seg.queries_start + g;
  return count;
}

// The per-row loss log_z - t, from the row's relative logsumexps.
template <typename T>
NF_HOST_DEVICE T mnr_row_loss(T rel_q, T rel_p, bool per_direction, bool has_p_row) {
  return mnr_log_partition(rel_q, rel_p, per_direction, has_p_row);
}

// The normalizer of a row kind's softmax in the gradient (mnr_normalizer),
// absolute, from the row's saved statistics (rel_q, rel_p, t).
template <typename T>
NF_HOST_DEVICE T mnr_row_normalizer(T rel_q, T rel_p, T target, bool query_row,
                                    bool per_direction, bool has_p_row) {
  const T rel_z = mnr_log_partition(rel_q, rel_p, per_direction, has_p_row);
  return target + mnr_normalizer(rel_z, query_row ? rel_q : rel_p, per_direction);
}

}  // namespace nanfree
