"""Scaling transforms: ``scale``, ``scale_by_learning_rate``, ``scale_by_schedule``."""

from __future__ import annotations

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, transform


@transform
def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiplies updates by ``step_size`` (Optax's ``scale``).

    Args:
      step_size: a Python number or a 0-dim tensor (then no host sync, and it may change between calls).

    >>> import torch, fxtrain as fx
    >>> tx = fx.scale(0.5)
    >>> tx.update({"w": torch.ones(2)}, tx.init(None))[0]["w"].tolist()
    [0.5, 0.5]
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        tree.scale_(tree.leaves(updates), step_size)
        return updates, state

    return GradientTransformation(init_fn, update_fn)
