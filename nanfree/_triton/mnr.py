"""Triton backend of the MNR family: mnr_loss and mnr_loss_backward, the fused
multiple negatives ranking (InfoNCE) loss of `queries` [R, d] and `docs`
[M, d].

One function per op, named and called as the ``nanfree::`` op
(csrc/registration.cpp), with the argument checks of nanfree/_ops/mnr.py.
The ops take raw embeddings: nanfree/_ops/mnr.py normalizes their
rows around this module's cores (_mnr_loss_normalized,
_mnr_loss_backward_normalized), which see unit rows and return the
gradients of the unit rows. The layout and every rule are
csrc/include/nanfree/mnr_math.h's, mirrored here function by function (same
names): mnr_doc_penalized, mnr_column_kind, mnr_logit, mnr_log_partition,
mnr_relative_lse, mnr_row_loss, mnr_row_normalizer, mnr_normalizer,
mnr_direction_weight, mnr_logit_grad; the row logsumexps use
the online state of numerics.py. No rule is written inline in a kernel.

Tiles, flash-attention style. Each local row g has a Q row (the docs, then
the queries with query_to_query) and, with doc_to_query / doc_to_doc, a P row
(the queries, then the docs). A row kind's columns are two segments (two
tensors, never concatenated); a tile is BLOCK_M rows by BLOCK_N columns of one
segment, its cosines a tl.dot over d in chunks of BLOCK_K, accumulated in
float32 (float64 for float64). No [rows, M] matrix is stored: memory is
O((R + M) d).

- Forward (_mnr_forward_kernel, one launch per row kind): a program holds
  BLOCK_M rows and a run of column blocks (a split; several splits per row
  block when the rows are too few to fill the GPU), keeps each row's online
  logsumexp state and, on Q rows, the positive's logit (the target logit t)
  picked from its tile (column g of the docs). _mnr_finish_kernel merges the
  splits' states and writes stats (the logsumexps relative to t, and t) and
  the per-row loss (mnr_row_loss); mean and sum are taken with torch.
- Backward: every tile's cosines are recomputed once, from stats.
  _mnr_row_grad_kernel (one launch per row kind) adds dlogit @ columns of the
  column blocks of its split to the row vectors' sums (queries[g] for Q rows,
  docs[g] for P rows) in a float32 (float64) buffer [splits, rows, d], chunk
  by chunk over d (BLOCK_D entries: a whole row of d would not fit the
  registers), and writes per-program partial sums of the scale gradient.
  _mnr_col_grad_kernel (one launch for the docs, one for the queries) adds
  dlogit^T @ rows over every row block of the row kinds a block of columns
  belongs to, the same way, to a buffer [n, d] (the output itself for
  float32 and float64), then adds the row buffers of the local rows and
  stores the gradient in the input dtype. Every buffer row is read and
  written by one program only: no atomics, deterministic.
- The gradient dots see each row's upstream gradient divided by a power of
  two 2^e (e from the largest finite upstream gradient), so |d loss / d
  logit| <= 2, and 2^e multiplies the sums at the end (exact). float16 and
  bfloat16: the dlogit tile is split into a high and a low half-precision
  part (float16 scaled by 2^14 first, so nothing falls below its normals),
  two tensor-core dots against the half-precision vectors, accumulated in
  float32: about 22 (float16) or 16 (bfloat16) bits of every dlogit, where a
  single cast would keep 11 or 8. float32 and float64: one IEEE dot
  (input_precision="ieee", never TF32).
- Gradients are stored in the input dtype, saturated at its largest finite
  value for halves (element_io's store_saturated); the scale gradient is the sum
  of the partial sums.

Triton's interpreter reads bfloat16 dot operands as raw 16-bit integers:
there bfloat16 vectors are widened to float32 first and every dot is a
float32 one (products of bfloat16 values are exact in float32).

The kernels run where the Triton of this process can run them (common.py):
CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 when this module
was imported), CUDA tensors when compiled.
"""

import torch
import triton
import triton.language as tl

from .._ops.common import acc_dtype
from .._ops.mnr import (STATS, check_mnr_loss, check_mnr_loss_backward, no_gradients,
                        on_raw_embeddings, reduce_loss, scaled_upstream, upstream_per_row)
from . import common
from .common import device_guard
from .element_io import store_saturated, widen
from .numerics import lse_merge, lse_scale, lse_update_max_candidate, lse_update_term

# Row kinds, column kinds and hardness modes of mnr_math.h.
ROW_QUERY = tl.constexpr(0)
ROW_POSITIVE = tl.constexpr(1)
COLUMN_PLAIN = tl.constexpr(0)
COLUMN_PENALIZED = tl.constexpr(1)
COLUMN_EXCLUDED = tl.constexpr(2)
COLUMN_POSITIVE = tl.constexpr(3)
HARDNESS_IN_BATCH = tl.constexpr(1)
HARDNESS_HARD = tl.constexpr(2)
HARDNESS_ALL = tl.constexpr(3)
# The column entities of _mnr_col_grad_kernel.
ENTITY_DOCS = tl.constexpr(0)
ENTITY_QUERIES = tl.constexpr(1)
STATS_PER_ROW = tl.constexpr(STATS)  # (rel_q, rel_p, t) of each local row

# Block policy (module attributes, so tests may shrink them to reach the loops).
# Per input dtype, (BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D): tiles of BLOCK_M rows
# by BLOCK_N columns, cosines summed over d in chunks of BLOCK_K; the
# backward adds each tile's dlogit @ vectors to its sums in chunks of BLOCK_D
# entries of d. float32's IEEE dots are FMA loops (short chunks); float64
# tiles are smaller. Every tile side a tl.dot reduces over (BLOCK_K, and
# BLOCK_N or BLOCK_M in the backward) is at least 16: compiled Triton 3.6
# refuses a dot with K < 16 (the interpreter and Triton 3.8 accept it;
# scripts/triton_compile_check.py compiles every kernel without a GPU).
BLOCKS = {
    torch.float16: (64, 64, 32, 64),
    torch.bfloat16: (64, 64, 32, 64),
    torch.float32: (64, 64, 16, 32),
    torch.float64: (32, 32, 16, 64),
}
FINISH_BLOCK = 128
NUM_WARPS = 8
# Column splits: None lets _splits fill the GPU (about SPLIT_PROGRAMS_PER_SM
# programs per SM, each at least MIN_SPLIT_BLOCKS column blocks; one split in
# the interpreter); a number forces that many (at most one per column block).
COLUMN_SPLITS = None
SPLIT_PROGRAMS_PER_SM = 2
MIN_SPLIT_BLOCKS = 4

