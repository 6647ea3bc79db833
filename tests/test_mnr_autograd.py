"""float64 gradcheck, torch.library.opcheck and torch.compile(fullgraph=True) of
the MNR loss (nanfree.ops.mnr_loss, the ops nanfree::mnr_loss and
nanfree::mnr_loss_backward): gradients of queries, positives, hard negatives
[B, k, d] and shared candidates [N, d] and of a tensor scale, for every
reduction and several direction sets, through both autograd paths (the
gradients the forward computes when the loss is a scalar, the recomputing
mnr_loss_backward otherwise); with a hardness mode (its term carries no
gradient, so gradcheck does not apply) against autograd of the float64
oracle; the scale's gradient in the scale's shape and dtype; double backward
refused."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, INTERPRETED
from mnr_oracle import composed_mnr_loss
from torch.library import opcheck

import nanfree.ops as nf

# Under Triton's interpreter every kernel launch runs in numpy: gradcheck's
# fast mode checks a random projection of the Jacobian.
GRADCHECK = dict(fast_mode=INTERPRETED)
ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
OPS = torch.ops.nanfree
HARDNESS = ["in_batch_negatives", "hard_negatives", "all_negatives"]


def _embeddings(b=3, k=2, d=4, n_shared=None, device="cpu", seed=0, dtype=torch.float64):
    """Leaves: queries, positives near them, and k hard negatives [b, k, d] (or
    n_shared candidates [N, d]; None when both are 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=gen, dtype=torch.float64)
    p = q + 0.8 * torch.randn(b, d, generator=gen, dtype=torch.float64)
    if n_shared is not None:
        n = torch.randn(n_shared, d, generator=gen, dtype=torch.float64)
    elif k:
        n = q[:, None] + 1.2 * torch.randn(b, k, d, generator=gen, dtype=torch.float64)
    else:
        n = None
    return [t.to(device, dtype).requires_grad_(True) if t is not None else None
            for t in (q, p, n)]


def _scale(kind, device, dtype=torch.float64, value=7.0):
    if kind == "float":
        return value
    shape = () if kind == "tensor []" else (1,)
    return torch.full(shape, value, dtype=dtype, device=device, requires_grad=True)


def _oracle_options(options):
    options = dict(options)
    if options.pop("symmetric", False):
        options.update(directions=("query_to_doc", "doc_to_query"),
                       partition_mode="per_direction")
    return options


# --- gradcheck ----------------------------------------------------------------------

# name: (negatives: "hard" [B, k, d] / "shared" [N, d] / None, scale kind, options)
GRADCHECK_CASES = {
    "query_to_doc, hard negatives, mean": ("hard", "tensor []", dict(reduction="mean")),
    "query_to_doc, none": (None, "tensor [1]", dict(reduction="none")),
    "every direction, hard negatives, sum": ("hard", "tensor []",
                                             dict(directions=ALL, reduction="sum")),
    "every direction, shared, none": ("shared", "tensor [1]",
                                      dict(directions=ALL, reduction="none")),
    "symmetric, hard negatives, none": ("hard", "tensor []",
                                       dict(symmetric=True, reduction="none")),
    "symmetric, shared, mean": ("shared", "float", dict(symmetric=True)),
    "query_to_query, mean": (None, "tensor [1]",
                             dict(directions=("query_to_doc", "query_to_query"))),
    "doc_to_doc, hard negatives, none": ("hard", "float",
                                         dict(directions=("query_to_doc", "doc_to_doc"),
                                              reduction="none")),
    "doc_to_query joint, shared, sum": ("shared", "tensor []",
                                        dict(directions=("query_to_doc", "doc_to_query"),
                                             reduction="sum")),
    "per_direction query_to_doc, mean": ("hard", "tensor []",
                                         dict(partition_mode="per_direction")),
    "B=1, every direction, none": ("hard1", "tensor []", dict(directions=ALL,
                                                              reduction="none")),
}
INTERPRETED_GRADCHECK_CASES = ["query_to_doc, hard negatives, mean",
                               "every direction, shared, none",
                               "symmetric, hard negatives, none", "B=1, every direction, none"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", INTERPRETED_GRADCHECK_CASES if INTERPRETED else
                         list(GRADCHECK_CASES))
