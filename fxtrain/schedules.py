"""Schedules: a step count in, a hyperparameter value out (Optax's names, arguments, defaults and math).

A schedule is a callable object with a readable ``repr``. It takes a Python int or an integer tensor
(the ``count`` kept in a transform's state) and returns a float32 tensor of the same shape on the same
device, computed with tensor ops only: no host sync, no Python branch on the count, so it runs inside a
compiled or CUDA-graphed step. The float32 operations follow Optax's order, so values agree with Optax
to the last bit or two. ``schedule(count, dtype=torch.float64)`` computes in float64 instead: the
transforms evaluate their schedules through :func:`value_at` in the dtype of the updates, so a float64
run keeps float64 hyperparameters (as Optax under JAX's x64).

Arguments are checked where the schedule is built, and errors name the schedule and the argument
(``decay_step is not an argument of cosine_decay_schedule``), which is what a Hydra config needs.

Example:
    >>> import fxtrain as fx
    >>> s = fx.warmup_cosine_decay_schedule(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=6)
    >>> s
    warmup_cosine_decay_schedule(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=6)
    >>> [round(float(s(t)), 4) for t in range(8)]
    [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from fxtrain._base import describe

Count = int | torch.Tensor
Value = float | torch.Tensor

__all__ = [
    "Schedule", "constant_schedule", "polynomial_schedule", "linear_schedule", "cosine_decay_schedule",
    "warmup_cosine_decay_schedule", "sgdr_schedule", "exponential_decay", "piecewise_constant_schedule",
    "piecewise_interpolate_schedule", "linear_onecycle_schedule", "cosine_onecycle_schedule", "join_schedules",
    "value_at",
]


class Schedule:
    """A step count -> value function with a readable ``repr`` (what every factory here returns).

    Calling it with a Python int or an integer tensor of any shape gives a float32 tensor of that shape,
    on the count's device. Tensor arguments (``init_value``, ``peak_value``...) stay in the computation:
    the value is differentiable with respect to them and batches under ``torch.func.vmap``.
    """

    __slots__ = ("fn", "_label")


    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], label: str | Callable[[], str]):
        self.fn, self._label = fn, label

    @property
    def label(self) -> str:
        # Built on demand: the repr of a tensor argument reads its value, which a vmapped tensor has not.
        if callable(self._label):
            self._label = self._label()
        return self._label

    def __call__(self, count: Count, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The value at ``count``, computed in ``dtype`` (``None``: the enclosing schedule's, float32 at the top)."""
        if dtype is None:
            return _as_value(self.fn(_as_count(count, self)))
        before = _float()
        _PRECISION.dtype = dtype
        try:
            return _as_value(self.fn(_as_count(count, self)))
        finally:
            _PRECISION.dtype = before

    def __repr__(self) -> str:
        return self.label


# --- argument binding and checks ------------------------------------------------------------------

