"""Pure-PyTorch mnr_loss and mnr_loss_backward: the rules of
csrc/include/nanfree/mnr_math.h written with torch ops (the header's names,
the same order of operations), on row chunks so that no [B, M] matrix is
ever held whole. The cores work on normalized rows; nanfree/_ops/mnr.py
wraps them into the ops, which take raw embeddings."""

import torch

from .._ops.mnr import (STATS, MnrProblem, check_mnr_loss, check_mnr_loss_backward,
                        no_gradients, on_raw_embeddings, reduce_loss, scaled_upstream, unscaled,
                        upstream_per_row)
from .numerics import acc_dtype

# Column kinds (mnr_math.h).
PLAIN, PENALIZED, EXCLUDED, POSITIVE = 0, 1, 2, 3
HARDNESS_IN_BATCH, HARDNESS_HARD, HARDNESS_ALL = 1, 2, 3

# Logit entries per chunk (a [chunk, columns] matrix of the accumulation dtype): about
# fifteen temporaries of this size live at once in the composed operations below.
CHUNK_ENTRIES = 1 << 20


def mnr_doc_penalized(mode, g, j, r, owned_end):
    """[rows, 1] g against [1, cols] j: whether doc j gets the hardness term."""
    own = (j < owned_end) & (j % r == g)
    if mode == HARDNESS_IN_BATCH:
        return ~own
    if mode == HARDNESS_HARD:
        return own & (j >= r)
    if mode == HARDNESS_ALL:
        return j != g
    return torch.zeros_like(own)


def mnr_column_kind(row_kind_is_query, g, j, first_len, r, owned_end, hardness_mode):
    if row_kind_is_query:
        doc_kind = torch.where(mnr_doc_penalized(hardness_mode, g, j, r, owned_end),
                               PENALIZED, PLAIN)
        doc_kind = torch.where(j == g, POSITIVE, doc_kind)
        # query_to_query: a query is not its own negative.
        return torch.where(j < first_len, doc_kind,
                           torch.where(j - first_len == g, EXCLUDED, PLAIN))
    doc = j - first_len
    # doc_to_doc: the docs of the positive's own query are not its negatives.
    own = (j >= first_len) & (doc < owned_end) & (doc % r == g)
    return torch.where(own, EXCLUDED, PLAIN)


def mnr_logit(cos, kind, scale, hardness_strength):
    logit = scale * cos
    logit = torch.where(kind == PENALIZED, logit + hardness_strength * cos, logit)
    # An excluded pair takes no part in its row's logsumexp (exp(-inf) = 0).
    return torch.where(kind == EXCLUDED, float("-inf"), logit)


def lse_scale(a, b):
    # exp(a - b) for a <= b; equal arguments (two infinities) give exactly 1.
    return torch.where(a == b, 1.0, torch.exp(a - b))


def mnr_log_partition(lse_q, lse_p, per_direction, has_p_row):
    if per_direction:
        return (lse_q + lse_p) / 2 if has_p_row else lse_q
    m = torch.maximum(lse_q, lse_p)
    # logaddexp; lse_scale keeps two equal (or two infinite) values at exp(0).
    return m + torch.log(lse_scale(lse_q, m) + lse_scale(lse_p, m))


def mnr_logit_grad(logit, kind, normalizer, weight, upstream):
    p = weight * lse_scale(logit, normalizer)
    p = torch.where(kind == POSITIVE, p - upstream, p)
    # An excluded pair has no gradient (exp(-inf - -inf) would be NaN).
    return torch.where(kind == EXCLUDED, 0.0, p)


def mnr_target_logit(positive_cos, scale):
    return scale * positive_cos


def mnr_relative_lse(max_, sum_, target):
    # (max - t) + log(sum); the empty state (-inf, 0) gives -inf.
    return (max_ - target) + torch.log(sum_)


def mnr_row_loss(rel_q, rel_p, per_direction, has_p_row):
    return mnr_log_partition(rel_q, rel_p, per_direction, has_p_row)


