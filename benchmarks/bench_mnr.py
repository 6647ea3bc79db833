"""Benchmark of nanfree's fused MNR (InfoNCE) loss, mnr_loss, against the composed loss.

nanfree.ops.mnr_loss(q, p, scale=20.0) (with ``--negatives k``: q, p and k hard negatives
per query, [B, k, d]) against the loss as sentence-transformers' MultipleNegativesRankingLoss
computes it: docs = torch.cat([p, n[:, 0], ..., n[:, k-1]]), scores = cos_sim(q, docs) * 20
(cos_sim: F.normalize of both, then torch.mm), F.cross_entropy(scores, arange(B)); torch
eager and torch.compile of that expression. The embeddings require grad; forward+backward
(torch.autograd.grad of the loss with respect to every embedding) is the main measure,
forward alone is timed too. Ratios are baseline time / nanfree time (above 1: nanfree
faster). TFLOP/s counts nanfree's GEMM-sized products, 2*B*M*d each (M = B*(1+k)
documents): one forward, four forward+backward (the forward one, then the logits
recomputed and the two gradient products). A side that runs out of memory is reported as
"out of memory" and the run goes on.

Peak memory of one forward+backward, beyond the embeddings (created before the
measurement; the figure includes their gradients, which are also reported apart):
  GPU  torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the memory
       allocated before the call, after a warm-up call.
  CPU  there is no allocator statistic: each (side, shape) runs in a fresh subprocess
       (this script with a hidden --probe-memory argument) that creates the embeddings,
       makes a warm-up call (compiling, loading libraries, starting threads), frees its
       result, returns free heap memory to the system (glibc malloc_trim), resets the
       kernel's high-water mark of resident memory (writing "5" to /proc/self/clear_refs)
       and makes the measured call; the figure is VmHWM (peak resident memory) after it
       minus VmRSS before it. The subprocess runs with MALLOC_MMAP_THRESHOLD_=65536, so
       every block of 64 KiB or more is mapped fresh and unmapped when freed: resident
       memory follows the live tensors, and a block that the warm-up call freed cannot be
       reused unseen (under glibc's default, freed blocks below its adaptive threshold, up
       to 32 MiB, stay in the heap, and the figure would count memory no tensor uses).
       Where clear_refs does not reset the mark, the first call of a fresh process is
       measured instead (growth of ru_maxrss: a lower bound, and it includes any one-time
       set-up; the method is printed with the figures).
  torch.compile is measured with its default settings (donated buffers on: the compiled
  backward frees the saved tensors it no longer needs), the harder baseline for memory.

Writes benchmarks/results/<machine>/mnr.{csv,png,md}.

    python benchmarks/bench_mnr.py            # default (about 1.5 min on 2 CPU cores; a few
                                              # minutes more while torch.compile's cache is cold)
    python benchmarks/bench_mnr.py --full     # full sweep: B 256-16384, d 384 and 768,
                                              # float32 and bfloat16 (GPU: B up to 262144,
                                              # float16 too); long
    python benchmarks/bench_mnr.py --quick    # smoke run (B = 256; seconds, plus compiling)

The default CPU run times float32, d = 384, B = 1024 and 4096 (the target row; torch.compile
on forward+backward) and measures peak memory at B = 4096 and 8192 (the memory target);
on a GPU, bfloat16, d = 768, B = 4096 to 262144, time and memory in one sweep.
"""

import argparse
import ctypes
import functools
import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import nanfree  # noqa: E402
import nanfree.ops as nf  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCALE = 20.0  # sentence-transformers' default
GIB = 1 << 30