def test_gradcheck_mnr_loss(device, case):
    negatives, scale_kind, options = GRADCHECK_CASES[case]
    b = 1 if negatives == "hard1" else 3
    q, p, n = _embeddings(b=b, k=2 if negatives in ("hard", "hard1") else 0,
                          n_shared=3 if negatives == "shared" else None, device=device)
    scale = _scale(scale_kind, device)
    tensors = [t for t in (q, p, n, scale) if isinstance(t, torch.Tensor)]
    has_n, has_scale = n is not None, isinstance(scale, torch.Tensor)

    def unpack(args):
        args = list(args)
        q, p = args.pop(0), args.pop(0)
        n = args.pop(0) if has_n else None
        s = args.pop(0) if has_scale else scale
        return q, p, n, s

    def fn(*args):
        q, p, n, s = unpack(args)
        return nf.mnr_loss(q, p, n, scale=s, **options)

    def oracle(*args):
        q, p, n, s = unpack(args)
        return composed_mnr_loss(q, p, n, scale=s, **_oracle_options(options))

    torch.testing.assert_close(fn(*tensors), oracle(*tensors))
    assert torch.autograd.gradcheck(fn, tensors, **GRADCHECK)


# --- hardness: gradients against the oracle's autograd --------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("hardness", HARDNESS)
@pytest.mark.parametrize("negatives", ["hard", "shared"])
def test_hardness_gradients_match_oracle(device, hardness, reduction, negatives):
    # The hardness term hardness_strength * cos is detached: the gradients are
    # those of autograd through sentence-transformers' composition.
    q, p, n = _embeddings(b=4, k=2, n_shared=3 if negatives == "shared" else None,
                          device=device, seed=1)
    scale = _scale("tensor []", device, value=10.0)
    directions = ALL if hardness != "hard_negatives" else ("query_to_doc", "doc_to_query")
    options = dict(directions=directions, hardness_mode=hardness, hardness_strength=3.0,
                   reduction=reduction)
    leaves = [q, p, n, scale]
    loss = nf.mnr_loss(q, p, n, scale=scale, **options)
    g = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64, device=device) \
        if reduction == "none" else torch.ones((), dtype=torch.float64, device=device)
    grads = torch.autograd.grad(loss, leaves, g)
    cpu = [t.detach().cpu().requires_grad_(True) for t in leaves]
    ref = composed_mnr_loss(*cpu[:3], scale=cpu[3], **options)
    ref_grads = torch.autograd.grad(ref, cpu, g.cpu())
    torch.testing.assert_close(loss.cpu(), ref.detach())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.cpu(), want)
    # The term matters (shared candidates are nobody's hard negatives: there
    # hard_negatives changes nothing).
    plain = nf.mnr_loss(q, p, n, scale=scale, **dict(options, hardness_mode=None))
    assert torch.allclose(plain, loss) == (negatives == "shared" and hardness == "hard_negatives")


# --- both autograd paths ---------------------------------------------------------------


