"""Benchmark of nanfree's elementwise ops with finite gradients against PyTorch.

Each unary op (sqrt, log, log1p, acos, asin) on a flat tensor, forward and
forward+backward, against three baselines in one run:
  torch        torch's plain op (fast, but NaN or inf gradients at its edges);
  double_where the "double where" workaround users write for a finite gradient
               (``where(ok, op(where(ok, x, safe)), edge value)``, pytorch #4132);
  compile      torch.compile of that workaround.
Each binary op (pow with a tensor exponent and with the exponents 2 and 0.5,
atan2, div_no_nan against torch's `/`, xlogy, xlog1py) likewise, both inputs
requiring grad (for a Python exponent, the base only). Then a compiled "safe
distance" block, ``sqrt(((a - b) ** 2).sum(-1))``, with
nanfree's sqrt against the same with torch's sqrt and with the double where, each
under torch.compile (how much a custom op costs the compiled graph's fusion). And
out= into a preallocated tensor, forward, against torch's op with out= (eager and
compiled).
GB/s counts the minimum bytes: forward reads x and writes y; forward+backward also
reads x and the upstream gradient and writes x's gradient (binary ops: both inputs
read, both gradients written). Ratios are baseline
time / nanfree time (above 1: nanfree faster). Writes
benchmarks/results/<machine>/elementwise.{csv,png,md}.

    python benchmarks/bench_elementwise.py          # default (about three minutes on 2 CPU cores)
    python benchmarks/bench_elementwise.py --full   # every op at 4M and 64M elements (unary: also fp16)
    python benchmarks/bench_elementwise.py --quick  # smoke run (seconds)

The default run: sqrt and log at 4M and 64M elements (64M: 256 MB of float32, past
the last-level cache of most CPUs, not of one with a 480 MiB L3) in float32 and bfloat16, the other unary ops at 4M float32,
pow with a tensor exponent and xlogy also at 4M bfloat16, every binary op at 4M
float32, out= into a preallocated tensor (log1p at 4M and 64M float32, xlogy at 64M
float32 and bfloat16), and the safe-distance block; --full: every binary op at both
sizes in float32 and bfloat16, and out= of sqrt, log1p and xlogy at both sizes in both.
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPS = ("sqrt", "log", "log1p", "acos", "asin")
M = 1 << 20


def double_where(op):
    """The workaround expression: op on a safe stand-in where x is outside the open
    domain, the edge value there (its gradient is then 0 instead of NaN or inf)."""
    if op == "sqrt":
        return lambda x: torch.where(x > 0, torch.sqrt(torch.where(x > 0, x, 1.0)), 0.0)
    if op == "log":
        return lambda x: torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.0)), -math.inf)
    if op == "log1p":
        return lambda x: torch.where(x > -1, torch.log1p(torch.where(x > -1, x, 0.0)), -math.inf)
    fn = getattr(torch, op)
    hi, lo = (0.0, math.pi) if op == "acos" else (math.pi / 2, -math.pi / 2)
    return lambda x: torch.where(x.abs() < 1, fn(torch.where(x.abs() < 1, x, 0.0)),
                                 torch.where(x >= 1, hi, lo))


def sample(op, n, dtype, device):
    """Inputs mostly inside the domain, a few at and beyond its edges."""
    gen = torch.Generator(device=device).manual_seed(0)
    u = torch.rand(n, device=device, generator=gen)
    x = {"sqrt": u * 4 - 0.1, "log": u * 4 - 0.1, "log1p": u * 4 - 1.1,
         "acos": u * 2.2 - 1.1, "asin": u * 2.2 - 1.1}[op]
    return x.to(DTYPES[dtype])


def sweep(bench):
    if bench.mode == "quick":
        return [(op, "float32", 1 << 16) for op in OPS]
    if bench.mode == "full":
        return [(op, dt, n) for op in OPS for dt in DTYPES for n in (4 * M, 64 * M)]
    return ([(op, dt, n) for op in ("sqrt", "log") for dt in ("float32", "bfloat16")
             for n in (4 * M, 64 * M)] + [(op, "float32", 4 * M) for op in ("log1p", "acos", "asin")])


def bench_ops(bench):
    bench.section("unary ops (times in ms; torch: the plain op, compile: the double where compiled)",
                  f"{'op':<7}{'dtype':<10}{'elements':>10}  {'direction':<18}", extra=("double_where",))
    for op, dtype, n in sweep(bench):
        bench.compiler.reset()
        x = sample(op, n, dtype, bench.device)
        workaround = double_where(op)
        fns = {"nanfree": getattr(nf, op), "torch": getattr(torch, op),
               "compile": bench.compiler(workaround), "double_where": workaround}
        size = x.numel() * x.element_size()
        nbytes = {"forward": 2 * size, "forward+backward": 5 * size}
        fields = dict(section="unary", op=op, dtype=dtype, elements=n, mbytes=size / bc.MB)
        for direction in ("forward", "forward+backward"):
            bench.compare(fields, f"{op:<7}{dtype:<10}{n:>10}  {direction:<18}", fns, (x,), direction,
                          nbytes[direction])
        del x


BINARY = ("pow", "pow 2.0", "pow 0.5", "atan2", "div_no_nan", "xlogy", "xlog1py")
TORCH_BINARY = {"pow": torch.pow, "atan2": torch.atan2, "div_no_nan": torch.div,
                "xlogy": torch.xlogy, "xlog1py": torch.special.xlog1py}


def binary_double_where(op):
    """The workaround users write for a finite gradient of each binary op."""
    if op == "pow":
        return lambda a, b: torch.where(a > 0, torch.pow(torch.where(a > 0, a, 1.0), b), 0.0)
    if op == "atan2":
        return torch.atan2  # torch's is finite at the origin already
    if op == "div_no_nan":
        return lambda a, b: torch.where(b != 0, a / torch.where(b != 0, b, 1.0), 0.0)
    if op == "xlogy":
        return lambda a, b: torch.xlogy(a, torch.where(a == 0, 1.0, b))
    return lambda a, b: torch.special.xlog1py(a, torch.where(a == 0, 0.0, b))


def binary_sample(op, n, dtype, device):
    """(a, b) mostly inside the domain, a few at and beyond its edges and zeros."""
    gen = torch.Generator(device=device).manual_seed(0)
    u = torch.rand(n, device=device, generator=gen)
    v = torch.rand(n, device=device, generator=gen)
    a, b = {"pow": (u * 4 - 0.1, v * 4 - 2), "atan2": (u * 4 - 2, v * 4 - 2),
            "div_no_nan": (u * 4 - 2, v * 4 - 2), "xlogy": (u * 4 - 2, v * 4 - 0.1),
            "xlog1py": (u * 4 - 2, v * 4 - 1.1)}[op]
    return a.to(DTYPES[dtype]), b.to(DTYPES[dtype])


def binary_sweep(bench):
    if bench.mode == "quick":
        return [(op, "float32", 1 << 16) for op in BINARY]
    if bench.mode == "full":
        return [(op, dt, n) for op in BINARY for dt in ("float32", "bfloat16") for n in (4 * M, 64 * M)]
    return ([("pow", "float32", 4 * M), ("pow", "bfloat16", 4 * M), ("xlogy", "bfloat16", 4 * M)] +
            [(op, "float32", 4 * M) for op in ("pow 2.0", "pow 0.5", "atan2", "div_no_nan", "xlogy",
                                               "xlog1py")])


def bench_binary(bench):
    bench.section("binary ops (times in ms; torch: the plain op, compile: the double where compiled)",
                  f"{'op':<11}{'dtype':<10}{'elements':>10}  {'direction':<18}",
                  extra=("double_where",))
    for name, dtype, n in binary_sweep(bench):
        bench.compiler.reset()
        op, _, exponent = name.partition(" ")
        a, b = binary_sample(op, n, dtype, bench.device)
        workaround = binary_double_where(op)
        ours, theirs = getattr(nf, op), TORCH_BINARY[op]
        if exponent:  # a Python exponent: the base is the only input
            p = float(exponent)
            fns = {"nanfree": lambda x: ours(x, p), "torch": lambda x: theirs(x, p),
                   "compile": bench.compiler(lambda x: workaround(x, p)),
                   "double_where": lambda x: workaround(x, p)}
            inputs, tensors = (a,), 1
        else:
            fns = {"nanfree": ours, "torch": theirs, "compile": bench.compiler(workaround),
                   "double_where": workaround}
            inputs, tensors = (a, b), 2
        size = a.numel() * a.element_size()
        nbytes = {"forward": (tensors + 1) * size,
                  "forward+backward": (tensors + 1) * size + (2 * tensors + 1) * size}
        fields = dict(section="binary", op=name, dtype=dtype, elements=n, mbytes=size / bc.MB)
        for direction in ("forward", "forward+backward"):
            bench.compare(fields, f"{name:<11}{dtype:<10}{n:>10}  {direction:<18}", fns, inputs,
                          direction, nbytes[direction])
        del a, b


def _count(n):
    return f"{n // M}M" if n >= M else f"{n >> 10}K"


def out_sweep(bench):
    if bench.mode == "quick":
        return [(op, "float32", 1 << 16) for op in ("log1p", "xlogy")]
    if bench.mode == "full":
        return [(op, dt, n) for op in ("sqrt", "log1p", "xlogy") for dt in ("float32", "bfloat16")
                for n in (4 * M, 64 * M)]
    return [("log1p", "float32", 4 * M), ("log1p", "float32", 64 * M), ("xlogy", "float32", 64 * M),
            ("xlogy", "bfloat16", 64 * M)]


def bench_out(bench):
    """out= into a preallocated tensor, forward: nanfree's <op>_out writes into it."""
    bench.section("out= into a preallocated tensor, forward (times in ms; torch: the same op with "
                  "out=, compile: that call compiled)", f"{'op':<7}{'dtype':<10}{'elements':>10}  "
                  f"{'direction':<18}")
    for op, dtype, n in out_sweep(bench):
        bench.compiler.reset()
        if op in OPS:
            inputs = (sample(op, n, dtype, bench.device),)
            ours, theirs = getattr(nf, op), getattr(torch, op)
        else:
            inputs = binary_sample(op, n, dtype, bench.device)
            ours, theirs = getattr(nf, op), TORCH_BINARY[op]
        out = torch.empty_like(inputs[0])
        fns = {"nanfree": lambda *ins: ours(*ins, out=out), "torch": lambda *ins: theirs(*ins, out=out),
               "compile": bench.compiler(lambda *ins: theirs(*ins, out=out))}
        size = out.numel() * out.element_size()
        bench.compare(dict(section="out", op=op, dtype=dtype, elements=n, mbytes=size / bc.MB),
                      f"{op:<7}{dtype:<10}{n:>10}  {'forward':<18}", fns, inputs, "forward",
                      (len(inputs) + 1) * size)
        del inputs, out


