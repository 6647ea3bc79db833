"""Fake (meta) kernels of the GeM ops, registered once for every backend. The
schemas are in csrc/registration.cpp; the autograd and autocast, also shared
by every backend, are in csrc/gem_autograd.cpp and csrc/gem_autocast.cpp. The
fake kernels check their arguments as the real ones do: they also serve the
meta device."""

import torch

from ._checks import acc_dtype
from ._gem_checks import check_gem, check_gem_backward, output_shape, stats_shape

FORWARD_OPS = ("gem",)
BACKWARD_OPS = ("gem_backward",)
OPS = FORWARD_OPS + BACKWARD_OPS


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
    torch.library.register_fake("nanfree::gem", _fake_gem)
    torch.library.register_fake("nanfree::gem_backward", _fake_gem_backward)
