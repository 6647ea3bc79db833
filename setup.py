"""Builds nanfree's C++ extensions.

- ``nanfree._C``: every operator schema (csrc/registration.cpp), the autograd and
  autocast kernels shared by every backend, and the Python entry points of nanfree.ops
  (csrc/*.cpp). Always built.
- ``nanfree._C_cpu``: the CPU kernels (csrc/cpu). Always built.
- ``nanfree._C_cuda``: the CUDA kernels (csrc/cuda). Built when torch has CUDA and
  ``nvcc`` is found, also on a machine without a GPU (compile and link only).
- ``nanfree._C_cuda_emulated_<build>`` (test-only, with ``NANFREE_CUDA_EMULATE``): the
  same CUDA kernels and registrations compiled by the host compiler against the
  emulation of the CUDA execution model in tests/cuda_emulation, serving CPU tensors
  (``NANFREE_BACKEND=cuda NANFREE_CUDA_EMULATION=<variant>``; the ``plain`` build serves
  the variants ``plain`` and ``grid_capped``, the ``sanitized`` build ``sanitized``).
  Needs CUDA's headers (a toolkit, or the nvidia wheels of a CUDA build of torch), not a
  GPU or nvcc.

Environment:
- ``NANFREE_CUDA=0|1|auto|only`` (default auto): 1 fails the build when CUDA cannot be
  built; only builds ``nanfree._C_cuda`` alone (as 1), for a GPU machine whose torch is
  given on the path (scripts/gpu_prebuild.sh).
- ``TORCH_CUDA_ARCH_LIST``: the CUDA architectures (default "8.0;9.0+PTX").
- ``NANFREE_CPU_ISA=auto|avx2|avx512|default`` (default auto): the x86 vector ISA of the
  CPU kernels; auto picks the best one the build machine has (and with AVX-512, its
  AVX512-BF16 conversion instructions where it has them).
- ``NANFREE_DEBUG_INFO=0|1`` (default 0): 1 compiles the C++ with full debug information
  (Python's -g); 0 leaves it out (-g0), a third less compile time.
- ``NANFREE_CUDA_EMULATE=0|1|auto|<build>[,<build>...]`` (default 0): the emulated
  CUDA builds; 1 builds every one of EMULATION_BUILDS (and fails without CUDA's
  headers), auto every one when CUDA's headers are found (scripts/test.sh).

No fast-math flag is ever used: it lets the compiler delete NaN and inf checks.
"""

import glob
import os
import platform
import shutil
import subprocess

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home():
    """A CUDA toolkit folder with bin/nvcc and include/cuda_runtime.h, or None."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            return os.environ[env]
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        # nvcc may be a wrapper script: ask it where its own binary lives.
        try:
            out = subprocess.run([nvcc, "-dryrun", "--version"], capture_output=True, text=True)
            for line in (out.stdout + out.stderr).splitlines():
                if "TOP=" in line:
                    candidates.append(line.split("TOP=", 1)[1].strip())
        except OSError:
            pass
    candidates.append("/usr/local/cuda")
    for path in candidates:
        if os.path.exists(os.path.join(path, "include", "cuda_runtime.h")) and os.path.exists(
            os.path.join(path, "bin", "nvcc")
        ):
            return path
    return None


_cuda_mode = os.environ.get("NANFREE_CUDA", "auto").lower()
if _cuda_mode not in ("0", "1", "auto", "only"):
    raise SystemExit(f"NANFREE_CUDA must be 0, 1, auto or only, got {_cuda_mode!r}")
_cuda_home = _find_cuda_home() if _cuda_mode != "0" else None
if _cuda_home:
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = _cuda_home

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

# Never -ffast-math / -Ofast: they delete NaN checks. No contraction of a * b + c
# into an fma either (g++ in ISO C++ mode does not; clang would): the roundings
# the tests check are those of the written expressions, as nvcc's --fmad=false.
SAFE_MATH = ["-fno-fast-math", "-ffp-contract=off"]
# Python's own compiler flags, which every extension gets, hold -g: full debug
# information, a third of the compile time of a file that includes torch's
# headers. -g0 leaves it out unless NANFREE_DEBUG_INFO=1.
DEBUG_INFO = ["-g"] if os.environ.get("NANFREE_DEBUG_INFO", "0") == "1" else ["-g0"]
CXX_FLAGS = ["-O3", "-std=c++20", "-Wno-unknown-pragmas", *SAFE_MATH, *DEBUG_INFO]
INCLUDE_DIRS = [os.path.join(HERE, "csrc"), os.path.join(HERE, "csrc", "include")]


def _gcc12_avx512_quiet():
    """GCC 12 reports its own AVX-512 intrinsics (the deliberately undefined
    `__Y` of avx512fintrin.h) as uninitialized thousands of times per build,
    burying real messages: GCC bug 105593, fixed in GCC 13. Those two warnings
    are turned off for GCC 12 only."""
    try:
        version = subprocess.run([os.environ.get("CXX", "c++"), "-dumpfullversion", "-dumpversion"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    return ["-Wno-uninitialized", "-Wno-maybe-uninitialized"] if version.startswith("12.") else []


def _cpu_isa_flags():
    """Compiler flags and ATen CPU_CAPABILITY for the vectorized CPU kernels."""
    isa = os.environ.get("NANFREE_CPU_ISA", "auto").lower()
    bf16 = []  # csrc/cpu/vec.h's narrow_pair: bfloat16 rounding in one instruction
    if isa == "auto":
        isa = "default"
        if platform.machine() in ("x86_64", "AMD64") and os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as f:
                flags = f.read()
            if all(f" {name}" in flags for name in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
                isa = "avx512"
                bf16 = ["-mavx512bf16"] if " avx512_bf16" in flags else []
            elif " avx2" in flags and " fma" in flags:
                isa = "avx2"
    if isa == "avx512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                *bf16, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
                *_gcc12_avx512_quiet()]
    if isa == "avx2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    if isa == "default":
        return ["-DCPU_CAPABILITY=DEFAULT"]
    raise SystemExit(f"NANFREE_CPU_ISA must be auto, avx2, avx512 or default, got {isa!r}")


def _openmp_flags():
    """at::parallel_for runs its body on one thread unless the file that calls
    it is compiled with OpenMP (ATen's header checks _OPENMP). Linking
    libgomp.so.1 by its soname reuses the copy torch has already loaded, so
    both share one thread pool and torch.set_num_threads applies."""
    if not torch.backends.openmp.is_available() or platform.system() != "Linux":
        return []
    return ["-fopenmp"]


def _shared_libstdcxx():
    """The libstdc++.so.6 this Python (with torch) has loaded, as a link input of
    every extension: a compiler whose own libstdc++ is static-only would
    otherwise copy the library into each extension, and such a copy's locale is
    never initialized (formatting a number into an error message then crashes
    or prints nothing). Where the compiler links libstdc++.so.6 anyway, this is
    the same library. Empty off Linux."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so.6" in line}
    except OSError:
        return []
    return sorted(paths)[:1]


