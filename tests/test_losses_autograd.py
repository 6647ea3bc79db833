"""The losses family against torch where torch is finite, on the backend this
session selects: every reduction, layout and option of torch.nn.functional's
signatures (weight, pos_weight, ignore_index, label_smoothing, class-index and
probability targets, [N, C, d1, ...] and unbatched inputs, log_target,
batchmean, the legacy size_average / reduce), float64 gradcheck, opcheck of
the five ops, torch.compile(fullgraph=True), double backward refused, the
autocast dtypes of torch's, and the nn modules."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES
from torch.library import opcheck

import losses_oracle as oracle
import nanfree
import nanfree.nn as nfnn
import nanfree.ops as nf


def _assert_same(ours, theirs, dtype):
    rtol, atol = {torch.float64: (1e-10, 1e-12), torch.float32: (2e-5, 1e-6),
                  torch.float16: (2e-2, 2e-3), torch.bfloat16: (5e-2, 1e-2)}[dtype]
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=rtol, atol=atol)


def _both(fn_ours, fn_theirs, leaves, *args, **kwargs):
    """(value, gradients) of each function of the leaves, upstream gradient 1."""
    results = []
    for fn in (fn_ours, fn_theirs):
        xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        out = fn(*xs, *args, **kwargs)
        need = [x for x in xs if x.requires_grad]
        grads = torch.autograd.grad(out, need, torch.ones_like(out))
        results.append((out.detach(), grads))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_bce_with_logits_as_torch(device, dtype, reduction):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 5, generator=gen) * 4).to(device, dtype).requires_grad_()
    t = torch.rand(6, 5, generator=gen).to(device, dtype).requires_grad_()
    w = torch.rand(5, generator=gen).to(device, dtype)
    pw = (torch.rand(5, generator=gen) * 3).to(device, dtype)
    for kwargs in ({}, {"weight": w}, {"pos_weight": pw}, {"weight": w, "pos_weight": pw}):
        (ov, og), (tv, tg) = _both(nf.binary_cross_entropy_with_logits,
                                   F.binary_cross_entropy_with_logits, [x, t],
                                   reduction=reduction, **kwargs)
        assert ov.dtype == tv.dtype and ov.shape == tv.shape
        _assert_same(ov, tv, dtype)
        for a, b in zip(og, tg):
            _assert_same(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_bce_as_torch(device, dtype, reduction):
    gen = torch.Generator().manual_seed(2)
    p = (torch.rand(4, 7, generator=gen) * 0.98 + 0.01).to(device, dtype).requires_grad_()
    t = torch.rand(4, 7, generator=gen).to(device, dtype).requires_grad_()
    w = torch.rand(7, generator=gen).to(device, dtype)
    for kwargs in ({}, {"weight": w}):
        (ov, og), (tv, tg) = _both(nf.binary_cross_entropy, F.binary_cross_entropy, [p, t],
                                   reduction=reduction, **kwargs)
        assert ov.dtype == tv.dtype and ov.shape == tv.shape
        _assert_same(ov, tv, dtype)
        for a, b in zip(og, tg):
            _assert_same(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_as_torch(device, dtype, reduction, log_target):
    gen = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(3, 6, generator=gen), 1).to(device, dtype).requires_grad_()
    t = torch.softmax(torch.randn(3, 6, generator=gen), 1)
    t = (t.log() if log_target else t).to(device, dtype).requires_grad_()
    (ov, og), (tv, tg) = _both(nf.kl_div, F.kl_div, [lp, t], reduction=reduction,
                               log_target=log_target)
    assert ov.dtype == tv.dtype and ov.shape == tv.shape
    _assert_same(ov, tv, dtype)
    for a, b in zip(og, tg):
        _assert_same(a, b, dtype)
    # kl_div broadcasts the target as torch's does
    row = t.detach()[:1]
    _assert_same(nf.kl_div(lp.detach(), row, reduction="sum", log_target=log_target),
                 F.kl_div(lp.detach(), row, reduction="sum", log_target=log_target), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_sigmoid_focal_loss_as_torchvision(device, dtype, reduction):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 4, generator=gen) * 3).to(device, dtype).requires_grad_()
    t = (torch.rand(5, 4, generator=gen) > 0.5).to(device, dtype).requires_grad_()

    def theirs(a, b, alpha, gamma, reduction):
        loss = oracle.torchvision_focal(a, b, alpha, gamma)
        return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[reduction]

    for alpha, gamma in ((0.25, 2.0), (-1.0, 1.0), (0.6, 0.0), (0.25, 3.5)):
        (ov, og), (tv, tg) = _both(nf.sigmoid_focal_loss, theirs, [x, t], alpha, gamma, reduction)
        _assert_same(ov, tv.to(ov.dtype), dtype)
        for a, b in zip(og, tg):
            _assert_same(a, b, dtype)


def _ce_inputs(device, dtype, shape, gen):
    x = (torch.randn(*shape, generator=gen) * 3).to(device, dtype)
    classes = shape[0] if len(shape) == 1 else shape[1]
    spatial = () if len(shape) == 1 else (shape[0], *shape[2:])
    y = torch.randint(0, classes, spatial, generator=gen).to(device)
    if y.dim():
        y.view(-1)[:: 4] = -100
    probs = torch.softmax(torch.randn(*shape, generator=gen), 0 if len(shape) == 1 else 1)
    return x, y, probs.to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# (4, 16): classes a multiple of every dtype's 16-byte vector, which the CUDA
# kernels read in vectors; the others in single logits (inner > 1 too).
@pytest.mark.parametrize("shape", [(7,), (6, 5), (4, 16), (3, 5, 4), (2, 4, 3, 2)])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_as_torch(device, dtype, shape, reduction):
    gen = torch.Generator().manual_seed(5)
    x, y, probs = _ce_inputs(device, dtype, shape, gen)
    classes = shape[0] if len(shape) == 1 else shape[1]
    w = torch.rand(classes, generator=gen).to(device, dtype)
    for target in (y, probs):
        for kwargs in ({}, {"weight": w}, {"label_smoothing": 0.1},
                       {"weight": w, "label_smoothing": 0.25}):
            if target.dtype == torch.int64 and len(shape) == 1 and kwargs:
                continue
            leaves = [x.requires_grad_(), target.requires_grad_(target.is_floating_point())]
            (ov, og), (tv, tg) = _both(nf.cross_entropy, F.cross_entropy, leaves,
                                       reduction=reduction, **kwargs)
            assert ov.dtype == tv.dtype and ov.shape == tv.shape
            _assert_same(ov, tv, dtype)
            for a, b in zip(og, tg):
                _assert_same(a, b, dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int16, torch.uint8, torch.int8])
def test_cross_entropy_takes_indices_of_any_integer_dtype(device, index_dtype):
    """Class indices of another integer dtype than int64 (torch takes uint8 too,
    and raises for int32) give the int64 call's loss and gradient."""
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(6, 5, 3, generator=gen).to(device).requires_grad_()
    y = torch.randint(0, 5, (6, 3), generator=gen).to(device)
    y[0, 1] = 2  # an ignored position
    for reduction in ("none", "mean", "sum"):
        want = nf.cross_entropy(x, y, ignore_index=2, reduction=reduction)
        got = nf.cross_entropy(x, y.to(index_dtype), ignore_index=2, reduction=reduction)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("classes", [10, 16])  # 16: the CUDA kernels' vector reads
