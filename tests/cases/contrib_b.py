"""Catalogue cases of this family (see tests/cases/__init__.py): Optax contrib part B (schedule-free, SAM,
differential privacy and the smaller contrib optimizers)."""

import fxtrain as fx  # noqa: F401

CONFORMANCE: dict = {
    "schedule_free": lambda: fx.contrib.schedule_free(fx.adam(1e-2, b1=0.0), 1e-2, b1=0.8),
    "schedule_free_sgd": lambda: fx.contrib.schedule_free_sgd(0.1, warmup_steps=2, weight_decay=1e-2),
    "schedule_free_adamw": lambda: fx.contrib.schedule_free_adamw(1e-2, weight_decay=1e-2),
}
COMPOSABLE: dict = {
    "schedule_free": (lambda: fx.contrib.schedule_free(fx.sgd(0.1), 0.1, b1=0.8),
                      lambda o: o.contrib.schedule_free(o.sgd(0.1), 0.1, b1=0.8)),
    "schedule_free_sgd": (lambda: fx.contrib.schedule_free_sgd(0.1, warmup_steps=3, weight_decay=0.1),
                          lambda o: o.contrib.schedule_free_sgd(0.1, warmup_steps=3, weight_decay=0.1)),
    "schedule_free_adamw": (lambda: fx.contrib.schedule_free_adamw(1e-2, weight_decay=0.1),
                            lambda o: o.contrib.schedule_free_adamw(1e-2, weight_decay=0.1)),
}
OPTIMIZERS: dict = {
    "schedule_free_sgd": lambda: fx.contrib.schedule_free_sgd(0.1),
    "schedule_free_adamw": lambda: fx.contrib.schedule_free_adamw(1e-2),
}
DTENSOR: dict = {}
