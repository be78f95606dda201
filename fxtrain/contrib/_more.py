"""Smaller contrib optimizers with Optax's names and numbers: DoG and DoWG (parameter-free step sizes),
COCOB (coin betting), MADGRAD (momentumized dual averaging), MoMo and MoMo-Adam (Polyak-type step sizes from the loss value), Mechanic (a learned scale of any optimizer's
updates), D-Adaptation AdamW, and ``split_real_and_imaginary`` (complex params as pairs of real ones)."""

from __future__ import annotations

from typing import Any, Callable, Literal, NamedTuple

import optree
import torch

from fxtrain import distributed, tree
from fxtrain._base import (GradientTransformation, Params, call_, chain, check_needs_params, check_nonnegative, identity,
                           is_elementwise, transform, with_traits)
from fxtrain._deferred import DTensor
from fxtrain.transforms._masking import Mask
from fxtrain.transforms._moments import (Scalar, bias_correction, counter, is_zero, param_device, safe_increment_,
                                        scalar_dtype)
from fxtrain.schedules import value_at
from fxtrain.transforms._scaling import precision, scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = ["DoGState", "scale_by_dog", "dog", "DoWGState", "scale_by_dowg", "dowg", "COCOBState", "scale_by_cocob",
           "cocob", "MadgradState", "scale_by_madgrad", "madgrad",
           "MomoState", "momo", "MomoAdamState", "momo_adam", "MechanicState", "mechanize",
           "DAdaptAdamWState", "dadapt_adamw", "SplitRealAndImaginaryArrays", "SplitRealAndImaginaryState",
           "split_real_and_imaginary"]

LearningRate = Scalar | Callable
_INIT_STEPS = ("distance", "learning_rate", "heuristic")


def _sum_sq(xs: list) -> torch.Tensor:
    """``|x|^2`` over all leaves, float32 or wider; DTensor leaves summed over their meshes (the norm engine)."""
    return distributed.global_sum_sq(xs).sum_sq


def _sq_dist(init_params: list, params: list) -> torch.Tensor:
    """``|x_0 - x_t|^2`` over all leaves, accumulated in float32 or wider (one temporary per leaf)."""
    with tree.functional():
        return _sum_sq(tree.add_(init_params, params, -1.0))