# float16's dlogit scale before the split (|dlogit| <= 2: at most 2^15).
FP16_PRESCALE = 16384.0


# ---------------------------------------------------------------------------
# Mirror of mnr_math.h
# ---------------------------------------------------------------------------


@triton.jit
def mnr_doc_penalized(mode: tl.constexpr, g, j, r, owned_end):
    """Whether doc j of the query_to_doc row of query g gets the hardness term."""
    own = (j < owned_end) & (j % r == g)
    if mode == HARDNESS_IN_BATCH:
        return own == 0
    elif mode == HARDNESS_HARD:
        return own & (j >= r)
    elif mode == HARDNESS_ALL:
        return j != g
    else:
        return tl.zeros_like(own)


@triton.jit
def mnr_column_kind(row_kind: tl.constexpr, g, j, first_len, r, owned_end,
                    hardness_mode: tl.constexpr):
    """What column j of a row's concatenated columns is to local row g
    (first_len: the length of the row's first segment)."""
    if row_kind == ROW_QUERY:
        doc_kind = tl.where(mnr_doc_penalized(hardness_mode, g, j, r, owned_end),
                            COLUMN_PENALIZED, COLUMN_PLAIN)
        doc_kind = tl.where(j == g, COLUMN_POSITIVE, doc_kind)
        # query_to_query: a query is not its own negative.
        return tl.where(j < first_len, doc_kind,
                        tl.where(j - first_len == g, COLUMN_EXCLUDED, COLUMN_PLAIN))
    else:
        doc = j - first_len
        # doc_to_doc: the docs of the positive's own query are not its negatives.
        own = (j >= first_len) & (doc < owned_end) & (doc % r == g)
        return tl.where(own, COLUMN_EXCLUDED, COLUMN_PLAIN)


@triton.jit
def mnr_logit(cos, column_kind, scale, hardness_strength):
    logit = scale * cos
    logit = tl.where(column_kind == COLUMN_PENALIZED, logit + hardness_strength * cos, logit)
    # An excluded pair takes no part in its row's logsumexp (exp(-inf) = 0).
    return tl.where(column_kind == COLUMN_EXCLUDED, float("-inf"), logit)


@triton.jit
def mnr_log_partition(lse_q, lse_p, per_direction: tl.constexpr, has_p_row: tl.constexpr):
    """log_z of a local row from its two rows' logsumexps."""
    if per_direction:
        if has_p_row:
            return (lse_q + lse_p) * 0.5
        else:
            return lse_q
    else:
        m = tl.where(lse_q > lse_p, lse_q, lse_p)
        # logaddexp; lse_scale keeps two equal (or two infinite) values at exp(0).
        return m + tl.log(lse_scale(lse_q, m) + lse_scale(lse_p, m))


@triton.jit
def mnr_relative_lse(m_state, s_state, target):
    """A row's logsumexp relative to its target logit: (max - t) + log(sum)."""
    return (m_state - target) + tl.log(s_state)


@triton.jit
def mnr_row_loss(rel_q, rel_p, per_direction: tl.constexpr, has_p_row: tl.constexpr):
    """loss_g = log_z - t from the row's relative logsumexps."""
    return mnr_log_partition(rel_q, rel_p, per_direction, has_p_row)


@triton.jit
def mnr_row_normalizer(rel_q, rel_p, target, query_row: tl.constexpr,
                       per_direction: tl.constexpr, has_p_row: tl.constexpr):
    """A row kind's softmax normalizer, absolute, from the saved (rel_q, rel_p, t)."""
    rel_z = mnr_log_partition(rel_q, rel_p, per_direction, has_p_row)
    if query_row:
        own = rel_q
    else:
        own = rel_p
    return target + mnr_normalizer(rel_z, own, per_direction)


@triton.jit
def mnr_normalizer(log_z, row_lse, per_direction: tl.constexpr):
    if per_direction:
        return row_lse
    else:
        return log_z


@triton.jit
def mnr_direction_weight(per_direction: tl.constexpr, has_p_row: tl.constexpr):
    if per_direction and has_p_row:
        return 0.5
    else:
        return 1.0


@triton.jit
def mnr_logit_grad(logit, column_kind, normalizer, weight, upstream):
    """d loss / d logit of one pair (`weight`: upstream times direction weight)."""
    p = weight * lse_scale(logit, normalizer)
    p = tl.where(column_kind == COLUMN_POSITIVE, p - upstream, p)
    # An excluded pair has no gradient; exp(-inf - normalizer) would be NaN for
    # a row whose every pair is excluded (normalizer -inf).
    return tl.where(column_kind == COLUMN_EXCLUDED, 0.0, p)


# ---------------------------------------------------------------------------
# Tiles (no special-value rule in here)
# ---------------------------------------------------------------------------


@triton.jit
def _operand(ptr, offs, inside, ACC: tl.constexpr, WIDEN: tl.constexpr):
    """A dot operand: the vectors' entries at ptr + offs, 0 outside the problem
    (a 0 adds nothing to a dot product); widened to ACC when WIDEN."""
    if WIDEN:
        return widen(ptr, offs, inside).to(ACC)
    else:
        return tl.load(ptr + offs, mask=inside, other=0.0)


