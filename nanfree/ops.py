"""Drop-in replacements for torch functions that never return NaN from non-NaN input.

Signatures copy torch's; extras are keyword-only. The contract of each family: docs/<family>.md.

Each function turns the torch-style call into its operator's call: through
the C++ entry points of ``nanfree._C`` (one call; the op checks its arguments
once, in C++), or through ``torch.ops.nanfree`` while ``torch.compile`` traces
it and for the ops without an entry point. The families' Python sides
(nanfree/_ops) hold the conversions. Argument errors name the op and the
argument: ``TypeError`` for a wrong type or dtype, ``IndexError`` for a
``dim`` out of range, ``ValueError`` for a wrong value, or a mask that does
not broadcast or is on another device.
"""

import math
import struct
import warnings

import torch

from . import _backends  # noqa: F401  (loads the kernels and registrations)
from . import _C
from ._ops import cosine as _cosine
from ._ops import elementwise as _elementwise
from ._ops import gem as _gem
from ._ops import losses as _losses
from ._ops import mnr as _mnr
from ._ops.common import (as_float, autocast_on, broadcast_mask, check_device, check_dim_type,
                          check_eps, check_float, check_number, check_optional_tensor,
                          check_tensors, is_bool, is_number, is_symbolic, refuse_torch_func,
                          wrap_dim)
from ._ops.layout import reduced_dims, reduced_shape, reduction_view

__all__ = [
    "softmax", "log_softmax", "logsumexp", "cosine_similarity", "normalize", "cos_sim", "gem",
    "gem_pool2d", "mnr_loss", "sqrt", "log", "log1p", "acos", "asin", "pow", "atan2",
    "div_no_nan", "xlogy", "xlog1py", "binary_cross_entropy_with_logits", "binary_cross_entropy",
    "cross_entropy", "kl_div", "sigmoid_focal_loss",
]

_is_compiling = torch.compiler.is_compiling
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_jit_tracing = torch._C._is_tracing


def _entry_allowed():
    """Whether a call may take a C++ entry point of nanfree._C (one crossing
    instead of the torch.ops steps): not while torch.compile traces (Dynamo
    does not trace into it), not under a TorchFunctionMode (nanfree.debug's
    detect_anomaly names the user's line of a call by the torch calls it sees,
    the Python steps', of which the entry point makes none), and not while
    torch.jit.trace records (the losses' entries divide a sum and read a
    count on the host, which the tracer would not record)."""
    return not (_is_compiling() or _function_mode_enabled() or _jit_tracing())


def _check_python_types(op, input, dim, dtype=None, mask=None):
    """Raises the TypeError naming the argument that is not of its Python type
    (the C++ entry points only say that the call did not match)."""
    check_tensors(op, input=input)
    check_dim_type(op, dim)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"nanfree.{op}: `dtype` must be a torch.dtype or None, got {dtype!r}")
    check_optional_tensor(op, "mask", mask)


def _check_dtype_and_dim(op, dtype, dim):
    """What the C++ entry points would take otherwise: a bool dim (as 0 or 1; torch
    refuses it) and a dtype that is not floating (the error would blame `input`)."""
    if dim.__class__ is bool:  # the cheap test of the per-call path
        check_dim_type(op, dim)  # raises: torch refuses a bool dim
    if dtype is not None and isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
        raise TypeError(f"nanfree.{op}: `dtype` must be a floating dtype (float16, bfloat16, "
                        f"float32 or float64), got {dtype}")


def _distribution(op, entry, input, dim, stacklevel, dtype, mask):
    """softmax or log_softmax: the C++ entry point, or what torch.compile traces
    (the same steps through torch.ops). `stacklevel` and `dtype`: F's arguments,
    or torch.softmax's dtype in stacklevel's place."""
    if stacklevel.__class__ is torch.dtype:  # torch.softmax's third argument
        dtype, stacklevel = stacklevel, 3
    if dim is None and isinstance(input, torch.Tensor):
        dim = _implicit_dim(op, input, stacklevel + 1)  # counted from softmax's caller
    _check_dtype_and_dim(op, dtype, dim)
    if _entry_allowed():
        try:
            return entry(input, dim, dtype, mask)
        except TypeError:
            _check_python_types(op, input, dim, dtype, mask)
            raise
        except RuntimeError:
            refuse_torch_func(op, input)
            raise
    _check_python_types(op, input, dim, dtype, mask)
    forward = getattr(torch.ops.nanfree, op)
    if dtype is None:
        return forward(input, dim, mask)[0]
    # As torch: cast first, and keep the explicit dtype under autocast.
    with torch.autocast(input.device.type, enabled=False):
        return forward(input.to(dtype), dim, mask)[0]


def _warn_when_eager(message, stacklevel):
    """torch's deprecation warnings, where torch.nn.functional gives them: not
    while torch.compile traces (Dynamo cannot trace warnings.warn from here)."""
    if not torch.compiler.is_compiling():
        warnings.warn(message, stacklevel=stacklevel + 1)


