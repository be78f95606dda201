"""Scaling transforms: ``scale``, ``scale_by_learning_rate``, ``scale_by_schedule``."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, check_nonnegative, identity, transform
from fxtrain.transforms._moments import counter

Schedule = Callable[[torch.Tensor], "float | torch.Tensor"]


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of updates so far (0-dim int32)."""

    count: torch.Tensor


@transform
def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    r"""Multiplies updates by ``step_size`` (Optax's ``scale``).

    .. math:: u_t = s\, g_t

    Args:
      step_size: a Python number or a 0-dim tensor (then no host sync, and it may change between calls).

    Returns:
      A stateless transform (state ``EmptyState``).

    Example:
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
        return tree.put(updates, updates, tree.scale_(tree.leaves(updates), step_size)), state

    return GradientTransformation(init_fn, update_fn)


@transform
def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    r"""Multiplies updates by ``step_size_fn(count)``, ``count`` being the number of updates so far.

    .. math:: u_t = \eta(t)\, g_t, \qquad t = 0, 1, \dots

    Args:
      step_size_fn: a schedule: called with the count as a 0-dim int32 tensor, it returns a Python number
        or a 0-dim tensor (computed on device: the update never waits for the host).

    Returns:
      A transform with state :class:`ScaleByScheduleState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_schedule(lambda count: 0.5 ** count)
        >>> g = {"w": torch.ones(1)}
        >>> state = tx.init(g)
        >>> for _ in range(3):
        ...     u, state = tx.update(g, state)
        >>> u["w"].tolist(), int(state.count)
        ([0.25], 3)
    """
    def init_fn(params):
        return ScaleByScheduleState(count=counter(params))

    def update_fn(updates, state, params=None):
        del params
        new = tree.scale_(tree.leaves(updates), step_size_fn(state.count))
        return tree.put(updates, updates, new), ScaleByScheduleState(tree.inc_(state.count))

    return GradientTransformation(init_fn, update_fn)


@transform
def scale_by_learning_rate(learning_rate: float | torch.Tensor | Schedule | None = None, *,
                           flip_sign: bool = True) -> GradientTransformation:
    r"""Multiplies updates by the negative learning rate, a number or a schedule (Optax's).

    .. math:: u_t = -\eta_t\, g_t

    Args:
      learning_rate: a non-negative number, a 0-dim tensor, or a schedule of the update count (then
        :func:`scale_by_schedule` is used). ``None`` leaves updates unchanged.
      flip_sign: scale by ``-learning_rate`` (descent, the default) rather than ``learning_rate``.

    Returns:
      :func:`scale` (state ``EmptyState``) or :func:`scale_by_schedule` (state
      :class:`ScaleByScheduleState`), or :func:`fxtrain.identity` for ``None``.

    Raises:
      ValueError: a negative learning rate (Optax would silently ascend).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_learning_rate(0.1)
        >>> tx
        scale_by_learning_rate(learning_rate=0.1)
        >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]["w"].tolist()
        [-0.1...]
    """
    check_nonnegative("scale_by_learning_rate", learning_rate=learning_rate)
    if learning_rate is None:
        return identity()
    sign = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)