def test_cross_entropy_mask_as_masked_fill(device, dtype, classes):
    """mask=... equals torch's cross_entropy of input.masked_fill(~mask, -inf)
    where torch's is finite (no label smoothing; every target kept)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, classes, generator=gen).to(device, dtype)
    mask = torch.rand(8, classes, generator=gen) > 0.4
    y = torch.multinomial(mask.float() + 1e-9, 1, generator=gen).squeeze(1)
    mask, y = mask.to(device), y.to(device)
    for m in (mask, mask.to(torch.int32), mask[:1].expand(8, classes)):
        keep = m != 0
        if not keep.gather(1, y[:, None]).all():
            continue
        (ov, og), (tv, tg) = _both(lambda a: nf.cross_entropy(a, y, mask=m),
                                   lambda a: F.cross_entropy(a.masked_fill(~keep, -torch.inf), y),
                                   [x.requires_grad_()])
        _assert_same(ov, tv, dtype)
        _assert_same(og[0], tg[0], dtype)


@pytest.mark.parametrize("device_dtype", [torch.float64])
def test_gradcheck(device, device_dtype):
    gen = torch.Generator().manual_seed(7)
    kw = {"dtype": torch.float64, "device": device}
    x = torch.randn(3, 4, generator=gen).to(**kw).requires_grad_()
    t = torch.rand(3, 4, generator=gen).to(**kw).requires_grad_()
    p = (torch.rand(3, 4, generator=gen) * 0.8 + 0.1).to(**kw).requires_grad_()
    lp = torch.log_softmax(torch.randn(3, 4, generator=gen), 1).to(**kw).requires_grad_()
    w = torch.rand(4, generator=gen).to(**kw)
    assert torch.autograd.gradcheck(
        lambda a, b: nf.binary_cross_entropy_with_logits(a, b, weight=w, pos_weight=w + 1), (x, t))
    assert torch.autograd.gradcheck(lambda a, b: nf.binary_cross_entropy(a, b, weight=w), (p, t))
    assert torch.autograd.gradcheck(lambda a, b: nf.kl_div(a, b, reduction="batchmean"), (lp, t))
    assert torch.autograd.gradcheck(lambda a, b: nf.kl_div(a, b, log_target=True), (lp, (lp * 0.5).detach().requires_grad_()))
    for gamma in (0.5, 2.0):
        assert torch.autograd.gradcheck(lambda a, b: nf.sigmoid_focal_loss(a, b, 0.3, gamma), (x, t))
    y = torch.tensor([0, 3, -100], device=device)
    mask = torch.tensor([[True, True, False, True]] * 3, device=device)
    assert torch.autograd.gradcheck(
        lambda a: nf.cross_entropy(a, y, weight=w, label_smoothing=0.2, mask=mask), (x,))
    assert torch.autograd.gradcheck(
        lambda a, b: nf.cross_entropy(a, b, weight=w, label_smoothing=0.1), (x, t))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_upstream_gradient(device, dtype):
    """An upstream gradient that is one element broadcast (autograd's expand in the
    backward of loss.sum()) gives what the same gradient written out gives."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(5, 7, generator=gen) * 3).to(device, dtype).requires_grad_()
    t = torch.rand(5, 7, generator=gen).to(device, dtype)
    for loss_of in (lambda a: nf.binary_cross_entropy_with_logits(a, t, reduction="none"),
                    lambda a: nf.kl_div(-a.abs(), t, reduction="none"),
                    lambda a: nf.sigmoid_focal_loss(a, t)):
        loss = loss_of(x)
        (broadcast,) = torch.autograd.grad(loss.sum() * 3, x)
        (written,) = torch.autograd.grad(loss_of(x), x, torch.full_like(loss, 3))
        assert torch.equal(broadcast, written)


