"""Float64 oracle of the elementwise family's rules (DESIGN.md section 2,
docs/elementwise.md), written from the rules with Python's math module, one
value at a time, independently of every backend: the value, derivative and
second derivative of each unary op at x."""

import math

INF = math.inf
NAN = math.nan


def _nan(x):
    return x != x


def _div(a, b):
    """a / b in float64, infinite (not an exception) when b underflowed to 0."""
    return a / b if b != 0 else math.copysign(INF, a) * math.copysign(1.0, b)


def sqrt(x):
    if _nan(x):
        return NAN, NAN, NAN
    if x <= 0:  # below the domain: sqrt(0) (rule 2); at 0 the derivative is infinite (rule 3)
        return 0.0, 0.0, 0.0
    if x == INF:
        return INF, 0.0, 0.0
    return math.sqrt(x), _div(0.5, math.sqrt(x)), _div(-0.25, x * math.sqrt(x))


def log(x):
    if _nan(x):
        return NAN, NAN, NAN
    if x <= 0:
        return -INF, 0.0, 0.0
    if x == INF:
        return INF, 0.0, 0.0
    return math.log(x), _div(1.0, x), _div(-1.0, x * x)


def log1p(x):
    if _nan(x):
        return NAN, NAN, NAN
    if x <= -1:
        return -INF, 0.0, 0.0
    if x == INF:
        return INF, 0.0, 0.0
    return math.log1p(x), _div(1.0, 1.0 + x), _div(-1.0, (1.0 + x) * (1.0 + x))


def _unit(x, value):
    if _nan(x):
        return NAN, NAN, NAN
    if x >= 1:
        return value(1.0), 0.0, 0.0
    if x <= -1:
        return value(-1.0), 0.0, 0.0
    return None


def acos(x):
    edge = _unit(x, math.acos)
    if edge is not None:
        return edge
    s = 1.0 - x * x
    return math.acos(x), _div(-1.0, math.sqrt(s)), _div(-x, s * math.sqrt(s))


def asin(x):
    edge = _unit(x, math.asin)
    if edge is not None:
        return edge
    s = 1.0 - x * x
    return math.asin(x), _div(1.0, math.sqrt(s)), _div(x, s * math.sqrt(s))


UNARY = {"sqrt": sqrt, "log": log, "log1p": log1p, "acos": acos, "asin": asin}


def chain(g, d, bound):
    """The gradient g * d under the rules: 0 where d or g is 0 (neither NaN),
    saturated to +-bound, NaN with a NaN factor."""
    if _nan(g) or _nan(d):
        return NAN
    if d == 0 or g == 0:
        return 0.0
    p = g * d
    return max(-bound, min(bound, p))
