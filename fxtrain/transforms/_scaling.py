"""Scaling transforms: ``scale``, ``scale_by_learning_rate``, ``scale_by_schedule``."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, check_nonnegative, identity, transform
from fxtrain.schedules import Schedule as _Schedule
from fxtrain.schedules import value_at
from fxtrain.transforms._moments import counter

Schedule = Callable[[torch.Tensor], "float | torch.Tensor"]


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of updates so far (0-dim int32).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_schedule(fx.constant_schedule(0.1)).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByScheduleState), state._fields
        (True, ('count',))
    """

    count: torch.Tensor


@transform(elementwise=True)
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


@transform(elementwise=True)
def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    r"""Multiplies updates by ``step_size_fn(count)``, ``count`` being the number of updates so far.

    .. math:: u_t = \eta(t)\, g_t, \qquad t = 0, 1, \dots

    Args:
      step_size_fn: a schedule: called with the count as a 0-dim int32 tensor, it returns a Python number
        or a 0-dim tensor (computed on device: the update never waits for the host). Evaluated in the
        updates' precision (float32 at least, float64 in a float64 run; see :func:`fxtrain.schedules.value_at`).

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
        leaves = tree.leaves(updates)
        new = tree.scale_(leaves, value_at(step_size_fn, state.count, precision(leaves)))
        return tree.put(updates, updates, new), ScaleByScheduleState(tree.inc_(state.count))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=True)
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
    if callable(learning_rate):  # a Schedule, so that it computes in the updates' precision
        return scale_by_schedule(_Schedule(lambda count: sign * learning_rate(count), lambda: repr(learning_rate)))
    return scale(sign * learning_rate)


def precision(leaves: list[torch.Tensor]) -> torch.dtype:
    """The dtype hyperparameters of updates ``leaves`` are computed in: their widest real floating dtype,
    float32 at least (float64 runs keep float64 schedules; bfloat16 ones get Optax's float32 values)."""
    dtype = torch.float32
    for x in leaves:
        if x is not None and (x.is_floating_point() or x.is_complex()):
            dtype = torch.promote_types(dtype, x.real.dtype if x.is_complex() else x.dtype)
    return dtype
