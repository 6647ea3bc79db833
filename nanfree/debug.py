"""Finding the first NaN or inf: ``nanfree.debug.detect_anomaly``.

The use of ``torch.autograd.detect_anomaly``: a context manager (and a
decorator) around a forward and backward. Unlike torch's, it checks every op
the region runs, forward and backward, for NaN and for +-inf, and raises
``NonFiniteError`` at the first op whose output holds one, naming:

- the op (an aten op, or a nanfree op such as ``nanfree.softmax``), and
  whether it ran in the forward or the backward; for a backward op, the
  autograd node it belongs to and the forward call that made that node;
- the module path (``encoder.layers.2.attn``) of the forward call;
- the user's file and line (for a backward op: the forward call's line);
- the inputs' and outputs' dtypes and shapes, and per offending tensor the
  counts of NaN, +inf, -inf and zeros and its finite minimum and maximum;
- whether an input already held the non-finite value (then the op only passed
  it on: it entered the region from outside, e.g. from the data).

How: a ``TorchDispatchMode`` sees every aten op (the autograd engine carries it
to the backward); a ``TorchFunctionMode`` stamps each autograd node made in the
forward with the call, module path and line that made it; global module hooks
keep the stack of modules being run. Each output is checked with one
``isfinite`` reduction and a host sync per op: this version costs several
times a plain step (docs/debug.md has the figures), which is what remains of
issue 20's speed goal (device flags, per-op bookkeeping in C++).

Under ``torch.compile``, code inside the region runs eagerly
(``torch.compiler.set_stance("force_eager")``), so that every op is seen; a
warning says so once.
"""

