"""The GeM family's Python side (gem, gem_backward over dim 1 of a 3-D input
[outer, n, inner]): the op-level argument checks and shapes of the Python
backends (Triton, pure PyTorch) and the fake kernels, with the same errors,
words and exception types as csrc/common/gem_op.h; the fake kernels,
registered once for every backend; nanfree.ops' conversion of a torch-style p;
and the host-side sum of p's gradient terms both Python backends use. The
schemas are in csrc/registration.cpp; the autograd, also shared by every
backend, in csrc/gem.cpp; the autocast in csrc/autocast.cpp."""

import math

import torch

from .common import (acc_dtype, as_float, check_device, check_eps, check_float, fake_kernels,
                     is_number, is_symbolic)

FORWARD_OPS = ("gem",)
BACKWARD_OPS = ("gem_backward",)
OPS = FORWARD_OPS + BACKWARD_OPS

GEM_STATS = 3  # m, mean, count


def check_gem_p(op, input, p, p_value):
    if p is not None:
        check_float(op, "p", p)
        if p.numel() != 1 or p.dim() > 1:
            raise ValueError(f"nanfree.{op}: a tensor `p` must have shape [] or [1], got "
                             f"{list(p.shape)}")
        check_device(op, "p", input, p)
    elif not is_symbolic(p_value) and not (math.isfinite(p_value) and p_value > 0):
        # A Python p is used as is: pow(mean, 1/p) needs a finite p > 0.
        raise ValueError(f"nanfree.{op}: `p` must be finite and > 0, got {p_value}")


def check_gem_input(op, input, eps, mask):
    check_float(op, "input", input)
    if input.dim() != 3:
        raise ValueError(f"nanfree.{op}: `input` must be 3-D [outer, n, inner] (nanfree.ops.gem "
                         f"views any dims so), got {input.dim()} dimensions")
    check_eps(op, eps)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"nanfree.{op}: `mask` must be bool here (nanfree.ops.gem converts "
                            f"integer masks), got {mask.dtype}")
        if mask.shape != input.shape:
            raise ValueError(f"nanfree.{op}: `mask` has shape {list(mask.shape)} but `input` has "
                             f"{list(input.shape)}")
        check_device(op, "mask", input, mask)


def output_shape(input):
    return (input.shape[0], input.shape[2])


def stats_shape(input):
    return (input.shape[0], input.shape[2], GEM_STATS)


def check_gem(input, p, p_value, eps, mask):
    check_gem_input("gem", input, eps, mask)
    check_gem_p("gem", input, p, p_value)


def check_gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad):
    op = "gem_backward"
    check_gem_input(op, input, eps, mask)
    check_gem_p(op, input, p, p_value)
    if p_grad and p is None:
        raise ValueError(f"nanfree.{op}: `p_grad` needs a tensor `p` (a Python p has no gradient)")
    if tuple(grad_output.shape) != output_shape(input) or grad_output.dtype != input.dtype:
        raise ValueError(f"nanfree.{op}: `grad_output` must be [outer, inner] = "
                         f"{list(output_shape(input))} of the input's dtype, got "
                         f"{list(grad_output.shape)} {grad_output.dtype}")
    check_device(op, "grad_output", input, grad_output)
    if tuple(stats.shape) != stats_shape(input) or stats.dtype != acc_dtype(input.dtype):
        raise ValueError(f"nanfree.{op}: `stats` must be the forward's saved statistics")
    check_device(op, "stats", input, stats)

def torch_style_p(p):
    """(p tensor or None, Python p value) of nanfree.ops.gem's `p`; the op
    checks the values (a Python p finite and > 0, a tensor p's shape)."""
    if isinstance(p, torch.Tensor):
        return p, 0.0
    if not is_number(p):
        raise TypeError(f"nanfree.gem: `p` must be a number or a tensor, got {type(p).__name__}")
    return None, as_float(p)


# --- shared by both Python backends --------------------------------------------------


def gem_divergence_coefficient(k):
    """c_k = 1 / (k! (k + 2)), the coefficients of gem_divergence_h's series (gem_math.h)."""
    return 1.0 / (math.factorial(k) * (k + 2))



GEM_P_GRAD_SCALE = 2.0 ** -64


def gem_p_grad_total(terms, acc):
    """The sum of every reduction's gem_p_grad, in float64 with each term scaled by
    2^-64 (no overflow, even for float64 terms), clamped to acc's range, scaled back."""
    bound = torch.finfo(acc).max * GEM_P_GRAD_SCALE
    scaled = (terms.double() * GEM_P_GRAD_SCALE).sum()
    return (scaled.clamp(-bound, bound) / GEM_P_GRAD_SCALE).to(acc)  # saturated; NaN stays


# --- fake kernels ---------------------------------------------------------------


def _fake_gem(input, p, p_value, eps, mask=None):
    check_gem(input, p, p_value, eps, mask)
    return (input.new_empty(output_shape(input)),
            input.new_empty(stats_shape(input), dtype=acc_dtype(input.dtype)))


def _fake_gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad):
    check_gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad)
    acc = acc_dtype(input.dtype)
    grad_p = input.new_empty((), dtype=acc) if p_grad else input.new_empty((0,), dtype=acc)
    return input.new_empty(input.shape), grad_p


def register():
    fake_kernels([("gem", _fake_gem), ("gem_backward", _fake_gem_backward)])
