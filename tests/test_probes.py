"""Probes a hostile user tried on the landed ops, kept so that they stay fixed:
Python floats that change between calls of a compiled function, huge upstream
gradients on every op, values at a clamp bound, arguments that must be refused
clearly (naming the op or class and the argument), and scalars torch takes.
Every backend: each probe calls the kernels of the pass's backend."""

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import DEVICES, INTERPRETED

import nanfree.nn as nfnn
import nanfree.ops as nf

INF_ = math.inf
COMPILE_SKIP = pytest.mark.skipif(
    INTERPRETED, reason="compiling around interpreted Triton kernels adds nothing")


# --- a changing Python float under torch.compile ------------------------------------


def _embeddings(device, b=6, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=gen).to(device).requires_grad_(True)
    p = torch.randn(b, d, generator=gen).to(device).requires_grad_(True)
    return q, p


def _compiled_twice(fn, values, *args, dynamic=None):
    """fn(*args, value) compiled (fullgraph) and eager, for each value in turn:
    the second value makes torch.compile recompile with the float symbolic."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    for value in values:
        got = compiled(*args, value)
        want = fn(*args, value)
        torch.testing.assert_close(got, want)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        torch.testing.assert_close(torch.autograd.grad(got.sum(), leaves),
                                   torch.autograd.grad(want.sum(), leaves))


@COMPILE_SKIP
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [None, True])
def test_mnr_changing_scale_and_strength_under_compile(device, dynamic):
    q, p = _embeddings(device)
    _compiled_twice(lambda q, p, s: nf.mnr_loss(q, p, scale=s), [20.0, 30.0, 7.5], q, p,
                    dynamic=dynamic)
    _compiled_twice(lambda q, p, h: nf.mnr_loss(q, p, hardness_mode="all_negatives",
                                                hardness_strength=h),
                    [1.0, 2.0, 3.5], q, p, dynamic=dynamic)


@COMPILE_SKIP
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [None, True])
def test_gem_changing_p_under_compile(device, dynamic):
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 4, 4, generator=gen).to(device).requires_grad_(True)
    _compiled_twice(lambda x, p: nf.gem(x, p, dim=(-2, -1)), [3.0, 2.5, 4.0], x, dynamic=dynamic)
    _compiled_twice(lambda x, p: nf.gem_pool2d(x, p), [3.0, 2.5, 4.0], x, dynamic=dynamic)
    _compiled_twice(lambda x, eps: nf.gem_pool2d(x, 3.0, eps), [1e-6, 1e-3], x, dynamic=dynamic)


@COMPILE_SKIP
@pytest.mark.parametrize("device", DEVICES)
def test_other_floats_under_compile(device):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(4, 8, generator=gen).to(device).requires_grad_(True)
    b = torch.randn(4, 8, generator=gen).to(device).requires_grad_(True)
    _compiled_twice(lambda a, b, eps: nf.cosine_similarity(a, b, 1, eps), [1e-8, 1e-6], a, b)
    _compiled_twice(lambda a, eps: nf.normalize(a, 2.0, 1, eps), [1e-12, 1e-6], a)
    _compiled_twice(lambda a, p: nf.normalize(a, p, 1), [3.0, 1.5], a)


@COMPILE_SKIP
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_bad_float_still_refused(device):
    """Under compile the op checks the value (at run time): a bad float is still a
    clear error, not a wrong result."""
    q, p = _embeddings(device)
    x = torch.rand(2, 3, 4, 4).to(device)
    torch._dynamo.reset()
    gem = torch.compile(lambda x, p: nf.gem_pool2d(x, p), fullgraph=True)
    gem(x, 3.0)
    gem(x, 2.0)
    with pytest.raises(Exception, match=r"`p` must be finite and > 0"):
        gem(x, -1.0)
    mnr = torch.compile(lambda q, p, s: nf.mnr_loss(q, p, scale=s), fullgraph=True)
    mnr(q, p, 20.0)
    mnr(q, p, 10.0)
    with pytest.raises(Exception, match=r"`scale` must be"):
        mnr(q, p, math.inf)


# --- GeM: a tensor p at its clamp bounds; modules that check when constructed -------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bound", [1e-2, 1e2])
def test_gem_p_gradient_passes_at_the_clamp_bounds(device, dtype, bound):
    """p exactly at a bound (in its dtype) gets d gem / d p (a learnable p
    initialised at 100 must be able to move); just outside it gets 0."""
    x = torch.tensor([[0.5, 1.0, 1.5, 2.0]], dtype=dtype, device=device)
    outside = bound * 1.01 if bound > 1 else bound * 0.99
    p = torch.tensor([outside], dtype=dtype, device=device, requires_grad=True)
    (grad,) = torch.autograd.grad(nf.gem(x, p, dim=-1).sum(), p)
    assert grad.item() == 0, grad
    # The value at the bound: the derivative of the formula itself.
    p = torch.tensor([bound], dtype=dtype, device=device, requires_grad=True)
    (grad,) = torch.autograd.grad(nf.gem(x, p, dim=-1).sum(), p)
    pd = torch.tensor(float(p.detach().item()), dtype=torch.float64, requires_grad=True)
    ref = (x.double().pow(pd).mean(-1)).pow(1 / pd).sum()
    (want,) = torch.autograd.grad(ref, pd)
    torch.testing.assert_close(grad.double().reshape(()).cpu(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("module", [nfnn.GeM, nfnn.GeMTokenPooling])
@pytest.mark.parametrize("learnable", [True, False])
@pytest.mark.parametrize("p", [0.0, -1.0, math.inf, -math.inf, math.nan])
def test_gem_modules_refuse_a_bad_p_when_constructed(module, learnable, p):
    with pytest.raises(ValueError, match=rf"nanfree.nn.{module.__name__}: `p` must be"):
        module(p=p, learnable=learnable)


@pytest.mark.parametrize("module", [nfnn.GeM, nfnn.GeMTokenPooling])
def test_gem_modules_refuse_a_learnable_p_the_op_would_clamp(module):
    for p in (5e-3, 200.0):
        with pytest.raises(ValueError, match=r"\[0.01, 100\]"):
            module(p=p)
    module(p=200.0, learnable=False)  # a fixed p is used as is, like the functional op
    module(p=100.0)
    module(p=0.01)


@pytest.mark.parametrize("module", [nfnn.GeM, nfnn.GeMTokenPooling])
@pytest.mark.parametrize("eps", [0.0, -1.0, math.inf, math.nan])
def test_gem_modules_refuse_a_bad_eps_when_constructed(module, eps):
    with pytest.raises(ValueError, match=rf"nanfree.nn.{module.__name__}: `eps` must be"):
        module(eps=eps)


@pytest.mark.parametrize("eps", [-1.0, math.inf, math.nan])
def test_cosine_similarity_module_refuses_a_bad_eps_when_constructed(eps):
    with pytest.raises(ValueError, match=r"nanfree.nn.CosineSimilarity: `eps` must be"):
        nfnn.CosineSimilarity(eps=eps)
    with pytest.raises(TypeError, match=r"nanfree.nn.CosineSimilarity: `dim` must be an int"):
        nfnn.CosineSimilarity(dim=True)
    nfnn.CosineSimilarity(eps=0.0)  # torch's accepts eps = 0 (a zero vector then gives 0 here)


@pytest.mark.parametrize("module", [nfnn.Softmax, nfnn.LogSoftmax])
def test_distribution_modules_refuse_a_bool_dim(module):
    with pytest.raises(TypeError, match=rf"nanfree.nn.{module.__name__}: `dim` must be an int"):
        module(dim=True)


# --- clear errors: the op or class and the argument named --------------------------


def _q_p(b=3, d=4):
    return torch.randn(b, d), torch.randn(b, d)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(directions=1), TypeError, r"`directions` must be a sequence"),
    (dict(directions=["query_to_doc", 3]), ValueError, r"unknown `directions`"),
    (dict(hardness_mode=["in_batch_negatives"]), ValueError, r"`hardness_mode` must be one of"),
    (dict(hardness_mode="in_batch_negatives", hardness_strength="1"), TypeError,
     r"`hardness_strength` must be a number"),
    (dict(symmetric="no"), TypeError, r"`symmetric` must be a bool"),
    (dict(partition_mode=["joint"]), ValueError, r"`partition_mode` must be"),
    (dict(reduction=["mean"]), ValueError, r"`reduction` must be"),
    (dict(gather_across_devices="yes"), TypeError, r"`gather_across_devices` must be a bool"),
])
def test_mnr_loss_bad_options_name_the_argument(kwargs, error, words):
    q, p = _q_p()
    with pytest.raises(error, match=r"nanfree.mnr_loss: .*" + words):
        nf.mnr_loss(q, p, **kwargs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(scale=-1.0), r"`scale` must be positive"),
    (dict(directions="query_to_doc"), r"`directions` must be"),
    (dict(hardness_mode="nope"), r"`hardness_mode` must be one of"),
    (dict(hardness_strength=-1.0), r"`hardness_strength` must be"),
])
@pytest.mark.parametrize("module", [nfnn.MNRLoss, nfnn.MultipleNegativesRankingLoss])
def test_mnr_modules_name_the_class(module, kwargs, words):
    args = () if module is nfnn.MNRLoss else (None,)
    with pytest.raises((ValueError, TypeError), match=rf"nanfree.nn.{module.__name__}: .*{words}"):
        module(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [nf.softmax, nf.log_softmax])
def test_distribution_non_float_dtype_names_dtype(device, op):
    x = torch.randn(2, 3, device=device)
    with pytest.raises(TypeError, match=rf"nanfree.{op.__name__}: `dtype` must be a floating"):
        op(x, -1, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_bool_dim_is_refused_like_torch(device):
    x = torch.randn(2, 3, device=device)
    for call in (lambda: nf.softmax(x, True), lambda: nf.log_softmax(x, True),
                 lambda: nf.logsumexp(x, True), lambda: nf.cosine_similarity(x, x, True),
                 lambda: nf.normalize(x, dim=True), lambda: nf.gem(x.abs(), dim=True)):
        with pytest.raises(TypeError, match=r"`dim` must be an int"):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_normalize_out_of_another_shape_is_resized_with_a_warning(device):
    x = torch.randn(3, 4, device=device)
    out = torch.empty(5, device=device)
    with pytest.warns(UserWarning, match=r"resized"):
        got = nf.normalize(x, out=out)
    assert got is out and out.shape == x.shape
    torch.testing.assert_close(out, torch.nn.functional.normalize(x))
    empty = torch.empty(0, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an empty out is resized silently, as torch's
        nf.normalize(x, out=empty)
    with pytest.raises(TypeError, match=r"nanfree.normalize: `out`"):
        nf.normalize(x, out=torch.empty(3, 4, dtype=torch.int64, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_scalars_are_numbers(device):
    """torch takes numpy scalars wherever it takes a Python number; so does nanfree."""
    x = torch.rand(2, 3, 4, 4, device=device) + 0.1
    torch.testing.assert_close(nf.gem_pool2d(x, np.float32(3.0), np.float64(1e-6)),
                               nf.gem_pool2d(x, 3.0, 1e-6))
    torch.testing.assert_close(nf.gem(x, np.int64(2), dim=-1), nf.gem(x, 2.0, dim=-1))
    a = x.reshape(4, -1)
    torch.testing.assert_close(nf.cosine_similarity(a, a.flip(0), 1, np.float32(1e-8)),
                               nf.cosine_similarity(a, a.flip(0), 1, 1e-8))
    torch.testing.assert_close(nf.normalize(a, np.float32(2.0), 1, np.float64(1e-12)),
                               nf.normalize(a, 2.0, 1, 1e-12))
    q, p = a[:2], a[2:]
    torch.testing.assert_close(nf.mnr_loss(q, p, scale=np.float32(10.0)),
                               nf.mnr_loss(q, p, scale=10.0))
    nfnn.GeM(p=np.float32(3.0))
    nfnn.CosineSimilarity(eps=np.float64(1e-8))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_is_refused_naming_the_op(device):
    """torch.func's transforms: refused with the op's name and the alternative
    (torch.autograd.grad), not an error from inside the dispatcher."""
    x = torch.randn(2, 3, device=device)
    calls = {"softmax": lambda t: nf.softmax(t, -1).sum(),
             "cosine_similarity": lambda t: nf.cosine_similarity(t, t.flip(0)).sum(),
             "gem": lambda t: nf.gem(t.abs() + 0.1, dim=-1).sum(),
             "mnr_loss": lambda t: nf.mnr_loss(t, t.flip(0)),
             "log_softmax": lambda t: nf.log_softmax(t, 0).sum(),
             "logsumexp": lambda t: nf.logsumexp(t, (0, 1)),
             "normalize": lambda t: nf.normalize(t).sum(),
             "cos_sim": lambda t: nf.cos_sim(t, t).sum()}
    for name, fn in calls.items():
        with pytest.raises(NotImplementedError, match=rf"nanfree.{name}: .*torch.func.*"
                                                      r"torch.autograd.grad"):
            torch.func.grad(fn)(x)


# --- bfloat16 outputs rounded to nearest even on every backend -------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_outputs_round_to_nearest_even(device):
    """Each bfloat16 output is the float32 result rounded to nearest even, as
    torch's conversion and compiled Triton's store round it. Triton's
    interpreter truncates in a plain store: about half the entries would
    differ by one bfloat16 step, and softmax of [0, 0, 0] would give 0.33203125
    instead of 0.333984375 (1/3 = 0x3EAAAAAB in float32)."""
    third = torch.zeros(2, 3, dtype=torch.bfloat16, device=device)
    assert (nf.softmax(third, -1) == torch.tensor(1 / 3).to(torch.bfloat16)).all()
    assert (nf.softmax(third.t(), 0) == torch.tensor(1 / 3).to(torch.bfloat16)).all()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 50, generator=gen).to(torch.bfloat16).to(device)
    g = torch.randn(64, 50, generator=gen).to(torch.bfloat16).to(device)
    for ours, theirs in ((nf.softmax, torch.softmax), (nf.log_softmax, torch.log_softmax)):
        for dim in (1, 0):
            xs = x.detach().requires_grad_(True)
            got = ours(xs, dim)
            (got_grad,) = torch.autograd.grad(got, xs, g)
            # The backward's float32 math from the saved bfloat16 output, as the kernels do it.
            y, gf = got.detach().float(), g.float()
            if ours is nf.softmax:
                want_grad = y * (gf - (gf * y).sum(dim, keepdim=True))
            else:
                want_grad = gf - torch.exp(y) * gf.sum(dim, keepdim=True)
            for what, a, b in (("output", got, theirs(x.float(), dim)),
                               ("gradient", got_grad, want_grad)):
                same = (a == b.to(torch.bfloat16)).float().mean().item()
                # float32 results of another summation order may differ by one
                # step at a rounding boundary; truncation would give about 0.5.
                assert same > 0.95, f"{ours.__name__} dim {dim} {what}: {same:.3f} round as torch"
    lse = nf.logsumexp(x, 1)
    assert (lse == torch.logsumexp(x.float(), 1).to(torch.bfloat16)).float().mean() > 0.95


# --- MNR: empty hard negatives keep the graph ----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_mnr_empty_hard_negatives_keep_the_graph(device):
    """[B, 0, d] negatives that require grad get a zero gradient (as through
    torch.cat), not "appears to not have been used in the graph"."""
    q, p = _embeddings(device, b=4, d=6)
    empty = torch.zeros(4, 0, 6, device=device, requires_grad=True)
    loss = nf.mnr_loss(q, p, empty)
    grads = torch.autograd.grad(loss, (q, p, empty))
    assert grads[2].shape == (4, 0, 6)
    torch.testing.assert_close(loss, nf.mnr_loss(q, p))
    torch.testing.assert_close(grads[:2], torch.autograd.grad(nf.mnr_loss(q, p), (q, p)))


# --- huge upstream gradients --------------------------------------------------------


def _huge_cases(dtype, device):
    """(name, x, g, mask) rows whose upstream gradient is near the dtype's largest
    value: the sums and differences of the backward overflow while the exact
    gradient is finite (or saturates)."""
    big = torch.finfo(dtype).max * 0.9
    gen = torch.Generator().manual_seed(4)
    cases = [("softmax [0, -200], g = [big, -big]", [[0.0, -200.0]], [[big, -big]], None),
             ("[0, -inf], g = [big, big]", [[0.0, -INF_]], [[big, big]], None),
             ("[0, 0], g = [big, big]", [[0.0, 0.0]], [[big, big]], None)]
    for n in (37, 300):
        x = torch.randn(3, n, generator=gen, dtype=torch.float64) * 3
        sign = torch.where(torch.rand(3, n, generator=gen) < 0.5, -1.0, 1.0).double()
        g = sign * big * (0.5 + 0.5 * torch.rand(3, n, generator=gen, dtype=torch.float64))
        mask = torch.rand(3, n, generator=gen) < 0.8
        cases.append((f"random n = {n}", x.tolist(), g.tolist(), mask))
        cases.append((f"same sign n = {n}", x.tolist(), g.abs().tolist(), None))
    for name, x, g, mask in cases:
        yield (name, torch.tensor(x, dtype=dtype, device=device),
               torch.tensor(g, dtype=torch.float64).clamp(-big, big).to(dtype).to(device),
               None if mask is None else mask.to(device))





def _expected_from_output(op, y, g, mask, dim, dtype):
    """The backward's exact math in float64 from the op's own (rounded) output,
    saturated to dtype's range."""
    # At the scale 2^-64 (float64 sums of float64 values near its largest would
    # overflow), unscaled with saturation at the end.
    scale = 2.0 ** -64
    y, g = y.double(), g.double() * scale
    if op == "softmax":
        want = y * (g - (g * y).sum(dim, keepdim=True))
    else:
        kept = g if mask is None else torch.where(mask, g, 0.0)
        want = g - torch.exp(y) * kept.sum(dim, keepdim=True)
        if mask is not None:
            want = torch.where(mask, want, 0.0)
    big = torch.finfo(dtype).max
    return (want / scale).clamp(-big, big)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("layout", ["rows", "strided"])
