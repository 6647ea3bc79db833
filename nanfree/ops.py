"""Drop-in replacements for torch functions that never return NaN from non-NaN input.

Signatures copy torch's; extras are keyword-only. See README.md for the contract.

Each function calls its operator through the C++ entry points of ``nanfree._C``
(one call, checks done once, in C++), or through ``torch.ops.nanfree`` while
``torch.compile`` traces it. Argument errors name the op and the argument:
``TypeError`` for a wrong type or dtype, ``IndexError`` for a ``dim`` out of
range, ``ValueError`` for a mask that does not broadcast or is on another device.
"""

from collections.abc import Sequence

import torch

from . import _backends  # noqa: F401  (loads the kernels and registrations)
from . import _C
from ._softmax_checks import broadcast_mask, check_float, wrap_dim

__all__ = ["softmax", "log_softmax", "logsumexp"]

_is_compiling = torch.compiler.is_compiling


def _check_python_types(op, input, dim, dtype=None, mask=None):
    """Raises the TypeError naming the argument that is not of its Python type
    (the C++ entry points only say that the call did not match)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `input` must be a torch.Tensor, got {type(input).__name__}")
    if not isinstance(dim, int):
        raise TypeError(f"nanfree.{op}: `dim` must be an int, got {type(dim).__name__}")
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