@triton.jit
def _wide(x):
    """An index (a Python int or an int32 scalar) as int64, for element offsets."""
    return tl.cast(x, tl.int64)


@triton.jit
def _cos_tile(a_ptr, a_start, a_in, b_ptr, b_start, b_in, d, ACC: tl.constexpr,
              BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
              WIDEN: tl.constexpr):
    """[BLOCK_A, BLOCK_B] dot products of the vectors a_start.. of a_ptr and
    b_start.. of b_ptr (rows of d entries), in ACC; 0 where a vector is
    outside (a_in, b_in). Offsets within a tile are int32 from the tile's
    first vector (fewer registers than int64 offsets per entry)."""
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + _wide(a_start) * d
    b_base = b_ptr + _wide(b_start) * d
    a_offs = tl.arange(0, BLOCK_A)[:, None] * d + ks[None, :]
    b_offs = tl.arange(0, BLOCK_B)[None, :] * d + ks[:, None]  # b read transposed
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=ACC)
    for k0 in range(0, d, BLOCK_K):
        k_in = k0 + ks < d
        a = _operand(a_base, a_offs + k0, a_in[:, None] & k_in[None, :], ACC, WIDEN)
        b = _operand(b_base, b_offs + k0, k_in[:, None] & b_in[None, :], ACC, WIDEN)
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=ACC)
    return acc


@triton.jit
def _vectors(ptr, start, inside, d0, d_in, d, ACC: tl.constexpr, BLOCK: tl.constexpr,
             BLOCK_D: tl.constexpr, WIDEN: tl.constexpr):
    """[BLOCK, BLOCK_D] entries d0.. of the vectors start.. (0 outside)."""
    offs = tl.arange(0, BLOCK)[:, None] * d + tl.arange(0, BLOCK_D)[None, :]
    return _operand(ptr + (_wide(start) * d + d0), offs, inside[:, None] & d_in[None, :],
                    ACC, WIDEN)


@triton.jit
def _grad_operands(dlogit, vec_ptr, SPLIT: tl.constexpr, PRESCALE: tl.constexpr):
    """(hi, lo): the dlogit tile as dot operands against the vectors of
    vec_ptr. SPLIT (half-precision vectors): dlogit * PRESCALE as a high and
    a low half-precision part (the sums then carry the factor PRESCALE);
    else dlogit itself (lo unused)."""
    if SPLIT:
        x = dlogit * PRESCALE
        hi = x.to(vec_ptr.dtype.element_ty)
        lo = (x - hi.to(x.dtype)).to(vec_ptr.dtype.element_ty)  # x - hi is exact
        return hi, lo
    else:
        return dlogit, dlogit


@triton.jit
def _accumulate(buf_ptr, buf_start, buf_in, vec_ptr, vec_start, vec_in, d, hi, lo,
                ACC: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
                BLOCK_D: tl.constexpr, WIDEN: tl.constexpr, SPLIT: tl.constexpr):
    """buf[a, :] += sum_b dlogit[a, b] * vec[vec_start + b, :] for the tile's
    rows a (rows of d entries from element buf_start of buf, ACC, owned by
    this program), in chunks of BLOCK_D entries of d."""
    ds = tl.arange(0, BLOCK_D)
    offs = tl.arange(0, BLOCK_A)[:, None] * d + ds[None, :]
    for d0 in range(0, d, BLOCK_D):
        d_in = d0 + ds < d
        vectors = _vectors(vec_ptr, vec_start, vec_in, d0, d_in, d, ACC, BLOCK_B, BLOCK_D, WIDEN)
        inside = buf_in[:, None] & d_in[None, :]
        acc = tl.load(buf_ptr + (buf_start + d0) + offs, mask=inside, other=0.0)
        if SPLIT:
            acc = tl.dot(hi, vectors, acc, out_dtype=ACC)
            acc = tl.dot(lo, vectors, acc, out_dtype=ACC)
        else:
            acc = tl.dot(hi, vectors, acc, input_precision="ieee", out_dtype=ACC)
        tl.store(buf_ptr + (buf_start + d0) + offs, acc, mask=inside)
    # The next tile reads these sums back, maybe in other threads of the program.
    tl.debug_barrier()


@triton.jit
def _scale_in(scale_ptr, scale_value, ACC: tl.constexpr, SCALE_TENSOR: tl.constexpr):
    """scale in ACC: a tensor scale (0-d, ACC) read, a Python scale as is."""
    if SCALE_TENSOR:
        return tl.load(scale_ptr)
    else:
        return _float_in(scale_value, ACC)


@triton.jit
def _float_in(value, ACC: tl.constexpr):
    """A float argument of the op (a float64 kernel argument) in ACC."""
    return tl.full([], value, tl.float64).to(ACC)


@triton.jit
def _kinds(row_kind: tl.constexpr, g, j, inside, first_len, r, owned_end,
           hardness_mode: tl.constexpr):
    """mnr_column_kind of a tile; a pair outside the problem (padding) is
    excluded: no logit, no gradient."""
    kind = mnr_column_kind(row_kind, g, j, first_len, r, owned_end, hardness_mode)
    return tl.where(inside, kind, COLUMN_EXCLUDED)


@triton.jit
def _row_terms(stats_ptr, up_ptr, i, row_in, ROW_KIND: tl.constexpr,
               PER_DIRECTION: tl.constexpr, HAS_P: tl.constexpr):
    """(normalizer, weight, upstream) of local rows i for rows of kind ROW_KIND."""
    # Rows outside the problem read 0s (their pairs are excluded).
    at = i.to(tl.int64) * STATS_PER_ROW
    rel_q = tl.load(stats_ptr + at, mask=row_in, other=0.0)
    rel_p = tl.load(stats_ptr + at + 1, mask=row_in, other=0.0)
    target = tl.load(stats_ptr + at + 2, mask=row_in, other=0.0)
    normalizer = mnr_row_normalizer(rel_q, rel_p, target, ROW_KIND == ROW_QUERY, PER_DIRECTION,
                                    HAS_P)
    up = tl.load(up_ptr + i, mask=row_in, other=0.0)
    return normalizer, up * mnr_direction_weight(PER_DIRECTION, HAS_P), up


