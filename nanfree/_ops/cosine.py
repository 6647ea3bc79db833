"""The cosine family's Python side (normalize, cosine_similarity,
cos_sim_matrix and their backward ops): the op-level argument checks and shapes
of the Python backends (Triton, pure PyTorch) and the fake kernels, with the
same errors, words and exception types as csrc/common/cosine_op.h; the fake
kernels, registered once for every backend; and normalize for p != 2, which no
kernel serves. The schemas are in csrc/registration.cpp; the autograd, also
shared by every backend, in csrc/cosine.cpp; the autocast in csrc/autocast.cpp."""

import math

import torch

from .common import acc_dtype, check_device, check_eps, check_float, check_number, fake_kernels

FORWARD_OPS = ("normalize", "cosine_similarity", "cos_sim_matrix")
BACKWARD_OPS = ("normalize_backward", "cosine_similarity_backward")
OPS = FORWARD_OPS + BACKWARD_OPS

# cos_sim normalizes with F.normalize's default eps, as sentence-transformers does.
COS_SIM_EPS = 1e-12
INF = float("inf")

NORMALIZE_STATS = 2  # p, grad_factor
COSINE_STATS = 8  # p, q, divisor, grad_factor of x1, then of x2 (kCosineStats)


def check_has_vectors(op, name, t):
    if t.dim() < 1:
        raise ValueError(f"nanfree.{op}: `{name}` must have at least one dimension (the "
                         "vectors' last), got a 0-d tensor")


def vector_rows(t):
    """(rows, d): the last dim holds the vectors."""
    return math.prod(t.shape[:-1]), t.shape[-1]


def per_vector_shape(t, extra=0):
    return (*t.shape[:-1], extra) if extra else tuple(t.shape[:-1])


def stats_dtype(t):
    return acc_dtype(t.dtype)


def check_stats(op, ref, ref_name, stats, count):
    if tuple(stats.shape) != per_vector_shape(ref, count) or stats.dtype != acc_dtype(ref.dtype):
        raise ValueError(f"nanfree.{op}: `stats` must be the forward's saved statistics")
    check_device(op, "stats", ref, stats, ref_name)


def check_pair(op, name, ref, ref_name, t):
    check_float(op, name, t)
    if t.dtype != ref.dtype:
        raise TypeError(f"nanfree.{op}: `{name}` dtype {t.dtype} differs from `{ref_name}`'s "
                        f"{ref.dtype} (nanfree.ops promotes them)")
    if t.shape != ref.shape:
        raise ValueError(f"nanfree.{op}: `{name}` has shape {list(t.shape)} but `{ref_name}` has "
                         f"{list(ref.shape)} (nanfree.ops broadcasts them)")
    check_device(op, name, ref, t, ref_name)


def check_normalize(input, eps):
    check_float("normalize", "input", input)
    check_has_vectors("normalize", "input", input)
    check_eps("normalize", eps)


def check_normalize_backward(grad, output, stats):
    op = "normalize_backward"
    check_float(op, "output", output)
    check_has_vectors(op, "output", output)
    check_pair(op, "grad_output", output, "output", grad)
    check_stats(op, output, "output", stats, NORMALIZE_STATS)


def check_cosine(x1, x2, eps):
    op = "cosine_similarity"
    check_float(op, "x1", x1)
    check_has_vectors(op, "x1", x1)
    check_pair(op, "x2", x1, "x1", x2)
    check_eps(op, eps)


def check_cosine_backward(grad, x1, x2, output, stats):
    op = "cosine_similarity_backward"
    check_float(op, "x1", x1)
    check_has_vectors(op, "x1", x1)
    check_pair(op, "x2", x1, "x1", x2)
    check_float(op, "output", output)
    check_pair(op, "grad_output", output, "output", grad)
    if tuple(output.shape) != per_vector_shape(x1) or output.dtype != x1.dtype:
        raise ValueError(f"nanfree.{op}: `output` must be the forward's output")
    check_device(op, "output", x1, output, "x1")
    check_stats(op, x1, "x1", stats, COSINE_STATS)