def test_huge_upstream_gradient_gives_a_finite_gradient(device, dtype, op, layout):
    """DESIGN 1.2 with an upstream gradient near the dtype's largest value: the
    gradient is finite and equals the exact one (saturated where it passes the
    range), on rows of 2 to 300 entries, masked or not, rows and strided."""
    fn = getattr(nf, op)
    for name, x, g, mask in _huge_cases(dtype, device):
        if op == "softmax" and mask is not None:
            mask = None  # softmax's mask is a forward matter; the backward takes none
        dim = -1
        if layout == "strided":
            # The reduced dim first: [n, rows], reduced over dim 0 (inner = rows).
            x = x.t().contiguous()
            g = g.t().contiguous()
            mask = None if mask is None else mask.t().contiguous()
            dim = 0
        xs = x.clone().requires_grad_(True)
        y = fn(xs, dim, mask=mask) if mask is not None else fn(xs, dim)
        (grad,) = torch.autograd.grad(y, xs, g)
        assert torch.isfinite(grad).all(), f"{op} {name}: {grad}"
        keep = None if mask is None else mask
        want = _expected_from_output(op, y.detach(), g, keep, dim, dtype)
        big = torch.finfo(dtype).max
        acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
        # Cancellation of terms near the largest value: errors of a few of their
        # ulps in the accumulation type per entry summed (the output's rounding
        # to dtype is relative: rtol).
        atol = 8 * big * acc_eps * x.shape[dim]
        torch.testing.assert_close(grad.double(), want, rtol=4 * torch.finfo(dtype).eps,
                                   atol=atol, msg=lambda m: f"{op} {name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=str)
def test_huge_upstream_gradient_normalize(device, dtype):
    """normalize's backward with g near the dtype's largest value: finite, and
    the exact gradient (saturated past the range): g parallel to the output
    gives exactly 0 in exact arithmetic, where sum(g * y) overflows."""
    big = torch.finfo(dtype).max * 0.9
    gen = torch.Generator().manual_seed(5)
    for d in (4, 37, 300):
        x = torch.randn(4, d, generator=gen, dtype=torch.float64)
        x[1] *= 1e-3  # a small vector: its gradient passes the range and saturates
        x[2] = 0.0  # a zero vector: gradient 0
        x = x.to(dtype).to(device)
        sign = torch.where(torch.rand(4, d, generator=gen) < 0.5, -1.0, 1.0).double()
        g = sign * big * (0.5 + 0.5 * torch.rand(4, d, generator=gen, dtype=torch.float64))
        g[0] = big * torch.sign(x[0].double().cpu())  # same signs as y: dot = sum |g y| overflows
        g = g.clamp(-big, big).to(dtype).to(device)
        xs = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(nf.normalize(xs, dim=1), xs, g)
        assert torch.isfinite(grad).all(), f"d = {d}: {grad}"
        # The backward's exact math from the op's own (rounded) output, in float64
        # at the scale 2^-64, scaled back and saturated: (g - y * dot) / norm, 0
        # for a vector below eps (nanfree's rule).
        scale = 2.0 ** -64
        y = nf.normalize(x, dim=1).double()
        gs = g.double() * scale
        norms = x.double().norm(dim=1, keepdim=True)
        want = (gs - y * (gs * y).sum(1, keepdim=True)) / norms.clamp_min(1e-300)
        want = torch.where(norms >= 1e-12, want / scale, 0.0)
        want = want.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
        acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
        # Cancellation of terms near the largest value (a few ulps of each of the
        # d products), divided by the norm; the result's rounding to dtype.
        atol = 8 * big * acc_eps * d / norms.clamp_min(1e-12)
        ok = (grad.double() - want).abs() <= atol + 4 * torch.finfo(dtype).eps * want.abs()
        assert ok.all(), f"d = {d}: got {grad[~ok]}, want {want[~ok]}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_huge_upstream_gradient_cos_sim(device, dtype):
    """cos_sim's backward with an upstream [N, M] near the dtype's largest value:
    the products G @ b and G.T @ a would overflow (then NaN in normalize's
    backward); the gradient is finite, and exact where no intermediate
    passes the range."""
    big = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(5, 8, generator=gen, dtype=torch.float64).to(dtype).to(device)
    b = torch.randn(7, 8, generator=gen, dtype=torch.float64).to(dtype).to(device)
    sign = torch.where(torch.rand(5, 7, generator=gen) < 0.5, -1.0, 1.0).double()
    for fraction in (0.9, 1 / 16):
        g = (sign * big * fraction).to(dtype).to(device)
        at, bt = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        grads = torch.autograd.grad(nf.cos_sim(at, bt), (at, bt), g)
        assert all(torch.isfinite(t).all() for t in grads), f"{fraction}: {grads}"
        if fraction < 0.5:  # no intermediate passes the range
            scale = 2.0 ** -64
            ad, bd = a.double().requires_grad_(True), b.double().requires_grad_(True)
            sim = torch.nn.functional.normalize(ad, dim=1) @ torch.nn.functional.normalize(bd, dim=1).T
            wants = torch.autograd.grad(sim, (ad, bd), g.double() * scale)
            acc_eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
            for got, want in zip(grads, wants):
                want = (want / scale).clamp(-big, big)
                tol = 64 * big * fraction * max(acc_eps, torch.finfo(dtype).eps) * 8
                torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)


