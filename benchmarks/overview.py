"""One picture of every family's benchmark: forward+backward speed against torch eager and
torch.compile, the geometric mean over each op's cases in the family's CSV.

    python benchmarks/overview.py benchmarks/results/<machine>

Reads the ``<family>.csv`` files in that folder (the families found there, from
whichever runs wrote them) and writes ``overview.png`` and ``overview.md`` beside
them. Every family's benchmark rewrites the overview of its folder when it
finishes. Ratios are baseline time / nanfree time: above 1 means nanfree is faster.
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_common import geomean  # noqa: E402

FAMILIES = ("softmax", "cosine", "gem", "mnr", "elementwise", "losses")
# Sections that time something other than one forward+backward of an op's cases
# (elementwise's "distance": a compiled block using sqrt, not the op against torch's).
SKIPPED_SECTIONS = {"latency", "memory", "distance"}
LOSS_NAMES = {"bce_logits": "binary_cross_entropy_with_logits", "focal": "sigmoid_focal_loss",
              "ce smoothed": "cross_entropy (smoothing, mask)"}


def case_label(family, row):
    """The bar a CSV row counts towards: the op (or layout) and its variant."""
    name = row.get("op") or row.get("layout") or {"mnr": "mnr_loss"}.get(family, family)
    if family == "losses":
        name = LOSS_NAMES.get(name, name)
    if family == "gem":
        name = {"images": "gem_pool2d", "tokens": "gem (tokens, masked)",
                "images p=3.0": "gem_pool2d (p a Python float)"}.get(name, name)
    variant = row.get("variant")
    if variant and variant != "plain":
        name += f" ({variant})"
    if row.get("section") == "inner dim":
        name += " (inner dim)"
    return name


def read(folder):
    """[(family, label, [eager ratios], [compile ratios])] in the CSVs' order."""
    bars = {}
    for family in FAMILIES:
        path = os.path.join(folder, f"{family}.csv")
        if not os.path.exists(path):
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row["direction"] != "forward+backward" or row["section"] in SKIPPED_SECTIONS:
                    continue
                if not row.get("ratio"):  # the baseline did not run (out of memory)
                    continue
                eager, compiled = bars.setdefault((family, case_label(family, row)), ([], []))
                eager.append(float(row["ratio"]))
                if row.get("ratio_compile"):
                    compiled.append(float(row["ratio_compile"]))
    return [(family, label, eager, compiled) for (family, label), (eager, compiled) in bars.items()]


def write_markdown(bars, path, machine):
    with open(path, "w") as f:
        f.write(f"# nanfree benchmark overview: {machine}\n\n"
                "Forward+backward, geometric mean over each op's cases (ratio = baseline time / "
                "nanfree time; above 1 = nanfree faster). Per-family reports: `<family>.md`.\n\n"
                "| family | op | cases | vs torch eager | vs torch.compile |\n|---|---|---|---|---|\n")
        for family, label, eager, compiled in bars:
            comp = f"{geomean(compiled):.2f}x" if compiled else "n/a"
            f.write(f"| {family} | {label} | {len(eager)} | {geomean(eager):.2f}x | {comp} |\n")


def plot(bars, path, machine):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    labels = [f"{label}" for _, label, _, _ in bars]
    eager = [geomean(e) for _, _, e, _ in bars]
    compiled = [geomean(c) if c else float("nan") for _, _, _, c in bars]
    ys = range(len(bars))
    fig, ax = plt.subplots(figsize=(8.5, 0.42 * len(bars) + 1.6))
    height = 0.38
    ax.barh([y - height / 2 for y in ys], eager, height, label="vs torch eager", color="tab:blue")
    ax.barh([y + height / 2 for y in ys], compiled, height, label="vs torch.compile",
            color="tab:orange")
    for y, (e, c) in enumerate(zip(eager, compiled)):
        ax.text(e, y - height / 2, f" {e:.2f}x", va="center", fontsize=7)
        if c == c:
            ax.text(c, y + height / 2, f" {c:.2f}x", va="center", fontsize=7)
    ax.set_xscale("log")
    values = [v for v in eager + compiled if v == v]
    ticks = [t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100)
             if min(values) / 2 <= t <= max(values) * 2]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axvline(1.0, color="grey", linewidth=1)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("baseline time / nanfree time (log scale; above 1 = nanfree faster)")
    ax.set_title(f"nanfree forward+backward speed on {machine}\n"
                 "geometric mean over each op's cases of the benchmark run", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(folder):
    """Writes overview.png and overview.md in `folder` from the families' CSVs there;
    returns the paths written (none when no CSV has forward+backward results)."""
    bars = read(folder)
    if not bars:
        return []
    machine = os.path.basename(os.path.normpath(folder))
    paths = [os.path.join(folder, "overview.png"), os.path.join(folder, "overview.md")]
    plot(bars, paths[0], machine)
    write_markdown(bars, paths[1], machine)
    return paths


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="a results folder, e.g. benchmarks/results/cpu-2-threads")
    paths = write(p.parse_args().folder)
    if not paths:
        raise SystemExit("overview.py: no family's forward+backward results there")
    print("wrote " + ", ".join(os.path.relpath(path) for path in paths))


if __name__ == "__main__":
    main()
