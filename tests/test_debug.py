"""nanfree.debug.detect_anomaly: the first op that produces NaN or inf, forward or
backward, with its module path, user line, tensors and counts."""

import inspect

import pytest
import torch
from conftest import DEVICES

import nanfree.ops as nf
from nanfree.debug import NonFiniteError, detect_anomaly

# Only torch's own kernels run in these tests (the checks are Python around
# every op), except where marked: the same in every backend's pass.
independent = pytest.mark.backend_independent
# Every test with each of the region's per-op checks (conftest.py: debug_checker).
pytestmark = pytest.mark.usefixtures("debug_checker")


def _line_of(fn, text):
    """'file:line' of the line of fn's source holding `text`."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + offset}"


class Attention(torch.nn.Module):
    def forward(self, x):
        return torch.log(x - 2.0)  # NaN for x < 2


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), Attention()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x):
        return self.encoder(x).sum()


@independent
@pytest.mark.parametrize("device", DEVICES)
def test_forward_nan_names_op_module_and_line(device):
    net = Net().to(device)
    x = torch.randn(3, 4, device=device)
    with pytest.raises(NonFiniteError) as info, detect_anomaly(model=net):
        net(x)
    e = info.value
    assert e.op == "aten.log" and e.phase == "forward" and e.node is None
    assert e.module == "encoder.layers.1"
    assert e.location == _line_of(Attention.forward, "torch.log")
    assert not e.inherited
    (out,) = e.tensors
    assert out["role"] == "output" and out["shape"] == [3, 4] and out["dtype"] == "float32"
    want = torch.log(net.encoder.layers[0](x) - 2.0)
    assert out["nan"] == int(torch.isnan(want).sum()) > 0
    message = str(e)
    assert "aten.log produced NaN in the forward" in message
    assert "encoder.layers.1" in message and "torch.log(x - 2.0)" in message


@independent
def test_module_path_without_model_starts_at_the_outermost_class():
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        Net()(torch.randn(3, 4))
    assert info.value.module == "Net.encoder.layers.1"


@independent
def test_module_paths_kept_across_regions_find_a_module_added_later():
    # The model's paths are walked once and kept across regions; a submodule put
    # in later is named by its parent's search when it runs, in the forward and
    # (through the stamps) in the backward.
    net = Net()
    x = torch.randn(3, 4)
    with detect_anomaly(model=net):
        net.encoder.layers[0](x)  # finite: the model's paths are now kept
    net.encoder.layers.append(torch.nn.Identity())
    net.encoder.layers[1] = Attention()  # a new module object at the old place
    with pytest.raises(NonFiniteError) as info, detect_anomaly(model=net):
        net(x)
    assert info.value.module == "encoder.layers.1" and info.value.phase == "forward"

    class Sqrt(torch.nn.Module):
        def forward(self, x):
            return torch.sqrt(x.abs() * 0)  # value 0, gradient inf at 0

    net.encoder.layers[1] = Sqrt()
    with pytest.raises(NonFiniteError) as info, detect_anomaly(model=net):
        net(x).backward()
    assert info.value.phase == "backward" and info.value.module == "encoder.layers.1"


@independent
@pytest.mark.parametrize("device", DEVICES)
def test_backward_inf_names_the_node_and_its_forward_line(device):
    x = torch.tensor([0.0, 1.0], device=device, requires_grad=True)

    def step():
        y = torch.sqrt(x)  # the forward line of the failing backward
        y.sum().backward()

    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        step()
    e = info.value
    assert e.phase == "backward" and e.node.name() == "SqrtBackward0"
    assert e.forward_op == "torch.sqrt"
    assert e.location == _line_of(step, "torch.sqrt(x)")
    assert e.tensors[0]["posinf"] == 1 and e.tensors[0]["finite_max"] == 0.5
    assert "autograd node: SqrtBackward0, made by the forward call torch.sqrt" in str(e)


@independent
def test_backward_check_of_tensors_the_cpu_scan_does_not_read(monkeypatch):
    # The TorchDispatchMode checks CUDA tensors (which nanfree._C's scan does not
    # read) by their sums. Its hook at the end of a backward node runs with the
    # mode active: its own sums must not be reported as the region's ops (the
    # first H200 run of this test on CUDA blamed aten.sum, an output with no
    # finite value). Forced here on CPU tensors by leaving the scan out.
    import nanfree.debug

    monkeypatch.setattr(nanfree.debug, "_OBSERVER", None)
    monkeypatch.setattr(nanfree.debug, "_any_nonfinite", None)
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        torch.sqrt(x).sum().backward()
    e = info.value
    assert e.op == "aten.div.Tensor" and e.node.name() == "SqrtBackward0"
    assert e.tensors[0]["posinf"] == 1 and e.tensors[0]["finite_max"] == 0.5
    assert not e.inherited


@independent
def test_inf_is_caught_unless_check_inf_is_false():
    x = torch.tensor([1.0, 0.0])
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        1.0 / x
    assert info.value.op == "aten.reciprocal" or info.value.op.startswith("aten.div")
    assert info.value.tensors[0]["posinf"] == 1
    with detect_anomaly(check_inf=False):
        y = 1.0 / x  # inf only: not checked
        with pytest.raises(NonFiniteError):
            y - y  # inf - inf = NaN


@independent
def test_dirty_data_blames_the_first_op_and_says_it_was_inherited():
    # m / m.max() with an all-zero mask: 0/0 is made here, by the division.
    mask = torch.zeros(4)
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        mask / mask.max()
    assert info.value.op == "aten.div.Tensor" and not info.value.inherited
    # A NaN already in the data: the first op that reads it, marked inherited.
    data = torch.tensor([1.0, float("nan")])
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        data * 2
    assert info.value.inherited and info.value.op == "aten.mul.Tensor"
    assert [t["role"] for t in info.value.tensors] == ["output", "input"]
    assert "already held a non-finite value" in str(info.value)


class Masked(torch.nn.Module):
    def forward(self, scores, keep, poison=False):
        out = scores.masked_fill(~keep, float("-inf"))
        return out * float("nan") if poison else out


@independent
def test_allow_takes_ops_and_module_paths_for_minus_inf_only():
    scores, keep = torch.randn(2, 3), torch.tensor([[True, False, True]] * 2)
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        Masked()(scores, keep)
    assert info.value.op == "aten.masked_fill.Scalar" and info.value.tensors[0]["neginf"] == 2
    with detect_anomaly(allow="masked_fill"):
        Masked()(scores, keep)
    with detect_anomaly(allow=["aten.masked_fill.Scalar"]):
        Masked()(scores, keep)
    net = torch.nn.Sequential(Masked())
    with detect_anomaly(allow=["0"], model=net):
        net[0](scores, keep)
    # NaN from an allowed module still raises.
    with pytest.raises(NonFiniteError), detect_anomaly(allow=["0"], model=net):
        net[0](scores, keep, poison=True)
    with pytest.raises(TypeError, match="allow"):
        detect_anomaly(allow=[torch.log])


@independent
def test_decorator_and_clean_exit():
    @detect_anomaly()
    def bad(x):
        return torch.log(x)

    with pytest.raises(NonFiniteError):
        bad(torch.tensor([-1.0]))
    # Nothing is left installed after the region (also after an error).
    assert torch.log(torch.tensor([-1.0])).isnan().all()
    with detect_anomaly():
        torch.randn(5).exp().sum()  # finite: nothing raised


@independent
def test_compiled_code_runs_eagerly_inside_the_region():
    @torch.compile(fullgraph=True)
    def f(x):
        return torch.log(x) * 2

    f(torch.tensor([2.0]))  # compiled outside the region
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        f(torch.tensor([-1.0]))
    assert info.value.op == "aten.log"


@pytest.mark.parametrize("device", DEVICES)
def test_nanfree_ops_are_checked_and_pass(device):
    # The backend's own kernels: a clean step through nanfree ops passes; a NaN
    # given to one is reported at the nanfree op, as inherited.
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with detect_anomaly():
        (nf.log_softmax(x, -1).sum() + nf.softmax(x, -1).sum()).backward()
    bad = x.detach().clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        nf.softmax(bad, -1)
    assert info.value.op.startswith("nanfree.softmax") and info.value.inherited


def _calls_of_ops_with_entry_points(bad):
    """A call of each nanfree op that has a C++ entry point (nanfree._C), whose
    input holds a NaN; one line each."""
    probabilities = torch.rand_like(bad)
    classes = torch.zeros(bad.shape[0], dtype=torch.int64, device=bad.device)
    return [
        lambda: nf.softmax(bad, -1),
        lambda: nf.log_softmax(bad, -1),
        lambda: nf.logsumexp(bad, -1),
        lambda: nf.cosine_similarity(bad, probabilities),
        lambda: nf.normalize(bad),
        lambda: nf.cos_sim(bad, probabilities),
        lambda: nf.sqrt(bad),
        lambda: nf.div_no_nan(bad, probabilities),
        lambda: nf.pow(bad, 2.0),
        lambda: nf.cross_entropy(bad, classes),
        lambda: nf.cross_entropy(bad, classes, reduction="none"),
        lambda: nf.binary_cross_entropy_with_logits(bad, probabilities),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_a_nanfree_op_is_reported_at_the_line_of_its_call(device):
    """The region names the user's line of a call by the torch calls it sees:
    inside it nanfree.ops takes the torch.ops steps, not the C++ entry points,
    which no TorchFunctionMode sees (the report would come at the region's
    end, naming its `with` line)."""
    bad = torch.randn(3, 4, device=device)
    bad[0, 0] = float("nan")
    for call in _calls_of_ops_with_entry_points(bad):
        with pytest.raises(NonFiniteError) as info, detect_anomaly():
            call()
        assert info.value.inherited  # at the op or at a step before it (broadcast_tensors)
        line = f"{inspect.getsourcefile(call)}:{call.__code__.co_firstlineno}"
        assert info.value.location == line, inspect.getsource(call)


@independent
def test_in_place_and_foreach_writes_are_checked_and_not_inherited():
    x = torch.tensor([-1.0, 2.0])
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        x.log_()
    assert info.value.op == "aten.log_" and not info.value.inherited
    ts = [torch.tensor([1.0]), torch.tensor([-1.0])]
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        torch._foreach_log_(ts)
    assert info.value.op == "aten._foreach_log_" and info.value.tensors[0]["nan"] == 1


@independent
def test_attention_masks_pass_with_allow():
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 4 + [True]] * 2)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad(), detect_anomaly(allow=["masked_fill"]):
        layer(x, src_key_padding_mask=padding)
    with pytest.raises(NonFiniteError), torch.no_grad(), detect_anomaly():
        layer(x, src_key_padding_mask=padding)
    with torch.no_grad(), detect_anomaly(allow=["triu"]):
        layer(x, src_mask=causal.clone())


@independent
def test_recursive_decorated_call_and_unusual_outputs():
    @detect_anomaly()
    def depth(n):
        return depth(n - 1) if n else torch.ones(2).sum()

    depth(3)
    assert torch.log(torch.tensor([-1.0])).isnan().all()  # nothing left installed
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    with detect_anomaly():
        embedding(torch.tensor([1, 2])).sum().backward()  # sparse gradient: not read
        z = torch.randn(3, dtype=torch.complex64) * 2
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        z / torch.zeros(3, dtype=torch.complex64)
    assert info.value.tensors[0]["dtype"] == "complex64"


@independent
def test_backward_inside_a_composite_call_names_that_call():
    # The gradient through normalize's division by a norm of 1e-3 overflows.
    x = torch.tensor([[1e-3, 0.0]], requires_grad=True)
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        y = torch.nn.functional.normalize(x)
        y.backward(torch.tensor([[0.0, 3e38]]))
    e = info.value
    assert e.phase == "backward" and e.forward_op == "torch.nn.functional.normalize"
    assert e.location == _line_of(test_backward_inside_a_composite_call_names_that_call,
                                  "normalize(x)")


@independent
def test_uninitialized_memory_is_not_a_result():
    with detect_anomaly():
        for _ in range(20):
            torch.empty(1000).fill_(1.0)
            torch.empty_like(torch.ones(64, 64)).zero_()


@independent
def test_an_out_tensor_just_allocated_holds_nothing():
    a = torch.full((1000,), 3e38)
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        e = torch.empty(1000)
        e.fill_(float("nan"))  # written: now it holds a NaN (and fill_ made it)
    assert info.value.op == "aten.fill_.Scalar" and not info.value.inherited
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        torch.mul(a, a, out=torch.empty(1000))  # overflow made here, whatever empty held
    assert not info.value.inherited


@independent
def test_finite_values_whose_sum_overflows_are_not_reported():
    with detect_anomaly():
        big = torch.full((1000,), 3e38)  # finite; its sum is inf
        (big * 0.5).neg()
        torch.full((4096,), 60000.0, dtype=torch.float16) * 1.0


# --- the C++ scan of CPU tensors (nanfree._C.any_nonfinite) -------------------------


@independent
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=str)
def test_cpu_scan_reports_exactly_what_the_region_checks(dtype):
    from nanfree._C import any_nonfinite

    info = torch.finfo(dtype)
    inf, nan = float("inf"), float("nan")
    cases = [(nan, True, 1), (nan, False, 1), (inf, True, 1), (inf, False, 0), (-inf, True, 1),
             (-inf, False, 0), (info.max, True, 0), (-info.max, True, 0), (info.tiny / 2, True, 0),
             (-0.0, True, 0)]
    for value, check_inf, want in cases:
        for where in (0, 4095, 4096, 9999):  # both sides of the scan's block edge
            t = torch.zeros(10000, dtype=dtype)
            t[where] = value
            assert any_nonfinite([t], check_inf) == want, (value, check_inf, where)
    # A later tensor of the list counts; integer and empty tensors hold nothing.
    bad = torch.tensor([nan], dtype=dtype)
    assert any_nonfinite([torch.ones(3, dtype=dtype), torch.arange(3), torch.empty(0), bad],
                         True) == 1
    # Left to the caller: non-contiguous. A found value still answers 1.
    assert any_nonfinite([torch.zeros(10, dtype=dtype)[::2]], True) == -1
    assert any_nonfinite([torch.zeros(10, dtype=dtype)[::2], bad], True) == 1


@independent
def test_cpu_scan_of_many_entries_splits_them_over_threads_exactly():
    # Past 16K entries in all the scan runs in ranges of the tensors joined end
    # to end, over ATen's threads: a value at each tensor's edges and at a
    # range's edges is found, in whichever tensor of the list it lies.
    from nanfree._C import any_nonfinite

    sizes = [3, 70000, 1, 2**16, 2**17 + 5]
    for index in range(len(sizes)):
        for where in {0, sizes[index] // 2, sizes[index] - 1}:
            for value, check_inf, want in ((float("nan"), False, 1), (float("inf"), True, 1),
                                           (float("inf"), False, 0)):
                tensors = [torch.zeros(n) for n in sizes]
                tensors[index][where] = value
                assert any_nonfinite(tensors, check_inf) == want, (index, where, value)
    assert any_nonfinite([torch.zeros(2**20, dtype=torch.float16)] * 3, True) == 0
    # Either side of where ranges of 2 to 8 threads split one tensor.
    n = 3 * 2**16
    for where in sorted({max(0, min(n - 1, n * i // k + d)) for k in (2, 3, 4, 6, 8)
                         for i in range(k + 1) for d in (-1, 0)}):
        t = torch.zeros(n)
        t[where] = float("nan")
        assert any_nonfinite([t], False) == 1, where
    # Complex tensors: their real and imaginary parts.
    z = torch.zeros(70000, dtype=torch.complex64)
    assert any_nonfinite([z], True) == 0
    z[-1] = complex(0.0, float("inf"))
    assert (any_nonfinite([z], True), any_nonfinite([z], False)) == (1, 0)
    z[3] = complex(float("nan"), 0.0)
    assert any_nonfinite([z], False) == 1


@independent
@pytest.mark.parametrize("shape", ["large", "strided"])
def test_outputs_the_scan_leaves_are_still_checked(shape):
    # A NaN in a large output (scanned on ATen's threads) or one the C++ scan
    # does not read (not contiguous, found by the other check) is reported.
    x = torch.ones(2**18 + 8) if shape == "large" else torch.ones(64, 64).t()
    x[..., 3] = -1.0
    with pytest.raises(NonFiniteError) as info, detect_anomaly():
        y = torch.sqrt(x) if shape == "large" else torch.sqrt(x).t().t()
        del y
    assert "aten.sqrt" in str(info.value)


@independent
def test_a_nan_a_backward_formula_masks_is_not_reported():
    # torch's gradient of linalg_vector_norm at a zero vector divides 0 by 0
    # and replaces the NaN by 0: the node's output is finite, nothing to report
    # (torch's detect_anomaly, which checks node outputs, is silent too).
    x = torch.zeros(3, 4, requires_grad=True)
    with detect_anomaly():
        torch.linalg.vector_norm(x, dim=-1).sum().backward()
    assert torch.equal(x.grad, torch.zeros(3, 4))
    # F.normalize with p = 0.5 at a zero entry: an infinite intermediate, masked.
    x = torch.tensor([[0.0, 1.0]], requires_grad=True)
    with detect_anomaly():
        torch.nn.functional.normalize(x, p=0.5).sum().backward()
    assert torch.isfinite(x.grad).all()


@independent
def test_the_nan_workflow_example_prints_what_its_page_shows(capsys):
    # docs/nan_workflow.md quotes this example's output: keep the two in step.
    import os
    import runpy

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runpy.run_path(os.path.join(root, "docs", "examples", "nan_example.py"), run_name="__main__")
    out = capsys.readouterr().out
    page = open(os.path.join(root, "docs", "nan_workflow.md")).read()
    for line in ("RuntimeError: Function 'PowBackward0' returned nan values in its 0th output.",
                 "NonFiniteError: nanfree.debug.detect_anomaly: aten.div.Tensor produced NaN in "
                 "the forward", "  module: pool", "  module: Net.pool",
                 "step skipped: 1 skipped, parameters unchanged: True"):
        assert line in out and line in page, line