def bind(owner: str, fn_name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``sig.bind(*args, **kwargs)`` with errors that name ``owner``, the bad argument and the valid ones.

    Shared with :func:`fxtrain.inject_hyperparams`, whose arguments usually come from a config file.
    """
    params = sig.parameters
    valid = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for k in kwargs:
        if k not in params and not takes_any:
            close = difflib.get_close_matches(k, valid, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TypeError(f"{owner}: {k} is not an argument of {fn_name}{hint}; "
                            f"its arguments are {', '.join(valid)}")
    try:
        return sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{owner}: {e} (the arguments of {fn_name} are {', '.join(valid)})") from None


def _schedule(factory: Callable) -> Callable[..., Schedule]:
    """Turns ``factory(**args) -> fn(count_tensor)`` into a public schedule factory with checked args."""
    sig = inspect.signature(factory)
    name = factory.__name__

    @functools.wraps(factory)
    def build(*args, **kwargs) -> Schedule:
        bound = bind(name, name, sig, args, kwargs)
        given = dict(bound.arguments)
        label = lambda: f"{name}({', '.join(f'{k}={describe(v)}' for k, v in given.items())})"
        bound.apply_defaults()
        return Schedule(factory(**bound.arguments), label)

    return build


def _value(owner: str, arg: str, v: Any, *, optional: bool = False) -> Value | None:
    """A numeric schedule argument: a Python number or a 0-dim real tensor."""
    if v is None and optional:
        return v
    if isinstance(v, torch.Tensor) and v.ndim == 0 and not v.is_complex() and v.dtype != torch.bool:
        return v
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        return float(v)
    raise TypeError(f"{owner}: {arg} must be a number or a 0-dim tensor, got {type(v).__name__} {v!r}")


def _steps(owner: str, arg: str, v: Any, *, minimum: int = 0) -> int:
    """A step-count argument: a Python int (an integral float such as 1e4 from a config is accepted)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise TypeError(f"{owner}: {arg} must be an integer number of steps, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{owner}: {arg}={v} must be >= {minimum}")
    return int(v)


def _as_count(count: Any, owner: Any) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        if count.dtype == torch.bool or count.is_complex():
            raise TypeError(f"{owner}: the step count must be an integer tensor, got dtype {count.dtype}")
        return count
    if isinstance(count, numbers.Real) and not isinstance(count, bool):
        return torch.tensor(count)
    raise TypeError(f"{owner}: the step count must be an int or an integer tensor, got {type(count).__name__}")


# The dtype schedules compute in while one is evaluated (Schedule.__call__'s dtype): float32, Optax's
# default, unless a float64 run asks for float64. Thread-local, as the op layer's mode in fxtrain/tree.py.
_PRECISION = threading.local()


def _float() -> torch.dtype:
    return getattr(_PRECISION, "dtype", torch.float32)


def _as_value(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.to(_float())
    return torch.tensor(float(v), dtype=_float())


def _full(count: torch.Tensor, value: Value) -> torch.Tensor:
    """``value`` (rounded to the schedule's dtype, float32 by default as Optax does) shaped and placed like
    ``count``.

    Out of place, so a tensor ``value`` stays differentiable and may be batched (``torch.func.vmap``).
    """
    if isinstance(value, torch.Tensor):
        value = value.to(_float())
    return torch.zeros(count.shape, dtype=_float(), device=count.device) + value


def value_at(schedule: Callable[[Count], Value], count: Count, dtype: torch.dtype) -> Value:
    """``schedule(count)`` for a transform whose updates are of (at least) ``dtype``.

    A :class:`Schedule` computes in ``dtype``; another callable is called as it is and a floating tensor
    it returns is cast to ``dtype`` (a Python number passes unchanged). Transforms pass the widest
    floating dtype of their updates, float32 at least: float32 and bfloat16 runs get Optax's float32
    values, a float64 run float64 ones.

    >>> import torch, fxtrain as fx
    >>> s = fx.linear_schedule(0.1, 0.0, 3)
    >>> from fxtrain.schedules import value_at
    >>> s(1).dtype, value_at(s, 1, torch.float64).dtype, float(value_at(s, 1, torch.float64))
    (torch.float32, torch.float64, 0.0666666666666666...)
    """
    if isinstance(schedule, Schedule):
        return schedule(count, dtype=dtype)
    v = schedule(count)
    return v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _is_negative(v: Value) -> bool:
    """``v < 0`` for a Python number; a tensor's value is never read (no host sync; vmap has none)."""
    return not isinstance(v, torch.Tensor) and v < 0


# --- schedules ------------------------------------------------------------------------------------

@_schedule
def constant_schedule(value: Value) -> Schedule:
    """Constant schedule: ``value`` at every step (Optax's ``constant_schedule``).

    Args:
      value: the value held throughout.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.constant_schedule(5)
    >>> s, float(s(0)), float(s(100))
    (constant_schedule(value=5), 5.0, 5.0)
    """
    value = _value("constant_schedule", "value", value)
    return lambda count: _full(count, value)


@_schedule
def polynomial_schedule(init_value: Value, end_value: Value, power: Value, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    r"""Polynomial transition from ``init_value`` to ``end_value`` (Optax's ``polynomial_schedule``).

    .. math::
      v(t) = (I - E) \left(1 - \mathrm{clip}\!\left(\frac{t - B}{T}, 0, 1\right)\right)^P + E

    with :math:`I` = ``init_value``, :math:`E` = ``end_value``, :math:`P` = ``power``,
    :math:`T` = ``transition_steps``, :math:`B` = ``transition_begin``. ``transition_steps=0`` holds
    ``init_value`` forever (as in Optax). Optax also reads a negative ``transition_steps`` as 0 and a
    negative ``transition_begin`` as 0 (with a log line); here both are errors.

    Args:
      init_value: value before and at ``transition_begin``.
      end_value: value from ``transition_begin + transition_steps`` on.
      power: exponent of the transition (1: linear, 2: quadratic...).
      transition_steps: length of the transition, >= 0.
      transition_begin: steps to hold ``init_value`` before the transition starts, >= 0.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.schedules.polynomial_schedule(init_value=1.0, end_value=0.0, power=2, transition_steps=4)
    >>> [float(s(t)) for t in (0, 1, 2, 4, 9)]
    [1.0, 0.5625, 0.25, 0.0, 0.0]
    """
    return _polynomial("polynomial_schedule", init_value, end_value, power, transition_steps, transition_begin)


def _polynomial(name: str, init_value: Value, end_value: Value, power: Value, transition_steps: int,
                transition_begin: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The one code path of :func:`polynomial_schedule` and :func:`linear_schedule` (``power=1``)."""
    init_value, end_value = _value(name, "init_value", init_value), _value(name, "end_value", end_value)
    power = _value(name, "power", power)
    transition_steps = _steps(name, "transition_steps", transition_steps)
    transition_begin = _steps(name, "transition_begin", transition_begin)
    if transition_steps == 0:
        return lambda count: _full(count, init_value)

    def fn(count):
        done = (count - transition_begin).clamp(0, transition_steps)
        frac = 1 - done.to(_float()) / transition_steps
        return (init_value - end_value) * frac ** power + end_value

    return fn


@_schedule
def linear_schedule(init_value: Value, end_value: Value, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    r"""Linear transition from ``init_value`` to ``end_value`` (Optax's ``linear_schedule``).

    :func:`polynomial_schedule` with ``power=1``:

    .. math::
      v(t) = I + (E - I) \, \mathrm{clip}\!\left(\frac{t - B}{T}, 0, 1\right)

    with :math:`I` = ``init_value``, :math:`E` = ``end_value``, :math:`T` = ``transition_steps``,
    :math:`B` = ``transition_begin``. ``transition_steps=0`` holds ``init_value`` forever (as in Optax).

    Args:
      init_value: value before and at ``transition_begin``.
      end_value: value from ``transition_begin + transition_steps`` on.
      transition_steps: length of the transition, >= 0.
      transition_begin: steps to hold ``init_value`` before the transition starts, >= 0.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.linear_schedule(init_value=1.0, end_value=0.0, transition_steps=4)
    >>> [float(s(t)) for t in (0, 1, 4, 9)]
    [1.0, 0.75, 0.0, 0.0]
    """
    return _polynomial("linear_schedule", init_value, end_value, 1.0, transition_steps, transition_begin)


@_schedule
def cosine_decay_schedule(init_value: Value, decay_steps: int, alpha: Value = 0.0,
                          exponent: Value = 1.0) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value`` (Optax's ``cosine_decay_schedule``).

    .. math::
      v(t) = I \left[(1 - \alpha) \left(\tfrac12 \left(1 + \cos\frac{\pi \min(t, T)}{T}\right)\right)^p
             + \alpha\right]

    with :math:`I` = ``init_value``, :math:`T` = ``decay_steps``, :math:`p` = ``exponent``.

    Args:
      init_value: value at step 0.
      decay_steps: steps over which to decay, > 0.
      alpha: the final value as a fraction of ``init_value``.
      exponent: power applied to the cosine factor.

    Returns:
      A :class:`Schedule`.

    References:
      Loshchilov & Hutter, `SGDR: Stochastic Gradient Descent with Warm Restarts
      <https://arxiv.org/abs/1608.03983>`_, 2017.

    >>> import fxtrain as fx
    >>> s = fx.cosine_decay_schedule(init_value=1.0, decay_steps=4, alpha=0.1)
    >>> [round(float(s(t)), 4) for t in (0, 2, 4, 8)]
    [1.0, 0.55, 0.1, 0.1]
    """
    name = "cosine_decay_schedule"
    init_value = _value(name, "init_value", init_value)
    alpha, exponent = _value(name, "alpha", alpha), _value(name, "exponent", exponent)
    decay_steps = _steps(name, "decay_steps", decay_steps, minimum=1)

    def fn(count):
        t = count.to(_float()).clamp(max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine ** exponent + alpha)

    return fn


@_schedule
def warmup_cosine_decay_schedule(init_value: Value, peak_value: Value, warmup_steps: int, decay_steps: int,
                                 end_value: Value = 0.0, exponent: Value = 1.0) -> Schedule:
    r"""Linear warmup to ``peak_value``, then cosine decay to ``end_value`` (Optax's schedule of that name).

    .. math::
      v(t) = \begin{cases}
        I + (P - I)\, t / W & t < W \\
        \mathrm{cosine\_decay}(P, D - W, \alpha = E / P, p)(t - W) & t \ge W
      \end{cases}

    with :math:`W` = ``warmup_steps`` and :math:`D` = ``decay_steps``, the total length *including*
    the warmup.

    Args:
      init_value: value at step 0.
      peak_value: value at the end of the warmup.
      warmup_steps: length of the linear warmup, >= 0.
      decay_steps: total length of the schedule, > ``warmup_steps``.
      end_value: value from ``decay_steps`` on.
      exponent: power applied to the cosine factor.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=4, end_value=0.5)
    >>> [float(s(t)) for t in (0, 1, 2, 3, 4, 5)]
    [0.0, 0.5, 1.0, 0.75, 0.5, 0.5]
    """
    name = "warmup_cosine_decay_schedule"
    init_value, peak_value = _value(name, "init_value", init_value), _value(name, "peak_value", peak_value)
    end_value, exponent = _value(name, "end_value", end_value), _value(name, "exponent", exponent)
    warmup_steps = _steps(name, "warmup_steps", warmup_steps)
    decay_steps = _steps(name, "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(f"{name}: decay_steps={decay_steps} must be greater than warmup_steps={warmup_steps} "
                         "(decay_steps is the total length, warmup included)")
    if isinstance(peak_value, torch.Tensor):
        alpha = torch.where(peak_value == 0, 0.0, end_value / peak_value)
    else:
        alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warmup = linear_schedule(init_value=init_value, end_value=peak_value, transition_steps=warmup_steps)
    decay = cosine_decay_schedule(init_value=peak_value, decay_steps=decay_steps - warmup_steps,
                                  alpha=alpha, exponent=exponent)
    return join_schedules([warmup, decay], [warmup_steps]).fn


@_schedule
def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    r"""Warm restarts: warmup-cosine cycles one after another (Optax's ``sgdr_schedule``).

    Cycle :math:`k` is ``warmup_cosine_decay_schedule(**cosine_kwargs[k])``; it starts when the previous
    one's ``decay_steps`` (its total length, warmup included) are over and sees the steps since then.

    Args:
      cosine_kwargs: one dict of :func:`warmup_cosine_decay_schedule` arguments per cycle
        (``init_value``, ``peak_value``, ``warmup_steps``, ``decay_steps``, optionally ``end_value`` and
        ``exponent``).

    Returns:
      A :class:`Schedule`.

    References:
      Loshchilov & Hutter, `SGDR: Stochastic Gradient Descent with Warm Restarts
      <https://arxiv.org/abs/1608.03983>`_, 2017.

    >>> import fxtrain as fx
    >>> cycle = dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=3)
    >>> s = fx.schedules.sgdr_schedule([cycle, {**cycle, "peak_value": 0.5}])
    >>> [float(s(t)) for t in range(7)]
    [0.0, 1.0, 0.5, 0.0, 0.5, 0.25, 0.0]
    """
    name = "sgdr_schedule"
    cycles, boundaries, step = [], [], 0
    for i, kwargs in enumerate(cosine_kwargs):
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"{name}: cosine_kwargs[{i}] must be a dict of warmup_cosine_decay_schedule "
                            f"arguments, got {type(kwargs).__name__}")
        try:
            cycles.append(warmup_cosine_decay_schedule(**kwargs))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: cosine_kwargs[{i}]: {e}") from None
        step += _steps(name, f"cosine_kwargs[{i}]['decay_steps']", kwargs["decay_steps"])
        boundaries.append(step)
    if not cycles:
        raise ValueError(f"{name}: cosine_kwargs is empty; give one dict per cycle")
    return join_schedules(cycles, boundaries[:-1]).fn


@_schedule
def exponential_decay(init_value: Value, transition_steps: int, decay_rate: Value, transition_begin: int = 0,
                      staircase: bool = False, end_value: Value | None = None) -> Schedule:
    r"""Decays ``init_value`` by ``decay_rate`` every ``transition_steps`` (Optax's ``exponential_decay``).

    .. math::
      v(t) = I \cdot r^{(t - B) / T} \text{ for } t > B, \quad I \text{ before}

    with :math:`r` = ``decay_rate``, :math:`T` = ``transition_steps``, :math:`B` = ``transition_begin``;
    the exponent is floored when ``staircase``. ``end_value`` bounds the result (below when
    ``decay_rate < 1``, above otherwise). ``transition_steps=0`` or ``decay_rate=0`` hold ``init_value``
    forever (as in Optax).

    Args:
      init_value: value up to ``transition_begin``.
      transition_steps: steps per factor of ``decay_rate``, >= 0.
      decay_rate: factor per ``transition_steps``, >= 0.
      transition_begin: steps to hold ``init_value`` first, >= 0.
      staircase: decay in discrete jumps every ``transition_steps``.
      end_value: optional bound on the decayed value.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.exponential_decay(init_value=1.0, transition_steps=2, decay_rate=0.5, staircase=True)
    >>> [float(s(t)) for t in range(6)]
    [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    """
    name = "exponential_decay"
    init_value, decay_rate = _value(name, "init_value", init_value), _value(name, "decay_rate", decay_rate)
    end_value = _value(name, "end_value", end_value, optional=True)
    transition_steps = _steps(name, "transition_steps", transition_steps)
    transition_begin = _steps(name, "transition_begin", transition_begin)
    if not isinstance(staircase, bool):
        raise TypeError(f"{name}: staircase must be a bool, got {staircase!r}")
    if _is_negative(decay_rate):
        raise ValueError(f"{name}: decay_rate={decay_rate!r} must be >= 0")
    if transition_steps == 0 or (not isinstance(decay_rate, torch.Tensor) and decay_rate == 0):
        return lambda count: _full(count, init_value)
    # A tensor decay_rate is never read on the host (differentiable, batchable): the two cases Optax
    # decides in Python (rate 0 holds init_value; the end_value bound is below for rates < 1) are selected
    # on device instead.
    traced = isinstance(decay_rate, torch.Tensor)

    def fn(count):
        steps = count - transition_begin
        p = steps.to(_float()) / transition_steps
        if staircase:
            p = torch.floor(p)
        held = _full(count, init_value)
        value = torch.where(steps <= 0, held, init_value * torch.pow(decay_rate, p))
        if traced:
            value = torch.where(decay_rate == 0, held, value)
        if end_value is not None:
            bound = _full(count, end_value)
            if traced:
                value = torch.where(decay_rate < 1.0, torch.maximum(value, bound), torch.minimum(value, bound))
            else:
                value = torch.maximum(value, bound) if decay_rate < 1.0 else torch.minimum(value, bound)
        return value

    return fn


@_schedule
def piecewise_constant_schedule(init_value: Value,
                                boundaries_and_scales: Mapping[int, float] | None = None) -> Schedule:
    r"""``init_value`` times every scale whose boundary has been reached (Optax's ``piecewise_constant_schedule``).

    .. math::
      v(t) = I \prod_{b_i \le t} s_i

    Args:
      init_value: value before the first boundary.
      boundaries_and_scales: ``{step: scale}``; scales are >= 0 and multiply in from their step on.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.piecewise_constant_schedule(1.0, {2: 0.5, 4: 0.5})
    >>> [float(s(t)) for t in range(6)]
    [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    """
    name = "piecewise_constant_schedule"
    init_value = _value(name, "init_value", init_value)
    pieces = _boundaries_and_scales(name, boundaries_and_scales)

    def fn(count):
        value = _full(count, init_value)
        for boundary, s in pieces:
            value = torch.where(count < boundary, value, s * value)
        return value

    return fn


def _linear_between(start: torch.Tensor, end: torch.Tensor, pct: torch.Tensor) -> torch.Tensor:
    return (end - start) * pct + start


def _cosine_between(start: torch.Tensor, end: torch.Tensor, pct: torch.Tensor) -> torch.Tensor:
    return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)


_INTERPOLATIONS = {"linear": _linear_between, "cosine": _cosine_between}


@_schedule
def piecewise_interpolate_schedule(interpolate_type: str, init_value: Value,
                                   boundaries_and_scales: Mapping[int, float] | None = None) -> Schedule:
    r"""Interpolates, linearly or by a half cosine, between values scaled at boundaries (Optax's schedule).

    With boundaries :math:`0 = b_0 < b_1 < \dots < b_n` and values :math:`v_0 = I`,
    :math:`v_k = v_{k-1} s_k` (the scales multiply up, as in :func:`piecewise_constant_schedule`):

    .. math::
      v(t) = f\!\left(v_{k}, v_{k+1}, \frac{t - b_k}{b_{k+1} - b_k}\right) \text{ for } b_k \le t < b_{k+1},
      \qquad v(t) = v_n \text{ for } t \ge b_n

    where :math:`f(a, b, p) = a + (b - a) p` (``"linear"``) or :math:`b + \tfrac{a - b}{2}(1 + \cos \pi p)`
    (``"cosine"``). The schedule moves between the accumulated values, not between the scales.

    Args:
      interpolate_type: ``"linear"`` or ``"cosine"``.
      init_value: value at step 0.
      boundaries_and_scales: ``{step: scale}``; the value reached at ``step`` is the previous one times
        ``scale`` (scales >= 0).

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.schedules.piecewise_interpolate_schedule("linear", 1.0, {4: 0.1, 8: 0.01})
    >>> [round(float(s(t)), 6) for t in range(0, 11, 2)]
    [1.0, 0.55, 0.1, 0.0505, 0.001, 0.001]
    """
    name = "piecewise_interpolate_schedule"
    if interpolate_type not in _INTERPOLATIONS:
        raise ValueError(f"{name}: interpolate_type={interpolate_type!r} must be 'linear' or 'cosine'")
    between = _INTERPOLATIONS[interpolate_type]
    init_value = _value(name, "init_value", init_value)
    pieces = _boundaries_and_scales(name, boundaries_and_scales)
    bounds = [0] + [b for b, _ in pieces]

    def fn(count):
        values = [_full(count, init_value)]  # the cumulative products, rounded to float32 at each step as Optax's
        for _, s in pieces:
            values.append(values[-1] * (s.to(_float()) if isinstance(s, torch.Tensor) else s))
        value = torch.where(count >= bounds[-1], values[-1], 0.0)
        for k in range(len(pieces)):
            pct = (count - bounds[k]).to(_float()) / max(bounds[k + 1] - bounds[k], 1)
            inside = (count >= bounds[k]) & (count < bounds[k + 1])
            value = torch.where(inside, between(values[k], values[k + 1], pct), value)
        return value

    return fn


def _boundaries_and_scales(name: str, boundaries_and_scales: Any) -> list[tuple[int, Value]]:
    """``{step: scale}`` checked (integer steps, scales >= 0) and sorted by step."""
    if boundaries_and_scales is not None and not isinstance(boundaries_and_scales, Mapping):
        raise TypeError(f"{name}: boundaries_and_scales must be a dict {{step: scale}}, "
                        f"got {type(boundaries_and_scales).__name__}")
    pieces = []
    for b, s in (boundaries_and_scales or {}).items():
        b = _steps(name, f"boundaries_and_scales key {b!r}", b, minimum=-(2**63))
        s = _value(name, f"boundaries_and_scales[{b}]", s)
        if _is_negative(s):
            raise ValueError(f"{name}: boundaries_and_scales[{b}]={s!r}: scales must be >= 0")
        pieces.append((b, s))
    return sorted(pieces, key=lambda bs: bs[0])


def _onecycle_steps(name: str, transition_steps: Any, **fractions: Any) -> int:
    transition_steps = _steps(name, "transition_steps", transition_steps, minimum=1)
    for arg, pct in fractions.items():
        if isinstance(pct, bool) or not isinstance(pct, numbers.Real):
            raise TypeError(f"{name}: {arg} must be a number (a fraction of transition_steps), got {pct!r}")
    return transition_steps


@_schedule
def linear_onecycle_schedule(transition_steps: int, peak_value: Value, pct_start: float = 0.3,
                             pct_final: float = 0.85, div_factor: Value = 25.0,
                             final_div_factor: Value = 1e4) -> Schedule:
    r"""One cycle in three linear phases (Optax's ``linear_onecycle_schedule``).

    From ``peak_value / div_factor`` up to ``peak_value`` at ``int(pct_start * transition_steps)``, back
    down to ``peak_value / div_factor`` at ``int(pct_final * transition_steps)``, then on to
    ``peak_value / div_factor / final_div_factor`` at ``transition_steps``, held after. It is
    :func:`piecewise_interpolate_schedule` ``("linear", P / d, {int(p_s T): d, int(p_f T): 1 / d,
    T: 1 / f})``.

    Args:
      transition_steps: length of the cycle, >= 1.
      peak_value: the highest value.
      pct_start: fraction of the cycle spent rising.
      pct_final: fraction of the cycle at whose end the value is back to the initial one.
      div_factor: the initial value is ``peak_value / div_factor``.
      final_div_factor: the final value is the initial value over ``final_div_factor``.

    Returns:
      A :class:`Schedule`.

    References:
      Smith & Topin, `Super-Convergence: Very Fast Training of Neural Networks Using Large Learning Rates
      <https://arxiv.org/abs/1708.07120>`_, 2017.

    >>> import fxtrain as fx
    >>> s = fx.schedules.linear_onecycle_schedule(10, 1.0, pct_start=0.2, pct_final=0.6, div_factor=10.0,
    ...                                           final_div_factor=10.0)
    >>> [round(float(s(t)), 4) for t in (0, 1, 2, 4, 6, 8, 10, 12)]
    [0.1, 0.55, 1.0, 0.55, 0.1, 0.055, 0.01, 0.01]
    """
    name = "linear_onecycle_schedule"
    steps = _onecycle_steps(name, transition_steps, pct_start=pct_start, pct_final=pct_final)
    peak_value = _value(name, "peak_value", peak_value)
    div_factor = _value(name, "div_factor", div_factor)
    final_div_factor = _value(name, "final_div_factor", final_div_factor)
    return piecewise_interpolate_schedule("linear", peak_value / div_factor, {
        int(pct_start * steps): div_factor, int(pct_final * steps): 1.0 / div_factor,
        steps: 1.0 / final_div_factor}).fn


@_schedule
def cosine_onecycle_schedule(transition_steps: int, peak_value: Value, pct_start: float = 0.3,
                             div_factor: Value = 25.0, final_div_factor: Value = 1e4) -> Schedule:
    r"""One cycle in two half-cosine phases (Optax's ``cosine_onecycle_schedule``).

    From ``peak_value / div_factor`` up to ``peak_value`` at ``int(pct_start * transition_steps)``, then
    down to ``peak_value / div_factor / final_div_factor`` at ``transition_steps``, held after. It is
    :func:`piecewise_interpolate_schedule` ``("cosine", P / d, {int(p_s T): d, T: 1 / (d f)})``.

    Args:
      transition_steps: length of the cycle, >= 1.
      peak_value: the highest value.
      pct_start: fraction of the cycle spent rising.
      div_factor: the initial value is ``peak_value / div_factor``.
      final_div_factor: the final value is the initial value over ``final_div_factor``.

    Returns:
      A :class:`Schedule`.

    References:
      Smith & Topin, `Super-Convergence: Very Fast Training of Neural Networks Using Large Learning Rates
      <https://arxiv.org/abs/1708.07120>`_, 2017.

    >>> import fxtrain as fx
    >>> s = fx.schedules.cosine_onecycle_schedule(4, 1.0, pct_start=0.5, div_factor=10.0, final_div_factor=10.0)
    >>> [round(float(s(t)), 4) for t in range(6)]
    [0.1, 0.55, 1.0, 0.505, 0.01, 0.01]
    """
    name = "cosine_onecycle_schedule"
    steps = _onecycle_steps(name, transition_steps, pct_start=pct_start)
    peak_value = _value(name, "peak_value", peak_value)
    div_factor = _value(name, "div_factor", div_factor)
    final_div_factor = _value(name, "final_div_factor", final_div_factor)
    return piecewise_interpolate_schedule("cosine", peak_value / div_factor, {
        int(pct_start * steps): div_factor, steps: 1.0 / (div_factor * final_div_factor)}).fn


@_schedule
def join_schedules(schedules: Sequence[Callable[[Count], Value]], boundaries: Sequence[int]) -> Schedule:
    r"""Runs ``schedules`` one after another, switching at ``boundaries`` (Optax's ``join_schedules``).

    .. math::
      v(t) = s_k(t - b_k) \quad \text{for } b_k \le t < b_{k+1}, \quad b_0 = 0

    Each schedule sees the steps since its own boundary.

    Args:
      schedules: step -> value callables (fxtrain schedules or functions of a tensor count).
      boundaries: ``len(schedules) - 1`` non-decreasing steps at which the next schedule takes over.

    Returns:
      A :class:`Schedule`.

    >>> import fxtrain as fx
    >>> s = fx.join_schedules([fx.constant_schedule(1.0), fx.linear_schedule(1.0, 0.0, 2)], [3])
    >>> [float(s(t)) for t in range(6)]
    [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    name = "join_schedules"
    schedules = list(schedules)
    if not schedules:
        raise ValueError(f"{name}: schedules is empty")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"{name}: schedules[{i}] is not callable: {s!r}")
    boundaries = [_steps(name, f"boundaries[{i}]", b) for i, b in enumerate(boundaries)]
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"{name}: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
                         f"got {len(boundaries)}")
    if boundaries != sorted(boundaries):
        raise ValueError(f"{name}: boundaries={boundaries} must be non-decreasing")

    def fn(count):
        value = _as_value(schedules[0](count))
        for boundary, s in zip(boundaries, schedules[1:]):
            value = torch.where(count < boundary, value, _as_value(s(count - boundary)))
        return value

    return fn
