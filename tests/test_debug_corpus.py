"""nanfree.debug.detect_anomaly on the seeded failures of tests/debug_corpus.py:
the report names the producing op (for a backward failure, the forward call
its node belongs to), the phase and the module `block.fault` in every case."""

import pytest
from debug_corpus import CASES, nanfree_report

# Only torch's kernels run (the checks are Python around each op): the same in
# every backend's pass.
# Each case with each of the region's per-op checks (conftest.py: debug_checker).
pytestmark = [pytest.mark.backend_independent, pytest.mark.usefixtures("debug_checker")]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_report_names_the_op_and_the_module(case):
    op_named, module_named, error = nanfree_report(case)
    assert error is not None, "no NonFiniteError raised"
    assert error.phase == case.phase, str(error)
    assert op_named, str(error)
    assert module_named, str(error)
