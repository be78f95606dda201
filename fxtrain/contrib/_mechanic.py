"""Mechanic: a learned scale of any optimizer's updates (Optax's ``contrib._mechanic``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fxtrain import distributed, tree
from fxtrain._base import (GradientTransformation, Params, call_, check_needs_params, check_nonnegative, transform,
                           with_traits)
from fxtrain.contrib._numerics import safe_sqrt
from fxtrain.transforms._moments import Scalar, counter, param_device, safe_increment_, scalar_dtype


__all__ = ["MechanicState", "mechanize"]

class MechanicState(NamedTuple):
    """State of :func:`mechanize` (Optax's field names and order)."""

    base_optimizer_state: Any
    count: torch.Tensor  # 0-dim int32
    r: torch.Tensor  # (num_betas,): the rewards
    m: torch.Tensor  # (num_betas,): the largest |h| seen (decayed)
    v: torch.Tensor  # (num_betas,): the sum of h^2 (decayed)
    s: torch.Tensor  # (num_betas,): the scales; their sum multiplies the base optimizer's updates
    x0: Params  # the params at the first update


@transform(elementwise=False, extra_args=True)
def mechanize(base_optimizer: GradientTransformation, weight_decay: Scalar = 1e-2, eps: Scalar = 1e-8,
              s_init: Scalar = 1e-6, num_betas: int = 6) -> GradientTransformation:
    r"""Mechanic: learns the scale of ``base_optimizer``'s updates online (Optax's ``contrib.mechanize``).

    The params are kept at :math:`x_t = x_0 - S_t \Delta_t`, with :math:`\Delta_t` the sum of the base
    optimizer's (negated) updates and :math:`S_t = \sum_j s_{t,j}` a scale learned by coin betting over
    ``num_betas`` decays :math:`\beta_j = 1 - 10^{-j}`. With :math:`g_t` the gradient plus a weight decay
    :math:`\lambda S_{t-1} \lVert g_t \rVert / (\lVert x_t \rVert + \epsilon)\, x_t` and
    :math:`h_t = \langle g_t, \Delta_{t-1} \rangle`:

    .. math::
        m_j = \max(\beta_j m_j, |h_t| + \epsilon), \quad v_j = \beta_j^2 v_j + h_t^2, \quad
        r_j = \beta_j r_j + \mathrm{clip}(h_t, \pm m_j^{old})\, s_j, \quad
        s_j = \frac{\frac{s_{init}}{n} m_j + \max(r_j, 0)}{\sqrt{v_j} + \epsilon}

    Use the base optimizer with its learning rate (schedule) at a constant scale such as 1.0: Mechanic
    learns the factor. A gradient through the update is finite (Optax's is NaN: :math:`\sqrt{v}` at
    :math:`v = 0` on the first update).

    Args:
      base_optimizer: the optimizer whose updates are scaled; extra arguments (``value=``...) reach it.
      weight_decay: :math:`\lambda` (Mechanic's own, not the base optimizer's).
      eps: for numerical stability.
      s_init: the initial scale (of each of the ``num_betas`` bettors).
      num_betas: how many decays :math:`1 - 10^{-1}, \dots, 1 - 10^{-n}` bet in parallel.

    Returns:
      A transform with state :class:`MechanicState`; it needs ``params`` at update. Not elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.mechanize(fx.adam(1.0))
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(30):   # f(x) = |x|^2: the scale starts at 6e-6 and grows
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((params ** 2).sum()), 2), float(state.s.sum()) > 1e-3
        (13.27, True)

    References:
      Cutkosky et al., `Mechanic: A Learning Rate Tuner <https://arxiv.org/abs/2306.00144>`_, 2023.
    """
    check_nonnegative("mechanize", weight_decay=weight_decay, eps=eps, s_init=s_init)
    counted = isinstance(num_betas, torch.Tensor) and num_betas.ndim == 0 and not (
        num_betas.is_floating_point() or num_betas.is_complex() or num_betas.dtype == torch.bool)
    if not counted and (not isinstance(num_betas, int) or isinstance(num_betas, bool) or num_betas < 1):
        raise ValueError(f"mechanize: num_betas={num_betas!r} must be an int >= 1")

    def init_fn(params):
        dtype, device = scalar_dtype(params), param_device(params)
        n = int(num_betas)  # a shape (inject_hyperparams gives a 0-dim int tensor): read once, here
        if n < 1:
            raise ValueError(f"mechanize: num_betas={n} must be an int >= 1")
        zeros = torch.zeros(n, dtype=dtype, device=device)
        return MechanicState(base_optimizer_state=base_optimizer.init(params), count=counter(params), r=zeros,
                             m=zeros.clone(), v=zeros.clone(), s=torch.full_like(zeros, s_init), x0=tree.clone(params))

    def update_fn(updates, state, params=None, **extra_args):
        check_needs_params("mechanize", params)
        g = tree.clone(tree.leaves(updates))  # the gradients, before the base optimizer writes its update there
        base_updates, base_state = call_(base_optimizer, updates, state.base_optimizer_state, params, extra_args)
        u, x0, x = tree.align(base_updates, state.x0, params)
        x0 = tree.where_(state.count == 0, x, x0)
        s_sum = state.s.sum()
        coef = weight_decay * s_sum * distributed.global_norm(g) / (distributed.global_norm(x) + eps)
        g = tree.add_(g, x, coef)
        with tree.functional():
            delta = tree.add_(x0, x, -1.0)  # the previous Delta = (x0 - x) / S
        delta = tree.div_(delta, s_sum + eps)
        h = tree.vdot(g, delta).to(state.m.dtype)
        delta = tree.add_(delta, u, -1.0)
        n = state.s.shape[0]  # num_betas, as a shape (no host read of an injected tensor)
        betas = torch.tensor([1.0 - 0.1 ** j for j in range(1, n + 1)], dtype=state.s.dtype,
                             device=state.s.device)
        clipped_h = torch.minimum(torch.maximum(h, -state.m), state.m)
        m = torch.maximum(betas * state.m, h.abs() + eps)
        v = betas ** 2 * state.v + h ** 2
        r = betas * state.r + clipped_h * state.s
        s = ((s_init / n) * m + torch.clamp_min(r, 0.0)) / (safe_sqrt(v) + eps)  # v = 0 at first
        u = tree.add_(tree.add_(tree.copy_(u, x0), delta, -s.sum()), x, -1.0)  # x0 - S Delta - x
        return tree.put(base_updates, base_updates, u), MechanicState(
            base_state, safe_increment_(state.count), r, m, v, s, tree.put(state.x0, base_updates, x0))

    return with_traits(GradientTransformation(init_fn, update_fn), elementwise=False)
