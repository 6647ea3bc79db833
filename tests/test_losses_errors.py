"""Bad inputs of the losses family raise before any kernel runs, naming the op
and the argument, with the same words on every backend (csrc/common/losses_op.h
and nanfree/_ops/losses.py)."""

import pytest
import torch

import nanfree.ops as nf
from error_checks import raises_before_any_kernel

POINTWISE = ("binary_cross_entropy_with_logits", "binary_cross_entropy", "kl_div")


@pytest.mark.parametrize("op", POINTWISE + ("cross_entropy",))
def test_public_argument_errors(device, op):
    x = torch.rand(3, 4, device=device)
    fn = getattr(nf, op)
    with pytest.raises(TypeError, match=f"nanfree.{op}: `input` must be a torch.Tensor"):
        fn([1.0], x)
    with pytest.raises(TypeError, match=f"nanfree.{op}: complex `input`"):
        fn(x.to(torch.complex64), x)
    raises_before_any_kernel(ValueError, f"nanfree.{op}: `reduction` must be one of", fn, x, x,
                             reduction="average")


# float8 has no math kernels in torch either; the C++ entry points leave it to
# the Python checks, which name the loss.
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("op", POINTWISE + ("cross_entropy",))
def test_float8_is_refused(op, dtype):
    x, low = torch.rand(3, 4), torch.rand(3, 4).to(dtype)
    message = "must be float16, bfloat16, float32 or float64, got"
    fn = getattr(nf, op)
    raises_before_any_kernel(TypeError, f"nanfree.{op}: `input` {message}", fn, low, x)
    raises_before_any_kernel(TypeError, f"nanfree.{op}: `target` {message}", fn, x, low)


def test_ignore_index_with_probabilities_is_refused_as_torch(device):
    x = torch.randn(4, 3, device=device)
    p = torch.softmax(torch.randn(4, 3, device=device), 1)
    for index in (0, 2, 7):
        raises_before_any_kernel(ValueError, rf"nanfree.cross_entropy: `ignore_index` \({index}\) "
                                 r"is not supported for probability targets", nf.cross_entropy, x,
                                 p, ignore_index=index)
    # A negative one is never a class: accepted, as torch accepts it.
    torch.testing.assert_close(nf.cross_entropy(x, p, ignore_index=-1), nf.cross_entropy(x, p))


@pytest.mark.parametrize("op", ["binary_cross_entropy_with_logits", "binary_cross_entropy"])
def test_target_of_another_size(device, op):
    x = torch.rand(3, 4, device=device)
    raises_before_any_kernel(ValueError, "target size .* must be the same as input size",
                             getattr(nf, op), x, x[:, :2])


def test_weights_with_gradients_are_refused(device):
    x = torch.rand(3, 4, device=device)
    w = torch.rand(4, device=device, requires_grad=True)
    for call in (lambda: nf.binary_cross_entropy_with_logits(x, x, weight=w),
                 lambda: nf.binary_cross_entropy_with_logits(x, x, pos_weight=w),
                 lambda: nf.cross_entropy(x, torch.tensor([0, 1, 2], device=device), weight=w)):
        with pytest.raises(NotImplementedError, match="the gradient with respect to"):
            call()


def test_cross_entropy_argument_errors(device):
    x = torch.randn(3, 4, device=device)
    y = torch.tensor([0, 1, 2], device=device)
    op = "nanfree.cross_entropy"
    raises_before_any_kernel(ValueError, f"{op}: `label_smoothing` must be in", nf.cross_entropy,
                             x, y, label_smoothing=1.5)
    raises_before_any_kernel(ValueError, f"{op}: class-index `target` must have shape",
                             nf.cross_entropy, x, y[:2])
    raises_before_any_kernel(ValueError, f"{op}: a probability `target` must have the input's",
                             nf.cross_entropy, x, x[:, :2])
    raises_before_any_kernel(ValueError, f"{op}: `weight` must have one entry per class",
                             nf.cross_entropy, x, y, weight=torch.ones(3, device=device))
    raises_before_any_kernel(TypeError, f"{op}: `mask` must be bool or integer", nf.cross_entropy,
                             x, y, mask=torch.ones(4, device=device))
    raises_before_any_kernel(ValueError, f"{op}: `mask` of shape .* does not broadcast",
                             nf.cross_entropy, x, y, mask=torch.ones(3, dtype=torch.bool,
                                                                     device=device))
    raises_before_any_kernel(TypeError, f"{op}: `target` must be class indices",
                             nf.cross_entropy, x, y.bool())
    raises_before_any_kernel(ValueError, f"{op}: `input` must have at least one dimension",
                             nf.cross_entropy, x[0, 0], y[0])


