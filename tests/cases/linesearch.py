"""Catalogue cases of this family (see tests/cases/__init__.py): Polyak's step size, line searches, L-BFGS.

The suite-wide tests call ``tx.update(g, state, params)`` with no extra arguments. Transforms that need
Optax's extra arguments (``value=``, and for line searches ``grad=`` and ``value_fn=``) are wrapped by
:func:`fed`, which computes them from a fixed objective and keeps the transform's repr and traits.
Under ``torch.func`` they are tested in tests/test_polyak.py and tests/test_linesearch.py.
"""

from __future__ import annotations

import torch

import fxtrain as fx
from fxtrain import tree
from fxtrain._base import _Update, call, traits


def objective(params) -> torch.Tensor:
    """``0.5 * sum(p**2)`` over the leaves, accumulated in float32, or float64 for float64 leaves (a
    float32 value would make finite differences of a float64 run noise)."""
    return 0.5 * sum(((p.double() if p.dtype == torch.float64 else p.float()) ** 2).sum() for p in tree.leaves(params))


def fed(tx: fx.GradientTransformation, line: bool = True) -> fx.GradientTransformation:
    """``tx`` whose ``update(g, state, params)`` passes ``value=objective(params)`` and, for a line search
    (``line``), ``grad=-g`` (so ``g`` is a descent direction for that gradient) and ``value_fn=objective``."""
    def update_fn(updates, state, params=None):
        extra = {"value": objective(params)}
        if line:
            with tree.functional():
                grad = tree.put(updates, updates, tree.neg_(tree.align(updates)[0]))
            extra.update(grad=tree.map(lambda p, g: torch.zeros_like(p) if g is None else g, params, grad),
                         value_fn=objective)
        return call(tx, updates, state, params, extra)

    return fx.GradientTransformation(tx.init, _Update(update_fn, repr(tx), traits(tx)._replace(extra_args=False)))


CONFORMANCE: dict = {
    "scale_by_polyak": lambda: fed(fx.scale_by_polyak(f_min=0.1, eps=1e-3), line=False),
    "polyak_sgd": lambda: fed(fx.polyak_sgd(max_learning_rate=0.5, variant="sps+"), line=False),
    "scale_by_backtracking_linesearch": lambda: fed(fx.scale_by_backtracking_linesearch(
        max_backtracking_steps=4, store_grad=True)),
    "scale_by_zoom_linesearch": lambda: fed(fx.scale_by_zoom_linesearch(max_linesearch_steps=6)),
    "scale_by_lbfgs": lambda: fx.scale_by_lbfgs(memory_size=2),
    "lbfgs": lambda: fed(fx.lbfgs(memory_size=2, linesearch=fx.scale_by_zoom_linesearch(
        max_linesearch_steps=4, initial_guess_strategy="one"))),
}
# Optax's side is None: un-jitted jax.grad through Optax's lbfgs (lax.scan op by op) takes ~45 s, and on the
# harness's gradients (not of any one objective) the ensemble's curvature pairs are near singular, so float32
# rounding grows past 1e-5 by step 18. tests/test_lbfgs.py compares vmap and grad with jitted Optax instead.
COMPOSABLE: dict = {
    "lbfgs": (lambda: fx.lbfgs(learning_rate=0.1, memory_size=3, linesearch=None), None),
}
OPTIMIZERS: dict = {
    "lbfgs": lambda: fx.lbfgs(learning_rate=0.1, memory_size=3, linesearch=None),
}
DTENSOR: dict = {}
