"""The MNR family's Python side (mnr_loss, mnr_loss_backward): the op-level
argument checks of the Python backends (Triton, pure PyTorch) and the fake
kernels, with the same errors, words and exception types as
csrc/common/mnr_op.h (the layout and rules are those of
csrc/include/nanfree/mnr_math.h); the fake kernels, registered once for every
backend; the normalization around the Python backends' cores; and
nanfree.ops' conversion of sentence-transformers' options into the op's. The
schemas are in csrc/registration.cpp; the autograd in
csrc/mnr.cpp; the autocast in csrc/autocast.cpp.

mnr_loss called with `grad=True` and a reduced loss (nanfree.ops.mnr_loss does
so when the loss is reduced to a scalar and a gradient is wanted) has already
computed the gradients for an upstream gradient of 1 in the same pass as the
loss (no logit is recomputed); the backward scales them by the incoming
gradient. Otherwise (reduction 'none', or called without `grad`) the backward
calls mnr_loss_backward, which recomputes the logits tile by tile from the
saved logsumexps. Double backward is refused."""

import math
from dataclasses import dataclass

import torch

from .common import (acc_dtype, as_float, check_device, check_float, check_number, check_tensors,
                     fake_kernels, is_bool, is_symbolic)

FORWARD_OPS = ("mnr_loss",)
BACKWARD_OPS = ("mnr_loss_backward",)
OPS = FORWARD_OPS + BACKWARD_OPS

QUERY_TO_DOC, QUERY_TO_QUERY, DOC_TO_QUERY, DOC_TO_DOC = 1, 2, 4, 8
# Per local row: its query row's and positive's row's logsumexps relative to
# its target logit t, and t (mnr_math.h's kMnrStatsPerRow).
STATS = 3
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


@dataclass(frozen=True)
class MnrProblem:
    r: int  # queries (all ranks)
    m: int  # docs (all ranks)
    d: int
    offset: int
    rows: int  # local rows
    owned_end: int
    query_to_query: bool
    doc_to_query: bool
    doc_to_doc: bool
    per_direction: bool
    hardness_mode: int
    hardness_strength: float
    reduction: int

    @property
    def has_p_row(self):
        return self.doc_to_query or self.doc_to_doc


def block_rows(shape):
    """The docs a block of this shape holds: [n, d] n, [R', k, d] k * R'
    (mnr_op.h's mnr_block_rows)."""
    return shape[0] if len(shape) == 2 else shape[0] * shape[1]


def _check_embeddings(op, queries, docs):
    """Checks `queries` and the docs' blocks; returns M, the docs in all."""
    check_float(op, "queries", queries)
    if queries.dim() != 2:
        raise ValueError(f"nanfree.{op}: `queries` must be 2-D, got {queries.dim()} dimensions")
    if not isinstance(docs, (list, tuple)) or not docs:
        raise ValueError(f"nanfree.{op}: `docs` must hold at least one block")
    m = 0
    for block in docs:
        check_float(op, "docs", block)
        check_device(op, "docs", queries, block, "queries")
        if block.dim() not in (2, 3):
            raise ValueError(f"nanfree.{op}: each block of `docs` must be [n, d] or [R, k, d], "
                             f"got {block.dim()} dimensions")
        if queries.dtype != block.dtype:
            raise TypeError(f"nanfree.{op}: `queries` is {queries.dtype} but `docs` is "
                            f"{block.dtype}")
        if queries.shape[1] != block.shape[-1]:
            raise ValueError(f"nanfree.{op}: `queries` has rows of {queries.shape[1]} entries "
                             f"but `docs` of {block.shape[-1]}")
        m += block_rows(block.shape)
    return m


