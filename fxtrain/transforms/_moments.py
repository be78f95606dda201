"""Private helpers of the moment-based transforms: moving averages over flat leaf lists, counters, dtypes.

Every helper takes hyperparameters as Python numbers or 0-dim tensors (``inject_hyperparams`` passes
tensors). Python numbers go to the ``Scalar`` overloads of ``torch._foreach_*`` (``lerp_``, ``alpha=``,
``value=``), which would silently call ``.item()`` on a tensor; tensors go to the ``Tensor`` overloads or
ride along as lists of 0-dim tensors that broadcast, so no host sync happens either way.

When a state leaf and its gradient have different dtypes (``mu_dtype``, ``accumulator_dtype``), Optax
computes the new moment in the promoted dtype, uses that value for this step's update and stores it cast
to the state's dtype. :func:`ema_` and :func:`ema_sq_` do the same: they return the promoted values
(the state buffers themselves when dtypes agree, the common case, which then costs nothing extra).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from fxtrain import tree
from fxtrain._deferred import DTensor

Scalar = Any  # a Python number or a 0-dim tensor
Count = Any  # a whole number or a 0-dim integer tensor (the runner keeps a config's int an int: build.floats_where_expected)
LearningRate = Scalar | Callable  # a number, a 0-dim tensor, or a schedule of the count


def is_number(x: Any) -> bool:
    """Whether ``x`` is a Python int or float (not a bool, not a tensor)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_zero(x: Scalar) -> bool:
    """Whether ``x`` is the Python number 0 (a tensor never is: its value is not looked at)."""
    return is_number(x) and x == 0


def as_dtype(dtype: torch.dtype | str | None, name: str) -> torch.dtype | None:
    """Canonical form of a ``mu_dtype``-style argument: ``None``, a ``torch.dtype`` or its name."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise TypeError(f"{name} must be None, a torch.dtype or its name (e.g. 'bfloat16'), got {dtype!r}")


def param_device(params: Any) -> torch.device:
    """Where a transform's counters and scalars live: the device of the first tensor in ``params``."""
    for x in tree.leaves(params):
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def scalar_dtype(params: Any) -> torch.dtype:
    """The dtype of a transform's 0-dim float state (learning rates, distances): Optax's ``tree.dtype(params,
    'lowest')``, the narrowest floating dtype of the params (complex params: its real counterpart, since
    learning rates are real); float32 when there is none.

    >>> import torch
    >>> scalar_dtype({"w": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(2)})
    torch.bfloat16
    """
    dtypes = {x.dtype.to_real() if x.is_complex() else x.dtype for x in tree.leaves(params)
              if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())}
    return min(dtypes, key=lambda d: (torch.finfo(d).bits, torch.finfo(d).eps), default=torch.float32)


def counter(params: Any) -> torch.Tensor:
    """A 0-dim int32 step counter, zero, on :func:`param_device`."""
    return torch.zeros((), dtype=torch.int32, device=param_device(params))


def safe_increment_(count: torch.Tensor) -> torch.Tensor:
    """``count + 1`` (in place when donated), saturating at the dtype's maximum (Optax's ``safe_increment``)."""
    return tree.inc_(count, count < torch.iinfo(count.dtype).max)


def full_like(params: Any, value: Scalar, dtype: torch.dtype | None = None) -> Any:
    """Leaves of ``params`` filled with ``value`` (Optax's ``tree.full_like``).

    A tensor ``value`` is added out of place, so the state stays a function of it: differentiable, and
    batched when ``value`` is (``torch.func.vmap`` over ``initial_scale``...).
    """
    if is_number(value):
        return tree.map(lambda x: torch.full_like(x, value, dtype=dtype), params)
    return tree.map(lambda x: (torch.zeros_like(x, dtype=dtype) + value).to(dtype or x.dtype), params)


def bias_correction(decay: Scalar, count: torch.Tensor, like: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``1 - decay ** count`` as a 0-dim tensor, computed on device in the precision of the leaves ``like``
    (float64 params get a float64 correction, as Optax's under x64; float32 at least: never rounded to
    bfloat16)."""
    dtype = torch.float32
    if like:
        real = like[0].real.dtype if like[0].is_complex() else like[0].dtype
        dtype = torch.promote_types(dtype, real)
    return 1 - decay ** count.to(dtype)


def mixed_dtypes(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    """Whether some leaf of ``xs`` and its partner in ``ys`` differ in dtype (``mu_dtype`` and the like)."""
    return any(x.dtype != y.dtype for x, y in zip(xs, ys))


def weak(c: Scalar, xs: list[torch.Tensor]) -> Scalar | list[float]:
    """``c`` as JAX uses it against each tensor of ``xs``: a Python number takes the tensor's dtype.

    JAX rounds a Python scalar to the dtype of the array it meets (weak typing): ``0.9 * bf16_array``
    multiplies by ``bfloat16(0.9) = 0.8984375``. Optax's mixed-dtype moments depend on it, so the paths
    that mix dtypes round the same way; tensors are used as they are.
    """
    if not is_number(c):
        return c
    return [_rounded(c, x.dtype) for x in xs]


@functools.lru_cache(maxsize=256)
def _rounded(c: float, dtype: torch.dtype) -> float:
    return torch.tensor(c, dtype=dtype).item()  # a host-side constant: no device is involved


def conj(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``xs`` with complex leaves conjugated (lazy views), so ``x * conj(x) = |x|^2`` (Optax's ``abs_sq``);
    real leaves are returned as they are (the same list when none is complex: free)."""
    if not any(x.is_complex() for x in xs):
        return xs
    return [x.conj() if x.is_complex() else x for x in xs]


def ema(mu: list[torch.Tensor], g: list[torch.Tensor], decay: Scalar) -> list[torch.Tensor]:
    """New tensors ``(1 - decay) * g + decay * mu`` in the promoted dtype (Optax's ``update_moment``)."""
    with tree.functional():
        return tree.add_(tree.scale_(g, weak(1 - decay, g)), tree.scale_(mu, weak(decay, mu)))


def ema_(mu: list[torch.Tensor], g: list[torch.Tensor], decay: Scalar) -> tuple[list, list]:
    """``decay * mu + (1 - decay) * g``: returns ``(stored, new)``, the moment as the state keeps it (written
    into ``mu`` when donated) and at the promoted precision for this step's update (the same list unless
    dtypes differ)."""
    if not mu:
        return mu, mu
    if mixed_dtypes(mu, g):
        new = ema(mu, g, decay)
        return tree.copy_(mu, new), new
    mu = tree.lerp_(mu, g, 1 - decay)
    return mu, mu


def ema_sq_(nu: list[torch.Tensor], g: list[torch.Tensor], decay: Scalar) -> tuple[list, list]:
    """``decay * nu + (1 - decay) * |g|^2``, returned as ``(stored, new)`` like :func:`ema_`."""
    if not nu:
        return nu, nu
    if mixed_dtypes(nu, g):
        with tree.functional():
            sq = tree.scale_(g, conj(g))
        new = ema(nu, sq, decay)
        return tree.copy_(nu, new), new
    # as torch.optim: mul_ then addcmul_ (a tensor decay folds into g's copy inside addcmul_)
    nu = tree.addcmul_(tree.scale_(nu, decay), g, conj(g), 1 - decay)
    return nu, nu