def check_cos_sim_matrix(a, b):
    op = "cos_sim_matrix"
    check_float(op, "a", a)
    check_float(op, "b", b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"nanfree.{op}: `a` and `b` must be [N, d] and [M, d], got "
                         f"{list(a.shape)} and {list(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"nanfree.{op}: `b` dtype {b.dtype} differs from `a`'s {a.dtype}")
    check_device(op, "b", a, b, "a")


# --- fake kernels ---------------------------------------------------------------


def _fake_stats(t, count):
    return t.new_empty(per_vector_shape(t, count), dtype=stats_dtype(t))


def _fake_normalize(input, eps):
    check_normalize(input, eps)
    return input.new_empty(input.shape), _fake_stats(input, NORMALIZE_STATS)


def _fake_normalize_backward(grad_output, output, stats):
    check_normalize_backward(grad_output, output, stats)
    return output.new_empty(output.shape)


def _fake_cosine(x1, x2, eps):
    check_cosine(x1, x2, eps)
    return x1.new_empty(per_vector_shape(x1)), _fake_stats(x1, COSINE_STATS)


def _fake_cosine_backward(grad_output, x1, x2, output, stats):
    check_cosine_backward(grad_output, x1, x2, output, stats)
    return x1.new_empty(x1.shape), x2.new_empty(x2.shape)


def _fake_cos_sim_matrix(a, b):
    check_cos_sim_matrix(a, b)
    return a.new_empty((a.shape[0], b.shape[0]))


def register():
    fake_kernels([("normalize", _fake_normalize), ("normalize_backward", _fake_normalize_backward),
                  ("cosine_similarity", _fake_cosine),
                  ("cosine_similarity_backward", _fake_cosine_backward),
                  ("cos_sim_matrix", _fake_cos_sim_matrix)])


# --- normalize for p != 2 (a torch composition) ----------------------------------


def vector_norm_order(p):
    """F.normalize's `p` as a number: a number as given, 'fro' as 2 (the Frobenius
    norm of the reduced entries is their 2-norm), a 0-d tensor without grad as its
    value (as torch's norm takes it); 'nuc', a matrix norm, is refused."""
    if isinstance(p, str):
        if p == "fro":
            return 2.0
        raise ValueError(f"nanfree.normalize: `p` must be a positive number or 'fro' (a vector "
                         f"norm), got {p!r}")
    if isinstance(p, torch.Tensor) and p.dim() == 0 and not p.requires_grad:
        return p.item()  # torch's norm reads the number too (a host sync on a GPU)
    check_number("normalize", "p", p)
    return p


def normalize_dims(input, dims, eps):
    """normalize (p = 2) over several dims, the sorted `dims`: they are moved
    last and flattened into one (views when they are the trailing dims of a
    contiguous tensor, else one copy), normalized by the fused op, and put back."""
    kept = [d for d in range(input.dim()) if d not in dims]
    moved = input.permute(*kept, *dims)
    flat = moved.reshape(*moved.shape[:len(kept)], -1)
    result = torch.ops.nanfree.normalize(flat, eps)[0].reshape(moved.shape)
    order = kept + dims
    return result.permute(*sorted(range(input.dim()), key=order.__getitem__))


def normalize_p(input, p, dim, eps):
    """F.normalize for p != 2 (no fused kernel), in torch operations that autograd
    differentiates (`dim` an int or a list of ints): x / max(norm_p(x), eps) with
    the norm taken on x / max|x|, so no power overflows or underflows; the rules
    of p = 2 otherwise (a vector with +-inf entries is their limit direction;
    vectors below eps, zero and infinite ones pass no gradient; NaN stays in its
    vector)."""
    x = input.to(acc_dtype(input.dtype))
    amax = x.abs().amax(dim=dim, keepdim=True)
    # The norm branch sees finite vectors only: an infinite or NaN vector there
    # would put inf / inf = NaN into the backward, even through a where.
    finite = torch.isfinite(amax)
    xf = torch.where(finite, x, 0.0)
    amax_f = torch.where(finite, amax, 0.0)
    scale = torch.where(amax_f > 0, amax_f, 1.0)  # 1 for a zero vector: no 0 / 0
    if p == INF:
        norm = amax_f
    else:
        norm = scale * torch.linalg.vector_norm(xf / scale, p, dim=dim, keepdim=True)
    live = norm >= eps
    # Below eps: x / eps with no gradient; the live branch's denominator is
    # never 0 (0 * (1/0) would be NaN in the backward where it is not taken).
    y = torch.where(live, xf / torch.where(live, norm, 1.0), xf.detach() / eps)
    # An infinite vector: +-1 at its k infinite entries, scaled to unit p-norm, no gradient.
    limit = torch.where(torch.isinf(x), torch.sign(x), 0.0).detach()
    count = torch.isinf(x).sum(dim=dim, keepdim=True).clamp_min(1).to(x.dtype)
    limit = limit if p == INF else limit / count ** (1.0 / p)
    y = torch.where(torch.isinf(amax), limit, y)
    # A NaN entry makes its vector NaN (amax is NaN there).
    y = torch.where(torch.isnan(amax), amax, y)
    return y.to(_normalize_result_dtype(input))


def _normalize_result_dtype(input):
    """F.normalize's result dtype: under CUDA autocast its norm runs in float32
    (the fp32 list), so a float16 or bfloat16 input gives float32, as the fused
    p = 2 op's autocast kernel does; elsewhere the input's dtype."""
    if (input.device.type == "cuda" and input.dtype in (torch.float16, torch.bfloat16)
            and torch.is_autocast_enabled("cuda")):
        return torch.float32
    return input.dtype