def bench_distance(bench):
    """sqrt(((a - b) ** 2).sum(-1)) compiled, with each sqrt: the custom op's cost to fusion."""
    rows, dim = (1024, 16) if bench.mode == "quick" else (1 << 18, 64)
    bench.section(f"compiled safe distance sqrt(((a - b) ** 2).sum(-1)), [{rows}, {dim}] float32 "
                  "(times in ms; torch and compile: torch's sqrt eager and compiled; the extra sides "
                  "compiled)", f"{'block':<30}  {'direction':<18}", extra=("torch_sqrt", "double_where"))
    gen = torch.Generator(device=bench.device).manual_seed(0)
    a = torch.randn(rows, dim, device=bench.device, generator=gen)
    b = torch.randn(rows, dim, device=bench.device, generator=gen)

    def block(sqrt):
        return lambda a, b: sqrt(((a - b) ** 2).sum(-1))

    bench.compiler.reset()
    fns = {"nanfree": bench.compiler(block(nf.sqrt)), "torch": block(torch.sqrt),
           "compile": bench.compiler(block(torch.sqrt)),
           "torch_sqrt": bench.compiler(block(torch.sqrt)),
           "double_where": bench.compiler(block(double_where("sqrt")))}
    fns = {side: fn for side, fn in fns.items() if fn is not None}
    if "compile" not in fns:
        print("  (torch.compile unavailable: the compiled block is not measured)")
        return
    size = a.numel() * a.element_size()
    for direction in ("forward", "forward+backward"):
        bench.compare(dict(section="distance", op="distance", dtype="float32", elements=rows * dim,
                           mbytes=2 * size / bc.MB),
                      f"{'nanfree sqrt, compiled':<30}  {direction:<18}", fns, (a, b), direction,
                      2 * size if direction == "forward" else 4 * size)


