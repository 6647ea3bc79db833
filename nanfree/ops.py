"""Drop-in replacements for torch functions that never return NaN from non-NaN input.

Signatures copy torch's; extras are keyword-only. See README.md for the contract.

Each function calls its operator through the C++ entry points of ``nanfree._C``
(one call, checks done once, in C++), or through ``torch.ops.nanfree`` while
``torch.compile`` traces it. Argument errors name the op and the argument:
``TypeError`` for a wrong type or dtype, ``IndexError`` for a ``dim`` out of
range, ``ValueError`` for a mask that does not broadcast or is on another device.
"""

import math
from collections.abc import Sequence

import torch

from . import _backends  # noqa: F401  (loads the kernels and registrations)
from . import _C, _checks
from ._checks import check_device, check_eps
from ._softmax_checks import broadcast_mask, check_float, wrap_dim
from ._torch_backend.cosine import normalize_p

__all__ = [
    "softmax", "log_softmax", "logsumexp", "cosine_similarity", "normalize", "cos_sim", "gem",
    "gem_pool2d", "mnr_loss",
]

_is_compiling = torch.compiler.is_compiling


def _check_tensors(op, **tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")


def _check_number(op, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"nanfree.{op}: `{name}` must be a number, got {type(value).__name__}")


def _check_dim_type(op, dim):
    if not isinstance(dim, int):
        raise TypeError(f"nanfree.{op}: `dim` must be an int, got {type(dim).__name__}")


def _check_python_types(op, input, dim, dtype=None, mask=None):
    """Raises the TypeError naming the argument that is not of its Python type
    (the C++ entry points only say that the call did not match)."""
    _check_tensors(op, input=input)
    _check_dim_type(op, dim)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"nanfree.{op}: `dtype` must be a torch.dtype or None, got {dtype!r}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `mask` must be a torch.Tensor or None, "
                        f"got {type(mask).__name__}")


def _distribution(op, entry, input, dim, dtype, mask):
    """softmax or log_softmax: the C++ entry point, or what torch.compile traces
    (the same steps through torch.ops)."""
    if not _is_compiling():
        try:
            return entry(input, dim, dtype, mask)
        except TypeError:
            _check_python_types(op, input, dim, dtype, mask)
            raise
    _check_python_types(op, input, dim, dtype, mask)
    forward = getattr(torch.ops.nanfree, op)
    if dtype is None:
        return forward(input, dim, mask)[0]
    # As torch: cast first, and keep the explicit dtype under autocast.
    with torch.autocast(input.device.type, enabled=False):
        return forward(input.to(dtype), dim, mask)[0]


def softmax(input, dim, dtype=None, *, mask=None):
    """``torch.softmax`` that is 0 on an all -inf or fully masked row, 1/k on k +inf
    entries, and has finite gradients; ``mask`` (True/nonzero = keep) means
    ``input.masked_fill(~mask, -inf)``."""
    return _distribution("softmax", _C.softmax, input, dim, dtype, mask)


def log_softmax(input, dim, dtype=None, *, mask=None):
    """``torch.log_softmax`` that is -inf on an all -inf or fully masked row, -log k
    on k +inf entries, and has finite gradients; ``mask`` as in :func:`softmax`."""
    return _distribution("log_softmax", _C.log_softmax, input, dim, dtype, mask)


def _consecutive(dims):
    return all(b == a + 1 for a, b in zip(dims, dims[1:]))


def _logsumexp_over_dims(input, dims, keepdim, mask):
    """logsumexp over several dims: adjacent ones of a contiguous input are
    flattened into one (a view); otherwise they are moved last first (a copy)."""
    _check_python_types("logsumexp", input, 0, None, mask)
    for d in dims:
        if not isinstance(d, int):
            raise TypeError(f"nanfree.logsumexp: `dim` must be an int or a non-empty sequence "
                            f"of ints, got {tuple(dims)!r}")
    check_float("logsumexp", "input", input)
    wrapped = sorted(wrap_dim("logsumexp", input, d) for d in dims)
    if len(set(wrapped)) != len(wrapped):
        raise ValueError(f"nanfree.logsumexp: `dim` {tuple(dims)} names a dimension twice")
    mask = broadcast_mask("logsumexp", input, mask)
    first, last = wrapped[0], wrapped[-1]
    if _consecutive(wrapped) and input.is_contiguous():
        x = input.flatten(first, last)
        m = None if mask is None else mask.flatten(first, last)
        dim = first
    else:
        ends = list(range(input.dim() - len(wrapped), input.dim()))
        x = input.movedim(wrapped, ends).flatten(-len(wrapped))
        m = None if mask is None else mask.movedim(wrapped, ends).flatten(-len(wrapped))
        dim = -1
    out = torch.ops.nanfree.logsumexp(x, dim, m)[0]
    if keepdim:
        for d in wrapped:
            out = out.unsqueeze(d)
    return out


