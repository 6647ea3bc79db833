"""Bad input to the MNR loss gets a clear error naming the op and the
argument, raised before any kernel runs: nanfree.ops.mnr_loss (embeddings'
shapes, dtypes and devices; scale; directions, partition, hardness and
reduction), the registered ops torch.ops.nanfree.mnr_loss / mnr_loss_backward
on the backend this session selects (C++ TORCH_CHECK_VALUE is a ValueError,
TORCH_CHECK_TYPE a TypeError, as the Python backends raise), and their fake
kernels (meta tensors)."""

import math

import pytest
import torch
from error_checks import NO_KERNEL, _Recorder

import nanfree.ops as nf

NON_FLOAT = [torch.int64, torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn,
             torch.float8_e5m2]
FLOAT_MESSAGE = r"must be float16, bfloat16, float32 or float64, got"
OTHER_DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
OPS = torch.ops.nanfree
# nanfree.ops.mnr_loss takes a [B, k, d] `negatives` apart (unbind, a view)
# while it checks the embeddings, before the other arguments' checks.
VIEWS = NO_KERNEL + ("aten.unbind.",)


def raises_before_any_kernel(exception, match, fn, *args, **kwargs):
    """error_checks.raises_before_any_kernel, with unbind counted as the view it is."""
    with _Recorder() as recorder, pytest.raises(exception, match=match):
        fn(*args, **kwargs)
    kernels = [op for op in recorder.ops if not op.startswith(VIEWS)]
    assert not kernels, f"ran {kernels} before raising"


def _batch(b=3, k=2, d=4, n_shared=None):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, d, generator=gen)
    p = torch.randn(b, d, generator=gen)
    n = torch.randn(n_shared, d, generator=gen) if n_shared else torch.randn(b, k, d,
                                                                             generator=gen)
    return q, p, n


def _mnr(match):
    return r"nanfree\.mnr_loss: " + match


# --- the embeddings --------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("which", ["positives", "negatives"])
def test_batch_sizes_differ(which):
    q, p, n = _batch()
    if which == "positives":
        raises_before_any_kernel(ValueError, _mnr(r"`positives` must have the shape of `queries` "
                                                  r"\[3, 4\], got \[2, 4\]"), nf.mnr_loss, q,
                                 p[:2].clone(), n)
    else:
        raises_before_any_kernel(ValueError, _mnr(r"3-D `negatives` must be \[B, k, d\] = "
                                                  r"\[3, k, 4\], got \[4, 2, 4\]"), nf.mnr_loss,
                                 q, p, torch.randn(4, 2, 4))


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("which", ["positives", "hard negatives", "shared negatives"])
def test_widths_differ(which):
    q, p, n = _batch()
    if which == "positives":
        raises_before_any_kernel(ValueError, _mnr(r"`positives` must have the shape of `queries` "
                                                  r"\[3, 4\], got \[3, 5\]"), nf.mnr_loss, q,
                                 torch.randn(3, 5))
    elif which == "hard negatives":
        raises_before_any_kernel(ValueError, _mnr(r"3-D `negatives` must be \[B, k, d\] = "
                                                  r"\[3, k, 4\], got \[3, 2, 5\]"), nf.mnr_loss,
                                 q, p, torch.randn(3, 2, 5))
    else:
        raises_before_any_kernel(ValueError, _mnr(r"2-D `negatives` must be \[N, d\] with d = 4, "
                                                  r"got \[6, 3\]"), nf.mnr_loss, q, p,
                                 torch.randn(6, 3))


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("wrong", [(2, 4), (3, 5), (3, 2, 4)], ids=str)
def test_negative_columns_of_another_shape(wrong):
    # Hard negatives as a list of columns (sentence-transformers' layout):
    # each [B, d], or a ValueError naming the column.
    q, p, _ = _batch()
    raises_before_any_kernel(ValueError, _mnr(r"each hard negative column must have the shape of "
                                              r"`queries` \[3, 4\], got .* \(negatives\[1\]\)"),
                             nf.mnr_loss, q, p, [torch.randn(3, 4), torch.randn(*wrong)])
    with pytest.raises(TypeError, match=_mnr(r"`negatives` must be a torch.Tensor, got list")):
        nf.mnr_loss(q, p, [torch.randn(3, 4), [1.0]])


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("shape", [(4,), (), (2, 3, 4)], ids=str)
def test_queries_not_2d(shape):
    x = torch.randn(shape)
    raises_before_any_kernel(ValueError, _mnr(rf"`queries` must be 2-D \[B, d\], got {len(shape)} "
                                              "dimensions"), nf.mnr_loss, x, x.clone())


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("shape", [(4,), (3, 2, 4, 1), (1, 3, 2, 4)], ids=str)
def test_negatives_of_wrong_rank(shape):
    q, p, _ = _batch()
    raises_before_any_kernel(ValueError, _mnr(rf"`negatives` must be \[B, k, d\] or \[N, d\], "
                                              rf"got {len(shape)} dimensions"), nf.mnr_loss, q,
                             p, torch.randn(shape))