import contextlib
import linecache
import os
import sys
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["detect_anomaly", "NonFiniteError"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# Frames inside these folders are not the user's line.
_INTERNAL = (_HERE, _TORCH, os.path.dirname(contextlib.__file__))
_META_KEY = "nanfree.debug.forward"


class NonFiniteError(RuntimeError):
    """Raised by ``detect_anomaly`` at the first op that produced NaN or +-inf.
    Attributes: ``op``, ``phase`` ("forward" or "backward"), ``node`` (the
    autograd node of a backward op, else None), ``forward_op``, ``module``,
    ``location`` ("file:line" of the user's forward call), ``tensors`` (a list
    of dicts, one per output and per non-finite input) and ``inherited`` (True
    when an input already held the value)."""

    def __init__(self, message, **details):
        super().__init__(message)
        for key, value in details.items():
            setattr(self, key, value)


def _user_location():
    """'file:line' of the innermost frame outside torch and nanfree."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_INTERNAL) and not path.startswith("<"):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _source(location):
    path, _, line = location.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return f"{location}: {text}" if text else location


def _stats(t):
    """Counts and finite range of a floating tensor (one sync each: only on failure)."""
    x = t.detach()
    finite = torch.isfinite(x)
    values = x[finite]
    return dict(
        dtype=str(x.dtype).replace("torch.", ""), shape=list(x.shape),
        nan=int(torch.isnan(x).sum()), posinf=int((x == float("inf")).sum()),
        neginf=int((x == float("-inf")).sum()), zeros=int((x == 0).sum()),
        finite_min=float(values.min()) if values.numel() else None,
        finite_max=float(values.max()) if values.numel() else None,
    )


def _describe(t):
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    return type(t).__name__


def _tensors(tree):
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _op_name(func):
    name = str(func)  # e.g. "aten.div.Tensor", "nanfree.softmax.default"
    return name[:-len(".default")] if name.endswith(".default") else name


class _ModuleStack:
    """Qualified names of the modules being run (their forward), innermost last."""

    def __init__(self):
        self.stack = []
        self.names = weakref.WeakKeyDictionary()
        self.handles = []

    def __enter__(self):
        hooks = torch.nn.modules.module
        self.handles = [hooks.register_module_forward_pre_hook(self._enter),
                        hooks.register_module_forward_hook(self._leave, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.stack.clear()

    def _enter(self, module, args):
        name = self.names.get(module)
        if name is None:
            child = type(module).__name__
            if self.stack:
                parent_name, parent = self.stack[-1]
                # A descendant, not only a child: containers (ModuleList) are not run.
                child = next((n for n, m in parent.named_modules() if m is module and n), child)
                name = f"{parent_name}.{child}" if parent_name else child
            else:
                name = child
        self.stack.append((name, module))

    def _leave(self, module, args, output):
        if self.stack and self.stack[-1][1] is module:
            self.stack.pop()

    def path(self):
        """The innermost module's path ('' for the root of `model`: its class name)."""
        if not self.stack:
            return ""
        name, module = self.stack[-1]
        return name or type(module).__name__


def _call_name(func):
    """torch.sqrt, Tensor.__truediv__, torch.nn.functional.linear, ..."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    for prefix, spelled in (("_VariableFunctionsClass.", "torch."), ("_TensorBase.", "Tensor."),
                            ("TensorBase.", "Tensor.")):
        if name.startswith(prefix):
            return spelled + name[len(prefix):]
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and "." not in name and module != "builtins" else name


class _ForwardStamps(TorchFunctionMode):
    """Stamps each autograd node made in the region's forward with the call,
    module path and user line that made it (read back in the backward)."""

    def __init__(self, modules):
        super().__init__()
        self.modules = modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            for t in _tensors(out):
                node = t.grad_fn
                if node is not None and _META_KEY not in node.metadata:
                    node.metadata[_META_KEY] = (_call_name(func), self.modules.path(),
                                                _user_location())
        return out


class _Checker(TorchDispatchMode):
    def __init__(self, modules, check_inf, allow):
        super().__init__()
        self.modules = modules
        self.check_inf = check_inf
        self.allow = tuple(allow)

    def _bad(self, t):
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            return False
        bad = ~torch.isfinite(t) if self.check_inf else torch.isnan(t)
        return bool(bad.any())

    def _allowed(self, op, module, t):
        """-inf alone (no NaN, no +inf), from an op or module the user allowed."""
        if not self.allow or bool(torch.isnan(t).any()) or bool((t == float("inf")).any()):
            return False
        short = op.split(".")[1] if op.count(".") >= 1 else op
        return any(a in (op, short) or (module and (module == a or module.startswith(a + ".")))
                   for a in self.allow)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = _tensors(out)
        offending = [t for t in outputs if self._bad(t)]
        if not offending:
            return out
        op = _op_name(func)
        node = torch._C._current_autograd_node()
        if node is None:
            phase, forward, module, location = "forward", None, self.modules.path(), _user_location()
        else:
            phase = "backward"
            forward, module, location = node.metadata.get(_META_KEY, (None, "", "<not recorded>"))
        if all(self._allowed(op, module, t) for t in offending):
            return out
        inputs = _tensors((args, kwargs))
        bad_inputs = [t for t in inputs if self._bad(t)]
        raise _error(op, phase, node, forward, module, location, inputs, outputs, offending,
                     bad_inputs)


def _error(op, phase, node, forward, module, location, inputs, outputs, offending, bad_inputs):
    what = "NaN or inf" if any(
        s["posinf"] or s["neginf"] for s in map(_stats, offending)) else "NaN"
    lines = [f"nanfree.debug.detect_anomaly: {op} produced {what} in the {phase}"]
    if node is not None:
        lines.append(f"  autograd node: {node.name()}"
                     + (f", made by the forward call {forward}" if forward else ""))
    lines.append(f"  module: {module or '(no module)'}")
    lines.append(f"  {'forward line' if node is not None else 'line'}: {_source(location)}")
    lines.append(f"  inputs: {', '.join(map(_describe, inputs)) or '(none)'}")
    lines.append(f"  outputs: {', '.join(map(_describe, outputs))}")
    records = []
    for kind, group in (("output", offending), ("input", bad_inputs)):
        for t in group:
            s = _stats(t)
            records.append(dict(s, role=kind))
            lines.append(
                f"  {kind} {s['dtype']}{s['shape']}: {s['nan']} NaN, {s['posinf']} +inf, "
                f"{s['neginf']} -inf, {s['zeros']} zeros, finite range "
                f"[{s['finite_min']}, {s['finite_max']}]")
    if bad_inputs:
        lines.append("  an input already held a non-finite value: this op passed it on; it "
                     "entered the region from outside (data, parameters or earlier code)")
    return NonFiniteError("\n".join(lines), op=op, phase=phase, node=node, forward_op=forward,
                          module=module, location=location, tensors=records,
                          inherited=bool(bad_inputs))


_WARNED_COMPILE = []


class detect_anomaly(contextlib.ContextDecorator):
    """Raise ``NonFiniteError`` at the first op, forward or backward, whose
    output holds NaN (or +-inf, with ``check_inf=True``) while the region runs.

    ``allow``: op names (``"masked_fill"``, ``"aten.masked_fill.Scalar"``) or
    module paths (``"encoder.layers.0.attn"``, which covers its submodules)
    whose ``-inf`` is intended, e.g. attention masks; NaN and +inf from them
    still raise. ``model``: the root module, whose attribute names give the
    module paths (without it the outermost module run is named by its class).
    Code compiled with ``torch.compile`` runs eagerly inside the region.
    """

    def __init__(self, check_inf=True, allow=(), model=None):
        if isinstance(allow, str):
            allow = (allow,)
        if not all(isinstance(a, str) for a in allow):
            raise TypeError("nanfree.debug.detect_anomaly: `allow` takes op names or module "
                            f"paths (strings), got {allow!r}")
        self.check_inf = bool(check_inf)
        self.allow = tuple(allow)
        self.model = model
        self._stack = None

    def __enter__(self):
        modules = _ModuleStack()
        if self.model is not None:
            modules.names[self.model] = ""
            for name, sub in self.model.named_modules():
                if name:
                    modules.names.setdefault(sub, name)
        stack = contextlib.ExitStack()
        stack.enter_context(modules)
        if not _WARNED_COMPILE:
            _WARNED_COMPILE.append(True)
            warnings.warn("nanfree.debug.detect_anomaly: code compiled with torch.compile runs "
                          "eagerly inside the region, so that every op is checked", stacklevel=2)
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(_ForwardStamps(modules))
        stack.enter_context(_Checker(modules, self.check_inf, self.allow))
        self._stack = stack
        return self

    def __exit__(self, *exc):
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc)
