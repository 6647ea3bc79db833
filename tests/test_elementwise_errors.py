"""Bad inputs of the elementwise family raise before any kernel runs, naming the
op and the argument, with the same words on every backend (csrc/common/
elementwise_op.h and nanfree/_ops/elementwise.py)."""

import pytest
import torch

import nanfree.ops as nf
from error_checks import raises_before_any_kernel

OPS = ("sqrt", "log", "log1p", "acos", "asin")


@pytest.mark.parametrize("op", OPS)
def test_complex_input_is_refused(device, op):
    with pytest.raises(TypeError, match=f"nanfree.{op}: complex `input` is not supported"):
        getattr(nf, op)(torch.ones(3, dtype=torch.complex64, device=device))


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOAT_MESSAGE = r"must be float16, bfloat16, float32 or float64 \(integer and bool tensors are promoted"


# float8 has no math kernels in torch either (torch.sqrt raises NotImplementedError).
@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_float8_input_is_refused(op, dtype):
    x = torch.ones(3).to(dtype)
    raises_before_any_kernel(TypeError, rf"nanfree.{op}: `input` {FLOAT_MESSAGE}",
                             getattr(nf, op), x)


@pytest.mark.parametrize("op", OPS)
def test_not_a_tensor(op):
    with pytest.raises(TypeError, match=f"nanfree.{op}: `input` must be a torch.Tensor"):
        getattr(nf, op)([1.0, 2.0])


@pytest.mark.parametrize("op", OPS)
def test_backward_op_checks(device, op):
    backward = getattr(torch.ops.nanfree, f"{op}_backward")
    x = torch.rand(3, device=device)
    with pytest.raises(ValueError, match=f"nanfree.{op}_backward: `order` must be 1"):
        backward(torch.ones(3, device=device), x, 3)
    with pytest.raises(ValueError, match=f"nanfree.{op}_backward: `grad` must have the input's shape"):
        backward(torch.ones(4, device=device), x, 1)
    with pytest.raises(ValueError, match="`grad` must have the input's shape"):
        backward(torch.ones(3, dtype=torch.float64, device=device), x, 1)
    with pytest.raises(TypeError, match=f"nanfree.{op}_backward: `input` must be float16"):
        backward(torch.ones(3, dtype=torch.int64, device=device),
                 torch.ones(3, dtype=torch.int64, device=device), 1)


@pytest.mark.parametrize("op", OPS)
def test_torch_func_is_refused_naming_the_op(device, op):
    x = torch.rand(3, device=device) + 0.1
    with pytest.raises(NotImplementedError, match=f"nanfree.{op}: torch.func transforms"):
        torch.func.grad(lambda t: getattr(nf, op)(t).sum())(x)


BINARY_OPS = ("pow", "atan2", "div_no_nan", "xlogy", "xlog1py")


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_complex_is_refused(device, op):
    x = torch.ones(3, device=device)
    c = torch.ones(3, dtype=torch.complex64, device=device)
    with pytest.raises(TypeError, match=f"nanfree.{op}: complex `input` is not supported"):
        getattr(nf, op)(c, x)
    with pytest.raises(TypeError, match=f"nanfree.{op}: complex `other` is not supported"):
        getattr(torch.ops.nanfree, op)(x, c)


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_float8_is_refused(op, dtype):
    x, low = torch.ones(3), torch.ones(3).to(dtype)
    raises_before_any_kernel(TypeError, rf"nanfree.{op}: `input` {FLOAT_MESSAGE}",
                             getattr(nf, op), low, low)
    raises_before_any_kernel(TypeError, rf"nanfree.{op}: `other` {FLOAT_MESSAGE}",
                             getattr(torch.ops.nanfree, op), x, low)


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_shapes_that_do_not_broadcast(device, op):
    with pytest.raises(ValueError, match=rf"nanfree.{op}: the size of `input` \(3\) must match "
                                         rf"the size of `other` \(4\)"):
        getattr(nf, op)(torch.ones(3, device=device), torch.ones(4, device=device))


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_not_a_tensor_or_number(device, op):
    name = "exponent" if op == "pow" else "other"
    with pytest.raises(TypeError, match=f"nanfree.{op}: `{name}` must be a torch.Tensor or a number"):
        getattr(nf, op)(torch.ones(3, device=device), [1.0])
    with pytest.raises(TypeError, match=f"nanfree.{op}: `input` must be a torch.Tensor"):
        getattr(nf, op)(1.0, 2.0)


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_backward_op_checks(device, op):
    backward = getattr(torch.ops.nanfree, f"{op}_backward")
    a, b, g = (torch.rand(3, device=device) + 0.5 for _ in range(3))
    with pytest.raises(ValueError, match=f"nanfree.{op}_backward: `order` must be 1"):
        backward(g, a, b, 3, 0)
    with pytest.raises(ValueError, match=f"nanfree.{op}_backward: `partial` must be in \\[0, 1\\]"):
        backward(g, a, b, 1, 2)
    with pytest.raises(ValueError, match=f"nanfree.{op}_backward: `grad` must have the broadcast shape"):
        backward(torch.ones(4, device=device), a, b, 1, 0)
    with pytest.raises(ValueError, match="must have one dtype"):
        backward(g, a, b.double(), 1, 0)


@pytest.mark.parametrize("op", BINARY_OPS)
def test_binary_torch_func_is_refused_naming_the_op(device, op):
    x = torch.rand(3, device=device) + 0.5
    with pytest.raises(NotImplementedError, match=f"nanfree.{op}: torch.func transforms"):
        torch.func.grad(lambda t: getattr(nf, op)(t, x).sum())(x)