# The targets. CPU: float32, d = 384; forward+backward at B = 4096 >= 1.2x eager and
# >= torch.compile; peak memory at B = 8192 >= 4x below eager's and torch.compile's.
CPU_TIME_TARGET = ("float32", 4096, 384)
CPU_MEMORY_TARGET = ("float32", 8192, 384)
# GPU: bfloat16, d = 768, forward+backward time <= these multiples of torch.compile's.
GPU_TIME_TARGETS = (("bfloat16", 16384, 768, 1.15), ("bfloat16", 131072, 768, 1.1))
GPU_RUNS_TARGET = ("bfloat16", 262144, 768)  # runs (torch.compile is out of memory on 80 GB)
GPU_EXTRA_MEMORY = 2 * GIB  # peak beyond the embeddings and their gradients, every B
PROBE_TAG = "MNR_MEMORY_PROBE "


# --- what to measure -------------------------------------------------------------------

def time_sweep(bench, args):
    """[(dtype, B, d, directions also timed against torch.compile)]."""
    both = ["forward", "forward+backward"]
    if bench.mode == "quick":
        cases, compiled = [("float32", 256, 384)], ["forward+backward"]
    elif bench.cuda:
        if bench.mode == "full":
            cases = [(dt, b, d) for dt in DTYPES for d in (384, 768)
                     for b in (256, 1024, 4096, 16384, 65536, 131072, 262144)]
        else:
            cases = [("bfloat16", b, 768) for b in (4096, 16384, 65536, 131072, 262144)]
        compiled = both
    elif bench.mode == "full":
        cases = [(dt, b, d) for dt in ("float32", "bfloat16") for d in (384, 768)
                 for b in (256, 1024, 4096, 16384)]
        compiled = both
    else:
        # torch.compile compiles each (shape, grad mode) graph anew, 30-60 s on 2 cores:
        # forward+backward only
        cases, compiled = [("float32", 1024, 384), CPU_TIME_TARGET], ["forward+backward"]
    return [(dt, b, d, compiled) for dt, b, d in select_cases(cases, args)]


def cpu_memory_sweep(bench, args):
    """[(dtype, B, d)] whose CPU peak memory is measured (on a GPU: every timed case)."""
    if bench.mode == "quick":
        cases = [("float32", 256, 384)]
    elif bench.mode == "full":
        cases = [(dt, b, d) for dt in ("float32", "bfloat16") for d in (384, 768)
                 for b in (1024, 4096, 8192, 16384)]
    else:
        cases = [("float32", 4096, 384), CPU_MEMORY_TARGET]
    return select_cases(cases, args)


def select_cases(cases, args):
    """The cases restricted to --dtypes and --dims, with --batch-sizes replacing B."""
    dtypes, dims = args.dtypes.split(","), [int(d) for d in args.dims.split(",")] if args.dims else None
    if args.batch_sizes:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        cases = list(dict.fromkeys((dt, b, d) for dt, _, d in cases for b in sizes))
    return [(dt, b, d) for dt, b, d in cases if dt in dtypes and (dims is None or d in dims)]


# --- the expressions -------------------------------------------------------------------

def ours(q, p, n=None):
    return nf.mnr_loss(q, p, n, scale=SCALE)


def composed(q, p, n=None):
    """sentence-transformers' MultipleNegativesRankingLoss on given embeddings: its cos_sim
    (util.cos_sim: normalize both, torch.mm) times the scale, cross entropy against each
    query's own positive (documents: the positives, then each column of hard negatives)."""
    docs = p if n is None else torch.cat([p, *n.unbind(1)])
    scores = torch.mm(F.normalize(q, p=2, dim=1), F.normalize(docs, p=2, dim=1).transpose(0, 1)) * SCALE
    return F.cross_entropy(scores, torch.arange(q.shape[0], device=q.device))