def logsumexp(input, dim, keepdim=False, *, mask=None):
    """``torch.logsumexp`` over ``dim`` (an int or a sequence of ints): -inf for an
    empty or fully masked set, +inf if an entry is +inf, gradient 0 for both."""
    if isinstance(dim, int):
        if not _is_compiling():
            try:
                return _C.logsumexp(input, dim, keepdim, mask)
            except TypeError:
                _check_python_types("logsumexp", input, dim, None, mask)
                raise
        _check_python_types("logsumexp", input, dim, None, mask)
        out = torch.ops.nanfree.logsumexp(input, dim, mask)[0]
        if keepdim and input.dim() > 0:
            out = out.unsqueeze(dim % input.dim())
        return out
    if not isinstance(dim, Sequence) or isinstance(dim, str) or len(dim) == 0:
        raise TypeError(
            f"nanfree.logsumexp: `dim` must be an int or a non-empty sequence of ints, got {dim!r}"
        )
    if len(dim) == 1:
        return logsumexp(input, dim[0], keepdim, mask=mask)
    return _logsumexp_over_dims(input, list(dim), keepdim, mask)


# --- cosine family -----------------------------------------------------------------

# cos_sim normalizes with F.normalize's default eps, as sentence-transformers does.
COS_SIM_EPS = 1e-12


def _wrap_vector_dim(op, dim, rank):
    _check_dim_type(op, dim)
    return _checks.wrap_dim(op, dim, rank, rank)


def _common_float_dtype(op, **tensors):
    (n1, t1), (n2, t2) = tensors.items()
    check_float(op, n1, t1)
    check_float(op, n2, t2)
    check_device(op, n2, t1, t2, n1)
    return torch.promote_types(t1.dtype, t2.dtype)


