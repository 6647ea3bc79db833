"""The losses family's Python side (pointwise_loss: binary_cross_entropy_with_logits,
binary_cross_entropy, kl_div, sigmoid_focal_loss; pointwise_loss_sum, their
'mean' and 'sum' reductions; cross_entropy; and their backward ops): the
op-level argument checks of the Python backends and fake kernels (the same
errors, words and exception types as csrc/common/losses_op.h), the fakes, and
the calls of nanfree.ops (type promotion, layout, autocast, reduction). The
autograd is C++ (csrc/losses.cpp), as every family's."""

import torch

from .common import (KERNEL_FLOATS, acc_dtype, autocast_on, broadcast_mask, broadcasts_to,
                     check_device, check_float, fake_kernels, readable_on_host)

# PointwiseLoss of losses_math.h.
BCE_WITH_LOGITS, BCE, KL_DIV, KL_DIV_LOG_TARGET, SIGMOID_FOCAL = range(5)
POINTWISE_NAMES = ("binary_cross_entropy_with_logits", "binary_cross_entropy", "kl_div", "kl_div",
                   "sigmoid_focal_loss")
CROSS_ENTROPY_STATS = 5  # kCrossEntropyStats

OPS = ("pointwise_loss", "pointwise_loss_sum", "pointwise_loss_backward", "cross_entropy",
       "cross_entropy_backward")


def _check_kind(op, kind):
    if kind not in range(5):
        raise ValueError(f"nanfree.{op}: `kind` must be 0 to 4 (PointwiseLoss), got {kind}")


def _check_same(op, name, ref, t):
    if t.shape != ref.shape or t.dtype != ref.dtype:
        raise ValueError(f"nanfree.{op}: `{name}` must have the input's shape {list(ref.shape)} "
                         f"and dtype {ref.dtype}, got {list(t.shape)} {t.dtype}")
    check_device(op, name, ref, t)


def _check_broadcast_operand(op, name, ref, t):
    if t is None:
        return
    if t.dtype != ref.dtype or not broadcasts_to(t.shape, ref.shape):
        raise ValueError(f"nanfree.{op}: `{name}` must be of the input's dtype {ref.dtype} and "
                         f"broadcast to its shape {list(ref.shape)}, got {list(t.shape)} {t.dtype}")
    check_device(op, name, ref, t)


def check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma,
                         op="pointwise_loss"):
    check_float(op, "input", input)
    _check_kind(op, kind)
    _check_same(op, "target", input, target)
    _check_broadcast_operand(op, "weight", input, weight)
    _check_broadcast_operand(op, "pos_weight", input, pos_weight)
    if kind == SIGMOID_FOCAL and not gamma >= 0:
        raise ValueError(f"nanfree.{op}: `gamma` must be >= 0, got {gamma}")


def check_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha, gamma,
                                  partial):
    check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma)
    op = "pointwise_loss_backward"
    if partial not in (0, 1):
        raise ValueError(f"nanfree.{op}: `partial` must be 0 (input) or 1 (target), got {partial}")
    _check_broadcast_operand(op, "grad", input, grad)


def check_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing):
    op = "cross_entropy"
    check_float(op, "input", input)
    if input.dim() != 3:
        raise ValueError(f"nanfree.{op}: `input` must be [outer, C, inner], got {list(input.shape)}")
    outer, classes, inner = input.shape
    if target.dtype == torch.int64:
        if tuple(target.shape) != (outer, inner):
            raise ValueError(f"nanfree.{op}: class-index `target` must be [outer, inner] = "
                             f"{[outer, inner]}, got {list(target.shape)}")
    elif target.dtype != input.dtype or target.shape != input.shape:
        raise ValueError(f"nanfree.{op}: `target` must be int64 [outer, inner] (class indices) or "
                         f"of the input's shape {list(input.shape)} and dtype {input.dtype} "
                         f"(probabilities), got {list(target.shape)} {target.dtype}")
    check_device(op, "target", input, target)
    if weight is not None:
        if weight.dtype != input.dtype or tuple(weight.shape) != (classes,):
            raise ValueError(f"nanfree.{op}: `weight` must be [C] = [{classes}] of the input's "
                             f"dtype {input.dtype}, got {list(weight.shape)} {weight.dtype}")
        check_device(op, "weight", input, weight)
    if mask is not None:
        if mask.dtype != torch.bool or mask.shape != input.shape:
            raise ValueError(f"nanfree.{op}: `mask` must be bool of the input's shape "
                             f"{list(input.shape)}, got {list(mask.shape)} {mask.dtype}")
        check_device(op, "mask", input, mask)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"nanfree.{op}: `label_smoothing` must be in [0, 1], got {label_smoothing}")


