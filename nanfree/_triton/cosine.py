"""Triton backend of the cosine family: normalize, cosine_similarity and their
backward ops over the last dimension, and cos_sim_matrix (cos_sim's GEMM).

One function per op, named and called as the ``nanfree::`` op
(csrc/registration.cpp), with the argument checks of
nanfree/_ops/cosine.py. The per-vector math mirrors
csrc/include/nanfree/cosine_math.h function by function (same names, same
rules, same comments); no rule is written inline in a kernel.

Row kernels. The contiguous input is viewed as [rows, d] (d the last dim);
entry (r, j) is at element r * d + j. A program handles a tile of
[BLOCK_R, BLOCK_D] entries: BLOCK_R consecutive rows of BLOCK_D columns.

- d <= MAX_FUSED_D: BLOCK_D = next_pow2(d) and BLOCK_R = ROW_TILE // BLOCK_D
  (at least 1, at most next_pow2(rows)), so short vectors (d = 3, 384) share a
  program. Each row is loaded once and kept in registers: its largest
  magnitude (amax, NaN propagated), then norm_scale, then the sums of the
  scaled entries (ssq; for cosine_similarity also the scaled dot product),
  then the outputs.
- d > MAX_FUSED_D: one row per program (BLOCK_R = 1) streamed in blocks of
  LOOP_BLOCK columns: a pass for amax, a pass for the sums, and (normalize)
  a pass writing the outputs.
- The backward kernels use the same tiles: normalize_backward needs the row
  sum(g * y) (one pass when the row fits, else a sum pass and an output
  pass); cosine_similarity_backward is elementwise given the forward's stats
  and output (one pass over the column blocks).

Everything is computed in float32 (float64 for float64 input); outputs take
the input dtype, statistics the accumulation dtype. Per-vector statistics:
normalize (p, grad_factor), cosine_similarity (p, q, unit_divisor, grad_factor of x1,
then of x2: COSINE_STATS), one row of them per vector.

cos_sim_matrix. clamp(a @ b.T) of a [N, d] and b [M, d]: a tiled tl.dot GEMM
(GEMM_BLOCK_N x GEMM_BLOCK_M output tiles, GEMM_BLOCK_K along d), b read
transposed through its strides (no copy of either operand), accumulated in
float32 (float64 for float64, which Triton lowers to the float64 MMA), the
clamp (cosine_clamp) in the epilogue, the output in the input dtype. float32
operands are multiplied in IEEE float32 (input_precision="ieee"), as torch's
matmul does by default, never in TF32. Output tiles are visited in groups of
GEMM_GROUP_N tile rows, so the b tiles a group reads stay in L2.

Numerics notes. Square roots and float32 divisions are IEEE-rounded
(tl.sqrt_rn, tl.div_rn: Triton's plain sqrt and `/` are approximate in
float32), as sqrtf and `/` in the header. ilogb and ldexp are built from the
bits of the float (Triton's interpreter has no libdevice).

The kernels run where the Triton of this process can run them (common.py):
CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 when this module
was imported), CUDA tensors when compiled.
"""

import torch
import triton
import triton.language as tl

from .._ops.cosine import (COSINE_STATS, NORMALIZE_STATS, check_cos_sim_matrix, check_cosine,
                           check_cosine_backward, check_normalize, check_normalize_backward,
                           per_vector_shape, stats_dtype, vector_rows)
from . import common
from .common import device_guard
from .element_io import ieee_div, load_acc, store_rounded, store_saturated, widen
from .numerics import (GRAD_SUM_SCALE, GRAD_SUM_UNSCALE, effective_eps, grad_sum_overflowed,
                       max_normal_exponent, min_normal_exponent, nf_ilogb, nf_ldexp, nf_sqrt)

# The per-row width of cosine_similarity's statistics, for the kernels.
STATS = tl.constexpr(COSINE_STATS)

