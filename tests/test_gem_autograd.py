"""float64 gradcheck, torch.library.opcheck and torch.compile(fullgraph=True) of
GeM pooling (nanfree.ops.gem, gem_pool2d, nanfree.nn.GeM and GeMTokenPooling,
the ops nanfree::gem and nanfree::gem_backward), double backward refused, and
the gradients DESIGN.md fixes at exactly 0: clamped entries, masked entries,
fully masked reductions, and p's gradient at and beyond its clamp bounds (passed at them, 0 beyond)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, INTERPRETED
from torch.library import opcheck

import nanfree.nn as nfnn
import nanfree.ops as nf

# Under Triton's interpreter every kernel launch runs in numpy: gradcheck's
# fast mode checks a random projection of the Jacobian (two evaluations per
# perturbation direction instead of one per input entry).
GRADCHECK = dict(fast_mode=INTERPRETED)


def _activations(*shape, device, seed=0, negatives=True):
    """float64 leaf of activations away from eps (gradcheck's steps of 1e-6
    never cross the clamp): entries in [0.2, 2.2], some negative (clamped)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 + 0.2
    if negatives:
        x = torch.where(torch.rand(shape, generator=gen) < 0.2, -x, x)
    return x.detach().to(device).requires_grad_(True)


def _p(value, shape, device, dtype=torch.float64):
    return torch.full(shape, value, dtype=dtype, device=device).requires_grad_(True)


def _composed(x, p, dim, eps=1e-6, keepdim=False, mask=None):
    """torch's composition: mean(clamp(x, eps) ** p) ** (1/p) over dim (kept entries)."""
    powered = x.clamp(min=eps).pow(p)
    if mask is None:
        return powered.mean(dim=dim, keepdim=keepdim).pow(1 / p)
    keep = (mask != 0).expand(x.shape).to(x.dtype)
    total = (powered * keep).sum(dim=dim, keepdim=keepdim)
    return (total / keep.sum(dim=dim, keepdim=keepdim)).pow(1 / p)


# --- gradcheck ----------------------------------------------------------------------

# name: (shape, dim, keepdim, p: float, or (value, shape) for a tensor, mask builder or None)
GEM_CASES = {
    "last dim, p []": ((3, 4, 5), -1, False, (3.0, ()), None),
    "last dim, p [1]": ((3, 4, 5), -1, False, (2.5, (1,)), None),
    "dim 0, Python p": ((4, 3, 2), 0, False, 3.0, None),
    "dim 1, keepdim, p 0.7": ((3, 4, 5), 1, True, (0.7, (1,)), None),
    "p 12": ((2, 6), 1, False, (12.0, ()), None),
    "tuple dims (2, 3)": ((2, 3, 4, 3), (2, 3), False, (3.0, (1,)), None),
    "tuple dims (0, 2), keepdim": ((3, 2, 4), (0, 2), True, (2.0, ()), None),
    "tuple dims (-1, 0)": ((3, 2, 4), (-1, 0), False, 4.0, None),
    "all dims": ((2, 3, 2), (0, 1, 2), False, (3.0, ()), None),
    "bool mask": ((3, 6), 1, False, (3.0, (1,)),
                  lambda g: torch.rand(3, 6, generator=g) < 0.7),
    "token layout, mask [B, L, 1]": ((3, 5, 4), 1, False, (3.0, (1,)),
                                     lambda g: torch.tensor([[1, 1, 1, 0, 0], [1] * 5,
                                                             [1, 0, 1, 0, 1]])[..., None]),
    "token layout, fully padded": ((3, 5, 4), 1, False, (3.0, ()),
                                   lambda g: torch.tensor([[1, 1, 0, 0, 0], [0] * 5,
                                                           [1] * 5])[..., None]),
    "mask [B, L, H] int": ((2, 4, 3), 1, False, (2.0, (1,)),
                           lambda g: (torch.rand(2, 4, 3, generator=g) < 0.6).to(torch.int32)),
}


