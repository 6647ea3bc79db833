"""The special-value tables of the elementwise family's binary ops (pow, atan2,
div_no_nan, xlogy, xlog1py; DESIGN.md section 2, docs/elementwise.md) through
nanfree.ops and its autograd, on the backend this session selects: value,
both gradients and the three second derivatives at every pair of a grid of
points where torch's are NaN or infinite (zeros of both signs, the domains'
edges, infinities, NaN, subnormals, the largest values) and ordinary points,
against the float64 oracle of tests/elementwise_oracle.py, in every dtype;
then the docs' tables verbatim, broadcast operands and scalar arguments."""

import math

import pytest
import torch
from conftest import DTYPES, INF, NAN

import elementwise_oracle as oracle
import nanfree.ops as nf
from test_elementwise_special_values import _assert_matches

OPS = tuple(oracle.BINARY)


def _grid(op, dtype):
    """Every pair of the op's points (a first), as two flat tensors of the dtype."""
    info = torch.finfo(dtype)
    common = [NAN, INF, -INF, 0.0, -0.0, info.max, -info.max, info.tiny, -info.tiny, 0.5, -0.5,
              1.0, -1.0, 2.0, -3.0]
    extra = {"pow": [2.5, 1e-3, 0.25], "atan2": [1e-30, 3.0, 1e30],
             "div_no_nan": [1e-30, 3.0, 1e30], "xlogy": [-2.0, 1e-30, 1e30],
             "xlog1py": [-2.0, -1.0 + 2 ** -8, 1e-8]}[op]
    points = torch.tensor(common + extra, dtype=torch.float64).to(dtype)
    a = points.repeat_interleave(len(points))
    b = points.repeat(len(points))
    return a, b


def _all_derivatives(op, a, b):
    """(value, d/da, d/db, d2/da2, d2/dadb, d2/db2) of nanfree.ops.<op> at (a, b),
    each element independent, through autograd (upstream gradients 1)."""
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    y = getattr(nf, op)(a, b)
    da, db = torch.autograd.grad(y, (a, b), torch.ones_like(y), create_graph=True)
    daa, dab = torch.autograd.grad(da, (a, b), torch.ones_like(da), retain_graph=True)
    dba, dbb = torch.autograd.grad(db, (a, b), torch.ones_like(db))
    return y.detach(), da.detach(), db.detach(), daa, dab, dbb, dba


def _rounded(values, dtype):
    """The oracle's float64 values rounded to the dtype (an exact value beyond the
    dtype's range is its infinity)."""
    return torch.tensor(values, dtype=torch.float64).to(dtype).double().tolist()


