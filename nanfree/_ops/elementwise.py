"""The elementwise family's Python side (the unary ops sqrt, log, log1p, acos,
asin, the binary ops pow, atan2, div_no_nan, xlogy, xlog1py, and their
<op>_backward and <op>_out): the op-level argument checks and output of the
Python backends (Triton, pure PyTorch) and the fake kernels, with the same
errors, words and exception types as csrc/common/elementwise_op.h. The
schemas are in csrc/registration.cpp, the autograd (shared by every backend)
in csrc/elementwise.cpp and csrc/elementwise_binary.cpp. Under CUDA autocast
torch runs log, log1p, acos, asin and pow in float32 (atan2 at its widest
input, which its type promotion gives already); csrc/autocast.cpp has those
rows. sqrt, xlogy and xlog1py are on no autocast list; nor is div_no_nan,
torch's `/`."""

import torch
from torch._prims_common import compute_elementwise_output_strides

from .common import KERNEL_FLOATS, check_device, check_float, fake_kernels, is_dense

UNARY_OPS = ("sqrt", "log", "log1p", "acos", "asin")
BINARY_OPS = ("pow", "atan2", "div_no_nan", "xlogy", "xlog1py")
FORWARD_OPS = UNARY_OPS + BINARY_OPS
BACKWARD_OPS = (tuple(f"{op}_backward" for op in FORWARD_OPS) +
                tuple(f"{op}_gradients" for op in BINARY_OPS))
OUT_OPS = tuple(f"{op}_out" for op in FORWARD_OPS)
OPS = FORWARD_OPS + BACKWARD_OPS + OUT_OPS


def check_elementwise_float(op, name, t):
    """A floating operand of a dtype the kernels compute in: float8 and float4
    are refused, as torch's own math kernels refuse them (TypeError)."""
    if t.dtype.is_floating_point and t.dtype not in KERNEL_FLOATS:
        raise TypeError(f"nanfree.{op}: `{name}` must be float16, bfloat16, float32 or float64 "
                        f"(integer and bool tensors are promoted to the default float dtype), "
                        f"got {t.dtype}")


def unary_dtype(op, input):
    """The floating dtype the op computes in: integer and bool inputs promote to
    the default float dtype, as torch's; complex is refused (TypeError)."""
    if input.dtype.is_complex:
        raise TypeError(f"nanfree.{op}: complex `input` is not supported (got {input.dtype}); "
                        f"nanfree's elementwise ops are real-valued")
    check_elementwise_float(op, "input", input)
    return input.dtype if input.dtype.is_floating_point else torch.get_default_dtype()


def unary_operand(op, input):
    """The floating tensor the op computes on (unary_dtype)."""
    return input.to(unary_dtype(op, input))


def check_out(op, out, shape, dtype, ref):
    """<op>_out's `out`: the output's shape and dtype, on ref's device (nanfree.ops
    resizes `out` and takes other dtypes by a copy before calling <op>_out)."""
    name = f"{op}_out"
    if list(out.shape) != list(shape) or out.dtype != dtype:
        raise ValueError(f"nanfree.{name}: `out` must have the output's shape {list(shape)} and "
                         f"dtype {dtype}, got {list(out.shape)} {out.dtype}")
    check_device(name, "out", ref, out)


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


def binary_dtype(op, input, other):
    """The floating dtype a binary op computes in (csrc/common/elementwise_op.h's
    binary_dtype): torch's type promotion, integer and bool results promoted to
    the default float dtype; complex refused (TypeError)."""
    for name, t in (("input", input), ("other", other)):
        if t.dtype.is_complex:
            raise TypeError(f"nanfree.{op}: complex `{name}` is not supported (got {t.dtype}); "
                            f"nanfree's elementwise ops are real-valued")
        check_elementwise_float(op, name, t)
    dtype = torch.result_type(input, other)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def binary_shape(op, input_shape, other_shape):
    """input's and other's shapes broadcast, or a ValueError naming the op."""
    ndim = max(len(input_shape), len(other_shape))
    a = (1,) * (ndim - len(input_shape)) + tuple(input_shape)
    b = (1,) * (ndim - len(other_shape)) + tuple(other_shape)
    shape = []
    for i, (sa, sb) in enumerate(zip(a, b)):
        if sa != sb and sa != 1 and sb != 1:
            raise ValueError(f"nanfree.{op}: the size of `input` ({sa}) must match the size of "
                             f"`other` ({sb}) at non-singleton dimension {i} (shapes "
                             f"{list(input_shape)} and {list(other_shape)} do not broadcast)")
        shape.append(sb if sa == 1 else sa)
    return shape


def binary_operands(op, input, other):
    """input and other in the op's dtype on one device (a 0-d CPU tensor joins
    the other's device), checked to broadcast."""
    dtype = binary_dtype(op, input, other)
    a, b = input, other
    if a.device != b.device:
        if b.dim() == 0 and b.device.type == "cpu":
            b = b.to(a.device)
        elif a.dim() == 0 and a.device.type == "cpu":
            a = a.to(b.device)
    check_device(op, "other", a, b)
    binary_shape(op, a.shape, b.shape)
    return a.to(dtype), b.to(dtype)