@pytest.mark.backend_independent  # raised in Python, before any kernel
def test_empty_batch():
    q = torch.randn(0, 4)
    raises_before_any_kernel(ValueError, _mnr(r"`queries` must hold at least one row"),
                             nf.mnr_loss, q, q.clone())


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
@pytest.mark.parametrize("which", ["queries", "positives", "negatives"])
def test_non_float_embeddings(which, dtype):
    inputs = dict(zip(("queries", "positives", "negatives"), _batch()))
    inputs[which] = inputs[which].to(dtype)
    raises_before_any_kernel(TypeError, _mnr(rf"`{which}` {FLOAT_MESSAGE}"), nf.mnr_loss,
                             *inputs.values())


@pytest.mark.backend_independent  # checked in Python before anything else
@pytest.mark.parametrize("which", ["queries", "positives", "negatives"])
@pytest.mark.parametrize("value", [[[1.0, 2.0]], 1.0], ids=["list", "float"])
def test_embeddings_not_tensors(which, value):
    inputs = dict(zip(("queries", "positives", "negatives"), _batch()))
    inputs[which] = value
    with pytest.raises(TypeError, match=_mnr(rf"`{which}` must be a torch\.Tensor, got "
                                             + type(value).__name__)):
        nf.mnr_loss(*inputs.values())


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("other", OTHER_DEVICES)
@pytest.mark.parametrize("which", ["positives", "negatives", "shared negatives", "scale"])
def test_mixed_devices(which, other):
    q, p, n = _batch(n_shared=5 if which == "shared negatives" else None)
    scale = torch.tensor(20.0)
    if which == "positives":
        p = p.to(other)
    elif which == "scale":
        scale = scale.to(other)
    else:
        n = n.to(other)
    name = "negatives" if which == "shared negatives" else which
    raises_before_any_kernel(ValueError, _mnr(rf"`{name}` is on {other}\S* but `queries` is on "
                                              "cpu"), nf.mnr_loss, q, p, n, scale=scale)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_queries_with_cpu_documents():
    q, p, n = _batch()
    with pytest.raises(ValueError, match=_mnr(r"`positives` is on cpu but `queries` is on cuda")):
        nf.mnr_loss(q.cuda(), p, n.cuda())
    with pytest.raises(ValueError, match=_mnr(r"`scale` is on cpu but `queries` is on cuda")):
        nf.mnr_loss(q.cuda(), p.cuda(), scale=torch.tensor(20.0))


def test_zero_width_embeddings_work():
    # d = 0: every vector is a zero vector (cosine 0), as torch's composition.
    q = torch.zeros(3, 0, requires_grad=True)
    loss = nf.mnr_loss(q, torch.zeros(3, 0), torch.zeros(3, 2, 0))
    torch.testing.assert_close(loss, torch.tensor(math.log(9.0)))
    loss.backward()
    assert q.grad.shape == (3, 0)


# --- scale -------------------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("scale", [0, 0.0, -1.0, -20, math.inf, -math.inf, math.nan], ids=str)
def test_python_scale_not_positive_and_finite(scale):
    raises_before_any_kernel(ValueError, _mnr(r"`scale` must be positive and finite, got"),
                             nf.mnr_loss, *_batch(), scale=scale)


@pytest.mark.backend_independent
@pytest.mark.parametrize("scale", ["20", None, True, [20.0], 2j], ids=str)
def test_scale_of_wrong_type(scale):
    with pytest.raises(TypeError, match=_mnr(r"`scale` must be a number, got")):
        nf.mnr_loss(*_batch(), scale=scale)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("shape", [(2,), (0,), (1, 2)], ids=str)
