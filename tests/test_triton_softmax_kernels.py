"""Triton softmax-family launchers on CPU tensors under TRITON_INTERPRET=1,
checked against a float64 torch reference of the DESIGN.md section 2 rules."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
# The interpreter evaluates both sides of tl.where (log 0, 1/0, inf - inf) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from nanfree._mask_layout import mask_layout  # noqa: E402
from nanfree._triton import softmax as K  # noqa: E402

INF = float("inf")
NAN = float("nan")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# (rtol, atol) against the float64 reference, for values of magnitude ~1.
TOL = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (4e-3, 1e-3),
    torch.bfloat16: (3e-2, 1e-2),
}


# ---------------------------------------------------------------- reference


def ref_forward(x, mask, with_stats=False):
    """float64 (softmax, log_softmax, logsumexp[, (max, log_sum)]) with the nanfree rules."""
    xd = x.double()
    if mask is not None:
        xd = xd.masked_fill(~mask, -INF)
    nan_row = torch.isnan(xd).any(-1, keepdim=True)
    m = torch.where(torch.isnan(xd), -INF, xd).amax(-1, keepdim=True)
    empty = (m == -INF) & ~nan_row
    posinf = m == INF
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(posinf, (xd == INF).double(), torch.exp(xd - shift))
    s = e.sum(-1, keepdim=True)
    sm = torch.where(empty, 0.0, e / s)
    lsm = torch.where(posinf, torch.log(sm), (xd - shift) - torch.log(s))
    lsm = torch.where(empty, -INF, lsm)
    lse = torch.where(posinf, INF, shift + torch.log(s))
    log_s = torch.where(nan_row, NAN, torch.log(s))
    sm, lsm, lse = (torch.where(nan_row, NAN, t) for t in (sm, lsm, lse))
    if with_stats:
        return sm, lsm, lse.squeeze(-1), torch.cat([m, log_s], dim=-1)
    return sm, lsm, lse.squeeze(-1)


def ref_backward(x, mask, g, g_row):
    """float64 gradients (softmax, log_softmax, logsumexp) for incoming g / g_row."""
    sm, lsm, lse = ref_forward(x, mask)
    keep = torch.ones_like(sm, dtype=torch.bool) if mask is None else mask
    has = ~torch.isinf(lse).unsqueeze(-1)
    g = g.double()
    d_sm = sm * (g - (g * sm).sum(-1, keepdim=True))
    g_kept = torch.where(keep, g, 0.0)
    d_lsm = torch.where(keep, g - torch.exp(lsm) * g_kept.sum(-1, keepdim=True), 0.0)
    d_lse = torch.where(keep, g_row.double().unsqueeze(-1) * sm, 0.0)
    return tuple(torch.where(has, d, 0.0) for d in (d_sm, d_lsm, d_lse))


def assert_near(actual, expected, dtype, scale=1.0, slack=None):
    """assert_close, plus an elementwise absolute allowance `slack` when given."""
    rtol, atol = TOL[dtype]
    # The reference is rounded to the dtype first: -2 * finfo.max is -inf there.
    actual, expected = actual.double(), expected.to(dtype).double()
    if slack is not None:
        near = (actual - expected).abs() <= slack
        actual = torch.where(near, expected, actual)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale,
                               equal_nan=True)


def run_all(x, mask, g, g_row):
    """Every launcher; backward ops take the forward's own output and stats."""
    sm, st_sm = K.softmax_lastdim(x, mask)
    lsm, st_lsm = K.log_softmax_lastdim(x, mask)
    out, st_lse = K.logsumexp_lastdim(x, mask)
    d_sm = K.softmax_lastdim_backward(g, sm, st_sm)
    d_lsm = K.log_softmax_lastdim_backward(g, lsm, st_lsm, mask)
    d_lse = K.logsumexp_lastdim_backward(g_row, x, st_lse, mask)
    return sm, lsm, out, (st_sm, st_lsm, st_lse), (d_sm, d_lsm, d_lse)


