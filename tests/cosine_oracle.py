"""A float64 oracle of the cosine family written from DESIGN.md's rules, one
vector at a time in plain Python (independent of every backend's code). A
vector's norm is kept as m * h with m its largest magnitude and h the norm of
v / m (math.hypot), so it neither overflows nor underflows even where the
norm itself is beyond float64."""

import math

INF = math.inf
NAN = math.nan


def _state(values):
    """('nan' | 'inf' | 'finite', m, h): the norm is m * h (m = 0 for a zero vector)."""
    if any(math.isnan(v) for v in values):
        return "nan", NAN, NAN
    if any(math.isinf(v) for v in values):
        return "inf", INF, INF
    m = max((abs(v) for v in values), default=0.0)
    if m == 0:
        return "finite", 0.0, 0.0
    return "finite", m, math.hypot(*(v / m for v in values))


def _at_least_eps(m, h, eps):
    # m * h >= eps, compared as h >= eps / m (eps / m may overflow to inf: False).
    return m > 0 and h >= eps / m


def normalize(values, eps):
    """x / max(norm, eps); NaN vector -> NaN; +-inf entries -> their limit direction."""
    kind, m, h = _state(values)
    if kind == "nan":
        return [NAN] * len(values)
    if kind == "inf":
        k = sum(math.isinf(v) for v in values)
        return [math.copysign(1.0, v) / math.sqrt(k) if math.isinf(v) else 0.0 for v in values]
    if _at_least_eps(m, h, eps):
        return [(v / m) / h for v in values]
    return [v / eps for v in values]


def _live(values, eps):
    """Whether the vector passes a gradient: finite, with norm >= eps."""
    kind, m, h = _state(values)
    return kind == "finite" and _at_least_eps(m, h, eps)


def normalize_grad(values, eps, grad):
    """d normalize for incoming grad: (g - y * (y . g)) / norm; 0 below eps and for
    zero and infinite vectors; NaN for a NaN vector."""
    kind, m, h = _state(values)
    if kind == "nan":
        return [NAN] * len(values)
    if not _live(values, eps):
        return [0.0] * len(values)
    y = normalize(values, eps)
    dot = math.fsum(g * v for g, v in zip(grad, y))
    return [((g - v * dot) / h) / m for g, v in zip(grad, y)]


def cosine(a, b, eps):
    """The similarity of the normalized vectors, clamped to [-1, 1]; NaN with a NaN entry."""
    if _state(a)[0] == "nan" or _state(b)[0] == "nan":
        return NAN
    c = math.fsum(x * y for x, y in zip(normalize(a, eps), normalize(b, eps)))
    return max(-1.0, min(1.0, c))


def cosine_grads(a, b, eps, grad):
    """(d/da, d/db) of cosine(a, b) * grad: g * (v_b - c * v_a) / norm_a for a live a, else 0."""
    c = cosine(a, b, eps)
    if math.isnan(c):
        return [NAN] * len(a), [NAN] * len(b)
    va, vb = normalize(a, eps), normalize(b, eps)

    def side(x, v_self, v_other):
        if not _live(x, eps):
            return [0.0] * len(x)
        _, m, h = _state(x)
        return [grad * (((o - c * s) / h) / m) for s, o in zip(v_self, v_other)]

    return side(a, va, vb), side(b, vb, va)
