"""The elementwise family's Python side (the unary ops sqrt, log, log1p, acos,
asin and their <op>_backward): the op-level argument checks and output of the
Python backends (Triton, pure PyTorch) and the fake kernels, with the same
errors, words and exception types as csrc/common/elementwise_op.h. The
schemas are in csrc/registration.cpp, the autograd (shared by every backend)
in csrc/elementwise.cpp. These ops are on no autocast list (torch's keep the
input's dtype under autocast), so csrc/autocast.cpp has no row for them."""

import torch

from .common import check_device, check_float, fake_kernels

UNARY_OPS = ("sqrt", "log", "log1p", "acos", "asin")
FORWARD_OPS = UNARY_OPS
BACKWARD_OPS = tuple(f"{op}_backward" for op in UNARY_OPS)
OPS = FORWARD_OPS + BACKWARD_OPS


def unary_operand(op, input):
    """The floating tensor the op computes on: integer and bool inputs promote to
    the default float dtype, as torch's; complex is refused (TypeError)."""
    if input.dtype.is_complex:
        raise TypeError(f"nanfree.{op}: complex `input` is not supported (got {input.dtype}); "
                        f"nanfree's elementwise ops are real-valued")
    if input.dtype.is_floating_point:
        return input
    return input.to(torch.get_default_dtype())


def check_unary_backward(op, grad, input, order):
    name = f"{op}_backward"
    check_float(name, "input", input)
    if order not in (1, 2):
        raise ValueError(f"nanfree.{name}: `order` must be 1 (the derivative) or 2 (the second "
                         f"derivative), got {order}")
    if grad.dtype != input.dtype or grad.shape != input.shape:
        raise ValueError(f"nanfree.{name}: `grad` must have the input's shape {list(input.shape)} "
                         f"and dtype {input.dtype}, got {list(grad.shape)} {grad.dtype}")
    check_device(name, "grad", input, grad)


def is_dense(t):
    """Whether t's elements fill a span of its storage without overlap or gap, in
    any order of its dimensions (ATen's is_non_overlapping_and_dense)."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def dense_operands(*tensors):
    """The tensors as they are when dense with one layout (the kernels read them
    flat), else contiguous copies (as the CUDA binding does)."""
    first = tensors[0]
    if all(is_dense(t) and t.stride() == first.stride() for t in tensors):
        return tensors
    return tuple(t.contiguous() for t in tensors)


def unary_output(x):
    """The output of an op on x (floating): x's shape, dtype and layout."""
    return torch.empty_like(x)


def unary_kernels(forward, backward):
    """{op name: kernel} of a Python backend for every unary op and its backward op,
    from the backend's forward(op, input) and backward(op, grad, input, order): the
    functions named as the ops that nanfree/_backends.py registers."""
    kernels = {}
    for op in UNARY_OPS:
        def kernel(input, op=op):
            return forward(op, input)

        def backward_kernel(grad, input, order=1, op=op):
            return backward(op, grad, input, order)

        kernel.__name__, backward_kernel.__name__ = op, f"{op}_backward"
        kernels[op], kernels[f"{op}_backward"] = kernel, backward_kernel
    return kernels


# --- fake kernels ---------------------------------------------------------------


def _fake_unary(op):
    def fake(input):
        return unary_output(unary_operand(op, input))

    return fake


def _fake_unary_backward(op):
    def fake(grad, input, order=1):
        check_unary_backward(op, grad, input, order)
        return unary_output(input)

    return fake


def register():
    fake_kernels([(op, _fake_unary(op)) for op in UNARY_OPS] +
                 [(f"{op}_backward", _fake_unary_backward(op)) for op in UNARY_OPS])
