"""The Triton cosine-family launchers (nanfree._triton.cosine), called directly,
checked against the pure-PyTorch implementation (nanfree._torch_backend.cosine,
the same algorithm) and against float64 math written here from the DESIGN.md
section 2 rules.

They run where conftest.triton_kernel_device says; shapes are small (the
interpreter runs every program in numpy)."""

import math

import pytest
import torch

pytest.importorskip("triton")

from conftest import (DTYPES, INF, NAN, TRITON_KERNEL_TOL, triton_kernel_device,  # noqa: E402
                      triton_kernel_mode_matches, triton_refusal_words, triton_refused_devices)
from nanfree._backends import BackendUnavailableError  # noqa: E402
from nanfree._ops.cosine import COSINE_STATS, NORMALIZE_STATS  # noqa: E402
from nanfree._torch_backend import cosine as R  # noqa: E402
from nanfree._triton import cosine as K  # noqa: E402

DEVICE = triton_kernel_device(K)

# The interpreter evaluates both sides of tl.where (1/0, inf * 0) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = TRITON_KERNEL_TOL
NORMALIZE_EPS = 1e-12  # F.normalize's default
COSINE_EPS = 1e-8  # F.cosine_similarity's default
TINY_EPS = 1e-300  # below every dtype's smallest normal: raised to it (effective_eps)


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def on_device(*ts):
    return tuple(t.to(DEVICE) for t in ts)


def cpu(*ts):
    return tuple(t.cpu() for t in ts)


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def uniform(*shape, dtype=torch.float32, seed=1):
    """Incoming gradients in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.rand(shape, generator=gen, dtype=torch.float64) - 1).to(dtype)


# ---------------------------------------------------------------- float64 oracle


def oracle_vectors(x, eps):
    """Each vector (last dim, d >= 1) of x from the rules, in float64:
    (v, inv_scale, live, nan), with v = x / max(norm, eps) (the limit direction
    +-1/sqrt(k) on the k infinite entries of a vector holding +-inf), live
    whether the vector passes gradient (norm >= eps, finite), nan whether it
    holds NaN, and inv_scale the size of its gradients (1 / norm when live,
    else 1 / eps, 1 for infinite and NaN vectors). The norm is never formed:
    it may overflow float64 (two entries of finfo.max)."""
    xd = x.double()
    eps = max(eps, torch.finfo(acc_dtype(x.dtype)).tiny)
    nan = torch.isnan(xd).any(-1, keepdim=True)
    is_inf = torch.isinf(xd)
    inf = is_inf.any(-1, keepdim=True) & ~nan
    fin = torch.where(torch.isfinite(xd), xd, 0.0)
    m = fin.abs().amax(-1, keepdim=True)
    unit = fin / torch.where(m > 0, m, 1.0)
    root = unit.square().sum(-1, keepdim=True).sqrt()  # norm == m * root
    at_least = m * root >= eps  # an overflowing norm is +inf >= eps
    safe_root = torch.where(root > 0, root, 1.0)
    k = is_inf.sum(-1, keepdim=True).clamp(min=1).double()  # sqrt of an integer tensor is float32
    limit = torch.where(is_inf, torch.sign(xd), 0.0) / k.sqrt()
    v = torch.where(inf, limit, torch.where(at_least, unit / safe_root, fin / eps))
    live = at_least & ~inf & ~nan
    inv = torch.where(live, (1.0 / torch.where(m > 0, m, 1.0)) / safe_root, 1.0 / eps)
    inv = torch.where(inf | nan, 1.0, inv)
    return torch.where(nan, NAN, v), inv, live, nan


def oracle_normalize_grad(g, y_saved, inv, live, nan):
    """(g - y * sum(g * y)) / norm from the saved output y; 0 without gradient."""
    g, y = g.double(), y_saved.double()
    grad = (g - y * (g * y).sum(-1, keepdim=True)) * inv
    return torch.where(nan, NAN, torch.where(live, grad, 0.0))


def oracle_cosine(x1, x2, eps):
    """(c, v1, inv1, live1, v2, inv2, live2, nan) of each vector pair."""
    v1, inv1, live1, nan1 = oracle_vectors(x1, eps)
    v2, inv2, live2, nan2 = oracle_vectors(x2, eps)
    c = (v1 * v2).sum(-1, keepdim=True).clamp(-1, 1)
    return c, v1, inv1, live1, v2, inv2, live2, nan1 | nan2


def oracle_cosine_grads(g, c_saved, v1, inv1, live1, v2, inv2, live2, nan):
    """g * (v_other - c * v_self) / norm_self from the saved similarity c."""
    g, c = g.double().unsqueeze(-1), c_saved.double().unsqueeze(-1)
    d1 = torch.where(live1, g * (v2 - c * v1) * inv1, 0.0)
    d2 = torch.where(live2, g * (v1 - c * v2) * inv2, 0.0)
    return torch.where(nan, NAN, d1), torch.where(nan, NAN, d2)


def assert_scaled(got, want, dtype, scale=1.0, what=""):
    """assert_close of got / scale and want / scale (scale: the natural size of
    each row's values), at the tolerance of `dtype`; NaN where want is NaN."""
    rtol, atol = TOL[dtype]
    # Outputs that are subnormal in `dtype` (the tiny entries next to a vector's
    # finfo.max ones, gradients of size 1/norm) carry an absolute error of up to
    # half a subnormal step, whatever their scale: one step is allowed on top.
    step = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    got, want = got.double(), want.double()
    scale = torch.as_tensor(scale, dtype=torch.float64)
    tol = torch.where(torch.isfinite(scale), atol * scale, 0.0) + rtol * want.abs() + step
    same = (got == want) | (got.isnan() & want.isnan())
    bad = ~(same | ((got - want).abs() <= tol))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: got {got[bad][:4].tolist()}, want "
        f"{want[bad][:4].tolist()} (rtol {rtol}, atol {atol} x scale, + {step:.3g})")


