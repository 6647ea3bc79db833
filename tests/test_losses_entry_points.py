"""The losses' C++ entry points (nanfree._C.cross_entropy, nanfree._C.pointwise_loss,
csrc/losses.cpp) against the Python steps of nanfree/_ops/losses.py, which serve
every other call and what torch.compile traces: the same values and gradients,
bit for bit, on the backend this session selects; the entry serves the calls it
says it serves, and leaves every other one (and every error) to the Python steps."""

import itertools

import pytest
import torch

import nanfree.ops as nf
from nanfree import _C
from nanfree._ops import losses as steps

REDUCTIONS = {name: i for i, name in enumerate(_C.LOSS_REDUCTIONS)}


def _value_and_grads(fn, leaves, create_graph=False):
    """fn's value and the gradients of its leaves that require one (upstream
    gradient: 0.3, a number whose division by a count rounds), from fresh
    copies of the leaves."""
    xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    out = fn(*xs)
    need = [x for x in xs if x.requires_grad]
    grads = torch.autograd.grad(out, need, torch.full_like(out, 0.3)) if need else ()
    return out.detach(), grads


def _assert_identical(got, expected):
    (value, grads), (value_ref, grads_ref) = got, expected
    assert value.dtype == value_ref.dtype and value.shape == value_ref.shape
    assert torch.equal(value, value_ref) or (value.isnan() == value_ref.isnan()).all()
    assert len(grads) == len(grads_ref)
    for g, r in zip(grads, grads_ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def _cross_entropy_cases(device):
    """(name, input, target, weight, mask, ignore_index, label_smoothing) for
    calls the entry serves: the layouts, options and dtypes of the op."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def classes(shape, c):
        return torch.randint(0, c, shape, generator=g).to(device)

    cases = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = randn(6, 5, dtype=dtype)
        y = classes((6,), 5)
        y_ignored = y.clone()
        y_ignored[[1, 4]] = -100
        probs = torch.softmax(randn(6, 5), 1).to(dtype)
        cases += [
            (f"{dtype} indices", x, y, None, None, -100, 0.0),
            (f"{dtype} ignored", x, y_ignored, None, None, -100, 0.1),
            (f"{dtype} weight", x, y_ignored, randn(5, dtype=dtype).abs(), None, -100, 0.0),
            (f"{dtype} probabilities", x, probs.requires_grad_(), None, None, -100, 0.2),
        ]
    x = randn(3, 4, 2, 3)
    y = classes((3, 2, 3), 4)
    keep = torch.rand(3, 4, 2, 3, generator=g).to(device) > 0.3
    cases += [
        ("spatial", x, y, None, None, -100, 0.0),
        ("spatial mask", x, y, randn(4).abs(), keep, -100, 0.1),
        ("broadcast integer mask", x, y, None, torch.tensor([1, 0, 2, 1], device=device).view(4, 1, 1), -100, 0.0),
        ("transposed", randn(5, 6).t(), classes((6,), 5), None, None, -100, 0.0),
        ("unbatched", randn(7), classes((), 7), None, None, -100, 0.05),
        ("unbatched probabilities", randn(7), torch.softmax(randn(7), 0).requires_grad_(), None,
         None, -100, 0.0),
        ("everything ignored", randn(4, 3), torch.full((4,), 2, device=device), None, None, 2, 0.0),
        ("all masked", randn(4, 3), classes((4,), 3), None, torch.zeros(4, 3, dtype=torch.bool, device=device), -100, 0.0),
        ("-inf logits", torch.tensor([[0.0, -torch.inf, 1.0], [-torch.inf] * 3], device=device),
         torch.tensor([0, 1], device=device), None, None, -100, 0.1),
    ]
    return cases


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_entry_equals_the_python_steps(device, reduction):
    for name, x, y, weight, mask, ignore_index, smoothing in _cross_entropy_cases(device):
        leaves = [x.detach().requires_grad_(), y]
        served = _C.cross_entropy(x, y, weight, mask, ignore_index, smoothing, REDUCTIONS[reduction])
        assert served is not None, name

        def entry(a, b):
            return nf.cross_entropy(a, b, weight, ignore_index=ignore_index, reduction=reduction,
                                    label_smoothing=smoothing, mask=mask)

        def python_steps(a, b):
            return steps.cross_entropy_call(a, b, weight, ignore_index, reduction, smoothing, mask)

        try:
            _assert_identical(_value_and_grads(entry, leaves), _value_and_grads(python_steps, leaves))
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


POINTWISE = {  # public op -> (kind, the call of nanfree.ops, its Python steps' extra arguments)
    "binary_cross_entropy_with_logits": (steps.BCE_WITH_LOGITS, {}),
    "binary_cross_entropy": (steps.BCE, {}),
    "kl_div": (steps.KL_DIV, {"same_shape": False}),
    "kl_div log_target": (steps.KL_DIV_LOG_TARGET, {"same_shape": False}),
    "sigmoid_focal_loss": (steps.SIGMOID_FOCAL, {"alpha": 0.3, "gamma": 1.5, "same_shape": False}),
}


def _public_pointwise(op, reduction, weight, pos_weight):
    if op == "binary_cross_entropy_with_logits":
        return lambda a, b: nf.binary_cross_entropy_with_logits(a, b, weight, reduction=reduction,
                                                                pos_weight=pos_weight)
    if op == "binary_cross_entropy":
        return lambda a, b: nf.binary_cross_entropy(a, b, weight, reduction=reduction)
    if op.startswith("kl_div"):
        return lambda a, b: nf.kl_div(a, b, reduction=reduction, log_target=op.endswith("log_target"))
    return lambda a, b: nf.sigmoid_focal_loss(a, b, 0.3, 1.5, reduction=reduction)


@pytest.mark.parametrize("op", sorted(POINTWISE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
def test_pointwise_entry_equals_the_python_steps(device, op, dtype):
    kind, extra = POINTWISE[op]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g).to(device=device, dtype=dtype)
    if kind == steps.BCE:
        x = torch.sigmoid(x)
    t = torch.rand(4, 6, generator=g).to(device=device, dtype=dtype)
    with_weights = kind in (steps.BCE_WITH_LOGITS, steps.BCE)
    weight = torch.rand(6, generator=g).to(device=device, dtype=dtype) if with_weights else None
    pos_weight = (torch.rand(4, 1, generator=g).to(device=device, dtype=dtype) + 0.5
                  if kind == steps.BCE_WITH_LOGITS else None)
    reductions = ["none", "mean", "sum"] + (["batchmean"] if op.startswith("kl_div") else [])
    for reduction, weights in itertools.product(reductions, [False, True] if with_weights else [False]):
        w, pw = (weight, pos_weight) if weights else (None, None)
        served = _C.pointwise_loss(x, t, w, pw, kind, extra.get("alpha", 0.0),
                                   extra.get("gamma", 0.0), REDUCTIONS[reduction])
        assert served is not None, reduction

        def python_steps(a, b):
            return steps.pointwise_call(op.split(" ")[0], kind, a, b, w, pw, reduction=reduction,
                                        **extra)

        leaves = [x.detach().requires_grad_(), t.detach().requires_grad_()]
        try:
            _assert_identical(_value_and_grads(_public_pointwise(op, reduction, w, pw), leaves),
                              _value_and_grads(python_steps, leaves))
        except AssertionError as error:
            raise AssertionError(f"{reduction}, weights {weights}: {error}") from None


@pytest.mark.backend_independent
def test_calls_left_to_the_python_steps():
    """The entry returns None for what needs promotion, broadcasting, a cast, a
    conversion or a check's error; the public op then gives the Python steps'
    result or error."""
    x, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])
    t = torch.rand(4, 3)
    mean = REDUCTIONS["mean"]
    left = {
        "int32 target": lambda: _C.cross_entropy(x, y.int(), None, None, -100, 0.0, mean),
        "target out of range": lambda: _C.cross_entropy(x, torch.tensor([0, 3, 1, 0]), None, None,
                                                        -100, 0.0, mean),
        "weight of another dtype": lambda: _C.cross_entropy(x, y, torch.ones(3, dtype=torch.float64),
                                                            None, -100, 0.0, mean),
        "weight asking for a gradient": lambda: _C.cross_entropy(
            x, y, torch.ones(3, requires_grad=True), None, -100, 0.0, mean),
        "float mask": lambda: _C.cross_entropy(x, y, None, torch.ones(4, 3), -100, 0.0, mean),
        "label smoothing past 1": lambda: _C.cross_entropy(x, y, None, None, -100, 1.5, mean),
        "integer input": lambda: _C.cross_entropy(x.long(), y, None, None, -100, 0.0, mean),
        "batchmean": lambda: _C.cross_entropy(x, y, None, None, -100, 0.0, REDUCTIONS["batchmean"]),
        "target of another dtype": lambda: _C.pointwise_loss(x, t.double(), None, None, 0, 0.0, 0.0, mean),
        "broadcast target": lambda: _C.pointwise_loss(x, t[:1], None, None, 2, 0.0, 0.0, mean),
        "pos_weight not broadcasting": lambda: _C.pointwise_loss(x, t, None, torch.ones(2), 0, 0.0,
                                                                 0.0, mean),
    }
    for name, call in left.items():
        assert call() is None, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _C.cross_entropy(x, y, None, None, -100, 0.0, mean) is None
        assert _C.pointwise_loss(x, t, None, None, 0, 0.0, 0.0, mean) is None
        assert nf.cross_entropy(x, y).dtype == torch.float32
    with pytest.raises(IndexError, match="target 3 is out of bounds for 3 classes"):
        nf.cross_entropy(x, torch.tensor([0, 3, 1, 0]))
    torch.testing.assert_close(nf.cross_entropy(x, y.int()), nf.cross_entropy(x, y), rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_cross_entropy_refuses_double_backward(device, reduction):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    for target in (torch.tensor([0, 1, 2], device=device),
                   torch.softmax(torch.randn(3, 4, device=device), 1)):
        loss = nf.cross_entropy(x, target, reduction=reduction)
        assert loss.grad_fn.name().endswith("::NanfreeCrossEntropyLossBackward>")
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        with pytest.raises(RuntimeError, match="has no derivative: double backward"):
            torch.autograd.grad(g.sum(), x)


@pytest.mark.parametrize("op", ["cross_entropy", "binary_cross_entropy_with_logits"])
def test_reduced_loss_sees_an_input_changed_in_place(device, op):
    """The reduced nodes save the user's tensors (cross entropy's views in the
    op's layout are made again in the backward): autograd's version check
    still applies."""
    x = torch.randn(3, 4, device=device, requires_grad=True)
    logits = x * 1.0
    target = (torch.tensor([0, 1, 2], device=device) if op == "cross_entropy"
              else torch.rand(3, 4, device=device))
    loss = getattr(nf, op)(logits, target)
    with torch.no_grad():
        logits.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("reduction", ["mean", "sum", "batchmean"])
def test_reduced_pointwise_loss_is_one_node_that_refuses_double_backward(device, reduction):
    x = torch.randn(3, 4, device=device, requires_grad=True)
    t = torch.rand(3, 4, device=device, requires_grad=True)
    loss = nf.kl_div(x, t, reduction=reduction)
    assert loss.grad_fn.name().endswith("::NanfreePointwiseLossReducedBackward>")
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="has no derivative: double backward"):
        torch.autograd.grad(g.sum(), x)


