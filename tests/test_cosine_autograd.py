"""float64 gradcheck, torch.library.opcheck and torch.compile(fullgraph=True) of
the cosine family (cosine_similarity, normalize, cos_sim), and the gradients
DESIGN.md fixes: 0 (and finite) for zero vectors and vectors below eps."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, DTYPES, INTERPRETED
from torch.library import opcheck

import nanfree.ops as nf

# Under Triton's interpreter every kernel launch runs in numpy: gradcheck's
# fast mode checks a random projection of the Jacobian (two evaluations per
# perturbation direction instead of one per input entry).
GRADCHECK = dict(fast_mode=INTERPRETED)


def _randn(*shape, device, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=dtype).to(device).requires_grad_(True)


def _composed_cos_sim(a, b):
    """sentence_transformers.util.cos_sim: F.normalize of the rows, then a @ b.T."""
    a = a.unsqueeze(0) if a.dim() == 1 else a
    b = b.unsqueeze(0) if b.dim() == 1 else b
    return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T


# --- gradcheck ----------------------------------------------------------------------

# (x1 shape, x2 shape, dim, eps): same shapes over each dim, broadcasting over
# the batch dims, a vector dim that broadcasts (each vector of x1 constant),
# ranks that differ, a single pair of 1-D vectors, and eps other than the default.
COSINE_CASES = {
    "dim -1": ((3, 4, 5), (3, 4, 5), -1, 1e-8),
    "dim 1": ((3, 4, 5), (3, 4, 5), 1, 1e-8),
    "dim 0": ((3, 4, 5), (3, 4, 5), 0, 1e-8),
    "broadcast batch": ((3, 1, 5), (1, 4, 5), -1, 1e-8),
    "broadcast vector dim": ((3, 1), (3, 5), 1, 1e-8),
    "broadcast rank": ((5,), (3, 5), -1, 1e-8),
    "1-D": ((6,), (6,), 0, 1e-8),
    "eps 1e-2, dim 0": ((3, 4), (3, 4), 0, 1e-2),
    "eps 0.5, broadcast": ((1, 6), (2, 6), 1, 0.5),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(COSINE_CASES))
def test_gradcheck_cosine_similarity(device, case):
    shape1, shape2, dim, eps = COSINE_CASES[case]
    x1, x2 = _randn(*shape1, device=device, seed=1), _randn(*shape2, device=device, seed=2)
    out = nf.cosine_similarity(x1, x2, dim, eps)
    torch.testing.assert_close(out, F.cosine_similarity(x1, x2, dim, eps))
    assert torch.autograd.gradcheck(lambda a, b: nf.cosine_similarity(a, b, dim, eps), (x1, x2),
                                    **GRADCHECK)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_gradcheck_normalize(device, dim):
    x = _randn(3, 4, 5, device=device)
    torch.testing.assert_close(nf.normalize(x, dim=dim), F.normalize(x, dim=dim))
    assert torch.autograd.gradcheck(lambda v: nf.normalize(v, 2.0, dim, 1e-6), (x,), **GRADCHECK)


@pytest.mark.backend_independent  # p != 2 is a torch composition: no kernel of any backend
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [1.0, 3.0, 1.5])
@pytest.mark.parametrize("dim", [-1, 0])
def test_gradcheck_normalize_other_p(device, p, dim):
    x = _randn(3, 4, 5, device=device)
    torch.testing.assert_close(nf.normalize(x, p, dim), F.normalize(x, p, dim))
    assert torch.autograd.gradcheck(lambda v: nf.normalize(v, p, dim), (x,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [2.0, 3.0])
@pytest.mark.parametrize("dim", [(1, 2), (0, 2)])
def test_gradcheck_normalize_several_dims(device, p, dim):
    x = _randn(3, 4, 5, device=device)
    torch.testing.assert_close(nf.normalize(x, p, dim), F.normalize(x, p, dim))
    assert torch.autograd.gradcheck(lambda v: nf.normalize(v, p, dim, 1e-6), (x,), **GRADCHECK)


# (a shape, b shape): 2-D by 2-D, and 1-D inputs taken as one row.
COS_SIM_CASES = [((3, 5), (4, 5)), ((5,), (4, 5)), ((3, 5), (5,)), ((5,), (5,))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", COS_SIM_CASES, ids=str)
def test_gradcheck_cos_sim(device, shapes):
    a, b = _randn(*shapes[0], device=device, seed=3), _randn(*shapes[1], device=device, seed=4)
    out = nf.cos_sim(a, b)
    assert out.shape == (a.shape[0] if a.dim() == 2 else 1, b.shape[0] if b.dim() == 2 else 1)
    torch.testing.assert_close(out, _composed_cos_sim(a, b))
    assert torch.autograd.gradcheck(nf.cos_sim, (a, b), **GRADCHECK)


# --- opcheck ------------------------------------------------------------------------


def _op(name):
    return getattr(torch.ops.nanfree, name).default


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_forward_ops(device, dtype):
    x1 = torch.randn(4, 9, dtype=dtype, device=device, requires_grad=True)
    x2 = torch.randn(4, 9, dtype=dtype, device=device, requires_grad=True)
    # A zero vector goes through the special-value branches too.
    with torch.no_grad():
        x1[1] = 0
    opcheck(_op("normalize"), (x1, 1e-12))
    opcheck(_op("cosine_similarity"), (x1, x2, 1e-8))
    # (F.normalize would turn the float16 zero row into NaN.)
    a = nf.normalize(x1.detach()).requires_grad_(True)
    b = nf.normalize(torch.randn(3, 9, dtype=dtype, device=device)).requires_grad_(True)
    opcheck(_op("cos_sim_matrix"), (a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_backward_ops(device, dtype):
    x1 = torch.randn(2, 3, 5, dtype=dtype, device=device)
    x2 = torch.randn(2, 3, 5, dtype=dtype, device=device)
    out, stats = torch.ops.nanfree.normalize(x1, 1e-12)
    opcheck(_op("normalize_backward"), (torch.randn_like(out), out, stats))
    out, stats = torch.ops.nanfree.cosine_similarity(x1, x2, 1e-8)
    opcheck(_op("cosine_similarity_backward"), (torch.randn_like(out), x1, x2, out, stats))


# --- torch.compile ------------------------------------------------------------------


def _loss(x1, x2):
    """Every public op once (cosine_similarity over dim 0 and broadcast,
    normalize with p = 2 and through the p != 2 composition, over one dim and
    over several, cos_sim of 2-D and 1-D inputs), each term weighted so that a wrong gradient cannot cancel."""
    weights = torch.arange(1.0, 6.0, device=x1.device)
    return (
        (nf.cosine_similarity(x1, x2, 0) * weights).sum()
        + 2 * nf.cosine_similarity(x1[:, None], x2[None], -1, 1e-3).pow(2).sum()
        + 3 * (nf.normalize(x1, dim=0) * x2).sum()
        + 4 * (nf.normalize(x1, 3.0, -1) * x2).sum()
        + 5 * nf.cos_sim(x1, x2).pow(2).sum()
        + 6 * nf.cos_sim(x1[0], x2).sum()
        + 7 * (nf.normalize(x1[None], dim=(0, 2)) * x2).sum()
        + 8 * (nf.normalize(x1, "fro", ()) * x2).sum()
    )


@pytest.mark.skipif(INTERPRETED, reason="compiling around interpreted Triton kernels adds nothing")
@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    x1 = torch.randn(4, 5, device=device, requires_grad=True)
    x2 = torch.randn(4, 5, device=device, requires_grad=True)
    with torch.no_grad():
        x1[2] = 0  # a zero vector: value 0 and gradient 0, compiled as eager
    compiled = torch.compile(_loss, fullgraph=True)
    expected = _loss(x1, x2)
    expected_grads = torch.autograd.grad(expected, (x1, x2))
    got = compiled(x1, x2)
    got_grads = torch.autograd.grad(got, (x1, x2))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grads, expected_grads)
    assert all(torch.isfinite(g).all() for g in got_grads)


# --- double backward, partial gradients ---------------------------------------------

DOUBLE_BACKWARD = {
    "cosine_similarity": lambda a, b: nf.cosine_similarity(a, b, -1),
    "normalize": lambda a, b: nf.normalize(a, dim=-1) * b,
    "cos_sim": lambda a, b: nf.cos_sim(a, b),
}


# The backward nodes call the backward ops through the dispatcher, autograd
# included, so that with create_graph=True the gradient records the node that
# refuses a second derivative (a call below autograd would record nothing and
# silently drop the cosine family's second-order term).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(DOUBLE_BACKWARD))
def test_double_backward_refuses_clearly(device, op):
    x1, x2 = _randn(3, 5, device=device, seed=5), _randn(3, 5, device=device, seed=6)
    out = DOUBLE_BACKWARD[op](x1, x2)
    # First-order gradients with create_graph=True still work ...
    (grad,) = torch.autograd.grad(out.pow(2).sum(), x1, create_graph=True)
    (expected,) = torch.autograd.grad(out.pow(2).sum(), x1, retain_graph=True)
    torch.testing.assert_close(grad, expected)
    assert grad.requires_grad
    # ... but differentiating them again is refused, not silently incomplete.
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_one_input_only(device):
    x1 = _randn(3, 5, device=device, seed=7)
    x2 = _randn(3, 5, device=device, seed=8).detach()
    out = nf.cosine_similarity(x1, x2, -1)
    # Only the first pair reaches the loss: the other rows get exactly 0.
    (grad,) = torch.autograd.grad(out[0], x1)
    (expected,) = torch.autograd.grad(F.cosine_similarity(x1, x2, -1)[0], x1)
    torch.testing.assert_close(grad, expected)
    assert (grad[1:] == 0).all()


# --- zero vectors and vectors below eps ---------------------------------------------


def _special_rows(dtype, device, d=4, tiny=1e-6):
    """[zero vector, vector far below eps (for eps=1e-3), plain vector] as rows."""
    rows = torch.stack([torch.zeros(d, dtype=torch.float64),
                        torch.full((d,), tiny, dtype=torch.float64),
                        torch.linspace(-1.0, 2.0, d, dtype=torch.float64)])
    return rows.to(device=device, dtype=dtype).requires_grad_(True)


def _close_to_torch(got, expected, dtype):
    """got (computed in dtype, given in float64) against torch's float64 result."""
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-7}
    torch.testing.assert_close(got, expected, rtol=tol[dtype], atol=tol[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_and_below_eps_vectors_cosine_similarity(device, dtype):
    x1 = _special_rows(dtype, device)
    x2 = torch.linspace(0.5, -1.5, 12, dtype=torch.float64).reshape(3, 4).to(device, dtype)
    x2.requires_grad_(True)
    out = nf.cosine_similarity(x1, x2, 1, 1e-3)
    g1, g2 = torch.autograd.grad(out.sum(), (x1, x2))
    assert g1.dtype == g2.dtype == dtype
    assert torch.isfinite(g1).all() and torch.isfinite(g2).all()
    # The zero vector and the one below eps pass no gradient (torch: 1/eps-sized ones) ...
    assert (g1[:2] == 0).all()
    # ... and their similarity does not depend on x2 at all for the zero vector.
    assert out[0] == 0 and (g2[0] == 0).all()
    # The plain pair is torch's.
    x1_ref, x2_ref = x1.detach().double().requires_grad_(), x2.detach().double().requires_grad_()
    r1, r2 = torch.autograd.grad(F.cosine_similarity(x1_ref, x2_ref, 1, 1e-3).sum(), (x1_ref, x2_ref))
    _close_to_torch(g1[2].double(), r1[2], dtype)
    _close_to_torch(g2.double(), r2, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [2.0, 3.0, 1.0])
def test_zero_and_below_eps_vectors_normalize(device, dtype, p):
    x = _special_rows(dtype, device)
    weights = torch.linspace(1.0, 2.0, 12, device=device).reshape(3, 4).to(dtype)
    out = nf.normalize(x, p, 1, 1e-3)
    (grad,) = torch.autograd.grad((out * weights).sum(), x)
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    assert (out[0] == 0).all()
    assert (grad[:2] == 0).all()
    x_ref = x.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad((F.normalize(x_ref, p, 1, 1e-3) * weights.double()).sum(),
                                      x_ref)
    _close_to_torch(out.double(), F.normalize(x_ref.detach(), p, 1, 1e-3), dtype)
    _close_to_torch(grad[2].double(), expected[2], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_and_below_eps_vectors_cos_sim(device, dtype):
    # cos_sim normalizes with eps 1e-12: entries of 1e-14 are below it (float16
    # flushes them to zero, which is the zero vector's case).
    a = _special_rows(dtype, device, tiny=1e-14)
    b = torch.linspace(-1.0, 1.0, 8, dtype=torch.float64).reshape(2, 4).to(device, dtype)
    b.requires_grad_(True)
    out = nf.cos_sim(a, b)
    ga, gb = torch.autograd.grad(out.sum(), (a, b))
    assert torch.isfinite(ga).all() and torch.isfinite(gb).all()
    assert (out[0] == 0).all() and (ga[:2] == 0).all()
    # The rest is torch's: the row below eps normalizes to a / eps, and it
    # reaches b's gradient through that.
    a_ref, b_ref = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    expected = _composed_cos_sim(a_ref, b_ref)
    ra, rb = torch.autograd.grad(expected.sum(), (a_ref, b_ref))
    _close_to_torch(out.double(), expected.detach(), dtype)
    _close_to_torch(ga[2].double(), ra[2], dtype)
    _close_to_torch(gb.double(), rb, dtype)
