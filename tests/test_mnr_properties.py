"""Property tests of the MNR loss (nanfree.ops.mnr_loss) over random batches
(B in 1..8 queries, 0..3 hard negatives each or 0..5 shared candidates, d in
1..16, every dtype, scale 0.05..1e4 as a float or a tensor, random direction
sets, partition and hardness modes and reductions) whose rows may be zero,
duplicated, huge, tiny or subnormal: no NaN and no infinity in the loss or any
gradient; where sentence-transformers' composition (tests/mnr_oracle.py run in
the input dtype) is finite, nanfree's error against the float64 oracle is at
most 2x torch's own plus a rounding floor (DESIGN.md 1.4), for the loss and
every gradient; a NaN query reaches only the rows that see it; permuting the
(query, positive, negatives) triples permutes the per-row losses and the
gradients; and the backward saves nothing of the size of the [B, M] logit
matrix. The special-value table itself is test_mnr_special_values.py."""

import math

import pytest
import torch
from conftest import DEVICES, DTYPES, INTERPRETED, SERVING, acc_dtype
from memory_checks import cpu_allocated_bytes, cpu_allocations_at_least, saved_sizes
from hypothesis import given, settings
from hypothesis import strategies as st
from mnr_oracle import composed_mnr_loss

import nanfree.ops as nf

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]
COS_EPS = 1e-12  # cos_sim's eps
# Magnitudes near each dtype's limits (float16: squares past 65504) and far
# below 1 (float16: squares below its subnormals).
HUGE = {torch.float16: 6e4, torch.bfloat16: 1e38, torch.float32: 1e38, torch.float64: 1e300}
SMALL = {torch.float16: 1e-4, torch.bfloat16: 1e-30, torch.float32: 1e-30, torch.float64: 1e-300}
FEWER_EXAMPLES = settings(max_examples=max(5, settings().max_examples // 2))


# --- batches --------------------------------------------------------------------------


class Problem:
    """Embeddings (float64 tensors of values the dtype holds) and options."""

    def __init__(self, dtype, q, p, n, scale, scale_kind, options):
        self.dtype = dtype
        self.q, self.p, self.n = q, p, n
        self.scale, self.scale_kind = scale, scale_kind
        self.options = options

    def __repr__(self):
        n = None if self.n is None else list(self.n.shape)
        return (f"Problem({self.dtype}, q={self.q.tolist()}, p={self.p.tolist()}, "
                f"n{n}={None if self.n is None else self.n.tolist()}, scale={self.scale} "
                f"({self.scale_kind}), {self.options})")

    @property
    def scale_eff(self):
        return self.scale + self.options.get("hardness_strength", 0.0)

    def embeddings(self):
        return [t for t in (self.q, self.p, self.n) if t is not None]


def _row(kind, d, dtype, gen):
    z = torch.randn(d, generator=gen, dtype=torch.float64)
    if kind == "zero":
        return torch.zeros(d, dtype=torch.float64)
    if kind == "huge":
        return z / z.abs().max() * HUGE[dtype]
    if kind == "tiny":
        return z * SMALL[dtype]
    if kind == "subnormal":
        return torch.round(z * 3) * (torch.finfo(dtype).tiny / 8)
    if kind == "spike":  # one huge entry among ordinary ones
        z[int(torch.randint(d, (1,), generator=gen))] = HUGE[dtype] / 2
        return z
    return z


@st.composite
def problems(draw, dtypes=DTYPES, max_b=8):
    dtype = draw(st.sampled_from(dtypes))
    b = draw(st.integers(1, max_b))
    d = draw(st.integers(1, 16))
    negatives = draw(st.sampled_from(["none", "hard", "shared"]))
    k = draw(st.integers(0, 3)) if negatives == "hard" else 0
    n_shared = draw(st.integers(0, 5)) if negatives == "shared" else 0
    count = 2 * b + b * k + n_shared
    kinds = draw(st.lists(st.sampled_from(["normal"] * 4 + ["zero", "duplicate", "huge", "tiny",
                                                            "subnormal", "spike"]),
                          min_size=count, max_size=count))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = []
    for i, kind in enumerate(kinds):
        if kind == "duplicate" and rows:
            rows.append(rows[int(torch.randint(len(rows), (1,), generator=gen))].clone())
        else:
            rows.append(_row(kind, d, dtype, gen))
    values = torch.stack(rows).to(dtype).double()
    q, p, rest = values[:b], values[b:2 * b], values[2 * b:]
    n = rest.reshape(b, k, d) if negatives == "hard" else (rest if negatives == "shared" else None)
    scale = draw(st.one_of(st.sampled_from([0.05, 1.0, 20.0, 100.0, 1e4]),
                           st.floats(0.05, 1e4)))
    scale_kind = draw(st.sampled_from(["float", "tensor []", "tensor [1]"]))
    directions = ("query_to_doc",) + tuple(x for x in ALL[1:] if draw(st.booleans()))
    per_direction = not ({"query_to_query", "doc_to_doc"} & set(directions)) and \
        draw(st.booleans())
    hardness = draw(st.sampled_from(HARDNESS))
    options = dict(directions=directions,
                   partition_mode="per_direction" if per_direction else "joint",
                   hardness_mode=hardness,
                   hardness_strength=draw(st.sampled_from([0.5, 4.0])) if hardness else 0.0,
                   reduction=draw(st.sampled_from(["mean", "sum", "none"])))
    return Problem(dtype, q, p, n, scale, scale_kind, options)


def _upstream(problem):
    if problem.options["reduction"] != "none":
        return torch.tensor(1.0, dtype=torch.float64)
    b = problem.q.shape[0]
    g = torch.cos(torch.arange(b, dtype=torch.float64) * 1.3 + 0.2)
    return torch.where(g.abs() < 0.1, 0.1, g).to(torch.bfloat16).double()


def _run(fn, problem, dtype, device, upstream, options=None):
    """(loss, [grads of the embeddings, then of a tensor scale]) of fn, on
    leaves of `dtype`, as float64 CPU tensors."""
    leaves = [t.detach().clone().to(dtype).to(device).requires_grad_(True)
              for t in problem.embeddings()]
    q, p, *rest = leaves
    n = rest[0] if rest else None
    scale = problem.scale
    if problem.scale_kind != "float":
        shape = () if problem.scale_kind == "tensor []" else (1,)
        scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        scale = torch.full(shape, problem.scale, dtype=scale_dtype, device=device,
                           requires_grad=True)
        leaves.append(scale)
    loss = fn(q, p, n, scale=scale, **(options or problem.options))
    # (Empty negatives [B, 0, d] take no part in the graph, in torch's composition too.)
    grads = torch.autograd.grad(loss, leaves, upstream.reshape(loss.shape).to(loss.dtype)
                                .to(device), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None and t.numel() == 0 else g
             for g, t in zip(grads, leaves)]
    return loss.detach().cpu().double(), [g.cpu().double() for g in grads], loss, grads


def _oracle(problem, dtype, upstream):
    """The composition at `dtype`: torch's own."""
    return _run(composed_mnr_loss, problem, dtype, "cpu", upstream)[:2]


def _row_powers(t):
    """Per row of t, the power of two 2^-e that brings a row whose largest
    magnitude is above 1 into [1, 2) (exact); 1 for the others."""
    amax = t.abs().amax(dim=-1, keepdim=True) if t.shape[-1] else torch.zeros(t.shape[:-1] + (1,))
    e = torch.where(amax > 1, torch.floor(torch.log2(amax.clamp_min(1))), 0.0)
    return torch.exp2(-e)


def _reference(problem, upstream):
    """The float64 oracle, exact where float64's composition is not: rows past
    float64's square range (1e300) are scaled by a power of two first; the unit
    vectors are the same (a row of norm above 1 is far above eps), the
    gradients scale back by the same power."""
    powers = [_row_powers(t) for t in problem.embeddings()]
    scaled = Problem(torch.float64, *(t * w for t, w in zip(problem.embeddings(), powers)),
                     *([None] if problem.n is None else []), problem.scale, problem.scale_kind,
                     problem.options)
    loss, grads = _run(composed_mnr_loss, scaled, torch.float64, "cpu", upstream)[:2]
    return loss, [g * w for g, w in zip(grads, powers)] + grads[len(powers):]


def _below_eps(t):
    """Rows (of a [..., d] tensor) that cos_sim's eps takes as directionless:
    their gradient is 0 by design (torch: x / eps, 1e12)."""
    return torch.linalg.vector_norm(t, dim=-1) < COS_EPS


# --- no NaN, no infinity ---------------------------------------------------------------


def _amax(t):
    return t.abs().max().item() if t.numel() else 0.0


def _error(got, ref):
    return _amax(got - ref)


def _floors(problem, ref_loss, ref_grads, upstream):
    """One rounding of the dtype at the loss's magnitude and at the logits'
    (scale * cos: the unit vectors are held in the dtype); for a gradient, a
    few at its magnitude and at that of the unit vectors' gradient through
    normalize (scale * the incoming gradients / the smallest norm: a gradient
    that cancels to about 0, as in d = 1, is reached through terms that large,
    times the logits' magnitude for the softmax weights' error); for the
    scale's, one at the logits' magnitude (the softmax weights' error)."""
    eps = torch.finfo(problem.dtype).eps
    loss_floor = 2 * eps * (_amax(ref_loss) + problem.scale_eff)
    rows = problem.q.shape[0]
    incoming = float(upstream.abs().sum()) * (rows if problem.options["reduction"] == "sum"
                                              else 1)
    grad_floors = []
    for i, g in enumerate(ref_grads):
        magnitude = max(1.0, _amax(g))
        if i == len(problem.embeddings()):
            # The scale's: sum of softmax * cos per row, the softmax off by the
            # logits' rounding (scale * eps) at most.
            magnitude += 0.5 * problem.scale_eff * incoming
        else:
            t = problem.embeddings()[i]
            norms = torch.linalg.vector_norm(t, dim=-1)
            norms = norms[norms >= COS_EPS]
            if norms.numel():
                # (and the softmax weights off by the logits' rounding: scale * eps)
                magnitude = max(magnitude, 2 * problem.scale_eff * (1 + problem.scale_eff)
                                * incoming / norms.min().item())
        grad_floors.append(4 * eps * magnitude)
    return loss_floor, grad_floors


def _check(problem, device):
    dtype = problem.dtype
    upstream = _upstream(problem)
    loss, grads, raw_loss, raw_grads = _run(nf.mnr_loss, problem, dtype, device, upstream)
    # Half inputs give a float32 loss; gradients come back in their inputs' dtypes.
    assert raw_loss.dtype == acc_dtype(dtype)
    for g, t in zip(raw_grads, problem.embeddings()):
        assert g.dtype == dtype and g.shape == t.shape
    if problem.scale_kind != "float":
        assert raw_grads[-1].dtype == acc_dtype(dtype)
    assert torch.isfinite(loss).all(), f"loss {loss}"
    for i, g in enumerate(grads):
        assert torch.isfinite(g).all(), f"gradient {i}: {g}"
    for g, t in zip(grads, problem.embeddings()):
        assert (g[_below_eps(t)] == 0).all(), "a row below eps has gradient 0"

    # The 2x-torch-error rule, where torch's composition is finite.
    ref_loss, ref_grads = _reference(problem, upstream)
    t_loss, t_grads = _oracle(problem, dtype, upstream)
    if not (torch.isfinite(t_loss).all() and all(torch.isfinite(g).all() for g in t_grads)):
        return
    loss_floor, grad_floors = _floors(problem, ref_loss, ref_grads, upstream)
    n_err, t_err = _error(loss, ref_loss), _error(t_loss, ref_loss)
    assert n_err <= 2 * t_err + loss_floor, \
        f"loss error {n_err} vs torch {t_err} (floor {loss_floor}): {loss} vs {ref_loss}"
    masks = [~_below_eps(t) for t in problem.embeddings()] + [None]
    for i, (ours, theirs, ref, floor, keep) in enumerate(zip(grads, t_grads, ref_grads,
                                                             grad_floors, masks)):
        if keep is not None:  # rows below eps are 0 by design
            ours, theirs, ref = ours[keep], theirs[keep], ref[keep]
        n_err, t_err = _error(ours, ref), _error(theirs, ref)
        assert n_err <= 2 * t_err + floor, \
            f"gradient {i}: error {n_err} vs torch {t_err} (floor {floor})"


@pytest.mark.parametrize("device", DEVICES)
@given(problem=problems())
def test_finite_and_at_most_twice_torch_error(device, problem):
    _check(problem, device)


@pytest.mark.parametrize("device", DEVICES)
@given(problem=problems(dtypes=[torch.float16, torch.bfloat16]))
def test_half_inputs(device, problem):
    # Half precision gets its own examples: where overflow and rounding bite.
    _check(problem, device)


# --- NaN reaches only the rows that see it -----------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@FEWER_EXAMPLES
@given(problem=problems(), data=st.data())
def test_nan_query_reaches_only_its_rows(device, problem, data):
    b, d = problem.q.shape
    row = data.draw(st.integers(0, b - 1))
    problem.q[row, data.draw(st.integers(0, d - 1))] = math.nan
    options = dict(problem.options, reduction="none")
    loss = _run(nf.mnr_loss, problem, problem.dtype, device, torch.ones(b, dtype=torch.float64),
                options)[0]
    sees_queries = {"query_to_query", "doc_to_query"} & set(options["directions"])
    expected = torch.ones(b, dtype=torch.bool) if sees_queries else \
        torch.arange(b) == row
    assert torch.isnan(loss).eq(expected).all(), f"NaN rows {torch.isnan(loss)}"
    assert not torch.isinf(loss).any()


# --- permutation equivariance ---------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@FEWER_EXAMPLES
@given(problem=problems(), data=st.data())
def test_permuting_the_batch_permutes_the_losses(device, problem, data):
    b = problem.q.shape[0]
    perm = torch.tensor(data.draw(st.permutations(range(b))), dtype=torch.long)
    problem.options["reduction"] = "none"
    upstream = _upstream(problem)
    loss, grads = _run(nf.mnr_loss, problem, problem.dtype, device, upstream)[:2]
    # The triple (query, positive, hard negatives) of row i moves to row perm^-1(i);
    # shared candidates stay; the incoming gradient moves with its row.
    moved = Problem(problem.dtype, problem.q[perm], problem.p[perm],
                    problem.n[perm] if problem.n is not None and problem.n.dim() == 3
                    else problem.n, problem.scale, problem.scale_kind, problem.options)
    m_loss, m_grads = _run(nf.mnr_loss, moved, problem.dtype, device, upstream[perm])[:2]
    # The same sums in another order: a few roundings of the accumulation type.
    eps = torch.finfo(acc_dtype(problem.dtype)).eps
    tol = 16 * eps * (problem.scale_eff + _amax(loss) + 1)
    torch.testing.assert_close(m_loss, loss[perm], rtol=0, atol=tol)
    hard = problem.n is not None and problem.n.dim() == 3
    moves = [True, True] + ([hard] if problem.n is not None else []) + \
        ([False] if problem.scale_kind != "float" else [])
    for g, mg, move in zip(grads, m_grads, moves):
        gtol = 16 * torch.finfo(problem.dtype).eps * max(1.0, _amax(g))
        torch.testing.assert_close(mg, g[perm] if move else g, rtol=0, atol=gtol)


# --- memory: nothing of the logit matrix's size is saved -------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("directions", [("query_to_doc",), ALL], ids=["query_to_doc", "all"])
def test_backward_saves_nothing_of_the_logit_size(device, reduction, directions):
    # B queries, B(1 + k) docs: the logit matrices are [B, B(1 + k)] (and
    # [B, B(2 + k)] with every direction), far above max(R, M) * d.
    b, k, d = (20, 3, 4) if INTERPRETED else (48, 3, 4)
    gen = torch.Generator().manual_seed(0)
    q, p = (torch.randn(b, d, generator=gen).to(device).requires_grad_(True) for _ in range(2))
    n = torch.randn(b, k, d, generator=gen).to(device).requires_grad_(True)
    scale = torch.tensor(20.0, device=device, requires_grad=True)
    m = b * (1 + k)
    bound = max(max(b, m) * d, 2 * b)
    assert b * m > 4 * bound
    loss, sizes = saved_sizes(lambda: nf.mnr_loss(q, p, n, scale=scale, directions=directions,
                                                   reduction=reduction))
    assert sizes and max(sizes) <= bound, f"saved tensors of {sorted(sizes)[-3:]} elements"
    # And the gradients are those of the composition.
    grads = torch.autograd.grad(loss.sum(), (q, p, n, scale))
    cpu = [t.detach().cpu().double().requires_grad_(True) for t in (q, p, n, scale)]
    ref = composed_mnr_loss(*cpu[:3], scale=cpu[3], directions=directions, reduction=reduction)
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), cpu)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("negatives", ["[B, k, d]", "columns", "shared"])
def test_documents_are_read_in_place(device, reduction, negatives):
    # The op takes the positives and the negatives as they are (its docs are a
    # list of blocks): the recomputing path (reduction 'none') saves the
    # caller's tensors themselves, never a concatenation of them (the other
    # saves the docs' gradient for an upstream 1, which it needs), and their
    # gradients are views of one [M, d] gradient (no stacked copy for a
    # [B, k, d] negatives, none for k columns [B, d]).
    b, k, d = 6, 3, 5
    gen = torch.Generator().manual_seed(3)
    q, p = (torch.randn(b, d, generator=gen).to(device).requires_grad_(True) for _ in range(2))
    shape = (b, d) if negatives == "columns" else (b, k, d) if negatives == "[B, k, d]" else (7, d)
    ns = [torch.randn(*shape, generator=gen).to(device).requires_grad_(True)
          for _ in range(k if negatives == "columns" else 1)]
    n = ns if negatives == "columns" else ns[0]
    packed = []  # every tensor the loss's node saves
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        loss = nf.mnr_loss(q, p, n, reduction=reduction)
    if reduction == "none":
        saved = [t for t in packed if t is not None]
        docs_sized = [t.shape for t in saved if t.numel() >= p.numel() + ns[0].numel()]
        assert not docs_sized, f"saved tensors of the docs' size: {docs_sized}"
        pointers = {t.data_ptr() for t in saved}
        assert p.data_ptr() in pointers and all(t.data_ptr() in pointers for t in ns)
    gp, *gns = torch.autograd.grad(loss.sum(), (p, *ns))
    assert all(gp.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() for g in gns)
    stacked = torch.stack(ns, 1) if negatives == "columns" else ns[0]
    cpu = [t.detach().cpu().double().requires_grad_(True) for t in (q, p, stacked)]
    ref = composed_mnr_loss(*cpu, reduction=reduction)
    gn = torch.stack(gns, 1) if negatives == "columns" else gns[0]
    for got, want in zip((gp, gn), torch.autograd.grad(ref.sum(), cpu[1:])):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(SERVING["cpu"] != "cpu", reason="the CPU kernels' chunk size (the CUDA "
                    "kernels run the same driver in several chunks in the grid-capped emulated pass)")
