"""Compiles every Triton kernel nanfree launches for a CUDA GPU, on a machine
without one: the kernels as each op launches them (every family, forward and
backward, over dtypes, layouts and options) are compiled for sm_90 down to a
cubin with the Triton installed here, and nothing is run.

Compiled Triton refuses some code its interpreter runs (a global that is not a
constexpr, a tl.dot tile with K < 16 in Triton 3.6); the CPU test passes run the
interpreter only, so this is how a compile error is found before a GPU is at
hand. Run it with the Triton of the GPU machine to check what that machine will
compile, e.g. ``pip install --target DIR triton==3.6.0`` and
``PYTHONPATH=DIR python scripts/triton_compile_check.py``.

How: the ops are called on CPU tensors with the Triton backend; each launch
(``JITFunction.run``) is replaced by a compile of the same kernel with the
launch's argument types and constexprs (``triton.compile`` with
``GPUTarget("cuda", ARCH, 32)``). The outputs stay uninitialized: values are
not the point. Exit status 1 if any kernel fails to compile.

Usage: ``python scripts/triton_compile_check.py [--arch 90] [--quick]``
"""

import argparse
import os
import sys
import time
import traceback

# The registrations send CPU tensors to the Triton backend only under the
# interpreter; the kernels are defined (imported) after it is switched off
# below, so they are compiled JITFunctions.
os.environ["NANFREE_BACKEND"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import nanfree  # noqa: E402,F401
from nanfree import ops  # noqa: E402

del os.environ["TRITON_INTERPRET"]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nanfree._triton import common  # noqa: E402

TYPES = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
    torch.float64: "fp64", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
    torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
}


