"""Masks in every memory layout a kernel sees: unit column stride, one flag per
row (column stride 0), one row for all rows (row stride 0), a transposed mask
(column stride > 1) and an attention-style [B, 1, 1, S] mask. Each must give
what the masked_fill reference gives, forward and backward, with NaN in the
dropped entries ignored."""

import math

import pytest
import torch
from conftest import DEVICES, INTERPRETED

import nanfree.ops as nf

OPS = ["softmax", "log_softmax", "logsumexp"]
# 37 columns leave a vector tail; 1500 span two chunks of the CPU kernels.
COLS = [37] if INTERPRETED else [37, 1500]


def _layouts(rows, cols, gen):
    dense = torch.rand(rows, cols, generator=gen) > 0.4
    per_row = (torch.rand(rows, 1, generator=gen) > 0.3).expand(rows, cols)
    shared_row = (torch.rand(1, cols, generator=gen) > 0.4).expand(rows, cols)
    transposed = dense.t().contiguous().t()
    return {"dense": dense, "per_row": per_row, "shared_row": shared_row, "transposed": transposed}


def _reference(op, x, mask, dim):
    """The op on x.masked_fill(~mask, -inf), and the leaf it was computed from."""
    filled = x.detach().masked_fill(~mask, -math.inf).requires_grad_(True)
    out = getattr(nf, op)(filled, dim)
    return out, filled


