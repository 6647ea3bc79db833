"""The special-value table of DESIGN.md section 2 for softmax, log_softmax and
logsumexp, forward and backward, on the backend this session selects."""

import math

import pytest
import torch
from conftest import DTYPES, INF, NAN
from softmax_oracle import row_grad_oracle, row_oracle

import nanfree.ops as nf



def _cases(dtype):
    info = torch.finfo(dtype)
    big, tiny = info.max, info.tiny
    return {
        # name: (row, keep mask or None)
        "zeros": ([0.0, 0.0, 0.0, 0.0], None),
        "signed zeros": ([-0.0, 0.0, -0.0], None),
        "denormals": ([tiny / 4, -tiny / 4, 0.0], None),
        "plus and minus max": ([big, -big, 0.0], None),
        "two max": ([big, big], None),
        "two minus max": ([-big, -big], None),
        "two +inf": ([INF, 1.0, INF], None),
        "one +inf": ([INF, -INF, 0.0], None),
        "+inf and -inf only": ([-INF, INF], None),
        "some -inf": ([-INF, 0.0, 1.0], None),
        "all -inf": ([-INF, -INF, -INF, -INF], None),
        "fully masked": ([1.0, 2.0, 3.0], [False, False, False]),
        "masked NaN": ([NAN, 1.0, 2.0], [False, True, True]),
        "masked +inf": ([INF, 1.0, 2.0], [False, True, True]),
        "NaN": ([NAN, 1.0, 2.0], None),
        "NaN and +inf": ([NAN, INF, 2.0], None),
        "NaN and -inf": ([NAN, -INF], None),
        "logits 1e4": ([1e4, -1e4, 0.0], None),
        "logits 1000": ([1000.0, 999.0, -1000.0], None),
        "length 1": ([5.0], None),
        "length 1 -inf": ([-INF], None),
    }


TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}

OPS = ["softmax", "log_softmax", "logsumexp"]
CASE_NAMES = list(_cases(torch.float32))


def _run(op, x, mask, dim=-1):
    return getattr(nf, op)(x, dim, mask=mask)


# Special values past the first 1024 entries of a long row: the CPU kernels
# work in chunks of 1024 and the Triton kernels in blocks.
LONG = 2500


def _long_cases():
    base = [math.sin(0.37 * i) * 3 for i in range(LONG)]

    def with_values(**at):
        row = list(base)
        for index, value in at.items():
            row[int(index[1:])] = value
        return row

    some_dropped = [i % 3 != 0 for i in range(LONG)]
    return {
        "+inf late": (with_values(i2000=INF), None),
        "NaN late": (with_values(i1800=NAN), None),
        "all -inf": ([-INF] * LONG, None),
        "fully masked": (base, [False] * LONG),
        "dropped NaN and +inf late": (with_values(i2100=NAN, i2400=INF), some_dropped),
        "max late": (with_values(i2300=40.0), None),
    }


# Where the case row sits: "last" reduces over the last dim of [2, cols] (the
# case row, then a plain row it must not disturb); "strided" reduces over dim 0
# of [cols, 19], the rows laid side by side, the case row in columns 0 and 17
# (apart by more than a 16-wide vector) and plain rows elsewhere.
LAYOUTS = ["last", "strided"]
STRIDED_CASE_ROWS = (0, 17)
STRIDED_ROWS = 19


def _case_batch(case, dtype, device, layout="last"):
    """The case row among plain rows, which the case must not disturb.

    Returns the input, the mask (or None), the reduced dim and, per row, the
    values as the tensor holds them (rounded to dtype, as Python floats) with
    the row's keep list, as the oracle takes them."""
    row, keep = _long_cases()[case] if case in LONG_CASE_NAMES else _cases(dtype)[case]
    plain = [0.5 - 0.25 * i for i in range(len(row))]
    if layout == "last":
        case_rows = (0,)
        count = 2
    else:
        case_rows = STRIDED_CASE_ROWS
        count = STRIDED_ROWS
    values = [row if r in case_rows else plain for r in range(count)]
    keeps = [keep if r in case_rows else None for r in range(count)]
    x = torch.tensor(values, dtype=dtype)
    mask = None
    if keep is not None:
        mask = torch.tensor([k if k is not None else [True] * len(row) for k in keeps])
    rounded = x.double().tolist()
    dim = -1
    if layout == "strided":  # rows become columns of a contiguous [cols, rows] tensor
        x, dim = x.t().contiguous(), 0
        mask = None if mask is None else mask.t().contiguous()
    x = x.to(device)
    mask = None if mask is None else mask.to(device)
    return x, mask, dim, list(zip(rounded, keeps))


def _as_rows(t, layout):
    """A result of the layout's shape as [rows, cols] (logsumexp results are already rows)."""
    return t.t() if layout == "strided" and t.dim() == 2 else t


def _holds_nan(values, keep):
    """Whether a kept entry of the row is NaN."""
    return any(math.isnan(v) for v, k in zip(values, keep or [True] * len(values)) if k)


