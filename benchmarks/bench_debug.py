"""What nanfree.debug.detect_anomaly and nanfree.optim.FiniteGuard cost: forward+
backward steps of two small models eager, under torch.autograd.detect_anomaly
and under nanfree's; then whole training steps (forward, backward, Adam) with
the plain optimizer and wrapped in FiniteGuard (for-loop Adam: restored from a
copy where skipped; fused Adam: its found_inf flag). Timed alternately, best of
--rounds rounds of --steps steps each.

    python benchmarks/bench_debug.py [--rounds 5] [--steps 5]
"""

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanfree.debug import detect_anomaly  # noqa: E402
from nanfree.optim import FiniteGuard  # noqa: E402


def models():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    mlp = [m for _ in range(24) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())]
    return {
        "2-layer transformer encoder, d 64, batch 8 x 32": (
            torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.randn(8, 32, 64)),
        "24-layer MLP, 256 wide, batch 64": (torch.nn.Sequential(*mlp), torch.randn(64, 256)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per step "
          "(ratio to eager)")
    for name, (model, x) in models().items():
        sides = {"eager": lambda: torch.enable_grad(),
                 "torch.autograd.detect_anomaly": lambda: torch.autograd.detect_anomaly(),
                 "nanfree.debug.detect_anomaly": lambda model=model: detect_anomaly(model=model)}
        best = {}
        for _ in range(args.rounds):
            for side, region in sides.items():
                with region():
                    model(x).square().mean().backward()  # warm-up
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        model(x).square().mean().backward()
                    elapsed = (time.perf_counter() - start) / args.steps
                best[side] = min(best.get(side, float("inf")), elapsed)
        print(name)
        for side, seconds in best.items():
            print(f"  {side:<30} {seconds * 1e3:8.2f} ms  {seconds / best['eager']:5.1f}x")
        print(f"  training steps (ms per step, ratio to the plain optimizer's)")
        for fused in (False, True):
            plain = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused)
            guard = FiniteGuard(torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused),
                                log_every=100)
            steppers = {"Adam": plain, "FiniteGuard(Adam)": guard}
            best = {}
            for _ in range(args.rounds):
                for side, optimizer in steppers.items():
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        optimizer.zero_grad()
                        model(x).square().mean().backward()
                        optimizer.step()
                    elapsed = (time.perf_counter() - start) / args.steps
                    best[side] = min(best.get(side, float("inf")), elapsed)
            kind = "fused" if fused else "for-loop"
            for side, seconds in best.items():
                print(f"    {side + ' ' + kind:<28} {seconds * 1e3:8.2f} ms  "
                      f"{seconds / best['Adam']:6.3f}x")


if __name__ == "__main__":
    main()
