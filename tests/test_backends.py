"""Backend selection: NANFREE_BACKEND, backend_info() and clear refusals. The
tests that start a Python of their own (with its own environment) test no
kernel of this pass's backend: they are marked backend_independent."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import nanfree
import nanfree.nn as nfnn
import nanfree.ops as nf
from conftest import ENVIRONMENT_AT_START, INTERPRETED
from nanfree._backends import SERVING

HERE = os.path.dirname(os.path.abspath(__file__))


def _python(code, environment=None, **env):
    base = os.environ if environment is None else environment
    full_env = {k: v for k, v in base.items() if k not in ("NANFREE_BACKEND", "TRITON_INTERPRET")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env)


def test_backend_info_names_every_device():
    info = nanfree.backend_info()
    serving = info["ops"]["softmax"]
    assert set(serving) == {"cpu", "cuda", "other devices"}
    assert serving["other devices"].startswith("torch")
    assert SERVING["cpu"] in serving["cpu"] or serving["cpu"].startswith("refused")


def test_backend_info_says_how_triton_runs():
    info = nanfree.backend_info()
    assert info["triton"] in ("compiled", "interpreted")
    assert (info["triton"] == "interpreted") == INTERPRETED


@pytest.mark.skipif(not (torch.cuda.is_available() and SERVING["cuda"] == "triton"),
                    reason="Triton does not serve CUDA tensors in this pass")
def test_triton_on_cuda_tensors_is_compiled():
    # A GPU pass whose Triton kernels ran in the interpreter (a test module
    # that set TRITON_INTERPRET=1, say) would test the wrong thing, slowly.
    from nanfree._triton import softmax as triton_softmax

    assert not triton_softmax.kernels_interpreted()
    assert nanfree.backend_info()["triton"] == "compiled"


@pytest.mark.backend_independent
def test_interpreter_never_serves_cuda_tensors():
    code = (
        "import json, nanfree\n"
        "info = nanfree.backend_info()\n"
        "print(json.dumps([info['ops']['softmax']['cuda'], info['unavailable'].get('triton')]))\n"
    )
    forced = _python(code, NANFREE_BACKEND="triton", TRITON_INTERPRET="1")
    assert forced.returncode == 0, forced.stderr
    cuda, _ = json.loads(forced.stdout)
    assert cuda.startswith("refused") and "interpreter" in cuda
    automatic = _python(code, TRITON_INTERPRET="1")
    assert automatic.returncode == 0, automatic.stderr
    cuda, why = json.loads(automatic.stdout)
    assert not cuda.startswith("triton") and "interpreter" in why


@pytest.mark.backend_independent
def test_no_test_module_changes_the_environment():
    # Each pass of scripts/test.sh tests the backend it names only if no module
    # it imports changes the process's environment (TRITON_INTERPRET above all).
    # The third-party libraries the test modules import are imported first:
    # some set variables of their own when imported (sklearn, under
    # sentence-transformers, KMP_*; torch._inductor its cache folder), which is
    # not a test module's doing. The child starts from the environment pytest
    # started with (collection has imported every test module since).
    modules = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "test_*.py")))
    code = (
        "import importlib, os, sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "for library in ('torch', 'torch._inductor.config', 'numpy', 'pytest', 'hypothesis',\n"
        "                'triton', 'sentence_transformers'):\n"
        "    try:\n"
        "        importlib.import_module(library)\n"
        "    except ImportError:\n"
        "        pass\n"
        "before = dict(os.environ)\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException:\n"
        "        pass  # a module may skip itself; what it did to os.environ still counts\n"
        "    changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}\n"
        "    assert not changed, f'{name} changed {sorted(changed)}'\n"
    )
    result = _python(code, environment=ENVIRONMENT_AT_START)
    assert result.returncode == 0, result.stderr


@pytest.mark.backend_independent
def test_unknown_backend_is_refused():
    result = _python("import nanfree", NANFREE_BACKEND="magic")
    assert result.returncode != 0
    assert "NANFREE_BACKEND='magic' is not one of cpu, cuda, triton, torch" in result.stderr


@pytest.mark.backend_independent
def test_forced_torch_backend_serves_cpu():
    code = (
        "import torch, nanfree, nanfree.ops as nf\n"
        "assert nanfree.backend_info()['ops']['softmax']['cpu'].startswith('torch')\n"
        "print(nf.softmax(torch.tensor([[float('-inf')] * 3]), -1).tolist())"
    )
    result = _python(code, NANFREE_BACKEND="torch")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[0.0, 0.0, 0.0]]"


@pytest.mark.backend_independent
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


@pytest.mark.backend_independent
@pytest.mark.skipif(importlib.util.find_spec("nanfree._C_cuda") is not None,
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
    # Subclasses of torch's modules: code that looks for torch's finds them.
    for ours, theirs in ((nfnn.Softmax(1), torch.nn.Softmax), (nfnn.LogSoftmax(1), torch.nn.LogSoftmax),
                         (nfnn.CosineSimilarity(), torch.nn.CosineSimilarity)):
        assert isinstance(ours, theirs)


def _triton_functions():
    """(module name, function name, Python function) of every @triton.jit
    function in nanfree/_triton, compiled or interpreted alike."""
    import pkgutil

    import nanfree._triton as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"nanfree._triton.{info.name}")
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__ \
                    and type(value).__module__.startswith("triton."):
                yield module.__name__, name, fn


def _global_triton_accepts(value):
    """Whether compiled Triton lets a kernel read this module-level value (the
    rule of its code generator's global lookup; the interpreter checks nothing)."""
    import types

    import triton.language as tl

    module = getattr(value, "__module__", "") or ""
    return (isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype))
            or type(value).__module__.startswith("triton.runtime")  # other jit functions
            or getattr(value, "__triton_builtin__", False)
            or getattr(value, "__triton_aggregate__", False)
            or module.startswith("triton.language")
            or (isinstance(value, tuple) and hasattr(value, "_fields")))


@pytest.mark.backend_independent
def test_triton_kernels_read_only_globals_compiled_triton_accepts():
    # A global written `X: tl.constexpr = 1.0` runs under the interpreter but
    # fails to compile on a GPU ("Cannot access global variable X"): it must be
    # `X = tl.constexpr(1.0)`. This finds such globals without a GPU.
    import ast
    import inspect
    import textwrap

    functions = list(_triton_functions())
    assert len(functions) > 20
    bad = []
    for module, name, fn in functions:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                    and node.id not in local and node.id in fn.__globals__ \
                    and not _global_triton_accepts(fn.__globals__[node.id]):
                bad.append(f"{module}.{name} reads {node.id}")
    assert not bad, sorted(set(bad))


@pytest.mark.backend_independent
@pytest.mark.parametrize("variant", ["plain ", "no_such_variant"])
def test_an_unknown_emulation_variant_is_refused_clearly(variant):
    # The emulated build reads NANFREE_CUDA_EMULATION as it is (and aborts on a
    # variant it does not know), so nanfree must refuse it first, by name, with
    # the variants it knows; never load a build under a variant it would abort on.
    result = _python("import nanfree", NANFREE_BACKEND="cuda", NANFREE_CUDA_EMULATION=variant)
    assert result.returncode == 1, result.stderr
    assert "BackendUnavailableError" in result.stderr
    assert "names one of plain, grid_capped, sanitized" in result.stderr
