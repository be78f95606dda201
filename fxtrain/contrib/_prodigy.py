"""Prodigy: AdamW that estimates its own learning rate (Optax's ``contrib.prodigy``)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, check_needs_params, check_nonnegative, transform
from fxtrain._deferred import DTensor
from fxtrain.schedules import value_at
from fxtrain.transforms._moments import Scalar, counter, ema_, ema_sq_, is_zero, param_device, safe_increment_
from fxtrain.transforms._scaling import precision

__all__ = ["ProdigyState", "prodigy"]


class ProdigyState(NamedTuple):
    """State of :func:`prodigy` (Optax's field names and order)."""

    exp_avg: Updates  # first moment of the scaled gradients d_k g
    exp_avg_sq: Updates  # second moment of the scaled gradients
    grad_sum: Updates  # weighted sum of the scaled gradients (the estimate's denominator)
    params0: Updates  # the params at init (a copy)
    estim_lr: torch.Tensor  # 0-dim, the params' lowest dtype: the distance estimate d_k
    numerator_weighted: torch.Tensor  # 0-dim: the estimate's numerator
    count: torch.Tensor  # 0-dim int32: updates so far


def _lowest_dtype(params) -> torch.dtype:
    """The floating dtype of ``params`` with the fewest bits (Optax's ``tree.dtype(params, 'lowest')``)."""
    dtypes = {x.dtype for x in tree.leaves(params) if isinstance(x, torch.Tensor) and x.is_floating_point()}
    return min(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else torch.float32


def _vdot(xs: list, ys: list, zs: list) -> torch.Tensor:
    """``sum_i <xs_i, ys_i - zs_i>`` over every leaf."""
    return tree.vdot(xs, [y - z for y, z in zip(ys, zs)])


def _l1(xs: list) -> torch.Tensor:
    """``sum_i ||xs_i||_1`` over every leaf."""
    if tree.is_functional() or any(isinstance(x, DTensor) for x in xs):
        return torch.stack([tree.full(x.abs().sum()) for x in xs]).sum()
    return torch.stack(torch._foreach_norm(xs, 1)).sum()


@transform(elementwise=False)
def prodigy(learning_rate: Scalar | Callable = 1.0, betas: tuple[Scalar, Scalar] = (0.9, 0.999),
            beta3: Scalar | None = None, eps: Scalar = 1e-8, estim_lr0: Scalar = 1e-6, estim_lr_coef: Scalar = 1.0,
            weight_decay: Scalar = 0.0, safeguard_warmup: bool = False) -> GradientTransformation:
    r"""Prodigy: a learning-rate-free AdamW that grows an estimate :math:`d_k` of the distance to a solution.

    With :math:`\eta_k` the learning rate (schedule) and gradients scaled by the estimate,
    :math:`\tilde g_k = d_k g_k`:

    .. math::
        \hat d_k = d_k \eta_k \frac{\sqrt{1 - \beta_2^{k+1}}}{1 - \beta_1^{k+1}}, \qquad
        m_k = \beta_1 m_{k-1} + (1 - \beta_1) \tilde g_k, \qquad
        v_k = \beta_2 v_{k-1} + (1 - \beta_2) \tilde g_k^2, \\
        s_k = \beta_3 s_{k-1} + \frac{\hat d_k}{d_0} \tilde g_k, \qquad
        r_k = \beta_3 r_{k-1} + \frac{d_k}{d_0} \hat d_k \langle g_k, x_0 - x_k \rangle, \qquad
        d_{k+1} = \max\!\left(d_k, c\, \frac{r_k}{\|s_k\|_1}\right), \\
        u_k = -\hat d_k \left(\frac{m_k}{\sqrt{v_k} + d_{k+1} \epsilon} + \lambda x_k\right).

    (``safeguard_warmup=True`` uses :math:`d_k` instead of :math:`\hat d_k` in :math:`s_k`.) The update
    already includes the learning rate and its sign, as in Optax: apply it directly. The inner
    product and the norm run over every element of every leaf (DTensor leaves included: summed across
    their shards), so the transform is not elementwise (``sharded_apply`` refuses it).

    Args:
      learning_rate: :math:`\eta_k`, a multiplier of the estimated step (a number, a 0-dim tensor or a
        schedule; Optax recommends a schedule with 1.0 as its peak).
      betas: :math:`(\beta_1, \beta_2)` of the underlying AdamW.
      beta3: decay of the estimate's sums; ``None``: :math:`\sqrt{\beta_2}`.
      eps: :math:`\epsilon` of AdamW (scaled by :math:`d_{k+1}`).
      estim_lr0: :math:`d_0`, an initial under-estimate of the distance.
      estim_lr_coef: :math:`c`, a multiplier of the estimates.
      weight_decay: :math:`\lambda`, AdamW-style decay (chain :func:`fxtrain.add_decayed_weights` for
        Adam-style).
      safeguard_warmup: leave the learning rate out of :math:`s_k` (helps during warm-up).

    Returns:
      A transform with state :class:`ProdigyState`; its update needs ``params``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.prodigy()
        >>> params = {"x": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(100):   # minimise sum(x ** 2)
        ...     u, state = tx.update(fx.tree.map(lambda p: 2 * p, params), state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float(state.estim_lr), 2), float((params["x"] ** 2).sum()) < 1e-2   # d grew from 1e-6
        (0.83, True)

    References:
      Mishchenko and Defazio, `Prodigy: An Expeditiously Adaptive Parameter-Free Learner
      <https://arxiv.org/abs/2306.06101>`_, 2023.
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"prodigy: betas={betas!r} must be a pair (beta1, beta2)")
    beta1, beta2 = betas
    check_nonnegative("prodigy", learning_rate=learning_rate, beta1=beta1, beta2=beta2, beta3=beta3, eps=eps,
                      estim_lr0=estim_lr0, estim_lr_coef=estim_lr_coef, weight_decay=weight_decay)
    if beta3 is None:
        beta3 = beta2 ** 0.5

    def init_fn(params):
        dtype, device = _lowest_dtype(params), param_device(params)
        return ProdigyState(
            exp_avg=tree.zeros_like(params), exp_avg_sq=tree.zeros_like(params),
            grad_sum=tree.zeros_like(params), params0=tree.clone(params),
            estim_lr=torch.as_tensor(estim_lr0, dtype=dtype, device=device).clone(),
            numerator_weighted=torch.zeros((), dtype=dtype, device=device), count=counter(params))

    def update_fn(updates, state, params=None):
        check_needs_params("prodigy", params)
        g, m, v, s, x0, x = tree.align(updates, state.exp_avg, state.exp_avg_sq, state.grad_sum, state.params0,
                                       params)
        d = state.estim_lr
        lr = value_at(learning_rate, state.count, precision(g)) if callable(learning_rate) else learning_rate
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        debias = (1 - beta2 ** count) ** 0.5 / (1 - beta1 ** count)
        d_hat = (d * lr * debias).to(d.dtype)
        inner = _vdot(g, x0, x)  # <g, x0 - x>, before g's buffer takes the scaled gradient
        g = tree.scale_(g, d)
        m, _ = ema_(m, g, beta1)
        v, _ = ema_sq_(v, g, beta2)
        s = tree.add_(tree.scale_(s, beta3), g, (d if safeguard_warmup else d_hat) / estim_lr0)
        numerator = beta3 * state.numerator_weighted + (d / estim_lr0) * d_hat * inner
        new_d = torch.maximum(d, estim_lr_coef * numerator / _l1(s))
        # u = -d_hat * (m / (sqrt(v) + new_d * eps) + weight_decay * x), built in g's buffer
        g = tree.add_(tree.sqrt_(tree.copy_(g, v)), new_d * eps)
        g = tree.scale_(tree.reciprocal_(g), m)
        g = tree.scale_(g, -d_hat)
        if not is_zero(weight_decay):
            g = tree.add_(g, x, -weight_decay * d_hat)
        return tree.put(updates, updates, g), ProdigyState(
            tree.put(state.exp_avg, updates, m), tree.put(state.exp_avg_sq, updates, v),
            tree.put(state.grad_sum, updates, s), state.params0, new_d.to(d.dtype),
            numerator.to(d.dtype), count)

    return GradientTransformation(init_fn, update_fn)