# Under Triton's interpreter: one case of each kind.
INTERPRETED_GEM_CASES = ["last dim, p []", "tuple dims (2, 3)", "token layout, mask [B, L, 1]",
                         "token layout, fully padded", "dim 0, Python p"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", INTERPRETED_GEM_CASES if INTERPRETED else list(GEM_CASES))
def test_gradcheck_gem(device, case):
    shape, dim, keepdim, p, make_mask = GEM_CASES[case]
    x = _activations(*shape, device=device)
    gen = torch.Generator().manual_seed(1)
    mask = None if make_mask is None else make_mask(gen).to(device)
    if isinstance(p, tuple):
        p = _p(p[0], p[1], device)
        inputs = (x, p)

        def fn(x, p):
            return nf.gem(x, p, dim, 1e-6, keepdim, mask=mask)
    else:
        inputs = (x,)

        def fn(x):
            return nf.gem(x, p, dim, 1e-6, keepdim, mask=mask)
    out = fn(*inputs)
    # Where every reduction keeps an entry, torch's composition is the same function.
    if mask is None or bool((mask != 0).expand(shape).any(dim=dim).all()):
        torch.testing.assert_close(out, _composed(x, p, dim, keepdim=keepdim, mask=mask)
                                   .reshape(out.shape))
    assert torch.autograd.gradcheck(fn, inputs, **GRADCHECK)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_shape", [(1,)] if INTERPRETED else [(), (1,)], ids=str)
def test_gradcheck_gem_pool2d(device, p_shape):
    x = _activations(2, 3, 3, 4, device=device, seed=2)
    p = _p(3.0, p_shape, device)
    expected = F.avg_pool2d(x.clamp(min=1e-6).pow(p), (3, 4)).pow(1.0 / p)
    torch.testing.assert_close(nf.gem_pool2d(x, p), expected)
    assert torch.autograd.gradcheck(lambda x, p: nf.gem_pool2d(x, p), (x, p), **GRADCHECK)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float32_p_with_float64_input(device):
    # A float32 p (the usual Parameter) with float64 activations: p's gradient
    # comes back in float32; x's is checked in float64.
    x = _activations(3, 7, device=device, seed=3)
    p = torch.tensor([3.0], device=device)
    assert torch.autograd.gradcheck(lambda x: nf.gem(x, p, 1), (x,), **GRADCHECK)
    p.requires_grad_(True)
    nf.gem(x, p, 1).sum().backward()
    assert p.grad.dtype == torch.float32 and p.grad.shape == (1,)


# --- opcheck ------------------------------------------------------------------------


def _op(name):
    return getattr(torch.ops.nanfree, name).default


def _op_inputs(device, dtype, with_mask, p_kind):
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(2, 5, 3, generator=gen, dtype=torch.float64) * 2 - 0.3).to(device, dtype)
    x.requires_grad_(True)
    mask = None
    if with_mask:
        mask = torch.rand(2, 5, 3, generator=gen) < 0.6
        mask[1, :, 0] = False  # a fully masked reduction
        mask = mask.to(device)
    if p_kind == "tensor":
        p, p_value = torch.tensor([2.5], device=device, requires_grad=True), 0.0
    else:
        p, p_value = None, 2.5
    return x, p, p_value, mask


# (dtype, with_mask, p_kind); under Triton's interpreter two of them.
OPCHECK_FORWARD = [(torch.float16, True, "tensor"), (torch.float32, False, "float")]
if not INTERPRETED:
    OPCHECK_FORWARD += [(torch.float32, True, "tensor"), (torch.float16, False, "float"),
                        (torch.float32, False, "tensor"), (torch.float16, True, "float")]
OPCHECK_BACKWARD = [(torch.float32, True, "tensor"), (torch.float64, False, "float")]
if not INTERPRETED:
    OPCHECK_BACKWARD += [(torch.float64, True, "tensor"), (torch.float32, False, "float"),
                         (torch.float32, False, "tensor"), (torch.float64, True, "float")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,with_mask,p_kind", OPCHECK_FORWARD, ids=str)
def test_opcheck_gem(device, dtype, with_mask, p_kind):
    x, p, p_value, mask = _op_inputs(device, dtype, with_mask, p_kind)
    opcheck(_op("gem"), (x, p, p_value, 1e-6, mask))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gem_broadcast_mask(device):
    # The token layout's mask [B, L, 1] expanded to [B, L, H]: 0 strides.
    x, p, p_value, _ = _op_inputs(device, torch.float32, False, "tensor")
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool,
                        device=device)[..., None].expand(2, 5, 3)
    opcheck(_op("gem"), (x, p, p_value, 1e-6, mask))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,with_mask,p_kind", OPCHECK_BACKWARD, ids=str)
