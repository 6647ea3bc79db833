"""Property tests of GeM pooling (nanfree.ops.gem, gem_pool2d, nanfree.nn.GeM,
GeMTokenPooling): extreme finite inputs in every dtype, for p in [0.5, 64],
give a finite output and finite gradients for x and p, against the float64
oracle of gem_oracle.py; a NaN entry makes only its own reduction NaN; where
torch's composition (clamp, pow, mean, pow) is finite nanfree's error is at
most 2x torch's (DESIGN.md 1.4), also where torch overflows or underflows
(measured against torch on the same values scaled into its range by a power
of two). Drop-in behaviour, the modules and memory are test_gem_drop_in.py; the
special-value table itself is test_gem_special_values.py."""

import math

import pytest
import torch
from conftest import DEVICES, DTYPES, INF, INTERPRETED, NAN, acc_dtype
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import gem_oracle
import nanfree.ops as nf


# Magnitudes near each dtype's limits: a power that overflows the dtype
# (fp16: 6e4^3) and one that underflows it (fp16: (1e-4)^3 = 1e-12).
HUGE = {torch.float16: 6e4, torch.bfloat16: 1e38, torch.float32: 1e38, torch.float64: 1e300}
SMALL = {torch.float16: 1e-4, torch.bfloat16: 1e-30, torch.float32: 1e-30, torch.float64: 1e-300}

# Forward tolerances against the oracle: the output's rounding plus the
# accumulation in float32 (float64) of at most MAX_N ratio powers.
TOL = {
    torch.float64: dict(rtol=1e-10, atol=0.0),
    torch.float32: dict(rtol=2e-5, atol=0.0),
    torch.float16: dict(rtol=2e-3, atol=0.0),
    torch.bfloat16: dict(rtol=1.6e-2, atol=0.0),
}
# Each gradient entry is a product of a few float32 (float64) factors,
# r^(p-1) amplifying the ratio's rounding by p - 1, rounded to the dtype.
GRAD_RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3,
             torch.bfloat16: 1.6e-2}
# p's gradient comes back in p's dtype, float32 here: for float64 input, two
# float32 roundings.
P_GRAD_RTOL = {torch.float64: 2.5e-7, torch.float32: 1e-4, torch.float16: 1e-4,
               torch.bfloat16: 1e-4}