def _scheduled(value: Any, count: torch.Tensor, updates: Any) -> Any:
    """``value``, or its schedule at ``count`` computed in the updates' precision (float64 runs: float64)."""
    return value_at(value, count, precision(tree.leaves(updates))) if callable(value) else value


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` whose gradient at 0 is 0, not NaN: the first update's distance is 0, and Optax's gradient
    through it (``jax.grad`` through ``dog``) is NaN."""
    positive = x > 0
    return torch.where(positive, torch.where(positive, x, 1.0).sqrt(), 0.0)


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
        max_dist = torch.maximum(state.max_dist, _safe_sqrt(_sq_dist(x0, x)).to(state.max_dist.dtype))
        sum_sq = state.sum_sq_norm_grads + _sum_sq(g).to(state.sum_sq_norm_grads.dtype)
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
        weighted = estim * _sum_sq(g).to(estim.dtype) + state.weighted_sq_norm_grads
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



class COCOBState(NamedTuple):
    """State of :func:`scale_by_cocob` (Optax's field names and order), all like the params."""

    init_particles: Params  # x_0, a copy
    cumulative_gradients: Params  # C: minus the sum of the gradients
    scale: Params  # L: the largest |g| seen (eps at first)
    subgradients: Params  # G: the sum of |g|
    reward: Params  # R: the bettor's wealth


@transform(elementwise=True)
def scale_by_cocob(alpha: Scalar = 100.0, eps: Scalar = 1e-8) -> GradientTransformation:
    r"""Rescales updates by COntinuous COin Betting (COCOB-Backprop; Optax's ``contrib.scale_by_cocob``).

    Elementwise, with :math:`x_0` the initial params and :math:`g_t` the gradient:

    .. math::
        L_t = \max(L_{t-1}, |g_t|), \quad G_t = G_{t-1} + |g_t|, \quad
        R_t = \max(R_{t-1} - g_t (x_t - x_0), 0), \quad C_t = C_{t-1} - g_t, \\
        u_t = x_0 + \frac{C_t}{L_t \max(G_t + L_t, \alpha L_t)} (L_t + R_t) - x_t

    (:math:`L_0 = \epsilon`): the update moves the params to the bet :math:`x_0 + \dots`.

    Args:
      alpha: bounds the fraction bet early on (the paper's :math:`\alpha`).
      eps: the first :math:`L`, against dividing by 0.

    Returns:
      A transform with state :class:`COCOBState`; it needs ``params`` at update. Elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_cocob()
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> u, state = tx.update({"w": torch.tensor([2.0, -4.0])}, tx.init(params), params)
        >>> u["w"].tolist()   # -g / (alpha |g|): a first bet of 1 / alpha against the gradient
        [-0.01, 0.01]

    References:
      Orabona and Tommasi, `Training Deep Networks without Learning Rates Through Coin Betting
      <https://arxiv.org/abs/1705.07795>`_, 2017.
    """
    check_nonnegative("scale_by_cocob", alpha=alpha, eps=eps)

    def init_fn(params):
        return COCOBState(init_particles=tree.clone(params), cumulative_gradients=tree.zeros_like(params),
                          scale=tree.map(lambda p: torch.full_like(p, eps), params),
                          subgradients=tree.zeros_like(params), reward=tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_cocob", params)
        g, x0, c, lo, s, r, x = tree.align(updates, *state, params)
        with tree.functional():  # two temporaries: |g| and the bet's distance
            a, d = tree.abs_(g), tree.add_(x, x0, -1.0)
        lo = tree.maximum_(lo, a)
        s = tree.add_(s, a)
        r = tree.clamp_(tree.add_(r, tree.scale_(d, g), -1.0), 0.0)  # max(R - g (x - x0), 0)
        c = tree.add_(c, g, -1.0)
        den = tree.maximum_(tree.add_(tree.copy_(a, s), lo), tree.scale_(tree.copy_(d, lo), alpha))
        den = tree.scale_(den, lo)  # L max(G + L, alpha L)
        g = tree.scale_(tree.div_(tree.copy_(g, c), den), tree.add_(tree.copy_(d, lo), r))
        g = tree.add_(tree.add_(g, x0), x, -1.0)
        put = lambda old, new: tree.put(old, updates, new)  # noqa: E731
        return tree.put(updates, updates, g), COCOBState(state.init_particles, put(state.cumulative_gradients, c),
                                                         put(state.scale, lo), put(state.subgradients, s),
                                                         put(state.reward, r))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def cocob(learning_rate: LearningRate = 1.0, alpha: Scalar = 100.0, eps: Scalar = 1e-8, weight_decay: Scalar = 0.0,
          mask: Mask | None = None) -> GradientTransformation:
    r"""COCOB-Backprop: learning-rate-free coin betting per coordinate (Optax's ``contrib.cocob``).

    The gradients (plus ``weight_decay`` times the params) are multiplied by ``learning_rate`` and fed to
    :func:`scale_by_cocob`, whose update moves each coordinate to its bet.

    Args:
      learning_rate: multiplies the gradients before the betting (1: none), a number or a schedule.
      alpha: bounds the fraction bet early on.
      eps: the first scale, against dividing by 0.
      weight_decay: L2 penalty added to the gradients.
      mask: which params decay (a tree of bools or a function of the params).

    Returns:
      ``chain(add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate,
      flip_sign=False), scale_by_cocob(alpha, eps))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.cocob()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(30):   # f(x) = |x|^2: slow at first, then the bets grow
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((params ** 2).sum()), 2)
        0.22

    References:
      Orabona and Tommasi, `Training Deep Networks without Learning Rates Through Coin Betting
      <https://arxiv.org/abs/1705.07795>`_, 2017.
    """
    check_nonnegative("cocob", learning_rate=None if callable(learning_rate) else learning_rate,
                      weight_decay=weight_decay)
    return chain(add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate, flip_sign=False),
                 scale_by_cocob(alpha, eps))


class MadgradState(NamedTuple):
    """State of :func:`scale_by_madgrad` (Optax's field names and order)."""

    count: torch.Tensor  # 0-dim int32: number of updates so far
    grad_sum_sq: Params  # G: the lambda-weighted sum of squared gradients
    s: Params  # the lambda-weighted sum of gradients
    x0: Params  # the initial params, a copy


def _cbrt_(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The cube root of non-negative ``xs`` (torch has no ``cbrt``; an op-layer-style private op)."""
    if tree.is_functional():
        return [x.pow(1 / 3) for x in xs]
    torch._foreach_pow_(xs, 1 / 3)
    return xs


@transform(elementwise=True)
def scale_by_madgrad(learning_rate: LearningRate, momentum: Scalar = 0.9, eps: Scalar = 1e-6
                     ) -> GradientTransformation:
    r"""Rescales updates by MADGRAD's momentumized dual averaging (Optax's ``contrib.scale_by_madgrad``).

    With :math:`k` the number of updates so far, :math:`x_0` the initial params and :math:`\eta_k` the
    learning rate:

    .. math::
        \lambda_k = (\eta_k + \epsilon) \sqrt{k + 1}, \qquad
        G_k = G_{k-1} + \lambda_k g_k^2, \qquad s_k = s_{k-1} + \lambda_k g_k, \
        z_k = x_0 - rac{s_k}{\sqrt[3]{G_k} + \epsilon}, \qquad
        u_k = (1 - eta)\, z_k + eta\, x_k - x_k

    The learning rate is inside: chain no ``scale_by_learning_rate`` after it.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule of the count.
      momentum: :math:`eta`.
      eps: added to the learning rate and to the denominator.

    Returns:
      A transform with state :class:`MadgradState`; it needs ``params`` at update. Elementwise.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.scale_by_madgrad(0.1, momentum=0.0, eps=0.0)
        >>> params = {"w": torch.tensor([0.0, 0.0])}
        >>> u, state = tx.update({"w": torch.tensor([8.0, -1.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # -s / cbrt(G) = -(0.1 g) / cbrt(0.1 g^2)
        [-0.4309, 0.2154]

    References:
      Defazio and Jelassi, `Adaptivity without Compromise: A Momentumized, Adaptive, Dual Averaged Gradient
      Method for Stochastic Optimization <https://arxiv.org/abs/2101.11075>`_, 2021.
    """
    check_nonnegative("scale_by_madgrad", learning_rate=None if callable(learning_rate) else learning_rate,
                      momentum=momentum, eps=eps)

    def init_fn(params):
        return MadgradState(count=counter(params), grad_sum_sq=tree.zeros_like(params), s=tree.zeros_like(params),
                            x0=tree.clone(params))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_madgrad", params)
        lr = _scheduled(learning_rate, state.count, updates)
        lamb = (lr + eps) * (state.count + 1).to(precision(tree.leaves(updates))).sqrt()
        g, sq, s, x0, x = tree.align(updates, state.grad_sum_sq, state.s, state.x0, params)
        sq = tree.addcmul_(sq, g, g, lamb)
        s = tree.add_(s, g, lamb)
        # The gradient buffer is free now: z = x0 - s / (cbrt(G) + eps), then the update, built in it.
        g = tree.add_(_cbrt_(tree.copy_(g, sq)), eps)
        g = tree.add_(tree.neg_(tree.scale_(tree.reciprocal_(g), s)), x0)
        g = tree.add_(tree.add_(tree.scale_(g, 1 - momentum), x, momentum), x, -1.0)
        return tree.put(updates, updates, g), MadgradState(
            safe_increment_(state.count), tree.put(state.grad_sum_sq, updates, sq), tree.put(state.s, updates, s),
            state.x0)

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def madgrad(learning_rate: LearningRate, momentum: Scalar = 0.9, weight_decay: Scalar = 0.0, eps: Scalar = 1e-6
            ) -> GradientTransformation:
    r"""MADGRAD: momentumized, adaptive dual averaging (Optax's ``contrib.madgrad``).

    :func:`scale_by_madgrad` on the gradients plus ``weight_decay`` times the params (L2).

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      momentum: :math:`eta`.
      weight_decay: L2 strength added to the gradients.
      eps: added to the learning rate and to the denominator.

    Returns:
      ``chain(add_decayed_weights(weight_decay), scale_by_madgrad(learning_rate, momentum, eps))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.madgrad(0.1)
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(20):   # f(x) = |x|^2
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((params ** 2).sum()), 3)   # from 14
        0.181

    References:
      Defazio and Jelassi, `Adaptivity without Compromise: A Momentumized, Adaptive, Dual Averaged Gradient
      Method for Stochastic Optimization <https://arxiv.org/abs/2101.11075>`_, 2021.
    """
    check_nonnegative("madgrad", weight_decay=weight_decay)
    return chain(add_decayed_weights(weight_decay),
                 scale_by_madgrad(learning_rate=learning_rate, momentum=momentum, eps=eps))


class MomoState(NamedTuple):
    """State of :func:`momo` (Optax's field names and order)."""

    exp_avg: Params  # d: the moving average of the gradients
    barf: torch.Tensor  # 0-dim: the moving average of the loss values
    gamma: torch.Tensor  # 0-dim: the moving average of <g, x>
    lb: torch.Tensor  # 0-dim: the lower bound of the loss (estimated with adapt_lower_bound)
    count: torch.Tensor  # 0-dim int32


_vdot = tree.vdot


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
    :math:`eta_k = 0` at the first update and :math:`eta` after, :math:`lpha` the learning rate,
    :math:`\lambda` the weight decay and :math:`f^*` the lower bound:

    .. math::
        ar f_k = eta_k ar f_{k-1} + (1 - eta_k) f_k, \quad
        d_k = eta_k d_{k-1} + (1 - eta_k) g_k, \quad
        \gamma_k = eta_k \gamma_{k-1} + (1 - eta_k) \langle g_k, x_k 
angle, \
        	au_k = \min\left(lpha, rac{\left((1 + lpha\lambda)(ar f_k - f^* - \gamma_k)
            + \langle d_k, x_k 
angle
ight)_+}{\lVert d_k 
Vert^2}
ight), \quad
        u_k = -	au_k d_k - rac{lpha\lambda}{1 + lpha\lambda} x_k

    Args:
      learning_rate: :math:`lpha`, the largest step (rather large, 1 by default), a number or a schedule.
      beta: the momentum :math:`eta`.
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
        gamma = bt * state.gamma + (1 - bt) * _vdot(g, x)
        sq_norm, iprod = _sum_sq(d), _vdot(d, x)
        alpha = _scheduled(learning_rate, state.count, updates)
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
    Adam's moments :math:`d_k, v_k`, :math:`D_k = \epsilon + \sqrt{v_k / (1 - eta_2^{k})}` and
    :math:`c_k = 1 - eta_1^{k}`:

    .. math::
        	au_k = \min\left(rac{lpha}{c_k}, rac{\left((1 + lpha\lambda)(ar f_k - c_k f^* - \gamma_k)
            + \langle d_k, x_k 
angle
ight)_+}{\langle d_k, d_k / D_k 
angle}
ight), \quad
        u_k = -	au_k rac{d_k}{D_k} - rac{lpha\lambda}{1 + lpha\lambda} x_k

    with :math:`ar f_k, \gamma_k` moving averages (decay :math:`eta_1`) of the loss and of
    :math:`\langle g_k, x_k 
angle`.

    Args:
      learning_rate: :math:`lpha`, a number or a schedule.
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
        gamma = b1 * state.gamma + (1 - b1) * _vdot(g, x)
        d = tree.lerp_(d, g, 1 - b1)
        v = tree.addcmul_(tree.scale_(v, b2), g, g, 1 - b2)
        bc1, bc2 = bias_correction(b1, count), bias_correction(b2, count)
        g = tree.add_(tree.sqrt_(tree.div_(tree.copy_(g, v), bc2)), eps)  # Adam's denominator D, in g's buffer
        with tree.functional():
            dw = tree.div_(d, g)  # d / D
        sq_norm, iprod = _vdot(d, dw), _vdot(d, x)
        alpha = _scheduled(learning_rate, state.count, updates)
        tau, lb = _polyak_step(1 + alpha * weight_decay, barf, gamma, state.lb, iprod, sq_norm, alpha, bc1,
                               lower_bound, adapt_lower_bound)
        g = _decayed_step_(tree.copy_(g, dw), tau, x, alpha, weight_decay)
        return tree.put(updates, updates, g), MomoAdamState(
            tree.put(state.exp_avg, updates, d), tree.put(state.exp_avg_sq, updates, v), barf.to(state.barf.dtype),
            gamma.to(state.gamma.dtype), lb.to(state.lb.dtype), count)

    return GradientTransformation(init_fn, update_fn)


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
    ``num_betas`` decays :math:`eta_j = 1 - 10^{-j}`. With :math:`g_t` the gradient plus a weight decay
    :math:`\lambda S_{t-1} \lVert g_t 
Vert / (\lVert x_t 
Vert + \epsilon)\, x_t` and
    :math:`h_t = \langle g_t, \Delta_{t-1} 
angle`:

    .. math::
        m_j = \max(eta_j m_j, |h_t| + \epsilon), \quad v_j = eta_j^2 v_j + h_t^2, \quad
        r_j = eta_j r_j + \mathrm{clip}(h_t, \pm m_j^{old})\, s_j, \quad
        s_j = rac{rac{s_{init}}{n} m_j + \max(r_j, 0)}{\sqrt{v_j} + \epsilon}

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
        h = _vdot(g, delta).to(state.m.dtype)
        delta = tree.add_(delta, u, -1.0)
        n = state.s.shape[0]  # num_betas, as a shape (no host read of an injected tensor)
        betas = torch.tensor([1.0 - 0.1 ** j for j in range(1, n + 1)], dtype=state.s.dtype,
                             device=state.s.device)
        clipped_h = torch.minimum(torch.maximum(h, -state.m), state.m)
        m = torch.maximum(betas * state.m, h.abs() + eps)
        v = betas ** 2 * state.v + h ** 2
        r = betas * state.r + clipped_h * state.s
        s = ((s_init / n) * m + torch.clamp_min(r, 0.0)) / (_safe_sqrt(v) + eps)  # v = 0 at first
        u = tree.add_(tree.add_(tree.copy_(u, x0), delta, -s.sum()), x, -1.0)  # x0 - S Delta - x
        return tree.put(base_updates, base_updates, u), MechanicState(
            base_state, safe_increment_(state.count), r, m, v, s, tree.put(state.x0, base_updates, x0))

    return with_traits(GradientTransformation(init_fn, update_fn), elementwise=False)


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

    The learning rate is :math:`d_k \eta_k \sqrt{1 - eta_2^{k}} / (1 - eta_1^{k})` with :math:`\eta_k`
    the schedule (1 at its peak) and :math:`d_k` a lower estimate of the distance to the solution, grown
    from ``estim_lr0``:

    .. math::
        \lambda_k = d_k \eta_k rac{\sqrt{1 - eta_2^{k}}}{1 - eta_1^{k}}, \quad
        m_k = eta_1 m_{k-1} + (1 - eta_1) \lambda_k g_k, \quad
        v_k = eta_2 v_{k-1} + (1 - eta_2) g_k^2, \
        r_k = \sqrt{eta_2}\, r_{k-1} + (1 - \sqrt{eta_2}) \lambda_k
            \left\langle g_k, rac{s_{k-1}}{\sqrt{v_{k-1}} + \epsilon} 
ight
angle, \quad
        s_k = \sqrt{eta_2}\, s_{k-1} + (1 - \sqrt{eta_2}) \lambda_k g_k, \
        d_{k+1} = \max\left(d_k, rac{r_k}{(1 - \sqrt{eta_2}) \lVert s_k 
Vert_1}
ight), \quad
        u_k = -rac{m_k}{\sqrt{v_k} + \epsilon} - \lambda_k w\, x_k

    Args:
      learning_rate: :math:`\eta`, a schedule with 1 as its peak (e.g. a linear decay from 1 to 0 after a
        warmup), or a number.
      betas: Adam's :math:`(eta_1, eta_2)`.
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
        sched = _scheduled(learning_rate, state.count, updates)
        count = state.count + 1
        bc = bias_correction(beta2, count) ** 0.5 / bias_correction(beta1, count)
        dlr = (state.estim_lr * sched * bc).to(state.numerator_weighted.dtype)
        g, m, v, sk, x = tree.align(updates, state.exp_avg, state.exp_avg_sq, state.grad_sum, params)
        with tree.functional():  # s / (sqrt(v) + eps) with the previous s and v
            weighted = tree.div_(sk, tree.add_(tree.sqrt_(v), eps))
        numerator = _vdot(g, weighted)
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


class SplitRealAndImaginaryArrays(NamedTuple):
    """A complex tensor as the pair of real tensors the inner transform of :func:`split_real_and_imaginary` sees."""

    real: torch.Tensor
    imaginary: torch.Tensor


class SplitRealAndImaginaryState(NamedTuple):
    """State of :func:`split_real_and_imaginary`: the inner transform's, built on the split params."""

    inner_state: Any


def _split(x: Any) -> Any:
    # Views: a donated inner update writing into them writes into the complex buffer.
    return SplitRealAndImaginaryArrays(x.real, x.imag) if isinstance(x, torch.Tensor) and x.is_complex() else x


def _merge(x: Any) -> Any:
    return torch.complex(x.real, x.imaginary) if isinstance(x, SplitRealAndImaginaryArrays) else x


def _map_split(fn: Callable, t: Any) -> Any:
    return optree.tree_map(fn, t, is_leaf=lambda x: isinstance(x, SplitRealAndImaginaryArrays), none_is_leaf=True,
                           namespace="fxtrain")


@transform(elementwise=None)
def split_real_and_imaginary(inner: GradientTransformation) -> GradientTransformation:
    r"""Runs ``inner`` on complex params as on pairs of real ones (Optax's ``contrib.split_real_and_imaginary``).

    Each complex leaf :math:`z = x + iy` of the updates and params becomes a
    :class:`SplitRealAndImaginaryArrays` ``(x, y)`` for ``inner``; its two real updates are merged back into
    one complex update. Real leaves pass unchanged. An optimizer then treats :math:`x` and :math:`y` as
    independent real params (Adam's second moment per part, not :math:`|g|^2`).

    PyTorch's gradient of a real loss with respect to a complex tensor is already the conjugate of JAX's
    (``z.grad`` points along the steepest ascent), so unlike with ``jax.grad`` no conjugation is needed
    before the update.

    Args:
      inner: the transform to run on the real pairs.

    Returns:
      A transform with state :class:`SplitRealAndImaginaryState`; elementwise if ``inner`` is.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.split_real_and_imaginary(fx.scale_by_adam())
        >>> z = torch.tensor([3.0 - 4.0j, 0.5 + 0.0j])
        >>> u, state = tx.update(z, tx.init(z), z)
        >>> [[round(v, 4) for v in pair] for pair in torch.view_as_real(u).tolist()]   # Adam's first step: signs
        [[1.0, -1.0], [1.0, 0.0]]

    References:
      Optax issue `#196 <https://github.com/google-deepmind/optax/issues/196>`_ (complex gradient conventions).
    """
    def init_fn(params):
        return SplitRealAndImaginaryState(inner.init(_map_split(_split, params)))

    def update_fn(updates, state, params=None):
        split_updates, split_params = _map_split(_split, updates), _map_split(_split, params)
        split_updates, inner_state = call_(inner, split_updates, state.inner_state, split_params)
        return _map_split(_merge, split_updates), SplitRealAndImaginaryState(inner_state)

    return with_traits(GradientTransformation(init_fn, update_fn), elementwise=is_elementwise(inner))