def test_scale_tensor_not_one_element(shape):
    raises_before_any_kernel(ValueError, _mnr(rf"a tensor `scale` must have one element, got shape "
                                              rf"\[{', '.join(map(str, shape))}\]"),
                             nf.mnr_loss, *_batch(), scale=torch.full(shape, 20.0))


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
def test_scale_tensor_of_integer_dtype(dtype):
    raises_before_any_kernel(TypeError, _mnr(rf"`scale` {FLOAT_MESSAGE}"), nf.mnr_loss,
                             *_batch(), scale=torch.tensor(20).to(dtype))


@pytest.mark.parametrize("value", [0.0, -3.0, math.inf, math.nan], ids=str)
def test_scale_tensor_values_are_not_checked(value):
    # A learnable temperature is not value-checked (that would sync a GPU): a
    # non-positive scale gives a finite loss, inf and NaN what they give.
    q, p, n = _batch()
    loss = nf.mnr_loss(q, p, n, scale=torch.tensor(value))
    if value in (0.0, -3.0):
        assert torch.isfinite(loss)
    elif math.isnan(value):
        assert torch.isnan(loss)


# --- options ---------------------------------------------------------------------------------


OPTION_ERRORS = {
    "unknown reduction": (dict(reduction="avg"), r"`reduction` must be 'mean', 'sum' or 'none', "
                                                 r"got 'avg'"),
    "reduction None": (dict(reduction=None), r"`reduction` must be 'mean', 'sum' or 'none'"),
    "unknown direction": (dict(directions=("query_to_doc", "doc_to_pos")),
                          r"unknown `directions` \['doc_to_pos'\]; valid: \['doc_to_doc', "
                          r"'doc_to_query', 'query_to_doc', 'query_to_query'\]"),
    "directions a string": (dict(directions="query_to_doc"),
                            r"`directions` must be a non-empty sequence of"),
    "no directions": (dict(directions=()), r"`directions` must be a non-empty sequence of"),
    "missing query_to_doc": (dict(directions=("doc_to_query", "query_to_query")),
                             r"`directions` must include 'query_to_doc'"),
    "per_direction with query_to_query": (
        dict(directions=("query_to_doc", "query_to_query"), partition_mode="per_direction"),
        r"partition_mode='per_direction' needs every direction to hold the positive pair"),
    "per_direction with doc_to_doc": (
        dict(directions=ALL, partition_mode="per_direction"),
        r"partition_mode='per_direction' needs every direction"),
    "unknown partition mode": (dict(partition_mode="separate"),
                               r"`partition_mode` must be 'joint' or 'per_direction', got "
                               r"'separate'"),
    "unknown hardness mode": (dict(hardness_mode="hard", hardness_strength=1.0),
                              r"`hardness_mode` must be one of \[None, 'in_batch_negatives', "
                              r"'hard_negatives', 'all_negatives'\], got 'hard'"),
    "negative hardness strength": (dict(hardness_mode="hard_negatives", hardness_strength=-0.5),
                                   r"`hardness_strength` must be finite and >= 0, got -0\.5"),
    "NaN hardness strength": (dict(hardness_mode="all_negatives", hardness_strength=math.nan),
                              r"`hardness_strength` must be finite and >= 0, got nan"),
    "infinite hardness strength": (dict(hardness_mode="all_negatives",
                                        hardness_strength=math.inf),
                                   r"`hardness_strength` must be finite and >= 0, got inf"),
    "symmetric with directions": (dict(symmetric=True, directions=("query_to_doc",
                                                                   "doc_to_query")),
                                  r"`symmetric=True` sets directions and partition_mode; do not "
                                  "pass them too"),
    "symmetric with partition_mode": (dict(symmetric=True, partition_mode="per_direction"),
                                      r"`symmetric=True` sets directions and partition_mode"),
}


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("case", list(OPTION_ERRORS))
def test_bad_options(case):
    options, match = OPTION_ERRORS[case]
    raises_before_any_kernel(ValueError, _mnr(match), nf.mnr_loss, *_batch(), **options)


