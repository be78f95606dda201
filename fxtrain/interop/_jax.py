"""The one place that imports JAX: lazily, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_HINT = "pip install 'fxtrain[jax]'"


def require(name: str = "jax", *, what: str = "fxtrain.interop") -> ModuleType:
    """Imports ``name`` (``jax``, ``jax.numpy``...) or raises ImportError naming the ``jax`` extra."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{what} needs JAX, which is an optional extra of fxtrain: {EXTRA_HINT}") from e


def is_jax_array(x: object) -> bool:
    """Whether ``x`` is a ``jax.Array``, without importing JAX when nobody else has."""
    import sys

    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)
