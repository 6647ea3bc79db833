"""The special-value table of DESIGN.md section 2 (gem) for the pure-torch
GeM functions (nanfree/_torch_backend/gem.py, the mirror of gem_math.h),
forward and backward, against the float64 oracle of tests/gem_oracle.py."""

import math

import pytest
import torch
from conftest import DTYPES

import gem_oracle
from nanfree._torch_backend import gem as G

INF = math.inf
NAN = math.nan
N = 8


def _plain(n, shift=0.0):
    return [1.5 + math.sin(0.7 * i + shift) for i in range(n)]


def _cases(dtype):
    """name: (row, p, eps, mask row or None): p a float or ('tensor', value)."""
    info = torch.finfo(dtype)
    big = {torch.float16: 6e4, torch.bfloat16: 1e38, torch.float32: 1e38,
           torch.float64: 1e300}[dtype]
    pl = _plain(N)
    mixed = [1.0, -2.0, 0.0, 3.0, -0.0, 1e-7, 2.0, -INF]
    return {
        "plain p=3": (pl, 3.0, 1e-6, None),
        "zeros": ([0.0] * N, 3.0, 1e-6, None),
        "negatives": ([-v for v in pl], 3.0, 1e-6, None),
        "mixed signs": (mixed, 3.0, 1e-6, None),
        "eps-sized": ([1e-6 * v for v in pl], 3.0, 1e-6, None),
        "small, eps below": ([1e-5 * v for v in pl], 3.0, 1e-7, None),
        "x=1e4 p=10": ([1e4 * v for v in pl], 10.0, 1e-6, None),
        "huge p=3": ([big * v / 3 for v in pl], 3.0, 1e-6, None),
        "huge and tiny p=0.5": ([big / 3] + [1e-5] * (N - 1), 0.5, 1e-6, None),
        "huge and eps p=0.05": ([big / 3] + [0.0] * (N - 1), 0.05, 1e-6, None),
        "fully masked": (pl, 3.0, 1e-6, [0] * N),
        "partly masked": (pl, 3.0, 1e-6, [1, 0, 1, 1, 0, 0, 1, 1]),
        "masked NaN and inf": ([NAN, INF] + pl[2:], 3.0, 1e-6, [0, 0] + [1] * (N - 2)),
        "single element": ([2.5], 3.0, 1e-6, None),
        "single negative": ([-2.5], 3.0, 1e-6, None),
        "p=0.5": (pl, 0.5, 1e-6, None),
        "p=1": (pl, 1.0, 1e-6, None),
        "p=64": (pl, 64.0, 1e-6, None),
        "p=64 spread": ([v ** 4 for v in pl], 64.0, 1e-6, None),
        "p tensor 3": (pl, ("tensor", 3.0), 1e-6, None),
        "p tensor below clamp": (pl, ("tensor", 0.005), 1e-6, None),
        "p tensor at low clamp": (pl, ("tensor", 0.01), 1e-6, None),
        "p tensor just above low clamp": (pl, ("tensor", 0.0125), 1e-6, None),
        "p tensor at high clamp": (pl, ("tensor", 100.0), 1e-6, None),
        "p tensor above clamp": (pl, ("tensor", 150.0), 1e-6, None),
        "p tensor 0.5": (pl, ("tensor", 0.5), 1e-6, None),
        "p tensor 64": (pl, ("tensor", 64.0), 1e-6, None),
        "p tensor 10 x=1e4": ([1e4 * v for v in pl], ("tensor", 10.0), 1e-6, None),
        "p tensor 0.5 eps-sized": ([1e-6 * v for v in pl], ("tensor", 0.5), 1e-6, None),
        "NaN": ([NAN] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "+inf": ([INF] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "-inf": ([-INF] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "eps tiny": ([0.0, info.tiny] + pl[2:], 3.0, 1e-45, None),
    }


CASES = list(_cases(torch.float32))
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=2e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-6),
}


def _setup(case, dtype):
    """[2, n] input (the case's row, a plain row below it), p as passed, p
    for the oracle (a fresh float64 leaf when a tensor), eps, mask [2, n]."""
    row, p, eps, mrow = _cases(dtype)[case]
    n = len(row)
    x = torch.tensor([row, _plain(n, 2.0)], dtype=torch.float64).to(dtype)
    mask = None if mrow is None else torch.tensor([mrow, [1] * n], dtype=torch.int64)
    if isinstance(p, tuple):
        p_op = torch.tensor([p[1]], dtype=torch.float32)
        p_ref = p_op.clone().requires_grad_(True)
    else:
        p_op = p_ref = p
    return x, p_op, p_ref, eps, mask


def _oracle(x, p_ref, eps, mask, g):
    xr = x.to(torch.float64).clone().requires_grad_(True)
    out = gem_oracle.gem(xr, p_ref, 1, eps, mask)
    finite_rows = torch.isfinite(out)
    (out[finite_rows] * g[finite_rows]).sum().backward()
    gp = p_ref.grad if isinstance(p_ref, torch.Tensor) else None
    return out.detach(), xr.grad, gp


def _dtype_eps(eps, dtype):
    # The op works with eps in the accumulation type, raised to its smallest normal.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return max(eps, torch.finfo(acc).tiny)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_gem_table(case, dtype):
    x, p_op, p_ref, eps, mask = _setup(case, dtype)
    out, stats = G.gem(x, p_op, dim=1, eps=eps, mask=mask)
    assert out.dtype == dtype and out.shape == (2,)
    assert stats.shape == (3, 2)
    g = torch.tensor([0.75, -1.25], dtype=torch.float64)
    ref, ref_dx, ref_dp = _oracle(x, p_ref, _dtype_eps(eps, dtype), mask, g)
    # Forward: the oracle's value (NaN where it is NaN, inf where inf), rounded to dtype.
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), equal_nan=True,
                               **TOL[dtype])
    assert not torch.isnan(out[1]), "the plain row must not see the case's NaN"

    dx, dp = G.gem_backward(g.to(dtype), x, p_op, out, stats, dim=1, eps=eps, mask=mask)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert (dp is None) == (not isinstance(p_op, torch.Tensor))
    row_nan = bool(torch.isnan(ref[0]))
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask != 0
    if mask is not None:
        assert (dx[~keep] == 0).all(), "a masked entry gets gradient 0"
    if row_nan:
        # NaN stays in its reduction: its kept entries' gradients are NaN, and p's.
        assert torch.isnan(dx[0][keep[0]]).all()
        assert torch.isfinite(dx[1]).all()
        if dp is not None:
            assert torch.isnan(dp).all()
        return
    assert torch.isfinite(dx).all(), dx
    if dp is not None:
        assert torch.isfinite(dp).all() and dp.dtype == p_op.dtype and dp.shape == p_op.shape
    # Gradients against autograd of the oracle (finite rows; the rules give 0
    # elsewhere: empty and +inf rows pass no gradient), saturated to the dtype.
    big = torch.finfo(dtype).max
    ref_dx = ref_dx.clamp(-big, big)
    gtol = dict(TOL[dtype])
    if dtype in (torch.float16, torch.bfloat16):
        gtol["rtol"] *= 2
    scale = max(1.0, float(ref_dx.abs().max()))
    torch.testing.assert_close(dx.double(), ref_dx.to(dtype).double(), rtol=gtol["rtol"],
                               atol=gtol["atol"] * scale)
    if dp is not None:
        # p's gradient is computed in float32 (p's dtype) for every input dtype;
        # its error follows the input's rounding, whose values the oracle saw exactly.
        ptol = 1e-4 if dtype != torch.float64 else 1e-6
        pscale = max(1.0, float(ref_dp.abs().max()))
        torch.testing.assert_close(dp.double(), ref_dp.double(), rtol=ptol,
                                   atol=ptol * pscale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_is_zero_with_zero_gradients(dtype):
    # Token pooling [B, L, H] with an attention mask [B, L]: a fully padded sequence.
    x = torch.randn(3, 5, 4, dtype=torch.float64).to(dtype)
    am = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    p = torch.tensor([3.0])
    out, stats = G.gem(x, p, dim=1, mask=am[..., None])
    assert out.shape == (3, 4)
    assert (out[1] == 0).all()
    g = torch.ones_like(out)
    dx, dp = G.gem_backward(g, x, p, out, stats, dim=1, mask=am[..., None])
    assert (dx[1] == 0).all() and (dx[0, 2:] == 0).all()
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all()
    ref = gem_oracle.gem(x.double(), p, 1, 1e-6, am[..., None])
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), **TOL[dtype])
    # An all-masked input: every output 0, p's gradient 0.
    none = torch.zeros(3, 5, dtype=torch.bool)
    out, stats = G.gem(x, p, dim=1, mask=none[..., None])
    dx, dp = G.gem_backward(g, x, p, out, stats, dim=1, mask=none[..., None])
    assert (out == 0).all() and (dx == 0).all() and (dp == 0).all()


