"""Properties of the elementwise family's unary ops on the backend this session
selects: every float16 and bfloat16 bit pattern (all 65536 of each) gives a
value that is finite or the exact infinity the rules allow and finite first
and second derivatives, NaN exactly where the input is NaN; and the 2x-torch-
error rule of DESIGN.md section 1.4 for values and gradients at random points
where torch is finite (float32, float16, bfloat16 against float64; float64
within torch.testing.assert_close of torch's)."""

import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, HALF_DTYPES
from hypothesis import given
from hypothesis import strategies as st

import elementwise_oracle as oracle
import nanfree.ops as nf

OPS = ("sqrt", "log", "log1p", "acos", "asin")


def _all_bit_patterns(dtype):
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def _allowed_infinity(op, x, y):
    """Where the exact value is infinite (DESIGN.md 2: log at and below its edge, +inf at +inf)."""
    if op in ("acos", "asin"):
        return torch.zeros_like(x, dtype=torch.bool)
    edge = -1.0 if op == "log1p" else 0.0
    below = (x <= edge) & (y == -math.inf)
    return below | ((x == math.inf) & (y == math.inf))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_every_half_bit_pattern(device, op, dtype):
    x = _all_bit_patterns(dtype).to(device).requires_grad_(True)
    y = getattr(nf, op)(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)
    (gg,) = torch.autograd.grad(g, x, torch.ones_like(g))
    nan_in = torch.isnan(x.detach())
    for name, t in (("value", y.detach()), ("derivative", g.detach()), ("second", gg)):
        assert torch.equal(torch.isnan(t), nan_in), f"{name}: NaN not exactly where x is NaN"
    finite_or_allowed = torch.isfinite(y.detach()) | _allowed_infinity(op, x.detach(), y.detach())
    assert bool((finite_or_allowed | nan_in).all())
    assert bool((torch.isfinite(g.detach()) | nan_in).all())
    assert bool((torch.isfinite(gg) | nan_in).all())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_every_half_bit_pattern_is_rounded_correctly(device, op, dtype):
    # Inside the domain (where the exact value is finite), every float16 and
    # bfloat16 value is within one ulp of float64's value rounded to the dtype,
    # and is that value in all but 1 in 1000 (a float result rounded again to
    # the dtype can land on a tie: float16 sqrt at 15 inputs, computed in float;
    # the CPU kernels and torch's CPU ops miss only float16 asin's 2).
    x = _all_bit_patterns(dtype)
    exact = getattr(torch, op)(x.double())
    inside = torch.isfinite(exact)
    rounded = exact[inside].to(dtype).double()
    ours = getattr(nf, op)(x.to(device)).cpu()[inside].double()
    ulp = (torch.nextafter(rounded.to(dtype), torch.tensor(math.inf, dtype=dtype)).double() - rounded).abs()
    assert bool(((ours - rounded).abs() <= ulp).all()), f"{op}: a value more than one ulp off"
    missed = ours != rounded
    assert int(missed.sum()) <= inside.sum() // 1000, \
        f"{op}: {int(missed.sum())} values not the correctly rounded one, e.g. x = " \
        f"{x[inside][missed][:4].tolist()}"


def _error(ours, ref):
    return (ours.double() - ref).abs().max().item() if ours.numel() else 0.0


