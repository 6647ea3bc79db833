"""Property tests of the losses family (hypothesis) on the backend this session
selects: no NaN from non-NaN input in any dtype (values may be the exact +-inf
the rules allow; gradients are finite), NaN kept to its element or row, and
the 2x-torch-error rule of DESIGN.md 1.4 where torch's composition is finite."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, DTYPES, INF
from hypothesis import given
from hypothesis import strategies as st

import losses_oracle as oracle
import nanfree.ops as nf

SPECIAL = [INF, -INF, 0.0, -0.0, 1.0, -1.0, 30.0, -30.0, 1e-30, 3e38, -3e38, 0.5]


def _values(draw, n, dtype, special, low=-50.0, high=50.0):
    """n non-NaN values of the dtype: specials and uniform ones."""
    picks = draw(st.lists(st.one_of(st.sampled_from(special), st.floats(low, high)),
                          min_size=n, max_size=n))
    return torch.tensor(picks, dtype=torch.float64).to(dtype)


@st.composite
def pointwise_case(draw):
    op = draw(st.sampled_from(["binary_cross_entropy_with_logits", "binary_cross_entropy",
                               "kl_div", "kl_div_log", "sigmoid_focal_loss"]))
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 40))
    if op == "binary_cross_entropy":
        x = _values(draw, n, dtype, [0.0, 1.0, -0.5, 1.5, 1e-30, 0.5], -1.0, 2.0)
    else:
        x = _values(draw, n, dtype, SPECIAL)
    if op in ("kl_div",):
        t = _values(draw, n, dtype, [0.0, INF, 1e-30, 1.0, 3e38], 0.0, 10.0)
    elif op == "kl_div_log":
        t = _values(draw, n, dtype, SPECIAL)
    else:  # probabilities of a binary target
        t = _values(draw, n, dtype, [0.0, 1.0, 0.5, 1e-30], 0.0, 1.0)
    return op, x, t, draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.7])), \
        draw(st.sampled_from([0.25, -1.0, 0.9]))


def _pointwise(op, x, t, gamma, alpha):
    if op == "sigmoid_focal_loss":
        return nf.sigmoid_focal_loss(x, t, alpha, gamma)
    if op == "kl_div_log":
        return nf.kl_div(x, t, reduction="none", log_target=True)
    if op == "binary_cross_entropy_with_logits":
        w = torch.linspace(0, 3, x.numel(), dtype=x.dtype, device=x.device)
        return nf.binary_cross_entropy_with_logits(x, t, weight=w, pos_weight=w.flip(0),
                                                   reduction="none")
    return getattr(nf, op)(x, t, reduction="none")


@pytest.mark.parametrize("device", DEVICES)
@given(case=pointwise_case())
def test_pointwise_no_nan_from_non_nan(device, case):
    op, x, t, gamma, alpha = case
    x = x.to(device).requires_grad_()
    t = t.to(device).requires_grad_()
    loss = _pointwise(op, x, t, gamma, alpha)
    assert not torch.isnan(loss).any(), f"{op}: NaN value at {x[torch.isnan(loss)]}"
    dx, dt = torch.autograd.grad(loss, (x, t), torch.ones_like(loss))
    assert torch.isfinite(dx).all(), f"{op}: d/dx {dx} at x {x} t {t}"
    assert torch.isfinite(dt).all(), f"{op}: d/dt {dt} at x {x} t {t}"


@st.composite
def cross_entropy_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    rows, classes = draw(st.integers(1, 6)), draw(st.integers(1, 70))
    inner = draw(st.sampled_from([1, 1, 3]))
    x = _values(draw, rows * classes * inner, dtype, SPECIAL + [-INF, -INF])
    x = x.reshape(rows, classes, inner) if inner > 1 else x.reshape(rows, classes)
    probabilities = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if probabilities:
        target = torch.softmax(torch.randn(x.shape, generator=gen) * 3, 1)
        target = torch.where(torch.rand(x.shape, generator=gen) < 0.3, 0.0, target).to(dtype)
    else:
        shape = (rows, inner) if inner > 1 else (rows,)
        target = torch.randint(0, classes, shape, generator=gen)
        target = torch.where(torch.rand(shape, generator=gen) < 0.2, -100, target)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(x.shape, generator=gen) < 0.7
    weight = torch.rand(classes, generator=gen).to(dtype) if draw(st.booleans()) else None
    smoothing = draw(st.sampled_from([0.0, 0.1, 1.0]))
    reduction = draw(st.sampled_from(["none", "mean", "sum"]))
    return x, target, mask, weight, smoothing, reduction


@pytest.mark.parametrize("device", DEVICES)
@given(case=cross_entropy_case())
def test_cross_entropy_no_nan_from_non_nan(device, case):
    x, target, mask, weight, smoothing, reduction = case
    x = x.to(device).requires_grad_()
    target = target.to(device)
    if target.is_floating_point():
        target.requires_grad_()
    kwargs = {"weight": None if weight is None else weight.to(device),
              "mask": None if mask is None else mask.to(device),
              "label_smoothing": smoothing, "reduction": reduction}
    loss = nf.cross_entropy(x, target, **kwargs)
    assert not torch.isnan(loss).any(), f"NaN loss {loss}"
    leaves = (x, target) if target.requires_grad else (x,)
    grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss))
    for g in grads:
        assert torch.isfinite(g).all(), f"non-finite gradient {g}"


def _error(got, ref):
    return (got.double() - ref).abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       rows=st.integers(1, 8), classes=st.integers(2, 300), scale=st.sampled_from([1.0, 10.0]),
       smoothing=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**31 - 1))
def test_cross_entropy_error_at_most_twice_torch(device, dtype, rows, classes, scale, smoothing,
                                                 seed):
    """Against torch's float64 result, the loss and gradient errors are at most
    2x torch's own at the dtype, plus one rounding of the dtype at the result's size."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, classes, generator=gen) * scale).to(dtype)
    y = torch.randint(0, classes, (rows,), generator=gen)
    results = {}
    for name, fn, inp in (("ours", nf.cross_entropy, x), ("torch", F.cross_entropy, x),
                          ("exact", F.cross_entropy, x.double())):
        leaf = inp.to(device).detach().requires_grad_()
        loss = fn(leaf, y.to(device), reduction="sum", label_smoothing=smoothing)
        (g,) = torch.autograd.grad(loss, leaf)
        results[name] = (loss.detach().cpu(), g.cpu())
    for k in range(2):
        exact = results["exact"][k]
        floor = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
        assert _error(results["ours"][k], exact) <= 2 * _error(results["torch"][k], exact) + floor


