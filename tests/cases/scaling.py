"""Catalogue cases of this family (see tests/cases/__init__.py): factored moments, trust ratios, signs, noise."""

import torch

import fxtrain as fx  # noqa: F401
from tests._parity import TREE_MASK, ndim_mask


def _matrices(p):
    return fx.tree.map(lambda x: x.ndim >= 2, p)


CONFORMANCE: dict = {
    "scale_by_factored_rms": lambda: fx.scale_by_factored_rms(min_dim_size_to_factor=2),
    "adafactor": lambda: fx.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=1e-2),
    "scale_by_sm3": lambda: fx.scale_by_sm3(),
    "sm3": lambda: fx.sm3(1e-2),
    "scale_by_trust_ratio": lambda: fx.scale_by_trust_ratio(min_norm=1e-3),
    "fromage": lambda: fx.fromage(1e-2),
    "lamb": lambda: fx.lamb(1e-2, weight_decay=1e-2, mask=_matrices),
    "lars": lambda: fx.lars(1e-2, weight_decay=1e-2, trust_ratio_mask=_matrices),
    "scale_by_sign": lambda: fx.scale_by_sign(),
    "sign_sgd": lambda: fx.sign_sgd(1e-2),
    "signum": lambda: fx.signum(1e-2),
    "scale_by_rprop": lambda: fx.scale_by_rprop(1e-2),
    "rprop": lambda: fx.rprop(1e-2),
    "add_noise": lambda: fx.add_noise(0.01, 0.55, key=0),
    "noisy_sgd": lambda: fx.noisy_sgd(1e-2, key=0),
}

# id -> (fxtrain transform, optax module -> Optax's). sm3: Optax fails on 0-dim params (the composable
# tests' params have one), so it is checked under vmap/grad against itself; noise: other generator.
COMPOSABLE: dict = {
    "scale_by_factored_rms": (lambda: fx.scale_by_factored_rms(min_dim_size_to_factor=2),
                              lambda o: o.scale_by_factored_rms(min_dim_size_to_factor=2)),
    "adafactor": (lambda: fx.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9),
                  lambda o: o.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9)),
    "scale_by_sm3": (lambda: fx.scale_by_sm3(), None),
    "sm3": (lambda: fx.sm3(1e-2), None),
    "scale_by_trust_ratio": (lambda: fx.scale_by_trust_ratio(min_norm=1e-3),
                             lambda o: o.scale_by_trust_ratio(min_norm=1e-3)),
    "fromage": (lambda: fx.fromage(1e-2), lambda o: o.fromage(1e-2)),
    "lamb": (lambda: fx.lamb(1e-2, weight_decay=1e-2), lambda o: o.lamb(1e-2, weight_decay=1e-2)),
    "lars": (lambda: fx.lars(1e-2, weight_decay=1e-2), lambda o: o.lars(1e-2, weight_decay=1e-2)),
    "scale_by_sign": (lambda: fx.scale_by_sign(), lambda o: o.scale_by_sign()),
    "sign_sgd": (lambda: fx.sign_sgd(1e-2), lambda o: o.sign_sgd(1e-2)),
    "signum": (lambda: fx.signum(1e-2), lambda o: o.signum(1e-2)),
    "scale_by_rprop": (lambda: fx.scale_by_rprop(1e-2), lambda o: o.scale_by_rprop(1e-2)),
    "rprop": (lambda: fx.rprop(1e-2), lambda o: o.rprop(1e-2)),
    "add_noise": (lambda: fx.add_noise(0.01, 0.55, key=0), None),
    "noisy_sgd": (lambda: fx.noisy_sgd(1e-2, eta=0.0), None),
}

OPTIMIZERS: dict = {
    "adafactor": lambda: fx.adafactor(1e-2, min_dim_size_to_factor=2),
    "sm3": lambda: fx.sm3(1e-2),
    "fromage": lambda: fx.fromage(1e-2),
    "lamb": lambda: fx.lamb(1e-2),
    "lars": lambda: fx.lars(1e-2),
    "sign_sgd": lambda: fx.sign_sgd(1e-2),
    "signum": lambda: fx.signum(1e-2),
    "rprop": lambda: fx.rprop(1e-2),
    "noisy_sgd": lambda: fx.noisy_sgd(1e-2, key=0),
}

DTENSOR: dict = {}