def _layouts(device):
    """(input, target) pairs of [2, 3, 4, 5] in other layouts: channels-last, a
    transpose, a target in another layout than the input, a slice (not dense)."""
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(2, 3, 4, 5, generator=gen) * 3).to(device)
    t = torch.rand(2, 3, 4, 5, generator=gen).to(device)
    last = torch.channels_last
    return {
        "channels_last": (x.to(memory_format=last), t.to(memory_format=last)),
        "transposed": (x.transpose(0, 3), t.transpose(0, 3)),
        "target contiguous": (x.to(memory_format=last), t),
        "slice": (x[:, :, ::2], t[:, :, ::2]),
    }


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "target contiguous", "slice"])
def test_pointwise_losses_keep_the_input_layout(device, layout):
    """reduction='none' and every gradient in input's layout (torch.empty_like's:
    a dense input's strides), as torch's elementwise results; values as torch's."""
    x, t = _layouts(device)[layout]
    pw = torch.rand(x.shape[-1], generator=torch.Generator().manual_seed(13)).to(device) + 0.5
    cases = [(nf.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits, x, {}),
             (nf.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits, x,
              {"pos_weight": pw}),
             (nf.binary_cross_entropy, F.binary_cross_entropy, torch.sigmoid(x), {}),
             (nf.kl_div, F.kl_div, -x.abs(), {})]
    expected = torch.empty_like(x).stride()
    for ours, theirs, inp, kwargs in cases:
        for reduction in ("none", "mean", "sum"):
            (ov, og), (tv, tg) = _both(ours, theirs, [inp.requires_grad_(), t.requires_grad_()],
                                       reduction=reduction, **kwargs)
            _assert_same(ov, tv, torch.float32)
            for a, b in zip(og, tg):
                _assert_same(a, b, torch.float32)
                assert a.stride() == expected, (ours.__name__, reduction)
            if reduction == "none":
                assert ov.stride() == expected, ours.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 5, generator=gen).to(device, dtype)
    t = torch.rand(3, 5, generator=gen).to(device, dtype)
    w = torch.rand(5, generator=gen).to(device, dtype)
    ops = torch.ops.nanfree
    for kind in range(5):
        operand = t if kind != 1 else t.clamp(0.05, 0.95)
        weights = (w, w + 1) if kind == 0 else (None, None)
        opcheck(ops.pointwise_loss, (x if kind != 1 else operand, t, *weights, kind, 0.25, 2.0))
        opcheck(ops.pointwise_loss_sum, (x if kind != 1 else operand, t, *weights, kind, 0.25, 2.0))
        opcheck(ops.pointwise_loss_backward,
                (torch.ones_like(x), x if kind != 1 else operand, t, *weights, kind, 0.25, 2.0, 0))
        # The 'mean' and 'sum' reductions' backward: a 0-d upstream gradient.
        opcheck(ops.pointwise_loss_backward,
                (torch.full((), 0.1, dtype=dtype, device=device), x if kind != 1 else operand, t,
                 *weights, kind, 0.25, 2.0, 1))
    # Fakes and kernels agree on the layout of other inputs' outputs.
    for x4, t4 in _layouts(device).values():
        x4, t4 = x4.to(dtype), t4.to(dtype)
        opcheck(ops.pointwise_loss, (x4, t4, None, None, 0, 0.25, 2.0))
        opcheck(ops.pointwise_loss_sum, (x4, t4, None, None, 0, 0.25, 2.0))
        opcheck(ops.pointwise_loss_backward, (torch.ones_like(x4), x4, t4, None, None, 0, 0.25, 2.0, 0))
    x3 = x.reshape(3, 5, 1)
    y = torch.tensor([[0], [4], [-100]], device=device)
    mask = torch.rand(3, 5, 1, generator=gen).to(device) > 0.2
    for target in (y, t.reshape(3, 5, 1)):
        args = (x3, target, w, mask, -100, 0.1)
        opcheck(ops.cross_entropy, args)
        loss, stats = ops.cross_entropy(*args)
        opcheck(ops.cross_entropy_backward,
                (torch.ones_like(loss), *args, stats, target.is_floating_point()))