def test_opcheck_gem_backward(device, dtype, with_mask, p_kind):
    x, p, p_value, mask = _op_inputs(device, dtype, with_mask, p_kind)
    # (gem_backward refuses to be differentiated: inputs that do not require grad)
    x = x.detach()
    p = None if p is None else p.detach()
    out, stats = _op("gem")(x, p, p_value, 1e-6, mask)
    grad = torch.randn(out.shape, dtype=dtype, device=device)
    p_grad = p is not None
    opcheck(_op("gem_backward"), (grad, x, p, p_value, stats, 1e-6, mask, p_grad))
    if p_grad:  # and with p's gradient not asked for
        opcheck(_op("gem_backward"), (grad, x, p, p_value, stats, 1e-6, mask, False))


@pytest.mark.parametrize("device", DEVICES)
def test_raw_ops_outputs(device):
    # The ops' contract (csrc/registration.cpp): output [outer, inner] in the
    # input's dtype, stats [outer, inner, 3] (m, mean, count) in the
    # accumulation dtype; grad_p a 0-d sum when asked for, else empty [0].
    x, p, p_value, mask = _op_inputs(device, torch.float16, True, "tensor")
    x = x.detach()
    out, stats = torch.ops.nanfree.gem(x, p, p_value, 1e-6, mask)
    assert out.shape == (2, 3) and out.dtype == torch.float16
    assert stats.shape == (2, 3, 3) and stats.dtype == torch.float32
    count = stats[..., 2]
    torch.testing.assert_close(count.cpu(), mask.sum(1).float().cpu(), rtol=0, atol=0)
    assert out[1, 0] == 0 and stats[1, 0, 1] == 0
    grad = torch.ones_like(out)
    gx, gp = torch.ops.nanfree.gem_backward(grad, x, p, p_value, stats, 1e-6, mask, True)
    assert gx.shape == x.shape and gx.dtype == x.dtype and (gx[~mask] == 0).all()
    assert gp.shape == () and gp.dtype == torch.float32 and torch.isfinite(gp)
    gx2, gp2 = torch.ops.nanfree.gem_backward(grad, x, p, p_value, stats, 1e-6, mask, False)
    assert gp2.shape == (0,) and gp2.dtype == torch.float32
    torch.testing.assert_close(gx2, gx, rtol=0, atol=0)


# --- torch.compile ------------------------------------------------------------------


def _loss(x, tokens, attention, p):
    """ops.gem over a tuple of dims with a tensor p, over one dim with a Python p
    and keepdim, with a mask [B, L, 1], and gem_pool2d, each term weighted so
    that a wrong gradient cannot cancel."""
    weights = torch.arange(1.0, 4.0, device=x.device)
    return (
        (nf.gem(x, p, (2, 3)) * weights).sum()
        + 2 * nf.gem(x, 2.0, 1, keepdim=True).pow(2).sum()
        + 3 * nf.gem(tokens, p, 1, mask=attention[..., None]).sum()
        + 4 * nf.gem_pool2d(x, p, 1e-3).sum()
    )


def _compile_inputs(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, 4, generator=gen).to(device).requires_grad_(True)
    tokens = torch.randn(2, 5, 3, generator=gen).to(device).requires_grad_(True)
    attention = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], device=device)
    p = torch.tensor([3.0], device=device, requires_grad=True)
    return x, tokens, attention, p


@pytest.mark.skipif(INTERPRETED, reason="compiling around interpreted Triton kernels adds nothing")
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_ops(device):
    x, tokens, attention, p = _compile_inputs(device)
    leaves = (x, tokens, p)
    expected = _loss(x, tokens, attention, p)
    expected_grads = torch.autograd.grad(expected, leaves)
    compiled = torch.compile(_loss, fullgraph=True)
    got = compiled(x, tokens, attention, p)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grads, expected_grads)
    assert all(torch.isfinite(g).all() for g in got_grads)
    assert (got_grads[1][1] == 0).all()  # the fully padded sequence passes no gradient


