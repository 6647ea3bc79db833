import os

import pytest
import torch
from hypothesis import settings

import nanfree

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# The Triton interpreter runs kernels in numpy, one program at a time: fewer examples.
settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("interpreted", max_examples=15, deadline=None)
settings.load_profile("interpreted" if INTERPRETED else "default")

from nanfree._backends import BACKENDS, SERVING

# Devices the selected backend serves here (a forced backend may refuse one).
DEVICES = [
    device
    for device in ("cpu", "cuda")
    if SERVING[device] in BACKENDS and (device == "cpu" or torch.cuda.is_available())
]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


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


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