def _op_args(q, p, n, scale, directions=1, per_direction=False, hardness=0, strength=0.0,
             reduction=1, grad=False, offset=0, rows=None):
    """The op's arguments for the public function's inputs, normalized with
    F.normalize (differentiable, as the oracle's): the docs as nanfree.ops
    passes them, the blocks [B, d] positives, [B, k, d] hard negatives, [N, d]
    shared candidates."""
    docs = [p] + ([n] if n is not None else [])
    owned_blocks = 1 + (n.shape[1] if n is not None and n.dim() == 3 else 0)
    scale_t, scale_value = (scale, 0.0) if isinstance(scale, torch.Tensor) else (None, scale)
    return (F.normalize(q, dim=-1), [F.normalize(block, dim=-1) for block in docs], scale_t,
            scale_value, offset, q.shape[0] if rows is None else rows, owned_blocks, directions,
            per_direction, hardness, strength, reduction, grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", [1, 2])  # mean, sum
def test_both_paths_give_the_same_gradients(device, reduction):
    # grad=True: the forward returns the gradients of an upstream 1 and the
    # backward scales them; grad=False: the backward is mnr_loss_backward.
    q, p, n = _embeddings(b=4, k=2, device=device, seed=2)
    scale = _scale("tensor [1]", device, value=15.0)
    leaves = [q, p, n, scale]
    results = []
    for grad in (True, False):
        args = _op_args(q, p, n, scale, directions=1 | 2 | 4 | 8, hardness=3, strength=1.5,
                        reduction=reduction, grad=grad)
        loss, stats, gq, gd, gs = OPS.mnr_loss(*args)
        if grad:
            docs = sum(block[..., 0].numel() for block in args[1])
            assert gq.shape == args[0].shape and gd.shape == (docs, args[0].shape[1]) and \
                gs.shape == ()
        else:
            assert gq.shape == (0,) and gd.shape == (0,) and gs.shape == (0,)
        # An upstream gradient other than 1.
        results.append((loss, torch.autograd.grad(loss * 1.75, leaves)))
    (loss_t, grads_t), (loss_f, grads_f) = results
    torch.testing.assert_close(loss_t, loss_f, rtol=0, atol=0)
    cpu = [t.detach().cpu().requires_grad_(True) for t in leaves]
    ref = composed_mnr_loss(*cpu[:3], scale=cpu[3], directions=ALL,
                            hardness_mode="all_negatives", hardness_strength=1.5,
                            reduction="mean" if reduction == 1 else "sum")
    ref_grads = torch.autograd.grad(ref * 1.75, cpu)
    torch.testing.assert_close(loss_t.cpu(), ref.detach())
    for a, b, want in zip(grads_t, grads_f, ref_grads):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_public_function_paths(device):
    # nanfree.ops.mnr_loss: a scalar loss takes the forward's gradients, 'none'
    # the recomputing backward; summing the 'none' losses gives the gradients of 'sum'.
    q, p, n = _embeddings(b=5, k=1, device=device, seed=3)
    scale = _scale("tensor []", device, value=20.0)
    leaves = [q, p, n, scale]
    total = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, reduction="sum")
    per_row = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, reduction="none")
    torch.testing.assert_close(per_row.sum(), total)
    for a, b in zip(torch.autograd.grad(total, leaves), torch.autograd.grad(per_row.sum(), leaves)):
        torch.testing.assert_close(a, b)
    # Without grad mode the op computes no gradient, and the result has no graph.
    with torch.no_grad():
        plain = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, reduction="sum")
    assert not plain.requires_grad
    torch.testing.assert_close(plain, total.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["queries", "positives", "negatives", "scale"])
