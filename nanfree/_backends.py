"""Which implementation serves which device.

Default order: CPU tensors use the compiled C++ kernels; CUDA tensors use the
compiled CUDA kernels, else the Triton kernels, else the pure-PyTorch
implementation; any other device uses the pure-PyTorch implementation.

``NANFREE_BACKEND=cpu|cuda|triton|torch`` forces one implementation for every
device it can run on; import fails if it is not available at all, and a tensor
on a device the forced backend cannot serve gets a clear error at call time.
``triton`` serves CPU tensors only under ``TRITON_INTERPRET=1`` (Triton's
interpreter), which is how the Triton kernels are tested without a GPU, and
CUDA tensors only without it (compiled Triton): the interpreter is never used
for CUDA tensors.

``NANFREE_BACKEND=cuda NANFREE_CUDA_EMULATION=<variant>`` is the same for the
CUDA kernels: a test-only emulated build (setup.py's NANFREE_CUDA_EMULATE;
``nanfree._C_cuda_emulated_plain`` for the variants ``plain`` and ``grid_capped``,
which differ in launch limits only, ``nanfree._C_cuda_emulated_sanitized`` for
``sanitized``) runs them on CPU tensors through an emulation of the CUDA execution model
(tests/cuda_emulation), and CUDA tensors are refused.
"""

import importlib
import importlib.util
import os

import torch

from ._ops import cosine, elementwise, gem, losses, mnr, softmax

BACKENDS = ("cpu", "cuda", "triton", "torch")

# op family -> its Python side (nanfree/_ops/<family>.py): its op names (OPS)
# and fake kernels (register()). Each Python backend holds one module per
# family, nanfree._triton.<family> and nanfree._torch_backend.<family>, with one
# function per op named as the op.
FAMILIES = {"softmax": softmax, "cosine": cosine, "gem": gem, "mnr": mnr,
            "elementwise": elementwise, "losses": losses}

_DESCRIPTIONS = {
    "cpu": "cpu: compiled C++ kernels (nanfree._C_cpu)",
    "cuda": "cuda: compiled CUDA kernels (nanfree._C_cuda)",
    "cuda (emulated)": "cuda (emulated): the CUDA kernels on the CPU, through an emulation of the "
                       "CUDA execution model (nanfree.{module}, schedule {schedule})",
    "triton": "triton: Triton kernels (nanfree._triton)",
    "torch": "torch: pure-PyTorch implementation (nanfree._torch_backend)",
}


class BackendUnavailableError(RuntimeError):
    """NANFREE_BACKEND names an implementation that cannot run here."""


def _extension_path(name):
    spec = importlib.util.find_spec(f"nanfree.{name}")
    return None if spec is None else spec.origin


def _load_extension(name):
    """Loads a compiled library; returns None on success, else why it failed."""
    path = _extension_path(name)
    if path is None:
        return f"nanfree.{name} is not built"
    try:
        torch.ops.load_library(path)
    except OSError as error:
        return f"nanfree.{name} failed to load: {error}"
    return None


# Variant of NANFREE_CUDA_EMULATION -> the emulated build that serves it (the
# build reads its variant's launch limits when it loads: csrc/cuda/launch_limits.h).
EMULATED_BUILDS = {"plain": "plain", "grid_capped": "plain", "sanitized": "sanitized"}


def emulated_cuda_module():
    """The emulated CUDA build NANFREE_CUDA_EMULATION names, or None when it is unset."""
    variant = os.environ.get("NANFREE_CUDA_EMULATION", "")
    if not variant.strip():
        return None
    # An unknown variant (" plain" too: the build reads the variable as it is) names a
    # build that does not exist: _load_emulated_cuda says so.
    return f"_C_cuda_emulated_{EMULATED_BUILDS.get(variant, variant)}"


def _load_emulated_cuda(module):
    problem = _load_extension(module)
    if problem is not None and "_sanitized" in module and "libasan" in problem:
        problem += (" (the sanitized build runs with AddressSanitizer's runtime preloaded: "
                    "LD_PRELOAD=$(gcc -print-file-name=libasan.so), as scripts/test.sh does)")
    if problem is not None and _extension_path(module) is None:
        problem += (" (build it with NANFREE_CUDA_EMULATE=1 python setup.py build_ext --inplace; "
                    f"NANFREE_CUDA_EMULATION names one of {', '.join(EMULATED_BUILDS)})")
    return problem


def _triton_problem():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton's mode is fixed when the kernels are defined, from TRITON_INTERPRET
# then; nanfree chooses its backends from the same variable when it is imported.
_INTERPRETING = _interpreting()
_INTERPRETER_REFUSES_CUDA = (
    "TRITON_INTERPRET=1 runs Triton's interpreter, which nanfree uses for CPU tensors only; "
    "unset it to run the compiled Triton kernels on CUDA tensors"
)


def triton_mode():
    """'interpreted' or 'compiled': how nanfree's Triton kernels run in this process."""
    import sys

    module = sys.modules.get("nanfree._triton.softmax")
    if module is not None:  # defined already: ask the kernels themselves
        return "interpreted" if module.kernels_interpreted() else "compiled"
    return "interpreted" if _interpreting() else "compiled"


def forced_backend():
    value = os.environ.get("NANFREE_BACKEND", "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise BackendUnavailableError(
            f"NANFREE_BACKEND={value!r} is not one of {', '.join(BACKENDS)}"
        )
    return value


