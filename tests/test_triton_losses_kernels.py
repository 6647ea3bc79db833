"""The Triton losses launchers (nanfree._triton.losses), called directly, checked
against the pure-PyTorch backend (nanfree._torch_backend.losses: the same rules
of csrc/include/nanfree/losses_math.h, mirrored in torch) to float rounding,
with every infinity, NaN and zero in the same place: pointwise_loss, its sum
(pointwise_loss_sum) and its backward for the five kinds on a grid of special values and on random inputs
with every operand layout (absent, one element, broadcast); cross_entropy and
its backward for class-index and probability targets, label smoothing, class
weights, masks of any strides, special rows, inner > 1 and class counts that
are not a multiple of the tile.

They run where conftest.triton_kernel_device says; shapes are small (the
interpreter runs every program in numpy)."""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from conftest import (DTYPES, INF, NAN, acc_dtype, triton_kernel_device,  # noqa: E402
                      triton_kernel_mode_matches, triton_refusal_words, triton_refused_devices)
from nanfree._backends import BackendUnavailableError  # noqa: E402
from nanfree._torch_backend import losses as R  # noqa: E402
from nanfree._triton import losses as K  # noqa: E402

DEVICE = triton_kernel_device(K)

# The interpreter evaluates both sides of tl.where (log 0, 0 / 0, inf * 0) in numpy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# Relative tolerance per dtype of the compared values: a few rounding errors of
# the accumulation type, one unit in the last place of a half-precision output.
RTOL = {
    torch.float64: 1e-11,
    torch.float32: 2e-5,
    torch.float16: 2.0 ** -10,
    torch.bfloat16: 2.0 ** -7,
}
SPECIAL = [-INF, -3e38, -1e4, -50.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.3, 0.5, 1.0, 2.0, 50.0,
           1e4, 3e38, INF, NAN]
FOCAL = [(gamma, alpha) for gamma in (0.0, 0.5, 1.0, 2.0) for alpha in (0.25, -1.0)]


def on_device(*ts):
    return tuple(None if t is None else t.to(DEVICE) for t in ts)


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)


