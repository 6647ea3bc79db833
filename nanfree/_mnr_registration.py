"""Fake (meta) kernels and autograd of the MNR ops, registered once for every
backend. The schemas are in csrc/registration.cpp. Unlike the older families,
the autograd of mnr_loss is registered from Python (torch.library.register_autograd):
it only routes saved tensors, and the kernels do all the work.

Autograd: mnr_loss called with `grad=True` and a reduced loss (nanfree.ops.mnr_loss
does so when the loss is reduced to a scalar and a gradient is wanted) has already computed
the gradients for an upstream gradient of 1 in the same pass as the loss (no
logit is recomputed); the backward scales them by the incoming gradient.
Otherwise (reduction 'none', or called without `grad`) the backward calls
mnr_loss_backward, which recomputes the logits tile by tile from the saved
logsumexps. Double backward is refused."""

import torch

from ._checks import acc_dtype
from ._mnr_checks import (STATS, check_mnr_loss, check_mnr_loss_backward, loss_shape,
                          no_gradients, unscaled)

FORWARD_OPS = ("mnr_loss",)
BACKWARD_OPS = ("mnr_loss_backward",)
OPS = FORWARD_OPS + BACKWARD_OPS


def _fake_grads(queries, docs, scale, acc, grad):
    if not grad:
        return no_gradients(queries, acc)
    grad_scale = queries.new_empty((), dtype=acc) if scale is not None else \
        queries.new_empty((0,), dtype=acc)
    return queries.new_empty(queries.shape), docs.new_empty(docs.shape), grad_scale


def _fake_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks, directions,
                   per_direction, hardness_mode, hardness_strength, reduction, grad):
    problem = check_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks,
                             directions, per_direction, hardness_mode, hardness_strength,
                             reduction)
    acc = acc_dtype(queries.dtype)
    return (queries.new_empty(loss_shape(problem), dtype=acc),
            queries.new_empty((rows, STATS), dtype=acc),
            *_fake_grads(queries, docs, scale, acc, grad))


def _fake_mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset, rows,
                            owned_blocks, directions, per_direction, hardness_mode,
                            hardness_strength, reduction):
    check_mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset, rows,
                            owned_blocks, directions, per_direction, hardness_mode,
                            hardness_strength, reduction)
    return _fake_grads(queries, docs, scale, acc_dtype(queries.dtype), True)


# mnr_loss's arguments after the tensors (queries, docs, scale), as saved.
_CONFIG = ("scale_value", "offset", "rows", "owned_blocks", "directions", "per_direction",
           "hardness_mode", "hardness_strength", "reduction")


def _setup_context(ctx, inputs, output):
    queries, docs, scale, *config, grad = inputs
    loss, stats, grad_queries, grad_docs, grad_scale = output
    ctx.config = config
    ctx.has_scale = scale is not None
    ctx.scale_shape = None if scale is None else scale.shape
    ctx.scale_dtype = None if scale is None else scale.dtype
    # Gradients computed for an upstream 1 can be scaled by a scalar upstream
    # gradient only; with reduction 'none' (0) the backward recomputes.
    ctx.precomputed = grad and config[-1] != 0
    if ctx.precomputed:
        ctx.save_for_backward(grad_queries, grad_docs, grad_scale)
    else:
        ctx.save_for_backward(queries, docs, scale, stats)
    ctx.mark_non_differentiable(stats, grad_queries, grad_docs, grad_scale)
    # The other outputs never receive a gradient: no zero tensors of their sizes.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *unused):
    if torch.is_grad_enabled():
        raise RuntimeError("nanfree.mnr_loss: double backward is not supported")
    if grad_loss is None:
        # No gradient reached the loss (only its unmaterialized siblings'): none flows back.
        return (None,) * (3 + len(_CONFIG) + 1)
    if ctx.precomputed:
        # The gradients of an upstream 1 (a scalar loss): scaled, not recomputed.
        grad_queries, grad_docs, grad_scale = ctx.saved_tensors
        factor = grad_loss.to(grad_scale.dtype)
        # A product past the dtype's range saturates (unscaled), as the
        # recomputing path's gradients do.
        grad_queries = unscaled(grad_queries.to(factor.dtype), factor, grad_queries.dtype)
        grad_docs = unscaled(grad_docs.to(factor.dtype), factor, grad_docs.dtype)
        grad_scale = unscaled(grad_scale, factor)
    else:
        queries, docs, scale, stats = ctx.saved_tensors
        grad_queries, grad_docs, grad_scale = torch.ops.nanfree.mnr_loss_backward(
            grad_loss.contiguous(), queries, docs, scale, ctx.config[0], stats, *ctx.config[1:])
    if ctx.has_scale:
        # In the scale's dtype, saturating (a float32 scale of float64 embeddings).
        grad_scale = unscaled(grad_scale.reshape(ctx.scale_shape), 1.0, ctx.scale_dtype)
    else:
        grad_scale = None
    return (grad_queries, grad_docs, grad_scale) + (None,) * (len(_CONFIG) + 1)


def register():
    torch.library.register_fake("nanfree::mnr_loss", _fake_mnr_loss)
    torch.library.register_fake("nanfree::mnr_loss_backward", _fake_mnr_loss_backward)
    torch.library.register_autograd("nanfree::mnr_loss", _backward, setup_context=_setup_context)
    # Under autocast the loss is computed in float32 from float32 embeddings,
    # as the composed loss's cross_entropy is (it is on autocast's float32
    # list), and no GEMM inside the kernels is lowered by autocast.
    for op in OPS:
        for device_type in ("cpu", "cuda"):
            torch.library.register_autocast(f"nanfree::{op}", device_type, torch.float32)
