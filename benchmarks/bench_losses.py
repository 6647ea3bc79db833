"""Benchmark of nanfree's losses against PyTorch: cross_entropy (class indices,
plain and with label smoothing and a class mask), binary_cross_entropy_with_logits,
sigmoid_focal_loss and kl_div, each forward+backward (and forward alone for
cross entropy) with reduction 'mean', against torch eager and torch.compile of
the same expression:
  cross_entropy   F.cross_entropy(x, y)
  ce smoothed     with label_smoothing=0.1 and a mask (30% of the classes dropped
                  per row): nanfree's mask= against the composed masked expression
                  (log_softmax of x.masked_fill(~mask, -inf), the target's term and
                  the smoothing term over the kept classes; F.cross_entropy itself
                  returns inf there)
  bce_logits      F.binary_cross_entropy_with_logits(x, t)
  focal           torchvision's sigmoid_focal_loss, written out (torchvision is not
                  a dependency), reduction 'mean'
  kl_div          F.kl_div(log-probabilities, probabilities, reduction='batchmean')
A latency section times each loss per call on a small batch ([32, 10] float32, the
losses' C++ entry points' case), forward and forward+backward, against torch eager.
GB/s counts the minimum bytes: forward reads the logits (and a probability target),
backward reads them again and writes their gradient. Ratios are baseline time /
nanfree time (above 1: nanfree faster). Writes
benchmarks/results/<machine>/losses.{csv,png,md}.

    python benchmarks/bench_losses.py            # default (about 3 minutes on 2 CPU cores)
    python benchmarks/bench_losses.py --full     # also float16, and the masked case in bfloat16
    python benchmarks/bench_losses.py --quick    # smoke run (seconds)

The issue's CPU targets: cross entropy forward+backward at [8192, 32000] and
[32768, 1000] in float32 and bfloat16 at least torch eager's speed and 0.9x
torch.compile's; with label smoothing and a mask at least 1.3x the composed masked
expression; BCE and focal at least torch eager's. On a GPU: at least 85% of copy
bandwidth at [8192, 32000] bfloat16. Per call on a small batch, on the CPU: at most
1.5x torch's time (the softmax family's small-tensor target).
"""

import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import nanfree.ops as nf  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CE_SHAPES = ((8192, 32000), (32768, 1000))
POINTWISE_SIZES = (4 * 2**20, 32 * 2**20)


def sweep(bench):
    """[(loss, dtype, shape, directions)]."""
    if bench.mode == "quick":
        return [("cross_entropy", "float32", (64, 1000), ["forward+backward"]),
                ("ce smoothed", "float32", (64, 1000), ["forward+backward"]),
                ("bce_logits", "float32", (4096,), ["forward+backward"]),
                ("focal", "float32", (4096,), ["forward+backward"]),
                ("kl_div", "float32", (64, 1000), ["forward+backward"])]
    dtypes = list(DTYPES) if bench.mode == "full" else ["float32", "bfloat16"]
    both = ["forward", "forward+backward"]
    cases = [("cross_entropy", dt, shape, both) for shape in CE_SHAPES for dt in dtypes]
    # The masked rows take the class-by-class path (seconds a call): bfloat16 in --full only.
    cases += [("ce smoothed", dt, CE_SHAPES[0], ["forward+backward"])
              for dt in (dtypes if bench.mode == "full" else ["float32"])]
    for loss in ("bce_logits", "focal"):
        cases += [(loss, dt, (n,), ["forward+backward"]) for n in POINTWISE_SIZES for dt in dtypes]
    cases += [("kl_div", "float32", (8192, 1000), ["forward+backward"])]
    return cases


def masked_composition(x, y, mask, eps=0.1):
    """Label-smoothed cross entropy over the kept classes, composed from torch ops."""
    lp = torch.log_softmax(x.masked_fill(~mask, -torch.inf), -1)
    nll = -lp.gather(1, y[:, None]).squeeze(1)
    smooth = -lp.masked_fill(~mask, 0.0).sum(-1) / mask.sum(-1)
    return ((1 - eps) * nll + eps * smooth).mean()


def torchvision_focal(x, t, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    p_t = p * t + (1 - p) * (1 - t)
    loss = ce * ((1 - p_t) ** gamma)
    return ((alpha * t + (1 - alpha) * (1 - t)) * loss).mean()


def expressions(loss):
    """(nanfree, torch) functions of (x, *args)."""
    return {
        "cross_entropy": (lambda x, y: nf.cross_entropy(x, y), lambda x, y: F.cross_entropy(x, y)),
        "ce smoothed": (lambda x, y, m: nf.cross_entropy(x, y, label_smoothing=0.1, mask=m),
                        masked_composition),
        "bce_logits": (nf.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits),
        "focal": (lambda x, t: nf.sigmoid_focal_loss(x, t, reduction="mean"), torchvision_focal),
        "kl_div": (lambda x, t: nf.kl_div(x, t, reduction="batchmean"),
                   lambda x, t: F.kl_div(x, t, reduction="batchmean")),
    }[loss]


def make_inputs(bench, loss, dtype, shape):
    gen = torch.Generator(device=bench.device).manual_seed(0)
    dt = DTYPES[dtype]
    dev = bench.device
    x = (torch.randn(shape, device=dev, generator=gen) * 2).to(dt)
    if loss in ("cross_entropy", "ce smoothed"):
        n, c = shape
        if loss == "cross_entropy":
            return x, (torch.randint(0, c, (n,), device=dev, generator=gen),)
        mask = torch.rand(shape, device=dev, generator=gen) > 0.3
        mask[:, 0] = True
        y = torch.zeros(n, dtype=torch.long, device=dev)  # class 0 is always kept
        return x, (y, mask)
    if loss == "kl_div":
        x = torch.log_softmax(x.float(), -1).to(dt)
        return x, (torch.softmax(torch.randn(shape, device=dev, generator=gen), -1).to(dt),)
    return x, ((torch.rand(shape, device=dev, generator=gen) > 0.5).to(dt),)


def min_bytes(x, args):
    x_bytes = x.numel() * x.element_size()
    extra = sum(a.numel() * a.element_size() for a in args)
    forward = x_bytes + extra
    backward = 2 * x_bytes + extra
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}


