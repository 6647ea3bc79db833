"""Checks that need a GPU and are not in the test suite: each op captured in
a CUDA graph and replayed (values equal to an eager call on the new inputs),
the result dtype under CUDA autocast against torch's op, and a
`torch.compile(fullgraph=True)` training step per op (finite, equal to the eager
step), for every family (softmax, cosine, GeM, MNR, elementwise, losses).

Run on a machine with a GPU: ``python3 scripts/gpu_checks.py`` (exit status 1
if any check fails; one line per check); ``--smoke`` only runs every family
forward and backward once (what scripts/gpu_check.sh runs under
compute-sanitizer's racecheck).
"""

import sys

import torch
import torch.nn.functional as F

import nanfree
from nanfree import ops

FAILED = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILED.append(name)


def cases(device):
    """(name, nanfree call, torch call, inputs factory) per family."""
    def rows(*shape):
        return lambda: [torch.randn(*shape, device=device, requires_grad=True)]

    def pair(*shape):
        return lambda: [torch.randn(*shape, device=device, requires_grad=True) for _ in range(2)]

    def pooled():
        return [(torch.rand(8, 64, 7, 7, device=device) + 0.1).requires_grad_()]

    def pooled_ref(x):
        return F.avg_pool2d(x.clamp(min=1e-6).pow(3.0), x.shape[-2:]).pow(1.0 / 3.0)

    def mnr_ref(q, d):
        scores = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T * 20.0
        return F.cross_entropy(scores, torch.arange(len(q), device=q.device))

    return [
        ("softmax", lambda x: ops.softmax(x, -1), lambda x: torch.softmax(x, -1), rows(64, 1000)),
        ("log_softmax", lambda x: ops.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1),
         rows(64, 1000)),
        ("logsumexp", lambda x: ops.logsumexp(x, -1), lambda x: torch.logsumexp(x, -1),
         rows(64, 1000)),
        ("cosine_similarity", ops.cosine_similarity, F.cosine_similarity, pair(128, 384)),
        ("normalize", lambda x: ops.normalize(x, dim=-1), lambda x: F.normalize(x, dim=-1),
         rows(128, 384)),
        ("cos_sim", ops.cos_sim,
         lambda a, b: F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T, pair(128, 384)),
        ("gem_pool2d", lambda x: ops.gem_pool2d(x, 3.0), pooled_ref, pooled),
        ("mnr_loss", ops.mnr_loss, mnr_ref, pair(256, 384)),
    ] + elementwise_cases(device) + losses_cases(device)


def elementwise_cases(device):
    """The ten elementwise ops on inputs inside their domains."""
    def draw(low, high, *shape):
        return (torch.rand(*shape, device=device) * (high - low) + low).requires_grad_()

    positive = lambda: [draw(0.1, 4.0, 256, 513)]  # noqa: E731
    unit = lambda: [draw(-0.9, 0.9, 256, 513)]  # noqa: E731
    two = lambda: [draw(0.1, 4.0, 256, 513), draw(-2.0, 2.0, 256, 513)]  # noqa: E731
    two_positive = lambda: [draw(0.1, 4.0, 256, 513), draw(0.1, 4.0, 256, 513)]  # noqa: E731
    return [
        ("sqrt", ops.sqrt, torch.sqrt, positive),
        ("log", ops.log, torch.log, positive),
        ("log1p", ops.log1p, torch.log1p, positive),
        ("acos", ops.acos, torch.acos, unit),
        ("asin", ops.asin, torch.asin, unit),
        ("pow", ops.pow, torch.pow, two),
        ("atan2", ops.atan2, torch.atan2, two),
        ("div_no_nan", ops.div_no_nan, torch.div, two_positive),
        ("xlogy", ops.xlogy, torch.xlogy, two_positive),
        ("xlog1py", ops.xlog1py, torch.special.xlog1py, two_positive),
    ]


def losses_cases(device):
    """The losses family, each with the torch loss it replaces."""
    def logits():
        return [torch.randn(256, 1000, device=device, requires_grad=True),
                torch.rand(256, 1000, device=device)]

    def probabilities():
        return [torch.rand(256, 1000, device=device).clamp(0.01, 0.99).requires_grad_(),
                torch.rand(256, 1000, device=device)]

    def classes():
        return [torch.randn(256, 1000, device=device, requires_grad=True),
                torch.randint(0, 1000, (256,), device=device)]

    def distributions():
        return [torch.randn(256, 1000, device=device).log_softmax(-1).requires_grad_(),
                torch.randn(256, 1000, device=device).softmax(-1)]

    def focal_ref(x, t):
        p = torch.sigmoid(x)
        ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
        p_t = p * t + (1 - p) * (1 - t)
        return ((0.25 * t + 0.75 * (1 - t)) * ce * (1 - p_t) ** 2).mean()

    return [
        ("binary_cross_entropy", ops.binary_cross_entropy, F.binary_cross_entropy, probabilities),
        ("binary_cross_entropy_with_logits", ops.binary_cross_entropy_with_logits,
         F.binary_cross_entropy_with_logits, logits),
        ("cross_entropy", ops.cross_entropy, F.cross_entropy, classes),
        ("cross_entropy smoothed", lambda x, t: ops.cross_entropy(x, t, label_smoothing=0.1),
         lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), classes),
        ("kl_div", lambda x, t: ops.kl_div(x, t, reduction="batchmean"),
         lambda x, t: F.kl_div(x, t, reduction="batchmean"), distributions),
        ("sigmoid_focal_loss", lambda x, t: ops.sigmoid_focal_loss(x, t, reduction="mean"),
         focal_ref, logits),
    ]


