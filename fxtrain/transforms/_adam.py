"""Adam's rescaling: ``scale_by_adam`` (Optax's math, torch.optim's op count)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, Updates, check_nonnegative, transform
from fxtrain.transforms._moments import Scalar, as_dtype, bias_correction, counter, ema_, ema_sq_, is_zero


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_adam().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByAdamState), state._fields
        (True, ('count', 'mu', 'nu'))
    """

    count: torch.Tensor  # 0-dim int32: number of updates so far
    mu: Updates  # first moment, in mu_dtype (default: the param dtype)
    nu: Updates  # second moment, in the param dtype


@transform(elementwise=True)
def scale_by_adam(b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-8, eps_root: Scalar = 0.0,
                  mu_dtype: torch.dtype | str | None = None, *, nesterov: bool = False
                  ) -> GradientTransformation:
    r"""Rescales updates with Adam's bias-corrected moment estimates (Optax's ``scale_by_adam``).

    .. math::
        m_t = \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \\
        \hat m_t = \frac{m_t}{1 - \beta_1^t}, \qquad \hat v_t = \frac{v_t}{1 - \beta_2^t}, \qquad
        u_t = \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}.

    With ``nesterov=True`` (NAdam, Dozat 2016):
    :math:`\hat m_t = \beta_1 m_t / (1 - \beta_1^{t+1}) + (1 - \beta_1) g_t / (1 - \beta_1^t)`.

    The kernel writes :math:`u_t` into the gradient buffers with torch.optim's passes over memory
    (``lerp_``, ``mul_``, ``addcmul_``, then the denominator built in the gradient buffer): a donated
    step allocates nothing parameter-sized (except with ``nesterov`` or a ``mu_dtype``).

    Args:
      b1: decay of the first moment (mean of gradients).
      b2: decay of the second moment (mean of squared gradients).
      eps: added to the denominator outside the square root.
      eps_root: added to the second moment inside the square root (for meta-gradients).
      mu_dtype: dtype of the first moment (a ``torch.dtype`` or its name); ``None``: the param dtype.
      nesterov: use Nesterov momentum (NAdam).

    Returns:
      A transform with state :class:`ScaleByAdamState`. Updates keep the gradients' dtype.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_adam()
        >>> g = {"w": torch.tensor([1.0, -2.0])}
        >>> u, state = tx.update(g, tx.init(g))
        >>> u["w"].tolist(), int(state.count)   # the first step is sign(g) up to eps
        ([1.0, -1.0], 1)

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization <https://arxiv.org/abs/1412.6980>`_, 2014.
      Dozat, `Incorporating Nesterov Momentum into Adam <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
    """
    check_nonnegative("scale_by_adam", b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    mu_dtype = as_dtype(mu_dtype, "scale_by_adam: mu_dtype")

    def init_fn(params):
        return ScaleByAdamState(count=counter(params), mu=tree.zeros_like(params, dtype=mu_dtype),
                                nu=tree.zeros_like(params))

    def denominator_(d, bc1, bc2):
        """``bc1 * (sqrt(d / bc2 + eps_root) + eps)``, written into ``d`` (the second moment) when donated."""
        if is_zero(eps_root):  # sqrt(v / bc2) = sqrt(v) / sqrt(bc2): one pass fewer
            d = tree.sqrt_(d)
            d = tree.scale_(d, bc1 / bc2.sqrt())
            return tree.add_(d, eps * bc1)
        d = tree.add_(tree.div_(d, bc2), eps_root)
        d = tree.add_(tree.sqrt_(d), eps)
        return tree.scale_(d, bc1)

    def update_fn(updates, state, params=None):
        del params
        g, mu, nu = tree.align(updates, state.mu, state.nu)
        count = tree.inc_(state.count)
        if not g:
            return updates, state._replace(count=count)
        mu, m = ema_(mu, g, b1)  # m: the new first moment at full precision (mu itself unless mu_dtype)
        nu, v = ema_sq_(nu, g, b2)
        bc1, bc2 = bias_correction(b1, count, g), bias_correction(b2, count, g)
        if nesterov:
            # g <- bc1 * m_hat = (1 - b1) g + b1 bc1 / (1 - b1^(t+1)) m; the denominator needs a buffer.
            g = tree.scale_(g, 1 - b1)
            g = tree.add_(g, m, b1 * bc1 / bias_correction(b1, count + 1, g))
            with tree.functional():
                d = tree.scale_(v, 1.0)
            g = tree.div_(g, denominator_(d, bc1, bc2))
        elif any(x.is_complex() for x in g):
            # 1 / (d / m) below divides by m: complex division by a zero m is NaN, not the real path's inf -> 0.
            with tree.functional():
                d = denominator_(tree.scale_(v, 1.0), bc1, bc2)
            g = tree.div_(tree.copy_(g, m), d)
        else:
            # The gradient is no longer needed: build bc1 * (sqrt(v_hat) + eps) in its buffer, then
            # u = 1 / (that / m) = m_hat / (sqrt(v_hat) + eps) without a temporary. Out of place (under
            # autograd or torch.func) the plain quotient m / d: the derivative of 1 / (d / m) at m = 0 is
            # 0 * inf = NaN, a NaN meta-gradient wherever a gradient coordinate is 0 (a dead ReLU unit).
            g = denominator_(tree.copy_(g, v), bc1, bc2)
            if tree.is_functional():
                g = tree.div_(m, g)
            else:
                g = tree.reciprocal_(tree.div_(g, m))
        return tree.put(updates, updates, g), ScaleByAdamState(
            count, tree.put(state.mu, updates, mu), tree.put(state.nu, updates, nu))

    return GradientTransformation(init_fn, update_fn)
