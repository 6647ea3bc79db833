"""Triton backend of the GeM family: generalized mean pooling over dim 1 of a
3-D input [outer, n, inner] (nanfree.ops views any dims so) and its backward.

One function per op, named and called as the ``nanfree::`` op
(csrc/registration.cpp: ``gem`` and ``gem_backward``), with the argument
checks of nanfree/_ops/gem.py. The math mirrors
csrc/include/nanfree/gem_math.h function by function (same names, same
rules): each reduction is scaled by its largest clamped entry m, so every
ratio r = max(x, eps) / m is in (0, 1], mean = (1/n) sum r^p is in [1/n, 1]
and gem = m * mean^(1/p). No rule is written inline in a kernel.

Layout. Entry j of reduction (o, i) is at o * n * inner + j * inner + i of
the contiguous input. A program loads tiles [BLOCK_J, BLOCK_K]: BLOCK_J
entries j (axis 0, reduced) of BLOCK_K reductions (axis 1); the block policy
is _config's, from the module attributes below.

- inner == 1 (ROWS; gem_pool2d's [B*C, H*W, 1], a last dim): reductions are
  contiguous rows, several short rows per program. The forward loads a row
  of at most MAX_FUSED_N entries as one tile (BLOCK_J = next_pow2(n), about
  ROW_TILE entries per program) and keeps it in registers; a longer row has a
  program of its own and is streamed in tiles of LOOP_BLOCK entries.
- inner > 1 (the token layout [B, L, H] reduced over L): a program holds one
  o and BLOCK_K = min(next_pow2(inner), STRIDED_BLOCK_I) consecutive i, so
  every tile row is contiguous (coalesced); BLOCK_J = min(next_pow2(n),
  STRIDED_TILE // BLOCK_K) entries per tile, streamed when n is longer.
- The backward streams every reduction in smaller tiles (BACKWARD_ROW_TILE,
  BACKWARD_STRIDED_TILE): it does more per entry, and per reduction (rows:
  a thread holds entries of several rows, each with its own per-row values).

Forward: one read of the input. When the reduction fits one tile: its
maximum m (the fold of gem_max_update), then the sum of gem_ratio_power
against it, from registers. Streamed: an online state per reduction, m and
the ratio powers against it summed per tile row (lanes, a tile of sums);
each tile's maximum updates m, and where it grew the lanes are re-expressed
against it (times gem_rescale_sum's factor, computed once per reduction)
before the tile's ratio powers are added. Saves the statistics (m, mean,
count) the backward uses.

Sums. Every sum over entries is a tree over a tile's rows (_sum_entries),
after a sum over tiles in each row when streamed, so its rounding error
grows with log2(BLOCK_J) plus the number of tiles, not with n, as torch's
cascade sum: the output carries the mean's rounding raised to 1/p.

Backward: one read of the input and one write of its gradient, tile by tile
(gem_input_grad); masked entries are not read. With p_grad, each entry's
divergence term (gem_divergence_term) is summed in registers; each
reduction's gem_p_grad goes to a buffer of one value per reduction, which
gem_p_grad_total sums in float64 without overflow (deterministic). No host
sync: a tensor p is read inside the kernels from a 0-d tensor of the
accumulation dtype and clamped there (gem_clamp_p); a Python p is passed by
value (a float64 argument).

Branches. Triton evaluates both sides of a tl.where. The header's log-domain
branches (a ratio below the normal range, an underflowing weight) are rare:
on an entry tile they are computed only when one of its entries takes them
(_any_entry, a uniform branch), which changes no value. Entries whose result
is dropped (masked, clamped, reductions without gradient) are given the
operands of a ratio 1, so they never start such work.

Numerics. Everything is computed in float32 (float64 for float64 input);
outputs in the input dtype, statistics and grad_p in the accumulation dtype.
Compiled, pow, exp and log are libdevice's (IEEE subnormals kept: the
kernels are launched with enable_reflect_ftz=False, as nvcc's default) and
float32 divisions are rounded to nearest (tl.div_rn; Triton's plain float32
`/` is approximate), as in the header. Triton's interpreter has no libdevice:
there pow(x, y) is exp(y log x), taken in float64 for float32 (within
rounding of the true value) and in float64 for float64 (a relative error of
about |y log x| ulps). bfloat16 is read and written through its bits
(element_io.py's load_acc / store_rounded: the interpreter converts bfloat16 subnormals
wrongly). Float constants that float32 cannot hold exactly (1e-2, 1/3) are
made in the operand's dtype (_const): Triton may round a bare float constant
to float32 first (the interpreter always, compiled code in comparisons).

The kernels run where the Triton of this process can run them (common.py):
CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 when this module
was imported), CUDA tensors when compiled.
"""

