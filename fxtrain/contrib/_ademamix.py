"""AdEMAMix: Adam with a second, slow momentum mixed in; and its simplified form (Optax's ``contrib``)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, chain, check_learning_rate, check_nonnegative, transform

from fxtrain.transforms._masking import Mask
from fxtrain.transforms._moments import (Scalar, as_dtype, bias_correction, counter, ema_, ema_sq_, is_zero,
                                         safe_increment_)
from fxtrain.schedules import value_at
from fxtrain.transforms._scaling import precision, scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = [
    "ScaleByAdemamixState", "scale_by_ademamix", "ademamix",
    "ScaleBySimplifiedAdEMAMixState", "scale_by_simplified_ademamix", "simplified_ademamix",
]

ScalarOrSchedule = Scalar | Callable  # a number, a 0-dim tensor, or a function of the 0-dim int32 count


def _at(value: ScalarOrSchedule, count: torch.Tensor, updates: Updates) -> Scalar:
    """``value``, or its schedule evaluated at ``count`` in the updates' precision (float64 runs: float64)."""
    return value_at(value, count, precision(tree.leaves(updates))) if callable(value) else value


def _divided_(num: list, den: list, eps_root: Scalar, eps: Scalar) -> list:
    """``num / (sqrt(den + eps_root) + eps)``; ``den`` (a buffer of ours) holds the denominator on return."""
    if not is_zero(eps_root):
        den = tree.add_(den, eps_root)
    den = tree.add_(tree.sqrt_(den), eps)
    return tree.div_(num, den)


class ScaleByAdemamixState(NamedTuple):
    """State of :func:`scale_by_ademamix` (Optax's field names)."""

    count: torch.Tensor  # 0-dim int32: updates so far (fast EMA and second moment)
    count_m2: torch.Tensor  # 0-dim int32: updates so far (slow EMA and the schedules of b3 and alpha)
    m1: Updates  # fast EMA of the gradients, in mu_dtype
    m2: Updates  # slow EMA of the gradients, in mu_dtype
    nu: Updates  # EMA of the squared gradients, in mu_dtype


