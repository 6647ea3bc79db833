"""Never apply a non-finite step: ``nanfree.optim.FiniteGuard``.

``FiniteGuard(optimizer)`` wraps any optimizer. Its ``step()`` checks the
gradients (and the loss, when given) for NaN and inf on their device, with one
fused check per device and dtype (``torch._amp_foreach_non_finite_check_and_unscale_``,
GradScaler's kernel), and skips the update on the device, without a host sync:

- an optimizer that takes a ``found_inf`` flag (the fused implementations of
  Adam, AdamW, SGD, ...: ``_step_supports_amp_scaling``) gets the flag and skips
  the update itself;
- any other optimizer steps, and every parameter and state tensor it changed is
  put back where the flag is set (``torch.where`` from a copy taken before the
  step): the same result, at the cost of one copy of the parameters and state.

With ``clip_norm``, the gradients are clipped by their total norm first, with a
coefficient that a non-finite norm cannot turn into NaN or 0 in every gradient
(``torch.nn.utils.clip_grad_norm_`` with one inf gradient writes NaN or 0 into
all of them): a non-finite norm leaves the gradients as they are (the step is
skipped anyway).

Skips are counted on the device (``skipped``); every ``log_every`` steps the
count is read (one sync) and a new skip is logged as a warning, and reading
``skipped_steps`` syncs too: never silent. The optimizer's ``step`` is called
on every step, so LR schedulers stay in step.

``guard.step(closure)`` runs the closure (forward and backward, returning the
loss) itself; with ``locate=True`` a skipped step is run again under
``nanfree.debug.detect_anomaly`` with the same parameters, random state and
batch, and the report of the first op that produced a non-finite value is kept
in ``last_report`` (and logged). Locating reads the flag after each step (one
sync); it runs only after a detection.
"""

import warnings

import torch

from .debug import NonFiniteError, detect_anomaly

__all__ = ["FiniteGuard"]


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
    given as a closure with ``nanfree.debug.detect_anomaly``.
    """

    def __init__(self, optimizer, *, clip_norm=None, norm_type=2.0, log_every=100, locate=False):
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
        self.steps = 0
        self.skipped = None  # device counter of skipped steps (int64), made on first use
        self._logged = 0
        self.last_report = None

    # The optimizer's interface, passed through.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps,
                "skipped": self.skipped_steps}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        self.skipped = None if not state["skipped"] else torch.tensor(state["skipped"])
        self._logged = state["skipped"]

    @property
    def skipped_steps(self):
        """How many steps were skipped (reads the device counter: a sync)."""
        return 0 if self.skipped is None else int(self.skipped)

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]
                if p.grad is not None]

    def _found(self, params, loss):
        """A float flag [1] on the first parameter's device: 1 when the loss or a gradient
        is non-finite. One fused check per device and dtype group, no sync."""
        device = params[0].device if params else (loss.device if loss is not None else "cpu")
        found = torch.zeros(1, device=device)
        groups = {}
        for p in params:
            if p.grad.is_sparse:
                grad = p.grad.coalesce()._values()
            else:
                grad = p.grad
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        one = {}
        for (dev, _), grads in groups.items():
            flag = torch.zeros(1, device=dev)
            scale = one.setdefault(dev, torch.ones(1, device=dev))
            # GradScaler's kernel with scale 1: sets flag where a value is NaN or inf,
            # leaves the gradients as they are.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, scale)
            found = torch.maximum(found, flag.to(device, non_blocking=True))
        if loss is not None:
            bad = (~torch.isfinite(loss.detach())).any().to(device=device, dtype=found.dtype)
            found = torch.maximum(found, bad.reshape(1))
        return found

    def _clip(self, params, found):
        """Clip by the total norm; a non-finite norm (the step is skipped) leaves the
        gradients unchanged instead of NaN or 0."""
        grads = [p.grad for p in params if not p.grad.is_sparse]
        if not grads:
            return
        total = torch.nn.utils.get_total_norm(grads, self.norm_type, error_if_nonfinite=False)
        coefficient = self.clip_norm / (total + 1e-6)
        # 1 where the norm is within the bound or non-finite (inf / inf would be NaN).
        coefficient = torch.where(torch.isfinite(total) & (coefficient < 1), coefficient, 1.0)
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))

    def _native_found_inf(self):
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def _step_with_restore(self, found):
        """Any optimizer: step, then put every changed tensor back where found is set."""
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        tensors += [v for s in self.optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.layout == torch.strided]
        known = {id(t) for t in tensors}
        saved = [t.detach().clone() for t in tensors]
        self.optimizer.step()
        keep = found.reshape(()).bool()
        with torch.no_grad():
            torch._foreach_copy_(tensors, [torch.where(keep.to(t.device), old, t)
                                           for t, old in zip(tensors, saved)])
            # State the step created (a first step's moments): zeroed where skipped,
            # as if the step had not run (the optimizer treats zero moments as fresh).
            for s in self.optimizer.state.values():
                for v in s.values():
                    if isinstance(v, torch.Tensor) and id(v) not in known:
                        v.copy_(torch.where(keep.to(v.device), torch.zeros_like(v), v))

    def step(self, closure=None, *, loss=None):
        """One guarded step. ``closure``: runs forward and backward and returns the
        loss (as ``optimizer.step(closure)``); ``loss``: the loss already computed,
        checked with the gradients. Returns the loss."""
        rng = _rng_state() if closure is not None and self.locate else None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        found = self._found(params, loss if isinstance(loss, torch.Tensor) else None)
        if self.clip_norm is not None:
            self._clip(params, found)
        if self._native_found_inf():
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = found.reshape(())
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale
        else:
            self._step_with_restore(found)
        counted = found.to(torch.int64).reshape(())
        self.skipped = counted if self.skipped is None else self.skipped + counted.to(self.skipped.device)
        self.steps += 1
        if self.locate and rng is not None and bool(found):  # one sync, only when locating
            self._localize(closure, rng)
        if self.log_every and self.steps % self.log_every == 0:
            self._log()
        return loss

    def _localize(self, closure, rng):
        state = _rng_state()
        _set_rng_state(rng)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            with detect_anomaly():
                with torch.enable_grad():
                    closure()
            self.last_report = None
            message = "the re-run under detect_anomaly produced no NaN or inf (not reproducible)"
        except NonFiniteError as error:
            self.last_report = error
            message = str(error)
        finally:
            _set_rng_state(state)
            self.optimizer.zero_grad(set_to_none=True)
        warnings.warn(f"nanfree.optim.FiniteGuard: step {self.steps} skipped; {message}",
                      stacklevel=3)

    def _log(self):
        skipped = self.skipped_steps
        if skipped > self._logged:
            warnings.warn(f"nanfree.optim.FiniteGuard: {skipped - self._logged} of the last steps "
                          f"skipped (non-finite loss or gradients); {skipped} of {self.steps} in all",
                          stacklevel=3)
            self._logged = skipped
