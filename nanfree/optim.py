"""Never apply a non-finite step: ``nanfree.optim.FiniteGuard``.

``FiniteGuard(optimizer)`` wraps any optimizer. Its ``step()`` checks the
gradients (and the loss, when given) for NaN and inf on their device, with one
fused check per device and dtype (``torch._amp_foreach_non_finite_check_and_unscale_``,
GradScaler's kernel; on the CPU nanfree's own scan, last item), and skips the
update on the device, without a host sync:

- an optimizer that takes a ``found_inf`` flag (the fused implementations of
  Adam, AdamW, SGD, ...: ``_step_supports_amp_scaling``) gets the flag and skips
  the update itself;
- any other optimizer whose state is on the parameters' device steps, and every
  parameter and state tensor it changed is put back where the flag is set
  (``torch.where`` from a copy taken before the step): the same result, at the
  cost of one copy of the parameters and state;
- an optimizer that keeps state on the CPU for parameters on an accelerator
  (the step counters of non-capturable Adam, AdamW, NAdam, ...): restoring
  that state needs the flag on the host, so the flag is read (one sync per
  step, as GradScaler's) and the optimizer is called or not by it, with no
  copy;
- a step that would create optimizer state (a parameter's first) reads the flag
  once and, when set, does not call the optimizer: a skipped first step leaves
  no state behind;
- on the CPU (every gradient, and the loss when given, CPU tensors; no ranks
  to agree with) the check is nanfree's own scan (``nanfree._C.any_nonfinite``,
  on ATen's threads) and its answer is a Python bool: a CPU tensor's values are
  there when the scan returns, so nothing is waited for, and any optimizer,
  fused or not, is called or not by it: no ``found_inf``, no copy.

With ``clip_norm``, the gradients are clipped by their total norm first, with a
coefficient that a non-finite norm cannot turn into NaN or 0 in every gradient
(``torch.nn.utils.clip_grad_norm_`` with one inf gradient writes NaN or 0 into
all of them): a non-finite norm leaves the gradients as they are (the step is
skipped anyway). The norms are taken without overflow (float64 sums, or scaled
by the largest magnitude), so finite gradients whose float32 norm would be inf
are clipped, not zeroed (``_norms``, ``_clip``).

Skips are counted on the device (``skipped``); every ``log_every`` steps the
count is read (one sync) and a new skip is logged as a warning, and reading
``skipped_steps`` syncs too: never silent. On an accelerator the optimizer's
``step`` is called on every step but a skipped first one, except for an optimizer
with state on the CPU (called only on the steps not skipped, as on the CPU's
path); an LR scheduler stepped by the loop stays in step either way.

``guard.step(closure)`` runs the closure (forward and backward, returning the
loss) itself; with ``locate=True`` a skipped step is run again under
``nanfree.debug.detect_anomaly`` with the same parameters, random state and
batch, and the report of the first op that produced a non-finite value is kept
in ``last_report`` (and logged). Locating reads the flag after each step (one
sync); it runs only after a detection.
"""

import math
import warnings

import torch

from .debug import NonFiniteError, detect_anomaly

try:  # the CPU's check (and clipping norm): one multi-threaded scan in C++, answered on the host
    from nanfree._C import any_nonfinite as _any_nonfinite
    from nanfree._C import nonfinite_and_norm as _nonfinite_and_norm
except ImportError:
    _any_nonfinite = _nonfinite_and_norm = None

__all__ = ["FiniteGuard"]

# Gradient dtypes whose norms are taken scaled and whose clipping factor stays float64.
_WIDE = (torch.float64, torch.complex128)