# Block policy (module attributes, so tests may shrink them to reach the loops).
# Row kernels: rows of at most MAX_FUSED_D entries are loaded once, in tiles of
# about ROW_TILE entries (several rows for short d); longer rows are streamed
# in blocks of LOOP_BLOCK columns.
MAX_FUSED_D = 8192
ROW_TILE = 4096
LOOP_BLOCK = 4096
# cos_sim_matrix: output tile [GEMM_BLOCK_N, GEMM_BLOCK_M], GEMM_BLOCK_K along d
# (at least 16: the smallest K of a float16 tl.dot), GEMM_GROUP_N tile rows
# per group.
GEMM_BLOCK_N = 64
GEMM_BLOCK_M = 64
GEMM_BLOCK_K = 32
GEMM_GROUP_N = 8
GEMM_NUM_WARPS = 4
GEMM_NUM_STAGES = 3


# ---------------------------------------------------------------------------
# Mirror of cosine_math.h
# ---------------------------------------------------------------------------


@triton.jit
def norm_scale(amax):
    """The power of two p = 2^-e that scales a vector whose largest magnitude is
    `amax` so that the largest scaled entry lies in [1, 2). e is clamped to the
    normal exponents, so p is exact and finite. Marks: amax NaN -> p NaN;
    amax +inf -> p 0 (the infinite-vector mark); amax 0 -> p 1."""
    MIN_E = min_normal_exponent(amax)
    MAX_E = max_normal_exponent(amax)
    e = tl.where(amax > 0, nf_ilogb(amax), 0)  # ilogb(0) is a sentinel, not an exponent
    e = tl.where(e < MIN_E, MIN_E, e)
    e = tl.where(e > MAX_E, MAX_E, e)
    p = nf_ldexp(tl.full(amax.shape, 1.0, amax.dtype), -e)
    p = tl.where(amax == float("inf"), 0.0, p)  # the infinite-vector mark
    return tl.where(amax != amax, amax, p)  # NaN reaches every scaled entry


@triton.jit
def scaled_entry(x, p):
    # One entry scaled by p (exact). For an infinite vector (p == 0) the limit:
    # +-1 at an infinite entry, 0 at a finite one (x * 0 would be NaN at +-inf).
    limit = tl.where(tl.abs(x) == float("inf"), tl.where(x > 0, 1.0, -1.0), 0.0)
    return tl.where(p == 0, limit, x * p)


@triton.jit
def norm_factors(p, ssq, eps):
    """(q, divisor, grad_factor) of a vector from its scale p and the sum of
    squares ssq of its scaled entries, with one square root: q, the clamped
    norm factor (x / max(norm, eps) == scaled_entry(x, p) * q); divisor, the
    scaled norm sqrt(ssq) where q is 1 / sqrt(ssq), else 0; grad_factor,
    1 / norm == p * grad_factor, 0 where the vector passes no gradient."""
    root = nf_sqrt(ssq)
    unit = ieee_div(1.0, root)  # inf at ssq == 0, which the zero-vector rule replaces
    # The norm (root / p) is at least eps, compared as root >= eps * p; when
    # eps * p overflows to +inf the vector is tiny next to eps and fails, as it should.
    at_least = root >= eps * p
    # An infinite vector's limit direction (scaled entries +-1 and 0) divides
    # by its root too. Below eps: x / eps = (x * p) * ((1 / eps) / p); dividing
    # by p (a power of two, at most 2^-min_exponent) rather than multiplying by
    # eps * p keeps it finite.
    q = tl.where((p == 0) | at_least, unit, ieee_div(ieee_div(1.0, eps), p))
    divisor = tl.where((p == 0) | at_least, root, 0.0)
    # An infinite vector's limit direction is locally constant, and a vector
    # below eps has no direction to differentiate: no gradient.
    grad_factor = tl.where((p != 0) & at_least, unit, 0.0)
    # A zero vector normalizes to 0 (1 / (eps * p) may overflow), has no norm
    # to divide by and passes no gradient.
    zero = ssq == 0
    q = tl.where(zero, 0.0, q)
    divisor = tl.where(zero, 0.0, divisor)
    grad_factor = tl.where(zero, 0.0, grad_factor)
    # A NaN vector: NaN throughout (the comparisons above would be false and hide it).
    nan = ssq != ssq
    return tl.where(nan, ssq, q), tl.where(nan, ssq, divisor), tl.where(nan, ssq, grad_factor)


