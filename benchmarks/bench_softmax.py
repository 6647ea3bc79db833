"""Benchmark of nanfree's softmax and log_softmax against PyTorch, in one run.

For each shape, dtype, op and variant it times forward, backward and
forward+backward of nanfree and of the PyTorch baseline (``torch.softmax``, or
``masked_fill`` + ``torch.softmax`` for the masked variant), reports the ratio
(PyTorch time / nanfree time: above 1 means nanfree is faster; each side's
time is the fastest of a few alternating rounds of median timings) and the achieved
bandwidth counting the minimum bytes (forward: read x, write y; backward: read
y and dy, write dx; the masked variant also reads a 1-byte mask per element).

    python benchmarks/bench_softmax.py            # default sweep (a few minutes on 2 cores)
    python benchmarks/bench_softmax.py --full     # full sweep
"""

import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch
import torch.utils.benchmark as benchmark

import nanfree
import nanfree.ops as nf

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full sweep of shapes and dtypes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--csv", default=None, help="where to write the results (CSV)")
    parser.add_argument("--min-run-time", type=float, default=None,
                        help="seconds of timed runs per measurement")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds of nanfree and torch per case; the fastest "
                             "round of each counts, so a burst of load on a shared machine "
                             "does not land on one side only")
    return parser.parse_args(argv)


