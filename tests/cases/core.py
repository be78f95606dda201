"""Catalogue cases of this family (see tests/cases/__init__.py): the core transforms and Optax's aliases
(fxtrain/transforms/_adam.py, _momentum.py, _scaling.py, _weight_decay.py, _rms.py, _lion.py and
fxtrain/optimizers.py). Their conformance, composable and stack cases are tests/test_conformance.py's,
tests/test_composable.py's and tests/test_optimizers.py's ``CORE``; here only their Optax parity.

The variants dicts are shared with the family's own test files (purity, dtypes and ``None`` leaves run on
the same arguments).
"""

import torch

import fxtrain as fx
from tests._parity import TREE_MASK, ndim_mask


def sched(count):
    """A decaying schedule both libraries can run (learning rates, weight decays)."""
    return 0.1 * 0.9 ** count


ADAM_VARIANTS = {
    "default": {},
    "nesterov": {"nesterov": True},
    "eps_root": {"eps_root": 1e-4, "eps": 1e-6},
    "b2_small": {"b1": 0.5, "b2": 0.9},
    "b1_zero": {"b1": 0.0},
    "b1_zero_nesterov": {"b1": 0.0, "nesterov": True},
    "eps_root_nesterov": {"eps_root": 1e-3, "nesterov": True},
}
TRACE_VARIANTS = {
    "heavy_ball": {"decay": 0.9},
    "nesterov": {"decay": 0.9, "nesterov": True},
    "acc_bf16": {"decay": 0.8, "accumulator_dtype": "bfloat16"},
    "acc_bf16_nesterov": {"decay": 0.8, "nesterov": True, "accumulator_dtype": "bfloat16"},
}
LION_VARIANTS = {  # mu_dtype as Optax spells it; fxtrain's side takes torch's dtype (lion_kwargs)
    "default": {},
    "betas": {"b1": 0.5, "b2": 0.9},
    "mu_bf16": {"mu_dtype": "bfloat16"},
    "smooth": {"mode": "smooth", "smooth_beta": 3.0},
    "refined": {"mode": "refined"},
}
# add_decayed_weights: masks as a full tree, a prefix of it, a callable; decays as numbers and schedules
WEIGHT_DECAY_VARIANTS = {
    "plain": {"weight_decay": 0.1},
    "zero": {"weight_decay": 0.0},
    "tree_mask": {"weight_decay": 0.1, "mask": TREE_MASK},
    "prefix_mask": {"weight_decay": 0.1, "mask": {"dense": True, "blocks": False, "scalar": True}},
    "callable_mask": {"weight_decay": 0.1, "mask": ndim_mask},
    "schedule": {"weight_decay": sched},
    "schedule_masked": {"weight_decay": sched, "mask": ndim_mask},
}
RMS_VARIANTS = {
    "scale_by_rms": {
        "default": {},
        "eps_outside": {"eps_in_sqrt": False, "eps": 1e-6},
        "bias_correction": {"bias_correction": True, "decay": 0.8},
        "initial_scale": {"initial_scale": 1.0, "decay": 0.95},
        "all": {"initial_scale": 0.5, "eps_in_sqrt": False, "bias_correction": True},
    },
    # Centered with bias correction and initial_scale=0 is degenerate at step 1 (the variance estimate is
    # g^2 - g^2 = 0 up to rounding, in Optax too), so those variants start from a positive initial_scale.
    "scale_by_stddev": {
        "default": {},
        "eps_outside": {"eps_in_sqrt": False, "eps": 1e-6},
        "bias_correction": {"bias_correction": True, "initial_scale": 1.0},
        "all": {"initial_scale": 0.5, "eps_in_sqrt": False, "bias_correction": True, "decay": 0.8},
    },
    "scale_by_rss": {
        "default": {},
        "no_eps": {"eps": 0.0},
        "zero_start": {"initial_accumulator_value": 0.0, "eps": 1e-10},
    },
}
# id -> (alias name, positional args, keyword args), the same for both libraries
OPTIMIZER_VARIANTS = {
    "sgd": ("sgd", (0.1,), {}),
    "sgd_momentum": ("sgd", (0.1,), {"momentum": 0.9}),
    "sgd_nesterov": ("sgd", (0.1,), {"momentum": 0.9, "nesterov": True}),
    "sgd_schedule": ("sgd", (sched,), {"momentum": 0.5}),
    "adam": ("adam", (0.05,), {}),
    "adam_nesterov": ("adam", (0.05,), {"nesterov": True, "b1": 0.8}),
    "adam_eps_root": ("adam", (0.05,), {"eps_root": 1e-5}),
    "adam_schedule": ("adam", (sched,), {}),
    "adamw": ("adamw", (0.05,), {"weight_decay": 0.1}),
    "adamw_tree_mask": ("adamw", (0.05,), {"weight_decay": 0.1, "mask": TREE_MASK}),
    "adamw_callable_mask": ("adamw", (0.05,), {"weight_decay": 0.1, "mask": ndim_mask}),
    "adamw_nesterov_schedules": ("adamw", (sched,), {"weight_decay": sched, "nesterov": True}),
    "lion": ("lion", (0.01,), {}),
    "lion_mask": ("lion", (0.01,), {"weight_decay": 0.1, "mask": ndim_mask, "b2": 0.9}),
    "rmsprop": ("rmsprop", (0.01,), {}),
    "rmsprop_torch_like": ("rmsprop", (0.01,), {"decay": 0.99, "eps_in_sqrt": False}),
    "rmsprop_centered": ("rmsprop", (0.01,), {"centered": True}),
    "rmsprop_momentum": ("rmsprop", (0.01,), {"momentum": 0.9}),
    "rmsprop_centered_nesterov": ("rmsprop", (0.01,), {"centered": True, "momentum": 0.9, "nesterov": True}),
    "rmsprop_all": ("rmsprop", (sched,), {"initial_scale": 1.0, "bias_correction": True, "centered": True,
                                          "eps_in_sqrt": False, "momentum": 0.5}),
    "adagrad": ("adagrad", (0.1,), {}),
    "adagrad_zero_start": ("adagrad", (0.1,), {"initial_accumulator_value": 0.0, "eps": 1e-10}),
}
SCALING_VARIANTS = {  # id -> (name, args, kwargs), the same for both libraries
    "scale": ("scale", (0.3,), {}),
    "scale_by_schedule": ("scale_by_schedule", (sched,), {}),
    "scale_by_learning_rate": ("scale_by_learning_rate", (0.3,), {}),
    "scale_by_learning_rate-no_flip": ("scale_by_learning_rate", (0.3,), {"flip_sign": False}),
    "scale_by_learning_rate-schedule": ("scale_by_learning_rate", (sched,), {}),
    "scale_by_learning_rate-schedule_no_flip": ("scale_by_learning_rate", (sched,), {"flip_sign": False}),
    "scale_by_learning_rate-none": ("scale_by_learning_rate", (None,), {}),
}


