"""What every op family's Python side shares: the op-level argument checks of
the Python backends and fake kernels (the same errors, with the same words and
exception types, as csrc/common/checks.h), the checks of Python argument types
that nanfree.ops makes before calling an op (the C++ entry points only say
that a call did not match), and the accumulation dtype."""

import math

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_float(op, name, t):
    if t.dtype not in _FLOATS:
        raise TypeError(
            f"nanfree.{op}: `{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_device(op, name, ref, t, ref_name="input"):
    if t.device != ref.device:
        raise ValueError(
            f"nanfree.{op}: `{name}` is on {t.device} but `{ref_name}` is on {ref.device}")


def check_eps(op, eps):
    if not (isinstance(eps, (int, float)) and 0 < eps < math.inf):
        raise ValueError(f"nanfree.{op}: `eps` must be positive and finite, got {eps!r}")


def wrap_dim(op, dim, rank, ndim):
    """`dim` wrapped into [0, rank), else IndexError; `ndim` is the tensor's number
    of dimensions for the message (as csrc/common/checks.h)."""
    if not -rank <= dim < rank:
        raise IndexError(
            f"nanfree.{op}: `dim` {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % rank


def _broadcasts_to(src, dst):
    if len(src) > len(dst):
        return False
    lead = len(dst) - len(src)
    return all(s in (1, dst[lead + d]) for d, s in enumerate(src))


def broadcast_mask(op, ref, mask):
    """The mask as a bool tensor of ref's shape (an expanded view), or None."""
    if mask is None:
        return None
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"nanfree.{op}: `mask` must be bool or integer (nonzero = keep), "
                        f"got {mask.dtype}")
    check_device(op, "mask", ref, mask)
    if not _broadcasts_to(mask.shape, ref.shape):
        raise ValueError(f"nanfree.{op}: `mask` of shape {list(mask.shape)} does not broadcast "
                         f"to the input's shape {list(ref.shape)}")
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep.expand(ref.shape)


def check_tensors(op, **tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")


def check_optional_tensor(op, name, t):
    if t is not None and not isinstance(t, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor or None, "
                        f"got {type(t).__name__}")


def check_number(op, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"nanfree.{op}: `{name}` must be a number, got {type(value).__name__}")


def check_dim_type(op, dim):
    if not isinstance(dim, int):
        raise TypeError(f"nanfree.{op}: `dim` must be an int, got {type(dim).__name__}")


def fake_kernels(pairs):
    """Registers each (op name, fake kernel) pair: fake kernels check their
    arguments as the real ones do (they also serve the meta device, which a
    mixed-device call dispatches to)."""
    for name, fake in pairs:
        torch.library.register_fake(f"nanfree::{name}", fake)