def assert_stats(got, want, what):
    """Statistics against the reference's: powers of two p exactly, the factors
    up to the rounding of a sum of squares; NaN in the same places."""
    acc = got.dtype
    assert want.dtype == acc and got.shape == want.shape, what
    p_cols = [0] if got.shape[-1] == NORMALIZE_STATS else [0, COSINE_STATS // 2]  # each p
    for k in range(got.shape[-1]):
        exact = k in p_cols
        rtol = 0.0 if exact else (1e-12 if acc == torch.float64 else 1e-5)
        torch.testing.assert_close(got[..., k], want[..., k], rtol=rtol, atol=0.0,
                                   equal_nan=True, msg=lambda m: f"{what} stat {k}: {m}")


# ---------------------------------------------------------------- running and checking


def run_normalize(x, eps, g):
    """normalize and its backward on DEVICE -> (y, stats, grad) on the CPU; checks
    shapes, dtypes and devices, and the torch reference on the same inputs."""
    xd, gd = on_device(x, g)
    y, stats = K.normalize(xd, eps)
    grad = K.normalize_backward(gd, y, stats)
    acc = acc_dtype(x.dtype)
    assert y.device == xd.device and stats.device == xd.device and grad.device == xd.device
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert stats.shape == (*x.shape[:-1], 2) and stats.dtype == acc and stats.is_contiguous()
    assert grad.shape == x.shape and grad.dtype == x.dtype and grad.is_contiguous()
    y, stats, grad = cpu(y, stats, grad)
    r_y, r_stats = R.normalize(x, eps)
    assert_scaled(y, r_y, x.dtype, what="normalize vs torch backend")
    assert_stats(stats, r_stats, "normalize vs torch backend")
    # The backward on the kernel's own saved tensors, both ways.
    r_grad = R.normalize_backward(g, y, stats)
    _, inv, _, _ = oracle_vectors(x, eps) if x.shape[-1] else (None, 1.0, None, None)
    assert_scaled(grad, r_grad, x.dtype, scale=inv, what="normalize_backward vs torch backend")
    return y, stats, grad


def run_cosine(x1, x2, eps, g):
    """cosine_similarity and its backward on DEVICE -> (c, stats, d1, d2) on the
    CPU, checked as run_normalize."""
    a, b, gd = on_device(x1, x2, g)
    c, stats = K.cosine_similarity(a, b, eps)
    d1, d2 = K.cosine_similarity_backward(gd, a, b, c, stats)
    acc = acc_dtype(x1.dtype)
    assert c.shape == x1.shape[:-1] and c.dtype == x1.dtype and c.device == a.device
    assert stats.shape == (*x1.shape[:-1], COSINE_STATS) and stats.dtype == acc
    for d in (d1, d2):
        assert d.shape == x1.shape and d.dtype == x1.dtype and d.is_contiguous()
        assert d.device == a.device
    c, stats, d1, d2 = cpu(c, stats, d1, d2)
    r_c, r_stats = R.cosine_similarity(x1, x2, eps)
    assert_scaled(c, r_c, x1.dtype, what="cosine_similarity vs torch backend")
    assert_stats(stats, r_stats, "cosine_similarity vs torch backend")
    r_d1, r_d2 = R.cosine_similarity_backward(g, x1, x2, c, stats)
    if x1.shape[-1]:
        _, _, inv1, _, _, inv2, _, _ = oracle_cosine(x1, x2, eps)
    else:
        inv1 = inv2 = 1.0
    assert_scaled(d1, r_d1, x1.dtype, scale=inv1, what="grad x1 vs torch backend")
    assert_scaled(d2, r_d2, x1.dtype, scale=inv2, what="grad x2 vs torch backend")
    return c, stats, d1, d2


def check_normalize(x, eps=NORMALIZE_EPS):
    """run_normalize, then against the float64 rules; returns (y, stats, grad, live, nan)."""
    g = uniform(*x.shape, dtype=x.dtype)
    y, stats, grad = run_normalize(x, eps, g)
    v, inv, live, nan = oracle_vectors(x, eps)
    assert_scaled(y, v, x.dtype, what="normalize vs float64 rules")
    want = oracle_normalize_grad(g, y, inv, live, nan)
    assert_scaled(grad, want, x.dtype, scale=inv, what="normalize_backward vs float64 rules")
    # No gradient at all (exactly 0) for vectors below eps, zero and infinite ones.
    assert (grad.masked_select(~live & ~nan) == 0).all()
    return y, stats, grad, live.squeeze(-1), nan.squeeze(-1)


def check_cosine(x1, x2, eps=COSINE_EPS):
    """run_cosine, then against the float64 rules; returns (c, stats, d1, d2, live1,
    live2, nan)."""
    g = uniform(*x1.shape[:-1], dtype=x1.dtype, seed=2)
    c, stats, d1, d2 = run_cosine(x1, x2, eps, g)
    o_c, v1, inv1, live1, v2, inv2, live2, nan = oracle_cosine(x1, x2, eps)
    assert_scaled(c, o_c.squeeze(-1), x1.dtype, what="cosine_similarity vs float64 rules")
    w1, w2 = oracle_cosine_grads(g, c, v1, inv1, live1, v2, inv2, live2, nan)
    assert_scaled(d1, w1, x1.dtype, scale=inv1, what="grad x1 vs float64 rules")
    assert_scaled(d2, w2, x1.dtype, scale=inv2, what="grad x2 vs float64 rules")
    assert (d1.masked_select(~live1 & ~nan) == 0).all()
    assert (d2.masked_select(~live2 & ~nan) == 0).all()
    return c, stats, d1, d2, live1.squeeze(-1), live2.squeeze(-1), nan.squeeze(-1)


# ---------------------------------------------------------------- device and mode


def test_kernel_mode_and_device():
    assert triton_kernel_mode_matches(K, DEVICE)


@pytest.mark.parametrize("device", triton_refused_devices(DEVICE))
def test_refuses_tensors_the_kernels_cannot_run_on(device):
    # Refused before any launch, whatever the shape (never an error from inside Triton).
    words = triton_refusal_words(DEVICE)
    x = torch.zeros(3, 4, device=device)
    stats2 = torch.zeros(3, 2, device=device)
    cosine_stats = torch.zeros(3, COSINE_STATS, device=device)
    c = torch.zeros(3, device=device)
    calls = [
        lambda: K.normalize(x, 1e-12),
        lambda: K.normalize(x[:0], 1e-12),
        lambda: K.normalize_backward(x, x, stats2),
        lambda: K.cosine_similarity(x, x, 1e-8),
        lambda: K.cosine_similarity_backward(c, x, x, c, cosine_stats),
        lambda: K.cos_sim_matrix(x, x),
        lambda: K.cos_sim_matrix(x[:0], x),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError) as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)
    # The argument checks come first.
    with pytest.raises(TypeError, match="nanfree.normalize: `input` must be float16"):
        K.normalize(x.int(), 1e-12)