import torch
import triton
import triton.language as tl

from .._ops.common import acc_dtype
from .._ops.gem import (check_gem, check_gem_backward, gem_divergence_coefficient, gem_p_grad_total,
                        output_shape, stats_shape)
from . import common
from .common import device_guard
from .element_io import ieee_div, load_acc, store_rounded, store_saturated
from .numerics import (COMPILED, effective_eps, nf_exp, nf_largest, nf_log, nf_pow, nf_tiny,
                       saturate)

# Block policy (module attributes, so tests may shrink them to reach the loops).
# inner == 1: in the forward, rows of at most MAX_FUSED_N entries are loaded
# once, about ROW_TILE entries per program (several rows for short n); longer
# rows are streamed in tiles of LOOP_BLOCK entries. The backward streams every
# row in tiles of at most LOOP_BLOCK entries, about BACKWARD_ROW_TILE per
# program: its per-entry and per-row work is heavier, and a thread holds
# entries of BLOCK_K / (warps across rows) different rows, each with its own
# per-row values, so its tiles are smaller (sm_90: no spills).
MAX_FUSED_N = 4096
ROW_TILE = 2048
LOOP_BLOCK = 2048
BACKWARD_ROW_TILE = 512
# inner > 1: consecutive i per program, entries per tile (forward, backward).
STRIDED_BLOCK_I = 64
STRIDED_TILE = 4096
BACKWARD_STRIDED_TILE = 2048
# Tile entries per warp: 8 per thread in the forward, 2 to 8 in the backward.
FORWARD_WARP_ENTRIES = 256
BACKWARD_WARP_ENTRIES = 64
MAX_WARPS = 8

GEM_MIN_P = tl.constexpr(1e-2)
GEM_MAX_P = tl.constexpr(1e2)
# c_k = 1 / (k! (k + 2)), k = 0 .. 17, of gem_divergence_h's series (the
# header's gem_divergence_coefficient), as Python floats.
GEM_DIVERGENCE_COEFFICIENTS = tl.constexpr(tuple(gem_divergence_coefficient(k) for k in range(18)))


@triton.jit
def _const(value, like):
    """A Python float in like's dtype, rounded once: Triton may make a bare
    float constant within float32's range float32 first (the interpreter
    always, compiled code in comparisons), so a float64 operand would meet
    1e-2 or 1/3 rounded to float32."""
    return tl.full([], value, like.dtype)


@triton.jit
def _any_entry(cond):
    """Whether a header branch must be computed: on a tile of entries (2-D),
    only when one of them takes it (a uniform branch; the values are the
    same); on per-reduction vectors, always (cheap)."""
    if len(cond.shape) >= 2:
        return tl.max(cond.to(tl.int32)) > 0
    else:
        return True


# ---------------------------------------------------------------------------
# Mirror of gem_math.h
# ---------------------------------------------------------------------------


@triton.jit
def gem_clamp_p(p):
    # A tensor p clamped to [1e-2, 1e2]; NaN stays NaN (both tests are false).
    lo = _const(GEM_MIN_P, p)
    hi = _const(GEM_MAX_P, p)
    return tl.where(p < lo, lo, tl.where(p > hi, hi, p))


