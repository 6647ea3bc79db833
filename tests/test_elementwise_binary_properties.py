"""Properties of the elementwise family's binary ops on the backend this session
selects: on a grid of float16 and bfloat16 bit patterns (every 256th of the
65536, every 1024th under Triton's interpreter, and the special values, in every pair) every value is finite or an
infinity the float64 op also gives at those inputs, every first and second
derivative is finite, and NaN is exactly where an input is NaN; and the
2x-torch-error rule of DESIGN.md section 1.4 for values and both gradients at
random points where torch is finite (float32, float16, bfloat16 against
float64; float64 within torch.testing.assert_close of torch's)."""

import math

import pytest
import torch
from conftest import DEVICES, HALF_DTYPES, INTERPRETED
from hypothesis import given
from hypothesis import strategies as st

import nanfree.ops as nf
from test_elementwise_properties import _error, _floor

OPS = ("pow", "atan2", "div_no_nan", "xlogy", "xlog1py")
TORCH = {"pow": torch.pow, "atan2": torch.atan2, "div_no_nan": torch.div, "xlogy": torch.xlogy,
         "xlog1py": torch.special.xlog1py}


def _half_grid(dtype):
    # Every 256th bit pattern (every 1024th under Triton's interpreter, which runs
    # the kernels in numpy: 5929 pairs instead of 76176).
    step = 1024 if INTERPRETED else 256
    bits = torch.arange(-32768, 32768, step, dtype=torch.int32).to(torch.int16).view(dtype)
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, math.inf, -math.inf, math.nan,
                            info.max, -info.max, info.tiny, -info.tiny], dtype=dtype)
    points = torch.cat([bits, special])
    return points.repeat_interleave(len(points)), points.repeat(len(points))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_grid(device, op, dtype):
    a0, b0 = _half_grid(dtype)
    a = a0.to(device).requires_grad_(True)
    b = b0.to(device).requires_grad_(True)
    y = getattr(nf, op)(a, b)
    da, db = torch.autograd.grad(y, (a, b), torch.ones_like(y), create_graph=True)
    daa, dab = torch.autograd.grad(da, (a, b), torch.ones_like(da), retain_graph=True)
    _, dbb = torch.autograd.grad(db, (a, b), torch.ones_like(db))
    nan_in = (torch.isnan(a0) | torch.isnan(b0)).to(device)
    for name, t in (("value", y.detach()), ("d/da", da.detach()), ("d/db", db.detach()),
                    ("d2/da2", daa), ("d2/dadb", dab), ("d2/db2", dbb)):
        assert torch.equal(torch.isnan(t), nan_in), f"{name}: NaN not exactly where an input is"
        if name != "value":
            assert bool((torch.isfinite(t) | nan_in).all()), f"{name}: not finite"
    # An infinite value only where the float64 op's value is infinite or beyond the dtype.
    wide = getattr(nf, op)(a0.double().to(device), b0.double().to(device)).to(dtype)
    infinite = torch.isinf(y.detach())
    assert torch.equal(y.detach()[infinite], wide[infinite])


def _points(op, raw_a, raw_b, scale):
    return {
        "pow": (raw_a.abs() * scale + 1e-3, raw_b * 2),
        "atan2": (raw_a * scale, raw_b),
        "div_no_nan": (raw_a * scale, raw_b),
        "xlogy": (raw_a, raw_b.abs() * scale),
        "xlog1py": (raw_a, raw_b.abs() * scale - 0.99),
    }[op]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_error_at_most_twice_torch(device, op, dtype, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    n = 256
    raw_a = torch.randn(n, generator=gen, dtype=torch.float64)
    raw_b = torch.randn(n, generator=gen, dtype=torch.float64)
    a, b = (t.to(dtype) for t in _points(op, raw_a, raw_b, scale))
    ref_a, ref_b = a.double().requires_grad_(True), b.double().requires_grad_(True)
    ref = TORCH[op](ref_a, ref_b)
    ref_grads = torch.autograd.grad(ref.sum(), (ref_a, ref_b))
    keep = torch.isfinite(ref) & torch.isfinite(ref_grads[0]) & torch.isfinite(ref_grads[1])
    results = {}
    for name, fn in (("nanfree", getattr(nf, op)), ("torch", TORCH[op])):
        ai, bi = a.to(device).requires_grad_(True), b.to(device).requires_grad_(True)
        yi = fn(ai, bi)
        gi = torch.autograd.grad(yi.sum(), (ai, bi))
        results[name] = [t.detach().cpu()[keep] for t in (yi, *gi)]
    for i, what in enumerate(("value", "d/da", "d/db")):
        ours, theirs = results["nanfree"][i], results["torch"][i]
        if dtype == torch.float64:  # the reference is torch's own float64: assert_close (1.4)
            torch.testing.assert_close(ours, theirs)
            continue
        ref_i = (ref.detach(), *ref_grads)[i][keep]
        n_err, t_err = _error(ours, ref_i), _error(theirs, ref_i)
        assert n_err <= 2 * t_err + _floor(dtype, ref_i), f"{op} {what}: {n_err} vs torch {t_err}"


def _ulp(x):
    """The spacing of float32 at |x| (the smallest subnormal below the normals)."""
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def test_float32_pow_within_one_ulp(device):
    # pow's value in float32 against float64 pow rounded to float32, on wide
    # random bases and exponents (overflow and underflow included), negative bases
    # at integer exponents (odd and even), bases next to 1 with large exponents,
    # and subnormal bases: within one ulp of the rounded float64 value (torch's
    # float pow is within one ulp; the CPU kernels' is within about half).
    gen = torch.Generator().manual_seed(0)
    n = 1 << (14 if INTERPRETED else 18)
    u = torch.rand(6, n, generator=gen, dtype=torch.float64)
    bases = torch.cat([
        torch.exp2(u[0] * 80 - 40),                              # 2^-40 .. 2^40
        -torch.exp2(u[1] * 20 - 10),                             # negative ...
        1 + (u[2] - 0.5) * 1e-5,                                 # next to 1
        torch.exp2(u[3] * 20 - 149),                             # float32 subnormals and tiny normals
    ]).float()
    exponents = torch.cat([
        (u[4] - 0.5) * 8,
        torch.round((u[5] - 0.5) * 40),                          # ... at integer exponents
        (u[4] - 0.5) * 4e6,
        (u[5] - 0.5) * 3,
    ]).float()
    ours = nf.pow(bases.to(device), exponents.to(device)).cpu()
    ref = torch.pow(bases.double(), exponents.double())
    ref32 = ref.float()
    finite = torch.isfinite(ref32) & (ref32 != 0)
    assert torch.equal(ours[~finite], ref32[~finite]), "overflow or underflow to 0 differs"
    err = (ours[finite].double() - ref[finite]).abs() / _ulp(ref32[finite]).double()
    assert float(err.max()) <= 1.0, f"pow: {float(err.max())} ulp"