def _assert_matches_conditioned(got, expected, bases, dtype, what, exponents=None):
    """_assert_matches for a power's derivative at base a: the tolerance grows with
    |log a|, the condition of a^(b - k) in its rounded exponent. With `exponents`
    (the second derivative b (b - 1) a^(b - 2)): where a^(b - 2) alone passes the
    dtype's range the result saturates even if the product would not (a base near
    the smallest normal with an exponent near 0; docs/elementwise.md)."""
    bound = torch.finfo(dtype).max
    acc_bound = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    eps = torch.finfo(dtype).eps
    for i, (g, e, base) in enumerate(zip(got.double().tolist(), expected, bases)):
        if e != e:
            assert g != g, f"{what}[{i}]: expected NaN, got {g}"
            continue
        if exponents is not None and e != 0 and abs(oracle._pow(base, exponents[i] - 2)) > acc_bound:
            assert abs(g) == bound and math.copysign(1, g) == math.copysign(1, e), \
                f"{what}[{i}]: expected {e} saturated, got {g}"
            continue
        e = max(-bound, min(bound, e))
        if math.isinf(e) or e == 0:
            assert g == e, f"{what}[{i}]: expected {e}, got {g}"
            continue
        condition = 4 + (abs(math.log(abs(base))) if base != 0 and math.isfinite(base) else 0)
        tol = condition * eps * abs(e) + torch.finfo(dtype).tiny * eps
        assert abs(g - e) <= tol or abs(g) == bound and abs(e) > bound / (1 + condition * eps), \
            f"{what}[{i}]: expected {e}, got {g}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_table(device, op, dtype):
    a, b = _grid(op, dtype)
    got = _all_derivatives(op, a.to(device), b.to(device))
    assert all(t.dtype == dtype for t in got)
    expected = [oracle.BINARY[op](x, y) for x, y in zip(a.double().tolist(), b.double().tolist())]
    names = ("value", "d/da", "d/db", "d2/da2", "d2/dadb", "d2/db2")
    # pow's derivatives are powers with exponents b - 1 and b - 2, rounded in the
    # dtype as in torch's formula: relative error up to |log a| roundings there.
    conditioned = [op == "pow" and k > 0 for k in range(6)]
    for k, name in enumerate(names):
        column = [e[k] for e in expected]
        if k == 0:
            column = _rounded(column, dtype)
        if conditioned[k]:
            _assert_matches_conditioned(got[k].cpu(), column, a.double().tolist(), dtype,
                                        f"{op} {name}", b.double().tolist() if k == 3 else None)
        else:
            _assert_matches(got[k].cpu(), column, dtype, f"{op} {name}", saturated=k > 0)
    # The mixed second derivative is one, from either first derivative.
    torch.testing.assert_close(got[4], got[6], rtol=0, atol=0, equal_nan=True)
    # out= (nanfree::<op>_out) writes the same values: bit for bit into a
    # contiguous out; into a strided one within the dtype's rounding (the CPU
    # kernel's strided loop takes the scalar path, as torch's loops do).
    a, b = a.to(device), b.to(device)
    out = torch.empty_like(got[0])
    getattr(nf, op)(a, b, out=out)
    torch.testing.assert_close(out, got[0], rtol=0, atol=0, equal_nan=True)
    strided = torch.empty(2 * a.numel(), dtype=dtype, device=device)[::2]
    getattr(nf, op)(a, b, out=strided)
    _assert_matches(strided.cpu(), _rounded([e[0] for e in expected], dtype), dtype,
                    f"{op} value into a strided out", saturated=False)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_rule(device, op, dtype):
    """Infinite, zero, huge and NaN upstream gradients against partials counted 0
    and ordinary ones."""
    info = torch.finfo(dtype)
    zero_point = {"pow": (0.0, 0.5), "atan2": (0.0, 0.0), "div_no_nan": (1.0, 0.0),
                  "xlogy": (0.0, 0.0), "xlog1py": (0.0, -1.0)}[op]
    a = torch.tensor([zero_point[0]] * 3 + [0.75] * 3, dtype=dtype, device=device,
                     requires_grad=True)
    b = torch.tensor([zero_point[1]] * 3 + [1.5] * 3, dtype=dtype, device=device,
                     requires_grad=True)
    g = torch.tensor([INF, -INF, NAN, info.max, 0.0, NAN], dtype=dtype, device=device)
    ga, gb = torch.autograd.grad(getattr(nf, op)(a, b), (a, b), g)
    for k, got in ((1, ga), (2, gb)):
        expected = [oracle.chain(gv, oracle.BINARY[op](x, y)[k], info.max)
                    for gv, x, y in zip(g.double().tolist(), a.detach().double().tolist(),
                                        b.detach().double().tolist())]
        _assert_matches(got.cpu(), expected, dtype, f"{op} chain rule, partial {k}")
    for got in (ga, gb):
        assert got[:2].eq(0).all() and got[2].isnan() and got[5].isnan()
        assert torch.isfinite(got[[0, 1, 3, 4]]).all()


F32_MAX = torch.finfo(torch.float32).max

# docs/elementwise.md's tables, float32: (op, a, b, value, d/da, d/db).
DOC_TABLE = [
    ("atan2", 0.0, 0.0, 0.0, 0.0, 0.0),
    ("pow", 0.0, 0.5, 0.0, 0.0, 0.0), ("pow", 0.0, -1.0, INF, 0.0, 0.0),
    ("pow", -2.0, 0.5, 0.0, 0.0, 0.0), ("pow", -2.0, 2.0, 4.0, -4.0, 0.0),
    ("pow", 0.0, 0.0, 1.0, 0.0, 0.0), ("pow", 0.0, 1.0, 0.0, 1.0, 0.0),
    ("pow", -2.0, -0.5, INF, 0.0, 0.0), ("pow", -2.0, 0.0, 1.0, 0.0, 0.0),
    ("pow", INF, -1.0, 0.0, 0.0, 0.0), ("pow", 1.0, INF, 1.0, F32_MAX, 0.0),
    ("pow", 1.0, -INF, 1.0, -F32_MAX, 0.0), ("pow", 0.5, INF, 0.0, 0.0, 0.0),
    ("pow", 2.0, -INF, 0.0, 0.0, 0.0),
    ("div_no_nan", 1.0, 0.0, 0.0, 0.0, 0.0), ("div_no_nan", -1.0, 0.0, 0.0, 0.0, 0.0),
    ("div_no_nan", 0.0, 0.0, 0.0, 0.0, 0.0), ("div_no_nan", INF, INF, 0.0, 0.0, 0.0),
    ("div_no_nan", INF, -INF, 0.0, 0.0, 0.0), ("div_no_nan", 2.0, INF, 0.0, 0.0, 0.0),
    ("div_no_nan", INF, 2.0, INF, 0.5, -F32_MAX), ("div_no_nan", NAN, 0.0, NAN, NAN, NAN),
    ("xlogy", 0.0, 0.0, 0.0, 0.0, 0.0), ("xlogy", 1.0, 0.0, -INF, 0.0, 0.0),
    ("xlogy", 1.0, -1.0, -INF, 0.0, 0.0), ("xlogy", INF, 1.0, 0.0, 0.0, F32_MAX),
    ("xlogy", -INF, 1.0, 0.0, 0.0, -F32_MAX), ("xlogy", 0.0, INF, 0.0, F32_MAX, 0.0),
    ("xlogy", 2.0, INF, INF, F32_MAX, 0.0),
    ("xlog1py", 0.0, -1.0, 0.0, 0.0, 0.0), ("xlog1py", 1.0, -2.0, -INF, 0.0, 0.0),
    ("xlog1py", INF, 0.0, 0.0, 0.0, F32_MAX),
]


