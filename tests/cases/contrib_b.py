"""Catalogue cases of this family (see tests/cases/__init__.py): Optax contrib part B (schedule-free, SAM,
differential privacy and the smaller contrib optimizers)."""

import fxtrain as fx
from fxtrain._base import _Update, kernel
from tests._parity import ndim_mask

LOSS = 1.5  # the loss value given to transforms that read one (momo...): the suite-wide checks pass none


def _with_value(tx):
    """``tx`` (which reads ``value=``) with the loss bound to :data:`LOSS`; same repr and traits."""
    k = kernel(tx)
    return fx.GradientTransformation(tx.init, _Update(lambda u, s, p=None, **_: k(u, s, p, value=LOSS), repr(tx),
                                                      fx.traits(tx)))


def _with_value_optax(otx):
    import optax
    return optax.GradientTransformation(otx.init, lambda u, s, p=None: otx.update(u, s, p, value=LOSS))


CONFORMANCE: dict = {
    "schedule_free": lambda: fx.contrib.schedule_free(fx.adam(1e-2, b1=0.0), 1e-2, b1=0.8),
    "schedule_free_sgd": lambda: fx.contrib.schedule_free_sgd(0.1, warmup_steps=2, weight_decay=1e-2),
    "schedule_free_adamw": lambda: fx.contrib.schedule_free_adamw(1e-2, weight_decay=1e-2),
    "normalize": lambda: fx.contrib.normalize(),
    "sam": lambda: fx.contrib.sam(fx.adam(1e-2), fx.chain(fx.contrib.normalize(), fx.sgd(1e-2)), sync_period=3),
    "scale_by_dog": lambda: fx.contrib.scale_by_dog(("learning_rate", 0.1)),
    "dog": lambda: fx.contrib.dog(weight_decay=1e-2),
    "scale_by_dowg": lambda: fx.contrib.scale_by_dowg(),
    "dowg": lambda: fx.contrib.dowg(0.5, init_estim_sq_dist=0.1),
    "scale_by_cocob": lambda: fx.contrib.scale_by_cocob(alpha=10.0),
    "cocob": lambda: fx.contrib.cocob(weight_decay=1e-2),
    "scale_by_madgrad": lambda: fx.contrib.scale_by_madgrad(1e-2, momentum=0.5),
    "madgrad": lambda: fx.contrib.madgrad(1e-2, weight_decay=1e-2),
    "momo": lambda: _with_value(fx.contrib.momo(0.5, weight_decay=1e-2, adapt_lower_bound=True)),
    "momo_adam": lambda: _with_value(fx.contrib.momo_adam(1e-2, weight_decay=1e-2)),
    "mechanize": lambda: fx.contrib.mechanize(fx.sgd(1.0, momentum=0.9), num_betas=3),
    "dadapt_adamw": lambda: fx.contrib.dadapt_adamw(weight_decay=1e-2),
    "split_real_and_imaginary": lambda: fx.contrib.split_real_and_imaginary(fx.adam(1e-2)),  # real leaves: as is
}
COMPOSABLE: dict = {
    "schedule_free": (lambda: fx.contrib.schedule_free(fx.sgd(0.1), 0.1, b1=0.8),
                      lambda o: o.contrib.schedule_free(o.sgd(0.1), 0.1, b1=0.8)),
    "schedule_free_sgd": (lambda: fx.contrib.schedule_free_sgd(0.1, warmup_steps=3, weight_decay=0.1),
                          lambda o: o.contrib.schedule_free_sgd(0.1, warmup_steps=3, weight_decay=0.1)),
    "schedule_free_adamw": (lambda: fx.contrib.schedule_free_adamw(1e-2, weight_decay=0.1),
                            lambda o: o.contrib.schedule_free_adamw(1e-2, weight_decay=0.1)),
    "normalize": (lambda: fx.chain(fx.contrib.normalize(), fx.scale(-0.1)),
                  lambda o: o.chain(o.contrib.normalize(), o.scale(-0.1))),
    "sam": (lambda: fx.contrib.sam(fx.sgd(0.1, momentum=0.5), fx.chain(fx.contrib.normalize(), fx.adam(1e-2))),
            lambda o: o.contrib.sam(o.sgd(0.1, momentum=0.5), o.chain(o.contrib.normalize(), o.adam(1e-2)))),
    # No Optax reference: a gradient through dog's first update is NaN in Optax (the sqrt of the distance 0),
    # 0 here; this file's PARITY checks the values against Optax (tests/test_optax_parity.py).
    "dog": (lambda: fx.contrib.dog(init_step=("distance", 0.1), weight_decay=0.1), None),
    "dowg": (lambda: fx.contrib.dowg(0.5, init_estim_sq_dist=0.01), lambda o: o.contrib.dowg(0.5, init_estim_sq_dist=0.01)),
    "scale_by_dog": (lambda: fx.chain(fx.contrib.scale_by_dog(("learning_rate", 0.1)), fx.scale(-1.0)), None),
    "scale_by_dowg": (lambda: fx.chain(fx.contrib.scale_by_dowg(init_estim_sq_dist=0.01), fx.scale(-1.0)),
                      lambda o: o.chain(o.contrib._dog.scale_by_dowg(init_estim_sq_dist=0.01), o.scale(-1.0))),
    "scale_by_cocob": (lambda: fx.contrib.scale_by_cocob(), lambda o: o.contrib.scale_by_cocob()),
    "scale_by_madgrad": (lambda: fx.contrib.scale_by_madgrad(1e-2, momentum=0.5),
                         lambda o: o.contrib.scale_by_madgrad(1e-2, momentum=0.5)),
    "cocob": (lambda: fx.contrib.cocob(alpha=20.0, weight_decay=0.1), lambda o: o.contrib.cocob(alpha=20.0, weight_decay=0.1)),
    "madgrad": (lambda: fx.contrib.madgrad(1e-2, momentum=0.5, weight_decay=0.1),
                lambda o: o.contrib.madgrad(1e-2, momentum=0.5, weight_decay=0.1)),
    "momo": (lambda: _with_value(fx.contrib.momo(0.1, weight_decay=0.1)),
             lambda o: _with_value_optax(o.contrib.momo(0.1, weight_decay=0.1))),
    # A small rate, so that the step-size cap binds: where the Polyak ratio binds, the batched and unbatched
    # kernels' rounding differences (1 ulp) grow past 1e-6 in 20 steps (8e-6 at step 19 with rate 0.1).
    "momo_adam": (lambda: _with_value(fx.contrib.momo_adam(1e-3, weight_decay=0.1)),
                  lambda o: _with_value_optax(o.contrib.momo_adam(1e-3, weight_decay=0.1))),
    # No Optax reference, as for dog: Optax's gradient through mechanize is NaN (sqrt(v) at v = 0 on the first
    # update), 0 here (tests/test_contrib.py checks it is finite).
    "mechanize": (lambda: fx.contrib.mechanize(fx.adam(1.0), s_init=1e-3), None),
    "dadapt_adamw": (lambda: fx.contrib.dadapt_adamw(estim_lr0=1e-3, weight_decay=0.1),
                     lambda o: o.contrib.dadapt_adamw(estim_lr0=1e-3, weight_decay=0.1)),
    "split_real_and_imaginary": (lambda: fx.contrib.split_real_and_imaginary(fx.adam(1e-2)),
                                 lambda o: o.contrib.split_real_and_imaginary(o.adam(1e-2))),
}
OPTIMIZERS: dict = {
    "schedule_free_sgd": lambda: fx.contrib.schedule_free_sgd(0.1),
    "schedule_free_adamw": lambda: fx.contrib.schedule_free_adamw(1e-2),
    "sam": lambda: fx.contrib.sam(fx.sgd(0.1), fx.sgd(1e-2)),
    "dog": lambda: fx.contrib.dog(),
    "dowg": lambda: fx.contrib.dowg(),
    "cocob": lambda: fx.contrib.cocob(),
    "madgrad": lambda: fx.contrib.madgrad(1e-2),
    "mechanize": lambda: fx.contrib.mechanize(fx.adam(1.0)),
    "momo": lambda: _with_value(fx.contrib.momo(0.1)),
    "momo_adam": lambda: _with_value(fx.contrib.momo_adam()),
    "dadapt_adamw": lambda: fx.contrib.dadapt_adamw(),
}
DTENSOR: dict = {}


