"""Mirror of csrc/include/nanfree/losses_math.h in plain torch operations (same
names, same rules): the losses family's pure-PyTorch backend, one function per
op named as the op. Both branches of a torch.where are evaluated; these
functions are never differentiated by autograd (the family's autograd is in
nanfree/_ops/losses.py), so an unused inf or NaN branch is harmless. Values are
computed in the accumulation dtype (float32 for float16 and bfloat16) and
rounded once, as the C++ kernels do."""

import torch

from .._ops import losses as _losses
from .numerics import acc_dtype, nf_largest, saturate

INF = float("inf")


def _where(cond, a, b):
    return torch.where(cond, a, b)


def _nan(a, b):
    return torch.isnan(a) | torch.isnan(b)


def loss_product(a, b):
    """a * b where an exact 0 factor wins against an infinite one; NaN stays NaN."""
    zero = ((a == 0) | (b == 0)) & ~_nan(a, b)
    return _where(zero, 0.0, a * b)


def softplus_pair(x):
    """(softplus(x), softplus(-x)) from one exp and one log1p."""
    l = torch.log1p(torch.exp(-x.abs()))
    return x.clamp(min=0) + l, (-x).clamp(min=0) + l


def sigmoid_pair(x):
    """(sigmoid(x), sigmoid(-x)) from one exp: 1 / (1 + e) and e / (1 + e), e = exp(-|x|)."""
    e = torch.exp(-x.abs())
    big = 1.0 / (1.0 + e)
    small = e * big
    return _where(x < 0, small, big), _where(x < 0, big, small)


# --- binary_cross_entropy_with_logits ----------------------------------------------


def bce_with_logits_value(x, t, w, pw):
    # Each term weighted by its own coefficient: 0 where the target agrees at x = +-inf.
    sp_pos, sp_neg = softplus_pair(x)
    loss = loss_product(pw * t, sp_neg) + loss_product(1 - t, sp_pos)
    return loss_product(w, loss)


def bce_with_logits_grad_input(x, t, w, pw):
    sig, sig_neg = sigmoid_pair(x)
    return loss_product(w, (1 - t) * sig - pw * t * sig_neg)


def bce_with_logits_grad_target(x, t, w, pw):
    # A weight pw of 0 contributes 0 against softplus(-x) = inf at x = -inf;
    # the derivative does not read t, but a NaN target still gives NaN.
    sp_pos, sp_neg = softplus_pair(x)
    d = loss_product(w, loss_product(pw, sp_neg) - sp_pos)
    return _where(torch.isnan(t), t, d)


# --- binary_cross_entropy ----------------------------------------------------------


def probability_in_domain(p):
    return p.clamp(0.0, 1.0)  # outside [0, 1]: the nearest bound (the domain rule)


def bce_value(x, t, w, pw):
    p = probability_in_domain(x)
    loss = loss_product(t, -torch.log(p)) + loss_product(1 - t, -torch.log1p(-p))
    return loss_product(w, loss)


def bce_grad_input(x, t, w, pw):
    low = _where(t == 0, 0.0, -t / x)  # 0 log p contributes 0, also at p = 0
    high = _where(t == 1, 0.0, (1 - t) / (1 - x))
    d = loss_product(w, low + high)
    # Outside the domain the loss does not move.
    return _where((x < 0) | (x > 1), 0.0, d)


def bce_grad_target(x, t, w, pw):
    p = probability_in_domain(x)
    d = loss_product(w, torch.log1p(-p) - torch.log(p))
    return _where(torch.isnan(t), t, d)  # not read, but NaN in gives NaN out


# --- kl_div ------------------------------------------------------------------------


def target_in_domain(t):
    return t.clamp(min=0.0)  # a negative target is read as 0 (the domain rule)


def log_ratio(log_t, x):
    return _where(log_t == x, 0.0, log_t - x)  # the same infinity: a match, 0


def kl_div_value(x, t, w, pw):
    td = target_in_domain(t)
    value = _where(td == 0, 0.0, loss_product(td, log_ratio(torch.log(td), x)))  # 0 log 0 = 0
    return _where(_nan(x, t), x + t, value)


