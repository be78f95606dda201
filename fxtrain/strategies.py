"""Moved: the runner's layouts (``fxtrain.strategies`` until issue 26) are :mod:`fxtrain.parallel`.

Each old name resolves to its new place with a :class:`DeprecationWarning` (see :mod:`fxtrain._moved`).

Example:
    >>> import warnings, fxtrain.strategies, fxtrain.parallel
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     fxtrain.strategies.parallelize is fxtrain.parallel.parallelize
    True
"""

from fxtrain._moved import moved_names

__getattr__ = moved_names(__name__, {
    name: f"fxtrain.parallel.{name}" for name in ("Parallel", "evaluate", "forward", "loss_function", "parallelize")})