def test_argument_errors_are_the_ops():
    x = torch.ones(3, 4, device=DEVICE)
    with pytest.raises(TypeError, match="nanfree.normalize: `input` must be float16"):
        K.normalize(x.long(), 1e-12)
    with pytest.raises(ValueError, match="nanfree.normalize: `input` must have at least one"):
        K.normalize(x[0, 0], 1e-12)
    for eps in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="nanfree.normalize: `eps` must be positive"):
            K.normalize(x, eps)
    with pytest.raises(ValueError, match="nanfree.cosine_similarity: `eps` must be positive"):
        K.cosine_similarity(x, x, 0.0)
    with pytest.raises(ValueError, match="nanfree.cosine_similarity: `x2` has shape"):
        K.cosine_similarity(x, x[:, :2], 1e-8)
    with pytest.raises(TypeError, match="nanfree.cosine_similarity: `x2` dtype"):
        K.cosine_similarity(x, x.double(), 1e-8)
    y, stats = K.normalize(x, 1e-12)
    with pytest.raises(ValueError, match="nanfree.normalize_backward: `stats` must be"):
        K.normalize_backward(y, y, stats.double())
    with pytest.raises(ValueError, match="nanfree.normalize_backward: `grad_output` has shape"):
        K.normalize_backward(y[:, :2], y, stats)
    c, stats = K.cosine_similarity(x, x, 1e-8)
    with pytest.raises(ValueError, match="nanfree.cosine_similarity_backward: `output` must be"):
        K.cosine_similarity_backward(c[:2], x, x, c[:2], stats)
    with pytest.raises(ValueError, match="nanfree.cosine_similarity_backward: `stats` must be"):
        K.cosine_similarity_backward(c, x, x, c, stats[:, :2])
    with pytest.raises(ValueError, match=r"nanfree.cos_sim_matrix: `a` and `b` must be \[N, d\]"):
        K.cos_sim_matrix(x, x[:, :3])
    with pytest.raises(ValueError, match="nanfree.cos_sim_matrix"):
        K.cos_sim_matrix(x[0], x)
    with pytest.raises(TypeError, match="nanfree.cos_sim_matrix: `b` dtype"):
        K.cos_sim_matrix(x, x.half())
    with pytest.raises(TypeError, match="nanfree.cos_sim_matrix: `a` must be float16"):
        K.cos_sim_matrix(x.int(), x)


