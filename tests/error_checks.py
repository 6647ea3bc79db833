"""What the error tests of every op family share: the check that an argument
error is raised before any kernel runs."""

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only look at metadata or make a view or a cast; anything else (a
# nanfree op above all) is a kernel that ran before the error.
NO_KERNEL = ("aten.promote_types.", "aten.expand.", "aten.permute.", "aten.view.",
             "aten.unsqueeze.", "aten.alias.", "aten.detach.", "aten._to_copy.",
             "aten.movedim.", "aten.t.", "aten.reshape.", "aten._unsafe_view.")


class _Recorder(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher's Python key and
    returns (an op whose own argument checks raise is not recorded)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        return out


def raises_before_any_kernel(exception, match, fn, *args, **kwargs):
    """fn(*args, **kwargs) raises `exception` matching `match`, and no kernel ran first."""
    with _Recorder() as recorder, pytest.raises(exception, match=match):
        fn(*args, **kwargs)
    kernels = [op for op in recorder.ops if not op.startswith(NO_KERNEL)]
    assert not kernels, f"ran {kernels} before raising"
