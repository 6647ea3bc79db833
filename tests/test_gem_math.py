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


# --- p's gradient at small p: the divergence form ------------------------------------


def _rows(kind, b, n, gen):
    """b rows of n float64 entries of a given shape of distribution."""
    if kind == "sin":
        return torch.tensor([_plain(n, 0.3 * i) for i in range(b)], dtype=torch.float64)
    z = torch.randn(b, n, generator=gen, dtype=torch.float64)
    if kind == "abs normal":
        return z.abs()
    if kind == "relu":  # about half the entries clamped to eps: eps^p enters p's gradient
        return z.clamp(min=0)
    return torch.exp(2.0 * z)  # log-normal: ratios down to 1e-7


def _p_grad_errors(x, p, eps):
    """(ours, torch's) largest per-row error of p's gradient against the oracle,
    relative to the largest exact gradient; torch's is inf where it is not finite."""
    ours, theirs, scale = [], [], 0.0
    for b in range(x.shape[0]):
        xb = x[b:b + 1]
        p_ref = torch.tensor(p, dtype=torch.float32, requires_grad=True)
        gem_oracle.gem(xb.double(), p_ref, 1, eps).sum().backward()
        ref = p_ref.grad.double().item()
        p_t = torch.tensor(p, dtype=torch.float32, requires_grad=True)
        # torch's composition at the input's dtype (a 0-dim float32 p does not promote it).
        xb.clamp(min=eps).pow(p_t).mean(1).pow(1 / p_t).float().sum().backward()
        torch_dp = p_t.grad.double().item()
        p_op = torch.tensor([p], dtype=torch.float32)
        out, stats = G.gem(xb, p_op, dim=1, eps=eps)
        _, dp = G.gem_backward(torch.ones(1, dtype=x.dtype), xb, p_op, out, stats, dim=1, eps=eps)
        ours.append(abs(dp.double().item() - ref))
        theirs.append(abs(torch_dp - ref) if math.isfinite(torch_dp) else INF)
        scale = max(scale, abs(ref))
    return max(ours) / scale, max(theirs) / scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["sin", "abs normal", "relu", "log-normal"])
def test_p_grad_sweep_at_most_twice_torch(kind, dtype):
    # p from the low clamp up: the old form T / (p mean) - log(mean) / p^2
    # cancelled two O(1/p) terms (2.2x torch's error at p = 0.0125); the
    # divergence D / p^2 has no cancellation. What is left is gem's own error,
    # the saved mean's rounding raised to 1/p, as in torch's composition.
    gen = torch.Generator().manual_seed(7)
    x = _rows(kind, 6, 33, gen).to(dtype)
    floor = torch.finfo(torch.float32).eps  # p's gradient is float32: one rounding
    known = []
    for p in (0.0101, 0.0125, 0.02, 0.035, 0.05, 0.075, 0.1, 0.5, 3.0, 64.0):
        ours, theirs = _p_grad_errors(x, p, 1e-6)
        # And absolutely: gem's rounding amplified by at most 1/p, plus a few ulp.
        assert ours <= (64 / p + 64) * floor, f"p={p}: error {ours}"
        if ours > 2 * theirs + floor:
            msg = f"p={p}: error {ours} vs torch {theirs}"
            assert (dtype, kind, p) in _KNOWN_GEM_FORWARD_LIMITED, msg
            known.append(msg)
    if known:
        pytest.xfail("gem's forward rounding (mean^(1/p)), not D: " + "; ".join(known))


# Points where the remaining error is gem = m * mean^(1/p) itself (the saved
# mean's rounding raised to 1/p; D is within a few ulp there), and torch's
# composition was luckier: to be fixed by a centred forward, not by D.
_KNOWN_GEM_FORWARD_LIMITED = {(torch.float32, "relu", 0.05)}


@pytest.mark.parametrize("p", [0.01, 0.0125, 0.05, 0.5, 3.0, 64.0, 100.0])
def test_divergence_matches_float64(p):
    # D = (1/n) sum h(p log r - log mean) in float32 against float64 KL(w || uniform),
    # w = softmax(p log c): a few ulp for every p (no 1/p amplification).
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([_rows(k, 4, 40, gen) for k in ("sin", "abs normal", "relu", "log-normal")])
    eps = 1e-6
    xf = x.float()
    pv = torch.tensor(p, dtype=torch.float32)
    _, stats = G.gem(xf, pv, dim=1, eps=eps)
    m, mean, count = (s.unsqueeze(-1) for s in stats)
    c = G.clamp_to_eps(xf, eps)
    d = G.gem_divergence_term(c, m, torch.log(mean), pv).mean(dim=1).double()
    u = float(pv) * torch.log(xf.double().clamp(min=eps))
    w = torch.softmax(u, dim=1)
    exact = (w * u).sum(1) - (torch.logsumexp(u, 1) - math.log(u.shape[1]))
    assert (d >= 0).all()
    torch.testing.assert_close(d, exact, rtol=16 * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_divergence_h(dtype):
    # h(s) = 1 + (s - 1) e^s: the series inside [-1, 1] meets the closed form at
    # the ends, is s^2 / 2 near 0, and float32 is within a few ulp of float64.
    s = torch.linspace(-3, 3, 6001, dtype=torch.float64)
    s = torch.cat([s, torch.tensor([-1e-30, 1e-30, 0.0, -1.0, 1.0, -200.0, -1e5,
                                    math.log(1e4)], dtype=torch.float64)])
    h64 = G.gem_divergence_h(s)
    assert (h64 >= 0).all() and torch.isfinite(h64).all()
    assert h64[-6] == 0.0 and h64[-3] == 1.0 and h64[-2] == 1.0  # 0; e^s = 0
    tiny = torch.tensor([1e-4, -1e-4, 1e-6], dtype=torch.float64)
    torch.testing.assert_close(G.gem_divergence_h(tiny), tiny ** 2 / 2 + tiny ** 3 / 3 + tiny ** 4 / 8,
                               rtol=1e-12, atol=0)
    outer = s.abs() >= 0.5  # the closed form loses at most ~4 bits there in float64
    closed = 1.0 + (s - 1.0) * torch.exp(s)
    torch.testing.assert_close(h64[outer], closed[outer], rtol=1e-14, atol=0)
    if dtype == torch.float32:
        h32 = G.gem_divergence_h(s.float()).double()
        ref = G.gem_divergence_h(s.float().double())  # same arguments, in float64
        # (s = 1e-30: h = 5e-61 is below float32's range and underflows to 0.)
        torch.testing.assert_close(h32, ref, rtol=8 * torch.finfo(torch.float32).eps,
                                   atol=torch.finfo(torch.float32).tiny)
    assert torch.isnan(G.gem_divergence_h(torch.tensor([math.nan], dtype=dtype))).all()


def test_header_compiles(tmp_path):
    # The header is the single source of the math: it must compile on its own.
    import shutil
    import subprocess
    from pathlib import Path
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "gem_math_check.cpp"
    src.write_text('#include "nanfree/gem_math.h"\n'
                   "template float nanfree::gem_divergence_h<float>(float);\n"
                   "template double nanfree::gem_divergence_term<double>(double, double, double, double);\n"
                   "float f(float g, float x) {\n"
                   "  using namespace nanfree;\n"
                   "  return gem_p_grad(g, x, x, 1.0f, gem_divergence_term(x, x, 0.0f, 0.5f), 0.5f) +\n"
                   "         gem_input_grad(g, x, 1e-6f, x, 1.0f, 1.0f, 3.0f);\n"
                   "}\n")
    res = subprocess.run([gxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra",
                          f"-I{root / 'csrc' / 'include'}", str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