def _sched(count):
    return 0.05 * 0.9 ** count


def _decay(step, rate):  # a decay_rate_fn both libraries can run: capped at `rate`
    return rate * (1.0 - 0.5 ** (step + 1))


def _factored(o, **kwargs):
    return o.chain(o.scale_by_factored_rms(**kwargs), o.scale(-0.01))


def _adafactor_bf16(o):
    """adafactor with a bfloat16 momentum: Optax names the dtype, fxtrain takes torch's."""
    dtype = torch.bfloat16 if o is fx else "bfloat16"
    return o.adafactor(learning_rate=0.01, clipping_threshold=0.5, momentum=0.5, dtype_momentum=dtype, factored=False,
                       weight_decay_rate=_sched)


_ADAFACTOR_ARGS = {"learning_rate": _sched, "min_dim_size_to_factor": 2, "decay_rate": 0.7, "decay_offset": -2,
                   "multiply_by_parameter_scale": False, "clipping_threshold": None, "momentum": 0.9,
                   "weight_decay_rate": 0.1, "eps": 1e-20, "weight_decay_mask": TREE_MASK}
_LARS_ARGS = {"weight_decay": 0.1, "weight_decay_mask": ndim_mask, "trust_coefficient": 0.01, "eps": 1e-3,
              "trust_ratio_mask": TREE_MASK, "momentum": 0.5, "nesterov": True}

# id -> (fxtrain's, optax -> Optax's[, assert_parity's options]). nested_params' leaves: (4, 3), (3,), (2, 2, 2),
# (5,), (1,), (): min_dim_size_to_factor=2 factors the first and third (the 3-d one over its last two dims, ties
# kept in order); the default (128) factors none. sign_sgd is chain(scale_by_sign(), scale(-lr)) and rprop
# chain(scale_by_rprop(...), scale(-1)): their cases cover the transforms' too.
PARITY: dict = {
    "scale_by_factored_rms": (lambda: _factored(fx), lambda o: _factored(o)),
    "scale_by_factored_rms-args": (
        lambda: _factored(fx, min_dim_size_to_factor=2, decay_rate=0.5, step_offset=-3, epsilon=1e-3,
                          decay_rate_fn=_decay),
        lambda o: _factored(o, min_dim_size_to_factor=2, decay_rate=0.5, step_offset=-3, epsilon=1e-3,
                            decay_rate_fn=_decay)),
    "adafactor": (lambda: fx.adafactor(), lambda o: o.adafactor()),
    "adafactor-args": (lambda: fx.adafactor(**_ADAFACTOR_ARGS), lambda o: o.adafactor(**_ADAFACTOR_ARGS)),
    # a bfloat16 momentum rounds the state; the updates keep float32 (Optax's too)
    "adafactor-momentum_bf16": (lambda: _adafactor_bf16(fx), _adafactor_bf16, {"rtol": 1e-2, "atol": 1e-3}),
    "scale_by_trust_ratio": (lambda: fx.chain(fx.scale_by_trust_ratio(), fx.scale(-0.01)),
                             lambda o: o.chain(o.scale_by_trust_ratio(), o.scale(-0.01))),
    # min_norm above some leaves' norms: the clipped branch
    "scale_by_trust_ratio-args": (
        lambda: fx.chain(fx.scale_by_trust_ratio(min_norm=1.5, trust_coefficient=0.3, eps=0.1), fx.scale(-0.01)),
        lambda o: o.chain(o.scale_by_trust_ratio(min_norm=1.5, trust_coefficient=0.3, eps=0.1), o.scale(-0.01))),
    "fromage": (lambda: fx.fromage(0.01), lambda o: o.fromage(0.01)),
    "fromage-schedule": (lambda: fx.fromage(_sched, min_norm=0.1), lambda o: o.fromage(_sched, min_norm=0.1)),
    "lamb": (lambda: fx.lamb(0.01), lambda o: o.lamb(0.01)),
    "lamb-args": (lambda: fx.lamb(_sched, b1=0.5, b2=0.9, eps=1e-3, eps_root=1e-4, weight_decay=0.1, mask=TREE_MASK),
                  lambda o: o.lamb(_sched, b1=0.5, b2=0.9, eps=1e-3, eps_root=1e-4, weight_decay=0.1, mask=TREE_MASK)),
    "lars": (lambda: fx.lars(0.1), lambda o: o.lars(0.1)),
    "lars-args": (lambda: fx.lars(_sched, **_LARS_ARGS), lambda o: o.lars(_sched, **_LARS_ARGS)),
    "sign_sgd": (lambda: fx.sign_sgd(0.01), lambda o: o.sign_sgd(0.01)),
    "sign_sgd-schedule": (lambda: fx.sign_sgd(_sched), lambda o: o.sign_sgd(_sched)),
    "signum": (lambda: fx.signum(0.01), lambda o: o.signum(0.01)),
    "signum-args": (lambda: fx.signum(_sched, beta=0.5, accumulator_dtype=torch.float32),
                    lambda o: o.signum(_sched, beta=0.5, accumulator_dtype="float32")),
    "rprop": (lambda: fx.rprop(0.01), lambda o: o.rprop(0.01)),
    # bounds that bind: step sizes grow to 0.2 and shrink to 0.05
    "rprop-args": (lambda: fx.rprop(0.1, eta_minus=0.3, eta_plus=1.5, min_step_size=0.05, max_step_size=0.2),
                   lambda o: o.rprop(0.1, eta_minus=0.3, eta_plus=1.5, min_step_size=0.05, max_step_size=0.2)),
}


