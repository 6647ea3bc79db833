"""Bad input gets a clear error naming the op and the argument."""

import pytest
import torch

import nanfree.ops as nf


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64,
                                   torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_non_float_input(op, dtype):
    x = torch.zeros(2, 3, dtype=dtype)
    if op == "logsumexp" and not (dtype.is_floating_point or dtype.is_complex):
        # As torch's: integers and bool are taken in the default dtype.
        x = torch.tensor([[0, 3, -2], [5, 1, 1]]).to(dtype)
        for dim in (-1, 0, (0, 1)):
            got, want = nf.logsumexp(x, dim), torch.logsumexp(x, dim)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)
        return
    with pytest.raises(TypeError, match=f"nanfree.{op}: `input`"):
        getattr(nf, op)(x, -1)


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("dim", [2, -3, 5])
def test_dim_out_of_range(op, dim):
    with pytest.raises(IndexError, match=f"nanfree.{op}: `dim`"):
        getattr(nf, op)(torch.zeros(2, 3), dim)


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_dim_of_wrong_type(op):
    with pytest.raises(TypeError, match=f"nanfree.{op}: `dim`"):
        getattr(nf, op)(torch.zeros(2, 3), 1.0)


def test_logsumexp_repeated_dim():
    with pytest.raises(ValueError, match="nanfree.logsumexp: `dim`"):
        nf.logsumexp(torch.zeros(2, 3), (1, -1))


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_mask_of_wrong_shape(op):
    with pytest.raises(ValueError, match=f"nanfree.{op}: `mask`"):
        getattr(nf, op)(torch.zeros(2, 3), -1, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=f"nanfree.{op}: `mask`"):
        # broadcastable together, but the mask would grow the input
        getattr(nf, op)(torch.zeros(3), -1, mask=torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_mask_of_wrong_dtype(op, dtype):
    with pytest.raises(TypeError, match=f"nanfree.{op}: `mask`"):
        getattr(nf, op)(torch.zeros(2, 3), -1, mask=torch.ones(2, 3, dtype=dtype))


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_mask_on_another_device(op):
    with pytest.raises(ValueError, match=f"nanfree.{op}: `mask` is on meta"):
        getattr(nf, op)(torch.zeros(2, 3), -1, mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))


def test_integer_mask_is_accepted():
    x = torch.randn(2, 4)
    am = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    torch.testing.assert_close(nf.softmax(x, -1, mask=am), nf.softmax(x, -1, mask=am.bool()))


def test_non_tensor_input():
    with pytest.raises(TypeError, match="nanfree.softmax: `input` must be a torch.Tensor"):
        nf.softmax([1.0, 2.0], 0)


def test_op_level_checks():
    # The registered ops check their own arguments too (for direct callers),
    # with the same errors on every backend.
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="nanfree.softmax: `mask` of shape"):
        torch.ops.nanfree.softmax(x, -1, torch.ones(3, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="nanfree.log_softmax: `mask` must be bool or integer"):
        torch.ops.nanfree.log_softmax(x, -1, torch.ones(2, 3))
    with pytest.raises(IndexError, match="nanfree.logsumexp: `dim` 2 is out of range"):
        torch.ops.nanfree.logsumexp(x, 2)
    out, stats = torch.ops.nanfree.log_softmax(x, 0)
    with pytest.raises(ValueError, match="`stats` must be the forward's saved row statistics"):
        torch.ops.nanfree.log_softmax_backward(out, out, stats, 1)
    with pytest.raises(ValueError, match="`grad_output` has shape"):
        torch.ops.nanfree.softmax_backward(out[:1], out, stats, 0)
    with pytest.raises(TypeError, match="`grad_output` dtype"):
        torch.ops.nanfree.softmax_backward(out.double(), out, stats, 0)