def _floor(dtype, ref):
    # Half an ulp of the dtype at the reference's largest magnitude: the rounding every
    # result in that dtype may carry, torch's included.
    return torch.finfo(dtype).eps * max(ref.abs().max().item(), torch.finfo(dtype).tiny)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_error_at_most_twice_torch(device, op, dtype, seed, scale):
    gen = torch.Generator().manual_seed(seed)
    n = 256
    raw = torch.randn(n, generator=gen, dtype=torch.float64)
    x = {"sqrt": raw.abs() * scale, "log": raw.abs() * scale, "log1p": raw.abs() * scale - 0.99,
         "acos": torch.tanh(raw), "asin": torch.tanh(raw)}[op].to(dtype)
    ref_x = x.double().requires_grad_(True)
    ref = getattr(torch, op)(ref_x)
    (ref_g,) = torch.autograd.grad(ref.sum(), ref_x)
    keep = torch.isfinite(ref) & torch.isfinite(ref_g)
    for name in ("nanfree", "torch"):
        xi = x.to(device).requires_grad_(True)
        yi = (getattr(nf, op) if name == "nanfree" else getattr(torch, op))(xi)
        (gi,) = torch.autograd.grad(yi.sum(), xi)
        if name == "nanfree":
            ours = (yi.detach().cpu()[keep], gi.cpu()[keep])
        else:
            theirs = (yi.detach().cpu()[keep], gi.cpu()[keep])
    for i, what in enumerate(("value", "gradient")):
        if dtype == torch.float64:  # the reference is torch's own float64: assert_close (1.4)
            torch.testing.assert_close(ours[i], theirs[i])
            continue
        ref_i = (ref.detach(), ref_g)[i][keep]
        n_err, t_err = _error(ours[i], ref_i), _error(theirs[i], ref_i)
        assert n_err <= 2 * t_err + _floor(dtype, ref_i), f"{op} {what}: {n_err} vs torch {t_err}"


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_results_below_float_normals_are_kept(device):
    # bfloat16 has float32's exponent range: a result below FLT_MIN is a
    # bfloat16 denormal, which torch keeps. The vector stores must keep it too
    # (the CPU's one-instruction bfloat16 rounding reads float denormals as 0,
    # so vectors holding one take the exact rounding). 77 entries: whole
    # vectors and a tail, denormal and normal results in the same vectors.
    n = 77
    x = torch.full((n,), 3.3e38, dtype=torch.bfloat16, device=device)
    x[::3] = 2.0
    x = x.requires_grad_()
    g = torch.ones(n, dtype=torch.bfloat16, device=device)
    grad_log, = torch.autograd.grad(nf.log(x), x, g)
    small = torch.full((n,), 1e-20, dtype=torch.bfloat16, device=device)
    grad_sqrt, = torch.autograd.grad(nf.sqrt(x), x, small)
    a = torch.full((n,), 1e-30, dtype=torch.bfloat16, device=device)
    quotient = nf.div_no_nan(a, torch.full((n,), 1e9, dtype=torch.bfloat16, device=device))
    xf = x.detach().float()
    cases = [("log'", grad_log, 1 / xf), ("sqrt'", grad_sqrt, small.float() * 0.5 / xf.sqrt()),
             ("div_no_nan", quotient, a.float() / torch.tensor(1e9, dtype=torch.bfloat16).float())]
    for name, ours, exact in cases:
        expected = exact.to(torch.bfloat16)
        assert bool(((expected.float().abs() < torch.finfo(torch.float32).tiny)
                     & (expected != 0)).any()), name  # the case holds denormal results
        torch.testing.assert_close(ours.cpu().float(), expected.cpu().float(), rtol=2 ** -8,
                                   atol=0, msg=name)


def _ulp_error(ours, x, fn):
    """|ours - fn(x)| in ulps of fn(x) rounded to float32, where that is finite and
    not 0; and asserts ours is exactly that rounding (sign of 0 included) elsewhere."""
    ref = fn(x.double())
    ref32 = ref.float()
    finite = torch.isfinite(ref32) & (ref32 != 0)
    assert torch.equal(ours[~finite], ref32[~finite])
    assert torch.equal(torch.signbit(ours[ref32 == 0]), torch.signbit(ref32[ref32 == 0]))  # -0 kept
    spacing = (torch.nextafter(ref32[finite].abs(), torch.tensor(math.inf)) - ref32[finite].abs()).double()
    return (ours[finite].double() - ref[finite]).abs() / spacing


