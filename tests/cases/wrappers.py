"""Catalogue cases of this family (see tests/cases/__init__.py): wrappers (fxtrain/transforms/_accumulation.py,
_masking.py, _conditionality.py, _lookahead.py, _flatten.py, _monitoring.py, _periodic.py).

Names from the modules that fxtrain/__init__.py imports explicitly are built through the module, so the
cases run before ``fx.<name>`` is listed there.
"""

import optree

import fxtrain as fx  # noqa: F401
from fxtrain import _base, tree
from fxtrain.transforms import _conditionality, _masking


def ndim_mask(params):
    """True for matrices and up, on torch and jax trees alike."""
    return optree.tree_map(lambda x: x.ndim >= 2, params)


def even_steps(step):
    """``step % 2 == 0`` on torch and jax counters alike: 3 conformance steps see both branches."""
    return step % 2 == 0


def doubled(updates):
    return optree.tree_map(lambda x: 2 * x, updates)


def lookahead_on_plain_params(**kwargs):
    """``lookahead`` as the conformance test drives every transform: plain params in, plain updates out.

    lookahead's params and updates are ``LookaheadParams(fast, slow)``; here the slow params ride in the
    state, ``(lookahead state, slow params)``, and the fast updates come back (not registered as a factory:
    a test adapter around lookahead's kernel, with lookahead's repr).
    """
    inner = fx.lookahead(**kwargs)

    def init_fn(params):
        return inner.init(params), tree.clone(params)

    def update_fn(updates, state, params=None):
        la_state, slow = state
        new, la_state = _base.kernel(inner)(updates, la_state, fx.LookaheadParams(fast=params, slow=slow))
        slow = tree.map(lambda s, d: s + d if d is not None else s, slow, new.slow)
        return new.fast, (la_state, slow)

    return fx.GradientTransformation(init_fn, _base._Update(update_fn, repr(inner), _base.traits(inner)))


CONFORMANCE: dict = {
    "apply_every": lambda: fx.apply_every(k=2),
    "lookahead": lambda: lookahead_on_plain_params(fast_optimizer=fx.sgd(0.1, momentum=0.9), sync_period=2,
                                                   slow_step_size=0.5, reset_state=True),
    "flatten": lambda: fx.flatten(fx.adam(1e-2)),
    "snapshot": lambda: fx.snapshot("norm", fx.tree.norm),
    "monitor": lambda: fx.monitor({"trace": fx.trace(0.5), "scaled": fx.scale(2.0)}),
    "measure_with_ema": lambda: fx.measure_with_ema(doubled, 0.9),  # a measure shaped like the updates
    "conditionally_transform": lambda: _conditionality.conditionally_transform(fx.adam(1e-2), even_steps),
    "conditionally_mask": lambda: _conditionality.conditionally_mask(fx.sgd(0.1, momentum=0.9), even_steps),
    "freeze": lambda: _masking.freeze(ndim_mask(fx.testing.nested_params())),
    "selective_transform": lambda: _masking.selective_transform(
        fx.adam(1e-2), freeze_mask={"dense": True, "blocks": False, "scalar": False}),
    "multi_transform": lambda: _masking.multi_transform(
        {"a": fx.adam(1e-2), "b": fx.sgd(0.1)}, lambda p: fx.tree.map(lambda x: "a" if x.ndim > 1 else "b", p)),
}

# One case per name (accumulate, masked, partition and apply_if_finite are run under torch.func by their
# own test files; lookahead's params are (fast, slow) pairs: tests/test_lookahead.py runs it under vmap).
COMPOSABLE: dict = {
    "apply_every": (lambda: fx.chain(fx.apply_every(k=2), fx.sgd(0.1, momentum=0.9)),
                    lambda o: o.chain(o.apply_every(k=2), o.sgd(0.1, momentum=0.9))),
    "flatten": (lambda: fx.flatten(fx.adam(1e-2)), lambda o: o.flatten(o.adam(1e-2))),
    "snapshot": (lambda: fx.chain(fx.sgd(0.1), fx.snapshot("doubled", doubled)),
                 lambda o: o.chain(o.sgd(0.1), o.snapshot("doubled", doubled))),
    "monitor": (lambda: fx.chain(fx.monitor({"trace": fx.trace(0.5), "doubled": doubled}), fx.sgd(0.1)),
                lambda o: o.chain(o.monitor({"trace": o.trace(0.5), "doubled": doubled}), o.sgd(0.1))),
    "measure_with_ema": (lambda: fx.measure_with_ema(doubled, 0.9), lambda o: o.measure_with_ema(doubled, 0.9)),
    "conditionally_transform": (lambda: _conditionality.conditionally_transform(fx.adam(1e-2), even_steps),
                                lambda o: o.conditionally_transform(o.adam(1e-2), even_steps)),
    "conditionally_mask": (lambda: _conditionality.conditionally_mask(fx.sgd(0.1, momentum=0.9), even_steps),
                           lambda o: o.conditionally_mask(o.sgd(0.1, momentum=0.9), even_steps)),
    "freeze": (lambda: fx.chain(_masking.freeze({"w": True, "b": False, "s": False}), fx.sgd(0.1)),
               lambda o: o.chain(o.freeze({"w": True, "b": False, "s": False}), o.sgd(0.1))),
    "selective_transform": (
        lambda: _masking.selective_transform(fx.adam(1e-2), freeze_mask={"w": False, "b": True, "s": False}),
        lambda o: o.selective_transform(o.adam(1e-2), freeze_mask={"w": False, "b": True, "s": False})),
    "multi_transform": (
        lambda: _masking.multi_transform({"a": fx.adam(1e-2), "b": fx.sgd(0.1)}, {"w": "a", "b": "b", "s": "a"}),
        lambda o: o.multi_transform({"a": o.adam(1e-2), "b": o.sgd(0.1)}, {"w": "a", "b": "b", "s": "a"})),
}

OPTIMIZERS: dict = {}

# flatten concatenates every leaf into one plain vector (DTensor leaves of different placements cannot
# be concatenated); its parity with the unflattened transform is tested on plain tensors.
DTENSOR: dict = {"flatten": "concatenates all leaves into one vector: no DTensor layout for it"}

# parity with Optax over 20 steps (tests/test_optax_parity.py)
PARITY: dict = {
    "flatten": (lambda: fx.flatten(fx.adamw(0.1, weight_decay=0.1)), lambda o: o.flatten(o.adamw(0.1, weight_decay=0.1))),
}


@fx.transform(elementwise=False, extra_args=True)
def reads_value():
    """Adds the ``value=`` extra argument to every update, when given (tests that wrappers forward extra
    arguments)."""
    def init_fn(params):
        del params
        return fx.EmptyState()

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del params, extra_args
        return fx.tree.map(lambda u: u if value is None else u + value, updates), state

    return fx.GradientTransformation(init_fn, update_fn)