def test_only_some_inputs_require_grad(device, which):
    q, p, n = [t.detach() for t in _embeddings(b=3, k=2, device=device, seed=4)]
    scale = torch.tensor(12.0, dtype=torch.float64, device=device)
    inputs = dict(queries=q, positives=p, negatives=n, scale=scale)
    leaf = inputs[which].requires_grad_(True)
    for reduction in ("mean", "none"):
        loss = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, reduction=reduction)
        (grad,) = torch.autograd.grad(loss.sum(), leaf)
        cpu = {k: v.detach().cpu().requires_grad_(k == which) for k, v in inputs.items()}
        ref = composed_mnr_loss(cpu["queries"], cpu["positives"], cpu["negatives"],
                                scale=cpu["scale"], directions=ALL, reduction=reduction)
        (want,) = torch.autograd.grad(ref.sum(), cpu[which])
        torch.testing.assert_close(grad.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_distributed_layout_offset(device):
    # The op's local rows [offset, offset + rows) of a gathered batch (rank 1 of
    # 2): the oracle's offset and local_rows, both autograd paths.
    q, p, n = _embeddings(b=6, k=1, device=device, seed=5)
    scale = _scale("tensor []", device, value=9.0)
    leaves = [q, p, n, scale]
    cpu = [t.detach().cpu().requires_grad_(True) for t in leaves]
    for reduction, grad in ((1, True), (1, False), (0, False)):
        args = _op_args(q, p, n, scale, directions=1 | 2 | 4 | 8, reduction=reduction,
                        grad=grad, offset=3, rows=3)
        loss = OPS.mnr_loss(*args)[0]
        ref = composed_mnr_loss(*cpu[:3], scale=cpu[3], directions=ALL,
                                reduction="mean" if reduction else "none", offset=3,
                                local_rows=3)
        torch.testing.assert_close(loss.cpu(), ref.detach())
        for got, want in zip(torch.autograd.grad(loss.sum(), leaves),
                             torch.autograd.grad(ref.sum(), cpu)):
            torch.testing.assert_close(got.cpu(), want)


# --- opcheck ------------------------------------------------------------------------


def _unit(rows, d, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, d, generator=gen, dtype=torch.float64), dim=-1).to(
        device, dtype)


# (dtype, scale kind, directions, per_direction, hardness, reduction, offset/rows)
OPCHECK_CASES = [
    (torch.float32, "tensor", 15, False, 3, 0, (0, 4)),
    (torch.float16, "float", 1, False, 0, 1, (0, 4)),
]
if not INTERPRETED:
    OPCHECK_CASES += [
        (torch.float64, "tensor", 5, True, 0, 2, (0, 4)),
        (torch.bfloat16, "tensor", 11, False, 2, 1, (2, 2)),
        (torch.float32, "float", 3, False, 1, 0, (1, 3)),
    ]


def _opcheck_args(device, dtype, scale_kind, directions, per_direction, hardness, reduction,
                  local, requires_grad):
    offset, rows = local
    # 4 queries, 2 owned blocks (positives [4, 6] and one hard negative each,
    # [4, 1, 6]) and 2 shared docs [2, 6]; a zero doc.
    queries = _unit(4, 6, device, dtype, 6)
    rows_ = _unit(10, 6, device, dtype, 7)
    rows_[5] = 0
    docs = [rows_[:4].clone(), rows_[4:8].reshape(4, 1, 6).clone(), rows_[8:].clone()]
    scale = torch.tensor(12.0, device=device) if scale_kind == "tensor" else None
    if requires_grad:
        queries.requires_grad_(True)
        for block in docs:
            block.requires_grad_(True)
        if scale is not None:
            scale.requires_grad_(True)
    return [queries, docs, scale, 12.0 if scale is None else 0.0, offset, rows, 2, directions,
            per_direction, hardness, 1.5 if hardness else 0.0, reduction]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_mnr_loss(device, case, grad):
    args = _opcheck_args(device, *case, requires_grad=True)
    opcheck(OPS.mnr_loss.default, (*args, grad))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
def test_opcheck_mnr_loss_backward(device, case):
    # (mnr_loss_backward refuses to be differentiated: inputs without grad)
    args = _opcheck_args(device, *case, requires_grad=False)
    loss, stats, *_ = OPS.mnr_loss(*args, False)
    grad_loss = torch.linspace(-1.0, 1.5, loss.numel(), dtype=loss.dtype,
                               device=device).reshape(loss.shape)
    opcheck(OPS.mnr_loss_backward.default, (grad_loss, *args[:4], stats, *args[4:]))