@triton.jit
def unit_divisor(divisor, p, amax):
    """A vector's divisor (norm_factors) where the vector holds an entry of the
    norm's magnitude, which normalized_entry makes exactly +-1; else 0. Only a
    largest entry can, and only if the divisor equals it (the rounded norm is
    never smaller), so normalized_entry gives the same with either divisor. `amax` is the vector's largest magnitude (NaN and +inf as in
    norm_scale)."""
    # A NaN divisor fails the test: 0, and q is NaN.
    return tl.where((divisor > 0) & (divisor == scaled_entry(amax, p)), divisor, 0.0)


@triton.jit
def normalized_entry(s, divisor, q):
    """The normalized entry x / max(norm, eps) of a scaled entry s, given its
    vector's divisor (or unit_divisor) and its q (norm_factors): s * q, within a rounding
    of the quotient, except an entry whose magnitude is the (positive) divisor
    itself, which is exactly +-1 as the quotient is (s * q can give 1 - 2^-24
    there). NaN for a NaN vector: q is NaN."""
    unit = tl.where(s > 0, 1.0, -1.0)
    return tl.where((divisor > 0) & (tl.abs(s) == divisor), unit, s * q)


@triton.jit
def cosine_row(scaled_dot, p1, ssq1, amax1, p2, ssq2, amax2, eps, st, mask):
    """A row's cosine similarity from the dot product of its vectors' scaled
    entries and each vector's p, ssq and amax; stores the row's STATS statistics
    (p, q, unit_divisor, grad_factor of x1, then of x2) at `st`."""
    q1, divisor1, grad_factor1 = norm_factors(p1, ssq1, eps)
    q2, divisor2, grad_factor2 = norm_factors(p2, ssq2, eps)
    tl.store(st, p1, mask=mask)
    tl.store(st + 1, q1, mask=mask)
    tl.store(st + 2, unit_divisor(divisor1, p1, amax1), mask=mask)
    tl.store(st + 3, grad_factor1, mask=mask)
    tl.store(st + 4, p2, mask=mask)
    tl.store(st + 5, q2, mask=mask)
    tl.store(st + 6, unit_divisor(divisor2, p2, amax2), mask=mask)
    tl.store(st + 7, grad_factor2, mask=mask)
    return cosine_value(scaled_dot, divisor1, divisor2, q1, q2)


@triton.jit
def cosine_clamp(c):
    # A cosine similarity clamped to [-1, 1] (rounding can carry a dot product of
    # unit vectors past 1, and acos of that is NaN); NaN stays NaN.
    return tl.where(c > 1.0, 1.0, tl.where(c < -1.0, -1.0, c))


@triton.jit
def cosine_value(scaled_dot, divisor1, divisor2, q1, q2):
    """The cosine similarity of two vectors from the dot product of their scaled
    entries, their divisors and their factors q (norm_factors), clamped. Where both
    divisors are positive: scaled_dot / (divisor1 * divisor2), exactly +-1 for
    two vectors with one nonzero entry at the same index, as torch's; otherwise
    (a zero, below-eps or NaN vector) (scaled_dot * q1) * q2."""
    divisible = (divisor1 > 0) & (divisor2 > 0)
    quotient = ieee_div(scaled_dot, tl.where(divisible, divisor1 * divisor2, 1.0))
    return cosine_clamp(tl.where(divisible, quotient, (scaled_dot * q1) * q2))


@triton.jit
def normalize_grad_value(g, y, dot, dot_scaled, p, grad_factor):
    """d normalize: the gradient of y = x / norm for an incoming g, given
    dot = sum(g * y) over the vector and grad_factor (norm_factors):
    (g - y * dot) / norm, with 1 / norm applied as grad_factor, then p. In that
    order a grad_factor of 0 gives 0 even where p (up to 2^126 for a vector of
    subnormals) would overflow the product first and make it inf * 0 = NaN."""
    d = g - y * dot
    plain = (d * grad_factor) * p
    # Upstream gradients near the largest value: where dot (a GradSum) overflowed,
    # at its scale 2^-64; where g - y * dot overflowed, at half scale.
    halved = (((0.5 * g - y * (0.5 * dot)) * grad_factor) * p) * 2.0
    at_scale = (((g * GRAD_SUM_SCALE - y * dot_scaled) * grad_factor) * p) * GRAD_SUM_UNSCALE
    return tl.where(grad_sum_overflowed(dot, dot_scaled), at_scale,
                    tl.where(tl.abs(d) == float("inf"), halved, plain))


