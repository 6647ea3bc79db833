"""Op-level argument checks of the softmax-family ops for the Python backends
(Triton, pure PyTorch): the same errors, with the same words, as the C++ checks
in csrc/common/softmax_op.h."""

import torch


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(ok, op, message):
    # Same messages (and RuntimeError) as the C++ op-level checks in softmax_op.h.
    if not ok:
        raise RuntimeError(f"nanfree.{op}: {message}")


def check_float(op, name, t):
    _check(t.dtype in _FLOATS, op,
           f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_mask(op, ref, mask):
    if mask is None:
        return
    _check(mask.dtype == torch.bool, op, "`mask` must be bool at the op level "
           f"(nanfree.ops converts integer masks), got {mask.dtype}")
    _check(mask.shape == ref.shape, op, f"`mask` must have the input's shape "
           f"{list(ref.shape)} (nanfree.ops broadcasts it), got {list(mask.shape)}")
    _check(mask.device == ref.device, op,
           f"`mask` is on {mask.device} but the input is on {ref.device}")


def check_backward(op, grad, saved, stats, mask, grad_shape):
    check_float(op, "grad_output", grad)
    check_float(op, "saved", saved)
    _check(grad.dtype == saved.dtype, op, f"`grad_output` dtype {grad.dtype} differs from "
           f"the saved tensor's {saved.dtype}")
    _check(grad.shape == grad_shape, op,
           f"`grad_output` has shape {list(grad.shape)}, expected {list(grad_shape)}")
    _check(stats.shape == (*saved.shape[:-1], 2) and stats.dtype == acc_dtype(saved.dtype),
           op, "`stats` must be the forward's saved row statistics")
    for name, t in (("grad_output", grad), ("stats", stats)):
        _check(t.device == saved.device, op,
               f"`{name}` is on {t.device} but the input is on {saved.device}")
    check_mask(op, saved, mask)