def check_cross_entropy_backward(grad, input, target, weight, mask, ignore_index, label_smoothing,
                                 stats, target_grad):
    check_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing)
    op = "cross_entropy_backward"
    outer, _, inner = input.shape
    acc = acc_dtype(input.dtype)
    if grad.dtype != acc or tuple(grad.shape) != (outer, inner):
        raise ValueError(f"nanfree.{op}: `grad` must be [outer, inner] = {[outer, inner]} of "
                         f"{acc}, got {list(grad.shape)} {grad.dtype}")
    if stats.dtype != acc or tuple(stats.shape) != (outer, inner, CROSS_ENTROPY_STATS):
        raise ValueError(f"nanfree.{op}: `stats` must be [outer, inner, {CROSS_ENTROPY_STATS}] of "
                         f"{acc} (cross_entropy's), got {list(stats.shape)} {stats.dtype}")
    check_device(op, "grad", input, grad)
    check_device(op, "stats", input, stats)
    if target_grad and target.dtype == torch.int64:
        raise ValueError(f"nanfree.{op}: `target_grad` needs a probability target")


# --- fakes ---------------------------------------------------------------------------


def _fake_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma):
    check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma)
    return torch.empty_like(input)  # the input's layout, as every backend's


def _fake_pointwise_loss_sum(input, target, weight, pos_weight, kind, alpha, gamma):
    check_pointwise_loss(input, target, weight, pos_weight, kind, alpha, gamma,
                         "pointwise_loss_sum")
    return input.new_empty((), dtype=acc_dtype(input.dtype))


def _fake_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha, gamma,
                                  partial):
    check_pointwise_loss_backward(grad, input, target, weight, pos_weight, kind, alpha, gamma,
                                  partial)
    return torch.empty_like(input)


def _fake_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing):
    check_cross_entropy(input, target, weight, mask, ignore_index, label_smoothing)
    outer, _, inner = input.shape
    acc = acc_dtype(input.dtype)
    return (input.new_empty((outer, inner), dtype=acc),
            input.new_empty((outer, inner, CROSS_ENTROPY_STATS), dtype=acc))


def _fake_cross_entropy_backward(grad, input, target, weight, mask, ignore_index, label_smoothing,
                                 stats, target_grad):
    check_cross_entropy_backward(grad, input, target, weight, mask, ignore_index, label_smoothing,
                                 stats, target_grad)
    grad_target = target.new_empty(target.shape) if target_grad else input.new_empty(0)
    return input.new_empty(input.shape), grad_target


def register():
    fake_kernels([("pointwise_loss", _fake_pointwise_loss),
                  ("pointwise_loss_sum", _fake_pointwise_loss_sum),
                  ("pointwise_loss_backward", _fake_pointwise_loss_backward),
                  ("cross_entropy", _fake_cross_entropy),
                  ("cross_entropy_backward", _fake_cross_entropy_backward)])


# --- the calls of nanfree.ops ----------------------------------------------------------
#
# Each public loss turns torch's call into the op's call: type promotion,
# broadcasting, the layout, autocast and the reduction happen here.

REDUCTIONS = ("none", "mean", "sum")


def reduction_of(op, size_average, reduce, reduction, extra=()):
    """torch's reduction string, the legacy size_average / reduce included."""
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in REDUCTIONS + tuple(extra):
        raise ValueError(f"nanfree.{op}: `reduction` must be one of "
                         f"{', '.join(REDUCTIONS + tuple(extra))}, got {reduction!r}")
    return reduction