def check_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks, directions,
                   per_direction, hardness_mode, hardness_strength, reduction,
                   op="mnr_loss"):
    m = _check_embeddings(op, queries, docs)
    r = queries.shape[0]
    if scale is not None:
        check_float(op, "scale", scale)
        if scale.numel() != 1:
            raise ValueError(f"nanfree.{op}: a tensor `scale` must have one element, got shape "
                             f"{list(scale.shape)}")
        check_device(op, "scale", queries, scale, "queries")
    elif not is_symbolic(scale_value) and not (math.isfinite(scale_value) and scale_value > 0):
        raise ValueError(f"nanfree.{op}: `scale` must be positive and finite, got {scale_value}")
    if not (rows >= 1 and offset >= 0 and offset + rows <= r):
        raise ValueError(f"nanfree.{op}: local rows [{offset}, {offset + rows}) are not within "
                         f"the {r} queries")
    if not (owned_blocks >= 1 and owned_blocks * r <= m):
        raise ValueError(f"nanfree.{op}: {owned_blocks} blocks of {r} docs do not fit in the "
                         f"{m} docs")
    if not (0 <= directions < 16 and directions & QUERY_TO_DOC):
        raise ValueError(f"nanfree.{op}: `directions` {directions} must hold query_to_doc (1)")
    if per_direction and directions & (QUERY_TO_QUERY | DOC_TO_DOC):
        raise ValueError(f"nanfree.{op}: partition_mode 'per_direction' does not allow "
                         "query_to_query or doc_to_doc")
    if hardness_mode not in (0, 1, 2, 3):
        raise ValueError(f"nanfree.{op}: `hardness_mode` {hardness_mode} is not 0-3")
    if not is_symbolic(hardness_strength) and not (math.isfinite(hardness_strength)
                                                   and hardness_strength >= 0):
        raise ValueError(f"nanfree.{op}: `hardness_strength` must be finite and >= 0, got "
                         f"{hardness_strength}")
    if reduction not in (REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM):
        raise ValueError(f"nanfree.{op}: `reduction` {reduction} is not 0-2")
    return MnrProblem(r=r, m=m, d=queries.shape[1], offset=offset, rows=rows,
                      owned_end=owned_blocks * r,
                      query_to_query=bool(directions & QUERY_TO_QUERY),
                      doc_to_query=bool(directions & DOC_TO_QUERY),
                      doc_to_doc=bool(directions & DOC_TO_DOC),
                      per_direction=bool(per_direction), hardness_mode=hardness_mode,
                      hardness_strength=as_float(hardness_strength), reduction=reduction)


def loss_shape(problem):
    return (problem.rows,) if problem.reduction == REDUCTION_NONE else ()


def check_mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset, rows,
                            owned_blocks, directions, per_direction, hardness_mode,
                            hardness_strength, reduction):
    op = "mnr_loss_backward"
    problem = check_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks,
                             directions, per_direction, hardness_mode, hardness_strength,
                             reduction, op=op)
    acc = acc_dtype(queries.dtype)
    if tuple(grad_loss.shape) != loss_shape(problem) or grad_loss.dtype != acc:
        raise ValueError(f"nanfree.{op}: `grad_loss` must be {list(loss_shape(problem))} of "
                         f"{acc}, got {list(grad_loss.shape)} {grad_loss.dtype}")
    check_device(op, "grad_loss", queries, grad_loss, "queries")
    if tuple(stats.shape) != (rows, STATS) or stats.dtype != acc:
        raise ValueError(f"nanfree.{op}: `stats` must be the forward's saved statistics")
    check_device(op, "stats", queries, stats, "queries")
    return problem


def reduce_loss(problem, loss_rows):
    """The loss of the problem's reduction from the local rows' losses [rows]."""
    if problem.reduction == REDUCTION_MEAN:
        return loss_rows.sum() / problem.rows
    if problem.reduction == REDUCTION_SUM:
        return loss_rows.sum()
    return loss_rows


def no_gradients(queries, acc):
    """mnr_loss's gradient outputs without `grad`: three distinct empty tensors
    (outputs of an op may not alias)."""
    return queries.new_empty((0,)), queries.new_empty((0,)), queries.new_empty((0,), dtype=acc)


