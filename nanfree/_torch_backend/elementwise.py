"""Mirror of csrc/include/nanfree/elementwise_math.h and
elementwise_binary_math.h in plain torch operations (same names, same
rules): the elementwise family's pure-PyTorch backend, one function per op
named as the op. Both branches of a torch.where are evaluated; these
functions are never differentiated by autograd (the family's autograd is
csrc/elementwise.cpp and elementwise_binary.cpp), so an unused inf or NaN branch is harmless.
Values are computed in the accumulation dtype (float32 for float16 and
bfloat16) and rounded once, as the C++ kernels do."""

import torch

from .._ops import elementwise as _ew
from .numerics import acc_dtype, nf_largest, saturate


def _where(cond, a, b):
    return torch.where(cond, a, b)


# --- the header's functions, by name ----------------------------------------------


def sqrt_domain(x):
    return _where(x < 0, 0.0, x)  # below the domain: sqrt(0) (rule 2)


def sqrt_value(x):
    return torch.sqrt(sqrt_domain(x))


def sqrt_derivative(x):
    # x < 0: outside the domain (rule 2); x == 0: 1 / (2 sqrt(0)) is infinite (rule 3).
    return _where(x <= 0, 0.0, 0.5 / torch.sqrt(x))


def sqrt_second_derivative(x):
    return _where(x <= 0, 0.0, -0.25 / (x * torch.sqrt(x)))  # 0 where the derivative is


def log_domain(x):
    return _where(x < 0, 0.0, x)  # below the domain: log(0) = -inf (rule 2)


def log_value(x):
    return torch.log(log_domain(x))


def log_derivative(x):
    return _where(x <= 0, 0.0, 1.0 / x)  # outside the domain, or 1/0 (rules 2 and 3)


def log_second_derivative(x):
    return _where(x <= 0, 0.0, -1.0 / (x * x))  # 0 where the derivative is


def log1p_domain(x):
    return _where(x < -1, -1.0, x)  # below the domain: log1p(-1) = -inf (rule 2)


def log1p_value(x):
    return torch.log1p(log1p_domain(x))


def log1p_derivative(x):
    return _where(x <= -1, 0.0, 1.0 / (x + 1))  # outside the domain, or 1/0 (rules 2 and 3)


def log1p_second_derivative(x):
    u = x + 1
    return _where(x <= -1, 0.0, -1.0 / (u * u))  # 0 where the derivative is


def unit_clamp(x):
    """x clamped to [-1, 1]; NaN stays NaN."""
    return _where(x < -1, -1.0, _where(x > 1, 1.0, x))


def unit_rsqrt(x):
    return 1.0 / torch.sqrt((1 - x) * (1 + x))  # exact 1 -+ x near +-1


def acos_domain(x):
    return unit_clamp(x)  # beyond +-1: acos of +-1 (rule 2)


def acos_value(x):
    return torch.acos(acos_domain(x))


def acos_derivative(x):
    # |x| > 1: outside the domain; |x| == 1: -1 / sqrt(0) is infinite (rules 2 and 3).
    return _where(x.abs() >= 1, 0.0, -unit_rsqrt(x))


def acos_second_derivative(x):
    outside = x.abs() >= 1  # 0 where the derivative is
    r = unit_rsqrt(_where(outside, 0.0, x))
    return _where(outside, 0.0, -x * r * r * r)


def asin_domain(x):
    return unit_clamp(x)  # beyond +-1: asin of +-1 (rule 2)


def asin_value(x):
    return torch.asin(asin_domain(x))


def asin_derivative(x):
    return _where(x.abs() >= 1, 0.0, unit_rsqrt(x))  # as acos's (rules 2 and 3)


def asin_second_derivative(x):
    outside = x.abs() >= 1  # 0 where the derivative is
    r = unit_rsqrt(_where(outside, 0.0, x))
    return _where(outside, 0.0, x * r * r * r)