def check(x, mask, g=None, g_row=None):
    dtype = x.dtype
    gen = torch.Generator().manual_seed(1)
    if g is None:
        g = torch.randn(x.shape, generator=gen).to(dtype)
    if g_row is None:
        g_row = torch.randn(x.shape[:-1], generator=gen).to(dtype)
    sm, lsm, out, stats, grads = run_all(x, mask, g, g_row)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for t in (sm, lsm, *grads):
        assert t.dtype == dtype and t.shape == x.shape and t.is_contiguous()
    assert out.dtype == dtype and out.shape == x.shape[:-1]
    for t in stats:
        assert t.dtype == acc and t.shape == (*x.shape[:-1], 2) and t.is_contiguous()
    r_sm, r_lsm, r_lse, r_stats = ref_forward(x, mask, with_stats=True)
    assert_near(sm, r_sm, dtype)
    # log-probabilities and logsumexp grow with |x|: relative tolerance.
    assert_near(lsm, r_lsm, dtype, scale=10.0)
    for t in stats:  # (max, log_sum): the max exactly, never NaN
        assert torch.equal(t[..., 0].double(), r_stats[..., 0])
        assert_near(t[..., 1], r_stats[..., 1], acc)
    assert_near(out, r_lse, dtype, scale=10.0)
    # The log_softmax gradient g - exp(y) * sum(g) inherits the rounding of the
    # stored y (input dtype) times |sum(g)|, as torch's own does.
    keep = torch.ones_like(r_sm, dtype=torch.bool) if mask is None else mask
    g_sum = torch.where(keep, g.double(), 0.0).sum(-1, keepdim=True)
    slack = [None, (TOL[dtype][0] * g_sum.abs() * r_sm).nan_to_num(), None]
    for got, want, extra in zip(grads, ref_backward(x, mask, g, g_row), slack):
        assert_near(got, want, dtype, scale=2.0, slack=extra)
    return sm, lsm, out, grads


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)


def rand_mask(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) > 0.3


