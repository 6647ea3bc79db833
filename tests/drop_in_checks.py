"""The drop-in check shared by the families' tests: a nanfree function and the
torch expression it replaces give the same output and gradients."""

import torch


def match_torch(nf_fn, torch_fn, bases, incoming, view=lambda *ts: ts, **tol):
    """nf_fn and torch_fn on view(*leaves) give the same output (dtype, shape,
    values) and the same gradients for every leaf (dtype, shape, values), for
    the upstream gradient incoming(shape, dtype, device)."""
    results = []
    for fn in (nf_fn, torch_fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in bases]
        out = fn(*view(*leaves))
        grads = torch.autograd.grad(out, leaves, incoming(out.shape, out.dtype, out.device))
        results.append((out.detach(), grads))
    (n_out, n_grads), (t_out, t_grads) = results
    assert n_out.dtype == t_out.dtype and n_out.shape == t_out.shape
    torch.testing.assert_close(n_out, t_out, **tol)
    for n_g, t_g in zip(n_grads, t_grads):
        assert n_g.dtype == t_g.dtype and n_g.shape == t_g.shape
        torch.testing.assert_close(n_g, t_g, **tol)
