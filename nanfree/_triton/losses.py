"""Triton kernels of the losses family: pointwise_loss (binary_cross_entropy_with_logits,
binary_cross_entropy, kl_div, sigmoid_focal_loss), cross_entropy and their
backward ops, mirroring csrc/include/nanfree/losses_math.h by name, one
launcher per op named as the op (csrc/registration.cpp), each calling the
checks of nanfree/_ops/losses.py first.

Everything is computed in float32 (float64 for float64 input) and rounded once
to the output's dtype. alpha, gamma and label_smoothing come in as float64
arguments and are rounded to that dtype first, as the C++ kernels do.

- pointwise_loss(_backward): one flat kernel over the contiguous input and
  target (KIND and PARTIAL constexpr). weight, pos_weight and grad are absent
  (read as 1, a constexpr flag), one element (read at every position, step 0)
  or a contiguous copy expanded to the input's shape. The output is contiguous
  in the input's dtype; the backward is saturated to the dtype's largest finite
  value (loss_chain_rule).
- cross_entropy(_backward): logits [outer, C, inner], one program per
  (o, BLOCK_I consecutive positions i), tiles [BLOCK_C, BLOCK_I] (BLOCK_I = 1
  for inner == 1, a row of contiguous classes). The forward loops over the
  classes twice: the online logsumexp of the kept classes (numerics.py's
  lse_tile_state_axis0 and lse_merge, the mirror of LseState) and their count,
  then the q-weighted sums (forward_scalar of csrc/cpu/losses_cross_entropy.cpp;
  a class-index target without label smoothing needs only its own class). The
  mask is read through its strides (an expanded view has step 0). The backward
  is one loop over the classes from the saved statistics.

The kernels run where the Triton of this process can run them: CPU tensors
when they were defined under Triton's interpreter (TRITON_INTERPRET=1), CUDA
tensors when compiled; any other tensor is refused with
BackendUnavailableError before anything is launched (common.py).
"""

import torch
import triton
import triton.language as tl

from .._ops import losses as _losses
from .._ops.common import acc_dtype, is_dense
from . import common
from .common import device_guard
from .element_io import ieee_div, load_acc, store_rounded
from .numerics import (COMPILED, largest_finite, lse_merge, lse_tile_state_axis0, nf_exp, nf_log,
                       nf_log1p, nf_pow, saturate)

_BLOCK = 1024  # elements per program of the pointwise kernel
# Cross entropy (module attributes, so tests may shrink them to reach the loops):
# positions i per program (inner > 1) and entries per tile.
CE_BLOCK_I = 64
CE_TILE = 4096

_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}
_INF = tl.constexpr(float("inf"))


# --- losses_math.h, by name -------------------------------------------------------------


@triton.jit
def _isnan(x):
    return x != x


@triton.jit
def loss_product(a, b):
    # a * b where an exact 0 factor wins against an infinite one (a term of weight
    # 0 contributes 0 even where its log is infinite); NaN stays NaN.
    # (Nested wheres: a factor may be 0-d, and the interpreter cannot `|` a 0-d
    # bool with a tensor.)
    r = tl.where(a == 0, 0.0, tl.where(b == 0, 0.0, a * b))
    return tl.where(_isnan(a), a + b, tl.where(_isnan(b), a + b, r))


@triton.jit
def softplus_pair(x):
    # (softplus(x), softplus(-x)) from one exp and one log1p.
    l = nf_log1p(nf_exp(-tl.abs(x)))
    return tl.where(x > 0, x, 0.0) + l, tl.where(x < 0, -x, 0.0) + l


@triton.jit
def sigmoid_pair(x):
    # (sigmoid(x), sigmoid(-x)) from one exp: 1 / (1 + e) and e / (1 + e), e = exp(-|x|).
    e = nf_exp(-tl.abs(x))
    big = ieee_div(1.0, 1.0 + e)
    small = e * big
    return tl.where(x < 0, small, big), tl.where(x < 0, big, small)


# binary_cross_entropy_with_logits


@triton.jit
def bce_with_logits_value(x, t, w, pw):
    # Each term weighted by its own coefficient: at x = +-inf the term whose
    # coefficient is 0 (the target agrees) is 0 instead of 0 * inf = NaN.
    sp_pos, sp_neg = softplus_pair(x)
    loss = loss_product(pw * t, sp_neg) + loss_product(1.0 - t, sp_pos)
    return loss_product(w, loss)


@triton.jit
def bce_with_logits_grad_input(x, t, w, pw):
    sig, sig_neg = sigmoid_pair(x)
    d = (1.0 - t) * sig - pw * t * sig_neg
    return loss_product(w, d)


@triton.jit
def bce_with_logits_grad_target(x, t, w, pw):
    # A weight pw of 0 contributes 0 against softplus(-x) = inf at x = -inf.
    sp_pos, sp_neg = softplus_pair(x)
    d = loss_product(w, loss_product(pw, sp_neg) - sp_pos)
    return tl.where(_isnan(t), t, d)  # t is not read, but a NaN target gives NaN


