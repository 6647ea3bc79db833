"""mnr_loss with gather_across_devices=True on two CPU processes (gloo): each
rank scores its own queries against every rank's documents, and gradients flow
back to the rank that owns the rows. Checked against sentence-transformers'
MultipleNegativesRankingLoss run the same way (when it is installed) and against
the composed oracle on the whole batch (always): per rank, the loss value; per
rank's local embeddings, the gradient of the sum of every rank's loss (what
torch.distributed.nn.all_gather's backward hands each rank)."""

import datetime
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mnr_oracle import composed_mnr_loss

import nanfree.nn as nfnn
import nanfree.ops as nf

WORLD = 2
B, D = 4, 8  # rows per rank, embedding size
ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

# name: (mnr_loss keyword arguments, hard negatives per query, shared negatives per rank)
CASES = {
    "plain": ({}, 0, 0),
    "hard negatives": ({}, 2, 0),
    "symmetric": (dict(symmetric=True), 0, 0),
    "all directions joint": (dict(directions=ALL), 2, 0),
    "hardness": (dict(hardness_mode="all_negatives", hardness_strength=3.0), 1, 0),
    "hard negatives, hardness": (dict(directions=ALL, hardness_mode="hard_negatives",
                                      hardness_strength=2.0), 2, 0),
}
# Only the op takes shared candidates and other reductions (oracle variant only).
ORACLE_CASES = {
    **CASES,
    "shared negatives": (dict(directions=("query_to_doc", "doc_to_query")), 0, 3),
    "sum": (dict(reduction="sum", scale=7.0), 1, 0),
}


def _global_columns(k, shared, seed):
    """Every rank's rows (the same on every rank): queries, positives [W*B, d],
    hard negatives [W*B, k, d] or None, shared negatives [W*shared, d] or None."""
    gen = torch.Generator().manual_seed(seed)
    n = WORLD * B
    q = torch.randn(n, D, generator=gen, dtype=torch.float64)
    p = q + 0.8 * torch.randn(n, D, generator=gen, dtype=torch.float64)
    hard = q[:, None] + torch.randn(n, k, D, generator=gen, dtype=torch.float64) if k else None
    extra = torch.randn(WORLD * shared, D, generator=gen, dtype=torch.float64) if shared else None
    return q, p, hard, extra


def _local(t, rank, rows):
    return None if t is None else t[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)


def _leaves(*ts):
    return [t for t in ts if t is not None]