def kl_div_grad_input(x, t, w, pw):
    return _where(torch.isnan(x), x, -target_in_domain(t))


def kl_div_grad_target(x, t, w, pw):
    d = _where(t < 0, 0.0, log_ratio(torch.log(t), x) + 1)  # below 0 the loss does not move
    return _where(_nan(x, t), x + t, d)


def kl_div_log_target_value(x, t, w, pw):
    return _where(_nan(x, t), x + t, loss_product(torch.exp(t), log_ratio(t, x)))


def kl_div_log_target_grad_input(x, t, w, pw):
    return _where(torch.isnan(x), x, -torch.exp(t))


def kl_div_log_target_grad_target(x, t, w, pw):
    return _where(_nan(x, t), x + t, loss_product(torch.exp(t), log_ratio(t, x) + 1))


# --- sigmoid_focal_loss ------------------------------------------------------------


def focal_alpha_t(t, alpha):
    return alpha * t + (1 - alpha) * (1 - t) if alpha >= 0 else torch.ones_like(t)


def focal_parts(x, t, gamma):
    sp_pos, sp_neg = softplus_pair(x)
    ce = loss_product(t, sp_neg) + loss_product(1 - t, sp_pos)
    sig, sig_neg = sigmoid_pair(x)
    m = sig * (1 - t) + sig_neg * t  # 1 - p_t from both sigmoids: no 1 - 1 = 0
    return ce, m, torch.pow(m, gamma), sig, sig_neg


def sigmoid_focal_value(x, t, alpha, gamma):
    ce, m, m_gamma, _, _ = focal_parts(x, t, gamma)
    return focal_alpha_t(t, alpha) * loss_product(ce, m_gamma)


def sigmoid_focal_grad_input(x, t, alpha, gamma):
    ce, m, m_gamma, sig, sig_neg = focal_parts(x, t, gamma)
    slope = 1 - 2 * t
    # m = 0 only at a logit saturated toward its target: m'/m tends to 1 - 2t.
    ratio = _where(m == 0, slope, sig * sig_neg * slope / m)
    g = torch.full_like(ce, gamma)
    ce_slope = (1 - t) * sig - t * sig_neg  # sigmoid(x) - t without 1 - 1 where sig rounds to 1
    d = ce_slope + loss_product(g, loss_product(ce, ratio))  # ce = inf meets ratio = 0: 0
    return _where(torch.isnan(ce), ce, focal_alpha_t(t, alpha) * loss_product(m_gamma, d))


def sigmoid_focal_grad_target(x, t, alpha, gamma):
    ce, m, m_gamma, sig, sig_neg = focal_parts(x, t, gamma)
    alpha_slope = 2 * alpha - 1 if alpha >= 0 else 0.0
    ce_over_m = _where(m == 0, 1.0, ce / m)  # both vanish at saturation: the limit 1
    # gamma = 0 against ce / m = inf (a logit saturated against its target): 0.
    inner = -x + loss_product(torch.full_like(ce, gamma), loss_product(ce_over_m, sig_neg - sig))
    d = loss_product(torch.full_like(ce, alpha_slope), ce) + loss_product(focal_alpha_t(t, alpha), inner)
    # At x = +-inf, ce, -x and ce / m are infinite together: the limit is
    # S (alpha_t' m + s alpha_t (1 + g)), S = |x|, s = +1 at -inf, -1 at +inf.
    m_inf = _where(x < 0, t, 1 - t)
    side = _where(x < 0, 1.0, -1.0)
    coefficient = alpha_slope * m_inf + side * focal_alpha_t(t, alpha) * (1 + gamma)
    d = _where(torch.isinf(x), loss_product(coefficient, torch.full_like(ce, INF)), d)
    return _where(torch.isnan(ce), ce, loss_product(m_gamma, d))


# kind (PointwiseLoss) -> (value, d/dx, d/dt), each f(x, t, w, pw, alpha, gamma)
def _plain(f):
    return lambda x, t, w, pw, alpha, gamma: f(x, t, w, pw)


def _focal(f):
    return lambda x, t, w, pw, alpha, gamma: f(x, t, alpha, gamma)