class Compiler:
    def __init__(self, arch):
        self.target = GPUTarget("cuda", arch, 32)
        self.seen = {}
        self.failures = []
        self.flushing = []

    def signature(self, kernel, args, kwargs):
        bound = kernel.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        types, constexprs = {}, {}
        for param in kernel.params:
            value = bound.arguments[param.name]
            if param.is_constexpr or value is None:
                types[param.name] = "constexpr"
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                types[param.name] = "*" + TYPES[value.dtype]
            elif isinstance(value, bool):
                types[param.name] = "i1"
            elif isinstance(value, int):
                types[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                types[param.name] = "fp32"
            else:
                raise TypeError(f"{kernel.fn.__name__}: argument {param.name} of type "
                                f"{type(value).__name__}")
        return types, constexprs

    def launch(self, kernel, *args, grid, warmup, **kwargs):
        params = {param.name for param in kernel.params}
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in params}
        types, constexprs = self.signature(kernel, args, kwargs)
        name = f"{kernel.fn.__module__}.{kernel.fn.__name__}"
        key = (name, tuple(types.items()), repr(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        if key in self.seen:
            return None
        if options.get("enable_reflect_ftz", True):
            # libdevice would flush subnormal inputs and results to zero (compiled
            # Triton's default); the rules keep them, as the C++ kernels do.
            self.flushing.append(f"{name} {options}")
        started = time.time()
        try:
            triton.compile(ASTSource(kernel, types, constexprs), target=self.target,
                           options=options)
            self.seen[key] = time.time() - started
        except Exception as error:  # every failure is reported, then the run goes on
            self.seen[key] = None
            shown = {k: v for k, v in constexprs.items() if v is not None}
            self.failures.append(f"{name} {shown} {options}:\n{error}")
        return None


def calls(quick):
    """(name, function of no argument) pairs: every family forward and backward."""
    dtypes = [torch.float32, torch.bfloat16] if quick else \
        [torch.float32, torch.float64, torch.float16, torch.bfloat16]

    def leaf(*shape, dtype):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    def backward(out):
        torch.autograd.backward(out, torch.ones_like(out))

    found = []
    for dtype in dtypes:
        widths = [100, 5000] if quick else [7, 100, 1000, 5000, 70000]
        for op in ("softmax", "log_softmax", "logsumexp"):
            fn = getattr(ops, op)
            for n in widths:
                found.append((f"{op} last {dtype} {n}",
                              lambda fn=fn, n=n, dtype=dtype: backward(fn(leaf(4, n, dtype=dtype), -1))))
                found.append((f"{op} inner {dtype} {n}",
                              lambda fn=fn, n=n, dtype=dtype: backward(fn(leaf(2, n, 3, dtype=dtype), 1))))
                found.append((f"{op} masked {dtype} {n}", lambda fn=fn, n=n, dtype=dtype: backward(
                    fn(leaf(4, n, dtype=dtype), -1, mask=torch.rand(4, n) > 0.3))))
                found.append((f"{op} masked inner {dtype} {n}", lambda fn=fn, n=n, dtype=dtype: backward(
                    fn(leaf(2, n, 3, dtype=dtype), 1, mask=torch.rand(2, n, 3) > 0.3))))
        for d in ([384] if quick else [1, 40, 384, 5000]):
            found.append((f"cosine_similarity {dtype} {d}", lambda d=d, dtype=dtype: backward(
                ops.cosine_similarity(leaf(8, d, dtype=dtype), leaf(8, d, dtype=dtype)))))
            found.append((f"normalize {dtype} {d}", lambda d=d, dtype=dtype: backward(
                ops.normalize(leaf(8, d, dtype=dtype), dim=-1))))
            found.append((f"cos_sim {dtype} {d}", lambda d=d, dtype=dtype: backward(
                ops.cos_sim(leaf(8, d, dtype=dtype), leaf(5, d, dtype=dtype)))))
        for p in (3.0, "tensor"):
            def gem_call(p=p, dtype=dtype, tokens=False, masked=False):
                x = leaf(*((2, 50, 16) if tokens else (2, 16, 7, 7)), dtype=dtype)
                pv = torch.tensor(3.0, requires_grad=True) if p == "tensor" else p
                if tokens:
                    mask = torch.rand(2, 50, 1) > 0.3 if masked else None
                    out = ops.gem(x, pv, dim=1, mask=mask)
                else:
                    out = ops.gem_pool2d(x, pv)
                backward(out)
            found.append((f"gem_pool2d {dtype} p={p}", gem_call))
            found.append((f"gem tokens {dtype} p={p}",
                          lambda gem_call=gem_call: gem_call(tokens=True)))
            found.append((f"gem tokens masked {dtype} p={p}",
                          lambda gem_call=gem_call: gem_call(tokens=True, masked=True)))
        for d in ([384] if quick else [8, 40, 384]):
            options = [{}] if quick else [
                {}, {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
                {"directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")},
                {"hardness_mode": "in_batch_negatives", "hardness_strength": 2.0},
                {"hardness_mode": "hard_negatives", "hardness_strength": 2.0},
                {"hardness_mode": "all_negatives", "hardness_strength": 2.0},
                {"reduction": "none"}, {"scale": "tensor"},
            ]
            for k in (0, 2):
                for opt in options:
                    def mnr_call(d=d, dtype=dtype, k=k, opt=opt):
                        kwargs = dict(opt)
                        if kwargs.get("scale") == "tensor":
                            kwargs["scale"] = torch.tensor(20.0, requires_grad=True)
                        q, p = leaf(6, d, dtype=dtype), leaf(6, d, dtype=dtype)
                        negatives = leaf(6, k, d, dtype=dtype) if k else None
                        backward(ops.mnr_loss(q, p, negatives, **kwargs))
                    found.append((f"mnr_loss {dtype} d={d} k={k} {opt}", mnr_call))
        for op in ("sqrt", "log", "log1p", "acos", "asin"):
            def unary_call(op=op, dtype=dtype):
                # The value, the derivative and (double backward) the second derivative.
                x = (torch.rand(1000) * 0.5).to(dtype).requires_grad_()
                (g,) = torch.autograd.grad(getattr(ops, op)(x).sum(), x, create_graph=True)
                backward(g)
            found.append((f"{op} {dtype}", unary_call))
        for op in ("pow", "atan2", "div_no_nan", "xlogy", "xlog1py"):
            for other in ("tensor", "scalar"):
                def binary_call(op=op, dtype=dtype, other=other):
                    # The value, both gradients and (double backward) every second partial.
                    a = (torch.rand(1000) + 0.5).to(dtype).requires_grad_()
                    b = (torch.rand(1000) + 0.5).to(dtype).requires_grad_() if other == "tensor" else 2.5
                    inputs = (a, b) if other == "tensor" else (a,)
                    grads = torch.autograd.grad(getattr(ops, op)(a, b).sum(), inputs, create_graph=True)
                    backward(sum(g.sum() for g in grads))
                    # Without a graph, both gradients in one pass (<op>_gradients).
                    torch.autograd.grad(getattr(ops, op)(a, b).sum(), inputs)
                found.append((f"{op} {dtype} {other}", binary_call))
        for loss in ("bce_with_logits", "bce", "kl_div", "kl_div_log", "focal"):
            # 'none': the unreduced loss; 'sum': pointwise_loss_sum and a 0-d upstream gradient.
            for reduction in ("none", "sum"):
                def loss_call(loss=loss, dtype=dtype, reduction=reduction):
                    x = (torch.rand(300) * 0.9 + 0.05).to(dtype).requires_grad_()
                    t = torch.rand(300).to(dtype).requires_grad_()
                    w = torch.rand(300).to(dtype)
                    r = {"reduction": reduction}
                    out = {"bce_with_logits": lambda: ops.binary_cross_entropy_with_logits(
                               x, t, weight=w[0], pos_weight=w, **r),
                           "bce": lambda: ops.binary_cross_entropy(x, t, weight=w, **r),
                           "kl_div": lambda: ops.kl_div(x, t, **r),
                           "kl_div_log": lambda: ops.kl_div(x, t, log_target=True, **r),
                           "focal": lambda: ops.sigmoid_focal_loss(x, t, gamma=0.5, **r)}[loss]()
                    torch.autograd.grad(out.sum(), (x, t))
                found.append((f"{loss} {dtype} {reduction}", loss_call))
        for n in ([1000] if quick else [5, 40000]):
            for target in ("index", "probabilities"):
                for inner in (1, 3):
                    def ce_call(n=n, dtype=dtype, target=target, inner=inner, masked=False):
                        shape = (4, n, inner) if inner > 1 else (4, n)
                        x = leaf(*shape, dtype=dtype)
                        if target == "index":
                            y = torch.randint(0, n, (4, inner) if inner > 1 else (4,))
                        else:
                            y = torch.softmax(torch.randn(shape), 1).to(dtype).requires_grad_()
                        mask = torch.rand(shape) > 0.3 if masked else None
                        out = ops.cross_entropy(x, y, label_smoothing=0.1, mask=mask)
                        torch.autograd.grad(out, (x, y) if y.is_floating_point() else (x,))
                    found.append((f"cross_entropy {dtype} {n} {target} inner={inner}", ce_call))
                    if inner == 1:  # the mask's strides are arguments: one layout suffices
                        found.append((f"cross_entropy {dtype} {n} {target} masked",
                                      lambda ce_call=ce_call: ce_call(masked=True)))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the compute capability (90: sm_90)")
    parser.add_argument("--quick", action="store_true", help="fewer dtypes and shapes")
    args = parser.parse_args()
    compiler = Compiler(args.arch)
    JITFunction.run = lambda kernel, *a, grid, warmup, **kw: compiler.launch(
        kernel, *a, grid=grid, warmup=warmup, **kw)
    # The launchers refuse CPU tensors for compiled kernels; here nothing is launched.
    common.check_runnable = lambda op, t, kernels: None
    common.KernelSet.check_runnable = lambda self, op, t: None
    torch.cuda.get_device_properties = lambda device=None: type(
        "Properties", (), {"multi_processor_count": 132})()
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    started = time.time()
    errors = []
    for name, call in calls(args.quick):
        try:
            call()
        except Exception:  # a launcher's own failure: reported with the call that made it
            errors.append(f"{name}:\n{traceback.format_exc()}")
    compiled = [t for t in compiler.seen.values() if t is not None]
    print(f"{len(compiler.seen)} kernel variants, {len(compiled)} compiled, "
          f"{len(compiler.failures)} refused, {len(compiler.flushing)} flush subnormals, "
          f"{len(errors)} calls failed, {time.time() - started:.0f} s")
    for failure in compiler.failures + errors:
        print("FAIL", failure, "\n")
    for flushing in compiler.flushing:
        print("FAIL launched without enable_reflect_ftz=False (libdevice flushes subnormals):",
              flushing)
    return 1 if compiler.failures or compiler.flushing or errors else 0


if __name__ == "__main__":
    sys.exit(main())
