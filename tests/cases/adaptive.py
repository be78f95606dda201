"""Catalogue cases of this family (see tests/cases/__init__.py): Adam's relatives
(fxtrain/transforms/_adaptive.py)."""

import warnings

import fxtrain as fx  # noqa: F401


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
