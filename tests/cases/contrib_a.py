"""Catalogue cases of this family (see tests/cases/__init__.py): muon, prodigy, adopt, ademamix."""

import fxtrain as fx

CONFORMANCE: dict = {
    "scale_by_adopt": lambda: fx.contrib.scale_by_adopt(nesterov=True),
    "adopt": lambda: fx.contrib.adopt(1e-2),
}
COMPOSABLE: dict = {
    "adopt": (lambda: fx.contrib.adopt(1e-2, nesterov=True), lambda o: o.contrib.adopt(1e-2, nesterov=True)),
}
OPTIMIZERS: dict = {
    "adopt": lambda: fx.contrib.adopt(1e-2),
}
DTENSOR: dict = {}