MAX_ROWS = 4
MAX_N = 24
# The NaN-placement test runs two forward and backward passes an example:
# half the examples of the profile conftest.py loaded.
FEWER_EXAMPLES = settings(max_examples=max(5, settings().max_examples // 2))
LAYOUTS = ["rows", "columns", "tokens", "image"]


# --- layouts: a [R, n] batch of reductions as the op's input --------------------------


def _to_layout(v, layout):
    """v [R, n] (R reductions of n entries) as (input, dim) of nanfree.ops.gem:
    rows [R, n] over dim 1 (the image layout's memory: gem_pool2d of [1, R, 1, n]);
    columns [n, R] over dim 0 (entries R apart); tokens [2, n, R/2] over dim 1
    (R even; otherwise as columns)."""
    if layout == "rows":
        return v, 1
    if layout == "image":
        return v[None, :, None, :], (2, 3)
    if layout == "tokens" and v.shape[0] % 2 == 0:
        r = v.shape[0]
        return v.reshape(2, r // 2, v.shape[1]).transpose(1, 2), 1
    return v.t(), 0


def _from_layout_grad(g, layout, shape):
    """The input's gradient back as [R, n]."""
    r, n = shape
    if layout == "rows":
        return g
    if layout == "image":
        return g.reshape(r, n)
    if layout == "tokens" and r % 2 == 0:
        return g.transpose(1, 2).reshape(r, n)
    return g.t()


def _run_gem(v, p, eps, mask, layout, device, g):
    """nanfree's gem of the reductions of v [R, n] (held values, the op's dtype)
    in a layout, forward and backward with incoming g [R]; returns the output
    [R], the input's gradient [R, n] and p's gradient, all on the CPU."""
    base, dim = _to_layout(v, layout)
    # The input contiguous in its layout (the kernels' own strides); the mask
    # keeps the layout's view (strided).
    x = base.contiguous().detach().to(device).requires_grad_(True)
    m = None if mask is None else _to_layout(mask, layout)[0].to(device)
    if isinstance(p, torch.Tensor):
        p = p.detach().clone().to(device).requires_grad_(True)
    if layout == "image":
        out = nf.gem_pool2d(x, p, eps) if mask is None else nf.gem(x, p, dim, eps, True, mask=m)
    else:
        out = nf.gem(x, p, dim, eps, mask=m)
    flat = out.reshape(-1)
    assert flat.shape == (v.shape[0],) and out.dtype == v.dtype
    flat.backward(g.to(v.dtype).to(device))
    dp = p.grad.cpu() if isinstance(p, torch.Tensor) else None
    return (flat.detach().cpu(), _from_layout_grad(x.grad, layout, v.shape).cpu(), dp)


def _incoming(r, positive=False):
    """A fixed incoming gradient of r entries, none 0 (all positive if asked:
    then p's gradient is a sum of nonnegative terms, d gem / d p >= 0)."""
    g = torch.cos(torch.arange(r, dtype=torch.float64) * 1.3 + 0.2)
    g = 0.5 + 0.5 * g.abs() if positive else g
    # Held exactly by every dtype (bfloat16's 8 bits, no entry near 0).
    return torch.where(g.abs() < 0.1, 0.1, g).to(torch.bfloat16).double()


# --- strategies ---------------------------------------------------------------------


def _extreme_values(dtype):
    info = torch.finfo(dtype)
    sub = info.tiny / 4  # a subnormal
    return [0.0, -0.0, info.tiny, sub, info.max, -info.max, -INF, HUGE[dtype], -HUGE[dtype],
            SMALL[dtype], 1e-6, 1e4 if dtype != torch.float16 else 3e4, 1.0, -1.0, 0.5]


@st.composite
def _row(draw, dtype, n):
    """One reduction's entries: all clamped (zeros and negatives), one magnitude
    times [0, 1] (some entries negative), or extreme values mixed with ordinary
    ones. No NaN, no +inf."""
    info = torch.finfo(dtype)
    kind = draw(st.sampled_from(["clamped", "scaled", "scaled", "mixed", "mixed"]))
    if kind == "clamped":
        return [draw(st.sampled_from([0.0, -0.0, -1.0, -INF, 1e-7]))] * n
    magnitude = draw(st.sampled_from([HUGE[dtype], SMALL[dtype], info.tiny / 4, info.max, 1.0,
                                      1e-6]))
    if kind == "scaled":
        units = draw(st.lists(st.floats(-0.25, 1, width=32), min_size=n, max_size=n))
        return [magnitude * u for u in units]
    value = st.one_of(st.sampled_from(_extreme_values(dtype)), st.floats(-5, 50, width=32))
    return draw(st.lists(value, min_size=n, max_size=n))


@st.composite
def extreme_batches(draw, dtypes=DTYPES):
    """(dtype, v [R, n] of values the dtype holds (no NaN, no +inf), mask [R, n]
    bool or None: some reductions may be fully masked)."""
    dtype = draw(st.sampled_from(dtypes))
    n = draw(st.integers(1, MAX_N))
    rows = draw(st.integers(1, MAX_ROWS))
    v = torch.tensor([draw(_row(dtype, n)) for _ in range(rows)], dtype=torch.float64)
    v = v.reshape(rows, n).to(dtype)
    mask = None
    if draw(st.booleans()):
        keep = draw(st.lists(st.booleans(), min_size=rows * n, max_size=rows * n))
        mask = torch.tensor(keep, dtype=torch.bool).reshape(rows, n)
    return dtype, v, mask


def _p_strategy():
    """p in [0.5, 64]: a Python float, or a float32 tensor of shape [] or [1]."""
    value = st.one_of(st.sampled_from([0.5, 1.0, 3.0, 10.0, 64.0]),
                      st.floats(0.5, 64.0, width=32))
    kind = st.sampled_from(["float", "tensor []", "tensor [1]"])

    def build(pair):
        v, k = pair
        if k == "float":
            return v
        return torch.full(() if k == "tensor []" else (1,), v, dtype=torch.float32)

    return st.tuples(value, kind).map(build)


# --- oracle helpers -----------------------------------------------------------------


def _effective_eps(eps, dtype):
    # Below the accumulation type's smallest normal, eps acts as that value.
    return max(eps, torch.finfo(acc_dtype(dtype)).tiny)


def _oracle(v, p, eps, mask, g):
    """(output [R], d/dx [R, n], d/dp per reduction [R] or None) of the float64
    oracle on the held values; gradients of non-finite rows are 0. d/dx is the
    oracle's closed form (autograd's product underflows at extreme ratios),
    d/dp autograd's."""
    x = v.double()
    p_ref = p.detach().float().reshape(()).clone().requires_grad_(True) \
        if isinstance(p, torch.Tensor) else p
    out = gem_oracle.gem(x, p_ref, 1, eps, mask)
    finite = torch.isfinite(out)
    dx = gem_oracle.input_gradient(x, p_ref, 1, eps, out, torch.where(finite, g, 0.0), mask)
    if not isinstance(p, torch.Tensor):
        return out.detach(), dx, None
    dps = torch.zeros(v.shape[0], dtype=torch.float64)
    for r in range(v.shape[0]):
        if finite[r]:
            (dps[r],) = torch.autograd.grad(out[r] * g[r], p_ref, retain_graph=True)
    return out.detach(), dx, dps


def _assert_grads(dx, want, dtype, what):
    """The input's gradient against the oracle's, entry by entry: finite; an
    entry beyond the dtype's range is its largest finite value with the exact
    gradient's sign; else within GRAD_RTOL of itself, plus the dtype's
    smallest normal (gradients in the subnormal range)."""
    got = dx.double()
    assert torch.isfinite(got).all(), f"non-finite gradient ({what}): {got}"
    big = torch.finfo(dtype).max
    ok_want = torch.isfinite(want)
    beyond = ok_want & (want.abs() > big)
    assert (got[beyond] == torch.sign(want[beyond]) * big).all(), \
        f"a gradient beyond the dtype's range must saturate ({what}): {got}, exact {want}"
    inside = ok_want & ~beyond
    torch.testing.assert_close(got[inside], want[inside], rtol=GRAD_RTOL[dtype],
                               atol=torch.finfo(dtype).tiny, msg=lambda m: f"{what}: {m}")


# --- extreme inputs -------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@given(batch=extreme_batches(), p=_p_strategy(), eps=st.sampled_from([1e-6, 1e-3, 1e-45]),
       layout=st.sampled_from(LAYOUTS))
# Found by hypothesis: the gradient of the 1 (7e-301) is a product of 7e299 and 1e-600.
@example(batch=(torch.float64, torch.tensor([[1e300, 1.0]], dtype=torch.float64), None),
         p=2.0, eps=1e-6, layout="rows")
def test_finite_on_finite_input(device, batch, p, eps, layout):
    dtype, v, mask = batch
    g = _incoming(v.shape[0])
    out, dx, dp = _run_gem(v, p, eps, mask, layout, device, g)
    assert torch.isfinite(out).all() and (out >= 0).all(), f"output {out}"
    eps_eff = _effective_eps(eps, dtype)
    ref, want_dx, want_dps = _oracle(v, p, eps_eff, mask, g)
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), **TOL[dtype])
    keep = torch.ones_like(v, dtype=torch.bool) if mask is None else mask
    clamped = v.to(acc_dtype(dtype)) <= torch.tensor(eps_eff, dtype=acc_dtype(dtype))
    assert (dx[~keep] == 0).all(), "a masked entry's gradient is exactly 0"
    assert (dx[clamped] == 0).all(), "a clamped entry's gradient is exactly 0"
    empty = ~keep.any(dim=1)
    assert (out[empty] == 0).all() and (dx[empty] == 0).all()
    _assert_grads(dx, want_dx, dtype, f"{layout}, p={p}, eps={eps}, x={v.tolist()}")
    if dp is not None:
        assert torch.isfinite(dp).all() and dp.dtype == torch.float32 and dp.shape == p.shape
        want = want_dps.sum()
        # The terms' scale: d gem / d p <= gem log(n) / p^2 per reduction.
        pv = float(p.reshape(()))
        n = v.shape[1]
        scale = float((g.abs() * ref.nan_to_num(0.0)).sum()) * math.log(n + 1) / pv ** 2
        big = torch.finfo(torch.float32).max
        if scale <= big / 4:
            torch.testing.assert_close(dp.double().reshape(()), want,
                                       rtol=P_GRAD_RTOL[dtype],
                                       atol=P_GRAD_RTOL[dtype] * scale + 1e-30)


