"""Element access and exact arithmetic shared by the Triton kernels of every op
family: loads and stores that treat bfloat16 exactly (through its bits),
saturated stores of gradients, and division rounded to nearest as C++'s `/`.
No special-value rule lives here."""

import triton
import triton.language as tl

from .numerics import largest_finite, saturate


@triton.jit
def ieee_div(a, b):
    """a / b rounded to nearest (C++ `/`): Triton's float32 `/` is approximate.
    b is a tensor; a may be a Python float."""
    if b.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def store_rounded(ptr, offs, x, mask):
    """Stores x (in the accumulation dtype) at ptr + offs in ptr's dtype, rounded
    to nearest even. bfloat16 is rounded and stored in its bits: Triton's
    interpreter (3.8) truncates float32 -> bfloat16 and gets subnormals wrong
    (outputs of vectors of 1e38 reach them); compiled, cvt.rn gives the same bits."""
    if ptr.dtype.element_ty == tl.bfloat16:
        xf = x.to(tl.float32)
        bits = xf.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        # A NaN stays NaN (the rounding carry could turn a NaN payload into inf).
        bits = tl.where(xf != xf, 0x7FC0, bits)
        tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offs, bits.to(tl.uint16), mask=mask)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_saturated(ptr, offs, x, mask):
    """store_rounded of a gradient saturated to the largest finite value of
    ptr's dtype (numerics' saturate: an inf would become NaN downstream)."""
    store_rounded(ptr, offs, saturate(x, largest_finite(ptr)), mask)


@triton.jit
def widen(ptr, offs, inside):
    """The entries at ptr + offs (0 outside `inside`), bfloat16 read exactly:
    from its bits, the upper half of a float32. Triton's interpreter (3.8)
    converts bfloat16 subnormals to float32 wrongly (5.1e-39 reads as 8.8e-39),
    and a vector of them must keep its direction; compiled, this is the same
    conversion."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=inside, other=0)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=inside, other=0.0)


@triton.jit
def load_acc(ptr, offs, inside, ACC: tl.constexpr):
    # 0 outside the problem: a 0 entry adds nothing to amax, ssq or a dot.
    return widen(ptr, offs, inside).to(ACC)
