"""float64 gradcheck and gradgradcheck, torch.library.opcheck and
torch.compile(fullgraph=True) of the elementwise family's binary ops
(nanfree.ops.pow, atan2, div_no_nan, xlogy, xlog1py; the ops nanfree::<op>
and nanfree::<op>_backward), broadcasting and type promotion as torch's
(gradients summed to each input's shape and returned in its dtype, Python
numbers either side), the third derivative refused, and torch's behaviour in
values, gradients and second derivatives inside the domains, layouts, out=
and autocast."""

import math

import pytest
import torch
from conftest import DTYPES, INTERPRETED
from drop_in_checks import allocations_and_copies, out_matches_torch, top_level_ops
from torch.library import opcheck

import nanfree.ops as nf
from nanfree import _backends

OPS = ("pow", "atan2", "div_no_nan", "xlogy", "xlog1py")
TORCH = {"pow": torch.pow, "atan2": torch.atan2, "div_no_nan": torch.div, "xlogy": torch.xlogy,
         "xlog1py": torch.special.xlog1py}
GRADCHECK = dict(fast_mode=INTERPRETED)


def _interior(op, shape_a, shape_b, device, seed=0):
    """float64 (a, b) inside the op's domain, away from its edges and singular
    points (gradcheck's steps of 1e-6 never cross one)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(shape_a, generator=gen, dtype=torch.float64)
    v = torch.rand(shape_b, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(shape_b, generator=gen) < 0.5, -1.0, 1.0).double()
    a, b = {
        "pow": (0.2 + 2.8 * u, -2 + 5 * v),
        "atan2": (-2 + 4 * u, sign * (0.3 + v)),
        "div_no_nan": (-2 + 4 * u, sign * (0.3 + v)),
        "xlogy": (-2 + 4 * u, 0.2 + 2.8 * v),
        "xlog1py": (-2 + 4 * u, -0.8 + 3 * v),
    }[op]
    return a.to(device).requires_grad_(True), b.to(device).requires_grad_(True)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 1), (4,))], ids=["same", "broadcast"])
def test_gradcheck_and_gradgradcheck(device, op, shapes):
    a, b = _interior(op, *shapes, device)
    fn = getattr(nf, op)
    assert torch.autograd.gradcheck(fn, (a, b), **GRADCHECK)
    assert torch.autograd.gradgradcheck(fn, (a, b), **GRADCHECK)


@pytest.mark.parametrize("op", OPS)
def test_matches_torch_inside_the_domain(device, op):
    a, b = _interior(op, (64,), (64,), device, seed=1)
    y, t = getattr(nf, op)(a, b), TORCH[op](a, b)
    torch.testing.assert_close(y, t)
    ours = torch.autograd.grad(y.sum(), (a, b), create_graph=True)
    theirs = torch.autograd.grad(t.sum(), (a, b), create_graph=True)
    for g, tg in zip(ours, theirs):
        torch.testing.assert_close(g, tg)
    for g, tg in zip(ours, theirs):
        second = torch.autograd.grad(g.sum(), (a, b), retain_graph=True, allow_unused=True)
        t_second = torch.autograd.grad(tg.sum(), (a, b), retain_graph=True, allow_unused=True)
        for s, ts in zip(second, t_second):
            ts = torch.zeros_like(a) if ts is None else ts
            torch.testing.assert_close(s, ts)


@pytest.mark.parametrize("op", OPS)
def test_third_derivative_is_refused(device, op):
    a, b = _interior(op, (4,), (4,), device)
    y = getattr(nf, op)(a, b)
    (g,) = torch.autograd.grad(y.sum(), a, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), b, create_graph=True)
    with pytest.raises(RuntimeError, match=f"{op}_backward.*third derivative"):
        torch.autograd.grad(gg.sum(), a)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, op, dtype):
    a, b = _interior(op, (3, 5), (3, 5), device)
    a, b = a.detach().to(dtype), b.detach().to(dtype)
    opcheck(getattr(torch.ops.nanfree, op), (a, b))
    g = torch.randn(3, 5, dtype=torch.float64).to(device, dtype)
    backward = getattr(torch.ops.nanfree, f"{op}_backward")
    for order, partial in ((1, 0), (1, 1), (2, 0), (2, 1), (2, 2)):
        opcheck(backward, (g, a, b, order, partial))


@pytest.mark.parametrize("op", OPS)
def test_opcheck_broadcast_strided_and_requiring_grad(device, op):
    a, b = _interior(op, (4, 6), (6,), device)
    opcheck(getattr(torch.ops.nanfree, op), (a.detach()[:, ::2].requires_grad_(True),
                                             b.detach()[::2].requires_grad_(True)))
    opcheck(getattr(torch.ops.nanfree, op), (a, b.detach()[0]))


@pytest.mark.parametrize("op", OPS if not INTERPRETED else ("pow",))
def test_compile_fullgraph(device, op):
    fn = getattr(nf, op)

    def step(a, b, p):
        return (fn(a * 2, b) + fn(a, p)).sum()

    torch._dynamo.reset()  # one compile cache per op (the step's code object is shared)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a, b = _interior(op, (8,), (8,), device)
    a, b = a.detach() / 2, b.detach()
    for p in (1.5, 2.5):  # a changing Python float
        ins = [t.clone().requires_grad_(True) for t in (a, b)]
        ref = [t.clone().requires_grad_(True) for t in (a, b)]
        compiled(*ins, p).backward()
        step(*ref, p).backward()
        for x, y in zip(ins, ref):
            torch.testing.assert_close(x.grad, y.grad)


@pytest.mark.parametrize("op", OPS)
def test_type_promotion_as_torch(device, op):
    """Mixed dtypes, 0-d tensors, integers and Python numbers: torch's result dtype;
    each gradient in its input's dtype."""
    half = torch.tensor([0.5, 1.5, 2.0], dtype=torch.float16, device=device)
    cases = [
        (half, torch.tensor([1.0, 2.0, 3.0], device=device)),       # float16, float32 -> float32
        (half, torch.tensor(2.0, dtype=torch.float64, device=device)),  # 0-d does not widen
        (half, 2.5), (2.5, half), (half, 2), (torch.tensor([1, 2, 3], device=device), 2.5),
        (torch.tensor([1, 2, 3], device=device), torch.tensor([2, 1, 2], device=device)),
        (torch.tensor([True, False, True], device=device), half),
    ]
    for a, b in cases:
        y = getattr(nf, op)(a, b)
        if op == "atan2":  # torch.atan2 takes tensors only: a number as a 0-d tensor (same dtype rule)
            a, b = (x if isinstance(x, torch.Tensor) else torch.tensor(x, device=device)
                    for x in (a, b))
        t = TORCH[op](a, b)
        assert y.dtype == t.dtype, f"{op}({a}, {b}): {y.dtype} vs torch {t.dtype}"
        assert y.shape == t.shape
        if y.dtype.is_floating_point:
            torch.testing.assert_close(y, t, equal_nan=True, rtol=2e-3, atol=1e-3)
    a = torch.tensor([0.5, 1.5, 2.0], dtype=torch.float16, device=device, requires_grad=True)
    b = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    ga, gb = torch.autograd.grad(getattr(nf, op)(a, b).sum(), (a, b))
    assert ga.dtype == torch.float16 and gb.dtype == torch.float32