def summary(bench):
    records = bc.select(bench.records, section="unary") + bc.select(bench.records, section="binary")
    lines = bc.geomean_table(records, ("dtype", "direction"), "Geometric-mean ratio (baseline time / "
                             "nanfree time; above 1 = nanfree faster):")
    for r in records:
        r["ratio_double_where"] = 1 / r["nanfree_over_double_where"] if r.get(
            "nanfree_over_double_where") else None
    target = functools.partial(bc.target, describe_keys=("op", "dtype", "elements", "direction"))
    fwbw = [r for r in records if r["direction"] == "forward+backward" and r["elements"] >= 4 * M
            and r["dtype"] in ("float32", "bfloat16")]
    fw = [r for r in records if r["direction"] == "forward" and r["elements"] >= 4 * M]
    lines += ["", f"Targets ({bench.device}):",
              target("forward+backward >= 0.9x torch's plain op (4M and 64M, fp32 and bf16)", fwbw,
                     at_least=0.9),
              target("forward+backward >= 2x the double-where workaround", fwbw,
                     key="ratio_double_where", at_least=2.0),
              target("forward >= 0.95x torch's plain op", fw, at_least=0.95)]
    if bench.cuda:
        lines.append(target("GPU >= 90% of copy bandwidth at 64M elements",
                            [r for r in records if r["elements"] >= 64 * M], key="copy_fraction",
                            at_least=0.9))
    outs = bc.select(bench.records, section="out")
    if outs:
        lines.append("out= (torch time / nanfree time, both with out=): " + "; ".join(
            f"{r['op']} {r['dtype']} {_count(r['elements'])} {r['ratio']:.2f}x" for r in outs))
    distance = bc.select(bench.records, section="distance")
    if distance:
        lines.append("Compiled safe distance (ms): " + "; ".join(
            f"{r['direction']}: nanfree sqrt {r['nanfree_ms']:.4g}, torch sqrt "
            f"{r['torch_sqrt_ms']:.4g}, double where {r['double_where_ms']:.4g}" for r in distance))
    lines.append(f"  torch.compile baseline: {bench.compiler.reason or 'measured'}")
    return lines


def plot(bench):
    def draw(records, path):
        rows = bc.select(records, section="unary") + bc.select(records, section="binary")
        return rows and bc.plot_ratios(
            rows, path, f"nanfree elementwise ops on {bench.machine} ({bench.mode} run)",
            copy_gbs=bench.copy_gbs if bench.cuda else None, panel_key="op", x_key="mbytes",
            line_keys=("dtype", "direction"), show_rate=bench.cuda, x_label="input size (MB), log scale")
    return draw


def main(argv=None):
    parser = bc.parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if not hasattr(nf, "sqrt"):
        raise SystemExit("nanfree.ops has no sqrt: this build of nanfree predates the elementwise "
                         "family (rebuild it: bash scripts/setup.sh)")
    bench = bc.Bench(args, "elementwise")
    info = nanfree.backend_info()["ops"].get("elementwise", {})
    bench.note(f"nanfree backend: {info.get(torch.device(bench.device).type, 'not reported')}")
    bench_ops(bench)
    bench_binary(bench)
    bench_out(bench)
    bench_distance(bench)
    bench.finish(summary(bench), plot(bench))


if __name__ == "__main__":
    main()
