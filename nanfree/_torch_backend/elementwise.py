"""Mirror of csrc/include/nanfree/elementwise_math.h in plain torch operations
(same names, same rules): the elementwise family's pure-PyTorch backend, one
function per op named as the op. Both branches of a torch.where are
evaluated; these functions are never differentiated by autograd (the family's
autograd is csrc/elementwise.cpp), so an unused inf or NaN branch is harmless.
Values are computed in the accumulation dtype (float32 for float16 and
bfloat16) and rounded once, as the C++ kernels do."""

import torch

from .._ops import elementwise as _ew
from .numerics import acc_dtype, nf_largest


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
    # beyond the range (an infinite d or g): +-bound; NaN fails both tests and stays.
    return _where(masked > bound, bound, _where(masked < -bound, -bound, masked))


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
    d = _FUNCTIONS[op][order](input.to(acc))
    out = _ew.unary_output(input)
    out.copy_(chain_rule(grad.to(acc), d, nf_largest(input.dtype)))
    return out


# sqrt, sqrt_backward, log, ..., asin_backward: one function per op, named as the op.
globals().update(_ew.unary_kernels(_unary, _unary_backward))