def test_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 6, generator=gen).to(device).requires_grad_()
    y = torch.tensor([0, 5, 2, -100], device=device)
    t = torch.rand(4, 6, generator=gen).to(device)
    mask = torch.ones(6, dtype=torch.bool, device=device)

    def step(a):
        return (nf.cross_entropy(a, y, label_smoothing=0.1, mask=mask)
                + nf.binary_cross_entropy_with_logits(a, t)
                + nf.sigmoid_focal_loss(a, t, reduction="mean")
                + nf.kl_div(torch.log_softmax(a, 1), t, reduction="batchmean")
                + nf.kl_div(torch.log_softmax(a, 1), t))  # 'mean': torch's warning, eager only

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    expected = step(x)
    (ge,) = torch.autograd.grad(expected, x)
    got = compiled(x)
    (gg,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(gg, ge)


def test_double_backward_refused(device):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    t = torch.rand(3, 4, device=device)
    for loss in (nf.binary_cross_entropy_with_logits(x, t),
                 nf.cross_entropy(x, torch.tensor([0, 1, 2], device=device))):
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        with pytest.raises(RuntimeError, match="has no derivative: double backward"):
            torch.autograd.grad(g.sum(), x)


AUTOCAST_TWINS = {"binary_cross_entropy_with_logits": "aten::binary_cross_entropy_with_logits",
                  "kl_div": "aten::kl_div", "binary_cross_entropy": "aten::binary_cross_entropy"}


@pytest.mark.parametrize("loss", sorted(AUTOCAST_TWINS))
@pytest.mark.parametrize("key", ["AutocastCPU", "AutocastCUDA"])
def test_autocast_policy_is_torchs(loss, key):
    """The losses run in float32 under autocast (binary_cross_entropy refused on
    CUDA) because torch's ops have autocast kernels there; cross_entropy's
    log_softmax and nll_loss, and focal's float32 cross entropy, likewise."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(AUTOCAST_TWINS[loss], key)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::nll_loss", key)


def test_autocast_dtype_as_torch(device):
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    x = torch.randn(4, 5, device=device, dtype=autocast_dtype)
    t = torch.rand(4, 5, device=device, dtype=autocast_dtype)
    y = torch.tensor([0, 1, 2, 3], device=device)
    with torch.autocast(device_type=device, dtype=autocast_dtype):
        pairs = [(nf.binary_cross_entropy_with_logits(x, t), F.binary_cross_entropy_with_logits(x, t)),
                 (nf.cross_entropy(x, y), F.cross_entropy(x, y)),
                 (nf.kl_div(x, t, reduction="sum"), F.kl_div(x, t, reduction="sum")),
                 (nf.sigmoid_focal_loss(x, t), oracle.torchvision_focal(x, t, 0.25, 2))]
        if device == "cpu":
            pairs.append((nf.binary_cross_entropy(t, t), F.binary_cross_entropy(t, t)))
        else:
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                nf.binary_cross_entropy(t, t)
    for ours, theirs in pairs:
        assert ours.dtype == theirs.dtype == torch.float32


def test_autocast_leaves_float64_as_torch(device):
    """Autocast's float32 policy casts float16 and bfloat16 only: a float64 loss
    stays float64 (value and gradient), as torch's."""
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    t = torch.rand(4, 5, generator=gen, dtype=torch.float64).to(device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    calls = [(nf.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits, (x, t)),
             (nf.cross_entropy, F.cross_entropy, (x, y)),
             (lambda a, b: nf.kl_div(a, b, reduction="batchmean"),
              lambda a, b: F.kl_div(a, b, reduction="batchmean"), (x, t)),
             (lambda a, b: nf.sigmoid_focal_loss(a, b, 0.25, 2, reduction="mean"),
              lambda a, b: oracle.torchvision_focal(a, b, 0.25, 2).mean(), (x, t))]
    with torch.autocast(device_type=device, dtype=autocast_dtype):
        for ours, theirs, args in calls:
            value, expected = ours(*args), theirs(*args)
            assert value.dtype == expected.dtype == torch.float64
            (grad,), (grad_expected,) = (torch.autograd.grad(v, x) for v in (value, expected))
            assert grad.dtype == torch.float64
            torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(grad, grad_expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float16, torch.float32),
                                    (torch.bfloat16, torch.float16)], ids=str)