@pytest.mark.parametrize("op,a,b,value,da,db", DOC_TABLE)
def test_docs_table(device, op, a, b, value, da, db):
    ta = torch.tensor([a], device=device, requires_grad=True)
    tb = torch.tensor([b], device=device, requires_grad=True)
    y = getattr(nf, op)(ta, tb)
    ga, gb = torch.autograd.grad(y, (ta, tb), torch.ones_like(y))
    for got, want in ((y, value), (ga, da), (gb, db)):
        if math.isnan(want):
            assert got.isnan().all()
        else:
            assert got.item() == want


@pytest.mark.parametrize("op", OPS)
def test_broadcast_operands_and_scalars(device, op):
    """A [3, 1] against a [4] (both broadcast), and a Python number either side:
    the values of the full grid, gradients summed to each input's shape."""
    a = torch.tensor([[0.0], [0.5], [-2.0]], device=device, requires_grad=True)
    b = torch.tensor([0.0, 1.0, -1.0, 2.5], device=device, requires_grad=True)
    y = getattr(nf, op)(a, b)
    assert y.shape == (3, 4)
    full = getattr(nf, op)(a.detach().expand(3, 4).contiguous(), b.detach().expand(3, 4).contiguous())
    torch.testing.assert_close(y.detach(), full, equal_nan=True)
    ga, gb = torch.autograd.grad(y.sum(), (a, b))
    assert ga.shape == a.shape and gb.shape == b.shape
    expected = [[oracle.BINARY[op](x, v) for v in b.tolist()] for x in a.detach().flatten().tolist()]
    torch.testing.assert_close(ga.cpu().flatten(), torch.tensor([sum(e[1] for e in row)
                                                                 for row in expected]))
    torch.testing.assert_close(gb.cpu(), torch.tensor([sum(row[j][2] for row in expected)
                                                       for j in range(4)]))
    for number in (2, 0.5):
        left = getattr(nf, op)(number, b.detach())
        right = getattr(nf, op)(b.detach(), number)
        torch.testing.assert_close(left.cpu(), torch.tensor(
            [oracle.BINARY[op](float(number), v)[0] for v in b.tolist()], dtype=torch.float32),
            equal_nan=True)
        torch.testing.assert_close(right.cpu(), torch.tensor(
            [oracle.BINARY[op](v, float(number))[0] for v in b.tolist()], dtype=torch.float32),
            equal_nan=True)


@pytest.mark.parametrize("op", OPS)
def test_nan_stays_in_its_element(device, op):
    a = torch.tensor([0.25, NAN, 0.5, 0.0, INF, NAN], device=device, requires_grad=True)
    b = torch.tensor([0.5, 0.5, NAN, NAN, INF, 0.0], device=device, requires_grad=True)
    y = getattr(nf, op)(a, b)
    ga, gb = torch.autograd.grad(y, (a, b), torch.ones_like(y))
    nan = [False, True, True, True, False, True]
    assert y.isnan().tolist() == nan and ga.isnan().tolist() == nan and gb.isnan().tolist() == nan


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 2.5, 0.0, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pow_at_a_number_exponent(device, exponent, dtype):
    """pow with a Python exponent (the CPU kernels compute 2, 3, 0.5, -0.5, -1 and -2
    without pow): value, derivative and second derivative in the base at every
    point of the grid as the oracle, and as pow with that exponent in a tensor;
    with a 0-d exponent requiring grad, its gradient too."""
    a, _ = _grid("pow", dtype)
    base = a[::len(a) // 18 + 1].unique().to(device).requires_grad_(True)  # each point once
    y = nf.pow(base, exponent)
    (da,) = torch.autograd.grad(y, base, torch.ones_like(y), create_graph=True)
    (daa,) = torch.autograd.grad(da, base, torch.ones_like(da))
    points = base.detach().double().tolist()
    expected = [oracle.pow(x, exponent) for x in points]
    _assert_matches(y.detach().cpu(), _rounded([e[0] for e in expected], dtype), dtype,
                    f"pow(a, {exponent}) value", saturated=False)
    exponents = [exponent] * len(points)
    _assert_matches_conditioned(da.detach().cpu(), [e[1] for e in expected], points, dtype,
                                f"pow(a, {exponent}) d/da")
    _assert_matches_conditioned(daa.cpu(), [e[3] for e in expected], points, dtype,
                                f"pow(a, {exponent}) d2/da2", exponents)
    p = torch.full_like(base, exponent).detach().requires_grad_(True)
    y0 = nf.pow(base, p)
    # The general pow and the products differ by their roundings only.
    torch.testing.assert_close(y0, y, equal_nan=True, rtol=4 * torch.finfo(dtype).eps, atol=0)
    (dp,) = torch.autograd.grad(y0, p, torch.ones_like(y0))
    _assert_matches_conditioned(dp.cpu(), [e[2] for e in expected], points, dtype,
                                f"pow(a, {exponent}) d/dp")
