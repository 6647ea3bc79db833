"""Bad input to GeM pooling gets a clear error naming the op and the argument,
raised before any kernel runs: nanfree.ops.gem and gem_pool2d, the modules,
the registered ops torch.ops.nanfree.gem / gem_backward, and their fake
kernels (meta tensors)."""

import math

import pytest
import torch
from error_checks import raises_before_any_kernel

import nanfree.nn as nfnn
import nanfree.ops as nf

NON_FLOAT = [torch.int64, torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn,
             torch.float8_e5m2]
FLOAT_MESSAGE = r"must be float16, bfloat16, float32 or float64, got"

# Other devices than the CPU a tensor can be on here: "meta" always (no data),
# "cuda" with a GPU.
OTHER_DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _x(*shape):
    return torch.rand(shape) + 0.1


# --- input ---------------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
@pytest.mark.parametrize("op", ["gem", "gem_pool2d"])
def test_non_float_input(op, dtype):
    x = _x(2, 3, 4, 4).to(dtype)
    raises_before_any_kernel(TypeError, rf"nanfree\.gem: `input` {FLOAT_MESSAGE}",
                              getattr(nf, op), x)


@pytest.mark.backend_independent  # checked in Python before anything else
@pytest.mark.parametrize("op", ["gem", "gem_pool2d"])
@pytest.mark.parametrize("value", [[1.0, 2.0], 1.0, None], ids=["list", "float", "None"])
def test_input_not_a_tensor(op, value):
    with pytest.raises(TypeError, match=rf"nanfree\.{op}: `input` must be a torch\.Tensor, got "
                                        + type(value).__name__):
        getattr(nf, op)(value)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("shape", [(4, 4), (7,), (), (1, 2, 3, 4, 5)], ids=str)
def test_gem_pool2d_needs_3d_or_4d(shape):
    raises_before_any_kernel(ValueError, rf"nanfree\.gem_pool2d: `input` must be \[B, C, H, W\] "
                              rf"or \[C, H, W\], got {len(shape)} dimensions", nf.gem_pool2d,
                              torch.rand(shape))


def test_gem_pool2d_3d_input_works():
    # [C, H, W] -> [C, 1, 1] (as cirtorch's gem on an unbatched map).
    x = _x(3, 4, 5)
    out = nf.gem_pool2d(x)
    assert out.shape == (3, 1, 1)
    torch.testing.assert_close(out, nf.gem(x, 3.0, (1, 2), keepdim=True))


# --- p -------------------------------------------------------------------------------


@pytest.mark.backend_independent  # checked in Python before anything else
@pytest.mark.parametrize("p", [0, 0.0, -1.0, -3, math.inf, -math.inf, math.nan], ids=str)
@pytest.mark.parametrize("op", ["gem", "gem_pool2d"])
def test_python_p_not_finite_and_positive(op, p):
    raises_before_any_kernel(ValueError, r"nanfree\.gem: `p` must be finite and > 0, got",
                              getattr(nf, op), _x(2, 3, 4, 4), p)


@pytest.mark.backend_independent
@pytest.mark.parametrize("p", ["3", None, True, [3.0], 3j], ids=str)
def test_p_of_wrong_type(p):
    with pytest.raises(TypeError, match=r"nanfree\.gem: `p` must be a number or a tensor, got"):
        nf.gem(_x(2, 3), p)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("shape", [(2,), (1, 1), (3, 1), (0,)], ids=str)
def test_p_tensor_of_wrong_shape(shape):
    p = torch.full(shape, 3.0)
    raises_before_any_kernel(ValueError, rf"nanfree\.gem: a tensor `p` must have shape \[\] or "
                              rf"\[1\], got \[{', '.join(map(str, shape))}\]", nf.gem, _x(2, 3), p)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
