"""Catalogue cases of this family (see tests/cases/__init__.py): Adam's relatives
(fxtrain/transforms/_adaptive.py)."""

import warnings

import fxtrain as fx  # noqa: F401
from tests._parity import ndim_mask


def quietly(build):
    """``build()`` without its DeprecationWarning (``optimistic_adam`` warns as Optax's does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return build()


CONFORMANCE: dict = {
    "scale_by_amsgrad": lambda: fx.scale_by_amsgrad(),
    "scale_by_adamax": lambda: fx.scale_by_adamax(),
    "scale_by_belief": lambda: fx.scale_by_belief(nesterov=True),
    "scale_by_yogi": lambda: fx.scale_by_yogi(),
    "scale_by_radam": lambda: fx.scale_by_radam(nesterov=True),
    "scale_by_adadelta": lambda: fx.scale_by_adadelta(),
    "scale_by_adan": lambda: fx.scale_by_adan(),
    "scale_by_novograd": lambda: fx.scale_by_novograd(weight_decay=1e-2),
    "scale_by_optimistic_gradient": lambda: fx.scale_by_optimistic_gradient(alpha=0.7, beta=0.1),
    "adabelief": lambda: fx.adabelief(1e-2),
    "adadelta": lambda: fx.adadelta(1.0, weight_decay=1e-2),
    "adamax": lambda: fx.adamax(1e-2),
    "adamaxw": lambda: fx.adamaxw(1e-2, weight_decay=1e-2),
    "adan": lambda: fx.adan(1e-2, weight_decay=1e-2),
    "amsgrad": lambda: fx.amsgrad(1e-2),
    "radam": lambda: fx.radam(1e-2),
    "yogi": lambda: fx.yogi(1e-2),
    "novograd": lambda: fx.novograd(1e-2),
    "optimistic_gradient_descent": lambda: fx.optimistic_gradient_descent(1e-2),
    "optimistic_adam": lambda: quietly(lambda: fx.optimistic_adam(1e-2)),
    "optimistic_adam_v2": lambda: fx.optimistic_adam_v2(1e-2),
    "nadam": lambda: fx.nadam(1e-2),
    "nadamw": lambda: fx.nadamw(1e-2),
}

# One case per name. radam with b2=0.3: rho_t stays below 2, where Optax's rectification factor is finite;
# in (2, 4) it is NaN, and although unused (momentum steps) it makes jax.grad through Optax's update NaN.
# threshold=0.9 rectifies every step (rho_1 = 1: scale_by_radam), the default threshold none (radam).
COMPOSABLE: dict = {
    "scale_by_amsgrad": (lambda: fx.scale_by_amsgrad(), lambda o: o.scale_by_amsgrad()),
    "scale_by_adamax": (lambda: fx.scale_by_adamax(), lambda o: o.scale_by_adamax()),
    "scale_by_belief": (lambda: fx.scale_by_belief(), lambda o: o.scale_by_belief()),
    "scale_by_yogi": (lambda: fx.scale_by_yogi(), lambda o: o.scale_by_yogi()),
    "scale_by_radam": (lambda: fx.scale_by_radam(b2=0.3, threshold=0.9, nesterov=True),
                       lambda o: o.scale_by_radam(b2=0.3, threshold=0.9, nesterov=True)),
    "scale_by_adadelta": (lambda: fx.scale_by_adadelta(), lambda o: o.scale_by_adadelta()),
    "scale_by_adan": (lambda: fx.scale_by_adan(), lambda o: o.scale_by_adan()),
    "scale_by_novograd": (lambda: fx.scale_by_novograd(), lambda o: o.scale_by_novograd()),
    "scale_by_optimistic_gradient": (lambda: fx.scale_by_optimistic_gradient(alpha=0.7, beta=0.1),
                                     lambda o: o.scale_by_optimistic_gradient(alpha=0.7, beta=0.1)),
    "adabelief": (lambda: fx.adabelief(1e-2, nesterov=True), lambda o: o.adabelief(1e-2, nesterov=True)),
    "adadelta": (lambda: fx.adadelta(1.0, weight_decay=0.1), lambda o: o.adadelta(1.0, weight_decay=0.1)),
    "adamax": (lambda: fx.adamax(1e-2), lambda o: o.adamax(1e-2)),
    "adamaxw": (lambda: fx.adamaxw(1e-2, weight_decay=0.1), lambda o: o.adamaxw(1e-2, weight_decay=0.1)),
    "adan": (lambda: fx.adan(1e-2, weight_decay=0.1), lambda o: o.adan(1e-2, weight_decay=0.1)),
    "amsgrad": (lambda: fx.amsgrad(1e-2), lambda o: o.amsgrad(1e-2)),
    "radam": (lambda: fx.radam(1e-2, b2=0.3), lambda o: o.radam(1e-2, b2=0.3)),
    "yogi": (lambda: fx.yogi(1e-2), lambda o: o.yogi(1e-2)),
    "novograd": (lambda: fx.novograd(1e-2, weight_decay=0.1), lambda o: o.novograd(1e-2, weight_decay=0.1)),
    "optimistic_gradient_descent": (lambda: fx.optimistic_gradient_descent(1e-2),
                                    lambda o: o.optimistic_gradient_descent(1e-2)),
    "optimistic_adam": (lambda: quietly(lambda: fx.optimistic_adam(1e-2)),
                        lambda o: quietly(lambda: o.optimistic_adam(1e-2))),
    "optimistic_adam_v2": (lambda: fx.optimistic_adam_v2(1e-2, alpha=0.5, beta=0.5),
                           lambda o: o.optimistic_adam_v2(1e-2, alpha=0.5, beta=0.5)),
    "nadam": (lambda: fx.nadam(1e-2), lambda o: o.nadam(1e-2)),
    "nadamw": (lambda: fx.nadamw(1e-2, weight_decay=0.1), lambda o: o.nadamw(1e-2, weight_decay=0.1)),
}

OPTIMIZERS: dict = {
    "adabelief": lambda: fx.adabelief(1e-2),
    "adadelta": lambda: fx.adadelta(1.0),
    "adamax": lambda: fx.adamax(1e-2),
    "adamaxw": lambda: fx.adamaxw(1e-2),
    "adan": lambda: fx.adan(1e-2),
    "amsgrad": lambda: fx.amsgrad(1e-2),
    "radam": lambda: fx.radam(1e-2),
    "yogi": lambda: fx.yogi(1e-2),
    "novograd": lambda: fx.novograd(1e-2),
    "optimistic_gradient_descent": lambda: fx.optimistic_gradient_descent(1e-2),
    "optimistic_adam": lambda: quietly(lambda: fx.optimistic_adam(1e-2)),
    "optimistic_adam_v2": lambda: fx.optimistic_adam_v2(1e-2),
    "nadam": lambda: fx.nadam(1e-2),
    "nadamw": lambda: fx.nadamw(1e-2),
}

DTENSOR: dict = {}


# --- parity with Optax over 20 steps (tests/test_optax_parity.py) ----------------------------------------
# id -> (kwargs of fxtrain's and Optax's factory, named as the test id's prefix); transforms are followed
# by scale(-0.01) so the params move as under an optimizer.

_TRANSFORMS = {
    "scale_by_amsgrad": {},
    "scale_by_amsgrad-paper": {"b1": 0.8, "b2": 0.99, "eps_root": 1e-8, "bias_correction_mu": False,
                               "bias_correction_nu": False},
    "scale_by_amsgrad-mu_bf16": {"mu_dtype": "bfloat16"},
    "scale_by_adamax": {},
    "scale_by_adamax-args": {"b1": 0.5, "b2": 0.9, "eps": 1e-3},
    "scale_by_belief": {},
    "scale_by_belief-nesterov": {"b1": 0.8, "b2": 0.99, "eps": 1e-8, "eps_root": 1e-10, "nesterov": True},
    "scale_by_yogi": {},
    "scale_by_yogi-args": {"b1": 0.5, "b2": 0.9, "eps": 1e-4, "eps_root": 1e-8, "initial_accumulator_value": 0.1},
    # b2=0.9: rectified from step 5, with rho_t well computed in float32 (the default b2: below)
    "scale_by_radam-nesterov": {"b1": 0.8, "b2": 0.9, "eps_root": 1e-8, "threshold": 4.5, "nesterov": True},
    "scale_by_adadelta": {},
    "scale_by_adadelta-args": {"rho": 0.5, "eps": 1e-3},
    "scale_by_adan": {},
    "scale_by_adan-args": {"b1": 0.9, "b2": 0.8, "b3": 0.95, "eps": 1e-6, "eps_root": 1e-8},
    "scale_by_novograd": {},
    "scale_by_novograd-args": {"b1": 0.5, "b2": 0.5, "eps": 1e-3, "eps_root": 1e-8, "weight_decay": 0.1},
    "scale_by_novograd-mu_bf16": {"mu_dtype": "bfloat16"},
    "scale_by_optimistic_gradient": {},
    "scale_by_optimistic_gradient-args": {"alpha": 0.7, "beta": 0.1},
}

# Optimizers with Optax's test arguments (defaults otherwise) are compared over 30-50 steps in
# tests/test_adaptive.py's test_optimization_follows_optax; here with other arguments.
_OPTIMIZERS = {
    "adabelief-args": {"learning_rate": 1e-2, "b1": 0.8, "eps": 1e-8, "nesterov": True},
    "adadelta-decay": {"learning_rate": 1.0, "rho": 0.5, "weight_decay": 0.1, "weight_decay_mask": "ndim"},
    "adamax-args": {"learning_rate": 1e-2, "b1": 0.5, "b2": 0.9},
    "adamaxw-mask": {"learning_rate": 1e-2, "weight_decay": 0.1, "mask": "ndim"},
    "adan-decay": {"learning_rate": 1e-2, "b3": 0.9, "weight_decay": 0.1, "mask": "ndim"},
    "amsgrad-args": {"learning_rate": 1e-2, "b2": 0.99, "bias_correction_nu": False},
    "radam-nesterov": {"learning_rate": 5e-3, "b2": 0.9, "threshold": 6.0, "nesterov": True},
    "yogi-args": {"learning_rate": 1e-2, "b1": 0.5, "eps": 1e-5},
    "novograd-decay": {"learning_rate": 1e-2, "b2": 0.5, "weight_decay": 0.1},
    "optimistic_gradient_descent-args": {"learning_rate": 1e-2, "alpha": 0.5, "beta": 0.3},
    "optimistic_adam-args": {"learning_rate": 1e-2, "optimism": 0.5, "b1": 0.5, "nesterov": False},
    "optimistic_adam_v2-args": {"learning_rate": 1e-2, "alpha": 0.5, "beta": 2.0, "nesterov": False},
    "nadam-args": {"learning_rate": 1e-2, "b1": 0.8, "eps_root": 1e-8},
    "nadamw-mask": {"learning_rate": 1e-2, "weight_decay": 0.1, "mask": "ndim"},
}


def build(ns, name: str, kwargs: dict):
    """``ns.<name>(**kwargs)`` for ``ns`` fxtrain or Optax, ``"ndim"`` masks made for ``ns``'s trees
    (matrices and up); ``optimistic_adam`` quietly."""
    kwargs = {k: ndim_mask if v == "ndim" else v for k, v in kwargs.items()}
    return quietly(lambda: getattr(ns, name)(**kwargs))


def _pair(case_id: str, kwargs: dict):
    name = case_id.split("-")[0]
    if not name.startswith("scale_by"):
        return lambda: build(fx, name, kwargs), lambda o: build(o, name, kwargs)
    # Optax's novograd returns its bfloat16 momentum as the update, where fxtrain keeps the gradients'
    # dtype (the same values): scaled by a power of two, the two stay equal.
    step = -0.5 if case_id == "scale_by_novograd-mu_bf16" else -0.01
    return (lambda: fx.chain(build(fx, name, kwargs), fx.scale(step)),
            lambda o: o.chain(build(o, name, kwargs), o.scale(step)))


PARITY: dict = {k: _pair(k, kwargs) for k, kwargs in {**_TRANSFORMS, **_OPTIMIZERS}.items()}
