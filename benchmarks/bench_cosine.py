"""Benchmark of nanfree's cosine family (cosine_similarity, normalize, cos_sim) against PyTorch.

Two sections, in one run:
  rows     cosine_similarity(x1, x2, dim=-1) of two [rows, d] tensors and
           normalize(x, dim=-1), forward, backward and forward+backward, against torch
           eager (F.cosine_similarity, F.normalize) and torch.compile of the same
           expression; GB/s counts the minimum bytes (cosine_similarity forward: read
           x1 and x2, write one value per row; backward: read x1, x2 and dy, write dx1
           and dx2; normalize forward: read x, write y; backward: read x (or y) and dy,
           write dx). Eager is timed cheaply where one call is slow (no target
           depends on it: see bench_common.fastest_alternating);
  cos_sim  cos_sim(a, b), the [N, M] matrix of cosine similarities of the rows of a
           [N, d] and b [M, d], against F.normalize(a, dim=1) @ F.normalize(b, dim=1).T
           eager and compiled, and against a bare a @ b.T of the same shape (nf/mat =
           nanfree time / matmul time, in the same direction); TFLOP/s counts the GEMMs'
           FLOPs: 2*N*M*d forward, 4*N*M*d backward (two GEMMs), 6*N*M*d both. At
           least 5 rounds (a CPU call is long, so a round holds few calls).
Ratios are baseline time / nanfree time (above 1: nanfree faster). Writes
benchmarks/results/<machine>/cosine.{csv,png,md}.

    python benchmarks/bench_cosine.py            # default (about 1.5-2 min on 2 CPU cores)
    python benchmarks/bench_cosine.py --full     # full sweep: 3 dtypes, d 64-4096, inputs of
                                                 # 4-256 MB (16 MB-1 GB on a GPU)
    python benchmarks/bench_cosine.py --quick    # smoke run (seconds)

The default CPU run times the issue's two CPU targets ([65536, 384] float32 rows;
cos_sim of [4096, 384] x [4096, 384] float32) and rows of [4096, 768] in float32 and
bfloat16; on a GPU, bfloat16 rows of [65536, 768], [262144, 768], [65536, 4096] and
cos_sim of [16384, 768] x [16384, 768].
"""

import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import nanfree  # noqa: E402
import nanfree.ops as nf  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROW_OPS = ("cosine_similarity", "normalize")

# The targets' shapes (DESIGN.md section 2; the issue's targets).
CPU_ROWS_TARGET = ("float32", 65536, 384)        # cosine_similarity fwd+bwd >= torch.compile
CPU_COS_SIM_TARGET = ("float32", 4096, 4096, 384)  # cos_sim fwd+bwd >= the composed eager version


# --- what to measure -------------------------------------------------------------------

def rows_sweep(bench):
    """[(dtype, rows, d)] and the directions also timed against torch.compile."""
    if bench.mode == "quick":
        return [("float32", 512, 64), ("float32", 64, 768)], ["forward+backward"]
    if bench.mode == "full":  # every dtype, d from 64 to 4096, tensors (each input) of 4 MB to 256 MB
        sizes = [16 * bc.MB, 64 * bc.MB, 256 * bc.MB, 1024 * bc.MB] if bench.cuda else \
            [4 * bc.MB, 64 * bc.MB, 256 * bc.MB]
        return [(dt, s // DTYPES[dt].itemsize // d, d) for dt in DTYPES for s in sizes
                for d in (64, 384, 768, 4096)], bc.DIRECTIONS
    if bench.cuda:  # bfloat16 tensors of 96 MB and larger
        return [("bfloat16", 65536, 768), ("bfloat16", 262144, 768), ("bfloat16", 65536, 4096)], bc.DIRECTIONS
    # the target shape (96 MB per input, past the 32 MB last-level cache), a 12 MB one,
    # and bfloat16 at d = 768 (6 MB)
    return [CPU_ROWS_TARGET, ("float32", 4096, 768), ("bfloat16", 4096, 768)], bc.DIRECTIONS


def cos_sim_sweep(bench):
    """[(dtype, N, M, d)], the directions and those also timed against torch.compile."""
    if bench.mode == "quick":
        return [("float32", 256, 256, 64)], ["forward", "forward+backward"], ["forward+backward"]
    if bench.cuda:
        if bench.mode == "full":
            shapes = [(dt, n, n, d) for dt in DTYPES for n, d in
                      ((16384, 256), (8192, 768), (16384, 768), (16384, 4096))]
            return shapes, bc.DIRECTIONS, bc.DIRECTIONS
        return [("bfloat16", 16384, 16384, 768)], bc.DIRECTIONS, bc.DIRECTIONS
    if bench.mode == "full":
        shapes = [(dt, n, n, d) for dt in ("float32", "bfloat16") for n, d in ((4096, 384), (8192, 768))]
        return shapes, bc.DIRECTIONS, bc.DIRECTIONS
    return [CPU_COS_SIM_TARGET], ["forward", "forward+backward"], ["forward", "forward+backward"]


# --- rows ------------------------------------------------------------------------------

def row_expressions(op):
    """(nanfree, torch) functions: the same result over the last dim."""
    if op == "cosine_similarity":
        return (lambda x1, x2: nf.cosine_similarity(x1, x2, dim=-1)), \
            (lambda x1, x2: F.cosine_similarity(x1, x2, dim=-1))
    return (lambda x: nf.normalize(x, dim=-1)), (lambda x: F.normalize(x, dim=-1))


def row_bytes(op, rows, d, itemsize):
    """Minimum bytes per direction (see the module's docstring)."""
    vectors, values = rows * d * itemsize, rows * itemsize
    if op == "cosine_similarity":
        forward, backward = 2 * vectors + values, 4 * vectors + values
    else:
        forward, backward = 2 * vectors, 3 * vectors
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}


