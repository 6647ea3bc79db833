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


# --- the binary ops: (value, d/da, d/db, d2/da2, d2/dadb, d2/db2) at (a, b) -----------

NAN6 = (NAN,) * 6
ZERO5 = (0.0,) * 5


def _is_int(p):
    """An integer exponent (+-inf counts: C's pow is defined there)."""
    return math.isinf(p) or p == math.floor(p)


def _odd(p):
    return math.isfinite(p) and p == math.floor(p) and math.fmod(p, 2.0) != 0


def _pow(x, p):
    """C's pow in float64, infinite where Python's raises."""
    try:
        return math.pow(x, p)
    except OverflowError:
        return -INF if x < 0 and _odd(p) else INF
    except ValueError:  # 0 to a negative power
        return -INF if math.copysign(1.0, x) < 0 and _odd(p) else INF


def _zd(x, y):
    """x * y with zeros dominant (a factor the rules count 0 against an infinite one)."""
    return 0.0 if x == 0 or y == 0 else x * y


def _log(x):
    return -INF if x == 0 else math.log(x)


def pow(a, p):
    if _nan(a) or _nan(p):
        return NAN6
    outside = a < 0 and not _is_int(p)  # no real power: the base clamped to 0 (rule 2)
    base = 0.0 if outside else a
    value = _pow(base, p)
    da = 0.0 if outside or (base == 0 and p < 1) else _zd(p, _pow(base, p - 1))
    daa = 0.0 if outside or (base == 0 and p < 2) else _zd(p * (p - 1), _pow(base, p - 2))
    if a <= 0:  # rule 4 at 0, rule 2 below
        return value, da, 0.0, daa, 0.0, 0.0
    la = _log(a)
    return (value, da, _zd(_pow(a, p), la), daa, _zd(_pow(a, p - 1), 1.0 + _zd(p, la)),
            _zd(_pow(a, p), la * la))


def atan2(a, b):
    if _nan(a) or _nan(b):
        return NAN6
    value = math.atan2(a, b)
    s = max(abs(a), abs(b))
    if s == 0 or math.isinf(s):  # the origin (torch's 0) and infinite inputs (the limit)
        return (value,) + ZERO5
    x, y = a / s, b / s
    r = x * x + y * y
    return (value, y / r / s, -x / r / s, -2 * x * y / (r * r) / s / s,
            (x * x - y * y) / (r * r) / s / s, 2 * x * y / (r * r) / s / s)


def div_no_nan(a, b):
    if _nan(a) or _nan(b):
        return NAN6
    if b == 0 or (math.isinf(a) and math.isinf(b)):  # rule 4; inf / inf has no limit
        return (0.0,) + ZERO5
    q = a / b
    return q, 1.0 / b, -q / b, 0.0, -1.0 / b / b, 2.0 * q / b / b


def _xlog(a, b, shift, log):
    if _nan(a) or _nan(b):
        return NAN6
    lb = log(max(b, shift))  # below the domain: L of the edge, -inf (rule 2)
    value = _zd(a, lb)  # 0 at a == 0 (rule 4) and where L(b) == 0
    if b <= shift:  # at and below the edge (rules 2 and 3)
        return value, 0.0, 0.0, 0.0, 0.0, 0.0
    u = b - shift
    zero = a == 0 or (math.isinf(a) and math.isinf(b))  # rule 4; no limit
    return (value, lb, 0.0 if zero else a / u, 0.0, 1.0 / u, 0.0 if zero else -(a / u) / u)


def xlogy(a, b):
    return _xlog(a, b, 0.0, _log)


def xlog1py(a, b):
    return _xlog(a, b, -1.0, lambda v: -INF if v == -1 else math.log1p(v))


BINARY = {"pow": pow, "atan2": atan2, "div_no_nan": div_no_nan, "xlogy": xlogy,
          "xlog1py": xlog1py}