# ---------------------------------------------------------------- random rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 3, 37, 384])
def test_random_rows(dtype, d):
    rows = 3 if d == 384 else 5  # 5 rows: a partial block of 8 rows
    x = randn(rows, d, dtype=dtype)
    y, _, _, live, _ = check_normalize(x)
    assert live.all()
    # Unit vectors: |y| == 1 up to the output's rounding.
    norms = y.double().norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=3 * TOL[dtype][1])
    c, *_ = check_cosine(x, randn(rows, d, dtype=dtype, seed=7))
    assert (c.abs() <= 1).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_rows_looped(dtype, monkeypatch):
    # Rows longer than MAX_FUSED_D stream in blocks of LOOP_BLOCK columns: 100
    # columns are 7 blocks of 16, the last partial.
    monkeypatch.setattr(K, "MAX_FUSED_D", 32)
    monkeypatch.setattr(K, "LOOP_BLOCK", 16)
    assert K._row_config(3, 100) == (1, 16, False, 1)
    x = randn(3, 100, dtype=dtype, seed=4)
    check_normalize(x)
    check_cosine(x, randn(3, 100, dtype=dtype, seed=5))


def test_row_blocks(monkeypatch):
    # Short rows share a program: 37 rows of 3 in blocks of 16 rows, the last partial.
    monkeypatch.setattr(K, "ROW_TILE", 64)
    assert K._row_config(37, 3)[:3] == (16, 4, True)
    x = randn(37, 3, dtype=torch.float32, seed=8)
    x[17, 1] = NAN  # stays in its row, in the middle of a block
    _, _, grad, _, nan = check_normalize(x)
    assert nan.tolist() == [r == 17 for r in range(37)]
    assert grad[17].isnan().all() and not grad[nan.logical_not()].isnan().any()
    c, _, d1, d2, *_ = check_cosine(x, randn(37, 3, dtype=torch.float32, seed=9))
    assert c.isnan().tolist() == nan.tolist()


