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


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake_forward(input, mask=None):
    rows_shape = input.shape[:-1]
    lse = input.new_empty(rows_shape, dtype=_lse_dtype(input.dtype))
    return input.new_empty(input.shape), lse


def _fake_logsumexp(input, mask=None):
    rows_shape = input.shape[:-1]
    return input.new_empty(rows_shape), input.new_empty(rows_shape, dtype=_lse_dtype(input.dtype))


def _fake_backward(grad_output, saved, lse, mask=None):
    return saved.new_empty(saved.shape)


def _setup_softmax(ctx, inputs, output):
    _, mask = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(out, lse, mask)


def _setup_logsumexp(ctx, inputs, output):
    input, mask = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(input, lse, mask)


def _softmax_backward(ctx, grad_out, _grad_lse):
    out, lse, _ = ctx.saved_tensors
    return torch.ops.nanfree.softmax_lastdim_backward(grad_out, out, lse), None


def _log_softmax_backward(ctx, grad_out, _grad_lse):
    out, lse, mask = ctx.saved_tensors
    return torch.ops.nanfree.log_softmax_lastdim_backward(grad_out, out, lse, mask), None


def _logsumexp_backward(ctx, grad_out, _grad_lse):
    input, lse, mask = ctx.saved_tensors
    return torch.ops.nanfree.logsumexp_lastdim_backward(grad_out, input, lse, mask), None


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
