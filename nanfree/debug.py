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

How: a C++ per-op observer (csrc/debug_observer.cpp, ATen's RecordFunction
callbacks) sees every dispatcher op, forward and backward, without Python per
op, checks the outputs of each outermost op (contiguous CPU tensors by one scan,
others by their sum, then the exact test where that is not finite) and records
the ops that made what the region reports; a ``TorchFunctionMode`` raises a
forward finding when the torch call that ran the op returns, and stamps the
autograd nodes each call made (by their sequence numbers) with the call, module
path and line; global module hooks keep the stack of modules being run. A
backward op's NaN or inf is reported only once it reaches its autograd node's
outputs (a C++ hook on the node, which aborts the backward): torch's backward
formulas mask some intermediate values. Without the compiled extension a
``TorchDispatchMode`` runs the same checks in Python. docs/debug.md has the
costs (about 1.3-1.8x a plain step on the benchmark's models).

Under ``torch.compile``, code inside the region runs eagerly
(``torch.compiler.set_stance("force_eager")``), so that every op is seen; a
warning says so once.
"""

import bisect
import contextlib
import functools
import linecache
import math
import os
import sys
import sysconfig
import threading
import warnings
import weakref

import torch

try:  # the per-op check of CPU tensors in C++; without the extension, the sum-first check
    from nanfree._C import any_nonfinite as _any_nonfinite
except ImportError:
    _any_nonfinite = None
try:  # the per-op observer in C++ (csrc/debug_observer.cpp); else a TorchDispatchMode
    from nanfree import _C as _OBSERVER
    if not hasattr(_OBSERVER, "anomaly_observer_start"):
        _OBSERVER = None
except ImportError:
    _OBSERVER = None
_next_sequence_nr = getattr(_OBSERVER, "next_sequence_nr", None)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["detect_anomaly", "NonFiniteError"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})
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


@functools.lru_cache(maxsize=4096)
def _internal(filename):
    """Whether a frame's file is torch's, nanfree's or the standard library's
    (whose folder may hold site-packages: the libraries there are the user's).
    Cached: the stamps of a step ask about the same few files per op."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith((_HERE + os.sep, _TORCH + os.sep)):
        return True
    return path.startswith(_STDLIB) and not path.startswith(_SITE)


def _source(location):
    path, _, line = location.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    return f"{location}: {text}" if text else location


def _checked(t):
    """A dense tensor with values (not sparse, meta or fake) of a floating or
    complex dtype, as a tensor isfinite runs on (float8 upcast), else None."""
    if t.layout != torch.strided or t.device.type == "meta" or t.numel() == 0 \
            or not (t.is_floating_point() or t.is_complex()):
        return None
    if type(t).__name__ == "FakeTensor":
        return None
    if t.is_floating_point() and t.element_size() == 1:
        return t.detach().float()  # float8: no isfinite of its own
    return t.detach()


def _stats(t):
    """Counts and finite range of a floating tensor (one sync each: only on failure)."""
    x = _checked(t)
    if x is None:
        x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)  # counts and range over real and imaginary parts
    finite = torch.isfinite(x)
    values = x[finite]
    return dict(
        dtype=str(t.dtype).replace("torch.", ""), shape=list(t.shape),
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


_SCHEMAS = {}  # op -> (its written arguments [(index, name, kwarg_only)], whether it only views)


def _schema_facts(func):
    """What the checks need of an op's schema, read once per op."""
    facts = _SCHEMAS.get(func)
    if facts is None:
        try:
            schema = func._schema
            written = [(i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
            # Every output a view of an input (view, t, expand, detach, ...): its
            # values were checked where they were made.
            views = bool(schema.returns) and not written and all(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        except AttributeError:
            written, views = [], False
        facts = _SCHEMAS[func] = (written, views)
    return facts


def _written_arguments(func, args, kwargs):
    """The tensors an op writes in place (its schema's `(a!)` arguments)."""
    written = []
    for i, name, kwarg_only in _schema_facts(func)[0]:
        written += _tensors(args[i] if i < len(args) and not kwarg_only else kwargs.get(name))
    return written


def _op_name(func):
    name = str(func)  # e.g. "aten.div.Tensor", "nanfree.softmax.default"
    return name[:-len(".default")] if name.endswith(".default") else name


def _paths_below(parent):
    """{module: its path below parent} for parent's descendants (the first path of
    one reached twice), in a WeakKeyDictionary."""
    found = weakref.WeakKeyDictionary()
    for name, module in parent.named_modules():
        if name and module not in found:
            found[module] = name
    return found


# The code of nn.Module's __call__ body: each frame running it is a module being
# run, its `self` the module.
_CALL_IMPL = torch.nn.Module._call_impl.__code__


class _ModuleStack:
    """Qualified names of the modules being run, read from the Python stack: each
    frame of nn.Module's __call__ is a module running (no module hooks: torch's
    global hooks cost every module call of the region a few microseconds)."""

    def __init__(self, names=None):
        # module -> path: the model's (kept across regions), or this region's own.
        self.names = weakref.WeakKeyDictionary() if names is None else names
        self.below = weakref.WeakKeyDictionary()  # parent -> _descendants(parent)

    def locate(self, frame):
        """(innermost module's path, 'file:line' of the innermost user frame) of
        the code running at `frame`, in one walk of the stack; the path is ''
        outside every module, the class name for the root of an unnamed tree."""
        location = None
        running = []  # modules, innermost first, up to the first with a path
        known = False  # running[-1] has a path: the outer ones are not needed
        while frame is not None:
            code = frame.f_code
            if code is _CALL_IMPL:
                if not known:
                    module = frame.f_locals.get("self")
                    if module is not None:
                        running.append(module)
                        known = module in self.names
            elif location is None and not _internal(code.co_filename):
                location = f"{code.co_filename}:{frame.f_lineno}"
            if known and location is not None:
                break
            frame = frame.f_back
        return self._path(running), location or "<unknown>"

    def _path(self, running):
        if not running:
            return ""
        # Named from the innermost module with a path (or the outermost, a root
        # named by its class) inwards: a descendant, not only a child, as
        # containers (ModuleList) are not run. Kept: a module run again (every
        # step of a loop) is not searched for again; one reached from two
        # parents keeps the path it was first run under.
        parent = running[-1]
        parent_name = self.names.get(parent)
        if parent_name is None:
            parent_name = self.names[parent] = type(parent).__name__
        for module in reversed(running[:-1]):
            name = self.names.get(module)
            if name is None:
                child = self._descendants(parent).get(module, type(module).__name__)
                name = self.names[module] = f"{parent_name}.{child}" if parent_name else child
            parent, parent_name = module, name
        return parent_name or type(parent).__name__

    def _descendants(self, parent):
        """{module: its path below parent}, one walk of parent's tree per region."""
        found = self.below.get(parent)
        if found is None:
            found = self.below[parent] = _paths_below(parent)
        return found


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
    module path and user line that made it (read back in the backward by
    `find`), and raises the observer's findings when a call returns.

    A node is stamped by its sequence number: the autograd nodes a call makes
    (its output's and, for a composite function, the interior ones) take the
    consecutive numbers the thread hands out while the call runs, so one
    (first, end) range per call that made any records them all, without
    walking the graph. Without the C++ extension the nodes are walked and
    stamped in their metadata."""

    def __init__(self, modules, observer=None):
        super().__init__()
        self.modules = modules
        self.observer = observer  # _Observer: its findings are raised when a call returns
        self.stamps = []  # (first, end, func, module path, location), by first

    def __torch_function__(self, func, types, args=(), kwargs=None):
        first = _next_sequence_nr() if _next_sequence_nr is not None else None
        try:
            out = func(*args, **(kwargs or {}))
        except RuntimeError:
            # A backward aborted by the observer's node hook: the report instead.
            if self.observer is not None:
                self.observer.raise_first()
            raise
        if self.observer is not None and _OBSERVER.anomaly_confirmed():
            self.observer.raise_first()
        if first is None:
            self._stamp_by_walk(func, out)
        else:
            end = _next_sequence_nr()
            if end != first:
                self.stamps.append((first, end, func, *self.modules.locate(sys._getframe(1))))
        return out

    def find(self, node):
        """(forward call, module path, location) of the call that made node, or
        None when the region's forward did not make it."""
        stamp = node.metadata.get(_META_KEY)
        if stamp is not None or not self.stamps:
            return stamp
        seq = node._sequence_nr()
        i = bisect.bisect_right(self.stamps, (seq, math.inf)) - 1
        if i < 0 or not self.stamps[i][0] <= seq < self.stamps[i][1]:
            return None
        first, end, func, module, location = self.stamps[i]
        return _call_name(func), module, location

    def _stamp_by_walk(self, func, out):
        if torch.is_grad_enabled():
            stamp = None
            # The output's node and the nodes behind it that this call made
            # (a composite function's interior): every unstamped one.
            todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
            while todo:
                node = todo.pop()
                if node is None or _META_KEY in node.metadata \
                        or type(node).__name__ == "AccumulateGrad":
                    continue
                stamp = stamp or (_call_name(func), *self.modules.locate(sys._getframe(1)))
                node.metadata[_META_KEY] = stamp
                todo += [n for n, _ in node.next_functions]


# Ops whose output is allocated, not computed.
_UNINITIALIZED = {getattr(torch.ops.aten, name) for name in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "resize_as_", "set_")}


def _allowed_by_name(allow, op, module):
    """Whether `allow` names the op (full, short, or without its trailing _)
    or the module path or one of its parents."""
    short = op.split(".")[1] if op.count(".") >= 1 else op
    return any(a in (op, short, short.rstrip("_"))
               or (module and (module == a or module.startswith(a + ".")))
               for a in allow)


class _Observer:
    """The region's per-op checks by the C++ observer (csrc/debug_observer.cpp):
    it records, without Python per op, each outermost op whose outputs hold what
    the region reports (a backward one only once its autograd node's outputs
    hold it too), and aborts a backward at such a node; this class turns the
    first finding that `allow` does not let pass into NonFiniteError, when the
    torch call that ran it returns (_ForwardStamps) or when the region ends."""

    def __init__(self, modules, check_inf, allow):
        self.modules = modules
        self.check_inf = check_inf
        self.allow = tuple(allow)
        self.stamps = None  # the region's _ForwardStamps

    def __enter__(self):
        _OBSERVER.anomaly_observer_start(self.check_inf, bool(self.allow))
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            # A region ending normally, or by a backward the node hook aborted (a
            # RuntimeError); a NonFiniteError already raised is the first finding.
            if exc is None or (isinstance(exc, RuntimeError)
                               and not isinstance(exc, NonFiniteError)):
                self.raise_first()
        finally:
            _OBSERVER.anomaly_observer_stop()
        return False

    def raise_first(self):
        """Raise the first confirmed finding that `allow` does not let pass."""
        if not _OBSERVER.anomaly_confirmed():
            return
        for f in _OBSERVER.anomaly_take_confirmed():
            node = f["node"]
            if node is None:
                module, location = self.modules.locate(sys._getframe(1))
                phase, forward = "forward", None
            else:
                phase = "backward"
                forward, module, location = self.stamps.find(node) or (None, "", "<not recorded>")
            # -inf alone, passed on from an input that held -inf or from an allowed op or module.
            if self.allow and f["minus_inf_only"] and (
                    f["minus_inf_in"] or _allowed_by_name(self.allow, f["op"], module)):
                continue
            raise _error(f["op"], phase, node, forward, module, location, f["inputs"],
                         f["outputs"], f["offending"], f["bad_inputs"])


class _Checker(TorchDispatchMode):
    """The region's per-op checks without the C++ observer: Python around every op."""

    def __init__(self, modules, stamps, check_inf, allow):
        super().__init__()
        self.modules = modules
        self.stamps = stamps
        self.check_inf = check_inf
        self.allow = tuple(allow)
        self.fresh = weakref.WeakValueDictionary()  # id -> tensor just allocated, unwritten
        self.pending = {}  # id(node) -> the first error of a backward node still running
        # Set, per thread, while the checks run their own ops outside __torch_dispatch__
        # (backward runs on per-device threads, which share the mode).
        self.own = threading.local()

    def _nonfinite(self, tensors):
        """Whether any of the tensors may hold NaN or +-inf. Contiguous CPU
        tensors: the exact answer of one C++ call for all of them
        (nanfree._C.any_nonfinite, the region's NaN-or-inf or NaN-only rule).
        Others: the sum of a tensor is finite when all its entries are (a NaN or
        an inf makes it NaN or inf; finite entries whose sum overflows only send
        the op to the exact check). One reduction and one read per tensor, no
        allocation of its size: about 20x cheaper on the CPU than
        isfinite().any(), a composite of several ops."""
        if _any_nonfinite is not None:
            found = _any_nonfinite(tensors, self.check_inf)
            if found >= 0:  # -1: a tensor the C++ scan does not read
                return bool(found)
        return self._sums_nonfinite(tensors)

    @staticmethod
    def _sums_nonfinite(tensors):
        """_nonfinite's check of the tensors the C++ scan does not read: their sums."""
        for t in tensors:
            x = _checked(t)
            if x is None:
                continue
            if x.is_complex():
                x = torch.view_as_real(x)
            total = x.sum(dtype=torch.float32) if x.element_size() < 4 else x.sum()
            if not math.isfinite(total.item()):
                return True
        return False

    def _bad(self, t):
        """Whether t holds what the region reports: NaN or +-inf, or NaN only."""
        if _any_nonfinite is not None:
            found = _any_nonfinite([t], self.check_inf)
            if found >= 0:
                return bool(found)
        if not self._sums_nonfinite([t]):
            return False
        x = _checked(t)  # the exact check: a sum may also overflow from finite entries
        return bool((~torch.isfinite(x) if self.check_inf else torch.isnan(x)).any())

    def _allowed(self, op, module, t, minus_inf_in):
        """-inf alone (no NaN, no +inf), from an op or module the user allowed,
        or passed on from an input that held -inf (a view, copy or reduction of
        an allowed mask), once anything is allowed."""
        x = _checked(t)
        if not self.allow or x is None or x.is_complex() or bool(torch.isnan(x).any()) \
                or bool((x == float("inf")).any()):
            return False
        return minus_inf_in or _allowed_by_name(self.allow, op, module)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The checks' own ops pass; views: nothing new to check.
        if getattr(self.own, "ops", False) or _schema_facts(func)[1]:
            return func(*args, **kwargs)
        if func.overloadpacket in _UNINITIALIZED:
            # Memory not yet written (whatever bits it holds are not a result):
            # not checked, and not "held" by an op that writes it next.
            out = func(*args, **kwargs)
            for t in _tensors(out):
                self.fresh[id(t)] = t
            return out
        written = _written_arguments(func, args, kwargs)
        # An argument the op writes: whether it held a non-finite value before.
        held = {id(t) for t in written if self.fresh.pop(id(t), None) is not t and self._bad(t)}
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        seen = {id(t) for t in outputs}
        outputs += [t for t in written if id(t) not in seen]
        if not self._nonfinite(outputs):  # the common case: one reduction per output
            return out
        offending = [t for t in outputs if self._bad(t)]
        if not offending:
            return out
        op = _op_name(func)
        node = torch._C._current_autograd_node()
        if node is None:
            module, location = self.modules.locate(sys._getframe(1))
            phase, forward = "forward", None
        else:
            phase = "backward"
            forward, module, location = self.stamps.find(node) or (None, "", "<not recorded>")
        written_ids = {id(t) for t in written}
        inputs = _tensors((args, kwargs))
        # Written arguments count as inputs by what they held before the op.
        bad_inputs = [t for t in inputs if (id(t) in held if id(t) in written_ids
                                            else self._bad(t))]
        read = [_checked(t) for t in inputs if id(t) not in written_ids]
        minus_inf_in = any(x is not None and bool((x == float("-inf")).any()) for x in read)
        if all(self._allowed(op, module, t, minus_inf_in) for t in offending):
            return out
        error = _error(op, phase, node, forward, module, location, inputs, outputs, offending,
                       bad_inputs)
        if node is None or bad_inputs:
            raise error
        self._defer(node, error)
        return out

    def _defer(self, node, error):
        """A backward op's NaN or inf is reported only if it reaches its node's
        outputs: torch's backward formulas compute some values that they then
        mask (linalg_vector_norm's gradient at a zero vector divides 0 by 0 and
        replaces the NaN by 0), so a non-finite intermediate is not yet a
        non-finite gradient. The first one of a node is kept, and a hook run
        when the node finishes raises it if an output is not finite."""
        key = id(node)
        if key in self.pending:
            return
        self.pending[key] = error

        def finished(grad_inputs, grad_outputs):
            kept = self.pending.pop(key, None)
            if kept is None:
                return
            outputs = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
            # The hook runs with the region's mode active: the check's own ops (a
            # sum of each CUDA gradient) must not be checked as the region's.
            before = getattr(self.own, "ops", False)
            self.own.ops = True
            try:
                bad = any(self._bad(g) for g in outputs)
            finally:
                self.own.ops = before
            if bad:
                raise kept

        node.register_hook(finished)


def _error(op, phase, node, forward, module, location, inputs, outputs, offending, bad_inputs):
    records = [dict(_stats(t), role=kind)
               for kind, group in (("output", offending), ("input", bad_inputs)) for t in group]
    what = "NaN or inf" if any(
        r["posinf"] or r["neginf"] for r in records if r["role"] == "output") else "NaN"
    lines = [f"nanfree.debug.detect_anomaly: {op} produced {what} in the {phase}"]
    if node is not None:
        lines.append(f"  autograd node: {node.name()}"
                     + (f", made by the forward call {forward}" if forward else ""))
    lines.append(f"  module: {module or '(no module)'}")
    lines.append(f"  {'forward line' if node is not None else 'line'}: {_source(location)}")
    lines.append(f"  inputs: {', '.join(map(_describe, inputs)) or '(none)'}")
    lines.append(f"  outputs: {', '.join(map(_describe, outputs))}")
    for r in records:
        lines.append(
            f"  {r['role']} {r['dtype']}{r['shape']}: {r['nan']} NaN, {r['posinf']} +inf, "
            f"{r['neginf']} -inf, {r['zeros']} zeros, finite range "
            f"[{r['finite_min']}, {r['finite_max']}]")
    if bad_inputs:
        lines.append("  an input already held a non-finite value: this op passed it on; it "
                     "entered the region from outside (data, parameters or earlier code)")
    return NonFiniteError("\n".join(lines), op=op, phase=phase, node=node, forward_op=forward,
                          module=module, location=location, tensors=records,
                          inherited=bool(bad_inputs))


_WARNED_COMPILE = []
_ACTIVE = []  # the region being run (one at a time: nested ones run under it)
# model -> {submodule: its path}, walked once per model, not at each region (a
# training loop enters one per step). A submodule added later is found by its
# parent's search when it runs (_ModuleStack._path).
_MODEL_NAMES = weakref.WeakKeyDictionary()


def _model_names(model):
    names = _MODEL_NAMES.get(model)
    if names is None:
        names = _MODEL_NAMES[model] = _paths_below(model)
        names[model] = ""
    return names


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
        self._stacks = []  # one per entry (a decorator's instance is entered again)

    def __enter__(self):
        # Nested regions (also a decorated function calling itself) run under
        # the outermost one: its settings apply, and nothing is checked twice.
        if _ACTIVE:
            self._stacks.append(None)
            return self
        if not _WARNED_COMPILE:
            _WARNED_COMPILE.append(True)
            warnings.warn("nanfree.debug.detect_anomaly: code compiled with torch.compile runs "
                          "eagerly inside the region, so that every op is checked", stacklevel=2)
        modules = _ModuleStack(_model_names(self.model) if self.model is not None else None)
        # Built in a stack that undoes whatever was installed if a step fails.
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            if _OBSERVER is not None:
                observer = stack.enter_context(_Observer(modules, self.check_inf, self.allow))
                observer.stamps = stack.enter_context(_ForwardStamps(modules, observer))
            else:
                stamps = stack.enter_context(_ForwardStamps(modules))
                stack.enter_context(_Checker(modules, stamps, self.check_inf, self.allow))
            self._stacks.append(stack.pop_all())
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        stack = self._stacks.pop()
        if stack is None:
            return False
        _ACTIVE.pop()
        return stack.__exit__(*exc)
