"""float64 gradcheck, torch.library.opcheck and torch.compile(fullgraph=True)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, INTERPRETED
from drop_in_checks import out_matches_torch
from torch.library import opcheck

import nanfree.nn as nfnn
import nanfree.ops as nf

OPS = ["softmax", "log_softmax", "logsumexp"]

# Under Triton's interpreter every kernel launch runs in numpy: gradcheck's
# fast mode checks a random projection of the Jacobian (two evaluations per
# perturbation direction instead of one per input entry).
GRADCHECK = dict(fast_mode=INTERPRETED)


def _inputs(device, shape=(3, 4, 5)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
    mask = (torch.rand(shape[0], 1, shape[-1], generator=gen) > 0.3).to(device)
    mask[..., 0] = True
    return x, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dim", [-1, 1, 0])
@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck(device, op, dim, masked):
    x, mask = _inputs(device)
    mask = mask if masked else None

    def fn(inp):
        out = getattr(nf, op)(inp, dim, mask=mask)
        # Fully masked sets give -inf (log_softmax, logsumexp), whose finite
        # differences are NaN: compare the finite part only.
        return torch.where(torch.isinf(out), 0.0, out)

    assert torch.autograd.gradcheck(fn, (x,), **GRADCHECK)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_logsumexp_over_several_dims(device):
    x, mask = _inputs(device)
    assert torch.autograd.gradcheck(lambda v: nf.logsumexp(v, (0, 2), keepdim=True, mask=mask), (x,),
                                    **GRADCHECK)


def _op(name):
    return getattr(torch.ops.nanfree, name).default


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck_forward_ops(device, dtype, masked):
    x = torch.randn(4, 9, dtype=dtype, device=device, requires_grad=True)
    # A [4, 1] mask broadcasts at the op level; an integer one counts nonzero as kept.
    mask = (torch.rand(4, 1, device=device) > 0.5).int() if masked else None
    for name in ("softmax", "log_softmax", "logsumexp"):
        for dim in (-1, 0):
            opcheck(_op(name), (x, dim, mask))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_opcheck_backward_ops(device, dim):
    x = torch.randn(4, 9, device=device)
    mask = torch.rand(4, 9, device=device) > 0.3
    out, stats = torch.ops.nanfree.softmax(x, dim, mask)
    opcheck(_op("softmax_backward"), (torch.randn_like(out), out, stats, dim))
    out, stats = torch.ops.nanfree.log_softmax(x, dim, mask)
    opcheck(_op("log_softmax_backward"), (torch.randn_like(out), out, stats, dim, mask))
    out, stats = torch.ops.nanfree.logsumexp(x, dim, mask)
    opcheck(_op("logsumexp_backward"), (torch.randn_like(out), x, stats, dim, mask))


@pytest.mark.skipif(INTERPRETED, reason="compiling around interpreted Triton kernels adds nothing")
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    def loss(x, mask):
        return (
            nf.softmax(x, -1, mask=mask).pow(2).sum()
            + nf.log_softmax(x, 1).sum()
            + nf.logsumexp(x, -1, mask=mask).sum()
            + nf.softmax(x).amax()  # the implicit dim, its warning left out while tracing
        )

    x = torch.randn(4, 6, 8, device=device, requires_grad=True)
    mask = torch.rand(4, 1, 8, device=device) > 0.3
    compiled = torch.compile(loss, fullgraph=True)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        expected = loss(x, mask)
    (expected_grad,) = torch.autograd.grad(expected, x)
    got = compiled(x, mask)
    (got_grad,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_double_backward_refuses_clearly(device, op):
    x, mask = _inputs(device)
    out = getattr(nf, op)(x, -1, mask=mask)
    # First-order gradients with create_graph=True still work ...
    (grad,) = torch.autograd.grad(torch.where(torch.isinf(out), 0.0, out).pow(2).sum(), x,
                                  create_graph=True)
    assert grad.requires_grad
    # ... but differentiating them again is refused, not silently incomplete.
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_through_one_of_two_uses(device):
    x, mask = _inputs(device)
    out = nf.log_softmax(x, -1, mask=mask)
    # Only part of the output reaches the loss; the rest gets no gradient at all.
    (grad,) = torch.autograd.grad(out[0].exp().sum(), x)
    assert torch.isfinite(grad).all() and (grad[1:] == 0).all()


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("ndim", [0, 1, 2, 3, 4])
def test_implicit_dim_as_torch_nn_functional(device, op, ndim):
    """Without dim, torch.nn.functional's deprecated choice (0 for a 0-, 1- or 3-d
    input, else 1) with its warning at the caller's line; the modules likewise;
    a dtype as the third argument is torch.softmax's dtype."""
    x = torch.randn((2, 3, 4, 5)[:ndim], device=device)
    chosen = 0 if ndim in (0, 1, 3) else 1
    message = f"Implicit dimension choice for {op} has been deprecated"
    with pytest.warns(UserWarning, match=message) as record:
        got = getattr(nf, op)(x)  # the line the warning must name
    assert record[0].filename == __file__
    torch.testing.assert_close(got, getattr(nf, op)(x, chosen), rtol=0, atol=0)
    torch.testing.assert_close(got, getattr(F, op)(x, chosen))
    module = {"softmax": nfnn.Softmax, "log_softmax": nfnn.LogSoftmax}[op]()
    assert module.dim is None and repr(module) == repr(getattr(torch.nn, type(module).__name__)())
    with pytest.warns(UserWarning, match=message):
        torch.testing.assert_close(module(x), got, rtol=0, atol=0)
    as_torch_softmax = getattr(nf, op)(x, chosen, torch.float64)
    assert as_torch_softmax.dtype == torch.float64


@pytest.mark.parametrize("dim", [1, (0, 2)], ids=str)
def test_logsumexp_out_as_torch(device, dim):
    x = torch.randn(3, 4, 5, device=device)
    out_matches_torch(lambda t, out=None: nf.logsumexp(t, dim, out=out),
                      lambda t, out=None: torch.logsumexp(t, dim, out=out), (x,))
    with pytest.warns(UserWarning, match="was resized"):
        resized = nf.logsumexp(x, dim, out=torch.empty(2, device=device))
    torch.testing.assert_close(resized, nf.logsumexp(x, dim), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        nf.logsumexp(x.requires_grad_(), dim, out=torch.empty(0, device=device))


def test_numpy_integer_dims_as_torch(device):
    x = torch.randn(3, 4, 5, device=device)
    torch.testing.assert_close(nf.logsumexp(x, np.int64(1)), nf.logsumexp(x, 1), rtol=0, atol=0)
    torch.testing.assert_close(nf.logsumexp(x, (np.int32(0), 2)), nf.logsumexp(x, (0, 2)),
                               rtol=0, atol=0)
    torch.testing.assert_close(nf.softmax(x, np.int64(-1)), nf.softmax(x, -1), rtol=0, atol=0)
