"""A float64 oracle of the softmax family written from DESIGN.md's rules, one row
at a time in plain Python (independent of every backend's code)."""

import math

INF = math.inf
NAN = math.nan


def row_oracle(values, keep=None):
    """softmax, log_softmax and logsumexp of one row, as Python float lists."""
    keep = keep if keep is not None else [True] * len(values)
    vals = [v if k else -INF for v, k in zip(values, keep)]
    n = len(vals)
    if any(math.isnan(v) for v in vals):
        return [NAN] * n, [NAN] * n, NAN
    if all(v == -INF for v in vals):
        return [0.0] * n, [-INF] * n, -INF
    k = sum(v == INF for v in vals)
    if k:
        soft = [1.0 / k if v == INF else 0.0 for v in vals]
        log = [-math.log(k) if v == INF else -INF for v in vals]
        return soft, log, INF
    m = max(vals)
    s = math.fsum(math.exp(v - m) for v in vals)
    soft = [math.exp(v - m) / s for v in vals]
    log = [(v - m) - math.log(s) if v != -INF else -INF for v in vals]
    return soft, log, m + math.log(s)


def row_grad_oracle(op, values, keep, grad):
    """Input gradient of one row for an incoming gradient (a list, or a float for logsumexp)."""
    keep = keep if keep is not None else [True] * len(values)
    vals = [v if k else -INF for v, k in zip(values, keep)]
    n = len(vals)
    soft, _, lse = row_oracle(values, keep)
    if math.isinf(lse):
        return [0.0] * n  # empty rows and rows holding +inf pass no gradient
    if op == "softmax":
        dot = math.fsum(g * y for g, y in zip(grad, soft))
        return [y * (g - dot) for g, y in zip(grad, soft)]
    if op == "log_softmax":
        total = math.fsum(g for g, k in zip(grad, keep) if k)
        return [g - y * total if k else 0.0 for g, y, k in zip(grad, soft, keep)]
    return [grad * y if k else 0.0 for y, k in zip(soft, keep)]
