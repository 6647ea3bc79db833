"""float64 gradcheck and gradgradcheck, torch.library.opcheck and
torch.compile(fullgraph=True) of the elementwise family's unary ops
(nanfree.ops.sqrt, log, log1p, acos, asin; the ops nanfree::<op> and
nanfree::<op>_backward), the third derivative refused, a gradient penalty
(sqrt of a sum of squares of a gradient) finite at a flat critic, and torch's
behaviour in layouts, dtypes, out= and autocast."""

import pytest
import torch
from conftest import DTYPES, INTERPRETED
from drop_in_checks import allocations_and_copies, out_matches_torch, top_level_ops
from torch.library import opcheck

import nanfree.ops as nf
from nanfree import _backends
from nanfree._ops.elementwise import is_dense

OPS = ("sqrt", "log", "log1p", "acos", "asin")
GRADCHECK = dict(fast_mode=INTERPRETED)


def _interior(op, shape, device, seed=0):
    """float64 points inside the op's domain, away from its edges (gradcheck's
    steps of 1e-6 never cross one)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    x = {"sqrt": 0.1 + 3 * u, "log": 0.1 + 3 * u, "log1p": -0.9 + 3 * u,
         "acos": -0.9 + 1.8 * u, "asin": -0.9 + 1.8 * u}[op]
    return x.to(device).requires_grad_(True)


@pytest.mark.parametrize("op", OPS)
def test_gradcheck_and_gradgradcheck(device, op):
    x = _interior(op, (3, 4), device)
    fn = getattr(nf, op)
    assert torch.autograd.gradcheck(fn, (x,), **GRADCHECK)
    assert torch.autograd.gradgradcheck(fn, (x,), **GRADCHECK)


@pytest.mark.parametrize("op", OPS)
def test_matches_torch_inside_the_domain(device, op):
    x = _interior(op, (64,), device, seed=1)
    y, t = getattr(nf, op)(x), getattr(torch, op)(x)
    torch.testing.assert_close(y, t)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (tg,) = torch.autograd.grad(t.sum(), x, create_graph=True)
    torch.testing.assert_close(g, tg)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (tgg,) = torch.autograd.grad(tg.sum(), x)
    torch.testing.assert_close(gg, tgg)


@pytest.mark.parametrize("op", OPS)
def test_third_derivative_is_refused(device, op):
    x = _interior(op, (4,), device)
    y = getattr(nf, op)(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=f"{op}_backward.*third derivative"):
        torch.autograd.grad(gg.sum(), x)


def test_gradient_penalty_at_a_flat_critic(device):
    """WGAN-GP's penalty (||grad D(x)|| - 1)^2 with the norm by nanfree's sqrt:
    at a flat critic (zero input gradients) torch's sqrt gives a NaN parameter
    gradient (pytorch #2534); nanfree's gives a finite one."""
    torch.manual_seed(0)
    w = torch.zeros(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    x = torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True)
    for sqrt, finite in ((nf.sqrt, True), (torch.sqrt, False)):
        out = (x @ w.T).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        penalty = ((sqrt((gx ** 2).sum(1)) - 1) ** 2).mean()
        (gw,) = torch.autograd.grad(penalty, w)
        assert bool(torch.isfinite(gw).all()) == finite


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, op, dtype):
    x = _interior(op, (3, 5), device).detach().to(dtype)
    opcheck(getattr(torch.ops.nanfree, op), (x,))
    g = torch.randn(3, 5, dtype=torch.float64).to(device, dtype)
    for order in (1, 2):
        opcheck(getattr(torch.ops.nanfree, f"{op}_backward"), (g, x, order))


@pytest.mark.parametrize("op", OPS)
def test_opcheck_strided_and_requiring_grad(device, op):
    x = _interior(op, (4, 6), device).detach()[:, ::2].requires_grad_(True)
    opcheck(getattr(torch.ops.nanfree, op), (x,))


