"""Op-level argument checks of the MNR ops (mnr_loss, mnr_loss_backward) for the
Python backends (Triton, pure PyTorch) and the fake kernels: the same errors,
with the same words and exception types, as csrc/common/mnr_op.h. The layout
and rules are those of csrc/include/nanfree/mnr_math.h."""

import math
from dataclasses import dataclass

import torch

from ._checks import acc_dtype, check_device, check_float

QUERY_TO_DOC, QUERY_TO_QUERY, DOC_TO_QUERY, DOC_TO_DOC = 1, 2, 4, 8
STATS = 2  # the logsumexp of each local row's query row and positive's row
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


def _check_embeddings(op, queries, docs):
    check_float(op, "queries", queries)
    check_float(op, "docs", docs)
    check_device(op, "docs", queries, docs, "queries")
    if queries.dim() != 2 or docs.dim() != 2:
        raise ValueError(f"nanfree.{op}: `queries` and `docs` must be 2-D, got "
                         f"{queries.dim()} and {docs.dim()} dimensions")
    if queries.dtype != docs.dtype:
        raise TypeError(f"nanfree.{op}: `queries` is {queries.dtype} but `docs` is {docs.dtype}")
    if queries.shape[1] != docs.shape[1]:
        raise ValueError(f"nanfree.{op}: `queries` has rows of {queries.shape[1]} entries but "
                         f"`docs` of {docs.shape[1]}")


def check_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks, directions,
                   per_direction, hardness_mode, hardness_strength, reduction,
                   op="mnr_loss"):
    _check_embeddings(op, queries, docs)
    r, m = queries.shape[0], docs.shape[0]
    if scale is not None:
        check_float(op, "scale", scale)
        if scale.numel() != 1:
            raise ValueError(f"nanfree.{op}: a tensor `scale` must have one element, got shape "
                             f"{list(scale.shape)}")
        check_device(op, "scale", queries, scale, "queries")
    elif not (math.isfinite(scale_value) and scale_value > 0):
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
    if not (math.isfinite(hardness_strength) and hardness_strength >= 0):
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
                      hardness_strength=float(hardness_strength), reduction=reduction)


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
