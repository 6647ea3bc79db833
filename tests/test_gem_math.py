"""Unit tests of the GeM header math (csrc/include/nanfree/gem_math.h) through
its torch mirror, nanfree/_torch_backend/gem.py, function by function: the
divergence form of p's gradient against float64, h(s) on both sides of its
series, and the header compiling on its own. The ops themselves, on every
backend, are tested by the other test_gem_*.py files."""

import math

import pytest
import torch

import gem_oracle
from nanfree._torch_backend import gem as G

# These call the torch mirror's functions directly (no kernel of any backend).
pytestmark = pytest.mark.backend_independent


@pytest.mark.parametrize("p", [0.01, 0.0125, 0.05, 0.5, 3.0, 64.0, 100.0])
def test_divergence_matches_float64(p):
    # D = (1/n) sum h(p log r - log mean) in float32 against float64 KL(w || uniform),
    # w = softmax(p log c): a few ulp for every p (no 1/p amplification).
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([gem_oracle.distribution_rows(k, 4, 40, gen)
                   for k in ("sin", "abs normal", "relu", "log-normal")])
    eps = 1e-6
    xf = x.float()
    pv = torch.tensor(p, dtype=torch.float32)
    # The op's statistics (m, mean, count) of each row, as [rows, 1] columns.
    _, stats = G.gem(xf[:, :, None], pv, 0.0, eps)
    m, mean, count = (s for s in stats[:, 0, :, None].unbind(1))
    c = G.clamp_to_eps(xf, eps)
    d = G.gem_divergence_term(c, m, torch.log(mean), G.gem_clamp_p(pv)).mean(dim=1).double()
    u = float(pv) * torch.log(xf.double().clamp(min=eps))
    w = torch.softmax(u, dim=1)
    exact = (w * u).sum(1) - (torch.logsumexp(u, 1) - math.log(u.shape[1]))
    assert (d >= 0).all()
    torch.testing.assert_close(d, exact, rtol=16 * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_divergence_h(dtype):
    # h(s) = 1 + (s - 1) e^s: the series inside [-1, 1] meets the closed form at
    # the ends, is s^2 / 2 near 0, and float32 is within a few ulp of float64.
    s = torch.linspace(-3, 3, 6001, dtype=torch.float64)
    s = torch.cat([s, torch.tensor([-1e-30, 1e-30, 0.0, -1.0, 1.0, -200.0, -1e5,
                                    math.log(1e4)], dtype=torch.float64)])
    h64 = G.gem_divergence_h(s)
    assert (h64 >= 0).all() and torch.isfinite(h64).all()
    assert h64[-6] == 0.0 and h64[-3] == 1.0 and h64[-2] == 1.0  # 0; e^s = 0
    tiny = torch.tensor([1e-4, -1e-4, 1e-6], dtype=torch.float64)
    torch.testing.assert_close(G.gem_divergence_h(tiny), tiny ** 2 / 2 + tiny ** 3 / 3 + tiny ** 4 / 8,
                               rtol=1e-12, atol=0)
    outer = s.abs() >= 0.5  # the closed form loses at most ~4 bits there in float64
    closed = 1.0 + (s - 1.0) * torch.exp(s)
    torch.testing.assert_close(h64[outer], closed[outer], rtol=1e-14, atol=0)
    if dtype == torch.float32:
        h32 = G.gem_divergence_h(s.float()).double()
        ref = G.gem_divergence_h(s.float().double())  # same arguments, in float64
        # (s = 1e-30: h = 5e-61 is below float32's range and underflows to 0.)
        torch.testing.assert_close(h32, ref, rtol=8 * torch.finfo(torch.float32).eps,
                                   atol=torch.finfo(torch.float32).tiny)
    assert torch.isnan(G.gem_divergence_h(torch.tensor([math.nan], dtype=dtype))).all()


def test_header_compiles(tmp_path):
    # The header is the single source of the math: it must compile on its own.
    import shutil
    import subprocess
    from pathlib import Path
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "gem_math_check.cpp"
    src.write_text('#include "nanfree/gem_math.h"\n'
                   "template float nanfree::gem_divergence_h<float>(float);\n"
                   "template double nanfree::gem_divergence_term<double>(double, double, double, double);\n"
                   "float f(float g, float x) {\n"
                   "  using namespace nanfree;\n"
                   "  return gem_p_grad(g, x, x, 1.0f, gem_divergence_term(x, x, 0.0f, 0.5f), 0.5f) +\n"
                   "         gem_input_grad(g, x, 1e-6f, x, 1.0f, 1.0f, 3.0f);\n"
                   "}\n")
    res = subprocess.run([gxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra",
                          f"-I{root / 'csrc' / 'include'}", str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
