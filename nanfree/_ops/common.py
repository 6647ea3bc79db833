"""What every op family's Python side shares: the op-level argument checks of
the Python backends and fake kernels (the same errors, with the same words and
exception types, as csrc/common/checks.h), the checks of Python argument types
that nanfree.ops makes before calling an op (the C++ entry points only say
that a call did not match), and the accumulation dtype."""

import math
import numbers

import torch

# The floating dtypes nanfree's kernels compute in (not float8 or float4, which
# torch's own math kernels refuse too).
KERNEL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_float(op, name, t):
    if t.dtype not in KERNEL_FLOATS:
        raise TypeError(
            f"nanfree.{op}: `{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_device(op, name, ref, t, ref_name="input"):
    if t.device != ref.device:
        raise ValueError(
            f"nanfree.{op}: `{name}` is on {t.device} but `{ref_name}` is on {ref.device}")


def is_symbolic(value):
    """Whether a Python number's value is left for the op to check when it runs:
    while torch.compile traces (a float that changed between calls is then a
    symbolic SymFloat, whose value a check cannot read without breaking the
    graph), or in a fake kernel given a SymFloat or SymInt."""
    return torch.compiler.is_compiling() or isinstance(
        value, (torch.SymFloat, torch.SymInt, torch.SymBool))


def is_bool(value):
    """A Python, numpy or symbolic bool (a bool is an int to Python, not to torch)."""
    return isinstance(value, (bool, torch.SymBool)) or type(value).__name__ == "bool_"


def is_number(value):
    """A real number as torch takes one: int, float, numpy scalars, symbolic
    numbers; not bool (torch refuses bool where it wants a number)."""
    if is_bool(value):
        return False
    return isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt))


def as_float(value):
    """A Python float of a number (numpy scalars included); while compiling, a
    float as it is (float() could make torch.compile specialize on its value)."""
    if isinstance(value, float) or (is_symbolic(value) and not isinstance(value, int)):
        return value
    return float(value)


def check_eps(op, eps):
    if is_symbolic(eps):
        return  # checked by the op when it runs
    if not (is_number(eps) and 0 < eps < math.inf):
        raise ValueError(f"nanfree.{op}: `eps` must be positive and finite, got {eps!r}")


def wrap_dim(op, dim, rank, ndim):
    """`dim` wrapped into [0, rank), else IndexError; `ndim` is the tensor's number
    of dimensions for the message (as csrc/common/checks.h)."""
    if not -rank <= dim < rank:
        raise IndexError(
            f"nanfree.{op}: `dim` {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % rank


def broadcasts_to(src, dst):
    """Whether a shape broadcasts to another (torch's rule, trailing dims aligned)."""
    if len(src) > len(dst):
        return False
    lead = len(dst) - len(src)
    return all(s in (1, dst[lead + d]) for d, s in enumerate(src))


def broadcast_mask(op, ref, mask):
    """The mask as a bool tensor of ref's shape (an expanded view), or None."""
    if mask is None:
        return None
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"nanfree.{op}: `mask` must be bool or integer (nonzero = keep), "
                        f"got {mask.dtype}")
    check_device(op, "mask", ref, mask)
    if not broadcasts_to(mask.shape, ref.shape):
        raise ValueError(f"nanfree.{op}: `mask` of shape {list(mask.shape)} does not broadcast "
                         f"to the input's shape {list(ref.shape)}")
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep.expand(ref.shape)


def check_tensors(op, **tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")


def check_optional_tensor(op, name, t):
    if t is not None and not isinstance(t, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor or None, "
                        f"got {type(t).__name__}")


def check_number(op, name, value):
    if not is_number(value):
        raise TypeError(f"nanfree.{op}: `{name}` must be a number, got {type(value).__name__}")


def check_dim_type(op, dim):
    if is_bool(dim) or not isinstance(dim, int):
        raise TypeError(f"nanfree.{op}: `dim` must be an int, got {type(dim).__name__}")


def refuse_torch_func(op, *tensors):
    """After an op failed with a RuntimeError: if an argument is one of torch.func's
    wrapped tensors (grad, vjp, jacrev, vmap), raises a NotImplementedError that
    names the op and the alternative instead of the dispatcher's words. nanfree's
    ops define their autograd as C++ (or Python) autograd Functions, which
    torch.func's transforms do not run."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(isinstance(t, torch.Tensor) and wrapped(t) for t in tensors):
        raise NotImplementedError(
            f"nanfree.{op}: torch.func transforms (grad, vjp, jacrev, vmap, functional_call "
            f"under grad) do not run nanfree's ops, whose gradients are autograd Functions; "
            f"take gradients with torch.autograd.grad (or loss.backward()) instead") from None


def fake_kernels(pairs):
    """Registers each (op name, fake kernel) pair: fake kernels check their
    arguments as the real ones do (they also serve the meta device, which a
    mixed-device call dispatches to)."""
    for name, fake in pairs:
        torch.library.register_fake(f"nanfree::{name}", fake)


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


def autocast_on(device_type):
    """Whether autocast is on for the device type (False for a device autocast
    does not know, such as meta, where torch.is_autocast_enabled raises)."""
    if device_type in ("cpu", "cuda"):  # autocast is available for both
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def readable_on_host(t):
    """Whether t's values may be read on the host without a device sync and
    without being baked into a trace: a CPU tensor with data (not a fake tensor
    or another subclass that dispatches in Python), outside torch.compile's and
    torch.jit.trace's tracing."""
    return (t.device.type == "cpu" and not torch._C._dispatch_keys(t).has(_PYTHON_KEY)
            and not torch.compiler.is_compiling() and not torch._C._is_tracing())


_PYTHON_KEY = torch._C.DispatchKey.Python