@triton.jit
def _split_blocks(n_first, n_second, per_split, BLOCK_N: tl.constexpr):
    """This program's column blocks: [lo1, hi1) of the first segment and
    [lo2, hi2) of the second (block numbers within each segment)."""
    nb1 = tl.cdiv(n_first, BLOCK_N)
    nb = nb1 + tl.cdiv(n_second, BLOCK_N)
    start = tl.program_id(2) * per_split
    end = tl.minimum(start + per_split, nb)
    return start, tl.minimum(end, nb1), tl.maximum(start, nb1) - nb1, tl.maximum(end, nb1) - nb1


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@triton.jit
def _forward_tile(row_ptr, col_ptr, g0, g, row_in, c0, n_cols, j_shift, d, first_len, r,
                  owned_end, scale, hs, m_state, s_state, pos, ROW_KIND: tl.constexpr,
                  HARDNESS: tl.constexpr, PICK: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  WIDEN: tl.constexpr):
    """The row states (and the positive's logit, the target logit t, where
    PICK) after the tile of columns c0.. of col_ptr (n_cols of them), numbered
    j_shift + c in the row's concatenated columns."""
    c = c0 + tl.arange(0, BLOCK_N)
    c_in = c < n_cols
    j = j_shift + c
    cos = _cos_tile(row_ptr, g0, row_in, col_ptr, c0, c_in, d, ACC, BLOCK_M, BLOCK_N, BLOCK_K,
                    WIDEN)
    kind = _kinds(ROW_KIND, g[:, None], j[None, :], row_in[:, None] & c_in[None, :], first_len,
                  r, owned_end, HARDNESS)
    logit = mnr_logit(cos, kind, scale, hs)
    # lse_block_state of each row of the tile (numerics.h's lse_update rules).
    tile_max = tl.max(lse_update_max_candidate(logit), axis=1)
    tile_sum = tl.sum(lse_update_term(logit, tile_max[:, None]), axis=1)
    m_state, s_state = lse_merge(m_state, s_state, tile_max, tile_sum)
    if PICK:  # the positive: column g of the docs; the very logit the states saw
        pos += tl.sum(tl.where(j[None, :] == g[:, None], logit, 0.0), axis=1)
    return m_state, s_state, pos


@triton.jit
def _mnr_forward_kernel(q_ptr, d_ptr, scale_ptr, part_ptr, pos_ptr, r, d, offset, rows,
                        owned_end, first_len, second_len, per_split, scale_value: tl.float64,
                        hs: tl.float64, ROW_KIND: tl.constexpr, HARDNESS: tl.constexpr,
                        SCALE_TENSOR: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr):
    """Online logsumexp states (max, sum) of BLOCK_M rows of kind ROW_KIND over
    this split's column blocks -> part [splits, rows, 2]; Q rows: the
    positive's logit (0 if not in this split) -> pos [splits, rows]."""
    ACC: tl.constexpr = part_ptr.dtype.element_ty
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = i < rows
    g0 = offset + tl.program_id(0) * BLOCK_M
    g = offset + i
    split = tl.program_id(2)
    scale = _scale_in(scale_ptr, scale_value, ACC, SCALE_TENSOR)
    hs = _float_in(hs, ACC)
    if ROW_KIND == ROW_QUERY:  # docs, then queries
        row_ptr, first_ptr, second_ptr = q_ptr, d_ptr, q_ptr
    else:  # queries, then docs
        row_ptr, first_ptr, second_ptr = d_ptr, q_ptr, d_ptr
    m_state = tl.full([BLOCK_M], float("-inf"), ACC)  # the empty set
    s_state = tl.zeros([BLOCK_M], ACC)
    pos = tl.zeros([BLOCK_M], ACC)
    lo1, hi1, lo2, hi2 = _split_blocks(first_len, second_len, per_split, BLOCK_N)
    for cb in range(lo1, hi1):
        m_state, s_state, pos = _forward_tile(
            row_ptr, first_ptr, g0, g, row_in, cb * BLOCK_N, first_len, 0, d, first_len, r,
            owned_end, scale, hs, m_state, s_state, pos, ROW_KIND, HARDNESS,
            ROW_KIND == ROW_QUERY, ACC, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN)
    for cb in range(lo2, hi2):
        m_state, s_state, pos = _forward_tile(
            row_ptr, second_ptr, g0, g, row_in, cb * BLOCK_N, second_len, first_len, d, first_len,
            r, owned_end, scale, hs, m_state, s_state, pos, ROW_KIND, HARDNESS, False, ACC,
            BLOCK_M, BLOCK_N, BLOCK_K, WIDEN)
    at = split.to(tl.int64) * rows + i
    tl.store(part_ptr + at * 2, m_state, mask=row_in)
    tl.store(part_ptr + at * 2 + 1, s_state, mask=row_in)
    if ROW_KIND == ROW_QUERY:
        tl.store(pos_ptr + at, pos, mask=row_in)


@triton.jit
def _merged_relative_lse(part_ptr, i, row_in, rows, splits, target, ACC: tl.constexpr,
                         BLOCK: tl.constexpr):
    """The logsumexp of rows i relative to their target logits, from their
    splits' states."""
    m_state = tl.full([BLOCK], float("-inf"), ACC)
    s_state = tl.zeros([BLOCK], ACC)
    for s in range(splits):
        at = (s * rows + i).to(tl.int64) * 2
        # Rows outside the problem read the empty state (never stored).
        m_s = tl.load(part_ptr + at, mask=row_in, other=float("-inf"))
        s_s = tl.load(part_ptr + at + 1, mask=row_in, other=0.0)
        m_state, s_state = lse_merge(m_state, s_state, m_s, s_s)
    return mnr_relative_lse(m_state, s_state, target)


