"""Updates on a period of steps: ``apply_every`` (a transform), ``periodic_update`` and ``incremental_update``
(functions on param trees: target networks and Polyak averages). Optax's semantics, arguments and state.

``apply_every`` decides on device (its counter lives with the params, as in Optax): every call sums the
gradients into its accumulator and multiplies the emitted updates by 0 or 1, so there is no host sync.
For Optax's ``MultiSteps`` semantics (the rest of the chain runs once per window), see
:func:`fxtrain.accumulate`.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, transform
from fxtrain.transforms._moments import counter

__all__ = ["ApplyEvery", "apply_every", "incremental_update", "periodic_update"]


class ApplyEvery(NamedTuple):
    """State of :func:`apply_every` (Optax's, same name and fields).

    Attributes:
      count: calls in the current window, in ``[0, k)`` (0-dim int32).
      grad_acc: the sum of this window's gradients, in the params' dtype.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.apply_every(2).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ApplyEvery), state._fields
        (True, ('count', 'grad_acc'))
    """

    count: torch.Tensor
    grad_acc: Any


@transform(elementwise=True)
def apply_every(k: int = 1) -> GradientTransformation:
    r"""Sums the gradients of ``k`` calls and emits the sum every ``k``-th call, zeros otherwise (Optax's).

    With :math:`c` the call index in the window (``count``)::

        grad_acc = grad_acc * (c != 0) + g
        updates  = grad_acc * (c == k - 1)

    Unlike :func:`fxtrain.accumulate`, the transforms chained after it run on every call (on zeros between
    emissions), so their states move every call: ``apply_every(2)`` on half batches is not one full batch.

    Args:
      k: emit every ``k`` calls, an int >= 1.

    Returns:
      A transform with an :class:`ApplyEvery` state.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.apply_every(k=2)
        >>> state = tx.init(torch.zeros(2))
        >>> u, state = tx.update(torch.ones(2), state)
        >>> v, state = tx.update(torch.full((2,), 2.0), state)
        >>> u.tolist(), v.tolist()
        ([0.0, 0.0], [3.0, 3.0])

    References:
      Optax, `apply_every <https://optax.readthedocs.io/en/latest/api/transformations.html>`_.
    """
    if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
        raise ValueError(f"apply_every: k={k!r} must be an int >= 1")
    k = int(k)

    def init_fn(params):
        return ApplyEvery(count=counter(params), grad_acc=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, acc = tree.align(updates, state.grad_acc)
        c = state.count % k
        # Multiplications by 0 or 1 (Optax's): an Inf kept in the accumulator gives NaN, as there.
        acc = tree.add_(tree.scale_(acc, (c != 0).to(_opmath(acc))), g)
        g = tree.scale_(tree.copy_(g, acc), (c == k - 1).to(_opmath(g)))
        count = tree.inc_(state.count)
        count = count % k if tree.is_functional() else count.remainder_(k)
        return tree.put(updates, updates, g), ApplyEvery(count, tree.put(state.grad_acc, updates, acc))

    return GradientTransformation(init_fn, update_fn)


def _opmath(xs: list) -> torch.dtype:
    return torch.promote_types(xs[0].dtype, torch.float32) if xs else torch.float32


def incremental_update(new_tensors: Any, old_tensors: Any, step_size: Any) -> Any:
    r"""A Polyak (exponential moving) average of params: ``step_size * new + (1 - step_size) * old`` (Optax's).

    Pure, leafwise; a ``None`` in ``new_tensors`` stays ``None``.

    Args:
      new_tensors: the latest params.
      old_tensors: the moving average so far (same structure).
      step_size: weight of the new params, a number or a 0-dim tensor.

    Returns:
      The new moving average, a tree like ``new_tensors``.

    Example:
        >>> import torch, fxtrain as fx
        >>> fx.incremental_update({"w": torch.full((2,), 2.0)}, {"w": torch.ones(2)}, 0.5)["w"].tolist()
        [1.5, 1.5]

    References:
      Polyak and Juditsky, `Acceleration of stochastic approximation by averaging
      <https://epubs.siam.org/doi/10.1137/0330046>`_, 1992.
    """
    return tree.map(lambda new, old: step_size * new + (1.0 - step_size) * old, new_tensors, old_tensors)


def periodic_update(new_tensors: Any, old_tensors: Any, steps: Any, update_period: Any) -> Any:
    """``new_tensors`` when ``steps`` is a multiple of ``update_period``, else ``old_tensors`` (Optax's).

    A slow copy of the params for a target network. With Python ints the choice is made on the host and
    one of the two trees comes back as is; with a tensor ``steps`` it is made on device, leaf by leaf
    (``torch.where``, no host sync).

    Args:
      new_tensors: the latest params.
      old_tensors: the slow copy (same structure).
      steps: update steps taken so far, an int or a 0-dim integer tensor.
      update_period: copy every ``update_period`` steps.

    Returns:
      ``new_tensors`` or ``old_tensors``.

    Example:
        >>> import torch, fxtrain as fx
        >>> new, old = {"w": torch.full((1,), 2.0)}, {"w": torch.ones(1)}
        >>> fx.periodic_update(new, old, 4, 5)["w"].tolist(), fx.periodic_update(new, old, 5, 5)["w"].tolist()
        ([1.0], [2.0])

    References:
      Mnih et al., `Human-level control through deep reinforcement learning
      <https://www.nature.com/articles/nature14236>`_, 2015.
    """
    if not isinstance(steps, torch.Tensor) and not isinstance(update_period, torch.Tensor):
        return new_tensors if steps % update_period == 0 else old_tensors
    now = torch.as_tensor(steps) % update_period == 0
    return tree.map(lambda new, old: torch.where(now.to(new.device), new, old), new_tensors, old_tensors)