def assert_close(got, want, dtype, what, scale=None):
    """got == want up to RTOL[dtype] relative (plus RTOL * scale where given, for
    sums that cancel); NaN, infinities and zeros in the same places."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    rtol = RTOL[dtype]
    tol = rtol * want.abs() + torch.finfo(dtype).tiny
    if scale is not None:
        scale = torch.as_tensor(scale, dtype=torch.float64).expand(want.shape)
        tol = tol + rtol * torch.where(torch.isfinite(scale), scale, 0.0)
    same = (got == want) | (got.isnan() & want.isnan())
    special = ((got == 0) == (want == 0)) & (got.isinf() == want.isinf()) & \
        (got.isnan() == want.isnan())
    bad = ~(same | (((got - want).abs() <= tol) & special))
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: got {got[bad][:4].tolist()}, want "
        f"{want[bad][:4].tolist()}")


# ---------------------------------------------------------------- pointwise losses


def check_pointwise(x, t, w, pw, kind, alpha, gamma, g, what):
    """The value and both partials against the reference, on the same inputs."""
    dtype = x.dtype
    xd, td, wd, pwd, gd = on_device(x, t, w, pw, g)
    out = K.pointwise_loss(xd, td, wd, pwd, kind, alpha, gamma)
    layout = torch.empty_like(xd).stride()  # the input's (a transposed one's transposed)
    assert out.shape == x.shape and out.dtype == dtype and out.stride() == layout
    want = R.pointwise_loss(x, t, w, pw, kind, alpha, gamma)
    assert_close(out, want, dtype, f"{what} value")
    # The sum of the losses (pointwise_loss_sum), in the accumulation dtype: both add
    # unrounded losses, in a different order.
    total = K.pointwise_loss_sum(xd, td, wd, pwd, kind, alpha, gamma)
    want_total = R.pointwise_loss_sum(x, t, w, pw, kind, alpha, gamma)
    assert total.shape == () and total.dtype == want_total.dtype == acc_dtype(dtype)
    assert_close(total, want_total, acc_dtype(dtype), f"{what} sum",
                 scale=R.pointwise_loss(x.double(), t.double(), None if w is None else w.double(),
                                        None if pw is None else pw.double(), kind, alpha,
                                        gamma).abs().sum())
    # Sums that cancel (sigmoid(x) - t, pw softplus(-x) - softplus(x)): an allowance
    # on the scale of their terms.
    scale = g.double().abs() * (1 + x.double().abs().clamp(max=100))
    for operand in (w, pw):
        if operand is not None:
            scale = scale * (1 + operand.double().abs())
    for partial in (0, 1):
        grad = K.pointwise_loss_backward(gd, xd, td, wd, pwd, kind, alpha, gamma, partial)
        assert grad.shape == x.shape and grad.dtype == dtype and grad.stride() == layout
        want = R.pointwise_loss_backward(g, x, t, w, pw, kind, alpha, gamma, partial)
        assert_close(grad, want, dtype, f"{what} d/d{'xt'[partial]}", scale=scale)


def special_grid(dtype):
    """Every pair (x, t) of SPECIAL, flat."""
    v = torch.tensor(SPECIAL, dtype=torch.float64)
    x, t = torch.meshgrid(v, v, indexing="ij")
    return x.reshape(-1).to(dtype), t.reshape(-1).to(dtype)


def test_kernel_mode_and_device():
    assert triton_kernel_mode_matches(K, DEVICE)


@pytest.mark.parametrize("device", triton_refused_devices(DEVICE))
def test_refuses_tensors_the_kernels_cannot_run_on(device):
    # Refused before any launch, whatever the shape (never an error from inside Triton).
    words = triton_refusal_words(DEVICE)
    x = torch.ones(2, 5, 3, device=device)
    y = torch.zeros(2, 3, dtype=torch.int64, device=device)
    g = torch.ones(2, 3, device=device)
    stats = torch.zeros(2, 3, 5, device=device)
    calls = [
        lambda: K.pointwise_loss(x, x, None, None, 0, 0.25, 2.0),
        lambda: K.pointwise_loss(x[:0], x[:0], None, None, 4, 0.25, 2.0),
        lambda: K.pointwise_loss_backward(x, x, x, x, None, 1, 0.25, 2.0, 1),
        lambda: K.cross_entropy(x, y, None, None, -100, 0.0),
        lambda: K.cross_entropy_backward(g, x, x, None, None, -100, 0.1, stats, True),
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError) as info:
            call()
        assert all(w in str(info.value) for w in words), str(info.value)
    # The argument checks come first.
    with pytest.raises(TypeError, match="nanfree.pointwise_loss: `input` must be float16"):
        K.pointwise_loss(x.int(), x.int(), None, None, 0, 0.25, 2.0)


def test_argument_errors_are_the_ops():
    x = torch.ones(2, 5, 3, device=DEVICE)
    y = torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
    g = torch.ones(2, 3, device=DEVICE)
    stats = torch.zeros(2, 3, 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"nanfree.pointwise_loss: `kind` must be 0 to 4"):
        K.pointwise_loss(x, x, None, None, 5, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"nanfree.pointwise_loss: `gamma` must be >= 0"):
        K.pointwise_loss(x, x, None, None, 4, 0.25, -1.0)
    with pytest.raises(ValueError, match=r"nanfree.pointwise_loss_backward: `partial` must be"):
        K.pointwise_loss_backward(x, x, x, None, None, 0, 0.0, 0.0, 2)
    with pytest.raises(ValueError, match=r"nanfree.pointwise_loss: `weight` must be"):
        K.pointwise_loss(x, x, torch.ones(4, device=DEVICE), None, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"nanfree.cross_entropy: class-index `target`"):
        K.cross_entropy(x, y[:1], None, None, -100, 0.0)
    with pytest.raises(ValueError, match=r"nanfree.cross_entropy: `label_smoothing`"):
        K.cross_entropy(x, y, None, None, -100, 1.5)
    with pytest.raises(ValueError, match=r"nanfree.cross_entropy_backward: `target_grad`"):
        K.cross_entropy_backward(g, x, y, None, None, -100, 0.0, stats, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", range(5))
def test_pointwise_special_values(dtype, kind):
    x, t = special_grid(dtype)
    n = x.numel()
    g = randn(n, dtype=dtype, seed=1)
    g[::9] = 0  # a zero upstream gradient against infinite partials: 0
    w = rand(n, dtype=dtype, seed=2)
    w[::7] = 0
    pw = rand(n, dtype=dtype, seed=3) * 3
    pw[::5] = 0
    operands = [(None, None)]
    if kind in (0, 1):
        operands += [(w, pw), (w, None), (torch.tensor(0.5, dtype=dtype), None)]
    for (weight, pos_weight), (gamma, alpha) in itertools.product(
            operands, FOCAL if kind == 4 else [(0.0, 0.0)]):
        what = f"kind {kind} weight {weight is not None} pos_weight {pos_weight is not None} " \
               f"gamma {gamma} alpha {alpha}"
        check_pointwise(x, t, weight, pos_weight if kind == 0 else None, kind, alpha, gamma, g,
                        what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", range(5))
def test_pointwise_random(dtype, kind):
    # Inputs in each loss's domain; weight broadcast along rows (a copy), pos_weight
    # [1, n] and grad [n] (copies), a transposed (non-contiguous) input and target.
    x = randn(37, 29, dtype=dtype, seed=4, scale=4.0)
    t = rand(37, 29, dtype=dtype, seed=5)
    if kind == 1:
        x = rand(37, 29, dtype=dtype, seed=6)
    if kind == 3:
        t = t.double().log().to(dtype)
    g = randn(29, dtype=dtype, seed=7)
    w = rand(29, dtype=dtype, seed=8) if kind < 2 else None
    pw = rand(1, 29, dtype=dtype, seed=9) * 2 if kind == 0 else None
    for gamma, alpha in (FOCAL if kind == 4 else [(0.0, 0.0)]):
        check_pointwise(x, t, w, pw, kind, alpha, gamma, g, f"kind {kind} gamma {gamma}")
    check_pointwise(x.t(), t.t(), None, None, kind, 0.25, 2.0, torch.tensor(-1.5, dtype=dtype),
                    f"kind {kind} transposed")


def test_pointwise_operand_layouts():
    # One element at every position (step 0), of any shape that broadcasts; a
    # column broadcast (a copy); an empty input.
    f32 = torch.float32
    x = randn(6, 11, dtype=f32, seed=10, scale=3.0)
    t = rand(6, 11, dtype=f32, seed=11)
    for w, pw, g in [(torch.tensor([[0.7]]), torch.tensor([2.5]), torch.tensor(0.5)),
                     # one element broadcast (every stride 0), as autograd expands a
                     # reduction's gradient: read in place
                     (torch.tensor(0.3).expand(6, 11), torch.tensor([1.5]).expand(11),
                      torch.tensor(-0.25).expand(6, 11)),
                     (rand(6, 1, dtype=f32, seed=12), None, randn(1, 11, dtype=f32, seed=13)),
                     (None, rand(11, dtype=f32, seed=14), randn(6, 11, dtype=f32, seed=15))]:
        check_pointwise(x, t, w, pw, 0, 0.0, 0.0, g, "layouts")
    empty = torch.empty(0, 3, device=DEVICE)
    assert K.pointwise_loss(empty, empty, None, None, 4, 0.25, 2.0).shape == (0, 3)
    grad = K.pointwise_loss_backward(empty, empty, empty, None, None, 0, 0.0, 0.0, 1)
    assert grad.shape == (0, 3)


# ---------------------------------------------------------------- cross entropy


def check_cross_entropy(x, target, weight, mask, ignore_index, eps, target_grad, what):
    """cross_entropy and its backward against the reference: the backward from the
    kernel's own stats, compared with the reference's from the reference's stats."""
    dtype, acc = x.dtype, acc_dtype(x.dtype)
    xd, yd, wd, md = on_device(x, target, weight, mask)
    loss, stats = K.cross_entropy(xd, yd, wd, md, ignore_index, eps)
    r_loss, r_stats = R.cross_entropy(x, target, weight, mask, ignore_index, eps)
    assert loss.dtype == acc and stats.dtype == acc and loss.shape == r_loss.shape
    assert stats.shape == r_stats.shape and stats.is_contiguous()
    total, log_sum = r_stats[..., 2].double().abs(), r_stats[..., 1].double().abs()
    # log p = (x - max) - log_sum cancels near p = 1; a sum over many classes.
    assert_close(loss, r_loss, acc, f"{what} loss", scale=4 * total * (1 + log_sum))
    assert_close(stats, r_stats, acc, f"{what} stats", scale=4 * r_stats.double().abs() + 1)
    g = randn(*loss.shape, dtype=acc, seed=16)
    g.view(-1)[::5] = 0
    (gd, sd) = on_device(g, stats)
    grad, grad_t = K.cross_entropy_backward(gd, xd, yd, wd, md, ignore_index, eps, sd,
                                            target_grad)
    r_grad, r_grad_t = R.cross_entropy_backward(g, x, target, weight, mask, ignore_index, eps,
                                                r_stats, target_grad)
    assert grad.shape == x.shape and grad.dtype == dtype and grad.is_contiguous()
    w_max = 1.0 if weight is None else float(weight.double().abs().max())
    scale = (g.double().abs() * (total + w_max)).unsqueeze(1)
    assert_close(grad, r_grad, dtype, f"{what} grad_input", scale=scale)
    if target_grad:
        assert grad_t.shape == target.shape and grad_t.dtype == target.dtype
        assert_close(grad_t, r_grad_t, dtype, f"{what} grad_target",
                     scale=scale * (1 + log_sum.unsqueeze(1)))
    else:
        assert grad_t.shape == (0,)