# ---------------------------------------------------------------- random inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 7, 128, 1000, 20000])
def test_random_unmasked(dtype, cols):
    rows = 2 if cols > 1000 else 3
    check(randn(rows, cols, dtype=dtype), None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_noncontiguous_input_and_grad(dtype):
    x = randn(9, 4, dtype=dtype).t()  # [4, 9], strided
    g = randn(9, 4, dtype=dtype, seed=2).t()
    check(x, None, g=g, g_row=randn(8, dtype=dtype)[::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("cols", [7, 1000])
def test_random_full_mask(dtype, cols):
    check(randn(2, 3, cols, dtype=dtype), rand_mask(2, 3, cols))


@pytest.mark.parametrize("cols", [7, 20000])
def test_expanded_mask(cols):
    # [B, 1, L] -> [B, H, L] (attention mask): broadcast rows, never copied.
    mask = rand_mask(2, 1, cols).expand(2, 3, cols)
    _, sizes, strides, _ = mask_layout(mask)
    assert 0 in strides
    check(randn(2, 3, cols, dtype=torch.float32), mask)


def test_expanded_mask_column_broadcast():
    # [B, H, 1] -> [B, H, L]: column stride 0, whole rows kept or dropped.
    mask = rand_mask(4, 3, 1).expand(4, 3, 9)
    assert mask_layout(mask)[3] == 0
    check(randn(4, 3, 9, dtype=torch.bfloat16), mask)


def test_mask_needing_materialization():
    mask = rand_mask(2, 1, 2, 1, 7).expand(2, 2, 2, 2, 7)  # four leading dims remain
    m, sizes, strides, col = mask_layout(mask)
    assert m.is_contiguous() and sizes == (1, 1, 16) and strides == (0, 0, 7)
    check(randn(2, 2, 2, 2, 7, dtype=torch.float64), mask)


def test_mask_layout_collapse():
    full = torch.ones(2, 3, 4, 5, dtype=torch.bool)
    assert mask_layout(full)[1:] == ((1, 1, 24), (0, 0, 5), 1)
    t = torch.ones(5, 4, 3, dtype=torch.bool).permute(2, 1, 0)  # [3, 4, 5]
    assert mask_layout(t)[1:] == ((1, 3, 4), (0, 1, 3), 12)
    e = torch.ones(2, 1, 1, 5, dtype=torch.bool).expand(2, 1, 6, 5)
    m, sizes, strides, col = mask_layout(e)
    assert m is e and (sizes, strides, col) == ((1, 2, 6), (0, 5, 0), 1)
    assert mask_layout(torch.ones(7, dtype=torch.bool))[1:] == ((1, 1, 1), (0, 0, 0), 1)


# ---------------------------------------------------------------- special values


def special_rows(dtype, cols):
    """Rows of special values (and their mask); cols >= 8."""
    fmax, tiny = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    x = randn(12, cols, dtype=torch.float64, seed=3)
    mask = torch.ones(12, cols, dtype=torch.bool)
    x[0] = -INF                                   # all -inf
    x[1, ::2] = NAN                               # fully masked, NaN underneath
    mask[1] = False
    x[2, 1], x[2, cols - 2], x[2, 3] = INF, INF, -INF   # two +inf
    x[3, cols - 1] = INF                          # one +inf, last column
    x[4, cols // 2] = NAN                         # NaN, unmasked
    x[5, 2] = NAN                                 # NaN, masked
    mask[5, 2] = False
    x[6] = torch.where(torch.arange(cols) % 2 == 0, 1e4, -1e4)
    x[7] = torch.where(torch.arange(cols) % 3 == 0, 1000.0, -1000.0)
    x[8, 0], x[8, 1], x[8, 5] = fmax, -fmax, fmax
    x[9] = tiny * torch.linspace(-0.5, 0.5, cols)  # denormals
    x[10] = -INF                                  # NaN among -inf only
    x[10, 4] = NAN
    x[11, 0], x[11, 6] = -INF, -fmax              # -inf and -max among finite
    return x.to(dtype), mask


def check_special(x, mask):
    cols = x.shape[-1]
    sm, lsm, out, grads = check(x, mask)
    # The rules, spelled out (the reference above encodes the same ones).
    assert (sm[0] == 0).all() and (sm[1] == 0).all()
    assert (lsm[0] == -INF).all() and (lsm[1] == -INF).all()
    assert out[0] == -INF and out[1] == -INF and out[2] == INF and out[3] == INF
    assert sm[2, 1] == 0.5 and sm[2, cols - 2] == 0.5 and sm[2].sum() == 1
    assert sm[3, cols - 1] == 1 and sm[3].sum() == 1
    assert torch.isclose(lsm[2, 1].double(), torch.tensor(-math.log(2), dtype=torch.float64),
                         rtol=1e-2)
    assert lsm[3, cols - 1] == 0 and (lsm[3, : cols - 1] == -INF).all()
    for rows in (sm, lsm):
        assert rows[4].isnan().all() and rows[10].isnan().all()
    assert out[4].isnan() and out[10].isnan()
    clean = [r for r in range(12) if r not in (4, 10)]
    for t in (sm, lsm, out, *grads):
        assert not t[clean].isnan().any()
    for grad in grads:
        assert (grad[:4] == 0).all()          # empty and +inf rows: no gradient
        assert grad[5, 2] == 0                # masked NaN: gradient 0
        assert torch.isfinite(grad[clean]).all()
        assert grad[4].isnan().any()          # NaN is not laundered


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(dtype):
    check_special(*special_rows(dtype, 9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_special_rows_block_loop(dtype, monkeypatch):
    # Force the multi-block path with small blocks: every special value lands in
    # some block, and a first all -inf block merges with later ones.
    monkeypatch.setattr(K, "MAX_FUSED_COLS", 16)
    monkeypatch.setattr(K, "LOOP_BLOCK", 8)
    x, mask = special_rows(dtype, 21)  # blocks of 8, 8 and 5 columns
    x[11, :8] = -INF
    check_special(x, mask)


def test_log_softmax_grad_at_unmasked_minus_inf():
    x = torch.tensor([[0.0, -INF, 1.0]])
    g = torch.tensor([[1.0, 2.0, 3.0]])
    y, stats = K.log_softmax_lastdim(x, None)
    d = K.log_softmax_lastdim_backward(g, y, stats, None)
    assert d[0, 1] == 2.0  # receives g there


# ---------------------------------------------------------------- shapes


def test_empty_shapes():
    for fn in (K.softmax_lastdim, K.log_softmax_lastdim):
        y, stats = fn(torch.empty(3, 0), None)
        assert y.shape == (3, 0) and (stats == -INF).all() and stats.shape == (3, 2)
        y, stats = fn(torch.empty(0, 5), torch.ones(0, 5, dtype=torch.bool))
        assert y.shape == (0, 5) and stats.shape == (0, 2)
    out, stats = K.logsumexp_lastdim(torch.empty(2, 3, 0, dtype=torch.float16), None)
    assert out.shape == (2, 3) and out.dtype == torch.float16 and (out == -INF).all()
    d = K.logsumexp_lastdim_backward(torch.ones(2, 3), torch.empty(2, 3, 0), stats, None)
    assert d.shape == (2, 3, 0)
    d = K.softmax_lastdim_backward(torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 2))
    assert d.shape == (0, 4)


def test_one_dim_input():
    x = randn(10)
    sm, stats = K.softmax_lastdim(x, None)
    assert stats.shape == (2,) and sm.shape == (10,)
    check(x, rand_mask(10))