# binary_cross_entropy


@triton.jit
def probability_in_domain(p):
    # Outside [0, 1]: the nearest bound (the domain rule); NaN stays NaN.
    return tl.where(p < 0, 0.0, tl.where(p > 1, 1.0, p))


@triton.jit
def bce_value(x, t, w, pw):
    # Not clamped at -100: p = 0 or 1 against a target that disagrees is +inf, one
    # that agrees gives 0 (0 log 0 = 0, loss_product).
    p = probability_in_domain(x)
    loss = loss_product(t, -nf_log(p)) + loss_product(1.0 - t, -nf_log1p(-p))
    return loss_product(w, loss)


@triton.jit
def bce_grad_input(x, t, w, pw):
    # Each term is 0 where its coefficient is (0 / 0 at p = 0, t = 0 is its limit 0).
    low = tl.where(t == 0, 0.0, ieee_div(-t, x))
    high = tl.where(t == 1, 0.0, ieee_div(1.0 - t, 1.0 - x))
    d = loss_product(w, low + high)
    # Outside the domain the loss does not move.
    return tl.where((x < 0) | (x > 1), 0.0, d)


@triton.jit
def bce_grad_target(x, t, w, pw):
    # +inf at p = 0, -inf at p = 1 (saturated by loss_chain_rule).
    p = probability_in_domain(x)
    d = loss_product(w, nf_log1p(-p) - nf_log(p))
    return tl.where(_isnan(t), t, d)  # t is not read, but a NaN target gives NaN


# kl_div


@triton.jit
def target_in_domain(t):
    return tl.where(t < 0, 0.0, t)  # a negative target is read as 0 (the domain rule)


@triton.jit
def log_ratio(log_t, x):
    # log t and x the same infinity: the input matches the target, 0 (not inf - inf).
    return tl.where(log_t == x, 0.0, log_t - x)


@triton.jit
def kl_div_value(x, t, w, pw):
    td = target_in_domain(t)
    # A zero target contributes 0 whatever x (0 log 0 = 0, and 0 * -inf = 0); t = x =
    # +inf is a match (log_ratio 0), where inf * 0 is 0 (loss_product).
    v = tl.where(td == 0, 0.0, loss_product(td, log_ratio(nf_log(td), x)))
    return tl.where(_isnan(x) | _isnan(t), x + t, v)  # a NaN operand gives NaN


@triton.jit
def kl_div_grad_input(x, t, w, pw):
    return tl.where(_isnan(x), x, -target_in_domain(t))  # a NaN input gives NaN


@triton.jit
def kl_div_grad_target(x, t, w, pw):
    # log t + 1 - x: -inf at t = 0 (saturated by loss_chain_rule); below 0 the loss
    # does not move, 0.
    d = tl.where(t < 0, 0.0, log_ratio(nf_log(t), x) + 1.0)
    return tl.where(_isnan(x) | _isnan(t), x + t, d)  # a NaN operand gives NaN


@triton.jit
def kl_div_log_target_value(x, t, w, pw):
    # t = -inf (a zero target) contributes 0 (loss_product against exp(-inf) = 0).
    v = loss_product(nf_exp(t), log_ratio(t, x))
    return tl.where(_isnan(x) | _isnan(t), x + t, v)  # a NaN operand gives NaN


@triton.jit
def kl_div_log_target_grad_input(x, t, w, pw):
    return tl.where(_isnan(x), x, -nf_exp(t))  # a NaN input gives NaN


@triton.jit
def kl_div_log_target_grad_target(x, t, w, pw):
    # exp(t) (t - x + 1): 0 at t = -inf.
    v = loss_product(nf_exp(t), log_ratio(t, x) + 1.0)
    return tl.where(_isnan(x) | _isnan(t), x + t, v)  # a NaN operand gives NaN


# sigmoid_focal_loss (torchvision's)


@triton.jit
def _pow_any_base(x, y):
    """C's pow(x, y) for any base x (m = 1 - p_t is negative for a target outside
    [0, 1]): numerics' nf_pow (libdevice's) when compiled; in the interpreter,
    where nf_pow takes x >= 0 only, the power of |x| with the sign of x for an odd
    integer y. (Nested wheres: y is 0-d.)"""
    if COMPILED:
        return nf_pow(x, y)
    else:
        magnitude = nf_pow(tl.abs(x), y)
        half = y * 0.5
        odd = (tl.floor(half) != half) & (tl.floor(y) == y)
        v = tl.where(x < 0, tl.where(odd, -magnitude, magnitude), magnitude)
        # A finite negative base has no real power at a non-integer exponent: NaN, as C's.
        no_power = tl.where(x == -_INF, v, float("nan"))
        return tl.where(tl.floor(y) == y, v, tl.where(x < 0, no_power, v))


