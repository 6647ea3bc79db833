"""The Triton MNR launchers (nanfree._triton.mnr), called directly, checked
against the pure-PyTorch implementation (nanfree._torch_backend.mnr: the same
rules of csrc/include/nanfree/mnr_math.h, mirrored in torch): the cores on
normalized rows (loss, stats, the gradients of the rows and of the scale), for
every direction set, partition mode, hardness mode and reduction, with and
without hard negatives and shared candidates, a rank's slice (offset > 0),
B = 1, zero and duplicated rows, scale 1e4 and every dtype, on one tile and on
many (shrunken blocks, sizes that are no multiple of them, column splits);
the ops on raw embeddings (normalized around the cores); and the mirrored
header functions one by one against the reference's.

They run where conftest.triton_kernel_device says; shapes are small (the
interpreter runs every program in numpy)."""

import itertools

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import (DTYPES, INF, NAN, triton_kernel_device, triton_kernel_mode_matches,
                      triton_refusal_words, triton_refused_devices)  # noqa: E402
from nanfree._backends import BackendUnavailableError  # noqa: E402
from nanfree._torch_backend import mnr as R  # noqa: E402
from nanfree._triton import mnr as K  # noqa: E402

DEVICE = triton_kernel_device(K)

# The interpreter evaluates both sides of tl.where (log 0, inf - inf) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

Q2D, Q2Q, D2Q, D2D = 1, 2, 4, 8
# (directions, per_direction): every direction set with the joint partition,
# and the two sets per_direction allows.
CONFIGS = [(Q2D | sum(extra), False)
           for n in range(4) for extra in itertools.combinations((Q2Q, D2Q, D2D), n)]
CONFIGS += [(Q2D, True), (Q2D | D2Q, True)]
HARDNESS = [0, 1, 2, 3]
REDUCTIONS = [0, 1, 2]  # none, mean, sum
# Rounding of a gradient stored in the dtype (one unit in the last place).
OUT_RTOL = {torch.float64: 0.0, torch.float32: 0.0, torch.float16: 2.0 ** -10,
            torch.bfloat16: 2.0 ** -7}
SMALL = (16, 16, 16, 16)  # BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D of the shrunken tiles


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def embeddings(r, k=0, shared=0, d=12, dtype=torch.float32, seed=0):
    """Normalized queries [r, d] and docs [(1 + k) r + shared, d] (positives,
    k hard-negative blocks, shared candidates) of the dtype: positives near
    their query, so the losses are neither 0 nor log M."""
    q = randn(r, d, seed=seed)
    docs = [q + 0.8 * randn(r, d, seed=seed + 1)]
    docs += [q + 1.5 * randn(r, d, seed=seed + 2 + b) for b in range(k)]
    if shared:
        docs.append(randn(shared, d, seed=seed + 50))
    return F.normalize(q, dim=-1).to(dtype), F.normalize(torch.cat(docs), dim=-1).to(dtype)


def on_device(*ts):
    return tuple(None if t is None else t.to(DEVICE) for t in ts)


