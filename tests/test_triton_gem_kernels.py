"""The Triton GeM launchers (nanfree._triton.gem), called directly, checked
against the pure-PyTorch implementation (nanfree._torch_backend.gem: the same
rules of csrc/include/nanfree/gem_math.h, mirrored in torch) to float
rounding, on both layouts of the [outer, n, inner] problem (inner == 1 rows,
as gem_pool2d's [B*C, H*W, 1]; inner > 1, the token layout [B, L, H] reduced
over L), with the special-value rules spelled out on top; and the mirrored
header functions one by one against the reference's.

They run where conftest.triton_kernel_device says; shapes are small (the
interpreter runs every program in numpy)."""

import math

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import (DTYPES, INF, NAN, triton_kernel_device, triton_kernel_mode_matches,
                      triton_refusal_words, triton_refused_devices)  # noqa: E402
from nanfree._backends import BackendUnavailableError  # noqa: E402
from nanfree._torch_backend import gem as R  # noqa: E402
from nanfree._triton import gem as K  # noqa: E402
from nanfree._triton.gem import (gem_divergence_h, gem_input_grad_weight,  # noqa: E402
                                 gem_log_ratio, gem_p_grad, gem_ratio_power, gem_rescale_sum,
                                 gem_value)

DEVICE = triton_kernel_device(K)

# The interpreter evaluates both sides of tl.where (log 0, 0 / 0, inf * 0) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

EPS = 1e-6  # the ops' default
TINY_EPS = 1e-300  # below every accumulation type's smallest normal: raised to it
# Relative tolerance against the reference, per dtype of the compared values:
# a few rounding errors of the accumulation type (more in float32 for the log
# domain, where exp(a) carries the rounding of an `a` up to ~90 in size), one
# unit in the last place of a half-precision output.
RTOL = {
    torch.float64: 1e-11,
    torch.float32: 3e-5,
    torch.float16: 2.0 ** -10,
    torch.bfloat16: 2.0 ** -7,
}
# grad_p (a sum over reductions) against the sum of its terms' magnitudes.
P_GRAD_RTOL = {torch.float64: 1e-11, torch.float32: 1e-4}


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def eff_eps(eps, dtype):
    return max(eps, torch.finfo(acc_dtype(dtype)).tiny)


def on_device(*ts):
    return tuple(None if t is None else t.to(DEVICE) for t in ts)


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def rand_mask(*shape, keep=0.7, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) < keep


