"""Momentum: ``trace`` (Optax's, heavy-ball or Nesterov)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Params, check_nonnegative, transform
from fxtrain.transforms._moments import Scalar, as_dtype, mixed_dtypes, weak


class TraceState(NamedTuple):
    """State of :func:`trace`: the accumulated momentum.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.trace(0.9).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.TraceState), state._fields
        (True, ('trace',))
    """

    trace: Params


@transform(elementwise=True)
def trace(decay: Scalar, nesterov: bool = False, accumulator_dtype: torch.dtype | str | None = None
          ) -> GradientTransformation:
    r"""Accumulates a trace of past updates: momentum (Optax's ``trace``).

    .. math::
        t_k = g_k + \beta\, t_{k-1}, \qquad u_k = t_k \;\text{ or, with Nesterov, }\; g_k + \beta\, t_k.

    As torch.optim.SGD with ``dampening=0``; unlike Optax's ``ema`` there is no :math:`(1 - \beta)`.

    Args:
      decay: :math:`\beta`, the momentum.
      nesterov: use Nesterov momentum.
      accumulator_dtype: dtype of the trace (a ``torch.dtype`` or its name); ``None``: the param dtype.

    Returns:
      A transform with state :class:`TraceState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.trace(decay=0.5)
        >>> g = {"w": torch.ones(1)}
        >>> state = tx.init(g)
        >>> for _ in range(3):
        ...     u, state = tx.update(g, state)
        >>> u["w"].tolist()   # 1 + 0.5 + 0.25
        [1.75]

    References:
      Sutskever et al., `On the importance of initialization and momentum in deep learning
      <http://proceedings.mlr.press/v28/sutskever13.pdf>`_, 2013.
    """
    check_nonnegative("trace", decay=decay)
    accumulator_dtype = as_dtype(accumulator_dtype, "trace: accumulator_dtype")

    def init_fn(params):
        return TraceState(trace=tree.zeros_like(params, dtype=accumulator_dtype))

    def update_fn(updates, state, params=None):
        del params
        g, t = tree.align(updates, state.trace)
        if not g:
            return updates, state
        if mixed_dtypes(g, t):
            # As Optax: the new trace in the promoted dtype feeds this update, the state keeps a cast.
            with tree.functional():
                new = tree.add_(g, tree.scale_(t, weak(decay, t)))
            t = tree.copy_(t, new)
            g = tree.add_(g, new, decay) if nesterov else tree.copy_(g, new)
        elif nesterov:
            t = tree.add_(tree.scale_(t, decay), g)
            g = tree.add_(g, t, decay)
        else:
            g = tree.add_(g, t, decay)  # g <- g + decay * t, the new trace
            t = tree.copy_(t, g)
        return tree.put(updates, updates, g), TraceState(tree.put(state.trace, updates, t))

    return GradientTransformation(init_fn, update_fn)