def chain_rule(g, d, bound):
    """g * d: 0 where d or g is 0 and neither is NaN (a derivative counted 0 stays 0
    against an infinite g; a zero g against an infinite d), saturated to +-bound
    (rule 5); NaN g or d gives NaN (rule 7)."""
    zero = ((d == 0) | (g == 0)) & ~torch.isnan(d) & ~torch.isnan(g)
    masked = _where(zero, 0.0, g * d)
    # beyond the range (an infinite d or g): +-bound; NaN stays.
    return saturate(masked, bound)


def log_gradient(g, x, bound):
    """chain_rule(g, log_derivative(x), bound) as g / x (one rounding): 0 where the
    derivative is 0 (x <= 0; x beyond bound is +inf) unless g is NaN (an infinite g
    would make inf / inf), else g / x saturated (rule 5); NaN passes (rule 7)."""
    zero = ((x <= 0) | (x > bound)) & ~torch.isnan(g)
    return saturate(_where(zero, 0.0, g / x), bound)


_FUNCTIONS = {
    op: (globals()[f"{op}_value"], globals()[f"{op}_derivative"],
         globals()[f"{op}_second_derivative"])
    for op in _ew.UNARY_OPS
}


def _unary(op, input):
    x = _ew.unary_operand(op, input)
    out = _ew.unary_output(x)
    out.copy_(_FUNCTIONS[op][0](x.to(acc_dtype(x.dtype))))
    return out


def _unary_backward(op, grad, input, order=1):
    _ew.check_unary_backward(op, grad, input, order)
    acc = acc_dtype(input.dtype)
    out = _ew.unary_output(input)
    bound = nf_largest(input.dtype)
    if op == "log" and order == 1:
        out.copy_(log_gradient(grad.to(acc), input.to(acc), bound))
        return out
    d = _FUNCTIONS[op][order](input.to(acc))
    out.copy_(chain_rule(grad.to(acc), d, bound))
    return out


# sqrt, sqrt_backward, log, ..., asin_backward: one function per op, named as the op.
globals().update(_ew.unary_kernels(_unary, _unary_backward))


# --- the binary ops: elementwise_binary_math.h, by name -----------------------------


def propagate_nan(a, b, r):
    """r where neither input is NaN, else NaN (rule 7, before every other rule)."""
    return _where(~torch.isnan(a) & ~torch.isnan(b), r, a + b)


def is_infinite(x):
    return torch.isinf(x)


def zero_dominant_product(a, b):
    """a * b, 0 where a factor is 0 and neither is NaN (inf * 0 counts 0)."""
    zero = ((a == 0) | (b == 0)) & ~torch.isnan(a) & ~torch.isnan(b)
    return _where(zero, 0.0, a * b)


def pow_outside(a, b):
    """A negative base has a real power only at an integer exponent (+-inf counts)."""
    return (a < 0) & (torch.floor(b) != b)


def pow_domain(a, b):
    return _where(pow_outside(a, b), 0.0, a)  # no real power: the base clamped to 0 (rule 2)


def pow_of_zero(b):
    """pow(0, b) for a non-integer b: 0 above 0, +inf below."""
    return _where(b > 0, 0.0, torch.inf)


def pow_value(a, b):
    # C's pow of the inputs, then outside the domain pow(0, b) (rule 2) and NaN
    # inputs NaN (rule 7).
    return propagate_nan(a, b, _where(pow_outside(a, b), pow_of_zero(b), torch.pow(a, b)))


def pow_da(a, b):
    d = zero_dominant_product(b, torch.pow(pow_domain(a, b), b - 1))  # b a^(b-1)
    # Outside the domain (rule 2); at a == 0 below b = 1 the derivative is infinite (rule 3).
    return propagate_nan(a, b, _where(pow_outside(a, b) | ((a == 0) & (b < 1)), 0.0, d))


def pow_db(a, b):
    d = zero_dominant_product(torch.pow(a, b), torch.log(a))  # a^b log(a)
    return propagate_nan(a, b, _where(a <= 0, 0.0, d))  # rules 4 (a == 0) and 2 (a < 0)