@pytest.mark.parametrize("op", OPS if not INTERPRETED else ("sqrt",))
def test_compile_fullgraph(device, op):
    fn = getattr(nf, op)

    def step(x):
        return fn(x * 2).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = _interior(op, (8,), device).detach() / 2
    x1 = x.clone().requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    compiled(x1).backward()
    step(x2).backward()
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_inputs_promote_as_torch(device, op, dtype):
    x = torch.tensor([0, 1, 2, 1], device=device).to(dtype)
    y, t = getattr(nf, op)(x), getattr(torch, op)(x)
    assert y.dtype == t.dtype
    torch.testing.assert_close(y, torch.where(torch.isnan(t), y, t))


@pytest.mark.parametrize("op", OPS)
def test_layouts_as_torch(device, op):
    x = _interior(op, (2, 3, 4, 5), device).detach().float()
    for view in (x, x.transpose(1, 3), x[:, :, ::2], x.contiguous(memory_format=torch.channels_last),
                 x[0, 0, 0, 0], x[:0], x.expand(2, 2, 3, 4, 5)[1]):
        y, t = getattr(nf, op)(view), getattr(torch, op)(view)
        assert y.shape == t.shape and y.dtype == t.dtype
        if is_dense(view):
            assert y.stride() == t.stride()
        torch.testing.assert_close(y, t)


