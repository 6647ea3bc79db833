"""Property tests: extreme inputs never give NaN or non-finite gradients, and
where torch is finite nanfree's error is at most 2x torch's (DESIGN.md 1.4)."""


import pytest
import torch
from conftest import DEVICES, DTYPES, INF
from hypothesis import given
from hypothesis import strategies as st

import nanfree.ops as nf
from nanfree._backends import SERVING



def _extreme_values(dtype):
    info = torch.finfo(dtype)
    return [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, INF, -INF,
            1e4, -1e4, 1000.0, -1000.0, 1.0, -1.0, 30.0, -30.0]


@st.composite
def extreme_batches(draw):
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 40))
    pool = _extreme_values(dtype)
    value = st.one_of(st.sampled_from(pool), st.floats(-50, 50, width=32))
    data = draw(st.lists(value, min_size=rows * cols, max_size=rows * cols))
    use_mask = draw(st.booleans())
    keep = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    x = torch.tensor(data, dtype=torch.float64).reshape(rows, cols).to(dtype)
    mask = torch.tensor(keep).reshape(rows, cols) if use_mask else None
    return x, mask


def _strided(x, mask):
    """The same rows laid out as columns: reduced over dim 0 of a contiguous tensor."""
    return x.t().contiguous(), None if mask is None else mask.t().contiguous()


@pytest.mark.parametrize("device", DEVICES)
@given(batch=extreme_batches(), op=st.sampled_from(["softmax", "log_softmax", "logsumexp"]),
       strided=st.booleans())
def test_extreme_inputs_never_give_nan(device, batch, op, strided):
    x, mask = batch
    dim = -1
    if strided:
        (x, mask), dim = _strided(x, mask), 0
    x = x.to(device).requires_grad_(True)
    mask = None if mask is None else mask.to(device)
    fn = getattr(nf, op)
    out = fn(x, dim, mask=mask)
    assert not torch.isnan(out).any()
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=device).reshape(out.shape)
    (dx,) = torch.autograd.grad(out, x, grad)
    assert torch.isfinite(dx).all()


def _errors(op, x, mask, dim=-1):
    """(nanfree error, torch error) against a float64 reference, forward and input gradient."""
    torch_fn = {"softmax": torch.softmax, "log_softmax": torch.log_softmax,
                "logsumexp": torch.logsumexp}[op]

    def run(fn, inp):
        inp = inp.detach().requires_grad_(True)
        masked = inp if mask is None else inp.masked_fill(~mask, -INF)
        out = fn(masked, dim)
        g = torch.cos(torch.arange(out.numel(), device=out.device, dtype=torch.float64))
        g = g.reshape(out.shape).to(out.dtype)
        (dx,) = torch.autograd.grad(out, inp, g)
        return out.double(), dx.double()

    ref_out, ref_dx = run(torch_fn, x.double())
    t_out, t_dx = run(torch_fn, x)
    n_out, n_dx = run(lambda v, d: getattr(nf, op)(v, d), x)

    def err(a, b):
        finite = torch.isfinite(b)
        return (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0

    finite_out = ref_out[torch.isfinite(ref_out)]
    out_magnitude = finite_out.abs().max().item() if finite_out.numel() else 0.0
    return ((err(n_out, ref_out), err(t_out, ref_out)), (err(n_dx, ref_dx), err(t_dx, ref_dx)),
            out_magnitude)


def _ulp_floor(dtype, scale):
    return torch.finfo(dtype).eps * max(scale, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    op=st.sampled_from(["softmax", "log_softmax", "logsumexp"]),
    scale=st.sampled_from([0.01, 1.0, 10.0, 100.0]),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
    masked=st.booleans(),
    strided=st.booleans(),
)
def test_error_at_most_twice_torch(device, dtype, op, scale, cols, seed, masked, strided):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, cols, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)
    mask = (torch.rand(3, cols, generator=gen) > 0.3).to(device) if masked else None
    if mask is not None:
        mask[:, 0] = True  # keep rows non-empty, where torch is finite
    dim = -1
    if strided:
        (x, mask), dim = _strided(x, mask), 0
    (n_out, t_out), (n_dx, t_dx), out_magnitude = _errors(op, x, mask, dim)
    # One rounding step at the size of the input or of the output, whichever is
    # larger (logsumexp of small entries is about log(cols)).
    magnitude = max(x.double().abs().max().item(), out_magnitude)
    floor = _ulp_floor(dtype, magnitude)
    assert n_out <= 2 * t_out + floor, f"forward error {n_out} vs torch {t_out}"
    assert n_dx <= 2 * t_dx + floor, f"gradient error {n_dx} vs torch {t_dx}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_float32_matches_torch(device, op):
    x = torch.randn(16, 1000, device=device) * 5
    torch_fn = getattr(torch, op)
    torch.testing.assert_close(getattr(nf, op)(x, -1), torch_fn(x, -1))
    torch.testing.assert_close(getattr(nf, op)(x, 0), torch_fn(x, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_long_rows_match_torch(device):
    # Rows longer than one kernel block/chunk exercise the online merge.
    x = torch.randn(3, 20000, device=device) * 20
    x[1, 12345] = 500.0
    for op in ("softmax", "log_softmax", "logsumexp"):
        torch.testing.assert_close(getattr(nf, op)(x, -1), getattr(torch, op)(x, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "logsumexp"])
def test_very_long_float32_rows_at_most_twice_torch(device, op):
    # 2^21 columns: a row of thousands of chunks or blocks, whose partial sums
    # must be combined without a float running sum's loss of digits.
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(2, 2**21, generator=gen) * 3).to(device)
    (n_out, t_out), (n_dx, t_dx), out_magnitude = _errors(op, x, None, -1)
    floor = _ulp_floor(torch.float32, max(3.0, out_magnitude))
    assert n_out <= 2 * t_out + floor, f"forward error {n_out} vs torch {t_out}"
    assert n_dx <= 2 * t_dx + floor, f"gradient error {n_dx} vs torch {t_dx}"


@pytest.mark.skipif(SERVING["cpu"] != "cpu", reason="the C++ CPU kernels' chunked rows only: "
                    "2^24 columns is too slow interpreted or emulated")
@pytest.mark.parametrize("columns", [2**23, 2**24], ids=["2^23", "2^24"])
def test_logsumexp_of_long_float32_rows_as_accurate_as_torch(columns):
    # The C++ kernels sum a row in chunks of 1024 columns: 8192 or 16384 chunks
    # here, whose states a float running sum merged with up to 6x torch's error
    # (1e-7 relative); merged in double, the error is the output's rounding, torch's.
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, columns, generator=gen) * 3
    ref = torch.logsumexp(x.double(), -1)
    ours = (nf.logsumexp(x, -1).double() - ref).norm() / ref.norm()
    theirs = (torch.logsumexp(x, -1).double() - ref).norm() / ref.norm()
    assert ours <= 2 * theirs, (float(ours), float(theirs))