def pow_daa(a, b):
    d = zero_dominant_product(b * (b - 1), torch.pow(pow_domain(a, b), b - 2))
    # Outside the domain; at a == 0 below b = 2 infinite or counted 0 (rules 2 and 3).
    return propagate_nan(a, b, _where(pow_outside(a, b) | ((a == 0) & (b < 2)), 0.0, d))


def pow_dab(a, b):
    d = zero_dominant_product(torch.pow(a, b - 1), 1 + zero_dominant_product(b, torch.log(a)))
    return propagate_nan(a, b, _where(a <= 0, 0.0, d))  # as pow_db (rules 2 and 4)


def pow_dbb(a, b):
    log_a = torch.log(a)
    d = zero_dominant_product(torch.pow(a, b), log_a * log_a)
    return propagate_nan(a, b, _where(a <= 0, 0.0, d))  # as pow_db (rules 2 and 4)


def atan2_scale(a, b):
    s = torch.maximum(a.abs(), b.abs())
    # the origin and infinite inputs: derivatives 0 (rule 3, torch's; the limit)
    return _where((s == 0) | is_infinite(s), 0.0, s)


def atan2_value(a, b):
    return torch.atan2(a, b)  # C's atan2: defined at the origin and at infinities


def atan2_derivative(a, b, which):
    s = atan2_scale(a, b)
    safe = _where(s == 0, 1.0, s)  # the origin and infinities: 0 below
    x, y = a / safe, b / safe
    r = x * x + y * y
    if which == 0:
        d = y / r / safe
    elif which == 1:
        d = -x / r / safe
    elif which == 2:
        d = -2 * x * y / (r * r) / safe / safe
    elif which == 3:
        d = (x - y) * (x + y) / (r * r) / safe / safe
    else:
        d = 2 * x * y / (r * r) / safe / safe
    return propagate_nan(a, b, _where(s == 0, 0.0, d))  # origin or infinity: 0


def atan2_da(a, b):
    return atan2_derivative(a, b, 0)


def atan2_db(a, b):
    return atan2_derivative(a, b, 1)


def atan2_daa(a, b):
    return atan2_derivative(a, b, 2)


def atan2_dab(a, b):
    return atan2_derivative(a, b, 3)


def atan2_dbb(a, b):
    return atan2_derivative(a, b, 4)


def div_no_nan_zero(a, b):
    """b == 0 (rule 4), or inf / inf (no limit): 0 with every derivative."""
    return (b == 0) | (is_infinite(a) & is_infinite(b))


def div_no_nan_value(a, b):
    return propagate_nan(a, b, _where(div_no_nan_zero(a, b), 0.0, a / b))  # rule 4


def div_no_nan_da(a, b):
    return propagate_nan(a, b, _where(div_no_nan_zero(a, b), 0.0, 1 / b))  # rule 4


def div_no_nan_db(a, b):
    return propagate_nan(a, b, _where(div_no_nan_zero(a, b), 0.0, -(a / b) / b))  # rule 4


def div_no_nan_daa(a, b):
    return propagate_nan(a, b, torch.zeros_like(a + b))  # linear in a


def div_no_nan_dab(a, b):
    return propagate_nan(a, b, _where(div_no_nan_zero(a, b), 0.0, -(1 / b) / b))


def div_no_nan_dbb(a, b):
    return propagate_nan(a, b, _where(div_no_nan_zero(a, b), 0.0, 2 * (a / b) / b / b))


def xlog_value(a, log_b):
    return zero_dominant_product(a, log_b)  # 0 at a == 0 (rule 4) and along L(b) == 0


def xlog_da(b, shift, log_b):
    return _where(b <= shift, 0.0, log_b)  # at and below the edge (rules 2 and 3)


