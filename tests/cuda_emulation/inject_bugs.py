"""Proof that the emulated CUDA pass bites: injects, one at a time, bugs that
only a GPU would show into the CUDA kernels, rebuilds the emulated extensions
and runs the emulated tests under every build and schedule; each bug must make
at least one of them fail. Prints, per bug, which build and schedule caught it.

    python tests/cuda_emulation/inject_bugs.py [--bug NAME ...] [--tests FILE ...]

It edits csrc/cuda in place (refusing to start unless the files it edits match
git's HEAD) and restores every file afterwards, also on an error or Ctrl-C,
then rebuilds the emulated extensions from the restored sources. Takes about
half an hour on two cores. Exit status 1 if a bug went uncaught.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (file, exact text, replacement, what it breaks). Each text occurs once.
BUGS = {
    "sync-between-write-and-read": (
        "csrc/cuda/softmax_kernels.cu",
        "    if (threadIdx.x % kWarp == 0) partial[warp] = state;\n    __syncthreads();\n",
        "    if (threadIdx.x % kWarp == 0) partial[warp] = state;\n",
        "the softmax forward's warps read each other's partial states before they are written"),
    "sync-between-read-and-next-write": (
        "csrc/cuda/softmax_kernels.cu",
        "    for (int w = 1; w < per_group; ++w) state = lse_merge(state, partial[first + w]);\n"
        "    __syncthreads();  // partial is reused by the next row\n",
        "    for (int w = 1; w < per_group; ++w) state = lse_merge(state, partial[first + w]);\n",
        "a warp that runs ahead overwrites the partial states of the next row while slower "
        "warps still read this row's"),
    "butterfly-wrong-width": (
        "csrc/cuda/device_common.cuh",
        "  const int width = G < kWarp ? G : kWarp;\n  for (int offset = width / 2;",
        "  const int width = kWarp;\n  for (int offset = width / 2;",
        "group_reduce's butterfly starts at a warp's width whatever the group: rows narrower "
        "than a warp mix"),
    "tree-off-by-one": (
        "csrc/cuda/softmax_strided_kernels.cu",
        "  for (int half = count / 2; half > 0; half /= 2) {",
        "  for (int half = count / 2; half > 1; half /= 2) {",
        "the strided kernels' tree over slices stops one level early"),
    "shared-index-wrong-stride": (
        "csrc/cuda/device_common.cuh",
        "      for (int k = 0; k < N; ++k) partial[warp * N + k] = v[k];",
        "      for (int k = 0; k < N; ++k) partial[warp + k] = v[k];",
        "group_reduce writes N values per warp with stride 1 instead of N"),
    "grid-stride-skips-last-step": (
        "csrc/cuda/softmax_kernels.cu",
        "  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups; base < rows;\n"
        "       base += static_cast<int64_t>(gridDim.x) * groups) {\n"
        "    const int64_t row = base + group;\n"
        "    const bool active = row < rows;\n"
        "    const scalar_t* x_row",
        "  for (int64_t base = static_cast<int64_t>(blockIdx.x) * groups;\n"
        "       base == static_cast<int64_t>(blockIdx.x) * groups ||\n"
        "       base + static_cast<int64_t>(gridDim.x) * groups < rows;\n"
        "       base += static_cast<int64_t>(gridDim.x) * groups) {\n"
        "    const int64_t row = base + group;\n"
        "    const bool active = row < rows;\n"
        "    const scalar_t* x_row",
        "the softmax forward's grid-stride loop stops one step early once it iterates"),
    "split-range-off-by-one": (
        "csrc/cuda/mnr_kernels.cu",
        "  const int64_t end = begin + split.part_vecs < split.nvec ? begin + split.part_vecs "
        ": split.nvec;",
        "  const int64_t end = begin + split.part_vecs - 1 < split.nvec ? "
        "begin + split.part_vecs - 1 : split.nvec;",
        "each part of a split MNR row leaves out its last vector"),
    "max-drops-nan": (
        "csrc/cuda/device_common.cuh",
        "  return (a > b || a != a) ? a : b;",
        "  return ::fmax(a, b);",
        "max_keep_nan becomes fmax, which drops a NaN operand"),
    "vector-load-without-alignment-test": (
        "csrc/cuda/softmax_kernels.cu",
        "  const bool vec = cols % vec_width<scalar_t>() == 0 && aligned16(input) &&\n"
        "                   (kind == SoftmaxKind::LogSumExp || aligned16(output));",
        "  const bool vec = cols % vec_width<scalar_t>() == 0 &&\n"
        "                   (kind == SoftmaxKind::LogSumExp || aligned16(output));",
        "the softmax forward takes 16-byte vector loads from an input that is not 16-byte aligned"),
}

# (build, schedule): every configuration of scripts/test.sh's emulated passes.
CONFIGS = [("plain", "lockstep"), ("plain", "first-warp-ahead"), ("plain", "last-warp-ahead"),
           ("plain", "random:1"), ("grid_capped", "last-warp-ahead"),
           ("sanitized", "first-warp-ahead")]

TESTS = ["tests/test_cuda_emulation.py", "tests/test_softmax_mask_layouts.py",
         "tests/test_softmax_special_values.py", "tests/test_cosine_special_values.py",
         "tests/test_gem_special_values.py", "tests/test_mnr_special_values.py"]


def compiler():
    return os.environ.get("CXX", "c++")


def build():
    env = dict(os.environ, NANFREE_CUDA="0", NANFREE_CUDA_EMULATE="1",
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    # --force: setuptools' own check would skip an extension whose header alone
    # changed; ninja still recompiles only what the edit touches.
    result = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--force"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError("the emulated build failed:\n" + result.stdout[-4000:] +
                           result.stderr[-4000:])


def run_tests(variant, schedule, tests):
    env = dict(os.environ, NANFREE_BACKEND="cuda", NANFREE_CUDA_EMULATION=variant,
               NANFREE_CUDA_SCHEDULE=schedule,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    if variant == "sanitized":
        libs = [subprocess.run([compiler(), f"-print-file-name={lib}"], capture_output=True,
                               text=True).stdout.strip() for lib in ("libasan.so", "libstdc++.so")]
        env.update(LD_PRELOAD=" ".join(libs), ASAN_OPTIONS="detect_leaks=0")
    result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                             "-m", "not backend_independent", *tests],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    out = result.stdout + result.stderr
    # The first failing test, or the emulation's own abort message.
    first = next((line for line in out.splitlines()
                  if line.startswith("FAILED") or line.startswith("cuda emulation:")
                  or "runtime error:" in line or "ERROR: AddressSanitizer" in line
                  or line.startswith("Fatal Python error")), "")
    return result.returncode, first.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bug", action="append", choices=sorted(BUGS),
                        help="inject only this bug (repeatable)")
    parser.add_argument("--tests", action="append", help="test files to run (default: "
                        "the emulation's, layout and special-value tests)")
    args = parser.parse_args()
    bugs = args.bug or list(BUGS)
    tests = args.tests or TESTS
    files = sorted({BUGS[b][0] for b in bugs})
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *files], cwd=ROOT).returncode
    if dirty:
        sys.exit(f"inject_bugs.py edits {', '.join(files)}: commit or stash their changes first")
    originals = {f: open(os.path.join(ROOT, f)).read() for f in files}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    uncaught = []
    try:
        for name in bugs:
            path, text, replacement, what = BUGS[name]
            source = originals[path]
            if source.count(text) != 1:
                raise RuntimeError(f"{name}: the text to replace occurs {source.count(text)} "
                                   f"times in {path}, not once")
            with open(os.path.join(ROOT, path), "w") as f:
                f.write(source.replace(text, replacement))
            start = time.time()
            build()
            print(f"\n## {name}: {what} ({path}; rebuilt in {time.time() - start:.0f} s)",
                  flush=True)
            caught = []
            for variant, schedule in CONFIGS:
                start = time.time()
                code, first = run_tests(variant, schedule, tests)
                verdict = "caught" if code != 0 else "passed"
                print(f"- {variant:11s} {schedule:16s} {verdict:6s} ({time.time() - start:.0f} s)"
                      f"{': ' + first if first else ''}", flush=True)
                if code != 0:
                    caught.append((variant, schedule))
            if not caught:
                uncaught.append(name)
            with open(os.path.join(ROOT, path), "w") as f:
                f.write(source)
    finally:
        for path, text in originals.items():
            with open(os.path.join(ROOT, path), "w") as f:
                f.write(text)
        build()
    print("\nuncaught: " + (", ".join(uncaught) if uncaught else "none"))
    sys.exit(1 if uncaught else 0)


if __name__ == "__main__":
    main()