@pytest.mark.backend_independent
@pytest.mark.parametrize("options,match", [
    (dict(hardness_mode="hard_negatives", hardness_strength="1"),
     r"`hardness_strength` must be a number, got str"),
    (dict(gather_across_devices=1), r"`gather_across_devices` must be a bool"),
    (dict(gather_across_devices="yes"), r"`gather_across_devices` must be a bool"),
], ids=["strength str", "gather int", "gather str"])
def test_options_of_wrong_type(options, match):
    with pytest.raises(TypeError, match=_mnr(match)):
        nf.mnr_loss(*_batch(), **options)


# --- the registered ops, called directly -------------------------------------------------------


def _forward_results(device="cpu", dtype=torch.float32):
    """Unit rows: 4 queries, 2 owned blocks of 4 docs and 1 shared doc, and the
    op's results (reduction none) with a tensor scale."""
    gen = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(4, 5, generator=gen), dim=-1).to(device, dtype)
    d = torch.nn.functional.normalize(torch.randn(9, 5, generator=gen), dim=-1).to(device, dtype)
    scale = torch.tensor(20.0, device=device)
    loss, stats, *_ = OPS.mnr_loss(q, [d], scale, 0.0, 0, 4, 2, 15, False, 1, 0.5, 0, False)
    return q, d, scale, loss, stats


def _blocks(docs):
    """The op's `docs` (a list of blocks) from one [M, d] tensor, or as given."""
    return [docs] if isinstance(docs, torch.Tensor) else docs


# The op's arguments after the tensors: (scale_value, offset, rows, owned_blocks,
# directions, per_direction, hardness_mode, hardness_strength, reduction).
GOOD = dict(scale_value=0.0, offset=0, rows=4, owned_blocks=2, directions=15,
            per_direction=False, hardness_mode=1, hardness_strength=0.5, reduction=0)