@transform(elementwise=True)
def scale_by_ademamix(b1: Scalar = 0.9, b2: Scalar = 0.999, b3: ScalarOrSchedule = 0.9999,
                      alpha: ScalarOrSchedule = 6.0, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                      mu_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    r"""Rescales updates with AdEMAMix: a fast and a slow momentum over Adam's denominator (Optax's).

    .. math::
        m^{(1)}_t = \beta_1 m^{(1)}_{t-1} + (1 - \beta_1) g_t, \quad
        m^{(2)}_t = \beta_3 m^{(2)}_{t-1} + (1 - \beta_3) g_t, \quad
        \nu_t = \beta_2 \nu_{t-1} + (1 - \beta_2) g_t^2, \\
        u_t = \frac{m^{(1)}_t / (1 - \beta_1^t) + \alpha\, m^{(2)}_t}
                   {\sqrt{\nu_t / (1 - \beta_2^t) + \bar\epsilon} + \epsilon}.

    ``b3`` and ``alpha`` may be schedules of ``count_m2`` (the paper warms both up).

    Args:
      b1: decay of the fast EMA.
      b2: decay of the second moment.
      b3: decay of the slow EMA (a number, a 0-dim tensor or a schedule).
      alpha: weight of the slow EMA (a number, a 0-dim tensor or a schedule).
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      mu_dtype: dtype of the three moments (a ``torch.dtype`` or its name); ``None``: the param dtype.
        The state stays in it (Optax's state takes the gradients' dtype after the first update).

    Returns:
      A transform with state :class:`ScaleByAdemamixState`. Updates keep the gradients' dtype.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_ademamix(alpha=5.0)
        >>> g = {"w": torch.tensor([2.0, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(x, 4) for x in u["w"].tolist()]   # sign(g) (fast) + 5 * 1e-4 * sign(g) (slow)
        [1.0005, -1.0005]

    References:
      Pagliardini et al., `The AdEMAMix Optimizer: Better, Faster, Older <https://arxiv.org/abs/2409.03137>`_, 2024.
    """
    check_nonnegative("scale_by_ademamix", b1=b1, b2=b2, b3=b3, alpha=alpha, eps=eps, eps_root=eps_root)
    mu_dtype = as_dtype(mu_dtype, "scale_by_ademamix: mu_dtype")

    def init_fn(params):
        return ScaleByAdemamixState(count=counter(params), count_m2=counter(params),
                                    m1=tree.zeros_like(params, dtype=mu_dtype),
                                    m2=tree.zeros_like(params, dtype=mu_dtype),
                                    nu=tree.zeros_like(params, dtype=mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        g, m1, m2, nu = tree.align(updates, state.m1, state.m2, state.nu)
        # before the counts move on
        b3_, alpha_ = _at(b3, state.count_m2, updates), _at(alpha, state.count_m2, updates)
        count, count_m2 = safe_increment_(state.count), safe_increment_(state.count_m2)
        if not g:
            return updates, state._replace(count=count, count_m2=count_m2)
        m1, fast = ema_(m1, g, b1)  # fast, slow, v: at the promoted precision (the state itself unless mu_dtype)
        m2, slow = ema_(m2, g, b3_)
        nu, v = ema_sq_(nu, g, b2)
        with tree.functional():  # a new buffer for the numerator
            num = tree.div_(fast, bias_correction(b1, count))
        num = tree.add_(num, slow, alpha_)
        g = tree.div_(tree.copy_(g, v), bias_correction(b2, count))
        g = tree.copy_(g, _divided_(num, g, eps_root, eps))
        return tree.put(updates, updates, g), ScaleByAdemamixState(
            count, count_m2, tree.put(state.m1, updates, m1), tree.put(state.m2, updates, m2),
            tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def ademamix(learning_rate: ScalarOrSchedule, b1: Scalar = 0.9, b2: Scalar = 0.999, b3: ScalarOrSchedule = 0.9999,
             alpha: ScalarOrSchedule = 5.0, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
             mu_dtype: torch.dtype | str | None = None, weight_decay: Scalar = 0.0, mask: Mask | None = None
             ) -> GradientTransformation:
    r"""AdEMAMix: AdamW with a mixture of a fast and a slow momentum (Optax's ``contrib.ademamix``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left(u_t + \lambda \theta_t\right)

    with :math:`u_t` from :func:`scale_by_ademamix`. Old gradients keep counting for about
    :math:`1 / (1 - \beta_3)` steps: best for long runs (the paper suggests a smaller ``b3`` for short ones).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the fast EMA.
      b2: decay of the second moment.
      b3: decay of the slow EMA (a number, a 0-dim tensor or a schedule).
      alpha: weight of the slow EMA (a number, a 0-dim tensor or a schedule).
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      mu_dtype: dtype of the moments; ``None``: the param dtype.
      weight_decay: :math:`\lambda` (multiplied by the learning rate, as in torch.optim.AdamW).
      mask: where to decay (see :func:`fxtrain.adamw`).

    Returns:
      ``chain(scale_by_ademamix(...), add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.ademamix(0.01)
        >>> params = {"x": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     u, state = tx.update(fx.tree.map(lambda p: 2 * p, params), state, params)
        ...     params = fx.apply_updates(params, u)
        >>> f"{float((params['x'] ** 2).sum()):.2E}"   # Optax's docstring: 1.34E+01
        '1.34E+01'

    References:
      Pagliardini et al., `The AdEMAMix Optimizer: Better, Faster, Older <https://arxiv.org/abs/2409.03137>`_, 2024.
    """
    check_learning_rate("ademamix", learning_rate=learning_rate, b1=b1, b2=b2, b3=b3, alpha=alpha, eps=eps, eps_root=eps_root,
           weight_decay=weight_decay)
    return chain(
        scale_by_ademamix(b1, b2, b3, alpha, eps, eps_root, mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


class ScaleBySimplifiedAdEMAMixState(NamedTuple):
    """State of :func:`scale_by_simplified_ademamix` (Optax's field names)."""

    t: torch.Tensor  # 0-dim int32: updates so far
    m: Updates  # the (undamped) EMA of the gradients
    n: Updates  # EMA of the squared gradients


@transform(elementwise=True)
def scale_by_simplified_ademamix(b1: Scalar = 0.99, b2: Scalar = 0.95, alpha: ScalarOrSchedule = 0.0,
                                 eps: Scalar = 1e-8, eps_root: Scalar = 0.0) -> GradientTransformation:
    r"""Rescales updates with Simplified AdEMAMix: one undamped momentum plus the gradient (Optax's).

    .. math::
        m_t = \beta_1 m_{t-1} + g_t, \qquad n_t = \beta_2 n_{t-1} + (1 - \beta_2) g_t^2, \qquad
        u_t = \frac{m_t + \alpha\, g_t}{\sqrt{n_t / (1 - \beta_2^t) + \bar\epsilon} + \epsilon}.

    Args:
      b1: decay of the momentum (no :math:`1 - \beta_1` factor on the gradient).
      b2: decay of the second moment.
      alpha: weight of the current gradient (a number, a 0-dim tensor or a schedule of ``t``).
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.

    Returns:
      A transform with state :class:`ScaleBySimplifiedAdEMAMixState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_simplified_ademamix(alpha=1.0)
        >>> g = {"w": torch.tensor([2.0, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> [round(x, 4) for x in u["w"].tolist()]   # (g + g) / |g|
        [2.0, -2.0]

    References:
      Morwani et al., `Connections between Schedule-Free Optimizers, AdEMAMix, and Accelerated SGD Variants
      <https://arxiv.org/abs/2502.02431>`_, 2025.
    """
    check_nonnegative("scale_by_simplified_ademamix", b1=b1, b2=b2, alpha=alpha, eps=eps, eps_root=eps_root)

    def init_fn(params):
        return ScaleBySimplifiedAdEMAMixState(t=counter(params), m=tree.zeros_like(params),
                                              n=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        g, m, n = tree.align(updates, state.m, state.n)
        alpha_ = _at(alpha, state.t, updates)  # before the count moves on
        t = safe_increment_(state.t)
        if not g:
            return updates, state._replace(t=t)
        m = tree.add_(tree.scale_(m, b1), g)
        n, _ = ema_sq_(n, g, b2)
        with tree.functional():  # a new buffer for the numerator
            num = tree.add_(m, g, alpha_) if not is_zero(alpha_) else tree.scale_(m, 1.0)
        g = tree.div_(tree.copy_(g, n), bias_correction(b2, t))
        g = tree.copy_(g, _divided_(num, g, eps_root, eps))
        return tree.put(updates, updates, g), ScaleBySimplifiedAdEMAMixState(
            t, tree.put(state.m, updates, m), tree.put(state.n, updates, n))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def simplified_ademamix(learning_rate: ScalarOrSchedule, b1: Scalar = 0.99, b2: Scalar = 0.95,
                        alpha: ScalarOrSchedule = 0.0, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                        weight_decay: Scalar = 0.0, mask: Mask | None = None) -> GradientTransformation:
    r"""Simplified AdEMAMix: one momentum, no schedule needed for :math:`\alpha` (Optax's ``contrib``).

    .. math:: \theta_{t+1} = \theta_t - \eta \left(u_t + \lambda \theta_t\right)

    with :math:`u_t` from :func:`scale_by_simplified_ademamix`; ``alpha=0`` is Adam up to a change of
    :math:`\eta` and :math:`\beta_1`.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the momentum.
      b2: decay of the second moment.
      alpha: weight of the current gradient (a number, a 0-dim tensor or a schedule).
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root.
      weight_decay: :math:`\lambda` (multiplied by the learning rate).
      mask: where to decay (see :func:`fxtrain.adamw`).

    Returns:
      ``chain(scale_by_simplified_ademamix(...), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.simplified_ademamix(0.01)
        >>> params = {"x": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     u, state = tx.update(fx.tree.map(lambda p: 2 * p, params), state, params)
        ...     params = fx.apply_updates(params, u)
        >>> f"{float((params['x'] ** 2).sum()):.2E}"   # Optax's docstring: 1.23E+01
        '1.23E+01'

    References:
      Morwani et al., `Connections between Schedule-Free Optimizers, AdEMAMix, and Accelerated SGD Variants
      <https://arxiv.org/abs/2502.02431>`_, 2025.
    """
    check_learning_rate("simplified_ademamix", learning_rate=learning_rate, b1=b1, b2=b2, alpha=alpha, eps=eps,
           eps_root=eps_root, weight_decay=weight_decay)
    return chain(
        scale_by_simplified_ademamix(b1, b2, alpha, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
