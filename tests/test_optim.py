"""nanfree.optim.FiniteGuard: a step with a non-finite loss or gradient is skipped on
the device, every other step is the optimizer's own."""

import collections
import copy
import math
import warnings

import pytest
import torch

from nanfree.debug import NonFiniteError
from nanfree.optim import FiniteGuard

# Only torch's kernels run here: the same in every backend's pass.
pytestmark = pytest.mark.backend_independent

OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-fused-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(before, model):
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _state_tensors(optimizer):
    return [v.clone() for s in optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_skips_exactly_the_non_finite_steps(name, path):
    # "host": the CPU's way, the optimizer called or not by the flag's value;
    # "device": an accelerator's, stepped and restored where the flag is set.
    batches = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    plain_model, guarded_model = _model(), _model()
    plain = OPTIMIZERS[name](plain_model.parameters())
    guard = FiniteGuard(OPTIMIZERS[name](guarded_model.parameters()), log_every=0)
    guard._read_host_flag = path == "host"
    for i, x in enumerate(batches):
        _grads(guarded_model, x)
        if i in (0, 2):  # an inf gradient, first step included (state not made yet)
            guarded_model[0].weight.grad[0, 0] = float("inf")
            before = _snapshot(guarded_model)
            state = _state_tensors(guard.optimizer)
            guard.step()
            assert _unchanged(before, guarded_model)
            after = _state_tensors(guard.optimizer)
            assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after))
            continue
        _grads(plain_model, x)
        plain.step()
        guard.step()
        for a, b in zip(plain_model.parameters(), guarded_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert guard.skipped_steps == 2 and guard.steps == 4


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("nan", [torch.tensor(float("nan")), float("nan"),
                                 torch.tensor([1.0, float("inf")], dtype=torch.float64),
                                 torch.tensor(complex(1.0, float("nan")))],
                         ids=["tensor", "python-number", "float64-vector", "complex"])
def test_nan_loss_skips_with_finite_gradients(nan, path):
    model = _model()
    guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), log_every=0)
    guard._read_host_flag = path == "host"
    _grads(model, torch.randn(5, 4))
    guard.step(loss=torch.tensor(1.0))  # state made: the device path's steady step below
    before = _snapshot(model)
    loss = nan.clone() if isinstance(nan, torch.Tensor) else nan
    version = loss._version if isinstance(loss, torch.Tensor) else None
    guard.step(loss=loss)
    assert _unchanged(before, model)
    assert guard.skipped_steps == 1
    if isinstance(nan, torch.Tensor):  # the check reads the loss, never writes it
        assert loss._version == version
        torch.testing.assert_close(loss, nan, rtol=0, atol=0, equal_nan=True)
    guard.step(loss=torch.tensor(1.0))
    assert not _unchanged(before, model)


def test_clipping_never_writes_nan_and_matches_clip_grad_norm():
    model, ref = _model(), _model()
    x = torch.randn(5, 4)
    _grads(model, x), _grads(ref, x)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=0.0), clip_norm=0.01, log_every=0)
    guard.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    # One inf gradient: clip_grad_norm_ would write NaN or 0 everywhere; here the
    # other gradients stay as they were (and the step is skipped).
    _grads(model, x)
    model[0].weight.grad[0, 0] = float("inf")
    others = [p.grad.clone() for p in list(model.parameters())[1:]]
    guard.step()
    assert all(torch.equal(a, p.grad) for a, p in zip(others, list(model.parameters())[1:]))
    assert guard.skipped_steps == 1


def test_skips_are_logged_and_schedulers_stay_in_step():
    model = _model()
    guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=1.0), log_every=2)
    scheduler = torch.optim.lr_scheduler.StepLR(guard.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            _grads(model, torch.randn(5, 4))
            if i == 1:
                model[0].bias.grad[0] = float("nan")
            guard.step()
            scheduler.step()
    messages = [str(w.message) for w in caught]
    assert any("1 more step(s) skipped" in m and "1 of 2 in all" in m for m in messages)
    assert not any("lr_scheduler.step()" in m for m in messages)
    assert guard.optimizer.param_groups[0]["lr"] == 1.0 / 16


def test_a_skipped_closure_step_is_located():
    model = _model()
    guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=0.1), locate=True, log_every=0)
    x = torch.randn(5, 4)
    batch = {"c": torch.tensor(2.0)}

    def closure():
        guard.zero_grad()
        loss = model(x).square().mean() * torch.log(batch["c"])  # NaN for c < 0
        loss.backward()
        return loss

    guard.step(closure)
    assert guard.last_report is None and guard.skipped_steps == 0
    batch["c"] = torch.tensor(-1.0)
    before = _snapshot(model)
    with pytest.warns(UserWarning, match="skipped; nanfree.debug.detect_anomaly: aten.log"):
        guard.step(closure)
    assert _unchanged(before, model)
    report = guard.last_report
    assert isinstance(report, NonFiniteError) and report.op == "aten.log"
    assert report.phase == "forward" and guard.skipped_steps == 1


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="FiniteGuard: `optimizer`"):
        FiniteGuard(object())
    params = _model().parameters()
    with pytest.raises(ValueError, match="clip_norm"):
        FiniteGuard(torch.optim.SGD(params, lr=0.1), clip_norm=float("inf"))