@FEWER_EXAMPLES
@pytest.mark.parametrize("device", DEVICES)
@given(batch=extreme_batches(), p=_p_strategy(), layout=st.sampled_from(LAYOUTS),
       data=st.data())
def test_nan_stays_in_its_reduction(device, batch, p, layout, data):
    """A NaN entry makes its reduction's output and its kept entries' gradients
    NaN (and p's gradient); the other reductions get exactly what they get
    without it; a NaN under the mask reaches nothing."""
    dtype, v, mask = batch
    if v.shape[0] == 1:
        v = torch.cat([v, v.flip(1)])
        mask = None if mask is None else torch.cat([mask, mask.flip(1)])
    rows, n = v.shape
    keep = torch.ones_like(v, dtype=torch.bool) if mask is None else mask
    nan_rows = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows - 1,
                                  unique=True))
    dirty = v.clone()
    hit = []
    for r in nan_rows:
        j = data.draw(st.integers(0, n - 1))
        dirty[r, j] = NAN
        if keep[r, j]:
            hit.append(r)
    g = _incoming(rows)
    out_c, dx_c, dp_c = _run_gem(v, p, 1e-6, mask, layout, device, g)
    out_d, dx_d, dp_d = _run_gem(dirty, p, 1e-6, mask, layout, device, g)
    others = [r for r in range(rows) if r not in hit]
    assert torch.isnan(out_d[hit]).all()
    clamped = dirty.to(acc_dtype(dtype)) <= 1e-6  # (NaN <= eps is false: a NaN entry is not)
    for r in hit:
        live = keep[r] & ~clamped[r]
        # Its kept entries' gradients are NaN, but a clamped entry's is 0 (as
        # torch.clamp's) and a masked one's too.
        assert torch.isnan(dx_d[r][live]).all() and (dx_d[r][~live] == 0).all()
    torch.testing.assert_close(out_d[others], out_c[others], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dx_d[others], dx_c[others], rtol=0, atol=0)
    if dp_d is not None:
        if hit:
            assert torch.isnan(dp_d).all()
        else:
            torch.testing.assert_close(dp_d, dp_c, rtol=0, atol=0)