def test_query_gradient_streams_without_a_float_accumulator():
    # Queries that are rows only are normalized chunk by chunk and get their
    # whole gradient within their chunk: finished there, with no [B, d]
    # normalized copy or float accumulator. A reduced loss's forward computes
    # the gradients; its [B, d]-sized allocations are the normalized docs, the
    # docs' accumulator and the two gradients (the docs' gradient is finished
    # in blocks, so its rounding and normalize_backward's result are not a
    # fifth and sixth). 2560 rows against 2560 columns are two chunks of the
    # CPU driver's 2^22 scores, each below [B, d].
    b, d = 2560, 2048
    gen = torch.Generator().manual_seed(0)
    q, p = (torch.randn(b, d, generator=gen).requires_grad_(True) for _ in range(2))
    loss, count = cpu_allocations_at_least(lambda: nf.mnr_loss(q, p), b * d * 4)
    assert count == 4, count
    # The streamed gradient against the composed loss's.
    grads = torch.autograd.grad(loss, (q, p))
    q64, p64 = (t.detach().double().requires_grad_(True) for t in (q, p))
    ref = composed_mnr_loss(q64, p64, None, scale=20.0)
    for got, want in zip(grads, torch.autograd.grad(ref, (q64, p64))):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-7)


def test_reduced_backward_allocates_each_gradient_once():
    # With a reduced loss the forward already holds the gradients of an
    # upstream 1; the backward's only sizable allocations are the gradients it
    # returns (scaled and saturated in place; no zero gradients materialized for
    # the op's other outputs), and for an upstream 1 on the CPU (backward() of
    # the loss itself) none: it returns the gradients the forward made.
    gen = torch.Generator().manual_seed(0)
    q, p = (torch.randn(64, 32, generator=gen).requires_grad_(True) for _ in range(2))
    for upstream in (2.0, 1.0):
        loss = nf.mnr_loss(q, p)
        grads, allocated = cpu_allocated_bytes(
            lambda: torch.autograd.grad(loss, (q, p), torch.tensor(upstream)))
        gradient_bytes = sum(g.numel() * g.element_size() for g in grads)
        if upstream == 1.0:
            assert allocated < 0.05 * gradient_bytes, (allocated, gradient_bytes)
        else:
            assert gradient_bytes <= allocated <= 1.25 * gradient_bytes, (allocated, gradient_bytes)


