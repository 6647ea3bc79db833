"""The losses family's contract as data (docs/losses.md, DESIGN.md section 2,
"NaN-safe losses"): per loss, rows of (inputs, expected value, expected
gradients) at the points where torch's composition is NaN or infinite, and
float64 references of the plain formulas for interior points.

Expected numbers are written from the rules by hand (limits), not computed by
the code under test. MAX / -MAX stand for the largest finite value of the
dtype (a gradient that is infinite in the limit saturates to it)."""

import math

import torch

INF = math.inf
NAN = math.nan
MAX = "max"
NEG_MAX = "-max"
LOG2 = math.log(2.0)
E = math.e


def resolve(value, dtype):
    """A table entry as a float of the dtype (MAX and -MAX resolved)."""
    if value == MAX:
        return torch.finfo(dtype).max
    if value == NEG_MAX:
        return -torch.finfo(dtype).max
    return value


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def _focal_interior(x, t, alpha, gamma):
    """torchvision's sigmoid_focal_loss at an interior point, (value, d/dx, d/dt),
    evaluated with 50 significant digits (mpmath): in float64 the composition's
    1 - p_t loses digits once |x| passes a few units."""
    import mpmath

    with mpmath.workdps(50):
        def loss(xv, tv):
            p = 1 / (1 + mpmath.exp(-xv))
            ce = -(tv * mpmath.log(p) + (1 - tv) * mpmath.log(1 - p))
            p_t = p * tv + (1 - p) * (1 - tv)
            value = ce * (1 - p_t) ** gamma
            if alpha >= 0:
                value *= alpha * tv + (1 - alpha) * (1 - tv)
            return value

        xv, tv = mpmath.mpf(x), mpmath.mpf(t)
        return (float(loss(xv, tv)), float(mpmath.diff(lambda a: loss(a, tv), xv)),
                float(mpmath.diff(lambda b: loss(xv, b), tv)))


def torchvision_focal(inputs, targets, alpha, gamma):
    """torchvision.ops.sigmoid_focal_loss (reduction 'none'), written out: the
    composition nanfree's replaces (torchvision is not a dependency)."""
    p = torch.sigmoid(inputs)
    ce = torch.nn.functional.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss


# (x, t, kwargs) -> (value, d/dx, d/dt); kwargs of the nanfree.ops function.
BCE_WITH_LOGITS = [
    ((INF, 1.0, {}), (0.0, 0.0, NEG_MAX)),          # torch: NaN
    ((INF, 0.0, {}), (INF, 1.0, NEG_MAX)),
    ((-INF, 0.0, {}), (0.0, 0.0, MAX)),             # torch: NaN
    ((-INF, 1.0, {}), (INF, -1.0, MAX)),
    ((INF, 0.5, {}), (INF, 0.5, NEG_MAX)),
    ((0.0, 0.5, {}), (LOG2, 0.0, 0.0)),
    ((MAX, 1.0, {}), (0.0, 0.0, NEG_MAX)),
    ((NEG_MAX, 1.0, {}), (MAX, -1.0, MAX)),
    ((0.0, 1.0, {"pos_weight": 2.0, "weight": 0.5}), (LOG2, -0.5, 0.5 * LOG2)),
    ((-INF, 1.0, {"pos_weight": 0.0}), (0.0, 0.0, 0.0)),  # a zero weight against inf
    ((INF, 0.0, {"weight": 0.0}), (0.0, 0.0, 0.0)),
    ((NAN, 1.0, {}), (NAN, NAN, NAN)),
    ((1.0, NAN, {}), (NAN, NAN, NAN)),
]

BCE = [
    ((0.0, 0.0, {}), (0.0, 1.0, MAX)),        # 0 log 0 = 0
    ((0.0, 1.0, {}), (INF, NEG_MAX, MAX)),    # torch: 100 (log clamped at -100)
    ((1.0, 1.0, {}), (0.0, -1.0, NEG_MAX)),
    ((1.0, 0.0, {}), (INF, MAX, NEG_MAX)),
    ((0.5, 0.5, {}), (LOG2, 0.0, 0.0)),
    ((-0.5, 1.0, {}), (INF, 0.0, MAX)),       # outside [0, 1]: read at 0, the loss is flat
    ((1.5, 0.0, {}), (INF, 0.0, NEG_MAX)),
    ((0.5, 1.0, {"weight": 0.0}), (0.0, 0.0, 0.0)),
    ((NAN, 1.0, {}), (NAN, NAN, NAN)),
]

KL_DIV = [
    ((-INF, 0.0, {}), (0.0, 0.0, 1.0)),          # torch: NaN (0 * -inf)
    ((0.0, 0.0, {}), (0.0, 0.0, NEG_MAX)),       # d/dt of t log t at 0
    ((-INF, 0.5, {}), (INF, -0.5, MAX)),
    ((0.0, 1.0, {}), (0.0, -1.0, 1.0)),
    ((-1.0, -0.5, {}), (0.0, 0.0, 0.0)),         # a negative target reads as 0; flat there
    ((INF, INF, {}), (0.0, NEG_MAX, 1.0)),       # log t = x = inf: a match
    ((NAN, 0.0, {}), (NAN, NAN, NAN)),
    ((0.0, NAN, {}), (NAN, NAN, NAN)),
]

