"""Every catalogue case of the ``tests/cases`` registry (``PARITY``, one module per family) against Optax.

Each case runs 20 steps through tests/_parity.py's driver: every step's updates, the final params and the
final state equal Optax's, and the donated (in-place) run equals the pure one. Optax runs op by op: one
compile per case cost twice the CPU time of running the cases' ops, whose kernels JAX caches per shape. A
family's own test file keeps what this driver cannot say (Optax's test inputs, trajectories, errors, dtypes).
"""

import pytest

from tests import cases
from tests._parity import assert_parity

CASES = cases.merged("PARITY")


@pytest.mark.optax
@pytest.mark.parametrize("case", CASES)
def test_matches_optax(case):
    optax = pytest.importorskip("optax")
    ours, theirs, *options = CASES[case]
    assert_parity(ours(), theirs(optax), **{"jit": False, **(options[0] if options else {})})