@triton.jit
def clamp_to_eps(x, eps):
    # max(x, eps) as torch.clamp: negatives, zeros and -inf become eps; NaN
    # stays NaN (x < eps is false for it), +inf stays +inf.
    return tl.where(x < eps, eps, x)


@triton.jit
def gem_unclamped(x, eps):
    # x > eps (torch.clamp's gradient is 0 at the bound), and NaN too (written
    # !(x <= eps)), so a NaN entry's gradient is NaN like its reduction's.
    return ~(x <= eps)


@triton.jit
def gem_max_update(m, c):
    # The larger; NaN is sticky (c > m alone is false for a NaN c and would drop it).
    return tl.where((c > m) | (c != c), c, m)


@triton.jit
def gem_ratio(c, m):
    # c / m; for m = +inf the limit: 1 at a +inf entry (inf / inf is NaN), 0 elsewhere.
    return tl.where(m == float("inf"), tl.where(c == m, 1.0, 0.0), ieee_div(c, m))


@triton.jit
def gem_log_ratio(c, m):
    """log r for c, m > 0 finite; a ratio below the normal range has lost bits
    or underflowed to 0 (log 0 = -inf): there log c - log m, each finite
    since c >= eps >= the smallest normal."""
    r = ieee_div(c, m)
    out = nf_log(r)
    low = r < nf_tiny(r)
    if _any_entry(low):
        out = tl.where(low, nf_log(c) - nf_log(m), out)
    return out


@triton.jit
def gem_ratio_power(c, m, p):
    """r^p in [0, 1] for p > 0: pow for a normal ratio, the log domain below
    it (an underflowed ratio would give 0 even for p = 0.01); NaN stays NaN
    (pow of NaN); for m = +inf the limit ratio's power, 1 or 0."""
    r = ieee_div(c, m)
    out = nf_pow(r, p)
    # The header returns the limit for m = +inf before this test.
    low = (r < nf_tiny(r)) & (m != float("inf"))
    if _any_entry(low):
        out = tl.where(low, nf_exp(p * (nf_log(c) - nf_log(m))), out)
    return tl.where(m == float("inf"), gem_ratio(c, m), out)  # inf / inf would be NaN


@triton.jit
def gem_rescale_sum(total, m_old, m_new, p):
    """sum (c_i / m_old)^p re-expressed against m_new >= m_old: times
    (m_old / m_new)^p. The empty state (m_old 0) gives 0; a NaN maximum stays NaN."""
    # Equal maxima keep the sum, also both +inf (inf / inf would be NaN).
    return tl.where(m_old == m_new, total, total * gem_ratio_power(m_old, m_new, p))


@triton.jit
def gem_mean(total, count):
    # 0 for the empty set (0 / 0 would be NaN); else in [1/n, 1] or NaN.
    return tl.where(count == 0.0, 0.0, ieee_div(total, tl.where(count == 0.0, 1.0, count)))


@triton.jit
def gem_value(m, mean, p):
    """m * mean^(1/p); the log domain when mean^(1/p) underflows; 0 for the
    empty set; +inf for m = +inf (mean >= 1/n > 0 there); NaN stays."""
    s = nf_pow(mean, ieee_div(1.0, p))
    logd = nf_exp(nf_log(m) + ieee_div(nf_log(mean), p))
    out = tl.where(s < nf_tiny(s), logd, m * s)  # a NaN s fails the test: m * s, NaN
    return tl.where(mean == 0.0, 0.0, out)  # the empty set (log 0 would be -inf)


@triton.jit
def gem_has_gradient(m, count):
    # Not empty and no +inf entry (its limit is locally constant); a NaN m
    # passes, so NaN reaches the gradients.
    return (count > 0.0) & (m != float("inf"))


