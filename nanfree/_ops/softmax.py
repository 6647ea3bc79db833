"""The softmax family's Python side (softmax, log_softmax, logsumexp and their
backward ops): the op-level argument checks and shapes of the Python backends
(Triton, pure PyTorch), with the same errors, words and exception types as the
C++ checks in csrc/common/softmax_op.h, and the fake kernels, registered once
for every backend. The schemas are in csrc/registration.cpp; the autograd, also
shared by every backend, in csrc/softmax.cpp; the autocast in csrc/autocast.cpp."""

from .common import acc_dtype, broadcast_mask, check_device, check_float, fake_kernels
from .layout import wrap_reduced_dim as wrap_dim

FORWARD_OPS = ("softmax", "log_softmax", "logsumexp")
BACKWARD_OPS = ("softmax_backward", "log_softmax_backward", "logsumexp_backward")
OPS = FORWARD_OPS + BACKWARD_OPS


def row_shape(t, dim):
    """The input's shape without `dim` (logsumexp's output)."""
    return t.shape[:dim] + t.shape[dim + 1:] if t.dim() else t.shape


def stats_shape(t, dim):
    """The input's shape with `dim` of size 2 holding (max, log_sum); [2] for a 0-d input."""
    if t.dim() == 0:
        return (2,)
    return (*t.shape[:dim], 2, *t.shape[dim + 1:])


def check_forward(op, input, dim, mask):
    """-> (dim wrapped, mask as bool of the input's shape or None)."""
    check_float(op, "input", input)
    dim = wrap_dim(op, input, dim)
    return dim, broadcast_mask(op, input, mask)


def check_backward(op, grad, saved, stats, dim, mask, per_row_grad):
    """-> (dim wrapped, mask as bool of the saved tensor's shape or None)."""
    check_float(op, "grad_output", grad)
    check_float(op, "saved", saved)
    dim = wrap_dim(op, saved, dim)
    if grad.dtype != saved.dtype:
        raise TypeError(f"nanfree.{op}: `grad_output` dtype {grad.dtype} differs from the saved "
                        f"tensor's {saved.dtype}")
    expected = row_shape(saved, dim) if per_row_grad else saved.shape
    if grad.shape != expected:
        raise ValueError(f"nanfree.{op}: `grad_output` has shape {list(grad.shape)}, expected "
                         f"{list(expected)}")
    if stats.shape != stats_shape(saved, dim) or stats.dtype != acc_dtype(saved.dtype):
        raise ValueError(f"nanfree.{op}: `stats` must be the forward's saved row statistics")
    for name, t in (("grad_output", grad), ("stats", stats)):
        check_device(op, name, saved, t)
    return dim, broadcast_mask(op, saved, mask)


# --- fake kernels ---------------------------------------------------------------


def _fake_stats(input, dim):
    """(max, log_sum) along `dim`, saved for the backward."""
    return input.new_empty(stats_shape(input, dim), dtype=acc_dtype(input.dtype))


def _fake_distribution(op):
    def fake(input, dim, mask=None):
        dim, _ = check_forward(op, input, dim, mask)
        return input.new_empty(input.shape), _fake_stats(input, dim)

    return fake


def _fake_logsumexp(input, dim, mask=None):
    dim, _ = check_forward("logsumexp", input, dim, mask)
    return input.new_empty(row_shape(input, dim)), _fake_stats(input, dim)


def _fake_backward(op, per_row_grad):
    def fake(grad_output, saved, stats, dim, mask=None):
        check_backward(op, grad_output, saved, stats, dim, mask, per_row_grad)
        return saved.new_empty(saved.shape)

    return fake


def register():
    fake_kernels([(name, _fake_distribution(name)) for name in ("softmax", "log_softmax")] +
                 [("logsumexp", _fake_logsumexp)] +
                 [(name, _fake_backward(name, per_row_grad=name == "logsumexp_backward"))
                  for name in BACKWARD_OPS])
