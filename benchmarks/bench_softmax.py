"""Benchmark of nanfree's softmax family (softmax, log_softmax, logsumexp) against PyTorch.

Three sections, in one run:
  rows       softmax and log_softmax over the last dim, forward, backward and
             forward+backward, plain (baseline torch.softmax) and masked (baseline
             masked_fill + torch.softmax), against torch eager and torch.compile of the
             same expression; GB/s counts the minimum bytes (forward: read x, write y;
             backward: read y and dy, write dx; masked: a 1-byte mask per element,
             read in the forward and, by log_softmax, in the backward);
  inner dim  softmax/log_softmax over dim=1 of [16, 64, 32, 32] and [32, 1000, 7, 7],
             logsumexp over dim=0 of [4096, 4096], plain;
  latency    per-call time of a [4, 8] float32 tensor, forward (no grad) and
             forward+backward, nanfree / torch (below 1: nanfree faster).
Ratios elsewhere are baseline time / nanfree time (above 1: nanfree faster). Writes
benchmarks/results/<machine>/softmax.{csv,png,md}.

    python benchmarks/bench_softmax.py            # default (about 3-4 min on 2 CPU cores)
    python benchmarks/bench_softmax.py --full     # full sweep: 4 MB to 256 MB, 3 dtypes
    python benchmarks/bench_softmax.py --quick    # smoke run (seconds)
"""

import functools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import nanfree  # noqa: E402
import nanfree.ops as nf  # noqa: E402