def test_many_row_blocks_default_policy():
    # 600 rows of 37 (blocks of 64 rows): several programs with the default policy.
    x = randn(600, 37, dtype=torch.float32, seed=10)
    check_normalize(x)
    check_cosine(x, randn(600, 37, dtype=torch.float32, seed=11))


# ---------------------------------------------------------------- special rows

# Magnitudes whose squares overflow / underflow the input dtype, or (bfloat16's
# 1e30 and 1e-30) even the float32 accumulation.
BIG = {torch.float16: 300.0, torch.bfloat16: 1e30, torch.float32: 1e20, torch.float64: 1e300}
SMALL = {torch.float16: 1e-4, torch.bfloat16: 1e-30, torch.float32: 1e-25,
         torch.float64: 1e-300}
ZERO, PLAIN, BIG_ROW, SMALL_ROW, SUBNORMAL, TWO_INF, ONE_INF, NAN_ROW, NAN_INF, MAX_ROW, \
    MIXED, ONES = range(12)
INF_ROWS = (TWO_INF, ONE_INF)
NAN_ROWS = (NAN_ROW, NAN_INF)


def special_rows(dtype, d, seed=5):
    """[12, d] vectors of special values in `dtype` (rows named above)."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.rand(d, generator=gen, dtype=torch.float64) + 0.5) * torch.where(
        torch.rand(d, generator=gen) > 0.5, 1.0, -1.0).double()  # |entries| in [0.5, 1.5)
    info = torch.finfo(dtype)
    x = randn(12, d, dtype=torch.float64, seed=seed)
    x[ZERO] = 0.0
    x[BIG_ROW] = BIG[dtype] * base
    x[SMALL_ROW] = SMALL[dtype] * base
    x[SUBNORMAL] = 0.5 * info.tiny * base              # subnormal entries
    x[TWO_INF, 0], x[TWO_INF, d - 1] = INF, -INF       # d == 1: one -inf
    x[ONE_INF, d // 2] = INF
    x[NAN_ROW, d // 2] = NAN
    x[NAN_INF, d - 1], x[NAN_INF, 0] = INF, NAN        # NaN wins over inf
    x[MAX_ROW, 0], x[MAX_ROW, d - 1] = info.max, -info.max
    x[MIXED] = SMALL[dtype] * base
    x[MIXED, 0] = BIG[dtype]                           # one big entry among tiny ones
    x[ONES] = 1.0
    return x.to(dtype)


def check_normalize_rules(x, y, stats, grad, nan):
    """The rules spelled out on the special rows (the oracle encodes the same)."""
    d = x.shape[-1]
    assert nan.tolist() == [r in NAN_ROWS for r in range(12)]
    assert (y[ZERO] == 0).all() and (grad[ZERO] == 0).all()
    assert stats[ZERO].tolist() == [1.0, 0.0]  # p of a zero vector is 1, no gradient
    for r in INF_ROWS:  # the limit direction; locally constant: no gradient
        is_inf = torch.isinf(x[r])
        k = int(is_inf.sum())
        want = torch.where(is_inf, torch.sign(x[r].double()) / math.sqrt(k), 0.0)
        assert_scaled(y[r], want, x.dtype)
        assert (y[r][~is_inf] == 0).all()
        assert (grad[r] == 0).all() and stats[r].tolist() == [0.0, 0.0]
    for r in NAN_ROWS:  # NaN is not laundered, and stays in its row
        assert y[r].isnan().all() and grad[r].isnan().all() and stats[r].isnan().all()
    clean = ~nan
    for t in (y, grad, stats):
        assert torch.isfinite(t[clean]).all()
    assert (y[clean].abs() <= 1).all()
    for r in (PLAIN, BIG_ROW, MAX_ROW, MIXED, ONES):  # above any eps: unit vectors
        assert abs(y[r].double().norm().item() - 1) <= 3 * TOL[x.dtype][1] * max(d, 1) ** 0.5
    assert_scaled(y[ONES], torch.full((d,), 1 / math.sqrt(d), dtype=torch.float64), x.dtype)


def check_cosine_rules(c, d1, d2, live1, live2, nan):
    clean = ~nan
    assert c.isnan().tolist() == nan.tolist()
    assert (c[clean].abs() <= 1).all()
    for t in (d1, d2):
        assert torch.isfinite(t[clean]).all()
        assert t[nan].isnan().all()
    # Vectors passing no gradient (zero, below eps, infinite) get exactly 0.
    assert (d1[clean & ~live1] == 0).all() and (d2[clean & ~live2] == 0).all()


@pytest.mark.parametrize("eps_kind", ["default", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 6, 384])
def test_special_rows(dtype, d, eps_kind):
    # eps "tiny" (1e-300, raised to the accumulation dtype's smallest normal)
    # puts the small and subnormal vectors above eps: their direction must then
    # survive squares that underflow.
    x = special_rows(dtype, d)
    n_eps = NORMALIZE_EPS if eps_kind == "default" else TINY_EPS
    c_eps = COSINE_EPS if eps_kind == "default" else TINY_EPS
    y, stats, grad, live, nan = check_normalize(x, n_eps)
    check_normalize_rules(x, y, stats, grad, nan)
    if eps_kind == "tiny":
        assert live[SMALL_ROW] and live[MIXED]
        if d == 384 and dtype != torch.float64:
            # 384 entries of 0.25 to 0.75 smallest normals: norm above it (in
            # float64, eps 1e-300 is a normal number far above these entries).
            assert live[SUBNORMAL]
    else:
        assert not live[ZERO] and live[PLAIN] and live[BIG_ROW]
    # Pairs: each row with the row 3 below it (zero with small, NaN with plain,
    # inf with big, ...), with itself (similarity 1) and with its negation (-1).
    for x2 in (x.roll(3, 0), x, -x):
        c, _, d1, d2, live1, live2, nan = check_cosine(x, x2, c_eps)
        check_cosine_rules(c, d1, d2, live1, live2, nan)
    assert c[ZERO] == 0 and abs(c[ONES].item() + 1) <= TOL[dtype][1]  # the last pair: x with -x
    for r in (PLAIN, BIG_ROW, MAX_ROW, MIXED):
        assert abs(c[r].item() + 1) <= TOL[dtype][1] and c[r] >= -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_special_rows_looped(dtype, monkeypatch):
    # The streamed path: 40 columns in blocks of 16, 16 and 8; the special
    # entries (inf in the first and last block, NaN, max) land in different blocks.
    monkeypatch.setattr(K, "MAX_FUSED_D", 16)
    monkeypatch.setattr(K, "LOOP_BLOCK", 16)
    x = special_rows(dtype, 40)
    for eps in (NORMALIZE_EPS, TINY_EPS):
        y, stats, grad, live, nan = check_normalize(x, eps)
        check_normalize_rules(x, y, stats, grad, nan)
    for x2 in (x.roll(5, 0), x):
        check_cosine_rules(*[t for i, t in enumerate(check_cosine(x, x2)) if i != 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_below_eps_rows(dtype):
    # Every vector has a norm below eps: x / eps, similarity (x1 . x2) / eps^2,
    # and no gradient at all (torch: 1e7-1e12 or NaN).
    x1 = randn(4, 5, dtype=dtype, seed=12)
    x2 = randn(4, 5, dtype=dtype, seed=13)
    eps = 100.0
    y, stats, grad, live, _ = check_normalize(x1, eps)
    assert not live.any() and (grad == 0).all() and (stats[:, 1] == 0).all()
    assert_scaled(y, x1.double() / eps, dtype)
    c, stats, d1, d2, live1, live2, _ = check_cosine(x1, x2, eps)
    assert (d1 == 0).all() and (d2 == 0).all()
    assert_scaled(c, (x1.double() * x2.double()).sum(-1) / eps ** 2, dtype)
    # One vector below eps, the other above: only the first passes no gradient.
    c, _, d1, d2, live1, live2, _ = check_cosine(x1 * 1e-3, x2 * 1e3, 1.0)
    assert not live1.any() and live2.all() and (d1 == 0).all() and (d2 != 0).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_length_one_vectors(dtype):
    # d == 1: the sign (or x / eps below eps); similarity +-1 or 0; gradient 0
    # (a unit vector of length 1 is locally constant).
    x = torch.tensor([[2.0], [-3.0], [0.0], [1e-20], [INF], [-INF], [NAN]]).to(dtype)
    y, stats, grad, live, nan = check_normalize(x)
    assert y[:3, 0].tolist() == [1.0, -1.0, 0.0] and y[4:6, 0].tolist() == [1.0, -1.0]
    assert (grad[~nan] == 0).all() and grad[6].isnan().all()
    c, _, d1, d2, *_ = check_cosine(x, torch.tensor([[5.0]] * 7).to(dtype))
    assert c[:3].tolist() == [1.0, -1.0, 0.0] and c[4:6].tolist() == [1.0, -1.0]
    assert c[6].isnan() and (d1[:6] == 0).all() and (d2[[0, 1, 2, 4, 5]] == 0).all()
    # Row 3 (1e-20 against 5): the exact gradient for x2 is 0, computed from the
    # saved similarity rounded to the dtype: within a rounding of 1e-12 / 5.
    assert d2[3].abs() <= 1e-12 / 5 * TOL[dtype][0]


# ---------------------------------------------------------------- shapes


def test_empty_shapes():
    e = lambda *shape: torch.empty(shape, device=DEVICE)  # noqa: E731
    # No vectors.
    y, stats = K.normalize(e(0, 5), 1e-12)
    assert y.shape == (0, 5) and stats.shape == (0, 2)
    assert K.normalize_backward(e(0, 5), y, stats).shape == (0, 5)
    c, stats = K.cosine_similarity(e(2, 0, 3), e(2, 0, 3), 1e-8)
    assert c.shape == (2, 0) and stats.shape == (2, 0, COSINE_STATS)
    d1, d2 = K.cosine_similarity_backward(e(2, 0), e(2, 0, 3), e(2, 0, 3), c, stats)
    assert d1.shape == d2.shape == (2, 0, 3)
    # Empty vectors (d == 0) are zero vectors: normalize to nothing with stats
    # (p 1, no gradient); similarity 0.
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = e(3, 0).to(dtype)
        y, stats = K.normalize(x, 1e-12)
        r_y, r_stats = R.normalize(x.cpu(), 1e-12)
        assert y.shape == (3, 0) and stats.cpu().tolist() == [[1.0, 0.0]] * 3
        assert torch.equal(stats.cpu(), r_stats)
        assert K.normalize_backward(y, y, stats).shape == (3, 0)
        c, stats = K.cosine_similarity(x, x, 1e-8)
        r_c, r_stats = R.cosine_similarity(x.cpu(), x.cpu(), 1e-8)
        assert c.dtype == dtype and c.cpu().tolist() == [0.0] * 3
        assert torch.equal(stats.cpu(), r_stats) and torch.equal(c.cpu(), r_c)
        d1, d2 = K.cosine_similarity_backward(c, x, x, c, stats)
        assert d1.shape == d2.shape == (3, 0)
    # cos_sim_matrix: no rows, and rows of d == 0 (all similarities 0).
    assert K.cos_sim_matrix(e(0, 4), e(3, 4)).shape == (0, 3)
    assert K.cos_sim_matrix(e(3, 4), e(0, 4)).shape == (3, 0)
    out = K.cos_sim_matrix(e(3, 0), e(2, 0))
    assert out.shape == (3, 2) and (out == 0).all()


def test_vector_and_batched_shapes():
    # A 1-D input is one vector (stats [2] / [6], a 0-d similarity); 3-D inputs
    # keep their leading dims.
    x = randn(7, seed=14)
    y, stats = K.normalize(x.to(DEVICE), 1e-12)
    assert y.shape == (7,) and stats.shape == (2,)
    c, stats = K.cosine_similarity(x.to(DEVICE), x.to(DEVICE), 1e-8)
    assert c.shape == () and stats.shape == (COSINE_STATS,) and c.item() == pytest.approx(1.0)
    check_normalize(randn(2, 3, 9, seed=15))
    check_cosine(randn(2, 3, 9, seed=16), randn(2, 3, 9, seed=17))


def test_noncontiguous_inputs():
    x = randn(9, 4, seed=18).t()  # [4, 9], strided
    x2 = randn(9, 4, seed=19).t()
    y, stats = K.normalize(x.to(DEVICE), 1e-12)
    y_c, stats_c = K.normalize(x.contiguous().to(DEVICE), 1e-12)
    assert torch.equal(y, y_c) and torch.equal(stats, stats_c)
    g = randn(4, 9, seed=20)
    gd = g.to(DEVICE)
    assert torch.equal(K.normalize_backward(gd.t().contiguous().t(), y, stats),
                       K.normalize_backward(gd, y_c, stats_c))
    check_cosine(x, x2)


# ---------------------------------------------------------------- cos_sim_matrix


def unit_rows(n, d, dtype, seed):
    return torch.nn.functional.normalize(randn(n, d, dtype=torch.float64, seed=seed),
                                         dim=-1).to(dtype)


def check_matrix(a, b):
    out = K.cos_sim_matrix(*on_device(a, b)).cpu()
    assert out.shape == (a.shape[0], b.shape[0]) and out.dtype == a.dtype
    assert out.is_contiguous()
    want = (a.double() @ b.double().T).clamp(-1, 1)
    assert_scaled(out, want, a.dtype, what="cos_sim_matrix vs float64")
    assert_scaled(out, R.cos_sim_matrix(a, b), a.dtype, what="cos_sim_matrix vs torch backend")
    assert (out.abs() <= 1).all()
    return out


@pytest.fixture
def small_gemm_tiles(monkeypatch):
    """Output tiles of 16 x 16 over d in steps of 16, groups of 2 tile rows:
    the shapes below end partly outside tiles, steps and groups."""
    monkeypatch.setattr(K, "GEMM_BLOCK_N", 16)
    monkeypatch.setattr(K, "GEMM_BLOCK_M", 16)
    monkeypatch.setattr(K, "GEMM_BLOCK_K", 16)
    monkeypatch.setattr(K, "GEMM_GROUP_N", 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 21, 45), (1, 1, 1), (16, 48, 16), (50, 3, 17)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cos_sim_matrix_tiles(dtype, shape, small_gemm_tiles):
    n, m, d = shape
    check_matrix(unit_rows(n, d, dtype, 21), unit_rows(m, d, dtype, 22))


def test_cos_sim_matrix_default_tiles():
    check_matrix(unit_rows(70, 40, torch.float32, 23), unit_rows(130, 40, torch.float32, 24))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cos_sim_matrix_clamps(dtype, small_gemm_tiles):
    # Unit rows rounded to the dtype: some self-similarities round past 1 (and
    # -1 against the negated rows); acos of the result stays finite.
    a = unit_rows(24, 37, dtype, 25)
    exact = (a.double() ** 2).sum(-1)
    a[0] = 0.0
    a[0, 0] = 1 + torch.finfo(dtype).eps  # a unit vector rounded up by one ulp
    exact[0] = a[0, 0].double() ** 2
    assert (exact > 1).any()
    out = check_matrix(a, a)
    neg = check_matrix(a, -a)
    # Whether a sum of squares a little past 1 rounds past 1 depends on the
    # order and the FMAs of the GEMM (the GPU's differ from the interpreter's);
    # the clamp must hold wherever it does, and does at the one-ulp row.
    past = exact > 1
    assert (out.diagonal()[past] <= 1).all() and (neg.diagonal()[past] >= -1).all()
    assert (out.diagonal()[past] >= 1 - 4 * torch.finfo(dtype).eps).all()
    assert out[0, 0] == 1 and neg[0, 0] == -1
    assert torch.isfinite(torch.acos(out.double())).all()


def test_cos_sim_matrix_nan_rows_stay_in_their_row(small_gemm_tiles):
    a = unit_rows(20, 20, torch.float32, 26)
    b = unit_rows(18, 20, torch.float32, 27)
    a[3, 5] = NAN
    b[17, 0] = NAN
    out = K.cos_sim_matrix(*on_device(a, b)).cpu()
    nan = torch.zeros(20, 18, dtype=torch.bool)
    nan[3, :] = True
    nan[:, 17] = True
    assert torch.equal(out.isnan(), nan)
    assert (out[~nan].abs() <= 1).all()


def test_cos_sim_matrix_strided_operands(small_gemm_tiles):
    # b read through its strides (b.T of a contiguous [d, M]; a every other column).
    base = unit_rows(21, 2 * 19, torch.float32, 28)
    a = base[:, ::2]
    b = unit_rows(25, 19, torch.float32, 29).T.contiguous().T  # [25, 19], column-major
    assert not a.is_contiguous() and not b.is_contiguous()
    a2 = unit_rows(25, 19, torch.float32, 30)
    out = check_matrix(a2, b)
    assert torch.equal(out, K.cos_sim_matrix(*on_device(a2, b.contiguous())).cpu())
    out = check_matrix(a, unit_rows(7, 19, torch.float32, 31))
    assert out.shape == (21, 7)