@triton.jit
def focal_alpha_t(t, alpha):
    # alpha t + (1 - alpha) (1 - t) for alpha >= 0, else 1 (torchvision's rule).
    return tl.where(alpha >= 0, alpha * t + (1.0 - alpha) * (1.0 - t), 1.0)


@triton.jit
def focal_parts(x, t, gamma):
    """(ce, m, m^gamma, sigmoid(x), sigmoid(-x)): m = 1 - p_t from both sigmoids,
    so that it is not 1 - 1 = 0 where it is small; 0^0 = 1 at gamma = 0."""
    sp_pos, sp_neg = softplus_pair(x)
    ce = loss_product(t, sp_neg) + loss_product(1.0 - t, sp_pos)
    sig, sig_neg = sigmoid_pair(x)
    m = sig * (1.0 - t) + sig_neg * t
    return ce, m, _pow_any_base(m, gamma), sig, sig_neg


@triton.jit
def sigmoid_focal_value(x, t, alpha, gamma):
    ce, m, m_gamma, sig, sig_neg = focal_parts(x, t, gamma)
    # ce = +inf meets m^gamma = 1 there; ce = 0 meets m^gamma = 0: the product is 0.
    return focal_alpha_t(t, alpha) * loss_product(ce, m_gamma)


@triton.jit
def sigmoid_focal_grad_input(x, t, alpha, gamma):
    # alpha_t m^g (ce' + g ce m'/m): the factor m^(g - 1) (infinite at m = 0 for
    # g < 1) never forms.
    ce, m, m_gamma, sig, sig_neg = focal_parts(x, t, gamma)
    slope = 1.0 - 2.0 * t
    # m = 0 only where the logit saturates toward its target: the limit of m'/m is 1 - 2t.
    ratio = tl.where(m == 0, slope, ieee_div(sig * sig_neg * slope, tl.where(m == 0, 1.0, m)))
    # ce' = sigmoid(x) - t as two terms: no 1 - 1 where sigmoid(x) rounds to 1.
    ce_slope = (1.0 - t) * sig - t * sig_neg
    # ce = +inf (the other saturation) meets ratio = 0 there: the term is 0.
    d = ce_slope + loss_product(gamma, loss_product(ce, ratio))
    v = focal_alpha_t(t, alpha) * loss_product(m_gamma, d)
    return tl.where(_isnan(ce), ce, v)  # a NaN operand gives NaN


@triton.jit
def sigmoid_focal_grad_target(x, t, alpha, gamma):
    ce, m, m_gamma, sig, sig_neg = focal_parts(x, t, gamma)
    alpha_slope = tl.where(alpha >= 0, 2.0 * alpha - 1.0, 0.0)
    # ce and m vanish together where the logit saturates toward its target; ce/m
    # tends to 1 there (0 / 0 otherwise).
    ce_over_m = tl.where(m == 0, 1.0, ieee_div(ce, tl.where(m == 0, 1.0, m)))
    # gamma = 0 against ce / m = inf (a logit saturated against its target): 0.
    inner = -x + loss_product(gamma, loss_product(ce_over_m, sig_neg - sig))
    d = loss_product(alpha_slope, ce) + loss_product(focal_alpha_t(t, alpha), inner)
    # x = +-inf: ce, -x and ce / m are infinite together (inf - inf above); the limit
    # is S (alpha_t' m + s alpha_t (1 + g)), S = |x| -> inf, m the weight of the
    # infinite softplus in ce, s = +1 at -inf, -1 at +inf.
    m_inf = tl.where(x < 0, t, 1.0 - t)
    side = tl.where(x < 0, 1.0, -1.0)
    coefficient = alpha_slope * m_inf + side * focal_alpha_t(t, alpha) * (1.0 + gamma)
    d = tl.where(tl.abs(x) == _INF, loss_product(coefficient, tl.zeros_like(x) + _INF), d)
    # m^g = 0 (saturated toward the target, g > 0) against -x = -inf: 0.
    return tl.where(_isnan(ce), ce, loss_product(m_gamma, d))  # a NaN operand gives NaN


@triton.jit
def pointwise_loss_value(x, t, w, pw, alpha, gamma, KIND: tl.constexpr):
    """The loss of PointwiseLoss KIND (0 bce_with_logits, 1 bce, 2 kl_div, 3 kl_div
    with a log target, 4 sigmoid focal)."""
    if KIND == 0:
        v = bce_with_logits_value(x, t, w, pw)
    elif KIND == 1:
        v = bce_value(x, t, w, pw)
    elif KIND == 2:
        v = kl_div_value(x, t, w, pw)
    elif KIND == 3:
        v = kl_div_log_target_value(x, t, w, pw)
    else:
        v = sigmoid_focal_value(x, t, alpha, gamma)
    return v


