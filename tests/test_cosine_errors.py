"""Bad input to the cosine family gets a clear error naming the op and the
argument, raised before any kernel runs: the public functions of nanfree.ops
and the registered torch.ops.nanfree ops."""

import re

import pytest
import torch
import torch.nn.functional as F
from error_checks import raises_before_any_kernel

import nanfree.ops as nf

NON_FLOAT = [torch.int64, torch.int32, torch.bool, torch.complex64, torch.float8_e4m3fn,
             torch.float8_e5m2]

# Other devices than the CPU a tensor can be on here: "meta" always (no data),
# "cuda" with a GPU.
OTHER_DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _call(op, first, second=None, **kwargs):
    """One call of a public op with its tensor arguments in order."""
    if op == "normalize":
        return nf.normalize(first, **kwargs)
    if op == "normalize p=3":
        return nf.normalize(first, 3.0, **kwargs)
    return getattr(nf, op)(first, second, **kwargs)


TENSOR_ARGS = {  # public op -> the names of its tensor arguments
    "cosine_similarity": ("x1", "x2"),
    "cos_sim": ("a", "b"),
    "normalize": ("input",),
    "normalize p=3": ("input",),
}


def _op_name(op):
    return op.split(" ")[0]


# --- dtypes -------------------------------------------------------------------------


@pytest.mark.parametrize("op,position", [(op, i) for op, names in TENSOR_ARGS.items()
                                         for i in range(len(names))])
@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
def test_non_float_input(op, position, dtype):
    tensors = [torch.randn(2, 3), torch.randn(2, 3)][:len(TENSOR_ARGS[op])]
    tensors[position] = tensors[position].to(dtype)
    name = TENSOR_ARGS[op][position]
    raises_before_any_kernel(TypeError,
                              rf"nanfree\.{_op_name(op)}: `{name}` must be float16, bfloat16, "
                              rf"float32 or float64, got", _call, op, *tensors)


@pytest.mark.parametrize("op", ["cosine_similarity", "cos_sim"])
def test_mixed_float_dtypes_are_promoted(op):
    # As torch: float16 with float64 computes in float64.
    x1, x2 = torch.randn(3, 4, dtype=torch.float16), torch.randn(3, 4, dtype=torch.float64)
    out = _call(op, x1, x2)
    assert out.dtype == torch.float64
    if op == "cosine_similarity":
        expected = F.cosine_similarity(x1.double(), x2)
    else:
        expected = F.normalize(x1.double()) @ F.normalize(x2).T
    torch.testing.assert_close(out, expected)


# --- shapes and dims ----------------------------------------------------------------


@pytest.mark.parametrize("shapes", [((2, 3), (4, 3)), ((3,), (4,)), ((2, 3, 4), (3, 3, 4))],
                         ids=str)
def test_cosine_similarity_shapes_that_do_not_broadcast(shapes):
    x1, x2 = torch.randn(shapes[0]), torch.randn(shapes[1])
    match = (rf"nanfree\.cosine_similarity: `x1` of shape {re.escape(str(list(shapes[0])))} and "
             rf"`x2` of shape {re.escape(str(list(shapes[1])))} do not broadcast")
    raises_before_any_kernel(ValueError, match, nf.cosine_similarity, x1, x2, -1)


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_cosine_similarity_dim_out_of_range(dim):
    # The range is the broadcast shape's ([2, 3] here), as torch's.
    with pytest.raises(IndexError, match=rf"nanfree\.cosine_similarity: `dim` {dim} is out of "
                                         "range for a tensor of 2 dimensions"):
        nf.cosine_similarity(torch.randn(3), torch.randn(2, 3), dim)
    # ... and dim 1 is inside it, though x1 alone has one dimension.
    torch.testing.assert_close(nf.cosine_similarity(torch.ones(3), torch.ones(2, 3), 1),
                               torch.ones(2))


@pytest.mark.parametrize("op", ["normalize", "normalize p=3"])
@pytest.mark.parametrize("dim", [2, -3, 5])
def test_normalize_dim_out_of_range(op, dim):
    raises_before_any_kernel(IndexError, rf"nanfree\.normalize: `dim` {dim} is out of range",
                              _call, op, torch.randn(2, 3), dim=dim)