# --- the 2x-torch-error rule ----------------------------------------------------------


def _torch_gem(x, p, dim, eps):
    """torch's composition at x's dtype: a 0-d float32 p does not promote it."""
    return x.clamp(min=eps).pow(p).mean(dim=dim).pow(1 / p)


def _reference_gem(x, p, dim, eps):
    """The float64 reference of the 2x rule: the generalized mean in the log
    domain, exp((logsumexp(p log c) - log n) / p), c = max(x, eps), finite for
    every finite x and p (torch's float64 composition is not where eps^p
    underflows float64, e.g. eps = 1e-6, p = 64); differentiable in x and p."""
    u = p * torch.log(x.clamp(min=eps))
    dims = (dim,) if isinstance(dim, int) else dim
    n = math.prod(x.shape[d] for d in dims)
    return torch.exp((torch.logsumexp(u, dim=dims) - math.log(n)) / p)


def _run(fn_kind, x, p_value, dim, eps, g, device):
    """(output, d/dx, d/dp) in float64 on the CPU, of nanfree, torch's
    composition or the reference (float64 x), p a 0-d tensor (float32;
    float64 for float64 x) requiring grad."""
    leaf = x.detach().clone().to(device).requires_grad_(True)
    p_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    p = torch.tensor(p_value, dtype=p_dtype, device=device, requires_grad=True)
    if fn_kind == "nanfree":
        out = nf.gem(leaf, p, dim, eps)
    elif fn_kind == "reference":
        out = _reference_gem(leaf, p, dim, eps)
    else:
        out = _torch_gem(leaf, p, dim, eps)
    dx, dp = torch.autograd.grad(out, (leaf, p), g.reshape(out.shape).to(out.dtype).to(device))
    return out.detach().double().cpu(), dx.double().cpu(), dp.double().cpu()