def test_probability_target_of_another_dtype_promotes_as_torch(device, dtypes):
    """cross_entropy computes in torch's promotion of the logits' and the
    probabilities' dtypes, and returns it (float32 logits with float64
    probabilities: a float64 loss)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 4, generator=gen).to(device=device, dtype=dtypes[0]).requires_grad_()
    p = torch.softmax(torch.randn(5, 4, generator=gen), 1).to(device=device, dtype=dtypes[1])
    # torch's log_softmax of 16-bit logits rounds to their dtype first; nanfree's does not.
    tol = dict(rtol=1e-2, atol=1e-2) if torch.finfo(dtypes[0]).bits == 16 else {}
    for reduction in ("none", "mean", "sum"):
        ours, theirs = (fn(x, p, reduction=reduction) for fn in (nf.cross_entropy, F.cross_entropy))
        assert ours.dtype == theirs.dtype == torch.promote_types(*dtypes)
        torch.testing.assert_close(ours, theirs, **tol)
        (grad,), (grad_expected,) = (torch.autograd.grad(v.sum(), x) for v in (ours, theirs))
        assert grad.dtype == grad_expected.dtype == dtypes[0]
        torch.testing.assert_close(grad, grad_expected, **tol)


def test_kl_div_mean_warns_as_torch(device):
    # Only UserWarnings: Triton's interpreter adds numpy's RuntimeWarnings (log of 0).
    def mean_warnings(record):
        return [w for w in record if issubclass(w.category, UserWarning)
                and "'mean' divides the total loss by both" in str(w.message)]

    x, t = torch.randn(3, 4, device=device), torch.rand(3, 4, device=device)
    messages = []
    for fn in (nf.kl_div, F.kl_div, nfnn.KLDivLoss()):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            fn(x, t)  # the line the functions' warning names
        (warning,) = mean_warnings(record)
        assert isinstance(fn, nfnn.KLDivLoss) or warning.filename == __file__
        messages.append(str(warning.message))
    assert messages[0] == messages[1] == messages[2]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nf.kl_div(x, t, reduction="batchmean")
    assert not mean_warnings(record)


def test_legacy_reduction_arguments(device):
    x = torch.randn(3, 4, device=device)
    t = torch.rand(3, 4, device=device)
    torch.testing.assert_close(nf.binary_cross_entropy_with_logits(x, t, size_average=False),
                               F.binary_cross_entropy_with_logits(x, t, size_average=False))
    torch.testing.assert_close(nf.kl_div(x, t, reduce=False), F.kl_div(x, t, reduce=False))


def test_modules(device):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(4, 6, generator=gen).to(device)
    t = torch.rand(4, 6, generator=gen).to(device)
    y = torch.tensor([1, 0, 5, -100], device=device)
    w = torch.rand(6, generator=gen).to(device)
    pairs = [
        (nanfree.nn.BCEWithLogitsLoss(weight=w, pos_weight=w)(x, t),
         torch.nn.BCEWithLogitsLoss(weight=w, pos_weight=w)(x, t)),
        (nanfree.nn.BCELoss(reduction="sum")(torch.sigmoid(x), t),
         torch.nn.BCELoss(reduction="sum")(torch.sigmoid(x), t)),
        (nanfree.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1)(x, y),
         torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1)(x, y)),
        (nanfree.nn.KLDivLoss(reduction="batchmean")(torch.log_softmax(x, 1), t),
         torch.nn.KLDivLoss(reduction="batchmean")(torch.log_softmax(x, 1), t)),
        (nanfree.nn.SigmoidFocalLoss(alpha=0.3, gamma=1.5, reduction="sum")(x, t),
         oracle.torchvision_focal(x, t, 0.3, 1.5).sum()),
    ]
    for ours, theirs in pairs:
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-6)
    masked = nanfree.nn.CrossEntropyLoss()(x, y, mask=torch.ones(6, dtype=torch.bool, device=device))
    torch.testing.assert_close(masked, F.cross_entropy(x, y))
    assert "weight" in dict(nanfree.nn.CrossEntropyLoss(weight=w).named_buffers())