def bench_rows(bench):
    shapes, compile_directions = rows_sweep(bench)
    bench.section("rows: cosine_similarity and normalize over the last dim of [rows, d] (times in ms)",
                  f"{'op':<18}{'dtype':<10}{'rows':>8}{'d':>6}  {'direction':<18}")
    for dtype, rows, d in shapes:
        bench.compiler.reset()
        gen = torch.Generator(device=bench.device).manual_seed(0)
        x1 = torch.randn(rows, d, device=bench.device, generator=gen).to(DTYPES[dtype])
        x2 = torch.randn(rows, d, device=bench.device, generator=gen).to(DTYPES[dtype])
        for op in ROW_OPS:
            ours, theirs = row_expressions(op)
            compiled = bench.compiler(theirs)
            inputs = (x1, x2) if op == "cosine_similarity" else (x1,)
            nbytes = row_bytes(op, rows, d, x1.element_size())
            fields = dict(section="rows", op=op, dtype=dtype, shape=f"{rows}x{d}", rows=rows, d=d,
                          mbytes=x1.numel() * x1.element_size() / bc.MB)
            for direction in bc.DIRECTIONS:
                fns = {"nanfree": ours, "torch": theirs,
                       "compile": compiled if direction in compile_directions else None}
                bench.compare(fields, f"{op:<18}{dtype:<10}{rows:>8}{d:>6}  {direction:<18}", fns, inputs,
                              direction, nbytes[direction], cheap=("torch",))
        del x1, x2


# --- cos_sim ---------------------------------------------------------------------------

def composed_cos_sim(a, b):
    return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T


def bare_matmul(a, b):
    return a @ b.T


def cos_sim_flops(n, m, d):
    forward = 2 * n * m * d
    return {"forward": forward, "backward": 2 * forward, "forward+backward": 3 * forward}


def bench_cos_sim(bench):
    shapes, directions, compile_directions = cos_sim_sweep(bench)
    # A call is long (a CPU GEMM: a quarter of a second), so a round holds few
    # of them: at least five rounds, for the fastest call to be a quiet one.
    rounds = bench.rounds if bench.mode == "quick" else max(bench.rounds, 5)
    bench.section("cos_sim: [N, d] x [M, d] -> [N, M] (times in ms; nf/mat = nanfree time / a @ b.T time)",
                  f"{'dtype':<10}{'N':>7}{'M':>7}{'d':>6}  {'direction':<18}", rate="TFLOP/s", extra=("matmul",))
    for dtype, n, m, d in shapes:
        bench.compiler.reset()
        gen = torch.Generator(device=bench.device).manual_seed(0)
        a = torch.randn(n, d, device=bench.device, generator=gen).to(DTYPES[dtype])
        b = torch.randn(m, d, device=bench.device, generator=gen).to(DTYPES[dtype])
        compiled = bench.compiler(composed_cos_sim)
        flops = cos_sim_flops(n, m, d)
        fields = dict(section="cos_sim", op="cos_sim", dtype=dtype, shape=f"{n}x{d} @ {m}x{d}", rows=n,
                      d=d, N=n, M=m, mbytes=a.numel() * a.element_size() / bc.MB)
        for direction in directions:
            fns = {"nanfree": nf.cos_sim, "torch": composed_cos_sim,
                   "compile": compiled if direction in compile_directions else None, "matmul": bare_matmul}
            bench.compare(fields, f"{dtype:<10}{n:>7}{m:>7}{d:>6}  {direction:<18}", fns, (a, b), direction,
                          None, flops=flops[direction], rounds=rounds)
        del a, b


# --- summary and picture ---------------------------------------------------------------

def times_line(r):
    """One record's times: nanfree, torch eager, torch.compile and (cos_sim) the bare matmul."""
    line = (f"  {r['op']:<17} {r['dtype']:<9} {r['shape']:<22} {r['direction']:<17} nanfree {r['nanfree_ms']:.4g}, "
            f"torch {r['torch_ms']:.4g} ({r['ratio']:.2f}x)")
    if r.get("compile_ms") is not None:
        line += f", compile {r['compile_ms']:.4g} ({r['ratio_compile']:.2f}x)"
    if r.get("matmul_ms") is not None:
        line += f", a @ b.T {r['matmul_ms']:.4g} (nanfree / matmul {r['nanfree_over_matmul']:.2f})"
    return line