def mnr_row_normalizer(rel_q, rel_p, target, query_row, per_direction, has_p_row):
    if per_direction:
        return target + (rel_q if query_row else rel_p)
    return target + mnr_log_partition(rel_q, rel_p, per_direction, has_p_row)


def _row_relative_lse(logits, target):
    m = logits.amax(dim=1, keepdim=True)
    # An all -inf row (every pair excluded) is the empty set: -inf, not NaN.
    m = torch.where(m == float("-inf"), 0.0, m)
    # A NaN logit (a NaN embedding) keeps its row NaN: amax propagates it.
    total = lse_scale(logits, m).sum(dim=1, keepdim=True)
    return mnr_relative_lse(m, total, target[:, None]).squeeze(1)


class _Columns:
    """The columns of one row kind: the embeddings, as one acc-dtype matrix."""

    def __init__(self, problem, row_kind_is_query, queries, docs):
        self.is_query = row_kind_is_query
        parts = []
        if row_kind_is_query:
            parts.append(docs)
            if problem.query_to_query:
                parts.append(queries)
            self.first_len = docs.shape[0]
        else:
            if problem.doc_to_query:
                parts.append(queries)
            if problem.doc_to_doc:
                parts.append(docs)
            self.first_len = queries.shape[0] if problem.doc_to_query else 0
        self.parts = parts
        self.matrix = torch.cat(parts) if len(parts) > 1 else parts[0]

    def kinds(self, problem, g):
        j = torch.arange(self.matrix.shape[0], device=g.device)[None, :]
        first = self.first_len
        return mnr_column_kind(self.is_query, g[:, None], j, first, problem.r,
                               problem.owned_end, problem.hardness_mode)

    def split(self, grad):
        """The column gradient [columns, d] as (grad of queries, grad of docs)."""
        sizes = [p.shape[0] for p in self.parts]
        pieces = list(torch.split(grad, sizes))
        if self.is_query:
            return (pieces[1] if len(pieces) > 1 else None), pieces[0]
        q = pieces.pop(0) if self.parts and self.first_len else None
        return q, (pieces[0] if pieces else None)


def _scale(problem, scale, scale_value, acc, device):
    if scale is None:
        return torch.tensor(scale_value, dtype=acc, device=device)
    return scale.reshape(()).to(acc)