def _implicit_dim(op, input, stacklevel):
    """torch.nn.functional's deprecated choice of dim when none is given (0 for
    a 0-, 1- or 3-d input, else 1), with its warning at the caller's line."""
    _warn_when_eager(f"Implicit dimension choice for {op} has been deprecated. Change the call "
                     f"to include dim=X as an argument.", stacklevel=stacklevel)
    return 0 if input.dim() in (0, 1, 3) else 1


def softmax(input, dim=None, _stacklevel=3, dtype=None, *, mask=None):
    """``torch.nn.functional.softmax`` (and ``torch.softmax(input, dim, dtype)``: a
    dtype as the third argument is the dtype) that is 0 on an all -inf or fully
    masked row, 1/k on k +inf entries, and has finite gradients; ``mask``
    (True/nonzero = keep) means ``input.masked_fill(~mask, -inf)``."""
    return _distribution("softmax", _C.softmax, input, dim, _stacklevel, dtype, mask)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None, *, mask=None):
    """``torch.nn.functional.log_softmax`` (and ``torch.log_softmax``) that is -inf on
    an all -inf or fully masked row, -log k on k +inf entries, and has finite
    gradients; ``mask`` as in :func:`softmax`."""
    return _distribution("log_softmax", _C.log_softmax, input, dim, _stacklevel, dtype, mask)


def logsumexp(input, dim, keepdim=False, *, out=None, mask=None):
    """``torch.logsumexp`` over ``dim`` (an int or a sequence of ints): -inf for an
    empty or fully masked set, +inf if an entry is +inf, gradient 0 for both.
    Integer and bool input is taken in the default dtype, as torch's."""
    if isinstance(input, torch.Tensor) and not (input.is_floating_point() or input.is_complex()):
        input = input.to(torch.get_default_dtype())
    if out is not None:
        check_tensors("logsumexp", out=out)
        _refuse_out_with_grad("logsumexp", input, out)
        return _into_out("logsumexp", out, logsumexp(input, dim, keepdim, mask=mask), (input,))
    if isinstance(dim, int):
        _check_dtype_and_dim("logsumexp", None, dim)
        if _entry_allowed():
            try:
                return _C.logsumexp(input, dim, keepdim, mask)
            except TypeError:
                _check_python_types("logsumexp", input, dim, None, mask)
                raise
            except RuntimeError:
                refuse_torch_func("logsumexp", input)
                raise
        _check_python_types("logsumexp", input, dim, None, mask)
        out = torch.ops.nanfree.logsumexp(input, dim, mask)[0]
        if keepdim and input.dim() > 0:
            out = out.unsqueeze(dim % input.dim())
        return out
    # Several dims: the op reduces the middle dim of the [outer, n, inner] view.
    check_tensors("logsumexp", input=input)
    check_optional_tensor("logsumexp", "mask", mask)
    dims = reduced_dims("logsumexp", input, dim)
    if len(dims) == 1:
        return logsumexp(input, dims[0], keepdim, mask=mask)
    check_float("logsumexp", "input", input)
    keep = broadcast_mask("logsumexp", input, mask)
    x = reduction_view(input, dims)
    m = None if keep is None else reduction_view(keep, dims)
    try:
        out = torch.ops.nanfree.logsumexp(x, 1, m)[0]
    except RuntimeError:
        refuse_torch_func("logsumexp", input)
        raise
    return out.reshape(reduced_shape(input, dims, keepdim))