@pytest.mark.parametrize("op", OPS)
def test_out_as_torch(device, op):
    x = _interior(op, (5,), device).detach().float()
    out = torch.empty(5, device=device)
    r = getattr(nf, op)(x, out=out)
    assert r is out
    torch.testing.assert_close(out, getattr(torch, op)(x))
    resized = torch.empty(0, device=device)
    getattr(nf, op)(x, out=resized)
    assert resized.shape == (5,)
    with pytest.warns(UserWarning, match="resized") as warned:
        getattr(nf, op)(x, out=torch.empty(3, device=device))
    # the caller's line, as torch's warning (Triton's interpreter may warn too)
    assert [w.filename for w in warned if "resized" in str(w.message)] == [__file__]
    with pytest.raises(TypeError, match=f"nanfree.{op}.*out"):
        getattr(nf, op)(x, out=torch.empty(5, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match="out=.*automatic differentiation"):
        getattr(nf, op)(x.clone().requires_grad_(True), out=out)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_is_written_in_place_as_torch(device, op, dtype):
    """out= writes into `out` (nanfree::<op>_out), strided or wider outs
    included; out=input computes in place; an `out` that overlaps the input
    partly gets the op of the input as it was (torch refuses it); an integer
    input writes its promoted result."""
    x = _interior(op, (4, 5), device).detach().to(dtype)
    out_matches_torch(getattr(nf, op), getattr(torch, op), (x,))
    assert top_level_ops(getattr(nf, op), x, out=torch.empty_like(x)) == [f"nanfree.{op}_out.default"]
    expected = getattr(nf, op)(x)
    inplace = x.clone()
    assert getattr(nf, op)(inplace, out=inplace) is inplace
    torch.testing.assert_close(inplace, expected, rtol=0, atol=0)
    buffer = torch.cat([x.flatten(), x.flatten()[:1]])
    getattr(nf, op)(buffer[:-1], out=buffer[1:])
    torch.testing.assert_close(buffer[1:], expected.flatten(), rtol=0, atol=0)
    ints = torch.tensor([0, 1, 2], device=device)
    out = torch.empty(3, device=device)
    getattr(nf, op)(ints, out=out)
    torch.testing.assert_close(out, getattr(nf, op)(ints), rtol=0, atol=0, equal_nan=True)


def _compiled_kernels_serve(device):
    """Whether nanfree's C++ or CUDA kernels (emulated ones included) serve the
    device, whose <op>_out write `out` themselves (the Python backends copy)."""
    return _backends.SERVING[torch.device(device).type] in ("cpu", "cuda")


@pytest.mark.parametrize("op", OPS)
def test_out_takes_no_temporary(device, op):
    """The C++ and CUDA kernels write `out` with no tensor allocated or copied: a
    contiguous `out`, and on the C++ kernels a strided one too."""
    if not _compiled_kernels_serve(device):
        pytest.skip("the Python backends compute, then copy into `out`")
    x = _interior(op, (4, 6), device).detach().float()
    outs = [torch.empty(4, 6, device=device)]
    if _backends.SERVING[torch.device(device).type] == "cpu":
        outs.append(torch.empty(4, 12, device=device)[:, ::2])
    for out in outs:
        assert allocations_and_copies(getattr(nf, op), x, out=out) == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_out(device, op, dtype):
    x = _interior(op, (3, 5), device).detach().to(dtype)
    opcheck(getattr(torch.ops.nanfree, f"{op}_out"), (x, torch.empty_like(x)))
    opcheck(getattr(torch.ops.nanfree, f"{op}_out"), (x, torch.empty_like(x.T).T))


def test_out_op_refuses_a_graph_and_bumps_the_version(device):
    """nanfree::<op>_out, called directly: an argument requiring grad is refused
    as torch's out= forms refuse it; a tensor a graph saved and <op>_out
    overwrote makes that graph's backward fail, as after torch's out= forms."""
    x = _interior("sqrt", (4,), device)
    with pytest.raises(RuntimeError, match="sqrt_out: functions with out=.*requires grad"):
        torch.ops.nanfree.sqrt_out(x, torch.empty(4, device=device))
    saved = (x * 2).exp()  # exp saves its output
    with torch.no_grad():
        torch.ops.nanfree.sqrt_out(x, saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


@pytest.mark.parametrize("op", OPS if not INTERPRETED else ("sqrt",))
def test_compile_fullgraph_out(device, op):
    fn = getattr(nf, op)

    def step(x, out):
        fn(x, out=out)
        return out * 2

    torch._dynamo.reset()  # one compile cache per op (the step's code object is shared)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = _interior(op, (8,), device).detach()
    out, ref = torch.empty_like(x), torch.empty_like(x)
    torch.testing.assert_close(compiled(x, out), step(x, ref))
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_autocast_keeps_the_dtype_as_torch(device, op, dtype):
    x = _interior(op, (4,), device).detach().to(dtype)
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    with torch.autocast(device_type=device, dtype=autocast_dtype):
        y, t = getattr(nf, op)(x), getattr(torch, op)(x)
    assert y.dtype == t.dtype
    # CUDA autocast runs log, log1p, acos and asin in float32 (torch's fp32 list);
    # CPU autocast has no row for them, nor for sqrt anywhere.
    on_fp32_list = device == "cuda" and op in ("log", "log1p", "acos", "asin")
    assert y.dtype == (torch.float32 if on_fp32_list else dtype)
    # out= as torch's out= under autocast (no autocast list has an out= overload):
    # the op in the input's dtype, written into an out of that dtype or of float32.
    for out_dtype in (dtype, torch.float32):
        ours, theirs = (torch.empty(4, dtype=out_dtype, device=device) for _ in range(2))
        with torch.autocast(device_type=device, dtype=autocast_dtype):
            getattr(nf, op)(x, out=ours)
            getattr(torch, op)(x, out=theirs)
        # Both computed in the input's dtype: its tolerance.
        torch.testing.assert_close(ours.to(dtype), theirs.to(dtype))


@pytest.mark.parametrize("op", OPS)
def test_double_backward_with_an_infinite_upstream_against_zero(device, op):
    """gg = inf against a first-order upstream gradient of 0: the second-order
    weight gg * grad is 0 (zeros dominant), not NaN."""
    x = _interior(op, (4,), device)
    y = getattr(nf, op)(x)
    (g,) = torch.autograd.grad(y, x, torch.zeros_like(y), create_graph=True)
    (gg,) = torch.autograd.grad(g, x, torch.full_like(g, float("inf")))
    assert not torch.isnan(gg).any()