KL_DIV_LOG_TARGET = [
    ((-INF, -INF, {"log_target": True}), (0.0, 0.0, 0.0)),   # torch: NaN
    ((0.0, -INF, {"log_target": True}), (0.0, 0.0, 0.0)),
    ((-INF, 0.0, {"log_target": True}), (INF, -1.0, MAX)),
    ((0.0, 0.0, {"log_target": True}), (0.0, -1.0, 1.0)),
    ((0.0, INF, {"log_target": True}), (INF, NEG_MAX, MAX)),
    ((NAN, 0.0, {"log_target": True}), (NAN, NAN, NAN)),
]


def _focal_rows():
    rows = []
    for gamma in (0.0, 0.5, 1.0, 2.0):
        kw = {"alpha": 0.25, "gamma": gamma}
        rows += [
            ((INF, 1.0, kw), (0.0, 0.0, NEG_MAX if gamma == 0 else 0.0)),  # torchvision: NaN
            ((INF, 0.0, kw), (INF, 0.75, NEG_MAX)),
            ((-INF, 0.0, kw), (0.0, 0.0, MAX if gamma == 0 else 0.0)),
            # d/dt = S (alpha_t' + alpha_t (1 + g)) at t = 1, S -> inf: -0.25 + 0.25 g
            ((-INF, 1.0, kw), (INF, -0.25, {0.0: NEG_MAX, 0.5: NEG_MAX, 1.0: 0.0, 2.0: MAX}[gamma])),
            ((NAN, 1.0, kw), (NAN, NAN, NAN)),
        ]
    rows.append(((INF, 1.0, {"alpha": -1.0, "gamma": 2.0}), (0.0, 0.0, 0.0)))
    return rows


SIGMOID_FOCAL = _focal_rows()

# Interior points where torchvision's composition is finite in float64, each
# (x, t, alpha, gamma): the float64 composition is the reference.
FOCAL_INTERIOR = [(0.0, 1.0, 0.25, 2.0), (1.5, 0.0, 0.25, 0.5), (-2.0, 1.0, -1.0, 1.0),
                  (3.0, 0.3, 0.4, 2.0), (20.0, 1.0, 0.25, 0.5), (-30.0, 0.0, 0.25, 0.5)]


def focal_interior_expected(x, t, alpha, gamma):
    return _focal_interior(x, t, alpha, gamma)


POINTWISE = {
    "binary_cross_entropy_with_logits": BCE_WITH_LOGITS,
    "binary_cross_entropy": BCE,
    "kl_div": KL_DIV + KL_DIV_LOG_TARGET,
    "sigmoid_focal_loss": SIGMOID_FOCAL,
}

# cross_entropy rows: (logits [C], target (int or probability list), kwargs)
# -> (loss, gradient [C]). log1pe = log(1 + e).
LOG1PE = math.log1p(E)
CROSS_ENTROPY = [
    # A -inf logit with label smoothing: the smoothing mass goes to the kept classes
    # (torch: inf).
    (([0.0, -INF, 1.0], 0, {"label_smoothing": 0.1}),
     (LOG1PE - 0.05, [1 / (1 + E) - 0.95, 0.0, E / (1 + E) - 0.05])),
    # A soft target of 0 on a -inf class contributes 0 (torch: NaN).
    (([0.0, -INF, 0.0], [0.5, 0.0, 0.5], {}), (LOG2, [0.0, 0.0, 0.0])),
    # The target's logit far below: finite, the true loss.
    (([0.0, -200.0], 1, {}), (200.0, [1.0, -1.0])),
    # A masked class is a -inf one.
    (([0.0, 5.0, 1.0], 0, {"mask": [True, False, True]}),
     (LOG1PE, [1 / (1 + E) - 1.0, 0.0, E / (1 + E)])),
    # The target class masked, or no class kept: loss 0, gradient 0.
    (([0.0, 5.0, 1.0], 1, {"mask": [True, False, True]}), (0.0, [0.0, 0.0, 0.0])),
    (([-INF, -INF], 0, {}), (0.0, [0.0, 0.0])),
    (([1.0, 2.0], 0, {"mask": [False, False]}), (0.0, [0.0, 0.0])),
    (([1.0, 2.0], -100, {}), (0.0, [0.0, 0.0])),                   # ignore_index
    # A +inf logit: the +inf classes share the mass; the row is flat.
    (([INF, 0.0], 0, {}), (0.0, [0.0, 0.0])),
    (([INF, 0.0], 1, {}), (INF, [0.0, 0.0])),
    (([INF, INF, 0.0], 0, {}), (LOG2, [0.0, 0.0, 0.0])),
    # NaN in a counted row: NaN loss and gradient.
    (([NAN, 0.0], 1, {}), (NAN, [NAN, NAN])),
]