LINK_FLAGS = _shared_libstdcxx()


def _cuda_extension():
    if _cuda_mode == "0":
        return None
    problem = None
    if torch.version.cuda is None:
        problem = "this torch build has no CUDA"
    elif _cuda_home is None:
        problem = "nvcc (a CUDA toolkit) was not found"
    if problem is None and not glob.glob("csrc/cuda/*.cu"):
        problem = "there are no CUDA kernel sources"
    if problem:
        if _cuda_mode in ("1", "only"):
            raise SystemExit(f"NANFREE_CUDA={_cuda_mode} but {problem}")
        print(f"nanfree: not building the CUDA extension: {problem}")
        return None
    from torch.utils.cpp_extension import CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    include_dirs = list(INCLUDE_DIRS)
    # Wheels of torch ship the CUDA library headers (cuBLAS, cuSPARSE, ...) in
    # site-packages/nvidia/*/include; ATen's CUDA headers include them.
    try:
        import nvidia

        for root in nvidia.__path__:
            include_dirs += sorted(glob.glob(os.path.join(root, "*", "include")))
    except ImportError:
        pass
    sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    return CUDAExtension(
        "nanfree._C_cuda",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": CXX_FLAGS,
            # --fmad=false: nvcc would contract a * b + c into one fma, which moves
            # the cancellations of the shared math away from what the CPU and the
            # emulated CUDA builds compute and test (g++ in ISO C++ mode does not
            # contract); the kernels are memory- or cuBLAS-bound.
            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "--fmad=false"],
        },
        extra_link_args=LINK_FLAGS,
    )