def _rng_state():
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class FiniteGuard:
    """Wraps ``optimizer``: ``step()`` applies the update only when the loss (if
    given) and every gradient are finite; see the module's docstring.

    ``clip_norm``, ``norm_type``: clip the gradients by their total norm (as
    ``clip_grad_norm_``) before the step, never writing NaN. ``log_every``: read
    the skip count every so many steps and warn about new skips (0: never;
    ``skipped_steps`` still counts them). ``locate``: localize a skipped step
    given as a closure with ``nanfree.debug.detect_anomaly``. ``process_group``:
    under torch.distributed (initialized, more than one rank) the skip flag is
    reduced (max) over this group, the default group when None, so that every
    rank skips the same steps (DDP's ranks already see the same gradients, but
    not the same loss; FSDP's see their own shards); ``sync_ranks=False`` keeps
    each rank's own decision.
    """

    def __init__(self, optimizer, *, clip_norm=None, norm_type=2.0, log_every=100, locate=False,
                 process_group=None, sync_ranks=True):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("nanfree.optim.FiniteGuard: `optimizer` must be a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        if clip_norm is not None and not (float(clip_norm) > 0 and float(clip_norm) < float("inf")):
            raise ValueError(f"nanfree.optim.FiniteGuard: `clip_norm` must be positive and finite, "
                             f"got {clip_norm!r}")
        if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 0:
            raise ValueError(f"nanfree.optim.FiniteGuard: `log_every` must be an int >= 0, "
                             f"got {log_every!r}")
        self.optimizer = optimizer
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.norm_type = float(norm_type)
        self.log_every = log_every
        self.locate = bool(locate)
        self.process_group = process_group
        self.sync_ranks = bool(sync_ranks)
        self.steps = 0
        self.skipped = None  # device counter of skipped steps (int64), made on first use
        self._skipped_host = 0  # skips decided on the CPU's path (_host_check)
        self._skipped_before = 0  # skips counted before a load_state_dict
        self._logged = 0
        self.last_report = None  # the first skipped step's report (False: not reproducible)
        self._ones = {}  # device -> the scale 1 of GradScaler's kernel (_one)
        # Where the flag and every parameter are CPU tensors, the flag's value is on the
        # host when it is computed (no device to wait for): the step runs or not by it.
        # False: the device path (restore) there too; the tests use it to check that
        # path's results and its absence of reads on CPU.
        self._read_host_flag = True

    # The optimizer's interface, passed through (an LR scheduler takes
    # guard.optimizer: the guard is not an Optimizer).
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        self.report()
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps,
                "skipped": self.skipped_steps}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        self.skipped = None  # made on the device of the next step's flag
        self._skipped_host = 0
        self._skipped_before = self._logged = int(state["skipped"])

    @property
    def skipped_steps(self):
        """How many steps were skipped (reads the device counter: a sync)."""
        return self._skipped_before + self._skipped_host + \
            (0 if self.skipped is None else int(self.skipped))

    def report(self):
        """Warn about skips not reported yet (reads the counter: a sync). Called every
        `log_every` steps and by state_dict; call it at the end of training."""
        skipped = self.skipped_steps
        if skipped > self._logged:
            warnings.warn(f"nanfree.optim.FiniteGuard: {skipped - self._logged} more step(s) "
                          f"skipped (non-finite loss or gradients); {skipped} of {self.steps} "
                          "in all", stacklevel=2)
            self._logged = skipped
        return skipped

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]
                if p.grad is not None]

    @staticmethod
    def _values(grad):
        """The values of a gradient as a real strided tensor (sparse: its values)."""
        if grad.is_sparse:
            grad = grad.coalesce()._values()
        return torch.view_as_real(grad) if grad.is_complex() else grad

    def _found(self, params, loss):
        """A float32 flag [1]: 1 when the loss or a gradient is non-finite. On an
        accelerator when any gradient is on one (a flag copied from the host to it
        does not wait); one fused check per device and dtype, no sync. The loss
        joins the gradients of its device and dtype: on one device and dtype the
        whole check is three launches (a flag, a copy of the loss, the check)."""
        devices = [p.grad.device for p in params]
        if isinstance(loss, torch.Tensor):
            devices.append(loss.device)
        device = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
        groups = {}
        for p in params:
            grad = self._values(p.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        if isinstance(loss, torch.Tensor):
            value = loss.detach()
            if value.is_complex():
                value = torch.view_as_real(value)
            if value.is_floating_point():  # an integer loss is finite
                # A copy: GradScaler's kernel multiplies what it checks by the scale in place.
                groups.setdefault((value.device, value.dtype), []).append(value.reshape(-1).clone())
        found = None
        for (dev, _), tensors in groups.items():
            flag = torch.zeros(1, dtype=torch.float32, device=dev)
            # GradScaler's kernel with scale 1: sets flag where a value is NaN or inf,
            # leaves the gradients as they are.
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, self._one(dev))
            flag = flag.to(device, non_blocking=dev.type == "cpu")
            found = flag if found is None else torch.maximum(found, flag)
        if found is None:
            found = torch.zeros(1, dtype=torch.float32, device=device)
        if loss is not None and not isinstance(loss, torch.Tensor) and not math.isfinite(float(loss)):
            found.fill_(1.0)  # a Python number: known on the host, no sync
        return found

    def _one(self, device):
        """The scale 1 of GradScaler's kernel on `device`, made once."""
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return one

    def _host_check(self, params, loss):
        """The CPU's path: (bad, norm). bad: whether the loss or a gradient is
        non-finite, a Python bool from one scan of every gradient (on ATen's
        threads; a CPU tensor's values are there when it returns, so it waits for
        nothing). norm: with clip_norm, the gradients' total norm taken in the same
        pass (nanfree._C.nonfinite_and_norm: float64 sums; norm types 1, 2 and inf of
        float32 and half gradients), else None (_clip takes it). (None, None) where
        the path does not apply: a tensor off the CPU or of a kind the scan does not
        read, ranks to agree with, a found_inf already set, no compiled extension."""
        if _any_nonfinite is None or not self._read_host_flag or self._ranks_to_agree():
            return None, None
        # A found_inf or grad_scale set by someone else (a GradScaler): combined with the
        # guard's flag on the device path.
        if getattr(self.optimizer, "found_inf", None) is not None or \
                getattr(self.optimizer, "grad_scale", None) is not None:
            return None, None
        grads = [p.grad for p in params]  # a sparse one: -1, the device path checks it
        found, norm = -1, None
        if self.clip_norm is not None:
            found, norm = _nonfinite_and_norm(grads, self.norm_type)
        if found < 0:  # no clipping, or a norm the fused pass does not take
            found, norm = _any_nonfinite(grads, True), None
        if found == 0 and isinstance(loss, torch.Tensor):
            found = _any_nonfinite([loss.detach()], True)
        if found < 0:  # a tensor off the CPU, strided or of another dtype
            return None, None
        # A Python number as the loss: its value is on the host.
        bad = found == 1 or (loss is not None and not isinstance(loss, torch.Tensor)
                             and not math.isfinite(float(loss)))
        return bad, norm

    def _ranks_to_agree(self):
        """Whether the flag is reduced over ranks (torch.distributed runs, more than one)."""
        import torch.distributed as dist

        return self.sync_ranks and dist.is_available() and dist.is_initialized() and \
            dist.get_world_size(self.process_group) > 1

    def _agreed(self, found):
        """The flag, reduced (max) over the ranks when torch.distributed runs: one
        all_reduce of one float, queued on the device's stream with NCCL (no host
        sync); with gloo, a blocking exchange of that float on the host."""
        import torch.distributed as dist

        if not self._ranks_to_agree():
            return found
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        return found

    def _norms(self, parts):
        """Per-tensor norms (of norm_type) as float64 tensors, without overflow: a
        float32 or half gradient's norm is accumulated in float64 (complex64 in
        complex128), where its entries' powers up to the 8th cannot overflow; a
        float64 or complex128 gradient, or a norm type above 8, is divided by its
        largest magnitude first and its norm multiplied back."""
        p = self.norm_type
        summable = p <= 8 or math.isinf(p)  # in float64, for float32 and half entries
        direct = [t for t in parts if summable and t.dtype not in _WIDE]
        scaled = [t for t in parts if not (summable and t.dtype not in _WIDE)]
        norms = []
        for complex_ in (False, True):
            group = [t for t in direct if t.is_complex() == complex_]
            if group:
                norms += torch._foreach_norm(group, p,
                                             dtype=torch.complex128 if complex_ else torch.float64)
        for t in scaled:
            amax = torch.linalg.vector_norm(t, math.inf, dtype=torch.complex128 if t.is_complex()
                                            else torch.float64)
            if math.isinf(p):
                norms.append(amax)
                continue
            # A zero gradient: divided by 1 (its norm is 0 either way).
            unit = torch.where(amax > 0, amax, 1.0)
            norms.append(torch.linalg.vector_norm(t / unit.to(t.real.dtype if t.is_complex()
                                                              else t.dtype), p).double() * unit)
        return norms

    def _clip(self, params, found):
        """Clip by the total norm, as clip_grad_norm_ does, but never to 0 or NaN: the
        norms without overflow (_norms: a finite gradient of 1e20 in float32, whose
        float32 norm is inf, is scaled to the norm asked instead of to 0), the
        coefficient applied in float32 (float64 to float64 gradients) and never
        rounded to a half dtype first (where a coefficient below 6e-8 would be 0).
        Where found is set (the step is skipped) the gradients stay as they are."""
        by_device = {}  # device -> (dense gradients, sparse gradients)
        for p in params:
            by_device.setdefault(p.grad.device, ([], []))[p.grad.is_sparse].append(p.grad)
        norms = []
        for dense, sparse in by_device.values():
            parts = dense + [self._values(g) for g in sparse]
            if parts:
                norms += [n.to(found.device, non_blocking=n.device.type == "cpu")
                          for n in self._norms(parts)]
        if not norms:
            return
        # The total divided by the largest norm (float64 powers of norms near its
        # largest value would overflow): clip / (total + 1e-6) formed as
        # (clip / top) / (total / top + 1e-6 / top).
        stacked = torch.stack(norms)
        top = stacked.amax()
        unit = torch.where(top > 0, top, 1.0)  # all gradients zero: any unit
        coefficient = torch.clamp((self.clip_norm / unit) / (
            torch.linalg.vector_norm(stacked / unit, self.norm_type) + 1e-6 / unit), max=1.0)
        # A skipped step's gradients stay as they are; so do they where the coefficient
        # is not finite (an infinite or NaN norm), never multiplied by NaN.
        coefficient = torch.where((found.reshape(()) > 0) | ~torch.isfinite(coefficient), 1.0,
                                  coefficient)
        self._scale(by_device, coefficient)

    @staticmethod
    def _scale(by_device, coefficient):
        """Multiplies the gradients ({device: (dense, sparse)}) by the float64 0-d
        coefficient: in float32 (float64 for float64 gradients), never rounded to a
        half dtype first (a coefficient below 6e-8 would be 0 in float16)."""
        for device, (dense, sparse) in by_device.items():
            factor = coefficient.to(device, non_blocking=device.type != "cpu"
                                    or coefficient.device.type == "cpu")
            narrow_factor = factor.float()
            for group, f in (([g for g in dense if g.dtype not in _WIDE], narrow_factor),
                             ([g for g in dense if g.dtype in _WIDE], factor)):
                if group:
                    torch._foreach_mul_(group, f)
            for g in sparse:
                g.mul_(factor if g.dtype in _WIDE else narrow_factor)

    def _native_found_inf(self):
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def _first_state(self, params):
        """Whether the step would create state for a parameter (its first step)."""
        return any(len(self.optimizer.state.get(p, {})) == 0 for p in params)

    def _state_on_cpu(self, found):
        """Whether the flag is on an accelerator and the optimizer keeps state on the
        CPU (non-capturable Adam's step counters): restoring that state after a
        skipped step would read the flag anyway (a copy to the CPU that waits)."""
        return found.device.type != "cpu" and any(
            isinstance(v, torch.Tensor) and v.device.type == "cpu"
            for st in self.optimizer.state.values() for v in st.values())

    def _on_host(self, found):
        """Whether the flag and every parameter (so their optimizer state) are on the CPU."""
        return self._read_host_flag and found.device.type == "cpu" and all(
            p.device.type == "cpu" for group in self.optimizer.param_groups for p in group["params"])

    def _call_step(self, closure):
        # An optimizer whose step needs the closure (LBFGS) gets it.
        if closure is not None and isinstance(self.optimizer, torch.optim.LBFGS):
            return self.optimizer.step(closure)
        return self.optimizer.step()

    def _step_with_restore(self, found, closure):
        """Any optimizer: step, then put every changed parameter and state entry back
        where found is set (one flag per device; a flag read on another device than
        its own, e.g. CPU step counters of a CUDA optimizer, is a copy that waits)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved_params = [p.detach().clone() for p in params]
        saved_state = {(p, key): v.detach().clone() for p, st in self.optimizer.state.items()
                       for key, v in st.items()
                       if isinstance(v, torch.Tensor) and v.layout == torch.strided}
        self._call_step(closure)
        keep = found.reshape(()).bool()
        keeps = {}

        def on(device):
            if device not in keeps:
                keeps[device] = keep.to(device)
            return keeps[device]

        with torch.no_grad():
            torch._foreach_copy_(params, [torch.where(on(t.device), old, t)
                                          for t, old in zip(params, saved_params)])
            for (p, key), old in saved_state.items():
                now = self.optimizer.state[p][key]
                merged = torch.where(on(now.device), old, now)
                if now.shape == old.shape and now.dtype == old.dtype and not now.is_inference():
                    now.copy_(merged)  # in place: the optimizer may hold it elsewhere
                else:
                    self.optimizer.state[p][key] = merged

    def step(self, closure=None, *, loss=None):
        """One guarded step. ``closure``: runs forward and backward and returns the
        loss (as ``optimizer.step(closure)``); ``loss``: the loss already computed
        (a tensor or a number), checked with the gradients. Returns the loss."""
        rng = _rng_state() if closure is not None and self.locate and self.last_report is None \
            else None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        bad, norm = self._host_check(params, loss)
        if bad is None:
            bad = self._device_step(params, loss, closure)
        else:  # the CPU's path: any optimizer is called or not by the scan's answer
            if self.clip_norm is not None and norm is None:
                self._clip(params, torch.full((1,), float(bad)))
            elif self.clip_norm is not None and not bad:
                # The norm of the check's pass (finite: float64 sums of finite entries).
                coefficient = self.clip_norm / (norm + 1e-6)
                if coefficient < 1.0:
                    self._scale({params[0].grad.device: ([p.grad for p in params], [])},
                                torch.tensor(coefficient, dtype=torch.float64))
            if not bad:
                self._call_step(closure)
            self._skipped_host += bad
        self.steps += 1
        if rng is not None and bool(bad):  # a device flag: one sync, only while locating
            self._localize(closure, rng)
        if self.log_every and self.steps % self.log_every == 0:
            self.report()
        return loss

    def _device_step(self, params, loss, closure):
        """The step of any other case (an accelerator's, or ranks to agree with): the
        flag stays on the device and the update is skipped there; returns the flag."""
        found = self._agreed(self._found(params, loss))
        if self.clip_norm is not None:
            self._clip(params, found)
        if self._first_state(params) or (not self._native_found_inf() and (
                self._on_host(found) or self._state_on_cpu(found))):
            # The step would create state (a first step): a skipped one must create
            # none (fused SGD's momentum buffer is allocated, not written, when it
            # skips). One sync, on such steps only. On the CPU (_on_host) reading the
            # flag waits for nothing: an optimizer without found_inf steps or not by it
            # instead of stepping and restoring. State on the CPU for parameters on an
            # accelerator (_state_on_cpu) could only be restored by reading the flag:
            # read once, and no copy or restore.
            if not bool(found):
                self._call_step(closure)
        elif self._native_found_inf():
            optimizer = self.optimizer
            prior_found = getattr(optimizer, "found_inf", None)
            prior_scale = getattr(optimizer, "grad_scale", None)
            combined = found.reshape(()) if prior_found is None else torch.maximum(
                found.reshape(()), prior_found.to(found.device, torch.float32).reshape(()))
            optimizer.found_inf, optimizer.grad_scale = combined, prior_scale
            try:
                self._call_step(closure)
            finally:
                for name, prior in (("found_inf", prior_found), ("grad_scale", prior_scale)):
                    if prior is None:
                        if hasattr(optimizer, name):
                            delattr(optimizer, name)
                    else:
                        setattr(optimizer, name, prior)
        else:
            self._step_with_restore(found, closure)
        counted = found.to(torch.int64).reshape(())
        self.skipped = counted if self.skipped is None else self.skipped + counted.to(self.skipped.device)
        return found

    def _localize(self, closure, rng):
        """Runs the skipped step's closure again under detect_anomaly (the first
        skipped step only). Its gradients are discarded (grads are None after it)
        and its forward runs again (module buffers such as BatchNorm's running
        statistics are updated a second time)."""
        state = _rng_state()
        _set_rng_state(rng)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with detect_anomaly():
                with torch.enable_grad():
                    closure()
            self.last_report = False  # located once: not reproducible
            message = "the re-run under detect_anomaly produced no NaN or inf (not reproducible)"
        except NonFiniteError as error:
            self.last_report = error
            message = str(error)
        finally:
            _set_rng_state(state)
            self.optimizer.zero_grad(set_to_none=True)
        warnings.warn(f"nanfree.optim.FiniteGuard: step {self.steps} skipped; {message}",
                      stacklevel=3)