def _op_cases(q, d, scale, loss, stats, dtype):
    """(op, args, exception, message) of every argument the ops check."""

    def fwd(queries=q, docs=d, s=scale, grad=False, **changes):
        c = dict(GOOD, **changes)
        return (OPS.mnr_loss, (queries, _blocks(docs), s, c["scale_value"], c["offset"], c["rows"],
                               c["owned_blocks"], c["directions"], c["per_direction"],
                               c["hardness_mode"], c["hardness_strength"], c["reduction"], grad))

    def bwd(grad_loss=loss, queries=q, docs=d, s=scale, st=stats, **changes):
        c = dict(GOOD, **changes)
        return (OPS.mnr_loss_backward, (grad_loss, queries, _blocks(docs), s, c["scale_value"], st,
                                        c["offset"], c["rows"], c["owned_blocks"],
                                        c["directions"], c["per_direction"], c["hardness_mode"],
                                        c["hardness_strength"], c["reduction"]))

    bad = q.to(dtype)
    cases = [
        # dtypes
        (*fwd(queries=bad), TypeError, rf"mnr_loss: `queries` {FLOAT_MESSAGE}"),
        (*fwd(docs=d.to(dtype)), TypeError, rf"mnr_loss: `docs` {FLOAT_MESSAGE}"),
        (*fwd(docs=d.double()), TypeError, r"mnr_loss: `queries` is \S+ but `docs` is \S+"),
        (*fwd(docs=[d, d.double()]), TypeError, r"mnr_loss: `queries` is \S+ but `docs` is \S+"),
        (*fwd(s=scale.to(dtype)), TypeError, rf"mnr_loss: `scale` {FLOAT_MESSAGE}"),
        (*bwd(queries=bad), TypeError, rf"mnr_loss_backward: `queries` {FLOAT_MESSAGE}"),
        # shapes
        (*fwd(queries=q[0]), ValueError, r"mnr_loss: `queries` must be 2-D, got 1 dimensions"),
        (*fwd(docs=d[None, None]), ValueError, r"mnr_loss: each block of `docs` must be \[n, d\] "
                                               r"or \[R, k, d\], got 4 dimensions"),
        (*fwd(docs=[d, d[0]]), ValueError, r"mnr_loss: each block of `docs` must be \[n, d\]"),
        (*fwd(docs=[]), ValueError, r"mnr_loss: `docs` must hold at least one block"),
        (*fwd(docs=d[:, :3]), ValueError, r"mnr_loss: `queries` has rows of 5 entries but "
                                          "`docs` of 3"),
        (*fwd(docs=[d[:4], d[4:8, :3].reshape(4, 1, 3)]), ValueError,
         r"mnr_loss: `queries` has rows of 5 entries but `docs` of 3"),
        (*fwd(s=torch.ones(2)), ValueError, r"mnr_loss: a tensor `scale` must have one element, "
                                            r"got shape \[2\]"),
        # scale_value (no tensor scale)
        (*fwd(s=None, scale_value=0.0), ValueError,
         r"mnr_loss: `scale` must be positive and finite, got"),
        (*fwd(s=None, scale_value=-1.0), ValueError, r"mnr_loss: `scale` must be positive"),
        (*fwd(s=None, scale_value=math.nan), ValueError, r"mnr_loss: `scale` must be positive"),
        (*fwd(s=None, scale_value=math.inf), ValueError, r"mnr_loss: `scale` must be positive"),
        # the local rows
        (*fwd(offset=-1), ValueError, r"mnr_loss: local rows \[-1, 3\) are not within the 4 "
                                      "queries"),
        (*fwd(offset=1), ValueError, r"mnr_loss: local rows \[1, 5\) are not within the 4 "
                                     "queries"),
        (*fwd(rows=0), ValueError, r"mnr_loss: local rows \[0, 0\) are not within the 4 queries"),
        (*fwd(rows=5), ValueError, r"mnr_loss: local rows \[0, 5\) are not within"),
        # the owned blocks
        (*fwd(owned_blocks=0), ValueError, r"mnr_loss: 0 blocks of 4 docs do not fit in the 9 "
                                           "docs"),
        (*fwd(owned_blocks=3), ValueError, r"mnr_loss: 3 blocks of 4 docs do not fit in the 9 "
                                           "docs"),
        (*fwd(owned_blocks=-1), ValueError, r"mnr_loss: -1 blocks of 4 docs do not fit"),
        # the options
        (*fwd(directions=0), ValueError, r"mnr_loss: `directions` 0 must hold query_to_doc"),
        (*fwd(directions=6), ValueError, r"mnr_loss: `directions` 6 must hold query_to_doc"),
        (*fwd(directions=17), ValueError, r"mnr_loss: `directions` 17 must hold query_to_doc"),
        (*fwd(directions=3, per_direction=True), ValueError,
         r"mnr_loss: partition_mode 'per_direction' does not allow query_to_query or doc_to_doc"),
        (*fwd(directions=9, per_direction=True), ValueError,
         r"mnr_loss: partition_mode 'per_direction' does not allow"),
        (*fwd(hardness_mode=4), ValueError, r"mnr_loss: `hardness_mode` 4 is not 0-3"),
        (*fwd(hardness_mode=-1), ValueError, r"mnr_loss: `hardness_mode` -1 is not 0-3"),
        (*fwd(hardness_strength=-1.0), ValueError,
         r"mnr_loss: `hardness_strength` must be finite and >= 0, got"),
        (*fwd(hardness_strength=math.nan), ValueError, r"mnr_loss: `hardness_strength` must be"),
        (*fwd(reduction=3), ValueError, r"mnr_loss: `reduction` 3 is not 0-2"),
        (*fwd(reduction=-1), ValueError, r"mnr_loss: `reduction` -1 is not 0-2"),
        # the backward's own arguments and the same checks
        (*bwd(offset=2), ValueError, r"mnr_loss_backward: local rows \[2, 6\) are not within"),
        (*bwd(owned_blocks=3), ValueError, r"mnr_loss_backward: 3 blocks of 4 docs do not fit"),
        (*bwd(directions=8), ValueError, r"mnr_loss_backward: `directions` 8 must hold"),
        (*bwd(grad_loss=loss[:3]), ValueError,
         r"mnr_loss_backward: `grad_loss` must be \[4\] of \S+, got \[3\]"),
        (*bwd(grad_loss=loss.double()), ValueError, r"mnr_loss_backward: `grad_loss` must be"),
        (*bwd(grad_loss=loss.sum()), ValueError, r"mnr_loss_backward: `grad_loss` must be"),
        (*bwd(st=stats[:3]), ValueError,
         r"mnr_loss_backward: `stats` must be the forward's saved statistics"),
        (*bwd(st=stats[:, :1]), ValueError, r"mnr_loss_backward: `stats` must be the forward's"),
        (*bwd(st=stats.double()), ValueError, r"mnr_loss_backward: `stats` must be the forward's"),
    ]
    return cases


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_op_level_checks(dtype):
    # On the backend this session selects: the same types and words everywhere.
    for op, args, exception, match in _op_cases(*_forward_results(), dtype):
        raises_before_any_kernel(exception, r"nanfree\." + match, op, *args)


