"""Scaling the updates down when a watched value stops improving: ``reduce_on_plateau`` (Optax's contrib)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, check_nonnegative, transform
from fxtrain.transforms._moments import Count, Scalar, counter, is_number, param_device, weak

__all__ = ["ReduceLROnPlateauState", "reduce_on_plateau"]


class ReduceLROnPlateauState(NamedTuple):
    """State of :func:`reduce_on_plateau` (Optax's fields, in Optax's order; 0-dim tensors on the params' device).

    Attributes:
      scale: what the updates are multiplied by, in the lowest float dtype of the params.
      best_value: the best average value seen, in the highest float dtype of the params (inf at first).
      plateau_count: decisions in a row without improvement (int32).
      cooldown_count: decisions left before the plateau count resumes after a reduction (int32).
      count: values accumulated toward the next decision (int32).
      avg_value: the running mean of those values, in the highest float dtype of the params.
    """

    scale: torch.Tensor
    best_value: torch.Tensor
    plateau_count: torch.Tensor
    cooldown_count: torch.Tensor
    count: torch.Tensor
    avg_value: torch.Tensor

    def report(self) -> dict[str, torch.Tensor]:
        """The scale, so a reduction shows in the step's metrics."""
        return {"plateau_scale": self.scale}


@transform(elementwise=False, extra_args=True)
def reduce_on_plateau(factor: Scalar = 0.1, patience: Count = 10, rtol: Scalar = 1e-4, atol: Scalar = 0.0,
                      cooldown: Count = 0, accumulation_size: Count = 1, min_scale: Scalar = 0.0
                      ) -> GradientTransformation:
    r"""Scales the updates by ``factor`` each time a watched value stops improving (Optax's contrib).

    Each update takes ``value=`` (a loss or a validation metric) as an extra argument. Every
    ``accumulation_size`` updates, the mean :math:`\bar v` of the values given since the last decision is
    compared with the best mean so far :math:`b`:

    .. math::
      \text{improved} \iff \bar v < (1 - \mathrm{rtol})\, b - \mathrm{atol}

    An improvement sets :math:`b = \bar v` and the plateau count to 0; otherwise the count grows, and when
    it reaches ``patience`` the scale becomes :math:`\max(\text{scale} \cdot \text{factor},
    \text{min\_scale})`, the count restarts and the next ``cooldown`` decisions only count down the
    cooldown. The updates are ``scale * updates`` (so put it after the learning rate in a chain, or
    anywhere: it is a scalar multiple). Decisions are taken on device with ``torch.where``: no host sync,
    and under ``torch.func.vmap`` each member of an ensemble decides on its own value.

    Args:
      factor: multiplies the scale on a plateau, in (0, 1).
      patience: decisions without improvement before the scale is reduced.
      rtol: relative improvement needed, in [0, 1].
      atol: absolute improvement needed, >= 0 (``rtol`` and ``atol`` are not both 0).
      cooldown: decisions after a reduction during which plateaus are not counted.
      accumulation_size: values averaged per decision (1 for a validation metric given once per
        evaluation; more for a noisy per-batch training loss), >= 1.
      min_scale: the scale never goes below it.

    Returns:
      A transform with state :class:`ReduceLROnPlateauState`, whose update takes ``value=``.

    Example:
        Without a runner, pass the value to ``update`` (``chain`` hands it to the transforms that read it):

        >>> import torch, fxtrain as fx
        >>> tx = fx.chain(fx.adam(1e-2), fx.contrib.reduce_on_plateau(patience=2, cooldown=1))
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> for loss in [1.0, 0.9, 0.95, 0.92, 0.91]:
        ...     grads = {"w": 2 * params["w"]}
        ...     updates, state = tx.update(grads, state, params, value=torch.tensor(loss))
        ...     params = fx.apply_updates(params, updates)
        >>> round(float(fx.tree.get(state, "scale")), 6)  # two decisions without improvement: x 0.1
        0.1

    References:
      Optax's ``contrib.reduce_on_plateau``; ``torch.optim.lr_scheduler.ReduceLROnPlateau``.
    """
    name = "reduce_on_plateau"
    check_nonnegative(name, factor=factor, rtol=rtol, atol=atol, min_scale=min_scale)
    if is_number(factor) and not 0 < factor < 1:
        raise ValueError(f"{name}: factor={factor!r} must be in (0, 1)")
    if is_number(rtol) and rtol > 1:
        raise ValueError(f"{name}: rtol={rtol!r} must be <= 1")
    if is_number(rtol) and is_number(atol) and rtol == 0 and atol == 0:
        raise ValueError(f"{name}: rtol and atol are both 0; make one of them positive")
    for arg, v, least in (("patience", patience, 0), ("cooldown", cooldown, 0),
                          ("accumulation_size", accumulation_size, 1)):
        if is_number(v) and v < least:
            raise ValueError(f"{name}: {arg}={v!r} must be >= {least}")

    def init_fn(params):
        lowest, highest = _float_dtypes(params)
        device = param_device(params)
        return ReduceLROnPlateauState(
            scale=torch.ones((), dtype=lowest, device=device),
            best_value=torch.full((), float("inf"), dtype=highest, device=device),
            plateau_count=counter(params), cooldown_count=counter(params), count=counter(params),
            avg_value=torch.zeros((), dtype=highest, device=device))

    def update_fn(updates, state, params=None, *, value=None, **extra_args):
        del params, extra_args
        if value is None:
            raise TypeError(f"{name}: update needs value=, the loss or metric to watch: "
                            "tx.update(grads, state, params, value=loss)")
        # a few scalars computed out of place, then written into the state (in place when donated)
        new = ReduceLROnPlateauState(*tree.copy_(list(state), list(_step(state, value))))
        (g,) = tree.align(updates)
        return tree.put(updates, updates, tree.scale_(g, new.scale)), new

    def _step(state: ReduceLROnPlateauState, value: Any) -> ReduceLROnPlateauState:
        count = _incremented(state.count)
        value = torch.as_tensor(value, device=state.avg_value.device).to(state.avg_value.dtype)
        avg = ((state.count * state.avg_value + value) / count).to(state.avg_value.dtype)
        best = state.best_value  # Python numbers meet it rounded to its dtype, as in JAX
        improved = avg < _like(1 - rtol, best) * best - _like(atol, best)
        best = torch.where(improved, avg, best)
        plateau = torch.where(improved, 0, _incremented(state.plateau_count))
        cooling = state.cooldown_count > 0
        reduce = ~cooling & (plateau == patience)
        reduced = torch.where(reduce, state.scale * _like(factor, state.scale), state.scale)
        floor = torch.as_tensor(_like(min_scale, state.scale), dtype=state.scale.dtype, device=reduced.device)
        decided = ReduceLROnPlateauState(
            scale=torch.where(cooling, state.scale, torch.maximum(reduced, floor)),
            best_value=best,
            plateau_count=torch.where(cooling | reduce, 0, plateau),
            cooldown_count=torch.where(cooling, state.cooldown_count - 1, torch.where(reduce, cooldown, 0)),
            count=torch.zeros_like(count), avg_value=torch.zeros_like(avg))
        accumulated = state._replace(count=count, avg_value=avg)
        ready = count == accumulation_size
        return ReduceLROnPlateauState(*(torch.where(ready, d, a).to(a.dtype) for d, a in zip(decided, accumulated)))

    return GradientTransformation(init_fn, update_fn)


def _incremented(count: torch.Tensor) -> torch.Tensor:
    """``count + 1``, saturating at the dtype's maximum (Optax's ``safe_increment``), out of place."""
    return torch.where(count < torch.iinfo(count.dtype).max, count + 1, count)


def _like(c: Scalar, x: torch.Tensor) -> Scalar:
    """``c`` as JAX uses it against ``x``: a Python number rounded to ``x``'s dtype (a tensor as it is)."""
    c = weak(c, [x])
    return c[0] if isinstance(c, list) else c


def _float_dtypes(params: Any) -> tuple[torch.dtype, torch.dtype]:
    """The lowest and highest floating dtypes of the params (Optax's ``tree.dtype(params, "lowest"/"highest")``).

    Float32 for params without floating leaves (JAX's default); complex leaves count as their real dtype.
    """
    dtypes = {x.real.dtype if x.is_complex() else x.dtype for x in tree.leaves(params)
              if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())}
    if not dtypes:
        return torch.float32, torch.float32
    highest = functools.reduce(torch.promote_types, dtypes)
    lowest = [d for d in dtypes if all(torch.promote_types(d, e) == e for e in dtypes)]
    if not lowest:  # float16 and bfloat16: neither holds the other
        raise ValueError(f"reduce_on_plateau: the params mix {sorted(map(str, dtypes))}, which have no lowest "
                         "dtype for the scale; cast them to one of them (Optax refuses them too)")
    return lowest[0], highest