def _row_chunks(problem, columns):
    width = sum(c.matrix.shape[0] for c in columns)
    step = max(1, min(problem.rows, CHUNK_ENTRIES // max(width, 1)))
    return range(0, problem.rows, step), step


def _chunk_logits(problem, sets, g, scale, hs):
    """(cos, kind, logit) of rows g (global) for each row kind."""
    out = []
    for rows, cols in sets:
        cos = rows[g] @ cols.matrix.T
        kind = cols.kinds(problem, g)
        out.append((cos, kind, mnr_logit(cos, kind, scale, hs)))
    return out


def _sets(problem, queries, docs, acc):
    q = queries.to(acc)
    d = docs.to(acc)
    sets = [(q, _Columns(problem, True, q, d))]
    if problem.has_p_row:
        sets.append((d, _Columns(problem, False, q, d)))
    return q, d, sets


def _gradients(problem, queries, docs, scale_t, want_scale, stats, upstream):
    """d loss / d (normalized queries, normalized docs, scale), in the
    accumulation dtype, for per-row upstream gradients."""
    acc = stats.dtype
    upstream, factor = scaled_upstream(upstream, acc)
    q, d, sets = _sets(problem, queries, docs, acc)
    hs = problem.hardness_strength
    grad_q = torch.zeros_like(q)
    grad_d = torch.zeros_like(d)
    grad_s = torch.zeros((), dtype=acc, device=q.device)
    chunks, step = _row_chunks(problem, [c for _, c in sets])
    weight_factor = 0.5 if problem.per_direction and problem.has_p_row else 1.0
    for start in chunks:
        local = torch.arange(start, min(start + step, problem.rows), device=q.device)
        g = local + problem.offset
        rel_q, rel_p, target = stats[local, 0], stats[local, 1], stats[local, 2]
        up = upstream[local]
        weight = up * weight_factor
        for (rows, cols), (cos, kind, logit), query_row in zip(
                sets, _chunk_logits(problem, sets, g, scale_t, hs), (True, False)):
            normalizer = mnr_row_normalizer(rel_q, rel_p, target, query_row,
                                            problem.per_direction, problem.has_p_row)
            dlogit = mnr_logit_grad(logit, kind, normalizer[:, None], weight[:, None],
                                    up[:, None])
            grad_s = grad_s + (dlogit * cos).sum()
            ds = scale_t * dlogit
            grad_rows = ds @ cols.matrix
            (grad_q if cols.is_query else grad_d).index_add_(0, g, grad_rows)
            cq, cd = cols.split(ds.T @ rows[g])
            if cq is not None:
                grad_q += cq
            if cd is not None:
                grad_d += cd
    grad_s = unscaled(grad_s, factor) if want_scale else grad_q.new_empty((0,))
    return unscaled(grad_q, factor), unscaled(grad_d, factor), grad_s


def _mnr_loss_normalized(queries, docs, scale, scale_value, offset, rows, owned_blocks,
                         directions, per_direction, hardness_mode, hardness_strength, reduction,
                         grad):
    # `docs`: the normalized docs, one [M, d] tensor (_ops/mnr.py's on_raw_embeddings).
    problem = check_mnr_loss(queries, [docs], scale, scale_value, offset, rows, owned_blocks,
                             directions, per_direction, hardness_mode, hardness_strength,
                             reduction)
    acc = acc_dtype(queries.dtype)
    scale_t = _scale(problem, scale, scale_value, acc, queries.device)
    q, d, sets = _sets(problem, queries, docs, acc)
    stats = torch.full((rows, STATS), float("-inf"), dtype=acc, device=queries.device)
    loss_rows = torch.empty((rows,), dtype=acc, device=queries.device)
    chunks, step = _row_chunks(problem, [c for _, c in sets])
    for start in chunks:
        local = torch.arange(start, min(start + step, rows), device=q.device)
        g = local + offset
        results = _chunk_logits(problem, sets, g, scale_t, problem.hardness_strength)
        # The Q rows' positive is doc g, column g: its logit is the target logit.
        target = mnr_target_logit(results[0][0].gather(1, g[:, None]).squeeze(1), scale_t)
        for k, (_, _, logit) in enumerate(results):
            stats[local, k] = _row_relative_lse(logit, target)
        stats[local, STATS - 1] = target
        loss_rows[local] = mnr_row_loss(stats[local, 0], stats[local, 1], per_direction,
                                        problem.has_p_row)
    loss = reduce_loss(problem, loss_rows)
    if not grad:
        return (loss, stats, *no_gradients(queries, acc))
    upstream = upstream_per_row(problem, torch.ones_like(loss))
    gq, gd, gs = _gradients(problem, queries, docs, scale_t, scale is not None, stats,
                            upstream)
    return loss, stats, gq, gd, gs


def _mnr_loss_backward_normalized(grad_loss, queries, docs, scale, scale_value, stats, offset,
                                  rows, owned_blocks, directions, per_direction, hardness_mode,
                                  hardness_strength, reduction):
    problem = check_mnr_loss_backward(grad_loss, queries, [docs], scale, scale_value, stats,
                                      offset, rows, owned_blocks, directions, per_direction,
                                      hardness_mode, hardness_strength, reduction)
    acc = stats.dtype
    scale_t = _scale(problem, scale, scale_value, acc, queries.device)
    upstream = upstream_per_row(problem, grad_loss.to(acc))
    return _gradients(problem, queries, docs, scale_t, scale is not None, stats, upstream)


mnr_loss, mnr_loss_backward = on_raw_embeddings(
    _mnr_loss_normalized, _mnr_loss_backward_normalized, check_mnr_loss, check_mnr_loss_backward)

__all__ = ["mnr_loss", "mnr_loss_backward", "MnrProblem"]