def _oracle(q, p, hard, extra, rank, kwargs):
    """(rank's loss, gradients of the sum of every rank's loss w.r.t. this rank's
    rows of q, p, hard, extra), from the composed loss on the whole batch."""
    kwargs = dict(kwargs)
    if kwargs.pop("symmetric", False):
        kwargs.update(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
    leaves = [t.clone().requires_grad_(True) for t in _leaves(q, p, hard, extra)]
    gq, gp, rest = leaves[0], leaves[1], leaves[2:]
    negatives = rest[0] if rest else None
    per_rank = [composed_mnr_loss(gq, gp, negatives, offset=s * B, local_rows=B, **kwargs)
                for s in range(WORLD)]
    grads = torch.autograd.grad(sum(v.sum() for v in per_rank), leaves)
    rows = [B, B] + ([B] if hard is not None else []) + \
        ([extra.shape[0] // WORLD] if extra is not None else [])
    return per_rank[rank].detach(), [g[rank * r:(rank + 1) * r] for g, r in zip(grads, rows)]


def _check(failures, name, got, want):
    try:
        torch.testing.assert_close(got, want)
    except AssertionError as error:
        failures.append(f"{name}: {error}")


def _worker(rank, init_file, use_sentence_transformers):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    failures = []
    try:
        cases = CASES if use_sentence_transformers else ORACLE_CASES
        if use_sentence_transformers:
            from sentence_transformers.sentence_transformer.losses import (
                MultipleNegativesRankingLoss)
        for seed, (name, (kwargs, k, shared)) in enumerate(cases.items()):
            q, p, hard, extra = _global_columns(k, shared, seed)
            lq, lp, lh, le = (_local(q, rank, B), _local(p, rank, B), _local(hard, rank, B),
                              _local(extra, rank, shared))
            leaves = _leaves(lq, lp, lh, le)
            loss = nf.mnr_loss(lq, lp, lh if lh is not None else le, gather_across_devices=True,
                               **kwargs)
            reduced = loss.sum() if loss.dim() else loss
            got_grads = torch.autograd.grad(reduced, leaves)
            if use_sentence_transformers:
                st_kwargs = dict(kwargs)
                if st_kwargs.pop("symmetric", False):
                    st_kwargs.update(directions=("query_to_doc", "doc_to_query"),
                                     partition_mode="per_direction")
                columns = [lq, lp] + ([] if lh is None else list(lh.unbind(1)))
                columns = [c.detach().clone().requires_grad_(True) for c in columns]
                theirs = MultipleNegativesRankingLoss(torch.nn.Identity(),
                                                      gather_across_devices=True, **st_kwargs)
                want = theirs.compute_loss_from_embeddings(columns, None)
                grads = torch.autograd.grad(want, columns)
                want_grads = list(grads[:2]) + ([torch.stack(grads[2:], 1)] if lh is not None
                                                else [])
                # nanfree's module, fused (cosine) and composed (another similarity).
                ours = nfnn.MultipleNegativesRankingLoss(None, gather_across_devices=True,
                                                         **st_kwargs)
                module_loss = ours.compute_loss_from_embeddings(columns, None)
                _check(failures, f"{name} module", module_loss, want)
                module_grads = torch.autograd.grad(module_loss, columns)
                for i, (g, w) in enumerate(zip(module_grads, grads)):
                    _check(failures, f"{name} module grad {i}", g, w)
            else:
                want, want_grads = _oracle(q, p, hard, extra, rank, kwargs)
            _check(failures, f"{name} loss", loss, want)
            for i, (g, w) in enumerate(zip(got_grads, want_grads)):
                _check(failures, f"{name} grad {i}", g, w)
        if use_sentence_transformers:
            _composed_fallback(rank, failures, MultipleNegativesRankingLoss)
    finally:
        dist.destroy_process_group()
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    _exit_without_finalizing()


def _exit_without_finalizing():
    """Ends a rank that passed with exit code 0, skipping Python's finalization.
    A gloo worker thread can still be releasing the last reference to a finished
    collective's work object (the all_gather backward's scatter, whose captured
    thread-local state holds a Python object) while the interpreter finalizes:
    the thread then cannot take the GIL, unwinds through a noexcept destructor
    and the rank aborts (std::terminate, SIGABRT) after its checks passed. Seen
    with torch 2.14.1 in about one run in five of this module; a failing rank
    raises before this and is reported by mp.spawn as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def dot_score(a, b):
    return a @ b.T


def _composed_fallback(rank, failures, st_loss_class):
    """A non-cosine similarity takes nanfree's composed path: gathered as
    sentence-transformers gathers."""
    q, p, hard, _ = _global_columns(1, 0, 99)
    columns = [_local(q, rank, B), _local(p, rank, B), _local(hard[:, 0], rank, B)]
    kwargs = dict(scale=1.0, similarity_fct=dot_score, gather_across_devices=True,
                  directions=ALL, hardness_mode="in_batch_negatives", hardness_strength=0.5)
    values, grads = [], []
    for loss_class in (nfnn.MultipleNegativesRankingLoss, st_loss_class):
        leaves = [c.detach().clone().requires_grad_(True) for c in columns]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nanfree's "not cosine" note
            value = loss_class(None, **kwargs).compute_loss_from_embeddings(leaves, None)
        values.append(value)
        grads.append(torch.autograd.grad(value, leaves))
    _check(failures, "composed fallback loss", values[0], values[1])
    for i, (g, w) in enumerate(zip(*grads)):
        _check(failures, f"composed fallback grad {i}", g, w)


def _spawn(tmp_path, use_sentence_transformers):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    init_file = tmp_path / "init"
    mp.spawn(_worker, args=(str(init_file), use_sentence_transformers), nprocs=WORLD,
             join=True)


def test_gathered_matches_composed_oracle(tmp_path):
    _spawn(tmp_path, use_sentence_transformers=False)


def test_gathered_matches_sentence_transformers(tmp_path):
    pytest.importorskip("sentence_transformers")
    _spawn(tmp_path, use_sentence_transformers=True)


def test_gather_without_process_group_is_local():
    """Without torch.distributed initialized, gathering changes nothing (as in
    sentence-transformers: the local batch is the whole batch)."""
    q, p, hard, _ = _global_columns(2, 0, 5)
    for kwargs in (dict(), dict(directions=ALL)):
        torch.testing.assert_close(nf.mnr_loss(q, p, hard, gather_across_devices=True, **kwargs),
                                   nf.mnr_loss(q, p, hard, **kwargs))



# Per case, what rank 1 holds differently from rank 0 (B = 4, d = 8, float32, no negatives).
UNEQUAL = {
    "batch size": dict(b=3),
    "embedding size": dict(d=6),
    "dtype": dict(dtype=torch.float64),
    "hard negatives": dict(k=1),
    "hard negative count": dict(k=2, k0=1),
    "shared negatives": dict(shared=2, shared0=3),
}


def _unequal_worker(rank, init_file):
    """Each case: both ranks must raise the same ValueError (no crash, no hang)
    before any data is gathered; then a gathered call with equal ranks works."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    failures = []
    try:
        for name, case in UNEQUAL.items():
            mine = case if rank == 1 else {k[:-1]: v for k, v in case.items() if k.endswith("0")}
            b, d = mine.get("b", B), mine.get("d", D)
            dtype = mine.get("dtype", torch.float32)
            q, p = torch.randn(b, d, dtype=dtype), torch.randn(b, d, dtype=dtype)
            negatives = None
            if mine.get("k"):
                negatives = torch.randn(b, mine["k"], d, dtype=dtype)
            elif mine.get("shared"):
                negatives = torch.randn(mine["shared"], d, dtype=dtype)
            try:
                nf.mnr_loss(q, p, negatives, gather_across_devices=True)
                failures.append(f"{name}: no error")
            except ValueError as error:
                if "the same batch size, embedding size, negatives and dtype" not in str(error) \
                        or "rank 1:" not in str(error):
                    failures.append(f"{name}: unclear error {error}")
        q, p = torch.randn(B, D), torch.randn(B, D)
        with warnings.catch_warnings():
            # A gathered call warns nothing (torch's deprecated collectives did).
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", UserWarning)
            loss = nf.mnr_loss(q.requires_grad_(True), p, gather_across_devices=True)
            loss.backward()
        if not torch.isfinite(loss):
            failures.append(f"equal ranks: loss {loss}")
    finally:
        dist.destroy_process_group()
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    _exit_without_finalizing()


def test_unequal_ranks_are_refused_on_every_rank(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_unequal_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)
