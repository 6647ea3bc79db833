"""Backend selection: NANFREE_BACKEND, backend_info() and clear refusals."""

import os
import subprocess
import sys

import pytest
import torch

import nanfree
import nanfree.nn as nfnn
import nanfree.ops as nf
from nanfree._backends import SERVING


def _python(code, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("NANFREE_BACKEND", "TRITON_INTERPRET")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env)


def test_backend_info_names_every_device():
    info = nanfree.backend_info()
    serving = info["ops"]["softmax"]
    assert set(serving) == {"cpu", "cuda", "other devices"}
    assert serving["other devices"].startswith("torch")
    assert SERVING["cpu"] in serving["cpu"] or serving["cpu"].startswith("refused")


def test_unknown_backend_is_refused():
    result = _python("import nanfree", NANFREE_BACKEND="magic")
    assert result.returncode != 0
    assert "NANFREE_BACKEND='magic' is not one of cpu, cuda, triton, torch" in result.stderr


def test_forced_torch_backend_serves_cpu():
    code = (
        "import torch, nanfree, nanfree.ops as nf\n"
        "assert nanfree.backend_info()['ops']['softmax']['cpu'].startswith('torch')\n"
        "print(nf.softmax(torch.tensor([[float('-inf')] * 3]), -1).tolist())"
    )
    result = _python(code, NANFREE_BACKEND="torch")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[0.0, 0.0, 0.0]]"


def test_forced_triton_without_interpreter_refuses_cpu_tensors():
    code = (
        "import torch, nanfree.ops as nf\n"
        "try:\n"
        "    nf.softmax(torch.zeros(2, 3), -1)\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    result = _python(code, NANFREE_BACKEND="triton")
    assert result.returncode == 0, result.stderr
    assert "serves CPU tensors only with TRITON_INTERPRET=1" in result.stdout


@pytest.mark.skipif(nanfree.backend_info()["unavailable"].get("cuda") is None,
                    reason="the CUDA extension is built here")
def test_forced_cuda_without_extension_fails_loudly():
    result = _python("import nanfree", NANFREE_BACKEND="cuda")
    assert result.returncode != 0
    assert "NANFREE_BACKEND=cuda but nanfree._C_cuda" in result.stderr


def test_modules():
    x = torch.randn(3, 5)
    mask = torch.tensor([1, 1, 0, 1, 0])
    torch.testing.assert_close(nfnn.Softmax(dim=1)(x, mask=mask), nf.softmax(x, 1, mask=mask))
    torch.testing.assert_close(nfnn.LogSoftmax(-1)(x), torch.log_softmax(x, -1))
    assert "dim=1" in repr(nfnn.Softmax(dim=1))