def ce_problem(outer, classes, inner, dtype, seed):
    """(logits with special positions, class-index targets with ignored and
    out-of-range entries, probability targets, class weights with a 0)."""
    x = randn(outer, classes, inner, dtype=dtype, seed=seed, scale=3.0)
    x[1, :, 0] = -INF   # no class exists: left out
    x[2, 0, 0] = INF    # a +inf logit: locally constant
    x[3, 1, 0] = NAN    # a NaN logit: its position is NaN
    x[4, :, -1] = -INF
    x[4, 2, -1] = 7.0   # one class exists
    x[5, :, 0] = -INF
    x[5, 3, 0] = NAN    # a NaN and no other class: max -inf, log_sum NaN
    x[6, 1, -1] = INF
    x[6, 4, -1] = NAN   # +inf and NaN: max +inf, log_sum NaN
    gen = torch.Generator().manual_seed(seed + 1)
    y = torch.randint(0, classes, (outer, inner), generator=gen)
    y[0, 0] = -100           # ignore_index
    y[1, -1] = classes + 3   # out of range: left out
    y[4, -1] = 2
    y[5, 0] = 3
    p = rand(outer, classes, inner, dtype=torch.float64, seed=seed + 2)
    p = (p / p.sum(1, keepdim=True)).to(dtype)
    w = (rand(classes, dtype=torch.float64, seed=seed + 3) + 0.5).to(dtype)
    w[0] = 0
    return x, y, p, w


