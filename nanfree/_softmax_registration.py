"""Fake (meta) kernels and autograd of the softmax-family ops, registered once
for every backend. The schemas are in csrc/registration.cpp."""

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


def _setup_softmax(ctx, inputs, output):
    _, mask = inputs
    out, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.save_for_backward(out, stats, mask)


def _setup_logsumexp(ctx, inputs, output):
    input, mask = inputs
    _, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.save_for_backward(input, stats, mask)


def _softmax_backward(ctx, grad_out, _grad_stats):
    out, stats, _ = ctx.saved_tensors
    return torch.ops.nanfree.softmax_lastdim_backward(grad_out, out, stats), None


def _log_softmax_backward(ctx, grad_out, _grad_stats):
    out, stats, mask = ctx.saved_tensors
    return torch.ops.nanfree.log_softmax_lastdim_backward(grad_out, out, stats, mask), None


def _logsumexp_backward(ctx, grad_out, _grad_stats):
    input, stats, mask = ctx.saved_tensors
    return torch.ops.nanfree.logsumexp_lastdim_backward(grad_out, input, stats, mask), None


def register():
    for name in ("softmax_lastdim", "log_softmax_lastdim"):
        torch.library.register_fake(f"nanfree::{name}", _fake_forward)
    torch.library.register_fake("nanfree::logsumexp_lastdim", _fake_logsumexp)
    for name in BACKWARD_OPS:
        torch.library.register_fake(f"nanfree::{name}", _fake_backward)
    torch.library.register_autograd(
        "nanfree::softmax_lastdim", _softmax_backward, setup_context=_setup_softmax
    )
    torch.library.register_autograd(
        "nanfree::log_softmax_lastdim", _log_softmax_backward, setup_context=_setup_softmax
    )
    torch.library.register_autograd(
        "nanfree::logsumexp_lastdim", _logsumexp_backward, setup_context=_setup_logsumexp
    )
