"""Bad inputs of the elementwise family raise before any kernel runs, naming the
op and the argument, with the same words on every backend (csrc/common/
elementwise_op.h and nanfree/_ops/elementwise.py)."""

import pytest
import torch

import nanfree.ops as nf

OPS = ("sqrt", "log", "log1p", "acos", "asin")


@pytest.mark.parametrize("op", OPS)
def test_complex_input_is_refused(device, op):
    with pytest.raises(TypeError, match=f"nanfree.{op}: complex `input` is not supported"):
        getattr(nf, op)(torch.ones(3, dtype=torch.complex64, device=device))


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