def summary(bench):
    rows, cos = (bc.select(bench.records, section=name) for name in ("rows", "cos_sim"))
    lines = bc.geomean_table(rows, ("op", "direction"), "Geometric-mean ratio, rows section "
                             "(baseline time / nanfree time; above 1 = nanfree faster):")
    lines += bc.geomean_table(cos, ("op", "direction"), "cos_sim (baseline: the composed "
                              "F.normalize(a) @ F.normalize(b).T):")
    if cos:
        lines.append("cos_sim against a bare a @ b.T of the same shape (nanfree time / matmul time):")
        lines += [f"  {r['dtype']:<9} {r['shape']:<22} {r['direction']:<17} {r['nanfree_over_matmul']:.3f}x, "
                  f"{r['tflops']:.3g} TFLOP/s" for r in cos if r.get("nanfree_over_matmul") is not None]
    if bench.cuda:  # the shapes: rows of [65536, 768] and cos_sim of [16384, 768], bfloat16
        shown = [r for r in rows if (r["dtype"], r["rows"], r["d"]) == ("bfloat16", 65536, 768)]
        shown += [r for r in cos if (r["dtype"], r["N"], r["d"]) == ("bfloat16", 16384, 768)]
    else:
        shown = [r for r in rows if (r["dtype"], r["rows"], r["d"]) == CPU_ROWS_TARGET]
        shown += [r for r in cos if (r["dtype"], r["N"], r["M"], r["d"]) == CPU_COS_SIM_TARGET]
    if shown:
        lines.append("Times at the targets' shapes (ms; ratio = baseline time / nanfree time):")
        lines += [times_line(r) for r in shown]
    lines += ["", f"Targets ({bench.device}):"]
    target = functools.partial(bc.target, describe_keys=("op", "dtype", "shape", "direction"))
    if bench.cuda:
        big = [r for r in rows if r["direction"] in ("forward", "forward+backward") and r["mbytes"] >= 64]
        lines += [
            target("GPU row-wise forward and forward+backward >= 90% of copy bandwidth (tensors >= 64 MB)",
                   big, key="copy_fraction", at_least=0.9),
            target("GPU row-wise forward and forward+backward ahead of torch.compile (tensors >= 64 MB)",
                   big, key="ratio_compile", at_least=1.0),
            target("GPU cos_sim <= 1.03x the bare matmul time, d >= 256 (nanfree / matmul)",
                   [r for r in cos if r["d"] >= 256], key="nanfree_over_matmul", at_most=1.03),
        ]
    else:
        dtype, n_rows, d = CPU_ROWS_TARGET
        dt, n, m, dd = CPU_COS_SIM_TARGET
        lines += [
            target(f"CPU cosine_similarity forward+backward at [{n_rows}, {d}] {dtype} >= torch.compile's speed",
                   bc.select(rows, op="cosine_similarity", direction="forward+backward", dtype=dtype,
                             rows=n_rows, d=d), key="ratio_compile", at_least=1.0),
            target(f"CPU cos_sim forward+backward at [{n}, {dd}] x [{m}, {dd}] {dt} >= the composed eager "
                   f"version's speed", bc.select(cos, direction="forward+backward", dtype=dt, N=n, M=m, d=dd),
                   at_least=1.0),
        ]
    lines.append(f"  torch.compile baseline: {bench.compiler.reason or 'measured'}")
    return lines


def plot(bench):
    def draw(records, path):
        fwbw = bc.select(records, direction="forward+backward")
        return fwbw and bc.plot_ratios(
            fwbw, path, f"nanfree cosine family, forward+backward, on {bench.machine} ({bench.mode} run)",
            copy_gbs=bench.copy_gbs if bench.cuda else None, x_key="d", line_keys=("dtype",),
            show_rate=bench.cuda, x_label="vector length d, log scale")
    return draw


def main(argv=None):
    parser = bc.parser(__doc__.splitlines()[0])
    parser.add_argument("--sections", default="rows,cos_sim", help="comma-separated subset of rows,cos_sim")
    args = parser.parse_args(argv)
    missing = [name for name in (*ROW_OPS, "cos_sim") if not hasattr(nf, name)]
    if missing:
        raise SystemExit(f"nanfree.ops has no {', '.join(missing)}: this build of nanfree predates the "
                         f"cosine family (rebuild it: bash scripts/setup.sh)")
    bench = bc.Bench(args, "cosine")
    info = nanfree.backend_info()["ops"].get("cosine", {})
    bench.note(f"nanfree backend: {info.get(torch.device(bench.device).type, 'not reported')}")
    sections = args.sections.split(",")
    for name, run in (("rows", bench_rows), ("cos_sim", bench_cos_sim)):
        if name in sections:
            run(bench)
    bench.finish(summary(bench), plot(bench))


if __name__ == "__main__":
    sys.exit(main())
