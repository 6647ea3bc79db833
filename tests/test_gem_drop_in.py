"""Drop-in behaviour of GeM pooling (nanfree.ops.gem, gem_pool2d, nanfree.nn.GeM,
GeMTokenPooling): the same outputs and gradients as cirtorch's composition and
torch's reductions (dims, keepdim, 0-d, non-contiguous and channels-last inputs,
masks), the modules (parameters, training, token pooling, state dicts), and the
memory the backward keeps and allocates. The properties over extreme inputs are
test_gem_properties.py, the special-value table test_gem_special_values.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, DTYPES, INTERPRETED
from drop_in_checks import match_torch
from memory_checks import peak_bytes, saved_sizes

import nanfree.nn as nfnn
import nanfree.ops as nf
from nanfree._backends import SERVING


# --- drop-in behaviour ------------------------------------------------------------------


def _cirtorch_gem(x, p, eps=1e-6):
    """cirtorch's gem: avg_pool2d of clamp(x, eps) ** p over the whole map, ** (1/p)."""
    return F.avg_pool2d(x.clamp(min=eps).pow(p), (x.size(-2), x.size(-1))).pow(1.0 / p)


def _masked_composed(x, p, dim, eps=1e-6, keepdim=False, mask=None):
    """torch's composition over the kept entries (an attention mask's layout)."""
    if mask is None:
        return x.clamp(min=eps).pow(p).mean(dim=dim, keepdim=keepdim).pow(1 / p)
    keep = (mask != 0).expand(x.shape).to(x.dtype)
    total = (x.clamp(min=eps).pow(p) * keep).sum(dim=dim, keepdim=keepdim)
    return (total / keep.sum(dim=dim, keepdim=keepdim)).pow(1 / p)


def _incoming(shape, dtype, device):
    """A fixed incoming gradient in [-1, 1]."""
    g = torch.cos(torch.arange(math.prod(shape), dtype=torch.float64) * 0.7 + 0.3)
    return g.reshape(shape).to(dtype).to(device)


def _match_torch(nf_fn, torch_fn, bases, view=lambda *ts: ts, **tol):
    match_torch(nf_fn, torch_fn, bases, _incoming, view, **tol)


def _rand(shape, dtype, device, seed, low=0.05):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 + low).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("p_kind", ["Parameter [1]", "tensor []", "float"])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (3, 5, 4), (1, 1, 1, 1)], ids=str)
def test_gem_pool2d_matches_cirtorch(device, dtype, p_kind, shape):
    x = _rand(shape, dtype, device, 1, low=-0.5)  # some entries clamped
    if p_kind == "float":
        _match_torch(lambda x: nf.gem_pool2d(x, 3.0), lambda x: _cirtorch_gem(x, 3.0), [x])
        return
    p = torch.full((1,) if p_kind == "Parameter [1]" else (), 3.0, dtype=dtype, device=device)
    _match_torch(nf.gem_pool2d, _cirtorch_gem, [x, p])


