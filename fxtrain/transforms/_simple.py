"""Small transforms: ``ema``, ``zero_nans``, ``set_to_zero``, ``stateless_with_tree_map`` (Optax's)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fxtrain import distributed, tree
from fxtrain._base import EmptyState, GradientTransformation, Params, Updates, check_nonnegative, transform
from fxtrain.transforms._moments import Scalar, as_dtype, bias_correction, counter, ema_, safe_increment_

__all__ = ["EmaState", "ema", "ZeroNansState", "zero_nans", "set_to_zero", "stateless_with_tree_map"]


class EmaState(NamedTuple):
    """State of :func:`ema` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.ema(0.9).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.EmaState), state._fields
        (True, ('count', 'ema'))
    """

    count: torch.Tensor  # 0-dim int32: number of updates so far
    ema: Updates  # the moving average, not debiased, in accumulator_dtype (default: the param dtype)


@transform(elementwise=True)
def ema(decay: Scalar, debias: bool = True, accumulator_dtype: torch.dtype | str | None = None
        ) -> GradientTransformation:
    r"""An exponential moving average of past updates (Optax's ``ema``).

    .. math::
        m_t = \beta m_{t-1} + (1 - \beta) g_t, \qquad u_t = \frac{m_t}{1 - \beta^t} \text{ (debias) or } m_t.

    ``trace`` accumulates ``decay * trace + g`` instead; this is the average.

    Args:
      decay: the decay :math:`\beta` (a number or a 0-dim tensor).
      debias: divide by :math:`1 - \beta^t` (the state keeps the biased average).
      accumulator_dtype: dtype of the average (a ``torch.dtype`` or its name); ``None``: the param dtype.

    Returns:
      A transform with state :class:`EmaState`. Updates keep the gradients' dtype.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.ema(0.9)
        >>> g = {"w": torch.tensor([5.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), [round(x, 4) for x in state.ema["w"].tolist()]   # debiased: the first update is g
        ([5.0], [0.5])
    """
    check_nonnegative("ema", decay=decay)
    accumulator_dtype = as_dtype(accumulator_dtype, "ema: accumulator_dtype")

    def init_fn(params):
        return EmaState(count=counter(params), ema=tree.zeros_like(params, dtype=accumulator_dtype))

    def update_fn(updates, state, params=None):
        del params
        g, mu = tree.align(updates, state.ema)
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, new = ema_(mu, g, decay)  # new: the average at the promoted precision (mu itself unless mixed)
        g = tree.copy_(g, new)
        if debias:
            g = tree.div_(g, bias_correction(decay, count, g))
        return tree.put(updates, updates, g), EmaState(count, tree.put(state.ema, updates, mu))

    return GradientTransformation(init_fn, update_fn)


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`: per param, a 0-dim bool, whether the last update held a NaN there.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.zero_nans().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ZeroNansState), state._fields
        (True, ('found_nan',))
    """

    found_nan: Any


@transform(elementwise=False)
def zero_nans() -> GradientTransformation:
    r"""Replaces NaN entries of the updates by 0 and records, per leaf, whether there was one (Optax's).

    .. math:: u_i = 0 \text{ if } g_i \text{ is NaN, else } g_i; \qquad
        \text{found\_nan} = \exists i: g_i \text{ is NaN}.

    Infinities are kept. The state is not used by the update; it lets a training loop see where NaNs came
    from. It reduces each leaf (``found_nan``), so it is not elementwise: ``sharded_apply`` refuses it. A
    DTensor leaf's flag is the full tensor's (one all-reduce per DTensor leaf); a ``Partial`` gradient is
    reduced first (replacing NaN in the partial sums would not replace it in their sum).

    Returns:
      A transform with state :class:`ZeroNansState` (``found_nan``: a tree like the params of 0-dim bools).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.zero_nans()
        >>> g = {"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([float("inf")])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["a"].tolist(), u["b"].tolist(), bool(state.found_nan["a"]), bool(state.found_nan["b"])
        ([1.0, 0.0], [inf], True, False)
    """
    def init_fn(params):
        return ZeroNansState(tree.map(lambda p: torch.zeros((), dtype=torch.bool, device=p.device), params))

    def update_fn(updates, state, params=None):
        del params
        updates = distributed.reduce_partials(updates)
        g, found = tree.align(updates, state.found_nan)
        if not g:
            return updates, state
        if tree.is_functional():
            nan = [tree.full(torch.isnan(x).any()) for x in g]
        else:  # a norm is NaN iff an element is (inf and overflow give inf): one kernel for every leaf
            nan = list(torch.stack([tree.full(n) for n in torch._foreach_norm(g)]).isnan().unbind())
        found = tree.copy_(found, nan)
        g = _zero_nans_(g)
        return tree.put(updates, updates, g), ZeroNansState(tree.put(state.found_nan, updates, found))

    return GradientTransformation(init_fn, update_fn)


def _zero_nans_(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``xs`` with NaN entries set to 0 (inf kept); on local pieces. One kernel per leaf: no foreach op."""
    inf = float("inf")
    if tree.is_functional():
        return [tree.local(x).nan_to_num(0.0, inf, -inf) for x in xs]
    for x in xs:
        tree.local(x).nan_to_num_(0.0, inf, -inf)
    return xs



@transform(elementwise=True)
def set_to_zero() -> GradientTransformation:
    r"""Maps every update to zero (Optax's ``set_to_zero``): :math:`u = 0`, NaN and inf included.

    With :func:`fxtrain.partition` or :func:`fxtrain.masked`, freezes part of the params.

    Returns:
      A stateless transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.set_to_zero()
        >>> tx.update({"w": torch.tensor([1.0, float("nan")])}, tx.init(None))[0]["w"].tolist()
        [0.0, 0.0]
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        local = distributed.local_leaves(updates)  # zero pieces sum to zero: Partial leaves stay right
        if tree.is_functional():
            local = [torch.zeros_like(x) for x in local]
        elif local:
            torch._foreach_zero_(local)
        return tree.put(updates, updates, local), state

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=False)
def stateless_with_tree_map(f: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                            ) -> GradientTransformation:
    r"""A stateless transform from a function of one update leaf and its param (Optax's).

    :math:`u = f(g, p)` leaf by leaf; ``f(g, None)`` when ``update`` gets no params. ``f`` must be pure
    (return new tensors, never write into its inputs); it may reduce over its leaf, so the transform is
    not elementwise. ``None`` updates (frozen params) are not passed to ``f``.

    Args:
      f: ``(update, param or None) -> update``, a torch function of one tensor and its param.

    Returns:
      A stateless transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> def decayed(g, p):
        ...     return g + 0.1 * p
        >>> tx = fx.stateless_with_tree_map(decayed)
        >>> tx
        stateless_with_tree_map(decayed)
        >>> u, _ = tx.update({"b": torch.full((1,), 2.0)}, tx.init(None), {"b": torch.ones(1)})
        >>> [round(x, 4) for x in u["b"].tolist()]
        [2.1]
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates: Updates, state, params: Params = None):
        if params is None:
            return tree.map(lambda g: f(g, None), updates), state
        return tree.map(f, updates, params), state

    return GradientTransformation(init_fn, update_fn)