# --- Optax's alias_test.test_optimization, for this family: (name, kwargs, complex64 too) ---------------
# Optax runs 10000 steps to the optimum; here both libraries run 50 steps and the trajectories are compared.
# noisy_sgd runs with eta=0 (its noise cannot match); sign_sgd and signum skip Rosenbrock, as Optax does.

OPTIMIZATION = [
    ("adafactor", {"learning_rate": 5e-3}, True),
    ("adafactor", {}, True),
    ("fromage", {"learning_rate": 5e-3}, False),
    ("lamb", {"learning_rate": 1e-3}, True),
    ("lars", {"learning_rate": 1.0}, True),
    ("noisy_sgd", {"learning_rate": 1e-3, "eta": 0.0, "key": 0}, False),
    ("rprop", {"learning_rate": 1e-1}, False),
    ("sign_sgd", {"learning_rate": 1e-1}, False),
    ("signum", {"learning_rate": 1e-2}, False),
    ("sm3", {"learning_rate": 1.0}, False),
]


def target(name: str, complex_: bool):
    """Optax's targets: (initial params, objective(params, xp)); ``xp`` is torch or jax.numpy."""
    if name == "parabola":
        init, final = [-1.0, 10.0, 1.0], [1.0, -1.0, 1.0]
        final = [f * (1 + 1j) for f in final] if complex_ else final
        return init, lambda p, xp: (abs(p - xp.asarray(final, dtype=p.dtype)) ** 2).sum()
    a, b = (1 + 1j if complex_ else 1.0), 100.0
    return [0.0, 0.0], lambda p, xp: abs(a - p[0]) ** 2 + b * abs(p[1] - p[0] ** 2) ** 2


def trajectories(name: str, kwargs: dict, target_name: str, complex_: bool, steps: int = 50):
    """Params after each step, fxtrain's (torch autograd) and Optax's (jax.grad, conjugated for complex)."""
    import jax
    import numpy as np
    import optax

    init, objective = target(target_name, complex_)
    tdtype, jdtype = (torch.complex64, np.complex64) if complex_ else (torch.float32, np.float32)
    tx, otx = getattr(fx, name)(**kwargs), getattr(optax, name)(**kwargs)
    p, ours = torch.tensor(init, dtype=tdtype), []
    state = tx.init(p)
    for _ in range(steps):
        q = p.clone().requires_grad_()
        (g,) = torch.autograd.grad(objective(q, torch).real, q)
        with torch.no_grad():
            u, state = tx.update(g, state, p)
        p = fx.apply_updates(p, u)
        ours.append(p.numpy().copy())

    @jax.jit  # Optax op by op costs seconds here
    def step(jp, ostate):
        g = jax.grad(lambda x: objective(x, jax.numpy).real)(jp).conj()
        u, ostate = otx.update(g, ostate, jp)
        return optax.apply_updates(jp, u), ostate

    jp, theirs = jax.numpy.asarray(init, dtype=jdtype), []
    ostate = otx.init(jp)
    for _ in range(steps):
        jp, ostate = step(jp, ostate)
        theirs.append(np.asarray(jp))
    return ours, theirs