def test_p_tensor_of_integer_dtype(dtype):
    p = torch.tensor([3]).to(dtype)
    raises_before_any_kernel(TypeError, rf"nanfree\.gem: `p` {FLOAT_MESSAGE}", nf.gem, _x(2, 3), p)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_p_tensor_on_another_device(other):
    p = torch.tensor([3.0], device=other)
    raises_before_any_kernel(ValueError, rf"nanfree\.gem: `p` is on {other}\S* but `input` is on "
                              "cpu", nf.gem, _x(2, 3), p)


@pytest.mark.parametrize("p", [0.0, -1.0, math.nan, math.inf])
def test_p_tensor_out_of_range_is_clamped_not_refused(p):
    # A learnable p that drifted is clamped (DESIGN.md), not refused; NaN stays NaN.
    x = _x(2, 5)
    out = nf.gem(x, torch.tensor(p))
    if math.isnan(p):
        assert torch.isnan(out).all()
    else:
        bound = 1e-2 if p < 1 else 1e2
        torch.testing.assert_close(out, nf.gem(x, bound), rtol=1e-5, atol=0)


# --- dim -------------------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dim", [2, -3, 5, (0, 2), (-3, 1), [1, 7]], ids=str)
def test_dim_out_of_range(dim):
    bad = next(d for d in ((dim,) if isinstance(dim, int) else dim) if not -2 <= d < 2)
    raises_before_any_kernel(IndexError, rf"nanfree\.gem: `dim` {bad} is out of range for a "
                              "tensor of 2 dimensions", nf.gem, _x(2, 3), 3.0, dim)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dim", [(1, 1), (0, -3), [2, 0, -1]], ids=str)
def test_repeated_dim(dim):
    raises_before_any_kernel(ValueError, r"nanfree\.gem: `dim` .* names a dimension twice",
                              nf.gem, _x(2, 3, 4), 3.0, dim)


@pytest.mark.backend_independent  # checked in Python before anything else
@pytest.mark.parametrize("dim", [1.0, "1", None, (), [], (1.0,), True, (0, True), {0: 1}],
                         ids=str)
def test_dim_of_wrong_type(dim):
    with pytest.raises(TypeError, match=r"nanfree\.gem: `dim` must be an int or a non-empty "
                                        "sequence of ints"):
        nf.gem(_x(2, 3), 3.0, dim)


def test_zero_dim_input_dims():
    # A 0-d tensor counts as one dimension (as torch.sum): dim 0 and -1 only.
    out = nf.gem(torch.tensor(2.0), 3.0, 0)
    assert out.shape == () and out.item() == pytest.approx(2.0)
    with pytest.raises(IndexError, match=r"nanfree\.gem: `dim` 1 is out of range for a tensor "
                                         "of 0 dimensions"):
        nf.gem(torch.tensor(2.0), 3.0, 1)


# --- eps -------------------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("eps", [0.0, -1e-6, 0, math.inf, math.nan], ids=str)
@pytest.mark.parametrize("op", ["gem", "gem_pool2d"])
def test_eps_not_positive_and_finite(op, eps):
    x = _x(2, 3, 4, 4)
    args = (x, 3.0, eps) if op == "gem_pool2d" else (x, 3.0, -1, eps)
    raises_before_any_kernel(ValueError, r"nanfree\.gem: `eps` must be positive and finite",
                              getattr(nf, op), *args)


@pytest.mark.backend_independent
@pytest.mark.parametrize("eps", ["1e-6", None, torch.tensor(1e-6)], ids=str)
def test_eps_of_wrong_type(eps):
    with pytest.raises(TypeError, match=r"nanfree\.gem: `eps` must be a number"):
        nf.gem(_x(2, 3), 3.0, -1, eps)


# --- mask ------------------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64,
                                   torch.complex64], ids=str)