# --- cosine family -----------------------------------------------------------------


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
    _check_dtype_and_dim("cosine_similarity", None, dim)
    if _entry_allowed():
        try:
            return _C.cosine_similarity(x1, x2, dim, eps)
        except TypeError:
            check_tensors("cosine_similarity", x1=x1, x2=x2)
            check_number("cosine_similarity", "eps", eps)
            # The C++ entry point's own TypeErrors (a non-float dtype) pass through.
            check_dim_type("cosine_similarity", dim)
            raise
        except RuntimeError:
            refuse_torch_func("cosine_similarity", x1, x2)
            raise
    check_tensors("cosine_similarity", x1=x1, x2=x2)
    check_number("cosine_similarity", "eps", eps)
    dtype = _common_float_dtype("cosine_similarity", x1=x1, x2=x2)
    try:
        shape = torch.broadcast_shapes(x1.shape, x2.shape)
    except RuntimeError:
        raise ValueError(f"nanfree.cosine_similarity: `x1` of shape {list(x1.shape)} and `x2` of "
                         f"shape {list(x2.shape)} do not broadcast") from None
    check_dim_type("cosine_similarity", dim)
    dim = wrap_dim("cosine_similarity", dim, len(shape), len(shape))
    a = x1.to(dtype).expand(shape).movedim(dim, -1)
    b = x2.to(dtype).expand(shape).movedim(dim, -1)
    return torch.ops.nanfree.cosine_similarity(a, b, eps)[0]


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``F.normalize``: input / max(‖input‖_p, eps) along ``dim`` (an int or a
    sequence of ints; an empty one is every dim, as torch's), with norms that
    never overflow or underflow; a zero vector normalizes to 0 with gradient 0.
    p = 2 (or 'fro') runs fused kernels; another p > 0 (inf included) a torch
    composition with the same rules."""
    _check_dtype_and_dim("normalize", None, dim)
    if not (p.__class__ is float or p.__class__ is int):
        p = _cosine.vector_norm_order(p)
    if not p > 0:
        raise ValueError(f"nanfree.normalize: `p` must be positive, got {p}")
    if p == 2 and out is None and dim.__class__ is int and _entry_allowed():
        try:
            return _C.normalize(input, dim, eps)
        except TypeError:
            check_tensors("normalize", input=input)
            check_number("normalize", "eps", eps)
            raise
        except RuntimeError:
            refuse_torch_func("normalize", input)
            raise
    check_tensors("normalize", input=input)
    check_number("normalize", "eps", eps)
    dims = _wrapped_normalize_dims(input, dim)
    if out is not None:
        check_tensors("normalize", out=out)
        _refuse_out_with_grad("normalize", input, out, torch_name="torch.nn.functional.normalize")
    check_float("normalize", "input", input)
    try:
        if p == 2:
            result = _cosine.normalize_dims(input, dims, eps)
        else:
            check_eps("normalize", eps)
            result = _cosine.normalize_p(input, float(p), dims, eps)
    except RuntimeError:
        refuse_torch_func("normalize", input)
        raise
    if out is None:
        return result
    return _into_out("normalize", out, result)


def _wrapped_normalize_dims(input, dim):
    """normalize's `dim` as the sorted list of the wrapped dims: an int, numpy's
    integer, or a sequence of them (every dim for an empty one, as torch's
    norm)."""
    if isinstance(dim, (tuple, list)) and not dim:
        dim = list(range(max(input.dim(), 1)))
    dims = reduced_dims("normalize", input, dim)
    if input.dim() == 0:
        wrap_dim("normalize", dims[0], 0, 0)  # raises: a 0-d tensor holds no vector
    return dims


def _can_cast(source, target):
    """torch.can_cast(source, target) in Python, which torch.compile traces
    (torch.can_cast breaks the graph): no cast to a lower category of bool,
    integer, floating, complex."""
    def category(dtype):
        if dtype == torch.bool:
            return 0
        return 3 if dtype.is_complex else 2 if dtype.is_floating_point else 1

    return category(source) <= category(target)


def _prepare_out(op, out, shape, dtype, ref, operands=(), stacklevel=2):
    """`out` made ready for a result of `shape` and `dtype` on ref's device, as
    torch's out= does: a non-empty `out` of another shape is resized with torch's
    warning (an empty one silently), unless it shares memory with one of the
    `operands` (a broadcast input as `out`: refused with torch's words); a dtype
    the result cannot be cast to is refused. `stacklevel`: the user's frame as
    warnings.warn counts it from here. Returns whether `out` has the result's dtype (an
    op's <op>_out can then write into it)."""
    if not _can_cast(dtype, out.dtype):
        raise TypeError(f"nanfree.{op}: `out` is {out.dtype}, which the result's "
                        f"{dtype} cannot be cast to")
    check_device(op, "out", ref, out)
    if list(out.shape) != list(shape):
        if any(_shares_memory(out, t) for t in operands):
            raise RuntimeError(f"nanfree.{op}: output with shape {list(out.shape)} doesn't match "
                               f"the broadcast shape {list(shape)} (it is an input, which a "
                               f"resize would change; as torch)")
        if out.numel() != 0:
            warnings.warn(f"nanfree.{op}: an output with one or more elements was resized since "
                          f"it had shape {list(out.shape)}, which does not match the required "
                          f"output shape {list(shape)}. As torch, resize `out` to 0 "
                          "elements first (out.resize_(0)) to silence this.", UserWarning,
                          stacklevel=stacklevel)
        out.resize_(shape)
    return out.dtype == dtype


def _shares_memory(a, b):
    """Whether tensor a and b (a tensor or a number) are views of one allocation."""
    if not isinstance(b, torch.Tensor):
        return False
    storage = a.untyped_storage()
    return storage.nbytes() > 0 and storage.data_ptr() == b.untyped_storage().data_ptr()


def _refuse_out_with_grad(op, *tensors, torch_name=None):
    """torch's refusal of out= where an argument (out included) requires grad."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in tensors):
        raise RuntimeError(f"nanfree.{op}: functions with out=... arguments don't support "
                           f"automatic differentiation, but one of the arguments requires "
                           f"grad (as {torch_name or 'torch.' + op})")


def _into_out(op, out, result, operands=(), stacklevel=3):
    """result written into `out` as torch's out= does (_prepare_out; `stacklevel`
    from here)."""
    _prepare_out(op, out, result.shape, result.dtype, result, operands, stacklevel + 1)
    return out.copy_(result)


def cos_sim(a, b):
    """``sentence_transformers.util.cos_sim``: the [N, M] matrix of cosine
    similarities of the rows of ``a`` [N, d] and ``b`` [M, d] (a 1-D input is
    one row), as one GEMM of the normalized rows, clamped to [-1, 1]."""
    if _entry_allowed():
        try:
            return _C.cos_sim(a, b)
        except TypeError:
            check_tensors("cos_sim", a=a, b=b)
            raise
        except RuntimeError:
            refuse_torch_func("cos_sim", a, b)
            raise
    check_tensors("cos_sim", a=a, b=b)
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
    a_rows = torch.ops.nanfree.normalize(a_rows.to(dtype), _cosine.COS_SIM_EPS)[0]
    b_rows = torch.ops.nanfree.normalize(b_rows.to(dtype), _cosine.COS_SIM_EPS)[0]
    return torch.ops.nanfree.cos_sim_matrix(a_rows, b_rows)


# --- GeM family --------------------------------------------------------------------


def gem(input, p=3.0, dim=-1, eps=1e-6, keepdim=False, *, mask=None):
    """Generalized mean ``mean(clamp(input, min=eps) ** p, dim) ** (1/p)`` over ``dim``
    (an int or a sequence of ints), computed from the largest clamped value of each
    reduction so that nothing overflows or underflows. ``p`` is a float (finite, > 0)
    or a one-element tensor that may require grad (clamped to [1e-2, 1e2]). ``mask``
    (bool or integer, nonzero = keep) broadcasts to ``input``; a reduction with no
    kept entry gives 0 with gradient 0."""
    check_tensors("gem", input=input)
    check_number("gem", "eps", eps)
    check_optional_tensor("gem", "mask", mask)
    p_tensor, p_value = _gem.torch_style_p(p)
    dims = reduced_dims("gem", input, dim)
    keep = broadcast_mask("gem", input, mask)
    x = reduction_view(input, dims)
    m = None if keep is None else reduction_view(keep, dims)
    # The op checks the input's dtype, eps, p and a tensor p's shape and device.
    try:
        out = torch.ops.nanfree.gem(x, p_tensor, p_value, as_float(eps), m)[0]
    except RuntimeError:
        refuse_torch_func("gem", input, p_tensor)
        raise
    return out.reshape(reduced_shape(input, dims, keepdim))


def gem_pool2d(input, p=3.0, eps=1e-6):
    """GeM pooling of images, as cirtorch's ``gem``: ``[B, C, H, W] -> [B, C, 1, 1]``
    (a 3-D ``[C, H, W]`` gives ``[C, 1, 1]``), the generalized mean over H and W."""
    check_tensors("gem_pool2d", input=input)
    if input.dim() not in (3, 4):
        raise ValueError(f"nanfree.gem_pool2d: `input` must be [B, C, H, W] or [C, H, W], "
                         f"got {input.dim()} dimensions")
    return gem(input, p, (-2, -1), eps, keepdim=True)


# --- MNR (InfoNCE) loss ------------------------------------------------------------


def mnr_loss(queries, positives, negatives=None, *, scale=20.0, symmetric=False,
             directions=("query_to_doc",), partition_mode="joint", hardness_mode=None,
             hardness_strength=0.0, reduction="mean", gather_across_devices=False):
    """The multiple negatives ranking (InfoNCE) loss of sentence-transformers'
    ``MultipleNegativesRankingLoss`` on given embeddings, fused: cross entropy of
    ``scale * cos_sim`` with each query's positive as target, without ever
    holding the [B, B(1+k)] logit matrix, and never NaN from non-NaN input.

    ``queries``, ``positives`` [B, d]; ``negatives`` None, [B, k, d] (k hard
    negatives per query), a list of k [B, d] columns (the same, as
    sentence-transformers passes them) or [N, d] (extra candidates shared by
    every query, owned by none); read in place, never concatenated. ``scale`` is a positive float or a one-element tensor (its
    gradient is returned). See docs/mnr.md for directions, partition modes,
    hardness modes and gathering across ranks. Half-precision inputs give a
    float32 loss."""
    op = "mnr_loss"
    dtype = _mnr.check_torch_style_embeddings(queries, positives, negatives)
    scale_tensor, scale_value = _mnr.torch_style_scale(scale, queries)
    bits, per_direction, hardness, strength, red = _mnr.torch_style_options(
        symmetric, directions, partition_mode, hardness_mode, hardness_strength, reduction)
    if not isinstance(gather_across_devices, bool):
        raise TypeError(f"nanfree.{op}: `gather_across_devices` must be a bool")
    # The docs, read in place by the op: the positives, the k blocks
    # negatives[:, j] of a [B, k, d] negatives (one block of the op; k = 0
    # too, so that its gradient is zeros, as torch's), then shared candidates.
    if isinstance(negatives, (list, tuple)):  # k columns [B, d], each a block
        docs, owned_blocks = [positives, *negatives], 1 + len(negatives)
    elif negatives is not None and negatives.dim() == 3:
        docs, owned_blocks = [positives, negatives], 1 + negatives.shape[1]
    else:
        docs, owned_blocks = [positives] + ([] if negatives is None else [negatives]), 1
    rows = queries.shape[0]
    docs = [block.to(dtype) for block in docs]
    queries = queries.to(dtype)
    offset = 0
    import torch.distributed as dist

    if gather_across_devices and dist.is_available() and dist.is_initialized():
        _mnr.check_gather_shapes(queries, negatives, dtype)
        # Each block is gathered on its own (along its first dimension) so that
        # the gathered docs keep the layout [every rank's positives, every
        # rank's negatives 0, ..., shared].
        docs = [_mnr.gather_with_grad(block) for block in docs]
        queries = _mnr.gather_with_grad(queries)
        offset = dist.get_rank() * rows
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (queries, *docs, scale_tensor))
    # The op normalizes the rows itself (as cos_sim does, eps 1e-12), so that no
    # normalized copy is kept for the backward.
    try:
        return torch.ops.nanfree.mnr_loss(queries, docs, scale_tensor, scale_value, offset, rows,
                                          owned_blocks, bits, per_direction, hardness, strength,
                                          red, wants_grad and red != 0)[0]
    except RuntimeError:
        refuse_torch_func("mnr_loss", queries, *docs, scale_tensor)
        raise


# --- elementwise ops with finite gradients (docs/elementwise.md) -----------------------


def _plain_out(out, *inputs):
    """Whether `out` and `inputs` are plain tensors of one floating dtype, shape and
    device, with no gradient to refuse, no autocast and no trace: then <op>_out
    writes into `out` as it stands (a few microseconds less than the checks and
    promotions of the general path, which such a call would pass unchanged)."""
    if type(out) is not torch.Tensor or not out.dtype.is_floating_point:
        return False
    dtype, shape, device = out.dtype, out.shape, out.device
    grad = torch.is_grad_enabled()
    if grad and out.requires_grad:
        return False
    for t in inputs:
        if (type(t) is not torch.Tensor or t.dtype != dtype or t.shape != shape
                or t.device != device or (grad and t.requires_grad)):
            return False
    return not autocast_on(device.type) and not _is_compiling()


_OUT_OPS = {}


def _out_op(op):
    """torch.ops.nanfree.<op>_out, looked up once."""
    f = _OUT_OPS.get(op)
    if f is None:
        f = _OUT_OPS[op] = getattr(torch.ops.nanfree, f"{op}_out").default
    return f


def _unary(op, input, out):
    """torch.<op>(input, out=out) through nanfree's op of that name: its C++ entry
    point (nanfree._C.<op>, about a microsecond less than torch.ops), or torch.ops
    while torch.compile traces; out= through <op>_out, which writes into `out`
    (computed and copied while torch.compile traces, or for an `out` of another
    dtype)."""
    fast = out is None and _entry_allowed()
    if out is not None and _plain_out(out, input):
        _out_op(op)(input, out)
        return out
    if not fast:
        check_tensors(op, input=input)
        if out is not None:
            check_tensors(op, out=out)
            # torch's out= overloads are on no autocast list: given `out`, an op
            # computes in its inputs' dtype under autocast too (CUDA autocast's
            # log row would compute in float32, its atan2 row refuse a bfloat16
            # input under float16 autocast).
            if autocast_on(input.device.type):
                with torch.autocast(input.device.type, enabled=False):
                    return _unary(op, input, out)
            _refuse_out_with_grad(op, input, out)
            if not _is_compiling():
                if _prepare_out(op, out, input.shape, _elementwise.unary_dtype(op, input), input,
                                stacklevel=4):
                    _out_op(op)(input, out)
                    return out
    try:
        result = getattr(_C if fast else torch.ops.nanfree, op)(input)
    except TypeError:  # the entry point's words for a non-tensor: name the argument
        check_tensors(op, input=input)
        raise
    except RuntimeError:
        refuse_torch_func(op, input)
        raise
    return result if out is None else _into_out(op, out, result, (input,), stacklevel=4)


def sqrt(input, *, out=None):
    """``torch.sqrt``: 0 with gradient 0 below 0 (the square root of the clamp) and
    gradient 0 at 0, where torch's is inf."""
    return _unary("sqrt", input, out)


def log(input, *, out=None):
    """``torch.log``: -inf with gradient 0 at and below 0 (the log of the clamp), where
    torch's value is NaN below 0 and its gradient inf at 0."""
    return _unary("log", input, out)


def log1p(input, *, out=None):
    """``torch.log1p``: -inf with gradient 0 at and below -1."""
    return _unary("log1p", input, out)


def acos(input, *, out=None):
    """``torch.acos``: inputs beyond +-1 (infinities included) take the clamp's value;
    gradient 0 at and beyond +-1, where torch's is -inf or NaN."""
    return _unary("acos", input, out)


def asin(input, *, out=None):
    """``torch.asin``: inputs beyond +-1 take the clamp's value; gradient 0 at and
    beyond +-1."""
    return _unary("asin", input, out)


_FINITE_MAX = {dtype: torch.finfo(dtype).max
               for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def _binary_operand(op, name, value, like):
    """A binary op's argument as a tensor: a tensor as it is; a number (numpy
    scalars included) as a 0-d tensor on like's device, made there without a
    host-to-device copy, of the dtype torch's promotion gives it beside `like`:
    like's floating dtype (a Python scalar does not widen a tensor of its
    category), else the default float dtype (the op's result for an integer
    tensor; written out, as torch.result_type does not trace under compile)."""
    if isinstance(value, torch.Tensor):
        return value
    if is_bool(value):  # torch's binary ops take True and False as 1 and 0
        value = int(value)
    if not is_number(value):
        raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor or a number, got "
                        f"{type(value).__name__}")
    if type(value).__module__ == "numpy":  # a numpy scalar: its Python number
        value = value.item()
    dtype = like.dtype if like.dtype.is_floating_point else torch.get_default_dtype()
    if is_symbolic(value) or _within_range(value, dtype):
        # Made in the dtype at once (a third of the time of the cast below):
        # scalar_tensor rounds as the cast does, but refuses a finite number beyond
        # the dtype's largest (on CUDA for every dtype, on the CPU for float32).
        return torch.scalar_tensor(value, dtype=dtype, device=like.device)
    if type(value) is int:
        if -2**63 <= value < 2**63:
            # An int past 2^53 or the dtype's range: made in int64 and cast, one rounding
            # as torch's own ops give it (through float64 it would be rounded twice).
            return torch.full((), value, dtype=torch.int64, device=like.device).to(dtype)
        # Past int64 (torch refuses it): the nearest float64, or its infinity.
        try:
            value = float(value)
        except OverflowError:  # past float64's range too
            value = math.inf if value > 0 else -math.inf
    # Made in float64 and cast: a number beyond the dtype's range is its infinity
    # (torch.full would refuse it), as in torch's own ops.
    return torch.full((), value, dtype=torch.float64, device=like.device).to(dtype)


def _within_range(value, dtype):
    """Whether torch.scalar_tensor takes the number in the dtype: NaN, an
    infinity, or a finite number up to the dtype's largest (an int also exact in
    float64)."""
    limit = _FINITE_MAX.get(dtype, math.inf)
    if type(value) is int:
        return abs(value) < 2**53 and abs(value) <= limit
    return type(value) is float and (not math.isfinite(value) or abs(value) <= limit)


def _exact_in(dtype, value):
    """Whether the Python number `value` is exactly a value of the half-precision
    dtype (float16, bfloat16): from its float32 bits, without a tensor."""
    if is_symbolic(value):
        return False  # unknown while compiling: take the float32 path
    try:
        bits = struct.unpack("<I", struct.pack("<f", float(value)))[0]
        if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
            return False  # not even a float32
        if dtype == torch.bfloat16:
            return bits & 0xFFFF == 0
        return struct.unpack("<e", struct.pack("<e", float(value)))[0] == value
    except (OverflowError, struct.error):  # beyond float32's or float16's range
        return False


_BINARY_OPS = ("pow", "atan2", "div_no_nan", "xlogy", "xlog1py")
_C_BINARY = {op: getattr(_C, op) for op in _BINARY_OPS}
_C_BINARY_NUMBER = {op: getattr(_C, f"{op}_number") for op in _BINARY_OPS}


def _binary(op, input, other, out, other_name="other"):
    """torch.<op>(input, other, out=out) through nanfree's op of that name: numbers
    become 0-d tensors (torch's promotion of Python scalars), then the op
    broadcasts and promotes as torch's binary ops. torch.pow(tensor, number) and
    tensor / number compute a float16 or bfloat16 tensor in float32 with the
    number unrounded (its other ops, and a number first, round the number to the
    tensor's dtype): where the number is not a value of that dtype, so do pow and
    div_no_nan here (the tensor widened, the result rounded once, as the kernels
    round it). Two plain tensors without `out` go straight to the op's C++ entry
    point (nanfree._C.<op>, about a microsecond less than torch.ops), as the unary
    ops do."""
    if out is None and type(input) is torch.Tensor and _entry_allowed():
        entry = _C_BINARY[op]
        if type(other) is not torch.Tensor:
            # A float or int beside a float32 / float64 tensor: the entry that
            # makes the 0-d tensor _binary_operand would make (in Python it
            # was a third of pow(x, 2.0)'s call).
            if (input.dtype not in (torch.float32, torch.float64)
                    or not _within_range(other, input.dtype)):
                return _binary_general(op, input, other, out, other_name)
            entry = _C_BINARY_NUMBER[op]
        try:
            return entry(input, other)
        except RuntimeError:
            refuse_torch_func(op, input, other)
            raise
    return _binary_general(op, input, other, out, other_name)


def _binary_general(op, input, other, out, other_name):
    """_binary past its fast paths: every argument form, out= and tracing."""
    if out is not None and _plain_out(out, input, other):
        _out_op(op)(input, other, out)
        return out
    if not isinstance(input, torch.Tensor) and not isinstance(other, torch.Tensor):
        check_tensors(op, input=input)  # one argument must be a tensor, as torch's
    if out is not None:
        check_tensors(op, out=out)
        _refuse_out_with_grad(op, input, other, out)
        device_type = (input if isinstance(input, torch.Tensor) else other).device.type
        if autocast_on(device_type):  # out= is on no autocast list (as in _unary)
            with torch.autocast(device_type, enabled=False):
                return _binary_general(op, input, other, out, other_name)
    if (op in ("pow", "div_no_nan") and isinstance(input, torch.Tensor)
            and input.dtype in (torch.float16, torch.bfloat16) and is_number(other)
            and not _exact_in(input.dtype, other)):
        tensor = input
        result = _binary(op, input.float(), other, None, other_name)
        if not (op == "pow" and tensor.device.type == "cuda" and
                torch.is_autocast_enabled("cuda")):  # CUDA autocast: torch's pow is float32
            result = result.to(tensor.dtype)
        return result if out is None else _into_out(op, out, result, (input, other), stacklevel=5)
    if isinstance(input, torch.Tensor):
        other = _binary_operand(op, other_name, other, input)
    else:
        input = _binary_operand(op, "input", input, other)
    if out is not None and not _is_compiling():
        dtype = _elementwise.binary_dtype(op, input, other)
        shape = _elementwise.binary_shape(op, input.shape, other.shape)
        # The result's device (a 0-d CPU tensor joins the other operand's), and
        # the op's own refusal of other devices before `out` is touched.
        ref = input
        if input.device != other.device:
            if input.dim() == 0 and input.device.type == "cpu":
                ref = other
            elif not (other.dim() == 0 and other.device.type == "cpu"):
                check_device(op, "other", input, other)
        if _prepare_out(op, out, shape, dtype, ref, (input, other), stacklevel=5):
            _out_op(op)(input, other, out)
            return out
    try:
        result = getattr(torch.ops.nanfree, op)(input, other)
    except RuntimeError:
        refuse_torch_func(op, input, other)
        raise
    return result if out is None else _into_out(op, out, result, (input, other), stacklevel=5)


def pow(input, exponent, *, out=None):
    """``torch.pow`` (tensor or number base and exponent): at base 0 the
    exponent's gradient is 0 and an infinite derivative in the base counts 0; a
    negative base with a non-integer exponent is clamped to 0 (value pow(0, p),
    gradients 0), where torch's value and gradients are NaN. Integer base and
    exponent: torch.pow's integer result (no gradient to guard)."""
    def integral(t):  # an integer or bool tensor, or a Python / numpy integer
        if isinstance(t, torch.Tensor):
            return not (t.dtype.is_floating_point or t.dtype.is_complex)
        return isinstance(t, int) or type(t).__name__.startswith(("int", "uint"))

    if integral(input) and integral(exponent) and (isinstance(input, torch.Tensor)
                                                   or isinstance(exponent, torch.Tensor)):
        return torch.pow(input, exponent) if out is None else torch.pow(input, exponent, out=out)
    return _binary("pow", input, exponent, out, other_name="exponent")


def atan2(input, other, *, out=None):
    """``torch.atan2`` (angle of the point (other, input)); gradients 0 at the
    origin (torch's) and at infinite inputs, and computed without overflow of
    input**2 + other**2."""
    return _binary("atan2", input, other, out)


def div_no_nan(input, other, *, out=None):
    """``input / other`` with 0 (and gradients 0) where ``other == 0``, and where
    both are infinite; NaN inputs stay NaN (TensorFlow's ``div_no_nan``)."""
    return _binary("div_no_nan", input, other, out)


def xlogy(input, other, *, out=None):
    """``torch.xlogy``: 0 where ``input == 0`` with the gradient in ``other`` 0 there
    (torch's is NaN at other = 0); ``other`` below 0 is clamped to 0."""
    return _binary("xlogy", input, other, out)


def xlog1py(input, other, *, out=None):
    """``torch.special.xlog1py``: 0 where ``input == 0`` with the gradient in
    ``other`` 0 there; ``other`` below -1 is clamped to -1."""
    return _binary("xlog1py", input, other, out)


# --- losses (docs/losses.md) ------------------------------------------------------------

_LOSS_REDUCTIONS = {name: i for i, name in enumerate(_C.LOSS_REDUCTIONS)}


def _loss_entry(op, entry, tensors, *args):
    """A loss's C++ entry point (the common call in one crossing; args end with
    the reduction's name), or None for a call it leaves to
    nanfree/_ops/losses.py: every other call, every error, and the calls
    _entry_allowed leaves to the Python steps."""
    if not _entry_allowed():
        return None
    try:
        return entry(*args[:-1], _LOSS_REDUCTIONS[args[-1]])
    except TypeError:
        return None  # an argument of another type: the Python steps name it
    except RuntimeError:
        refuse_torch_func(op, *tensors)
        raise


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """torch.nn.functional.binary_cross_entropy_with_logits; finite at logits of +-inf."""
    op = "binary_cross_entropy_with_logits"
    reduction = _losses.reduction_of(op, size_average, reduce, reduction)
    result = _loss_entry(op, _C.pointwise_loss, (input, target), input, target, weight, pos_weight,
                         _losses.BCE_WITH_LOGITS, 0.0, 0.0, reduction)
    if result is not None:
        return result
    return _losses.pointwise_call(op, _losses.BCE_WITH_LOGITS, input, target, weight, pos_weight,
                                  reduction=reduction)


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None,
                         reduction="mean"):
    """torch.nn.functional.binary_cross_entropy on probabilities, with the exact loss
    and gradient down to the dtype's smallest probability (no clamp at -100)."""
    op = "binary_cross_entropy"
    reduction = _losses.reduction_of(op, size_average, reduce, reduction)
    result = _loss_entry(op, _C.pointwise_loss, (input, target), input, target, weight, None,
                         _losses.BCE, 0.0, 0.0, reduction)
    if result is not None:
        return result
    return _losses.pointwise_call(op, _losses.BCE, input, target, weight, reduction=reduction)


