"""Catalogue cases of this family (see tests/cases/__init__.py)."""

import fxtrain as fx  # noqa: F401

CONFORMANCE: dict = {}
COMPOSABLE: dict = {}
OPTIMIZERS: dict = {}
DTENSOR: dict = {}
