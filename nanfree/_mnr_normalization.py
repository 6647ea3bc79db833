"""The normalization around the MNR ops of the Python backends (Triton, pure
PyTorch), as csrc/common/mnr_driver.h does it for the compiled ones: the ops
take raw embeddings, normalize their rows with the cosine family's op (as
cos_sim does, eps 1e-12) and return the gradients of the raw embeddings,
taken back through normalize_backward. A backend's `core` functions see the
normalized rows and return the gradients of the normalized rows in the
accumulation dtype (or the inputs' dtype)."""

import torch

MNR_NORMALIZE_EPS = 1e-12  # kMnrNormalizeEps of mnr_math.h


def _normalize(t):
    return torch.ops.nanfree.normalize(t.contiguous(), MNR_NORMALIZE_EPS)


def _raw_grad(grad, normalized, stats):
    dtype = normalized.dtype
    if dtype in (torch.float16, torch.bfloat16):
        # Half gradients saturate at the type's largest finite value (as the
        # cosine family's); NaN stays NaN through clamp.
        big = torch.finfo(dtype).max
        grad = grad.clamp(-big, big)
    return torch.ops.nanfree.normalize_backward(grad.to(dtype).contiguous(), normalized, stats)


def on_raw_embeddings(core_forward, core_backward, check_forward, check_backward):
    """(mnr_loss, mnr_loss_backward) op functions over a backend's cores:
    core_forward(queries_hat, docs_hat, scale, scale_value, ..., grad) and
    core_backward(grad_loss, queries_hat, docs_hat, ...), with the ops'
    signatures (csrc/registration.cpp)."""

    def mnr_loss(queries, docs, scale, scale_value, *config):
        check_forward(queries, docs, scale, scale_value, *config[:-1])
        (q_hat, q_stats), (d_hat, d_stats) = _normalize(queries), _normalize(docs)
        loss, stats, gq, gd, gs = core_forward(q_hat, d_hat, scale, scale_value, *config)
        if config[-1]:  # grad
            gq, gd = _raw_grad(gq, q_hat, q_stats), _raw_grad(gd, d_hat, d_stats)
        return loss, stats, gq, gd, gs

    def mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, *config):
        check_backward(grad_loss, queries, docs, scale, scale_value, stats, *config)
        (q_hat, q_stats), (d_hat, d_stats) = _normalize(queries), _normalize(docs)
        gq, gd, gs = core_backward(grad_loss, q_hat, d_hat, scale, scale_value, stats, *config)
        return _raw_grad(gq, q_hat, q_stats), _raw_grad(gd, d_hat, d_stats), gs

    return mnr_loss, mnr_loss_backward
