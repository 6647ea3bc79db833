"""Fake (meta) kernels of the softmax-family ops, registered once for every
backend. The schemas are in csrc/registration.cpp; the autograd, also shared by
every backend, is in csrc/softmax_autograd.cpp (a C++ autograd kernel costs a
fraction of a Python one per call)."""

import torch

FORWARD_OPS = ("softmax_lastdim", "log_softmax_lastdim", "logsumexp_lastdim")
BACKWARD_OPS = (
    "softmax_lastdim_backward",
    "log_softmax_lastdim_backward",
    "logsumexp_lastdim_backward",
)
OPS = FORWARD_OPS + BACKWARD_OPS


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake_stats(input):
    """Per-row (max, log_sum) saved for the backward."""
    return input.new_empty((*input.shape[:-1], 2), dtype=_acc_dtype(input.dtype))


def _fake_forward(input, mask=None):
    return input.new_empty(input.shape), _fake_stats(input)


def _fake_logsumexp(input, mask=None):
    return input.new_empty(input.shape[:-1]), _fake_stats(input)


def _fake_backward(grad_output, saved, stats, mask=None):
    return saved.new_empty(saved.shape)


def register():
    for name in ("softmax_lastdim", "log_softmax_lastdim"):
        torch.library.register_fake(f"nanfree::{name}", _fake_forward)
    torch.library.register_fake("nanfree::logsumexp_lastdim", _fake_logsumexp)
    for name in BACKWARD_OPS:
        torch.library.register_fake(f"nanfree::{name}", _fake_backward)
