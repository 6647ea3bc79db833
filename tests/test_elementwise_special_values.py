"""The special-value table of the elementwise family (DESIGN.md section 2,
docs/elementwise.md) through nanfree.ops and its autograd, on the backend this
session selects: value, gradient and second derivative of every unary op at
the points where torch's are NaN or infinite (below the domain, at its edge,
infinities, NaN, subnormals, the largest values) and at ordinary points,
against the float64 oracle of tests/elementwise_oracle.py, in every dtype;
then the chain rule's own cases (infinite, zero, huge and NaN upstream
gradients) and the rows of the docs' table verbatim."""

import math

import pytest
import torch
from conftest import DTYPES, INF, NAN

import elementwise_oracle as oracle
import nanfree.ops as nf

OPS = tuple(oracle.UNARY)


def _points(op, dtype):
    info = torch.finfo(dtype)
    common = [NAN, INF, -INF, 0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4,
              -info.tiny, 0.5, -0.5, 2.0, -2.0, 1e-3]
    edges = {
        "sqrt": [1e-30, 4.0, 1e30],
        "log": [1e-30, 1.0, 1e30],
        "log1p": [-1.0, -1.0 + 2 ** -8, -1.5, 1e-8, 1e30],
        "acos": [1.0, -1.0, 1.0 - 2 ** -8, -1.0 + 2 ** -8, 1.5, -1.5, 0.99],
        "asin": [1.0, -1.0, 1.0 - 2 ** -8, -1.0 + 2 ** -8, 1.5, -1.5, 0.99],
    }[op]
    # Only points the dtype holds (1e30 is inf in float16, 1e-30 0).
    values = torch.tensor(common + edges, dtype=torch.float64).to(dtype)
    return values


def _tolerance(dtype):
    # Relative tolerance of one computed value against the float64 oracle at
    # the dtype's own (rounded) input: a few roundings of the dtype.
    return {torch.float64: 1e-13, torch.float32: 4e-7, torch.float16: 2e-3,
            torch.bfloat16: 1.6e-2}[dtype]


def _assert_matches(got, expected, dtype, what, saturated=True):
    """Each value equal to the oracle's within a few roundings; a gradient (saturated)
    the oracle's within the dtype's range (rule 5)."""
    bound = torch.finfo(dtype).max
    for i, (g, e) in enumerate(zip(got.double().tolist(), expected)):
        if e != e:
            assert g != g, f"{what}[{i}]: expected NaN, got {g}"
            continue
        if saturated:
            e = max(-bound, min(bound, e))
        if math.isinf(e) or e == 0:
            assert g == e, f"{what}[{i}]: expected {e}, got {g}"
            continue
        # e may underflow the dtype: within its smallest subnormal there.
        tol = _tolerance(dtype) * abs(e) + torch.finfo(dtype).tiny * torch.finfo(dtype).eps
        assert abs(g - e) <= tol, f"{what}[{i}]: expected {e}, got {g}"


def _derivatives(op, x):
    """(value, gradient, second derivative) of nanfree.ops.<op> at x, each
    element independent, through autograd (upstream gradient 1)."""
    x = x.detach().requires_grad_()
    y = getattr(nf, op)(x)
    (d1,) = torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)
    (d2,) = torch.autograd.grad(d1, x, torch.ones_like(d1))
    return y.detach(), d1.detach(), d2


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_table(device, op, dtype):
    x = _points(op, dtype).to(device)
    value, d1, d2 = _derivatives(op, x)
    assert value.dtype == dtype and d1.dtype == dtype and d2.dtype == dtype
    expected = [oracle.UNARY[op](v) for v in x.double().tolist()]
    _assert_matches(value.cpu(), [e[0] for e in expected], dtype, f"{op} value", saturated=False)
    _assert_matches(d1.cpu(), [e[1] for e in expected], dtype, f"{op} derivative")
    _assert_matches(d2.cpu(), [e[2] for e in expected], dtype, f"{op} second derivative")
    # out= (nanfree::<op>_out) writes the same values: bit for bit into a
    # contiguous out; into a strided one within the dtype's rounding (the CPU
    # kernel's strided loop takes the scalar path, as torch's loops do).
    out = torch.empty_like(value)
    getattr(nf, op)(x, out=out)
    torch.testing.assert_close(out, value, rtol=0, atol=0, equal_nan=True)
    strided = torch.empty(2 * x.numel(), dtype=dtype, device=device)[::2]
    getattr(nf, op)(x, out=strided)
    _assert_matches(strided.cpu(), [e[0] for e in expected], dtype, f"{op} value into a strided out",
                    saturated=False)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_rule(device, op, dtype):
    """Upstream gradients against derivatives counted 0, large derivatives and NaN."""
    info = torch.finfo(dtype)
    edge = {"sqrt": 0.0, "log": 0.0, "log1p": -1.0, "acos": 1.0, "asin": -1.0}[op]
    near = {"sqrt": info.tiny, "log": info.tiny, "log1p": -1.0 + info.eps,
            "acos": 1.0 - info.eps, "asin": -1.0 + info.eps}[op]
    # The last three: infinite upstream gradients at +inf, where every derivative is 0
    # (log's gradient, g / x, would be inf / inf there), and below every domain.
    x = torch.tensor([edge, edge, edge, near, near, near, 0.25, 0.25, INF, INF, -2.0],
                     dtype=dtype, device=device, requires_grad=True)
    g = torch.tensor([INF, -INF, NAN, info.max, -info.max, 0.0, NAN, info.max, INF, -INF, INF],
                     dtype=dtype, device=device)
    (grad,) = torch.autograd.grad(getattr(nf, op)(x), x, g)
    bound = info.max
    expected = [oracle.chain(gv, oracle.UNARY[op](xv)[1], bound)
                for gv, xv in zip(g.double().tolist(), x.detach().double().tolist())]
    _assert_matches(grad.cpu(), expected, dtype, f"{op} chain rule")
    assert grad[:2].eq(0).all() and grad[2].isnan() and grad[6].isnan()
    assert grad[8:].eq(0).all()
    assert torch.isfinite(grad[[0, 1, 3, 4, 5, 7]]).all()