def upstream_per_row(problem, grad_loss):
    """Each local row's upstream gradient [rows] from the loss's gradient."""
    if problem.reduction == REDUCTION_MEAN:
        return (grad_loss / problem.rows).expand(problem.rows)
    if problem.reduction == REDUCTION_SUM:
        return grad_loss.expand(problem.rows)
    return grad_loss


# (integer type of the same width, exponent bias, mantissa bits) of acc.
_FLOAT_BITS = {torch.float32: (torch.int32, 127, 23), torch.float64: (torch.int64, 1023, 52)}


def scaled_upstream(upstream, acc):
    """(upstream / 2^e, 2^e as a 0-d tensor): 2^e from the largest finite
    |upstream| (at most 2 after the division), a normal power of two of acc
    whose inverse is normal too; computed on the device (no host sync). The
    gradients are computed for the scaled upstream (no logit gradient, times
    the scale, can overflow) and multiplied by 2^e at the end, saturating at
    acc's largest finite value (mnr_math.h)."""
    # A non-finite upstream gradient (NaN stays NaN in its rows) does not set the scale.
    finite = torch.where(torch.isfinite(upstream), upstream.abs(), 0.0)
    exponent = torch.frexp(finite.amax()).exponent.to(torch.int64)
    bits, bias, mantissa = _FLOAT_BITS[acc]
    exponent = exponent.clamp(2 - bias, bias)
    # 2^e built from its bits: exact (torch.ldexp goes through a float32 pow).
    factor = ((exponent + bias) << mantissa).to(bits).view(acc)
    return (upstream / factor).contiguous(), factor


def unscaled(grad, factor, dtype=None):
    """grad * factor (2^e of scaled_upstream, or an upstream gradient) in
    `dtype` (default grad's), saturated at that dtype's largest finite value (a
    true gradient past its range); NaN stays NaN through clamp."""
    dtype = grad.dtype if dtype is None else dtype
    big = torch.finfo(dtype).max
    wide = torch.promote_types(grad.dtype, dtype)  # holds both grad and the bound
    # Clamped in place: the product is a fresh tensor, and no second copy is held.
    return (grad.to(wide) * factor).clamp_(-big, big).to(dtype)


# --- the normalization around the Python backends' cores ---------------------------

MNR_NORMALIZE_EPS = 1e-12  # kMnrNormalizeEps of mnr_math.h


def _normalize(t):
    return torch.ops.nanfree.normalize(t.contiguous(), MNR_NORMALIZE_EPS)


def _normalize_docs(docs):
    """The docs' blocks normalized into one [M, d] tensor in the docs' order
    (a [R', k, d] block as its k blocks [:, j]) and their statistics [M, 2]:
    MnrChunked::normalized_docs of csrc/common/mnr_driver.h."""
    if len(docs) == 1 and docs[0].dim() == 2:
        return _normalize(docs[0])
    hats, stats = [], []
    for block in docs:
        hat, st = _normalize(block)
        if block.dim() == 3:  # rows [j * R' + i] = block[i, j]
            hat, st = hat.transpose(0, 1), st.transpose(0, 1)
        n = block_rows(block.shape)
        hats.append(hat.reshape(n, hat.shape[-1]))
        stats.append(st.reshape(n, st.shape[-1]))
    return torch.cat(hats), torch.cat(stats)


def _raw_grad(grad, normalized, stats):
    dtype = normalized.dtype
    if dtype in (torch.float16, torch.bfloat16):
        # Half gradients saturate at the type's largest finite value (as the
        # cosine family's); NaN stays NaN through clamp.
        grad = grad.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return torch.ops.nanfree.normalize_backward(grad.to(dtype).contiguous(), normalized, stats)


