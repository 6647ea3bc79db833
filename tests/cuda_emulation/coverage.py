"""Which CUDA kernels, launch sites and launch plans a test run reaches
through the emulated CUDA build.

    NANFREE_CUDA_EMULATION_LOG=launches.jsonl NANFREE_BACKEND=cuda \\
        NANFREE_CUDA_EMULATION=plain python -m pytest tests -m "not backend_independent"
    python tests/cuda_emulation/coverage.py launches.jsonl [--markdown report.md]

The inventory (every __global__ function and every <<<...>>> launch of
csrc/cuda) comes from the same rewrite that builds the emulation; the log has
one line per launch (runtime.cpp). A plan is what the launch configures: the
kernel's template arguments (element type, vector width, cached vectors per
thread; 0 cached vectors is a streamed row), the threads per row (below, at or
above a warp) and the blocks. Exits with status 1 when a kernel or a launch
site was never reached.
"""

import argparse
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import rewrite  # noqa: E402


def inventory():
    found = {"kernels": [], "launches": []}
    source_dir = os.path.join(ROOT, "csrc", "cuda")
    for name in sorted(os.listdir(source_dir)):
        if name.endswith((".cu", ".cuh")):
            path = os.path.join(source_dir, name)
            with open(path) as f:
                _, part = rewrite.rewrite_text(f.read(), os.path.relpath(path, ROOT))
            for key in found:
                found[key] += part[key]
    return found


def kernel_name(pretty):
    """'softmax_forward_kernel' from 'void nanfree::gpu::{anonymous}::softmax_forward_kernel(...) [with ...]'."""
    head = pretty.split("(", 1)[0]
    return re.split(r"::|\s", head)[-1]


def template_arguments(pretty):
    m = re.search(r"\[with (.*)\]$", pretty)
    if not m:
        return {}
    out = {}
    for part in m.group(1).split("; "):
        if " = " in part:
            name, value = part.rsplit(" = ", 1)
            out[name.split()[-1]] = value
    return out


def group_class(threads):
    if threads < 32:
        return "row below a warp"
    if threads == 32:
        return "row of one warp"
    return "row above a warp"


def plan_of(record):
    """The launch plan's features, as labels."""
    name = kernel_name(record["kernel"])
    targs = template_arguments(record["kernel"])
    args = record["args"]
    labels = []
    dtype = targs.get("scalar_t") or targs.get("acc_t") or targs.get("half_t")
    if dtype:
        labels.append(dtype)
    if "kVec" in targs:
        labels.append("vector loads" if targs["kVec"] != "1" else "scalar loads")
    if "kIters" in targs:
        labels.append("streamed row" if targs["kIters"] == "0" else "cached row")
    if name == "long_row_forward_kernel":
        labels.append("streamed row")
    if "strided" in name:
        labels.append("strided layout")
    if name.endswith("_finish_kernel"):
        labels.append("split rows merged")
    group = args.get("G", args.get("group"))
    if group is not None:
        labels.append(group_class(group))
    block = record["block"]
    if block[1] > 1:
        labels.append(f"2-d block {block[0]}x{block[1]}")
    blocks = record["grid"][0]
    labels.append("one block" if blocks == 1 else "several blocks")
    return name, labels


def report(log_path):
    inv = inventory()
    kernels = collections.Counter()
    sites = collections.Counter()
    plans = collections.defaultdict(collections.Counter)
    instantiations = collections.defaultdict(collections.Counter)
    total = 0
    with open(log_path) as f:
        for line in f:
            record = json.loads(line)
            if not record["site"].startswith("csrc/"):
                continue  # the emulation's own self-test kernels
            total += 1
            name, labels = plan_of(record)
            # Kernels of one name in two files (strided_forward_kernel) are two kernels.
            name = (name, record["kernel_site"].rsplit(":", 1)[0])
            kernels[name] += 1
            sites[record["site"]] += 1
            for label in labels:
                plans[name][label] += 1
            targs = template_arguments(record["kernel"])
            instantiations[name][", ".join(f"{k}={v}" for k, v in targs.items())] += 1
    lines = [f"# CUDA kernels reached through the emulation ({total} launches)", ""]
    lines += ["| kernel | defined at | launches | instantiations | plans (launches) |",
              "|---|---|---|---|---|"]
    missing = []
    for k in inv["kernels"]:
        name = (k["name"], k["site"].rsplit(":", 1)[0])
        count = kernels.get(name, 0)
        if count == 0:
            missing.append(f"kernel {name[0]} ({k['site']})")
        plan_text = ", ".join(f"{label} ({n})" for label, n in sorted(plans[name].items()))
        lines.append(f"| `{name[0]}` | {k['site']} | {count} | {len(instantiations[name])} | "
                     f"{plan_text or '-'} |")
    lines += ["", "| launch site | kernel | launches |", "|---|---|---|"]
    for launch in inv["launches"]:
        count = sites.get(launch["site"], 0)
        if count == 0:
            missing.append(f"launch {launch['callee']} ({launch['site']})")
        lines.append(f"| {launch['site']} | `{launch['callee']}` | {count} |")
    lines += ["", "## Not reached", ""]
    lines += [f"- {m}" for m in missing] or ["- nothing: every kernel and launch site ran"]
    return "\n".join(lines) + "\n", missing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the launch log (NANFREE_CUDA_EMULATION_LOG)")
    parser.add_argument("--markdown", help="also write the report to this file")
    args = parser.parse_args()
    text, missing = report(args.log)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