def test_empty_dimension():
    x = torch.randn(3, 0)
    p = torch.tensor(3.0)
    out, stats = G.gem(x, p, dim=1)
    assert out.shape == (3,) and (out == 0).all()
    dx, dp = G.gem_backward(torch.ones(3), x, p, out, stats, dim=1)
    assert dx.shape == (3, 0) and dp.shape == () and dp == 0


@pytest.mark.parametrize("dims,keepdim", [((2, 3), False), ((2, 3), True), ((0, 2), False),
                                          (-1, True), ((1,), False)])
def test_tuple_dims_match_oracle(dims, keepdim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    p = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    out, stats = G.gem(x, p, dim=dims, keepdim=keepdim)
    xr = x.clone().requires_grad_(True)
    ref = gem_oracle.gem(xr, p, dims, 1e-6)
    if keepdim:
        ref_k = ref.reshape(out.shape)
    else:
        ref_k = ref
    torch.testing.assert_close(out, ref_k.detach())
    g = torch.randn(out.shape, dtype=torch.float64)
    (ref_k * g).sum().backward()
    dx, dp = G.gem_backward(g, x, p, out, stats, dim=dims, keepdim=keepdim)
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(dp, p.grad)


def test_zero_dim_input():
    x = torch.tensor(2.0)
    out, stats = G.gem(x, 3.0, dim=0)
    assert out.shape == () and out == 2.0
    dx, dp = G.gem_backward(torch.tensor(1.0), x, 3.0, out, stats, dim=0)
    assert dx.shape == () and dx == 1.0 and dp is None


def test_gem_pool2d_layout_huge_fp32():
    # [B, C, H, W] -> [B, C]; fp32 activations of 1e4 with p = 10 (torch's
    # composition overflows: (1e4)^10 = 1e40 > float32 max).
    torch.manual_seed(1)
    x = (torch.rand(2, 3, 7, 7) * 1e4).float()
    p = torch.tensor([10.0])
    out, stats = G.gem(x, p, dim=(2, 3))
    naive = x.clamp(min=1e-6).pow(10.0).mean(dim=(2, 3)).pow(0.1)
    assert torch.isinf(naive).all()
    ref = gem_oracle.gem(x.double(), p, (2, 3), 1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=0)
    dx, dp = G.gem_backward(torch.ones_like(out), x, p, out, stats, dim=(2, 3))
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all()


def test_fp16_eps_power_underflow():
    # eps^p underflows in fp16 (and (1e-4)^3 too): computed in fp32 on ratios.
    x = torch.full((2, 16), 1e-4, dtype=torch.float16)
    x[1] = 0
    p = torch.tensor([3.0])
    out, stats = G.gem(x, p, dim=1)
    assert torch.isfinite(out).all() and out[0] > 0
    torch.testing.assert_close(out[0].double(), torch.tensor(1e-4, dtype=torch.float16).double(),
                               rtol=1e-3, atol=0)
    torch.testing.assert_close(out[1].double(), torch.tensor(1e-6, dtype=torch.float16).double(),
                               rtol=1e-2, atol=0)
    dx, dp = G.gem_backward(torch.ones(2, dtype=torch.float16), x, p, out, stats, dim=1)
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all()
    assert (dx[1] == 0).all()


def test_p_below_one_tiny_ratio_bounded():
    # p < 1 with an entry far below the max: r^(p-1) is huge; fp16 gradients
    # saturate at 65504 rather than becoming inf; an incoming 0 gives 0.
    x = torch.tensor([[6e4, 2e-6, 1.0]], dtype=torch.float16)
    p = torch.tensor([0.02])
    out, stats = G.gem(x, p, dim=1)
    dx, dp = G.gem_backward(torch.ones(1, dtype=torch.float16), x, p, out, stats, dim=1)
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all()
    dx0, dp0 = G.gem_backward(torch.zeros(1, dtype=torch.float16), x, p, out, stats, dim=1)
    assert (dx0 == 0).all() and (dp0 == 0).all()
    # float32, ratio below float's normal range (m / eps > 2^126): still finite, no NaN.
    x = torch.tensor([[3e38, 1e-6, 1e-30]], dtype=torch.float32)
    for pv in (0.01, 0.1, 0.5, 0.99):
        p = torch.tensor([pv])
        out, stats = G.gem(x, p, dim=1, eps=1e-8)
        ref = gem_oracle.gem(x.double(), p, 1, 1e-8)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=0)
        dx, dp = G.gem_backward(torch.ones(1), x, p, out, stats, dim=1, eps=1e-8)
        assert torch.isfinite(dx).all() and torch.isfinite(dp).all(), (pv, dx, dp)
        dx0, dp0 = G.gem_backward(torch.zeros(1), x, p, out, stats, dim=1, eps=1e-8)
        assert (dx0 == 0).all() and (dp0 == 0).all()


def test_nan_stays_in_its_reduction_multi_dim():
    x = torch.rand(3, 4, 5) + 0.1
    x[1, 2, 3] = NAN
    p = torch.tensor(3.0)
    out, stats = G.gem(x, p, dim=(0, 2))
    assert torch.isnan(out[2]) and torch.isfinite(out[[0, 1, 3]]).all()
    dx, dp = G.gem_backward(torch.ones(4), x, p, out, stats, dim=(0, 2))
    assert torch.isnan(dx[:, 2]).all()
    assert torch.isfinite(dx[:, [0, 1, 3]]).all()
    assert torch.isnan(dp)


def test_bad_p_and_mask():
    x = torch.rand(2, 3)
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="`p`"):
            G.gem(x, bad)
    with pytest.raises(TypeError, match="`mask`"):
        G.gem(x, 3.0, mask=torch.ones(2, 3))
    with pytest.raises(IndexError, match="`dim`"):
        G.gem(x, 3.0, dim=2)