_KL_DIV_MEAN_WARNING = (
    "reduction: 'mean' divides the total loss by both the batch size and the support size."
    "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
    "'mean' will be changed to behave the same as 'batchmean' in the next major release.")


def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """torch.nn.functional.kl_div; a zero target contributes 0 whatever the input."""
    op = "kl_div"
    if reduction == "mean" and size_average is None and reduce is None:
        _warn_when_eager(_KL_DIV_MEAN_WARNING, stacklevel=2)  # torch's, word for word
    reduction = _losses.reduction_of(op, size_average, reduce, reduction, extra=("batchmean",))
    kind = _losses.KL_DIV_LOG_TARGET if log_target else _losses.KL_DIV
    result = _loss_entry(op, _C.pointwise_loss, (input, target), input, target, None, None, kind,
                         0.0, 0.0, reduction)
    if result is not None:
        return result
    return _losses.pointwise_call(op, kind, input, target, same_shape=False, reduction=reduction)


def sigmoid_focal_loss(inputs, targets, alpha=0.25, gamma=2, reduction="none"):
    """torchvision.ops.sigmoid_focal_loss; finite value and gradient for every gamma >= 0."""
    op = "sigmoid_focal_loss"
    if reduction not in _losses.REDUCTIONS:
        raise ValueError(f"nanfree.{op}: Invalid Value for arg 'reduction': '{reduction} \n "
                         f"Supported reduction modes: 'none', 'mean', 'sum'")
    check_number(op, "alpha", alpha)
    check_number(op, "gamma", gamma)
    if not gamma >= 0:
        raise ValueError(f"nanfree.{op}: `gamma` must be >= 0, got {gamma}")
    result = _loss_entry(op, _C.pointwise_loss, (inputs, targets), inputs, targets, None, None,
                         _losses.SIGMOID_FOCAL, alpha, gamma, reduction)
    if result is not None:
        return result
    return _losses.pointwise_call(op, _losses.SIGMOID_FOCAL, inputs, targets, alpha=alpha,
                                  gamma=gamma, same_shape=False, reduction=reduction)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0, *, mask=None):
    """torch.nn.functional.cross_entropy; `-inf` logits and classes the keyword-only
    `mask` drops (bool or integer, nonzero = the class exists, broadcast to the
    input) do not exist: probability and gradient 0, no label-smoothing mass; a
    position with no kept class or whose target class is dropped gives 0 and is
    left out of the mean, as ignore_index."""
    op = "cross_entropy"
    reduction = _losses.reduction_of(op, size_average, reduce, reduction)
    result = _loss_entry(op, _C.cross_entropy, (input, target), input, target, weight, mask,
                         ignore_index, label_smoothing, reduction)
    if result is not None:
        return result
    check_optional_tensor(op, "mask", mask)
    check_number(op, "label_smoothing", label_smoothing)
    return _losses.cross_entropy_call(input, target, weight, ignore_index, reduction,
                                      label_smoothing, mask)