CASES = {  # name: (shape, dim, keepdim)
    "dim -1": ((3, 4, 5), -1, False),
    "dim 0": ((3, 4, 5), 0, False),
    "dim 1 keepdim": ((3, 4, 5), 1, True),
    "dim -2": ((3, 4, 5), -2, False),
    "tuple (0, 2)": ((3, 4, 5), (0, 2), False),
    "tuple (2, 0) keepdim": ((3, 4, 5), (2, 0), True),
    "tuple negative (-1, -2)": ((2, 3, 4, 5), (-1, -2), False),
    "tuple (1,)": ((3, 4, 5), (1,), False),
    "list [1, 3]": ((2, 3, 4, 5), [1, 3], True),
    "all dims": ((3, 4, 5), (0, 1, 2), False),
    "1-D": ((7,), 0, False),
    "1-D keepdim": ((7,), -1, True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p_kind", ["tensor"] if INTERPRETED else ["tensor", "float"])
@pytest.mark.parametrize("case", list(CASES))
def test_dims_match_torch(device, case, p_kind):
    shape, dim, keepdim = CASES[case]
    x = _rand(shape, torch.float32, device, 2, low=-0.3)
    torch_dim = tuple(dim) if isinstance(dim, list) else dim
    if p_kind == "float":
        _match_torch(lambda x: nf.gem(x, 2.5, dim, 1e-6, keepdim),
                     lambda x: _masked_composed(x, 2.5, torch_dim, keepdim=keepdim), [x])
    else:
        p = torch.tensor(2.5, device=device)
        _match_torch(lambda x, p: nf.gem(x, p, dim, 1e-6, keepdim),
                     lambda x, p: _masked_composed(x, p, torch_dim, keepdim=keepdim), [x, p])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keepdim", [False, True])
def test_zero_dim_input_matches_torch(device, keepdim):
    x = torch.tensor(1.7, device=device)
    for dim in (0, -1):
        _match_torch(lambda x: nf.gem(x, 3.0, dim, 1e-6, keepdim),
                     lambda x: _masked_composed(x, 3.0, dim, keepdim=keepdim), [x])


# Views of shape [3, 4, 5] that are not plain contiguous tensors.
LAYOUT_VIEWS = {
    "transposed": ((5, 4, 3), lambda t: t.transpose(0, 2)),
    "stepped": ((3, 8, 11), lambda t: t[:, ::2, 1::2]),
    "expanded": ((1, 4, 5), lambda t: t.expand(3, 4, 5)),
    "channels last": ((3, 4, 5, 2), lambda t: t.permute(0, 3, 1, 2)[..., 0]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUT_VIEWS))
@pytest.mark.parametrize("dim", [0, -1, (1, 2), (0, 2)], ids=str)
def test_non_contiguous_match_torch(device, layout, dim):
    shape, view = LAYOUT_VIEWS[layout]
    x = _rand(shape, torch.float32, device, 3, low=-0.3)
    p = torch.tensor([3.0], device=device)
    _match_torch(lambda x, p: nf.gem(x, p, dim),
                 lambda x, p: _masked_composed(x, p.reshape(()), dim), [x, p],
                 lambda x, p: (view(x), p))


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_image(device):
    x = _rand((2, 3, 5, 5), torch.float32, device, 4).contiguous(
        memory_format=torch.channels_last)
    p = torch.tensor([3.0], device=device)
    _match_torch(nf.gem_pool2d, _cirtorch_gem, [x, p])


MASKS = {  # name: (x shape, mask builder), the mask over dim 1
    "[B, L, 1] bool": ((3, 6, 4), lambda g: torch.rand(3, 6, 1, generator=g) < 0.6),
    "[B, L, 1] int64": ((3, 6, 4), lambda g: (torch.rand(3, 6, 1, generator=g) < 0.6).long()),
    "[B, L, H] bool": ((3, 6, 4), lambda g: torch.rand(3, 6, 4, generator=g) < 0.6),
    "[B, L, H] int32 values 0..3": ((3, 6, 4),
                                    lambda g: torch.randint(0, 4, (3, 6, 4), generator=g,
                                                            dtype=torch.int32)),
    "[L, 1] broadcast over B": ((3, 6, 4), lambda g: torch.rand(6, 1, generator=g) < 0.6),
    "uint8 [B, L, 1]": ((3, 6, 4), lambda g: (torch.rand(3, 6, 1, generator=g) < 0.6)
                        .to(torch.uint8)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_masks_match_torch(device, mask_kind):
    shape, build = MASKS[mask_kind]
    gen = torch.Generator().manual_seed(5)
    mask = build(gen)
    keep = (mask != 0).expand(shape)
    # Every reduction keeps an entry (torch's composition is NaN on an empty one).
    mask = mask.clone()
    if not bool(keep.any(dim=1).all()):
        if mask.dim() == 2:
            mask[0] = 1
        else:
            mask[:, 0] = 1
    mask = mask.to(device)
    x = _rand(shape, torch.float32, device, 6, low=-0.3)
    p = torch.tensor([3.0], device=device)
    _match_torch(lambda x, p: nf.gem(x, p, 1, mask=mask),
                 lambda x, p: _masked_composed(x, p.reshape(()), 1, mask=mask), [x, p])
    # keepdim, and a mask given as a non-contiguous view
    strided = mask.transpose(0, -1).contiguous().transpose(0, -1)
    _match_torch(lambda x, p: nf.gem(x, p, 1, keepdim=True, mask=strided),
                 lambda x, p: _masked_composed(x, p.reshape(()), 1, keepdim=True, mask=mask),
                 [x, p])


@pytest.mark.parametrize("device", DEVICES)
def test_mask_over_tuple_dims(device):
    x = _rand((2, 3, 4, 4), torch.float32, device, 7)
    mask = (torch.arange(16).reshape(1, 1, 4, 4) % 3 != 0).to(device)  # [1, 1, H, W]
    p = torch.tensor([2.0], device=device)
    _match_torch(lambda x, p: nf.gem(x, p, (2, 3), mask=mask),
                 lambda x, p: _masked_composed(x, p.reshape(()), (2, 3), mask=mask), [x, p])


# --- the modules ---------------------------------------------------------------------


class _CirtorchGeM(torch.nn.Module):
    """cirtorch's GeM layer, as composed torch code."""

    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = torch.nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return _cirtorch_gem(x, self.p, self.eps)


@pytest.mark.backend_independent  # the modules' attributes only
def test_gem_module_parameters():
    module = nfnn.GeM()
    assert isinstance(module.p, torch.nn.Parameter) and module.p.shape == (1,)
    assert module.p.dtype == torch.float32 and module.p.requires_grad and module.p.item() == 3.0
    assert [name for name, _ in module.named_parameters()] == ["p"]
    assert module.eps == 1e-6
    assert "p=3.0000" in repr(module) and "eps=1e-06" in repr(module)
    fixed = nfnn.GeM(p=4, eps=1e-5, learnable=False)
    assert isinstance(fixed.p, float) and fixed.p == 4.0 and list(fixed.parameters()) == []
    assert fixed.state_dict() == {}
    assert "p=4.0000" in repr(fixed)
    tokens = nfnn.GeMTokenPooling(p=2.0)
    assert isinstance(tokens.p, torch.nn.Parameter) and tokens.p.shape == (1,)
    assert isinstance(nfnn.GeMTokenPooling(learnable=False).p, float)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("learnable", [True, False])
def test_gem_module_matches_cirtorch(device, learnable):
    ours = nfnn.GeM(p=3.0, learnable=learnable).to(device)
    theirs = _CirtorchGeM(3.0).to(device)
    if not learnable:
        theirs.p.requires_grad_(False)
    x = _rand((2, 4, 5, 5), torch.float32, device, 8, low=-0.5).requires_grad_(True)
    out = ours(x)
    expected = theirs(x)
    assert out.shape == expected.shape == (2, 4, 1, 1)
    torch.testing.assert_close(out, expected)
    g = torch.linspace(-1, 1, 8, device=device).reshape(2, 4, 1, 1)
    (dx,) = torch.autograd.grad(out, x, g, retain_graph=True)
    (dx_ref,) = torch.autograd.grad(expected, x, g, retain_graph=True)
    torch.testing.assert_close(dx, dx_ref)
    if learnable:
        (dp,) = torch.autograd.grad(out, ours.p, g)
        (dp_ref,) = torch.autograd.grad(expected, theirs.p, g)
        assert dp.shape == (1,)
        torch.testing.assert_close(dp, dp_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_gem_module_trains(device):
    # One optimizer step moves p as cirtorch's layer moves it.
    x = _rand((2, 3, 4, 4), torch.float32, device, 9)
    modules = [nfnn.GeM().to(device), _CirtorchGeM().to(device)]
    for module in modules:
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        module(x).pow(2).sum().backward()
        opt.step()
    torch.testing.assert_close(modules[0].p.detach(), modules[1].p.detach())
    assert modules[0].p.item() != 3.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_pooling_with_attention_mask(device, dtype):
    gen = torch.Generator().manual_seed(10)
    tokens = torch.randn(3, 6, 5, generator=gen).to(dtype).to(device).requires_grad_(True)
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
                             device=device)
    pool = nfnn.GeMTokenPooling(p=3.0).to(device)
    out = pool(tokens, attention)
    assert out.shape == (3, 5) and out.dtype == dtype
    assert (out[1] == 0).all(), "a fully padded sequence pools to 0"
    out.sum().backward()
    assert torch.isfinite(tokens.grad).all() and torch.isfinite(pool.p.grad).all()
    assert (tokens.grad[1] == 0).all() and (tokens.grad[0, 4:] == 0).all()
    # The sequences with tokens are torch's composition over their tokens
    # (which is NaN in p's gradient and in the padded sequence's hidden states).
    x = tokens.detach().double()
    p_ref = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    x_ref = x.clone().requires_grad_(True)
    composed = _masked_composed(x_ref, p_ref, 1, mask=attention[..., None])
    composed.sum().backward()
    assert torch.isnan(composed[1]).all() and torch.isnan(p_ref.grad)
    tol = {torch.float64: {}, torch.float32: {},
           torch.float16: dict(rtol=2e-3, atol=1e-3),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}[dtype]
    torch.testing.assert_close(out.detach().double()[[0, 2]], composed.detach()[[0, 2]], **tol)
    torch.testing.assert_close(tokens.grad.double()[[0, 2]], x_ref.grad[[0, 2]], **tol)
    # Without an attention mask: every token.
    torch.testing.assert_close(pool(tokens.detach()).double(),
                               _masked_composed(x, 3.0, 1).to(dtype).double(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_token_pooling_fully_padded_batch(device):
    # Every sequence padded: 0 everywhere, gradients 0, no NaN anywhere.
    tokens = torch.randn(2, 4, 3, device=device, requires_grad=True)
    pool = nfnn.GeMTokenPooling().to(device)
    out = pool(tokens, torch.zeros(2, 4, dtype=torch.long, device=device))
    (out * 3).sum().backward()
    assert (out == 0).all() and (tokens.grad == 0).all() and pool.p.grad.item() == 0


@pytest.mark.parametrize("module_cls", [nfnn.GeM, nfnn.GeMTokenPooling])
def test_state_dict_round_trip(module_cls):
    trained = module_cls(p=3.0)
    with torch.no_grad():
        trained.p.fill_(4.25)
    state = trained.state_dict()
    assert list(state) == ["p"] and state["p"].shape == (1,)
    restored = module_cls()
    restored.load_state_dict(state)
    assert restored.p.item() == 4.25 and isinstance(restored.p, torch.nn.Parameter)
    x = torch.rand(2, 3, 4, 4) if module_cls is nfnn.GeM else torch.rand(2, 4, 3)
    torch.testing.assert_close(restored(x), trained(x), rtol=0, atol=0)
    # A cirtorch checkpoint (p of shape [1]) loads as well.
    restored.load_state_dict(_CirtorchGeM(2.0).state_dict())
    assert restored.p.item() == 2.0


# --- memory: nothing full-size besides input, output and gradients ---------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["image", "tokens"])
def test_backward_saves_input_stats_and_mask_only(device, layout):
    if layout == "image":
        x = torch.rand(4, 8, 7, 7, device=device, dtype=torch.float16, requires_grad=True)
        p = torch.tensor([3.0], device=device, requires_grad=True)
        out, sizes = saved_sizes(lambda: nf.gem_pool2d(x, p))
        allowed = x.numel() + 1 + 3 * out.numel()
    else:
        x = torch.rand(4, 32, 16, device=device, dtype=torch.float16, requires_grad=True)
        attention = (torch.arange(32, device=device)[None] < torch.tensor(
            [[32], [10], [0], [5]], device=device)).long()
        p = torch.tensor([3.0], device=device, requires_grad=True)
        out, sizes = saved_sizes(lambda: nf.gem(x, p, 1, mask=attention[..., None]))
        # The mask is saved as the expanded view of a [B, L, 1] bool tensor.
        allowed = x.numel() + 1 + 3 * out.numel() + x.numel()
    assert max(sizes) <= x.numel(), f"a saved tensor larger than the input: {sizes}"
    assert sum(sizes) <= allowed, f"saved {sizes}"
    assert sum(1 for s in sizes if s == x.numel()) <= 2


def _served_by_torch_fallback(device):
    backend = SERVING.get(device)
    if backend == "torch":
        return True
    # The compiled kernels of this family may not be built: then the
    # pure-torch kernel registered for every device serves.
    key = {"cpu": "CPU", "cuda": "CUDA"}[device]
    return backend in ("cpu", "cuda") and not torch._C._dispatch_has_kernel_for_dispatch_key(
        "nanfree::gem", key)


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter copies every argument")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["image", "tokens"])
def test_peak_memory(device, dtype, layout):
    """Forward: no more than the output and the statistics (and the small mask
    conversion); backward: no more than the input's gradient (in the input's
    dtype, not a float32 copy) and p's. Not for the pure-torch reference."""
    if _served_by_torch_fallback(device):
        pytest.skip("the pure-torch reference implementation builds full-size intermediates")
    gen = torch.Generator().manual_seed(11)
    if layout == "image":
        x = torch.rand(16, 64, 7, 7, generator=gen).to(dtype).to(device).requires_grad_(True)
        mask = None

        def forward():
            return nf.gem_pool2d(x, p)
    else:
        x = torch.rand(8, 128, 64, generator=gen).to(dtype).to(device).requires_grad_(True)
        lengths = torch.tensor([[128], [100], [0], [7], [64], [128], [1], [50]])
        mask = (torch.arange(128)[None] < lengths).long().to(device)[..., None]

        def forward():
            return nf.gem(x, p, 1, mask=mask)
    p = torch.tensor([3.0], device=device, requires_grad=True)
    input_bytes = x.numel() * x.element_size()
    outputs = []
    forward_peak = peak_bytes(lambda: outputs.append(forward()), device)
    out = outputs[0]
    small = out.numel() * (out.element_size() + 3 * 8) + (x.shape[0] * x.shape[1] * 2
                                                           if mask is not None else 0) + 4096
    assert forward_peak <= small, f"forward peak {forward_peak} bytes (input {input_bytes})"
    g = torch.ones_like(out)
    backward_peak = peak_bytes(lambda: torch.autograd.grad(out, (x, p), g), device)
    assert backward_peak <= input_bytes + small, \
        f"backward peak {backward_peak} bytes, input (and its gradient) {input_bytes}"