def shape_text(shape):
    return "x".join(map(str, shape))


def bench_cases(bench):
    bench.section("losses, reduction mean (times in ms)", f"{'loss':<15}{'dtype':<10}{'shape':<12}  {'direction':<18}")
    for loss, dtype, shape, directions in sweep(bench):
        bench.compiler.reset()
        x, args = make_inputs(bench, loss, dtype, shape)
        ours, theirs = expressions(loss)
        compiled = bench.compiler(theirs)
        nbytes = min_bytes(x, args)
        fields = dict(section="losses", op=loss, dtype=dtype, shape=shape_text(shape),
                      cols=shape[-1], mbytes=float(f"{x.numel() * x.element_size() / bc.MB:.3g}"))
        for direction in directions:
            fns = {"nanfree": ours, "torch": theirs, "compile": compiled}
            bench.compare(fields, f"{loss:<15}{dtype:<10}{shape_text(shape):<12}  {direction:<18}",
                          fns, (x,), direction, nbytes[direction], args=args, cheap=("torch",))
        del x, args


def bench_latency(bench):
    calls, blocks, rounds = (100, 2, 2) if bench.mode == "quick" else (200, 10, max(bench.rounds, 5))
    bench.section(f"latency: per-call time of a [32, 10] float32 batch; {rounds} alternating rounds "
                  f"of {blocks} blocks of {calls} calls, fastest block (times in us; ratio = torch / "
                  f"nanfree)", f"{'loss':<15}{'direction':<18}")
    for loss in ("cross_entropy", "bce_logits", "focal", "kl_div"):
        x, args = make_inputs(bench, loss, "float32", (32, 10))
        ours, theirs = expressions(loss)
        for direction in ("forward", "forward+backward"):
            fields = dict(section="latency", op=loss, dtype="float32", shape="32x10", cols=10,
                          mbytes=x.numel() * 4 / bc.MB)
            record = bench.compare(fields, f"{loss:<15}{direction:<18}", {"nanfree": ours, "torch": theirs},
                                   (x,), direction, None, args=args, number=calls, min_blocks=blocks,
                                   rounds=rounds, unit="us")
            record["per_call_ratio"] = 1 / record["ratio"]  # nanfree time / torch time


def summary(bench):
    latency = bc.select(bench.records, section="latency")
    records = bc.select(bench.records, section="losses")
    lines = bc.geomean_table(records, ("op", "direction"), "Geometric-mean ratio (baseline time / "
                             "nanfree time; above 1 = nanfree faster):")
    target = functools.partial(bc.target, describe_keys=("op", "dtype", "shape", "direction"))
    fb = bc.select(records, direction="forward+backward")
    ce = [r for r in fb if r["op"] == "cross_entropy"]
    if latency:
        lines.append("Latency, [32, 10] float32, per call (nanfree / torch; below 1 = nanfree faster):")
        lines += [f"  {r['op']:<15} {r['direction']:<17} nanfree {r['nanfree_ms'] * 1e3:6.2f} us, "
                  f"torch {r['torch_ms'] * 1e3:6.2f} us, {r['per_call_ratio']:.2f}x" for r in latency]
    lines += ["", f"Targets ({bench.device}):"]
    if bench.cuda:
        lines.append(target("GPU cross entropy forward+backward >= 85% of copy bandwidth at "
                            "[8192, 32000] bfloat16",
                            bc.select(ce, shape="8192x32000", dtype="bfloat16"),
                            key="copy_fraction", at_least=0.85))
    else:
        lines += [
            target("CPU cross entropy forward+backward >= torch eager", ce, at_least=1.0),
            target("CPU cross entropy forward+backward >= 0.9x torch.compile", ce,
                   key="ratio_compile", at_least=0.9),
            target("CPU label smoothing + mask >= 1.3x the composed masked expression",
                   [r for r in fb if r["op"] == "ce smoothed"], at_least=1.3),
            target("CPU BCE with logits and focal forward+backward >= torch eager",
                   [r for r in fb if r["op"] in ("bce_logits", "focal")], at_least=1.0),
            target("CPU small-batch per-call time <= 1.5x torch's (nanfree / torch)", latency,
                   key="per_call_ratio", at_most=1.5),
        ]
    lines.append(f"  torch.compile baseline: {bench.compiler.reason or 'measured'}")
    return lines


def plot(records, path):
    records = bc.select(records, section="losses")
    return bc.plot_ratios(records, path, "nanfree losses: baseline time / nanfree time",
                          panel_key="op", x_key="mbytes", line_keys=("dtype",), x_label="MB of logits")


def main():
    args = bc.parser(__doc__.splitlines()[0]).parse_args()
    bench = bc.Bench(args, "losses")
    bench_cases(bench)
    bench_latency(bench)
    bench.finish(summary(bench), plot)


if __name__ == "__main__":
    main()