@pytest.mark.parametrize("op", OPS)
def test_layouts_as_torch(device, op):
    a, b = _interior(op, (2, 3, 4, 5), (2, 3, 4, 5), device)
    a, b = a.detach().float(), b.detach().float()
    views = [(a, b), (a.transpose(1, 3), b.transpose(1, 3)), (a[:, :, ::2], b[:, :, ::2]),
             (a.contiguous(memory_format=torch.channels_last),
              b.contiguous(memory_format=torch.channels_last)),
             (a, b[0, 0, 0]), (a[0, 0, 0, 0], b), (a[:0], b[:0]), (a[:, :1], b[:1, :, :1])]
    views += [(a[:, :, ::2].transpose(0, 3), b[0, 0, 0, 0]), (a[0, 0, 0], b.transpose(1, 2)),
              (a.contiguous(memory_format=torch.channels_last), b),
              (a, b.contiguous(memory_format=torch.channels_last))]
    # One element broadcast (every stride 0), read in place as a 0-d operand is.
    views += [(a, b[0, 0, 0, :1].expand(2, 3, 4, 5)), (a[:1, :1, :1, :1].expand(2, 3, 4, 5), b)]
    for x, y in views:
        ours, theirs = getattr(nf, op)(x, y), TORCH[op](x, y)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert ours.stride() == theirs.stride() or ours.numel() <= 1, (x.stride(), y.stride())
        torch.testing.assert_close(ours, theirs)
        xg, yg = x.detach().requires_grad_(True), y.detach().requires_grad_(True)
        grads = torch.autograd.grad(getattr(nf, op)(xg, yg).sum(), (xg, yg))
        t_grads = torch.autograd.grad(TORCH[op](xg, yg).sum(), (xg, yg))
        for g, tg in zip(grads, t_grads):
            torch.testing.assert_close(g, tg)


