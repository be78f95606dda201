"""MoMo and MoMo-Adam: Polyak-type step sizes from the loss value (Optax's ``contrib._momo``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Params, check_needs_params, check_nonnegative, transform
from fxtrain.contrib._numerics import LearningRate, scheduled, tree_sum_sq
from fxtrain.transforms._moments import (Scalar, bias_correction, counter, is_zero, param_device, safe_increment_,
                                         scalar_dtype)
from fxtrain.transforms._scaling import precision


__all__ = ["MomoState", "momo", "MomoAdamState", "momo_adam"]

class MomoState(NamedTuple):
    """State of :func:`momo` (Optax's field names and order)."""

    exp_avg: Params  # d: the moving average of the gradients
    barf: torch.Tensor  # 0-dim: the moving average of the loss values
    gamma: torch.Tensor  # 0-dim: the moving average of <g, x>
    lb: torch.Tensor  # 0-dim: the lower bound of the loss (estimated with adapt_lower_bound)
    count: torch.Tensor  # 0-dim int32




def _momo_check(name: str, params: Params, value: Any) -> None:
    check_needs_params(name, params)
    if value is None:
        raise ValueError(f"{name} needs the loss value at update: tx.update(grads, state, params, value=loss)")


def _polyak_step(f, barf, gamma, lb, iprod, sq_norm, alpha, bc1, lower_bound, adapt):
    """MoMo's step size ``tau`` and next lower bound (Optax's expressions; ``bc1 = 1`` for plain MoMo).

    ``f = 1 + alpha * weight_decay``; with ``adapt`` the lower bound is re-estimated when the model falls
    below it. The step is 0 when the momentum is 0 (its squared norm at most float64's eps, as in Optax).
    """
    if adapt:
        cap = f * (barf - gamma) + iprod
        lb = torch.where(cap < f * bc1 * lb, torch.clamp_min(cap / (2 * bc1 * f), lower_bound), lb)
    t1 = torch.clamp_min(f * (barf - bc1 * lb - gamma) + iprod, 0.0) / sq_norm
    t1 = torch.where(sq_norm <= torch.finfo(torch.float64).eps, 0.0, t1)
    tau = torch.clamp_max(t1, alpha / bc1) if isinstance(alpha, (int, float)) else torch.minimum(alpha / bc1, t1)
    if adapt:
        lb = torch.clamp_min(((barf + iprod - gamma) - 0.5 * tau * sq_norm) / bc1, lower_bound)
    return tau, lb


def _momo_init(params: Params, lower_bound: Scalar) -> tuple:
    dtype, device = scalar_dtype(params), param_device(params)
    zero = torch.zeros((), dtype=dtype, device=device)
    return zero, zero.clone(), torch.as_tensor(lower_bound, dtype=dtype, device=device).clone(), counter(params)


def _decayed_step_(g: list, tau: torch.Tensor, x: list, alpha: Scalar, weight_decay: Scalar) -> list:
    """``-tau * g - alpha wd / (1 + alpha wd) * x``, written into ``g``."""
    g = tree.scale_(g, -tau)
    if is_zero(weight_decay):
        return g
    return tree.add_(g, x, -(alpha * weight_decay) / (1 + alpha * weight_decay))


@transform(elementwise=False, extra_args=True)
def momo(learning_rate: LearningRate = 1.0, beta: Scalar = 0.9, lower_bound: Scalar = 0.0,
         weight_decay: Scalar = 0.0, adapt_lower_bound: bool = False) -> GradientTransformation:
    r"""MoMo: SGD with momentum and a Polyak-type step size from the loss value (Optax's ``contrib.momo``).

    Pass the loss: ``tx.update(grads, state, params, value=loss)``. With :math:`f_k` the loss,
    :math:`\beta_k = 0` at the first update and :math:`\beta` after, :math:`\alpha` the learning rate,
    :math:`\lambda` the weight decay and :math:`f^*` the lower bound:

    .. math::
        \bar f_k = \beta_k \bar f_{k-1} + (1 - \beta_k) f_k, \quad
        d_k = \beta_k d_{k-1} + (1 - \beta_k) g_k, \quad
        \gamma_k = \beta_k \gamma_{k-1} + (1 - \beta_k) \langle g_k, x_k \rangle, \
        \tau_k = \min\left(\alpha, \frac{\left((1 + \alpha\lambda)(\bar f_k - f^* - \gamma_k)
            + \langle d_k, x_k \rangle\right)_+}{\lVert d_k \rVert^2}\right), \quad
        u_k = -\tau_k d_k - \frac{\alpha\lambda}{1 + \alpha\lambda} x_k

    Args:
      learning_rate: :math:`\alpha`, the largest step (rather large, 1 by default), a number or a schedule.
      beta: the momentum :math:`\beta`.
      lower_bound: :math:`f^*`, a lower bound of the loss (0 suits most losses).
      weight_decay: :math:`\lambda`.
      adapt_lower_bound: estimate the lower bound on the fly (when no good guess exists).

    Returns:
      A transform with state :class:`MomoState` that reads ``value=``; it needs ``params``. Not elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.momo()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(3):   # f(x) = |x|^2 (Optax's docstring prints f of the update, not of the params)
        ...     loss = (params ** 2).sum()
        ...     u, state = tx.update(2 * params, state, params, value=loss)
        ...     params = fx.apply_updates(params, u)
        ...     print(f"{float((params ** 2).sum()):.2f}")
        3.50
        3.32
        3.14

    References:
      Schaipp et al., `MoMo: Momentum Models for Adaptive Learning Rates <https://arxiv.org/abs/2305.07583>`_,
      2023.
    """
    check_nonnegative("momo", learning_rate=None if callable(learning_rate) else learning_rate, beta=beta,
                      weight_decay=weight_decay)

    def init_fn(params):
        return MomoState(tree.zeros_like(params), *_momo_init(params, lower_bound))

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del extra_args
        _momo_check("momo", params, value)
        bt = torch.where(state.count == 0, 0.0, torch.as_tensor(beta, dtype=precision(tree.leaves(updates))))
        g, d, x = tree.align(updates, state.exp_avg, params)
        barf = bt * state.barf + (1 - bt) * torch.as_tensor(value, dtype=state.barf.dtype)
        d = tree.lerp_(d, g, 1 - bt)
        gamma = bt * state.gamma + (1 - bt) * tree.vdot(g, x)
        sq_norm, iprod = tree_sum_sq(d), tree.vdot(d, x)
        alpha = scheduled(learning_rate, state.count, updates)
        tau, lb = _polyak_step(1 + alpha * weight_decay, barf, gamma, state.lb, iprod, sq_norm, alpha, 1.0,
                               lower_bound, adapt_lower_bound)
        g = _decayed_step_(tree.copy_(g, d), tau, x, alpha, weight_decay)
        return tree.put(updates, updates, g), MomoState(
            tree.put(state.exp_avg, updates, d), barf.to(state.barf.dtype), gamma.to(state.gamma.dtype),
            lb.to(state.lb.dtype), safe_increment_(state.count))

    return GradientTransformation(init_fn, update_fn)


class MomoAdamState(NamedTuple):
    """State of :func:`momo_adam` (Optax's field names and order)."""

    exp_avg: Params  # d: Adam's first moment
    exp_avg_sq: Params  # Adam's second moment
    barf: torch.Tensor  # 0-dim: the moving average of the loss values
    gamma: torch.Tensor  # 0-dim: the moving average of <g, x>
    lb: torch.Tensor  # 0-dim: the lower bound of the loss
    count: torch.Tensor  # 0-dim int32


@transform(elementwise=False, extra_args=True)
def momo_adam(learning_rate: LearningRate = 1e-2, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8,
              lower_bound: Scalar = 0.0, weight_decay: Scalar = 0.0, adapt_lower_bound: bool = False
              ) -> GradientTransformation:
    r"""MoMo-Adam: Adam(W) with a Polyak-type step size from the loss value (Optax's ``contrib.momo_adam``).

    Pass the loss: ``tx.update(grads, state, params, value=loss)``. :func:`momo` in Adam's geometry: with
    Adam's moments :math:`d_k, v_k`, :math:`D_k = \epsilon + \sqrt{v_k / (1 - \beta_2^{k})}` and
    :math:`c_k = 1 - \beta_1^{k}`:

    .. math::
        \tau_k = \min\left(\frac{\alpha}{c_k}, \frac{\left((1 + \alpha\lambda)(\bar f_k - c_k f^* - \gamma_k)
            + \langle d_k, x_k \rangle\right)_+}{\langle d_k, d_k / D_k \rangle}\right), \quad
        u_k = -\tau_k \frac{d_k}{D_k} - \frac{\alpha\lambda}{1 + \alpha\lambda} x_k

    with :math:`\bar f_k, \gamma_k` moving averages (decay :math:`\beta_1`) of the loss and of
    :math:`\langle g_k, x_k \rangle`.

    Args:
      learning_rate: :math:`\alpha`, a number or a schedule.
      b1: decay of the first moment and of the averages.
      b2: decay of the second moment.
      eps: added to Adam's denominator.
      lower_bound: :math:`f^*`, a lower bound of the loss.
      weight_decay: :math:`\lambda` (decoupled, as in AdamW).
      adapt_lower_bound: estimate the lower bound on the fly.

    Returns:
      A transform with state :class:`MomoAdamState` that reads ``value=``; it needs ``params``. Not
      elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.momo_adam()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(2):   # f(x) = |x|^2: steps of at most learning_rate / (1 - b1^k) in Adam's geometry
        ...     loss = (params ** 2).sum()
        ...     u, state = tx.update(2 * params, state, params, value=loss)
        ...     params = fx.apply_updates(params, u)
        ...     print(f"{float((params ** 2).sum()):.2f}")
        13.88
        13.76

    References:
      Schaipp et al., `MoMo: Momentum Models for Adaptive Learning Rates <https://arxiv.org/abs/2305.07583>`_,
      2023.
    """
    check_nonnegative("momo_adam", learning_rate=None if callable(learning_rate) else learning_rate, b1=b1, b2=b2,
                      eps=eps, weight_decay=weight_decay)

    def init_fn(params):
        return MomoAdamState(tree.zeros_like(params), tree.zeros_like(params), *_momo_init(params, lower_bound))

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del extra_args
        _momo_check("momo_adam", params, value)
        count = safe_increment_(tree.clone(state.count) if not tree.is_functional() else state.count)
        g, d, v, x = tree.align(updates, state.exp_avg, state.exp_avg_sq, params)
        barf = b1 * state.barf + (1 - b1) * torch.as_tensor(value, dtype=state.barf.dtype)
        gamma = b1 * state.gamma + (1 - b1) * tree.vdot(g, x)
        d = tree.lerp_(d, g, 1 - b1)
        v = tree.addcmul_(tree.scale_(v, b2), g, g, 1 - b2)
        bc1, bc2 = bias_correction(b1, count), bias_correction(b2, count)
        g = tree.add_(tree.sqrt_(tree.div_(tree.copy_(g, v), bc2)), eps)  # Adam's denominator D, in g's buffer
        with tree.functional():
            dw = tree.div_(d, g)  # d / D
        sq_norm, iprod = tree.vdot(d, dw), tree.vdot(d, x)
        alpha = scheduled(learning_rate, state.count, updates)
        tau, lb = _polyak_step(1 + alpha * weight_decay, barf, gamma, state.lb, iprod, sq_norm, alpha, bc1,
                               lower_bound, adapt_lower_bound)
        g = _decayed_step_(tree.copy_(g, dw), tau, x, alpha, weight_decay)
        return tree.put(updates, updates, g), MomoAdamState(
            tree.put(state.exp_avg, updates, d), tree.put(state.exp_avg_sq, updates, v), barf.to(state.barf.dtype),
            gamma.to(state.gamma.dtype), lb.to(state.lb.dtype), count)

    return GradientTransformation(init_fn, update_fn)
