"""DoG and DoWG: parameter-free step sizes from the distance travelled (Optax's ``contrib._dog``)."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from fxtrain import distributed, tree
from fxtrain._base import (GradientTransformation, Params, chain, check_needs_params, check_nonnegative, identity,
                           transform)
from fxtrain.contrib._numerics import LearningRate, safe_sqrt, tree_sum_sq
from fxtrain.transforms._masking import Mask
from fxtrain.transforms._moments import Scalar, param_device, scalar_dtype
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights


__all__ = ["DoGState", "scale_by_dog", "dog", "DoWGState", "scale_by_dowg", "dowg"]

_INIT_STEPS = ("distance", "learning_rate", "heuristic")


def _sq_dist(init_params: list, params: list) -> torch.Tensor:
    """``|x_0 - x_t|^2`` over all leaves, accumulated in float32 or wider (one temporary per leaf)."""
    with tree.functional():
        return tree_sum_sq(tree.add_(init_params, params, -1.0))


class DoGState(NamedTuple):
    """State of :func:`scale_by_dog` (Optax's field names and order)."""

    is_init_step: torch.Tensor  # 0-dim bool: no update yet
    init_params: Params  # x_0, a copy
    max_dist: torch.Tensor  # 0-dim, the params' lowest dtype: max_k |x_k - x_0| (r_epsilon at first)
    sum_sq_norm_grads: torch.Tensor  # 0-dim: sum_k |g_k|^2


@transform(elementwise=False)
def scale_by_dog(init_step: tuple[Literal["distance", "learning_rate", "heuristic"], Scalar],
                 eps: Scalar = 1e-8) -> GradientTransformation:
    r"""Scales updates by the Distance over Gradients step size (DoG; Optax's ``contrib.scale_by_dog``).

    .. math::
        \bar r_t = \max\left(r_\epsilon, \max_{k \le t} \lVert x_k - x_0 \rVert\right), \qquad
        G_t = \sum_{k \le t} \lVert g_k \rVert^2, \qquad
        u_t = \frac{\bar r_t}{\sqrt{G_t + \epsilon}}\, g_t

    (norms over all leaves). ``init_step`` sets the first step: ``("distance", r)`` gives
    :math:`r_\epsilon = r`; ``("heuristic", a)`` gives :math:`r_\epsilon = a (1 + \lVert x_0 \rVert)` (so
    ``init`` must see the real params); ``("learning_rate", eta)`` uses :math:`\eta` as the first step size.

    Args:
      init_step: ``(kind, value)`` with ``kind`` one of ``"distance"``, ``"learning_rate"``, ``"heuristic"``.
      eps: added to :math:`G_t` under the square root.

    Returns:
      A transform with state :class:`DoGState`; it needs ``params`` at update. Not elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_dog(("distance", 0.5))
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> u, state = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # 0.5 * g / |g|
        [0.3..., 0.4...]

    References:
      Ivgi et al., `DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size Schedule
      <https://arxiv.org/abs/2302.12022>`_, 2023.
    """
    kind, value = init_step
    if kind not in _INIT_STEPS:
        raise ValueError(f"scale_by_dog: init_step=({kind!r}, ...) must start with one of {_INIT_STEPS}")
    check_nonnegative("scale_by_dog", init_step=value, eps=eps)

    def init_fn(params):
        dtype = scalar_dtype(params)
        if kind == "distance":
            r_eps = value
        elif kind == "heuristic":
            # Out of place: plain leaves get Optax's leaf-by-leaf sum, which vmap and grad see through (the
            # packed kernel of the donated path has no batching rule); DTensor leaves still take the engine.
            with tree.functional():
                r_eps = value * (1 + distributed.global_norm(params))
        else:
            r_eps = 0.0
        return DoGState(is_init_step=torch.ones((), dtype=torch.bool, device=param_device(params)),
                        init_params=tree.clone(params),
                        max_dist=torch.as_tensor(r_eps, dtype=dtype, device=param_device(params)).clone(),
                        sum_sq_norm_grads=torch.zeros((), dtype=dtype, device=param_device(params)))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_dog", params)
        g, x0, x = tree.align(updates, state.init_params, params)
        max_dist = torch.maximum(state.max_dist, safe_sqrt(_sq_dist(x0, x)).to(state.max_dist.dtype))
        sum_sq = state.sum_sq_norm_grads + tree_sum_sq(g).to(state.sum_sq_norm_grads.dtype)
        lr = max_dist / (sum_sq + eps).sqrt()
        if kind == "learning_rate":
            lr = torch.where(state.is_init_step, torch.as_tensor(value, dtype=lr.dtype, device=lr.device), lr)
        g = tree.scale_(g, lr)
        return tree.put(updates, updates, g), DoGState(torch.zeros_like(state.is_init_step), state.init_params,
                                                       max_dist, sum_sq)

    return GradientTransformation(init_fn, update_fn)


def _decay_or_identity(weight_decay: Scalar | None, mask: Mask | None) -> GradientTransformation:
    return add_decayed_weights(weight_decay, mask) if weight_decay is not None else identity()


@transform(elementwise=None)
def dog(learning_rate: LearningRate = 1.0,
        init_step: tuple[Literal["distance", "learning_rate", "heuristic"], Scalar] = ("heuristic", 1e-6),
        eps: Scalar = 1e-8, weight_decay: Scalar | None = None, mask: Mask | None = None) -> GradientTransformation:
    r"""Distance over Gradients (DoG): SGD with a parameter-free step size (Optax's ``contrib.dog``).

    .. math::
        \bar r_t = \max_{k \le t} \lVert x_k - x_0 \rVert, \qquad G_t = \sum_{k \le t} \lVert g_k \rVert^2,
        \qquad x_{t+1} = x_t - \eta\, \frac{\bar r_t}{\sqrt{G_t + \epsilon}}\, g_t

    Args:
      learning_rate: :math:`\eta`, a multiplier (1 by default), a number, a 0-dim tensor or a schedule.
      init_step: the first step, see :func:`scale_by_dog` (the authors suggest ``("heuristic", 1e-6)``,
        ``1e-4`` with batch normalization).
      eps: added to :math:`G_t` under the square root.
      weight_decay: strength of weight decay added to the gradients first; ``None``: none.
      mask: which params decay (a tree of bools or a function of the params).

    Returns:
      ``chain(add_decayed_weights(weight_decay, mask) or identity(), scale_by_dog(init_step, eps),
      scale_by_learning_rate(learning_rate))``. ``init`` must see the real params (the heuristic).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.dog()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(3):
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> f"{float((params ** 2).sum()):.5f}"   # tiny first steps, growing with the distance travelled
        '13.99990'

    References:
      Ivgi et al., `DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size Schedule
      <https://arxiv.org/abs/2302.12022>`_, 2023.
    """
    check_nonnegative("dog", learning_rate=None if callable(learning_rate) else learning_rate)
    return chain(_decay_or_identity(weight_decay, mask), scale_by_dog(init_step, eps),
                 scale_by_learning_rate(learning_rate))


class DoWGState(NamedTuple):
    """State of :func:`scale_by_dowg` (Optax's field names and order)."""

    init_params: Params  # x_0, a copy
    weighted_sq_norm_grads: torch.Tensor  # 0-dim: sum_k r_k^2 |g_k|^2
    estim_sq_dist: torch.Tensor  # 0-dim: r_t^2 = max_k |x_k - x_0|^2


@transform(elementwise=False)
def scale_by_dowg(init_estim_sq_dist: Scalar | None = None, eps: Scalar = 1e-4) -> GradientTransformation:
    r"""Scales updates by the Distance over Weighted Gradients step size (DoWG; Optax's ``contrib.scale_by_dowg``).

    .. math::
        \bar r_t^2 = \max\left(\bar r_{t-1}^2, \lVert x_t - x_0 \rVert^2\right), \qquad
        v_t = v_{t-1} + \bar r_t^2 \lVert g_t \rVert^2, \qquad
        u_t = \frac{\bar r_t^2}{\sqrt{v_t} + \epsilon}\, g_t

    Args:
      init_estim_sq_dist: :math:`\bar r_0^2`, a guess of the squared distance to the solution; ``None``: ``eps``.
      eps: added to the denominator (and the default first guess).

    Returns:
      A transform with state :class:`DoWGState`; it needs ``params`` at update. Not elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_dowg(init_estim_sq_dist=1.0, eps=0.0)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> u, state = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # 1 * g / (1 * |g|)
        [0.6..., 0.8...]

    References:
      Khaled et al., `DoWG Unleashed: An Efficient Universal Parameter-Free Gradient Descent Method
      <https://arxiv.org/abs/2305.16284>`_, 2023.
    """
    check_nonnegative("scale_by_dowg", init_estim_sq_dist=init_estim_sq_dist, eps=eps)

    def init_fn(params):
        dtype, device = scalar_dtype(params), param_device(params)
        first = eps if init_estim_sq_dist is None else init_estim_sq_dist
        return DoWGState(init_params=tree.clone(params),
                         weighted_sq_norm_grads=torch.zeros((), dtype=dtype, device=device),
                         estim_sq_dist=torch.as_tensor(first, dtype=dtype, device=device).clone())

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_dowg", params)
        g, x0, x = tree.align(updates, state.init_params, params)
        estim = torch.maximum(state.estim_sq_dist, _sq_dist(x0, x).to(state.estim_sq_dist.dtype))
        weighted = estim * tree_sum_sq(g).to(estim.dtype) + state.weighted_sq_norm_grads
        g = tree.scale_(g, estim / (weighted.sqrt() + eps))
        return tree.put(updates, updates, g), DoWGState(state.init_params, weighted, estim)

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def dowg(learning_rate: LearningRate = 1.0, init_estim_sq_dist: Scalar | None = None, eps: Scalar = 1e-4,
         weight_decay: Scalar | None = None, mask: Mask | None = None) -> GradientTransformation:
    r"""Distance over Weighted Gradients (DoWG): SGD with a parameter-free step size (Optax's ``contrib.dowg``).

    .. math:: x_{t+1} = x_t - \eta\, \frac{\bar r_t^2}{\sqrt{v_t} + \epsilon}\, g_t

    with :math:`\bar r_t^2` and :math:`v_t` as in :func:`scale_by_dowg`.

    Args:
      learning_rate: :math:`\eta`, a multiplier (1 by default), a number, a 0-dim tensor or a schedule.
      init_estim_sq_dist: a guess of the squared distance to the solution; ``None``: ``eps``.
      eps: added to the denominator (and the default first guess).
      weight_decay: strength of weight decay added to the gradients first; ``None``: none.
      mask: which params decay (a tree of bools or a function of the params).

    Returns:
      ``chain(add_decayed_weights(weight_decay, mask) or identity(), scale_by_dowg(init_estim_sq_dist, eps),
      scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.dowg()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(5):   # f(x) = |x|^2: Optax's example
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        ...     print(f"{float((params ** 2).sum()):.4f}")
        13.9254
        13.8728
        13.7754
        13.5962
        13.2688

    References:
      Khaled et al., `DoWG Unleashed: An Efficient Universal Parameter-Free Gradient Descent Method
      <https://arxiv.org/abs/2305.16284>`_, 2023.
    """
    check_nonnegative("dowg", learning_rate=None if callable(learning_rate) else learning_rate)
    return chain(_decay_or_identity(weight_decay, mask), scale_by_dowg(init_estim_sq_dist, eps),
                 scale_by_learning_rate(learning_rate))