# --- torch.export and torch.jit.trace record the ops; meta and fake tensors ----------

# One call of every public function, with other inputs' values at replay.
_RECORDED_CALLS = {
    "softmax": lambda x, y: nf.softmax(x, 1),
    "log_softmax": lambda x, y: nf.log_softmax(x, -1),
    "logsumexp": lambda x, y: nf.logsumexp(x, (0, 1)),
    "cosine_similarity": lambda x, y: nf.cosine_similarity(x, y),
    "normalize": lambda x, y: nf.normalize(x, dim=(0, 1)),
    "normalize p=3": lambda x, y: nf.normalize(x, 3.0),
    "cos_sim": lambda x, y: nf.cos_sim(x, y),
    "gem": lambda x, y: nf.gem(x.abs(), 3.0, dim=1),
    "mnr_loss": lambda x, y: nf.mnr_loss(x, y),
    "sqrt": lambda x, y: nf.sqrt(x.abs()),
    "pow": lambda x, y: nf.pow(x.abs(), y),
    "pow of a number": lambda x, y: nf.pow(x.abs(), 2.5),
    "bce with logits, mean": lambda x, y: nf.binary_cross_entropy_with_logits(x, y.sigmoid()),
    "bce, sum": lambda x, y: nf.binary_cross_entropy(x.sigmoid(), y.sigmoid(), reduction="sum"),
    "cross_entropy, mean": lambda x, y: nf.cross_entropy(x, y.softmax(1)),
    "cross_entropy of indices": lambda x, y: nf.cross_entropy(x, y.argmax(1), ignore_index=2),
    "kl_div, batchmean": lambda x, y: nf.kl_div(x, y.softmax(1), reduction="batchmean"),
    "focal, mean": lambda x, y: nf.sigmoid_focal_loss(x, y.sigmoid(), reduction="mean"),
}


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_RECORDED_CALLS))
def test_export_and_jit_trace_replay_other_inputs(device, name):
    """torch.export and torch.jit.trace record the torch.ops.nanfree ops: a replay
    on other inputs gives the eager result. (jit.trace once gave the sum for a
    loss's mean: the C++ entry divides on the host, unrecorded; it is not taken
    while the tracer records.)"""
    fn = _RECORDED_CALLS[name]
    gen = torch.Generator().manual_seed(7)
    x, y, x2, y2 = (torch.randn(4, 6, generator=gen).to(device) for _ in range(4))
    want = fn(x2, y2)
    exported = torch.export.export(_Call(fn), (x, y)).module()
    torch.testing.assert_close(exported(x2, y2), want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(_Call(fn), (x, y))
    torch.testing.assert_close(traced(x2, y2), want)


@pytest.mark.backend_independent  # meta and fake tensors run the fake kernels only
@pytest.mark.parametrize("name", list(_RECORDED_CALLS))
def test_meta_and_fake_tensors(name):
    """Every public function takes meta tensors and FakeTensorMode's tensors, value and
    gradient, with the shapes and dtypes of a real call. (The losses once raised:
    autocast knows no meta device, and their C++ entry and cross entropy's mean read
    values on the host, which a fake tensor does not have.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = _RECORDED_CALLS[name]
    x, y = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6)
    real = fn(x, y)
    real_grad = torch.autograd.grad(real.sum(), x)[0]

    def check(inp, other):
        out = fn(inp, other)
        (grad,) = torch.autograd.grad(out.sum(), inp)
        assert (out.shape, out.dtype) == (real.shape, real.dtype), name
        assert (grad.shape, grad.dtype) == (real_grad.shape, real_grad.dtype), name

    check(x.detach().to("meta").requires_grad_(True), y.to("meta"))
    plain = x.detach()
    with FakeTensorMode() as mode:
        check(mode.from_tensor(plain).requires_grad_(True), mode.from_tensor(y))
