"""Measuring updates inside a chain: ``snapshot`` and ``monitor`` (Optax's), which pass the updates through
unchanged and keep what they measured in their state (``fx.tree`` paths or attribute access read it)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

from fxtrain.transforms._moments import Scalar

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, combine, call_, chain, stateless, transform
from fxtrain.transforms._simple import ema

__all__ = ["SnapshotState", "snapshot", "MonitorState", "monitor", "measure_with_ema"]


class SnapshotState(NamedTuple):
    """State of :func:`snapshot` (Optax's): ``{measure_name: measurement}``.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.snapshot('x', lambda state: state).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.SnapshotState), state._fields
        (True, ('measurement',))
    """

    measurement: dict


class MonitorState(NamedTuple):
    """State of :func:`monitor` (Optax's).

    Attributes:
      measurements: ``{name: measurement}`` of the last update.
      measure_states: the measuring transforms' states, in the order of the names.

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.monitor({"norm": fx.tree.norm}).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.MonitorState), state._fields
        (True, ('measurements', 'measure_states'))
    """

    measurements: dict
    measure_states: tuple


@transform(elementwise=False)
def snapshot(measure_name: str, measure: Callable[[Any], Any]) -> GradientTransformation:
    """Keeps ``measure(updates)`` in the state under ``measure_name``; updates pass unchanged (Optax's).

    ``init`` stores ``measure(params)``, so the state has its final structure from the start. The
    measurement is computed when the transform runs: in a chain, on the updates transformed so far.
    ``measure`` should return new tensors (a norm, a copy), not views of the updates, which later
    transforms of a donated chain overwrite.

    Args:
      measure_name: the key of the measurement in the state.
      measure: ``measure(updates) -> tree of tensors``.

    Returns:
      A transform with a :class:`SnapshotState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.chain(fx.sgd(0.1), fx.snapshot("norm_before_clip", fx.tree.norm), fx.clip_by_global_norm(0.05))
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> u, state = tx.update(2 * params, state)
        >>> round(state[1].measurement["norm_before_clip"].item(), 4)
        0.7483
    """
    if not callable(measure):
        raise ValueError(f"snapshot: measure must be a callable of the updates, got {measure!r}")

    def init_fn(params):
        return SnapshotState({measure_name: measure(params)})

    def update_fn(updates, state, params=None):
        del params, state
        return updates, SnapshotState({measure_name: measure(updates)})

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=False)
def monitor(measures: Mapping[str, GradientTransformation | Callable[[Any], Any]]) -> GradientTransformation:
    """Keeps measurements of the updates, possibly stateful, in the state; updates pass unchanged (Optax's).

    Each measure is a function of the updates (as in :func:`snapshot`) or a transform whose *output* is
    the measurement (e.g. an exponential moving average of a norm): it runs on the updates and its state
    is kept in ``measure_states``. In place, a transform measure gets a copy of the updates, so the
    updates passed on are never written.

    One difference with Optax: Optax's ``init`` leaves ``measurements`` empty (``{}``), so its state
    changes structure at the first update; here ``init`` fills it with zeros shaped like the first
    measurements (each measure run once on zero updates, without extra arguments), so the state keeps one
    structure. From the first update on, the two states hold the same leaves.

    Args:
      measures: name -> a function of the updates or a transform.

    Returns:
      A transform with a :class:`MonitorState`; extra arguments reach the measuring transforms that read
      them.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.chain(fx.sgd(0.1), fx.monitor({"norm": fx.tree.norm, "trace": fx.trace(0.5)}))
        >>> params = torch.tensor([1.0, 2.0, 3.0])
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     u, state = tx.update(2 * params, state)
        >>> round(state[1].measurements["norm"].item(), 4), state[1].measurements["trace"].tolist()
        (0.7483, [-0.30000001192092896, -0.6000000238418579, -0.9000000357627869])
    """
    names = tuple(measures)
    txs = {n: m if isinstance(m, GradientTransformation) else _measuring(m) for n, m in measures.items()}
    for n, m in measures.items():
        if not isinstance(m, GradientTransformation) and not callable(m):
            raise ValueError(f"monitor: measures[{n!r}] must be a transform or a callable of the updates, got {m!r}")

    def init_fn(params):
        states = tuple(txs[n].init(params) for n in names)
        zeros = tree.zeros_like(params)
        with torch.no_grad():
            first = {n: txs[n].update(zeros, s, params)[0] for n, s in zip(names, states)}
        return MonitorState({n: tree.map(torch.zeros_like, first[n]) for n in names}, states)

    def update_fn(updates, state, params=None, **extra_args):
        measurements, states = {}, []
        for n, s in zip(names, state.measure_states):
            given = updates
            if not tree.is_functional() and isinstance(measures[n], GradientTransformation):
                given = tree.clone(updates)  # a transform measure may write into its input in place
            measurements[n], s = call_(txs[n], given, s, params, extra_args)
            states.append(s)
        return updates, MonitorState(measurements, tuple(states))

    return combine(init_fn, update_fn, tuple(txs.values()))


@transform(elementwise=False)
def measure_with_ema(measure: Callable[[Any], Any], decay: Scalar, debias: bool = True,
                     accumulator_dtype: torch.dtype | str | None = None) -> GradientTransformation:
    r"""A measure of the updates averaged over steps, for :func:`monitor` (Optax's ``measure_with_ema``).

    ``chain(stateless(measure), ema(decay, debias, accumulator_dtype))`` whose average starts as zeros shaped
    like ``measure(params)``: its output is :math:`m_t = eta m_{t-1} + (1 - eta)\,	ext{measure}(u_t)`,
    divided by :math:`1 - eta^t` with ``debias``.

    Args:
      measure: ``measure(updates) -> tree of tensors``.
      decay: the decay :math:`eta` (a number or a 0-dim tensor).
      debias: divide by :math:`1 - eta^t`.
      accumulator_dtype: dtype of the average; ``None``: the measurement's.

    Returns:
      A transform whose output is the averaged measurement; state ``(EmptyState(), EmaState(count, ema))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.monitor({"norm_ema": fx.measure_with_ema(fx.tree.norm, decay=0.9)})
        >>> state = tx.init(torch.zeros(2))
        >>> for g in (3.0, 4.0):
        ...     _, state = tx.update(torch.tensor([g, 0.0]), state)
        >>> round(state.measurements["norm_ema"].item(), 4)    # (0.9 * 0.1 * 3 + 0.1 * 4) / (1 - 0.81)
        3.5263
    """
    average = ema(decay, debias, accumulator_dtype)
    # The average has the measurement's shape, not the params'.
    return chain(_measuring(measure), average._replace(init=lambda params: average.init(measure(params))))


def _measuring(measure: Callable[[Any], Any]) -> GradientTransformation:
    """A function of the updates as a stateless transform whose output is the measurement."""
    return stateless(lambda updates, params: measure(updates))
