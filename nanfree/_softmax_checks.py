"""Op-level argument checks and shapes of the softmax-family ops for the Python
backends (Triton, pure PyTorch): the same errors, with the same words and
exception types, as the C++ checks in csrc/common/softmax_op.h."""

import math

import torch

from . import _checks
from ._checks import acc_dtype, broadcast_mask, check_device, check_float  # noqa: F401  (re-exported)


def wrap_dim(op, t, dim):
    """`dim` in [0, rank) (a 0-d tensor counts as one dimension), else IndexError."""
    return _checks.wrap_dim(op, dim, max(t.dim(), 1), t.dim())


def problem_shape(t, dim):
    """(outer, cols, inner) of a tensor reduced over `dim` (softmax_math.h's SoftmaxShape)."""
    if t.dim() == 0:
        return 1, 1, 1
    return math.prod(t.shape[:dim]), t.shape[dim], math.prod(t.shape[dim + 1:])


def row_shape(t, dim):
    """The input's shape without `dim` (logsumexp's output)."""
    return t.shape[:dim] + t.shape[dim + 1:] if t.dim() else t.shape


def stats_shape(t, dim):
    """The input's shape with `dim` of size 2 holding (max, log_sum); [2] for a 0-d input."""
    if t.dim() == 0:
        return (2,)
    return (*t.shape[:dim], 2, *t.shape[dim + 1:])


def check_forward(op, input, dim, mask):
    """-> (dim wrapped, mask as bool of the input's shape or None)."""
    check_float(op, "input", input)
    dim = wrap_dim(op, input, dim)
    return dim, broadcast_mask(op, input, mask)


def check_backward(op, grad, saved, stats, dim, mask, per_row_grad):
    """-> (dim wrapped, mask as bool of the saved tensor's shape or None)."""
    check_float(op, "grad_output", grad)
    check_float(op, "saved", saved)
    dim = wrap_dim(op, saved, dim)
    if grad.dtype != saved.dtype:
        raise TypeError(f"nanfree.{op}: `grad_output` dtype {grad.dtype} differs from the saved "
                        f"tensor's {saved.dtype}")
    expected = row_shape(saved, dim) if per_row_grad else saved.shape
    if grad.shape != expected:
        raise ValueError(f"nanfree.{op}: `grad_output` has shape {list(grad.shape)}, expected "
                         f"{list(expected)}")
    if stats.shape != stats_shape(saved, dim) or stats.dtype != acc_dtype(saved.dtype):
        raise ValueError(f"nanfree.{op}: `stats` must be the forward's saved row statistics")
    for name, t in (("grad_output", grad), ("stats", stats)):
        check_device(op, name, saved, t)
    return dim, broadcast_mask(op, saved, mask)