def assert_close(got, want, dtype, what, scale=None, rtol=None):
    """got == want up to RTOL[dtype] relative (plus rtol * scale where given),
    NaN and infinities in the same places; a subnormal value of `dtype` may be
    one step off."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    rtol = RTOL[dtype] if rtol is None else rtol
    step = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    tol = rtol * want.abs() + step
    if scale is not None:
        tol = tol + rtol * torch.as_tensor(scale, dtype=torch.float64).abs()
    same = (got == want) | (got.isnan() & want.isnan())
    bad = ~same & ~((got - want).abs() <= tol)  # inf against finite and NaN against a number fail
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: got {got[bad][:4].tolist()}, want "
        f"{want[bad][:4].tolist()} (rtol {rtol})")


# ---------------------------------------------------------------- running and checking


def run(x, p=None, p_value=3.0, eps=EPS, mask=None, g=None, seed=1):
    """gem and gem_backward on DEVICE, checked against the torch reference on
    the same inputs (the backward on the kernel's own stats, both ways).
    Returns (out, stats, grad_input, grad_p) on the CPU."""
    acc = acc_dtype(x.dtype)
    # mean^(1/p) multiplies the mean's relative rounding error by 1/p (the
    # output's and the gradients' condition number for p < 1).
    p_used = float(R.gem_p_acc(p, p_value, acc, "cpu"))
    cond = max(1.0, 1.0 / p_used) if p_used == p_used else 1.0
    rtol = max(RTOL[x.dtype], RTOL[acc] * cond)
    if g is None:
        gen = torch.Generator().manual_seed(seed)
        g = (2 * torch.rand((x.shape[0], x.shape[2]), generator=gen, dtype=torch.float64) - 1)
        g = g.to(x.dtype)
    xd, pd, md, gd = on_device(x, p, mask, g)
    out, stats = K.gem(xd, pd, p_value, eps, md)
    assert out.device == xd.device and stats.device == xd.device
    assert out.shape == (x.shape[0], x.shape[2]) and out.dtype == x.dtype and out.is_contiguous()
    assert stats.shape == (x.shape[0], x.shape[2], 3) and stats.dtype == acc
    p_grad = p is not None
    grad, grad_p = K.gem_backward(gd, xd, pd, p_value, stats, eps, md, p_grad)
    assert grad.shape == x.shape and grad.dtype == x.dtype and grad.device == xd.device
    assert grad_p.dtype == acc and grad_p.device == xd.device
    out, stats, grad, grad_p = (t.cpu() for t in (out, stats, grad, grad_p))

    r_out, r_stats = R.gem(x, p, p_value, eps, mask)
    assert_close(out, r_out, x.dtype, "gem output vs torch backend", rtol=rtol)
    # m is the largest clamped entry and count an integer: both exact.
    assert_close(stats[..., 0], r_stats[..., 0], acc, "stats m", rtol=0.0)
    assert_close(stats[..., 1], r_stats[..., 1], acc, "stats mean")
    assert_close(stats[..., 2], r_stats[..., 2], acc, "stats count", rtol=0.0)

    r_grad, r_grad_p = R.gem_backward(g, x, p, p_value, stats, eps, mask, p_grad)
    assert_close(grad, r_grad, x.dtype, "gem_backward grad_input vs torch backend", rtol=rtol)
    # No gradient at all (exactly 0) for masked and clamped entries.
    dead = x.double() <= eff_eps(eps, x.dtype)
    if mask is not None:
        dead = dead | ~mask
    assert (grad[dead] == 0).all()
    if p_grad:
        assert grad_p.shape == ()
        # The scale: the sum of the reductions' |d gem / d p| (gem, D >= 0).
        _, scale = R.gem_backward(g.abs(), x, p, p_value, stats, eps, mask, True)
        assert_close(grad_p, r_grad_p, acc, "grad_p vs torch backend", scale=scale,
                     rtol=P_GRAD_RTOL[acc] * cond)
    else:
        assert grad_p.shape == (0,)
    return out, stats, grad, grad_p


def tokens(x_rows):
    """The token layout of a rows problem [R, n, 1]: [1, n, R] (inner = R,
    reduced over n), a copy with the same reductions."""
    return x_rows.permute(2, 1, 0).contiguous()


# ---------------------------------------------------------------- device and mode


def test_kernel_mode_and_device():
    assert triton_kernel_mode_matches(K, DEVICE)


@pytest.mark.parametrize("device", triton_refused_devices(DEVICE))
def test_refuses_tensors_the_kernels_cannot_run_on(device):
    # Refused before any launch, whatever the shape (never an error from inside Triton).
    words = triton_refusal_words(DEVICE)
    x = torch.ones(2, 5, 3, device=device)
    g = torch.ones(2, 3, device=device)
    stats = torch.zeros(2, 3, 3, device=device)
    p = torch.tensor(3.0, device=device)
    calls = [
        lambda: K.gem(x, None, 3.0, EPS),
        lambda: K.gem(x[:0], p, 0.0, EPS),
        lambda: K.gem_backward(g, x, p, 0.0, stats, EPS, None, True),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError) as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)
    # The argument checks come first.
    with pytest.raises(TypeError, match="nanfree.gem: `input` must be float16"):
        K.gem(x.int(), None, 3.0, EPS)


def test_argument_errors_are_the_ops():
    x = torch.ones(2, 5, 3, device=DEVICE)
    p = torch.tensor([3.0], device=DEVICE)
    with pytest.raises(TypeError, match="nanfree.gem: `input` must be float16"):
        K.gem(x.long(), p, 0.0, EPS)
    with pytest.raises(ValueError, match=r"nanfree.gem: `input` must be 3-D \[outer, n, inner\]"):
        K.gem(x[0], p, 0.0, EPS)
    for eps in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="nanfree.gem: `eps` must be positive"):
            K.gem(x, p, 0.0, eps)
    for bad_p in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="nanfree.gem: `p` must be finite and > 0"):
            K.gem(x, None, bad_p, EPS)
    with pytest.raises(ValueError, match="nanfree.gem: a tensor `p` must have shape"):
        K.gem(x, torch.ones(2, device=DEVICE), 0.0, EPS)
    with pytest.raises(TypeError, match="nanfree.gem: `mask` must be bool"):
        K.gem(x, p, 0.0, EPS, torch.ones(2, 5, 3, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="nanfree.gem: `mask` has shape"):
        K.gem(x, p, 0.0, EPS, torch.ones(2, 5, 1, dtype=torch.bool, device=DEVICE))
    out, stats = K.gem(x, p, 0.0, EPS)
    with pytest.raises(ValueError, match="nanfree.gem_backward: `p_grad` needs a tensor `p`"):
        K.gem_backward(out, x, None, 3.0, stats, EPS, None, True)
    with pytest.raises(ValueError, match="nanfree.gem_backward: `grad_output` must be"):
        K.gem_backward(out[:1], x, p, 0.0, stats, EPS, None, True)
    with pytest.raises(ValueError, match="nanfree.gem_backward: `stats` must be"):
        K.gem_backward(out, x, p, 0.0, stats.double(), EPS, None, True)


# ---------------------------------------------------------------- random problems


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "tokens"])
@pytest.mark.parametrize("variant", ["tensor p, mask", "python p"])
def test_random(dtype, layout, variant):
    # Normal entries: about half of them negative, clamped to eps (eps^p enters p's gradient).
    if layout == "rows":  # gem_pool2d's layout: 6 rows of 7 x 7, a partial program of rows
        x = randn(6, 49, 1, dtype=dtype)
        mask = rand_mask(6, 49, 1)
    else:  # tokens [B, L, H] with an attention mask [B, L, 1] broadcast over H
        x = randn(2, 9, 37, dtype=dtype)
        mask = torch.ones(2, 9, 1, dtype=torch.bool)
        mask[0, 6:] = False  # padding
        mask = mask.expand(2, 9, 37)
    if variant == "python p":
        out, *_ = run(x, None, 2.5)
    else:
        out, stats, _, grad_p = run(x, torch.tensor([3.0]), 0.0, mask=mask)
        assert torch.isfinite(grad_p) and (stats[..., 2] > 0).all()
    assert torch.isfinite(out).all() and (out > 0).all()


def test_backward_is_deterministic():
    x = randn(3, 40, 21, seed=5)
    p = torch.tensor(2.0)
    xd, pd = on_device(x, p)
    out, stats = K.gem(xd, pd, 0.0, EPS)
    first = K.gem_backward(out, xd, pd, 0.0, stats, EPS, None, True)
    second = K.gem_backward(out, xd, pd, 0.0, stats, EPS, None, True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ---------------------------------------------------------------- p


# A tensor p is clamped to [1e-2, 1e2] (1e-3 and 1e3 act as the bounds); a
# Python p is used as is (1e-3, 1e30 and 1e300: inf in float32).
TENSOR_PS = [1e-3, 0.05, 0.5, 1.0, 10.0, 100.0, 1e3]
PYTHON_PS = [1e-3, 0.37, 150.0, 1e4, 1e30, 1e300]


def p_rows(dtype):
    """[4, 12, 1]: positive, with entries clamped, spread over decades, a small row."""
    x = randn(4, 12, 1, dtype=torch.float64, seed=7).abs()
    x[1] = torch.exp(3 * randn(12, 1, dtype=torch.float64, seed=8))  # ratios down to 1e-6
    x[2, ::3] = -1.0
    x[3] = 1e-3 * x[3] + 1e-5
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_p(dtype):
    x = p_rows(dtype)
    for pv in TENSOR_PS:
        out, *_ = run(x, torch.tensor(pv), 0.0)
        assert torch.isfinite(out).all()
    # p at a bound is the bound: 1e-3 gives the output of 1e-2.
    low = K.gem(*on_device(x, torch.tensor(1e-3)), 0.0, EPS)[0]
    assert torch.equal(low, K.gem(*on_device(x, torch.tensor(0.01)), 0.0, EPS)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_python_p(dtype):
    x = p_rows(dtype)
    for pv in PYTHON_PS:
        out, *_ = run(x, None, pv)
        assert torch.isfinite(out).all()


def test_nan_tensor_p():
    # A NaN p stays NaN through the clamp: every non-empty reduction is NaN.
    x = p_rows(torch.float32)
    mask = torch.ones(4, 12, 1, dtype=torch.bool)
    mask[0] = False
    out, _, grad, grad_p = run(x, torch.tensor(NAN), 0.0, mask=mask)
    assert out[0] == 0 and out[1:].isnan().all() and grad_p.isnan()


# ---------------------------------------------------------------- special values

ROW_NAMES = ["plain", "zeros", "negative", "one_inf", "nan", "nan_inf", "masked_nan",
             "masked_inf", "fully_masked", "single_kept", "eps_sized", "huge", "huge_and_eps",
             "1e4", "small", "subnormal"]
SPECIAL_N = 8


def special_rows(dtype):
    """(x [16, 8, 1], mask): one rows-layout reduction per ROW_NAMES entry."""
    info = torch.finfo(dtype)
    n = SPECIAL_N
    base = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    x = base.repeat(len(ROW_NAMES), 1)
    mask = torch.ones(len(ROW_NAMES), n, dtype=torch.bool)
    r = {name: i for i, name in enumerate(ROW_NAMES)}
    x[r["zeros"]] = 0.0
    x[r["negative"]] = -base
    x[r["negative"], 0] = -INF
    x[r["one_inf"], 3] = INF
    x[r["nan"], 5] = NAN
    x[r["nan_inf"], 1], x[r["nan_inf"], 6] = NAN, INF
    x[r["masked_nan"], 2], mask[r["masked_nan"], 2] = NAN, False
    x[r["masked_inf"], 7], mask[r["masked_inf"], 7] = INF, False
    x[r["fully_masked"], 0] = NAN
    mask[r["fully_masked"]] = False
    mask[r["single_kept"]] = False
    mask[r["single_kept"], 4] = True
    x[r["eps_sized"]] = EPS * torch.tensor([1.0, 0.5, 2.0, 1.0, 1.5, 0.999, 3.0, 1.0])
    x[r["huge"]] = info.max * torch.linspace(0.25, 1.0, n, dtype=torch.float64)
    x[r["huge_and_eps"]] = EPS
    x[r["huge_and_eps"], 0] = info.max  # ratios below the normal range in float32
    x[r["huge_and_eps"], 5] = 2 * EPS
    x[r["1e4"]] = 1e4 * base
    x[r["small"]] = 1e-4 * base  # fp16 activations: small ** p far below fp16's range
    x[r["subnormal"]] = info.smallest_normal * base / 4  # every dtype's subnormals
    x[r["subnormal"], 0] = 1.0
    return x.to(dtype)[:, :, None], mask[:, :, None], r


def check_special_rules(x, mask, out, grad, grad_p, r, eps):
    """The rules on the special rows (the reference encodes the same)."""
    kept_nan = (torch.isnan(x) & mask).any(1).squeeze(-1)
    assert out.isnan().squeeze(-1).tolist() == kept_nan.tolist()
    clean = ~kept_nan
    assert torch.isfinite(grad[clean]).all()
    assert grad[r["nan"]][mask[r["nan"]]].isnan().any()
    for name in ("zeros", "negative"):  # every entry clamped: eps, no gradient
        want = torch.tensor(eff_eps(eps, x.dtype), dtype=torch.float64).to(acc_dtype(x.dtype))
        assert out[r[name]].item() == want.to(x.dtype).item()
        assert (grad[r[name]] == 0).all()
    assert out[r["one_inf"]].item() == INF and (grad[r["one_inf"]] == 0).all()
    assert out[r["fully_masked"]].item() == 0 and (grad[r["fully_masked"]] == 0).all()
    for name in ("masked_nan", "masked_inf"):  # a masked entry changes nothing
        assert torch.isfinite(out[r[name]]).all() and (grad[r[name]][~mask[r[name]]] == 0).all()
    # One kept entry: its value, gradient g exactly (dgem/dx = 1).
    assert out[r["single_kept"]].item() == x[r["single_kept"], 4].item()
    assert (grad[r["single_kept"]] == 0).sum() == SPECIAL_N - 1
    assert out[r["huge"]].item() <= torch.finfo(x.dtype).max
    assert grad_p is None or bool(torch.isnan(grad_p)) == bool(kept_nan.any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "tokens"])
@pytest.mark.parametrize("eps", [EPS, TINY_EPS], ids=["eps", "tiny_eps"])
def test_special_rows(dtype, layout, eps):
    # eps "tiny" (1e-300, raised to the accumulation type's smallest normal)
    # puts the eps-sized, small and subnormal entries above eps.
    x, mask, r = special_rows(dtype)
    g = torch.linspace(-1.0, 1.0, len(ROW_NAMES), dtype=torch.float64)[:, None].to(dtype)
    for pv in ((0.5, 3.0, 64.0) if layout == "rows" else (3.0,)):
        p = torch.tensor([pv])
        if layout == "rows":
            out, _, grad, grad_p = run(x, p, 0.0, eps, mask, g)
        else:
            out, _, grad, grad_p = run(tokens(x), p, 0.0, eps, tokens(mask), g.T.contiguous())
            out, grad = out.T, tokens(grad)
        check_special_rules(x, mask, out, grad, grad_p, r, eps)
    # Without the NaN reductions grad_p is finite.
    clean = [i for i, name in enumerate(ROW_NAMES) if name not in ("nan", "nan_inf")]
    _, _, _, grad_p = run(x[clean], torch.tensor([3.0]), 0.0, eps, mask[clean], g[clean])
    assert torch.isfinite(grad_p)


def test_single_entry_reductions():
    # n == 1: the clamped entry itself; gradient g where unclamped.
    x = torch.tensor([2.0, -1.0, 0.0, 1e-7, INF, NAN, 3e-6])[:, None, None]
    g = torch.full((7, 1), 0.5)
    out, stats, grad, _ = run(x, torch.tensor(3.0), 0.0, g=g)
    assert out[:5, 0].tolist() == [2.0, pytest.approx(EPS), pytest.approx(EPS), pytest.approx(EPS),
                                   INF]
    assert out[5].isnan() and grad[5].isnan().all()
    assert grad.flatten().tolist()[:5] == [0.5, 0.0, 0.0, 0.0, 0.0]
    assert grad.flatten()[6].item() == 0.5


# ---------------------------------------------------------------- streamed paths


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of at most 8 entries along n: the problems below stream in 5 tiles,
    the last partial (rows: 37 entries; tokens: 37 entries of 4-wide blocks of i)."""
    monkeypatch.setattr(K, "MAX_FUSED_N", 8)
    monkeypatch.setattr(K, "LOOP_BLOCK", 8)
    monkeypatch.setattr(K, "ROW_TILE", 8)
    monkeypatch.setattr(K, "BACKWARD_ROW_TILE", 16)
    monkeypatch.setattr(K, "STRIDED_BLOCK_I", 4)
    monkeypatch.setattr(K, "STRIDED_TILE", 32)
    monkeypatch.setattr(K, "BACKWARD_STRIDED_TILE", 16)


def streamed_rows(dtype):
    """(x [6, 37, 1], mask): maxima that grow tile by tile (the sum is
    re-expressed against each new maximum), a maximum in the first tile, +inf
    and NaN in late tiles, a masked run, a fully masked row."""
    n = 37
    j = torch.arange(n, dtype=torch.float64)
    x = torch.stack([
        1.0 + j,                       # the maximum grows in every tile
        torch.flip(1.0 + j, [0]),      # the maximum in the first tile
        0.1 + torch.sin(j),            # clamped entries in every tile
        1.0 + torch.cos(j),            # +inf in the fourth tile
        1.0 + torch.cos(j),            # NaN in the third tile
        1.0 + j / 10,                  # fully masked
    ])
    x[3, 26] = INF
    x[4, 17] = NAN
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[2, 8:20] = False  # whole tiles masked
    mask[1, 0] = False  # the largest entry masked
    mask[5] = False
    return x.to(dtype)[:, :, None], mask[:, :, None]


@pytest.mark.parametrize("dtype, layout", [(torch.float32, "rows"), (torch.bfloat16, "rows"),
                                           (torch.float64, "tokens"), (torch.float32, "tokens")],
                         ids=str)
def test_streamed(dtype, layout, small_tiles):
    x, mask = streamed_rows(dtype)
    if layout == "tokens":
        x, mask = tokens(x), tokens(mask)
    assert K._config(*x.shape, False)[5] is False  # streamed, not one tile
    out, stats, grad, _ = run(x, torch.tensor(3.0), 0.0, mask=mask)
    out = out.flatten()
    assert out[3] == INF and out[4].isnan() and out[5] == 0
    # p = 64: a rescaled sum may underflow, (m_old / m_new)^p far below 1.
    run(x, None, 64.0)
    # The online (m, sum) state of the streamed forward equals the one-tile
    # forward up to the rounding of the rescalings.
    x0 = x[:, :, :3] if layout == "tokens" else x[:3]
    streamed = K.gem(*on_device(x0, torch.tensor(0.5)), 0.0, EPS)
    K.MAX_FUSED_N, K.ROW_TILE, K.STRIDED_TILE = 64, 64, 256
    assert K._config(*x0.shape, False)[5] is True
    fused = K.gem(*on_device(x0, torch.tensor(0.5)), 0.0, EPS)
    assert_close(streamed[0], fused[0], dtype, "streamed vs one tile", rtol=4 * RTOL[dtype])
    assert torch.equal(streamed[1][..., 0], fused[1][..., 0])


def test_long_rows_default_tiles():
    # Rows longer than MAX_FUSED_N with the default tiles (one program per row).
    x = randn(2, K.MAX_FUSED_N + 300, 1, seed=9).abs()
    x[1, -1] = 50.0  # the maximum in the last tile
    assert not K._config(*x.shape, False)[5]
    run(x, torch.tensor(4.0), 0.0)


# ---------------------------------------------------------------- accuracy of the sums


@pytest.mark.parametrize("shape", [(4, 512, 1), (1, 512, 3)], ids=["rows", "tokens"])
def test_tile_sum_is_a_tree(shape):
    # Each reduction: a 1 first, then 2^-24 (half a unit in the last place of
    # 1 in float32). At p = 1 a running sum from the 1 drops every one of them
    # (1 + 2^-24 rounds back to 1): the mean would lose (n - 1) 2^-24, 2^-15 of
    # itself. A tree adds the small ones to each other first. Several
    # reductions per program (BLOCK_K > 1), one tile.
    outer, n, inner = shape
    assert K._config(outer, n, inner, False)[4] > 1 and K._config(outer, n, inner, False)[5]
    x = torch.full(shape, 2.0 ** -24, dtype=torch.float32)
    x[:, 0, :] = 1.0
    _, stats = K.gem(*on_device(x, None), 1.0, TINY_EPS)
    exact = (1.0 + (n - 1) * 2.0 ** -24) / n
    err = (stats[..., 1].cpu().double() - exact).abs().max().item() / exact
    # A few units: compiled, each thread adds its own few entries in order first.
    assert err <= 16 * torch.finfo(torch.float32).eps, f"mean's relative error {err}"


def _relative_mean_error(stats, x, p):
    """The largest relative error of the saved means against float64's."""
    c = x.double().clamp(min=EPS)
    m = c.amax(1, keepdim=True)
    exact = ((c / m) ** p).mean(1)
    return ((stats[..., 1].cpu().double() - exact).abs() / exact).max().item()


# (outer, n, inner): rows, several per program; tokens, one tile; tokens streamed
# in tiles of 64 entries with the default tiles (inner >= STRIDED_BLOCK_I).
@pytest.mark.parametrize("shape", [(3, 500, 1), (2, 300, 3), (1, 700, 64)],
                         ids=["rows", "tokens", "tokens streamed"])
@pytest.mark.parametrize("p", [0.5, 3.0])
def test_float32_sums_as_accurate_as_torch(shape, p):
    # The mean of the ratio powers (whose rounding the output carries raised
    # to 1/p) and p's gradient (a sum of divergence terms) within twice the
    # torch backend's error (a cascade sum) and a unit, however many
    # reductions a program holds and whether it streams.
    x = (randn(*shape, seed=31).abs() * 30).float()
    eps_f = torch.finfo(torch.float32).eps
    _, stats = K.gem(*on_device(x, None), p, EPS)
    _, r_stats = R.gem(x, None, p, EPS)
    ours, torch_err = _relative_mean_error(stats, x, p), _relative_mean_error(r_stats, x, p)
    assert ours <= 2 * torch_err + eps_f, f"mean: {ours} vs torch backend {torch_err}"
    # p's gradient at g = 1 (every term >= 0), against the float64 reference.
    g = torch.ones((shape[0], shape[2]))
    pt = torch.tensor(p)
    _, grad_p = K.gem_backward(*on_device(g, x, pt), p, stats, EPS, None, True)
    _, r_grad_p = R.gem_backward(g, x, pt, p, r_stats, EPS, None, True)
    _, r64_stats = R.gem(x.double(), pt.double(), p, EPS)
    _, exact = R.gem_backward(g.double(), x.double(), pt.double(), p, r64_stats, EPS, None, True)
    ours = abs(grad_p.item() - exact.item()) / exact.item()
    torch_err = abs(r_grad_p.item() - exact.item()) / exact.item()
    assert ours <= 2 * torch_err + eps_f, f"grad_p: {ours} vs torch backend {torch_err}"


# ---------------------------------------------------------------- masks


def check_mask_layouts(x, masks):
    """Each mask (any strides) gives the results of its contiguous copy, and
    the reference's. Returns the results of the first."""
    p = torch.tensor(3.0)
    results = []
    for mask in masks:
        assert mask.shape == x.shape
        out, stats, grad, grad_p = run(x, p, 0.0, mask=mask)
        xd, pd, md = on_device(x, p, mask.contiguous())
        c_out, c_stats = K.gem(xd, pd, 0.0, EPS, md)
        assert torch.equal(out, c_out.cpu()) and torch.equal(stats, c_stats.cpu())
        # The backward of run() took grad_output uniform in [-1, 1] (seed 1).
        gen = torch.Generator().manual_seed(1)
        g = (2 * torch.rand(out.shape, generator=gen, dtype=torch.float64) - 1).to(x.dtype)
        c_grad, c_grad_p = K.gem_backward(g.to(DEVICE), xd, pd, 0.0, c_stats, EPS, md, True)
        assert torch.equal(grad, c_grad.cpu()) and torch.equal(grad_p, c_grad_p.cpu())
        results.append((out, grad))
    return results[0]


def test_token_masks_with_strides():
    b, l, h = 3, 10, 6
    x = randn(b, l, h, seed=11)
    attention = rand_mask(b, l, keep=0.6, seed=12)
    attention[2] = False  # a fully padded sequence: output 0, gradient 0
    big = rand_mask(b, 2 * l, h, seed=13)
    masks = [
        attention[:, :, None].expand(b, l, h),              # 0-stride over H
        rand_mask(1, l, h, seed=14).expand(b, l, h),        # 0-stride over B
        rand_mask(h, l, b, seed=15).permute(2, 1, 0),       # transposed storage
        big[:, ::2, :],                                     # every other L
    ]
    out, grad = check_mask_layouts(x, masks)
    assert (out[2] == 0).all() and (grad[2] == 0).all()


def test_row_masks_with_strides():
    x = randn(7, 49, 1, seed=17)
    masks = [
        rand_mask(49, 7, seed=18).T[:, :, None],           # transposed rows
        rand_mask(1, 49, 1, seed=19).expand(7, 49, 1),     # one mask for every row
        rand_mask(7, 1, 1, seed=20).expand(7, 49, 1),      # whole rows kept or dropped
    ]
    check_mask_layouts(x, masks)


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_empty_shapes(dtype):
    p = torch.tensor(3.0, device=DEVICE)
    # n == 0: every reduction is empty (output 0, stats 0); no entry to differentiate.
    x = torch.empty(3, 0, 2, dtype=dtype, device=DEVICE)
    out, stats = K.gem(x, p, 0.0, EPS)
    assert out.shape == (3, 2) and (out == 0).all() and (stats == 0).all()
    r_out, r_stats = R.gem(x.cpu(), p.cpu(), 0.0, EPS)
    assert torch.equal(out.cpu(), r_out) and torch.equal(stats.cpu(), r_stats)
    grad, grad_p = K.gem_backward(out, x, p, 0.0, stats, EPS, None, True)
    assert grad.shape == (3, 0, 2) and grad_p.shape == () and grad_p.item() == 0
    grad, grad_p = K.gem_backward(out, x, None, 3.0, stats, EPS, None, False)
    assert grad_p.shape == (0,)
    # No reduction at all.
    for shape in ((0, 5, 3), (2, 5, 0)):
        x = torch.ones(shape, dtype=dtype, device=DEVICE)
        out, stats = K.gem(x, p, 0.0, EPS, torch.ones(shape, dtype=torch.bool, device=DEVICE))
        assert out.shape == (shape[0], shape[2]) and stats.shape == (shape[0], shape[2], 3)
        grad, grad_p = K.gem_backward(out, x, p, 0.0, stats, EPS, None, True)
        assert grad.shape == shape and grad_p.item() == 0


def test_noncontiguous_inputs():
    x = randn(5, 8, 3, seed=21).permute(2, 1, 0)  # [3, 8, 5], strided
    g = randn(5, 3, seed=22).T
    assert not x.is_contiguous() and not g.is_contiguous()
    p = torch.tensor(2.0)
    xd, gd, pd = on_device(x, g, p)
    out, stats = K.gem(xd, pd, 0.0, EPS)
    c_out, c_stats = K.gem(xd.contiguous(), pd, 0.0, EPS)
    assert torch.equal(out, c_out) and torch.equal(stats, c_stats)
    grad, grad_p = K.gem_backward(gd, xd, pd, 0.0, stats, EPS, None, True)
    c_grad, c_grad_p = K.gem_backward(gd.contiguous(), xd.contiguous(), pd, 0.0, stats, EPS, None,
                                      True)
    assert torch.equal(grad, c_grad) and torch.equal(grad_p, c_grad_p)
    run(x, p, 0.0, g=g)


# ---------------------------------------------------------------- header functions


@triton.jit
def _mirror_kernel(a_ptr, b_ptr, c_ptr, d_ptr, e_ptr, p_ptr, out_ptr, n,
                   FN: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """out = FN(a, b, ...) for n entries, as a 1-D block (per-reduction values,
    both sides of a header branch) or a [BLOCK, 1] tile (entries: a rare branch
    only when an entry takes it)."""
    offs = tl.arange(0, BLOCK)
    if TILE:
        offs = offs[:, None]
    inside = offs < n
    a = tl.load(a_ptr + offs, mask=inside, other=1.0)
    b = tl.load(b_ptr + offs, mask=inside, other=1.0)
    c = tl.load(c_ptr + offs, mask=inside, other=1.0)
    d = tl.load(d_ptr + offs, mask=inside, other=1.0)
    e = tl.load(e_ptr + offs, mask=inside, other=1.0)
    p = tl.load(p_ptr)
    if FN == 0:
        out = gem_ratio_power(a, b, p)
    elif FN == 1:
        out = gem_log_ratio(a, b)
    elif FN == 2:
        out = gem_rescale_sum(a, b, c, p)
    elif FN == 3:
        out = gem_value(a, b, p)
    elif FN == 4:
        out = gem_input_grad_weight(a, b, c, d, p)
    elif FN == 5:
        out = gem_divergence_h(a)
    else:
        out = gem_p_grad(a, b, c, d, e, p)
    tl.store(out_ptr + offs, out, mask=inside)


MIRRORED = ["gem_ratio_power", "gem_log_ratio", "gem_rescale_sum", "gem_value",
            "gem_input_grad_weight", "gem_divergence_h", "gem_p_grad"]


def mirror_cases(name, dtype):
    """(args, p) for one header function: regular values, both sides of its
    branches and its special values."""
    info = torch.finfo(dtype)
    t = lambda *v: torch.tensor(v, dtype=dtype)  # noqa: E731
    if name in ("gem_ratio_power", "gem_log_ratio"):
        c = t(1.0, 0.5, 1e-6, 1e-6, 3.0, info.tiny, 2.0, INF, 2.0, NAN, 1.0, 0.0, 1.0)
        m = t(1.0, 1.0, 1e30, info.max, 7.0, info.max, 2.0, INF, INF, 1.0, NAN, 0.0, 1e-30)
        args = [c, m]
    elif name == "gem_rescale_sum":
        s = t(3.0, 2.5, 0.0, 1.0, 4.0, 5.0, 1.0, NAN)
        m_old = t(1.0, 1.0, 0.0, 1e-6, INF, 2.0, 0.0, 1.0)
        m_new = t(1.0, 4.0, 3.0, info.max, INF, INF, 0.0, NAN)
        args = [s, m_old, m_new]
    elif name == "gem_value":
        m = t(2.0, 1e30, info.tiny, 0.0, INF, NAN, 3.0, info.max)
        mean = t(0.5, 0.4, 0.4, 0.0, 0.25, NAN, 1.0, 1.0)
        args = [m, mean]
    elif name == "gem_input_grad_weight":
        c = t(0.5, 1e-6, 1e-6, 2.0, 1.0, 1e-6, NAN, 3.0, info.tiny)
        m = t(1.0, 1e30, 1.0, 2.0, 1.0, info.max, 1.0, 3.0, info.max)
        mean = t(0.6, 0.5, 0.3, 1.0, 1.0 / 7, 0.125, 0.5, NAN, 0.5)
        count = t(4.0, 2.0, 3.0, 1.0, 7.0, 8.0, 2.0, 2.0, 1e4)
        args = [c, m, mean, count]
    elif name == "gem_divergence_h":
        s = torch.cat([torch.linspace(-3.0, 3.0, 61, dtype=torch.float64),
                       torch.tensor([-1.0, 1.0, 0.0, -1e-20, -200.0, -1e5, math.log(1e4), NAN],
                                    dtype=torch.float64)]).to(dtype)
        args = [s]
    else:  # gem_p_grad(g, gem, m, count, divergence, p)
        g = t(0.5, -2.0, 0.0, 1.0, 1.0, 3.0, NAN, 1.0)
        gem = t(1.5, 2.0, info.max, 1.0, 1.0, 0.7, 1.0, info.max)
        m = t(2.0, 3.0, info.max, INF, 0.0, 1.0, 1.0, info.max)
        count = t(4.0, 5.0, 3.0, 2.0, 0.0, 1.0, 2.0, 9.0)
        div = t(0.1, 1e-8, 1.0, 0.3, 0.0, 0.0, 0.1, 2.0)
        args = [g, gem, m, count, div]
    return args


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("tile", [False, True], ids=["vector", "tile"])
@pytest.mark.parametrize("name", MIRRORED)
def test_mirrored_header_functions(name, tile, dtype):
    # Each mirrored function against the reference's function of the same name.
    args = mirror_cases(name, dtype)
    n = args[0].numel()
    block = triton.next_power_of_2(n)
    ps = [0.01, 0.5, 3.0, 100.0] if name not in ("gem_log_ratio", "gem_divergence_h") else [1.0]
    for pv in ps:
        p = torch.tensor(pv, dtype=dtype)
        padded = args + [torch.ones(n, dtype=dtype)] * (5 - len(args))
        out = torch.empty(n, dtype=dtype, device=DEVICE)
        _mirror_kernel[(1,)](*on_device(*padded), p.to(DEVICE), out, n,
                             FN=MIRRORED.index(name), TILE=tile, BLOCK=block,
                             enable_reflect_ftz=False)
        if name == "gem_rescale_sum":  # the reference reduces in two passes: the header's rule
            total, m_old, m_new = args
            want = torch.where(m_old == m_new, total, total * R.gem_ratio_power(m_old, m_new, p))
        elif name in ("gem_log_ratio", "gem_divergence_h"):
            want = getattr(R, name)(*args)
        else:
            want = getattr(R, name)(*args, p)
        assert_close(out, want, dtype, f"{name}(p={pv})")