@triton.jit
def pointwise_loss_grad(x, t, w, pw, alpha, gamma, KIND: tl.constexpr, PARTIAL: tl.constexpr):
    """d/dx (PARTIAL 0) or d/dt (PARTIAL 1) of the loss of KIND."""
    if KIND == 0:
        if PARTIAL == 0:
            v = bce_with_logits_grad_input(x, t, w, pw)
        else:
            v = bce_with_logits_grad_target(x, t, w, pw)
    elif KIND == 1:
        if PARTIAL == 0:
            v = bce_grad_input(x, t, w, pw)
        else:
            v = bce_grad_target(x, t, w, pw)
    elif KIND == 2:
        if PARTIAL == 0:
            v = kl_div_grad_input(x, t, w, pw)
        else:
            v = kl_div_grad_target(x, t, w, pw)
    elif KIND == 3:
        if PARTIAL == 0:
            v = kl_div_log_target_grad_input(x, t, w, pw)
        else:
            v = kl_div_log_target_grad_target(x, t, w, pw)
    else:
        if PARTIAL == 0:
            v = sigmoid_focal_grad_input(x, t, alpha, gamma)
        else:
            v = sigmoid_focal_grad_target(x, t, alpha, gamma)
    return v


@triton.jit
def loss_chain_rule(g, partial, bound):
    # A zero upstream gradient gives 0 also against an infinite partial (loss_product);
    # saturated to the output dtype's range (a gradient stays finite).
    return saturate(loss_product(g, partial), bound)


# --- the pointwise kernel ---------------------------------------------------------------


@triton.jit
def _operand(ptr, offs, inside, ACC: tl.constexpr, PRESENT: tl.constexpr):
    """An operand read at offs (step 0: one element everywhere), 1 where absent."""
    if PRESENT:
        return load_acc(ptr, offs, inside, ACC)
    else:
        return tl.full(offs.shape, 1.0, ACC)