@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_op_level_devices(other):
    q, d, scale, loss, stats = _forward_results()
    rest = tuple(GOOD.values())
    cases = [
        (OPS.mnr_loss, (q, [d[:4], d[4:].to(other)], scale, *rest, False),
         rf"mnr_loss: `docs` is on {other}\S* but `queries` is on cpu"),
        (OPS.mnr_loss, (q, [d], scale.to(other), *rest, False),
         rf"mnr_loss: `scale` is on {other}\S* but `queries` is on cpu"),
        (OPS.mnr_loss_backward, (loss.to(other), q, [d], scale, 0.0, stats, *rest[1:]),
         rf"mnr_loss_backward: `grad_loss` is on {other}\S* but `queries` is on cpu"),
        (OPS.mnr_loss_backward, (loss, q, [d], scale, 0.0, stats.to(other), *rest[1:]),
         rf"mnr_loss_backward: `stats` is on {other}\S* but `queries` is on cpu"),
    ]
    for op, args, match in cases:
        raises_before_any_kernel(ValueError, r"nanfree\." + match, op, *args)


@pytest.mark.backend_independent  # the fake kernels (Python), shared by every backend
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_fake_kernels_raise_the_same_errors(dtype):
    # Meta tensors go to the fake kernels: the same checks, the same words.
    for op, args, exception, match in _op_cases(*_forward_results("meta"), dtype):
        with pytest.raises(exception, match=r"nanfree\." + match):
            op(*args)


@pytest.mark.backend_independent  # the fake kernels (Python), shared by every backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=str)
def test_meta_tensors_give_shapes_and_dtypes(dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q = torch.empty(4, 6, device="meta", dtype=dtype)
    n = torch.empty(4, 2, 6, device="meta", dtype=dtype)
    for reduction, shape in (("mean", ()), ("sum", ()), ("none", (4,))):
        loss = nf.mnr_loss(q, q, n, directions=ALL, reduction=reduction)
        assert loss.device.type == "meta" and loss.shape == shape and loss.dtype == acc
    docs = torch.empty(13, 6, device="meta", dtype=dtype)
    scale = torch.empty((), device="meta")
    loss, stats, gq, gd, gs = OPS.mnr_loss(q, [docs[:4], docs[4:12].reshape(4, 2, 6), docs[12:]],
                                           scale, 0.0, 1, 2, 3, 15, False, 0, 0.0, 0, True)
    assert loss.shape == (2,) and loss.dtype == acc and stats.shape == (2, 3)
    assert gq.shape == q.shape and gq.dtype == dtype and gd.shape == docs.shape
    assert gs.shape == () and gs.dtype == acc
    gq, gd, gs = OPS.mnr_loss_backward(loss, q, [docs], None, 20.0, stats, 1, 2, 3, 15, False, 0,
                                       0.0, 0)
    assert gq.shape == q.shape and gd.shape == docs.shape and gs.shape == (0,)
    # The public function's checks hold on meta tensors too.
    with pytest.raises(ValueError, match=_mnr(r"`scale` must be positive")):
        nf.mnr_loss(q, q, scale=0.0)


@pytest.mark.backend_independent  # the dispatcher's own check of the schema
def test_op_level_non_tensor_arguments():
    # torch's dispatcher refuses these before any nanfree code runs, naming
    # the op and the argument (a RuntimeError, as for every torch.ops op).
    q, d, scale, loss, stats = _forward_results()
    d = [d]
    rest = list(GOOD.values())
    cases = [
        (([1.0], d, scale, *rest, False), "queries"),
        ((q, d, 20.0, *rest, False), "scale"),
        ((q, d, scale, "20", *rest[1:], False), "scale_value"),
        ((q, d, scale, 0.0, 1.5, *rest[2:], False), "offset"),
        ((q, d, scale, *rest[:4], "15", *rest[5:], False), "directions"),
        ((q, d, scale, *rest, "yes"), "grad"),
    ]
    for args, arg in cases:
        with pytest.raises(RuntimeError, match=rf"nanfree::mnr_loss\(\) Expected a value of type "
                                               rf"'[^']+' for argument '{arg}'"):
            OPS.mnr_loss(*args)