def on_raw_embeddings(core_forward, core_backward, check_forward, check_backward):
    """(mnr_loss, mnr_loss_backward) op functions over a backend's cores:
    core_forward(queries_hat, docs_hat, scale, scale_value, ..., grad) (docs_hat: the
    normalized docs, one [M, d] tensor, _normalize_docs) and
    core_backward(grad_loss, queries_hat, docs_hat, ...), with the ops'
    signatures (csrc/registration.cpp)."""

    def mnr_loss(queries, docs, scale, scale_value, *config):
        check_forward(queries, docs, scale, scale_value, *config[:-1])
        (q_hat, q_stats), (d_hat, d_stats) = _normalize(queries), _normalize_docs(docs)
        loss, stats, gq, gd, gs = core_forward(q_hat, d_hat, scale, scale_value, *config)
        if config[-1]:  # grad
            gq, gd = _raw_grad(gq, q_hat, q_stats), _raw_grad(gd, d_hat, d_stats)
        return loss, stats, gq, gd, gs

    def mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, *config):
        check_backward(grad_loss, queries, docs, scale, scale_value, stats, *config)
        (q_hat, q_stats), (d_hat, d_stats) = _normalize(queries), _normalize_docs(docs)
        gq, gd, gs = core_backward(grad_loss, q_hat, d_hat, scale, scale_value, stats, *config)
        return _raw_grad(gq, q_hat, q_stats), _raw_grad(gd, d_hat, d_stats), gs

    return mnr_loss, mnr_loss_backward


# --- fake kernels -------------------------------------------------------


def _fake_grads(queries, problem, scale, acc, grad):
    if not grad:
        return no_gradients(queries, acc)
    grad_scale = queries.new_empty((), dtype=acc) if scale is not None else \
        queries.new_empty((0,), dtype=acc)
    return queries.new_empty(queries.shape), queries.new_empty((problem.m, problem.d)), grad_scale


def _fake_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks, directions,
                   per_direction, hardness_mode, hardness_strength, reduction, grad):
    problem = check_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks,
                             directions, per_direction, hardness_mode, hardness_strength,
                             reduction)
    acc = acc_dtype(queries.dtype)
    return (queries.new_empty(loss_shape(problem), dtype=acc),
            queries.new_empty((rows, STATS), dtype=acc),
            *_fake_grads(queries, problem, scale, acc, grad))


def _fake_mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset, rows,
                            owned_blocks, directions, per_direction, hardness_mode,
                            hardness_strength, reduction):
    problem = check_mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset,
                                      rows, owned_blocks, directions, per_direction,
                                      hardness_mode, hardness_strength, reduction)
    return _fake_grads(queries, problem, scale, acc_dtype(queries.dtype), True)


def register():
    fake_kernels([("mnr_loss", _fake_mnr_loss), ("mnr_loss_backward", _fake_mnr_loss_backward)])


# --- nanfree.ops' conversion of sentence-transformers' options ----------------------

DIRECTIONS = {"query_to_doc": 1, "query_to_query": 2, "doc_to_query": 4, "doc_to_doc": 8}
HARDNESS = {None: 0, "in_batch_negatives": 1, "hard_negatives": 2, "all_negatives": 3}
REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
DEFAULT_DIRECTIONS = ("query_to_doc",)
# What symmetric=True means: (directions, partition_mode), as sentence-transformers'
# MultipleNegativesSymmetricRankingLoss.
SYMMETRIC = (("query_to_doc", "doc_to_query"), "per_direction")