@pytest.mark.parametrize("op", ["cosine_similarity", "normalize", "normalize p=3"])
def test_zero_dim_inputs_are_refused_clearly(op):
    # torch takes a 0-d tensor as one vector of one entry; nanfree refuses it
    # (DESIGN.md: 0-d inputs work or are refused clearly).
    scalar = torch.tensor(2.0)
    with pytest.raises(IndexError, match=rf"nanfree\.{_op_name(op)}: `dim` 0 is out of range "
                                         "for a tensor of 0 dimensions"):
        _call(op, scalar, scalar, dim=0)


@pytest.mark.parametrize("op", ["cosine_similarity", "normalize", "normalize p=3"])
@pytest.mark.parametrize("dim", [1.0, "1", None])
def test_dim_of_wrong_type(op, dim):
    with pytest.raises(TypeError, match=rf"nanfree\.{_op_name(op)}: `dim` must be an int"):
        _call(op, torch.randn(2, 3), torch.randn(2, 3), dim=dim)


@pytest.mark.parametrize("a_shape,b_shape,name,dims", [
    ((2, 3, 4), (2, 4), "a", 3), ((2, 4), (2, 3, 4), "b", 3), ((), (2, 4), "a", 0),
    ((2, 4), (), "b", 0)], ids=str)
def test_cos_sim_needs_1d_or_2d(a_shape, b_shape, name, dims):
    raises_before_any_kernel(ValueError, rf"nanfree\.cos_sim: `{name}` must be 1-D or 2-D, got "
                              rf"{dims} dimensions", nf.cos_sim, torch.randn(a_shape),
                              torch.randn(b_shape))


@pytest.mark.parametrize("a_shape,b_shape", [((2, 3), (2, 4)), ((3,), (2, 4)), ((2, 3), (4,))],
                         ids=str)
def test_cos_sim_vector_lengths_differ(a_shape, b_shape):
    raises_before_any_kernel(ValueError, rf"nanfree\.cos_sim: `a` has vectors of {a_shape[-1]} "
                              rf"entries but `b` of {b_shape[-1]}", nf.cos_sim,
                              torch.randn(a_shape), torch.randn(b_shape))


# --- devices ------------------------------------------------------------------------


@pytest.mark.parametrize("other", OTHER_DEVICES)
@pytest.mark.parametrize("op", ["cosine_similarity", "cos_sim"])
@pytest.mark.parametrize("position", [0, 1])
def test_mixed_devices(other, op, position):
    tensors = [torch.randn(2, 3), torch.randn(2, 3)]
    tensors[position] = tensors[position].to(other)
    first, second = TENSOR_ARGS[op]
    if position == 1:
        match = rf"nanfree\.{op}: `{second}` is on {other}\S* but `{first}` is on cpu"
    else:
        match = rf"nanfree\.{op}: `{second}` is on cpu but `{first}` is on {other}"
    raises_before_any_kernel(ValueError, match, _call, op, *tensors)


@pytest.mark.parametrize("op", ["cosine_similarity", "cos_sim", "normalize"])
def test_meta_tensors_give_shapes_and_dtypes(op):
    # Meta tensors have no data: the ops' fake kernels give the shapes.
    x1 = torch.empty(5, 1, 3, device="meta", dtype=torch.float16)
    x2 = torch.empty(4, 3, device="meta", dtype=torch.float32)
    if op == "cosine_similarity":
        out, shape, dtype = nf.cosine_similarity(x1, x2, -1), (5, 4), torch.float32
    elif op == "cos_sim":
        out, shape, dtype = nf.cos_sim(x1[0], x2), (1, 4), torch.float32
    else:
        out, shape, dtype = nf.normalize(x1, dim=0), (5, 1, 3), torch.float16
    assert out.device.type == "meta" and tuple(out.shape) == shape and out.dtype == dtype
    # The argument checks hold on meta tensors too.
    with pytest.raises(ValueError, match=r"nanfree\.cosine_similarity: `eps`"):
        nf.cosine_similarity(x1, x2, -1, 0.0)


