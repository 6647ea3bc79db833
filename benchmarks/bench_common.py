"""Machinery shared by nanfree's benchmarks: command line, timing, CSV, plot, summary.

A family's benchmark (``bench_<family>.py``) builds a :class:`Bench`, calls
:meth:`Bench.compare` once per case with the functions to time (``nanfree``, the
eager PyTorch baseline ``torch`` and, where torch.compile works, ``compile``: the
same PyTorch expression compiled) and the minimum bytes the op must move, then
hands its targets to :meth:`Bench.finish`, which writes
``<out-dir>/<family>.csv``, ``<family>.png`` and ``<family>.md`` and prints the
summary.

Times: the sides are timed in ``--rounds`` alternating rounds (the order of the
sides rotates between rounds, so a burst of load on a shared machine does not land
on one side only; more rounds follow while a round still finds a side >5% faster);
in a round a side runs short blocks of calls (about 1 ms on a CPU) for
``--min-run-time`` seconds; its time is the seconds per call of its fastest block
over all rounds. The fastest block, not the median: on a loaded 2-core machine a
descheduled OpenMP thread stalls a call by a scheduler slice (several ms), which
can land in most blocks of a fast op. torch.compile compiles before any timing.
A case that compares two sides a few percent apart (FiniteGuard's step against the
plain optimizer's) is timed in pairs instead (``paired_steps``: one call of each side
per round, many rounds, each side's median), which the fastest block cannot resolve.
Ratios are baseline time / nanfree time: above 1 means nanfree is faster.
"""

import argparse
import csv
import gc
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DIRECTIONS = ("forward", "backward", "forward+backward")
SIDES = ("nanfree", "torch", "compile")
MB = 1 << 20


# --- command line and output location ------------------------------------------------