@triton.jit
def _pointwise_kernel(grad_ptr, grad_step, x_ptr, t_ptr, w_ptr, w_step, pw_ptr, pw_step, out_ptr,
                      n, alpha: tl.float64, gamma: tl.float64, KIND: tl.constexpr,
                      BACKWARD: tl.constexpr, PARTIAL: tl.constexpr, HAS_W: tl.constexpr,
                      HAS_PW: tl.constexpr, SUM: tl.constexpr, ACC: tl.constexpr,
                      BLOCK: tl.constexpr):
    """The loss (BACKWARD false), or grad times its partial PARTIAL, of each element;
    with SUM the sum of the block's losses instead, at out_ptr[program]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.full([], alpha, tl.float64).to(ACC)
    gm = tl.full([], gamma, tl.float64).to(ACC)
    x = load_acc(x_ptr, offs, inside, ACC)
    t = load_acc(t_ptr, offs, inside, ACC)
    w = _operand(w_ptr, offs * w_step, inside, ACC, HAS_W)
    pw = _operand(pw_ptr, offs * pw_step, inside, ACC, HAS_PW)
    if BACKWARD:
        g = load_acc(grad_ptr, offs * grad_step, inside, ACC)
        d = pointwise_loss_grad(x, t, w, pw, a, gm, KIND, PARTIAL)
        y = loss_chain_rule(g, d, largest_finite(out_ptr))
    else:
        y = pointwise_loss_value(x, t, w, pw, a, gm, KIND)
    if SUM:
        # The lanes past n hold the loss of padding: left out. Added in float64 (as the
        # CPU and CUDA kernels add): a float32 sum would lose the losses' low bits.
        total = tl.sum(tl.where(inside, y.to(ACC), 0.0).to(tl.float64), axis=0)
        tl.store(out_ptr + tl.program_id(0), total)
    else:
        store_rounded(out_ptr, offs, y.to(ACC), inside)


# --- cross_entropy: losses_math.h, by name ----------------------------------------------


@triton.jit
def ce_left_out(ref):
    """The statistics (max, log_sum, total, smoothing, denominator) of a position
    left out, shaped and typed as ref: no loss, no gradient, no share of the mean."""
    zero = tl.zeros(ref.shape, ref.dtype)
    return zero - float("inf"), zero, zero, zero, zero


@triton.jit
def ce_class_kept(x, keep):
    # A -inf logit is a class that does not exist; a NaN logit is kept (its row is NaN).
    return keep & (x != -_INF)


@triton.jit
def ce_smoothing(eps, kept_classes, ACC: tl.constexpr):
    # No kept class: no smoothing mass to spread (and no division by 0).
    count = tl.where(kept_classes == 0, 1, kept_classes).to(ACC)
    return tl.where(kept_classes == 0, 0.0, ieee_div(eps + tl.zeros_like(count), count))


@triton.jit
def ce_index_weight(is_target, w_c, w_y, eps, smoothing):
    return tl.where(is_target, (1.0 - eps) * w_y, 0.0) + smoothing * w_c


@triton.jit
def ce_probability_weight(t_c, w_c, eps, smoothing):
    return w_c * ((1.0 - eps) * t_c + smoothing)


@triton.jit
def ce_log_probability(x, row_max, log_sum):
    # A +inf max: the +inf classes share the mass (-log k), x == max covering them
    # where x - max is NaN; the others have p = 0.
    return tl.where(x == row_max, -log_sum, (x - row_max) - log_sum)


@triton.jit
def ce_term(q, log_p):
    # A class of weight 0 contributes 0, also where its log-probability is -inf.
    return loss_product(q, -log_p)


@triton.jit
def ce_has_gradient(row_max, log_sum):
    # No kept class (max -inf) or a +inf logit (locally constant): gradient 0; a NaN
    # logit (NaN log_sum) passes its NaN on.
    return ((row_max != _INF) & (row_max != -_INF)) | _isnan(log_sum)


@triton.jit
def ce_grad_input(g, x, q, kept, row_max, log_sum, total, bound):
    # An excluded class's logit does not enter the loss: 0; so for a position
    # without gradient (ce_has_gradient).
    p = nf_exp((x - row_max) - log_sum)
    d = saturate(g * (total * p - q), bound)
    return tl.where(kept & ce_has_gradient(row_max, log_sum), d, 0.0)


@triton.jit
def ce_grad_target(g, x, w_c, eps, kept, row_max, log_sum, bound):
    # -g w_c (1 - eps) log p_c, +inf where p_c = 0 (saturated); 0 on an excluded
    # class and on a position with no kept class (max -inf).
    d = saturate(loss_product(g * w_c * (1.0 - eps), -ce_log_probability(x, row_max, log_sum)),
                 bound)
    return tl.where(kept & (row_max != -_INF), d, 0.0)


# --- cross_entropy kernels --------------------------------------------------------------


@triton.jit
def _ce_program(n_iblocks, inner, BLOCK_I: tl.constexpr):
    """(o, i, in_pos): this program's outer index, its BLOCK_I consecutive inner
    indices (int64) and which of them are real."""
    pid = tl.program_id(0).to(tl.int64)
    o = pid // n_iblocks
    i = (pid % n_iblocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    return o, i, i < inner


@triton.jit
def _keep(mask_ptr, o, c, i, inside, ms0, ms1, ms2, HAS_MASK: tl.constexpr):
    """Whether (o, c, i) is inside the problem and kept by the mask (read through
    its strides: an expanded mask has step 0)."""
    keep = inside
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + (o * ms0 + c * ms1 + i * ms2), mask=inside, other=0) != 0)
    return keep


@triton.jit
def _class_weight(w_ptr, c, inside, ACC: tl.constexpr, HAS_W: tl.constexpr):
    return _operand(w_ptr, c, inside, ACC, HAS_W)


@triton.jit
def _class_tile(x_ptr, mask_ptr, o, c, ii, n_classes, inner, in_pos, ms0, ms1, ms2,
                ACC: tl.constexpr, HAS_MASK: tl.constexpr):
    """(offsets, logits, kept, inside) of the classes c [BLOCK_C, 1] at the
    positions ii [1, BLOCK_I]."""
    inside = (c < n_classes) & in_pos
    offs = (o * n_classes + c) * inner + ii
    x = load_acc(x_ptr, offs, inside, ACC)
    keep = _keep(mask_ptr, o, c, ii, inside, ms0, ms1, ms2, HAS_MASK)
    return offs, x, ce_class_kept(x, keep), inside


@triton.jit
def _target_class(y_ptr, pos, in_pos, n_classes, ignore_index):
    """The target class of each position, -1 where it is left out."""
    y = tl.load(y_ptr + pos, mask=in_pos, other=0).to(tl.int64)
    # An ignored or out-of-range target leaves its position out (nanfree.ops refuses
    # out-of-range targets of CPU tensors before the op runs).
    valid = in_pos & (y != ignore_index) & (y >= 0) & (y < n_classes)
    return tl.where(valid, y, -1)


@triton.jit
def _index_target(y_ptr, x_ptr, w_ptr, mask_ptr, o, i, pos, in_pos, n_classes, inner,
                  ms0, ms1, ms2, ignore_index, ACC: tl.constexpr, HAS_W: tl.constexpr,
                  HAS_MASK: tl.constexpr):
    """(y, x_y, w_y, target_kept) of each position: its target class (-1 when left
    out), that class's logit and weight (0 when left out), whether it is kept."""
    y = _target_class(y_ptr, pos, in_pos, n_classes, ignore_index)
    valid = y >= 0
    safe = tl.where(valid, y, 0)
    x_y = load_acc(x_ptr, (o * n_classes + safe) * inner + i, valid, ACC)
    keep_y = _keep(mask_ptr, o, safe, i, valid, ms0, ms1, ms2, HAS_MASK)
    w_y = tl.where(valid, _class_weight(w_ptr, safe, valid, ACC, HAS_W), 0.0)
    return y, x_y, w_y, ce_class_kept(x_y, keep_y)


