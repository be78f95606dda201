"""MADGRAD: momentumized, adaptive dual averaging (Optax's ``contrib.madgrad``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Params, chain, check_needs_params, check_nonnegative, transform
from fxtrain.contrib._numerics import LearningRate, scheduled
from fxtrain.transforms._moments import Scalar, counter, safe_increment_
from fxtrain.transforms._scaling import precision
from fxtrain.transforms._weight_decay import add_decayed_weights


__all__ = ["MadgradState", "scale_by_madgrad", "madgrad"]

class MadgradState(NamedTuple):
    """State of :func:`scale_by_madgrad` (Optax's field names and order)."""

    count: torch.Tensor  # 0-dim int32: number of updates so far
    grad_sum_sq: Params  # G: the lambda-weighted sum of squared gradients
    s: Params  # the lambda-weighted sum of gradients
    x0: Params  # the initial params, a copy


def _cbrt_(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The cube root of non-negative ``xs`` (torch has no ``cbrt``; an op-layer-style private op)."""
    if tree.is_functional():
        return [x.pow(1 / 3) for x in xs]
    torch._foreach_pow_(xs, 1 / 3)
    return xs


@transform(elementwise=True)
def scale_by_madgrad(learning_rate: LearningRate, momentum: Scalar = 0.9, eps: Scalar = 1e-6
                     ) -> GradientTransformation:
    r"""Rescales updates by MADGRAD's momentumized dual averaging (Optax's ``contrib.scale_by_madgrad``).

    With :math:`k` the number of updates so far, :math:`x_0` the initial params and :math:`\eta_k` the
    learning rate:

    .. math::
        \lambda_k = (\eta_k + \epsilon) \sqrt{k + 1}, \qquad
        G_k = G_{k-1} + \lambda_k g_k^2, \qquad s_k = s_{k-1} + \lambda_k g_k, \
        z_k = x_0 - \frac{s_k}{\sqrt[3]{G_k} + \epsilon}, \qquad
        u_k = (1 - \beta)\, z_k + \beta\, x_k - x_k

    The learning rate is inside: chain no ``scale_by_learning_rate`` after it.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule of the count.
      momentum: :math:`\beta`.
      eps: added to the learning rate and to the denominator.

    Returns:
      A transform with state :class:`MadgradState`; it needs ``params`` at update. Elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_madgrad(0.1, momentum=0.0, eps=0.0)
        >>> params = {"w": torch.tensor([0.0, 0.0])}
        >>> u, state = tx.update({"w": torch.tensor([8.0, -1.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # -s / cbrt(G) = -(0.1 g) / cbrt(0.1 g^2)
        [-0.4309, 0.2154]

    References:
      Defazio and Jelassi, `Adaptivity without Compromise: A Momentumized, Adaptive, Dual Averaged Gradient
      Method for Stochastic Optimization <https://arxiv.org/abs/2101.11075>`_, 2021.
    """
    check_nonnegative("scale_by_madgrad", learning_rate=None if callable(learning_rate) else learning_rate,
                      momentum=momentum, eps=eps)

    def init_fn(params):
        return MadgradState(count=counter(params), grad_sum_sq=tree.zeros_like(params), s=tree.zeros_like(params),
                            x0=tree.clone(params))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_madgrad", params)
        lr = scheduled(learning_rate, state.count, updates)
        lamb = (lr + eps) * (state.count + 1).to(precision(tree.leaves(updates))).sqrt()
        g, sq, s, x0, x = tree.align(updates, state.grad_sum_sq, state.s, state.x0, params)
        sq = tree.addcmul_(sq, g, g, lamb)
        s = tree.add_(s, g, lamb)
        # The gradient buffer is free now: z = x0 - s / (cbrt(G) + eps), then the update, built in it.
        g = tree.add_(_cbrt_(tree.copy_(g, sq)), eps)
        g = tree.add_(tree.neg_(tree.scale_(tree.reciprocal_(g), s)), x0)
        g = tree.add_(tree.add_(tree.scale_(g, 1 - momentum), x, momentum), x, -1.0)
        return tree.put(updates, updates, g), MadgradState(
            safe_increment_(state.count), tree.put(state.grad_sum_sq, updates, sq), tree.put(state.s, updates, s),
            state.x0)

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def madgrad(learning_rate: LearningRate, momentum: Scalar = 0.9, weight_decay: Scalar = 0.0, eps: Scalar = 1e-6
            ) -> GradientTransformation:
    r"""MADGRAD: momentumized, adaptive dual averaging (Optax's ``contrib.madgrad``).

    :func:`scale_by_madgrad` on the gradients plus ``weight_decay`` times the params (L2).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      momentum: :math:`\beta`.
      weight_decay: L2 strength added to the gradients.
      eps: added to the learning rate and to the denominator.

    Returns:
      ``chain(add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.madgrad(0.1)
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(20):   # f(x) = |x|^2
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((params ** 2).sum()), 3)   # from 14
        0.181

    References:
      Defazio and Jelassi, `Adaptivity without Compromise: A Momentumized, Adaptive, Dual Averaged Gradient
      Method for Stochastic Optimization <https://arxiv.org/abs/2101.11075>`_, 2021.
    """
    check_nonnegative("madgrad", weight_decay=weight_decay)
    return chain(add_decayed_weights(weight_decay),
                 scale_by_madgrad(learning_rate=learning_rate, momentum=momentum, eps=eps))
