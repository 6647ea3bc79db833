"""What nanfree.debug.detect_anomaly and nanfree.optim.FiniteGuard cost, per
training step of two small models (a 4-layer transformer encoder, d 128, and a
24-layer Linear+Tanh MLP), on the benchmark suite's timing
(benchmarks/bench_common.py):

- detect_anomaly: a forward+backward step inside nanfree's region against the
  same step inside torch.autograd.detect_anomaly() (ratio = torch's time /
  nanfree's) and against the plain step (``nf/eag``: nanfree's time / eager's;
  the target, DESIGN.md section 2 and issue 20: at most 1.5x);
- FiniteGuard: a whole step (zero_grad, forward, backward, Adam) with the
  optimizer wrapped in FiniteGuard against the plain optimizer (ratio = plain
  time / guarded; the target, issue 20: the guard costs at most 3% of a step of
  the small transformer, eager and compiled: a ratio of at least 0.97), for-loop
  and fused Adam, the model eager and (the transformer, not with --quick)
  compiled with torch.compile (the guard's step is eager code either way). The
  two sides are a few percent apart: timed in pairs, a step of each in turn, and
  compared by their medians (bench_common.paired_medians; the fastest block swings
  by more than 3% on a loaded 2-core machine).

Each step enters the region (or the guard's step) anew, as a training loop
does. No torch.compile column: what is timed is a region around eager code (the
compiled FiniteGuard rows compile the model for both sides).

    python benchmarks/bench_debug.py            # default run (about two minutes on CPU,
                                                # half of it compiling the transformer)
    python benchmarks/bench_debug.py --quick    # smoke run

Writes benchmarks/results/<machine>/debug.{csv,md}.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from nanfree.debug import detect_anomaly  # noqa: E402
from nanfree.optim import FiniteGuard  # noqa: E402


def models(device):
    """[(name, model, input)] on the device: issue 20's two models, a 4-layer
    TransformerEncoder (d 128, 4 heads, batch 8 x 32) and a 24-layer
    Linear+Tanh MLP (256 wide, batch 64)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
    mlp = [m for _ in range(24) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())]
    cases = [("transformer-4x128", torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
              torch.randn(8, 32, 128)),
             ("mlp-24x256-tanh", torch.nn.Sequential(*mlp), torch.randn(64, 256))]
    return [(name, model.to(device), x.to(device)) for name, model, x in cases]


def bench_detect_anomaly(bench):
    bench.section("detect_anomaly: one forward+backward step (ms)", f"{'model':<20}",
                  extra=("eager",))
    for name, model, x in models(bench.device):
        def step():
            model(x).square().mean().backward()

        def nanfree_step():
            with detect_anomaly(model=model):
                step()

        def torch_step():
            with torch.autograd.detect_anomaly():
                step()

        bench.compare(dict(section="detect_anomaly", model=name), f"{name:<20}",
                      {"nanfree": nanfree_step, "torch": torch_step, "compile": None,
                       "eager": step}, (), "forward", 0)


def bench_finite_guard(bench):
    bench.section("FiniteGuard: one training step with Adam (ms; torch = the plain optimizer)",
                  f"{'model':<20}{'Adam':<20}")
    steps = 20 if bench.mode == "quick" else 1000 if bench.mode == "full" else 300
    cases = [(name, model, x, False) for name, model, x in models(bench.device)]
    if bench.mode != "quick":
        name, model, x = models(bench.device)[0]
        cases.append((name, model, x, True))
    for name, model, x, compiled in cases:
        forward = torch.compile(model) if compiled else model
        for fused in (False, True):
            plain = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused)
            guard = FiniteGuard(torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused),
                                log_every=10**9)

            def stepper(optimizer):
                def step():
                    optimizer.zero_grad()
                    forward(x).square().mean().backward()
                    optimizer.step()
                return step

            kind = ("fused" if fused else "for-loop") + (", compiled" if compiled else "")
            bench.compare(dict(section="FiniteGuard", model=name, variant=kind),
                          f"{name:<20}{kind:<20}",
                          {"nanfree": stepper(guard), "torch": stepper(plain), "compile": None},
                          (), "forward", 0, paired_steps=steps)


def summary(bench):
    lines = []
    anomaly = bc.select(bench.records, section="detect_anomaly")
    if anomaly:
        lines.append("detect_anomaly, per step (nanfree / eager; torch's detect_anomaly / eager):")
        for r in anomaly:
            lines.append(f"  {r['model']:<20} {r['nanfree_over_eager']:.2f}x eager "
                         f"(torch's: {r['nanfree_over_eager'] * r['ratio']:.2f}x)")
        lines.append(bc.target("detect_anomaly at most 1.5x the eager step", anomaly,
                               key="nanfree_over_eager", at_most=1.5, describe_keys=("model",)))
    guarded = bc.select(bench.records, section="FiniteGuard")
    if guarded:
        lines.append("FiniteGuard, per training step (guarded / plain optimizer):")
        for r in guarded:
            lines.append(f"  {r['model']:<20} {r['variant'] + ' Adam':<25} {r['nanfree_ms']:.2f} ms "
                         f"against {r['torch_ms']:.2f} ms: {1 / r['ratio']:.2f}x")
        transformer = [r for r in guarded if r["model"].startswith("transformer")]
        lines.append(bc.target("FiniteGuard at most 3% of the transformer's step, eager and compiled "
                               "(plain / guarded >= 0.97)",
                               transformer, at_least=0.97, describe_keys=("model", "variant")))
        lines.append(bc.target("(beyond the target) FiniteGuard at most 3% of every step", guarded,
                               at_least=0.97, describe_keys=("model", "variant")))
    return lines


def main(argv=None):
    args = bc.parser(__doc__.split("\n\n")[0]).parse_args(argv)
    args.no_compile = True  # nothing to compile: regions around eager code
    warnings.simplefilter("ignore")
    bench = bc.Bench(args, "debug")
    bench_detect_anomaly(bench)
    bench_finite_guard(bench)
    bench.finish(summary(bench))


if __name__ == "__main__":
    main()
