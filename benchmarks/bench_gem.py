"""Benchmark of nanfree's GeM pooling (gem_pool2d, and gem over tokens with a mask) against PyTorch.

Two layouts, in one run, with p a learnable tensor (shape [1], requiring grad, as
cirtorch keeps it), forward, backward and forward+backward:
  images  gem_pool2d(x, p) of [B, C, H, W] -> [B, C, 1, 1], against cirtorch's
          F.avg_pool2d(x.clamp(min=eps).pow(p), (H, W)).pow(1. / p);
  tokens  gem(x, p, dim=1, mask=am[..., None]) of hidden states [B, L, H] with an
          integer attention mask [B, L] (padding-style: a random length per sequence),
          against the masked mean written as in sentence-transformers' mean pooling
          (see ``token_expressions``);
each against torch eager and torch.compile of the same expression. GB/s counts the
minimum bytes: forward reads the input and writes the output; backward reads the input
and the output's gradient and writes the input's gradient; the tokens' mask adds one
byte per token in each direction; forward+backward is the sum. On a GPU the run also
measures the peak memory of a forward+backward beyond the inputs
(torch.cuda.max_memory_allocated) against the output and the gradients, the issue's
bound (peak no more than input + output + gradients). Ratios are baseline time /
nanfree time (above 1: nanfree faster). Writes benchmarks/results/<machine>/gem.{csv,png,md}.

    python benchmarks/bench_gem.py            # default (about 40 s on 2 CPU cores)
    python benchmarks/bench_gem.py --full     # full sweep: both layouts in float32, bfloat16
                                              # and float16 (and larger shapes)
    python benchmarks/bench_gem.py --quick    # smoke run (seconds)

The default CPU run times the issue's CPU target ([64, 2048, 7, 7] float32,
forward+backward, against torch.compile), tokens [64, 512, 768] float32 with a mask
and [64, 2048, 7, 7] bfloat16; on a GPU, [64, 2048, 7, 7], [64, 2048, 14, 14] and tokens
[64, 512, 768] in float32, bfloat16 and float16.
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
LAYOUTS = ("images", "tokens")
EPS = 1e-6
P0 = 3.0  # cirtorch's initial p

# The issue's CPU target: gem_pool2d forward+backward at least torch.compile's speed.
CPU_TARGET = ("images", "float32", (64, 2048, 7, 7))
# The issue's GPU shapes (its measured H100 figures are at these, bfloat16).
GPU_SHAPES = (("images", (64, 2048, 14, 14)), ("tokens", (64, 512, 768)))


# --- what to measure -------------------------------------------------------------------

def sweep(bench):
    """[(layout, dtype, shape, directions also timed against torch.compile)]."""
    images, tokens = (64, 2048, 7, 7), (64, 512, 768)
    if bench.mode == "quick":
        return [("images", "float32", (4, 64, 7, 7), ["forward+backward"]),
                ("tokens", "float32", (4, 32, 64), ["forward+backward"])]
    if bench.cuda:
        shapes = [("images", images), ("images", (64, 2048, 14, 14)), ("tokens", tokens)]
        if bench.mode == "full":
            shapes += [("images", (256, 2048, 14, 14)), ("tokens", (64, 128, 768)), ("tokens", (256, 512, 1024))]
        return [(layout, dt, shape, bc.DIRECTIONS) for dt in DTYPES for layout, shape in shapes]
    if bench.mode == "full":
        return [(layout, dt, shape, bc.DIRECTIONS) for dt in DTYPES
                for layout, shape in (("images", images), ("tokens", tokens))] + \
            [("images", "float32", (64, 2048, 14, 14), bc.DIRECTIONS)]
    # the target row (25 MB), tokens (96 MB, past the 32 MB last-level cache) and bfloat16
    # images; torch.compile compiles each (shape, grad mode) graph anew, which costs seconds on
    # 2 cores: outside the target row, only forward+backward is compiled
    return [(*CPU_TARGET, bc.DIRECTIONS),
            ("tokens", "float32", tokens, ["forward+backward"]),
            ("images", "bfloat16", images, ["forward+backward"])]


# --- the expressions -------------------------------------------------------------------

def image_expressions():
    """(nanfree, cirtorch) functions of (x, p): [B, C, H, W] -> [B, C, 1, 1]."""
    def ours(x, p):
        return nf.gem_pool2d(x, p, EPS)

    def cirtorch(x, p):  # cirtorch.layers.functional.gem
        return F.avg_pool2d(x.clamp(min=EPS).pow(p), (x.size(-2), x.size(-1))).pow(1. / p)

    return ours, cirtorch


def token_expressions():
    """(nanfree, composed) functions of (x, p, am): [B, L, H] with am [B, L] -> [B, H].

    The composed expression is sentence-transformers' mean pooling (the mask unsqueezed
    to [B, L, 1] and cast to the hidden states' dtype, the masked sum over the tokens
    divided by the count clamped to 1e-9) with GeM's clamp and powers around it. It
    broadcasts the [B, L, 1] mask instead of sentence-transformers'
    ``.expand(x.size()).to(x.dtype)``, which would materialize a full-size mask: the
    faster of the two, so the harder baseline."""
    def ours(x, p, am):
        return nf.gem(x, p, dim=1, mask=am[..., None])

    def composed(x, p, am):
        m = am[..., None].to(x.dtype)
        return ((x.clamp(min=EPS).pow(p) * m).sum(1) / m.sum(1).clamp(min=1e-9)).pow(1. / p)

    return ours, composed


def make_inputs(bench, layout, dtype, shape):
    """(x, p, args): x activations (images: post-ReLU-like, in [0, 1); tokens: signed
    hidden states), p = 3 of shape [1] in x's dtype (a cirtorch model moved to that
    dtype; a float32 p would promote the baseline's powers to float32), args the
    non-differentiated arguments (tokens: an int64 attention mask, 1 then 0 padding)."""
    gen = torch.Generator(device=bench.device).manual_seed(0)
    dt = DTYPES[dtype]
    if layout == "images":
        x = torch.rand(shape, device=bench.device, generator=gen).to(dt)
        args = ()
    else:
        x = torch.randn(shape, device=bench.device, generator=gen).to(dt)
        batch, length = shape[0], shape[1]
        lengths = torch.randint(1, length + 1, (batch, 1), device=bench.device, generator=gen)
        args = ((torch.arange(length, device=bench.device) < lengths).long(),)
    p = torch.full((1,), P0, dtype=dt, device=bench.device)
    return x, p, args


def min_bytes(x, out, args):
    """Minimum bytes per direction (see the module's docstring)."""
    x_bytes, out_bytes = x.numel() * x.element_size(), out.numel() * out.element_size()
    mask_bytes = args[0].numel() if args else 0  # one byte per token
    forward = x_bytes + out_bytes + mask_bytes
    backward = 2 * x_bytes + out_bytes + mask_bytes
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}


