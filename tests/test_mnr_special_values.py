"""The special-value table of DESIGN.md section 2 (mnr_loss) through
nanfree.ops.mnr_loss and its autograd, on the backend this session selects, in
every dtype: zero embeddings (an empty text) as queries, positives, negatives
or everything; duplicated rows; scale 1e4 (a float and a tensor); float16's
extremes (entries near 65504, subnormals); B = 1 with every direction (every
pair of a row excluded); hard negatives identical to the positives; many hard
negatives. Each case runs with reduction 'none' (the backward recomputes the
logits, mnr_loss_backward) and 'mean' (the gradients come from the forward):
the loss and the gradients of queries, positives, negatives and a tensor scale
against autograd of the float64 oracle (tests/mnr_oracle.py) on the values the
dtype holds, within the error the dtype's rounding of the unit vectors allows;
the loss in float32 for half inputs, the gradients in the inputs' dtypes. Then
a NaN in one query: NaN exactly where the composed loss has it; and every
direction set, partition mode and hardness mode on awkward inputs: finite."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, INTERPRETED, acc_dtype
from mnr_oracle import composed_mnr_loss

import nanfree.ops as nf

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# Every direction set (query_to_doc always in) with joint partition, and the
# two sets per_direction allows.
CONFIGS = [(("query_to_doc",) + extra, "joint")
           for n in range(4) for extra in itertools.combinations(ALL[1:], n)]
CONFIGS += [(("query_to_doc",), "per_direction"),
            (("query_to_doc", "doc_to_query"), "per_direction")]
HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]
EVERY = dict(directions=ALL)
COS_EPS = 1e-12  # cos_sim's eps (sentence-transformers': F.normalize's default)


# --- the table ------------------------------------------------------------------------


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _plain(b=4, k=2, d=8, seed=0):
    """Queries, positives near their query, k hard negatives [b, k, d] (None for k = 0)."""
    q = _randn(b, d, seed=seed)
    p = q + 0.7 * _randn(b, d, seed=seed + 1)
    n = (q[:, None] + 1.2 * _randn(b, k, d, seed=seed + 2)) if k else None
    return q, p, n


# Rows whose unit vectors every dtype holds exactly (entries 0, +-0.5, +-1):
# cosines are multiples of 0.25, so a scale of 1e4 gives logits 2500 apart,
# computed without rounding error.
_EXACT = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 0, 0, 0], [1, 1, -1, -1],
                       [0, 1, 0, 0], [-1, 1, 1, 1], [1, -1, -1, 1], [0, 0, 0, -1],
                       [1, 1, 1, -1], [0, 0, 1, 0], [-1, -1, 1, 1], [1, -1, 1, 1]],
                      dtype=torch.float64)


def _exact(rows, magnitude=1.0, shift=0):
    return magnitude * _EXACT[[(shift + 5 * i) % len(_EXACT) for i in range(rows)]]


def _fp16_subnormals(b, d, seed):
    # Multiples of float16's smallest subnormal 2^-24, a few units each.
    return torch.round(_randn(b, d, seed=seed) * 4) * 2.0 ** -24


def _cases(dtype):
    """name: (queries, positives, negatives, options of mnr_loss), the embeddings
    float64 tensors before rounding to the dtype; ("tensor", v) as scale means a
    float32 tensor scale requiring grad."""
    info = torch.finfo(dtype)
    q, p, n = _plain()
    zq, zp, zn = q.clone(), p.clone(), n.clone()
    zq[1] = 0
    zp[2] = 0
    zn[0, 1] = 0
    shared = _randn(3, 8, seed=5)
    shared[1] = 0
    dq = q.clone()
    dq[2] = dq[0]
    dp = p.clone()
    dp[2] = dp[0]
    eq, ep, en = _exact(4), _exact(4, shift=1), _exact(8, shift=2).reshape(4, 2, 4)
    tiny = info.tiny / 4  # a subnormal of the dtype
    sq, sp, sn = _plain(3, 1, 6, seed=7)
    b1q, b1p, b1n = _plain(1, 2, 5, seed=9)
    hq, hp, _ = _plain(4, 0, 6, seed=11)
    hn = torch.stack([hp, hp.roll(1, 0)], 1)  # negative 0 is the positive itself
    return {
        "plain": (q, p, n, {}),
        "plain, every direction": (q, p, n, dict(EVERY)),
        "plain, shared negatives": (q, p, shared, dict(EVERY)),
        "zero query": (zq, p, n, dict(EVERY)),
        "zero positive": (q, zp, n, dict(EVERY)),
        "zero positive, symmetric": (q, zp, n, dict(symmetric=True)),
        "zero hard negative": (q, p, zn, dict(EVERY, hardness_mode="all_negatives",
                                              hardness_strength=2.0)),
        "zero shared negative": (q, p, shared, dict(EVERY)),
        "all zeros": (0 * q, 0 * p, 0 * n, {}),
        "all zeros, every direction, tensor scale": (0 * q, 0 * p, 0 * n,
                                                     dict(EVERY, scale=("tensor", 20.0))),
        "duplicated pair": (dq, dp, n, dict(EVERY)),
        "every row the same": (q[:1].expand(4, 8), q[:1].expand(4, 8), q[:1, None].expand(4, 2, 8),
                               dict(EVERY, scale=("tensor", 20.0))),
        "scale 1e4": (eq, ep, en, dict(scale=1e4)),
        "scale 1e4 tensor, every direction": (eq, ep, en, dict(EVERY, scale=("tensor", 1e4))),
        "scale 1e4, hardness": (eq, ep, en, dict(scale=1e4, hardness_mode="all_negatives",
                                                 hardness_strength=5.0)),
        "scale 1e4, random rows": (q, p, n, dict(EVERY, scale=("tensor", 1e4))),
        "scale 0.05": (q, p, n, dict(EVERY, scale=0.05)),
        "near 65504": (_exact(4, 65504.0), _exact(4, 65504.0, 1), _exact(8, 65504.0, 2)
                       .reshape(4, 2, 4), dict(EVERY, scale=("tensor", 20.0))),
        "near 65504, random rows": ((q / q.abs().amax()) * 65504, p.clamp(-1, 1) * 65504,
                                    n.clamp(-1, 1) * 65504, dict(EVERY)),
        "float16 subnormals": (_fp16_subnormals(3, 6, 12), _fp16_subnormals(3, 6, 13),
                               _fp16_subnormals(6, 6, 14).reshape(3, 2, 6),
                               dict(EVERY, scale=("tensor", 20.0))),
        "subnormals of the dtype": (sq.sign() * tiny, sp * tiny, sn, dict(EVERY)),
        "huge and tiny mixed": (torch.cat([q[:2] * 6e4 / q[:2].abs().amax(), q[2:] * 2.0 ** -20]),
                                p, n, dict(EVERY)),
        "B=1": (b1q, b1p, None, {}),
        "B=1, every direction": (b1q, b1p, None, dict(EVERY, scale=("tensor", 20.0))),
        "B=1, doc_to_doc only": (b1q, b1p, None, dict(directions=("query_to_doc", "doc_to_doc"))),
        "B=1, query_to_query only": (b1q, b1p, None,
                                     dict(directions=("query_to_doc", "query_to_query"))),
        "B=1, hard negatives, every direction": (b1q, b1p, b1n, dict(EVERY)),
        "B=1, symmetric": (b1q, b1p, b1n, dict(symmetric=True)),
        "B=1, hardness": (b1q, b1p, b1n, dict(EVERY, hardness_mode="all_negatives",
                                               hardness_strength=1.0)),
        "hard negative is the positive": (hq, hp, hn, dict(EVERY)),
        "hard negative is the positive, hard_negatives": (
            hq, hp, hn, dict(EVERY, hardness_mode="hard_negatives", hardness_strength=3.0)),
        "hard negative is the positive, symmetric": (hq, hp, hn, dict(symmetric=True)),
        # More own columns (positive, 70 hard negatives, the query itself) than
        # a row sweep visits one by one in some kernels.
        "70 hard negatives, every direction": (*_plain(2, 70, 4, seed=15)[:2],
                                               _plain(2, 70, 4, seed=15)[2],
                                               dict(EVERY, hardness_mode="hard_negatives",
                                                    hardness_strength=1.0)),
    }


CASES = list(_cases(torch.float32))
# Under Triton's interpreter (every launch runs in numpy) each case runs twice:
# float16 (the extremes) through the recomputing backward (reduction 'none'),
# float64 (the tightest comparison) through the forward's gradients ('mean').
RUNS = ([(torch.float16, "none"), (torch.float64, "mean")] if INTERPRETED else
        list(itertools.product(DTYPES, ["none", "mean"])))


# --- running the op and the oracle ----------------------------------------------------


class _Inputs:
    """The case's embeddings as the dtype holds them (float64 copies, for the
    oracle) and its options; the scale as the op and the oracle take it."""

    def __init__(self, q, p, n, options, dtype):
        self.dtype = dtype
        self.held = [t.to(dtype).double() if t is not None else None for t in (q, p, n)]
        self.options = dict(options)
        scale = self.options.pop("scale", 20.0)
        self.scale_tensor = isinstance(scale, tuple)
        self.scale_value = scale[1] if self.scale_tensor else scale
        self.strength = self.options.get("hardness_strength", 0.0)
        # The oracle spells symmetric=True out.
        self.oracle_options = dict(self.options)
        if self.oracle_options.pop("symmetric", False):
            self.oracle_options.update(directions=("query_to_doc", "doc_to_query"),
                                       partition_mode="per_direction")

    @classmethod
    def of_case(cls, case, dtype):
        return cls(*_cases(dtype)[case], dtype)

    def leaves(self, dtype, device):
        ts = [None if t is None else t.detach().clone().to(dtype).to(device).requires_grad_(True)
              for t in self.held]
        if self.scale_tensor:
            ts.append(torch.tensor(self.scale_value, dtype=torch.float32 if dtype != torch.float64
                                   else torch.float64, device=device, requires_grad=True))
        else:
            ts.append(self.scale_value)
        return ts

    def run(self, fn, dtype, device, reduction, upstream):
        """(loss, [grad of q, p, n (None if absent), scale (None for a float)]) of
        fn on leaves of dtype, backward with `upstream` (per row for 'none')."""
        *embeddings, scale = self.leaves(dtype, device)
        options = self.oracle_options if fn is composed_mnr_loss else self.options
        loss = fn(*embeddings, scale=scale, reduction=reduction, **options)
        leaves = [t for t in embeddings + [scale] if isinstance(t, torch.Tensor)]
        grads = torch.autograd.grad(loss, leaves, upstream.to(loss.dtype).to(device).reshape(
            loss.shape))
        grads = list(grads)
        out = [grads.pop(0) if isinstance(t, torch.Tensor) else None
               for t in embeddings + [scale]]
        return loss.detach(), out


def _upstream(reduction, rows):
    """An incoming gradient: per row for 'none' (no entry 0, held by bfloat16), else 1."""
    if reduction != "none":
        return torch.tensor(1.0, dtype=torch.float64)
    g = torch.cos(torch.arange(rows, dtype=torch.float64) * 1.3 + 0.2)
    return torch.where(g.abs() < 0.1, 0.1, g).to(torch.bfloat16).double()


# --- the error the dtype allows -------------------------------------------------------


def _unit_error(x, dtype):
    """Per row of x (held values): a bound of the L1 distance between the unit
    vector the op uses (normalized in the accumulation type, rounded to the
    dtype) and the exact one: the rounding to the dtype plus a few units of the
    accumulation type."""
    ref = F.normalize(x, dim=-1, eps=COS_EPS)
    rounded = ref.to(dtype).double()
    eps_acc = torch.finfo(acc_dtype(dtype)).eps
    return (rounded - ref).abs().sum(-1) + 4 * math.sqrt(x.shape[-1]) * eps_acc


class _Bounds:
    """Bounds of the op's error on a case from the unit vectors' error: a
    cosine is off by at most du_i + du_j + d eps (accumulation), a logit by
    scale_eff times that, a logsumexp or a loss by the largest logit error."""

    def __init__(self, inputs, dtype):
        q, p, n = inputs.held
        rows = [q.reshape(-1, q.shape[-1]), p.reshape(-1, q.shape[-1])]
        if n is not None:
            rows.append(n.reshape(-1, q.shape[-1]))
        self.b, self.d = q.shape
        eps_acc = torch.finfo(acc_dtype(dtype)).eps
        du = max(float(_unit_error(r, dtype).max()) if r.numel() else 0.0 for r in rows)
        self.du = du
        self.dcos = 2 * du + self.d * eps_acc
        self.scale_eff = inputs.scale_value + inputs.strength
        self.dlogit = self.scale_eff * (self.dcos + 2 * eps_acc)
        self.eps_acc = eps_acc
        self.eps = torch.finfo(dtype).eps

    def loss_tol(self, ref):
        return 2 * self.dlogit + 8 * self.eps_acc * (1 + ref.abs())

    def grad_tol(self, x, ref_grad, upstream):
        """Per entry of the gradient of x ([..., d] held values): the softmax
        weights are off by a factor exp(2 dlogit) at most, every logit row that
        touches x (at most 2B + 2) passes its error through normalize's
        backward (1 / max(|x|, eps)); then the rounding to the dtype."""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(COS_EPS)
        touching = 2 * self.b + 2
        up = float(upstream.abs().max())
        per_row = up * self.scale_eff * touching * (2 * math.expm1(2 * self.dlogit)
                                                      + 4 * self.du + self.dcos) / norm
        return per_row + 4 * self.eps * ref_grad.abs()

    def scale_grad_tol(self, upstream, ref):
        # Per row and row kind: sum |d softmax| |cos| + sum softmax |d cos| + |d cos| of the
        # positive; then the accumulation's rounding.
        up = float(upstream.abs().sum())
        return up * 2 * (math.expm1(2 * self.dlogit) + 2 * self.dcos) + \
            8 * self.b * self.eps_acc * (1 + abs(float(ref)))


def _oracle(inputs, reduction, upstream):
    return inputs.run(composed_mnr_loss, torch.float64, "cpu", reduction, upstream)


def _saturated(g, dtype):
    big = torch.finfo(dtype).max
    return g.clamp(-big, big)


def _assert_matches_oracle(inputs, dtype, device, reduction):
    q = inputs.held[0]
    upstream = _upstream(reduction, q.shape[0])
    loss, grads = inputs.run(nf.mnr_loss, dtype, device, reduction, upstream)
    ref_loss, ref_grads = _oracle(inputs, reduction, upstream)
    # Half inputs give a float32 loss; float64 a float64 one.
    assert loss.dtype == acc_dtype(dtype) and loss.device.type == device
    assert loss.shape == ((q.shape[0],) if reduction == "none" else ())
    loss = loss.cpu().double()
    assert torch.isfinite(loss).all(), loss
    bounds = _Bounds(inputs, dtype)
    err = (loss - ref_loss).abs()
    tol = bounds.loss_tol(ref_loss)
    assert (err <= tol).all(), f"loss {loss} vs oracle {ref_loss}: error {err}, allowed {tol}"
    names = ["queries", "positives", "negatives", "scale"]
    for name, got, ref, x in zip(names, grads, ref_grads, inputs.held + [None]):
        if ref is None:
            assert got is None
            continue
        if name == "scale":
            assert got.dtype == acc_dtype(dtype)
            assert got.shape == () and torch.isfinite(got), got
            err = abs(float(got) - float(ref))
            tol = bounds.scale_grad_tol(upstream, ref)
            assert err <= tol, f"scale's gradient {float(got)} vs oracle {float(ref)}"
            continue
        assert got.dtype == dtype and got.shape == x.shape and got.device.type == device
        got = got.cpu().double()
        assert torch.isfinite(got).all(), f"{name}' gradient is not finite: {got}"
        # A zero vector (an empty text), or one below cos_sim's eps, has no
        # direction: gradient 0, as cos_sim's (torch: x / eps, 1e12 and more).
        directionless = torch.linalg.vector_norm(x, dim=-1) < COS_EPS
        assert (got[directionless] == 0).all(), f"{name}: a zero row's gradient is not 0"
        ref = _saturated(ref, dtype)
        err = (got - ref).abs()
        tol = bounds.grad_tol(x, ref, upstream)
        bad = (err > tol) & ~directionless[..., None]
        assert not bad.any(), (f"{name}' gradient off by {err[bad].max().item()} (allowed "
                               f"{tol.expand_as(err)[bad].min().item()}):\n{got}\nvs oracle\n{ref}")


@pytest.mark.parametrize("dtype,reduction", RUNS, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_mnr_table(case, dtype, reduction, device):
    _assert_matches_oracle(_Inputs.of_case(case, dtype), dtype, device, reduction)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zeros_is_log_of_the_candidates(dtype, device):
    # Every cosine is 0: each row's loss is log(#candidates), every gradient 0.
    b, k, d = 3, 2, 5
    q = torch.zeros(b, d, dtype=dtype, device=device, requires_grad=True)
    p = torch.zeros(b, d, dtype=dtype, device=device, requires_grad=True)
    n = torch.zeros(b, k, d, dtype=dtype, device=device, requires_grad=True)
    scale = torch.tensor(20.0, device=device, requires_grad=True)
    loss = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, reduction="none")
    # query row: b(1 + k) docs + (b - 1) other queries; positive row: b queries +
    # the b(1 + k) - (1 + k) docs of other queries.
    count = b * (1 + k) + (b - 1) + b + (b - 1) * (1 + k)
    torch.testing.assert_close(loss.cpu().double(), torch.full((b,), math.log(count),
                                                               dtype=torch.float64))
    loss.sum().backward()
    for t in (q, p, n):
        assert (t.grad == 0).all() and t.grad.dtype == dtype
    # d loss / d scale = sum of softmax-weighted cosines minus the positive's: 0.
    assert scale.grad == 0


# --- NaN stays where it belongs -------------------------------------------------------


def _nan_rows(directions, b, row):
    """Rows whose loss a NaN in query `row` reaches: its own, and every row when
    the queries are columns of other rows (query_to_query, doc_to_query)."""
    if {"query_to_query", "doc_to_query"} & set(directions):
        return set(range(b))
    return {row}


@pytest.mark.parametrize("dtype", [torch.float16] if INTERPRETED else DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "+".join(c[0]) + "," + c[1])
def test_nan_in_one_query(config, dtype, device):
    directions, partition = config
    q, p, n = _plain(4, 2, 6, seed=20)
    q[1, 3] = math.nan
    options = dict(directions=directions, partition_mode=partition, scale=("tensor", 20.0))
    upstream = _upstream("none", 4)
    inputs = _Inputs(q, p, n, options, dtype)
    loss, grads = inputs.run(nf.mnr_loss, dtype, device, "none", upstream)
    ref_loss, ref_grads = _oracle(inputs, "none", upstream)
    loss = loss.cpu().double()
    expected = _nan_rows(directions, 4, 1)
    assert {i for i in range(4) if math.isnan(loss[i])} == expected, loss
    assert torch.isnan(ref_loss).eq(torch.isnan(loss)).all()
    assert not torch.isinf(loss).any()
    # The other rows are what they are without the NaN (bounds of the clean batch).
    finite = ~torch.isnan(loss)
    tol = _Bounds(_Inputs(q.nan_to_num(0.0), p, n, options, dtype), dtype).loss_tol(ref_loss)
    assert ((loss - ref_loss).abs() <= tol)[finite].all()
    # The gradients are NaN exactly where torch's composition makes them NaN
    # (the NaN query's row, and every vector a NaN row's softmax reaches), finite
    # elsewhere.
    for name, got, ref in zip(["queries", "positives", "negatives", "scale"], grads, ref_grads):
        got = got.cpu().double()
        assert torch.isnan(got).eq(torch.isnan(ref)).all(), \
            f"{name}: NaN at {torch.isnan(got).nonzero().tolist()}, oracle at " \
            f"{torch.isnan(ref).nonzero().tolist()}"
        assert not torch.isinf(got).any()
    # The query's own gradient row is NaN; other queries' are finite unless
    # they are columns of a NaN row.
    assert torch.isnan(grads[0][1]).all()
    # A mean over the rows is NaN, and so are its gradients (not laundered).
    leaves = inputs.leaves(dtype, device)
    mean = nf.mnr_loss(*leaves[:3], scale=leaves[3], **inputs.options)
    assert torch.isnan(mean)
    mean.backward()
    assert torch.isnan(leaves[0].grad[1]).all() and torch.isnan(leaves[3].grad)


@pytest.mark.parametrize("where", ["positive", "negative", "shared"])
def test_nan_in_a_document(where, device):
    # A NaN document is a column of every query row: every row's loss is NaN.
    q, p, n = _plain(3, 2, 5, seed=21)
    if where == "positive":
        p[2, 0] = math.nan
    elif where == "negative":
        n[0, 1, 4] = math.nan
    else:
        n = _randn(4, 5, seed=22)
        n[3, 2] = math.nan
    loss = nf.mnr_loss(q.to(device), p.to(device), n.to(device), reduction="none")
    assert torch.isnan(loss).all()
    torch.testing.assert_close(loss.cpu(), composed_mnr_loss(q, p, n, reduction="none"),
                               equal_nan=True)


# --- every option stays finite ---------------------------------------------------------


def _awkward(negatives_kind):
    """A batch of zeros, duplicates, a hard negative equal to its positive, a
    shared candidate equal to a query, huge and tiny rows."""
    q, p, n = _plain(4, 2, 6, seed=30)
    q[0] = 0
    q[3] = q[2]
    p[3] = p[2]
    p[1] = 0
    n[2, 0] = p[2]
    n[1, 1] = 0
    q[2] = q[2] * 6e4 / q[2].abs().amax()
    n[0, 0] = n[0, 0] * 2.0 ** -20
    if negatives_kind == "shared":
        n = torch.cat([q[2:3], torch.zeros(1, 6), _randn(2, 6, seed=31)])
    elif negatives_kind == "none":
        n = None
    return q, p, n


@pytest.mark.parametrize("hardness", HARDNESS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "+".join(c[0]) + "," + c[1])
def test_every_option_is_finite(config, hardness, device):
    directions, partition = config
    runs = itertools.product(["hard", "shared", "none"],
                             [torch.float16, torch.bfloat16, torch.float32],
                             ["none", "mean", "sum"])
    if INTERPRETED:
        # One kind of negatives per test (every kind across a config's hardness
        # modes), float16, the two autograd paths.
        kind = ["hard", "shared", "none"][HARDNESS.index(hardness) % 3]
        runs = [(kind, torch.float16, "none"), (kind, torch.float16, "mean")]
    for kind, dtype, reduction in runs:
        options = dict(directions=directions, partition_mode=partition, scale=("tensor", 50.0),
                       hardness_mode=hardness, hardness_strength=2.0 if hardness else 0.0)
        inputs = _Inputs(*_awkward(kind), options, dtype)
        _assert_matches_oracle(inputs, dtype, device, reduction)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_many_candidates_match_oracle(reduction, device):
    # 8 queries against 16392 documents (their positives and 16384 shared
    # candidates): rows long enough that the CUDA kernels split each row over
    # several thread groups and merge the parts in a second launch. (Fewer
    # under Triton's interpreter, whose kernels do not split.)
    gen = torch.Generator().manual_seed(16384)
    q = torch.randn(8, 8, generator=gen)
    p = torch.randn(8, 8, generator=gen)
    n = torch.randn(1024 if INTERPRETED else 16384, 8, generator=gen)
    grad = torch.rand(8, generator=gen) if reduction == "none" else torch.tensor(1.0)
    leaves = [t.to(device).requires_grad_(True) for t in (q, p, n)]
    loss = nf.mnr_loss(*leaves, scale=20.0, reduction=reduction)
    grads = torch.autograd.grad(loss, leaves, grad.to(device))
    ref_leaves = [t.double().requires_grad_(True) for t in (q, p, n)]
    ref = composed_mnr_loss(*ref_leaves, scale=20.0, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad.double())
    torch.testing.assert_close(loss.detach().cpu().double(), ref.detach(), rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours.cpu().double(), theirs, rtol=1e-4, atol=1e-7)


# --- a loss near 0 --------------------------------------------------------------------

def test_one_row_loss_is_exactly_zero(device):
    # B = 1 with query_to_doc only: log(exp(t)) - t, exactly 0 for any embeddings.
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        q, p = (torch.randn(1, 48, generator=gen).to(device, dtype) for _ in range(2))
        for scale in (1.0, 20.0, 100.0):
            assert nf.mnr_loss(q, p, scale=scale).item() == 0.0
            assert nf.mnr_loss(q, q, scale=scale).item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("config", [(("query_to_doc",), "joint"),
                                    (("query_to_doc", "doc_to_query"), "per_direction"),
                                    (("query_to_doc", "doc_to_query"), "joint")],
                         ids=["one direction", "symmetric", "symmetric joint"])
@pytest.mark.parametrize("scale", [20.0, 100.0])
def test_loss_near_zero_within_twice_torch(device, dtype, config, scale):
    # Positives equal to the queries (or nearly): the loss is log(1 + tiny), 1e-11
    # at scale 100. Formed from the rows' logsumexps relative to the target logit,
    # its largest error over the rows is at most twice the composed loss's
    # (sentence-transformers', in the same dtype) against the float64 oracle;
    # in float64 (no more precise oracle here) within a few units of rounding.
    directions, partition = config
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    for p in (q, q + 1e-3 * torch.randn(64, 32, generator=gen, dtype=torch.float64)):
        qd, pd = q.to(dtype), p.to(dtype)
        kw = dict(scale=scale, directions=directions, partition_mode=partition, reduction="none")
        ours = nf.mnr_loss(qd.to(device), pd.to(device), **kw).cpu().double()
        exact = composed_mnr_loss(qd.double(), pd.double(), **kw)
        error = float((ours - exact).abs().max())
        if dtype == torch.float64:
            assert error <= 64 * torch.finfo(dtype).eps * (1 + float(exact.abs().max())), error
        else:
            theirs = composed_mnr_loss(qd, pd, **kw).double()
            assert error <= 2 * float((theirs - exact).abs().max()) + 1e-30, \
                (error, float((theirs - exact).abs().max()))