POINTWISE = {
    0: tuple(map(_plain, (bce_with_logits_value, bce_with_logits_grad_input,
                          bce_with_logits_grad_target))),
    1: tuple(map(_plain, (bce_value, bce_grad_input, bce_grad_target))),
    2: tuple(map(_plain, (kl_div_value, kl_div_grad_input, kl_div_grad_target))),
    3: tuple(map(_plain, (kl_div_log_target_value, kl_div_log_target_grad_input,
                          kl_div_log_target_grad_target))),
    4: tuple(map(_focal, (sigmoid_focal_value, sigmoid_focal_grad_input,
                          sigmoid_focal_grad_target))),
}


def _operands(input, target, weight, pos_weight):
    acc = acc_dtype(input.dtype)
    x, t = input.to(acc), target.to(acc)
    w = torch.ones((), dtype=acc, device=input.device) if weight is None else weight.to(acc)
    pw = torch.ones((), dtype=acc, device=input.device) if pos_weight is None else pos_weight.to(acc)
    return x, t, w, pw


def pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma):
    _losses.check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma)
    x, t, w, pw = _operands(input, target, weight, pos_weight)
    value = POINTWISE[kind][0](x, t, w, pw, alpha, gamma)
    return _like_input(value, input)


def pointwise_loss_sum(input, target, weight, pos_weight, kind, alpha, gamma):
    _losses.check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma,
                                 "pointwise_loss_sum")
    x, t, w, pw = _operands(input, target, weight, pos_weight)
    value = POINTWISE[kind][0](x, t, w, pw, alpha, gamma)
    # Summed in float64 where the device has it, as the CPU kernel sums (in double lanes).
    wide = torch.float64 if input.device.type in ("cpu", "cuda") else value.dtype
    return value.expand(input.shape).sum(dtype=wide).to(acc_dtype(input.dtype))


def pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha, gamma, partial):
    _losses.check_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha,
                                          gamma, partial)
    x, t, w, pw = _operands(input, target, weight, pos_weight)
    d = POINTWISE[kind][1 + partial](x, t, w, pw, alpha, gamma)
    out = saturate(loss_product(grad.to(x.dtype), d), nf_largest(input.dtype))
    return _like_input(out, input)


def _like_input(value, input):
    """value (broadcast to input's shape) in input's dtype and layout, as the
    kernels' outputs (torch.empty_like)."""
    return torch.empty_like(input).copy_(value.expand(input.shape))


# --- cross_entropy -----------------------------------------------------------------


def ce_class_kept(x, keep):
    return keep & (x != -INF)  # a -inf logit is a class that does not exist


def ce_smoothing(eps, kept_classes):
    return _where(kept_classes == 0, 0.0, eps / kept_classes.clamp(min=1))  # no kept class: 0


def ce_log_probability(x, row_max, log_sum):
    # x == max covers the +inf classes of a +inf row (-log k there).
    return _where(x == row_max, -log_sum, (x - row_max) - log_sum)


def ce_term(q, log_p):
    return loss_product(q, -log_p)  # a class of weight 0 contributes 0, also at log p = -inf


def ce_has_gradient(row_max, log_sum):
    return ~torch.isinf(row_max) | torch.isnan(log_sum)


def _class_weights(x, weight):
    if weight is None:
        return torch.ones((), dtype=x.dtype, device=x.device)
    return weight.to(x.dtype).view(1, -1, 1)


def _kept(input, x, mask):
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.expand(input.shape)
    return ce_class_kept(x, keep)


def _row_statistics(x, kept):
    """max and log_sum over the kept classes (dim 1, kept as size 1)."""
    masked = _where(kept, x, -INF)
    row_max = _where(torch.isnan(masked), -INF, masked).amax(dim=1, keepdim=True)
    scale = _where(masked == row_max, 1.0, torch.exp(masked - row_max))
    terms = _where(kept, scale, 0.0)
    terms = _where(torch.isnan(masked), masked, terms)
    return row_max, torch.log(terms.sum(dim=1, keepdim=True))