@triton.jit
def _class_q(t_ptr, w_ptr, offs, c, kept, inside, y, w_y, eps, smoothing,
             ACC: tl.constexpr, INDEX: tl.constexpr, HAS_W: tl.constexpr):
    """(q_c, w_c) of a tile: q_c 0 on an excluded class."""
    w_c = _class_weight(w_ptr, c, inside, ACC, HAS_W)
    if INDEX:
        q = ce_index_weight(c == y, w_c, w_y, eps, smoothing)
    else:
        q = ce_probability_weight(load_acc(t_ptr, offs, inside, ACC), w_c, eps, smoothing)
    return tl.where(kept, q, 0.0), w_c


@triton.jit
def _ce_forward_kernel(x_ptr, y_ptr, t_ptr, w_ptr, mask_ptr, loss_ptr, stats_ptr, n_classes,
                       inner, n_iblocks, ms0, ms1, ms2, ignore_index, label_smoothing: tl.float64,
                       INDEX: tl.constexpr, HAS_W: tl.constexpr, HAS_MASK: tl.constexpr,
                       SECOND_PASS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    o, i, in_pos = _ce_program(n_iblocks, inner, BLOCK_I)
    pos = o * inner + i
    eps = tl.full([], label_smoothing, tl.float64).to(ACC)
    cs = tl.arange(0, BLOCK_C).to(tl.int64)[:, None]
    ii = i[None, :]
    pos_b = in_pos[None, :]

    # Pass 1: the online logsumexp of the kept classes and their count.
    row_max = tl.full([BLOCK_I], float("-inf"), ACC)
    row_sum = tl.zeros([BLOCK_I], ACC)
    count = tl.zeros([BLOCK_I], tl.int32)
    for start in range(0, n_classes, BLOCK_C):
        _, x, kept, _ = _class_tile(x_ptr, mask_ptr, o, start + cs, ii, n_classes, inner, pos_b,
                                    ms0, ms1, ms2, ACC, HAS_MASK)
        tile_max, tile_sum = lse_tile_state_axis0(tl.where(kept, x, float("-inf")))
        row_max, row_sum = lse_merge(row_max, row_sum, tile_max, tile_sum)
        count += tl.sum(kept.to(tl.int32), axis=0)
    smoothing = ce_smoothing(eps, count, ACC)
    log_sum = nf_log(row_sum)

    if INDEX:
        y, x_y, w_y, target_kept = _index_target(y_ptr, x_ptr, w_ptr, mask_ptr, o, i, pos, in_pos,
                                                 n_classes, inner, ms0, ms1, ms2, ignore_index,
                                                 ACC, HAS_W, HAS_MASK)
        # Left out: an ignored target or one whose class is not kept (no kept class then).
        left_out = ~target_kept
        denominator = w_y
    else:
        y = i
        w_y = tl.zeros([BLOCK_I], ACC)
        left_out = count == 0  # no kept class
        denominator = tl.full([BLOCK_I], 1.0, ACC)

    if SECOND_PASS:
        # Pass 2: the q-weighted sums over the kept classes.
        loss = tl.zeros([BLOCK_I], ACC)
        total = tl.zeros([BLOCK_I], ACC)
        max_b = row_max[None, :]
        log_b = log_sum[None, :]
        for start in range(0, n_classes, BLOCK_C):
            c = start + cs
            offs, x, kept, inside = _class_tile(x_ptr, mask_ptr, o, c, ii, n_classes, inner,
                                                pos_b, ms0, ms1, ms2, ACC, HAS_MASK)
            q, _ = _class_q(t_ptr, w_ptr, offs, c, kept, inside, y[None, :], w_y[None, :], eps,
                            smoothing[None, :], ACC, INDEX, HAS_W)
            total += tl.sum(q, axis=0)
            # An excluded class adds nothing (its term may be NaN: 0 * NaN).
            loss += tl.sum(tl.where(kept, ce_term(q, ce_log_probability(x, max_b, log_b)), 0.0),
                           axis=0)
    else:
        # A class-index target without smoothing: only the target class has weight.
        total = w_y
        loss = ce_term(w_y, ce_log_probability(x_y, row_max, log_sum))
    # A NaN logit makes the sum NaN; the terms of weight 0 would hide it.
    loss = tl.where(_isnan(log_sum), log_sum, loss)

    out_max, out_log, out_total, out_s, out_den = ce_left_out(row_max)
    tl.store(loss_ptr + pos, tl.where(left_out, 0.0, loss), mask=in_pos)
    st = stats_ptr + pos * 5
    tl.store(st, tl.where(left_out, out_max, row_max), mask=in_pos)
    tl.store(st + 1, tl.where(left_out, out_log, log_sum), mask=in_pos)
    tl.store(st + 2, tl.where(left_out, out_total, total), mask=in_pos)
    tl.store(st + 3, tl.where(left_out, out_s, smoothing), mask=in_pos)
    tl.store(st + 4, tl.where(left_out, out_den, denominator), mask=in_pos)


@triton.jit
def _ce_backward_kernel(g_ptr, x_ptr, y_ptr, t_ptr, w_ptr, mask_ptr, stats_ptr, gx_ptr, gt_ptr,
                        n_classes, inner, n_iblocks, ms0, ms1, ms2, ignore_index,
                        label_smoothing: tl.float64, INDEX: tl.constexpr, HAS_W: tl.constexpr,
                        HAS_MASK: tl.constexpr, TARGET_GRAD: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    bound = largest_finite(gx_ptr)
    o, i, in_pos = _ce_program(n_iblocks, inner, BLOCK_I)
    pos = o * inner + i
    eps = tl.full([], label_smoothing, tl.float64).to(ACC)
    st = stats_ptr + pos * 5
    # Positions past the problem read as left out (never stored).
    row_max = tl.load(st, mask=in_pos, other=float("-inf"))[None, :]
    log_sum = tl.load(st + 1, mask=in_pos, other=0.0)[None, :]
    total = tl.load(st + 2, mask=in_pos, other=0.0)[None, :]
    smoothing = tl.load(st + 3, mask=in_pos, other=0.0)[None, :]
    g = tl.load(g_ptr + pos, mask=in_pos, other=0.0).to(ACC)[None, :]
    if INDEX:
        y = _target_class(y_ptr, pos, in_pos, n_classes, ignore_index)
        w_y = tl.where(y >= 0, _class_weight(w_ptr, tl.where(y >= 0, y, 0), y >= 0, ACC, HAS_W),
                       0.0)
    else:
        y = i
        w_y = tl.zeros([BLOCK_I], ACC)
    cs = tl.arange(0, BLOCK_C).to(tl.int64)[:, None]
    ii = i[None, :]
    pos_b = in_pos[None, :]
    for start in range(0, n_classes, BLOCK_C):
        c = start + cs
        offs, x, kept, inside = _class_tile(x_ptr, mask_ptr, o, c, ii, n_classes, inner, pos_b,
                                            ms0, ms1, ms2, ACC, HAS_MASK)
        q, w_c = _class_q(t_ptr, w_ptr, offs, c, kept, inside, y[None, :], w_y[None, :], eps,
                          smoothing, ACC, INDEX, HAS_W)
        store_rounded(gx_ptr, offs,
                      ce_grad_input(g, x, q, kept, row_max, log_sum, total, bound).to(ACC), inside)
        if TARGET_GRAD:
            store_rounded(gt_ptr, offs,
                          ce_grad_target(g, x, w_c, eps, kept, row_max, log_sum, bound).to(ACC),
                          inside)


# --- launchers --------------------------------------------------------------------------


# Every kernel of this module, as defined (tests may monkeypatch the names).
KERNELS = common.KernelSet(_pointwise_kernel, _ce_forward_kernel, _ce_backward_kernel)
kernels_interpreted = KERNELS.interpreted
_check_runnable = KERNELS.check_runnable


def _optional_operand(t, out):
    """(tensor, step) as the pointwise kernel reads t against out
    (common.flat_operand); None (absent) as (out, 0), never read."""
    return (out, 0) if t is None else common.flat_operand(t, out)


def _pointwise(op, grad, input, target, weight, pos_weight, kind, alpha, gamma, partial,
               summed=False):
    _check_runnable(op, input)
    n = input.numel()
    blocks = triton.cdiv(n, _BLOCK)
    if summed:
        # A dense input read in place (a sum's order does not matter), another
        # made contiguous; one partial sum per program, in float64.
        x = input if is_dense(input) else input.contiguous()
        out = torch.empty(blocks, dtype=torch.float64, device=x.device)
    else:
        # The output in the input's layout, as torch's result; the input read in it.
        out = torch.empty_like(input)
        x = common.in_layout_of(input, out)
    t = common.in_layout_of(target, x)
    if n == 0:
        return out
    # Only binary_cross_entropy(_with_logits) reads weight, only the latter pos_weight
    # (losses_math.h): the others are not loaded.
    if kind not in (_losses.BCE_WITH_LOGITS, _losses.BCE):
        weight = None
    if kind != _losses.BCE_WITH_LOGITS:
        pos_weight = None
    w, w_step = _optional_operand(weight, x)
    pw, pw_step = _optional_operand(pos_weight, x)
    g, g_step = _optional_operand(grad, x)
    with device_guard(x):
        _pointwise_kernel[(blocks,)](
            g, g_step, x, t, w, w_step, pw, pw_step, out, n, float(alpha), float(gamma),
            KIND=int(kind), BACKWARD=grad is not None, PARTIAL=int(partial),
            HAS_W=weight is not None, HAS_PW=pos_weight is not None, SUM=summed,
            ACC=_TL_ACC[acc_dtype(x.dtype)], BLOCK=_BLOCK, **common.LAUNCH)
    return out


def pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma):
    """The unreduced loss of PointwiseLoss `kind` in the input's dtype and layout."""
    _losses.check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma)
    return _pointwise("pointwise_loss", None, input, target, weight, pos_weight, kind, alpha,
                      gamma, 0)


