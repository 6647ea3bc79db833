"""The MNR loss under torch.autocast. sentence-transformers' composition
(cos_sim's matmul, then logsumexp) runs its matmul in the autocast dtype;
CUDA autocast computes logsumexp in float32 and returns float32, CPU autocast
leaves logsumexp alone and returns the autocast dtype. nanfree.ops.mnr_loss
returns float32 on both (DESIGN.md: half precision gives a float32 loss;
float64 inputs, which autocast leaves alone, a float64 loss), computes from
the inputs' own values (autocast does not round them), and its value is the
composition's to the autocast dtype's rounding. Every gradient returns in
its input's dtype, a tensor scale's in the scale's."""

import pytest
import torch
from conftest import DEVICES, INTERPRETED
from mnr_oracle import composed_mnr_loss

import nanfree.ops as nf

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# name: (negatives "hard" / "shared" / None, tensor scale, options)
CASES = {
    "default": (None, False, {}),
    "every direction, hard negatives, hardness": (
        "hard", True, dict(directions=ALL, hardness_mode="all_negatives", hardness_strength=1.0)),
    "symmetric, shared, none": ("shared", True, dict(symmetric=True, reduction="none")),
}


def _inputs(device, dtype, negatives, tensor_scale, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 8, generator=gen)
    p = q + 0.8 * torch.randn(4, 8, generator=gen)
    n = {"hard": torch.randn(4, 2, 8, generator=gen),
         "shared": torch.randn(3, 8, generator=gen), None: None}[negatives]
    leaves = [t.to(device, dtype).requires_grad_(True) for t in (q, p, n) if t is not None]
    scale = torch.tensor(20.0, device=device, requires_grad=True) if tensor_scale else 20.0
    return leaves, scale


def _call(fn, leaves, scale, options):
    q, p, *rest = leaves
    options = dict(options)
    if fn is composed_mnr_loss and options.pop("symmetric", False):
        options.update(directions=("query_to_doc", "doc_to_query"),
                       partition_mode="per_direction")
    return fn(q, p, rest[0] if rest else None, scale=scale, **options)


def _input_dtypes(device, autocast_dtype):
    # On CPU, torch.cat refuses float16 tensors under bfloat16 autocast (and
    # bfloat16 under float16): torch's composition cannot run there (nanfree
    # concatenates with autocast off, and is compared with itself only).
    if device == "cpu":
        return [torch.float32, torch.float64, autocast_dtype]
    return [torch.float32, torch.float64, torch.float16, torch.bfloat16]


RUNS = [(ad, idt) for ad in (torch.bfloat16, torch.float16)
        for idt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]
if INTERPRETED:
    RUNS = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype,input_dtype", RUNS, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_under_autocast(device, autocast_dtype, input_dtype, case):
    composable = input_dtype in _input_dtypes(device, autocast_dtype)
    negatives, tensor_scale, options = CASES[case]
    leaves, scale = _inputs(device, input_dtype, negatives, tensor_scale)
    with torch.autocast(device, dtype=autocast_dtype):
        ours = _call(nf.mnr_loss, leaves, scale, options)
        theirs = _call(composed_mnr_loss, leaves, scale, options) if composable else None
    acc = torch.float64 if input_dtype == torch.float64 else torch.float32
    assert ours.dtype == acc, f"{ours.dtype} under {device} autocast"
    if theirs is not None:
        if device == "cuda" or input_dtype == torch.float64:
            assert theirs.dtype == ours.dtype
        else:
            # CPU autocast: the composition returns the autocast dtype.
            assert theirs.dtype == autocast_dtype
        # The composition's matmul rounds the cosines to the autocast dtype: its
        # logits are off by scale * a few units of it.
        eps = torch.finfo(autocast_dtype).eps if input_dtype != torch.float64 else 1e-12
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=4 * 20.0 * eps)
    # nanfree's own value is that of the inputs as given, autocast or not; half
    # embeddings are widened to float32 under autocast before their rows are
    # normalized, so they differ by the rounding of a half-precision unit vector.
    with torch.autocast(device, enabled=False):
        plain = _call(nf.mnr_loss, leaves, scale, options)
    tol = 0 if input_dtype in (torch.float32, torch.float64) else 1e-2
    torch.testing.assert_close(ours, plain, rtol=tol, atol=tol)
    # Gradients in the inputs' dtypes (the scale's in float32), finite, and
    # those of the float64 oracle to the inputs' rounding.
    all_leaves = leaves + ([scale] if tensor_scale else [])
    upstream = torch.linspace(0.5, 1.5, ours.numel(), device=device).reshape(ours.shape)
    grads = torch.autograd.grad(ours, all_leaves, upstream.to(ours.dtype))
    ref_leaves = [t.detach().cpu().double().requires_grad_(True) for t in all_leaves]
    ref_scale = ref_leaves.pop() if tensor_scale else 20.0
    ref = _call(composed_mnr_loss, ref_leaves, ref_scale, options)
    ref_grads = torch.autograd.grad(ref, ref_leaves + ([ref_scale] if tensor_scale else []),
                                    upstream.cpu().double())
    gtol = 1e-4 if input_dtype in (torch.float32, torch.float64) else 0.1
    for g, t, want in zip(grads, all_leaves, ref_grads):
        assert g.dtype == t.dtype and g.shape == t.shape and torch.isfinite(g).all()
        torch.testing.assert_close(g.cpu().double(), want, rtol=gtol, atol=gtol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_zero_and_duplicate_rows_under_autocast(device, autocast_dtype):
    # The special values keep their rules under autocast: a zero query and a
    # duplicated pair give a finite loss and finite gradients, 0 for the zero row.
    leaves, scale = _inputs(device, torch.float32, "hard", True, seed=1)
    with torch.no_grad():
        leaves[0][0] = 0
        leaves[0][3] = leaves[0][2]
        leaves[1][3] = leaves[1][2]
    with torch.autocast(device, dtype=autocast_dtype):
        loss = nf.mnr_loss(*leaves, scale=scale, directions=ALL, reduction="none")
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.sum().backward()
    assert (leaves[0].grad[0] == 0).all()
    for t in leaves + [scale]:
        assert torch.isfinite(t.grad).all()
