"""Numerics the parameter-free contrib optimizers share (DoG, DoWG, MoMo, Mechanic, D-Adaptation, MADGRAD).

A map: :func:`tree_sum_sq` (a tree's squared norm, DTensors summed over their meshes), :func:`scheduled` (a
hyperparameter or its schedule's value), :func:`safe_sqrt` (a square root with a zero gradient at 0) and
:data:`LearningRate` (a number, 0-dim tensor or schedule).

Example:
    >>> import torch
    >>> from fxtrain.contrib._numerics import safe_sqrt, tree_sum_sq
    >>> float(tree_sum_sq([torch.tensor([3.0]), torch.tensor([4.0])])), safe_sqrt(torch.tensor([0.0, 4.0])).tolist()
    (25.0, [0.0, 2.0])
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fxtrain import distributed, tree
from fxtrain.schedules import value_at
from fxtrain.transforms._moments import Scalar
from fxtrain.transforms._scaling import precision

__all__ = ["LearningRate", "tree_sum_sq", "scheduled", "safe_sqrt"]

LearningRate = Scalar | Callable


def tree_sum_sq(xs: list) -> torch.Tensor:
    """``|x|^2`` over all leaves, float32 or wider; DTensor leaves summed over their meshes (the norm engine)."""
    return distributed.global_sum_sq(xs).sum_sq


def scheduled(value: Any, count: torch.Tensor, updates: Any) -> Any:
    """``value``, or its schedule at ``count`` computed in the updates' precision (float64 runs: float64)."""
    return value_at(value, count, precision(tree.leaves(updates))) if callable(value) else value


def safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` whose gradient at 0 is 0, not NaN: the first update's distance is 0, and Optax's gradient
    through it (``jax.grad`` through ``dog``) is NaN."""
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, 1.0).sqrt(), 0.0)