def test_float_mask(dtype):
    mask = torch.ones(2, 3).to(dtype)
    raises_before_any_kernel(TypeError, r"nanfree\.gem: `mask` must be bool or integer "
                              r"\(nonzero = keep\), got", nf.gem, _x(2, 3), mask=mask)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("x_shape,mask_shape", [
    ((2, 5, 4), (2, 5)),  # an attention mask [B, L] without its [..., None]
    ((2, 5, 4), (2, 4, 1)),
    ((2, 3), (3, 2)),
    ((2, 3), (1, 2, 3)),
    ((2, 3), (4,)),
], ids=str)
def test_mask_of_wrong_shape(x_shape, mask_shape):
    mask = torch.ones(mask_shape, dtype=torch.bool)
    raises_before_any_kernel(
        ValueError, rf"nanfree\.gem: `mask` of shape \[{', '.join(map(str, mask_shape))}\] does "
        rf"not broadcast to the input's shape \[{', '.join(map(str, x_shape))}\]",
        nf.gem, _x(*x_shape), 3.0, 1, mask=mask)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_mask_on_another_device(other):
    mask = torch.ones(2, 3, dtype=torch.bool, device=other)
    raises_before_any_kernel(ValueError, rf"nanfree\.gem: `mask` is on {other}\S* but `input` "
                              "is on cpu", nf.gem, _x(2, 3), mask=mask)


@pytest.mark.backend_independent  # raised in Python, before any kernel
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_input_with_cpu_mask_and_p():
    x = _x(2, 3).cuda()
    with pytest.raises(ValueError, match=r"nanfree\.gem: `mask` is on cpu but `input` is on cuda"):
        nf.gem(x, mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"nanfree\.gem: `p` is on cpu but `input` is on cuda"):
        nf.gem(x, torch.tensor([3.0]))


@pytest.mark.backend_independent
@pytest.mark.parametrize("mask", [[[True] * 3] * 2, 1], ids=["list", "int"])
def test_mask_not_a_tensor(mask):
    with pytest.raises(TypeError, match=r"nanfree\.gem: `mask` must be a torch\.Tensor or None"):
        nf.gem(_x(2, 3), mask=mask)


# --- the modules -----------------------------------------------------------------------


@pytest.mark.backend_independent  # raised in Python, before any kernel
def test_module_errors_name_the_op():
    raises_before_any_kernel(ValueError, r"nanfree\.gem_pool2d: `input` must be", nfnn.GeM(),
                              _x(4, 4))
    # A bad p is refused when the module is constructed (tests/test_probes.py has more).
    with pytest.raises(ValueError, match=r"nanfree\.nn\.GeM: `p` must be finite and > 0"):
        nfnn.GeM(p=-1.0, learnable=False)
    raises_before_any_kernel(ValueError, r"nanfree\.gem: `mask` of shape \[2, 4, 1\] does not "
                              "broadcast", nfnn.GeMTokenPooling(), _x(2, 5, 3),
                              torch.ones(2, 4, dtype=torch.long))
    raises_before_any_kernel(TypeError, r"nanfree\.gem: `mask` must be bool or integer",
                              nfnn.GeMTokenPooling(), _x(2, 5, 3), torch.ones(2, 5))


# --- the registered ops, called directly -----------------------------------------------

OPS = torch.ops.nanfree


def _forward_results(device="cpu"):
    x = (torch.rand(2, 5, 3) + 0.1).to(device)
    mask = (torch.rand(2, 5, 3) < 0.7).to(device)
    p = torch.tensor([3.0], device=device)
    out, stats = OPS.gem(x, p, 0.0, 1e-6, mask)
    return x, mask, p, out, stats


