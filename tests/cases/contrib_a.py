"""Catalogue cases of this family (see tests/cases/__init__.py): muon, prodigy, adopt, ademamix."""

import fxtrain as fx

CONFORMANCE: dict = {
    "scale_by_adopt": lambda: fx.contrib.scale_by_adopt(nesterov=True),
    "adopt": lambda: fx.contrib.adopt(1e-2),
    "scale_by_ademamix": lambda: fx.contrib.scale_by_ademamix(b3=fx.linear_schedule(0.9, 0.999, 10)),
    "ademamix": lambda: fx.contrib.ademamix(1e-2, weight_decay=0.1),
    "scale_by_simplified_ademamix": lambda: fx.contrib.scale_by_simplified_ademamix(alpha=2.0),
    "simplified_ademamix": lambda: fx.contrib.simplified_ademamix(1e-2, alpha=1.0),
    "prodigy": lambda: fx.contrib.prodigy(estim_lr0=1e-2, weight_decay=0.1),
}
COMPOSABLE: dict = {
    "adopt": (lambda: fx.contrib.adopt(1e-2, nesterov=True), lambda o: o.contrib.adopt(1e-2, nesterov=True)),
    "ademamix": (lambda: fx.contrib.ademamix(1e-2, b3=0.99, weight_decay=0.1),
                 lambda o: o.contrib.ademamix(1e-2, b3=0.99, weight_decay=0.1)),
    "simplified_ademamix": (lambda: fx.contrib.simplified_ademamix(1e-2, alpha=2.0),
                            lambda o: o.contrib.simplified_ademamix(1e-2, alpha=2.0)),
    "prodigy": (lambda: fx.contrib.prodigy(0.5, estim_lr0=1e-2, weight_decay=0.1),
                lambda o: o.contrib.prodigy(0.5, estim_lr0=1e-2, weight_decay=0.1)),
}
OPTIMIZERS: dict = {
    "adopt": lambda: fx.contrib.adopt(1e-2),
    "ademamix": lambda: fx.contrib.ademamix(1e-2),
    "simplified_ademamix": lambda: fx.contrib.simplified_ademamix(1e-2),
    "prodigy": lambda: fx.contrib.prodigy(),
}
DTENSOR: dict = {}