def close(a, b, dtype=torch.float32):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def check_graphs(device):
    for name, fn, _, make in cases(device):
        try:
            inputs = [t.detach() for t in make()]
            static = [t.clone() for t in inputs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the capture, as torch's docs say
                    fn(*static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*static)
            fresh = [t.detach() for t in make()]
            for s, f in zip(static, fresh):
                s.copy_(f)
            graph.replay()
            torch.cuda.synchronize()
            check(f"cuda graph replay {name}", close(out, fn(*fresh)))
        except Exception as error:  # report and go on with the next family
            check(f"cuda graph replay {name}", False, repr(error)[:300])


def check_compiled_steps(device):
    for name, fn, _, make in cases(device):
        try:
            def forward(*xs):  # the compiled part; autograd compiles its backward
                out = fn(*xs)
                return out.float().square().mean() if out.dim() else out

            # One code object compiled per op: without a reset, the ninth op
            # meets dynamo's recompile limit (the first GPU run of the six
            # families: every elementwise and losses step "failed" so).
            torch._dynamo.reset()
            compiled = torch.compile(forward, fullgraph=True)
            inputs = make()
            eager_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
            loss_c = compiled(*inputs)
            loss_c.backward()
            loss_e = forward(*eager_in)
            loss_e.backward()
            grads_ok = all(torch.isfinite(t.grad).all() and close(t.grad, e.grad)
                           for t, e in zip(inputs, eager_in) if t.requires_grad)
            check(f"compiled step {name}", bool(torch.isfinite(loss_c)) and close(loss_c.detach(), loss_e.detach())
                  and grads_ok)
        except Exception as error:
            check(f"compiled step {name}", False, repr(error)[:300])


def result_dtype(fn, inputs):
    """The result's dtype, or the error's type where the call refuses (torch's
    binary_cross_entropy refuses autocast)."""
    try:
        return fn(*inputs).dtype
    except Exception as error:
        return f"raises {type(error).__name__}"


def check_autocast(device):
    for name, fn, ref, make in cases(device):
        for dtype in (torch.float16, torch.bfloat16):
            try:
                inputs = [t.detach() for t in make()]
                with torch.autocast("cuda", dtype=dtype):
                    got, want = result_dtype(fn, inputs), result_dtype(ref, inputs)
                check(f"autocast {name} {dtype}", got == want, f"nanfree {got}, torch {want}")
            except Exception as error:
                check(f"autocast {name} {dtype}", False, repr(error)[:300])


def smoke(device):
    """One forward and backward per family at a narrow and a wide shape, for
    compute-sanitizer (racecheck over the reduction kernels)."""
    for rows, cols in ((33, 1000), (3, 70000)):
        x = torch.randn(rows, cols, device=device, requires_grad=True)
        for fn in (ops.softmax, ops.log_softmax):
            fn(x, -1).square().sum().backward()
        ops.logsumexp(x, -1).sum().backward()
        ops.softmax(x.detach().view(rows, 1, cols).transpose(1, 2).contiguous(), 1)
        y = torch.randn(rows, cols, device=device, requires_grad=True)
        ops.cosine_similarity(x, y).sum().backward()
        ops.normalize(x, dim=-1).sum().backward()
        ops.gem(x.abs(), 3.0, dim=-1).sum().backward()
    a, b = (torch.randn(200, 384, device=device, requires_grad=True) for _ in range(2))
    ops.cos_sim(a, b).sum().backward()
    negatives = torch.randn(200, 2, 384, device=device, requires_grad=True)
    ops.mnr_loss(a, b, negatives, symmetric=True).backward()
    # The warp-per-row cosine and normalize kernels (4096 rows and more).
    a, b = (torch.randn(4096, 768, device=device, requires_grad=True) for _ in range(2))
    ops.cosine_similarity(a, b).sum().backward()
    ops.normalize(a, dim=-1).square().sum().backward()
    # Elementwise (flat kernels) and losses (per-block partial sums, rows of classes).
    x = torch.rand(3, 70001, device=device, requires_grad=True)
    for fn in (ops.sqrt, ops.log, ops.log1p, ops.acos, ops.asin):
        fn(x).sum().backward()
    for fn in (ops.pow, ops.atan2, ops.div_no_nan, ops.xlogy, ops.xlog1py):
        fn(x, x.detach().flip(-1)).sum().backward()
    for rows, cols in ((33, 1000), (3, 70000)):
        z = torch.randn(rows, cols, device=device, requires_grad=True)
        t = torch.rand(rows, cols, device=device)
        ops.binary_cross_entropy_with_logits(z, t).backward()
        ops.binary_cross_entropy(torch.sigmoid(z), t).backward()
        ops.sigmoid_focal_loss(z, t, reduction="sum").backward()
        ops.kl_div(z.log_softmax(-1), t.softmax(-1), reduction="batchmean").backward()
        ops.cross_entropy(z, torch.randint(0, cols, (rows,), device=device),
                          label_smoothing=0.1).backward()
    image = torch.rand(4, 256, 14, 14, device=device, requires_grad=True)
    ops.gem_pool2d(image, torch.tensor(3.0, device=device, requires_grad=True)).sum().backward()
    torch.cuda.synchronize()
    print("smoke: every family ran forward and backward")


def main():
    if not torch.cuda.is_available():
        print("no GPU: nothing checked")
        return 1
    if "--smoke" in sys.argv:
        smoke("cuda")
        return 0
    print(nanfree.backend_info()["ops"]["softmax"]["cuda"], torch.cuda.get_device_name())
    torch.manual_seed(0)
    check_graphs("cuda")
    check_autocast("cuda")
    check_compiled_steps("cuda")  # the slowest (a compilation per family): last
    print(f"{len(FAILED)} failed: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
