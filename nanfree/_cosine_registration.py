"""Fake (meta) kernels of the cosine-family ops, registered once for every
backend. The schemas are in csrc/registration.cpp; the autograd and autocast,
also shared by every backend, are in csrc/cosine_autograd.cpp and
csrc/cosine_autocast.cpp. The fake kernels check their arguments as the real
ones do: they also serve the meta device."""

import torch

from ._cosine_checks import (COSINE_STATS, NORMALIZE_STATS, check_cos_sim_matrix, check_cosine,
                             check_cosine_backward, check_normalize, check_normalize_backward,
                             per_vector_shape, stats_dtype)

FORWARD_OPS = ("normalize", "cosine_similarity", "cos_sim_matrix")
BACKWARD_OPS = ("normalize_backward", "cosine_similarity_backward")
OPS = FORWARD_OPS + BACKWARD_OPS


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
    for name, fake in (("normalize", _fake_normalize),
                       ("normalize_backward", _fake_normalize_backward),
                       ("cosine_similarity", _fake_cosine),
                       ("cosine_similarity_backward", _fake_cosine_backward),
                       ("cos_sim_matrix", _fake_cos_sim_matrix)):
        torch.library.register_fake(f"nanfree::{name}", fake)
