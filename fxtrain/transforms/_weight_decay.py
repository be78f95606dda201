"""Decoupled weight decay: ``add_decayed_weights`` (Optax's)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, check_needs_params, check_nonnegative, transform
from fxtrain.transforms._masking import Mask, masked
from fxtrain.schedules import value_at
from fxtrain.transforms._moments import Scalar, counter, is_zero
from fxtrain.transforms._scaling import precision


class WeightDecaySchedule(NamedTuple):
    """State of :func:`add_decayed_weights` when the weight decay is a schedule: updates so far.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.add_decayed_weights(fx.constant_schedule(0.1)).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.WeightDecaySchedule), state._fields
        (True, ('count',))
    """

    count: torch.Tensor  # 0-dim int32


@transform(elementwise=True)
def add_decayed_weights(weight_decay: Scalar | Callable = 0.0, mask: Mask | None = None
                        ) -> GradientTransformation:
    r"""Adds the params scaled by ``weight_decay`` to the updates (Optax's ``add_decayed_weights``).

    .. math:: u_t = g_t + \lambda_t\, \theta_t

    Placed before the learning rate (as in :func:`fxtrain.adamw`) this is decoupled weight decay.

    Args:
      weight_decay: :math:`\lambda`, a non-negative number, a 0-dim tensor, or a schedule of the count.
      mask: where to apply it: a tree of bools (the params' structure or a prefix), or a function of the
        params returning one (see :func:`fxtrain.masked`). ``None``: everywhere.

    Returns:
      A transform with state ``EmptyState``, or :class:`WeightDecaySchedule` for a schedule (wrapped in
      :class:`fxtrain.MaskedState` when ``mask`` is given).

    Example:
        >>> import torch, fxtrain as fx
        >>> params = {"w": torch.full((2,), 2.0), "b": torch.ones(1)}
        >>> tx = fx.add_decayed_weights(0.5, mask={"w": True, "b": False})
        >>> u, _ = tx.update(fx.tree.map(torch.zeros_like, params), tx.init(params), params)
        >>> u["w"].tolist(), u["b"].tolist()
        ([1.0, 1.0], [0.0])

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    check_nonnegative("add_decayed_weights", weight_decay=weight_decay)
    scheduled = callable(weight_decay)

    def init_fn(params):
        return WeightDecaySchedule(count=counter(params)) if scheduled else EmptyState()

    def update_fn(updates, state, params=None):
        check_needs_params("add_decayed_weights", params)
        if updates is None:  # an empty tree of updates (Optax's test: update(None, 0, params) -> (None, 0))
            return None, WeightDecaySchedule(tree.inc_(state.count)) if scheduled else state
        g, p = tree.align(updates, params, what="params")
        if scheduled:
            g = tree.add_(g, p, value_at(weight_decay, state.count, precision(g)))  # float64 runs: float64
            state = WeightDecaySchedule(tree.inc_(state.count))
        elif not is_zero(weight_decay):
            g = tree.add_(g, p, weight_decay)
        return tree.put(updates, updates, g), state

    tx = GradientTransformation(init_fn, update_fn)
    return tx if mask is None else masked(tx, mask)