def test_state_dict_round_trip():
    model = _model()
    guard = FiniteGuard(torch.optim.Adam(model.parameters()), log_every=0)
    _grads(model, torch.randn(5, 4))
    guard.step()
    copied = FiniteGuard(torch.optim.Adam(copy.deepcopy(model).parameters()), log_every=0)
    copied.load_state_dict(guard.state_dict())
    assert copied.steps == 1 and copied.skipped_steps == 0


def test_clipping_a_float16_norm_that_overflows_and_sparse_gradients():
    # Finite float16 gradients whose norm overflows float16: still clipped.
    p = torch.nn.Parameter(torch.zeros(100, dtype=torch.float16))
    guard = FiniteGuard(torch.optim.SGD([p], lr=1.0), clip_norm=1.0, log_every=0)
    p.grad = torch.full((100,), 1e4, dtype=torch.float16)
    guard.step()
    assert guard.skipped_steps == 0 and torch.isfinite(p).all()
    assert abs(float(p.float().norm()) - 1.0) < 1e-2
    # A sparse gradient is in the norm and clipped.
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Linear(4, 1)
    guard = FiniteGuard(torch.optim.SGD([*embedding.parameters(), *dense.parameters()], lr=1.0),
                        clip_norm=1e-3, log_every=0)
    before = embedding.weight.detach().clone()
    dense(embedding(torch.tensor([1, 2]))).sum().backward()
    guard.step()
    assert (embedding.weight - before).norm() <= 1.01e-3


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("case", ["float32 1e20", "float64 1e300 p=3", "float64 1e300 p=inf",
                                  "bfloat16 3e38 p=1", "float16 and float32", "complex64 1e20",
                                  "float32 p=10"])
def test_finite_gradients_whose_norm_overflows_are_clipped_to_the_norm_asked(case, path):
    # clip_grad_norm_ takes these norms as inf and writes 0 into every gradient
    # (or, for a float16 coefficient, rounds it to 0): the guard clips them to
    # clip_norm, in the total norm of norm_type.
    norm_type = {"p=3": 3.0, "p=inf": math.inf, "p=1": 1.0, "p=10": 10.0}.get(case.split()[-1], 2.0)
    specs = {"float32 1e20": [(torch.float32, 1e20, 12), (torch.float32, 1e20, 3)],
             "float64 1e300 p=3": [(torch.float64, 1e300, 12), (torch.float64, -1e300, 3)],
             "float64 1e300 p=inf": [(torch.float64, 1e300, 12)],
             "bfloat16 3e38 p=1": [(torch.bfloat16, 3e38, 8)],
             # Mixed dtypes: a coefficient of about 4e-9 is 0 in float16.
             "float16 and float32": [(torch.float16, 6e4, 100), (torch.float32, 1e3, 10)],
             "complex64 1e20": [(torch.complex64, 1e20, 6)],
             "float32 p=10": [(torch.float32, 3e38, 4)]}[case]
    clip = 1e-3 if case == "float16 and float32" else 2.0
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for dtype, _, n in specs]
    guard = FiniteGuard(torch.optim.SGD(params, lr=1.0), clip_norm=clip, norm_type=norm_type,
                        log_every=0)
    guard._read_host_flag = path == "host"
    for p, (dtype, value, n) in zip(params, specs):
        p.grad = torch.full((n,), value, dtype=dtype)
        assert torch.isfinite(p.grad).all()
    guard.step()
    assert guard.skipped_steps == 0
    grads = torch.cat([p.grad.flatten().to(torch.complex128 if p.is_complex() else torch.float64)
                       for p in params])
    # Every gradient moved by the same coefficient, to the norm asked.
    assert all(torch.isfinite(p).all() and (p != 0).all() for p in params)
    total = float(torch.linalg.vector_norm(grads, norm_type))
    assert total == pytest.approx(clip, rel=1e-2 if case.startswith(("bfloat16", "float16")) else 1e-5)


