"""Catalogue cases of this family (see tests/cases/__init__.py): fxtrain/transforms/_normalizing.py and
fxtrain/transforms/_simple.py.

``per_example_layer_norm_clip`` has no conformance case (it sums away the batch axis, like
``per_example_global_norm_clip``, so it is not registered); tests/test_normalizing.py covers it.
"""

import optree

import fxtrain as fx


def _decayed(g, p):
    """``g + 0.1 p``: one expression that torch and JAX arrays both run."""
    return g + 0.1 * p


CONFORMANCE: dict = {
    "clip_by_block_rms": lambda: fx.clip_by_block_rms(0.3),
    "adaptive_grad_clip": lambda: fx.adaptive_grad_clip(0.1),
    "centralize": lambda: fx.centralize(),
    "normalize_by_update_norm": lambda: fx.normalize_by_update_norm(scale_factor=-0.5),
    "scale_by_param_block_norm": lambda: fx.scale_by_param_block_norm(),
    "scale_by_param_block_rms": lambda: fx.scale_by_param_block_rms(min_scale=0.5),
    "scale_by_distance_over_gradients": lambda: fx.scale_by_distance_over_gradients(reps_rel=1e-2),
    "ema": lambda: fx.ema(0.9),
    "zero_nans": lambda: fx.zero_nans(),
    "set_to_zero": lambda: fx.set_to_zero(),
    "stateless_with_tree_map": lambda: fx.stateless_with_tree_map(_decayed),
}

COMPOSABLE: dict = {
    "clip_by_block_rms": (lambda: fx.clip_by_block_rms(0.3), lambda o: o.clip_by_block_rms(0.3)),
    "adaptive_grad_clip": (lambda: fx.adaptive_grad_clip(0.1), lambda o: o.adaptive_grad_clip(0.1)),
    "centralize": (lambda: fx.centralize(), lambda o: o.centralize()),
    "normalize_by_update_norm": (lambda: fx.normalize_by_update_norm(scale_factor=-0.5),
                                 lambda o: o.normalize_by_update_norm(scale_factor=-0.5)),
    # times 0.1: updates proportional to the params' norm would grow the params over 20 steps
    "scale_by_param_block_norm": (lambda: fx.chain(fx.scale_by_param_block_norm(), fx.scale(0.1)),
                                  lambda o: o.chain(o.scale_by_param_block_norm(), o.scale(0.1))),
    "scale_by_param_block_rms": (lambda: fx.chain(fx.scale_by_param_block_rms(min_scale=0.5), fx.scale(0.1)),
                                 lambda o: o.chain(o.scale_by_param_block_rms(min_scale=0.5), o.scale(0.1))),
    # No Optax reference here: jax.grad through Optax's DoG is NaN (the gradient of sqrt(sum((p - p0)^2)) at
    # p = p0, the first step); fxtrain's norm has gradient 0 there. tests/test_normalizing.py compares values.
    "scale_by_distance_over_gradients": (lambda: fx.scale_by_distance_over_gradients(reps_rel=1e-2), None),
    "ema": (lambda: fx.ema(0.9), lambda o: o.ema(0.9)),
    "zero_nans": (lambda: fx.zero_nans(), lambda o: o.zero_nans()),
    "set_to_zero": (lambda: fx.set_to_zero(), lambda o: o.set_to_zero()),
    "stateless_with_tree_map": (lambda: fx.stateless_with_tree_map(_decayed),
                                lambda o: o.stateless_with_tree_map(_decayed)),
}

OPTIMIZERS: dict = {}
DTENSOR: dict = {}


def _optax_dog(o, **kwargs):
    """Optax's DoG with its updates reshaped like the params: for a 0-dim param Optax returns shape (1,)
    (its ``eta`` has shape (1,)); fxtrain keeps the gradient's shape."""
    import jax

    return o.chain(o.scale_by_distance_over_gradients(**kwargs),
                   o.stateless(lambda u, p: jax.tree.map(lambda x, q: x.reshape(q.shape), u, p)))


def _not_0_dim(params):
    return optree.tree_map(lambda x: x.ndim > 0, params)  # torch and jax trees alike


def _stepped(ours, theirs):
    """(fxtrain's, optax -> Optax's), each chained with a step of -0.1 (params move, so the param-dependent
    transforms see new params every step)."""
    return lambda: fx.chain(ours(), fx.scale(-0.1)), lambda o: o.chain(theirs(o), o.scale(-0.1))


_DOG_ARGS = {"reps_rel": 1e-2, "eps": 1e-4, "global_scale": -1.0}

PARITY: dict = {k: _stepped(*case) for k, case in {
    "clip_by_block_rms": (lambda: fx.clip_by_block_rms(0.3), lambda o: o.clip_by_block_rms(0.3)),
    "adaptive_grad_clip": (lambda: fx.adaptive_grad_clip(0.1), lambda o: o.adaptive_grad_clip(0.1)),
    # axis=-1 over every leaf but the 0-dim one (Optax refuses an axis for a 0-dim array)
    "adaptive_grad_clip-axis": (lambda: fx.masked(fx.adaptive_grad_clip(0.5, eps=0.3, axis=-1), _not_0_dim),
                                lambda o: o.masked(o.adaptive_grad_clip(0.5, eps=0.3, axis=-1), _not_0_dim)),
    "centralize": (lambda: fx.centralize(), lambda o: o.centralize()),
    "normalize_by_update_norm": (lambda: fx.normalize_by_update_norm(), lambda o: o.normalize_by_update_norm()),
    "normalize_by_update_norm-args": (lambda: fx.normalize_by_update_norm(scale_factor=-2.0, eps=0.5),
                                      lambda o: o.normalize_by_update_norm(scale_factor=-2.0, eps=0.5)),
    "scale_by_param_block_norm": (lambda: fx.scale_by_param_block_norm(), lambda o: o.scale_by_param_block_norm()),
    "scale_by_param_block_norm-min": (lambda: fx.scale_by_param_block_norm(min_scale=1.5),
                                      lambda o: o.scale_by_param_block_norm(min_scale=1.5)),
    "scale_by_param_block_rms": (lambda: fx.scale_by_param_block_rms(), lambda o: o.scale_by_param_block_rms()),
    "scale_by_param_block_rms-min": (lambda: fx.scale_by_param_block_rms(min_scale=0.8),
                                     lambda o: o.scale_by_param_block_rms(min_scale=0.8)),
    "scale_by_distance_over_gradients": (lambda: fx.scale_by_distance_over_gradients(), _optax_dog),
    "scale_by_distance_over_gradients-args": (lambda: fx.scale_by_distance_over_gradients(**_DOG_ARGS),
                                              lambda o: _optax_dog(o, **_DOG_ARGS)),
    "ema": (lambda: fx.ema(0.9), lambda o: o.ema(0.9)),
    "ema-biased": (lambda: fx.ema(0.7, debias=False), lambda o: o.ema(0.7, debias=False)),
    # both sides compute the average in float32 and round what they store
    "ema-bf16_accumulator": (lambda: fx.ema(0.9, accumulator_dtype="bfloat16"),
                             lambda o: o.ema(0.9, accumulator_dtype="bfloat16")),
    "zero_nans": (lambda: fx.zero_nans(), lambda o: o.zero_nans()),
    "set_to_zero": (lambda: fx.chain(fx.set_to_zero(), fx.scale(2.0)), lambda o: o.chain(o.set_to_zero(), o.scale(2.0))),
    "stateless_with_tree_map": (lambda: fx.stateless_with_tree_map(_decayed), lambda o: o.stateless_with_tree_map(_decayed)),
}.items()}