def peak_memory(bench, fn, x, p, out, args):
    """Bytes that one forward+backward call allocates at its peak beyond what is allocated
    before it (the inputs and the output's gradient), on a GPU."""
    leaves = (x.detach().requires_grad_(), p.detach().requires_grad_())
    grad = torch.randn(out.shape, dtype=out.dtype, device=out.device,
                       generator=torch.Generator(out.device).manual_seed(1))

    def call():
        return torch.autograd.grad(fn(*leaves, *args), leaves, grad)

    return bc.gpu_peak_bytes(bench.device, call)


def shape_text(shape):
    return "x".join(map(str, shape))


def bench_cases(bench, layouts, dtypes):
    cases = [c for c in sweep(bench) if c[0] in layouts and c[1] in dtypes]
    bench.section("GeM, p a tensor requiring grad (times in ms; images: gem_pool2d vs cirtorch's "
                  "avg_pool2d expression; tokens: gem(dim=1, mask) vs the masked mean)",
                  f"{'layout':<8}{'dtype':<10}{'shape':<17}  {'direction':<18}")
    for layout, dtype, shape, compile_directions in cases:
        bench.compiler.reset()
        x, p, args = make_inputs(bench, layout, dtype, shape)
        ours, theirs = image_expressions() if layout == "images" else token_expressions()
        compiled = bench.compiler(theirs)
        with torch.no_grad():
            out = ours(x, p, *args)
        nbytes = min_bytes(x, out, args)
        is_target = not bench.cuda and (layout, dtype, shape) == CPU_TARGET
        fields = dict(section="gem", layout=layout, dtype=dtype, shape=shape_text(shape),
                      n=shape[2] * shape[3] if layout == "images" else shape[1],
                      mbytes=float(f"{x.numel() * x.element_size() / bc.MB:.3g}"),
                      target="cpu" if is_target else "")
        for direction in bc.DIRECTIONS:
            fns = {"nanfree": ours, "torch": theirs,
                   "compile": compiled if direction in compile_directions else None}
            record = bench.compare(fields, f"{layout:<8}{dtype:<10}{shape_text(shape):<17}  {direction:<18}",
                                   fns, (x, p), direction, nbytes[direction], args=args, cheap=("torch",))
            if is_target and direction == "forward+backward":
                print(f"  ^ CPU TARGET ROW: {shape_text(shape)} {dtype} forward+backward, nanfree "
                      f"{record['nanfree_ms']:.4g} ms vs torch.compile "
                      + (f"{record['compile_ms']:.4g} ms: {record['ratio_compile']:.2f}x (target >= 1)"
                         if record["compile_ms"] else "n/a"), flush=True)
            if bench.cuda and direction == "forward+backward":
                measure_memory(bench, record, fns, x, p, out, args)
        del x, p, args, out
    if not bench.cuda and bench.mode != "quick" and "images" in layouts and "float32" in dtypes:
        bench_float_p(bench)


