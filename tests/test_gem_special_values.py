"""The special-value table of DESIGN.md section 2 (gem) through nanfree.ops.gem
and its autograd, on the backend this session selects: output, the input's
gradient and p's gradient against the float64 oracle of tests/gem_oracle.py
and the rules, in every dtype, with the reduced entries contiguous (rows) and
strided (columns); then the layouts and values the table does not hold
(tuple dims, 0-d and empty inputs, the image and token layouts, underflow,
overflow, p < 1 with tiny ratios, NaN in a multi-dim reduction) and p's
gradient at small p against torch's own error."""

import math

import pytest
import torch
from conftest import DTYPES, INF, INTERPRETED, NAN, acc_dtype
from nanfree._backends import SERVING

import gem_oracle
import nanfree.ops as nf

N = 8  # entries per reduction of the short cases
LONG = 300 if INTERPRETED else 1000  # the long cases: special values late in the reduction


def _cases(dtype):
    """name: (row, p, eps, mask row or None): p a float or ('tensor', value)."""
    info = torch.finfo(dtype)
    big = {torch.float16: 6e4, torch.bfloat16: 1e38, torch.float32: 1e38,
           torch.float64: 1e300}[dtype]
    pl = gem_oracle.plain_row(N)
    mixed = [1.0, -2.0, 0.0, 3.0, -0.0, 1e-7, 2.0, -INF]
    long_plain = gem_oracle.plain_row(LONG)
    late_inf, late_nan, late_max = list(long_plain), list(long_plain), list(long_plain)
    late_inf[LONG - 7] = INF
    late_nan[LONG - 5] = NAN
    late_max[LONG - 1] = 1e4  # the maximum comes last: every earlier sum is rescaled
    rising = [float(i + 1) for i in range(LONG)]  # a new maximum at every entry
    tail_masked = [1] * (LONG - 40) + [0] * 40
    long_dirty_tail = long_plain[:LONG - 40] + [NAN, INF] * 20
    return {
        "plain p=3": (pl, 3.0, 1e-6, None),
        "zeros": ([0.0] * N, 3.0, 1e-6, None),
        "negatives": ([-v for v in pl], 3.0, 1e-6, None),
        "mixed signs": (mixed, 3.0, 1e-6, None),
        "at eps": ([0.5, 1.0, 2.0, 0.5, 0.25, 1.5, 0.5, 3.0], ("tensor", 3.0), 0.5, None),
        "eps-sized": ([1e-6 * v for v in pl], 3.0, 1e-6, None),
        "small, eps below": ([1e-5 * v for v in pl], 3.0, 1e-7, None),
        "subnormals": ([info.tiny / 4] * 4 + pl[4:], 3.0, 1e-45, None),
        "x=1e4 p=10": ([1e4 * v for v in pl], 10.0, 1e-6, None),
        "max last p=10": (pl[:-1] + [1e4], 10.0, 1e-6, None),
        "huge p=3": ([big * v / 3 for v in pl], 3.0, 1e-6, None),
        "finfo.max": ([info.max] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "huge and tiny p=0.5": ([big / 3] + [1e-5] * (N - 1), 0.5, 1e-6, None),
        "huge and eps p=0.05": ([big / 3] + [0.0] * (N - 1), 0.05, 1e-6, None),
        # fp32: mean^(1/p) = 0.3^80 is below float's normal range, gem is not.
        "huge and eps p=0.0125": ([big / 3] + [0.0] * 31, ("tensor", 0.0125), 1e-6, None),
        "fully masked": (pl, 3.0, 1e-6, [0] * N),
        "partly masked": (pl, 3.0, 1e-6, [1, 0, 1, 1, 0, 0, 1, 1]),
        "masked NaN and inf": ([NAN, INF] + pl[2:], ("tensor", 3.0), 1e-6, [0, 0] + [1] * (N - 2)),
        "masked maximum": ([1e4] + pl[1:], ("tensor", 3.0), 1e-6, [0] + [1] * (N - 1)),
        "single kept": (pl, ("tensor", 3.0), 1e-6, [0, 0, 0, 1, 0, 0, 0, 0]),
        "single element": ([2.5], 3.0, 1e-6, None),
        "single negative": ([-2.5], 3.0, 1e-6, None),
        "p=0.5": (pl, 0.5, 1e-6, None),
        "p=1": (pl, 1.0, 1e-6, None),
        "p=64": (pl, 64.0, 1e-6, None),
        "p=64 spread": ([v ** 4 for v in pl], 64.0, 1e-6, None),
        "p tensor 3": (pl, ("tensor", 3.0), 1e-6, None),
        "p tensor below clamp": (pl, ("tensor", 0.005), 1e-6, None),
        "p tensor negative": (pl, ("tensor", -2.0), 1e-6, None),
        "p tensor at low clamp": (pl, ("tensor", 0.01), 1e-6, None),
        "p tensor just above low clamp": (pl, ("tensor", 0.0125), 1e-6, None),
        "p tensor at high clamp": (pl, ("tensor", 100.0), 1e-6, None),
        "p tensor above clamp": (pl, ("tensor", 150.0), 1e-6, None),
        "p tensor 0.5": (pl, ("tensor", 0.5), 1e-6, None),
        "p tensor 64": (pl, ("tensor", 64.0), 1e-6, None),
        "p tensor 10 x=1e4": ([1e4 * v for v in pl], ("tensor", 10.0), 1e-6, None),
        "p tensor 0.5 eps-sized": ([1e-6 * v for v in pl], ("tensor", 0.5), 1e-6, None),
        "NaN": ([NAN] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "NaN and +inf": ([NAN, INF] + pl[2:], ("tensor", 3.0), 1e-6, None),
        "+inf": ([INF] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "-inf": ([-INF] + pl[1:], ("tensor", 3.0), 1e-6, None),
        "eps tiny": ([0.0, info.tiny] + pl[2:], 3.0, 1e-45, None),
        "long plain": (long_plain, ("tensor", 3.0), 1e-6, None),
        "long +inf late": (late_inf, ("tensor", 3.0), 1e-6, None),
        "long NaN late": (late_nan, ("tensor", 3.0), 1e-6, None),
        "long maximum last p=10": (late_max, ("tensor", 10.0), 1e-6, None),
        "long rising p=64": (rising, 64.0, 1e-6, None),
        "long masked tail": (long_dirty_tail, ("tensor", 3.0), 1e-6, tail_masked),
    }


CASES = list(_cases(torch.float32))
# Under Triton's interpreter (each kernel launch runs in numpy, slowly) the
# strided layout takes the cases whose path through a kernel differs (masks,
# special values, long reductions, p's gradient); the rows layout takes all.
INTERPRETED_COLUMN_CASES = {
    "plain p=3", "mixed signs", "at eps", "x=1e4 p=10", "huge and eps p=0.0125", "max last p=10", "finfo.max",
    "fully masked", "partly masked", "masked NaN and inf", "masked maximum", "single kept",
    "single element", "p tensor 3", "p tensor above clamp", "NaN", "NaN and +inf", "+inf",
    "long plain", "long +inf late", "long NaN late", "long maximum last p=10",
    "long rising p=64", "long masked tail",
}
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-12),
    torch.float32: dict(rtol=2e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-6),
}
LAYOUTS = ["rows", "columns"]


def _setup(case, dtype, device, layout):
    """The case's row and a plain row below it as a [2, n] float64 tensor of the
    values the dtype holds; the op's input (rows: [2, n] reduced over dim 1;
    columns: [n, 2] reduced over dim 0, entries `inner` apart); p for the op (a
    leaf requiring grad when a tensor: shape [1] for rows, [] for columns); p
    for the oracle (a fresh float32 leaf); eps; mask [2, n] and the op's."""
    row, p, eps, mrow = _cases(dtype)[case]
    n = len(row)
    held = torch.tensor([row, gem_oracle.plain_row(n, 2.0)], dtype=torch.float64)
    held = held.to(dtype).double()
    x = held.to(dtype)
    x = (x.clone() if layout == "rows" else x.t().contiguous()).to(device).requires_grad_(True)
    mask = op_mask = None
    if mrow is not None:
        mask = torch.tensor([mrow, [1] * n], dtype=torch.int64)
        op_mask = (mask if layout == "rows" else mask.t()).to(device)  # columns: not contiguous
    if isinstance(p, tuple):
        shape = (1,) if layout == "rows" else ()
        p_op = torch.full(shape, p[1], dtype=torch.float32, device=device, requires_grad=True)
        p_ref = torch.tensor(p[1], dtype=torch.float32, requires_grad=True)
    else:
        p_op = p_ref = p
    return held, x, p_op, p_ref, eps, mask, op_mask


def _leaf(t, device):
    """A fresh leaf requiring grad on device, sharing nothing with t."""
    return t.detach().clone().to(device).requires_grad_(True)


def _effective_eps(eps, dtype):
    # The op works with eps in the accumulation type, raised to its smallest normal.
    return max(eps, torch.finfo(acc_dtype(dtype)).tiny)


def _oracle(held, p_ref, eps, mask, g, dtype):
    xr = held.detach().clone().requires_grad_(True)
    out = gem_oracle.gem(xr, p_ref, 1, eps, mask, acc=acc_dtype(dtype))
    finite_rows = torch.isfinite(out)
    (out[finite_rows] * g[finite_rows]).sum().backward()
    gp = p_ref.grad if isinstance(p_ref, torch.Tensor) else None
    return out.detach(), xr.grad, gp


def _clamped(held, eps, dtype):
    """Entries at or below eps as the op compares them (in the accumulation type)."""
    acc = acc_dtype(dtype)
    return held.to(acc) <= torch.tensor(eps, dtype=acc)


# The exact p-gradient is beyond p's float32 range (about 2e307 and 1e183):
# it saturates.
_P_GRAD_BEYOND_FLOAT32 = {("finfo.max", torch.float64), ("huge and eps p=0.0125", torch.float64)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_gem_table(case, dtype, layout, device, request):
    if INTERPRETED and layout == "columns" and case not in INTERPRETED_COLUMN_CASES:
        pytest.skip("the rows layout covers this case under Triton's interpreter")
    held, x, p_op, p_ref, eps, mask, op_mask = _setup(case, dtype, device, layout)
    dim = 1 if layout == "rows" else 0
    out = nf.gem(x, p_op, dim=dim, eps=eps, mask=op_mask)
    assert out.dtype == dtype and out.shape == (2,) and out.device.type == device
    g = torch.tensor([0.75, -1.25], dtype=torch.float64)
    eps_eff = _effective_eps(eps, dtype)
    ref, ref_dx, ref_dp = _oracle(held, p_ref, eps_eff, mask, g, dtype)
    got = out.detach().cpu().double()
    # Forward: the oracle's value (NaN where it is NaN, inf where inf), rounded to dtype.
    torch.testing.assert_close(got, ref.to(dtype).double(), equal_nan=True, **TOL[dtype])
    assert not torch.isnan(got[1]), "the plain row must not see the case's NaN"
    assert (got[~torch.isnan(got)] >= 0).all()

    out.backward(g.to(dtype).to(device))
    dx = x.grad.cpu().double()
    dx = dx if layout == "rows" else dx.t()
    dp = None if p_ref is p_op else p_op.grad
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    if dp is not None:
        assert dp.dtype == p_op.dtype and dp.shape == p_op.shape
        dp = dp.cpu().double().reshape(())
    keep = torch.ones_like(held, dtype=torch.bool) if mask is None else mask != 0
    assert (dx[~keep] == 0).all(), "a masked entry gets gradient 0 (NaN and inf under it too)"
    assert (dx[keep & _clamped(held, eps_eff, dtype)] == 0).all(), \
        "an entry at or below eps gets gradient 0"
    if bool(torch.isnan(ref[0])):
        # NaN stays in its reduction: its kept entries' gradients are NaN, and
        # p's (a clamped entry's is 0, as torch.clamp's).
        live = keep[0] & ~_clamped(held[0], eps_eff, dtype)
        assert torch.isnan(dx[0][live]).all() and (dx[0][~live] == 0).all()
        assert torch.isfinite(dx[1]).all()
        if dp is not None:
            assert torch.isnan(dp)
        return
    assert torch.isfinite(dx).all(), dx
    if not bool(torch.isfinite(ref[0])) or ref[0] == 0:
        assert (dx[0] == 0).all(), "an empty or +inf reduction passes no gradient"
    # Gradients against autograd of the oracle (the rules give 0 elsewhere),
    # saturated to the dtype.
    big = torch.finfo(dtype).max
    ref_dx = ref_dx.clamp(-big, big)
    gtol = dict(TOL[dtype])
    if dtype in (torch.float16, torch.bfloat16):
        gtol["rtol"] *= 2
    scale = max(1.0, float(ref_dx.abs().max()))
    torch.testing.assert_close(dx, ref_dx.to(dtype).double(), rtol=gtol["rtol"],
                               atol=gtol["atol"] * scale)
    if dp is not None:
        assert torch.isfinite(dp)
        if (case, dtype) in _P_GRAD_BEYOND_FLOAT32:
            # (the float64 oracle's own autograd overflows there)
            assert dp == torch.finfo(torch.float32).max
            return
        # p's gradient is computed in float32 (p's dtype) for every input dtype;
        # its error follows the input's rounding, whose values the oracle saw exactly.
        ptol = 1e-4 if dtype != torch.float64 else 1e-6
        pscale = max(1.0, float(ref_dp.abs()))
        torch.testing.assert_close(dp, ref_dp.double(), rtol=ptol, atol=ptol * pscale)


# --- layouts and values beyond the table --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["[B, L, 1] int", "[B, L, H] bool"])
def test_fully_masked_is_zero_with_zero_gradients(dtype, mask_kind, device):
    # Token pooling [B, L, H] with an attention mask [B, L]: a fully padded
    # sequence pools to 0 with gradient 0 (torch: NaN in p.grad and x.grad).
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64).to(dtype)
    am = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])

    def mask_of(attention):
        m = attention[..., None]
        return (m.expand(3, 5, 4).contiguous() != 0 if mask_kind.endswith("bool") else m).to(device)

    x = _leaf(base, device)
    p = torch.tensor([3.0], device=device, requires_grad=True)
    out = nf.gem(x, p, dim=1, mask=mask_of(am))
    assert out.shape == (3, 4) and out.dtype == dtype
    assert (out[1] == 0).all()
    out.backward(torch.ones_like(out))
    assert (x.grad[1] == 0).all() and (x.grad[0, 2:] == 0).all()
    assert torch.isfinite(x.grad).all() and torch.isfinite(p.grad).all()
    ref = gem_oracle.gem(base.double(), p.detach().cpu(), 1, 1e-6, am[..., None])
    torch.testing.assert_close(out.detach().cpu().double(), ref.to(dtype).double(), **TOL[dtype])
    # Every sequence padded: every output 0, every gradient 0.
    x.grad = None
    p.grad = None
    out = nf.gem(x, p, dim=1, mask=mask_of(torch.zeros_like(am)))
    out.backward(torch.ones_like(out))
    assert (out == 0).all() and (x.grad == 0).all() and (p.grad == 0).all()