def assert_close(got, want, what, rtol, atol=0.0):
    """got == want within rtol * |want| + atol, NaN and infinities in the same places."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    same = (got == want) | (got.isnan() & want.isnan())
    bad = ~same & ~((got - want).abs() <= rtol * want.abs() + atol)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: got {got[bad][:4].tolist()}, want "
        f"{want[bad][:4].tolist()} (rtol {rtol}, atol {atol})")


def _finite_max(t):
    t = t.detach().double().abs()
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def grad_atol(want, rounding, scaled_upstream):
    """Absolute tolerance of a gradient: 8 roundings of the largest entry, 4
    of scale * upstream. (float16's dlogit kept to 11 bits instead of 22
    errs by about 2^-12 of the largest entry.)"""
    return rounding * (8 * _finite_max(want) + 4 * scaled_upstream)


def check(q, docs, *, scale=None, scale_value=20.0, offset=0, rows=None, owned_blocks=1,
          directions=Q2D, per_direction=False, hardness_mode=0, hardness_strength=0.0,
          reduction=1, seed=5):
    """mnr_loss (with and without grad) and mnr_loss_backward of the normalized
    rows on DEVICE against the torch backend's; returns the kernels' results
    (loss, stats, grad_q, grad_d, grad_s) of the backward for a random upstream,
    on the CPU."""
    rows = q.shape[0] - offset if rows is None else rows
    dtype, acc = q.dtype, acc_dtype(q.dtype)
    config = (offset, rows, owned_blocks, directions, per_direction, hardness_mode,
              hardness_strength, reduction)
    qd, dd, sd = on_device(q, docs, scale)
    loss, stats, gq0, gd0, gs0 = K._mnr_loss_normalized(qd, dd, sd, scale_value, *config, False)
    assert loss.dtype == acc and stats.dtype == acc and stats.shape == (rows, 3)
    assert loss.shape == ((rows,) if reduction == 0 else ())
    assert gq0.shape == gd0.shape == gs0.shape == (0,) and gs0.dtype == acc
    assert gq0 is not gd0  # outputs of an op may not alias
    r_loss, r_stats, *_ = R._mnr_loss_normalized(q, docs, scale, scale_value, *config, False)

    # Logits are scale * cos: their rounding is eps * (scale + hardness) per entry.
    s_value = float(scale) if scale is not None else scale_value
    cond = max(1.0, abs(s_value) + hardness_strength)
    eps = torch.finfo(acc).eps
    tol = 64 * eps * cond
    assert_close(stats, r_stats, "stats", tol, tol)
    assert_close(loss, r_loss, "loss", tol, tol)

    gen = torch.Generator().manual_seed(seed)
    upstream = (torch.rand(tuple(r_loss.shape), generator=gen, dtype=torch.float64) + 0.5)
    upstream = upstream.to(acc)
    gq, gd, gs = K._mnr_loss_backward_normalized(upstream.to(DEVICE), qd, dd, sd, scale_value,
                                                 stats, *config)
    assert gq.dtype == dtype and gd.dtype == dtype and gq.shape == q.shape
    assert gd.shape == docs.shape and gs.dtype == acc
    assert gs.shape == (() if scale is not None else (0,))
    r_gq, r_gd, r_gs = R._mnr_loss_backward_normalized(upstream, q, docs, scale, scale_value,
                                                       stats.cpu(), *config)
    # A gradient is scale * sum_j dlogit * vector: its rounding is the dtype's
    # and the logits' (eps * cond) against the largest gradient and against
    # scale * upstream (a gradient that cancels to ~0).
    up_max = float(upstream.abs().max())
    for got, want, what in ((gq, r_gq, "grad_queries"), (gd, r_gd, "grad_docs")):
        atol = grad_atol(want, eps * cond, up_max * abs(s_value))
        assert_close(got, want, what, OUT_RTOL[dtype], atol)
    if scale is not None:
        # The sum over every pair of dlogit * cos: at most 4 |upstream| per row.
        per_row = {0: upstream.abs().sum(), 1: upstream.abs(), 2: upstream.abs() * rows}
        assert_close(gs, r_gs, "grad_scale", tol, 4 * tol * float(per_row[reduction]))

    # grad=True: the gradients for an upstream 1 (ones), computed with the loss.
    _, _, *got = K._mnr_loss_normalized(qd, dd, sd, scale_value, *config, True)
    _, _, *want = R._mnr_loss_normalized(q, docs, scale, scale_value, *config, True)
    for a, b, what in zip(got[:2], want[:2], ("grad=True queries", "grad=True docs")):
        assert_close(a, b, what, OUT_RTOL[dtype], grad_atol(b, eps * cond, abs(s_value)))
    if scale is not None:
        assert_close(got[2], want[2], "grad=True scale", tol, 4 * tol * rows)
    return loss.cpu(), stats.cpu(), gq.cpu(), gd.cpu(), gs.cpu()


@pytest.fixture
def small_tiles(monkeypatch):
    """Blocks of 16 (and two column splits): several row, column, K and d blocks."""
    for dtype in DTYPES:
        monkeypatch.setitem(K.BLOCKS, dtype, SMALL)
    monkeypatch.setattr(K, "COLUMN_SPLITS", 2)


# ---------------------------------------------------------------- device and mode


def test_kernel_mode_and_device():
    assert triton_kernel_mode_matches(K, DEVICE)


@pytest.mark.parametrize("device", triton_refused_devices(DEVICE))
def test_refuses_tensors_the_kernels_cannot_run_on(device):
    words = triton_refusal_words(DEVICE)
    q = torch.ones(2, 4, device=device)
    docs = torch.ones(4, 4, device=device)
    stats = torch.zeros(2, 3, device=device)
    g = torch.ones(2, device=device)
    config = (0, 2, 1, 1, False, 0, 0.0, 0)
    calls = [
        lambda: K.mnr_loss(q, [docs], None, 20.0, *config, True),
        lambda: K.mnr_loss_backward(g, q, [docs], None, 20.0, stats, *config),
        lambda: K._mnr_loss_normalized(q, docs, None, 20.0, *config, False),
        lambda: K._mnr_loss_backward_normalized(g, q, docs, None, 20.0, stats, *config),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError) as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)
    # The argument checks come first.
    with pytest.raises(TypeError, match="nanfree.mnr_loss: `queries` must be float16"):
        K.mnr_loss(q.int(), [docs], None, 20.0, *config, False)


def test_argument_errors_are_the_ops():
    q, docs = on_device(*embeddings(3, 1))
    config = dict(offset=0, rows=3, owned_blocks=2, directions=1, per_direction=False,
                  hardness_mode=0, hardness_strength=0.0, reduction=1)

    def call(**changes):
        c = dict(config, **changes)
        return K.mnr_loss(q, [docs], None, 20.0, *c.values(), False)

    with pytest.raises(ValueError, match=r"nanfree.mnr_loss: local rows \[2, 4\) are not"):
        call(offset=2, rows=2)
    with pytest.raises(ValueError, match="nanfree.mnr_loss: 3 blocks of 3 docs do not fit"):
        call(owned_blocks=3)
    with pytest.raises(ValueError, match="does not allow query_to_query or doc_to_doc"):
        call(directions=Q2D | D2D, per_direction=True)
    with pytest.raises(ValueError, match="nanfree.mnr_loss: `scale` must be positive"):
        K.mnr_loss(q, [docs], None, -1.0, *config.values(), False)
    loss, stats, *_ = call()
    with pytest.raises(ValueError, match="nanfree.mnr_loss_backward: `stats` must be"):
        K.mnr_loss_backward(loss, q, [docs], None, 20.0, stats[:1], *config.values())


# ---------------------------------------------------------------- every configuration


@pytest.mark.parametrize("negatives", ["none", "hard", "shared"])
@pytest.mark.parametrize("directions,per_direction", CONFIGS,
                         ids=[f"dirs{d}{'-per' if p else ''}" for d, p in CONFIGS])
def test_every_configuration(directions, per_direction, negatives):
    # float32, one tile; each hardness mode with a reduction and a tensor or Python scale.
    k, shared = {"none": (0, 0), "hard": (2, 0), "shared": (0, 3)}[negatives]
    q, docs = embeddings(5, k, shared, seed=directions)
    for hardness, reduction in zip(HARDNESS, itertools.cycle(REDUCTIONS)):
        scale = torch.tensor(13.0) if hardness % 2 else None
        check(q, docs, scale=scale, scale_value=17.0, owned_blocks=1 + k,
              directions=directions, per_direction=per_direction, hardness_mode=hardness,
              hardness_strength=0.3 if hardness else 0.0, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ["all-joint", "symmetric"])
def test_dtypes_many_tiles(dtype, config, small_tiles):
    # 21 queries (2 blocks of 16), docs 21 * 2 + 5 (3 column blocks), d 20 (2
    # chunks of 16), a rank's 17 rows from 4: no size a multiple of a block.
    q, docs = embeddings(21, 1, 5, d=20, dtype=dtype, seed=11)
    if config == "all-joint":
        opts = dict(directions=Q2D | Q2Q | D2Q | D2D, hardness_mode=3, hardness_strength=0.5,
                    reduction=0)
    else:
        opts = dict(directions=Q2D | D2Q, per_direction=True, hardness_mode=1,
                    hardness_strength=0.2, reduction=1)
    check(q, docs, scale=torch.tensor(20.0), offset=4, rows=17, owned_blocks=2, **opts)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("directions,per_direction", [(Q2D | Q2Q | D2D, False),
                                                      (Q2D | D2Q, False), (Q2D | D2Q, True)])
def test_column_splits(directions, per_direction, splits, small_tiles, monkeypatch):
    # Splits of the column blocks: their states merged, their row sums added.
    monkeypatch.setattr(K, "COLUMN_SPLITS", splits)
    q, docs = embeddings(20, 2, 7, d=18, dtype=torch.float64, seed=3)
    check(q, docs, scale=torch.tensor(9.0), owned_blocks=3, directions=directions,
          per_direction=per_direction, hardness_mode=2, hardness_strength=0.4, reduction=2)


def test_splits_do_not_change_the_result(small_tiles, monkeypatch):
    q, docs = on_device(*embeddings(20, 1, 0, d=18, dtype=torch.float64, seed=8))
    args = (torch.tensor(20.0, dtype=torch.float64).to(DEVICE), 0.0, 0, 20, 2, 15, False, 1,
            0.3, 0, True)
    results = []
    for splits in (1, 3):
        monkeypatch.setattr(K, "COLUMN_SPLITS", splits)
        results.append([t.cpu() for t in K._mnr_loss_normalized(q, docs, *args)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.allclose(a, b, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------- slices and edge problems


def test_rank_slices_add_up(small_tiles):
    # Two ranks' slices (offset 0 and 17 of 30 rows): sum losses and gradients
    # add up to the whole batch's.
    q, docs = embeddings(30, 1, 4, d=20, dtype=torch.float64, seed=21)
    qd, dd = on_device(q, docs)
    scale = torch.tensor(15.0, dtype=torch.float64).to(DEVICE)
    config = (2, Q2D | Q2Q | D2Q | D2D, False, 1, 0.25, 2)

    def run(offset, rows):
        return K._mnr_loss_normalized(qd, dd, scale, 0.0, offset, rows, *config, True)

    whole = run(0, 30)
    first, second = run(0, 17), run(17, 13)
    assert torch.allclose(whole[0], first[0] + second[0], rtol=1e-12)
    assert torch.equal(whole[1].cpu(), torch.cat([first[1], second[1]]).cpu()) or torch.allclose(
        whole[1], torch.cat([first[1], second[1]]), rtol=1e-13)
    for i in (2, 3, 4):
        assert torch.allclose(whole[i], first[i] + second[i], rtol=1e-10, atol=1e-12)
    check(q, docs, scale=scale.cpu(), offset=17, rows=13, owned_blocks=2,
          directions=config[1], hardness_mode=1, hardness_strength=0.25, reduction=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_query(dtype):
    # B = 1: the positive is the only doc and the only query is excluded
    # (query_to_query), the P row's only doc is its own (doc_to_doc: all -inf).
    q, docs = embeddings(1, 0, 0, dtype=dtype, seed=4)
    configs = CONFIGS if dtype == torch.float32 else [(Q2D | Q2Q | D2Q | D2D, False),
                                                      (Q2D | D2D, False), (Q2D | D2Q, True)]
    for directions, per_direction in configs:
        loss, stats, gq, gd, gs = check(q, docs, scale=torch.tensor(20.0), directions=directions,
                                        per_direction=per_direction, reduction=0)
        assert torch.isfinite(loss).all() and torch.isfinite(gq).all()
        assert torch.isfinite(gd).all() and torch.isfinite(gs).all()
        if directions == Q2D | D2D:
            assert stats[0, 1] == -INF  # the empty P row
    # With hard negatives: B = 1, k = 3.
    q, docs = embeddings(1, 3, 0, dtype=dtype, seed=5)
    check(q, docs, owned_blocks=4, directions=Q2D | Q2Q | D2Q | D2D, hardness_mode=2,
          hardness_strength=1.0, reduction=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_and_duplicated_rows(dtype, small_tiles):
    q, docs = embeddings(18, 1, 3, d=17, dtype=dtype, seed=9)
    q[2] = 0  # an empty text: a zero (normalized) row, every cosine 0
    docs[5] = 0
    docs[18 + 4] = 0  # a hard negative
    docs[7] = q[7]  # a positive equal to its query
    q[9] = q[10]  # two equal queries
    docs[18 + 11] = docs[11]  # a hard negative equal to its positive
    docs[-1] = docs[-2]  # duplicated shared candidates
    config = ((Q2D | Q2Q | D2Q | D2D, False), (Q2D | D2Q, True))[DTYPES.index(dtype) % 2]
    for directions, per_direction in (config,):
        loss, _, gq, gd, gs = check(q, docs, scale=torch.tensor(20.0), owned_blocks=2,
                                    directions=directions, per_direction=per_direction,
                                    hardness_mode=3, hardness_strength=0.5, reduction=0)
        for t in (loss, gq, gd, gs):
            assert torch.isfinite(t).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_1e4(dtype):
    # Logits 1e4 apart: every softmax one-hot, nothing overflows.
    q, docs = embeddings(6, 1, 2, dtype=dtype, seed=12)
    for scale, scale_value in ((None, 1e4), (torch.tensor(1e4), 0.0)):
        loss, stats, gq, gd, gs = check(q, docs, scale=scale, scale_value=scale_value,
                                        owned_blocks=2, directions=Q2D | Q2Q | D2Q | D2D,
                                        hardness_mode=1, hardness_strength=0.5, reduction=0)
        for t in (loss, stats, gq, gd, gs):
            assert torch.isfinite(t).all()


def test_upstream_of_every_magnitude():
    # Per-row upstream gradients from 1e-30 to 1e30 and 0 (reduction none): the
    # sums see them divided by a power of two, each row keeps its own.
    q, docs = on_device(*embeddings(6, 0, 0, seed=13))
    config = (0, 6, 1, Q2D | D2Q, False, 0, 0.0, 0)
    loss, stats, *_ = K._mnr_loss_normalized(q, docs, None, 20.0, *config, False)
    for up in ([1e30, 1e-30, 0.0, 1.0, -2.0, 1e10], [1e-30] * 6, [0.0] * 6, [3e38, 0, 0, 0, 0, 1]):
        g = torch.tensor(up).to(DEVICE)
        got = K._mnr_loss_backward_normalized(g, q, docs, None, 20.0, stats, *config)
        want = R._mnr_loss_backward_normalized(g.cpu(), q.cpu(), docs.cpu(), None, 20.0,
                                               stats.cpu(), *config)
        # Rounding of float32 logits against the largest row's upstream gradient.
        atol = 64 * torch.finfo(torch.float32).eps * 20.0 * max(abs(x) for x in up)
        for a, b in zip(got[:2], want[:2]):
            a = a.cpu()
            # Finite where the reference's scale * dlogit overflows float32 (3e38 * 20)
            # and the sums meet inf - inf; the gradient itself is finite.
            assert torch.isfinite(a).all()
            finite = torch.isfinite(b)
            assert_close(a[finite], b[finite], f"upstream {up}", 1e-5, atol)


def test_nan_row():
    # A NaN in one query: NaN where the reference has it (every row's loss
    # sees that query's column with query_to_query; only its own row without).
    q, docs = embeddings(5, 0, 0, seed=14)
    q[3, 1] = NAN
    for directions in (Q2D, Q2D | Q2Q):
        loss, stats, gq, gd, gs = check(q, docs, scale=torch.tensor(20.0),
                                        directions=directions, reduction=0)
        if directions == Q2D:
            assert loss.isnan().tolist() == [False, False, False, True, False]
            assert not gq[[0, 1, 2, 4]].isnan().any() and gq[3].isnan().all()


def test_backward_is_deterministic(small_tiles):
    q, docs = on_device(*embeddings(20, 1, 0, d=18, seed=15))
    config = (0, 20, 2, Q2D | Q2Q | D2Q | D2D, False, 0, 0.0, 0)
    loss, stats, *_ = K._mnr_loss_normalized(q, docs, None, 20.0, *config, False)
    first = K._mnr_loss_backward_normalized(loss, q, docs, None, 20.0, stats, *config)
    second = K._mnr_loss_backward_normalized(loss, q, docs, None, 20.0, stats, *config)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------- the ops (raw embeddings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_ops_on_raw_embeddings(dtype):
    # The ops normalize their rows (nanfree's normalize, eps 1e-12) and return
    # the raw embeddings' gradients, as the torch backend's ops do; the docs
    # given as blocks [7, 10] and [7, 2, 10] (read as its blocks [:, j]).
    q = (3 * randn(7, 10, seed=16)).to(dtype)
    docs = (0.5 * randn(21, 10, seed=17)).to(dtype)
    docs[4] = 0

    def blocks(d):
        return [d[:7], d[7:].reshape(7, 2, 10)]

    config = (0, 7, 3, Q2D | D2Q, True, 2, 0.3, 0)
    scale = torch.tensor(20.0)
    qd, dd, sd = on_device(q, docs, scale)
    got = K.mnr_loss(qd, blocks(dd), sd, 0.0, *config, True)
    want = R.mnr_loss(q, blocks(docs), scale, 0.0, *config, True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for a, b, what in zip(got, want, ("loss", "stats", "grad_q", "grad_d", "grad_s")):
        assert_close(a, b, what, tol, tol * max(_finite_max(b), 1e-3))
    g = torch.linspace(0.5, 1.5, 7)
    got = K.mnr_loss_backward(g.to(DEVICE), qd, blocks(dd), sd, 0.0, got[1].to(DEVICE), *config)
    want = R.mnr_loss_backward(g, q, blocks(docs), scale, 0.0, want[1], *config)
    for a, b, what in zip(got, want, ("grad_q", "grad_d", "grad_s")):
        assert_close(a, b, what, tol, tol * max(_finite_max(b), 1e-3))


# ---------------------------------------------------------------- mirrored header functions


@triton.jit
def _kind_kernel(out_ptr, first_len, r, owned_end, n_rows, n_cols, ROW_KIND: tl.constexpr,
                 HARDNESS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr):
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    kind = K.mnr_column_kind(ROW_KIND, g[:, None], j[None, :], first_len, r, owned_end, HARDNESS)
    inside = (g[:, None] < n_rows) & (j[None, :] < n_cols)
    tl.store(out_ptr + g[:, None] * n_cols + j[None, :], kind, mask=inside)


@pytest.mark.parametrize("row_kind", [0, 1])
@pytest.mark.parametrize("hardness", HARDNESS)
def test_mnr_column_kind(row_kind, hardness):
    # 4 queries, 3 owned blocks and 2 shared docs (14 docs); Q rows: docs then
    # queries; P rows: queries then docs.
    r, owned_end, m = 4, 12, 14
    first_len = m if row_kind == 0 else r
    n_cols = m + r
    out = torch.empty((r, n_cols), dtype=torch.int32, device=DEVICE)
    _kind_kernel[(1,)](out, first_len, r, owned_end, r, n_cols, ROW_KIND=row_kind,
                       HARDNESS=hardness, BLOCK_G=4, BLOCK_J=32)
    g = torch.arange(r)[:, None]
    j = torch.arange(n_cols)[None, :]
    want = R.mnr_column_kind(row_kind == 0, g, j, first_len, r, owned_end, hardness)
    assert torch.equal(out.cpu().long(), want.long())


@triton.jit
def _math_kernel(a_ptr, b_ptr, kind_ptr, out_ptr, n, FN: tl.constexpr, FLAG: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(a_ptr + offs, mask=inside, other=0.0)
    b = tl.load(b_ptr + offs, mask=inside, other=0.0)
    kind = tl.load(kind_ptr + offs, mask=inside, other=0)
    if FN == 0:
        v = K.mnr_log_partition(a, b, FLAG, True)
    elif FN == 1:
        v = K.mnr_logit(a, kind, 20.0, 0.5)
    else:
        v = K.mnr_logit_grad(a, kind, b, 0.5, 0.75)
    tl.store(out_ptr + offs, v, mask=inside)


SPECIAL = [-INF, INF, NAN, 0.0, -1.0, 3.0, 1e30, -1e30, 700.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_mirrored_math(dtype):
    pairs = list(itertools.product(SPECIAL, SPECIAL))
    a = torch.tensor([x for x, _ in pairs], dtype=dtype)
    b = torch.tensor([y for _, y in pairs], dtype=dtype)
    kind = torch.arange(len(pairs), dtype=torch.int32) % 4
    n = len(pairs)
    for fn, flag in ((0, False), (0, True), (1, False), (2, False)):
        out = torch.empty(n, dtype=dtype, device=DEVICE)
        _math_kernel[(1,)](*on_device(a, b, kind), out, n, FN=fn, FLAG=flag,
                           BLOCK=triton.next_power_of_2(n))
        if fn == 0:
            want = R.mnr_log_partition(a, b, flag, True)
        elif fn == 1:
            want = R.mnr_logit(a, kind, torch.tensor(20.0, dtype=dtype), 0.5)
        else:
            want = R.mnr_logit_grad(a, kind, b, 0.5, 0.75)
        assert_close(out, want, f"function {fn} ({flag})", 8 * torch.finfo(dtype).eps)
