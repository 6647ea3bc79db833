"""The special-value table of DESIGN.md section 2 (cosine) for normalize,
cosine_similarity and cos_sim, forward and backward, against a float64 oracle
written from the rules, on the backend this session selects."""

import math

import pytest
import torch
from conftest import DTYPES, INF, INTERPRETED, NAN
from cosine_oracle import cosine, cosine_grads, normalize, normalize_grad

import nanfree.ops as nf

D = 6  # entries per vector of the short cases
LONG = 1000  # entries per vector of the long cases (special values late in the row)


def _plain(d, shift=0.0):
    return [math.sin(0.7 * i + shift) + 0.25 for i in range(d)]


def _cases(dtype):
    """name: (a, b, eps): vectors as the dtype holds them (Python floats)."""
    info = torch.finfo(dtype)
    # Entries whose squares overflow (fp16: 300^2 > 65504) and entries whose
    # squares underflow, near the dtype's limits.
    huge = {torch.float16: 300.0, torch.bfloat16: 1e30, torch.float32: 1e20,
            torch.float64: 1e300}[dtype]
    biggest = info.max / 2
    small = {torch.float16: 1e-4, torch.bfloat16: 1e-25, torch.float32: 1e-25,
             torch.float64: 1e-300}[dtype]
    sub = info.tiny / 4  # subnormal
    p = _plain(D)
    cases = {
        "plain": (p, _plain(D, 1.0), 1e-8),
        "identical (rounds past 1)": (p, p, 1e-8),
        "opposite": (p, [-v for v in p], 1e-8),
        "zero and plain": ([0.0] * D, p, 1e-8),
        "two zeros": ([0.0] * D, [0.0] * D, 1e-8),
        "signed zeros": ([-0.0] * D, [0.0] * D, 1e-8),
        "squares overflow": ([huge * v for v in p], [huge * v for v in _plain(D, 1.0)], 1e-8),
        "max entries": ([biggest * v for v in p], [biggest] * D, 1e-8),
        "squares underflow, eps below": ([small * v for v in p], [small * v for v in _plain(D, 1.0)],
                                         info.tiny),
        "squares underflow, default eps": ([small * v for v in p], p, 1e-8),
        "subnormals": ([sub] * D, [sub, -sub] * (D // 2), info.tiny),
        "below eps": ([1e-3 * v for v in p], p, 1.0),
        "one +inf": ([INF] + p[1:], p, 1e-8),
        "+inf and -inf": ([INF, 1.0, -INF, 2.0, 0.0, 3.0], [INF, 0.0, INF, 0.0, 0.0, 0.0], 1e-8),
        "NaN": ([NAN] + p[1:], p, 1e-8),
        "NaN and +inf": ([NAN, INF] + p[2:], p, 1e-8),
        "length 1": ([3.0], [-2.0], 1e-8),
        "length 1 zero": ([0.0], [5.0], 1e-8),
        "empty vectors": ([], [], 1e-8),
    }
    long_plain = _plain(LONG)
    late = list(long_plain)
    late[900] = INF
    nan_late = list(long_plain)
    nan_late[950] = NAN
    cases.update({
        "long plain": (long_plain, _plain(LONG, 2.0), 1e-8),
        "long +inf late": (late, long_plain, 1e-8),
        "long NaN late": (nan_late, long_plain, 1e-8),
        "long squares overflow": ([huge * v for v in long_plain], long_plain, 1e-8),
    })
    return cases


CASE_NAMES = list(_cases(torch.float32))

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _batch(case, dtype, device):
    """The case's pair as the first row of [2, d] tensors, a plain pair below it
    (which the case must not disturb), and the rows as the dtype holds them."""
    a, b, eps = _cases(dtype)[case]
    d = len(a)
    pa, pb = _plain(d, 0.5), _plain(d, 3.0)
    xa = torch.tensor([a, pa], dtype=torch.float64).reshape(2, d).to(dtype)
    xb = torch.tensor([b, pb], dtype=torch.float64).reshape(2, d).to(dtype)
    rows_a, rows_b = xa.double().tolist(), xb.double().tolist()
    return xa.to(device), xb.to(device), eps, rows_a, rows_b


def _has_nan(values):
    return any(math.isnan(v) for v in values)


def _inverse_norm(values, eps):
    """1 / norm of a finite vector at least eps long, else 1 (the gradients' scale)."""
    m = max((abs(v) for v in values), default=0.0)
    if not values or not math.isfinite(m) or m == 0:
        return 1.0
    norm_over_m = math.hypot(*(v / m for v in values))
    return 1.0 / (m * norm_over_m) if m * norm_over_m >= eps else 1.0


def _grad_tol(dtype, scale):
    tol = dict(TOL[dtype])
    if dtype in (torch.float16, torch.bfloat16):
        tol = dict(rtol=3e-2, atol=3e-2)
    tol["atol"] *= max(1.0, scale)
    return tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_normalize_table(case, dtype, device):
    xa, _, eps, rows_a, _ = _batch(case, dtype, device)
    x = xa.clone().requires_grad_(True)
    y = nf.normalize(x, dim=1, eps=eps)
    expected = torch.tensor([normalize(r, eps) for r in rows_a], dtype=torch.float64)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.cpu().double(), expected.reshape(y.shape).to(dtype).double(),
                               equal_nan=True, **TOL[dtype])
    grad = torch.tensor([_plain(x.shape[1], 5.0)] * 2, dtype=torch.float64).reshape(x.shape)
    (dx,) = torch.autograd.grad(y, x, grad.to(dtype).to(device))
    for r, values in enumerate(rows_a):
        want = normalize_grad(values, eps, grad[r].tolist())
        if _has_nan(values):
            assert torch.isnan(dx[r]).all(), "a NaN vector's gradient is NaN"
            continue
        assert torch.isfinite(dx[r]).all(), f"non-finite gradient in {case}: {dx[r]}"
        # The gradient is 1/norm times a bounded vector: tolerances scale with it.
        scale = _inverse_norm(values, eps)
        torch.testing.assert_close(dx[r].cpu().double(), torch.tensor(want, dtype=torch.float64),
                                   **_grad_tol(dtype, scale))
    if not _has_nan(rows_a[0]):
        assert not torch.isnan(y).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_cosine_similarity_table(case, dtype, device):
    xa, xb, eps, rows_a, rows_b = _batch(case, dtype, device)
    a = xa.clone().requires_grad_(True)
    b = xb.clone().requires_grad_(True)
    c = nf.cosine_similarity(a, b, dim=1, eps=eps)
    expected = torch.tensor([cosine(ra, rb, eps) for ra, rb in zip(rows_a, rows_b)],
                            dtype=torch.float64)
    assert c.dtype == dtype and c.shape == (2,)
    torch.testing.assert_close(c.cpu().double(), expected.to(dtype).double(), equal_nan=True,
                               **TOL[dtype])
    finite = c[~torch.isnan(c)]
    assert ((finite >= -1) & (finite <= 1)).all(), "similarities stay in [-1, 1]"
    assert torch.isfinite(torch.acos(finite.double())).all()
    grad = torch.tensor([1.5, -0.5], dtype=dtype, device=device)
    da, db = torch.autograd.grad(c, (a, b), grad)
    for r, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        want_a, want_b = cosine_grads(ra, rb, eps, grad[r].item())
        if _has_nan(ra) or _has_nan(rb):
            assert torch.isnan(da[r]).all() and torch.isnan(db[r]).all()
            continue
        for got, want, x in ((da[r], want_a, ra), (db[r], want_b, rb)):
            assert torch.isfinite(got).all(), f"non-finite gradient in {case}: {got}"
            scale = _inverse_norm(x, eps)
            torch.testing.assert_close(got.cpu().double(), torch.tensor(want, dtype=torch.float64),
                                       **_grad_tol(dtype, scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "identical (rounds past 1)", "zero and plain",
                                  "squares overflow", "one +inf", "NaN", "length 1",
                                  "long plain", "long NaN late"])
def test_cos_sim_table(case, dtype, device):
    """cos_sim of the rows [case, plain] against [case', plain']: each entry is
    the similarity of one pair, with F.normalize's eps; NaN stays in its row and column."""
    xa, xb, _, rows_a, rows_b = _batch(case, dtype, device)
    s = nf.cos_sim(xa, xb)
    eps = 1e-12
    expected = torch.tensor([[cosine(ra, rb, eps) for rb in rows_b] for ra in rows_a],
                            dtype=torch.float64)
    assert s.dtype == dtype and s.shape == (2, 2)
    torch.testing.assert_close(s.cpu().double(), expected.to(dtype).double(), equal_nan=True,
                               **TOL[dtype])
    assert not torch.isnan(s[1, 1]), "a NaN row reaches its own row and column only"


def test_identical_vectors_give_exactly_one(device):
    v = torch.randn(64, 384, device=device)
    assert (nf.cosine_similarity(v, v) <= 1).all()
    assert torch.isfinite(torch.acos(nf.cos_sim(v, v))).all()
    assert torch.isfinite(torch.acos(nf.cosine_similarity(v, v))).all()


def test_broadcasting_as_torch(device):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 1, 5, generator=gen).to(device)
    b = torch.randn(1, 3, 5, generator=gen).to(device)
    torch.testing.assert_close(nf.cosine_similarity(a, b, dim=-1),
                               torch.nn.functional.cosine_similarity(a, b, dim=-1))
    x = torch.randn(5, generator=gen).to(device)
    m = torch.randn(3, 5, generator=gen).to(device)
    torch.testing.assert_close(nf.cosine_similarity(x, m, dim=-1),
                               torch.nn.functional.cosine_similarity(x, m, dim=-1))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_other_dims_and_non_contiguous(dim, device):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64).to(device).transpose(0, 2)
    b = torch.randn(5, 4, 3, generator=gen, dtype=torch.float64).to(device)
    assert not a.is_contiguous()
    F = torch.nn.functional
    torch.testing.assert_close(nf.cosine_similarity(a, b, dim=dim), F.cosine_similarity(a, b, dim=dim))
    torch.testing.assert_close(nf.normalize(a, dim=dim), F.normalize(a, dim=dim))


