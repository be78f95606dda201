"""Schedule-Free learning: ``schedule_free`` wraps an optimizer without momentum (Optax's contrib)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import (forwarded, GradientTransformation, Params, call_, chain, check_needs_params, check_nonnegative,
                           is_elementwise, transform, with_traits)
from fxtrain.optimizers import sgd
from fxtrain.schedules import linear_schedule
from fxtrain.transforms._moments import (Scalar, as_dtype, mixed_dtypes, param_device, safe_increment_,
                                        scalar_dtype)
from fxtrain.transforms._rms import scale_by_rms
from fxtrain.transforms._scaling import scale_by_learning_rate
from fxtrain.transforms._weight_decay import add_decayed_weights

__all__ = ["ScheduleFreeState", "schedule_free", "schedule_free_eval_params", "schedule_free_sgd",
           "schedule_free_adamw"]

LearningRate = Scalar | Callable


class ScheduleFreeState(NamedTuple):
    """State of :func:`schedule_free` (Optax's field names and order)."""

    b1: torch.Tensor  # 0-dim, the interpolation weight b1 (read by schedule_free_eval_params)
    weight_sum: torch.Tensor  # 0-dim: sum of the averaging weights max_lr ** weight_lr_power so far
    step_count: torch.Tensor  # 0-dim int32, starts at 1: the schedule is called with it
    max_lr: torch.Tensor  # 0-dim: the largest learning rate seen so far
    base_optimizer_state: Any
    z: Params  # the base optimizer's iterates, in state_dtype (default: the param dtype)


def schedule_free_eval_params(state: ScheduleFreeState, params: Params) -> Params:
    r"""The params to evaluate a :func:`schedule_free` model at: the averaged sequence :math:`x`.

    .. math:: x = \frac{y - (1 - \beta_1) z}{\beta_1}

    with :math:`y` the params being trained (where gradients are taken) and :math:`z` from ``state``.

    Args:
      state: the :class:`ScheduleFreeState` of a ``schedule_free`` transform (of ``schedule_free_sgd``...).
      params: the current params :math:`y`.

    Returns:
      A tree like ``params`` (``None`` leaves stay ``None``), in the params' dtypes.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.schedule_free_sgd(0.5)
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> state = tx.init(params)
        >>> u, state = tx.update({"w": torch.tensor([1.0, 1.0])}, state, params)
        >>> params = fx.apply_updates(params, u)
        >>> fx.contrib.schedule_free_eval_params(state, params)["w"].tolist()   # x_1 = z_1 = w - 0.5 g
        [0.5, 1.5]

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, 2024.
    """
    b1, z = getattr(state, "b1", None), getattr(state, "z", None)
    if b1 is None or z is None:
        raise ValueError(f"schedule_free_eval_params needs the ScheduleFreeState of a schedule_free transform, "
                         f"got {type(state).__name__}")
    return tree.map(lambda y, zi: ((y - (1 - b1) * zi) / b1).to(y.dtype), params, z)


@transform(elementwise=None, extra_args=True)
def schedule_free(base_optimizer: GradientTransformation, learning_rate: LearningRate, b1: Scalar = 0.9,
                  weight_lr_power: Scalar = 2.0, state_dtype: torch.dtype | str | None = None
                  ) -> GradientTransformation:
    r"""Makes ``base_optimizer`` schedule-free: interpolation and averaging replace its momentum (Optax's).

    With :math:`u_t` the base optimizer's update at the params :math:`y_t` (for SGD, :math:`-\gamma
    \nabla f(y_t)`), :math:`\eta_t` the learning rate and :math:`c_t` the averaging weight:

    .. math::
        z_{t+1} = z_t + u_t, \qquad
        x_{t+1} = (1 - c_t)\, x_t + c_t\, z_{t+1}, \qquad
        y_{t+1} = \beta_1 x_{t+1} + (1 - \beta_1)\, z_{t+1}, \\
        c_t = \frac{w_t}{\sum_{s \le t} w_s}, \qquad w_t = (\max_{s \le t} \eta_s)^{p}.

    The update returned is :math:`y_{t+1} - y_t`; :math:`x_t` is recomputed from :math:`y_t` and
    :math:`z_t` (so another transform may modify :math:`y`). Evaluate the model at :math:`x`
    (:func:`schedule_free_eval_params`). Switch the base optimizer's momentum off (``b1=0`` for Adam):
    :math:`\beta_1` here plays its part. A learning-rate schedule is called with the step count, which
    starts at 1; with zero learning rates the weights are 0 and :math:`c_t = 0`.

    Args:
      base_optimizer: the optimizer giving :math:`u_t` (without momentum). Extra arguments (``value=``...)
        passed to ``update`` reach it.
      learning_rate: the base optimizer's learning rate or schedule (with warmup, without decay): it sets
        the averaging weights.
      b1: :math:`\beta_1`, the interpolation weight; must be positive.
      weight_lr_power: :math:`p`: down-weights the average during warmup.
      state_dtype: dtype of :math:`z` (a ``torch.dtype`` or its name); ``None``: the params' dtype.

    Returns:
      A transform with state :class:`ScheduleFreeState`; it needs ``params`` at update. Elementwise if
      ``base_optimizer`` is.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.schedule_free(fx.sgd(0.1), learning_rate=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> u, state = tx.update({"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
        >>> u["w"].tolist(), int(state.step_count)   # y_1 = 0.9 x_1 + 0.1 z_1 = z_1
        ([-0.1..., 0.1...], 2)

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, 2024.
    """
    check_nonnegative("schedule_free", b1=b1, weight_lr_power=weight_lr_power)
    if not callable(learning_rate):
        check_nonnegative("schedule_free", learning_rate=learning_rate)
    if isinstance(b1, (int, float)) and b1 == 0:
        raise ValueError("schedule_free: b1=0 divides by zero in the average; use b1 > 0 (0.9 by default)")
    state_dtype = as_dtype(state_dtype, "schedule_free: state_dtype")

    def init_fn(params):
        dtype, device = scalar_dtype(params), param_device(params)
        # z is a copy: a donated update writes into it, never into the params.
        z = tree.map(lambda p: p.to(state_dtype or p.dtype, copy=True), params)
        return ScheduleFreeState(
            b1=torch.as_tensor(b1, dtype=dtype, device=device).clone(),
            weight_sum=torch.zeros((), dtype=dtype, device=device),
            step_count=torch.ones((), dtype=torch.int32, device=device),
            max_lr=torch.zeros((), dtype=dtype, device=device),
            base_optimizer_state=base_optimizer.init(params), z=z)

    def update_fn(updates, state, params=None, **extra_args):
        check_needs_params("schedule_free", params)
        lr = learning_rate(state.step_count) if callable(learning_rate) else learning_rate
        max_lr = torch.maximum(state.max_lr, torch.as_tensor(lr, dtype=state.max_lr.dtype,
                                                              device=state.max_lr.device))
        weight = max_lr ** weight_lr_power
        weight_sum = state.weight_sum + weight
        # c = weight / weight_sum, 0 while both are 0 (zero learning rates); NaN stays NaN.
        ck = torch.where(weight.isnan() | weight_sum.isnan(), torch.nan,
                         torch.nan_to_num(weight / weight_sum, nan=0.0, posinf=torch.inf))
        base_updates, base_state = call_(base_optimizer, updates, state.base_optimizer_state, params, extra_args)
        u, z, y = tree.align(base_updates, state.z, params)
        with tree.functional():  # x_t = (y_t - (1 - b1) z_t) / b1: a new buffer, promoted like Optax's
            x = [yi.to(torch.promote_types(yi.dtype, zi.dtype)) for yi, zi in zip(y, z)]
            x = tree.div_(tree.add_(x, z, -(1 - b1)), b1)
        z = tree.add_(z, u)  # z_{t+1}, in z's dtype
        zx = [zi.to(xi.dtype) for zi, xi in zip(z, x)] if mixed_dtypes(z, x) else z  # promoted, as Optax's
        x = tree.lerp_(x, zx, ck)  # x_{t+1} = (1 - c) x_t + c z_{t+1}
        x = tree.lerp_(x, zx, 1 - b1)  # y_{t+1} = b1 x_{t+1} + (1 - b1) z_{t+1}
        x = tree.add_(x, y, -1.0)  # the update y_{t+1} - y_t
        u = tree.copy_(u, x)
        return tree.put(base_updates, base_updates, u), ScheduleFreeState(
            b1=state.b1, weight_sum=weight_sum, step_count=safe_increment_(state.step_count), max_lr=max_lr,
            base_optimizer_state=base_state, z=tree.put(state.z, base_updates, z))

    return with_traits(GradientTransformation(init_fn, update_fn), elementwise=is_elementwise(base_optimizer),
                       **forwarded(base_optimizer))


def _warmup(learning_rate: Scalar, warmup_steps: int | None) -> LearningRate:
    """Optax's ``warmup_constant_schedule(0, learning_rate, warmup_steps)``, or ``learning_rate`` itself."""
    if warmup_steps is None:
        return learning_rate
    if isinstance(warmup_steps, torch.Tensor):  # inject_hyperparams' 0-dim int tensor: the same ramp on device
        return lambda count: learning_rate * torch.where(
            warmup_steps > 0, torch.minimum(count, warmup_steps) / warmup_steps.clamp_min(1), 1.0)
    return linear_schedule(init_value=0.0, end_value=learning_rate, transition_steps=warmup_steps)


@transform(elementwise=None)
def schedule_free_sgd(learning_rate: Scalar = 1.0, warmup_steps: int | None = None, b1: Scalar = 0.9,
                      weight_decay: Scalar | None = None, weight_lr_power: Scalar = 2.0,
                      state_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    r"""Schedule-Free SGD: :func:`schedule_free` around plain SGD (Optax's ``schedule_free_sgd``).

    .. math:: u_t = -\eta_t\, (\nabla f(y_t) + \lambda y_t)

    then :func:`schedule_free`'s interpolation and averaging.

    Args:
      learning_rate: :math:`\eta`, the peak learning rate.
      warmup_steps: length of a linear warmup from 0 to ``learning_rate``; ``None``: no warmup.
      b1: :math:`\beta_1` of :func:`schedule_free` (positive).
      weight_decay: :math:`\lambda`, multiplied by the learning rate (as in PyTorch); ``None``: none.
      weight_lr_power: the power of the learning rate in the averaging weights.
      state_dtype: dtype of :math:`z`; ``None``: the params' dtype.

    Returns:
      ``schedule_free(chain(add_decayed_weights(weight_decay), sgd(lr)) or sgd(lr), lr, ...)``; evaluate
      with :func:`schedule_free_eval_params`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.schedule_free_sgd()
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(3):   # f(w) = |w|^2 at the evaluation params (Optax's example)
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        ...     print(f"{float((fx.contrib.schedule_free_eval_params(state, params) ** 2).sum()):.2f}")
        14.00
        0.00
        1.00

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, 2024.
    """
    check_nonnegative("schedule_free_sgd", learning_rate=learning_rate, b1=b1, weight_decay=weight_decay)
    lr = _warmup(learning_rate, warmup_steps)
    optimizer = sgd(lr)
    if weight_decay is not None:
        optimizer = chain(add_decayed_weights(weight_decay), optimizer)
    return schedule_free(optimizer, learning_rate=lr, b1=b1, weight_lr_power=weight_lr_power,
                         state_dtype=state_dtype)


@transform(elementwise=None)
def schedule_free_adamw(learning_rate: Scalar = 0.0025, warmup_steps: int | None = None, b1: Scalar = 0.9,
                        b2: Scalar = 0.999, eps: Scalar = 1e-8, weight_decay: Scalar = 0.0,
                        weight_lr_power: Scalar = 2.0, state_dtype: torch.dtype | str | None = None
                        ) -> GradientTransformation:
    r"""Schedule-Free AdamW: :func:`schedule_free` around AdamW without momentum (Optax's).

    .. math::
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \qquad
        u_t = -\eta_t \left(\frac{g_t}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} + \lambda y_t\right)

    then :func:`schedule_free`'s interpolation and averaging (:math:`\beta_1` = ``b1``). Adam with
    ``b1=0`` is ``scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True)``: no zero first moment
    is stored.

    Args:
      learning_rate: :math:`\eta`, the peak learning rate.
      warmup_steps: length of a linear warmup from 0 to ``learning_rate``; ``None``: no warmup.
      b1: :math:`\beta_1` of :func:`schedule_free` (positive).
      b2: decay of the second moment.
      eps: added to the denominator outside the square root.
      weight_decay: :math:`\lambda` (decoupled, multiplied by the learning rate).
      weight_lr_power: the power of the learning rate in the averaging weights.
      state_dtype: dtype of :math:`z`; ``None``: the params' dtype.

    Returns:
      ``schedule_free(chain(scale_by_rms(...), add_decayed_weights(weight_decay),
      scale_by_learning_rate(lr)), lr, ...)``; evaluate with :func:`schedule_free_eval_params`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.schedule_free_adamw(1.0)
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(5):
        ...     u, state = tx.update(2 * params, state, params)
        ...     params = fx.apply_updates(params, u)
        >>> round(float((fx.contrib.schedule_free_eval_params(state, params) ** 2).sum()), 2)   # from 14
        0.41

    References:
      Defazio et al., `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, 2024.
    """
    check_nonnegative("schedule_free_adamw", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                      weight_decay=weight_decay)
    lr = _warmup(learning_rate, warmup_steps)
    optimizer = chain(scale_by_rms(decay=b2, eps=eps, eps_in_sqrt=False, bias_correction=True),
                      add_decayed_weights(weight_decay), scale_by_learning_rate(lr))
    return schedule_free(optimizer, learning_rate=lr, b1=b1, weight_lr_power=weight_lr_power,
                         state_dtype=state_dtype)