# docs/elementwise.md's table, float32: (op, x, value, gradient).
DOC_TABLE = [
    ("sqrt", -1.0, 0.0, 0.0), ("sqrt", 0.0, 0.0, 0.0), ("sqrt", INF, INF, 0.0),
    ("log", -1.0, -INF, 0.0), ("log", 0.0, -INF, 0.0),
    ("log", 1e-45, math.log(float(torch.tensor(1e-45))), torch.finfo(torch.float32).max),
    ("log1p", -2.0, -INF, 0.0), ("log1p", -1.0, -INF, 0.0),
    ("acos", 1.0, 0.0, 0.0), ("acos", -1.0, math.pi, 0.0), ("acos", 1.5, 0.0, 0.0),
    ("acos", INF, 0.0, 0.0), ("acos", -1.5, math.pi, 0.0), ("acos", -INF, math.pi, 0.0),
    ("asin", 1.0, math.pi / 2, 0.0), ("asin", -1.0, -math.pi / 2, 0.0),
    ("asin", 1.5, math.pi / 2, 0.0), ("asin", -INF, -math.pi / 2, 0.0),
]


@pytest.mark.parametrize("op,x,value,grad", DOC_TABLE)
def test_docs_table(device, op, x, value, grad):
    t = torch.tensor([x], dtype=torch.float32, device=device, requires_grad=True)
    y = getattr(nf, op)(t)
    (g,) = torch.autograd.grad(y, t, torch.ones_like(y))
    expected_value = float(torch.tensor(value, dtype=torch.float32))
    assert y.item() == expected_value or math.isclose(y.item(), expected_value, rel_tol=1e-6)
    assert g.item() == grad


@pytest.mark.parametrize("op", OPS)
def test_nan_stays_in_its_element(device, op):
    x = torch.tensor([0.25, NAN, 0.5, -INF, INF], device=device, requires_grad=True)
    y = getattr(nf, op)(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert y.isnan().tolist() == [False, True, False, False, False]
    assert g.isnan().tolist() == [False, True, False, False, False]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_runs_with_special_values_everywhere(device, op, dtype):
    """A run longer than the CPU kernels' chunk of the C library calls (8192) and
    than a vector, with edges, NaN, infinities and points beyond the domain at
    random places (chunk and vector boundaries included): every element as the
    oracle says, value and gradient."""
    n = 3 * 8192 + 17
    gen = torch.Generator().manual_seed(7)
    pool = _points(op, dtype).double()
    inside = {"sqrt": 0.1, "log": 0.1, "log1p": -0.9, "acos": -0.9, "asin": -0.9}[op]
    x = inside + torch.rand(n, generator=gen, dtype=torch.float64) * 1.8
    special = torch.rand(n, generator=gen) < 0.05
    special[[0, 8191, 8192, 16383, 16384, n - 1]] = True
    x[special] = pool[torch.randint(len(pool), (int(special.sum()),), generator=gen)]
    x = x.to(dtype).to(device).requires_grad_(True)
    y = getattr(nf, op)(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    expected = [oracle.UNARY[op](v) for v in x.detach().double().tolist()]
    _assert_matches(y.detach().cpu(), [e[0] for e in expected], dtype, f"{op} value", saturated=False)
    _assert_matches(g.cpu(), [e[1] for e in expected], dtype, f"{op} derivative")
