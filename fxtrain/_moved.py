"""Deprecation aliases for public names that moved, and clear errors for the ones removed.

A package whose names moved ends with ``__getattr__ = moved_names(__name__, {old: "new.module.name"}, removed)``:
Python calls it only for a name the module does not define, so the old name resolves to the new object with a
:class:`DeprecationWarning` that names its new place, and a removed one raises an :class:`AttributeError` that
says what replaces it. tests/test_public_names.py checks every public name of the landed commits listed in
tests/cases/public_names.json.

The new place is imported by name when an old name is first read (``importlib``): an alias in a lower layer
(``fxtrain.distributed.fully_sharded``, now in :mod:`fxtrain.parallel` above it) adds no import between the
layers, and nothing is imported until old code asks for it.

Example:
    >>> import warnings, fxtrain as fx
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     fn = fx.distributed.fully_sharded
    >>> fn is fx.parallel.fully_sharded, str(caught[0].message)
    (True, 'fxtrain.distributed.fully_sharded moved to fxtrain.parallel.fully_sharded: import it from there...')
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

__all__ = ["moved_names"]


def moved_names(module: str, moves: dict[str, str], removed: dict[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``'s names that moved (``moves``: old name -> ``"package.name"``) or
    were removed (``removed``: old name -> what to use instead).

    Args:
      module: the module's dotted name (``__name__``).
      moves: each old name and the dotted path of its new place.
      removed: each removed name and the sentence that says what replaces it.

    Returns:
      ``__getattr__(name)``: the moved object (warning once per call site, as Python's ``default`` filter
      does), else :class:`AttributeError`.

    Example:
        >>> import fxtrain._moved as m
        >>> get = m.moved_names("pkg", {}, {"old": "use pkg.new(x)"})
        >>> get("old")
        Traceback (most recent call last):
        ...
        AttributeError: pkg.old was removed: use pkg.new(x)
    """
    removed = removed or {}

    def __getattr__(name: str) -> Any:
        if name in moves:
            home, _, attr = moves[name].rpartition(".")
            warnings.warn(f"{module}.{name} moved to {moves[name]}: import it from there (the old name will be "
                          "removed)", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(home), attr)
        if name in removed:
            raise AttributeError(f"{module}.{name} was removed: {removed[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