def make_inputs(device, dtype, b, d, k):
    """(q, p) or (q, p, n): embeddings as an encoder gives them (not normalized), each
    positive near its query, hard negatives [B, k, d] nearer than a random document."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, d, device=device, generator=gen)
    p = q + torch.randn(b, d, device=device, generator=gen)
    inputs = (q, p)
    if k:
        inputs += (q[:, None] + 2 * torch.randn(b, k, d, device=device, generator=gen),)
    return tuple(t.to(DTYPES[dtype]) for t in inputs)


def gemm_flops(b, m, d):
    """{direction: FLOPs of nanfree's GEMM-sized products} (see the module's docstring)."""
    one = 2 * b * m * d
    return {"forward": one, "forward+backward": 4 * one}


def is_oom(exc):
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc) or \
        "not enough memory" in str(exc)


def release(bench):
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()


# --- timing ----------------------------------------------------------------------------

def compare(bench, fields, label, fns, inputs, direction, flops, rounds):
    """Bench.compare for sides that may run out of memory: times ``fns`` ({side: fn or None})
    with bc.fastest_alternating, records a side that runs out of memory as such (time None),
    prints a line, keeps the record."""
    calls, oom = {}, []
    for side, fn in fns.items():
        if fn is None:
            continue
        try:
            calls[side] = bc.direction_call(fn, inputs, direction)
            if bench.cuda or side == "compile":  # compile now, not in a timed call; meet OOM here
                calls[side]()
                bench.sync()
        except Exception as exc:  # noqa: BLE001 -- OOM: reported; compile failure: compile off
            calls.pop(side, None)
            if is_oom(exc):
                oom.append(side)
            elif side == "compile":
                bench.compiler.fail(exc)
            else:
                raise
        if side in oom:  # after the except clause: its traceback no longer holds the tensors
            release(bench)
    best = bc.fastest_alternating(calls, bench.sync, rounds, bench.budget, bench.block,
                                  extra_rounds=bench.extra_rounds) if calls else {}
    del calls
    release(bench)
    ms = {side: best[side] * 1e3 if side in best else None for side in bc.SIDES}
    ours_ms, base, comp = ms["nanfree"], ms["torch"], ms["compile"]
    record = dict(machine=bench.machine, **fields, direction=direction, nanfree_ms=ours_ms, torch_ms=base,
                  compile_ms=comp, ratio=base / ours_ms if base and ours_ms else None,
                  ratio_compile=comp / ours_ms if comp and ours_ms else None,
                  nanfree_over_compile=ours_ms / comp if comp and ours_ms else None,
                  tflops=flops / (ours_ms / 1e3) / 1e12 if ours_ms else None, oom=" ".join(oom))
    bench.records.append(record)
    bench.max_load = max(bench.max_load, os.getloadavg()[0])

    def cell(side, ratio):
        if ms[side] is not None:
            return f"{ms[side]:>10.4g}" + (f"{ratio:>7.2f}" if ratio is not None else f"{'':>7}")
        return f"{'OOM' if side in oom else 'n/a':>10}{'':>7}"

    line = f"{label}{ours_ms:>11.4g}" if ours_ms is not None else f"{label}{'OOM':>11}"
    line += cell("torch", record["ratio"]) + cell("compile", record["ratio_compile"])
    line += f"{record['tflops']:>8.3g}" if record["tflops"] is not None else f"{'':>8}"
    print(f"{line}   [{time.time() - bench.started:.0f}s]", flush=True)
    return record


def case_fields(dtype, b, d, k):
    m = b * (1 + k)
    return dict(dtype=dtype, B=b, d=d, k=k, M=m,
                logits_mb=round(b * m * 4 / bc.MB, 3),  # one [B, M] float32 matrix
                grads_mb=round((b + m) * d * DTYPES[dtype].itemsize / bc.MB, 3))


def bench_times(bench, args):
    rounds = bench.rounds if bench.mode == "quick" or bench.cuda else max(bench.rounds, 5)
    bench.section(f"forward and forward+backward, scale {SCALE}, k = {args.negatives} hard negatives per "
                  f"query (times in ms; TFLOP/s: nanfree's GEMM-sized products)",
                  f"{'dtype':<10}{'B':>8}{'d':>6}  {'direction':<18}", rate="TFLOP/s")
    for dtype, b, d, compile_directions in time_sweep(bench, args):
        bench.compiler.reset()
        inputs = make_inputs(bench.device, dtype, b, d, args.negatives)
        compiled = bench.compiler(composed)
        fields = dict(section="time", **case_fields(dtype, b, d, args.negatives))
        flops = gemm_flops(b, fields["M"], d)
        record = None
        for direction in ("forward", "forward+backward"):
            fns = {"nanfree": ours, "torch": composed,
                   "compile": compiled if direction in compile_directions else None}
            record = compare(bench, fields, f"{dtype:<10}{b:>8}{d:>6}  {direction:<18}", fns, inputs,
                             direction, flops[direction], rounds)
        if not bench.cuda and (dtype, b, d) == CPU_TIME_TARGET:
            print(f"  ^ CPU TARGET ROW: B = {b}, d = {d}, {dtype}, forward+backward: nanfree "
                  f"{record['nanfree_ms']:.4g} ms, eager {record['ratio']:.2f}x (target >= 1.2), torch.compile "
                  + (f"{record['ratio_compile']:.2f}x (target >= 1)" if record["ratio_compile"] else "n/a"),
                  flush=True)
        del inputs, compiled
        release(bench)


# --- peak memory -----------------------------------------------------------------------

def bench_memory(bench, args):
    """Peak memory of each side's forward+backward: on a GPU at every timed case (a side that
    ran out of memory in the timing is not tried again), on a CPU at the memory sweep's."""
    timed = {(r["dtype"], r["B"], r["d"]): r for r in bc.select(bench.records, section="time",
                                                                 direction="forward+backward")}
    cases = list(timed) if bench.cuda else cpu_memory_sweep(bench, args)
    if not cases:
        return
    method = ("torch.cuda.max_memory_allocated, after a warm-up call" if bench.cuda else
              "VmHWM growth of one call after a warm-up call, a fresh subprocess per figure")
    print(f"\n== peak memory of one forward+backward beyond the embeddings (MB; {method}; ratio = baseline "
          f"peak / nanfree peak; extra = nanfree beyond embeddings and gradients; logits = one [B, M] "
          f"float32 matrix)\n{'dtype':<10}{'B':>8}{'d':>6}  {'nanfree':>10}{'torch':>12}{'ratio':>7}"
          f"{'compile':>12}{'ratio':>7}{'extra':>10}{'logits':>10}", flush=True)
    methods = set()
    for dtype, b, d in cases:
        fields = case_fields(dtype, b, d, args.negatives)
        if bench.cuda:
            inputs = make_inputs(bench.device, dtype, b, d, args.negatives)
            oom = timed[(dtype, b, d)]["oom"].split()
            peaks = {side: "out of memory" if side in oom else gpu_memory(bench, side, inputs)
                     for side in bc.SIDES}
            del inputs
            release(bench)
            methods.add("torch.cuda.max_memory_allocated after a warm-up call, minus the memory allocated before")
        else:
            peaks = {side: cpu_memory(bench, side, dtype, b, d, args.negatives, methods) for side in bc.SIDES}
        memory_record(bench, fields, peaks)
    for line in sorted(methods):
        bench.note(f"peak memory method: {line}")