@triton.jit
def gem_input_grad_weight(c, m, mean, count, p):
    """dgem/dx = mean^(1/p-1) * r^(p-1) / n for an unclamped kept entry of a
    reduction with gradient; in the log domain where the direct product could
    be inf * 0 (p < 1, tiny r) or the ratio is below the normal range;
    bounded by the type's largest value."""
    tiny = nf_tiny(c)
    big = nf_largest(c)
    a = ieee_div(nf_pow(mean, ieee_div(1.0, p) - 1.0), count)
    r = ieee_div(c, m)
    rp1 = nf_pow(r, p - 1.0)
    # A ratio below the normal range lost bits (or is 0: 0^(p-1) = inf for p < 1).
    direct = (a >= tiny) & (r >= tiny) & (rp1 <= big)
    w = a * rp1
    if _any_entry(~direct):
        # NaN (c, m or mean) fails `direct` and stays NaN here.
        logd = nf_exp((ieee_div(1.0, p) - 1.0) * nf_log(mean) - nf_log(count)
                      + (p - 1.0) * gem_log_ratio(c, m))
        w = tl.where(direct, w, logd)
    return saturate(w, big)  # inf * 0 must not meet a 0 g; NaN stays


@triton.jit
def gem_input_grad(g, x, eps, m, mean, count, p):
    """g * weight for an unclamped kept entry of a reduction with gradient,
    else 0 (masked entries reach here as 0, which is clamped)."""
    has_grad = gem_has_gradient(m, count)
    live = has_grad & gem_unclamped(x, eps)
    # The header computes the weight only where it is used: here the other
    # entries get the operands of a ratio 1 (an empty reduction's m and count
    # are 0, and 0 / 0 = NaN), so they start no log-domain work.
    m1 = tl.where(has_grad, m, 1.0)
    c = tl.where(live, clamp_to_eps(x, eps), m1)
    w = gem_input_grad_weight(c, m1, tl.where(has_grad, mean, 1.0),
                              tl.where(has_grad, count, 1.0), p)
    return tl.where(live, g * w, 0.0)


@triton.jit
def gem_divergence_horner(s, LAST: tl.constexpr):
    """sum_{k=0..LAST} c_k s^k by Horner's rule, each coefficient rounded once
    to the operand's dtype (_const)."""
    poly = tl.full(s.shape, GEM_DIVERGENCE_COEFFICIENTS[LAST], s.dtype)
    for k in tl.static_range(LAST - 1, -1, -1):
        poly = _const(GEM_DIVERGENCE_COEFFICIENTS[k], s) + s * poly
    return poly


@triton.jit
def gem_divergence_h(s):
    """h(s) = 1 + (s - 1) e^s = t log t - t + 1 at t = e^s (>= 0): the series
    s^2 * sum_k c_k s^k, c_k = 1 / (k! (k + 2)), by Horner's rule with the
    header's number of terms for |s| <= 1, the closed form beyond."""
    # The header's number of terms: c_17 .. c_0 in float64, c_10 .. c_0 in float32.
    if s.dtype == tl.float64:
        poly = gem_divergence_horner(s, 17)
    else:
        poly = gem_divergence_horner(s, 10)
    series = s * s * poly
    # s <= log n, so e^s is finite; a very negative s underflows it to 0: h = 1,
    # the limit. A NaN s fails the test and takes the closed form (NaN).
    closed = 1.0 + (s - 1.0) * nf_exp(s)
    return tl.where((s >= -1.0) & (s <= 1.0), series, closed)


@triton.jit
def gem_divergence_term(c, m, log_mean, p):
    """h(p log r - log(mean)): one kept entry's term of D (clamped ones
    included), for a reduction with gradient, where it is finite; an r^p below
    the type's range gives 1, the limit. NaN stays."""
    return gem_divergence_h(p * gem_log_ratio(c, m) - log_mean)


@triton.jit
def gem_p_grad(g, gem, m, count, divergence, p):
    """g * gem * D / p^2 of a reduction with gradient, else 0 (D in
    [0, log n]); gem * D / p^2 is bounded by the type's range before meeting
    g, so that g = 0 gives 0."""
    big = nf_largest(gem)
    v = saturate(gem * ieee_div(divergence, p * p), big)  # NaN stays
    # g * v saturated too: the sum over reductions must never meet inf - inf.
    return tl.where(gem_has_gradient(m, count), saturate(g * v, big), 0.0)