@pytest.mark.parametrize("device", DEVICES)
def test_raw_ops_outputs(device):
    # The ops' contract (csrc/registration.cpp): loss [rows] or [] and stats
    # [rows, 3] in the accumulation dtype; with grad, gradients in the inputs'
    # dtype and a 0-d accumulation-dtype scale gradient; else empty [0] tensors.
    args = _opcheck_args(device, torch.float16, "tensor", 15, False, 0, 0, (1, 3), False)
    loss, stats, gq, gd, gs = OPS.mnr_loss(*args, False)
    assert loss.shape == (3,) and loss.dtype == torch.float32
    assert stats.shape == (3, 3) and stats.dtype == torch.float32 and torch.isfinite(stats).all()
    assert gq.shape == gd.shape == gs.shape == (0,)
    # reduction none with grad: the gradients of an upstream of ones.
    loss, stats, gq, gd, gs = OPS.mnr_loss(*args, True)
    assert gq.shape == (4, 6) and gq.dtype == torch.float16
    assert gd.shape == (10, 6) and gd.dtype == torch.float16
    assert gs.shape == () and gs.dtype == torch.float32
    bq, bd, bs = OPS.mnr_loss_backward(torch.ones_like(loss), *args[:4], stats, *args[4:])
    for a, b in ((gq, bq), (gd, bd), (gs, bs)):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad", [True, False])
def test_raw_op_outputs_do_not_alias(device, grad):
    # The schema declares five fresh outputs: no two may share storage (the
    # empty gradients of grad=False included), or functionalization and
    # torch.compile may treat a write to one as a write to another.
    from torch.multiprocessing.reductions import StorageWeakRef

    args = _opcheck_args(device, torch.float32, "float", 15, False, 0, 1, (0, 4), False)
    outs = OPS.mnr_loss(*args, grad)
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert StorageWeakRef(outs[i].untyped_storage()) != \
                StorageWeakRef(outs[j].untyped_storage()), f"outputs {i} and {j} alias"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_grad_true_with_reduction_none(device, scale_kind):
    # The schema allows grad=True with reduction 'none' (the gradients of an
    # upstream of ones); the loss's backward must then still honour the
    # incoming per-row gradient: the gradients of grad=False's path.
    args = _opcheck_args(device, torch.float64, scale_kind, 15, False, 0, 0, (0, 4), True)
    leaves = [t for t in (args[0], *args[1], args[2]) if t is not None]
    g = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64, device=device)
    results = [torch.autograd.grad(OPS.mnr_loss(*args, grad)[0], leaves, g)
               for grad in (False, True)]
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_raw_op_positive_row_stats(device):
    # stats[:, 1] is -inf without doc_to_query / doc_to_doc; with doc_to_doc
    # alone and B = 1 (every doc is the query's own) it is -inf too.
    args = _opcheck_args(device, torch.float32, "float", 1, False, 0, 0, (0, 4), False)
    _, stats, *_ = OPS.mnr_loss(*args, False)
    assert torch.isfinite(stats[:, 0]).all() and (stats[:, 1] == float("-inf")).all()
    q = _unit(1, 6, device, torch.float32, 8)
    d = _unit(3, 6, device, torch.float32, 9)
    loss, stats, *_ = OPS.mnr_loss(q, [d], None, 5.0, 0, 1, 3, 1 | 8, False, 0, 0.0, 0, False)
    assert stats[0, 1] == float("-inf") and torch.isfinite(loss).all()


# --- torch.compile ------------------------------------------------------------------


def _two_losses(q, p, n, shared, scale, w):
    """A scalar loss (the forward's gradients) and a weighted 'none' loss (the
    recomputing backward) with hardness, in one graph."""
    first = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, hardness_mode="all_negatives",
                        hardness_strength=2.0)
    second = nf.mnr_loss(q, p, shared, scale=scale, symmetric=True, reduction="none")
    return first + (second * w).sum()