def _op_cases(x, mask, p, out, stats, dtype):
    """(op, args, exception, message) of every argument the ops check."""
    bad = x.to(dtype)
    bw = OPS.gem_backward
    return [
        # dtypes
        (OPS.gem, (bad, p, 0.0, 1e-6, mask), TypeError, rf"gem: `input` {FLOAT_MESSAGE}"),
        (OPS.gem, (x, p.to(dtype), 0.0, 1e-6, mask), TypeError, rf"gem: `p` {FLOAT_MESSAGE}"),
        (OPS.gem, (x, p, 0.0, 1e-6, mask.to(torch.uint8)), TypeError,
         r"gem: `mask` must be bool here"),
        (OPS.gem, (x, p, 0.0, 1e-6, mask.float()), TypeError, r"gem: `mask` must be bool here"),
        (bw, (out, bad, p, 0.0, stats, 1e-6, mask, True), TypeError,
         rf"gem_backward: `input` {FLOAT_MESSAGE}"),
        (bw, (out, x, p.to(dtype), 0.0, stats, 1e-6, mask, True), TypeError,
         rf"gem_backward: `p` {FLOAT_MESSAGE}"),
        # shapes
        (OPS.gem, (x[0], p, 0.0, 1e-6, None), ValueError,
         r"gem: `input` must be 3-D \[outer, n, inner\] .*got 2 dimensions"),
        (OPS.gem, (x[None], p, 0.0, 1e-6, None), ValueError,
         r"gem: `input` must be 3-D .*got 4 dimensions"),
        (OPS.gem, (x, p, 0.0, 1e-6, mask[:, :1]), ValueError,
         r"gem: `mask` has shape \[2, 1, 3\] but `input` has \[2, 5, 3\]"),
        (OPS.gem, (x, torch.ones(2), 0.0, 1e-6, mask), ValueError,
         r"gem: a tensor `p` must have shape \[\] or \[1\], got \[2\]"),
        (bw, (out, x[0], p, 0.0, stats, 1e-6, None, True), ValueError,
         r"gem_backward: `input` must be 3-D"),
        (bw, (out[:1], x, p, 0.0, stats, 1e-6, mask, True), ValueError,
         r"gem_backward: `grad_output` must be \[outer, inner\] = \[2, 3\] of the input's dtype"),
        (bw, (out.double(), x, p, 0.0, stats, 1e-6, mask, True), ValueError,
         r"gem_backward: `grad_output` must be \[outer, inner\]"),
        (bw, (out, x, p, 0.0, stats[..., :2], 1e-6, mask, True), ValueError,
         r"gem_backward: `stats` must be the forward's saved statistics"),
        (bw, (out, x, p, 0.0, stats.double(), 1e-6, mask, True), ValueError,
         r"gem_backward: `stats` must be the forward's saved statistics"),
        (bw, (out, x, p, 0.0, stats, 1e-6, mask[:, :1], True), ValueError,
         r"gem_backward: `mask` has shape \[2, 1, 3\] but `input` has \[2, 5, 3\]"),
        # p and eps
        (OPS.gem, (x, None, 0.0, 1e-6, mask), ValueError, r"gem: `p` must be finite and > 0"),
        (OPS.gem, (x, None, -2.0, 1e-6, mask), ValueError, r"gem: `p` must be finite and > 0"),
        (OPS.gem, (x, None, math.nan, 1e-6, mask), ValueError,
         r"gem: `p` must be finite and > 0"),
        (OPS.gem, (x, None, math.inf, 1e-6, mask), ValueError,
         r"gem: `p` must be finite and > 0"),
        (OPS.gem, (x, p, 0.0, 0.0, mask), ValueError, r"gem: `eps` must be positive and finite"),
        (OPS.gem, (x, p, 0.0, math.nan, mask), ValueError,
         r"gem: `eps` must be positive and finite"),
        (bw, (out, x, None, 0.0, stats, 1e-6, mask, False), ValueError,
         r"gem_backward: `p` must be finite and > 0"),
        (bw, (out, x, None, 3.0, stats, 1e-6, mask, True), ValueError,
         r"gem_backward: `p_grad` needs a tensor `p`"),
        (bw, (out, x, p, 0.0, stats, -1.0, mask, True), ValueError,
         r"gem_backward: `eps` must be positive and finite"),
    ]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_op_level_checks(dtype):
    x, mask, p, out, stats = _forward_results()
    for op, args, exception, match in _op_cases(x, mask, p, out, stats, dtype):
        raises_before_any_kernel(exception, r"nanfree\." + match, op, *args)