# ---------------------------------------------------------------------------
# Helpers shared by the kernels (no special-value rule in here)
# ---------------------------------------------------------------------------


@triton.jit
def _reductions(n_outer, n, inner, n_iblocks, ms0, ms2, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """This program's reductions (o, i), as [BLOCK_K] int64 vectors: (index
    o * inner + i of the output and stats, which are real, element offset of
    entry 0 in the input, the same in the mask), and the input's stride
    between entries j."""
    pid = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    if ROWS:  # inner == 1: BLOCK_K consecutive rows o
        o = pid * BLOCK_K + ks
        return o, o < n_outer, o * n, o * ms0, 1
    else:  # one o, BLOCK_K consecutive i
        o = pid // n_iblocks
        i = (pid % n_iblocks) * BLOCK_K + ks
        return o * inner + i, i < inner, o * n * inner + i, o * ms0 + i * ms2, inner


@triton.jit
def _load_tile(x_ptr, mask_ptr, x_base, m_base, j_stride, ms1, start, n, valid,
               ACC: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_J: tl.constexpr):
    """(x, keep, offsets, inside) of the tile of entries start.. : x in the
    accumulation dtype, 0 where not kept (masked entries are not read)."""
    j = start + tl.arange(0, BLOCK_J).to(tl.int64)[:, None]
    inside = (j < n) & valid[None, :]
    keep = inside
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + (m_base[None, :] + j * ms1), mask=inside, other=0) != 0)
    offs = x_base[None, :] + j * j_stride
    return load_acc(x_ptr, offs, keep, ACC), keep, offs, inside


@triton.jit
def _tile_max(c):
    """The fold of gem_max_update over each column of a tile: the largest
    entry, NaN if one is NaN (a NaN-free max, then the NaN; a tl.reduce with
    gem_max_update as combine would run entry by entry in the interpreter)."""
    # NaN is sticky: it must not be dropped by a max that ignores it.
    has_nan = tl.max((c != c).to(tl.int32), 0) > 0
    largest = tl.max(tl.where(c != c, 0.0, c), 0)
    return tl.where(has_nan, float("nan"), largest)


