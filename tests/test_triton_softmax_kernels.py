"""The Triton softmax-family launchers (nanfree._triton.softmax), called directly,
checked against a float64 torch reference of the DESIGN.md section 2 rules.

They run where conftest.triton_kernel_device says; shapes are small (the
interpreter runs every program in numpy)."""

import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import (DTYPES, INF, NAN, TRITON_KERNEL_TOL, triton_kernel_device,  # noqa: E402
                      triton_kernel_mode_matches, triton_refusal_words, triton_refused_devices)
from nanfree._backends import BackendUnavailableError  # noqa: E402
from nanfree._ops.layout import mask_layout  # noqa: E402
from nanfree._triton import softmax as K  # noqa: E402

DEVICE = triton_kernel_device(K)

# The interpreter evaluates both sides of tl.where (log 0, 1/0, inf - inf) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = TRITON_KERNEL_TOL


# ---------------------------------------------------------------- reference


def ref_forward(x, mask, with_stats=False):
    """float64 (softmax, log_softmax, logsumexp[, (max, log_sum)]) over the last
    dim with the nanfree rules."""
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
    """float64 last-dim gradients (softmax, log_softmax, logsumexp) for incoming g / g_row."""
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


def run_all(x, mask, dim, g, g_row):
    """Every launcher on DEVICE; backward ops take the forward's own output and
    stats. Results come back on the CPU."""
    x, g, g_row = x.to(DEVICE), g.to(DEVICE), g_row.to(DEVICE)
    mask = None if mask is None else mask.to(DEVICE)
    sm, st_sm = K.softmax(x, dim, mask)
    lsm, st_lsm = K.log_softmax(x, dim, mask)
    out, st_lse = K.logsumexp(x, dim, mask)
    d_sm = K.softmax_backward(g, sm, st_sm, dim)
    d_lsm = K.log_softmax_backward(g, lsm, st_lsm, dim, mask)
    d_lse = K.logsumexp_backward(g_row, x, st_lse, dim, mask)
    for t in (sm, lsm, out, st_sm, st_lsm, st_lse, d_sm, d_lsm, d_lse):
        assert t.device == x.device
    cpu = lambda ts: tuple(t.cpu() for t in ts)  # noqa: E731
    return (*cpu((sm, lsm, out)), cpu((st_sm, st_lsm, st_lse)), cpu((d_sm, d_lsm, d_lse)))


def without(shape, dim):
    return shape[:dim] + shape[dim + 1:]


def check(x, mask, dim=-1, g=None, g_row=None):
    """Runs every launcher over `dim` and compares with the reference; returns
    (softmax, log_softmax, logsumexp, grads) with `dim` moved last."""
    dtype = x.dtype
    d = dim % x.dim()
    gen = torch.Generator().manual_seed(1)
    if g is None:
        g = torch.randn(x.shape, generator=gen).to(dtype)
    if g_row is None:
        g_row = torch.randn(without(x.shape, d), generator=gen).to(dtype)
    sm, lsm, out, stats, grads = run_all(x, mask, dim, g, g_row)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for t in (sm, lsm, *grads):
        assert t.dtype == dtype and t.shape == x.shape and t.is_contiguous()
    assert out.dtype == dtype and out.shape == without(x.shape, d) and out.is_contiguous()
    stats_shape = x.shape[:d] + (2,) + x.shape[d + 1:]
    for t in stats:
        assert t.dtype == acc and t.shape == stats_shape and t.is_contiguous()
    # The reference takes a bool mask of x's shape and works over the last
    # dim: move `dim` there.
    last = lambda t: t.movedim(d, -1)  # noqa: E731
    mask = None if mask is None else last((mask != 0).expand(x.shape))
    x, g = last(x), last(g)
    sm, lsm, grads, stats = last(sm), last(lsm), [last(t) for t in grads], [last(t) for t in stats]
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


@pytest.fixture
def small_strided_tiles(monkeypatch):
    """Strided blocks of 2 columns i and tiles of 4 x 2: rows span several tiles
    and the i-blocks of an odd inner size end partly outside the problem."""
    monkeypatch.setattr(K, "STRIDED_BLOCK_I", 2)
    monkeypatch.setattr(K, "STRIDED_TILE", 8)


# ---------------------------------------------------------------- device and mode


def test_kernel_mode_and_device():
    assert triton_kernel_mode_matches(K, DEVICE)


