"""Under torch.autocast each op returns the dtype the torch op it replaces
returns on that device type: CUDA autocast computes softmax, log_softmax and
logsumexp in float32; CPU autocast leaves them at the input's dtype. An
explicit dtype= is kept, as torch keeps it."""

import pytest
import torch
from conftest import DEVICES

import nanfree.ops as nf

OPS = ["softmax", "log_softmax", "logsumexp"]
INPUT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _pair(op, x, **kwargs):
    """(nanfree result, torch result) of the op over the last dim."""
    return getattr(nf, op)(x, -1, **kwargs), getattr(torch, op)(x, -1, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_result_dtype_matches_torch(device, autocast_dtype, input_dtype, op):
    x = torch.randn(3, 7, device=device, dtype=input_dtype, requires_grad=True)
    with torch.autocast(device, dtype=autocast_dtype):
        ours, theirs = _pair(op, x)
    assert ours.dtype == theirs.dtype, f"{op} under {device} autocast: {ours.dtype} vs torch {theirs.dtype}"
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    (grad,) = torch.autograd.grad(ours.sum(), x)
    assert grad.dtype == input_dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_explicit_dtype_is_kept_under_autocast(device, op, dtype):
    x = torch.randn(3, 7, device=device, dtype=torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        ours, theirs = _pair(op, x, dtype=dtype)
    assert ours.dtype == theirs.dtype == dtype


def test_cuda_autocast_kernel_is_registered_for_every_forward_op():
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"nanfree::{op}", "AutocastCUDA")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("input_dtype", INPUT_DTYPES, ids=str)
def test_cuda_autocast_kernel_computes_in_float32(op, input_dtype):
    # The AutocastCUDA kernel itself, called on CPU tensors through the
    # dispatcher (this runs without a GPU): half inputs become float32,
    # float32 and float64 stay, and the gradient returns in the input's dtype.
    x = torch.randn(3, 7, dtype=input_dtype, requires_grad=True)
    autocast_cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
    out, stats = getattr(torch.ops.nanfree, op).default.redispatch(autocast_cuda, x, -1, None)
    expected = torch.float64 if input_dtype == torch.float64 else torch.float32
    assert out.dtype == expected and stats.dtype == expected
    torch.testing.assert_close(out, getattr(torch, op)(x.to(expected), -1))
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.dtype == input_dtype