@pytest.mark.skipif(SERVING["cpu"] != "cpu", reason="the C++ CPU kernels' short-row blocks only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("columns", [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 37, 128, 1024, 1025])
def test_short_row_blocks_equal_the_general_path(dtype, op, columns):
    # Unmasked rows of one chunk go four at a time through short_rows_forward
    # (rows of one vector at most: a vector's width of rows at a time through
    # narrow_rows_forward); a mask of all True sends the same rows through the
    # general path. The values must be the same bits, also around rows the blocks
    # leave to the general path (NaN, +inf, all -inf) and in the tail of each
    # parallel task.
    gen = torch.Generator().manual_seed(columns)
    x = (torch.randn(203, columns, generator=gen) * 4).to(dtype)
    x[5, 0] = INF
    x[9] = -INF
    x[14, -1] = float("nan")
    x[60, -1] = -INF
    keep = torch.ones_like(x, dtype=torch.bool)
    blocks, general = getattr(nf, op)(x, -1), getattr(nf, op)(x, -1, mask=keep)
    assert torch.equal(blocks.nan_to_num(7.0), general.nan_to_num(7.0))
    assert blocks[14].isnan().all() and not blocks[15:].isnan().any()


@pytest.mark.skipif(SERVING["cpu"] != "cpu", reason="the C++ CPU kernels' row blocks only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("columns", [1, 2, 4, 5, 8, 9, 16, 17, 31, 32, 33])
@pytest.mark.parametrize("masking", ["none", "per-row", "transposed", "broadcast"])
def test_a_rows_values_and_gradient_do_not_depend_on_its_neighbours(dtype, op, columns, masking):
    # Rows of one vector at most go a vector's width at a time through
    # narrow_rows_forward and narrow_rows_backward (the rows across the lanes);
    # one row alone takes the per-row paths. Forward values and gradients must be
    # the same bits, also in the blocks those paths leave to the per-row rules: a
    # NaN, +inf or all -inf row, an upstream gradient whose g - dot overflows
    # (softmax) or whose sum overflows (log_softmax); with a mask of the input's
    # shape (a row of it all False; contiguous, or a transposed view whose columns
    # are strided) or one row of mask broadcast to every row.
    gen = torch.Generator().manual_seed(100 + columns)
    rows = 83
    x = (torch.randn(rows, columns, generator=gen) * 4).to(dtype)
    g = torch.randn(rows, columns, generator=gen).to(dtype)
    # In the first 32 rows, so that later blocks of 8 or 16 rows are all finite.
    x[3, 0] = INF
    x[5] = -INF
    x[9, -1] = float("nan")
    big = torch.finfo(dtype).max
    g[20] = big
    g[20, ::2] = -big
    g[22] = big
    mask = None
    if masking in ("per-row", "transposed"):
        mask = torch.rand(rows, columns, generator=gen) < 0.8
        mask[7] = False
        if masking == "transposed":
            mask = mask.t().contiguous().t()
    elif masking == "broadcast":
        mask = torch.arange(columns) != columns // 2 if columns > 1 else torch.ones(1, dtype=torch.bool)
    x.requires_grad_(True)
    fn = getattr(nf, op)
    whole = fn(x, -1, mask=mask)
    (grad_whole,) = torch.autograd.grad(whole, x, g)
    for i in range(rows):
        row = fn(x[i:i + 1], -1, mask=mask[i:i + 1] if masking in ("per-row", "transposed") else mask)
        (grad_row,) = torch.autograd.grad(row, x, g[i:i + 1])
        assert torch.equal(row.nan_to_num(7.0), whole[i:i + 1].nan_to_num(7.0)), i
        assert torch.equal(grad_row[i].nan_to_num(7.0), grad_whole[i].nan_to_num(7.0)), i
