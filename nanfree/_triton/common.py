"""Launcher plumbing shared by the Triton op families (softmax.py, cosine.py,
gem.py, mnr.py, elementwise.py, losses.py): in which mode the kernels run, the
options of every launch, the refusal of a device that mode cannot run, the
CUDA device guard, and how the elementwise families hand an operand to a
kernel that reads flat arrays. No kernel and no numerics in here.

The kernels run where the Triton of this process can run them: CPU tensors
when they were defined under Triton's interpreter (TRITON_INTERPRET=1 when the
module was imported), CUDA tensors when compiled; any other tensor is refused
with BackendUnavailableError before anything is launched.
"""

from contextlib import nullcontext

import torch

from .._backends import BackendUnavailableError

try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # a Triton without an interpreter
    _InterpretedFunction = None


# Options of every launch. Compiled Triton links libdevice with
# nvvm-reflect-ftz set unless told otherwise, so its float32 functions (log1p,
# asin, pow, atan2, exp, ...) flush subnormal inputs and results to zero, which
# the rules forbid (log1p(x) = x for a subnormal x, as the C++ kernels and torch
# give; bfloat16's subnormals are float32's): off. The interpreter ignores it;
# Triton's AMD backend has no such option (and no libdevice).
LAUNCH = {"enable_reflect_ftz": False} if torch.version.hip is None else {}


def kernels_interpreted(kernels):
    """True when every kernel in `kernels` (a family's kernels, as defined) was
    defined under Triton's interpreter: they then run on CPU tensors only;
    compiled, on CUDA tensors only."""
    return _InterpretedFunction is not None and all(
        isinstance(kernel, _InterpretedFunction) for kernel in kernels)


def check_runnable(op, t, kernels):
    """Refuses, before any launch, a tensor on a device `kernels` cannot run on."""
    if kernels_interpreted(kernels):
        if t.device.type != "cpu":
            raise BackendUnavailableError(
                f"nanfree.{op}: the Triton kernels were defined under Triton's interpreter "
                f"(TRITON_INTERPRET=1), which nanfree uses for CPU tensors only, got a tensor "
                f"on {t.device}; unset TRITON_INTERPRET to run the compiled Triton kernels on "
                f"CUDA tensors")
    elif t.device.type != "cuda":
        raise BackendUnavailableError(
            f"nanfree.{op}: the Triton kernels are compiled and run on CUDA tensors only, got "
            f"a tensor on {t.device}; set TRITON_INTERPRET=1 before starting Python to run "
            f"them on CPU tensors under Triton's interpreter")


class KernelSet:
    """A family's Triton kernels, as defined (a test may monkeypatch a module's
    kernel names; the set keeps the kernels the module defined): the mode they
    run in, and the refusal, before any launch, of a tensor they cannot run on."""

    def __init__(self, *kernels):
        self.kernels = kernels

    def interpreted(self):
        """True when the kernels were defined under Triton's interpreter
        (TRITON_INTERPRET=1 when their module was imported): they then run on
        CPU tensors only; compiled, on CUDA tensors only."""
        return kernels_interpreted(self.kernels)

    def check_runnable(self, op, t):
        check_runnable(op, t, self.kernels)


def device_guard(t):
    """Makes t's CUDA device current for a launch (nothing for a CPU tensor)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def in_layout_of(t, out):
    """t (out's shape, or broadcast to it) in out's layout (a dense output, as
    torch.empty_like allocates it): t itself when it has out's strides, else a
    copy; element i of the flat memory is then out's element i
    (csrc/cuda/operand_layout.h)."""
    if t.shape == out.shape and t.stride() == out.stride():
        return t
    copy = torch.empty_like(out)
    copy.copy_(t.expand(out.shape))
    return copy


def flat_operand(t, out):
    """(tensor, step) of an operand against out: step 0 for one element or one
    element broadcast (every stride 0: a scalar, a 0-d exponent, a reduction's
    upstream gradient expanded by autograd), read in place; else step 1 and
    in_layout_of(t, out)."""
    if all(size == 1 or stride == 0 for size, stride in zip(t.shape, t.stride())):
        return t, 0
    return in_layout_of(t, out), 1