def check_binary_backward(op, grad, input, other, order, partial):
    name = f"{op}_backward"
    if order not in (1, 2):
        raise ValueError(f"nanfree.{name}: `order` must be 1 (the derivative) or 2 (the second "
                         f"derivative), got {order}")
    if not 0 <= partial <= order:
        raise ValueError(f"nanfree.{name}: `partial` must be in [0, {order}] for order {order}, "
                         f"got {partial}")
    check_binary_gradient_operands(op, name, grad, input, other)


def check_binary_gradient_operands(op, name, grad, input, other):
    """The arguments of op's backward op `name` (<op>_backward, <op>_gradients)."""
    check_float(name, "input", input)
    if not grad.dtype == input.dtype == other.dtype:
        raise ValueError(f"nanfree.{name}: `grad`, `input` and `other` must have one dtype, got "
                         f"{grad.dtype}, {input.dtype}, {other.dtype}")
    shape = binary_shape(op, input.shape, other.shape)
    if list(grad.shape) != shape:
        raise ValueError(f"nanfree.{name}: `grad` must have the broadcast shape {shape}, got "
                         f"{list(grad.shape)}")
    check_device(name, "other", input, other)
    check_device(name, "grad", input, grad)


def binary_output(*operands):
    """The output of a binary op or backward op on the operands (one floating
    dtype): their broadcast shape in torch's layout for them (TensorIterator's,
    as the C++ kernels allocate it: the operands' order counts)."""
    shape = torch.broadcast_shapes(*(t.shape for t in operands))
    strides = compute_elementwise_output_strides(*(t.expand(shape) for t in operands))
    first = operands[0]
    return torch.empty_strided(shape, strides, dtype=first.dtype, device=first.device)


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
    """{op name: kernel} of a Python backend for every unary op, its backward op
    and its out op, from the backend's forward(op, input) and backward(op, grad,
    input, order): the functions named as the ops that nanfree/_backends.py
    registers. The out op computes, then copies into `out`."""
    kernels = {}
    for op in UNARY_OPS:
        def kernel(input, op=op):
            return forward(op, input)

        def backward_kernel(grad, input, order=1, op=op):
            return backward(op, grad, input, order)

        def out_kernel(input, out, op=op):
            x = unary_operand(op, input)
            check_out(op, out, x.shape, x.dtype, x)
            out.copy_(forward(op, input))

        kernel.__name__, backward_kernel.__name__ = op, f"{op}_backward"
        out_kernel.__name__ = f"{op}_out"
        kernels[op], kernels[f"{op}_backward"] = kernel, backward_kernel
        kernels[f"{op}_out"] = out_kernel
    return kernels


def binary_kernels(forward, backward, gradients):
    """As unary_kernels for the binary ops, from forward(op, input, other),
    backward(op, grad, input, other, order, partial) and gradients(op, grad,
    input, other)."""
    kernels = {}
    for op in BINARY_OPS:
        def kernel(input, other, op=op):
            return forward(op, input, other)

        def backward_kernel(grad, input, other, order=1, partial=0, op=op):
            return backward(op, grad, input, other, order, partial)

        def gradients_kernel(grad, input, other, op=op):
            return gradients(op, grad, input, other)

        def out_kernel(input, other, out, op=op):
            a, b = binary_operands(op, input, other)
            check_out(op, out, binary_shape(op, a.shape, b.shape), a.dtype, a)
            out.copy_(forward(op, input, other))

        kernel.__name__, backward_kernel.__name__ = op, f"{op}_backward"
        gradients_kernel.__name__, out_kernel.__name__ = f"{op}_gradients", f"{op}_out"
        kernels[op], kernels[f"{op}_backward"] = kernel, backward_kernel
        kernels[f"{op}_gradients"], kernels[f"{op}_out"] = gradients_kernel, out_kernel
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


def _fake_binary(op):
    def fake(input, other):
        return binary_output(*binary_operands(op, input, other))

    return fake


def _fake_binary_backward(op):
    def fake(grad, input, other, order=1, partial=0):
        check_binary_backward(op, grad, input, other, order, partial)
        return binary_output(grad, input, other)

    return fake


def _fake_unary_out(op):
    def fake(input, out):
        x = unary_operand(op, input)
        check_out(op, out, x.shape, x.dtype, x)

    return fake


def _fake_binary_out(op):
    def fake(input, other, out):
        a, b = binary_operands(op, input, other)
        check_out(op, out, binary_shape(op, a.shape, b.shape), a.dtype, a)

    return fake


def _fake_binary_gradients(op):
    def fake(grad, input, other):
        check_binary_gradient_operands(op, f"{op}_gradients", grad, input, other)
        out = binary_output(grad, input, other)
        return out, torch.empty_like(out)

    return fake


def register():
    fake_kernels([(op, _fake_unary(op)) for op in UNARY_OPS] +
                 [(f"{op}_backward", _fake_unary_backward(op)) for op in UNARY_OPS] +
                 [(op, _fake_binary(op)) for op in BINARY_OPS] +
                 [(f"{op}_backward", _fake_binary_backward(op)) for op in BINARY_OPS] +
                 [(f"{op}_gradients", _fake_binary_gradients(op)) for op in BINARY_OPS] +
                 [(f"{op}_out", _fake_unary_out(op)) for op in UNARY_OPS] +
                 [(f"{op}_out", _fake_binary_out(op)) for op in BINARY_OPS])