# The emulated CUDA builds: build -> extra compiler and linker flags. The
# variants that differ only in launch limits (csrc/cuda/launch_limits.h) share
# a build, which reads the limits of NANFREE_CUDA_EMULATION when it loads.
EMULATION_BUILDS = {
    # The variants plain and grid_capped (the latter: every launch gets at most
    # 3 blocks, so that every grid-stride loop iterates).
    "plain": ([], []),
    # AddressSanitizer and UndefinedBehaviorSanitizer (misaligned vector
    # accesses included); loading it needs libasan preloaded (scripts/test.sh).
    # (-g1: the line tables of the sanitizers' reports, without the rest of -g.)
    "sanitized": (["-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                   "-fno-sanitize-recover=undefined"], ["-fsanitize=address,undefined"]),
}


def _cuda_header_dirs():
    """Folders holding cuda_runtime.h, cuda_fp16.h and cuda_bf16.h: the toolkit's,
    else those of the nvidia wheels a CUDA build of torch installs."""
    dirs = [os.path.join(_find_cuda_home() or "/usr/local/cuda", "include")]
    try:
        import nvidia

        for root in nvidia.__path__:
            dirs += sorted(glob.glob(os.path.join(root, "*", "include")))
    except ImportError:
        pass
    return [d for d in dirs if os.path.exists(os.path.join(d, "cuda_fp16.h"))][:1]


def _cuda_emulation_extensions():
    requested = os.environ.get("NANFREE_CUDA_EMULATE", "0").strip().lower()
    if requested in ("", "0"):
        return []
    builds = list(EMULATION_BUILDS) if requested in ("1", "auto") else requested.split(",")
    unknown = [b for b in builds if b not in EMULATION_BUILDS]
    if unknown:
        raise SystemExit(f"NANFREE_CUDA_EMULATE: unknown builds {unknown}; "
                         f"known: {', '.join(EMULATION_BUILDS)}")
    headers = _cuda_header_dirs()
    if not headers:
        problem = ("the emulated CUDA build needs CUDA's headers (cuda_fp16.h): install a CUDA "
                   "toolkit or a CUDA build of torch")
        if requested == "auto":
            print(f"nanfree: not building the emulated CUDA extensions: {problem}")
            return []
        raise SystemExit(f"NANFREE_CUDA_EMULATE={requested}: {problem}")
    import sys

    sys.path.insert(0, os.path.join(HERE, "tests", "cuda_emulation"))
    import rewrite

    emulation = os.path.join(HERE, "tests", "cuda_emulation")
    extensions = []
    for build in builds:
        # One folder of sources per build: the rewritten kernels, and files
        # that include the registrations and the emulation's runtime, so that
        # no object file is shared between builds of different flags.
        root = os.path.join(HERE, "build", "cuda_emulation", build)
        # nanfree's kernels, and the emulation's own test kernels (test_cuda_emulation.py).
        rewrite.rewrite_tree(os.path.join(HERE, "csrc", "cuda"), os.path.join(root, "cuda"), HERE)
        rewrite.rewrite_tree(emulation, os.path.join(root, "self_test"), HERE)
        sources = sorted(glob.glob(os.path.join(root, "cuda", "*.cpp")) +
                         glob.glob(os.path.join(root, "self_test", "*.cpp")))
        wrapped = [os.path.join(HERE, "csrc", "cuda", name)
                   for name in sorted(os.listdir(os.path.join(HERE, "csrc", "cuda")))
                   if name.endswith(".cpp")]
        wrapped += [os.path.join(emulation, name) for name in ("runtime.cpp", "fiber.cpp", "self_test.cpp")]
        os.makedirs(os.path.join(root, "included"), exist_ok=True)
        for path in wrapped:
            target = os.path.join(root, "included", os.path.basename(path))
            text = f'#include "{path}"\n'
            if not os.path.exists(target) or open(target).read() != text:
                with open(target, "w") as f:
                    f.write(text)
            sources.append(target)
        # Headers too: setuptools rebuilds an extension only when a listed file is newer.
        depends = [p for pattern in ("csrc/**/*.h", "csrc/**/*.cuh", "tests/cuda_emulation/**/*.h")
                   for p in glob.glob(os.path.join(HERE, pattern), recursive=True)]
        cflags, ldflags = EMULATION_BUILDS[build]
        extensions.append(CppExtension(
            f"nanfree._C_cuda_emulated_{build}",
            [os.path.relpath(p, HERE) for p in sources],
            include_dirs=[root, os.path.join(emulation, "include"), emulation, *INCLUDE_DIRS,
                          *headers],
            # Hidden symbols: the emulation's cudaGetLastError and cudaGetErrorString must
            # not bind to (or be bound by) the CUDA runtime a CUDA build of torch loads. The
            # host compiler, unlike nvcc, warns that the kernels' registers may be read
            # uninitialized where flow it cannot follow (a kind fixed per launch) guards them.
            extra_compile_args={"cxx": ["-O2", "-std=c++20", "-Wno-unknown-pragmas", *SAFE_MATH,
                                        *DEBUG_INFO, "-fvisibility=hidden", "-Wno-subobject-linkage",
                                        "-Wno-maybe-uninitialized", "-Wno-uninitialized",
                                        "-DNANFREE_CUDA_EMULATION", *cflags]},
            extra_link_args=ldflags + LINK_FLAGS,
            depends=[os.path.relpath(p, HERE) for p in depends],
        ))
    return extensions


def _all_extensions():
    extensions = [
        # Schemas, autograd, autocast and Python entry points: device-independent, loaded first.
        # (OpenMP: nanfree.debug's finiteness scan runs large calls on ATen's threads.)
        CppExtension("nanfree._C", sorted(glob.glob("csrc/*.cpp")),
                     include_dirs=INCLUDE_DIRS,
                     extra_compile_args={"cxx": CXX_FLAGS + _openmp_flags()},
                     extra_link_args=_openmp_flags() + LINK_FLAGS),
        CppExtension("nanfree._C_cpu", sorted(glob.glob("csrc/cpu/*.cpp")), include_dirs=INCLUDE_DIRS,
                     extra_compile_args={"cxx": CXX_FLAGS + _cpu_isa_flags() + _openmp_flags()},
                     extra_link_args=_openmp_flags() + LINK_FLAGS),
    ]
    cuda = _cuda_extension()
    if cuda is not None:
        extensions.append(cuda)
    return extensions + _cuda_emulation_extensions()


# NANFREE_CUDA=only: the CUDA extension alone, for a GPU machine's torch (scripts/gpu_prebuild.sh).
ext_modules = [_cuda_extension()] if _cuda_mode == "only" else _all_extensions()

setup(
    packages=find_packages(include=["nanfree", "nanfree.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)},
)
