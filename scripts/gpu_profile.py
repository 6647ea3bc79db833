"""Runs one nanfree op at a benchmark shape on the GPU, a few times, for a
profiler to watch (scripts/gpu_profile.sh runs it under Nsight Compute).

    python3 scripts/gpu_profile.py CASE       # e.g. cosine_similarity-fwd
    python3 scripts/gpu_profile.py --list     # the cases

Each case is a row the H200 measurements left below its target
(docs/gpu.md): the warm-up calls run before ``torch.cuda.profiler.start()``,
the measured ones after it, so ``ncu --profile-from-start off`` sees only those.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import nanfree.ops as nf  # noqa: E402


def _rows(n, d, dtype, grad=False):
    x = torch.randn(n, d, device="cuda", dtype=dtype)
    return x.requires_grad_() if grad else x


def _forward_backward(fn, *inputs):
    out = fn(*inputs)
    torch.autograd.grad(out, [t for t in inputs if t.requires_grad], torch.ones_like(out))


def cases():
    bf16, fp32 = torch.bfloat16, torch.float32
    return {
        "cosine_similarity-fwd": lambda: (lambda a, b: nf.cosine_similarity(a, b, dim=-1),
                                          (_rows(262144, 768, bf16), _rows(262144, 768, bf16))),
        "cosine_similarity-fwdbwd": lambda: (
            lambda a, b: _forward_backward(lambda x, y: nf.cosine_similarity(x, y, dim=-1), a, b),
            (_rows(262144, 768, bf16, True), _rows(262144, 768, bf16, True))),
        "normalize-fwd": lambda: (lambda a: nf.normalize(a, dim=-1), (_rows(262144, 768, bf16),)),
        "normalize-fwdbwd": lambda: (
            lambda a: _forward_backward(lambda x: nf.normalize(x, dim=-1), a),
            (_rows(262144, 768, bf16, True),)),
        "gem_pool2d-fwd": lambda: (lambda x, p: nf.gem_pool2d(x, p),
                                   (torch.rand(64, 2048, 14, 14, device="cuda", dtype=fp32) + 0.1,
                                    torch.tensor([3.0], device="cuda"))),
        "gem_pool2d-fwdbwd": lambda: (
            lambda x, p: _forward_backward(nf.gem_pool2d, x, p),
            ((torch.rand(64, 2048, 14, 14, device="cuda", dtype=fp32) + 0.1).requires_grad_(),
             torch.tensor([3.0], device="cuda", requires_grad=True))),
        "softmax-fwd-16k-bf16": lambda: (lambda x: nf.softmax(x, -1),
                                         (_rows(4096, 16384, bf16),)),
        "softmax-fwd-128-fp32": lambda: (lambda x: nf.softmax(x, -1),
                                         (_rows(262144, 128, fp32),)),
        "log-fwd-64m-bf16": lambda: (nf.log, (torch.rand(1 << 26, device="cuda", dtype=bf16) + 0.5,)),
        "sqrt-fwdbwd-64m-bf16": lambda: (
            lambda x: _forward_backward(nf.sqrt, x),
            ((torch.rand(1 << 26, device="cuda", dtype=bf16) + 0.5).requires_grad_(),)),
        "cross_entropy-fwd-1000": lambda: (
            nf.cross_entropy, (_rows(32768, 1000, fp32), torch.randint(0, 1000, (32768,), device="cuda"))),
        "cross_entropy-fwdbwd-32k-bf16": lambda: (
            lambda x, y: _forward_backward(nf.cross_entropy, x, y),
            (_rows(8192, 32000, bf16, True), torch.randint(0, 32000, (8192,), device="cuda"))),
        "mnr_loss-fwdbwd-16k": lambda: (
            lambda q, p: _forward_backward(nf.mnr_loss, q, p),
            (_rows(16384, 768, bf16, True), _rows(16384, 768, bf16, True))),
    }


def main():
    table = cases()
    if len(sys.argv) != 2 or sys.argv[1] not in table:
        print("cases:", " ".join(table))
        return 0 if sys.argv[1:] == ["--list"] else 2
    fn, inputs = table[sys.argv[1]]()
    for _ in range(3):  # warm-up: allocations, autotuning, lazy loading
        fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(2):
        fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
