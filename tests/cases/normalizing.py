"""Catalogue cases of this family (see tests/cases/__init__.py): fxtrain/transforms/_normalizing.py and
fxtrain/transforms/_simple.py.

``per_example_layer_norm_clip`` has no conformance case (it sums away the batch axis, like
``per_example_global_norm_clip``, so it is not registered); tests/test_normalizing.py covers it.
"""

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