def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """``F.cosine_similarity`` (same broadcasting) with accurate norms: each vector
    is divided by max(‖x‖, eps), the result is clamped to [-1, 1], a zero vector
    gives 0, and the gradient is finite everywhere (0 for a vector below eps)."""
    if not _is_compiling():
        try:
            return _C.cosine_similarity(x1, x2, dim, eps)
        except TypeError:
            _check_tensors("cosine_similarity", x1=x1, x2=x2)
            _check_number("cosine_similarity", "eps", eps)
            # The C++ entry point's own TypeErrors (a non-float dtype) pass through.
            _check_dim_type("cosine_similarity", dim)
            raise
    _check_tensors("cosine_similarity", x1=x1, x2=x2)
    _check_number("cosine_similarity", "eps", eps)
    dtype = _common_float_dtype("cosine_similarity", x1=x1, x2=x2)
    try:
        shape = torch.broadcast_shapes(x1.shape, x2.shape)
    except RuntimeError:
        raise ValueError(f"nanfree.cosine_similarity: `x1` of shape {list(x1.shape)} and `x2` of "
                         f"shape {list(x2.shape)} do not broadcast") from None
    dim = _wrap_vector_dim("cosine_similarity", dim, len(shape))
    a = x1.to(dtype).expand(shape).movedim(dim, -1)
    b = x2.to(dtype).expand(shape).movedim(dim, -1)
    return torch.ops.nanfree.cosine_similarity(a, b, eps)[0]


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``F.normalize``: input / max(‖input‖_p, eps) along ``dim``, with norms that
    never overflow or underflow; a zero vector normalizes to 0 with gradient 0.
    p = 2 runs fused kernels; another p > 0 (inf included) a torch composition
    with the same rules."""
    _check_number("normalize", "p", p)
    if not p > 0:
        raise ValueError(f"nanfree.normalize: `p` must be positive, got {p}")
    if p == 2 and out is None and not _is_compiling():
        try:
            return _C.normalize(input, dim, eps)
        except TypeError:
            _check_tensors("normalize", input=input)
            _check_number("normalize", "eps", eps)
            _check_dim_type("normalize", dim)
            raise
    _check_tensors("normalize", input=input)
    _check_number("normalize", "eps", eps)
    if out is not None:
        _check_tensors("normalize", out=out)
    check_float("normalize", "input", input)
    dim = _wrap_vector_dim("normalize", dim, input.dim())
    if p == 2:
        result = torch.ops.nanfree.normalize(input.movedim(dim, -1), eps)[0].movedim(-1, dim)
    else:
        check_eps("normalize", eps)
        result = normalize_p(input, float(p), dim, eps)
    if out is None:
        return result
    return out.copy_(result)


def cos_sim(a, b):
    """``sentence_transformers.util.cos_sim``: the [N, M] matrix of cosine
    similarities of the rows of ``a`` [N, d] and ``b`` [M, d] (a 1-D input is
    one row), as one GEMM of the normalized rows, clamped to [-1, 1]."""
    if not _is_compiling():
        try:
            return _C.cos_sim(a, b)
        except TypeError:
            _check_tensors("cos_sim", a=a, b=b)
            raise
    _check_tensors("cos_sim", a=a, b=b)
    dtype = _common_float_dtype("cos_sim", a=a, b=b)

    def rows(t, name):
        if t.dim() not in (1, 2):
            raise ValueError(f"nanfree.cos_sim: `{name}` must be 1-D or 2-D, got {t.dim()} "
                             "dimensions")
        return t.reshape(1, -1) if t.dim() == 1 else t

    # Every check before the first kernel.
    a_rows, b_rows = rows(a, "a"), rows(b, "b")
    if a_rows.shape[1] != b_rows.shape[1]:
        raise ValueError(f"nanfree.cos_sim: `a` has vectors of {a_rows.shape[1]} entries but "
                         f"`b` of {b_rows.shape[1]}")
    a_rows = torch.ops.nanfree.normalize(a_rows.to(dtype), COS_SIM_EPS)[0]
    b_rows = torch.ops.nanfree.normalize(b_rows.to(dtype), COS_SIM_EPS)[0]
    return torch.ops.nanfree.cos_sim_matrix(a_rows, b_rows)


# --- GeM family --------------------------------------------------------------------


def _gem_dims(input, dim):
    """The reduced dims, wrapped and sorted (a 0-d tensor counts as one dimension)."""
    if isinstance(dim, bool) or not isinstance(dim, (int, Sequence)) or isinstance(dim, str):
        raise TypeError(f"nanfree.gem: `dim` must be an int or a non-empty sequence of ints, "
                        f"got {dim!r}")
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"nanfree.gem: `dim` must be an int or a non-empty sequence of ints, "
                        f"got {dim!r}")
    wrapped = sorted(wrap_dim("gem", input, d) for d in dims)
    if len(set(wrapped)) != len(wrapped):
        raise ValueError(f"nanfree.gem: `dim` {tuple(dims)} names a dimension twice")
    return wrapped


def _gem_view(t, dims):
    """t as the ops' [outer, n, inner] (a view when the reduced dims are adjacent
    and t's layout allows; otherwise they are moved last, a copy)."""
    if t.dim() == 0:
        return t.reshape(1, 1, 1)
    first, last = dims[0], dims[-1]
    if _consecutive(dims):
        shape = t.shape
        return t.reshape(math.prod(shape[:first]), math.prod(shape[first:last + 1]),
                         math.prod(shape[last + 1:]))
    kept = [d for d in range(t.dim()) if d not in dims]
    moved = t.permute(*kept, *dims)
    return moved.reshape(math.prod(moved.shape[:len(kept)]), -1, 1)


def _gem_p(p):
    """(p tensor or None, Python p value) as the ops take them."""
    if isinstance(p, torch.Tensor):
        return p, 0.0
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"nanfree.gem: `p` must be a number or a tensor, got {type(p).__name__}")
    p = float(p)
    if not (math.isfinite(p) and p > 0):
        raise ValueError(f"nanfree.gem: `p` must be finite and > 0, got {p}")
    return None, p