def test_float32_log_within_one_ulp(device):
    # log's value in float32 against float64's, over every binade from the
    # smallest subnormal to 2^128 and next to 1 on both sides: within one ulp
    # (torch's float log is; the AVX-512 CPU kernel's, computed in double,
    # within half an ulp: checked on all 2^32 floats when it was written).
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(3, 1 << 16, generator=gen, dtype=torch.float64)
    x = torch.cat([
        torch.exp2(u[0] * 277 - 149),                 # subnormal .. 2^128
        1 + (u[1] - 0.5) * 2 ** -4,                   # next to 1
        1 + (u[2] - 0.5) * 2 ** -20,
        torch.tensor([1.0, 0.5, 2.0, 3.4e38, 1.4e-45, 0.0, -0.0, math.inf]),
    ]).float()
    err = _ulp_error(nf.log(x.to(device)).cpu(), x, torch.log)
    assert float(err.max()) <= 1.0, f"log: {float(err.max())} ulp"


def test_float32_log1p_within_one_ulp(device):
    # log1p's value in float32 against float64's rounded to float32, from just
    # above -1 through tiny (subnormal) magnitudes of both signs to 1e38: within
    # one ulp of the rounded float64 value (torch's float log1p is within one
    # ulp; the AVX-512 CPU kernel's, computed in double, within about half).
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(4, 1 << 16, generator=gen, dtype=torch.float64)
    x = torch.cat([
        -1 + torch.exp2(-u[0] * 24),                  # just above -1
        torch.exp2(u[1] * 200 - 150),                 # subnormal .. 2^50
        -torch.exp2(-u[2] * 150),                     # small negatives
        u[3] * 8 - 1,
        torch.tensor([3e38, 1e38, 0.0, -0.0, -1.0]),
    ]).float()
    err = _ulp_error(nf.log1p(x.to(device)).cpu(), x, torch.log1p)
    assert float(err.max()) <= 1.0, f"log1p: {float(err.max())} ulp"


# The CPU kernels take MKL's vector math (VML) for some values on Intel's CPUs
# and ATen's Sleef vectors elsewhere (NANFREE_CPU_VML=auto); the other path is
# run here in child processes that force it, so both are tested on any x86 machine.
_CHILD = """
import sys, torch
import nanfree.ops as nf
inputs = torch.load(sys.argv[1])
torch.save({key: getattr(nf, key[0])(x) for key, x in inputs.items()}, sys.argv[2])
"""


@pytest.mark.backend_independent
@pytest.mark.parametrize("vml", ["0", "1"])
def test_cpu_values_with_and_without_vml(tmp_path, vml):
    # Each op in float32, float64 and bfloat16 on a grid over and beyond its domain
    # and the special values: the float64 oracle's value (the op at the domain's
    # clamp) rounded to the dtype, or within one ulp of it; infinities and NaN exact.
    special = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-30, -1e-30, 1 - 2 ** -24, -1 + 2 ** -24,
               math.inf, -math.inf, math.nan, 3e38, 1e-45]
    inputs = {}
    for op in OPS:
        grid = torch.linspace(-1.5, 1.5, 3001, dtype=torch.float64) * (1 if op in ("acos", "asin") else 5)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            inputs[(op, str(dtype))] = torch.cat([grid, torch.tensor(special, dtype=torch.float64)]).to(dtype)
    source, result = tmp_path / "inputs.pt", tmp_path / "values.pt"
    torch.save(inputs, source)
    env = {k: v for k, v in os.environ.items() if k not in ("NANFREE_BACKEND", "TRITON_INTERPRET")}
    env["NANFREE_CPU_VML"] = vml
    child = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(result)], env=env,
                           capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    values = torch.load(result)
    for (op, dtype_name), x in inputs.items():
        ours = values[(op, dtype_name)].double()
        exact = torch.tensor([oracle.UNARY[op](v)[0] for v in x.double().tolist()], dtype=torch.float64)
        rounded = exact.to(x.dtype)
        ulp = (torch.nextafter(rounded, torch.tensor(math.inf, dtype=x.dtype)) - rounded).double().abs()
        same = (ours == rounded.double()) | (torch.isnan(ours) & torch.isnan(exact))
        close = torch.isfinite(exact) & ((ours - exact).abs() <= ulp)
        assert bool((same | close).all()), \
            f"NANFREE_CPU_VML={vml} {op} {x.dtype}: x = {x[~(same | close)][:4].tolist()}"