def torch_style_options(symmetric, directions, partition_mode, hardness_mode, hardness_strength,
                 reduction):
    """The op's integer options, after sentence-transformers' checks."""
    op = "mnr_loss"
    if not is_bool(symmetric):
        raise TypeError(f"nanfree.{op}: `symmetric` must be a bool, got {symmetric!r}")
    if symmetric:
        if tuple(directions) != DEFAULT_DIRECTIONS or partition_mode != "joint":
            raise ValueError(f"nanfree.{op}: `symmetric=True` sets directions and "
                             "partition_mode; do not pass them too")
        directions, partition_mode = SYMMETRIC
    if isinstance(directions, str):
        raise ValueError(f"nanfree.{op}: `directions` must be a non-empty sequence of "
                         f"{sorted(DIRECTIONS)}, got the string {directions!r}; write "
                         f"({directions!r},)")
    try:
        directions = tuple(directions)
    except TypeError:
        raise TypeError(f"nanfree.{op}: `directions` must be a sequence of direction names "
                        f"{sorted(DIRECTIONS)}, got {directions!r}") from None
    if not directions:
        raise ValueError(f"nanfree.{op}: `directions` must be a non-empty sequence of "
                         f"{sorted(DIRECTIONS)}, got {directions!r}")
    unknown = [d for d in directions if not isinstance(d, str) or d not in DIRECTIONS]
    if unknown:
        raise ValueError(f"nanfree.{op}: unknown `directions` {unknown}; valid: "
                         f"{sorted(DIRECTIONS)}")
    if "query_to_doc" not in directions:
        raise ValueError(f"nanfree.{op}: `directions` must include 'query_to_doc' (it holds "
                         "the positive pair)")
    if not isinstance(partition_mode, str) or partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"nanfree.{op}: `partition_mode` must be 'joint' or 'per_direction', "
                         f"got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError(f"nanfree.{op}: partition_mode='per_direction' needs every direction "
                         "to hold the positive pair; 'query_to_query' and 'doc_to_doc' do not "
                         "(use partition_mode='joint')")
    if not (hardness_mode is None or isinstance(hardness_mode, str)) or \
            hardness_mode not in HARDNESS:
        raise ValueError(f"nanfree.{op}: `hardness_mode` must be one of "
                         f"{list(HARDNESS)}, got {hardness_mode!r}")
    check_number(op, "hardness_strength", hardness_strength)
    if not is_symbolic(hardness_strength) and not (math.isfinite(hardness_strength)
                                                   and hardness_strength >= 0):
        raise ValueError(f"nanfree.{op}: `hardness_strength` must be finite and >= 0, got "
                         f"{hardness_strength}")
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"nanfree.{op}: `reduction` must be 'mean', 'sum' or 'none', got "
                         f"{reduction!r}")
    bits = sum(DIRECTIONS[d] for d in set(directions))
    hardness = HARDNESS[hardness_mode] if hardness_strength > 0 else 0
    return bits, partition_mode == "per_direction", hardness, as_float(hardness_strength), \
        REDUCTIONS[reduction]


def torch_style_scale(scale, ref):
    """(scale tensor or None, Python scale value)."""
    op = "mnr_loss"
    # Checked here, before the documents are concatenated (a kernel), with the
    # op's words.
    if isinstance(scale, torch.Tensor):
        check_float(op, "scale", scale)
        if scale.numel() != 1:
            raise ValueError(f"nanfree.{op}: a tensor `scale` must have one element, got shape "
                             f"{list(scale.shape)}")
        check_device(op, "scale", ref, scale, "queries")
        return scale, 0.0
    check_number(op, "scale", scale)
    if not is_symbolic(scale) and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"nanfree.{op}: `scale` must be positive and finite, got {scale}")
    return None, as_float(scale)


