"""Under torch.autocast, GeM pooling returns the dtype of the torch code it
replaces on that device type: the composition clamp, pow, mean (or cirtorch's
avg_pool2d), pow. CUDA autocast runs pow in float32, so the composition, and
nanfree.ops.gem, return float32 for half inputs; CPU autocast leaves the
composition, and gem, at the input's dtype. The input's gradient always
returns in the input's dtype, p's in p's."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, INTERPRETED

import nanfree.nn as nfnn
import nanfree.ops as nf

INPUT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _composed(x, p, dim, eps=1e-6, mask=None):
    powered = x.clamp(min=eps).pow(p)
    if mask is None:
        return powered.mean(dim=dim).pow(1 / p)
    keep = mask.to(powered.dtype)
    return ((powered * keep).sum(dim=dim) / keep.sum(dim=dim)).pow(1 / p)


def _cirtorch(x, p, eps=1e-6):
    return F.avg_pool2d(x.clamp(min=eps).pow(p), (x.size(-2), x.size(-1))).pow(1.0 / p)


# op -> (nanfree, the torch code it replaces), over x [2, 3, 4, 5] and p (a 0-d
# float32 tensor, or a Python float): with p a 0-d tensor torch's composition
# keeps x's dtype, as nanfree does.
OPS = {
    "gem dim -1": (lambda x, p: nf.gem(x, p, -1), lambda x, p: _composed(x, p, -1)),
    "gem dims (2, 3) float p": (lambda x, p: nf.gem(x, 2.5, (2, 3)),
                                lambda x, p: _composed(x, 2.5, (2, 3))),
    "gem tokens mask": (lambda x, p: nf.gem(x[0], p, 1, mask=(torch.arange(4, device=x.device)
                                                              < 3)[None, :, None]),
                        lambda x, p: _composed(x[0], p, 1, mask=(torch.arange(4, device=x.device)
                                                                 < 3)[None, :, None])),
    "gem_pool2d": (lambda x, p: nf.gem_pool2d(x, p), _cirtorch),
}


def _inputs(device, input_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(2, 3, 4, 5, generator=gen) + 0.1).to(device, input_dtype).requires_grad_(True)
    p = torch.tensor(3.0, device=device, requires_grad=True)
    return x, p


# (Under Triton's interpreter: one autocast dtype, two input dtypes.)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16] if INTERPRETED else
                         [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16] if INTERPRETED else
                         INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_result_dtype_matches_torch(device, autocast_dtype, input_dtype, op):
    x, p = _inputs(device, input_dtype)
    ours_fn, theirs_fn = OPS[op]
    with torch.autocast(device, dtype=autocast_dtype):
        ours = ours_fn(x, p)
        theirs = theirs_fn(x, p)
    assert ours.dtype == theirs.dtype, \
        f"{op} under {device} autocast: {ours.dtype} vs torch {theirs.dtype}"
    expected = input_dtype if device == "cpu" or input_dtype == torch.float64 else torch.float32
    assert ours.dtype == expected
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(ours.sum(), (x, p), allow_unused=True)
    assert grads[0].dtype == input_dtype and torch.isfinite(grads[0]).all()
    assert grads[1] is None or (grads[1].dtype == torch.float32 and torch.isfinite(grads[1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_cirtorch_module_under_autocast(device, input_dtype):
    # cirtorch keeps p as Parameter(torch.ones(1) * 3): a 1-D float32 tensor,
    # which promotes a half input to float32 in torch's composition. nanfree
    # uses p in float32 without promoting: the result keeps the input's dtype
    # (float32 under CUDA autocast, as the composition).
    gem = nfnn.GeM().to(device)
    x, _ = _inputs(device, input_dtype, seed=1)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = gem(x)
        theirs = _cirtorch(x, gem.p)
    expected = input_dtype if device == "cpu" or input_dtype == torch.float64 else torch.float32
    assert out.dtype == expected and out.shape == (2, 3, 1, 1)
    torch.testing.assert_close(out.float(), theirs.float(), rtol=2e-2, atol=2e-2)
    out.sum().backward()
    assert x.grad.dtype == input_dtype and gem.p.grad.dtype == torch.float32
    assert torch.isfinite(gem.p.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fully_masked_under_autocast(device, autocast_dtype):
    # Autocast's casts keep the rules: a fully padded sequence gives 0, gradient 0.
    tokens = torch.randn(3, 5, 4, device=device, requires_grad=True)
    attention = torch.tensor([[1, 1, 0, 0, 0], [0] * 5, [1] * 5], device=device)
    pool = nfnn.GeMTokenPooling().to(device)
    with torch.autocast(device, dtype=autocast_dtype):
        out = pool(tokens, attention)
    assert (out[1] == 0).all()
    out.float().sum().backward()
    assert (tokens.grad[1] == 0).all() and torch.isfinite(tokens.grad).all()
    assert torch.isfinite(pool.p.grad).all()


@pytest.mark.backend_independent  # registrations only
def test_autocast_kernels_are_registered():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has_kernel("nanfree::gem", "AutocastCUDA")
    # CPU autocast leaves clamp, pow and mean alone: gem too.
    assert not has_kernel("nanfree::gem", "AutocastCPU")
    # The backward op is called from autograd, outside autocast's reach.
    assert not has_kernel("nanfree::gem_backward", "AutocastCUDA")


AUTOCAST_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("p_kind", ["tensor"] if INTERPRETED else ["tensor", "float"])
def test_cuda_autocast_kernel_computes_in_float32(input_dtype, p_kind):
    # The AutocastCUDA kernel itself, called on CPU tensors through the
    # dispatcher (this runs without a GPU): half inputs become float32,
    # float32 and float64 stay, and the gradient returns in the input's dtype.
    gen = torch.Generator().manual_seed(2)
    x = (torch.rand(2, 6, 3, generator=gen) + 0.1).to(input_dtype).requires_grad_(True)
    mask = torch.rand(2, 6, 3, generator=gen) < 0.7
    p = torch.tensor([3.0], requires_grad=True) if p_kind == "tensor" else None
    expected = torch.float64 if input_dtype == torch.float64 else torch.float32
    out, stats = torch.ops.nanfree.gem.default.redispatch(AUTOCAST_CUDA, x, p, 3.0, 1e-6, mask)
    assert out.dtype == expected and stats.dtype == expected
    reference = _composed(x.detach().to(expected), 3.0, 1, mask=mask)
    torch.testing.assert_close(out, reference)
    leaves = (x, p) if p is not None else (x,)
    grads = torch.autograd.grad(out.sum(), leaves)
    assert grads[0].dtype == input_dtype and torch.isfinite(grads[0]).all()
    if p is not None:
        assert grads[1].dtype == torch.float32 and torch.isfinite(grads[1]).all()


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_registered_op_under_cpu_autocast(input_dtype):
    # The op called directly: CPU autocast leaves it at the input's dtype.
    x = (torch.rand(2, 6, 3) + 0.1).to(input_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, stats = torch.ops.nanfree.gem(x, None, 2.0, 1e-6, None)
    assert out.dtype == input_dtype
    assert stats.dtype == (torch.float64 if input_dtype == torch.float64 else torch.float32)
    reference = _composed(x.double(), 2.0, 1)
    tol = 2e-2 if input_dtype in (torch.float16, torch.bfloat16) else 1e-5
    torch.testing.assert_close(out.double(), reference, rtol=tol, atol=tol)
