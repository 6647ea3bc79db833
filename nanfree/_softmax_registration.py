"""Fake (meta) kernels of the softmax-family ops, registered once for every
backend. The schemas are in csrc/registration.cpp; the autograd and autocast,
also shared by every backend, are in csrc/softmax_autograd.cpp and
csrc/softmax_autocast.cpp (C++ kernels cost a fraction of Python ones per call)."""

import torch

from ._softmax_checks import acc_dtype, check_backward, check_forward, row_shape, stats_shape

FORWARD_OPS = ("softmax", "log_softmax", "logsumexp")
BACKWARD_OPS = ("softmax_backward", "log_softmax_backward", "logsumexp_backward")
OPS = FORWARD_OPS + BACKWARD_OPS


def _fake_stats(input, dim):
    """(max, log_sum) along `dim`, saved for the backward."""
    return input.new_empty(stats_shape(input, dim), dtype=acc_dtype(input.dtype))


# The fake kernels check their arguments as the real ones do: they also serve
# the meta device, which a mixed-device call (a mask on meta) dispatches to.


def _fake_distribution(op):
    def fake(input, dim, mask=None):
        dim, _ = check_forward(op, input, dim, mask)
        return input.new_empty(input.shape), _fake_stats(input, dim)

    return fake


def _fake_logsumexp(input, dim, mask=None):
    dim, _ = check_forward("logsumexp", input, dim, mask)
    return input.new_empty(row_shape(input, dim)), _fake_stats(input, dim)


def _fake_backward(op, per_row_grad):
    def fake(grad_output, saved, stats, dim, mask=None):
        check_backward(op, grad_output, saved, stats, dim, mask, per_row_grad)
        return saved.new_empty(saved.shape)

    return fake


def register():
    for name in ("softmax", "log_softmax"):
        torch.library.register_fake(f"nanfree::{name}", _fake_distribution(name))
    torch.library.register_fake("nanfree::logsumexp", _fake_logsumexp)
    for name in BACKWARD_OPS:
        fake = _fake_backward(name, per_row_grad=name == "logsumexp_backward")
        torch.library.register_fake(f"nanfree::{name}", fake)