def test_empty_dimension(device):
    x = torch.randn(3, 0, device=device, requires_grad=True)
    p = torch.tensor(3.0, device=device, requires_grad=True)
    out = nf.gem(x, p, dim=1)
    assert out.shape == (3,) and (out == 0).all()
    out.sum().backward()
    assert x.grad.shape == (3, 0) and p.grad.shape == () and p.grad == 0
    # And an empty batch: no reduction at all.
    y = torch.randn(0, 5, device=device, requires_grad=True)
    out = nf.gem(y, p, dim=1)
    assert out.shape == (0,)
    out.sum().backward()
    assert y.grad.shape == (0, 5)


@pytest.mark.parametrize("dims,keepdim", [((2, 3), False), ((2, 3), True), ((0, 2), False),
                                          ((0, 2), True), (-1, True), ((1,), False),
                                          ((3, 1), False), ((0, 1, 2, 3), False)])
def test_tuple_dims_match_oracle(dims, keepdim, device):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    x = _leaf(base, device)
    p = torch.tensor(2.5, dtype=torch.float64, device=device, requires_grad=True)
    out = nf.gem(x, p, dim=dims, keepdim=keepdim)
    xr = base.clone().requires_grad_(True)
    p_ref = torch.tensor(2.5, dtype=torch.float32, requires_grad=True)
    ref = gem_oracle.gem(xr, p_ref, dims, 1e-6)
    expected_shape = torch.sum(base, dim=dims, keepdim=keepdim).shape
    assert out.shape == expected_shape
    ref = ref.reshape(expected_shape)
    torch.testing.assert_close(out.detach().cpu(), ref.detach())
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (ref * g).sum().backward()
    out.backward(g.to(device))
    torch.testing.assert_close(x.grad.cpu(), xr.grad)
    # (the oracle takes p in float32, the op a float64 p in float32 too)
    torch.testing.assert_close(p.grad.cpu(), p_ref.grad.double(), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim_input(dtype, device):
    for value, expected, grad in ((2.0, 2.0, 1.0), (-3.0, 1e-6, 0.0)):
        x = torch.tensor(value, dtype=dtype, device=device, requires_grad=True)
        for dim in (0, -1):
            out = nf.gem(x, 3.0, dim=dim)
            assert out.shape == () and out.dtype == dtype
            torch.testing.assert_close(out.cpu(), torch.tensor(expected, dtype=dtype))
            (dx,) = torch.autograd.grad(out, x)
            assert dx.shape == () and dx == grad
        out = nf.gem(x, 3.0, dim=0, keepdim=True)
        assert out.shape == ()


@pytest.mark.parametrize("p_shape", [(), (1,)], ids=str)
def test_gem_pool2d_layout_huge_fp32(p_shape, device):
    # [B, C, H, W] -> [B, C, 1, 1]; fp32 activations of 1e4 with p = 10 (torch's
    # composition overflows: (1e4)^10 = 1e40 > float32 max).
    gen = torch.Generator().manual_seed(1)
    base = torch.rand(2, 3, 7, 7, generator=gen) * 1e4
    x = _leaf(base, device)
    p = torch.full(p_shape, 10.0, device=device, requires_grad=True)
    out = nf.gem_pool2d(x, p)
    assert out.shape == (2, 3, 1, 1)
    naive = base.clamp(min=1e-6).pow(10.0).mean(dim=(2, 3)).pow(0.1)
    assert torch.isinf(naive).all()
    p_ref = torch.tensor(10.0, requires_grad=True)
    xr = base.double().requires_grad_(True)
    ref = gem_oracle.gem(xr, p_ref, (2, 3), 1e-6)
    torch.testing.assert_close(out.detach().cpu().double().reshape(2, 3), ref.detach(),
                               rtol=2e-5, atol=0)
    g = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
    (ref * g).sum().backward()
    out.backward(g.float().reshape(2, 3, 1, 1).to(device))
    assert torch.isfinite(x.grad).all() and torch.isfinite(p.grad).all()
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(p.grad.cpu().double().reshape(()), p_ref.grad.double(),
                               rtol=1e-4, atol=1e-4 * float(p_ref.grad.abs()))


def test_fp16_eps_power_underflow(device):
    # eps^p underflows in fp16 (and (1e-4)^3 too): computed in fp32 on ratios.
    x = torch.full((2, 16), 1e-4, dtype=torch.float16)
    x[1] = 0
    x = x.detach().to(device).requires_grad_(True)
    p = torch.tensor([3.0], device=device, requires_grad=True)
    out = nf.gem(x, p, dim=1)
    assert torch.isfinite(out).all() and out[0] > 0
    got = out.detach().cpu().double()
    torch.testing.assert_close(got[0], torch.tensor(1e-4, dtype=torch.float16).double(),
                               rtol=1e-3, atol=0)
    torch.testing.assert_close(got[1], torch.tensor(1e-6, dtype=torch.float16).double(),
                               rtol=1e-2, atol=0)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(x.grad).all() and torch.isfinite(p.grad).all()
    assert (x.grad[1] == 0).all()
    # Equal entries: d gem / d x_i = 1/n, d gem / d p = 0 (D = 0 for a constant row).
    torch.testing.assert_close(x.grad[0].cpu().double(), torch.full((16,), 1 / 16,
                                                                     dtype=torch.float64),
                               rtol=1e-3, atol=0)
    assert p.grad.abs().item() <= 1e-9


@pytest.mark.parametrize("p_value", [0.02, 0.5])
def test_p_below_one_tiny_ratio_bounded(p_value, device):
    # p < 1 with an entry far below the max: r^(p-1) is huge; fp16 gradients
    # saturate at 65504 rather than becoming inf; an incoming 0 gives 0.
    x = torch.tensor([[6e4, 2e-6, 1.0]], dtype=torch.float16, device=device, requires_grad=True)
    p = torch.tensor([p_value], device=device, requires_grad=True)
    out = nf.gem(x, p, dim=1)
    (dx, dp) = torch.autograd.grad(out, (x, p), torch.ones_like(out), retain_graph=True)
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all()
    assert (dx[0, :2] > 0).all()
    (dx0, dp0) = torch.autograd.grad(out, (x, p), torch.zeros_like(out))
    assert (dx0 == 0).all() and (dp0 == 0).all()


@pytest.mark.parametrize("p_value", [0.01001, 0.1, 0.5, 0.99])
def test_ratio_below_float_range(p_value, device):
    # float32, a ratio below float's normal range (m / eps > 2^126): still
    # finite, no NaN, the oracle's value; an incoming 0 gives 0.
    x = torch.tensor([[3e38, 1e-6, 1e-30]], dtype=torch.float32, device=device,
                     requires_grad=True)
    p = torch.tensor([p_value], device=device, requires_grad=True)
    out = nf.gem(x, p, dim=1, eps=1e-8)
    ref = gem_oracle.gem(x.detach().cpu().double(), p.detach().cpu(), 1, 1e-8)
    torch.testing.assert_close(out.detach().cpu().double(), ref, rtol=1e-4, atol=0)
    dx, dp = torch.autograd.grad(out, (x, p), torch.ones_like(out), retain_graph=True)
    assert torch.isfinite(dx).all() and torch.isfinite(dp).all(), (p_value, dx, dp)
    dx0, dp0 = torch.autograd.grad(out, (x, p), torch.zeros_like(out))
    assert (dx0 == 0).all() and (dp0 == 0).all()


def test_nan_stays_in_its_reduction_multi_dim(device):
    gen = torch.Generator().manual_seed(2)
    base = torch.rand(3, 4, 5, generator=gen) + 0.1
    base[1, 2, 3] = NAN
    x = _leaf(base, device)
    p = torch.tensor(3.0, device=device, requires_grad=True)
    out = nf.gem(x, p, dim=(0, 2))
    assert torch.isnan(out[2]) and torch.isfinite(out[[0, 1, 3]]).all()
    out.backward(torch.ones(4, device=device))
    assert torch.isnan(x.grad[:, 2]).all()
    assert torch.isfinite(x.grad[:, [0, 1, 3]]).all()
    assert torch.isnan(p.grad)
    # Masked out, the NaN reaches nothing.
    x.grad = None
    p.grad = None
    keep = ~torch.isnan(base).to(device)
    out = nf.gem(x, p, dim=(0, 2), mask=keep)
    out.backward(torch.ones(4, device=device))
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all() and torch.isfinite(p.grad)
    assert x.grad[1, 2, 3] == 0


# --- p's gradient at small p: the divergence form ------------------------------------


def _p_grad_errors(x, p, eps, device):
    """(ours, torch's) largest per-row error of p's gradient against the oracle,
    relative to the largest exact gradient; torch's is inf where it is not finite."""
    ours, theirs, scale = [], [], 0.0
    p_op = torch.tensor([p], dtype=torch.float32, device=device, requires_grad=True)
    out = nf.gem(x.to(device), p_op, dim=1, eps=eps)
    for b in range(x.shape[0]):
        xb = x[b:b + 1]
        p_ref = torch.tensor(p, dtype=torch.float32, requires_grad=True)
        gem_oracle.gem(xb.double(), p_ref, 1, eps).sum().backward()
        ref = p_ref.grad.double().item()
        p_t = torch.tensor(p, dtype=torch.float32, requires_grad=True)
        # torch's composition at the input's dtype (a 0-dim float32 p does not promote it).
        xb.clamp(min=eps).pow(p_t).mean(1).pow(1 / p_t).float().sum().backward()
        torch_dp = p_t.grad.double().item()
        (dp,) = torch.autograd.grad(out[b], p_op, retain_graph=True)  # this row's alone
        ours.append(abs(dp.double().item() - ref))
        theirs.append(abs(torch_dp - ref) if math.isfinite(torch_dp) else INF)
        scale = max(scale, abs(ref))
    return max(ours) / scale, max(theirs) / scale


# Points where the remaining error is gem = m * mean^(1/p) itself (the saved
# mean's rounding raised to 1/p; D is within a few ulp there), and torch's
# composition was luckier: to be fixed by a centred forward, not by D.
_KNOWN_GEM_FORWARD_LIMITED = {(torch.float32, "relu", 0.05)}
# The CUDA kernels sum a row's r^p in another order (one thread per row of 33
# here): their saved mean rounds differently, and one more point of the same
# kind lands beyond the rule (p = 0.035: 3.1x torch's error, found by the
# emulated CUDA pass; the forward value itself is as accurate as the CPU's).
_KNOWN_GEM_FORWARD_LIMITED_CUDA = {(torch.float32, "relu", 0.035)}


def _known_forward_limited(device):
    known = set(_KNOWN_GEM_FORWARD_LIMITED)
    if SERVING[device] == "cuda":
        known |= _KNOWN_GEM_FORWARD_LIMITED_CUDA
    return known


# (Under Triton's interpreter: float32, fewer rows and values of p.)
@pytest.mark.parametrize("dtype", [torch.float32] if INTERPRETED else
                         [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["sin", "abs normal", "relu", "log-normal"])
def test_p_grad_sweep_at_most_twice_torch(kind, dtype, device):
    # p from the low clamp up: the old form T / (p mean) - log(mean) / p^2
    # cancelled two O(1/p) terms (2.2x torch's error at p = 0.0125); the
    # divergence D / p^2 has no cancellation. What is left is gem's own error,
    # the saved mean's rounding raised to 1/p, as in torch's composition.
    gen = torch.Generator().manual_seed(7)
    x = gem_oracle.distribution_rows(kind, 3 if INTERPRETED else 6, 33, gen).to(dtype)
    floor = torch.finfo(torch.float32).eps  # p's gradient is float32: one rounding
    known = []
    known_points = _known_forward_limited(device)
    ps = (0.0101, 0.0125, 0.02, 0.035, 0.05, 0.075, 0.1, 0.5, 3.0, 64.0)
    for p in ps[::2] if INTERPRETED else ps:
        ours, theirs = _p_grad_errors(x, p, 1e-6, device)
        # And absolutely: gem's rounding amplified by at most 1/p, plus a few ulp.
        assert ours <= (64 / p + 64) * floor, f"p={p}: error {ours}"
        if ours > 2 * theirs + floor:
            msg = f"p={p}: error {ours} vs torch {theirs}"
            assert (dtype, kind, p) in known_points, msg
            known.append(msg)
    # Strict: a known point that no longer exceeds the rule is taken off the list.
    listed = {q for d, k, q in known_points if (d, k) == (dtype, kind) and q in ps}
    if listed and not known and not INTERPRETED:  # (the interpreter's sweep is shorter)
        pytest.fail(f"{sorted(listed)} no longer beyond the rule: remove from "
                    "_KNOWN_GEM_FORWARD_LIMITED")
    if known:
        pytest.xfail("gem's forward rounding (mean^(1/p)), not D: " + "; ".join(known))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_p_grad_sum_saturates_never_nan(dtype, device):
    # 64 reductions whose p-gradient terms are each near the type's largest
    # value (rows [m, m / 10] with m near finfo.max, p just above the clamp):
    # their sum passes the range. It must saturate, and terms of both signs
    # must cancel, never meet as inf - inf = NaN.
    m = 0.9 * torch.finfo(dtype).max
    x = torch.tensor([m, m / 10], dtype=dtype).repeat(64, 1)
    p = torch.tensor([0.0125], dtype=dtype, device=device, requires_grad=True)
    signs = {"all positive": torch.ones(64), "balanced": torch.cat([torch.ones(32), -torch.ones(32)]),
             "more negative": torch.cat([torch.ones(24), -torch.ones(40)])}
    expected = {"all positive": torch.finfo(dtype).max, "balanced": 0.0,
                "more negative": -torch.finfo(dtype).max}
    for name, g in signs.items():
        p.grad = None
        out = nf.gem(x.to(device), p, dim=1)
        assert torch.isfinite(out).all()
        out.backward(g.to(dtype).to(device))
        assert p.grad.item() == expected[name], (name, p.grad.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_long_rows_match_oracle(dtype, device):
    # 10000 entries: past what the CUDA forward keeps in shared memory (8192
    # float, 4096 double per row), so it streams the row; 5 rows, more than
    # the grid-capped emulated build's 3 blocks.
    gen = torch.Generator().manual_seed(11)
    x = torch.rand(5, 10000, generator=gen, dtype=dtype) * 2
    x[1, 4000:] = 0.0  # clamped entries in a long row
    p = torch.tensor([2.5], dtype=torch.float32, requires_grad=True)
    grad = torch.randn(5, generator=gen, dtype=dtype)
    xd = x.detach().to(device).requires_grad_(True)
    pd = p.detach().to(device).requires_grad_(True)
    out = nf.gem(xd, pd, dim=1)
    dx, dp = torch.autograd.grad(out, (xd, pd), grad.to(device))
    xr = x.double().requires_grad_(True)
    pr = p.detach().double().requires_grad_(True)
    ref = gem_oracle.gem(xr, pr, 1, 1e-6, acc=torch.float64)
    rdx, rdp = torch.autograd.grad(ref, (xr, pr), grad.double())
    tol = dict(rtol=1e-4, atol=1e-7) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), **tol)
    torch.testing.assert_close(dx.cpu().double(), rdx, **tol)
    torch.testing.assert_close(dp.cpu().double(), rdp, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rows_at_every_alignment(offset, dtype, device):
    # Contiguous views `offset` elements into their storage: rows of 64
    # entries make whole 16-byte vectors, but only offset 0 is 16-byte aligned.
    # The result is that of an aligned copy (up to the summation order of
    # another launch plan).
    gen = torch.Generator().manual_seed(offset)
    rows, n = 5, 64
    storage = torch.rand(rows * n + 8, generator=gen, dtype=dtype).to(device)
    x = storage[offset:offset + rows * n].view(rows, n)
    grad = torch.randn(rows, generator=gen, dtype=dtype).to(device)
    results = []
    for xs in (x, x.clone()):
        xs = xs.detach().requires_grad_(True)
        p = torch.tensor([3.0], device=device, requires_grad=True)
        out = nf.gem(xs, p, dim=1)
        results.append((out, *torch.autograd.grad(out, (xs, p), grad)))
    for ours, aligned in zip(*results):
        torch.testing.assert_close(ours, aligned)