def _error(got, ref):
    return (got - ref).abs().max().item() if ref.numel() else 0.0


def _floor(dtype, ref):
    """Two units of the dtype's rounding at the reference's largest magnitude (one
    rounding of the result, one of the accumulation), plus its smallest normal."""
    magnitude = ref.abs().max().item() if ref.numel() else 0.0
    return 2 * torch.finfo(dtype).eps * magnitude + torch.finfo(dtype).tiny


def _activations(kind, shape, gen):
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "abs normal":
        return z.abs()
    if kind == "relu":  # about half the entries clamped
        return z.clamp(min=0)
    return torch.exp(z)  # log-normal


def _layout_shape(layout, r, n):
    """(shape, dim) of an input holding about r reductions of n entries."""
    if layout == "rows":
        return (r, n), -1
    if layout == "image":
        h = max(1, int(math.sqrt(n)))
        return (2, r, h, max(1, n // h)), (2, 3)
    if layout == "tokens":
        return (2, n, r), 1
    return (n, r), 0


def _check_twice_torch(x, p_value, dim, eps, device, torch_scale=1, skip=()):
    """Asserts the 2x-torch-error rule for the output and both gradients (and
    that nanfree's are finite), unless torch_scale is 1 and torch's composition
    is not finite on x.
    torch's error is taken on x * torch_scale (a power of two: exact) with eps
    scaled alike, and scaled back: gem is homogeneous of degree 1 in (x, eps),
    its x-gradient of degree 0, its p-gradient of degree 1. Returns whether
    torch's own composition is finite on x as given."""
    dtype = x.dtype
    shape_out = torch.empty(x.shape).sum(dim=dim).shape
    g = _incoming(max(1, math.prod(shape_out)), positive=True).reshape(shape_out)
    ref_out, ref_dx, ref_dp = _run("reference", x.double(), p_value, dim, eps, g, device)
    assert torch.isfinite(ref_out).all() and torch.isfinite(ref_dx).all() and torch.isfinite(ref_dp)
    n_out, n_dx, n_dp = _run("nanfree", x, p_value, dim, eps, g, device)
    assert torch.isfinite(n_out).all() and torch.isfinite(n_dx).all() and torch.isfinite(n_dp)
    t_out, t_dx, t_dp = _run("torch", x, p_value, dim, eps, g, device)
    torch_finite = bool(torch.isfinite(t_out).all() and torch.isfinite(t_dx).all()
                        and torch.isfinite(t_dp))
    if torch_scale == 1 and not torch_finite:
        return False  # nothing to compare with
    if torch_scale != 1:
        s_out, s_dx, s_dp = _run("torch", x * torch_scale, p_value, dim, eps * torch_scale, g,
                                 device)
        assert torch.isfinite(s_out).all() and torch.isfinite(s_dx).all() \
            and torch.isfinite(s_dp), "the scaled input must be in torch's range"
        t_out, t_dx, t_dp = s_out / torch_scale, s_dx, s_dp / torch_scale
    for what, ours, theirs, ref, floor_dtype in (
            ("output", n_out, t_out, ref_out, dtype),
            ("grad x", n_dx, t_dx, ref_dx, dtype),
            # p's gradient is float32 for every input dtype but float64.
            ("grad p", n_dp, t_dp, ref_dp, torch.float64 if dtype == torch.float64
             else torch.float32)):
        if what in skip:
            continue
        n_err, t_err = _error(ours, ref), _error(theirs, ref)
        assert n_err <= 2 * t_err + _floor(floor_dtype, ref), \
            f"{what}: error {n_err} vs torch {t_err} (reference up to {ref.abs().max().item()})"
    return torch_finite


def _ordinary_scale(dtype, p):
    """Activations up to this size keep torch's composition in range (x^p below
    the dtype's largest value, with room for a sum of MAX 300 terms)."""
    return min(30.0, (torch.finfo(dtype).max / 1e3) ** (1 / p) / 4)


@pytest.mark.parametrize("device", DEVICES)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    p=st.sampled_from([0.5, 1.0, 3.0, 10.0, 64.0]),
    kind=st.sampled_from(["abs normal", "relu", "log-normal"]),
    layout=st.sampled_from(["rows", "columns", "tokens", "image"]),
    n=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    small=st.booleans(),
)
# Found by hypothesis: a strided reduction at p = 0.5 (the mean's rounding doubled).
@example(dtype=torch.float32, p=0.5, kind="relu", layout="columns", n=97, seed=49, small=False)
def test_error_at_most_twice_torch(device, dtype, p, kind, layout, n, seed, small):
    gen = torch.Generator().manual_seed(seed)
    shape, dim = _layout_shape(layout, 3, n)
    # Ordinary activations, or small ones (2^-6 times: fp16 powers in its
    # subnormal range, where torch's composition loses digits).
    scale = _ordinary_scale(dtype, p) * (2.0 ** -6 if small else 1.0)
    x = (_activations(kind, shape, gen) * scale).to(dtype)
    skip = ("grad x",) if (dtype, p) in _KNOWN_RATIO_ROUNDING else ()
    assume(_check_twice_torch(x, p, dim, 1e-6, device, skip=skip))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["rows", "columns", "tokens"])
