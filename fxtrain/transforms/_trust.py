"""Layer-wise trust ratios: ``scale_by_trust_ratio`` and the optimizers built on it, ``fromage``, ``lamb``,
``lars`` (Optax's).

A trust ratio is per leaf: the norm of the param over the norm of its update. On DTensor leaves each norm
is the whole tensor's (``torch.linalg.vector_norm`` and ``torch._foreach_norm`` both return a ``Partial``
norm DTensor there, reduced with ``full_tensor()``: one all-reduce per DTensor leaf), and the ratios
multiply the local pieces, so placements are kept.
"""

from __future__ import annotations

from typing import Callable

import torch

from fxtrain import tree
from fxtrain._base import (EmptyState, GradientTransformation, chain, check_learning_rate, check_needs_params,
                           check_nonnegative, transform)

from fxtrain.transforms._adam import scale_by_adam
from fxtrain.transforms._masking import Mask, masked
from fxtrain.transforms._moments import LearningRate, Scalar
from fxtrain.transforms._momentum import trace
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = ["fromage", "lamb", "lars", "scale_by_trust_ratio"]

def _leaf_norms(xs: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor of ``xs`` (DTensors: of the whole tensor), as one 1-D tensor.

    Each norm is accumulated in float32 or wider and rounded to its leaf's (real) dtype, as Optax's
    ``jnp.linalg.norm``; the 1-D result has the widest of them. In place: one ``torch._foreach_norm``;
    inside :func:`fxtrain.tree.functional`, ``vector_norm`` per leaf (what ``vmap`` and ``grad`` see).
    """
    norms = [torch.linalg.vector_norm(x) for x in xs] if tree.is_functional() else torch._foreach_norm(xs)
    return torch.stack([tree.full(n) for n in norms])


@transform(elementwise=False)
def scale_by_trust_ratio(min_norm: Scalar = 0.0, trust_coefficient: Scalar = 1.0, eps: Scalar = 0.0
                         ) -> GradientTransformation:
    r"""Scales each leaf's update by its trust ratio, the param's norm over the update's (Optax's).

    Per leaf, with norms clipped below at ``min_norm``:

    .. math:: u \leftarrow u \cdot \frac{c\, \lVert\theta\rVert}{\lVert u\rVert + \epsilon}
        \quad(\text{ratio } 1 \text{ where either norm is } 0)

    Args:
      min_norm: lower bound of both norms (0: no bound).
      trust_coefficient: :math:`c`, a multiplier of the ratio.
      eps: :math:`\epsilon`, added to the update's norm.

    Returns:
      A stateless transform (``EmptyState``) that needs the params.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_trust_ratio()
        >>> params = {"w": torch.tensor([3.0, 4.0]), "z": torch.zeros(2)}
        >>> u, _ = tx.update({"w": torch.tensor([0.0, 0.5]), "z": torch.ones(2)}, tx.init(params), params)
        >>> u["w"].tolist(), u["z"].tolist()   # |w| / |u| = 10; a zero param keeps its update
        ([0.0, 5.0], [1.0, 1.0])

    References:
      You et al., `Large Batch Training of Convolutional Networks <https://arxiv.org/abs/1708.03888>`_, 2017.
    """
    check_nonnegative("scale_by_trust_ratio", min_norm=min_norm, trust_coefficient=trust_coefficient, eps=eps)

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_trust_ratio", params)
        g, p = tree.align(updates, params, what="params")
        if not g:
            return updates, state
        param_norm = torch.clamp_min(_leaf_norms(p), min_norm)
        update_norm = torch.clamp_min(_leaf_norms(g), min_norm)
        ratio = trust_coefficient * param_norm / (update_norm + eps)
        ratio = torch.where((param_norm == 0) | (update_norm == 0), 1.0, ratio)
        g = tree.scale_([tree.local(x) for x in g], list(ratio.unbind()))  # on local pieces: placements kept
        return tree.put(updates, updates, g), state

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def fromage(learning_rate: LearningRate, min_norm: Scalar = 1e-6) -> GradientTransformation:
    r"""Frobenius matched gradient descent (Fromage; Optax's ``fromage``).

    .. math:: \theta_{t+1} = \frac{1}{\sqrt{1 + \eta^2}}\left(\theta_t - \eta\,
        \frac{\lVert\theta_t\rVert}{\lVert g_t\rVert}\, g_t\right) \quad\text{per leaf}

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      min_norm: lower bound of the norms in the trust ratio.

    Returns:
      ``chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(learning_rate * m),
      add_decayed_weights(m - 1))`` with :math:`m = 1 / \sqrt{1 + \eta^2}` (for a schedule, both are
      schedules).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.fromage(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> u, _ = tx.update({"w": torch.tensor([0.0, 1.0])}, tx.init(params), params)
        >>> fx.apply_updates(params, u)["w"].tolist()   # (w - 0.1 * 5 * g) / sqrt(1.01)
        [2.98..., 3.48...]

    References:
      Bernstein et al., `On the distance between two neural networks and the stability of learning
      <https://arxiv.org/abs/2002.03432>`_, 2020.
    """
    check_learning_rate("fromage", learning_rate=learning_rate, min_norm=min_norm)
    if callable(learning_rate):
        def mult(count):
            return 1 / (1 + learning_rate(count) ** 2) ** 0.5

        step, decay = (lambda count: mult(count) * learning_rate(count)), (lambda count: mult(count) - 1)
    else:
        m = 1 / (1 + learning_rate ** 2) ** 0.5
        # m - 1 < 0 is a shrink, which add_decayed_weights refuses as a number: a 0-dim tensor passes through
        step, decay = learning_rate * m, m - 1 if isinstance(m, torch.Tensor) else torch.tensor(m - 1)
    return chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(step), add_decayed_weights(decay))


@transform(elementwise=None)
def lamb(learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-6,
         eps_root: Scalar = 0.0, weight_decay: Scalar | Callable = 0.0, mask: Mask | None = None
         ) -> GradientTransformation:
    r"""Layer-wise adaptive moments (LAMB; Optax's ``lamb``): Adam's direction plus weight decay, rescaled
    per leaf by its trust ratio.

    .. math:: r_t = \frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon} + \lambda \theta_t, \qquad
        \theta_{t+1} = \theta_t - \eta_t\, \frac{\lVert\theta_t\rVert}{\lVert r_t\rVert}\, r_t

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the root of the second moment.
      eps_root: added inside the root.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      mask: where to decay (see :func:`fxtrain.masked`); ``None``: everywhere.

    Returns:
      ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
      scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.lamb(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> u, _ = tx.update({"w": torch.tensor([0.0, 2.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # Adam's first direction [0, 1], scaled to the param's norm 5
        [0.0, -0.5...]

    References:
      You et al., `Large Batch Optimization for Deep Learning: Training BERT in 76 minutes
      <https://arxiv.org/abs/1904.00962>`_, 2020.
    """
    check_learning_rate("lamb", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    return chain(scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
                 add_decayed_weights(weight_decay, mask=mask), scale_by_trust_ratio(),
                 scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def lars(learning_rate: LearningRate, weight_decay: Scalar | Callable = 0.0, weight_decay_mask: Mask = True,
         trust_coefficient: Scalar = 0.001, eps: Scalar = 0.0, trust_ratio_mask: Mask = True,
         momentum: Scalar = 0.9, nesterov: bool = False) -> GradientTransformation:
    r"""Layer-wise adaptive rate scaling (LARS; Optax's ``lars``): SGD with momentum on updates rescaled per
    leaf by a trust ratio.

    .. math:: r_t = c\, \frac{\lVert\theta_t\rVert}{\lVert g_t + \lambda\theta_t\rVert + \epsilon}
        (g_t + \lambda\theta_t), \qquad m_t = \beta m_{t-1} - \eta_t r_t, \qquad \theta_{t+1} = \theta_t + m_t

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      weight_decay: :math:`\lambda`, a number, a 0-dim tensor or a schedule.
      weight_decay_mask: where to decay: a bool, a tree of bools (a prefix of the params') or a
        function of the params returning one.
      trust_coefficient: :math:`c`.
      eps: :math:`\epsilon`, added to the update's norm.
      trust_ratio_mask: where to apply the trust ratio (like ``weight_decay_mask``).
      momentum: :math:`\beta`.
      nesterov: use Nesterov momentum.

    Returns:
      ``chain(add_decayed_weights(weight_decay, weight_decay_mask), masked(scale_by_trust_ratio(
      trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask), scale_by_learning_rate(learning_rate),
      trace(momentum, nesterov))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.lars(1.0, trust_coefficient=0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> u, _ = tx.update({"w": torch.tensor([0.0, 2.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # 0.1 * 5 / 2 * g
        [0.0, -0.5...]

    References:
      You et al., `Large Batch Training of Convolutional Networks <https://arxiv.org/abs/1708.03888>`_, 2017.
    """
    check_learning_rate("lars", learning_rate=learning_rate, trust_coefficient=trust_coefficient, eps=eps, momentum=momentum)
    return chain(add_decayed_weights(weight_decay, mask=weight_decay_mask),
                 masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask),
                 scale_by_learning_rate(learning_rate), trace(decay=momentum, nesterov=nesterov))