@triton.jit
def _mnr_finish_kernel(part_q_ptr, part_p_ptr, pos_ptr, stats_ptr, loss_ptr, rows, splits_q,
                       splits_p, PER_DIRECTION: tl.constexpr, HAS_P: tl.constexpr,
                       BLOCK: tl.constexpr):
    """stats (each row's two logsumexps relative to its target logit t, and t)
    and loss_g = log_z - t (mnr_row_loss)."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_in = i < rows
    target = tl.zeros([BLOCK], ACC)
    for s in range(splits_q):  # one split holds column g, the others add 0
        target += tl.load(pos_ptr + (s * rows + i).to(tl.int64), mask=row_in, other=0.0)
    rel_q = _merged_relative_lse(part_q_ptr, i, row_in, rows, splits_q, target, ACC, BLOCK)
    if HAS_P:
        rel_p = _merged_relative_lse(part_p_ptr, i, row_in, rows, splits_p, target, ACC, BLOCK)
    else:
        rel_p = tl.full([BLOCK], float("-inf"), ACC)  # no P row: the empty set
    at = i.to(tl.int64) * STATS_PER_ROW
    tl.store(stats_ptr + at, rel_q, mask=row_in)
    tl.store(stats_ptr + at + 1, rel_p, mask=row_in)
    tl.store(stats_ptr + at + 2, target, mask=row_in)
    tl.store(loss_ptr + i, mnr_row_loss(rel_q, rel_p, PER_DIRECTION, HAS_P), mask=row_in)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


@triton.jit
def _grad_tile(cos, kind, scale, hs, normalizer, weight, up):
    """(dlogit, dlogit * cos) of a tile: the gradient of its logits for the
    rows' (scaled) upstream gradients, and its terms of the scale gradient
    (the raw cosine: the hardness term has no gradient)."""
    logit = mnr_logit(cos, kind, scale, hs)
    dlogit = mnr_logit_grad(logit, kind, normalizer, weight, up)
    return dlogit, dlogit * cos


@triton.jit
def _row_grad_tile(row_ptr, col_ptr, buf_ptr, buf_start, g0, g, row_in, c0, n_cols, j_shift, d,
                   first_len, r, owned_end, scale, hs, normalizer, weight, up, s_acc,
                   ROW_KIND: tl.constexpr, HARDNESS: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_D: tl.constexpr, WIDEN: tl.constexpr, SPLIT: tl.constexpr,
                   PRESCALE: tl.constexpr):
    """The tile of columns c0.. of col_ptr (n_cols of them, numbered j_shift +
    c): its dlogit @ columns added to the rows' sums in buf; returns s_acc
    plus its scale-gradient terms."""
    c = c0 + tl.arange(0, BLOCK_N)
    c_in = c < n_cols
    j = j_shift + c
    cos = _cos_tile(row_ptr, g0, row_in, col_ptr, c0, c_in, d, ACC, BLOCK_M, BLOCK_N, BLOCK_K,
                    WIDEN)
    inside = row_in[:, None] & c_in[None, :]
    kind = _kinds(ROW_KIND, g[:, None], j[None, :], inside, first_len, r, owned_end, HARDNESS)
    dlogit, s_terms = _grad_tile(cos, kind, scale, hs, normalizer[:, None], weight[:, None],
                                 up[:, None])
    hi, lo = _grad_operands(dlogit, col_ptr, SPLIT, PRESCALE)
    _accumulate(buf_ptr, buf_start, row_in, col_ptr, c0, c_in, d, hi, lo, ACC, BLOCK_M, BLOCK_N,
                BLOCK_D, WIDEN, SPLIT)
    # Padding pairs add nothing (a NaN row against a zero padding column is NaN).
    return s_acc + tl.sum(tl.where(inside, s_terms, 0.0), axis=1)


@triton.jit
def _mnr_row_grad_kernel(q_ptr, d_ptr, scale_ptr, stats_ptr, up_ptr, buf_ptr, sgrad_ptr, r, d,
                         offset, rows, owned_end, first_len, second_len, per_split,
                         scale_value: tl.float64, hs: tl.float64, ROW_KIND: tl.constexpr,
                         HARDNESS: tl.constexpr, PER_DIRECTION: tl.constexpr,
                         HAS_P: tl.constexpr, SCALE_TENSOR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_D: tl.constexpr, WIDEN: tl.constexpr, SPLIT: tl.constexpr,
                         PRESCALE: tl.constexpr):
    """sum_j dlogit * column_j over this split's columns for BLOCK_M rows of
    kind ROW_KIND -> buf [splits, rows, d] (zeros on entry; times PRESCALE,
    without scale and 2^e), and the program's sum of dlogit * cos -> sgrad
    [splits, row blocks]."""
    ACC: tl.constexpr = buf_ptr.dtype.element_ty
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = i < rows
    g = offset + i
    split = tl.program_id(2)
    scale = _scale_in(scale_ptr, scale_value, ACC, SCALE_TENSOR)
    hs = _float_in(hs, ACC)
    normalizer, weight, up = _row_terms(stats_ptr, up_ptr, i, row_in, ROW_KIND, PER_DIRECTION,
                                        HAS_P)
    if ROW_KIND == ROW_QUERY:
        row_ptr, first_ptr, second_ptr = q_ptr, d_ptr, q_ptr
    else:
        row_ptr, first_ptr, second_ptr = d_ptr, q_ptr, d_ptr
    g0 = offset + tl.program_id(0) * BLOCK_M
    buf_start = (split.to(tl.int64) * rows + tl.program_id(0) * BLOCK_M) * d
    s_acc = tl.zeros([BLOCK_M], ACC)
    lo1, hi1, lo2, hi2 = _split_blocks(first_len, second_len, per_split, BLOCK_N)
    for cb in range(lo1, hi1):
        s_acc = _row_grad_tile(
            row_ptr, first_ptr, buf_ptr, buf_start, g0, g, row_in, cb * BLOCK_N, first_len, 0, d,
            first_len, r, owned_end, scale, hs, normalizer, weight, up, s_acc, ROW_KIND, HARDNESS,
            ACC, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D, WIDEN, SPLIT, PRESCALE)
    for cb in range(lo2, hi2):
        s_acc = _row_grad_tile(
            row_ptr, second_ptr, buf_ptr, buf_start, g0, g, row_in, cb * BLOCK_N, second_len,
            first_len, d, first_len, r, owned_end, scale, hs, normalizer, weight, up, s_acc,
            ROW_KIND, HARDNESS, ACC, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D, WIDEN, SPLIT, PRESCALE)
    tl.store(sgrad_ptr + split * tl.num_programs(0) + tl.program_id(0), tl.sum(s_acc, axis=0))


@triton.jit
def _col_grad_rows(col_ptr, row_ptr, stats_ptr, up_ptr, colbuf_ptr, c0, c_in, j, d, offset,
                   rows, first_len, r, owned_end, scale, hs, ROW_KIND: tl.constexpr,
                   HARDNESS: tl.constexpr, PER_DIRECTION: tl.constexpr, HAS_P: tl.constexpr,
                   ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN: tl.constexpr,
                   SPLIT: tl.constexpr, PRESCALE: tl.constexpr):
    """Adds sum over every local row g of kind ROW_KIND of dlogit(g, j) * row_g
    to the columns c's sums in colbuf (column numbers j of that row kind)."""
    col_start = _wide(c0) * d
    for rb in range(0, tl.cdiv(rows, BLOCK_M)):
        i = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_in = i < rows
        g = offset + i
        normalizer, weight, up = _row_terms(stats_ptr, up_ptr, i, row_in, ROW_KIND,
                                            PER_DIRECTION, HAS_P)
        # The tile transposed: [columns, rows].
        cos = _cos_tile(col_ptr, c0, c_in, row_ptr, offset + rb * BLOCK_M, row_in, d, ACC,
                        BLOCK_N, BLOCK_M, BLOCK_K, WIDEN)
        kind = _kinds(ROW_KIND, g[None, :], j[:, None], c_in[:, None] & row_in[None, :],
                      first_len, r, owned_end, HARDNESS)
        dlogit, _ = _grad_tile(cos, kind, scale, hs, normalizer[None, :], weight[None, :],
                               up[None, :])
        hi, lo = _grad_operands(dlogit, row_ptr, SPLIT, PRESCALE)
        _accumulate(colbuf_ptr, col_start, c_in, row_ptr, offset + rb * BLOCK_M, row_in, d, hi,
                    lo, ACC, BLOCK_N, BLOCK_M, BLOCK_D, WIDEN, SPLIT)