def test_gradients_handed_out_for_an_upstream_one_keep_retained_graphs_safe():
    # The backward for an upstream 1 on the CPU returns the gradients the
    # forward saved. Without retain_graph they are the caller's alone; with it,
    # backward() twice accumulates correctly, and a gradient modified in place
    # before differentiating again fails autograd's version check (never a
    # silently changed second gradient).
    gen = torch.Generator().manual_seed(1)
    q, p = (torch.randn(16, 8, generator=gen).requires_grad_(True) for _ in range(2))
    loss = nf.mnr_loss(q, p)
    loss.backward(retain_graph=True)
    first = q.grad.clone()
    loss.backward()
    torch.testing.assert_close(q.grad, 2 * first)
    loss = nf.mnr_loss(q, p)
    (gq,) = torch.autograd.grad(loss, (q,), retain_graph=True)
    torch.testing.assert_close(gq, first)
    gq.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, (q,))
    loss = nf.mnr_loss(q, p)
    (gq,) = torch.autograd.grad(loss, (q,))
    gq.mul_(2)  # the caller's own: nothing else reads it
    torch.testing.assert_close(gq, 2 * first)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("negatives", [0, 1])
def test_bfloat16_gradients_saturate_and_match_the_oracle(device, negatives):
    """bfloat16 embeddings: the gradient GEMMs take scale * dlogit rounded to
    bfloat16 (the CPU's MKL bfloat16 GEMM, CUDA's mm.dtype), saturated first, so
    a huge upstream gradient at scale 1e4 gives finite (saturated) gradients, and
    an ordinary one loss and gradients within 2x the composed bfloat16 loss's error."""
    gen = torch.Generator().manual_seed(3)
    b, d = 96, 40
    q, p, n = (torch.randn(b, d, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    args = (q, p, n) if negatives else (q, p)
    loss = nf.mnr_loss(*args, scale=1e4)
    grads = torch.autograd.grad(loss, args, torch.tensor(3e38, device=device))
    assert all(torch.isfinite(g).all() for g in grads)
    loss = nf.mnr_loss(*args, scale=20.0)
    grads = torch.autograd.grad(loss, args)

    def composed(tensors):
        return composed_mnr_loss(tensors[0], tensors[1],
                                 tensors[2][:, None] if negatives else None, scale=20.0)

    ref_args = [t.detach().double().requires_grad_(True) for t in args]
    ref = composed(ref_args)
    ref_grads = torch.autograd.grad(ref, ref_args)
    torch_args = [t.detach().clone().requires_grad_(True) for t in args]
    torch_loss = composed(torch_args)
    torch_grads = torch.autograd.grad(torch_loss, torch_args)
    # The 2x-torch-error rule against torch's composed bfloat16 loss.
    assert abs(loss.double() - ref) <= 2 * abs(torch_loss.double() - ref)
    for g, t, r in zip(grads, torch_grads, ref_grads):
        assert (g.double() - r).abs().max() <= 2 * (t.double() - r).abs().max()