@pytest.mark.skipif(INTERPRETED, reason="compiling around interpreted Triton kernels adds nothing")
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    q, p, n = _embeddings(b=4, k=2, device=device, seed=10, dtype=torch.float32)
    _, _, shared = _embeddings(b=4, n_shared=3, device=device, seed=11, dtype=torch.float32)
    scale = torch.tensor(20.0, device=device, requires_grad=True)
    w = torch.linspace(0.5, 2.0, 4, device=device)
    leaves = (q, p, n, shared, scale)
    expected = _two_losses(q, p, n, shared, scale, w)
    expected_grads = torch.autograd.grad(expected, leaves)
    compiled = torch.compile(_two_losses, fullgraph=True)
    got = compiled(q, p, n, shared, scale, w)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grads, expected_grads)
    assert all(torch.isfinite(g).all() for g in got_grads)


# --- double backward -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_refuses_clearly(device, reduction):
    q, p, n = _embeddings(b=3, k=1, device=device, seed=12)
    scale = _scale("tensor []", device)
    loss = nf.mnr_loss(q, p, n, scale=scale, reduction=reduction).sum()
    # create_graph=True gives the first-order gradients (as every family does)...
    grads = torch.autograd.grad(loss, (q, scale), create_graph=True)
    plain = torch.autograd.grad(nf.mnr_loss(q, p, n, scale=scale, reduction=reduction).sum(),
                                (q, scale))
    torch.testing.assert_close(grads, plain)
    assert grads[0].requires_grad
    # ... and differentiating them is refused, not silently incomplete.
    with pytest.raises(RuntimeError, match=r"nanfree::mnr_loss_backward has no derivative: "
                                           r"double backward .* of the mnr family"):
        grads[0].sum().backward()


# --- the scale's gradient ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=str)
@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float32), (torch.float32, torch.float64),
                                    (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float16)], ids=str)
def test_scale_gradient_shape_and_dtype(device, shape, dtypes):
    # A learnable temperature of any floating dtype and one element: its
    # gradient comes back in its own shape and dtype, with the value of a
    # float64 scale's (to the rounding of the two dtypes).
    dtype, scale_dtype = dtypes
    q, p, n = [t.detach().to(dtype) for t in _embeddings(b=4, k=1, device=device, seed=13)]
    scale = torch.full(shape, 16.0, dtype=scale_dtype, device=device, requires_grad=True)
    for reduction in ("mean", "none"):
        scale.grad = None
        loss = nf.mnr_loss(q, p, n, scale=scale, directions=ALL, reduction=reduction)
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        loss.sum().backward()
        assert scale.grad.shape == shape and scale.grad.dtype == scale_dtype
        ref_scale = torch.tensor(float(scale.detach().reshape(())), dtype=torch.float64,
                                 requires_grad=True)
        ref = composed_mnr_loss(*(t.cpu().double() for t in (q, p, n)), scale=ref_scale,
                                directions=ALL, reduction=reduction)
        ref.sum().backward()
        rtol = 2e-2 if torch.float16 in dtypes or torch.bfloat16 in dtypes else 1e-5
        torch.testing.assert_close(scale.grad.double().cpu().reshape(()), ref_scale.grad,
                                   rtol=rtol, atol=rtol)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_input_dtypes(device):
    # Queries, positives and negatives of different dtypes are promoted (as
    # torch.cat and matmul would); each gradient returns in its input's dtype.
    q, p, n = [t.detach() for t in _embeddings(b=3, k=2, device=device, seed=14)]
    leaves = [q.half().requires_grad_(True), p.float().requires_grad_(True),
              n.bfloat16().requires_grad_(True)]
    for reduction in ("mean", "none"):
        for leaf in leaves:
            leaf.grad = None
        loss = nf.mnr_loss(*leaves, directions=ALL, reduction=reduction)
        assert loss.dtype == torch.float32
        loss.sum().backward()
        for leaf in leaves:
            assert leaf.grad.dtype == leaf.dtype and torch.isfinite(leaf.grad).all()
        cpu = [t.detach().cpu().float().double() for t in leaves]
        ref = composed_mnr_loss(*cpu, directions=ALL, reduction=reduction)
        torch.testing.assert_close(loss.double().cpu(), ref, rtol=0, atol=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    # Strided views (a column slice, transposed storage, an expanded row) give
    # the values and gradients of their contiguous copies.
    gen = torch.Generator().manual_seed(15)
    base_q = torch.randn(4, 10, generator=gen, dtype=torch.float64, device="cpu").to(device)
    base_n = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64).to(device)
    base_p = torch.randn(1, 5, generator=gen, dtype=torch.float64).to(device)
    leaves = [t.clone().requires_grad_(True) for t in (base_q, base_n, base_p)]

    def views(bq, bn, bp):
        return bq[:, ::2], bp.expand(4, 5), bn.transpose(0, 1)

    strided = views(*leaves)
    assert not strided[0].is_contiguous() and not strided[2].is_contiguous()
    copies = [v.detach().contiguous().requires_grad_(True) for v in strided]
    for reduction in ("mean", "none"):
        got = nf.mnr_loss(*strided, directions=ALL, reduction=reduction)
        want = nf.mnr_loss(*copies, directions=ALL, reduction=reduction)
        torch.testing.assert_close(got, want)
        g_views = torch.autograd.grad(got.sum(), strided, retain_graph=False)
        g_copies = torch.autograd.grad(want.sum(), copies)
        for a, b in zip(g_views, g_copies):
            torch.testing.assert_close(a, b)
        strided = views(*leaves)