def lion_kwargs(kwargs: dict) -> dict:
    """A :data:`LION_VARIANTS` entry for fxtrain: ``mu_dtype`` as a torch dtype."""
    return {**kwargs, "mu_dtype": torch.bfloat16} if "mu_dtype" in kwargs else kwargs


def _stepped(name: str, kwargs: dict, step: float, fx_kwargs: dict | None = None):
    """(fxtrain's, optax -> Optax's) ``chain(<name>(**kwargs), scale(step))``: the params move as under an
    optimizer."""
    return (lambda: fx.chain(getattr(fx, name)(**(kwargs if fx_kwargs is None else fx_kwargs)), fx.scale(step)),
            lambda o: o.chain(getattr(o, name)(**kwargs), o.scale(step)))


def _same(name: str, args: tuple, kwargs: dict):
    """(fxtrain's, optax -> Optax's) ``<name>(*args, **kwargs)``."""
    return lambda: getattr(fx, name)(*args, **kwargs), lambda o: getattr(o, name)(*args, **kwargs)


PARITY: dict = {
    **{f"scale_by_adam-{k}": _stepped("scale_by_adam", kw, -0.05) for k, kw in ADAM_VARIANTS.items()},
    **{f"trace-{k}": _stepped("trace", kw, -0.01) for k, kw in TRACE_VARIANTS.items()},
    **{f"scale_by_lion-{k}": _stepped("scale_by_lion", kw, -0.01, lion_kwargs(kw)) for k, kw in LION_VARIANTS.items()},
    **{f"add_decayed_weights-{k}": _stepped("add_decayed_weights", kw, -0.1) for k, kw in WEIGHT_DECAY_VARIANTS.items()},
    **{f"{name}-{k}": _stepped(name, kw, -0.01) for name, variants in RMS_VARIANTS.items() for k, kw in variants.items()},
    **{k: _same(*case) for k, case in SCALING_VARIANTS.items()},
    **{f"optimizer-{k}": _same(*case) for k, case in OPTIMIZER_VARIANTS.items()},
}
