"""D-Adaptation AdamW: AdamW whose step size estimates the distance to the solution (Optax's
``contrib._dadapt_adamw``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Params, check_needs_params, check_nonnegative, transform
from fxtrain._deferred import DTensor
from fxtrain.contrib._numerics import LearningRate, scheduled
from fxtrain.transforms._moments import (Scalar, bias_correction, counter, is_zero, param_device, safe_increment_,
                                         scalar_dtype)


__all__ = ["DAdaptAdamWState", "dadapt_adamw"]

class DAdaptAdamWState(NamedTuple):
    """State of :func:`dadapt_adamw` (Optax's field names and order)."""

    exp_avg: Params  # Adam's first moment, of dlr-scaled gradients
    exp_avg_sq: Params  # Adam's second moment
    grad_sum: Params  # s: the decayed sum of dlr-scaled gradients
    estim_lr: torch.Tensor  # 0-dim: d, the distance estimate
    numerator_weighted: torch.Tensor  # 0-dim
    count: torch.Tensor  # 0-dim int32


def _l1(xs: list[torch.Tensor]) -> torch.Tensor:
    """``sum |x|`` over all elements of all leaves (float32 or wider)."""
    if not xs:
        return torch.zeros(())
    acc = torch.promote_types(xs[0].dtype, torch.float32)
    if tree.is_functional() or any(isinstance(x, DTensor) for x in xs):
        return sum(tree.full(x.abs().sum().to(acc)) for x in xs)
    return torch.stack(torch._foreach_norm(xs, 1, dtype=acc)).sum()


@transform(elementwise=False, extra_args=True)
def dadapt_adamw(learning_rate: LearningRate = 1.0, betas: tuple[Scalar, Scalar] = (0.9, 0.999), eps: Scalar = 1e-8,
                 estim_lr0: Scalar = 1e-6, weight_decay: Scalar = 0.0) -> GradientTransformation:
    r"""AdamW whose learning rate D-Adaptation estimates (Optax's ``contrib.dadapt_adamw``).

    The learning rate is :math:`d_k \eta_k \sqrt{1 - \beta_2^{k}} / (1 - \beta_1^{k})` with :math:`\eta_k`
    the schedule (1 at its peak) and :math:`d_k` a lower estimate of the distance to the solution, grown
    from ``estim_lr0``:

    .. math::
        \lambda_k = d_k \eta_k \frac{\sqrt{1 - \beta_2^{k}}}{1 - \beta_1^{k}}, \quad
        m_k = \beta_1 m_{k-1} + (1 - \beta_1) \lambda_k g_k, \quad
        v_k = \beta_2 v_{k-1} + (1 - \beta_2) g_k^2, \
        r_k = \sqrt{\beta_2}\, r_{k-1} + (1 - \sqrt{\beta_2}) \lambda_k
            \left\langle g_k, \frac{s_{k-1}}{\sqrt{v_{k-1}} + \epsilon} \right\rangle, \quad
        s_k = \sqrt{\beta_2}\, s_{k-1} + (1 - \sqrt{\beta_2}) \lambda_k g_k, \
        d_{k+1} = \max\left(d_k, \frac{r_k}{(1 - \sqrt{\beta_2}) \lVert s_k \rVert_1}\right), \quad
        u_k = -\frac{m_k}{\sqrt{v_k} + \epsilon} - \lambda_k w\, x_k

    Args:
      learning_rate: :math:`\eta`, a schedule with 1 as its peak (e.g. a linear decay from 1 to 0 after a
        warmup), or a number.
      betas: Adam's :math:`(\beta_1, \beta_2)`.
      eps: added to Adam's denominator.
      estim_lr0: :math:`d_0`, an under-estimate of the distance to the solution.
      weight_decay: :math:`w`, decoupled as in AdamW.

    Returns:
      A transform with state :class:`DAdaptAdamWState`; it needs ``params`` at update. Not elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.dadapt_adamw()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(50):   # f(x) = |x|^2: d grows from 1e-6
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> float(state.estim_lr) > 1e-3
        True

    References:
      Defazio and Mishchenko, `Learning-Rate-Free Learning by D-Adaptation <https://arxiv.org/abs/2301.07733>`_,
      2023.
    """
    beta1, beta2 = betas
    check_nonnegative("dadapt_adamw", learning_rate=None if callable(learning_rate) else learning_rate, beta1=beta1,
                      beta2=beta2, eps=eps, estim_lr0=estim_lr0, weight_decay=weight_decay)
    sb2 = beta2 ** 0.5

    def init_fn(params):
        dtype, device = scalar_dtype(params), param_device(params)
        return DAdaptAdamWState(tree.zeros_like(params), tree.zeros_like(params), tree.zeros_like(params),
                                torch.as_tensor(estim_lr0, dtype=dtype, device=device).clone(),
                                torch.zeros((), dtype=dtype, device=device), counter(params))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        check_needs_params("dadapt_adamw", params)
        sched = scheduled(learning_rate, state.count, updates)
        count = state.count + 1
        bc = bias_correction(beta2, count) ** 0.5 / bias_correction(beta1, count)
        dlr = (state.estim_lr * sched * bc).to(state.numerator_weighted.dtype)
        g, m, v, sk, x = tree.align(updates, state.exp_avg, state.exp_avg_sq, state.grad_sum, params)
        with tree.functional():  # s / (sqrt(v) + eps) with the previous s and v
            weighted = tree.div_(sk, tree.add_(tree.sqrt_(v), eps))
        numerator = tree.vdot(g, weighted)
        m = tree.add_(tree.scale_(m, beta1), g, (1 - beta1) * dlr)
        v = tree.addcmul_(tree.scale_(v, beta2), g, g, 1 - beta2)
        sk = tree.add_(tree.scale_(sk, sb2), g, (1 - sb2) * dlr)
        numerator_weighted = sb2 * state.numerator_weighted + (1 - sb2) * dlr * numerator
        estim_lr = torch.maximum(state.estim_lr, (numerator_weighted / ((1 - sb2) * _l1(sk))).to(dlr.dtype))
        g = tree.add_(tree.sqrt_(tree.copy_(g, v)), eps)  # the update, built in the gradient buffer
        g = tree.neg_(tree.scale_(tree.reciprocal_(g), m))
        if not is_zero(weight_decay):
            g = tree.add_(g, x, -weight_decay * dlr)
        put = lambda old, new: tree.put(old, updates, new)  # noqa: E731
        return tree.put(updates, updates, g), DAdaptAdamWState(
            put(state.exp_avg, m), put(state.exp_avg_sq, v), put(state.grad_sum, sk), estim_lr,
            numerator_weighted.to(state.numerator_weighted.dtype), safe_increment_(state.count))

    return GradientTransformation(init_fn, update_fn)
