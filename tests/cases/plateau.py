"""Catalogue cases of this family (see tests/cases/__init__.py): ``reduce_on_plateau``.

Its update needs ``value=`` and the suite-wide harnesses call ``update(g, state, params)``, so the cases
run it fed a constant value (every decision after the first is then a plateau: with ``patience=1`` the
scale drops, the cooldown runs, and so on). tests/test_reduce_on_plateau.py feeds real value sequences.
"""

import torch

import fxtrain as fx
from fxtrain._base import _Update, kernel, traits

VALUE = 1.0


def _fed(tx: fx.GradientTransformation) -> fx.GradientTransformation:
    """``tx`` with ``value=VALUE`` passed to each update; same kernel, state and repr."""
    inner = kernel(tx)

    def update_fn(updates, state, params=None):
        return inner(updates, state, params, value=torch.tensor(VALUE))

    return fx.GradientTransformation(tx.init, _Update(update_fn, lambda: repr(tx),
                                                      traits(tx)._replace(extra_args=False)))


def _optax_fed(otx):
    import jax.numpy as jnp
    import optax

    return optax.GradientTransformation(otx.init, lambda u, s, p=None: otx.update(u, s, p, value=jnp.float32(VALUE)))


CONFORMANCE: dict = {
    "reduce_on_plateau": lambda: _fed(fx.contrib.reduce_on_plateau(factor=0.5, patience=1, cooldown=1)),
}
COMPOSABLE: dict = {
    "reduce_on_plateau": (lambda: _fed(fx.contrib.reduce_on_plateau(factor=0.5, patience=2, cooldown=1,
                                                                    accumulation_size=2, min_scale=0.1)),
                          lambda o: _optax_fed(o.contrib.reduce_on_plateau(factor=0.5, patience=2, cooldown=1,
                                                                           accumulation_size=2, min_scale=0.1))),
}
OPTIMIZERS: dict = {}
DTENSOR: dict = {}
