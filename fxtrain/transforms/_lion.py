"""Lion's rescaling: ``scale_by_lion`` (Optax's math and state)."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, check_nonnegative, transform
from fxtrain.transforms._moments import Scalar, as_dtype, counter, ema_

_MODES = ("hard", "smooth", "refined")


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_lion().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByLionState), state._fields
        (True, ('count', 'mu'))
    """

    count: torch.Tensor  # 0-dim int32
    mu: Updates  # momentum, in mu_dtype (default: the param dtype)


@transform(elementwise=True)
def scale_by_lion(b1: Scalar = 0.9, b2: Scalar = 0.99, mu_dtype: torch.dtype | str | None = None, *,
                  mode: Literal["hard", "smooth", "refined"] = "hard", smooth_beta: float = 1.0
                  ) -> GradientTransformation:
    r"""Rescales updates to the sign of an interpolation of momentum and gradient (Lion; Optax's).

    .. math::
        c_t = (1 - \beta_1)\, g_t + \beta_1 m_{t-1}, \qquad u_t = \operatorname{sign}(c_t), \qquad
        m_t = \beta_2 m_{t-1} + (1 - \beta_2)\, g_t.

    ``mode="smooth"`` uses :math:`\tanh(\text{smooth\_beta}\, c_t)` and ``mode="refined"``
    :math:`c_t` clipped to :math:`[-1, 1]` instead of the sign.

    Args:
      b1: weight of the momentum in the interpolation.
      b2: decay of the momentum.
      mu_dtype: dtype of the momentum (a ``torch.dtype`` or its name); ``None``: the param dtype.
      mode: ``"hard"`` (sign), ``"smooth"`` (tanh) or ``"refined"`` (clip to [-1, 1]).
      smooth_beta: slope of the tanh in ``"smooth"`` mode.

    Returns:
      A transform with state :class:`ScaleByLionState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_lion()
        >>> g = {"w": torch.tensor([0.5, -3.0, 0.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), state.mu["w"].tolist()
        ([1.0, -1.0, 0.0], [0.005..., -0.03..., 0.0])

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms <https://arxiv.org/abs/2302.06675>`_, 2023.
    """
    check_nonnegative("scale_by_lion", b1=b1, b2=b2)
    if mode not in _MODES:
        raise ValueError(f"scale_by_lion: mode={mode!r} must be one of {_MODES}")
    mu_dtype = as_dtype(mu_dtype, "scale_by_lion: mu_dtype")

    def init_fn(params):
        return ScaleByLionState(count=counter(params), mu=tree.zeros_like(params, dtype=mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        g, mu = tree.align(updates, state.mu)
        count = tree.inc_(state.count)
        if not g:
            return updates, state._replace(count=count)
        with tree.functional():  # both g and the old momentum are needed: one temporary
            c = tree.scale_(g, 1 - b1)
        c = tree.add_(c, mu, b1)
        if mode == "hard":
            c = tree.sign_(c)
        elif mode == "smooth":
            c = tree.tanh_(tree.scale_(c, smooth_beta))
        else:
            c = tree.clamp_(c, -1.0, 1.0)
        mu, _ = ema_(mu, g, b2)
        g = tree.copy_(g, c)
        return tree.put(updates, updates, g), ScaleByLionState(count, tree.put(state.mu, updates, mu))

    return GradientTransformation(init_fn, update_fn)