@pytest.mark.parametrize("op", OPS)
def test_out_as_torch(device, op):
    a, b = _interior(op, (5,), (5,), device)
    a, b = a.detach().float(), b.detach().float()
    out = torch.empty(5, device=device)
    r = getattr(nf, op)(a, b, out=out)
    assert r is out
    torch.testing.assert_close(out, TORCH[op](a, b))
    with pytest.warns(UserWarning, match="resized") as warned:
        getattr(nf, op)(a, b, out=torch.empty(3, device=device))
    # the caller's line, as torch's warning (Triton's interpreter may warn too)
    assert [w.filename for w in warned if "resized" in str(w.message)] == [__file__]
    half = a.bfloat16()  # pow and div_no_nan: a number not in bfloat16 takes float32 first
    with pytest.warns(UserWarning, match="resized") as warned:
        resized = getattr(nf, op)(half, 0.3, out=torch.empty(3, dtype=torch.bfloat16, device=device))
    assert [w.filename for w in warned if "resized" in str(w.message)] == [__file__]
    torch.testing.assert_close(resized, getattr(nf, op)(half, 0.3), rtol=0, atol=0)
    row = b[:1].clone()  # an input that broadcasts, as `out`: a resize would change it
    with pytest.raises(RuntimeError, match=r"output with shape \[1\] doesn't match the broadcast"):
        theirs = row.clone()
        TORCH[op](a, theirs, out=theirs)  # torch's words
    with pytest.raises(RuntimeError, match=r"output with shape \[1\] doesn't match the broadcast"):
        getattr(nf, op)(a, row, out=row)
    with pytest.raises(TypeError, match=f"nanfree.{op}.*out"):
        getattr(nf, op)(a, b, out=torch.empty(5, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match="out=.*automatic differentiation"):
        getattr(nf, op)(a.clone().requires_grad_(True), b, out=out)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_is_written_in_place_as_torch(device, op, dtype):
    """out= writes into `out` (nanfree::<op>_out), strided or wider outs
    included, broadcast operands and a Python number too; out=input computes
    in place; an `out` that overlaps an operand partly gets the op of the
    operands as they were (torch refuses it)."""
    a, b = _interior(op, (4, 5), (5,), device)
    a, b = a.detach().to(dtype), b.detach().to(dtype)
    fn = getattr(nf, op)
    out_matches_torch(fn, TORCH[op], (a, b))
    assert top_level_ops(fn, a, b, out=torch.empty_like(a)) == [f"nanfree.{op}_out.default"]

    def torch_with_number(a, number, out=None):  # torch.atan2 takes no number: a 0-d tensor
        return TORCH[op](a, torch.scalar_tensor(number, dtype=a.dtype, device=a.device), out=out)

    out_matches_torch(fn, torch_with_number, (a, 2.0))
    expected = fn(a, b)
    inplace = a.clone()
    assert fn(inplace, b, out=inplace) is inplace
    torch.testing.assert_close(inplace, expected, rtol=0, atol=0)
    buffer = torch.cat([a.flatten(), a.flatten()[:1]])
    fn(buffer[:-1].view(4, 5), b, out=buffer[1:].view(4, 5))
    torch.testing.assert_close(buffer[1:], expected.flatten(), rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_out_takes_no_temporary(device, op):
    """The C++ and CUDA kernels write `out` with no tensor allocated or copied:
    operands and `out` in one layout (the CUDA kernels' flat case); on the C++
    kernels also a transposed or strided `out` and a broadcast operand."""
    serving = _backends.SERVING[torch.device(device).type]
    if serving not in ("cpu", "cuda"):
        pytest.skip("the Python backends compute, then copy into `out`")
    a, b = _interior(op, (4, 6), (4, 6), device)
    a, b = a.detach().float(), b.detach().float()
    cases = [(a, b, torch.empty(4, 6, device=device))]
    if serving == "cpu":
        cases += [(a, b[0], torch.empty(6, 4, device=device).T),
                  (a, b[0].expand(4, 6), torch.empty(4, 12, device=device)[:, ::2])]
    for first, second, out in cases:
        assert allocations_and_copies(getattr(nf, op), first, second, out=out) == []


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_out(device, op, dtype):
    a, b = _interior(op, (3, 5), (5,), device)
    a, b = a.detach().to(dtype), b.detach().to(dtype)
    opcheck(getattr(torch.ops.nanfree, f"{op}_out"), (a, b, torch.empty_like(a)))
    opcheck(getattr(torch.ops.nanfree, f"{op}_out"), (a, b, torch.empty_like(a.T).T))


@pytest.mark.parametrize("op", OPS if not INTERPRETED else ("pow",))
def test_compile_fullgraph_out(device, op):
    fn = getattr(nf, op)

    def step(a, b, out):
        fn(a, b, out=out)
        return out * 2

    torch._dynamo.reset()  # one compile cache per op (the step's code object is shared)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a, b = _interior(op, (8,), (8,), device)
    a, b = a.detach(), b.detach()
    out, ref = torch.empty_like(a), torch.empty_like(a)
    torch.testing.assert_close(compiled(a, b, out), step(a, b, ref))
    torch.testing.assert_close(out, ref)


def test_integer_pow_is_torch_pow(device):
    x = torch.tensor([0, 1, 2, -3], device=device)
    for exponent in (2, torch.tensor([3, 0, 1, 2], device=device)):
        y = nf.pow(x, exponent)
        assert y.dtype == torch.int64 and torch.equal(y, torch.pow(x, exponent))
    assert torch.equal(nf.pow(2, x.abs()), torch.pow(2, x.abs()))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_autocast_dtype_as_torch(device, op, dtype):
    a, b = _interior(op, (4,), (4,), device)
    a, b = a.detach().to(dtype), b.detach().to(dtype)
    autocast_dtype = torch.bfloat16 if device == "cpu" else torch.float16
    def outcome(fn):
        try:
            return fn(a, b).dtype
        except RuntimeError as error:  # CUDA autocast's promote rows refuse bfloat16 under float16
            assert "Unexpected floating ScalarType" in str(error)
            return "refused"

    with torch.autocast(device_type=device, dtype=autocast_dtype):
        ours, theirs = outcome(getattr(nf, op)), outcome(TORCH[op])
    assert ours == theirs
    # out= as torch's out= under autocast (no autocast list has an out= overload):
    # the op in the inputs' dtype, written into an out of that dtype or of float32.
    for out_dtype in (dtype, torch.float32):
        ours, theirs = (torch.empty(4, dtype=out_dtype, device=device) for _ in range(2))
        with torch.autocast(device_type=device, dtype=autocast_dtype):
            getattr(nf, op)(a, b, out=ours)
            TORCH[op](a, b, out=theirs)
        # Both computed in the inputs' dtype: its tolerance (xlogy's bfloat16
        # rounding is torch's within one unit, as without out=).
        torch.testing.assert_close(ours.to(dtype), theirs.to(dtype))


# Every elementwise op and the torch overload whose autocast policy it copies.
AUTOCAST_TWINS = {"sqrt": "aten::sqrt", "log": "aten::log", "log1p": "aten::log1p",
                  "acos": "aten::acos", "asin": "aten::asin", "pow": "aten::pow.Tensor_Tensor",
                  "atan2": "aten::atan2", "div_no_nan": "aten::div.Tensor",
                  "xlogy": "aten::xlogy.Tensor", "xlog1py": "aten::special_xlog1py"}


@pytest.mark.backend_independent
@pytest.mark.parametrize("op", list(AUTOCAST_TWINS))
@pytest.mark.parametrize("key", ["AutocastCUDA", "AutocastCPU"])
def test_autocast_rows_as_torch(op, key):
    """An op has an autocast kernel on a device exactly where the torch op it
    replaces has one (CUDA: log, log1p, acos, asin, pow run in float32, atan2 at
    its widest input; CPU: none), so under autocast it returns torch's dtype on
    GPUs too (checked here without one)."""
    theirs = torch._C._dispatch_has_kernel_for_dispatch_key(AUTOCAST_TWINS[op], key)
    ours = torch._C._dispatch_has_kernel_for_dispatch_key(f"nanfree::{op}", key)
    assert ours == theirs, f"{op} at {key}: nanfree {ours}, torch {theirs}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_both_gradients_in_one_pass_equal_the_partials(device, op, dtype):
    """Where both inputs need a gradient and no graph is recorded, the backward is
    <op>_gradients (one pass): the same gradients as <op>_backward's two partials,
    at every pair of the special-value grid and with broadcasting; opcheck passes;
    differentiating it is refused."""
    from test_elementwise_binary_special_values import _grid

    a, b = (t.to(device) for t in _grid(op, dtype))
    g = torch.randn(a.shape, dtype=torch.float64).to(device, dtype)
    backward = getattr(torch.ops.nanfree, f"{op}_backward")
    gradients = getattr(torch.ops.nanfree, f"{op}_gradients")
    ga, gb = gradients(g, a, b)
    torch.testing.assert_close(ga, backward(g, a, b, 1, 0), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gb, backward(g, a, b, 1, 1), rtol=0, atol=0, equal_nan=True)
    ia, ib = (t.detach().to(dtype) for t in _interior(op, (3, 5), (5,), device))
    opcheck(gradients, (torch.randn(3, 5, dtype=torch.float64).to(device, dtype), ia, ib))
    row, col = a[:12].reshape(3, 4), b[:4]
    gg = g[:12].reshape(3, 4)
    ga, gb = gradients(gg, row, col)
    torch.testing.assert_close(ga, backward(gg, row, col, 1, 0), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gb, backward(gg, row, col, 1, 1), rtol=0, atol=0, equal_nan=True)
    # through autograd: the one-pass path (both need a gradient, no graph) and the partials
    x, y = (t[:15].detach().requires_grad_(True) for t in (a, b))
    fused = torch.autograd.grad(getattr(nf, op)(x, y), (x, y), g[:15])
    (single,) = torch.autograd.grad(getattr(nf, op)(x, y.detach()), x, g[:15])
    torch.testing.assert_close(fused[0], single, rtol=0, atol=0, equal_nan=True)
    x, y = (t.detach().requires_grad_(True) for t in (g[:15], a[:15]))
    with pytest.raises(RuntimeError, match=f"{op}_gradients has no derivative"):
        out = gradients(x, y, b[:15])
        torch.autograd.grad(out[0].sum() + out[1].sum(), (x, y))


@pytest.mark.parametrize("op", OPS)
def test_python_numbers_as_torch_takes_them(device, op):
    """Numbers beside a float16 tensor give torch's values: torch.pow(tensor, number)
    and tensor / number use the number unrounded in float32 (1e-8 is not 0, 0.1 not
    0.0999756), the other forms round it to float16 first (1e5 is inf); a number
    beyond the dtype's range is no error (torch refuses some); True and False are 1
    and 0."""
    half = torch.tensor([1e-4, 0.5, 3.0], dtype=torch.float16, device=device)

    def theirs(*args):
        if op == "atan2":  # torch.atan2 takes tensors only
            args = [v if isinstance(v, torch.Tensor) else torch.tensor(v, device=device)
                    for v in args]
        return TORCH[op](*args)

    for number in (1e-8, 1e5, 0.1, 1e39, True):
        for args in ((half, number), (number, half)):
            ours = getattr(nf, op)(*args)
            assert ours.dtype == torch.float16
            try:
                expected = theirs(*args)
            except RuntimeError as error:  # torch refuses some numbers beyond float16
                assert "without overflow" in str(error)
                continue
            torch.testing.assert_close(ours, expected, equal_nan=True, rtol=1e-3, atol=0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_number_entry_equals_the_op_with_the_number_as_a_tensor(device, op, dtype):
    """nanfree._C.<op>_number, which nanfree.ops calls for a float32 or float64
    tensor beside a Python number the dtype holds (the 0-d tensor made in C++),
    gives the op's value and gradients with torch.scalar_tensor's 0-d tensor,
    bit for bit."""
    from nanfree import _C
    x = torch.tensor([0.0, 1e-3, 0.7, 2.0, -1.5, 40.0], dtype=dtype, device=device)
    numbers = (2.0, 0.5, 0.1, -3, 0, 7, -0.0, 1e-30, 3e38, 2**53 - 1, math.nan, math.inf, -math.inf)
    for number in numbers:
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours = getattr(_C, f"{op}_number")(a, number)
        theirs = getattr(_C, op)(b, torch.scalar_tensor(number, dtype=dtype, device=device))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True, msg=str(number))
        (ga,), (gb,) = torch.autograd.grad(ours.sum(), a), torch.autograd.grad(theirs.sum(), b)
        torch.testing.assert_close(ga, gb, rtol=0, atol=0, equal_nan=True, msg=str(number))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_large_python_ints_rounded_once_as_torch(device, dtype):
    """An int past 2^53 becomes the dtype's value with one rounding, as torch's ops
    make it (2^60 + 2^36 + 1 is 2^60 + 2^37 in float32, not 2^60 through float64);
    past int64, which torch refuses, the nearest float or its infinity."""
    x = torch.tensor([1.0, 2.0], dtype=dtype, device=device)
    for number in (2**60 + 2**36 + 1, -(2**62) - 2**38 - 1, 2**63 - 1):
        # Against torch's CPU quotient, the correctly rounded one: torch's CUDA `x / number`
        # was one unit off it in float32 on an H200 (docs/gpu.md, the fifth run).
        quotient = (x.cpu() / number).to(device)
        torch.testing.assert_close(nf.div_no_nan(x, number), quotient, rtol=0, atol=0)
        torch.testing.assert_close(nf.xlogy(x, abs(number)), torch.xlogy(x, abs(number)),
                                   rtol=0, atol=0)
    assert torch.isfinite(nf.div_no_nan(x, 2**70)).all()
    assert torch.equal(nf.xlogy(x, 2**2000), torch.full_like(x, math.inf))


@pytest.mark.parametrize("op", OPS)
def test_reduced_and_cast_gradients_saturate(device, op):
    """A gradient summed over a broadcast or cast to a half-precision input stays
    within that dtype's range (rule 5): no inf, no NaN from +max and -max meeting."""
    half = torch.tensor([1.0], dtype=torch.float16, device=device, requires_grad=True)
    small = torch.tensor([1e-5], device=device)
    values = {"pow": (half, torch.tensor([1e6], device=device)), "atan2": (half, small),
              "div_no_nan": (half, small), "xlogy": (half, small), "xlog1py": (half, small)}
    a, b = values[op]
    (g,) = torch.autograd.grad(getattr(nf, op)(a, b).sum(), a)
    assert g.dtype == torch.float16 and torch.isfinite(g).all()
    scalar = torch.tensor(1e-30, device=device, requires_grad=True)
    big = torch.tensor([1.0, -1.0, 1.0, -1.0] * 4, device=device)
    (gs,) = torch.autograd.grad(nf.div_no_nan(big, scalar).sum(), scalar)
    assert torch.isfinite(gs)


@pytest.mark.parametrize("op", OPS)
def test_double_backward_with_an_infinite_upstream_against_zero(device, op):
    """gg = inf against a first-order upstream gradient of 0: the second-order
    weight gg * grad is 0 (zeros dominant), not NaN."""
    a, b = _interior(op, (4,), (4,), device)
    y = getattr(nf, op)(a, b)
    (ga,) = torch.autograd.grad(y, a, torch.zeros_like(y), create_graph=True)
    second = torch.autograd.grad(ga, (a, b), torch.full_like(ga, float("inf")), allow_unused=True)
    for s in second:
        assert s is None or not torch.isnan(s).any()