@pytest.mark.parametrize("device", triton_refused_devices(DEVICE))
def test_refuses_tensors_the_kernels_cannot_run_on(device):
    # Refused before any launch, whatever the shape (never an error from inside Triton).
    words = triton_refusal_words(DEVICE)
    x = torch.zeros(3, 4, 5, device=device)
    stats = torch.zeros(3, 2, 5, device=device)
    calls = [
        lambda: K.softmax(x, 1),
        lambda: K.log_softmax(x, -1, torch.ones(5, dtype=torch.bool, device=device)),
        lambda: K.logsumexp(x[:, :0], 1),
        lambda: K.softmax_backward(x, x, stats, 1),
        lambda: K.log_softmax_backward(x, x, stats, 1),
        lambda: K.logsumexp_backward(x[:, 0], x, stats, 1),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError) as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)


def test_argument_errors_are_the_ops():
    x = torch.zeros(3, 4, device=DEVICE)
    with pytest.raises(TypeError, match="nanfree.softmax: `input` must be float16"):
        K.softmax(torch.zeros(3, 4, dtype=torch.int32, device=DEVICE), 1)
    with pytest.raises(IndexError, match="nanfree.logsumexp: `dim` 2 is out of range"):
        K.logsumexp(x, 2)
    with pytest.raises(TypeError, match="nanfree.log_softmax: `mask` must be bool or integer"):
        K.log_softmax(x, 0, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="does not broadcast"):
        K.log_softmax(x, 0, torch.ones(3, dtype=torch.bool, device=DEVICE))
    y, stats = K.softmax(x, 0)
    with pytest.raises(ValueError, match="nanfree.softmax_backward: `stats` must be"):
        K.softmax_backward(y, y, stats, 1)
    with pytest.raises(ValueError, match="nanfree.logsumexp_backward: `grad_output` has shape"):
        K.logsumexp_backward(y, x, stats, 0)


def test_strided_problems_use_the_strided_kernels(monkeypatch):
    # inner > 1 never reaches the last-dim kernels (so no movedim either).
    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("a last-dim kernel was launched for a strided problem")

    for name in ("_forward_kernel", "_softmax_backward_kernel", "_logsumexp_backward_kernel"):
        monkeypatch.setattr(K, name, Refuse())
    check(randn(2, 5, 3), rand_mask(2, 5, 3), dim=1)
    check(randn(5, 4, dtype=torch.float64), None, dim=0)


