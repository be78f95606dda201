"""ADOPT: Adam with the second moment taken one step late and a clipped normalised gradient (Optax's ``contrib``)."""

from __future__ import annotations

from typing import Callable

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, chain, check_learning_rate, check_nonnegative, transform

from fxtrain.transforms._adam import ScaleByAdamState
from fxtrain.transforms._moments import (Scalar, as_dtype, counter, ema, ema_, ema_sq_, is_number, mixed_dtypes,
                                         safe_increment_, weak)
from fxtrain.transforms._scaling import scale_by_learning_rate

__all__ = ["scale_by_adopt", "adopt"]


def _quarter_power(count: torch.Tensor) -> torch.Tensor:
    """Optax's default clipping bound of ADOPT: ``count ** 0.25``."""
    return count ** 0.25


@transform(elementwise=True)
def scale_by_adopt(b1: Scalar = 0.9, b2: Scalar = 0.9999, eps: Scalar = 1e-6,
                   mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = False,
                   use_clipping: bool = True, clip_value_fn: Callable = _quarter_power) -> GradientTransformation:
    r"""Rescales updates with ADOPT: the gradient normalised by the *previous* second moment, then averaged.

    With :math:`t` the number of earlier updates and :math:`c_t` = ``clip_value_fn(t)``:

    .. math::
        n_t = \operatorname{clip}\!\left(\frac{g_t}{\max(\sqrt{v_{t-1}}, \epsilon)}, -c_t, c_t\right), \qquad
        m_t = \beta_1 m_{t-1} + (1 - \beta_1)\, n_t, \qquad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2)\, g_t^2,

    and :math:`u_t = m_t` (Nesterov: :math:`\beta_1 m_t + (1 - \beta_1) n_t`). The first update only
    initialises :math:`v_0 = g_0^2` (:math:`\beta_2 = 0`, :math:`\beta_1 = 1` at :math:`t = 0`), so it is
    zero, as in Optax.

    Args:
      b1: decay of the first moment (of normalised gradients).
      b2: decay of the second moment.
      eps: lower bound of :math:`\sqrt{v}` in the normalisation.
      mu_dtype: dtype of the first moment (a ``torch.dtype`` or its name); ``None``: the param dtype.
      nesterov: use Nesterov momentum.
      use_clipping: clip the normalised gradient to :math:`[-c_t, c_t]`.
      clip_value_fn: the bound :math:`c_t` as a function of the 0-dim int32 count (default
        :math:`t^{1/4}`).

    Returns:
      A transform with state :class:`fxtrain.ScaleByAdamState` (Optax's ``ScaleByAdamState``).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_adopt()
        >>> g = {"w": torch.tensor([1.0, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))   # the first step only fills the second moment
        >>> u["w"].tolist(), state.nu["w"].tolist()
        ([0.0, 0.0], [1.0, 4.0])
        >>> u, state = tx.update(g, state)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [0.1, -0.1]

    References:
      Taniguchi et al., `ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal Rate
      <https://arxiv.org/abs/2411.02853>`_, NeurIPS 2024.
    """
    check_nonnegative("scale_by_adopt", b1=b1, b2=b2, eps=eps)
    mu_dtype = as_dtype(mu_dtype, "scale_by_adopt: mu_dtype")

    def init_fn(params):
        return ScaleByAdamState(count=counter(params), mu=tree.zeros_like(params, dtype=mu_dtype),
                                nu=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        started = state.count > 0  # the first step uses b2 = 0 (v_0 = g^2) and b1 = 1 (m unchanged)
        b1_, b2_ = torch.where(started, b1, 1.0), torch.where(started, b2, 0.0)
        bound = clip_value_fn(state.count) if use_clipping else None  # read before the count moves on
        count = safe_increment_(state.count)
        if not g:
            return updates, state._replace(count=count)
        with tree.functional():  # the normaliser uses the previous second moment: a new buffer
            n = tree.sqrt_(nu)
        nu, _ = ema_sq_(nu, g, b2_)
        n = tree.scale_(tree.reciprocal_(tree.clamp_(n, eps)), g)  # g / max(sqrt(v), eps)
        if use_clipping:
            n = tree.clamp_(n, -bound, bound)
        if mixed_dtypes(mu, n):  # mu_dtype: JAX rounds a number b1 to mu's dtype where it meets mu (weak typing)
            b1_mu = [torch.where(started, b, 1.0) for b in weak(b1, mu)] if is_number(b1) else b1_
            with tree.functional():
                m = tree.add_(tree.scale_(n, 1 - b1_), tree.scale_(mu, b1_mu))
            mu = tree.copy_(mu, m)
        else:
            mu, m = ema_(mu, n, b1_)
        out = ema(m, n, b1_) if nesterov else m
        g = tree.copy_(g, out)
        return tree.put(updates, updates, g), ScaleByAdamState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def adopt(learning_rate: Scalar | Callable, b1: Scalar = 0.9, b2: Scalar = 0.9999, eps: Scalar = 1e-6,
          mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = False, use_clipping: bool = True,
          clip_value_fn: Callable = _quarter_power) -> GradientTransformation:
    r"""ADOPT: Adam that converges for any :math:`\beta_2` (Optax's ``contrib.adopt``).

    .. math:: \theta_{t+1} = \theta_t - \eta\, u_t

    with :math:`u_t` from :func:`scale_by_adopt` (zero at the first step).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: lower bound of :math:`\sqrt{v}` in the normalisation.
      mu_dtype: dtype of the first moment; ``None``: the param dtype.
      nesterov: use Nesterov momentum.
      use_clipping: clip the normalised gradient (recommended when training from scratch).
      clip_value_fn: the clipping bound as a function of the count (default :math:`t^{1/4}`).

    Returns:
      ``chain(scale_by_adopt(...), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.adopt(0.1)
        >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     u, state = tx.update(fx.tree.map(lambda p: 2 * p, params), state, params)
        ...     params = fx.apply_updates(params, u)
        >>> [round(x, 4) for x in params["w"].tolist()]
        [0.9711, 1.9711, 2.971]

    References:
      Taniguchi et al., `ADOPT: Modified Adam Can Converge with Any beta2 with the Optimal Rate
      <https://arxiv.org/abs/2411.02853>`_, NeurIPS 2024.
    """
    check_learning_rate("adopt", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)
    return chain(
        scale_by_adopt(b1, b2, eps, mu_dtype, nesterov=nesterov, use_clipping=use_clipping,
                       clip_value_fn=clip_value_fn),
        scale_by_learning_rate(learning_rate),
    )
