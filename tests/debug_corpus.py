"""Seeded failures for nanfree.debug.detect_anomaly: each case puts one op that
makes NaN or inf (forward or backward) in the module `block.fault` of a small
network, and says which op that is. tests/test_debug_corpus.py checks that the
report names the op and the module in every case; run as a script, this file
prints nanfree's score beside torch.autograd.detect_anomaly's on the same
cases (docs/debug.md):

    python tests/debug_corpus.py
"""

import os
import re
import sys
import warnings
from dataclasses import dataclass, field

import torch

# A fault's input: x in [0.05, 1], [4, 8], through an identity Linear (so the
# parameters get gradients and the values stay those written here).
ROWS, COLS = 4, 8


@dataclass
class Case:
    name: str
    fault: object  # fn(module, x) -> tensor: the faulty computation
    # the producing op, as a word of its aten name ("log", "div", ...); "a|b": either
    # (the composite op the user called, as the C++ observer names it, or the op
    # it runs, as the dispatch-mode checks name it)
    op: str
    phase: str  # "forward" or "backward"
    allow: tuple = ()  # detect_anomaly's allow (an intended -inf upstream of the fault)
    upstream: float = 1.0  # the loss's incoming gradient
    notes: str = field(default="")


def _masked_scores(m, x):
    scores = x @ x.T
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool), float("-inf"))


CASES = [
    # Forward: the op's own value is NaN or inf.
    Case("log of a negative number", lambda m, x: torch.log(x - 2), "log", "forward"),
    Case("sqrt of a negative number", lambda m, x: torch.sqrt(x - 2), "sqrt", "forward"),
    Case("negative base, fractional power", lambda m, x: (x - 2) ** 2.5, "pow", "forward"),
    Case("0 / 0", lambda m, x: (x - x) / (x - x), "div", "forward"),
    Case("exp overflow", lambda m, x: torch.exp(200 * x), "exp", "forward"),
    Case("acos beyond 1", lambda m, x: torch.acos(x + 1.5), "acos", "forward"),
    Case("dirty data: an all-zero mask normalized", lambda m, x: (x * 0) / (x * 0).max(),
         "div", "forward"),
    Case("float16 overflow", lambda m, x: (x.half() + 300) * (x.half() + 300), "mul", "forward"),
    Case("float16 attention scores", lambda m, x: (300 * x.half()) @ (300 * x.half()).T,
         "matmul|mm", "forward"),
    Case("softmax of a fully masked row", lambda m, x: _masked_scores(m, x).softmax(-1),
         "softmax", "forward", allow=("masked_fill",)),
    Case("log of an underflowed sigmoid", lambda m, x: torch.log(torch.sigmoid(x - 200)), "log",
         "forward"),
    Case("division by a zero parameter", lambda m, x: x / m.zero, "div", "forward"),
    Case("cumulative sum overflow", lambda m, x: torch.cumsum(x * 2e38, 0), "cumsum", "forward"),
    Case("atan2 overflowed inputs", lambda m, x: torch.atan2(x * 1e39, x * 1e39), "mul",
         "forward"),
    # Backward: finite forward, a NaN or inf gradient.
    Case("sqrt at 0", lambda m, x: torch.sqrt(x * 0), "sqrt", "backward"),
    Case("0 * sqrt(0)", lambda m, x: torch.sqrt(x * 0) * 0, "sqrt", "backward"),
    Case("acos at 1", lambda m, x: torch.acos(x * 0 + 1), "acos", "backward"),
    Case("1 / a tiny number", lambda m, x: 1 / (x * 0 + 1e-30), "div", "backward"),
    Case("pow 0.5 at 0", lambda m, x: (x * 0) ** 0.5, "pow", "backward"),
    Case("log of a subnormal", lambda m, x: torch.log(x * 0 + 1e-45), "log", "backward"),
    Case("huge upstream gradient through a square", lambda m, x: x ** 2, "pow", "backward",
         upstream=3e38),
    Case("asin at -1", lambda m, x: torch.asin(x * 0 - 1), "asin", "backward"),
]


class Fault(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.zero = torch.nn.Parameter(torch.zeros(COLS))

    def forward(self, x):
        return self.fn(self, x)


class Block(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.proj = torch.nn.Linear(COLS, COLS)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(COLS))
            self.proj.bias.zero_()
        self.fault = Fault(fn)

    def forward(self, x):
        return self.fault(self.proj(x))


class Net(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.block = Block(fn)

    def forward(self, x):
        return self.block(x).float().sum()


def inputs():
    return torch.linspace(0.05, 1.0, ROWS * COLS).reshape(ROWS, COLS)


def run_step(case):
    """One forward+backward of the case's network (raises what the region raises)."""
    net = Net(case.fault)
    loss = net(inputs())
    loss.backward(torch.tensor(case.upstream))
    return net


def _words(text):
    """Lowercase letters only: 'aten._softmax.default' and 'SoftmaxBackward0' compare."""
    return re.sub(r"[^a-z]", "", (text or "").lower())


def _names(expected, named):
    """Whether `named` names the op `expected` (one of its "|" alternatives)."""
    return any(_words(op) in _words(named) for op in expected.split("|"))


def nanfree_report(case):
    """(op named, module named, the error) under nanfree.debug.detect_anomaly."""
    from nanfree.debug import NonFiniteError, detect_anomaly

    net = Net(case.fault)
    try:
        with detect_anomaly(model=net, allow=case.allow):
            net(inputs()).backward(torch.tensor(case.upstream))
    except NonFiniteError as error:
        named = error.op if error.phase == "forward" else error.forward_op
        return (error.phase == case.phase and _names(case.op, named),
                error.module == "block.fault", error)
    return False, False, None


def torch_report(case):
    """(op named, module named, the message) under torch.autograd.detect_anomaly:
    it names the backward node that first returned NaN; it never names a module."""
    net = Net(case.fault)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autograd.detect_anomaly():
                net(inputs()).backward(torch.tensor(case.upstream))
        except RuntimeError as error:
            match = re.search(r"Function '(\w+?)Backward\d*' returned nan", str(error))
            return bool(match) and _names(case.op, match.group(1)), False, str(error)
    return False, False, None


def main():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = []
    for case in CASES:
        ours, theirs = nanfree_report(case), torch_report(case)
        rows.append((case, ours, theirs))
    width = max(len(c.name) for c in CASES)
    print(f"{'case':<{width}}  phase     nanfree: op module   torch: op module")
    for case, (op, module, _), (t_op, t_module, _) in rows:
        print(f"{case.name:<{width}}  {case.phase:<8}  {'yes' if op else 'no':>11} "
              f"{'yes' if module else 'no':>6}   {'yes' if t_op else 'no':>9} "
              f"{'yes' if t_module else 'no':>6}")
    n = len(rows)
    print(f"\nnanfree.debug.detect_anomaly: op {sum(r[1][0] for r in rows)}/{n}, module "
          f"{sum(r[1][1] for r in rows)}/{n}; torch.autograd.detect_anomaly: op "
          f"{sum(r[2][0] for r in rows)}/{n}, module {sum(r[2][1] for r in rows)}/{n}")


if __name__ == "__main__":
    main()
