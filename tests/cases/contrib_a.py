"""Catalogue cases of this family (see tests/cases/__init__.py): muon, prodigy, adopt, ademamix."""

import fxtrain as fx


def _muon_dims(params):
    """Dimension numbers for every leaf (fxtrain lets vectors and scalars be 1 x n matrices; Optax refuses):
    the conformance trees have vectors, a 0-dim leaf and a 3-D leaf (axis 0 a batch)."""
    dims = fx.contrib.MuonDimensionNumbers
    return fx.tree.map(lambda x: {0: dims((), ()), 1: dims((), 0), 2: dims(), 3: dims(1, 2)}[x.ndim], params)


CONFORMANCE: dict = {
    "scale_by_muon": lambda: fx.contrib.scale_by_muon(weight_dimension_numbers=_muon_dims),
    "muon": lambda: fx.contrib.muon(1e-2, weight_decay=0.1, preconditioning="aol"),
    "scale_by_adopt": lambda: fx.contrib.scale_by_adopt(nesterov=True),
    "adopt": lambda: fx.contrib.adopt(1e-2),
    "scale_by_ademamix": lambda: fx.contrib.scale_by_ademamix(b3=fx.linear_schedule(0.9, 0.999, 10)),
    "ademamix": lambda: fx.contrib.ademamix(1e-2, weight_decay=0.1),
    "scale_by_simplified_ademamix": lambda: fx.contrib.scale_by_simplified_ademamix(alpha=2.0),
    "simplified_ademamix": lambda: fx.contrib.simplified_ademamix(1e-2, alpha=1.0),
    "prodigy": lambda: fx.contrib.prodigy(estim_lr0=1e-2, weight_decay=0.1),
}
COMPOSABLE: dict = {
    # Optax's side left out: its Newton-Schulz runs op by op under jax.grad (~30 s for this case); the
    # fxtrain-only checks (vmap equals separate runs, gradients through updates) still run, and
    # tests/test_muon.py compares with Optax (jitted) over 20 steps
    "muon": (lambda: fx.contrib.muon(1e-2, adaptive=True), None),
    "adopt": (lambda: fx.contrib.adopt(1e-2, nesterov=True), lambda o: o.contrib.adopt(1e-2, nesterov=True)),
    "ademamix": (lambda: fx.contrib.ademamix(1e-2, b3=0.99, weight_decay=0.1),
                 lambda o: o.contrib.ademamix(1e-2, b3=0.99, weight_decay=0.1)),
    "simplified_ademamix": (lambda: fx.contrib.simplified_ademamix(1e-2, alpha=2.0),
                            lambda o: o.contrib.simplified_ademamix(1e-2, alpha=2.0)),
    "prodigy": (lambda: fx.contrib.prodigy(0.5, estim_lr0=1e-2, weight_decay=0.1),
                lambda o: o.contrib.prodigy(0.5, estim_lr0=1e-2, weight_decay=0.1)),
}
OPTIMIZERS: dict = {
    "muon": lambda: fx.contrib.muon(1e-2),
    "adopt": lambda: fx.contrib.adopt(1e-2),
    "ademamix": lambda: fx.contrib.ademamix(1e-2),
    "simplified_ademamix": lambda: fx.contrib.simplified_ademamix(1e-2),
    "prodigy": lambda: fx.contrib.prodigy(),
}
DTENSOR: dict = {}


# --- parity with Optax over 20 steps (tests/test_optax_parity.py) ----------------------------------------

def _adopt(kwargs):
    return (lambda: fx.chain(fx.contrib.scale_by_adopt(**kwargs), fx.scale(-0.01)),
            lambda o: o.chain(o.contrib.scale_by_adopt(**kwargs), o.scale(-0.01)))


def _prodigy(kwargs):
    return lambda: fx.contrib.prodigy(**kwargs), lambda o: o.contrib.prodigy(**kwargs)


PARITY: dict = {
    "scale_by_adopt": _adopt({}),
    "scale_by_adopt-betas_eps_nesterov": _adopt({"b1": 0.5, "b2": 0.9, "eps": 1e-3, "nesterov": True}),
    "scale_by_adopt-no_clipping": _adopt({"use_clipping": False}),
    "scale_by_adopt-clip_fn": _adopt({"clip_value_fn": lambda c: 0.5 + 0.1 * c}),
    "prodigy": _prodigy({}),
    # a larger estim_lr0 makes the estimate move within 20 steps of the parity driver
    "prodigy-weight_decay": _prodigy({"learning_rate": 0.5, "betas": (0.8, 0.99), "estim_lr0": 1e-2,
                                      "weight_decay": 0.1}),
    "prodigy-safeguard": _prodigy({"beta3": 0.9, "eps": 1e-4, "estim_lr0": 1e-3, "estim_lr_coef": 2.0,
                                   "safeguard_warmup": True}),
}