def megabytes(value):
    """A figure in MB, 4 significant digits, no exponent."""
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def memory_record(bench, fields, peaks):
    """Keeps and prints a memory record; ``peaks`` {side: bytes, or a string saying why none}."""
    mb = {side: v / bc.MB if isinstance(v, (int, float)) else None for side, v in peaks.items()}
    ours_mb = mb["nanfree"]
    record = dict(machine=bench.machine, section="memory", **fields, direction="forward+backward",
                  **{f"{side}_peak_mb": mb[side] for side in bc.SIDES},
                  nanfree_extra_mb=ours_mb - fields["grads_mb"] if ours_mb is not None else None,
                  memory_ratio=mb["torch"] / ours_mb if mb["torch"] is not None and ours_mb else None,
                  memory_ratio_compile=mb["compile"] / ours_mb if mb["compile"] is not None and ours_mb else None,
                  **{f"{side}_memory_note": peaks[side] for side in bc.SIDES if mb[side] is None})
    bench.records.append(record)

    def cell(side, width, ratio=None):
        text = f"{megabytes(mb[side]):>{width}}" if mb[side] is not None else \
            f"{'OOM' if peaks[side] == 'out of memory' else 'n/a':>{width}}"
        return text + ("" if side == "nanfree" else f"{ratio:>7.1f}" if ratio is not None else f"{'':>7}")

    extra = record["nanfree_extra_mb"]
    print(f"{fields['dtype']:<10}{fields['B']:>8}{fields['d']:>6}  {cell('nanfree', 10)}"
          + cell("torch", 12, record["memory_ratio"]) + cell("compile", 12, record["memory_ratio_compile"])
          + f"{megabytes(extra) if extra is not None else '':>10}{megabytes(fields['logits_mb']):>10}"
          + f"   [{time.time() - bench.started:.0f}s]", flush=True)
    for side in bc.SIDES:
        if mb[side] is None and peaks[side] not in ("out of memory", "n/a"):
            print(f"    {side}: {peaks[side]}", flush=True)
    return record