def sweep(device, full):
    """(rows, cols) pairs and dtypes."""
    if device == "cuda":
        elements = 1 << 26 if full else 1 << 24
        cols = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536] if full else \
            [128, 1024, 4096, 16384, 65536]
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
    else:
        elements = 1 << 22 if full else 1 << 20
        cols = [128, 512, 1024, 4096, 16384, 65536] if full else [128, 1024, 4096, 65536]
        dtypes = [torch.float32, torch.bfloat16, torch.float16] if full else [torch.float32]
    return [(max(1, elements // c), c) for c in cols], dtypes


def masked_baseline(fn):
    def run(x, dim, mask):
        return fn(x.masked_fill(~mask, -math.inf), dim)

    return run


def cases(op):
    torch_fn = {"softmax": torch.softmax, "log_softmax": torch.log_softmax}[op]
    ours = getattr(nf, op)
    return {
        "plain": (lambda x, d, m: ours(x, d), lambda x, d, m: torch_fn(x, d)),
        "masked": (lambda x, d, m: ours(x, d, mask=m), masked_baseline(torch_fn)),
    }


def timed(stmt, min_run_time):
    """Median seconds of one call."""
    timer = benchmark.Timer(stmt="stmt()", globals={"stmt": stmt})
    return timer.blocked_autorange(min_run_time=min_run_time).median


def measure(fn, x, mask, direction, min_run_time):
    x = x.detach().requires_grad_(direction != "forward")
    if direction == "forward":
        with torch.no_grad():
            return timed(lambda: fn(x, -1, mask), min_run_time)
    grad = torch.randn_like(x)
    if direction == "backward":
        out = fn(x, -1, mask)
        return timed(lambda: torch.autograd.grad(out, x, grad, retain_graph=True), min_run_time)
    return timed(lambda: torch.autograd.grad(fn(x, -1, mask), x, grad), min_run_time)


def min_bytes(x, direction, masked):
    size = x.numel() * x.element_size()
    mask_bytes = x.numel() if masked else 0
    forward, backward = 2 * size + mask_bytes, 3 * size
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}[direction]


def copy_bandwidth(device):
    """Measured device copy bandwidth (read + write), GB/s."""
    x = torch.empty(1 << 28 if device == "cuda" else 1 << 24, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    seconds = timed(lambda: y.copy_(x), 0.5)
    return 2 * x.numel() * 4 / seconds / 1e9


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    min_run_time = args.min_run_time or (0.2 if device == "cuda" else 0.1)
    shapes, dtypes = sweep(device, args.full)
    directions = ["forward", "backward", "forward+backward"]
    ops = ["softmax", "log_softmax"]
    total = len(shapes) * len(dtypes) * len(ops) * 2 * len(directions)
    csv_path = args.csv or os.path.join(HERE, "results", f"softmax_{device}.csv")
    os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"nanfree softmax benchmark on {device} ({name}); torch {torch.__version__}")
    print(f"backend: {nanfree.backend_info()['ops']['softmax'][device]}")
    copy_gbs = copy_bandwidth(device)
    print(f"device copy bandwidth: {copy_gbs:.1f} GB/s (read + write)")
    header = f"{'op':<12}{'variant':<8}{'dtype':<10}{'rows':>8}{'cols':>7}  {'direction':<17}" \
             f"{'nanfree ms':>11}{'torch ms':>10}{'ratio':>7}{'GB/s':>9}{'% copy':>8}"
    print(header)
    rows_out = []
    started = time.time()
    step = 0
    for rows, cols in shapes:
        for dtype in dtypes:
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen) * 4
            lengths = torch.randint(1, cols + 1, (rows, 1), device=device, generator=gen)
            mask = torch.arange(cols, device=device) < lengths  # padding-style mask
            for op in ops:
                for variant, (ours, baseline) in cases(op).items():
                    m = mask if variant == "masked" else None
                    for direction in directions:
                        step += 1
                        t_ours, t_torch = math.inf, math.inf
                        for _ in range(args.rounds):
                            t_ours = min(t_ours, measure(ours, x, m, direction, min_run_time))
                            t_torch = min(t_torch, measure(baseline, x, mask, direction, min_run_time))
                        gbs = min_bytes(x, direction, variant == "masked") / t_ours / 1e9
                        record = dict(device=device, op=op, variant=variant, dtype=str(dtype).split(".")[-1],
                                      rows=rows, cols=cols, direction=direction,
                                      nanfree_ms=t_ours * 1e3, torch_ms=t_torch * 1e3,
                                      ratio=t_torch / t_ours, gbs=gbs, copy_fraction=gbs / copy_gbs)
                        rows_out.append(record)
                        print(f"{op:<12}{variant:<8}{record['dtype']:<10}{rows:>8}{cols:>7}  {direction:<17}"
                              f"{record['nanfree_ms']:>11.3f}{record['torch_ms']:>10.3f}"
                              f"{record['ratio']:>7.2f}{gbs:>9.1f}{100 * record['copy_fraction']:>7.0f}%"
                              f"   [{step}/{total}, {time.time() - started:.0f}s]", flush=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    print(f"\nwrote {csv_path}")
    summarize(rows_out, device)


def summarize(records, device):
    print("\nGeometric-mean ratio (torch time / nanfree time; above 1 = nanfree faster):")
    for variant in ("plain", "masked"):
        for direction in ("forward", "backward", "forward+backward"):
            ratios = [r["ratio"] for r in records if r["variant"] == variant and r["direction"] == direction]
            print(f"  {variant:<7} {direction:<17} {math.exp(statistics.fmean(map(math.log, ratios))):.2f}"
                  f"  (min {min(ratios):.2f})")
    print("\nTargets:")
    if device == "cpu":
        for variant, target in (("plain", 0.8), ("masked", 1.3)):
            ratios = [r["ratio"] for r in records if r["variant"] == variant and r["direction"] == "forward+backward"]
            mean = math.exp(statistics.fmean(map(math.log, ratios)))
            verdict = "met" if min(ratios) >= target else "MISSED at some shapes"
            print(f"  CPU {variant} forward+backward >= {target}x torch: geo-mean {mean:.2f}, "
                  f"min {min(ratios):.2f} -> {verdict}")
    else:
        slow = [r for r in records if r["ratio"] < 1.0]
        print(f"  GPU at least torch's speed everywhere: {len(records) - len(slow)}/{len(records)} measurements")
        long_rows = [r for r in records if r["cols"] >= 4096 and r["direction"] == "forward"]
        low = [r for r in long_rows if r["copy_fraction"] < 0.85]
        print(f"  GPU >= 85% of copy bandwidth (forward, rows >= 4096): "
              f"{len(long_rows) - len(low)}/{len(long_rows)} measurements")


if __name__ == "__main__":
    sys.exit(main())