@triton.jit
def _mnr_col_grad_kernel(q_ptr, d_ptr, scale_ptr, factor_ptr, stats_ptr, up_ptr, buf_ptr,
                         colbuf_ptr, out_ptr, r, m, d, offset, rows, owned_end, splits,
                         scale_value: tl.float64, hs: tl.float64, ENTITY: tl.constexpr,
                         QUERY_TO_QUERY: tl.constexpr, DOC_TO_QUERY: tl.constexpr,
                         DOC_TO_DOC: tl.constexpr, HARDNESS: tl.constexpr,
                         PER_DIRECTION: tl.constexpr, HAS_P: tl.constexpr,
                         HAS_BUF: tl.constexpr, SCALE_TENSOR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_D: tl.constexpr, WIDEN: tl.constexpr, SPLIT: tl.constexpr,
                         PRESCALE: tl.constexpr):
    """The gradient of BLOCK_N docs (ENTITY_DOCS) or queries: their column
    terms over the row kinds they are columns of, summed in colbuf (zeros on
    entry, ACC; the output itself when it is ACC), plus the row kernel's
    buffer (its splits) where they are the row vectors of local rows (docs[g]
    of P rows, queries[g] of Q rows), times scale * 2^e / PRESCALE."""
    ACC: tl.constexpr = colbuf_ptr.dtype.element_ty
    c0 = tl.program_id(0) * BLOCK_N
    c = c0 + tl.arange(0, BLOCK_N)
    scale = _scale_in(scale_ptr, scale_value, ACC, SCALE_TENSOR)
    hs = _float_in(hs, ACC)
    p_first = r if DOC_TO_QUERY else 0  # the P rows' first segment: queries or nothing
    if ENTITY == ENTITY_DOCS:
        c_in = c < m
        _col_grad_rows(d_ptr, q_ptr, stats_ptr, up_ptr, colbuf_ptr, c0, c_in, c, d, offset, rows,
                       m, r, owned_end, scale, hs, ROW_QUERY, HARDNESS, PER_DIRECTION, HAS_P,
                       ACC, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D, WIDEN, SPLIT, PRESCALE)
        if DOC_TO_DOC:
            _col_grad_rows(d_ptr, d_ptr, stats_ptr, up_ptr, colbuf_ptr, c0, c_in, p_first + c, d,
                           offset, rows, p_first, r, owned_end, scale, hs, ROW_POSITIVE,
                           HARDNESS, PER_DIRECTION, HAS_P, ACC, BLOCK_M, BLOCK_N, BLOCK_K,
                           BLOCK_D, WIDEN, SPLIT, PRESCALE)
    else:
        c_in = c < r
        if QUERY_TO_QUERY:
            _col_grad_rows(q_ptr, q_ptr, stats_ptr, up_ptr, colbuf_ptr, c0, c_in, m + c, d,
                           offset, rows, m, r, owned_end, scale, hs, ROW_QUERY, HARDNESS,
                           PER_DIRECTION, HAS_P, ACC, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D, WIDEN,
                           SPLIT, PRESCALE)
        if DOC_TO_QUERY:
            _col_grad_rows(q_ptr, d_ptr, stats_ptr, up_ptr, colbuf_ptr, c0, c_in, c, d, offset,
                           rows, p_first, r, owned_end, scale, hs, ROW_POSITIVE, HARDNESS,
                           PER_DIRECTION, HAS_P, ACC, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_D, WIDEN,
                           SPLIT, PRESCALE)
    factor = tl.load(factor_ptr) * (1.0 / PRESCALE)  # powers of two: exact
    local = c - offset
    is_local = c_in & (local >= 0) & (local < rows)
    ds = tl.arange(0, BLOCK_D)
    offs = tl.arange(0, BLOCK_N)[:, None] * d + ds[None, :]
    for d0 in range(0, d, BLOCK_D):
        d_in = d0 + ds < d
        inside = c_in[:, None] & d_in[None, :]
        start = _wide(c0) * d + d0
        acc = tl.load(colbuf_ptr + start + offs, mask=inside, other=0.0)
        if HAS_BUF:  # the row vectors' gradients of the local rows among these columns
            for s in range(splits):
                at = _wide(s * rows + (c0 - offset)) * d + d0
                acc += tl.load(buf_ptr + at + offs, mask=is_local[:, None] & d_in[None, :],
                               other=0.0)
        store_saturated(out_ptr + start, offs, (acc * factor) * scale, inside)