# --- eps and p ----------------------------------------------------------------------


@pytest.mark.parametrize("op", ["cosine_similarity", "normalize", "normalize p=3"])
@pytest.mark.parametrize("eps", [0.0, -1e-8, 0, float("inf"), float("nan")])
def test_eps_not_positive_and_finite(op, eps):
    raises_before_any_kernel(ValueError, rf"nanfree\.{_op_name(op)}: `eps` must be positive and "
                              "finite", _call, op, torch.randn(2, 3), torch.randn(2, 3), eps=eps)


@pytest.mark.parametrize("op", ["cosine_similarity", "normalize", "normalize p=3"])
def test_eps_of_wrong_type(op):
    with pytest.raises(TypeError, match=rf"nanfree\.{_op_name(op)}: `eps` must be a number"):
        _call(op, torch.randn(2, 3), torch.randn(2, 3), eps="1e-8")


@pytest.mark.backend_independent  # checked in Python before anything else
@pytest.mark.parametrize("p", [0, 0.0, -1.0, -float("inf"), float("nan")])
def test_normalize_p_not_positive(p):
    raises_before_any_kernel(ValueError, r"nanfree\.normalize: `p` must be positive",
                              nf.normalize, torch.randn(2, 3), p)


@pytest.mark.backend_independent
@pytest.mark.parametrize("p", [None, True, torch.tensor([2.0]),
                               torch.tensor(2.0, requires_grad=True)])
def test_normalize_p_of_wrong_type(p):
    # As torch's norm: a 0-d tensor without grad is taken as its number, no other.
    with pytest.raises(TypeError, match=r"nanfree\.normalize: `p` must be a number"):
        nf.normalize(torch.randn(2, 3), p)


@pytest.mark.backend_independent
@pytest.mark.parametrize("p", ["nuc", "inf"])
def test_normalize_p_string_other_than_fro(p):
    # 'nuc' is a matrix norm; 'fro' (the 2-norm of the reduced entries) is taken.
    raises_before_any_kernel(ValueError, r"nanfree\.normalize: `p` must be a positive number or 'fro'",
                              nf.normalize, torch.randn(2, 3, 4), p, (1, 2))


@pytest.mark.backend_independent
@pytest.mark.parametrize("dim, error, words", [
    ((1, 1), ValueError, r"`dim` \(1, 1\) names a dimension twice"),
    ((1, -2), ValueError, r"`dim` \(1, -2\) names a dimension twice"),
    ((0, 3), IndexError, r"`dim` 3 is out of range"),
    ((1.0, 2), TypeError, r"`dim` must be an int or a non-empty sequence of ints"),
    ("12", TypeError, r"`dim` must be an int or a non-empty sequence of ints"),
])
def test_normalize_bad_dims(dim, error, words):
    raises_before_any_kernel(error, r"nanfree\.normalize: " + words,
                              nf.normalize, torch.randn(2, 3, 4), 2.0, dim)


# --- arguments that are not tensors -------------------------------------------------


@pytest.mark.backend_independent  # checked in Python (or by the C++ entry's signature)
@pytest.mark.parametrize("op,position", [(op, i) for op, names in TENSOR_ARGS.items()
                                         for i in range(len(names))])
@pytest.mark.parametrize("value", [[1.0, 2.0], 1.0, None], ids=["list", "float", "None"])
def test_non_tensor_arguments(op, position, value):
    args = [torch.randn(2, 3), torch.randn(2, 3)][:len(TENSOR_ARGS[op])]
    args[position] = value
    name = TENSOR_ARGS[op][position]
    with pytest.raises(TypeError, match=rf"nanfree\.{_op_name(op)}: `{name}` must be a "
                                        r"torch\.Tensor, got " + type(value).__name__):
        _call(op, *args)


# --- the registered ops, called directly --------------------------------------------

OPS = torch.ops.nanfree


