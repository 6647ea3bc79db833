"""Op-level argument checks and shapes of the cosine-family ops (normalize,
cosine_similarity, cos_sim_matrix) for the Python backends (Triton, pure
PyTorch) and the fake kernels: the same errors, with the same words and
exception types, as csrc/common/cosine_op.h."""

import math

from ._checks import acc_dtype, check_device, check_eps, check_float

NORMALIZE_STATS = 2  # p, grad_factor
COSINE_STATS = 6  # p1, q1, grad_factor1, p2, q2, grad_factor2


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