@triton.jit
def _sum_entries(v):
    """The sum over axis 0 (the entries j) of a tile [BLOCK_J, BLOCK_K], as a
    tree: its rounding error grows with log2(BLOCK_J), not with BLOCK_J (torch
    sums by a cascade). Compiled, tl.sum is such a tree (each thread's few
    entries, then shuffles across lanes and a combine across warps). The
    interpreter's tl.sum is numpy's, which for BLOCK_K > 1 adds the BLOCK_J
    rows one after the other (a running sum: its pairwise summation only runs
    along the contiguous axis): there the tile's two halves are added, until
    one row is left."""
    if COMPILED:
        return tl.sum(v, 0)
    else:
        while v.shape[0] > 1:
            # [2, rows / 2, BLOCK_K]: the sum over an axis of 2 is one addition.
            v = tl.sum(tl.reshape(v, [2, v.shape[0] // 2, v.shape[1]]), 0)
        return tl.reshape(v, [v.shape[1]])


@triton.jit
def _forward_tile(x, keep, m, lanes, count, eps, p, RESCALE: tl.constexpr):
    """The state (m, lanes, count) of BLOCK_K reductions after one tile: the
    maximum so far and the ratio powers against it, summed per tile row
    (lanes [BLOCK_J, BLOCK_K]; _sum_entries adds them up at the end: a sum
    over tiles, then a tree). RESCALE: lanes from earlier tiles, re-expressed
    against the new maximum first."""
    # Entries outside the set are 0, below every clamped entry (and the empty set's m).
    c = tl.where(keep, clamp_to_eps(x, eps), 0.0)
    m_new = gem_max_update(m, _tile_max(c))
    mb = m_new[None, :]
    # Entries outside the set: a ratio 1 (their power is dropped; a 0 would
    # start log-domain work).
    rp = tl.where(keep, gem_ratio_power(tl.where(keep, c, mb), mb, p), 0.0)
    if RESCALE:
        # gem_rescale_sum of a sum 1: the factor (m / m_new)^p, once per
        # reduction; exactly 1 where the maximum did not grow (the lanes are
        # kept), 0 from the empty state, NaN with a NaN maximum.
        factor = gem_rescale_sum(tl.full(m.shape, 1.0, m.dtype), m, m_new, p)
        lanes = lanes * factor[None, :] + rp
    else:
        lanes = rp
    return m_new, lanes, count + tl.sum(keep.to(tl.int32), 0)


@triton.jit
def _p_in(p_ptr, p_value, ACC: tl.constexpr, P_TENSOR: tl.constexpr):
    """p in the accumulation dtype: a tensor p (0-d, ACC) clamped, a Python p as is."""
    if P_TENSOR:
        return gem_clamp_p(tl.load(p_ptr))
    else:
        return tl.full([], p_value, tl.float64).to(ACC)


@triton.jit
def _eps_in(eps, ACC: tl.constexpr):
    """effective_eps of the op's eps (a float64 argument) in the accumulation dtype."""
    return effective_eps(tl.full([], eps, tl.float64).to(ACC))


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@triton.jit
def _gem_kernel(x_ptr, p_ptr, mask_ptr, out_ptr, stats_ptr, n_outer, n, inner, n_iblocks,
                p_value: tl.float64, eps: tl.float64, ms0, ms1, ms2,
                ROWS: tl.constexpr, HAS_MASK: tl.constexpr, P_TENSOR: tl.constexpr,
                BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    red, valid, x_base, m_base, j_stride = _reductions(n_outer, n, inner, n_iblocks, ms0, ms2,
                                                       ROWS, BLOCK_K)
    p = _p_in(p_ptr, p_value, ACC, P_TENSOR)
    eps = _eps_in(eps, ACC)
    m = tl.zeros([BLOCK_K], dtype=ACC)  # the empty state
    lanes = tl.zeros([BLOCK_J, BLOCK_K], dtype=ACC)
    count = tl.zeros([BLOCK_K], dtype=tl.int32)
    if SINGLE:  # the whole reduction in one tile, in registers
        x, keep, _, _ = _load_tile(x_ptr, mask_ptr, x_base, m_base, j_stride, ms1, 0, n, valid,
                                   ACC, HAS_MASK, BLOCK_J)
        m, lanes, count = _forward_tile(x, keep, m, lanes, count, eps, p, False)
    else:
        for start in range(0, n, BLOCK_J):
            x, keep, _, _ = _load_tile(x_ptr, mask_ptr, x_base, m_base, j_stride, ms1, start, n,
                                       valid, ACC, HAS_MASK, BLOCK_J)
            m, lanes, count = _forward_tile(x, keep, m, lanes, count, eps, p, True)
    cnt = count.to(ACC)
    mean = gem_mean(_sum_entries(lanes), cnt)
    store_rounded(out_ptr, red, gem_value(m, mean, p), valid)
    st = stats_ptr + red * 3
    tl.store(st, m, mask=valid)
    tl.store(st + 1, mean, mask=valid)
    tl.store(st + 2, cnt, mask=valid)


@triton.jit
def _gem_backward_kernel(go_ptr, x_ptr, p_ptr, stats_ptr, mask_ptr, gi_ptr, partial_ptr,
                         n_outer, n, inner, n_iblocks, p_value: tl.float64, eps: tl.float64,
                         ms0, ms1, ms2, ROWS: tl.constexpr, HAS_MASK: tl.constexpr,
                         P_TENSOR: tl.constexpr, P_GRAD: tl.constexpr,
                         BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    """One pass over the tiles whatever n: each entry's gradient needs only its
    reduction's stats; with P_GRAD the divergence terms are summed on the way."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    red, valid, x_base, m_base, j_stride = _reductions(n_outer, n, inner, n_iblocks, ms0, ms2,
                                                       ROWS, BLOCK_K)
    p = _p_in(p_ptr, p_value, ACC, P_TENSOR)
    eps = _eps_in(eps, ACC)
    st = stats_ptr + red * 3
    # Reductions outside the problem read m, mean, count 0: no gradient.
    m = tl.load(st, mask=valid, other=0.0)
    mean = tl.load(st + 1, mask=valid, other=0.0)
    count = tl.load(st + 2, mask=valid, other=0.0)
    g = load_acc(go_ptr, red, valid, ACC)
    mb, meanb, countb, gb = m[None, :], mean[None, :], count[None, :], g[None, :]
    if P_GRAD:
        has_grad = gem_has_gradient(m, count)
        # Reductions without gradient (empty: m = 0, mean = 0; +inf: m = +inf)
        # get m = 1 and log(mean) = 0 here, so their unused terms stay finite.
        m_live = tl.where(has_grad, m, 1.0)[None, :]
        log_mean = nf_log(tl.where(has_grad, mean, 1.0))[None, :]
        partial = tl.zeros([BLOCK_J, BLOCK_K], dtype=ACC)
    for start in range(0, n, BLOCK_J):
        x, keep, offs, inside = _load_tile(x_ptr, mask_ptr, x_base, m_base, j_stride, ms1, start,
                                           n, valid, ACC, HAS_MASK, BLOCK_J)
        dx = gem_input_grad(gb, x, eps, mb, meanb, countb, p)
        # Into the input dtype's finite range (fp16 gradients for p < 1); NaN stays.
        store_saturated(gi_ptr, offs, dx, inside)
        if P_GRAD:
            # Entries outside the set: a ratio 1 (their term is dropped; a 0
            # would start log-domain work).
            c = tl.where(keep, clamp_to_eps(x, eps), m_live)
            term = gem_divergence_term(c, m_live, log_mean, p)
            partial += tl.where(keep, term, 0.0)
    if P_GRAD:
        divergence = gem_mean(_sum_entries(partial), count)
        dp = gem_p_grad(g, gem_value(m, mean, p), m, count, divergence, p)
        tl.store(partial_ptr + red, dp, mask=valid)


# ---------------------------------------------------------------------------
# Launchers (the op implementations)
# ---------------------------------------------------------------------------


# Every kernel of this module, as defined (tests may monkeypatch the names).
KERNELS = common.KernelSet(_gem_kernel, _gem_backward_kernel)
kernels_interpreted = KERNELS.interpreted
_check_runnable = KERNELS.check_runnable


def _config(outer, n, inner, backward):
    """(grid, n_iblocks, ROWS, BLOCK_J, BLOCK_K, SINGLE, num_warps) of the
    forward or backward kernel for a problem with outer * inner >= 1."""
    pow2_n = triton.next_power_of_2(max(n, 1))
    if inner == 1:
        if backward:
            block_j = min(pow2_n, LOOP_BLOCK)
            tile = BACKWARD_ROW_TILE
        else:
            block_j = pow2_n if n <= MAX_FUSED_N else LOOP_BLOCK
            tile = ROW_TILE
        # Several short rows per program (never beyond the rows there are),
        # one long row per program.
        block_k = max(min(tile // block_j, triton.next_power_of_2(outer)), 1)
        grid, n_iblocks, rows = triton.cdiv(outer, block_k), 1, True
    else:
        tile = BACKWARD_STRIDED_TILE if backward else STRIDED_TILE
        block_k = min(triton.next_power_of_2(inner), STRIDED_BLOCK_I)
        block_j = min(pow2_n, max(tile // block_k, 1))
        n_iblocks = triton.cdiv(inner, block_k)
        grid, rows = outer * n_iblocks, False
    per_warp = BACKWARD_WARP_ENTRIES if backward else FORWARD_WARP_ENTRIES
    num_warps = min(max(block_j * block_k // per_warp, 1), MAX_WARPS)
    return grid, n_iblocks, rows, block_j, block_k, n <= block_j, num_warps


def _p_args(p, p_value, x, acc):
    """(tensor, value, P_TENSOR): a tensor p as a 0-d tensor of the
    accumulation dtype (clamped in the kernel), a Python p by value."""
    if p is None:
        return x, float(p_value), False
    return p.detach().reshape(()).to(acc).contiguous(), 0.0, True


def _mask_args(mask, x):
    """(tensor, strides, HAS_MASK): the bool mask read as uint8 through its own
    strides (0 for a broadcast dim; never copied)."""
    if mask is None:
        return x, (0, 0, 0), False
    return mask.view(torch.uint8), tuple(mask.stride()), True


def gem(input, p, p_value, eps, mask=None):
    """(output [outer, inner], stats [outer, inner, 3] = (m, mean, count)) of
    the op nanfree::gem over dim 1 of input [outer, n, inner]."""
    check_gem(input, p, p_value, eps, mask)
    _check_runnable("gem", input)
    x = input.contiguous()
    acc = acc_dtype(x.dtype)
    out = torch.empty(output_shape(x), dtype=x.dtype, device=x.device)
    stats = torch.empty(stats_shape(x), dtype=acc, device=x.device)
    outer, n, inner = x.shape
    if outer * inner == 0:
        return out, stats
    # n == 0 runs too: every reduction is empty (m, mean, count 0; output 0).
    p_t, p_v, p_tensor = _p_args(p, p_value, x, acc)
    m, (ms0, ms1, ms2), has_mask = _mask_args(mask, x)
    grid, n_iblocks, rows, block_j, block_k, single, num_warps = _config(outer, n, inner, False)
    with device_guard(x):
        _gem_kernel[(grid,)](
            x, p_t, m, out, stats, outer, n, inner, n_iblocks, p_v, float(eps), ms0, ms1, ms2,
            ROWS=rows, HAS_MASK=has_mask, P_TENSOR=p_tensor, BLOCK_J=block_j, BLOCK_K=block_k,
            SINGLE=single, num_warps=num_warps, **common.LAUNCH)
    return out, stats


def gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad):
    """(grad_input, grad_p) of the op nanfree::gem_backward: grad_p is the 0-d
    sum over reductions of d gem / d p (accumulation dtype) when p_grad, else
    an empty [0] tensor."""
    check_gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad)
    _check_runnable("gem_backward", input)
    x, g, st = input.contiguous(), grad_output.contiguous(), stats.contiguous()
    acc = acc_dtype(x.dtype)
    grad_input = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    outer, n, inner = x.shape
    if grad_input.numel() == 0:
        # No entry: every reduction is empty or there is none; d gem / d p is 0.
        grad_p = x.new_zeros((), dtype=acc) if p_grad else x.new_empty((0,), dtype=acc)
        return grad_input, grad_p
    p_t, p_v, p_tensor = _p_args(p, p_value, x, acc)
    m, (ms0, ms1, ms2), has_mask = _mask_args(mask, x)
    grid, n_iblocks, rows, block_j, block_k, _, num_warps = _config(outer, n, inner, True)
    # One term of p's gradient per reduction.
    partials = x.new_empty((outer * inner,), dtype=acc) if p_grad else st
    with device_guard(x):
        _gem_backward_kernel[(grid,)](
            g, x, p_t, st, m, grad_input, partials, outer, n, inner, n_iblocks, p_v, float(eps),
            ms0, ms1, ms2, ROWS=rows, HAS_MASK=has_mask, P_TENSOR=p_tensor, P_GRAD=p_grad,
            BLOCK_J=block_j, BLOCK_K=block_k, num_warps=num_warps, **common.LAUNCH)
    # Summed without overflow as every backend does (gem_p_grad_total; deterministic).
    grad_p = gem_p_grad_total(partials, acc) if p_grad else x.new_empty((0,), dtype=acc)
    return grad_input, grad_p