def bench_float_p(bench):
    """The CPU target shape with p a Python float (3.0, not learnable): torch.compile then
    specializes pow(x, 3.0) into multiplications and has no p gradient to reduce."""
    layout, dtype, shape = CPU_TARGET
    bench.compiler.reset()
    x, _, args = make_inputs(bench, layout, dtype, shape)
    ours, theirs = image_expressions()

    def with_float_p(fn):
        return lambda x: fn(x, P0)

    fns = {"nanfree": with_float_p(ours), "torch": with_float_p(theirs),
           "compile": bench.compiler(with_float_p(theirs))}
    with torch.no_grad():
        out = ours(x, P0)
    nbytes = min_bytes(x, out, args)
    fields = dict(section="gem", layout="images p=3.0", dtype=dtype, shape=shape_text(shape),
                  n=shape[2] * shape[3], mbytes=float(f"{x.numel() * x.element_size() / bc.MB:.3g}"),
                  target="")
    bench.compare(fields, f"{'images, p a Python float 3.0':<35}  {'forward+backward':<18}", fns, (x,),
                  "forward+backward", nbytes["forward+backward"], cheap=("torch",))


def measure_memory(bench, record, fns, x, p, out, args):
    """Adds the peak memory (MB beyond the inputs) of each side's forward+backward to the
    record, with the bound (output + gradients) and nanfree's ratio to input + output +
    gradients; prints a line."""
    bound = out.numel() * out.element_size() + x.numel() * x.element_size() + p.numel() * p.element_size()
    inputs = x.numel() * x.element_size() + p.numel() * p.element_size()
    record["bound_mb"] = bound / bc.MB
    stats = out.numel() * 3 * 4  # the op's saved (m, mean, count) per reduction, float32
    record["stats_mb"] = stats / bc.MB
    line = (f"    peak memory beyond the inputs, forward+backward (MB; output + gradients = {bound / bc.MB:.4g}; "
            f"nanfree's saved statistics {stats / bc.MB:.4g}):")
    for side, fn in fns.items():
        if fn is None:
            continue
        try:
            peak = peak_memory(bench, fn, x, p, out, args)
        except Exception as exc:  # noqa: BLE001 -- a compile failure: no figure
            if side != "compile":
                raise
            print(f"    peak memory of compile: n/a ({type(exc).__name__})")
            continue
        record[f"{side}_peak_mb"] = peak / bc.MB
        line += f" {side} {peak / bc.MB:.4g}"
    if record.get("nanfree_peak_mb") is not None:
        record["memory_ratio"] = (inputs + record["nanfree_peak_mb"] * bc.MB) / (inputs + bound)
        line += f"; nanfree peak / (input + output + gradients) = {record['memory_ratio']:.3f}"
    print(line, flush=True)


# --- summary and picture ---------------------------------------------------------------

def times_line(r):
    line = (f"  {r['layout']:<7} {r['dtype']:<9} {r['shape']:<15} {r['direction']:<17} nanfree "
            f"{r['nanfree_ms']:.4g}, torch {r['torch_ms']:.4g} ({r['ratio']:.2f}x)")
    if r.get("compile_ms") is not None:
        line += f", compile {r['compile_ms']:.4g} ({r['ratio_compile']:.2f}x)"
    if r.get("gbs") is not None:
        line += f"; {r['gbs']:.1f} GB/s, {100 * r['copy_fraction']:.0f}% of copy"
    return line


