"""Sign-based methods: ``scale_by_sign``, ``sign_sgd``, ``signum``, ``scale_by_rprop``, ``rprop`` (Optax's)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, Updates, chain, check_learning_rate, check_nonnegative, transform

from fxtrain.transforms._moments import LearningRate, Scalar, full_like
from fxtrain.transforms._scaling import scale, scale_by_learning_rate
from fxtrain.transforms._simple import ema

__all__ = ["ScaleByRpropState", "rprop", "scale_by_rprop", "scale_by_sign", "sign_sgd", "signum"]

@transform(elementwise=True)
def scale_by_sign() -> GradientTransformation:
    r"""Replaces each update by its sign (Optax's ``scale_by_sign``).

    .. math:: u_t = \operatorname{sign}(g_t) \in \{-1, 0, 1\}

    Returns:
      A stateless transform (``EmptyState``).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_sign()
        >>> u, _ = tx.update({"w": torch.tensor([0.3, -2.0, 0.0])}, tx.init(None))
        >>> u["w"].tolist()
        [1.0, -1.0, 0.0]

    References:
      Bernstein et al., `signSGD: Compressed Optimisation for Non-Convex Problems
      <https://arxiv.org/abs/1802.04434>`_, 2018.
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        (g,) = tree.align(updates)
        return tree.put(updates, updates, tree.sign_(g)), state

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def sign_sgd(learning_rate: LearningRate) -> GradientTransformation:
    r"""SGD on the signs of the gradient's components (Optax's ``sign_sgd``).

    .. math:: \theta_{t+1} = \theta_t - \eta_t \operatorname{sign}(g_t)

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.

    Returns:
      ``chain(scale_by_sign(), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.sign_sgd(0.1)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> u, _ = tx.update({"w": torch.tensor([5.0, -0.01])}, tx.init(params), params)
        >>> u["w"].tolist()
        [-0.1..., 0.1...]

    References:
      Bernstein et al., `signSGD: Compressed Optimisation for Non-Convex Problems
      <https://arxiv.org/abs/1802.04434>`_, 2018.
    """
    check_learning_rate("sign_sgd", learning_rate=learning_rate)
    return chain(scale_by_sign(), scale_by_learning_rate(learning_rate))


@transform(elementwise=None)
def signum(learning_rate: LearningRate, beta: Scalar = 0.9,
           accumulator_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    r"""SGD on the signs of a moving average of the gradients (Optax's ``signum``).

    .. math:: m_t = \beta m_{t-1} + (1 - \beta) g_t, \qquad \theta_{t+1} = \theta_t - \eta_t \operatorname{sign}(m_t)

    The average is not debiased: its sign does not change.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      beta: :math:`\beta`, the decay of the moving average.
      accumulator_dtype: dtype of the moving average; ``None``: the param dtype.

    Returns:
      ``chain(ema(beta, debias=False, accumulator_dtype), scale_by_sign(), scale_by_learning_rate(learning_rate))``
      (Optax's state: ``(EmaState(count, ema), EmptyState(), EmptyState())``).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.signum(0.1)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> u, state = tx.update({"w": torch.tensor([5.0, -0.01])}, tx.init(params), params)
        >>> u["w"].tolist(), state[0].ema["w"].tolist()
        ([-0.1..., 0.1...], [0.5, -0.001...])

    References:
      Bernstein et al., `signSGD: Compressed Optimisation for Non-Convex Problems
      <https://arxiv.org/abs/1802.04434>`_, 2018.
    """
    check_learning_rate("signum", learning_rate=learning_rate, beta=beta)
    return chain(ema(beta, debias=False, accumulator_dtype=accumulator_dtype), scale_by_sign(),
                 scale_by_learning_rate(learning_rate))


class ScaleByRpropState(NamedTuple):
    """State of :func:`scale_by_rprop` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_rprop(0.1).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByRpropState), state._fields
        (True, ('step_sizes', 'prev_updates'))
    """

    step_sizes: Updates  # per-element step sizes
    prev_updates: Updates  # the last update (0 where the gradient changed sign)


@transform(elementwise=True)
def scale_by_rprop(learning_rate: Scalar, eta_minus: Scalar = 0.5, eta_plus: Scalar = 1.2,
                   min_step_size: Scalar = 1e-6, max_step_size: Scalar = 50.0) -> GradientTransformation:
    r"""Resilient backpropagation: per-element step sizes adapted to sign changes (Optax's ``scale_by_rprop``).

    With :math:`s = g_t\, u_{t-1}` per element:

    .. math::
        \delta_t = \begin{cases} \operatorname{clip}(\eta_+ \delta_{t-1}) & s > 0 \\
        \operatorname{clip}(\eta_- \delta_{t-1}) & s < 0 \\ \delta_{t-1} & s = 0 \end{cases}, \qquad
        u_t = \begin{cases} 0 & s < 0 \\ \delta_t \operatorname{sign}(g_t) & \text{otherwise} \end{cases}

    clipping to ``[min_step_size, max_step_size]``. As in Optax, the update returned at step :math:`t` is
    :math:`u_{t-1}` (0 at the first step, and where the sign flipped): the step is stored and applied on
    the next call. It is a step to *add* (see :func:`rprop`).

    Args:
      learning_rate: the initial step size :math:`\delta_0`.
      eta_minus: factor of the step size after a sign change.
      eta_plus: factor of the step size when the sign is kept.
      min_step_size: smallest step size after an adaptation.
      max_step_size: largest step size after an adaptation.

    Returns:
      A transform with state :class:`ScaleByRpropState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_rprop(0.1)
        >>> g = {"w": torch.tensor([1.0, -1.0])}
        >>> state = tx.init(g)
        >>> u, state = tx.update(g, state)
        >>> u, state = tx.update({"w": torch.tensor([2.0, 3.0])}, state)   # kept sign, then a flip
        >>> u["w"].tolist(), state.step_sizes["w"].tolist()   # the first step now, none where it flipped
        ([0.1..., 0.0], [0.12..., 0.05...])

    References:
      Riedmiller and Braun, `A Direct Adaptive Method for Faster Backpropagation Learning: The RPROP
      Algorithm <https://ieeexplore.ieee.org/document/298623>`_, 1993.
    """
    _no_schedule("scale_by_rprop", learning_rate)
    check_nonnegative("scale_by_rprop", learning_rate=learning_rate, eta_minus=eta_minus, eta_plus=eta_plus,
                      min_step_size=min_step_size, max_step_size=max_step_size)

    def init_fn(params):
        return ScaleByRpropState(step_sizes=full_like(params, learning_rate), prev_updates=tree.zeros_like(params))

    def adapt(g, prev, step):
        """One leaf: (step sizes, the step to store, the update), new tensors."""
        s = g * prev
        grown = step * torch.where(s > 0, eta_plus, eta_minus)
        step = torch.where(s == 0, step, grown.clamp(min_step_size, max_step_size)).to(step.dtype)
        flipped = s < 0
        return step, torch.where(flipped, 0.0, step * torch.sign(g)), torch.where(flipped, 0.0, prev)

    def update_fn(updates, state, params=None):
        del params
        g, step, prev = tree.align(updates, state.step_sizes, state.prev_updates)
        # torch has no foreach where: one small chain of kernels per leaf
        new = [adapt(*leaf) for leaf in zip(g, prev, step)]
        g = tree.copy_(g, [u for _, _, u in new])  # Optax applies the step stored last time (see above)
        step = tree.copy_(step, [s for s, _, _ in new])
        prev = tree.copy_(prev, [p for _, p, _ in new])
        return tree.put(updates, updates, g), ScaleByRpropState(tree.put(state.step_sizes, updates, step),
                                                                tree.put(state.prev_updates, updates, prev))

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def rprop(learning_rate: Scalar, eta_minus: Scalar = 0.5, eta_plus: Scalar = 1.2, min_step_size: Scalar = 1e-6,
          max_step_size: Scalar = 50.0) -> GradientTransformation:
    r"""Rprop: per-element step sizes grown while the gradient's sign holds, shrunk when it flips (Optax's).

    .. math:: \theta_{t+1} = \theta_t - u_t, \qquad u_t \text{ from } :func:`scale_by_rprop`

    Meant for full-batch training: sign flips of noisy minibatch gradients shrink every step size.

    Args:
      learning_rate: the initial step size (a number or a 0-dim tensor; a schedule is refused: Optax's rprop
        takes a float, the step sizes adapt by themselves).
      eta_minus: factor of the step size after a sign change.
      eta_plus: factor of the step size when the sign is kept.
      min_step_size: smallest step size.
      max_step_size: largest step size.

    Returns:
      ``chain(scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size), scale(-1.0))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.rprop(0.1)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> u, _ = tx.update({"w": torch.tensor([5.0, -0.01])}, tx.init(params), params)
        >>> u["w"].tolist()
        [-0.1..., 0.1...]

    References:
      Riedmiller and Braun, `A Direct Adaptive Method for Faster Backpropagation Learning: The RPROP
      Algorithm <https://ieeexplore.ieee.org/document/298623>`_, 1993.
    """
    _no_schedule("rprop", learning_rate)
    check_learning_rate("rprop", learning_rate=learning_rate)
    return chain(scale_by_rprop(learning_rate, eta_minus, eta_plus, min_step_size, max_step_size), scale(-1.0))


def _no_schedule(owner: str, learning_rate: object) -> None:
    """Optax's rprop takes a number: ``learning_rate`` is the initial step size of each element, read once."""
    if callable(learning_rate):
        raise ValueError(f"{owner}: learning_rate must be a number or a 0-dim tensor (the initial step size; "
                         f"a schedule is not supported, as in Optax), got {learning_rate!r}")
