"""The emulation of the CUDA execution model (tests/cuda_emulation) that runs
the CUDA kernels on CPU tensors: warp collectives, shared memory, launch
geometry, and the aborts on misuse. Runs in the emulated CUDA passes of
scripts/test.sh (NANFREE_BACKEND=cuda NANFREE_CUDA_EMULATION=<build>), through
the self-test kernels built into the emulated extensions; skipped elsewhere."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import nanfree.ops
from nanfree import _backends

if _backends.emulated_cuda_module() is None:
    pytest.skip("the emulated CUDA build serves only with NANFREE_BACKEND=cuda and "
                "NANFREE_CUDA_EMULATION set (the emulated passes of scripts/test.sh)",
                allow_module_level=True)

ops = torch.ops.nanfree_cuda_emulation
KERNELS = "tests/cuda_emulation/self_test_kernels.cu"


def _expected_shuffles(v):
    lanes = range(32)
    nan = math.nan
    rows = [
        [v[l ^ 1] for l in lanes],
        [v[l ^ 16] for l in lanes],
        [v[l ^ 4] for l in lanes],                                   # width 8
        [v[l + 1] if l + 1 < 32 else v[l] for l in lanes],           # down 1
        [v[l + 2] if l % 8 + 2 < 8 else v[l] for l in lanes],        # down 2, width 8
        [v[l - 3] if l >= 3 else v[l] for l in lanes],               # up 3
        [v[l - 1] if l % 4 >= 1 else v[l] for l in lanes],           # up 1, width 4
        [v[5] for l in lanes],                                       # from lane 5
        [v[l // 16 * 16 + (l + 3) % 16] for l in lanes],             # lane + 3, width 16
        [v[l ^ 2] if l % 2 == 0 else -1.0 for l in lanes],           # the even lanes only
        [nan if l < 16 else -1.0 for l in lanes],                    # source outside the mask
    ]
    return torch.tensor(rows)


def test_warp_shuffles_and_votes():
    values = torch.arange(32, dtype=torch.float32) * 1.5 - 7.0
    predicate = torch.tensor([1 if l % 3 == 0 else 0 for l in range(32)])
    out, votes = ops.shuffles(values, predicate)
    torch.testing.assert_close(out, _expected_shuffles(values.tolist()), equal_nan=True,
                               rtol=0, atol=0)
    ballot = sum(1 << l for l in range(32) if l % 3 == 0)
    assert votes.tolist()[0] & 0xFFFFFFFF == ballot
    assert votes.tolist()[1:] == [1, 0]


def test_shared_memory_is_poisoned_until_written():
    out = ops.shared_poison()
    assert torch.isnan(out[:64]).all(), "a read before any write must see the poison (NaN)"
    assert out[64:128].tolist() == [float(63 - t) for t in range(64)]
    assert math.isnan(out[128].item())


@pytest.mark.parametrize("blocks,threads", [(1, 1), (5, 48), (3, 1024)])
def test_blocks_have_their_own_shared_memory(blocks, threads):
    x = torch.randn(blocks * threads, generator=torch.Generator().manual_seed(blocks))
    out = ops.block_sums(x, blocks, threads)
    sums = x.double().view(blocks, threads).sum(1, keepdim=True).expand(blocks, threads)
    # A float32 sum of up to 1024 terms in another order than float64's: a few
    # units of its rounding (a block's sum can be near 0, so no relative bound).
    # Another block's values would be off by whole units.
    torch.testing.assert_close(out.double(), sums.reshape(-1), rtol=0, atol=1e-4)


# The launch limits of each variant (csrc/cuda/launch_limits.h; -1: the GPU's value).
VARIANT_LIMITS = {
    "plain": {"kMaxBlocks": -1, "kChunkEntries": -1, "kWarpRowsMin": 1},
    "grid_capped": {"kMaxBlocks": 3, "kChunkEntries": 1024, "kWarpRowsMin": 64},
    "sanitized": {"kMaxBlocks": -1, "kChunkEntries": -1, "kWarpRowsMin": -1},
}


def test_the_variant_sets_the_launch_limits():
    variant = os.environ["NANFREE_CUDA_EMULATION"]
    limits = VARIANT_LIMITS[variant]
    assert {name: ops.launch_limit(name) for name in limits} == limits
    # A problem that a GPU gives many blocks: grid_capped gives it 3.
    ops.largest_grid()
    nanfree.ops.log(torch.rand(1 << 16) + 0.5)
    if variant == "grid_capped":
        assert ops.largest_grid() == 3
    else:
        assert ops.largest_grid() > 3


def test_three_dimensional_indices():
    grid, block = [2, 3, 2], [4, 2, 3]
    out = ops.indices(grid, block).tolist()
    expected = []
    for bz in range(grid[2]):
        for by in range(grid[1]):
            for bx in range(grid[0]):
                for tz in range(block[2]):
                    for ty in range(block[1]):
                        for tx in range(block[0]):
                            expected.append([tx, ty, tz, bx, by, bz])
    assert out == expected


def test_atomics_count_every_update():
    counters, total = ops.atomics(torch.tensor([0, -1, 1000, 0, 0]), torch.tensor([1.0]))
    # 128 threads: 128 adds, the largest and smallest index, 128 increments
    # by compare-and-swap, the exchange.
    assert counters.tolist() == [128, 127, 0, 128, 7]
    assert total.item() == 1.0 + 64.0


def _misuse(name):
    code = f"import nanfree, torch\ntorch.ops.nanfree_cuda_emulation.misuse({name!r})\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120)


# name -> what the message must say (a regular expression).
MISUSE = {
    "divergent_barrier": r"divergent __syncthreads.*threads 0\.\.31 wait in __syncthreads at "
                         rf"{KERNELS}:\d+.*threads 32\.\.63 wait in __syncthreads at {KERNELS}:\d+",
    "exited_lane": r"(names lanes 0x00000080 that have exited|thread 7 .* exited while lane \d+ "
                   r"waits in __shfl_xor_sync)",
    "missing_lanes": r"names lanes 0xffff0000 that are not threads of the block \(the block has "
                     r"16 threads\)",
    "deadlock": rf"deadlock: no thread of the block can run.*__shfl_xor_sync at {KERNELS}:\d+ "
                r"with mask 0xffffffff; lanes 0x00000008 of the mask have not arrived",
    # Which of the three the emulation sees first depends on the schedule.
    "mismatched_masks": r"(lanes of warp 0 meet in different warp collectives|exited while "
                        r"lane \d+ waits in __shfl_xor_sync .* with mask 0xffffffff, which names it"
                        r"|__shfl_xor_sync at .* its mask 0xffffffff names lanes 0x0000ffff that "
                        r"have exited)",
    "launch_bounds": r"launch of 128 threads per block past the kernel's __launch_bounds__\(64\)",
    "too_many_threads": r"invalid launch at .*self_test_kernels.cu:\d+ of noop_kernel: block "
                        r"dimension x = 2048",
    "grid_too_large": r"grid dimension y = 70000 \(the device allows 1\.\.65535\)",
    "too_much_shared": r"__shared__ declaration at .*self_test_kernels.cu:\d+ brings the block's "
                       r"shared memory to 65536 static",
    "too_much_dynamic_shared": r"65536 bytes of dynamic shared memory",
}


@pytest.mark.parametrize("name", sorted(MISUSE))
def test_misuse_aborts_with_file_and_line(name):
    result = _misuse(name)
    assert result.returncode != 0, f"{name} did not abort: {result.stdout}{result.stderr}"
    assert "cuda emulation:" in result.stderr, result.stderr
    assert re.search(MISUSE[name], result.stderr, re.S), result.stderr
    # Every message names the launch (or the kernel) by file and line.
    assert re.search(rf"{KERNELS}:\d+", result.stderr), result.stderr


def _bad_calls():
    """A bad call of every family's ops, and the error type it must raise."""
    import nanfree.ops as nf

    x = torch.randn(4, 8)
    ints = torch.ones(4, 8, dtype=torch.int64)
    return {
        "softmax of integers": (TypeError, lambda: nf.softmax(ints, -1)),
        "softmax dim out of range": (IndexError, lambda: nf.softmax(x, 2)),
        "log_softmax float mask": (TypeError, lambda: nf.log_softmax(x, -1, mask=x)),
        "logsumexp mask of another shape": (ValueError,
                                            lambda: nf.logsumexp(x, -1, mask=torch.ones(3, 8) > 0)),
        "normalize eps 0": (ValueError, lambda: nf.normalize(x, eps=0.0)),
        "cosine_similarity shapes": (ValueError,
                                     lambda: nf.cosine_similarity(x, torch.randn(3, 8))),
        "cos_sim widths": (ValueError, lambda: nf.cos_sim(x, torch.randn(4, 7))),
        "gem p 0": (ValueError, lambda: nf.gem(x.abs(), 0.0)),
        "gem_pool2d of a 2-d input": (ValueError, lambda: nf.gem_pool2d(x)),
        "mnr_loss widths": (ValueError, lambda: nf.mnr_loss(x, torch.randn(4, 7))),
        "mnr_loss scale 0": (ValueError, lambda: nf.mnr_loss(x, x, scale=0.0)),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_input_fails_before_any_kernel(case):
    error, call = _bad_calls()[case]
    before = ops.launches()
    with pytest.raises(error):
        call()
    assert ops.launches() == before, f"{case}: a kernel ran before the error"
    # The counter counts: a good call launches.
    import nanfree.ops as nf

    nf.softmax(torch.randn(2, 3), -1)
    assert ops.launches() > before
