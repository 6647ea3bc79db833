"""The drop-in checks shared by the families' tests: a nanfree function and the
torch expression it replaces give the same output and gradients, and write
into `out=` as torch does."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


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


def out_matches_torch(nf_fn, torch_fn, args):
    """nf_fn(*args, out=o) writes nf_fn(*args) (torch_fn's result within the
    dtype's tolerance) into o itself (its storage and strides kept, its version
    counter bumped), for an `out` of the result's dtype and a wider one,
    contiguous (bit for bit) and strided (within the dtype's tolerance: a CPU
    kernel's strided loop is element by element, whose log can differ from the
    vector loop's by a rounding, as torch's loops do); an `out` whose elements
    share memory is refused as torch refuses it."""
    expected = nf_fn(*args)
    torch.testing.assert_close(expected, torch_fn(*args), equal_nan=True)
    shape, dtype, device = expected.shape, expected.dtype, expected.device

    def contiguous(dt):
        return torch.empty(shape, dtype=dt, device=device)

    def strided(dt):  # every other element of a wider buffer, dims reversed
        wide = torch.empty(tuple(reversed(shape))[:-1] + (2 * shape[0],), dtype=dt, device=device)
        return wide[..., ::2].permute(*reversed(range(len(shape))))

    for make in (contiguous, strided):
        for dt in (dtype, torch.float64):
            out = make(dt)
            ptr, stride, version = out.data_ptr(), out.stride(), out._version
            assert nf_fn(*args, out=out) is out
            assert out.data_ptr() == ptr and out.stride() == stride and out._version > version
            exact = dict(rtol=0, atol=0) if make is contiguous else {}
            torch.testing.assert_close(out.to(dtype), expected, equal_nan=True, **exact)
    shared = torch.empty(1, dtype=dtype, device=device).expand(shape)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch_fn(*args, out=shared)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        nf_fn(*args, out=shared)


class _TopLevelOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def top_level_ops(fn, *args, **kwargs):
    """The names of the ops fn(*args, **kwargs) dispatches (not those its ops'
    kernels call), e.g. ["nanfree.sqrt_out.default"]."""
    with _TopLevelOps() as mode:
        fn(*args, **kwargs)
    return mode.names


def allocations_and_copies(fn, *args, **kwargs):
    """The ATen ops fn(*args, **kwargs) runs, at any depth, that allocate a tensor
    or copy one (the profiler sees the ops a kernel calls too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)
    names = {event.name for event in prof.events()}
    return sorted(n for n in names if n.startswith(("aten::empty", "aten::copy_", "aten::clone",
                                                     "aten::contiguous", "aten::_to_copy")))