def gpu_memory(bench, side, inputs):
    """Bytes of one forward+backward's peak beyond what is allocated before it, or why none;
    torch.compile recompiled with its default settings (donated buffers on)."""
    if side == "compile" and bench.compiler.reason:
        return bench.compiler.reason
    import torch._functorch.config as functorch_config
    try:
        with functorch_config.patch(donated_buffer=True):
            if side == "compile":
                bench.compiler.reset()
                fn = bench.compiler(composed)
            else:
                fn = ours if side == "nanfree" else composed
            peak = gpu_peak(bench, fn, inputs)
    except Exception as exc:  # noqa: BLE001 -- OOM or a compile failure: no figure
        if side != "compile" and not is_oom(exc):
            raise
        peak = "out of memory" if is_oom(exc) else f"failed ({type(exc).__name__})"
    release(bench)  # after the except clause: its traceback no longer holds the tensors
    return peak


def gpu_peak(bench, fn, inputs):
    leaves = tuple(t.detach().requires_grad_() for t in inputs)

    def call():
        return torch.autograd.grad(fn(*leaves), leaves)

    return bc.gpu_peak_bytes(bench.device, call)


def cpu_memory(bench, side, dtype, b, d, k, methods):
    """Bytes of one forward+backward's peak resident-memory growth, measured in a fresh
    subprocess (see the module's docstring), or why none; adds the method to ``methods``."""
    if side == "compile" and bench.compiler.reason:
        return bench.compiler.reason
    root = os.path.dirname(os.path.dirname(os.path.abspath(nanfree.__file__)))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    spec = dict(side=side, dtype=dtype, B=b, d=d, k=k, threads=torch.get_num_threads())
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-memory", json.dumps(spec)],
                          env=env, capture_output=True, text=True)
    found = [line for line in proc.stdout.splitlines() if line.startswith(PROBE_TAG)]
    if proc.returncode == 0 and found:
        result = json.loads(found[-1][len(PROBE_TAG):])
        methods.add(result["method"])
        return result["peak_bytes"]
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
    if proc.returncode == -9 or is_oom(RuntimeError(tail)):  # the kernel's OOM killer, or a refused allocation
        return "out of memory"
    return f"probe failed (exit {proc.returncode}: {tail})"


# --- the CPU memory probe (runs in its own process) ------------------------------------