def ce_masks(outer, classes, inner, seed):
    """A dense mask with a fully masked position, an expanded one (0 strides),
    and one read through transposed strides."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(outer, classes, inner, generator=gen) < 0.8
    dense[0, :, -1] = False
    dense[3, 1, 0] = False if inner > 1 else dense[3, 1, 0]  # a masked NaN at inner > 1
    expanded = (torch.rand(1, classes, 1, generator=gen) < 0.7).expand(outer, classes, inner)
    transposed = (torch.rand(outer, inner, classes, generator=gen) < 0.8).transpose(1, 2)
    return {"dense": dense, "expanded": expanded, "transposed": transposed}


# (weight, mask, label smoothing): each option and mask layout at least once.
CE_OPTIONS = [(False, None, 0.0), (True, None, 0.1), (False, "dense", 0.1),
              (True, "expanded", 0.0), (True, "transposed", 0.1)]


def ce_cases(target_kind, dtype, inner, seed, options=CE_OPTIONS):
    x, y, p, w = ce_problem(7, 13, inner, dtype, seed=seed)
    masks = ce_masks(7, 13, inner, seed=seed + 5)
    for weighted, mask, eps in options:
        yield (x, y if target_kind == "index" else p, w if weighted else None,
               None if mask is None else masks[mask], eps,
               f"{target_kind} weight {weighted} mask {mask} eps {eps}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", [1, 3])
def test_cross_entropy_index_targets(dtype, inner):
    for x, y, w, mask, eps, what in ce_cases("index", dtype, inner, seed=20):
        check_cross_entropy(x, y, w, mask, -100, eps, False, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", [1, 3])
def test_cross_entropy_probability_targets(dtype, inner):
    for x, p, w, mask, eps, what in ce_cases("probability", dtype, inner, seed=30):
        check_cross_entropy(x, p, w, mask, -100, eps, True, what)
    check_cross_entropy(x, p, None, None, -100, 0.1, False, "no target gradient")


@pytest.mark.parametrize("target_kind", ["index", "probability"])
@pytest.mark.parametrize("inner", [1, 3])
def test_cross_entropy_small_tiles(target_kind, inner, monkeypatch):
    # Tiles of 8 entries (BLOCK_I 2 at inner > 1): both class loops run several
    # times, the last tile partial, and the positions of a program past inner.
    monkeypatch.setattr(K, "CE_BLOCK_I", 2)
    monkeypatch.setattr(K, "CE_TILE", 8)
    for x, t, w, mask, eps, what in ce_cases(target_kind, torch.float32, inner, seed=50,
                                             options=CE_OPTIONS[1:4]):
        check_cross_entropy(x, t, w, mask, -100, eps, target_kind == "probability", what)


@pytest.mark.parametrize("classes, inner", [(5, 1), (1000, 1), (1500, 1), (1500, 3)])
def test_cross_entropy_class_counts(classes, inner):
    # The module's tiles: 5 in one, 1000 and 1500 over a loop with a partial last tile.
    x, y, p, w = ce_problem(7, classes, inner, torch.float32, seed=classes + inner)
    check_cross_entropy(x, y, w, None, -100, 0.1, False, "index")
    check_cross_entropy(x, p, None, None, -100, 0.0, True, "probabilities")


def test_cross_entropy_ignore_index_and_empty():
    # ignore_index is any class (here 2); positions may be none.
    x, y, _, _ = ce_problem(7, 6, 2, torch.float32, seed=40)
    check_cross_entropy(x, y, None, None, 2, 0.0, False, "ignore_index 2")
    empty = torch.empty(0, 4, 3, device=DEVICE)
    loss, stats = K.cross_entropy(empty, torch.empty(0, 3, dtype=torch.int64, device=DEVICE),
                                  None, None, -100, 0.0)
    assert loss.shape == (0, 3) and stats.shape == (0, 3, 5)
    grad, grad_t = K.cross_entropy_backward(torch.empty(0, 3, device=DEVICE), empty, empty, None,
                                            None, -100, 0.0, stats, True)
    assert grad.shape == (0, 4, 3) and grad_t.shape == (0, 4, 3)