# ---------------------------------------------------------------------------
# Launchers (the op implementations)
# ---------------------------------------------------------------------------


# Every kernel of this module, as defined (tests may monkeypatch the names).
KERNELS = common.KernelSet(_mnr_forward_kernel, _mnr_finish_kernel, _mnr_row_grad_kernel, _mnr_col_grad_kernel)
kernels_interpreted = KERNELS.interpreted
_check_runnable = KERNELS.check_runnable


class _Launch:
    """What every launch of one problem shares: the contiguous inputs, the
    block policy, the scale arguments and the row kinds' column segments."""

    def __init__(self, problem, queries, docs, scale, scale_value):
        self.p = problem
        self.q = queries.contiguous()
        self.d = docs.contiguous()
        self.acc = acc_dtype(queries.dtype)
        self.device = queries.device
        self.block_m, self.block_n, self.block_k, block_d = BLOCKS[queries.dtype]
        self.block_d = min(block_d, triton.next_power_of_2(max(problem.d, 1)))
        # The interpreter's dot reads bfloat16 as integers: widened there.
        self.widen = kernels_interpreted() and queries.dtype == torch.bfloat16
        half = queries.dtype in (torch.float16, torch.bfloat16)
        self.split = half and not self.widen
        self.prescale = FP16_PRESCALE if queries.dtype == torch.float16 else 1.0
        if scale is None:
            self.scale_t, self.scale_value, self.scale_tensor = self.q, float(scale_value), False
        else:
            self.scale_t = scale.detach().reshape(()).to(self.acc).contiguous()
            self.scale_value, self.scale_tensor = 0.0, True
        self.row_blocks = triton.cdiv(problem.rows, self.block_m)
        self.kinds = [0, 1] if problem.has_p_row else [0]

    def segments(self, kind):
        """(first_len, second_len) of a row kind's columns."""
        p = self.p
        if kind == 0:
            return p.m, (p.r if p.query_to_query else 0)
        return (p.r if p.doc_to_query else 0), (p.m if p.doc_to_doc else 0)

    def splits(self, kind, programs):
        """(splits, column blocks per split) for `programs` programs per split."""
        blocks = sum(triton.cdiv(n, self.block_n) for n in self.segments(kind))
        if COLUMN_SPLITS is not None:
            want = COLUMN_SPLITS
        elif self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            want = min(SPLIT_PROGRAMS_PER_SM * sms // max(programs, 1),
                       triton.cdiv(blocks, MIN_SPLIT_BLOCKS))
        else:
            want = 1
        per = triton.cdiv(blocks, max(min(want, blocks), 1))
        return max(triton.cdiv(blocks, per), 1), max(per, 1)

    def common_args(self):
        p = self.p
        return dict(HARDNESS=p.hardness_mode, SCALE_TENSOR=self.scale_tensor,
                    BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    WIDEN=self.widen)


def _forward(launch):
    """(loss per row, stats) of the problem."""
    p = launch.p
    parts, positions, n_splits = [], None, []
    for kind in launch.kinds:
        first_len, second_len = launch.segments(kind)
        splits, per = launch.splits(kind, launch.row_blocks)
        part = torch.empty((splits, p.rows, 2), dtype=launch.acc, device=launch.device)
        if kind == 0:
            positions = torch.empty((splits, p.rows), dtype=launch.acc, device=launch.device)
        _mnr_forward_kernel[(launch.row_blocks, 1, splits)](
            launch.q, launch.d, launch.scale_t, part, positions, p.r, p.d, p.offset, p.rows,
            p.owned_end, first_len, second_len, per, launch.scale_value, p.hardness_strength,
            ROW_KIND=kind, num_warps=NUM_WARPS, **launch.common_args(), **common.LAUNCH)
        parts.append(part)
        n_splits.append(splits)
    stats = torch.empty((p.rows, STATS), dtype=launch.acc, device=launch.device)
    loss_rows = torch.empty((p.rows,), dtype=launch.acc, device=launch.device)
    part_p = parts[-1]
    _mnr_finish_kernel[(triton.cdiv(p.rows, FINISH_BLOCK),)](
        parts[0], part_p, positions, stats, loss_rows, p.rows, n_splits[0], n_splits[-1],
        PER_DIRECTION=p.per_direction, HAS_P=p.has_p_row, BLOCK=FINISH_BLOCK, **common.LAUNCH)
    return loss_rows, stats