def check_torch_style_embeddings(queries, positives, negatives):
    """Checks the embeddings; returns their common dtype."""
    op = "mnr_loss"
    check_tensors(op, queries=queries, positives=positives)
    columns = isinstance(negatives, (list, tuple))
    for t in (negatives if columns else [] if negatives is None else [negatives]):
        check_tensors(op, negatives=t)
    named = {"queries": queries, "positives": positives}
    if columns:
        named.update((f"negatives[{i}]", t) for i, t in enumerate(negatives))
    elif negatives is not None:
        named["negatives"] = negatives
    for name, t in named.items():
        check_float(op, name, t)
        check_device(op, name, queries, t, "queries")
    if queries.dim() != 2:
        raise ValueError(f"nanfree.{op}: `queries` must be 2-D [B, d], got {queries.dim()} "
                         "dimensions")
    if queries.shape[0] == 0:
        raise ValueError(f"nanfree.{op}: `queries` must hold at least one row")
    if positives.shape != queries.shape:
        raise ValueError(f"nanfree.{op}: `positives` must have the shape of `queries` "
                         f"{list(queries.shape)}, got {list(positives.shape)}")
    dtype = torch.promote_types(queries.dtype, positives.dtype)
    if columns:
        for i, t in enumerate(negatives):
            if t.shape != queries.shape:
                raise ValueError(f"nanfree.{op}: each hard negative column must have the shape "
                                 f"of `queries` {list(queries.shape)}, got {list(t.shape)} "
                                 f"(negatives[{i}])")
            dtype = torch.promote_types(dtype, t.dtype)
    elif negatives is not None:
        dtype = torch.promote_types(dtype, negatives.dtype)
        if negatives.dim() == 3:
            if negatives.shape[0] != queries.shape[0] or negatives.shape[2] != queries.shape[1]:
                raise ValueError(f"nanfree.{op}: 3-D `negatives` must be [B, k, d] = "
                                 f"[{queries.shape[0]}, k, {queries.shape[1]}], got "
                                 f"{list(negatives.shape)}")
        elif negatives.dim() == 2:
            if negatives.shape[1] != queries.shape[1]:
                raise ValueError(f"nanfree.{op}: 2-D `negatives` must be [N, d] with d = "
                                 f"{queries.shape[1]}, got {list(negatives.shape)}")
        else:
            raise ValueError(f"nanfree.{op}: `negatives` must be [B, k, d] or [N, d], got "
                             f"{negatives.dim()} dimensions")
    return dtype


_GATHER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_gather_shapes(queries, negatives, dtype):
    """Before any data is gathered: every rank's (B, d, negatives' layout and
    count, dtype), in one small all_gather, so that unequal ranks all raise the
    same ValueError instead of crashing in the collective (unequal sizes) or
    hanging (an unequal number of gathers)."""
    import torch.distributed as dist

    if negatives is None:
        kind, count = 0, 0
    elif isinstance(negatives, (list, tuple)):  # k hard negative columns [B, d]
        kind, count = 1, len(negatives)
    else:  # [B, k, d]: k hard negatives; [N, d]: N shared
        kind, count = (1, negatives.shape[1]) if negatives.dim() == 3 else (2, negatives.shape[0])
    mine = torch.tensor([queries.shape[0], queries.shape[1], kind, count,
                         _GATHER_DTYPES.index(dtype)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.to(queries.device)  # NCCL gathers CUDA tensors only
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = [tuple(int(v) for v in t.tolist()) for t in every]
    if len(set(rows)) == 1:
        return

    def describe(rank, row):
        b, d, kind, count, code = row
        negatives = ("no negatives", f"k = {count} hard negatives",
                     f"{count} shared negatives")[kind]
        return f"rank {rank}: B = {b}, d = {d}, {negatives}, {_GATHER_DTYPES[code]}"

    raise ValueError("nanfree.mnr_loss: gather_across_devices=True needs the same batch size, "
                     "embedding size, negatives and dtype on every rank; got " +
                     "; ".join(describe(r, row) for r, row in enumerate(rows)))


class _GatherRows(torch.autograd.Function):
    """Every rank's rows of t, concatenated in rank order. Backward: every rank's
    loss depends on every rank's rows, so the gradients of the whole gathered
    tensor are summed over ranks (one all_reduce) and each rank keeps its own
    rows: what torch.distributed.nn.all_gather's backward gives, without its
    deprecation warnings, and on gloo too."""

    @staticmethod
    def forward(ctx, t):
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        ctx.rows, ctx.rank = t.shape[0], dist.get_rank()
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        total = grad.contiguous().clone()
        dist.all_reduce(total)
        return total[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_with_grad(t):
    """Every rank's rows, concatenated in rank order; the gradient of each
    rank's rows flows back to that rank (as sentence-transformers gathers)."""
    return _GatherRows.apply(t)