def autocast_to_float32(op, device_type, *tensors):
    """Under autocast on the inputs' device, torch computes every loss of this
    family in float32 (binary_cross_entropy_with_logits, kl_div, nll_loss and
    log_softmax are on autocast's float32 lists; sigmoid_focal_loss's product
    with the float32 cross entropy is float32) and refuses binary_cross_entropy
    on CUDA; nanfree does the same. As autocast's float32 policy, float64
    tensors are left as they are (the loss then computes in float64)."""
    if not autocast_on(device_type):
        return tensors
    if op == "binary_cross_entropy" and device_type == "cuda":
        raise RuntimeError(
            "nanfree.binary_cross_entropy: torch.nn.functional.binary_cross_entropy and "
            "torch.nn.BCELoss are unsafe to autocast (as torch's): use "
            "nanfree.ops.binary_cross_entropy_with_logits on logits instead")
    return tuple(t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t
                 for t in tensors)


def _floating(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_complex:
        raise TypeError(f"nanfree.{op}: complex `{name}` is not supported (got {t.dtype})")
    if t.dtype.is_floating_point and t.dtype not in KERNEL_FLOATS:  # float8, float4
        raise TypeError(f"nanfree.{op}: `{name}` must be float16, bfloat16, float32 or float64, "
                        f"got {t.dtype}")


def pointwise_call(op, kind, input, target, weight=None, pos_weight=None, alpha=0.0, gamma=0.0,
                   same_shape=True, reduction="none"):
    """The loss of a pointwise kind, reduced as `reduction` says ('batchmean':
    the sum over the input's first size, as kl_div's): torch's type promotion
    over input, target, weight and pos_weight; target broadcast with the input
    (or of its shape where torch requires it); weight and pos_weight broadcast
    to it. 'mean', 'sum' and 'batchmean' go through pointwise_loss_sum, which
    never forms the unreduced loss."""
    for name, t in (("input", input), ("target", target)):
        _floating(op, name, t)
    batch = input.shape[0] if input.dim() else 1
    for name, t in (("weight", weight), ("pos_weight", pos_weight)):
        if t is not None:
            _floating(op, name, t)
            if t.requires_grad and torch.is_grad_enabled():
                raise NotImplementedError(
                    f"nanfree.{op}: the gradient with respect to `{name}` is not implemented; "
                    f"detach it")
    if same_shape and target.shape != input.shape:
        raise ValueError(f"nanfree.{op}: target size ({tuple(target.shape)}) must be the same as "
                         f"input size ({tuple(input.shape)})")
    input, target, weight, pos_weight = autocast_to_float32(op, input.device.type, input, target,
                                                            weight, pos_weight)
    dtype = input.dtype
    for t in (target, weight, pos_weight):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    input, target = torch.broadcast_tensors(input.to(dtype), target.to(dtype))
    for name, t in (("weight", weight), ("pos_weight", pos_weight)):
        if t is not None:
            check_device(op, name, input, t)
            if not broadcasts_to(t.shape, input.shape):
                raise ValueError(f"nanfree.{op}: `{name}` of shape {list(t.shape)} does not "
                                 f"broadcast to the input's shape {list(input.shape)}")
    check_device(op, "target", input, target)
    weight = None if weight is None else weight.to(dtype)
    pos_weight = None if pos_weight is None else pos_weight.to(dtype)
    args = (input, target, weight, pos_weight, kind, float(alpha), float(gamma))
    if reduction == "none":
        return torch.ops.nanfree.pointwise_loss(*args)
    total = torch.ops.nanfree.pointwise_loss_sum(*args)
    count = {"sum": 1, "mean": input.numel(), "batchmean": batch}[reduction]
    # A mean over nothing is 0 (as cross_entropy's), not 0 / 0.
    if count > 1:
        total = total / count
    return total.to(dtype)


def _class_dim_layout(op, input, target):
    """(input as [outer, C, inner], the target in its op layout, the loss's
    shape, probabilities?) for torch's [C], [N, C] and [N, C, d1, ...] layouts."""
    probabilities = target.is_floating_point()
    if input.dim() == 0:
        raise ValueError(f"nanfree.{op}: `input` must have at least one dimension (the classes)")
    unbatched = input.dim() == 1
    view = input.unsqueeze(0) if unbatched else input
    outer, classes = view.shape[0], view.shape[1]
    spatial = tuple(view.shape[2:])
    inner = 1
    for size in spatial:
        inner *= size
    loss_shape = () if unbatched else (outer, *spatial)
    if probabilities:
        if target.shape != input.shape:
            raise ValueError(f"nanfree.{op}: a probability `target` must have the input's shape "
                             f"{list(input.shape)}, got {list(target.shape)}")
        op_target = target.reshape(outer, classes, inner).contiguous()
    else:
        if target.dtype == torch.bool or target.dtype.is_complex:
            raise TypeError(f"nanfree.{op}: `target` must be class indices (an integer tensor) or "
                            f"probabilities (floating), got {target.dtype}")
        expected = tuple(loss_shape)
        if tuple(target.shape) != expected:
            raise ValueError(f"nanfree.{op}: class-index `target` must have shape "
                             f"{list(expected)} for an input of shape {list(input.shape)}, got "
                             f"{list(target.shape)}")
        op_target = target.reshape(outer, inner).to(torch.int64).contiguous()
    return view.reshape(outer, classes, inner).contiguous(), op_target, loss_shape, probabilities


def _check_targets_in_range(op, target, classes, ignore_index):
    """Class indices of a CPU tensor in [0, C) (or ignore_index), else IndexError
    as torch's. On other devices this would cost a host sync: there an
    out-of-range target leaves its position out (docs/losses.md)."""
    if target.numel() == 0 or not readable_on_host(target):
        return
    low, high = torch.aminmax(target)
    if int(low) >= 0 and int(high) < classes:
        return  # every index a class: one pass over the targets, no mask
    bad = (target != ignore_index) & ((target < 0) | (target >= classes))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(f"nanfree.{op}: target {value} is out of bounds for {classes} classes")


def cross_entropy_call(input, target, weight, ignore_index, reduction, label_smoothing, mask):
    op = "cross_entropy"
    _floating(op, "input", input)
    _floating(op, "target", target)
    if not input.is_floating_point():
        raise TypeError(f"nanfree.{op}: `input` must be floating, got {input.dtype}")
    if weight is not None:
        _floating(op, "weight", weight)
        if weight.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(f"nanfree.{op}: the gradient with respect to `weight` is not "
                                      f"implemented (torch's is not either); detach it")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"nanfree.{op}: `label_smoothing` must be in [0, 1], got {label_smoothing}")
    input, target, weight = autocast_to_float32(op, input.device.type, input, target, weight)
    keep = broadcast_mask(op, input, mask)
    view, op_target, loss_shape, probabilities = _class_dim_layout(op, input, target)
    classes = view.shape[1]
    if weight is not None:
        if tuple(weight.shape) != (classes,):
            raise ValueError(f"nanfree.{op}: `weight` must have one entry per class ({classes}), "
                             f"got shape {list(weight.shape)}")
        check_device(op, "weight", input, weight)
    if probabilities:
        if ignore_index >= 0:  # as torch's, which refuses it (a negative one is never a class)
            raise ValueError(f"nanfree.{op}: `ignore_index` ({ignore_index}) is not supported for "
                             f"probability targets")
        # torch's type promotion of the logits and the probabilities.
        view = view.to(torch.promote_types(view.dtype, op_target.dtype))
        op_target = op_target.to(view.dtype)
    else:
        _check_targets_in_range(op, op_target, classes, ignore_index)
    if weight is not None:
        weight = weight.to(view.dtype)
    dtype = view.dtype  # the input's, or its promotion with the probabilities'
    if keep is not None:
        keep = (keep.unsqueeze(0) if input.dim() == 1 else keep).reshape(view.shape)
    loss, stats = torch.ops.nanfree.cross_entropy(view, op_target, weight, keep, int(ignore_index),
                                                  float(label_smoothing))
    if reduction == "none":
        return loss.reshape(loss_shape).to(dtype)
    total = loss.sum()
    if reduction == "sum":
        return total.to(dtype)
    # No position counted (all ignored or masked): the mean of nothing is 0, not 0 / 0.
    if readable_on_host(stats):
        # A CPU value is read without waiting: a division by the number (the
        # denominator has no gradient), summed in float64 as csrc/losses.cpp's.
        count = float(stats.select(-1, 4).sum(dtype=torch.float64))
        return (total / count if count > 0 else total).to(dtype)
    denominator = stats.select(-1, 4).sum()
    return (total / torch.where(denominator > 0, denominator, 1.0)).to(dtype)