def parser(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--full", action="store_true", help="the full sweep (long)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny smoke run (seconds; written under <out-dir>/quick unless --out-dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out-dir", default=None,
                   help="where to write the CSV, PNG and MD (default benchmarks/results/<machine>)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating rounds per case (up to twice as many more while a round still "
                        "makes a side >5%% faster); each side keeps its fastest block")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads on CPU (default: torch's, here %d)" % torch.get_num_threads())
    p.add_argument("--min-run-time", type=float, default=None,
                   help="seconds of timed calls per side and round (default 0.1)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    return p


def machine_slug(device):
    """'cpu-2-threads', or the GPU's name slugified ('nvidia-h100-80gb-hbm3')."""
    if torch.device(device).type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{torch.get_num_threads()}-threads"


def cpu_description():
    """The CPU a run measured, as Linux names it ('AMD EPYC, family 26 model 2, L3
    32768K'): hosts of one machine kind differ between runs, and so do ratios."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break  # the first processor's fields
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            fields["L3"] = f.read().strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    parts = [name]
    if "cpu family" in fields:
        parts.append(f"family {fields['cpu family']} model {fields.get('model', '?')}")
    if "L3" in fields:
        parts.append(f"L3 {fields['L3']}")
    return ", ".join(parts)


def command_line():
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(HERE))
    return shlex.join(["python", script, *sys.argv[1:]])


# --- timing ----------------------------------------------------------------------------

def synchronizer(device):
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def fastest_alternating(calls, sync, rounds, budget, block, number=None, min_blocks=2, extra_rounds=0,
                        cheap=()):
    """{side: seconds per call of its fastest block of calls over the rounds}.

    In each round each side (in an order that rotates between rounds) runs blocks of
    ``number`` calls (default: as many as last about ``block`` seconds, from two
    untimed calls) until ``budget`` seconds have passed and ``min_blocks`` ran. Short
    blocks and the fastest one: on a loaded machine some blocks escape the stalls.
    After ``rounds`` rounds, up to ``extra_rounds`` more run while the last round still
    made some side faster by more than 5% (the load of a shared machine came and went).

    A side named in ``cheap`` (a slow baseline that no target depends on) whose sizing
    call takes longer than ``budget`` is timed cheaply: that call counts as its first
    round's block, then one call per round, in the first ``rounds`` rounds only (it
    neither runs in nor asks for extra rounds).
    """
    names = list(calls)
    best = dict.fromkeys(names, math.inf)
    numbers = dict.fromkeys(names, number)
    slow = set()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds + extra_rounds):
            before = dict(best)
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn = calls[name]
                if name in slow and r >= rounds:
                    continue
                if numbers[name] is None:  # a warm-up call, then one to size the blocks
                    fn()
                    sync()
                    start = time.perf_counter()
                    fn()
                    sync()
                    seconds = time.perf_counter() - start
                    numbers[name] = max(1, int(block / max(seconds, 1e-9)))
                    if name in cheap and seconds > budget:
                        slow.add(name)
                        best[name] = seconds
                        continue
                if name in slow:
                    start = time.perf_counter()
                    fn()
                    sync()
                    best[name] = min(best[name], time.perf_counter() - start)
                    continue
                blocks, end = 0, time.perf_counter() + budget
                while blocks < min_blocks or (time.perf_counter() < end and blocks < 1000):
                    start = time.perf_counter()
                    for _ in range(numbers[name]):
                        fn()
                    sync()
                    best[name] = min(best[name], (time.perf_counter() - start) / numbers[name])
                    blocks += 1
            if r + 1 >= rounds and all(best[n] > 0.95 * before[n] for n in names if n not in slow):
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return best


def paired_medians(calls, sync, steps, warmup=20):
    """{side: median seconds per call}: one call of each side per round (the order
    reversed every other round), ``steps`` rounds after ``warmup``. Each call meets
    nearly the same machine as the other sides' calls of its round, so a difference
    of a few percent between sides shows in the medians where the fastest block of
    :func:`fastest_alternating` swings by more on a loaded machine."""
    names = list(calls)
    times = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(warmup + steps):
            for name in names if r % 2 else names[::-1]:
                start = time.perf_counter()
                calls[name]()
                sync()
                if r >= warmup:
                    times[name].append(time.perf_counter() - start)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(t) for name, t in times.items()}


def direction_call(fn, inputs, direction, args=()):
    """A no-argument callable running ``fn(*inputs, *args)`` in ``direction``.

    forward: inputs that do not require grad (no autograd graph is recorded);
    backward: torch.autograd.grad of one saved output (retain_graph);
    forward+backward: both, each call. ``inputs`` (a tensor or a tuple) are
    differentiated, ``args`` are not.
    """
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    if direction == "forward":
        plain = tuple(t.detach() for t in inputs)
        return lambda: fn(*plain, *args)
    leaves = tuple(t.detach().requires_grad_() for t in inputs)
    out = fn(*leaves, *args)
    grad = torch.randn(out.shape, dtype=out.dtype, device=out.device,
                       generator=torch.Generator(out.device).manual_seed(1))
    if direction == "backward":
        return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)
    return lambda: torch.autograd.grad(fn(*leaves, *args), leaves, grad)


def gpu_peak_bytes(device, call):
    """Bytes that `call()` allocates at its peak on a GPU beyond what is allocated
    before it, after one warm-up call (which also compiles a compiled function)."""
    call()
    gc.collect()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return peak


def copy_bandwidth(device, sync):
    """GB/s (read + write) of y.copy_(x) and of x.clone() (which allocates its output: on a
    CPU, fresh pages of a large tensor cost more than the copy) of a buffer larger than
    any cache."""
    cuda = torch.device(device).type == "cuda"
    x = torch.ones(1 << (28 if cuda else 24), dtype=torch.float32, device=device)  # 1 GB / 64 MB
    y = torch.empty_like(x)
    seconds = fastest_alternating({"copy": lambda: y.copy_(x), "clone": x.clone}, sync, 3, 0.3, 0)
    return {name: 2 * x.numel() * 4 / s / 1e9 for name, s in seconds.items()}


class Compiler:
    """torch.compile(fullgraph=True, dynamic=False) of a baseline, or None where it fails.

    The first failure (probed once at start-up: on CPU, Inductor needs a C++
    compiler) turns the compile baseline off for the rest of the run, reported as n/a.
    Call :meth:`reset` before each new shape: every shape gets its own static graph.
    """

    def __init__(self, enabled, device):
        self.reason = None if enabled else "n/a (--no-compile)"
        config = torch._dynamo.config
        for name, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                            ("fail_on_recompile_limit_hit", True)):
            if hasattr(config, name):  # never fall back to eager silently
                setattr(config, name, value)
        # The backward direction runs one graph's backward again and again
        # (retain_graph), which a compiled backward that reuses ("donates") the
        # buffers it saved refuses; the buffers' reuse only saves memory.
        import torch._functorch.config as functorch_config
        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        if enabled:
            try:
                probe = torch.compile(lambda x: torch.softmax(x, -1) * 2, fullgraph=True)
                probe(torch.randn(4, 8, device=device))
            except Exception as exc:  # noqa: BLE001 -- any failure means "n/a"
                self.fail(exc)

    def __call__(self, fn):
        return None if self.reason else torch.compile(fn, fullgraph=True, dynamic=False)

    def reset(self):
        if not self.reason:
            torch._dynamo.reset()

    def fail(self, exc):
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        self.reason = f"n/a ({type(exc).__name__}: {first_line})"
        print(f"torch.compile baseline off for the rest of the run: {self.reason}", flush=True)


# --- the run ---------------------------------------------------------------------------

class Bench:
    """Times cases, prints a line per case, keeps the records; ``finish`` writes and sums up."""

    def __init__(self, args, family):
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available here")
        if args.threads:
            torch.set_num_threads(args.threads)
        self.args, self.family, self.device = args, family, args.device
        self.cuda = torch.device(self.device).type == "cuda"
        self.mode = "quick" if args.quick else "full" if args.full else "default"
        self.machine = machine_slug(self.device)
        self.out_dir = args.out_dir or os.path.join(
            HERE, "results", self.machine, *(["quick"] if args.quick else []))
        self.budget = args.min_run_time or (0.01 if args.quick else 0.1)
        self.block = self.budget / 20 if self.cuda else 1e-3  # seconds of calls timed together
        self.rounds = 1 if args.quick and args.rounds == 3 else args.rounds
        self.extra_rounds = 0 if args.quick else 2 * self.rounds
        self.sync = synchronizer(self.device)
        self.records = []
        self.max_load = os.getloadavg()[0]
        self.started = time.time()
        name = torch.cuda.get_device_name(self.device) if self.cuda else \
            f"CPU, {torch.get_num_threads()} threads; {cpu_description()}"
        self.header = [
            f"command: {command_line()}",
            f"machine: {self.machine} ({name}); torch {torch.__version__}; {self.mode} run"
            + (" (a smoke test: its timings are too short to mean anything)" if args.quick else ""),
        ]
        for line in self.header:
            print(line)
        bandwidth = copy_bandwidth(self.device, self.sync)
        self.copy_gbs = bandwidth["copy"]
        self.compiler = Compiler(not args.no_compile, self.device)
        self.header += [f"copy bandwidth: {self.copy_gbs:.1f} GB/s (read + write; x.clone(), which also "
                        f"allocates, {bandwidth['clone']:.1f} GB/s)",
                        f"torch.compile baseline: {self.compiler.reason or 'on'}"]
        for line in self.header[2:]:
            print(line)

    def note(self, line):
        """Prints a line and keeps it in the header of <family>.md."""
        print(line)
        self.header.append(line)

    def section(self, title, columns, rate="GB/s", extra=()):
        """Prints a section's title and column header. ``rate``: "GB/s" (with the
        fraction of copy bandwidth) or "TFLOP/s"; ``extra``: the names of the extra
        sides the section's compare calls time (columns: time and nanfree / side)."""
        print(f"\n== {title}\n{columns}{'nanfree':>11}{'torch':>10}{'ratio':>7}"
              f"{'compile':>10}{'ratio':>7}{rate:>8}{'%copy' if rate == 'GB/s' else '':>7}"
              + "".join(f"{side:>10}{'nf/' + side[:3]:>7}" for side in extra), flush=True)

    def compare(self, fields, label, fns, inputs, direction, nbytes, args=(),
                number=None, min_blocks=2, rounds=None, unit="ms", flops=None, cheap=(),
                paired_steps=None):
        """Times ``fns`` ({side: fn}; a side None is skipped) in ``direction``; returns the record.

        ``fields`` go to the CSV; ``label`` starts the printed line; ``nbytes`` is
        the minimum number of bytes the op moves in this direction (achieved GB/s);
        ``flops`` instead, the floating-point operations it must do (TFLOP/s). With
        ``number``, each side runs exactly ``min_blocks`` blocks of ``number`` calls
        per round. Sides other than nanfree, torch and compile (say a bare matmul of
        the same shape) are timed alongside and recorded as ``<side>_ms`` and
        ``nanfree_over_<side>`` (nanfree time / its time). ``cheap``: sides timed
        with a call per round when a call is slow (see :func:`fastest_alternating`).
        ``paired_steps``: timed by :func:`paired_medians` with that many rounds instead.
        """
        calls = {}
        for side, fn in fns.items():
            if fn is None:
                continue
            try:
                calls[side] = direction_call(fn, inputs, direction, args)
                if side == "compile":  # compile now, not in a timed call; fail once
                    calls[side]()
                    self.sync()
            except Exception as exc:  # noqa: BLE001
                if side != "compile":
                    raise
                calls.pop(side, None)
                self.compiler.fail(exc)
        if paired_steps:
            best = paired_medians(calls, self.sync, paired_steps)
        else:
            best = fastest_alternating(calls, self.sync, rounds or self.rounds,
                                       0 if number else self.budget, self.block, number, min_blocks,
                                       extra_rounds=self.extra_rounds, cheap=cheap)
        ours, base, comp = (best.get(side) for side in SIDES)
        gbs = nbytes / ours / 1e9 if nbytes else None
        record = dict(machine=self.machine, **fields, direction=direction, nanfree_ms=ours * 1e3,
                      torch_ms=base * 1e3, compile_ms=comp * 1e3 if comp else None, ratio=base / ours,
                      ratio_compile=comp / ours if comp else None, gbs=gbs,
                      copy_fraction=gbs / self.copy_gbs if gbs else None)
        if flops:
            record["tflops"] = flops / ours / 1e12
        extra = [side for side in fns if side not in SIDES]
        for side in extra:
            record[f"{side}_ms"] = best[side] * 1e3 if side in best else None
            record[f"nanfree_over_{side}"] = ours / best[side] if side in best else None
        self.records.append(record)
        self.max_load = max(self.max_load, os.getloadavg()[0])
        scale = 1e3 if unit == "us" else 1
        print(f"{label}{ours * 1e3 * scale:>11.4g}{base * 1e3 * scale:>10.4g}{record['ratio']:>7.2f}"
              + (f"{comp * 1e3 * scale:>10.4g}{record['ratio_compile']:>7.2f}" if comp else f"{'n/a':>10}{'':>7}")
              + (f"{gbs:>8.1f}{100 * record['copy_fraction']:>6.0f}%" if gbs else "")
              + ((f"{record['tflops']:>8.3g}" if record["tflops"] >= 0.01 else f"{record['tflops']:>8.1e}")
                 + f"{'':>7}" if flops else "")
              + "".join(f"{best[side] * 1e3 * scale:>10.4g}{record[f'nanfree_over_{side}']:>7.2f}"
                        if side in best else f"{'n/a':>10}{'':>7}" for side in extra)
              + f"   [{time.time() - self.started:.0f}s]", flush=True)
        return record

    def finish(self, summary_lines, plot_fn=None):
        """Writes <family>.csv, .png (``plot_fn(records, path)``, True if it drew) and .md;
        prints the summary."""
        os.makedirs(self.out_dir, exist_ok=True)
        base = os.path.join(self.out_dir, self.family)
        write_csv(self.records, base + ".csv")
        written = [base + ".csv"]
        drew = plot_fn is not None and plot_fn(self.records, base + ".png")
        if drew:
            written.append(base + ".png")
        run = f"run time: {time.time() - self.started:.0f} s"
        cores = len(os.sched_getaffinity(0))
        run += f"; 1-min load average up to {self.max_load:.1f} on {cores} cores"
        if not self.cuda and self.max_load > cores + 0.5:
            run += (" -- other processes competed for the cores: a stalled thread makes times "
                        "unreliable; rerun on an idle machine (or with --threads 1)")
        with open(base + ".md", "w") as f:
            f.write(f"# nanfree {self.family} benchmark\n\n```\n")
            f.write("\n".join(self.header + [run, ""] + summary_lines) + "\n```\n\n")
            f.write(f"Records: `{self.family}.csv` (ratio = baseline time / nanfree time, above 1 "
                    f"= nanfree faster)" + (f"; picture: `{self.family}.png`" if drew else "")
                    + ".\n")
        written.append(base + ".md")
        import overview  # here: it reads the CSV just written, and imports this module
        written += overview.write(self.out_dir)
        print("\n" + "\n".join(summary_lines))
        print(f"\n{run}\nwrote " + ", ".join(os.path.relpath(p) for p in written))


def write_csv(records, path):
    keys = list(dict.fromkeys(k for r in records for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for r in records:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else ("" if v is None else v)
                             for k, v in r.items()})


# --- summary ---------------------------------------------------------------------------

def select(records, **fields):
    """The records whose fields have the given values."""
    return [r for r in records if all(r.get(k) == v for k, v in fields.items())]


def geomean(values):
    return math.exp(statistics.fmean(math.log(v) for v in values))


def describe(record, keys):
    return " ".join(str(record[k]) for k in keys if record.get(k) not in (None, ""))


def target(text, records, key="ratio", at_least=None, at_most=None, describe_keys=()):
    """One summary line: '[met]', '[MISSED]' or '[n/a]', the worst case and the count met."""
    values = [(r[key], r) for r in records if r.get(key) is not None]
    if not values:
        return f"  [n/a]    {text}: not measured in this run"
    ok = [v for v, _ in values if (at_least is None or v >= at_least) and (at_most is None or v <= at_most)]
    worst_value, worst = (min if at_least is not None else max)(values, key=lambda vr: vr[0])
    verdict = "[met]   " if len(ok) == len(values) else "[MISSED]"
    return (f"  {verdict} {text}: {len(ok)}/{len(values)} cases, worst {worst_value:.2f} "
            f"({describe(worst, describe_keys)}), geo-mean {geomean([v for v, _ in values]):.2f}")


def geomean_table(records, group_keys, title):
    """Lines of geo-mean ratios vs eager and vs compile per group (e.g. variant, direction)."""
    if not records:
        return []
    lines = [title]
    groups = dict.fromkeys(tuple(r[k] for k in group_keys) for r in records)
    for g in groups:
        rs = [r for r in records if tuple(r[k] for k in group_keys) == g]
        eager = [r["ratio"] for r in rs]
        comp = [r["ratio_compile"] for r in rs if r["ratio_compile"] is not None]
        lines.append(f"  {' '.join(f'{v:<17}' for v in g)} vs torch {geomean(eager):5.2f} "
                     f"(min {min(eager):.2f})" + (f"   vs compile {geomean(comp):5.2f} "
                                                  f"(min {min(comp):.2f})" if comp else ""))
    return lines


# --- picture ---------------------------------------------------------------------------

def plot_ratios(records, path, title, copy_gbs=None, panel_key="op", x_key="cols",
                line_keys=("dtype", "variant"), show_rate=None, x_label=None):
    """A PNG: a row of panels per ``panel_key`` value; columns: ratio to torch eager, to
    torch.compile (if measured) and the achieved rate (if ``show_rate``, by default if
    ``copy_gbs``): GB/s, with the copy bandwidth ``copy_gbs`` drawn, for a panel whose
    records have ``gbs``, else TFLOP/s (``tflops``); x: ``x_key`` (log2, labelled
    ``x_label``); a line per ``line_keys`` value (the geometric mean over the other
    fields, with a bar spanning their range)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [("ratio", "vs torch eager", "torch time / nanfree time")]
    if any(r.get("ratio_compile") is not None for r in records):
        columns.append(("ratio_compile", "vs torch.compile", "torch.compile time / nanfree time"))
    if copy_gbs if show_rate is None else show_rate:
        columns.append(("rate", None, None))  # per panel: GB/s or TFLOP/s
    panels = list(dict.fromkeys(r[panel_key] for r in records))
    lines = list(dict.fromkeys(tuple(r[k] for k in line_keys) for r in records))
    xticks = sorted({r[x_key] for r in records})
    colors = plt.get_cmap("tab10")
    styles = ["-", "--", ":", "-."]
    firsts = list(dict.fromkeys(line[0] for line in lines))
    lasts = list(dict.fromkeys(line[-1] for line in lines))
    fig, axes = plt.subplots(len(panels), len(columns), squeeze=False, sharex=True,
                             figsize=(5.6 * len(columns), 3.4 * len(panels) + 1.4))
    for i, panel in enumerate(panels):
        for j, (key, what, ylabel) in enumerate(columns):
            ax = axes[i][j]
            if key == "rate":
                if any(r.get("gbs") is not None for r in records if r[panel_key] == panel):
                    key, what, ylabel = "gbs", "achieved bandwidth", "nanfree GB/s (minimum bytes)"
                else:
                    key, what, ylabel = "tflops", "achieved compute", "nanfree TFLOP/s (minimum FLOPs)"
            for line in lines:
                xs, mids, lows, highs = [], [], [], []
                for x in xticks:
                    vals = [r[key] for r in records if r[panel_key] == panel and r[x_key] == x
                            and tuple(r[k] for k in line_keys) == line and r.get(key) is not None]
                    if vals:
                        mid = geomean(vals)
                        xs.append(x), mids.append(mid)
                        lows.append(max(0.0, mid - min(vals))), highs.append(max(0.0, max(vals) - mid))
                if xs:
                    ax.errorbar(xs, mids, yerr=[lows, highs], capsize=3, marker="o", markersize=4,
                                color=colors(firsts.index(line[0]) % 10),
                                linestyle=styles[lasts.index(line[-1]) % len(styles)],
                                label=" ".join(map(str, line)) if i == 0 and j == 0 else None)
            if key == "gbs" and copy_gbs:
                ax.axhline(copy_gbs, color="grey", linewidth=1)
                ax.text(xticks[0], copy_gbs, " copy bandwidth", fontsize=7, va="top")
                ax.set_ylim(bottom=0)
            elif key in ("gbs", "tflops"):
                ax.set_ylim(bottom=0)
            else:
                ax.axhline(1.0, color="grey", linewidth=1)
                ax.set_yscale("log", base=2)
                low, high = ax.get_ylim()
                ticks = [2.0 ** k for k in range(-6, 9)]
                if high / low < 10:  # a narrow range: intermediate ticks too
                    ticks += [0.75, 1.25, 1.5, 3, 6]
                if high / low < 1.6:  # a very narrow one: finer still
                    ticks += [0.8, 0.9, 1.1, 1.2]
                ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(sorted(ticks)))
                ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xscale("log", base=2)
            if len(xticks) == 1:  # one x value: a range around it (log scale needs one)
                ax.set_xlim(xticks[0] / 2, xticks[0] * 2)
            ax.set_xticks(xticks, [str(x) for x in xticks], fontsize=8)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_title(f"{panel}: {what}", fontsize=10)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, alpha=0.3)
            if i == len(panels) - 1:
                ax.set_xlabel(x_label or f"row length ({x_key}), log scale", fontsize=8)
    fig.legend(loc="lower center", ncol=min(len(lines), 6), fontsize=8, frameon=False)
    fig.suptitle(title + "\nratios above 1: nanfree faster; points: geometric mean over "
                 "tensor sizes, bars: their range", fontsize=10)
    fig.tight_layout(rect=(0, 0.04 if len(lines) <= 6 else 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
