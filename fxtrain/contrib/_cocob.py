"""COCOB: step sizes by coin betting (Optax's ``contrib._cocob``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Params, chain, check_needs_params, check_nonnegative, transform
from fxtrain.contrib._numerics import LearningRate
from fxtrain.transforms._masking import Mask
from fxtrain.transforms._moments import Scalar
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights


__all__ = ["COCOBState", "scale_by_cocob", "cocob"]

class COCOBState(NamedTuple):
    """State of :func:`scale_by_cocob` (Optax's field names and order), all like the params."""

    init_particles: Params  # x_0, a copy
    cumulative_gradients: Params  # C: minus the sum of the gradients
    scale: Params  # L: the largest |g| seen (eps at first)
    subgradients: Params  # G: the sum of |g|
    reward: Params  # R: the bettor's wealth


@transform(elementwise=True)
def scale_by_cocob(alpha: Scalar = 100.0, eps: Scalar = 1e-8) -> GradientTransformation:
    r"""Rescales updates by COntinuous COin Betting (COCOB-Backprop; Optax's ``contrib.scale_by_cocob``).

    Elementwise, with :math:`x_0` the initial params and :math:`g_t` the gradient:

    .. math::
        L_t = \max(L_{t-1}, |g_t|), \quad G_t = G_{t-1} + |g_t|, \quad
        R_t = \max(R_{t-1} - g_t (x_t - x_0), 0), \quad C_t = C_{t-1} - g_t, \\
        u_t = x_0 + \frac{C_t}{L_t \max(G_t + L_t, \alpha L_t)} (L_t + R_t) - x_t

    (:math:`L_0 = \epsilon`): the update moves the params to the bet :math:`x_0 + \dots`.

    Args:
      alpha: bounds the fraction bet early on (the paper's :math:`\alpha`).
      eps: the first :math:`L`, against dividing by 0.

    Returns:
      A transform with state :class:`COCOBState`; it needs ``params`` at update. Elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_cocob()
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> u, state = tx.update({"w": torch.tensor([2.0, -4.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # -g / (alpha |g|): a first bet of 1 / alpha against the gradient
        [-0.01, 0.01]

    References:
      Orabona and Tommasi, `Training Deep Networks without Learning Rates Through Coin Betting
      <https://arxiv.org/abs/1705.07795>`_, 2017.
    """
    check_nonnegative("scale_by_cocob", alpha=alpha, eps=eps)

    def init_fn(params):
        return COCOBState(init_particles=tree.clone(params), cumulative_gradients=tree.zeros_like(params),
                          scale=tree.map(lambda p: torch.full_like(p, eps), params),
                          subgradients=tree.zeros_like(params), reward=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_cocob", params)
        g, x0, c, lo, s, r, x = tree.align(updates, *state, params)
        with tree.functional():  # two temporaries: |g| and the bet's distance
            a, d = tree.abs_(g), tree.add_(x, x0, -1.0)
        lo = tree.maximum_(lo, a)
        s = tree.add_(s, a)
        r = tree.clamp_(tree.add_(r, tree.scale_(d, g), -1.0), 0.0)  # max(R - g (x - x0), 0)
        c = tree.add_(c, g, -1.0)
        den = tree.maximum_(tree.add_(tree.copy_(a, s), lo), tree.scale_(tree.copy_(d, lo), alpha))
        den = tree.scale_(den, lo)  # L max(G + L, alpha L)
        g = tree.scale_(tree.div_(tree.copy_(g, c), den), tree.add_(tree.copy_(d, lo), r))
        g = tree.add_(tree.add_(g, x0), x, -1.0)
        put = lambda old, new: tree.put(old, updates, new)  # noqa: E731
        return tree.put(updates, updates, g), COCOBState(state.init_particles, put(state.cumulative_gradients, c),
                                                         put(state.scale, lo), put(state.subgradients, s),
                                                         put(state.reward, r))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def cocob(learning_rate: LearningRate = 1.0, alpha: Scalar = 100.0, eps: Scalar = 1e-8, weight_decay: Scalar = 0.0,
          mask: Mask | None = None) -> GradientTransformation:
    r"""COCOB-Backprop: learning-rate-free coin betting per coordinate (Optax's ``contrib.cocob``).

    The gradients (plus ``weight_decay`` times the params) are multiplied by ``learning_rate`` and fed to
    :func:`scale_by_cocob`, whose update moves each coordinate to its bet.

    Args:
      learning_rate: multiplies the gradients before the betting (1: none), a number or a schedule.
      alpha: bounds the fraction bet early on.
      eps: the first scale, against dividing by 0.
      weight_decay: L2 penalty added to the gradients.
      mask: which params decay (a tree of bools or a function of the params).

    Returns:
      ``chain(add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate,
      flip_sign=False), scale_by_cocob(alpha, eps))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.cocob()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(30):   # f(x) = |x|^2: slow at first, then the bets grow
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((params ** 2).sum()), 2)
        0.22

    References:
      Orabona and Tommasi, `Training Deep Networks without Learning Rates Through Coin Betting
      <https://arxiv.org/abs/1705.07795>`_, 2017.
    """
    check_nonnegative("cocob", learning_rate=None if callable(learning_rate) else learning_rate,
                      weight_decay=weight_decay)
    return chain(add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate, flip_sign=False),
                 scale_by_cocob(alpha, eps))
