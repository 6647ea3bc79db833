"""The special-value table of DESIGN.md section 2 for softmax, log_softmax and
logsumexp, forward and backward, on the backend this session selects."""

import math

import pytest
import torch
from conftest import DTYPES
from softmax_oracle import row_grad_oracle, row_oracle

import nanfree.ops as nf

INF = math.inf
NAN = math.nan


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


def _run(op, x, mask):
    if op == "logsumexp":
        return nf.logsumexp(x, -1, mask=mask)
    return getattr(nf, op)(x, -1, mask=mask)


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


def _case_batch(case, dtype, device):
    """The case row with a plain row below it, which the case must not disturb.

    Returns the input, the mask (or None) and, per row, the values as the
    tensor holds them (rounded to dtype, as Python floats) with the row's keep
    list, as the oracle takes them."""
    row, keep = _long_cases()[case] if case in LONG_CASE_NAMES else _cases(dtype)[case]
    plain = [0.5 - 0.25 * i for i in range(len(row))]
    x = torch.tensor([row, plain], dtype=dtype, device=device)
    mask = None
    if keep is not None:
        mask = torch.tensor([keep, [True] * len(row)], device=device)
    rounded = torch.tensor([row, plain], dtype=dtype).double().tolist()
    return x, mask, [(rounded[0], keep), (rounded[1], None)]


def _holds_nan(values, keep):
    """Whether a kept entry of the row is NaN."""
    return any(math.isnan(v) for v, k in zip(values, keep or [True] * len(values)) if k)


LONG_CASE_NAMES = list(_long_cases())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASE_NAMES + LONG_CASE_NAMES)
def test_forward_table(case, op, dtype, device):
    x, mask, rows = _case_batch(case, dtype, device)
    out = _run(op, x, mask)
    expected = [row_oracle(values, keep)[OPS.index(op)] for values, keep in rows]
    expected = torch.tensor(expected, dtype=torch.float64).to(dtype)
    assert out.dtype == dtype and out.device.type == device
    torch.testing.assert_close(out.cpu(), expected, equal_nan=True, **TOL[dtype])
    if not _holds_nan(*rows[0]):
        assert not torch.isnan(out).any(), f"NaN from non-NaN input in {case}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASE_NAMES + LONG_CASE_NAMES)
def test_backward_table(case, op, dtype, device):
    x, mask, rows = _case_batch(case, dtype, device)
    cols = x.shape[-1]
    x.requires_grad_(True)
    out = _run(op, x, mask)
    if op == "logsumexp":
        grad = torch.tensor([1.5, -0.5], dtype=dtype, device=device)
    else:
        grad = torch.tensor([[math.cos(0.5 * i) for i in range(cols)]] * 2, dtype=dtype, device=device)
    (dx,) = torch.autograd.grad(out, x, grad)
    for r, (values, keep) in enumerate(rows):
        if _holds_nan(values, keep):
            assert torch.isnan(dx[r]).all(), "a NaN input propagates to its own row's gradient"
            continue
        assert torch.isfinite(dx[r]).all(), f"non-finite gradient in {case}: {dx[r]}"
        g = grad[r].item() if op == "logsumexp" else grad[r].double().tolist()
        expected = torch.tensor(row_grad_oracle(op, values, keep, g), dtype=torch.float64)
        # The backward of a half-precision op starts from its rounded output.
        tol = TOL[dtype] if dtype in (torch.float32, torch.float64) else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dx[r].cpu().double(), expected, **tol)
    keep = rows[0][1]
    if keep is not None:
        dropped = ~torch.tensor(keep, device=device)
        assert (dx[0][dropped] == 0).all(), "a dropped entry's gradient is 0"


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