@pytest.mark.skipif(INTERPRETED, reason="compiling around interpreted Triton kernels adds nothing")
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_modules(device):
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), nfnn.GeM()).to(device)
    pool = nfnn.GeMTokenPooling(p=2.0).to(device)
    x, tokens, attention, _ = _compile_inputs(device)

    def step(x, tokens):
        return model(x).pow(2).sum() + pool(tokens, attention).sum()

    params = [*model.parameters(), *pool.parameters(), x, tokens]
    expected = step(x, tokens)
    expected_grads = torch.autograd.grad(expected, params)
    got = torch.compile(step, fullgraph=True)(x, tokens)
    got_grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grads, expected_grads)
    p_grads = [got_grads[i] for i, t in enumerate(params) if t is model[2].p or t is pool.p]
    assert len(p_grads) == 2 and all(torch.isfinite(g).all() and g.shape == (1,) for g in p_grads)


# --- double backward -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_kind", ["tensor", "float"])
def test_double_backward_refuses_clearly(device, p_kind):
    x = _activations(3, 5, device=device, seed=7)
    p = _p(3.0, (1,), device) if p_kind == "tensor" else 3.0
    out = nf.gem(x, p, 1)
    # First-order gradients with create_graph=True still work ...
    (grad,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    (expected,) = torch.autograd.grad(out.pow(2).sum(), x, retain_graph=True)
    torch.testing.assert_close(grad, expected)
    assert grad.requires_grad
    # ... but differentiating them again is refused, not silently incomplete.
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()


# --- gradients that are exactly 0 ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
def test_clamped_entries_get_exactly_zero(device, dtype):
    # Negatives, zeros, -inf, entries below eps and entries exactly at eps
    # (torch.clamp's gradient is 0 at the bound).
    eps = 0.25
    row = [-1.0, 0.0, -0.0, -math.inf, 0.125, eps, 0.5, 2.0, 1.0, 3.0]
    x = torch.tensor([row, row[::-1]], dtype=dtype, device=device, requires_grad=True)
    p = torch.tensor(3.0, device=device, requires_grad=True)
    out = nf.gem(x, p, 1, eps)
    out.backward(torch.tensor([1.0, -2.0], dtype=dtype, device=device))
    clamped = x.detach() <= eps
    assert (x.grad[clamped] == 0).all() and (x.grad[~clamped] != 0).all()
    assert torch.isfinite(x.grad).all() and torch.isfinite(p.grad)
    # All clamped: gem is eps, and no gradient reaches x; p's is 0 (a constant row).
    y = torch.tensor([[-1.0, 0.0, 0.1, eps]], dtype=dtype, device=device, requires_grad=True)
    q = torch.tensor([3.0], device=device, requires_grad=True)
    out = nf.gem(y, q, 1, eps)
    assert out.item() == eps
    out.sum().backward()
    assert (y.grad == 0).all() and q.grad.abs().item() <= 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["rows", "tokens"])
def test_masked_entries_get_exactly_zero(device, layout):
    # Whatever is under the mask (NaN, +inf, huge, the would-be maximum).
    gen = torch.Generator().manual_seed(8)
    if layout == "rows":
        x = torch.rand(3, 7, generator=gen) + 0.5
        mask = torch.rand(3, 7, generator=gen) < 0.5
        mask[:, 0] = True
        dim = 1
    else:
        x = torch.rand(2, 6, 4, generator=gen) + 0.5
        mask = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 1]])[..., None]
        dim = 1
    keep = (mask != 0).expand(x.shape)
    dirty = x.clone()
    specials = torch.tensor([math.nan, math.inf, 1e30, -math.inf])
    idx = torch.nonzero(~keep)
    for k, pos in enumerate(idx):
        dirty[tuple(pos)] = specials[k % 4]
    leaves = []
    for values in (x, dirty):
        v = values.detach().to(device).requires_grad_(True)
        p = torch.tensor([2.5], device=device, requires_grad=True)
        out = nf.gem(v, p, dim, mask=mask.to(device))
        out.backward(torch.ones_like(out))
        leaves.append((out.detach(), v.grad, p.grad))
    (out_c, gx_c, gp_c), (out_d, gx_d, gp_d) = leaves
    assert (gx_d[~keep.to(device)] == 0).all() and (gx_c[~keep.to(device)] == 0).all()
    # The values under the mask reach nothing.
    torch.testing.assert_close(out_d, out_c, rtol=0, atol=0)
    torch.testing.assert_close(gx_d, gx_c, rtol=0, atol=0)
    torch.testing.assert_close(gp_d, gp_c, rtol=0, atol=0)
    assert torch.isfinite(gx_d).all() and torch.isfinite(gp_d).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