def test_cross_entropy_target_out_of_range_on_cpu():
    """A class index outside [0, C) (other than ignore_index) is refused on CPU
    tensors, as torch's; on CUDA tensors it would cost a host sync, and the
    position is left out instead (docs/losses.md)."""
    x = torch.randn(3, 4)
    for bad in (4, -1):
        with pytest.raises(IndexError, match=f"nanfree.cross_entropy: target {bad} is out of bounds"):
            nf.cross_entropy(x, torch.tensor([0, bad, 1]))
    nf.cross_entropy(x, torch.tensor([0, -7, 1]), ignore_index=-7)


def test_focal_argument_errors(device):
    x = torch.randn(3, device=device)
    raises_before_any_kernel(ValueError, "nanfree.sigmoid_focal_loss: `gamma` must be >= 0",
                             nf.sigmoid_focal_loss, x, x, gamma=-1.0)
    raises_before_any_kernel(ValueError, "Invalid Value for arg 'reduction'",
                             nf.sigmoid_focal_loss, x, x, reduction="batchmean")
    raises_before_any_kernel(TypeError, "nanfree.sigmoid_focal_loss: `alpha` must be a number",
                             nf.sigmoid_focal_loss, x, x, alpha="0.25")


def test_op_level_checks(device):
    """The ops themselves check their arguments (the same words on every backend)."""
    ops = torch.ops.nanfree
    x = torch.rand(3, 4, device=device)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss: `kind` must be 0 to 4"):
        ops.pointwise_loss(x, x, None, None, 7, 0.0, 0.0)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss: `target` must have the input's"):
        ops.pointwise_loss(x, x[:2], None, None, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss: `weight` must be of the input's"):
        ops.pointwise_loss(x, x, torch.ones(5, device=device), None, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss: `gamma` must be >= 0"):
        ops.pointwise_loss(x, x, None, None, 4, 0.25, -1.0)
    with pytest.raises(TypeError, match="nanfree.pointwise_loss: `input` must be float16"):
        ops.pointwise_loss(x.long(), x.long(), None, None, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss_sum: `kind` must be 0 to 4"):
        ops.pointwise_loss_sum(x, x, None, None, 7, 0.0, 0.0)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss_sum: `target` must have the"):
        ops.pointwise_loss_sum(x, x[:2], None, None, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="nanfree.pointwise_loss_backward: `partial` must be 0"):
        ops.pointwise_loss_backward(x, x, x, None, None, 0, 0.0, 0.0, 2)
    x3 = x.reshape(3, 4, 1)
    y = torch.zeros(3, 1, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"nanfree.cross_entropy: `input` must be \[outer, C, inner\]"):
        ops.cross_entropy(x, y, None, None, -100, 0.0)
    with pytest.raises(ValueError, match="nanfree.cross_entropy: class-index `target` must be"):
        ops.cross_entropy(x3, y[:2], None, None, -100, 0.0)
    with pytest.raises(ValueError, match="nanfree.cross_entropy: `mask` must be bool"):
        ops.cross_entropy(x3, y, None, torch.ones(3, 4, 1, device=device), -100, 0.0)
    with pytest.raises(ValueError, match="nanfree.cross_entropy: `label_smoothing` must be in"):
        ops.cross_entropy(x3, y, None, None, -100, 2.0)
    loss, stats = ops.cross_entropy(x3, y, None, None, -100, 0.0)
    with pytest.raises(ValueError, match="nanfree.cross_entropy_backward: `stats` must be"):
        ops.cross_entropy_backward(loss, x3, y, None, None, -100, 0.0, stats[:, :, :3], False)
    with pytest.raises(ValueError, match="nanfree.cross_entropy_backward: `grad` must be"):
        ops.cross_entropy_backward(loss[:2], x3, y, None, None, -100, 0.0, stats, False)
    with pytest.raises(ValueError, match="`target_grad` needs a probability target"):
        ops.cross_entropy_backward(loss, x3, y, None, None, -100, 0.0, stats, True)
