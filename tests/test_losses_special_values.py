"""The special-value tables of the losses family (DESIGN.md section 2, "NaN-safe
losses"; docs/losses.md) through nanfree.ops and its autograd, on the backend
this session selects: every row of tests/losses_oracle.py (value, d/d input,
d/d target) in every dtype, the cross-entropy rows (-inf and masked classes,
label smoothing, soft targets, empty rows, +inf and NaN logits), what the
mean leaves out, the issue's cases verbatim, NaN kept to its row, and the
pointwise losses' fused 'mean' and 'sum' (pointwise_loss_sum) against the sum
of the unreduced losses."""

import math

import pytest
import torch
from conftest import DTYPES, INF, INTERPRETED, NAN

import losses_oracle as oracle
import nanfree.ops as nf

OPS = tuple(oracle.POINTWISE)


def _close(got, expected, dtype, what, rel=None):
    """got (a float) equals the expected float of the dtype: NaN for NaN, the same
    infinity, an exact 0 for 0, else within a few roundings of the dtype."""
    if math.isnan(expected):
        assert math.isnan(got), f"{what}: expected NaN, got {got}"
        return
    if math.isinf(expected) or expected == 0.0:
        assert got == expected, f"{what}: expected {expected}, got {got}"
        return
    if abs(expected) >= torch.finfo(dtype).max:
        assert got == math.copysign(torch.finfo(dtype).max, expected), f"{what}: got {got}"
        return
    rel = rel if rel is not None else 8 * torch.finfo(dtype).eps
    assert math.isfinite(got) and abs(got - expected) <= rel * abs(expected) + 1e-30, (
        f"{what}: expected {expected}, got {got}")


