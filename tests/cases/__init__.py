"""Catalogue cases by family, merged for the suite-wide tests (issue 18's acceptance).

Each module here (one per family, next to the family's own test file) defines up to five dicts:

* ``CONFORMANCE = {name: () -> transform}``: one case per public name (``fx.<name>`` or
  ``fx.contrib.<name>``), run by tests/test_conformance.py (pure, donated equal, state structure, dtypes,
  ``None`` leaves, repr) and tests/test_conformance_dtensor.py (DTensor leaves on 2 ranks equal plain ones).
* ``COMPOSABLE = {id: (() -> transform, optax_module -> Optax's transform or None)}``: run by
  tests/test_composable.py under ``torch.func.vmap``/``grad``/``jvp``/``jacrev`` against Optax under JAX.
* ``OPTIMIZERS = {name: () -> optimizer}``: run inside the recommended stack (tests/test_optimizers.py:
  ``accumulate``, ``amp_cast``, ``sharded_apply``).
* ``PARITY = {id: (() -> transform, optax_module -> Optax's transform[, options])}``: run by
  tests/test_optax_parity.py through tests/_parity.py's ``assert_parity`` (20 steps of updates, final params
  and state against Optax; donated equal to pure); ``options`` are ``assert_parity``'s keywords (``rtol``...).
* ``DTENSOR = {name: reason}``: conformance names not compared on DTensor leaves, each with why (e.g.
  randomness drawn per shard); a name that must *refuse* DTensor leaves is tested in its family's file.
"""

from __future__ import annotations

import importlib
import pkgutil

FAMILIES = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def merged(attr: str) -> dict:
    """``attr`` of every family module in one dict; a name defined twice is an error."""
    out: dict = {}
    for family in FAMILIES:
        part = getattr(importlib.import_module(f"{__name__}.{family}"), attr, {})
        clash = set(out) & set(part)
        assert not clash, f"tests/cases/{family}.py redefines {sorted(clash)}"
        out.update(part)
    return out