@triton.jit
def cosine_grad_value(g, v_self, v_other, c, p_self, grad_factor_self):
    """d cosine_similarity with respect to x1 (swap the roles for x2): with
    v = x / max(norm, eps) the normalized entries and c the similarity,
    dc/dx1 = (v2 - c * v1) / norm1 (grad_factor before p, as in normalize_grad_value);
    v is normalized_entry."""
    return g * (((v_other - c * v_self) * grad_factor_self) * p_self)


# ---------------------------------------------------------------------------
# Helpers shared by the row kernels (no special-value rule in here)
# ---------------------------------------------------------------------------


@triton.jit
def _amax_combine(a, b):
    # The larger magnitude, NaN winning either way: a NaN entry must reach norm_scale.
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _row_amax(x):
    """Largest |x| of each row of a [BLOCK_R, BLOCK_D] tile (NaN if any entry is)."""
    return tl.reduce(tl.abs(x), 1, _amax_combine)


@triton.jit
def _row_block(n_rows, BLOCK_R: tl.constexpr):
    """(rows [BLOCK_R] int64, in_row) of this program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < n_rows


@triton.jit
def _tile_at(rows, in_row, start, d, BLOCK_D: tl.constexpr):
    """(offsets, inside) of the [BLOCK_R, BLOCK_D] tile of columns start.. of `rows`."""
    cols = start + tl.arange(0, BLOCK_D)
    inside = in_row[:, None] & (cols[None, :] < d)
    return rows[:, None] * d + cols[None, :], inside


@triton.jit
def _eps_in(eps, ACC: tl.constexpr):
    """effective_eps of the op's eps (a float64 argument) in the accumulation dtype."""
    return effective_eps(tl.full([], eps, tl.float64).to(ACC))


@triton.jit
def _vector_amax(x_ptr, rows, in_row, d, first, ACC: tl.constexpr, BLOCK_D: tl.constexpr,
                 SINGLE_BLOCK: tl.constexpr):
    """amax of each row: of the loaded tile `first` when the row fits one block,
    else of a pass over the row's blocks."""
    if SINGLE_BLOCK:
        amax = _row_amax(first)
    else:
        amax = tl.zeros([rows.shape[0]], dtype=ACC)
        for start in range(0, d, BLOCK_D):
            offs, inside = _tile_at(rows, in_row, start, d, BLOCK_D)
            amax = _amax_combine(amax, _row_amax(load_acc(x_ptr, offs, inside, ACC)))
    return amax


# ---------------------------------------------------------------------------
# Row kernels
# ---------------------------------------------------------------------------