@pytest.mark.parametrize("device", DEVICES)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       op=st.sampled_from(["binary_cross_entropy_with_logits", "sigmoid_focal_loss", "kl_div"]),
       n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1))
def test_pointwise_error_at_most_twice_torch(device, dtype, op, n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=gen) * 4).to(dtype)
    t = torch.rand(n, generator=gen).to(dtype)
    if op == "kl_div":
        x = -x.abs()
    reference = {"binary_cross_entropy_with_logits": F.binary_cross_entropy_with_logits,
                 "kl_div": F.kl_div,
                 "sigmoid_focal_loss": lambda a, b, reduction: oracle.torchvision_focal(
                     a, b, 0.25, 2.0).sum()}[op]
    ours = {"sigmoid_focal_loss": lambda a, b, reduction: nf.sigmoid_focal_loss(
        a, b, reduction=reduction)}.get(op, getattr(nf, op))
    results = {}
    for name, fn, inp, tgt in (("ours", ours, x, t), ("torch", reference, x, t),
                               ("exact", reference, x.double(), t.double())):
        leaf = inp.to(device).detach().requires_grad_()
        loss = fn(leaf, tgt.to(device), reduction="sum")
        (g,) = torch.autograd.grad(loss, leaf)
        results[name] = (loss.detach().cpu(), g.cpu())
    for k in range(2):
        exact = results["exact"][k]
        floor = torch.finfo(dtype).eps * max(1.0, exact.abs().max().item())
        if not math.isfinite(_error(results["torch"][k], exact)):
            continue
        assert _error(results["ours"][k], exact) <= 2 * _error(results["torch"][k], exact) + floor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("classes", [5000, 32000])
@pytest.mark.parametrize("probabilities", [False, True])
def test_cross_entropy_long_rows_error_at_most_twice_torch(device, classes, probabilities):
    """Rows of thousands of classes with label smoothing, through every path a
    backend has (no mask; a mask that keeps every class, so the result is torch's):
    the sums over a row must not drift past 2x torch's error."""
    gen = torch.Generator().manual_seed(classes)
    x = torch.randn(3, classes, generator=gen) * 4
    if probabilities:
        target = torch.softmax(torch.randn(3, classes, generator=gen) * 2, 1)
    else:
        target = torch.randint(0, classes, (3,), generator=gen)
    keep = torch.ones(3, classes, dtype=torch.bool, device=device)
    for mask in (None, keep):
        results = {}
        for name, fn, inp, tgt in (
                ("ours", lambda *a, **k: nf.cross_entropy(*a, mask=mask, **k), x, target),
                ("torch", F.cross_entropy, x, target),
                ("exact", F.cross_entropy, x.double(), target.double() if probabilities else target)):
            leaf = inp.to(device).detach().requires_grad_()
            loss = fn(leaf, tgt.to(device), reduction="sum", label_smoothing=0.1)
            (g,) = torch.autograd.grad(loss, leaf)
            results[name] = (loss.detach().cpu(), g.cpu())
        for k in range(2):
            exact = results["exact"][k]
            floor = torch.finfo(torch.float32).eps * max(1.0, exact.abs().max().item())
            ours, theirs = _error(results["ours"][k], exact), _error(results["torch"][k], exact)
            assert ours <= 2 * theirs + floor, (mask is None, k, ours, theirs)