def gem(input, p=3.0, dim=-1, eps=1e-6, keepdim=False, *, mask=None):
    """Generalized mean ``mean(clamp(input, min=eps) ** p, dim) ** (1/p)`` over ``dim``
    (an int or a sequence of ints), computed from the largest clamped value of each
    reduction so that nothing overflows or underflows. ``p`` is a float (finite, > 0)
    or a one-element tensor that may require grad (clamped to [1e-2, 1e2]). ``mask``
    (bool or integer, nonzero = keep) broadcasts to ``input``; a reduction with no
    kept entry gives 0 with gradient 0."""
    _check_tensors("gem", input=input)
    _check_number("gem", "eps", eps)
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"nanfree.gem: `mask` must be a torch.Tensor or None, "
                        f"got {type(mask).__name__}")
    check_float("gem", "input", input)
    p_tensor, p_value = _gem_p(p)
    check_eps("gem", eps)
    if p_tensor is not None:
        check_float("gem", "p", p_tensor)
        if p_tensor.numel() != 1 or p_tensor.dim() > 1:
            raise ValueError(f"nanfree.gem: a tensor `p` must have shape [] or [1], got "
                             f"{list(p_tensor.shape)}")
        check_device("gem", "p", input, p_tensor)
    dims = _gem_dims(input, dim)
    keep = broadcast_mask("gem", input, mask)
    x = _gem_view(input, dims)
    m = None if keep is None else _gem_view(keep, dims)
    out = torch.ops.nanfree.gem(x, p_tensor, p_value, float(eps), m)[0]
    if input.dim() == 0:
        return out.reshape(())
    shape = [1 if d in dims else size for d, size in enumerate(input.shape)]
    if not keepdim:
        shape = [size for d, size in enumerate(shape) if d not in dims]
    return out.reshape(shape)


def gem_pool2d(input, p=3.0, eps=1e-6):
    """GeM pooling of images, as cirtorch's ``gem``: ``[B, C, H, W] -> [B, C, 1, 1]``
    (a 3-D ``[C, H, W]`` gives ``[C, 1, 1]``), the generalized mean over H and W."""
    _check_tensors("gem_pool2d", input=input)
    if input.dim() not in (3, 4):
        raise ValueError(f"nanfree.gem_pool2d: `input` must be [B, C, H, W] or [C, H, W], "
                         f"got {input.dim()} dimensions")
    return gem(input, p, (-2, -1), eps, keepdim=True)


# --- MNR (InfoNCE) loss ------------------------------------------------------------

_MNR_DIRECTIONS = {"query_to_doc": 1, "query_to_query": 2, "doc_to_query": 4, "doc_to_doc": 8}
_MNR_HARDNESS = {None: 0, "in_batch_negatives": 1, "hard_negatives": 2, "all_negatives": 3}
_MNR_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
_MNR_DEFAULT_DIRECTIONS = ("query_to_doc",)
# What symmetric=True means: (directions, partition_mode), as sentence-transformers'
# MultipleNegativesSymmetricRankingLoss.
MNR_SYMMETRIC = (("query_to_doc", "doc_to_query"), "per_direction")


def _mnr_options(symmetric, directions, partition_mode, hardness_mode, hardness_strength,
                 reduction):
    """The op's integer options, after sentence-transformers' checks."""
    op = "mnr_loss"
    if symmetric:
        if tuple(directions) != _MNR_DEFAULT_DIRECTIONS or partition_mode != "joint":
            raise ValueError(f"nanfree.{op}: `symmetric=True` sets directions and "
                             "partition_mode; do not pass them too")
        directions, partition_mode = MNR_SYMMETRIC
    if isinstance(directions, str) or not directions:
        raise ValueError(f"nanfree.{op}: `directions` must be a non-empty sequence of "
                         f"{sorted(_MNR_DIRECTIONS)}, got {directions!r}")
    unknown = set(directions) - set(_MNR_DIRECTIONS)
    if unknown:
        raise ValueError(f"nanfree.{op}: unknown `directions` {sorted(unknown)}; valid: "
                         f"{sorted(_MNR_DIRECTIONS)}")
    if "query_to_doc" not in directions:
        raise ValueError(f"nanfree.{op}: `directions` must include 'query_to_doc' (it holds "
                         "the positive pair)")
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"nanfree.{op}: `partition_mode` must be 'joint' or 'per_direction', "
                         f"got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError(f"nanfree.{op}: partition_mode='per_direction' needs every direction "
                         "to hold the positive pair; 'query_to_query' and 'doc_to_doc' do not "
                         "(use partition_mode='joint')")
    if hardness_mode not in _MNR_HARDNESS:
        raise ValueError(f"nanfree.{op}: `hardness_mode` must be one of "
                         f"{list(_MNR_HARDNESS)}, got {hardness_mode!r}")
    _check_number(op, "hardness_strength", hardness_strength)
    if not (math.isfinite(hardness_strength) and hardness_strength >= 0):
        raise ValueError(f"nanfree.{op}: `hardness_strength` must be finite and >= 0, got "
                         f"{hardness_strength}")
    if reduction not in _MNR_REDUCTIONS:
        raise ValueError(f"nanfree.{op}: `reduction` must be 'mean', 'sum' or 'none', got "
                         f"{reduction!r}")
    bits = sum(_MNR_DIRECTIONS[d] for d in set(directions))
    hardness = _MNR_HARDNESS[hardness_mode] if hardness_strength > 0 else 0
    return bits, partition_mode == "per_direction", hardness, float(hardness_strength), \
        _MNR_REDUCTIONS[reduction]