def summary(bench):
    records = bc.select(bench.records, section="gem")
    lines = bc.geomean_table(records, ("layout", "direction"), "Geometric-mean ratio (baseline time / "
                             "nanfree time; above 1 = nanfree faster):")
    target = functools.partial(bc.target, describe_keys=("layout", "dtype", "shape", "direction"))
    if bench.cuda:
        shown = [r for r in records if (r["layout"], r["shape"]) in
                 {(layout, shape_text(shape)) for layout, shape in GPU_SHAPES}]
        if shown:
            lines.append("Times at the issue's GPU shapes (ms; ratio = baseline time / nanfree time):")
            lines += [times_line(r) for r in shown]
        memory = [r for r in records if r.get("nanfree_peak_mb") is not None]
        if memory:
            lines.append("Peak memory of forward+backward beyond the inputs (MB), against output + gradients:")
            lines += [f"  {r['layout']:<7} {r['dtype']:<9} {r['shape']:<15} bound {r['bound_mb']:.4g}: "
                      + ", ".join(f"{side} {r[f'{side}_peak_mb']:.4g}" for side in bc.SIDES
                                  if r.get(f"{side}_peak_mb") is not None)
                      + f" (nanfree peak / (input + output + gradients) {r['memory_ratio']:.3f})"
                      for r in memory]
        issue = [r for r in shown if r["direction"] in ("forward", "forward+backward")]
        lines += [
            "", f"Targets ({bench.device}):",
            target("GPU forward and forward+backward >= 80% of copy bandwidth at [64, 2048, 14, 14] and "
                   "tokens [64, 512, 768]", issue, key="copy_fraction", at_least=0.8),
            target("GPU forward+backward >= 5x torch.compile at those shapes, bfloat16",
                   bc.select(shown, direction="forward+backward", dtype="bfloat16"),
                   key="ratio_compile", at_least=5.0),
            target("GPU at least torch.compile's speed everywhere", records, key="ratio_compile", at_least=1.0),
            target("GPU peak memory <= input + output + gradients (forward+backward)", memory,
                   key="memory_ratio", at_most=1.0),
        ]
    else:
        layout, dtype, shape = CPU_TARGET
        rows = bc.select(records, target="cpu")
        if rows:
            lines.append(f"CPU TARGET ROW, {layout} {shape_text(shape)} {dtype}, p a tensor requiring grad "
                         f"(ms; ratio = baseline time / nanfree time):")
            lines += [times_line(r) for r in rows]
        lines += [
            "", f"Targets ({bench.device}):",
            target(f"CPU gem_pool2d forward+backward at {list(shape)} {dtype} >= torch.compile's speed",
                   bc.select(rows, direction="forward+backward"), key="ratio_compile", at_least=1.0),
            "  [n/a]    peak memory: measured on a GPU only (torch.cuda.max_memory_allocated)",
        ]
    lines.append(f"  torch.compile baseline: {bench.compiler.reason or 'measured'}")
    return lines


def plot(bench):
    def draw(records, path):
        fwbw = bc.select(records, section="gem", direction="forward+backward")
        return fwbw and bc.plot_ratios(
            fwbw, path, f"nanfree GeM pooling, p a learnable tensor, forward+backward, on {bench.machine} "
            f"({bench.mode} run)", copy_gbs=bench.copy_gbs if bench.cuda else None, panel_key="layout",
            x_key="mbytes", line_keys=("dtype",), show_rate=bench.cuda, x_label="input size (MB), log scale")
    return draw


def main(argv=None):
    parser = bc.parser(__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of images,tokens")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated subset of float32,bfloat16,float16 (of the run's sweep)")
    args = parser.parse_args(argv)
    layouts, dtypes = args.layouts.split(","), args.dtypes.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS] + [name for name in dtypes if name not in DTYPES]
    if unknown:
        parser.error(f"unknown layout or dtype: {', '.join(unknown)}")
    missing = [name for name in ("gem", "gem_pool2d") if not hasattr(nf, name)]
    if missing:
        raise SystemExit(f"nanfree.ops has no {', '.join(missing)}: this build of nanfree predates the "
                         f"gem family (rebuild it: bash scripts/setup.sh)")
    bench = bc.Bench(args, "gem")
    info = nanfree.backend_info()["ops"].get("gem", {})
    bench.note(f"nanfree backend: {info.get(torch.device(bench.device).type, 'not reported')}")
    bench.note(f"p: a [1] tensor = {P0} in the input's dtype, requiring grad; eps = {EPS}; tokens: an int64 "
               f"attention mask, a random length in [1, L] per sequence")
    bench_cases(bench, layouts, dtypes)
    bench.finish(summary(bench), plot(bench))


if __name__ == "__main__":
    sys.exit(main())