@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_op_level_devices(other):
    x, mask, p, out, stats = _forward_results()
    bw = OPS.gem_backward
    cases = [
        (OPS.gem, (x, p.to(other), 0.0, 1e-6, mask), rf"gem: `p` is on {other}\S* but `input`"),
        (OPS.gem, (x, p, 0.0, 1e-6, mask.to(other)), rf"gem: `mask` is on {other}\S* but `input`"),
        (bw, (out.to(other), x, p, 0.0, stats, 1e-6, mask, True),
         rf"gem_backward: `grad_output` is on {other}\S* but `input` is on cpu"),
        (bw, (out, x, p, 0.0, stats.to(other), 1e-6, mask, True),
         rf"gem_backward: `stats` is on {other}\S* but `input` is on cpu"),
        (bw, (out, x, p, 0.0, stats, 1e-6, mask.to(other), True),
         rf"gem_backward: `mask` is on {other}\S* but `input` is on cpu"),
    ]
    for op, args, match in cases:
        raises_before_any_kernel(ValueError, r"nanfree\." + match, op, *args)


@pytest.mark.backend_independent  # the fake kernels (Python), shared by every backend
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_fake_kernels_raise_the_same_errors(dtype):
    # Meta tensors go to the fake kernels: the same checks, the same words.
    x, mask, p, out, stats = _forward_results("meta")
    for op, args, exception, match in _op_cases(x, mask, p, out, stats, dtype):
        with pytest.raises(exception, match=r"nanfree\." + match):
            op(*args)


@pytest.mark.backend_independent  # the fake kernels (Python), shared by every backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=str)
def test_meta_tensors_give_shapes_and_dtypes(dtype):
    x = torch.empty(2, 3, 7, 7, device="meta", dtype=dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = nf.gem_pool2d(x, torch.tensor([3.0], device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, 1, 1) and out.dtype == dtype
    tokens = torch.empty(4, 9, 5, device="meta", dtype=dtype)
    am = torch.ones(4, 9, dtype=torch.long, device="meta")
    out = nf.gem(tokens, 3.0, 1, mask=am[..., None])
    assert out.shape == (4, 5) and out.dtype == dtype
    out, stats = OPS.gem(tokens, None, 3.0, 1e-6, None)
    assert out.shape == (4, 5) and stats.shape == (4, 5, 3) and stats.dtype == acc
    gx, gp = OPS.gem_backward(out, tokens, torch.tensor(3.0, device="meta"), 0.0, stats, 1e-6,
                              None, True)
    assert gx.shape == tokens.shape and gx.dtype == dtype and gp.shape == () and gp.dtype == acc
    gx, gp = OPS.gem_backward(out, tokens, None, 3.0, stats, 1e-6, None, False)
    assert gp.shape == (0,)
    # The argument checks hold on meta tensors too.
    with pytest.raises(ValueError, match=r"nanfree\.gem: `eps`"):
        nf.gem(tokens, 3.0, 1, 0.0)


@pytest.mark.backend_independent  # the dispatcher's own check of the schema
def test_op_level_non_tensor_arguments():
    # torch's dispatcher refuses these before any nanfree code runs, naming
    # the op and the argument (a RuntimeError, as for every torch.ops op).
    x = _x(2, 3, 4)
    cases = [
        (OPS.gem, ([1.0, 2.0], None, 3.0, 1e-6, None), "gem", "input"),
        (OPS.gem, (x, 3.0, 3.0, 1e-6, None), "gem", "p"),
        (OPS.gem, (x, None, "3", 1e-6, None), "gem", "p_value"),
        (OPS.gem, (x, None, 3.0, 1e-6, 1), "gem", "mask"),
    ]
    for op, args, name, arg in cases:
        with pytest.raises(RuntimeError, match=rf"nanfree::{name}\(\) Expected a value of type "
                                               rf"'[^']+' for argument '{arg}'"):
            op(*args)