def _gradients(launch, stats, upstream, want_scale):
    """(grad_queries, grad_docs, grad_scale) for per-row upstream gradients."""
    p = launch.p
    acc, device = launch.acc, launch.device
    up, factor = scaled_upstream(upstream, acc)
    stats = stats.contiguous()
    kernel_args = dict(SPLIT=launch.split, PRESCALE=launch.prescale, BLOCK_D=launch.block_d,
                       PER_DIRECTION=p.per_direction, HAS_P=p.has_p_row, num_warps=NUM_WARPS,
                       **launch.common_args())
    bufs, sgrads = {}, []
    for kind in launch.kinds:
        first_len, second_len = launch.segments(kind)
        splits, per = launch.splits(kind, launch.row_blocks)
        buf = torch.zeros((splits, p.rows, p.d), dtype=acc, device=device)
        sgrad = torch.empty((splits, launch.row_blocks), dtype=acc, device=device)
        _mnr_row_grad_kernel[(launch.row_blocks, 1, splits)](
            launch.q, launch.d, launch.scale_t, stats, up, buf, sgrad, p.r, p.d, p.offset, p.rows,
            p.owned_end, first_len, second_len, per, launch.scale_value, p.hardness_strength,
            ROW_KIND=kind, **kernel_args, **common.LAUNCH)
        bufs[kind] = (buf, splits)
        sgrads.append(sgrad.reshape(-1))
    flags = dict(QUERY_TO_QUERY=p.query_to_query, DOC_TO_QUERY=p.doc_to_query,
                 DOC_TO_DOC=p.doc_to_doc)
    grads = []
    # Docs: the P rows' buffer (docs[g]); queries: the Q rows' buffer (queries[g]).
    for entity, x, kind in ((0, launch.d, 1), (1, launch.q, 0)):
        # The column sums: in the output when it has the accumulation dtype.
        out = torch.zeros(x.shape, dtype=x.dtype, device=device)
        colbuf = out if x.dtype == acc else torch.zeros(x.shape, dtype=acc, device=device)
        buf, splits = bufs.get(kind, (colbuf, 0))
        if out.numel():
            _mnr_col_grad_kernel[(triton.cdiv(x.shape[0], launch.block_n),)](
                launch.q, launch.d, launch.scale_t, factor, stats, up, buf, colbuf, out, p.r,
                p.m, p.d, p.offset, p.rows, p.owned_end, splits, launch.scale_value,
                p.hardness_strength, ENTITY=entity, HAS_BUF=kind in bufs, **flags,
                **kernel_args, **common.LAUNCH)
        grads.append(out)
    grad_d, grad_q = grads
    if want_scale:
        grad_s = torch.cat(sgrads).sum() * factor
    else:
        grad_s = torch.empty((0,), dtype=acc, device=device)
    return grad_q, grad_d, grad_s


def _mnr_loss_normalized(queries, docs, scale, scale_value, offset, rows, owned_blocks,
                         directions, per_direction, hardness_mode, hardness_strength, reduction,
                         grad):
    """mnr_loss of normalized rows: (loss, stats, grad_queries, grad_docs,
    grad_scale), the gradients those of the normalized rows."""
    # `docs`: the normalized docs, one [M, d] tensor (_ops/mnr.py's on_raw_embeddings).
    problem = check_mnr_loss(queries, [docs], scale, scale_value, offset, rows, owned_blocks,
                             directions, per_direction, hardness_mode, hardness_strength,
                             reduction)
    _check_runnable("mnr_loss", queries)
    launch = _Launch(problem, queries, docs, scale, scale_value)
    with device_guard(queries):
        loss_rows, stats = _forward(launch)
        loss = reduce_loss(problem, loss_rows)
        if not grad:
            return (loss, stats, *no_gradients(queries, launch.acc))
        upstream = upstream_per_row(problem, torch.ones_like(loss))
        grad_q, grad_d, grad_s = _gradients(launch, stats, upstream, scale is not None)
    return loss, stats, grad_q, grad_d, grad_s


def _mnr_loss_backward_normalized(grad_loss, queries, docs, scale, scale_value, stats, offset,
                                  rows, owned_blocks, directions, per_direction, hardness_mode,
                                  hardness_strength, reduction):
    """mnr_loss_backward of normalized rows: the gradients of the normalized rows."""
    problem = check_mnr_loss_backward(grad_loss, queries, [docs], scale, scale_value, stats,
                                      offset, rows, owned_blocks, directions, per_direction,
                                      hardness_mode, hardness_strength, reduction)
    _check_runnable("mnr_loss_backward", queries)
    launch = _Launch(problem, queries, docs, scale, scale_value)
    with device_guard(queries):
        upstream = upstream_per_row(problem, grad_loss)
        return _gradients(launch, stats, upstream, scale is not None)


_mnr_loss_raw, _mnr_loss_backward_raw = on_raw_embeddings(
    _mnr_loss_normalized, _mnr_loss_backward_normalized, check_mnr_loss, check_mnr_loss_backward)


def mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks, directions,
             per_direction, hardness_mode, hardness_strength, reduction, grad):
    """(loss, stats, grad_queries, grad_docs, grad_scale) of the op nanfree::mnr_loss
    (raw embeddings, normalized by the op; _ops/mnr.py)."""
    check_mnr_loss(queries, docs, scale, scale_value, offset, rows, owned_blocks, directions,
                   per_direction, hardness_mode, hardness_strength, reduction)
    _check_runnable("mnr_loss", queries)  # before the normalization runs anything
    return _mnr_loss_raw(queries, docs, scale, scale_value, offset, rows, owned_blocks,
                         directions, per_direction, hardness_mode, hardness_strength, reduction,
                         grad)


def mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset, rows,
                      owned_blocks, directions, per_direction, hardness_mode, hardness_strength,
                      reduction):
    """(grad_queries, grad_docs, grad_scale) of the op nanfree::mnr_loss_backward."""
    check_mnr_loss_backward(grad_loss, queries, docs, scale, scale_value, stats, offset, rows,
                            owned_blocks, directions, per_direction, hardness_mode,
                            hardness_strength, reduction)
    _check_runnable("mnr_loss_backward", queries)
    return _mnr_loss_backward_raw(grad_loss, queries, docs, scale, scale_value, stats, offset,
                                  rows, owned_blocks, directions, per_direction, hardness_mode,
                                  hardness_strength, reduction)