def test_cpu_check_and_norm_in_one_pass_match_float64_norms():
    # nanfree._C.nonfinite_and_norm, the CPU path's check and clipping norm:
    # the total norm of every entry (float32, float16, bfloat16; complex64 for
    # the 2-norm) as float64 norms give it, across chunk and tensor edges, the
    # same on one thread as on two; NaN or inf anywhere: found; what it does not
    # take: -1.
    from nanfree._C import nonfinite_and_norm

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(40000, generator=gen) * 1e18, torch.randn(7, generator=gen).half(),
               torch.randn(30001, generator=gen).bfloat16(), torch.randn(16384, generator=gen)]
    complex_ = torch.randn(9, dtype=torch.complex64, generator=gen)
    threads = torch.get_num_threads()
    for p in (2.0, 1.0, math.inf):
        listed = tensors + ([complex_] if p == 2.0 else [])
        want = float(torch.linalg.vector_norm(torch.cat(
            [torch.view_as_real(t).flatten().double() if t.is_complex() else t.double()
             for t in listed]), p))
        found, norm = nonfinite_and_norm(listed, p)
        assert found == 0 and norm == pytest.approx(want, rel=1e-12), p
        torch.set_num_threads(1)
        try:
            assert nonfinite_and_norm(listed, p) == (found, norm)  # bit for bit
        finally:
            torch.set_num_threads(threads)
    for index, where in ((0, 0), (0, 39999), (2, 16383), (2, 30000), (3, 5)):
        bad = [t.clone() for t in tensors]
        bad[index][where] = float("inf") if where % 2 else float("nan")
        assert nonfinite_and_norm(bad, 2.0)[0] == 1, (index, where)
    for refused, p in (([torch.ones(3, dtype=torch.float64)], 2.0), (tensors, 3.0),
                       ([complex_], 1.0), ([torch.ones(4, 4).t()], 2.0),
                       ([torch.ones(3).to_sparse()], 2.0)):
        assert nonfinite_and_norm(refused, p)[0] == -1


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_cpu_path_clips_from_its_check_pass_as_clip_grad_norm(monkeypatch, norm_type):
    # On the CPU's path the 1-, 2- and inf-norms come from the check's own pass
    # (no second read of the gradients: _clip is not called); the result is
    # clip_grad_norm_'s either way.
    model, ref = _model(), _model()
    x = torch.randn(5, 4)
    _grads(model, x), _grads(ref, x)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type)
    guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=0.0), clip_norm=0.01,
                        norm_type=norm_type, log_every=0)
    calls = []
    original = FiniteGuard._clip
    monkeypatch.setattr(FiniteGuard, "_clip",
                        lambda self, *args: (calls.append(1), original(self, *args))[1])
    guard.step()
    assert bool(calls) == (norm_type == 3.0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_float64_default_dtype_and_an_existing_found_inf():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _model()
        guard = FiniteGuard(torch.optim.Adam(model.parameters(), fused=True), log_every=0)
        _grads(model, torch.randn(5, 4))
        guard.step()  # the first step (state made)
        _grads(model, torch.randn(5, 4))
        # A found_inf set by someone else (a GradScaler) still skips the step.
        guard.optimizer.found_inf = torch.ones(())
        before = _snapshot(model)
        guard.step()
        assert _unchanged(before, model)
        assert guard.optimizer.found_inf.item() == 1.0  # left as it was
        del guard.optimizer.found_inf
    finally:
        torch.set_default_dtype(previous)


def test_state_dict_keeps_the_skip_count_and_lbfgs_gets_its_closure():
    model = _model()
    guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=0.1), log_every=0)
    for bad in (True, False, True):
        _grads(model, torch.randn(5, 4))
        if bad:
            model[0].bias.grad[0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            guard.step()
    with pytest.warns(UserWarning, match="2 more step"):
        state = guard.state_dict()
    copied = FiniteGuard(torch.optim.SGD(_model().parameters(), lr=0.1), log_every=0)
    copied.load_state_dict(state)
    assert copied.skipped_steps == 2 and copied.steps == 3
    lbfgs_model = _model()
    lbfgs = FiniteGuard(torch.optim.LBFGS(lbfgs_model.parameters(), max_iter=3), log_every=0)
    x = torch.randn(5, 4)

    def closure():
        lbfgs.zero_grad()
        return _grads(lbfgs_model, x)

    first = float(closure())
    lbfgs.step(closure)
    assert float(closure()) < first


# --- under torch.distributed: every rank skips the same steps ----------------------------


def _ranks_worker(rank, init_file, world):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        for sync in (True, False):
            torch.manual_seed(0)  # the same model on every rank
            model = torch.nn.Linear(4, 2)
            guard = FiniteGuard(torch.optim.SGD(model.parameters(), lr=0.1), sync_ranks=sync,
                                log_every=0)
            before = [p.detach().clone() for p in model.parameters()]
            x = torch.ones(3, 4)
            if rank == 1:
                x[0, 0] = float("nan")  # only rank 1's gradients are NaN
            model(x).sum().backward()
            guard.step()
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            # With the flag reduced, rank 0 skips too; without, it applies its finite step.
            want = True if sync else rank == 1
            assert unchanged == want, (rank, sync, unchanged)
            assert guard.skipped_steps == int(want), (rank, sync, guard.skipped_steps)
    finally:
        dist.destroy_process_group()


def test_every_rank_skips_the_same_steps(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ranks_worker, args=(str(tmp_path / "init"), 2), nprocs=2, join=True)


# --- no host sync in a steady step ------------------------------------------------------


@pytest.mark.parametrize("path", ["device", "host"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_steady_step_adds_no_host_read(monkeypatch, fused, clip, path):
    # The ways a step could wait for the device: reading a tensor's value on
    # the host. After the first step (which reads the flag once, so that a
    # skipped first step creates no state), a guarded step on the device path
    # (an accelerator's, forced here on CPU tensors), skipped or not, reads
    # nothing more than the plain optimizer's own step does (for-loop Adam reads
    # its step counters; on a GPU each read would be a sync). On the CPU's path
    # the check is a C++ scan answering on the host: no tensor is read, and the
    # skipped steps do not call the optimizer (for-loop Adam's own reads of
    # those steps are missing).
    def run(guarded):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
        guard = FiniteGuard(optimizer, clip_norm=clip, log_every=0) if guarded else None
        if guarded:
            guard._read_host_flag = path == "host"
        x = torch.randn(5, 4)

        def step(bad):
            optimizer.zero_grad()
            loss = model(x * (float("nan") if bad else 1.0)).square().mean()
            loss.backward()
            if guarded:
                guard.step(loss=loss)
            else:
                optimizer.step()

        step(False)
        reads = []
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
                original = getattr(torch.Tensor, name)

                def counting(self, *args, _original=original, _name=name, **kwargs):
                    reads.append(_name)
                    return _original(self, *args, **kwargs)

                patch.setattr(torch.Tensor, name, counting)
            for bad in (False, True, False, True):
                step(bad and guarded)  # the plain optimizer steps on finite gradients
        return reads, guard

    plain, _ = run(False)
    guarded, guard = run(True)
    if path == "host" and not fused:
        # Nothing beyond the reads of the optimizer's own steps, fewer of which run.
        assert not collections.Counter(guarded) - collections.Counter(plain), (guarded, plain)
        assert len(guarded) < len(plain), (guarded, plain)
    else:
        assert guarded == plain, (guarded, plain)
    assert guard.skipped_steps == 2


# --- on a GPU: the device path as it runs there ------------------------------------------

# Optimizers whose state lives on the GPU beside the parameters; the others keep
# their step counters on the CPU (non-capturable Adam and NAdam, Rprop's step
# sizes are on the GPU), so restoring them after a skipped step reads the flag.
_STATE_ON_DEVICE = {"sgd-momentum", "sgd-fused-momentum", "sgd-dampening", "adamw-fused"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cuda_skips_are_bit_identical_and_add_no_sync(name):
    # On CUDA tensors, with the loss given: a skipped step (an inf gradient, or a
    # NaN loss) leaves parameters and state bit-identical, and a steady step
    # (after the first, which reads the flag once) synchronizes no more often
    # than the optimizer's own step, counted by torch's sync debug mode (a
    # warning per synchronizing call); with step counters on the CPU, once more.
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                   torch.nn.Linear(8, 1)).cuda()

    batches = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)).cuda()
               for i in range(6)]
    bad_gradient, bad_loss = 2, 4  # an inf gradient; finite gradients with a NaN loss

    def run(guarded):
        net = model()
        optimizer = OPTIMIZERS[name](net.parameters())
        guard = FiniteGuard(optimizer, log_every=0) if guarded else None
        syncs, counted = 0, 0
        for i, x in enumerate(batches):
            bad = i in (bad_gradient, bad_loss)
            if not guarded and bad:
                continue  # the plain optimizer never sees the bad steps
            loss = _grads(net, x)
            if i == bad_gradient:
                net[0].weight.grad[0, 0] = float("inf")
            if i == bad_loss:
                loss = loss.detach() * float("nan")
            if bad:
                params, state = _snapshot(net), _state_tensors(optimizer)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    guard.step(loss=loss) if guarded else optimizer.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if i > 0 and not bad:  # steady steps that both runs take
                syncs += sum("synchronizing" in str(w.message) for w in caught)
                counted += 1
            if bad:
                assert _unchanged(params, net)
                assert all(torch.equal(a, b) for a, b in zip(state, _state_tensors(optimizer)))
        return net, syncs / counted, guard

    plain, plain_rate, _ = run(False)
    guarded, guarded_rate, guard = run(True)
    for a, b in zip(plain.parameters(), guarded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert guard.skipped_steps == 2
    extra = guarded_rate - plain_rate
    if name in _STATE_ON_DEVICE:
        assert extra == 0, (plain_rate, guarded_rate)
    else:  # CPU step counters: the flag read once per step to call the optimizer or not
        assert extra == 1, (plain_rate, guarded_rate)
