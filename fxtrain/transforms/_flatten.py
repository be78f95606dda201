"""``flatten``: runs a transform on one vector holding every leaf (Optax's ``flatten``, in ``_layouts``)."""

from __future__ import annotations

from typing import Any

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, combine, call_, transform, with_traits

__all__ = ["flatten"]


@transform(elementwise=None)
def flatten(inner: GradientTransformation) -> GradientTransformation:
    """Runs ``inner`` on the concatenation of all leaves into one vector (Optax's ``flatten``).

    Fewer, larger tensors for a transform written leaf by leaf: its state is one vector per moment.
    Leaves are flattened in tree order (``None`` leaves skipped) and concatenated in their promoted
    dtype; the updates come back in the gradients' shapes and dtypes. The ``None`` leaves of the
    gradients must be those of the params ``init`` saw (the state is one vector of their total size).

    Args:
      inner: the transform to run on the flat vector.

    Returns:
      A transform whose state is ``inner``'s state for a 1-d vector; extra arguments reach ``inner``
      if it reads them.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.flatten(fx.adam(0.1))
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(3)}
        >>> state = tx.init(params)
        >>> state[0].mu.shape                          # one vector for the 7 elements
        torch.Size([7])
        >>> u, state = tx.update(params, state, params)
        >>> u["w"].shape, round(u["b"][0].item(), 4)
        (torch.Size([2, 2]), -0.1)

    References:
      Optax, `flatten <https://optax.readthedocs.io/en/latest/api/optimizer_wrappers.html>`_.
    """
    def init_fn(params):
        return inner.init(_flat(tree.leaves(params)))

    def update_fn(updates, state, params=None, **extra_args):
        us = tree.leaves(updates)
        flat_params = None if params is None else _flat(tree.leaves(params))
        new, state = call_(inner, _flat(us), state, flat_params, extra_args)
        pieces = [p.view(u.shape) for p, u in zip(torch.split(new, [u.numel() for u in us]), us)]
        return tree.put(updates, updates, tree.copy_(us, pieces)), state

    # One vector mixes every leaf: Partial gradients are reduced before (the step does it).
    return with_traits(combine(init_fn, update_fn, (inner,)), partial_grads=False)


def _flat(xs: list) -> Any:
    """Every tensor of ``xs`` flattened and concatenated (a new buffer; ``xs`` are never written)."""
    if not xs:
        return torch.zeros(0)
    return torch.cat([x.reshape(-1) for x in xs])
