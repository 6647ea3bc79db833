"""Under torch.autocast each op of the cosine family returns the dtype of the
torch code it replaces on that device type: F.cosine_similarity, F.normalize,
and for cos_sim sentence-transformers' F.normalize(a) @ F.normalize(b).T.
CUDA autocast computes cosine_similarity and normalize in float32; its matmul
(so cos_sim's GEMM) runs in the autocast dtype, on CPU as on CUDA; CPU autocast
leaves cosine_similarity and normalize at the input's dtype. The gradient
always returns in the input's dtype."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES

import nanfree.ops as nf

INPUT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _composed_cos_sim(a, b):
    return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T


# op -> (nanfree, the torch code it replaces), both over x1 [3, 7] and x2 [4, 7].
OPS = {
    "cosine_similarity": (lambda a, b: nf.cosine_similarity(a, b[:3]),
                          lambda a, b: F.cosine_similarity(a, b[:3])),
    "normalize": (lambda a, b: nf.normalize(a), lambda a, b: F.normalize(a)),
    "normalize p=3": (lambda a, b: nf.normalize(a, 3.0, -1), lambda a, b: F.normalize(a, 3.0, -1)),
    "cos_sim": (nf.cos_sim, _composed_cos_sim),
    "cos_sim 1-D": (lambda a, b: nf.cos_sim(a[0], b), lambda a, b: _composed_cos_sim(a[:1], b)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_result_dtype_matches_torch(device, autocast_dtype, input_dtype, op):
    gen = torch.Generator().manual_seed(0)
    x1 = torch.randn(3, 7, generator=gen).to(device, input_dtype).requires_grad_(True)
    x2 = torch.randn(4, 7, generator=gen).to(device, input_dtype).requires_grad_(True)
    ours_fn, theirs_fn = OPS[op]
    with torch.autocast(device, dtype=autocast_dtype):
        ours = ours_fn(x1, x2)
        theirs = theirs_fn(x1, x2)
    assert ours.dtype == theirs.dtype, f"{op} under {device} autocast: {ours.dtype} vs torch {theirs.dtype}"
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(ours.sum(), (x1, x2), allow_unused=True)
    for grad in grads:
        assert grad is None or (grad.dtype == input_dtype and torch.isfinite(grad).all())
    assert grads[0] is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_zero_vector_under_autocast(device, autocast_dtype):
    # Autocast's casts keep the zero vector's rules: similarity 0, gradient 0.
    x1 = torch.randn(3, 7, device=device)
    x1[1] = 0
    x1.requires_grad_(True)
    x2 = torch.randn(4, 7, device=device)
    with torch.autocast(device, dtype=autocast_dtype):
        out = nf.cos_sim(x1, x2).float().sum() + nf.cosine_similarity(x1, x2[:3]).float().sum()
        out = out + nf.normalize(x1).float().sum()
    (grad,) = torch.autograd.grad(out, x1)
    assert torch.isfinite(grad).all() and (grad[1] == 0).all() and (grad[0] != 0).any()


@pytest.mark.backend_independent  # registrations only
def test_autocast_kernels_are_registered():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("normalize", "cosine_similarity", "cos_sim_matrix"):
        assert has_kernel(f"nanfree::{op}", "AutocastCUDA")
    # CPU autocast casts for matmul only: cos_sim's GEMM.
    assert has_kernel("nanfree::cos_sim_matrix", "AutocastCPU")
    for op in ("normalize", "cosine_similarity"):
        assert not has_kernel(f"nanfree::{op}", "AutocastCPU")


AUTOCAST_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)


@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_cuda_autocast_kernels_compute_in_float32(input_dtype):
    # The AutocastCUDA kernels themselves, called on CPU tensors through the
    # dispatcher (this runs without a GPU): half inputs become float32,
    # float32 and float64 stay, and the gradient returns in the input's dtype.
    gen = torch.Generator().manual_seed(1)
    x1 = torch.randn(3, 7, generator=gen).to(input_dtype).requires_grad_(True)
    x2 = torch.randn(3, 7, generator=gen).to(input_dtype).requires_grad_(True)
    expected = torch.float64 if input_dtype == torch.float64 else torch.float32
    ops = torch.ops.nanfree
    out, stats = ops.normalize.default.redispatch(AUTOCAST_CUDA, x1, 1e-12)
    assert out.dtype == expected and stats.dtype == expected
    torch.testing.assert_close(out, F.normalize(x1.detach().to(expected), dim=-1))
    cos, cos_stats = ops.cosine_similarity.default.redispatch(AUTOCAST_CUDA, x1, x2, 1e-8)
    assert cos.dtype == expected and cos_stats.dtype == expected
    torch.testing.assert_close(cos, F.cosine_similarity(x1.detach().to(expected),
                                                        x2.detach().to(expected), -1))
    grads = torch.autograd.grad(out.sum() + cos.sum(), (x1, x2))
    assert all(g.dtype == input_dtype and torch.isfinite(g).all() for g in grads)


@contextlib.contextmanager
def _autocast_dtype(device_type, dtype):
    """The autocast dtype of a device type, for the duration of a test."""
    previous = torch.get_autocast_dtype(device_type)
    torch.set_autocast_dtype(device_type, dtype)
    try:
        yield
    finally:
        torch.set_autocast_dtype(device_type, previous)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_cuda_autocast_cos_sim_matrix_runs_in_lower_precision(autocast_dtype, input_dtype):
    # As torch.mm under CUDA autocast: any floating input but float64 is cast
    # to the autocast dtype (the result is in it); float64 is left alone.
    gen = torch.Generator().manual_seed(2)
    a = F.normalize(torch.randn(3, 7, generator=gen, dtype=torch.float64)).to(input_dtype)
    b = F.normalize(torch.randn(4, 7, generator=gen, dtype=torch.float64)).to(input_dtype)
    a.requires_grad_(True)
    b.requires_grad_(True)
    expected = torch.float64 if input_dtype == torch.float64 else autocast_dtype
    with _autocast_dtype("cuda", autocast_dtype):
        out = torch.ops.nanfree.cos_sim_matrix.default.redispatch(AUTOCAST_CUDA, a, b)
    assert out.dtype == expected
    reference = (a.detach().to(expected).double() @ b.detach().to(expected).double().T)
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=1e-2)
    grads = torch.autograd.grad(out.sum(), (a, b))
    assert all(g.dtype == input_dtype for g in grads)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_registered_ops_under_cpu_autocast(autocast_dtype, input_dtype):
    # The ops called directly: CPU autocast casts cos_sim_matrix's operands
    # (float64 excepted) and leaves normalize and cosine_similarity alone.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, generator=gen).to(input_dtype)
    unit = nf.normalize(x)
    with torch.autocast("cpu", dtype=autocast_dtype):
        matrix = torch.ops.nanfree.cos_sim_matrix(unit, unit)
        out, stats = torch.ops.nanfree.normalize(x, 1e-12)
        cos, _ = torch.ops.nanfree.cosine_similarity(x, x, 1e-8)
    assert matrix.dtype == (torch.float64 if input_dtype == torch.float64 else autocast_dtype)
    assert out.dtype == cos.dtype == input_dtype
    assert stats.dtype == (torch.float64 if input_dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(matrix.diagonal().double(), torch.ones(3, dtype=torch.float64),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(cos, torch.ones(3, dtype=input_dtype))
