"""Polyak's step size: ``scale_by_polyak`` and the optimizer ``polyak_sgd`` (Optax's math).

Both read the objective's value at the current params, passed as ``tx.update(g, state, params,
value=loss)`` (Optax's ``GradientTransformationExtraArgs``).
"""

from __future__ import annotations

from typing import Literal

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, chain, check_nonnegative, transform
from fxtrain.transforms._linesearch import plain_scalar, vdot
from fxtrain.transforms._moments import LearningRate, Scalar

__all__ = ["scale_by_polyak"]

POLYAK_VARIANTS = ("sps", "sps+")
# Optax compares the denominator with float64's machine epsilon (``jnp.finfo(float).eps``).
_TINY = torch.finfo(torch.float64).eps


@transform(elementwise=False, extra_args=True)
def scale_by_polyak(f_min: Scalar = 0.0, max_learning_rate: Scalar = 1.0, eps: Scalar = 0.0,
                    variant: Literal["sps", "sps+"] = "sps") -> GradientTransformation:
    r"""Scales updates by Polyak's step size (Optax's ``scale_by_polyak``).

    .. math::
        u_t = \min\left\{\frac{f(x_t) - f^\star}{\|g_t\|^2 + \epsilon}, \gamma_{\max}\right\} g_t

    with the gap :math:`f(x_t) - f^\star` replaced by its positive part for ``variant="sps+"``, and a
    step of 0 when :math:`\|g_t\|^2 + \epsilon` is below float64's machine epsilon. The norm is global
    over all leaves (a DTensor leaf counts all its shards).

    Args:
      f_min: :math:`f^\star`, a lower bound on the objective.
      max_learning_rate: :math:`\gamma_{\max}`, the largest step size.
      eps: :math:`\epsilon`, added to the denominator.
      variant: ``"sps"`` or ``"sps+"``.

    Returns:
      A stateless transform (:class:`fxtrain.EmptyState`) whose ``update`` requires ``value=``, the
      objective at ``params``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_polyak()
        >>> g = {"w": torch.tensor([3.0, 4.0])}
        >>> u, _ = tx.update(g, tx.init(g), value=torch.tensor(5.0))   # 5 / 25 of g
        >>> u["w"].tolist()
        [0.6..., 0.8...]

    References:
      Loizou et al., `Stochastic Polyak step-size for SGD: An adaptive learning rate for fast convergence
      <https://arxiv.org/abs/2002.10542>`_, 2021.
    """
    check_nonnegative("scale_by_polyak", max_learning_rate=max_learning_rate, eps=eps)
    if variant not in POLYAK_VARIANTS:
        raise ValueError(f"scale_by_polyak: variant={variant!r} must be one of {POLYAK_VARIANTS}")

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del params, extra_args  # Optax ignores the other extra arguments too
        if value is None:
            raise TypeError("scale_by_polyak.update needs value= (the objective at params): "
                            "tx.update(grads, state, params, value=loss)")
        g = tree.align(updates)[0]
        if not g:
            return updates, state
        sq = vdot(g, g)  # global: a DTensor leaf counts all its shards
        gap = plain_scalar(value, sq.dtype, sq.device) - f_min  # a DTensor value (a sum over shards) is gathered
        if variant == "sps+":
            gap = gap.clamp_min(0)
        denom = sq + eps
        step = torch.where(denom <= _TINY, torch.zeros_like(sq), torch.minimum(gap / denom, torch.as_tensor(
            max_learning_rate, dtype=sq.dtype, device=sq.device)))
        return tree.put(updates, updates, tree.scale_(g, step)), state

    return GradientTransformation(init_fn, update_fn)