@pytest.mark.parametrize("p", [0.5, 1.0])
def test_long_reductions_at_most_twice_torch(device, layout, p):
    """float32, reductions of hundreds of entries at small p, where the output
    carries the mean's rounding raised to 1/p: the sum of the ratio powers
    must be as accurate as torch's (a cascade, not a long running sum)."""
    for seed, n in ((0, 300), (1, 1000 if not INTERPRETED else 500)):
        gen = torch.Generator().manual_seed(20 + seed)
        shape, dim = _layout_shape(layout, 3, n)
        x = (_activations("abs normal", shape, gen) * 30).float()
        assert _check_twice_torch(x, p, dim, 1e-6, device)


# A known limit of the shared math (every backend): in float32 at p = 64 the
# input's gradient carries the rounding of the ratio r = c / m amplified by
# p - 1 (in r^(p-1), and through the mean of r^p in mean^(1/p - 1)): up to
# about (p - 1) / 2 ulp, where torch's composition, raising c itself, has a
# few. Correcting each power by the ratio's own rounding error (one fma:
# delta = fma(-r, m, c) / c, r^p (1 + p delta)) brings it within the rule.
_KNOWN_RATIO_ROUNDING = {(torch.float32, 64.0)}


@pytest.mark.xfail(strict=True, reason="float32, p = 64: the ratio's rounding amplified by p - 1 "
                                       "in the input's gradient (see _KNOWN_RATIO_ROUNDING)")
@pytest.mark.parametrize("device", DEVICES)
def test_grad_x_float32_p64_at_most_twice_torch(device):
    # Examples hypothesis found beyond the rule; the forward and p's gradient
    # are within it (checked by test_error_at_most_twice_torch).
    for kind, layout, n, seed in (("abs normal", "columns", 156, 156),
                                  ("abs normal", "rows", 49, 2), ("abs normal", "columns", 300, 4),
                                  ("log-normal", "tokens", 200, 5)):
        gen = torch.Generator().manual_seed(seed)
        shape, dim = _layout_shape(layout, 3, n)
        x = (_activations(kind, shape, gen) * _ordinary_scale(torch.float32, 64.0)).float()
        assert _check_twice_torch(x, 64.0, dim, 1e-6, device)