def pointwise_loss_sum(input, target, weight, pos_weight, kind, alpha, gamma):
    """The sum of the loss over every element, 0-d in the accumulation dtype: the
    programs' float64 partial sums added in order."""
    _losses.check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma,
                                 "pointwise_loss_sum")
    partials = _pointwise("pointwise_loss_sum", None, input, target, weight, pos_weight, kind,
                          alpha, gamma, 0, summed=True)
    return partials.sum().to(acc_dtype(input.dtype))


def pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha, gamma, partial):
    """grad * d loss / d input (partial 0) or d / d target (1), saturated."""
    _losses.check_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha,
                                          gamma, partial)
    return _pointwise("pointwise_loss_backward", grad, input, target, weight, pos_weight, kind,
                      alpha, gamma, partial)


def _ce_config(classes, inner):
    """(BLOCK_C, BLOCK_I, num_warps): positions i per program (1 for inner == 1, a
    row of contiguous classes), classes per tile."""
    block_i = 1 if inner == 1 else min(triton.next_power_of_2(inner), CE_BLOCK_I)
    block_c = min(triton.next_power_of_2(max(classes, 1)), max(CE_TILE // block_i, 1))
    num_warps = min(max(block_c * block_i // 512, 1), 8)
    return block_c, block_i, num_warps


def _ce_operands(input, target, weight, mask):
    """The operands as the kernels read them: contiguous input, target and weight;
    the mask as uint8 through its own strides (or a stand-in pointer)."""
    x = input.contiguous()
    index = target.dtype == torch.int64
    tgt = target.contiguous()
    w = x if weight is None else weight.contiguous()
    if mask is None:
        m, strides = x, (0, 0, 0)
    else:
        m, strides = mask.view(torch.uint8), mask.stride()
    return x, tgt, index, w, m, strides


def cross_entropy(input, target, weight, mask, ignore_index, label_smoothing):
    """(loss [outer, inner], stats [outer, inner, 5]), both in the accumulation dtype."""
    _losses.check_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing)
    _check_runnable("cross_entropy", input)
    outer, classes, inner = input.shape
    acc = acc_dtype(input.dtype)
    loss = torch.empty((outer, inner), dtype=acc, device=input.device)
    stats = torch.empty((outer, inner, _losses.CROSS_ENTROPY_STATS), dtype=acc,
                        device=input.device)
    if outer * inner == 0:
        return loss, stats
    x, tgt, index, w, m, (ms0, ms1, ms2) = _ce_operands(input, target, weight, mask)
    block_c, block_i, num_warps = _ce_config(classes, inner)
    n_iblocks = triton.cdiv(inner, block_i)
    with device_guard(x):
        _ce_forward_kernel[(outer * n_iblocks,)](
            x, tgt, tgt, w, m, loss, stats, classes, inner, n_iblocks, ms0, ms1, ms2,
            int(ignore_index), float(label_smoothing), INDEX=index, HAS_W=weight is not None,
            HAS_MASK=mask is not None, SECOND_PASS=not index or label_smoothing != 0,
            BLOCK_C=block_c, BLOCK_I=block_i, num_warps=num_warps, **common.LAUNCH)
    return loss, stats


def cross_entropy_backward(grad, input, target, weight, mask, ignore_index, label_smoothing,
                           stats, target_grad):
    """(grad_input, grad_target of a probability target or an empty [0] tensor)."""
    _losses.check_cross_entropy_backward(grad, input, target, weight, mask, ignore_index,
                                         label_smoothing, stats, target_grad)
    _check_runnable("cross_entropy_backward", input)
    outer, classes, inner = input.shape
    grad_input = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    grad_target = (torch.empty(target.shape, dtype=target.dtype, device=target.device)
                   if target_grad else input.new_empty(0))
    if grad_input.numel() == 0:
        return grad_input, grad_target
    x, tgt, index, w, m, (ms0, ms1, ms2) = _ce_operands(input, target, weight, mask)
    g, st = grad.contiguous(), stats.contiguous()
    block_c, block_i, num_warps = _ce_config(classes, inner)
    n_iblocks = triton.cdiv(inner, block_i)
    with device_guard(x):
        _ce_backward_kernel[(outer * n_iblocks,)](
            g, x, tgt, tgt, w, m, st, grad_input, grad_target if target_grad else grad_input,
            classes, inner, n_iblocks, ms0, ms1, ms2, int(ignore_index), float(label_smoothing),
            INDEX=index, HAS_W=weight is not None, HAS_MASK=mask is not None,
            TARGET_GRAD=bool(target_grad), BLOCK_C=block_c, BLOCK_I=block_i,
            num_warps=num_warps, **common.LAUNCH)
    return grad_input, grad_target