def _mnr_scale(scale, ref):
    """(scale tensor or None, Python scale value)."""
    op = "mnr_loss"
    if isinstance(scale, torch.Tensor):
        check_float(op, "scale", scale)
        if scale.numel() != 1:
            raise ValueError(f"nanfree.{op}: a tensor `scale` must have one element, got shape "
                             f"{list(scale.shape)}")
        check_device(op, "scale", ref, scale, "queries")
        return scale, 0.0
    _check_number(op, "scale", scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"nanfree.{op}: `scale` must be positive and finite, got {scale}")
    return None, float(scale)


def _mnr_embeddings(queries, positives, negatives):
    """Checks the embeddings; returns their common dtype."""
    op = "mnr_loss"
    _check_tensors(op, queries=queries, positives=positives)
    if negatives is not None:
        _check_tensors(op, negatives=negatives)
    named = {"queries": queries, "positives": positives}
    if negatives is not None:
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
    if negatives is not None:
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


def _cat_rows(parts):
    """torch.cat of same-dtype parts, also under autocast, whose cat refuses a
    half dtype other than its own (the op itself widens under autocast)."""
    device_type = parts[0].device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return torch.cat(parts)
    return torch.cat(parts)


def _gather_with_grad(t):
    """Every rank's rows, concatenated in rank order; the gradient of each
    rank's rows flows back to that rank (torch.distributed.nn.all_gather, as
    sentence-transformers gathers)."""
    import torch.distributed.nn

    return torch.cat(torch.distributed.nn.all_gather(t), dim=0)


def mnr_loss(queries, positives, negatives=None, *, scale=20.0, symmetric=False,
             directions=("query_to_doc",), partition_mode="joint", hardness_mode=None,
             hardness_strength=0.0, reduction="mean", gather_across_devices=False):
    """The multiple negatives ranking (InfoNCE) loss of sentence-transformers'
    ``MultipleNegativesRankingLoss`` on given embeddings, fused: cross entropy of
    ``scale * cos_sim`` with each query's positive as target, without ever
    holding the [B, B(1+k)] logit matrix, and never NaN from non-NaN input.

    ``queries``, ``positives`` [B, d]; ``negatives`` None, [B, k, d] (k hard
    negatives per query) or [N, d] (extra candidates shared by every query,
    owned by none). ``scale`` is a positive float or a one-element tensor (its
    gradient is returned). See README.md for directions, partition modes,
    hardness modes and gathering across ranks. Half-precision inputs give a
    float32 loss."""
    op = "mnr_loss"
    dtype = _mnr_embeddings(queries, positives, negatives)
    scale_tensor, scale_value = _mnr_scale(scale, queries)
    bits, per_direction, hardness, strength, red = _mnr_options(
        symmetric, directions, partition_mode, hardness_mode, hardness_strength, reduction)
    if not isinstance(gather_across_devices, bool):
        raise TypeError(f"nanfree.{op}: `gather_across_devices` must be a bool")
    rows = queries.shape[0]
    # The docs: the positives, the k blocks negatives[:, j], then shared candidates.
    blocks = [positives]
    if negatives is not None and negatives.dim() == 3:
        blocks += list(negatives.unbind(1))
    parts = blocks + ([negatives] if negatives is not None and negatives.dim() == 2 else [])
    parts = [part.to(dtype) for part in parts]
    queries = queries.to(dtype)
    offset = 0
    import torch.distributed as dist

    if gather_across_devices and dist.is_available() and dist.is_initialized():
        # Each part is gathered on its own so that the gathered docs keep the
        # layout [every rank's positives, every rank's negatives 0, ..., shared].
        parts = [_gather_with_grad(part) for part in parts]
        queries = _gather_with_grad(queries)
        offset = dist.get_rank() * rows
    docs = _cat_rows(parts) if len(parts) > 1 else parts[0]
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (queries, docs, scale_tensor))
    # The op normalizes the rows itself (as cos_sim does, eps 1e-12), so that no
    # normalized copy is kept for the backward.
    return torch.ops.nanfree.mnr_loss(queries, docs, scale_tensor, scale_value, offset, rows,
                                      len(blocks), bits, per_direction, hardness, strength, red,
                                      wants_grad and red != 0)[0]