@pytest.mark.parametrize("dim", [(1, 2), [0, 2], (0, 1, 2), (), (2, -3), (-1,)])
@pytest.mark.parametrize("p", [2.0, "fro", 3.0])
def test_normalize_over_several_dims(dim, p, device):
    """A tuple of dims normalizes the vectors of all their entries, as F.normalize
    (an empty tuple: every dim); the rules hold for such a vector."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64).to(device)
    F = torch.nn.functional
    # torch's 'fro' takes at most two dims; it is the 2-norm there.
    p_torch = 2.0 if p == "fro" else p
    for t in (x, x.transpose(0, 2)):
        torch.testing.assert_close(nf.normalize(t, p, dim), F.normalize(t, p_torch, dim))
    # A zero vector over (1, 2) is 0 with gradient 0; an infinite entry gives the
    # limit direction; a NaN stays in its own vector.
    x[0] = 0.0
    x[1, 2, 3] = INF
    x[2, 0, 0] = NAN
    leaf = x.clone().requires_grad_(True)
    y = nf.normalize(leaf, p, (1, 2))
    (g,) = torch.autograd.grad((y * torch.arange(60.0, dtype=y.dtype, device=device).view(3, 4, 5)).sum(), leaf)
    expected_inf = torch.zeros(4, 5, dtype=torch.float64)
    expected_inf[2, 3] = 1.0
    torch.testing.assert_close(y[0].cpu(), torch.zeros(4, 5, dtype=torch.float64))
    torch.testing.assert_close(y[1].cpu(), expected_inf)
    assert y[2].isnan().all()
    assert (g[:2] == 0).all() and g[2].isnan().all()


def test_empty_batches(device):
    assert nf.cosine_similarity(torch.empty(0, 4, device=device),
                                torch.empty(0, 4, device=device)).shape == (0,)
    assert nf.normalize(torch.empty(0, 4, device=device)).shape == (0, 4)
    assert nf.cos_sim(torch.empty(0, 4, device=device), torch.randn(3, 4, device=device)).shape == (0, 3)
    x = torch.empty(2, 0, device=device, requires_grad=True)
    c = nf.cosine_similarity(x, x)
    assert c.shape == (2,) and (c == 0).all()
    c.sum().backward()
    assert x.grad.shape == (2, 0)


@pytest.mark.parametrize("p", [1.0, 3.0, math.inf])
def test_normalize_other_p(p, device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64).to(device)
    torch.testing.assert_close(nf.normalize(x, p=p), torch.nn.functional.normalize(x, p=p))
    # Huge entries: torch's p-norm of 1e300s overflows; this one does not.
    big = (x * 1e300).requires_grad_(True)
    y = nf.normalize(big, p=p)
    torch.testing.assert_close(y, torch.nn.functional.normalize(x, p=p))
    zero = torch.zeros(2, 3, dtype=torch.float64, device=device, requires_grad=True)
    out = nf.normalize(zero, p=p)
    (g,) = torch.autograd.grad(out.sum(), zero)
    assert (out == 0).all() and (g == 0).all()
    inf_row = torch.tensor([[math.inf, 1.0, -math.inf]], dtype=torch.float64, device=device)
    expected = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)
    expected = expected if p == math.inf else expected / 2 ** (1 / p)
    torch.testing.assert_close(nf.normalize(inf_row, p=p).cpu(), expected)


def test_normalize_out(device):
    x = torch.randn(3, 4, device=device)
    out = torch.empty_like(x)
    assert nf.normalize(x, out=out) is out
    torch.testing.assert_close(out, torch.nn.functional.normalize(x))
    # As torch's: out= takes no argument that requires grad.
    for p in (2.0, 3.0):
        with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
            torch.nn.functional.normalize(x.requires_grad_(), p=p, out=out)
        with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
            nf.normalize(x, p=p, out=out)


def test_module(device):
    module = __import__("nanfree.nn", fromlist=["CosineSimilarity"]).CosineSimilarity(dim=0, eps=1e-6)
    a, b = torch.randn(5, 2, device=device), torch.randn(5, 2, device=device)
    torch.testing.assert_close(module(a, b), torch.nn.CosineSimilarity(dim=0, eps=1e-6)(a, b))
    assert "dim=0" in repr(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_long_vectors_match_float64(dtype, device):
    # 20000 entries: past what a CUDA thread group caches in registers, so the
    # normalize and cosine kernels stream each vector twice. (One vector
    # under Triton's interpreter, which takes seconds per vector.)
    gen = torch.Generator().manual_seed(5)
    rows = 1 if INTERPRETED else 5  # more than the grid-capped emulated build's 3 blocks
    a = torch.randn(rows, 20000, generator=gen, dtype=dtype)
    b = torch.randn(rows, 20000, generator=gen, dtype=dtype)
    grad_n = torch.randn(rows, 20000, generator=gen, dtype=dtype)
    grad_c = torch.randn(rows, generator=gen, dtype=dtype)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else {}
    ad, bd = a.detach().to(device).requires_grad_(True), b.detach().to(device).requires_grad_(True)
    n = nf.normalize(ad, dim=1)
    (dn,) = torch.autograd.grad(n, ad, grad_n.to(device))
    c = nf.cosine_similarity(ad, bd, dim=1)
    dca, dcb = torch.autograd.grad(c, (ad, bd), grad_c.to(device))
    ra, rb = a.double().requires_grad_(True), b.double().requires_grad_(True)
    rn = torch.nn.functional.normalize(ra, dim=1)
    (rdn,) = torch.autograd.grad(rn, ra, grad_n.double())
    rc = torch.nn.functional.cosine_similarity(ra, rb, dim=1)
    rdca, rdcb = torch.autograd.grad(rc, (ra, rb), grad_c.double())
    for ours, ref in ((n, rn), (dn, rdn), (c, rc), (dca, rdca), (dcb, rdcb)):
        torch.testing.assert_close(ours.detach().cpu().double(), ref.detach(), **tol)


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_vectors_at_every_alignment(offset, dtype, device):
    # Contiguous views `offset` elements into their storage: 64 entries per
    # vector make whole 16-byte vectors, but only offset 0 is 16-byte aligned.
    # The result is that of an aligned copy (up to the summation order of
    # another launch plan).
    gen = torch.Generator().manual_seed(offset)
    rows, d = 5, 64

    def view():
        storage = torch.randn(rows * d + 8, generator=gen, dtype=dtype).to(device)
        return storage[offset:offset + rows * d].view(rows, d)

    a, b, g_n = view(), view(), view()
    g_c = torch.randn(rows, generator=gen, dtype=dtype).to(device)
    results = []
    for x1, x2, gn in ((a, b, g_n), (a.clone(), b.clone(), g_n.clone())):
        x1 = x1.detach().requires_grad_(True)
        x2 = x2.detach().requires_grad_(True)
        n = nf.normalize(x1, dim=1)
        c = nf.cosine_similarity(x1, x2, dim=1)
        s = nf.cos_sim(x1, x2)
        grads = torch.autograd.grad((n * gn).sum() + (c * g_c).sum() + s.sum(), (x1, x2))
        results.append((n, c, s, *grads))
    for ours, aligned in zip(*results):
        torch.testing.assert_close(ours, aligned)


MANY_ROWS = 4160  # past the 4096 rows from which the CUDA build gives each row one warp
MANY_D = 264  # 33 16-byte vectors of bfloat16 (more than a warp's 32 lanes), 66 of float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_among_many_rows(dtype, device):
    """Every case of the table, its vectors repeated to MANY_D entries, as the
    rows of one large batch (row r holds case r % cases): each row gets the
    oracle's value, the same bits as every other row of its case, and, for
    the first row of each case, the oracle's gradients."""
    cases = [(a, b, eps) for a, b, eps in _cases(dtype).values() if a]
    rows = len(cases) * 3 if INTERPRETED else MANY_ROWS  # the interpreter takes long per row

    def long(v):
        return (v * (MANY_D // len(v) + 1))[:MANY_D]

    eps = 1e-8  # one eps for the batch: the cases' own eps rules are the table's
    a_rows = [long(cases[r % len(cases)][0]) for r in range(rows)]
    b_rows = [long(cases[r % len(cases)][1]) for r in range(rows)]
    xa = torch.tensor(a_rows, dtype=torch.float64).to(dtype)
    xb = torch.tensor(b_rows, dtype=torch.float64).to(dtype)
    held_a, held_b = xa[: len(cases)].double().tolist(), xb[: len(cases)].double().tolist()
    a = xa.to(device).requires_grad_(True)
    b = xb.to(device).requires_grad_(True)
    c = nf.cosine_similarity(a, b, dim=1, eps=eps)
    n = nf.normalize(a, dim=1, eps=eps)
    index = torch.arange(rows) % len(cases)
    # Same case, same bits (NaN included), wherever the row sits in the batch.
    for out in (c.detach().cpu(), n.detach().cpu()):
        first = out[index]
        assert torch.equal(out.isnan(), first.isnan())
        assert torch.equal(out.nan_to_num(), first.nan_to_num())
    want_c = torch.tensor([cosine(ra, rb, eps) for ra, rb in zip(held_a, held_b)],
                          dtype=torch.float64)
    torch.testing.assert_close(c.detach().cpu().double()[: len(cases)], want_c.to(dtype).double(),
                               equal_nan=True, **TOL[dtype])
    want_n = torch.tensor([normalize(ra, eps) for ra in held_a], dtype=torch.float64)
    torch.testing.assert_close(n.detach().cpu().double()[: len(cases)], want_n.to(dtype).double(),
                               equal_nan=True, **TOL[dtype])
    g_c = torch.full((rows,), 0.75, dtype=dtype, device=device)
    (da,) = torch.autograd.grad(c, a, g_c)
    for r, (ra, rb) in enumerate(zip(held_a, held_b)):
        want_a, _ = cosine_grads(ra, rb, eps, 0.75)
        if _has_nan(ra) or _has_nan(rb):
            assert torch.isnan(da[r]).all()
            continue
        assert torch.isfinite(da[r]).all()
        torch.testing.assert_close(da[r].cpu().double(), torch.tensor(want_a, dtype=torch.float64),
                                   **_grad_tol(dtype, _inverse_norm(ra, eps)))
