"""Lookahead (Zhang et al., 2019): a fast optimizer's steps, pulled back towards slow params every few steps.

The params are a pair, :class:`LookaheadParams` ``(fast, slow)``, and so are the updates, so that
``apply_updates(params, updates)`` moves both: gradients are taken at ``params.fast``; ``params.slow``
is for evaluation. Optax's semantics, names and state. The synchronization is decided on device (a
0-dim step counter, no host sync): its updates are multiplied by 0 or 1, as in Optax.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, combine, call_, check_nonnegative, transform, with_traits
from fxtrain.transforms._conditionality import select
from fxtrain.transforms._moments import counter

__all__ = ["LookaheadParams", "LookaheadState", "lookahead"]


class LookaheadState(NamedTuple):
    """State of :func:`lookahead` (Optax's, same fields).

    Attributes:
      fast_state: the fast optimizer's state.
      steps_since_sync: fast steps since the last synchronization (0-dim int32).

    Example:
        >>> import torch, fxtrain as fx
        >>> params = fx.LookaheadParams.init_synced({"w": torch.zeros(2)})
        >>> state = fx.lookahead(fx.sgd(0.1), 5, 0.5).init(params)
        >>> isinstance(state, fx.LookaheadState), state._fields
        (True, ('fast_state', 'steps_since_sync'))
    """

    fast_state: Any
    steps_since_sync: torch.Tensor


class LookaheadParams(NamedTuple):
    """The fast and slow params of :func:`lookahead` (Optax's): take gradients at ``fast``, evaluate ``slow``.

    >>> import torch
    >>> p = LookaheadParams.init_synced({"w": torch.ones(1)})
    >>> p.fast is p.slow
    True
    """

    fast: Any
    slow: Any

    @classmethod
    def init_synced(cls, params: Any) -> "LookaheadParams":
        """Both halves set to ``params`` (the same tensors: ``apply_updates`` is pure, so they part on the
        first update)."""
        return cls(fast=params, slow=params)


@transform(elementwise=None)
def lookahead(fast_optimizer: GradientTransformation, sync_period: int, slow_step_size: Any,
              reset_state: bool = False) -> GradientTransformation:
    r"""Lookahead: ``sync_period`` steps of ``fast_optimizer``, then the slow params move ``slow_step_size``
    of the way to the fast ones and the fast params restart from there (Optax's ``lookahead``).

    With :math:`u` the fast optimizer's update, :math:`s` = 1 on the ``sync_period``-th step of each
    period (0 otherwise) and :math:`\alpha` = ``slow_step_size``, :math:`d = \text{fast} + u - \text{slow}`::

        updates.slow = alpha * s * d
        updates.fast = u - s * (1 - alpha) * d

    so after a synchronization ``fast == slow == slow + alpha * (fast + u - slow)``. Apply the updates as
    they come (they are computed for both halves together).

    Args:
      fast_optimizer: the inner optimizer, run on every call on the gradients at ``params.fast``.
      sync_period: fast steps per synchronization, an int >= 1.
      slow_step_size: :math:`\alpha`, a number or a 0-dim tensor (0: the slow params never move; 1: no
        lookahead).
      reset_state: reinitialize the fast optimizer's state at each synchronization.

    Returns:
      A transform whose ``init`` takes :class:`LookaheadParams` (or the fast params alone) and whose
      ``update(grads, state, params)`` needs ``params`` as :class:`LookaheadParams` and returns
      :class:`LookaheadParams` updates; state :class:`LookaheadState`. Extra arguments reach the fast
      optimizer if it reads them.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.lookahead(fx.sgd(0.5), sync_period=2, slow_step_size=0.5)
        >>> params = fx.LookaheadParams.init_synced({"w": torch.tensor([4.0])})
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     grads = {"w": torch.tensor([2.0])}          # the gradient at params.fast
        ...     updates, state = tx.update(grads, state, params)
        ...     params = fx.apply_updates(params, updates)
        >>> params.fast["w"].tolist(), params.slow["w"].tolist()  # fast 4 -> 3 -> 2, then both to slow + 0.5 * (2 - 4)
        ([3.0], [3.0])

    References:
      Zhang et al., `Lookahead Optimizer: k steps forward, 1 step back <https://arxiv.org/abs/1907.08610>`_,
      2019.
    """
    if not isinstance(sync_period, numbers.Integral) or isinstance(sync_period, bool) or sync_period < 1:
        raise ValueError(f"lookahead: sync_period={sync_period!r} must be an int >= 1")
    check_nonnegative("lookahead", slow_step_size=slow_step_size)

    def init_fn(params):
        fast = params.fast if isinstance(params, LookaheadParams) else params  # Optax accepts the fast params too
        return LookaheadState(fast_state=fast_optimizer.init(fast), steps_since_sync=counter(fast))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(params, LookaheadParams):
            raise ValueError("lookahead: update needs params=LookaheadParams(fast, slow) (the slow params move "
                             f"at each synchronization), got {type(params).__name__}; start from "
                             "fx.LookaheadParams.init_synced(params)")
        updates, fast_state = call_(fast_optimizer, updates, state.fast_state, params.fast, extra_args)
        sync = state.steps_since_sync == sync_period - 1
        us, fs, ss = tree.align(updates, params.fast, params.slow, what="params")
        diff = tree.add_(_sum(fs, us), ss, alpha=-1.0)  # fast + u - slow, a new buffer
        dtype = torch.promote_types(us[0].dtype, torch.float32) if us else torch.float32
        s = sync.to(dtype)
        us = tree.add_(us, diff, alpha=-(s * (1 - slow_step_size)))
        slow = tree.scale_(diff, s * slow_step_size)
        if reset_state:  # the fresh state where this call synchronizes, on device
            fast_state = _reset_where(sync, fast_state, fast_optimizer.init(params.fast))
        steps = tree.inc_(state.steps_since_sync)
        steps = steps % sync_period if tree.is_functional() else steps.remainder_(sync_period)
        new = LookaheadParams(fast=tree.put(updates, updates, us), slow=_tree_like(updates, slow))
        return new, LookaheadState(fast_state, steps)

    # The updates are a (fast, slow) pair: no Partial gradients (the step reduces them first).
    return with_traits(combine(init_fn, update_fn, (fast_optimizer,)), partial_grads=False)


def _reset_where(sync: torch.Tensor, state: Any, fresh: Any) -> Any:
    """``fresh`` where the 0-dim ``sync`` is true, else ``state``, every leaf (Optax blends every leaf).

    Tensors are selected on device (:func:`select`). A host number (a Python bool or int in a hand-written
    state) that differs from its fresh value, or meets a tensor there, cannot wait for a device decision
    as a number: it becomes a 0-dim tensor selected on device, as Optax's blend turns it into an array.
    Equal host values stay as they are.
    """
    old, spec = tree.flatten(state)
    new = tree.flatten(fresh)[0]
    if len(new) != len(old):
        raise ValueError(f"lookahead(reset_state=True): the fast optimizer's init state differs in structure from "
                         f"its updated state at '{tree.first_mismatch(state, fresh)}'")
    host = [i for i, (a, b) in enumerate(zip(old, new))
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) and not _same(a, b)]
    for i in host:
        if not all(isinstance(v, (numbers.Number, torch.Tensor)) for v in (old[i], new[i])):
            raise ValueError(f"lookahead(reset_state=True): the fast optimizer's state leaf "
                             f"'{tree.paths(state)[i]}' is {old[i]!r}, not a tensor or a number, and differs from "
                             f"its init value {new[i]!r}: it cannot be reset on device; keep it a tensor")
        old[i], new[i] = (torch.as_tensor(v, device=sync.device) for v in (old[i], new[i]))
    return select(~sync, tree.unflatten(spec, old), tree.unflatten(spec, new), what="fast optimizer state")


def _same(a: Any, b: Any) -> bool:
    """Equal host values of the same type (a tensor is never the same as a number)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # values that do not compare to a bool (arrays): taken as different
        return False


def _sum(xs: list, ys: list) -> list:
    """``xs + ys`` as new tensors (``xs`` are params: never written)."""
    if tree.is_functional():
        return [x + y for x, y in zip(xs, ys)]
    return list(torch._foreach_add(xs, ys))


def _tree_like(like: Any, new: list) -> Any:
    """``like``'s structure with its non-``None`` leaves replaced by ``new`` (new tensors, in either op mode)."""
    flat, spec = tree.flatten(like)
    it = iter(new)
    return tree.unflatten(spec, [None if x is None else next(it) for x in flat])