try:
    # The operator schemas, the autograd and autocast kernels and the fast
    # Python entry points of nanfree.ops (registered when the library loads).
    from . import _C
except ImportError as error:
    raise ImportError(
        f"nanfree._C could not be imported ({error}): build nanfree with "
        "`pip install --no-build-isolation .` (the operator schemas live in the C++ extension)"
    ) from error
for _family in FAMILIES.values():
    _family.register()

_FORCED = forced_backend()
_EMULATED = emulated_cuda_module()
if _EMULATED is not None and _FORCED != "cuda":
    raise BackendUnavailableError(
        "NANFREE_CUDA_EMULATION runs the CUDA kernels through the emulated CUDA build and "
        f"needs NANFREE_BACKEND=cuda (it is {_FORCED or 'unset'})")
# device -> backend name, or an error message for a device the forced backend cannot serve
SERVING = {}
PROBLEMS = {}


def _require(backend, problem):
    if problem is not None:
        raise BackendUnavailableError(f"NANFREE_BACKEND={backend} but {problem}")


def _choose():
    if _FORCED is None:
        cpu_problem = _load_extension("_C_cpu")
        PROBLEMS["cpu"] = cpu_problem
        SERVING["cpu"] = "cpu" if cpu_problem is None else "torch"
        cuda_problem = _load_extension("_C_cuda")
        PROBLEMS["cuda"] = cuda_problem
        PROBLEMS["triton"] = _triton_problem()
        if PROBLEMS["triton"] is None and _INTERPRETING:
            PROBLEMS["triton"] = _INTERPRETER_REFUSES_CUDA
        if cuda_problem is None:
            SERVING["cuda"] = "cuda"
        elif PROBLEMS["triton"] is None:
            SERVING["cuda"] = "triton"
        else:
            SERVING["cuda"] = "torch"
        return
    if _FORCED == "cpu":
        _require("cpu", _load_extension("_C_cpu"))
        SERVING.update(cpu="cpu", cuda="NANFREE_BACKEND=cpu does not serve CUDA tensors")
    elif _FORCED == "cuda" and _EMULATED is not None:
        _require("cuda", _load_emulated_cuda(_EMULATED))
        SERVING.update(cpu="cuda", cuda="NANFREE_CUDA_EMULATION runs the CUDA kernels on CPU "
                                        "tensors only; unset it for CUDA tensors")
    elif _FORCED == "cuda":
        _require("cuda", _load_extension("_C_cuda"))
        SERVING.update(cuda="cuda", cpu="NANFREE_BACKEND=cuda does not serve CPU tensors")
    elif _FORCED == "triton":
        _require("triton", _triton_problem())
        if _INTERPRETING:
            SERVING.update(cpu="triton", cuda=f"NANFREE_BACKEND=triton with {_INTERPRETER_REFUSES_CUDA}")
        else:
            SERVING.update(
                cuda="triton",
                cpu="NANFREE_BACKEND=triton serves CPU tensors only with TRITON_INTERPRET=1",
            )
    else:
        SERVING.update(cpu="torch", cuda="torch")


def _refusing_kernel(message):
    def refuse(*args, **kwargs):
        raise BackendUnavailableError(f"nanfree: {message}")

    return refuse


def _lazy_kernel(module_name, name):
    """Imports the implementation on first call (importing triton takes a while)."""

    resolved = []

    def kernel(*args):
        if not resolved:
            resolved.append(getattr(importlib.import_module(module_name), name))
        return resolved[0](*args)

    kernel.__name__ = name
    return kernel


# backend -> the package of its per-family modules.
_PACKAGES = {"triton": "nanfree._triton", "torch": "nanfree._torch_backend"}


def _register_python_kernels():
    for family, registration in FAMILIES.items():
        modules = {backend: f"{package}.{family}" for backend, package in _PACKAGES.items()}
        for name in registration.OPS:
            # Any device without a kernel of its own gets the pure-PyTorch one.
            torch.library.register_kernel(f"nanfree::{name}", None,
                                          _lazy_kernel(modules["torch"], name))
        for device, serving in SERVING.items():
            if serving in ("cpu", "cuda"):
                continue  # compiled kernels registered themselves when loaded
            for name in registration.OPS:
                if serving in modules:
                    kernel = _lazy_kernel(modules[serving], name)
                else:
                    kernel = _refusing_kernel(serving)
                torch.library.register_kernel(f"nanfree::{name}", device, kernel)


_choose()
_register_python_kernels()


def backend_info():
    """Which implementation serves each op family on each device, and why."""
    serving = {}
    for device in ("cpu", "cuda"):
        choice = SERVING[device]
        if device == "cpu" and choice == "cuda" and _EMULATED is not None:
            schedule = os.environ.get("NANFREE_CUDA_SCHEDULE", "") or "lockstep"
            serving[device] = _DESCRIPTIONS["cuda (emulated)"].format(module=_EMULATED,
                                                                      schedule=schedule)
        else:
            serving[device] = _DESCRIPTIONS.get(choice, f"refused: {choice}")
    serving["other devices"] = _DESCRIPTIONS["torch"]
    return {
        "NANFREE_BACKEND": _FORCED or "(not set: automatic)",
        "TRITON_INTERPRET": _INTERPRETING,
        "triton": triton_mode(),
        "cuda_available": torch.cuda.is_available(),
        "ops": {family: dict(serving) for family in FAMILIES},
        "unavailable": {name: why for name, why in PROBLEMS.items() if why is not None},
    }