def _compare(device, op, x, mask, dim=-1):
    x = x.to(device)
    mask = mask.to(device)
    # NaN where the mask drops an entry: a masked op must not see it.
    x = x.masked_fill(~mask.expand(x.shape), math.nan).requires_grad_(True)
    out = getattr(nf, op)(x, dim, mask=mask)
    mask = mask.expand(x.shape)
    ref_out, ref_x = _reference(op, x, mask, dim)
    torch.testing.assert_close(out, ref_out, equal_nan=False)
    grad = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, x, grad)
    # A dropped entry's output is a constant (0 or -inf), so its incoming
    # gradient must not reach the other entries; the unmasked -inf reference
    # would pass it on (log_softmax), so it gets those gradients zeroed.
    ref_grad = grad if op == "logsumexp" else grad.masked_fill(~mask, 0.0)
    (ref_dx,) = torch.autograd.grad(ref_out, ref_x, ref_grad)
    ref_dx = ref_dx.masked_fill(~mask, 0.0)
    torch.testing.assert_close(dx, ref_dx)
    assert not dx.isnan().any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("layout", ["dense", "per_row", "shared_row", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_mask_layouts_match_masked_fill(device, op, cols, layout, dtype):
    gen = torch.Generator().manual_seed(cols)
    # 9 rows: with the CUDA kernels' 2 rows of 1500 columns per block, the
    # grid-capped emulated build (3 blocks) iterates its grid-stride loop.
    rows = 9
    x = torch.randn(rows, cols, generator=gen, dtype=dtype) * 3
    mask = _layouts(rows, cols, gen)[layout]
    _compare(device, op, x, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_attention_style_mask(device, op):
    gen = torch.Generator().manual_seed(1)
    batch, heads, queries, keys = 2, 3, 4, 19
    x = torch.randn(batch, heads, queries, keys, generator=gen)
    lengths = torch.tensor([keys, 7])
    key_padding = torch.arange(keys)[None, :] < lengths[:, None]
    mask = key_padding[:, None, None, :].expand(batch, heads, queries, keys)
    _compare(device, op, x, mask)


def _strided_layouts(cols, rows, gen):
    """Masks of a [cols, rows] input reduced over dim 0 (each column a row of the problem)."""
    dense = torch.rand(cols, rows, generator=gen) > 0.4
    per_entry_of_every_row = torch.rand(cols, 1, generator=gen) > 0.4  # broadcast over rows
    per_row = torch.rand(1, rows, generator=gen) > 0.3  # a flag per row: whole rows dropped
    transposed = dense.t().contiguous().t()
    return {"dense": dense, "shared_by_rows": per_entry_of_every_row, "per_row": per_row,
            "transposed": transposed}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", ["dense", "shared_by_rows", "per_row", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mask_layouts_over_a_leading_dim(device, op, layout, dtype):
    # 37 rows: two vectors of lanes and a tail on the CPU.
    gen = torch.Generator().manual_seed(7)
    cols, rows = 45, 37
    x = torch.randn(cols, rows, generator=gen, dtype=dtype) * 3
    mask = _strided_layouts(cols, rows, gen)[layout]
    _compare(device, op, x, mask, dim=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_key_padding_mask_over_a_middle_dim(device, op):
    # Scores [batch, keys, heads] reduced over the keys with a [batch, keys, 1] padding mask.
    gen = torch.Generator().manual_seed(3)
    batch, keys, heads = 3, 21, 5
    x = torch.randn(batch, keys, heads, generator=gen)
    lengths = torch.tensor([keys, 9, 1])
    mask = (torch.arange(keys)[None, :] < lengths[:, None])[:, :, None]
    _compare(device, op, x, mask, dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_long_rows_match_float64(device, op, dtype, masked):
    # 20000 columns: past what a CUDA thread group caches in registers (16K
    # float / 8K double forward, half that backward), so the kernels stream
    # the row twice; past the CPU kernels' chunk too. 5 rows: more than the
    # grid-capped emulated build's 3 blocks.
    gen = torch.Generator().manual_seed(20000)
    rows, cols = 5, 20000
    x = torch.randn(rows, cols, generator=gen, dtype=dtype) * 4
    mask = torch.rand(rows, cols, generator=gen) > 0.3 if masked else torch.ones(rows, cols,
                                                                                 dtype=torch.bool)
    grad = torch.randn(rows, 1 if op == "logsumexp" else cols, generator=gen, dtype=dtype)
    if op == "logsumexp":
        grad = grad[:, 0]
    xd = x.to(device).requires_grad_(True)
    out = getattr(nf, op)(xd, -1, mask=mask.to(device) if masked else None)
    (dx,) = torch.autograd.grad(out, xd, grad.to(device))
    ref_x = x.double().masked_fill(~mask, -math.inf).requires_grad_(True)
    ref = {"softmax": torch.softmax, "log_softmax": torch.log_softmax,
           "logsumexp": torch.logsumexp}[op](ref_x, -1)
    ref_grad = grad.double() if op == "logsumexp" else grad.double().masked_fill(~mask, 0.0)
    (ref_dx,) = torch.autograd.grad(ref, ref_x, ref_grad)
    ref_dx = ref_dx.masked_fill(~mask, 0.0)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else {}
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out.cpu().double()[finite], ref.detach()[finite], **tol)
    assert (out.cpu()[~finite] == ref.detach()[~finite].to(dtype)).all()
    torch.testing.assert_close(dx.cpu().double(), ref_dx, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_at_every_alignment(device, op, offset, dtype):
    # Contiguous views that start `offset` elements into their storage: 64
    # columns make whole 16-byte vectors, but only offset 0 is 16-byte aligned,
    # so the CUDA kernels must see the others and read them entry by entry
    # (another launch plan: the same values up to the summation order).
    gen = torch.Generator().manual_seed(offset)
    rows, cols = 5, 64
    storage = torch.randn(rows * cols + 8, generator=gen, dtype=dtype).to(device)
    x = storage[offset:offset + rows * cols].view(rows, cols).requires_grad_(True)
    grad_storage = torch.randn(rows * cols + 8, generator=gen, dtype=dtype).to(device)
    n_out = rows if op == "logsumexp" else rows * cols
    grad = grad_storage[offset:offset + n_out].view(rows if op == "logsumexp" else (rows, cols))
    out = getattr(nf, op)(x, -1)
    (dx,) = torch.autograd.grad(out, x, grad)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = getattr(nf, op)(ref_x, -1)  # the same op on an aligned copy
    (ref_dx,) = torch.autograd.grad(ref, ref_x, grad.clone())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dx, ref_dx)