def _forward_results():
    x = torch.randn(2, 3, 4)
    y = torch.randn(2, 3, 4)
    out, stats = OPS.normalize(x, 1e-12)
    cos, cos_stats = OPS.cosine_similarity(x, y, 1e-8)
    return x, y, out, stats, cos, cos_stats


@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
def test_op_level_dtypes(dtype):
    x, y, out, stats, cos, cos_stats = _forward_results()
    bad = x.to(dtype)
    float_message = r"must be float16, bfloat16, float32 or float64, got"
    cases = [
        (OPS.normalize, (bad, 1e-12), "normalize", "input"),
        (OPS.normalize_backward, (out, bad, stats), "normalize_backward", "output"),
        (OPS.normalize_backward, (bad, out, stats), "normalize_backward", "grad_output"),
        (OPS.cosine_similarity, (bad, y, 1e-8), "cosine_similarity", "x1"),
        (OPS.cosine_similarity, (x, bad, 1e-8), "cosine_similarity", "x2"),
        (OPS.cosine_similarity_backward, (cos, bad, y, cos, cos_stats),
         "cosine_similarity_backward", "x1"),
        (OPS.cosine_similarity_backward, (cos, x, bad, cos, cos_stats),
         "cosine_similarity_backward", "x2"),
        (OPS.cosine_similarity_backward, (cos.to(dtype), x, y, cos, cos_stats),
         "cosine_similarity_backward", "grad_output"),
        (OPS.cos_sim_matrix, (bad[0], out[0]), "cos_sim_matrix", "a"),
        (OPS.cos_sim_matrix, (out[0], bad[0]), "cos_sim_matrix", "b"),
    ]
    for op, args, name, arg in cases:
        raises_before_any_kernel(TypeError, rf"nanfree\.{name}: `{arg}` {float_message}", op,
                                  *args)


def test_op_level_mixed_float_dtypes():
    # The ops take one dtype (nanfree.ops promotes before calling them).
    x, y, out, stats, cos, cos_stats = _forward_results()
    cases = [
        (OPS.normalize_backward, (out.double(), out, stats),
         r"normalize_backward: `grad_output` dtype"),
        (OPS.cosine_similarity, (x, y.double(), 1e-8), r"cosine_similarity: `x2` dtype"),
        (OPS.cosine_similarity_backward, (cos, x, y.half(), cos, cos_stats),
         r"cosine_similarity_backward: `x2` dtype"),
        (OPS.cos_sim_matrix, (out[0], out[0].double()), r"cos_sim_matrix: `b` dtype"),
    ]
    for op, args, match in cases:
        raises_before_any_kernel(TypeError, r"nanfree\." + match + r" \S+ differs from", op,
                                  *args)


def test_op_level_shapes():
    x, y, out, stats, cos, cos_stats = _forward_results()
    cases = [
        (OPS.normalize, (torch.tensor(1.0), 1e-12),
         r"normalize: `input` must have at least one dimension"),
        (OPS.normalize_backward, (out[:1], out, stats),
         r"normalize_backward: `grad_output` has shape \[1, 3, 4\] but `output` has \[2, 3, 4\]"),
        (OPS.normalize_backward, (out, out, stats[..., :1]),
         r"normalize_backward: `stats` must be the forward's saved statistics"),
        (OPS.normalize_backward, (out, out, stats.double()),
         r"normalize_backward: `stats` must be the forward's saved statistics"),
        (OPS.cosine_similarity, (torch.tensor(1.0), torch.tensor(1.0), 1e-8),
         r"cosine_similarity: `x1` must have at least one dimension"),
        # The ops do not broadcast (nanfree.ops does, with views).
        (OPS.cosine_similarity, (x, y[:1], 1e-8),
         r"cosine_similarity: `x2` has shape \[1, 3, 4\] but `x1` has \[2, 3, 4\]"),
        (OPS.cosine_similarity_backward, (cos[:1], x, y, cos, cos_stats),
         r"cosine_similarity_backward: `grad_output` has shape \[1, 3\] but `output` has \[2, 3\]"),
        (OPS.cosine_similarity_backward, (cos[:1], x, y, cos[:1], cos_stats),
         r"cosine_similarity_backward: `output` must be the forward's output"),
        (OPS.cosine_similarity_backward, (cos, x, y[:, :1], cos, cos_stats),
         r"cosine_similarity_backward: `x2` has shape \[2, 1, 4\] but `x1` has \[2, 3, 4\]"),
        (OPS.cosine_similarity_backward, (cos, x, y, cos, stats),
         r"cosine_similarity_backward: `stats` must be the forward's saved statistics"),
        (OPS.cos_sim_matrix, (out[0, 0], out[0]),
         r"cos_sim_matrix: `a` and `b` must be \[N, d\] and \[M, d\], got \[4\] and \[3, 4\]"),
        (OPS.cos_sim_matrix, (out[0], out[0, :, :2]),
         r"cos_sim_matrix: `a` and `b` must be \[N, d\] and \[M, d\], got \[3, 4\] and \[3, 2\]"),
        (OPS.cos_sim_matrix, (out, out),
         r"cos_sim_matrix: `a` and `b` must be \[N, d\] and \[M, d\], got \[2, 3, 4\]"),
    ]
    for op, args, match in cases:
        raises_before_any_kernel(ValueError, r"nanfree\." + match, op, *args)