LONG_CASE_NAMES = list(_long_cases())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASE_NAMES + LONG_CASE_NAMES)
def test_forward_table(case, op, dtype, layout, device):
    x, mask, dim, rows = _case_batch(case, dtype, device, layout)
    out = _as_rows(_run(op, x, mask, dim), layout)
    expected = [row_oracle(values, keep)[OPS.index(op)] for values, keep in rows]
    expected = torch.tensor(expected, dtype=torch.float64).to(dtype)
    assert out.dtype == dtype and out.device.type == device
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, **TOL[dtype])
    for r, (values, keep) in enumerate(rows):
        if not _holds_nan(values, keep):
            assert not torch.isnan(out[r]).any(), f"NaN from non-NaN input in {case}, row {r}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASE_NAMES + LONG_CASE_NAMES)
def test_backward_table(case, op, dtype, layout, device):
    x, mask, dim, rows = _case_batch(case, dtype, device, layout)
    count, cols = len(rows), len(rows[0][0])
    x.requires_grad_(True)
    out = _run(op, x, mask, dim)
    if op == "logsumexp":
        grad_rows = torch.tensor([1.5 - r for r in range(count)], dtype=dtype)
        grad = grad_rows.to(device)
    else:
        grad_rows = torch.tensor([[math.cos(0.5 * i + r) for i in range(cols)] for r in range(count)],
                                 dtype=dtype)
        grad = (grad_rows.t().contiguous() if layout == "strided" else grad_rows).to(device)
    (dx,) = torch.autograd.grad(out, x, grad)
    dx = _as_rows(dx, layout)
    for r, (values, keep) in enumerate(rows):
        if _holds_nan(values, keep):
            assert torch.isnan(dx[r]).all(), "a NaN input propagates to its own row's gradient"
            continue
        assert torch.isfinite(dx[r]).all(), f"non-finite gradient in {case}, row {r}: {dx[r]}"
        g = grad_rows[r].item() if op == "logsumexp" else grad_rows[r].double().tolist()
        expected = torch.tensor(row_grad_oracle(op, values, keep, g), dtype=torch.float64)
        # The backward of a half-precision op starts from its rounded output.
        tol = dict(TOL[dtype]) if dtype in (torch.float32, torch.float64) else dict(rtol=2e-2, atol=2e-2)
        if op == "log_softmax":
            # g - exp(y) * sum(g) carries the rounding of the stored y times |sum(g)|.
            kept_sum = sum(gj for gj, k in zip(g, keep or [True] * cols) if k)
            tol["atol"] = max(tol["atol"], 4 * torch.finfo(dtype).eps * abs(kept_sum))
        torch.testing.assert_close(dx[r].cpu().double(), expected, **tol)
        if keep is not None:
            dropped = ~torch.tensor(keep, device=device)
            assert (dx[r][dropped] == 0).all(), "a dropped entry's gradient is 0"


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_empty_dim(op, device):
    x = torch.empty(3, 0, device=device)
    assert getattr(nf, op)(x, -1).shape == (3, 0)
    assert getattr(nf, op)(torch.empty(0, 5, device=device), 1).shape == (0, 5)


def test_logsumexp_of_empty_dim_is_minus_inf(device):
    x = torch.empty(3, 0, device=device, requires_grad=True)
    out = nf.logsumexp(x, -1)
    assert out.shape == (3,) and (out == -INF).all()
    out.sum().backward()
    assert x.grad.shape == (3, 0)


def test_zero_dim_input(device):
    x = torch.tensor(2.5, device=device)
    assert nf.softmax(x, 0).item() == 1.0
    assert nf.log_softmax(x, -1).item() == 0.0
    assert nf.logsumexp(x, 0).item() == 2.5
    assert nf.logsumexp(x, 0, keepdim=True).shape == ()


def test_nan_stays_in_its_row(device):
    x = torch.randn(6, 33, device=device)
    x[2, 5] = NAN
    for op in OPS:
        out = _run(op, x, None)
        nan_rows = torch.isnan(out).reshape(6, -1).any(dim=-1)
        assert nan_rows.tolist() == [False, False, True, False, False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cols", [3, 67])  # one vector or part of one; several and a tail
def test_softmax_backward_where_g_minus_dot_overflows(dtype, cols, device):
    """softmax's gradient y (g - dot) where g - dot itself overflows (g of +-max in a
    row whose dot is a third of max): the exact gradient is finite, -4 max / 9 at the
    entry of -max in a row of equal outputs of 3, and the kernels must give it (the CPU's
    fast loop computes y (g - dot) and redoes such a row with g and dot halved)."""
    big = torch.finfo(dtype).max
    x = torch.zeros(2, cols, dtype=dtype, device=device, requires_grad=True)
    g = torch.zeros(2, cols, dtype=torch.float64)
    g[0, :3] = torch.tensor([big, big, -big], dtype=torch.float64)
    g[1, :3] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)  # an ordinary row beside it
    y = nf.softmax(x, -1)
    (dx,) = torch.autograd.grad(y, x, g.to(dtype).to(device))
    y64 = torch.full((2, cols), 1.0 / cols, dtype=torch.float64)
    half_dot = (0.5 * g * y64).sum(-1, keepdim=True)  # halved: float64's max needs it too
    expected = 2 * (y64 * (0.5 * g - half_dot))
    assert torch.isfinite(expected).all() and torch.isfinite(dx).all(), dx
    torch.testing.assert_close(dx.cpu().double(), expected, rtol=8 * torch.finfo(dtype).eps, atol=0)