def proc_status(field):
    """Bytes of a /proc/self/status field (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_high_water_mark():
    """Resets VmHWM to the current resident memory; True where that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = proc_status("VmHWM"), proc_status("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 4 * bc.MB  # a few pages moved since


def trim_heap():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def max_rss():
    import resource
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024  # bytes on macOS, KiB on Linux


def probe_memory(spec):
    """Prints PROBE_TAG + {"peak_bytes", "method"}: the resident-memory growth of one
    forward+backward of ``spec``'s side (see the module's docstring)."""
    torch.set_num_threads(spec["threads"])
    can_reset = reset_high_water_mark()
    leaves = tuple(t.requires_grad_() for t in make_inputs("cpu", spec["dtype"], spec["B"], spec["d"], spec["k"]))
    fn = {"nanfree": ours, "torch": composed}.get(spec["side"])
    if fn is None:  # torch.compile with its default settings
        fn = torch.compile(composed, fullgraph=True, dynamic=False)

    def call():
        return torch.autograd.grad(fn(*leaves), leaves)

    if can_reset:
        grads = call()  # warm-up: compiles, loads libraries, starts threads
        del grads
        gc.collect()
        trim_heap()
        before = proc_status("VmRSS")
        reset_high_water_mark()
        grads = call()
        peak = proc_status("VmHWM") - before
        method = ("VmHWM after the call minus VmRSS before it, high-water mark reset after a warm-up call "
                  "(MALLOC_MMAP_THRESHOLD_=65536)")
    else:
        gc.collect()
        before = proc_status("VmRSS") or max_rss()
        grads = call()
        peak = max_rss() - before
        method = "ru_maxrss growth over the first call of a fresh process (a lower bound; includes set-up)"
    del grads
    print(PROBE_TAG + json.dumps(dict(peak_bytes=max(peak, 0), method=method)), flush=True)


# --- summary and picture ---------------------------------------------------------------

def times_line(r):
    def side(name, ratio):
        if r.get(f"{name}_ms") is not None:
            return f"{name} {r[f'{name}_ms']:.4g}" + (f" ({r[ratio]:.2f}x)" if r.get(ratio) else "")
        return f"{name} {'out of memory' if name in r['oom'].split() else 'n/a'}"

    ours_text = f"{r['nanfree_ms']:.4g}" if r["nanfree_ms"] is not None else "out of memory"
    line = (f"  {r['dtype']:<9} B={r['B']:<7} d={r['d']:<4} {r['direction']:<17} nanfree {ours_text}, "
            f"{side('torch', 'ratio')}, {side('compile', 'ratio_compile')}")
    return line + (f"; {r['tflops']:.3g} TFLOP/s" if r.get("tflops") is not None else "")


def memory_line(r):
    def side(name, ratio):
        if r.get(f"{name}_peak_mb") is not None:
            return f"{name} {megabytes(r[f'{name}_peak_mb'])}" + (f" ({r[ratio]:.1f}x)" if r.get(ratio) else "")
        return f"{name} {r.get(f'{name}_memory_note', 'n/a')}"

    line = f"  {r['dtype']:<9} B={r['B']:<7} d={r['d']:<4} {side('nanfree', None)}"
    if r.get("nanfree_extra_mb") is not None:
        line += f" (beyond embeddings and gradients {megabytes(r['nanfree_extra_mb'])})"
    return (line + f", {side('torch', 'memory_ratio')}, {side('compile', 'memory_ratio_compile')}; "
            f"logits {megabytes(r['logits_mb'])}")


def summary(bench):
    times, memory = bc.select(bench.records, section="time"), bc.select(bench.records, section="memory")
    lines = bc.geomean_table([r for r in times if r["ratio"] is not None], ("dtype", "d", "direction"),
                             "Geometric-mean ratio (baseline time / nanfree time; above 1 = nanfree faster; "
                             "cases where eager ran):")
    if times:
        lines.append("Times (ms; ratio = baseline time / nanfree time):")
        lines += [times_line(r) for r in times]
    if memory:
        lines.append("Peak memory of forward+backward beyond the embeddings (MB; ratio = baseline peak / "
                     "nanfree peak; logits = one [B, M] float32 matrix):")
        lines += [memory_line(r) for r in memory]
    lines += ["", f"Targets ({bench.device}):"]
    target = functools.partial(bc.target, describe_keys=("dtype", "B", "d", "direction"))
    fwbw = bc.select(times, direction="forward+backward")
    if bench.cuda:
        for dtype, b, d, most in GPU_TIME_TARGETS:
            lines.append(target(f"GPU forward+backward at B = {b}, d = {d}, {dtype}: time <= {most}x "
                                f"torch.compile's (nanfree / compile)", bc.select(fwbw, dtype=dtype, B=b, d=d),
                                key="nanfree_over_compile", at_most=most))
        lines.append(target(f"GPU peak memory beyond embeddings and gradients < {GPU_EXTRA_MEMORY / GIB:g} GiB "
                            f"(MB)", memory, key="nanfree_extra_mb", at_most=GPU_EXTRA_MEMORY / bc.MB))
        dtype, b, d = GPU_RUNS_TARGET
        rows = bc.select(fwbw, dtype=dtype, B=b, d=d)
        if not rows:
            lines.append(f"  [n/a]    GPU B = {b}, d = {d}, {dtype} runs: not measured in this run")
        else:
            r = rows[0]
            verdict = "[met]   " if r["nanfree_ms"] is not None else "[MISSED]"
            lines.append(f"  {verdict} GPU B = {b}, d = {d}, {dtype} runs: {times_line(r).strip()}")
        rates = [r for r in fwbw if r.get("tflops") is not None]
        if rates:
            best = max(rates, key=lambda r: r["tflops"])
            lines.append(f"  nanfree forward+backward up to {best['tflops']:.3g} TFLOP/s "
                         f"({best['dtype']}, B = {best['B']}, d = {best['d']})")
    else:
        dtype, b, d = CPU_TIME_TARGET
        rows = bc.select(fwbw, dtype=dtype, B=b, d=d)
        mdtype, mb, md = CPU_MEMORY_TARGET
        mem_rows = bc.select(memory, dtype=mdtype, B=mb, d=md)
        lines += [
            target(f"CPU forward+backward at B = {b}, d = {d}, {dtype} >= 1.2x the eager composed loss",
                   rows, key="ratio", at_least=1.2),
            target(f"CPU forward+backward at B = {b}, d = {d}, {dtype} >= torch.compile's speed",
                   rows, key="ratio_compile", at_least=1.0),
            target(f"CPU peak memory at B = {mb}, d = {md}, {mdtype} >= 4x below the eager composed loss's",
                   mem_rows, key="memory_ratio", at_least=4.0),
            target(f"CPU peak memory at B = {mb}, d = {md}, {mdtype} >= 4x below torch.compile's",
                   mem_rows, key="memory_ratio_compile", at_least=4.0),
        ]
    lines.append(f"  torch.compile baseline: {bench.compiler.reason or 'measured'}")
    return lines


def plot(bench):
    """Three panels against B (log scales): forward+backward time per side, its ratios to
    eager and torch.compile, peak memory per side; a colour per (dtype, d), a marker and a
    line style per side."""
    def draw(records, path):
        times = bc.select(records, section="time", direction="forward+backward")
        memory = bc.select(records, section="memory")
        if not times and not memory:
            return False
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        keys = list(dict.fromkeys((r["dtype"], r["d"]) for r in times + memory))
        colors = plt.get_cmap("tab10")
        styles = {"nanfree": ("-", "o"), "torch": ("--", "s"), "compile": (":", "^"),
                  "ratio": ("--", "s"), "ratio_compile": (":", "^")}
        names = {"torch": "eager", "compile": "torch.compile", "ratio": "vs eager", "ratio_compile": "vs compile"}
        fig, axes = plt.subplots(1, 3, figsize=(17, 5.4))
        panels = ((axes[0], times, "{}_ms", bc.SIDES, "forward+backward time (ms)"),
                  (axes[1], times, "{}", ("ratio", "ratio_compile"),
                   "baseline time / nanfree time (above 1: nanfree faster)"),
                  (axes[2], memory, "{}_peak_mb", bc.SIDES, "peak memory of forward+backward beyond the "
                                                            "embeddings (MB)"))
        for ax, rs, field, sides, title in panels:
            for i, key in enumerate(keys):
                for side in sides:
                    pts = sorted((r["B"], r[field.format(side)]) for r in rs if (r["dtype"], r["d"]) == key
                                 and r.get(field.format(side)) is not None)
                    if pts:
                        style, marker = styles[side]
                        ax.plot(*zip(*pts), style, marker=marker, markersize=5, color=colors(i % 10),
                                label=f"{names.get(side, side)} {key[0]} d={key[1]}")
            if ax is axes[1]:
                ax.axhline(1.0, color="grey", linewidth=1)
            xs = sorted({r["B"] for r in rs})
            ax.set_xscale("log", base=2)
            if xs:
                ax.set_xticks(xs, [str(x) for x in xs], fontsize=8)
                if len(xs) == 1:  # one B: a range around it (log scale needs one)
                    ax.set_xlim(xs[0] / 2, xs[0] * 2)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_yscale("log", base=2 if ax is axes[1] else 10)
            if ax is axes[1] and ax.lines:  # powers of 2, and finer ticks over a narrow range
                low, high = ax.get_ylim()
                ticks = [2.0 ** k for k in range(-6, 9)] + ([0.75, 1.25, 1.5, 3, 6] if high / low < 10 else [])
                ticks += [0.8, 0.9, 1.1, 1.2] if high / low < 1.6 else []
                ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(sorted(ticks)))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            else:  # decades, with 2 and 5 times them labelled
                ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
                    lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("batch size B (log scale)", fontsize=8)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.suptitle(f"nanfree mnr_loss vs the composed loss (cos_sim * scale, cross_entropy) on {bench.machine} "
                     f"({bench.mode} run)\nsolid nanfree, dashed eager, dotted torch.compile; a missing point: "
                     f"out of memory", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True
    return draw


def main(argv=None):
    parser = bc.parser(__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated subset of float32,bfloat16,float16 (of the run's sweep)")
    parser.add_argument("--dims", default=None, help="comma-separated subset of the sweep's d")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated B, replacing the sweep's")
    parser.add_argument("--negatives", type=int, default=0, help="hard negatives per query, k (default 0)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--probe-memory", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_memory:
        return probe_memory(json.loads(args.probe_memory))
    unknown = [name for name in args.dtypes.split(",") if name not in DTYPES]
    if unknown or args.negatives < 0:
        parser.error(f"unknown dtype: {', '.join(unknown)}" if unknown else "--negatives must be >= 0")
    if not hasattr(nf, "mnr_loss"):
        raise SystemExit("nanfree.ops has no mnr_loss: this build of nanfree predates the mnr family "
                         "(rebuild it: bash scripts/setup.sh)")
    bench = bc.Bench(args, "mnr")
    info = nanfree.backend_info()["ops"].get("mnr", {})
    bench.note(f"nanfree backend: {info.get(torch.device(bench.device).type, 'not reported')}")
    bench.note(f"scale {SCALE}; k = {args.negatives} hard negatives per query; baseline: "
               f"F.cross_entropy(torch.mm(F.normalize(q), F.normalize(docs).T) * {SCALE}, arange(B)) "
               f"(sentence-transformers' MultipleNegativesRankingLoss); embeddings require grad")
    bench_times(bench, args)
    if not args.no_memory:
        bench_memory(bench, args)
    bench.finish(summary(bench), plot(bench))


if __name__ == "__main__":
    sys.exit(main())