# --- parity with Optax over 20 steps (tests/test_optax_parity.py) ----------------------------------------

def with_schedules(lib, kwargs: dict) -> dict:
    """``kwargs`` with each ``"sched"`` replaced by ``lib``'s linear schedule from 1.0 to 0.2 over 15 steps."""
    return {k: (lib.linear_schedule(1.0, 0.2, 15) if v == "sched" else v) for k, v in kwargs.items()}


def _pair(name: str, kwargs: dict):
    def theirs(o):
        from optax.contrib import _dog  # scale_by_dog and scale_by_dowg are not exported by optax.contrib

        tx = (getattr(o.contrib, name, None) or getattr(_dog, name))(**with_schedules(o, kwargs))
        return o.chain(tx, o.scale(-1.0)) if name.startswith("scale_by") else tx

    def ours():
        tx = getattr(fx.contrib, name)(**with_schedules(fx, kwargs))
        return fx.chain(tx, fx.scale(-1.0)) if name.startswith("scale_by") else tx

    return ours, theirs


# name -> {variant: kwargs}; "sched" is replaced by a linear schedule on each side.
_VARIANTS = {
    "dog": {
        "default": {},
        "learning_rate": {"init_step": ("learning_rate", 0.01), "weight_decay": 0.1, "mask": ndim_mask},
        "heuristic_sched": {"learning_rate": "sched", "init_step": ("heuristic", 1e-3), "weight_decay": 0.01},
    },
    "dowg": {
        "guess": {"learning_rate": 0.5, "init_estim_sq_dist": 0.01, "eps": 1e-6},
        "decay_sched": {"learning_rate": "sched", "weight_decay": 0.1, "mask": ndim_mask},
    },
    "cocob": {
        "default": {},
        "all": {"learning_rate": "sched", "alpha": 20.0, "eps": 1e-4, "weight_decay": 1e-2, "mask": ndim_mask},
    },
    "madgrad": {
        "default": {"learning_rate": 1e-2},
        "all": {"learning_rate": "sched", "momentum": 0.5, "weight_decay": 1e-2, "eps": 1e-4},
    },
    "dadapt_adamw": {
        "default": {},
        "all": {"learning_rate": "sched", "betas": (0.8, 0.99), "eps": 1e-6, "estim_lr0": 1e-3, "weight_decay": 0.1},
    },
    "scale_by_dog": {"distance": {"init_step": ("distance", 0.1), "eps": 1e-4}},
    "scale_by_dowg": {"default": {}},
}
PARITY: dict = {f"{name}-{v}": _pair(name, kw) for name, variants in _VARIANTS.items() for v, kw in variants.items()}