def _call(op, x, t, kwargs):
    kwargs = dict(kwargs)
    for name in ("weight", "pos_weight"):
        if name in kwargs:
            kwargs[name] = torch.tensor([kwargs[name]], dtype=x.dtype, device=x.device)
    if op == "sigmoid_focal_loss":
        return nf.sigmoid_focal_loss(x, t, **kwargs)
    return getattr(nf, op)(x, t, reduction="none", **kwargs)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_table(device, op, dtype):
    for (x, t, kwargs), expected in oracle.POINTWISE[op]:
        xs = torch.tensor([oracle.resolve(x, dtype)], dtype=dtype, device=device,
                          requires_grad=True)
        ts = torch.tensor([oracle.resolve(t, dtype)], dtype=dtype, device=device,
                          requires_grad=True)
        loss = _call(op, xs, ts, kwargs)
        assert loss.dtype == dtype
        dx, dt = torch.autograd.grad(loss, (xs, ts), torch.ones_like(loss))
        what = f"{op}({x}, {t}, {kwargs}) {dtype}"
        value, grad_x, grad_t = (oracle.resolve(e, dtype) for e in expected)
        _close(loss.item(), value, dtype, what + " value")
        _close(dx.item(), grad_x, dtype, what + " d/dx")
        _close(dt.item(), grad_t, dtype, what + " d/dt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_focal_interior_equals_torchvision(device, dtype):
    """Away from saturation the value and both gradients are torchvision's (its
    formula with 50 digits as the reference), including gamma < 1 near it
    (x = 20, t = 1 in float32: torchvision's 1 - p_t rounds to 0 there)."""
    for x, t, alpha, gamma in oracle.FOCAL_INTERIOR:
        xs = torch.tensor([x], dtype=dtype, device=device, requires_grad=True)
        ts = torch.tensor([t], dtype=dtype, device=device, requires_grad=True)
        loss = nf.sigmoid_focal_loss(xs, ts, alpha, gamma)
        dx, dt = torch.autograd.grad(loss, (xs, ts))
        expected = oracle.focal_interior_expected(x, t, alpha, gamma)
        for got, want, what in zip((loss.item(), dx.item(), dt.item()), expected,
                                   ("value", "d/dx", "d/dt")):
            assert math.isfinite(got)
            tol = 64 * torch.finfo(dtype).eps * max(abs(want), 1e-30)
            assert abs(got - want) <= tol + 1e-37, f"focal({x}, {t}, {alpha}, {gamma}) {what}: {got} vs {want}"


def _ce_case(row, dtype, device):
    (logits, target, kwargs), expected = row
    x = torch.tensor([logits], dtype=dtype, device=device, requires_grad=True)
    kwargs = dict(kwargs)
    if "mask" in kwargs:
        kwargs["mask"] = torch.tensor([kwargs["mask"]], device=device)
    if isinstance(target, list):
        y = torch.tensor([target], dtype=dtype, device=device)
    else:
        y = torch.tensor([target], device=device)
    return x, y, kwargs, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row", range(len(oracle.CROSS_ENTROPY)))
def test_cross_entropy_table(device, dtype, row):
    x, y, kwargs, (value, grad) = _ce_case(oracle.CROSS_ENTROPY[row], dtype, device)
    loss = nf.cross_entropy(x, y, reduction="none", **kwargs)
    assert loss.dtype == dtype and loss.shape == (1,)
    (dx,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    rel = 4e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
    what = f"cross_entropy row {row} {dtype}"
    if dtype == torch.float16 and math.isfinite(value) and value > 65504:
        value = INF
    _close(loss.item(), value, dtype, what + " value", rel)
    for c, (got, want) in enumerate(zip(dx[0].tolist(), grad)):
        if math.isnan(want) or want == 0.0:
            _close(got, want, dtype, f"{what} d/dx[{c}]", rel)
        else:  # a difference of two terms of size 1: absolute rounding
            assert abs(got - want) <= rel, f"{what} d/dx[{c}]: {got} vs {want}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_mean_leaves_out_empty_rows(device, dtype):
    """Rows with no kept class, a masked target class or ignore_index are out of
    the mean (loss 0, gradient 0); a mean over no counted row is 0, not NaN."""
    x = torch.tensor([[1.0, 2.0, 0.5], [-INF, -INF, -INF], [3.0, 1.0, 0.0], [0.0, 1.0, 2.0]],
                     dtype=dtype, device=device, requires_grad=True)
    y = torch.tensor([0, 1, 1, -100], device=device)
    mask = torch.tensor([[True, True, True], [True, True, True], [True, False, True],
                         [True, True, True]], device=device)
    loss = nf.cross_entropy(x, y, mask=mask)
    (dx,) = torch.autograd.grad(loss, x)
    expected = torch.nn.functional.cross_entropy(x[:1].detach().double(), y[:1])
    assert abs(loss.item() - expected.item()) <= 1e-2 * expected.item()
    assert dx[1:].eq(0).all()
    assert torch.isfinite(dx).all()
    none = torch.tensor([[-INF, -INF]], dtype=dtype, device=device, requires_grad=True)
    for reduction in ("mean", "sum"):
        empty = nf.cross_entropy(none, torch.tensor([0], device=device), reduction=reduction)
        (g,) = torch.autograd.grad(empty, none)
        assert empty.item() == 0.0 and g.eq(0).all()
    ignored = nf.cross_entropy(x.detach()[:1], torch.tensor([-100], device=device))
    assert ignored.item() == 0.0


# Two of the CPU kernel's 32768-element chunks and a few more: chunk edges and
# a vector run's tail are summed once each. Under Triton's interpreter (numpy
# per block, about a second per 32768 elements and call) two of its kernel's
# 1024-element programs and a few more: the edges of that kernel.
_SUM_SIZES = (1, 17, 2 * 1024 + 21) if INTERPRETED else (1, 17, 2 * 32768 + 21)
# The CPU kernel's flat run below the threads' grain (32768) and its iterator at
# it; under the interpreter a program's edges (1024 elements).
_GRAIN_SIZES = (1, 17, 1023, 1025) if INTERPRETED else (1, 17, 32767, 32768)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", range(5))
def test_pointwise_sum_is_the_sum_of_the_losses(device, dtype, kind):
    """pointwise_loss_sum (the 'mean' and 'sum' reductions) adds the losses each
    computed in the accumulation dtype, without rounding them to the input's dtype:
    within a float32 rounding per loss of the float64 sum of the float64 losses at
    the same inputs; broadcast weights and strided operands included."""
    gen = torch.Generator().manual_seed(kind)
    ops = torch.ops.nanfree
    for n in _SUM_SIZES:
        x = (torch.randn(n, generator=gen) * 4).to(dtype)
        t = torch.rand(n, generator=gen).to(dtype)
        if kind == 1:  # probabilities
            x = torch.sigmoid(x.float()).clamp(0.01, 0.99).to(dtype)
        if kind == 2:  # log-probabilities
            x = -x.abs()
        cases = [(x, t, None, None)]
        if kind in (0, 1):
            w = torch.rand(n, generator=gen).to(dtype)
            cases.append((x, t, w, None))
            cases.append((x, t, torch.tensor(0.5, dtype=dtype), None))
        if kind == 0:
            cases.append((x, t, None, torch.tensor([3.0], dtype=dtype)))
        if n > 1:  # strided operands: every other element of twice the length
            cases.append((torch.stack([x, x]).t().reshape(-1)[::2], t.repeat_interleave(2)[::2],
                          None, None))
        for xs, ts, w, pw in cases:
            args = [a if a is None else a.to(device) for a in (xs, ts, w, pw)]
            got = ops.pointwise_loss_sum(*args, kind, 0.25, 2.0)
            assert got.shape == () and got.dtype == (torch.float64 if dtype == torch.float64
                                                     else torch.float32)
            wide = [a if a is None else a.double().to(device) for a in (xs, ts, w, pw)]
            losses = ops.pointwise_loss(*wide, kind, 0.25, 2.0)
            exact = losses.sum().item()
            rel = 1e-12 if dtype == torch.float64 else 4 * torch.finfo(torch.float32).eps
            assert abs(got.item() - exact) <= rel * losses.abs().sum().item() + 1e-300, (
                f"kind {kind} n {n} {dtype}: {got.item()} vs {exact}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", range(5))
def test_pointwise_ops_without_weights_equal_them_with_weights_of_one(device, dtype, kind):
    """Absent weight and pos_weight count 1: the ops give the bits they give with
    0-d weights of 1. On the CPU a small contiguous call without them is one run
    made without a TensorIterator, and with them the iterator's run: both add
    the same losses in the same lanes, below and at the threads' grain (32768)."""
    gen = torch.Generator().manual_seed(10 + kind)
    ops = torch.ops.nanfree
    for n in _GRAIN_SIZES:
        x = (torch.randn(n, generator=gen) * 4).to(dtype)
        if kind == 1:  # probabilities
            x = torch.sigmoid(x.float()).clamp(0.01, 0.99).to(dtype)
        if kind == 2:  # log-probabilities
            x = -x.abs()
        x, t = x.to(device), torch.rand(n, generator=gen).to(device=device, dtype=dtype)
        one = torch.ones((), dtype=dtype, device=device)
        grads = (torch.tensor(0.3, dtype=dtype, device=device),
                 torch.randn(n, generator=gen).to(device=device, dtype=dtype))
        for weights in ((None, None), (one, one)):
            args = (x, t) + weights + (kind, 0.25, 2.0)
            if weights[0] is None:
                plain = (ops.pointwise_loss(*args), ops.pointwise_loss_sum(*args),
                         [ops.pointwise_loss_backward(g, *args, p) for g in grads for p in (0, 1)])
            else:
                weighted = (ops.pointwise_loss(*args), ops.pointwise_loss_sum(*args),
                            [ops.pointwise_loss_backward(g, *args, p) for g in grads for p in (0, 1)])
        torch.testing.assert_close(plain[0], weighted[0], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(plain[1], weighted[1], rtol=0, atol=0, equal_nan=True)
        for got, expected in zip(plain[2], weighted[2]):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_reductions_keep_nan_and_inf_and_count_nothing_as_zero(device, dtype):
    """A NaN loss makes the mean NaN and an infinite one infinite (as torch's); the
    mean over no element is 0, not 0 / 0 (as cross_entropy's), with an empty gradient."""
    x = torch.tensor([0.5, NAN, -1.0], dtype=dtype, device=device)
    t = torch.tensor([1.0, 0.0, 0.0], dtype=dtype, device=device)
    for reduction in ("mean", "sum"):
        assert math.isnan(nf.binary_cross_entropy_with_logits(x, t, reduction=reduction).item())
    p = torch.tensor([0.0, 0.5], dtype=dtype, device=device)  # -log(0): +inf
    assert nf.binary_cross_entropy(p, torch.tensor([1.0, 1.0], dtype=dtype, device=device)).item() == INF
    empty = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
    for op in (nf.binary_cross_entropy_with_logits, nf.binary_cross_entropy, nf.kl_div):
        for reduction in ("mean", "sum"):
            loss = op(empty, empty.detach(), reduction=reduction)
            (g,) = torch.autograd.grad(loss, empty)
            assert loss.item() == 0.0 and loss.dtype == dtype and g.shape == (0,)
    batchmean = nf.kl_div(torch.empty(0, 3, dtype=dtype, device=device),
                          torch.empty(0, 3, dtype=dtype, device=device), reduction="batchmean")
    assert batchmean.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_nan_stays_in_its_row(device, dtype):
    x = torch.randn(4, 6, dtype=torch.float64).to(device, dtype)
    x[2, 3] = NAN
    x.requires_grad_(True)
    y = torch.tensor([0, 1, 2, 3], device=device)
    loss = nf.cross_entropy(x, y, reduction="none")
    (dx,) = torch.autograd.grad(loss.sum(), x)
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    assert torch.isnan(dx[2]).all() and torch.isfinite(dx[[0, 1, 3]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_issue_cases(device, dtype):
    """The cases the family was written for, verbatim (docs/losses.md)."""
    # BCE with logits at +-inf: torch NaN.
    x = torch.tensor([INF, -INF], dtype=dtype, device=device, requires_grad=True)
    t = torch.tensor([1.0, 0.0], dtype=dtype, device=device)
    loss = nf.binary_cross_entropy_with_logits(x, t)
    (dx,) = torch.autograd.grad(loss, x)
    assert loss.item() == 0.0 and dx.eq(0).all()
    # BCE on sigmoid(-50) against 1: the true loss 50 and d/dx -1 (torch: 100 and ~0).
    z = torch.tensor([-50.0], dtype=dtype, device=device, requires_grad=True)
    loss = nf.binary_cross_entropy(torch.sigmoid(z), torch.ones(1, dtype=dtype, device=device))
    (dz,) = torch.autograd.grad(loss, z)
    assert abs(loss.item() - 50.0) < 1e-4 and abs(dz.item() + 1.0) < 1e-4
    # Label smoothing with a -inf logit: finite (torch: inf).
    logits = torch.tensor([[0.0, -INF, 1.0, 2.0]], dtype=dtype, device=device, requires_grad=True)
    loss = nf.cross_entropy(logits, torch.tensor([2], device=device), label_smoothing=0.1)
    (g,) = torch.autograd.grad(loss, logits)
    assert math.isfinite(loss.item()) and torch.isfinite(g).all() and g[0, 1] == 0
    # kl_div with a zero target at a -inf log-probability: 0 (torch: NaN).
    lp = torch.tensor([[-INF, 0.0]], dtype=dtype, device=device, requires_grad=True)
    tgt = torch.tensor([[0.0, 1.0]], dtype=dtype, device=device)
    loss = nf.kl_div(lp, tgt, reduction="batchmean")
    (g,) = torch.autograd.grad(loss, lp)
    assert loss.item() == 0.0 and torch.isfinite(g).all()
    # Focal loss with gamma < 1 at saturated logits: finite (torchvision: NaN).
    xf = torch.tensor([30.0, -30.0, 100.0], dtype=dtype, device=device, requires_grad=True)
    tf = torch.tensor([1.0, 0.0, 1.0], dtype=dtype, device=device)
    loss = nf.sigmoid_focal_loss(xf, tf, gamma=0.5, reduction="sum")
    (g,) = torch.autograd.grad(loss, xf)
    assert math.isfinite(loss.item()) and torch.isfinite(g).all()