def xlog_zero(a, b, shift):
    """At and below the edge, a == 0 (rule 4), both infinite (no limit)."""
    return (b <= shift) | (a == 0) | (is_infinite(a) & is_infinite(b))


def xlogy_value(a, b):
    # below the domain: log(0) = -inf (rule 2)
    return propagate_nan(a, b, xlog_value(a, torch.log(_where(b < 0, 0.0, b))))


def xlogy_da(a, b):
    return propagate_nan(a, b, xlog_da(b, 0, torch.log(b)))


def xlogy_db(a, b):
    return propagate_nan(a, b, _where(xlog_zero(a, b, 0), 0.0, a / b))


def xlogy_daa(a, b):
    return propagate_nan(a, b, torch.zeros_like(a + b))  # linear in a


def xlogy_dab(a, b):
    return propagate_nan(a, b, _where(b <= 0, 0.0, 1 / b))  # as xlogy_da's edge


def xlogy_dbb(a, b):
    return propagate_nan(a, b, _where(xlog_zero(a, b, 0), 0.0, -(a / b) / b))


def xlog1py_value(a, b):
    # below the domain: log1p(-1) = -inf (rule 2)
    return propagate_nan(a, b, xlog_value(a, torch.log1p(_where(b < -1, -1.0, b))))


def xlog1py_da(a, b):
    return propagate_nan(a, b, xlog_da(b, -1, torch.log1p(b)))


def xlog1py_db(a, b):
    return propagate_nan(a, b, _where(xlog_zero(a, b, -1), 0.0, a / (b + 1)))


def xlog1py_daa(a, b):
    return propagate_nan(a, b, torch.zeros_like(a + b))  # linear in a


def xlog1py_dab(a, b):
    return propagate_nan(a, b, _where(b <= -1, 0.0, 1 / (b + 1)))  # as xlog1py_da's edge


def xlog1py_dbb(a, b):
    u = b + 1
    return propagate_nan(a, b, _where(xlog_zero(a, b, -1), 0.0, -(a / u) / u))


# op -> its functions by (order, partial)
_BINARY_FUNCTIONS = {
    op: {(0, 0): globals()[f"{op}_value"], (1, 0): globals()[f"{op}_da"],
         (1, 1): globals()[f"{op}_db"], (2, 0): globals()[f"{op}_daa"],
         (2, 1): globals()[f"{op}_dab"], (2, 2): globals()[f"{op}_dbb"]}
    for op in _ew.BINARY_OPS
}


def _binary(op, input, other):
    a, b = _ew.binary_operands(op, input, other)
    acc = acc_dtype(a.dtype)
    out = _ew.binary_output(a, b)
    out.copy_(_BINARY_FUNCTIONS[op][0, 0](a.to(acc), b.to(acc)))
    return out


def _binary_backward(op, grad, input, other, order=1, partial=0):
    _ew.check_binary_backward(op, grad, input, other, order, partial)
    acc = acc_dtype(input.dtype)
    d = _BINARY_FUNCTIONS[op][order, partial](input.to(acc), other.to(acc))
    out = _ew.binary_output(grad, input, other)
    out.copy_(chain_rule(grad.to(acc), d.expand(grad.shape), nf_largest(input.dtype)))
    return out


def _binary_gradients(op, grad, input, other):
    _ew.check_binary_gradient_operands(op, f"{op}_gradients", grad, input, other)
    acc = acc_dtype(input.dtype)
    a, b, g = input.to(acc), other.to(acc), grad.to(acc)
    bound = nf_largest(input.dtype)
    outs = []
    for partial in (0, 1):
        out = _ew.binary_output(grad, input, other)
        out.copy_(chain_rule(g, _BINARY_FUNCTIONS[op][1, partial](a, b).expand(grad.shape), bound))
        outs.append(out)
    return tuple(outs)


# pow, pow_backward, pow_gradients, ..., xlog1py_gradients: one function per op, named as the op.
globals().update(_ew.binary_kernels(_binary, _binary_backward, _binary_gradients))