@triton.jit
def _normalize_kernel(x_ptr, y_ptr, stats_ptr, n_rows, d, eps: tl.float64,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      SINGLE_BLOCK: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    rows, in_row = _row_block(n_rows, BLOCK_R)
    eps = _eps_in(eps, ACC)
    offs, inside = _tile_at(rows, in_row, 0, d, BLOCK_D)
    x = load_acc(x_ptr, offs, inside, ACC)  # the whole row when SINGLE_BLOCK
    amax = _vector_amax(x_ptr, rows, in_row, d, x, ACC, BLOCK_D, SINGLE_BLOCK)
    p = norm_scale(amax)
    pc = p[:, None]
    if SINGLE_BLOCK:
        s = scaled_entry(x, pc)
        ssq = tl.sum(s * s, axis=1)
    else:
        partial = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
        for start in range(0, d, BLOCK_D):
            o, inn = _tile_at(rows, in_row, start, d, BLOCK_D)
            sb = scaled_entry(load_acc(x_ptr, o, inn, ACC), pc)
            partial += sb * sb
        ssq = tl.sum(partial, axis=1)
    q, divisor, grad_factor = norm_factors(p, ssq, eps)
    tl.store(stats_ptr + rows * 2, p, mask=in_row)
    tl.store(stats_ptr + rows * 2 + 1, grad_factor, mask=in_row)
    qc = q[:, None]
    divisor = unit_divisor(divisor, p, amax)[:, None]
    if SINGLE_BLOCK:
        store_rounded(y_ptr, offs, normalized_entry(s, divisor, qc), inside)
    else:
        for start in range(0, d, BLOCK_D):
            o, inn = _tile_at(rows, in_row, start, d, BLOCK_D)
            sb = scaled_entry(load_acc(x_ptr, o, inn, ACC), pc)
            store_rounded(y_ptr, o, normalized_entry(sb, divisor, qc), inn)


@triton.jit
def _normalize_backward_kernel(go_ptr, y_ptr, stats_ptr, gi_ptr, n_rows, d,
                               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                               SINGLE_BLOCK: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    rows, in_row = _row_block(n_rows, BLOCK_R)
    p = tl.load(stats_ptr + rows * 2, mask=in_row, other=1.0)[:, None]
    grad_factor = tl.load(stats_ptr + rows * 2 + 1, mask=in_row, other=0.0)[:, None]
    if SINGLE_BLOCK:
        offs, inside = _tile_at(rows, in_row, 0, d, BLOCK_D)
        g = load_acc(go_ptr, offs, inside, ACC)
        y = load_acc(y_ptr, offs, inside, ACC)
        dot = tl.sum(g * y, axis=1)[:, None]
        dot_scaled = tl.sum((g * GRAD_SUM_SCALE) * y, axis=1)[:, None]
        grad = normalize_grad_value(g, y, dot, dot_scaled, p, grad_factor)
        store_saturated(gi_ptr, offs, grad, inside)
    else:
        partial = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
        partial_scaled = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
        for start in range(0, d, BLOCK_D):
            offs, inside = _tile_at(rows, in_row, start, d, BLOCK_D)
            g = load_acc(go_ptr, offs, inside, ACC)
            y = load_acc(y_ptr, offs, inside, ACC)
            partial += g * y
            partial_scaled += (g * GRAD_SUM_SCALE) * y
        dot = tl.sum(partial, axis=1)[:, None]
        dot_scaled = tl.sum(partial_scaled, axis=1)[:, None]
        for start in range(0, d, BLOCK_D):
            offs, inside = _tile_at(rows, in_row, start, d, BLOCK_D)
            g = load_acc(go_ptr, offs, inside, ACC)
            y = load_acc(y_ptr, offs, inside, ACC)
            grad = normalize_grad_value(g, y, dot, dot_scaled, p, grad_factor)
            store_saturated(gi_ptr, offs, grad, inside)


@triton.jit
def _cosine_kernel(x1_ptr, x2_ptr, out_ptr, stats_ptr, n_rows, d, eps: tl.float64,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE_BLOCK: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    rows, in_row = _row_block(n_rows, BLOCK_R)
    eps = _eps_in(eps, ACC)
    offs, inside = _tile_at(rows, in_row, 0, d, BLOCK_D)
    a = load_acc(x1_ptr, offs, inside, ACC)  # the whole rows when SINGLE_BLOCK
    b = load_acc(x2_ptr, offs, inside, ACC)
    amax1 = _vector_amax(x1_ptr, rows, in_row, d, a, ACC, BLOCK_D, SINGLE_BLOCK)
    amax2 = _vector_amax(x2_ptr, rows, in_row, d, b, ACC, BLOCK_D, SINGLE_BLOCK)
    p1 = norm_scale(amax1)
    p2 = norm_scale(amax2)
    p1c, p2c = p1[:, None], p2[:, None]
    if SINGLE_BLOCK:
        s1 = scaled_entry(a, p1c)
        s2 = scaled_entry(b, p2c)
        ssq1 = tl.sum(s1 * s1, axis=1)
        ssq2 = tl.sum(s2 * s2, axis=1)
        dot = tl.sum(s1 * s2, axis=1)
    else:
        part1 = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
        part2 = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
        part12 = tl.zeros([BLOCK_R, BLOCK_D], dtype=ACC)
        for start in range(0, d, BLOCK_D):
            o, inn = _tile_at(rows, in_row, start, d, BLOCK_D)
            s1 = scaled_entry(load_acc(x1_ptr, o, inn, ACC), p1c)
            s2 = scaled_entry(load_acc(x2_ptr, o, inn, ACC), p2c)
            part1 += s1 * s1
            part2 += s2 * s2
            part12 += s1 * s2
        ssq1 = tl.sum(part1, axis=1)
        ssq2 = tl.sum(part2, axis=1)
        dot = tl.sum(part12, axis=1)
    c = cosine_row(dot, p1, ssq1, amax1, p2, ssq2, amax2, eps, stats_ptr + rows * STATS, in_row)
    store_rounded(out_ptr, rows, c, in_row)


@triton.jit
def _cosine_backward_kernel(go_ptr, x1_ptr, x2_ptr, c_ptr, stats_ptr, g1_ptr, g2_ptr,
                            n_rows, d, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Elementwise given each row's stats, grad_output and output: one pass
    over the row's blocks whatever its length."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    rows, in_row = _row_block(n_rows, BLOCK_R)
    st = stats_ptr + rows * STATS
    # Rows outside the problem read p 1 and factors and divisors 0 (never stored).
    p1 = tl.load(st, mask=in_row, other=1.0)[:, None]
    q1 = tl.load(st + 1, mask=in_row, other=0.0)[:, None]
    divisor1 = tl.load(st + 2, mask=in_row, other=0.0)[:, None]
    gf1 = tl.load(st + 3, mask=in_row, other=0.0)[:, None]
    p2 = tl.load(st + 4, mask=in_row, other=1.0)[:, None]
    q2 = tl.load(st + 5, mask=in_row, other=0.0)[:, None]
    divisor2 = tl.load(st + 6, mask=in_row, other=0.0)[:, None]
    gf2 = tl.load(st + 7, mask=in_row, other=0.0)[:, None]
    g = tl.load(go_ptr + rows, mask=in_row, other=0.0).to(ACC)[:, None]
    c = tl.load(c_ptr + rows, mask=in_row, other=0.0).to(ACC)[:, None]
    for start in range(0, d, BLOCK_D):
        offs, inside = _tile_at(rows, in_row, start, d, BLOCK_D)
        v1 = normalized_entry(scaled_entry(load_acc(x1_ptr, offs, inside, ACC), p1), divisor1, q1)
        v2 = normalized_entry(scaled_entry(load_acc(x2_ptr, offs, inside, ACC), p2), divisor2, q2)
        store_saturated(g1_ptr, offs, cosine_grad_value(g, v1, v2, c, p1, gf1), inside)
        store_saturated(g2_ptr, offs, cosine_grad_value(g, v2, v1, c, p2, gf2), inside)


# ---------------------------------------------------------------------------
# cos_sim_matrix: tiled GEMM with the clamp in the epilogue
# ---------------------------------------------------------------------------


@triton.jit
def _gemm_tile(n_rows, n_cols, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
               GROUP_N: tl.constexpr):
    """(tile row, tile column) of this program: tiles are visited column by
    column within groups of GROUP_N tile rows, so consecutive programs share
    their b tiles."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n_rows, BLOCK_N)
    tiles_m = tl.cdiv(n_cols, BLOCK_M)
    per_group = GROUP_N * tiles_m
    first = (pid // per_group) * GROUP_N
    height = tl.minimum(tiles_n - first, GROUP_N)
    within = pid % per_group
    return first + within % height, within // height


@triton.jit
def _cos_sim_matrix_kernel(a_ptr, b_ptr, out_ptr, n_rows, n_cols, d,
                           stride_a0, stride_a1, stride_b0, stride_b1,
                           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_N: tl.constexpr, DOT_IN_ACC: tl.constexpr):
    ACC: tl.constexpr = tl.float64 if a_ptr.dtype.element_ty == tl.float64 else tl.float32
    tile_n, tile_m = _gemm_tile(n_rows, n_cols, BLOCK_N, BLOCK_M, GROUP_N)
    rn = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    # a tile [BLOCK_N, BLOCK_K]; b read transposed as a [BLOCK_K, BLOCK_M] tile.
    a_tile = a_ptr + rn[:, None] * stride_a0 + ks[None, :] * stride_a1
    b_tile = b_ptr + ks[:, None] * stride_b1 + rm[None, :] * stride_b0
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=ACC)
    for start in range(0, d, BLOCK_K):
        k_in = start + ks < d
        # 0 past the edges: adds nothing to the dot products.
        a_in = (rn[:, None] < n_rows) & k_in[None, :]
        b_in = k_in[:, None] & (rm[None, :] < n_cols)
        if DOT_IN_ACC:
            a = widen(a_tile, 0, a_in).to(ACC)
            b = widen(b_tile, 0, b_in).to(ACC)
        else:
            a = tl.load(a_tile, mask=a_in, other=0.0)
            b = tl.load(b_tile, mask=b_in, other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)
        a_tile += BLOCK_K * stride_a1
        b_tile += BLOCK_K * stride_b1
    c = cosine_clamp(acc)
    inside = (rn[:, None] < n_rows) & (rm[None, :] < n_cols)
    store_rounded(out_ptr, rn[:, None] * n_cols + rm[None, :], c, inside)


# ---------------------------------------------------------------------------
# Launchers (the op implementations)
# ---------------------------------------------------------------------------


# Every kernel of this module, as defined (tests may monkeypatch the names).
KERNELS = common.KernelSet(_normalize_kernel, _normalize_backward_kernel, _cosine_kernel,
            _cosine_backward_kernel, _cos_sim_matrix_kernel)
kernels_interpreted = KERNELS.interpreted
_check_runnable = KERNELS.check_runnable


def _row_config(n_rows, d):
    """(BLOCK_R, BLOCK_D, SINGLE_BLOCK, num_warps) for rows of d >= 0 entries."""
    if d <= MAX_FUSED_D:
        block_d = triton.next_power_of_2(max(d, 1))
        block_r = max(min(ROW_TILE // block_d, triton.next_power_of_2(n_rows)), 1)
        single = True
    else:
        block_d, block_r, single = LOOP_BLOCK, 1, False
    # 16 entries per thread, between 1 and 16 warps.
    num_warps = min(max(block_r * block_d // 512, 1), 16)
    return block_r, block_d, single, num_warps


def _grid(n_rows, block_r):
    return (triton.cdiv(n_rows, block_r),)


def normalize(input, eps):
    """x / max(||x||, eps) over the last dim -> (output, stats [..., 2] = (p, grad_factor))."""
    check_normalize(input, eps)
    _check_runnable("normalize", input)
    x = input.contiguous()
    n_rows, d = vector_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    stats = torch.empty(per_vector_shape(x, NORMALIZE_STATS), dtype=stats_dtype(x),
                        device=x.device)
    if n_rows == 0:
        return out, stats
    # d == 0 runs too: an empty vector is a zero vector (p 1, grad_factor 0).
    block_r, block_d, single, num_warps = _row_config(n_rows, d)
    with device_guard(x):
        _normalize_kernel[_grid(n_rows, block_r)](
            x, out, stats, n_rows, d, float(eps), BLOCK_R=block_r, BLOCK_D=block_d,
            SINGLE_BLOCK=single, num_warps=num_warps, **common.LAUNCH)
    return out, stats


def normalize_backward(grad_output, output, stats):
    """((g - y * sum(g * y)) * grad_factor) * p per entry."""
    check_normalize_backward(grad_output, output, stats)
    _check_runnable("normalize_backward", output)
    g, y, stats = grad_output.contiguous(), output.contiguous(), stats.contiguous()
    grad_input = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    n_rows, d = vector_rows(y)
    if grad_input.numel() == 0:
        return grad_input
    block_r, block_d, single, num_warps = _row_config(n_rows, d)
    with device_guard(y):
        _normalize_backward_kernel[_grid(n_rows, block_r)](
            g, y, stats, grad_input, n_rows, d, BLOCK_R=block_r, BLOCK_D=block_d,
            SINGLE_BLOCK=single, num_warps=num_warps, **common.LAUNCH)
    return grad_input


def cosine_similarity(x1, x2, eps):
    """Cosine similarity of x1 and x2 (one shape) over the last dim -> (output
    x1.shape[:-1], stats [..., COSINE_STATS])."""
    check_cosine(x1, x2, eps)
    _check_runnable("cosine_similarity", x1)
    a, b = x1.contiguous(), x2.contiguous()
    n_rows, d = vector_rows(a)
    out = torch.empty(per_vector_shape(a), dtype=a.dtype, device=a.device)
    stats = torch.empty(per_vector_shape(a, COSINE_STATS), dtype=stats_dtype(a), device=a.device)
    if n_rows == 0:
        return out, stats
    # d == 0 runs too: two zero vectors, similarity 0.
    block_r, block_d, single, num_warps = _row_config(n_rows, d)
    with device_guard(a):
        _cosine_kernel[_grid(n_rows, block_r)](
            a, b, out, stats, n_rows, d, float(eps), BLOCK_R=block_r, BLOCK_D=block_d,
            SINGLE_BLOCK=single, num_warps=num_warps, **common.LAUNCH)
    return out, stats


def cosine_similarity_backward(grad_output, x1, x2, output, stats):
    """(g * (((v2 - c * v1) * grad_factor1) * p1), the same with 1 and 2 swapped)."""
    check_cosine_backward(grad_output, x1, x2, output, stats)
    _check_runnable("cosine_similarity_backward", x1)
    g, c, stats = grad_output.contiguous(), output.contiguous(), stats.contiguous()
    a, b = x1.contiguous(), x2.contiguous()
    grad_x1 = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    grad_x2 = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    n_rows, d = vector_rows(a)
    if grad_x1.numel() == 0:
        return grad_x1, grad_x2
    # Elementwise: no fused/looped distinction, blocks of at most LOOP_BLOCK columns.
    block_r, block_d, _, num_warps = _row_config(n_rows, d)
    if block_d > LOOP_BLOCK:
        block_r, block_d = 1, LOOP_BLOCK
        num_warps = min(max(block_d // 512, 1), 16)
    with device_guard(a):
        _cosine_backward_kernel[_grid(n_rows, block_r)](
            g, a, b, c, stats, grad_x1, grad_x2, n_rows, d, BLOCK_R=block_r, BLOCK_D=block_d,
            num_warps=num_warps, **common.LAUNCH)
    return grad_x1, grad_x2


def cos_sim_matrix(a, b):
    """clamp(a @ b.T, -1, 1) of a [N, d] and b [M, d] -> [N, M] in their dtype."""
    check_cos_sim_matrix(a, b)
    _check_runnable("cos_sim_matrix", a)
    n_rows, d = a.shape
    n_cols = b.shape[0]
    out = torch.empty((n_rows, n_cols), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(n_rows, GEMM_BLOCK_N) * triton.cdiv(n_cols, GEMM_BLOCK_M),)
    # The interpreter's numpy matmul reads bfloat16 operands as raw 16-bit
    # integers: there they are widened first (bfloat16 products are exact in
    # float32, so only the summation order differs from the compiled MMA).
    dot_in_acc = kernels_interpreted() and a.dtype == torch.bfloat16
    with device_guard(a):
        _cos_sim_matrix_kernel[grid](
            a, b, out, n_rows, n_cols, d, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            BLOCK_N=GEMM_BLOCK_N, BLOCK_M=GEMM_BLOCK_M, BLOCK_K=GEMM_BLOCK_K,
            GROUP_N=GEMM_GROUP_N, DOT_IN_ACC=dot_in_acc, num_warps=GEMM_NUM_WARPS,
            num_stages=GEMM_NUM_STAGES, **common.LAUNCH)
    return out