def _class_q(x, target, w, kept, eps, ignore_index):
    """(q_c with 0 on excluded classes, smoothing s, per-position included, denominator)."""
    kept_classes = kept.sum(dim=1, keepdim=True).to(x.dtype)
    s = ce_smoothing(eps, kept_classes)
    w_full = w.expand(x.shape) if w.dim() else torch.ones_like(x)
    if target.dtype == torch.int64:
        index = target.unsqueeze(1)
        # An ignored or out-of-range target leaves the position out (nanfree.ops
        # refuses out-of-range targets of CPU tensors before the op runs).
        ignored = (index == ignore_index) | (index < 0) | (index >= x.shape[1])
        safe = _where(ignored, 0, index)
        target_kept = kept.gather(1, safe) & ~ignored
        w_y = w_full.gather(1, safe)
        is_target = torch.zeros_like(kept).scatter_(1, safe, True)
        q = (_where(is_target, (1 - eps) * w_y, 0.0) + s * w_full)
        included = target_kept
        denominator = _where(included, w_y, 0.0)
    else:
        t = target.to(x.dtype)
        q = w_full * ((1 - eps) * t + s)
        included = kept_classes > 0
        denominator = included.to(x.dtype)
    q = _where(kept & included, q, 0.0)
    s = _where(included, s, 0.0)
    return q, s, included, denominator


def cross_entropy(input, target, weight, mask, ignore_index, label_smoothing):
    _losses.check_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing)
    x = input.to(acc_dtype(input.dtype))
    if x.shape[1] == 0:  # no class at all: every position is left out
        outer, _, inner = x.shape
        left_out = torch.tensor([-INF, 0.0, 0.0, 0.0, 0.0], dtype=x.dtype, device=x.device)
        return x.new_zeros(outer, inner), left_out.expand(outer, inner, 5).contiguous()
    kept = _kept(input, x, mask)
    q, s, included, denominator = _class_q(x, target, _class_weights(x, weight), kept,
                                           label_smoothing, ignore_index)
    row_max, log_sum = _row_statistics(x, kept)
    log_p = ce_log_probability(x, row_max, log_sum)
    loss = _where(kept & included, ce_term(q, log_p), 0.0).sum(dim=1, keepdim=True)
    nan_row = torch.isnan(log_sum) & included
    loss = _where(nan_row, log_sum, loss)  # a NaN logit in a counted row passes on
    total = q.sum(dim=1, keepdim=True)
    left_out = ~included
    row_max = _where(left_out, -INF, row_max)
    log_sum = _where(left_out, 0.0, log_sum)
    stats = torch.cat([row_max, log_sum, total, s, denominator], dim=1)  # [outer, 5, inner]
    return loss.squeeze(1).contiguous(), stats.permute(0, 2, 1).contiguous()


def cross_entropy_backward(grad, input, target, weight, mask, ignore_index, label_smoothing,
                           stats, target_grad):
    _losses.check_cross_entropy_backward(grad, input, target, weight, mask, ignore_index,
                                         label_smoothing, stats, target_grad)
    x = input.to(acc_dtype(input.dtype))
    if x.shape[1] == 0:
        grad_target = target.new_empty(target.shape) if target_grad else input.new_empty(0)
        return input.new_empty(input.shape), grad_target
    w = _class_weights(x, weight)
    kept = _kept(input, x, mask)
    q, _, included, _ = _class_q(x, target, w, kept, label_smoothing, ignore_index)
    st = stats.permute(0, 2, 1)  # [outer, 5, inner]
    row_max, log_sum, total = st[:, 0:1], st[:, 1:2], st[:, 2:3]
    g = grad.to(x.dtype).unsqueeze(1)
    p = torch.exp((x - row_max) - log_sum)
    d = saturate(g * (total * p - q), nf_largest(input.dtype))
    live = kept & ce_has_gradient(row_max, log_sum)
    grad_input = _where(live, d, 0.0).to(input.dtype).contiguous()
    if not target_grad:
        return grad_input, input.new_empty(0)
    w_full = w.expand(x.shape) if w.dim() else torch.ones_like(x)
    log_p = ce_log_probability(x, row_max, log_sum)
    dt = saturate(loss_product(g * w_full * (1 - label_smoothing), -log_p),
                  nf_largest(input.dtype))
    dt = _where(kept & (row_max != -INF), dt, 0.0)
    return grad_input, dt.to(target.dtype).contiguous()