# Where torch's composition leaves its range: fp16 activations of 1e-4
# ((1e-4)^3 underflows to 0: torch gives 0 and an infinite gradient) and of
# 300 or 3e4 (300^3 overflows), fp32 activations of 1e4 with p = 10
# ((1e4)^10 = 1e40), fp32 and bf16 activations of 1e30 with p = 3 and of 1e-30
# with p = 10. torch's error is taken on the same values scaled into its range
# by a power of two; the activations spread over a factor 2^(2 spread), which
# the scaled composition holds (x^p within the dtype's range).
# name: (dtype, magnitude, p, spread, torch_scale)
OUT_OF_RANGE = {
    "fp16 1e-4 p=3": (torch.float16, 1e-4, 3.0, 2.0, 2.0 ** 14),
    "fp16 1e-4 p=10": (torch.float16, 1e-4, 10.0, 0.5, 2.0 ** 14),
    "fp16 300 p=3": (torch.float16, 300.0, 3.0, 2.0, 2.0 ** -8),
    "fp16 3e4 p=3": (torch.float16, 3e4, 3.0, 1.0, 2.0 ** -15),
    "fp16 256 p=64": (torch.float16, 256.0, 64.0, 0.1, 2.0 ** -8),
    "fp32 1e4 p=10": (torch.float32, 1e4, 10.0, 2.0, 2.0 ** -13),
    "fp32 1e4 p=64": (torch.float32, 1e4, 64.0, 1.0, 2.0 ** -13),
    "fp32 1e30 p=3": (torch.float32, 1e30, 3.0, 4.0, 2.0 ** -100),
    "fp32 1e-30 p=10": (torch.float32, 1e-30, 10.0, 2.0, 2.0 ** 100),
    "bf16 1e30 p=3": (torch.bfloat16, 1e30, 3.0, 4.0, 2.0 ** -100),
    "bf16 1e-30 p=10": (torch.bfloat16, 1e-30, 10.0, 2.0, 2.0 ** 100),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["tokens"] if INTERPRETED else ["rows", "tokens", "image"])
@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_error_at_most_twice_torch_out_of_torch_range(device, case, layout):
    dtype, magnitude, p, spread, torch_scale = OUT_OF_RANGE[case]
    gen = torch.Generator().manual_seed(12)
    shape, dim = _layout_shape(layout, 3, 49)
    exponents = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * spread
    x = (magnitude * torch.pow(2.0, exponents)).to(dtype)
    # eps below every activation (and still a normal number once scaled)
    eps = min(1e-6, magnitude / 1e3)
    # The known float32 p = 64 limit (_KNOWN_RATIO_ROUNDING) applies here too: on a
    # GPU, whose powf rounds differently, the fp32 1e4 p=64 case meets it.
    skip = ("grad x",) if (dtype, p) in _KNOWN_RATIO_ROUNDING else ()
    torch_finite = _check_twice_torch(x, p, dim, eps, device, torch_scale, skip=skip)
    assert not torch_finite, "this case is meant to leave torch's range"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("p", [0.5, 64.0] if INTERPRETED else [0.5, 1.0, 3.0, 10.0, 64.0])
def test_single_and_double_match_torch(device, dtype, p):
    """fp32/fp64: within assert_close's defaults of torch's composition, forward
    and gradients, on long reductions (several kernel blocks), as rows and as
    columns."""
    gen = torch.Generator().manual_seed(13)
    n = 300 if INTERPRETED else 2000
    base = (torch.rand(3, n, generator=gen, dtype=torch.float64) + 0.05).to(dtype)
    for x, dim in ((base, 1), (base.t().contiguous(), 0)):
        g = _incoming(3)
        n_out, n_dx, n_dp = _run("nanfree", x, p, dim, 1e-6, g, device)
        t_out, t_dx, t_dp = _run("torch", x, p, dim, 1e-6, g, device)
        tol = {} if dtype == torch.float64 else dict(rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(n_out, t_out, **tol)
        torch.testing.assert_close(n_dx, t_dx, **tol)
        torch.testing.assert_close(n_dp, t_dp, **(tol if p < 64 else dict(rtol=1e-5, atol=1e-5)))
