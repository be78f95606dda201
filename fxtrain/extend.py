"""Writing your own transforms: the machinery the library's own wrappers use (``fx.extend``).

What ``chain``, ``masked``, ``apply_if_finite`` or ``lookahead`` are built from, kept apart from the
optimizers users pick (as Equinox keeps its machinery in ``eqx.internal``). The functions live in
:mod:`fxtrain._base`; this module is their public door. docs/transforms.md walks through a wrapper.

* :func:`combine` builds a wrapper of child transforms carrying their merged traits;
  :func:`call` runs a child inside your ``update_fn`` (what you pass stays readable), :func:`call_` donates it;
  :func:`kernel` is a transform's update kernel.
* :func:`forwarded` gives the traits a wrapper passes on from its children (for ``fx.with_traits``).
* :func:`check_learning_rate`, :func:`check_nonnegative`, :func:`check_needs_params`: argument checks, one
  message each.
* :func:`describe`: how a hyperparameter prints in a transform's repr.

Example:
    >>> import torch, fxtrain as fx
    >>> def doubled(tx):                    # tx's update, times two
    ...     def update_fn(updates, state, params=None, **extra_args):
    ...         new, state = fx.extend.call(tx, updates, state, params, extra_args)
    ...         return fx.tree.map(lambda u: 2 * u, new), state
    ...     return fx.extend.combine(tx.init, update_fn, (tx,), lambda s: (s,))
    >>> tx = doubled(fx.scale(-0.5))
    >>> g = {"w": torch.ones(2)}
    >>> tx.update(g, tx.init(g))[0]["w"].tolist()
    [-1.0, -1.0]
"""

from fxtrain._base import (
    call,
    call_,
    check_learning_rate,
    check_needs_params,
    check_nonnegative,
    combine,
    describe,
    forwarded,
    kernel,
)

__all__ = ["call", "call_", "check_learning_rate", "check_needs_params", "check_nonnegative", "combine", "describe",
           "forwarded", "kernel"]