# ---------------------------------------------------------------- random inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 7, 128, 1000, 20000])
def test_random_unmasked(dtype, cols):
    rows = 2 if cols > 1000 else 3
    check(randn(rows, cols, dtype=dtype), None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cols", [1, 7, 300, 5000])
def test_random_unmasked_strided(dtype, cols):
    # [2, cols, 3] over dim 1: inner 3 (one i-block, partly outside); 5000
    # columns loop over tiles with the default block sizes.
    check(randn(2, cols, 3, dtype=dtype), None, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_random_strided_dim0_wide_inner(dtype):
    # [cols, 130] over dim 0: inner 130 spans three i-blocks of 64, the last partial.
    check(randn(9, 130, dtype=dtype), rand_mask(9, 130), dim=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_noncontiguous_input_and_grad(dtype):
    x = randn(9, 4, dtype=dtype).t()  # [4, 9], strided
    g = randn(9, 4, dtype=dtype, seed=2).t()
    check(x, None, g=g, g_row=randn(8, dtype=dtype)[::2])
    # The same over dim 0 (strided path on the copies).
    check(x, None, dim=0, g=g, g_row=randn(18, dtype=dtype)[::2])


def test_random_noncontiguous_strided_3d():
    x = randn(5, 6, 4, dtype=torch.float32).permute(2, 1, 0)  # [4, 6, 5], not contiguous
    check(x, rand_mask(4, 6, 5), dim=1)


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
    assert m.data_ptr() == e.data_ptr() and (sizes, strides, col) == ((1, 2, 6), (0, 5, 0), 1)
    assert mask_layout(torch.ones(7, dtype=torch.bool))[1:] == ((1, 1, 1), (0, 0, 0), 1)
    assert mask_layout(torch.ones((), dtype=torch.bool), 0)[1:] == ((1, 1, 1), (0, 0, 0), 0)


def test_mask_layout_of_a_strided_dim():
    # The reduced dim moves last (a view): rows r = o * inner + i, columns j.
    dense = torch.ones(2, 7, 3, dtype=torch.bool)  # strides (21, 3, 1)
    m, sizes, strides, col = mask_layout(dense, 1)
    assert m.data_ptr() == dense.data_ptr()
    assert (sizes, strides, col) == ((1, 2, 3), (0, 21, 1), 3)
    over_outer = torch.ones(7, 3, dtype=torch.bool).expand(2, 7, 3)
    assert mask_layout(over_outer, 1)[1:] == ((1, 2, 3), (0, 0, 1), 3)
    over_inner = torch.ones(2, 7, 1, dtype=torch.bool).expand(2, 7, 3)
    assert mask_layout(over_inner, -2)[1:] == ((1, 2, 3), (0, 7, 0), 1)
    # Four dims left besides the reduced one, not collapsible: made contiguous, dim last.
    odd = torch.ones(2, 1, 2, 1, 5, 3, dtype=torch.bool).expand(2, 2, 2, 2, 5, 3)
    m, sizes, strides, col = mask_layout(odd, 4)
    assert m.is_contiguous() and m.shape == (2, 2, 2, 2, 3, 5)
    assert (sizes, strides, col) == ((1, 1, 48), (0, 0, 5), 1)


STRIDED_MASKS = {
    # [2, cols, 3] over dim 1
    "dense": lambda cols: rand_mask(2, cols, 3),
    "broadcast_inner": lambda cols: rand_mask(2, cols, 1).expand(2, cols, 3),
    "broadcast_outer": lambda cols: rand_mask(cols, 3),
    "broadcast_columns": lambda cols: rand_mask(2, 1, 3).expand(2, cols, 3),
    "transposed": lambda cols: rand_mask(3, cols, 2).permute(2, 1, 0),
    "integer": lambda cols: rand_mask(2, cols, 3).to(torch.int32) * 7,
}


@pytest.mark.parametrize("layout", list(STRIDED_MASKS))
@pytest.mark.parametrize("tiles", ["one_tile", "small_tiles"])
def test_strided_masks(layout, tiles, request):
    # 9 columns in one tile of the default sizes; 21 columns over six tiles of 4.
    if tiles == "small_tiles":
        request.getfixturevalue("small_strided_tiles")
    cols = 9 if tiles == "one_tile" else 21
    check(randn(2, cols, 3, dtype=torch.float32), STRIDED_MASKS[layout](cols), dim=1)


def test_strided_mask_attention_style():
    # scores [B, H, Lq, Lk] reduced over the queries (dim 2) with a key mask
    # [B, 1, 1, Lk]: every row of the problem is one key, kept or dropped whole.
    mask = rand_mask(2, 1, 1, 5)
    mask[0, 0, 0, 1] = False
    check(randn(2, 3, 4, 5, dtype=torch.float32), mask.expand(2, 3, 4, 5), dim=2)


def test_strided_mask_needing_materialization():
    mask = rand_mask(2, 1, 2, 1, 6, 3).expand(2, 2, 2, 2, 6, 3)
    check(randn(2, 2, 2, 2, 6, 3, dtype=torch.float64), mask, dim=4)


# ---------------------------------------------------------------- special values


def special_rows(dtype, cols):
    """Rows of special values (and their mask), [12, cols]; cols >= 8."""
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


# Where the table's rows go: (to the layout, its reduced dim). Every layout keeps
# one case per row of the problem: row r of the table is row r = o * inner + i.
LAYOUTS = {
    "lastdim": (lambda t: t, -1),
    "outer4_inner3": (lambda t: t.reshape(4, 3, -1).transpose(1, 2).contiguous(), 1),
    "inner12": (lambda t: t.t().contiguous(), 0),
}


def check_special(x, mask, layout="lastdim"):
    """check() of the special-row table laid out as `layout`, then the rules
    spelled out on the rows (the reference above encodes the same ones)."""
    to_layout, dim = LAYOUTS[layout]
    cols = x.shape[-1]
    sm, lsm, out, grads = check(to_layout(x), to_layout(mask), dim=dim)
    # Back to the table's [12, cols] rows (check returns `dim` moved last).
    sm, lsm = sm.reshape(12, cols), lsm.reshape(12, cols)
    grads = [t.reshape(12, cols) for t in grads]
    out = out.reshape(12)
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(dtype, layout):
    check_special(*special_rows(dtype, 9), layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_special_rows_block_loop(dtype, monkeypatch):
    # Force the multi-block path with small blocks: every special value lands in
    # some block, and a first all -inf block merges with later ones.
    monkeypatch.setattr(K, "MAX_FUSED_COLS", 16)
    monkeypatch.setattr(K, "LOOP_BLOCK", 8)
    x, mask = special_rows(dtype, 21)  # blocks of 8, 8 and 5 columns
    x[11, :8] = -INF
    check_special(x, mask)


@pytest.mark.parametrize("layout", ["outer4_inner3", "inner12"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_special_rows_tile_loop(dtype, layout, small_strided_tiles):
    # The strided path over tiles of 4 columns: every special value lands in
    # some tile, and a first all -inf tile merges with later ones.
    x, mask = special_rows(dtype, 21)  # tiles of 4, 4, 4, 4, 4 and 1 columns
    x[11, :8] = -INF
    check_special(x, mask, layout)


@pytest.mark.parametrize("dim", [-1, 0])
def test_log_softmax_grad_at_unmasked_minus_inf(dim):
    x = torch.tensor([[0.0, -INF, 1.0]] * 2, device=DEVICE)
    g = torch.tensor([[1.0, 2.0, 3.0]] * 2, device=DEVICE)
    if dim == 0:  # columns of a [3, 2] problem: the strided path
        x, g = x.t().contiguous(), g.t().contiguous()
    y, stats = K.log_softmax(x, dim, None)
    d = K.log_softmax_backward(g, y, stats, dim, None)
    assert (d.select(dim, 1) == 2.0).all()  # receives g there


# ---------------------------------------------------------------- shapes


def test_empty_shapes():
    e = lambda *shape: torch.empty(shape, device=DEVICE)  # noqa: E731
    for fn in (K.softmax, K.log_softmax):
        y, stats = fn(e(3, 0), -1)
        assert y.shape == (3, 0) and (stats == -INF).all() and stats.shape == (3, 2)
        y, stats = fn(e(0, 5), 1, torch.ones(0, 5, dtype=torch.bool, device=DEVICE))
        assert y.shape == (0, 5) and stats.shape == (0, 2)
        # Strided: no columns, no outer rows, no inner rows.
        y, stats = fn(e(2, 0, 3), 1)
        assert y.shape == (2, 0, 3) and stats.shape == (2, 2, 3) and (stats == -INF).all()
        y, stats = fn(e(0, 4, 3), 1)
        assert y.shape == (0, 4, 3) and stats.shape == (0, 2, 3)
        y, stats = fn(e(2, 4, 0), 1)
        assert y.shape == (2, 4, 0) and stats.shape == (2, 2, 0)
    out, stats = K.logsumexp(e(2, 3, 0).half(), 2)
    assert out.shape == (2, 3) and out.dtype == torch.float16 and (out == -INF).all()
    d = K.logsumexp_backward(torch.ones(2, 3, device=DEVICE), e(2, 3, 0), stats, 2)
    assert d.shape == (2, 3, 0)
    out, stats = K.logsumexp(e(2, 0, 3), 1)
    assert out.shape == (2, 3) and (out == -INF).all() and stats.shape == (2, 2, 3)
    d = K.logsumexp_backward(torch.ones(2, 3, device=DEVICE), e(2, 0, 3), stats, 1)
    assert d.shape == (2, 0, 3)
    d = K.softmax_backward(e(0, 4), e(0, 4), e(0, 2), 1)
    assert d.shape == (0, 4)
    d = K.log_softmax_backward(e(2, 0, 3), e(2, 0, 3), stats, -2)
    assert d.shape == (2, 0, 3)


def test_one_dim_input():
    x = randn(10)
    sm, stats = K.softmax(x.to(DEVICE), 0)
    assert stats.shape == (2,) and sm.shape == (10,)
    check(x, rand_mask(10), dim=0)


@pytest.mark.parametrize("dim", [0, -1])
def test_zero_dim_input(dim):
    # One row of one entry: softmax 1, log_softmax 0, logsumexp x; stats [2].
    x = torch.tensor(2.5, device=DEVICE)
    g = torch.tensor(3.0, device=DEVICE)
    for keep in (None, True, False):
        mask = None if keep is None else torch.tensor(keep, device=DEVICE)
        kept = keep is not False
        sm, st_sm = K.softmax(x, dim, mask)
        lsm, st_lsm = K.log_softmax(x, dim, mask)
        lse, st_lse = K.logsumexp(x, dim, mask)
        for t in (sm, lsm, lse):
            assert t.shape == () and t.dtype == torch.float32
        for t in (st_sm, st_lsm, st_lse):
            assert t.shape == (2,)
        assert sm.item() == (1.0 if kept else 0.0)
        assert lsm.item() == (0.0 if kept else -INF)
        assert lse.item() == (2.5 if kept else -INF)
        assert st_sm.tolist() == ([2.5, 0.0] if kept else [-INF, -INF])
        grads = (K.softmax_backward(g, sm, st_sm, dim),
                 K.log_softmax_backward(g, lsm, st_lsm, dim, mask),
                 K.logsumexp_backward(g, x, st_lse, dim, mask))
        for d in grads:
            assert d.shape == ()
        # softmax: y * (g - g * y) = 0; log_softmax: g - exp(0) * g = 0; logsumexp: g.
        assert [d.item() for d in grads] == [0.0, 0.0, 3.0 if kept else 0.0]
