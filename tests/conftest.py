import math
import os

# The environment pytest started with, before any test module was collected
# (tests/test_backends.py checks that importing them changes nothing).
ENVIRONMENT_AT_START = dict(os.environ)

import pytest
import torch
from hypothesis import settings

import nanfree
from nanfree._ops.common import acc_dtype  # noqa: F401  (the test modules import it from here)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The Triton interpreter runs kernels in numpy, one program at a time: fewer examples.
# Derandomized: every run draws the same examples, so a test passes or fails the
# same way on every machine and CI run (HYPOTHESIS_PROFILE=explore draws new
# ones, 500 per test, to hunt for failures).
settings.register_profile("default", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("interpreted", max_examples=15, deadline=None, derandomize=True)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                      or ("interpreted" if INTERPRETED else "default"))

from nanfree._backends import BACKENDS, SERVING, BackendUnavailableError

# Devices the selected backend serves here (a forced backend may refuse one).
DEVICES = [
    device
    for device in ("cpu", "cuda")
    if SERVING[device] in BACKENDS and (device == "cpu" or torch.cuda.is_available())
]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
HALF_DTYPES = (torch.float16, torch.bfloat16)
INF = math.inf
NAN = math.nan


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "backend_independent: calls no kernel of the backend under test (argument checks in "
        "Python, registrations, subprocesses with an environment of their own); scripts/test.sh "
        "runs these in its first pass only",
    )


def pytest_report_header(config):
    info = nanfree.backend_info()
    return [f"nanfree backends: {info['ops']['softmax']} (NANFREE_BACKEND={info['NANFREE_BACKEND']})"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that makes CPU tensors is skipped in a pass whose backend refuses
    them (NANFREE_BACKEND=triton compiled, on a GPU: its CPU tensors are served
    under the interpreter, in the TRITON_INTERPRET=1 pass), and only there: the
    skip needs the backend's own refusal of CPU tensors (BackendUnavailableError,
    or its text in the error of a worker process), in a test not run on CUDA
    tensors (there a CPU tensor reaching an op is a bug, and fails)."""
    try:
        return (yield)
    except Exception as error:  # the refusal itself, or its text from a worker process
        params = getattr(item, "callspec", None)
        on_cuda = params is not None and params.params.get("device") == "cuda"
        refusal = isinstance(error, BackendUnavailableError) or type(error).__module__.startswith(
            ("torch.multiprocessing", "multiprocessing"))
        if "cpu" in DEVICES or on_cuda or not refusal or SERVING["cpu"] not in str(error):
            raise
        pytest.skip(f"CPU tensors, which this pass's backend refuses: {SERVING['cpu']}")


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


# (rtol, atol) of a Triton launcher against float64 math, for values of magnitude ~1.
TRITON_KERNEL_TOL = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (4e-3, 1e-3),
    torch.bfloat16: (3e-2, 1e-2),
}


def triton_kernel_device(kernels):
    """The device the Triton kernels of `kernels` (a nanfree._triton module) run on
    in this process: CPU tensors when they were defined under the interpreter,
    CUDA tensors when compiled and a GPU is present; otherwise the calling test
    module is skipped (its kernels run in the TRITON_INTERPRET=1 pass)."""
    if kernels.kernels_interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip(
        "Triton is compiled in this process and no GPU is present: the Triton kernels run on "
        "CPU tensors under Triton's interpreter, in the TRITON_INTERPRET=1 pass of "
        "scripts/test.sh",
        allow_module_level=True,
    )


def triton_kernel_mode_matches(kernels, device):
    """Whether a Triton family's kernels run where the tests run them (and
    backend_info says so): interpreted on CPU tensors, compiled on CUDA ones."""
    from nanfree._backends import triton_mode

    mode = "interpreted" if device == "cpu" else "compiled"
    return kernels.kernels_interpreted() == (device == "cpu") and triton_mode() == mode


def triton_refused_devices(device):
    """The devices whose tensors the Triton kernels running on `device` refuse."""
    if device == "cuda":
        return ["cpu"]
    return ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def triton_refusal_words(device):
    """What the refusal of a tensor on another device says, for kernels on `device`."""
    if device == "cpu":
        return ("CPU tensors only", "unset TRITON_INTERPRET")
    return ("CUDA tensors only", "set TRITON_INTERPRET=1")


@pytest.fixture(params=["observer", "dispatch_mode"])
def debug_checker(request, monkeypatch):
    """nanfree.debug.detect_anomaly with each of its per-op checks: the C++
    observer (csrc/debug_observer.cpp) and the TorchDispatchMode used without it."""
    import nanfree.debug

    if request.param == "dispatch_mode":
        monkeypatch.setattr(nanfree.debug, "_OBSERVER", None)
    elif nanfree.debug._OBSERVER is None:
        pytest.fail("nanfree._C (the C++ observer of nanfree.debug) is not built")
    return request.param