def test_fully_masked_reductions_pass_nothing(device, dtype):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 6, 2, generator=gen).to(device, dtype).requires_grad_(True)
    attention = torch.tensor([[0] * 6, [1, 1, 0, 0, 0, 0], [0] * 6], device=device)
    p = torch.tensor([3.0], device=device, requires_grad=True)
    out = nf.gem(x, p, 1, mask=attention[..., None])
    assert (out[0] == 0).all() and (out[2] == 0).all()
    # Only the fully masked reductions reach the loss: every gradient is exactly 0.
    (out[0].sum() + out[2].sum()).backward()
    assert (x.grad == 0).all() and p.grad.item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_value", [-1.0, 0.01, 100.0, 150.0] if INTERPRETED else
                         [-1.0, 0.0, 0.005, 0.01, 100.0, 150.0, 1e30])
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.float64], ids=str)
def test_p_gradient_zero_beyond_clamp_passed_at_bounds(device, p_value, p_dtype):
    # A tensor p is clamped to [1e-2, 1e2] (compared in the input's accumulation
    # dtype, float32 here): its gradient is 0 beyond the bounds and passed at them
    # (p = 0.01 in float32 is the clamp's bound itself).
    x = _activations(3, 8, device=device, seed=10).detach().float().requires_grad_(True)
    p = torch.tensor([p_value], dtype=p_dtype, device=device, requires_grad=True)
    out = nf.gem(x, p, 1)
    out.sum().backward()
    assert p.grad.dtype == p_dtype and p.grad.shape == (1,)
    if p_value in (0.01, 100.0):
        assert p.grad.item() != 0 and math.isfinite(p.grad.item()), f"p = {p_value}"
    else:
        assert p.grad.item() == 0, f"p = {p_value}: gradient {p.grad.item()}, not 0"
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # The output is that of the clamped p, as a Python p gives it.
    clamped = min(max(float(torch.tensor(p_value, dtype=torch.float32)), 1e-2), 1e2)
    torch.testing.assert_close(out, nf.gem(x.detach(), clamped, 1), rtol=1e-5, atol=0)
    # Just inside the clamp the gradient is not 0.
    for inside in (0.0125, 99.0):
        q = torch.tensor([inside], dtype=p_dtype, device=device, requires_grad=True)
        nf.gem(x.detach(), q, 1).sum().backward()
        assert q.grad.item() != 0 and math.isfinite(q.grad.item())


@pytest.mark.parametrize("device", DEVICES)
def test_zero_incoming_gradient_gives_zero(device):
    # Extreme rows (p < 1 with a ratio far below the maximum: huge weights) and
    # an incoming gradient of 0: every gradient exactly 0, never 0 * inf.
    x = torch.tensor([[3e38, 1e-6, 1e-30, 1.0], [6e4, 2e-6, 1.0, 0.0]], device=device,
                     requires_grad=True)
    p = torch.tensor([0.05], device=device, requires_grad=True)
    out = nf.gem(x, p, 1, 1e-8)
    out.backward(torch.zeros_like(out))
    assert (x.grad == 0).all() and p.grad.item() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64] if INTERPRETED else
                         [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_p_gradient_in_p_dtype(device, dtype, p_dtype):
    # p may have any floating dtype: it is used in float32 (float64 input:
    # widened from float32), and its gradient comes back in p's dtype and shape.
    x = _activations(2, 6, device=device, seed=11).detach().to(dtype).requires_grad_(True)
    p = torch.tensor([2.5], dtype=p_dtype, device=device, requires_grad=True)
    out = nf.gem(x, p, 1)
    assert out.dtype == dtype
    out.sum().backward()
    assert p.grad.dtype == p_dtype and p.grad.shape == (1,) and torch.isfinite(p.grad).all()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    q = torch.tensor([2.5], requires_grad=True, device=device)
    nf.gem(x.detach(), q, 1).sum().backward()
    torch.testing.assert_close(p.grad.float(), q.grad, rtol=1e-2 if p_dtype in (
        torch.float16, torch.bfloat16) else 1e-6, atol=0)