# --- upstream gradients near the dtype's range ------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_huge_upstream_gradient_stays_finite_and_linear(device, dtype, reduction):
    # Gradients are linear in the upstream gradient; one past the range
    # saturates at finfo.max (never inf - inf = NaN inside the GEMMs), and one
    # within it is the upstream times the gradient of an upstream 1.
    q, p, n = _embeddings(b=3, k=2, d=4, device=device, dtype=dtype)
    scale = _scale("tensor", device, torch.float32)
    options = dict(directions=ALL, scale=scale, reduction=reduction)

    def grads(upstream):
        loss = nf.mnr_loss(q, p, n, **options)
        return torch.autograd.grad(loss, (q, p, n, scale), torch.full_like(loss, upstream))

    acc_max = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    for g in grads(acc_max):
        assert torch.isfinite(g).all(), g
    big = 2.0 ** 40 if dtype in (torch.float16, torch.bfloat16) else 1e30
    if dtype == torch.float16:
        big = 2.0 ** -4  # float16 gradients saturate at 65504: stay well inside
    for g1, gb in zip(grads(1.0), grads(big)):
        torch.testing.assert_close(gb.double(), g1.double() * big, rtol=2e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_gradient_scaled_on_cpu_as_through_float32(dtype):
    # The CPU backward multiplies the half gradients computed for an upstream 1
    # by the float32 upstream directly (scaled_saved_gradient of csrc/mnr.cpp):
    # the result must be the float32 product saturated and rounded once, as
    # through a float32 copy, for factors no half dtype holds, products past
    # the range, NaN and zeros.
    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(3)
    q, p = (torch.randn(64, 32, generator=gen).to(dtype) for _ in range(2))
    # The op's arguments for nf.mnr_loss(q, p): scale 20, mean, with gradients.
    _, _, gq1, gp1, _ = torch.ops.nanfree.mnr_loss(q, [p], None, 20.0, 0, 64, 1, 1, False, 0,
                                                   0.0, 1, True)
    for value in (1.0, 1.0001, -1.7001, 3e38, -3e38, 2.0 ** -100, 1e-45, 0.0, float("nan")):
        factor = torch.tensor(value, dtype=torch.float32)
        qg, pg = (t.clone().requires_grad_(True) for t in (q, p))
        ours = torch.autograd.grad(nf.mnr_loss(qg, pg), (qg, pg), factor)
        for got, g1 in zip(ours, (gq1, gp1)):
            expected = (g1.float() * factor).clamp_(-big, big).to(dtype)
            assert got.dtype == dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
