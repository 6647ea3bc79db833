"""Op-level argument checks and shapes of the GeM ops (gem, gem_backward over
dim 1 of a 3-D input) for the Python backends (Triton, pure PyTorch) and the
fake kernels: the same errors, with the same words and exception types, as
csrc/common/gem_op.h."""

import math

import torch

from ._checks import acc_dtype, check_device, check_eps, check_float

GEM_STATS = 3  # m, mean, count


def check_gem_p(op, input, p, p_value):
    if p is not None:
        check_float(op, "p", p)
        if p.numel() != 1 or p.dim() > 1:
            raise ValueError(f"nanfree.{op}: a tensor `p` must have shape [] or [1], got "
                             f"{list(p.shape)}")
        check_device(op, "p", input, p)
    elif not (math.isfinite(p_value) and p_value > 0):
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