TORCH = {"softmax": torch.softmax, "log_softmax": torch.log_softmax, "logsumexp": torch.logsumexp}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rows_sweep(bench):
    """[(dtype, rows, cols)] and the directions also timed against torch.compile."""
    if bench.mode == "quick":
        return [("float32", 512, 128), ("float32", 16, 4096)], ["forward+backward"]
    if bench.mode == "full":  # tensors of 4 MB (16 MB on a GPU) to 256 MB, in every dtype
        sizes = [16 * bc.MB, 64 * bc.MB, 256 * bc.MB] if bench.cuda else [4 * bc.MB, 64 * bc.MB, 256 * bc.MB]
        cols = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536] if bench.cuda else \
            [128, 512, 1024, 4096, 16384, 65536]
        return [(d, s // DTYPES[d].itemsize // c, c) for d in DTYPES for s in sizes for c in cols], bc.DIRECTIONS
    if bench.cuda:  # 64 MB tensors
        return [(d, 64 * bc.MB // DTYPES[d].itemsize // c, c) for d in DTYPES
                for c in (128, 1024, 4096, 16384, 65536)], ["forward+backward"]
    # 4 MB tensors (one of rows of 16: a vector each), and one of 64 MB (larger than the last-level cache)
    return [("float32", r, c) for r, c in ((65536, 16), (8192, 128), (1024, 1024), (256, 4096), (16, 65536),
                                            (4096, 4096))], \
        bc.DIRECTIONS


def expressions(op, variant, dim):
    """(nanfree, torch) functions of (x, mask): the same result, mask meaning masked_fill."""
    ours, theirs = getattr(nf, op), TORCH[op]
    if variant == "plain":
        return (lambda x, mask: ours(x, dim)), (lambda x, mask: theirs(x, dim))
    return (lambda x, mask: ours(x, dim, mask=mask)), \
        (lambda x, mask: theirs(x.masked_fill(~mask, -math.inf), dim))


def min_bytes(op, x, out, mask):
    """Minimum bytes per direction. Forward: read x (and the mask), write the output.
    Backward: softmax and log_softmax read y and dy, logsumexp reads x, the output and
    dy; all write dx; log_softmax and logsumexp also read the mask (softmax's y is 0
    where masked, which is enough)."""
    x_bytes, out_bytes = x.numel() * x.element_size(), out.numel() * out.element_size()
    mask_bytes = mask.numel() * mask.element_size() if mask is not None else 0
    forward = x_bytes + mask_bytes + out_bytes
    backward = (2 * out_bytes + x_bytes + (x_bytes if op == "logsumexp" else 0)
                + (mask_bytes if op != "softmax" else 0))
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}


def compare_all(bench, fields, label, op, variant, x, dim, mask, compile_directions):
    ours, theirs = expressions(op, variant, dim)
    compiled = bench.compiler(theirs)
    with torch.no_grad():
        nbytes = min_bytes(op, x, ours(x, mask), mask)
    for direction in bc.DIRECTIONS:
        fns = {"nanfree": ours, "torch": theirs,
               "compile": compiled if direction in compile_directions else None}
        bench.compare(fields, f"{label}{direction:<18}", fns, x, direction, nbytes[direction], args=(mask,))


def bench_rows(bench):
    shapes, compile_directions = rows_sweep(bench)
    bench.section("rows: softmax and log_softmax over the last dim (times in ms)",
                  f"{'op':<12}{'variant':<8}{'dtype':<10}{'rows':>8}{'cols':>7}  {'direction':<18}")
    for dtype, rows, cols in shapes:
        bench.compiler.reset()
        gen = torch.Generator(device=bench.device).manual_seed(0)
        x = torch.randn(rows, cols, device=bench.device, generator=gen).mul_(4).to(DTYPES[dtype])
        lengths = torch.randint(1, cols + 1, (rows, 1), device=bench.device, generator=gen)
        mask = torch.arange(cols, device=bench.device) < lengths  # padding-style mask
        for op in ("softmax", "log_softmax"):
            for variant in ("plain", "masked"):
                fields = dict(section="rows", op=op, variant=variant, dtype=dtype,
                              shape=f"{rows}x{cols}", dim=-1, rows=rows, cols=cols,
                              mbytes=x.numel() * x.element_size() / bc.MB)
                compare_all(bench, fields, f"{op:<12}{variant:<8}{dtype:<10}{rows:>8}{cols:>7}  ", op,
                            variant, x, -1, mask if variant == "masked" else None, compile_directions)
        del x, mask


def bench_inner_dim(bench):
    cases = [("softmax", (16, 64, 32, 32), 1), ("log_softmax", (16, 64, 32, 32), 1),
             ("softmax", (32, 1000, 7, 7), 1), ("log_softmax", (32, 1000, 7, 7), 1),
             ("logsumexp", (4096, 4096), 0)]
    if bench.mode == "quick":
        cases = [("softmax", (4, 64, 8, 8), 1), ("logsumexp", (256, 64), 0)]
    compile_directions = ["forward+backward"] if bench.mode == "quick" else bc.DIRECTIONS
    bench.section("inner dim: a reduction over a dim other than the last, float32 (times in ms)",
                  f"{'op':<12}{'shape':<18}{'dim':>4}  {'direction':<18}")
    for op, shape, dim in cases:
        bench.compiler.reset()
        x = torch.randn(shape, device=bench.device, generator=torch.Generator(bench.device).manual_seed(0)) * 4
        fields = dict(section="inner dim", op=op, variant="plain", dtype="float32",
                      shape="x".join(map(str, shape)), dim=dim, rows=x.numel() // shape[dim], cols=shape[dim],
                      mbytes=x.numel() * 4 / bc.MB)
        compare_all(bench, fields, f"{op:<12}{fields['shape']:<18}{dim:>4}  ", op, "plain", x, dim, None,
                    compile_directions)


def bench_latency(bench):
    calls, blocks, rounds = (100, 2, 2) if bench.mode == "quick" else (200, 10, max(bench.rounds, 5))
    bench.section(f"latency: per-call time of a [4, 8] float32 tensor; {rounds} alternating rounds of "
                  f"{blocks} blocks of {calls} calls, fastest block (times in us; ratio = torch / nanfree)",
                  f"{'op':<12}{'direction':<18}")
    x = torch.randn(4, 8, device=bench.device)
    for op in ("softmax", "log_softmax", "logsumexp"):
        ours, theirs = expressions(op, "plain", -1)
        for direction in ("forward", "forward+backward"):
            fields = dict(section="latency", op=op, variant="plain", dtype="float32", shape="4x8", dim=-1,
                          rows=4, cols=8, mbytes=x.numel() * 4 / bc.MB)
            record = bench.compare(fields, f"{op:<12}{direction:<18}", {"nanfree": ours, "torch": theirs},
                                   x, direction, None, args=(None,), number=calls, min_blocks=blocks,
                                   rounds=rounds, unit="us")
            record["per_call_ratio"] = 1 / record["ratio"]  # nanfree time / torch time


def summary(bench):
    rows, inner, latency = (bc.select(bench.records, section=name) for name in ("rows", "inner dim", "latency"))
    sizes = sorted({r["mbytes"] for r in rows})
    lines = bc.geomean_table(rows, ("variant", "direction"), "Geometric-mean ratio, rows section "
                             "(baseline time / nanfree time; above 1 = nanfree faster):")
    lines += bc.geomean_table(inner, ("op", "direction"), "Inner dim:")
    if latency:
        lines.append("Latency, [4, 8] float32, per call (nanfree / torch; below 1 = nanfree faster):")
        lines += [f"  {r['op']:<12} {r['direction']:<17} nanfree {r['nanfree_ms'] * 1e3:6.2f} us, "
                  f"torch {r['torch_ms'] * 1e3:6.2f} us, {r['per_call_ratio']:.2f}x" for r in latency]
    lines += ["", f"Targets ({bench.device}"
              + (f"; rows section tensors of {', '.join(f'{s:g}' for s in sizes)} MB" if sizes else "") + "):"]
    target = functools.partial(bc.target, describe_keys=("op", "variant", "dtype", "shape", "direction"))
    if bench.cuda:
        lines += [
            target("GPU at least torch's speed everywhere (rows and inner dim)", rows + inner, at_least=1.0),
            target("GPU forward >= 85% of copy bandwidth, rows >= 4096, tensors >= 64 MB",
                   [r for r in bc.select(rows, direction="forward") if r["cols"] >= 4096 and r["mbytes"] >= 64],
                   key="copy_fraction", at_least=0.85),
        ]
    else:
        lines += [
            target("CPU plain forward >= 0.95x torch at every shape",
                   bc.select(rows, variant="plain", direction="forward"), at_least=0.95),
            target("CPU plain backward >= 0.95x torch at every shape",
                   bc.select(rows, variant="plain", direction="backward"), at_least=0.95),
            target("CPU masked forward+backward >= 1.5x masked_fill + torch",
                   bc.select(rows, variant="masked", direction="forward+backward"), at_least=1.5),
            target("CPU inner-dim forward+backward >= 1.0x torch",
                   bc.select(inner, direction="forward+backward"), at_least=1.0),
            target("CPU small-tensor per-call time <= 1.5x torch's (nanfree / torch)", latency,
                   key="per_call_ratio", at_most=1.5),
        ]
    lines.append(f"  torch.compile baseline: {bench.compiler.reason or 'measured'} (informational, no target)")
    return lines


def plot(bench):
    def draw(records, path):
        fwbw = bc.select(records, section="rows", direction="forward+backward")
        return fwbw and bc.plot_ratios(
            fwbw, path, f"nanfree softmax family, forward+backward, on {bench.machine} ({bench.mode} run)",
            copy_gbs=bench.copy_gbs if bench.cuda else None)
    return draw


def main(argv=None):
    parser = bc.parser(__doc__.splitlines()[0])
    parser.add_argument("--sections", default="rows,inner,latency",
                        help="comma-separated subset of rows,inner,latency")
    args = parser.parse_args(argv)
    bench = bc.Bench(args, "softmax")
    bench.note(f"nanfree backend: {nanfree.backend_info()['ops']['softmax'].get(torch.device(bench.device).type)}")
    sections = args.sections.split(",")
    for name, run in (("rows", bench_rows), ("inner", bench_inner_dim), ("latency", bench_latency)):
        if name in sections:
            run(bench)
    bench.finish(summary(bench), plot(bench))


if __name__ == "__main__":
    sys.exit(main())