@pytest.mark.parametrize("eps", [0.0, -1.0, float("inf"), float("nan")])
def test_op_level_eps(eps):
    x, y, *_ = _forward_results()
    raises_before_any_kernel(ValueError, r"nanfree\.normalize: `eps` must be positive and finite",
                              OPS.normalize, x, eps)
    raises_before_any_kernel(ValueError,
                              r"nanfree\.cosine_similarity: `eps` must be positive and finite",
                              OPS.cosine_similarity, x, y, eps)


@pytest.mark.parametrize("other", OTHER_DEVICES)
def test_op_level_devices(other):
    x, y, out, stats, cos, cos_stats = _forward_results()
    cases = [
        (OPS.cosine_similarity, (x, y.to(other), 1e-8),
         rf"cosine_similarity: `x2` is on {other}\S* but `x1` is on cpu"),
        (OPS.normalize_backward, (out.to(other), out, stats),
         rf"normalize_backward: `grad_output` is on {other}\S* but `output` is on cpu"),
        (OPS.normalize_backward, (out, out, stats.to(other)),
         rf"normalize_backward: `stats` is on {other}\S* but `output` is on cpu"),
        (OPS.cosine_similarity_backward, (cos, x, y, cos, cos_stats.to(other)),
         rf"cosine_similarity_backward: `stats` is on {other}\S* but `x1` is on cpu"),
        (OPS.cosine_similarity_backward, (cos, x, y.to(other), cos, cos_stats),
         rf"cosine_similarity_backward: `x2` is on {other}\S* but `x1` is on cpu"),
        (OPS.cos_sim_matrix, (out[0], out[0].to(other)),
         rf"cos_sim_matrix: `b` is on {other}\S* but `a` is on cpu"),
    ]
    for op, args, match in cases:
        raises_before_any_kernel(ValueError, r"nanfree\." + match, op, *args)


@pytest.mark.backend_independent  # the dispatcher's own check of the schema
def test_op_level_non_tensor_arguments():
    # torch's dispatcher refuses these before any nanfree code runs, naming
    # the op and the argument (a RuntimeError, as for every torch.ops op).
    x = torch.randn(2, 3)
    cases = [
        (OPS.normalize, ([1.0, 2.0], 1e-12), "normalize", "input"),
        (OPS.normalize, (x, "1e-12"), "normalize", "eps"),
        (OPS.cosine_similarity, (x, 1.0, 1e-8), "cosine_similarity", "x2"),
        (OPS.cos_sim_matrix, (x, 1.0), "cos_sim_matrix", "b"),
    ]
    for op, args, name, arg in cases:
        with pytest.raises(RuntimeError, match=rf"nanfree::{name}\(\) Expected a value of type "
                                               rf"'\w+' for argument '{arg}'"):
            op(*args)
