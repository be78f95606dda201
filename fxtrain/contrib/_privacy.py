"""Differential privacy: per-example clipping plus Gaussian noise (DP-SGD; Optax's contrib ``_privacy``).

Both transforms take per-example gradients (:func:`fxtrain.per_example_grads`: every leaf has a leading
batch axis) and return updates without that axis, so they go first in a stack. Like
:func:`fxtrain.per_example_global_norm_clip` they are not ``@transform`` factories: the catalogue's
conformance checks (updates shaped like the gradients) do not apply to a transform that sums an axis away.

Randomness: torch cannot reproduce JAX's PRNG, so the noise is not Optax's draw. It is a counter-based
generator computed on device from the state's ``rng_key`` = ``(seed, step)``: element ``j`` of the
flattened gradients at a given step gets its two uniforms from an integer hash of ``(seed, step, j)``
and a Gaussian by the Box-Muller transform. The update is therefore a pure function of
``(updates, state)``: no host sync, no global RNG, the same draws on resume and under ``torch.func``
(under ``vmap`` members whose keys are equal draw equal noise; give each member its own ``key`` to
draw independently). With ``noise_multiplier=0`` the numbers equal Optax's.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import (GradientTransformation, chain, check_learning_rate, check_nonnegative, describe, identity,
                           named)
from fxtrain.transforms._momentum import trace
from fxtrain.transforms._per_example import check_batch_axis, clip_sum
from fxtrain.transforms._scaling import scale_by_learning_rate

__all__ = ["DifferentiallyPrivateAggregateState", "differentially_private_aggregate", "dpsgd"]

_M32 = 0xFFFFFFFF


class DifferentiallyPrivateAggregateState(NamedTuple):
    """State of :func:`differentially_private_aggregate` (Optax's field name)."""

    rng_key: torch.Tensor  # int64 (2,): (seed folded to 32 bits, number of updates so far)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)`` (int64) and a 32-bit constant, without overflowing int64:
    the high half of ``x`` only contributes its product with ``c``'s low 16 bits."""
    return (((x & 0xFFFF) * c) + ((((x >> 16) * (c & 0xFFFF)) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' ``lowbias32``) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32, one per ``index`` (int64), from the 32-bit ``key``: 24 random bits each."""
    h = _mix(_mix((index & _M32) ^ key) ^ (index >> 32))
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0 ** -24


def gaussian(rng_key: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` standard normal float32 draws, a pure function of ``rng_key = (seed, step)`` (on its device).

    Box-Muller on two counter-based uniforms per element; with 24-bit uniforms the largest draw is about
    5.8 standard deviations.

    >>> z = gaussian(torch.tensor([0, 0]), 100_000)
    >>> abs(float(z.mean())) < 0.02, abs(float(z.std()) - 1) < 0.02
    (True, True)
    """
    seed, step = rng_key[0], rng_key[1]
    key = _mix(_mix(seed & _M32) ^ (step & _M32))
    index = torch.arange(n, dtype=torch.int64, device=rng_key.device)
    u1, u2 = _uniform(_mix(key ^ 0x68E31DA4), index), _uniform(_mix(key ^ 0x1B56C4E9), index)
    return (-2.0 * u1.log()).sqrt() * torch.cos((2 * math.pi) * u2)


def _seed(key: Any, seed: Any, owner: str) -> int | torch.Tensor:
    """Optax's ``key`` / deprecated ``seed`` handling, folded to 32 bits; a ``torch.Generator`` gives its
    initial seed. A 0-dim integer tensor (``inject_hyperparams`` makes one of an int; a vmapped member's own
    key) is folded on device: no host sync."""
    if seed is not None:
        warnings.warn(f'{owner}: "seed" is deprecated (as in Optax), use "key"', DeprecationWarning, stacklevel=3)
        if key is not None:
            raise ValueError(f"{owner}: pass one of key={describe(key)} or seed={describe(seed)}, not both")
        key = seed
    if key is None:
        warnings.warn(f"{owner}: no key given, using key=0 (as Optax does); pass key= for your own noise",
                      UserWarning, stacklevel=3)
        key = 0
    if isinstance(key, torch.Generator):
        key = key.initial_seed()
    if isinstance(key, torch.Tensor) and key.ndim == 0 and not (key.is_floating_point() or key.is_complex()
                                                                 or key.dtype == torch.bool):
        key = key.to(torch.int64)
    elif not isinstance(key, int) or isinstance(key, bool):
        raise TypeError(f"{owner}: key must be an int, a 0-dim integer tensor or a torch.Generator, got "
                        f"{type(key).__name__}" + (f" of shape {tuple(key.shape)} and dtype {key.dtype}"
                                                   if isinstance(key, torch.Tensor) else ""))
    return (key & _M32) ^ ((key >> 32) & _M32)


def differentially_private_aggregate(l2_norm_clip: Any, noise_multiplier: Any,
                                     key: int | None = None, *, seed: int | None = None) -> GradientTransformation:
    # (key: int | None, though a 0-dim integer tensor or a torch.Generator is taken too: see dpsgd)
    r"""Aggregates per-example gradients as DP-SGD does: clip each, sum, add Gaussian noise, average (Optax's).

    For the :math:`B` per-example gradients :math:`g_i` (a leading batch axis on every leaf), clip norm
    :math:`C` and noise multiplier :math:`\sigma`:

    .. math:: u = \frac{1}{B}\left(\sum_{i=1}^{B} \min\left(1, \frac{C}{\lVert g_i \rVert}\right) g_i
        + \mathcal{N}(0, \sigma^2 C^2 I)\right)

    with :math:`\lVert g_i \rVert` the L2 norm of example :math:`i`'s gradient over all leaves. The
    noise comes from the counter-based generator of this module (see its docstring): reproducible from
    the state, not Optax's draws. Put it first in a stack; ``accumulate`` and other aggregations of
    updates would break the privacy accounting.

    Args:
      l2_norm_clip: :math:`C`, the maximum L2 norm of each example's gradient (a number or a 0-dim tensor).
      noise_multiplier: :math:`\sigma`, the noise's standard deviation relative to :math:`C`.
      key: the noise's seed: an int, a 0-dim integer tensor or a ``torch.Generator`` (its initial seed).
        ``None``: 0, with a warning (as in Optax).
      seed: deprecated name of ``key`` (as in Optax).

    Returns:
      A transform with state :class:`DifferentiallyPrivateAggregateState`; updates are shaped like the
      params (the batch axis averaged away). Not elementwise.

    Raises:
      ValueError: at update, a leaf without a leading batch axis or with another length than the others.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.contrib.differentially_private_aggregate(l2_norm_clip=1.0, noise_multiplier=0.0, key=0)
        >>> grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}   # 2 examples, norms 5 and 0.5
        >>> u, state = tx.update(grads, tx.init(None))
        >>> [round(x, 4) for x in u["w"].tolist()], state.rng_key.tolist()   # (0.6 + 0.3) / 2, (0.8 + 0.4) / 2
        ([0.45, 0.6], [0, 1])

    References:
      Abadi et al., `Deep Learning with Differential Privacy <https://arxiv.org/abs/1607.00133>`_, 2016.
    """
    owner = "differentially_private_aggregate"
    check_nonnegative(owner, l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier)
    seed32 = _seed(key, seed, owner)
    noise_std = l2_norm_clip * noise_multiplier

    def init_fn(params):
        device = next((x.device for x in tree.leaves(params) if isinstance(x, torch.Tensor)), torch.device("cpu"))
        first = torch.as_tensor(seed32, dtype=torch.int64).to(device)
        return DifferentiallyPrivateAggregateState(torch.stack([first, torch.zeros_like(first)]))

    def update_fn(updates, state, params=None):
        del params
        flat, spec = tree.flatten(updates)
        check_batch_axis(updates, flat, owner="")  # the caller's _Update prefixes the transform's name
        present = [x for x in flat if x is not None]
        if not present:
            return updates, state
        batch = present[0].shape[0]
        clipped, _ = clip_sum(present, l2_norm_clip)  # new tensors: the ops below may write into them
        sizes = [c.numel() for c in clipped]
        noise = gaussian(state.rng_key.to(clipped[0].device), sum(sizes)).split(sizes)
        noise = [z.view_as(c).to(c.dtype) for z, c in zip(noise, clipped)]
        noised = tree.div_(tree.add_(clipped, noise, noise_std), batch)
        it = iter(noised)
        new_key = state.rng_key + torch.tensor([0, 1], dtype=torch.int64, device=state.rng_key.device)
        return (tree.unflatten(spec, [None if x is None else next(it) for x in flat]),
                DifferentiallyPrivateAggregateState(new_key))

    label = lambda: (f"{owner}({describe(l2_norm_clip)}, {describe(noise_multiplier)}"  # noqa: E731
                     f"{'' if key is None and seed is None else f', key={describe(seed32)}'})")
    return named(GradientTransformation(init_fn, update_fn), label)


def dpsgd(learning_rate: Any, l2_norm_clip: Any, noise_multiplier: Any,
          key: int | None = None, momentum: Any = None, nesterov: bool = False, *,
          seed: int | None = None) -> GradientTransformation:
    # (key: int | None, though a 0-dim integer tensor or a torch.Generator is taken too: inject_hyperparams
    # keeps an int argument an int32 tensor by its annotation, where other numbers become floats)
    r"""DP-SGD: :func:`differentially_private_aggregate`, then SGD with optional momentum (Optax's ``dpsgd``).

    .. math:: t_k = \tilde g_k + \beta t_{k-1}, \qquad \theta_{k+1} = \theta_k - \eta\, t_k

    with :math:`\tilde g_k` the clipped, noised and averaged per-example gradients.

    Args:
      learning_rate: :math:`\eta`, a number, a 0-dim tensor or a schedule.
      l2_norm_clip: the maximum L2 norm of each example's gradient.
      noise_multiplier: the noise's standard deviation relative to ``l2_norm_clip``.
      key: the noise's seed (an int, a 0-dim integer tensor or a ``torch.Generator``), current Optax's
        ``key``; ``None``: 0, with a warning.
      momentum: :math:`\beta`; ``None`` for none.
      nesterov: use Nesterov momentum.
      seed: deprecated name of ``key`` (as in Optax, with a ``DeprecationWarning``): ``seed=s`` is ``key=s``,
        the same noise. fxtrain's earlier ``dpsgd(lr, clip, noise, seed)`` took it in ``key``'s position, so
        positional calls are unchanged.

    Returns:
      ``chain(differentially_private_aggregate(l2_norm_clip, noise_multiplier, key), trace(momentum,
      nesterov) or identity(), scale_by_learning_rate(learning_rate))``; it takes per-example gradients.

    Example:
        >>> import torch, fxtrain as fx
        >>> loss_fn = lambda p, batch: ((batch @ p["w"]) ** 2).mean()
        >>> params = {"w": torch.ones(2)}
        >>> grads = fx.per_example_grads(loss_fn)(params, torch.eye(2))   # per example: 2 * e_i
        >>> tx = fx.contrib.dpsgd(learning_rate=0.5, l2_norm_clip=1.0, noise_multiplier=0.0, key=0)
        >>> u, _ = tx.update(grads, tx.init(params), params)   # each clipped to norm 1, averaged
        >>> fx.apply_updates(params, u)["w"].tolist()
        [0.75, 0.75]

    References:
      Abadi et al., `Deep Learning with Differential Privacy <https://arxiv.org/abs/1607.00133>`_, 2016.
    """
    check_learning_rate("dpsgd", learning_rate=learning_rate, momentum=momentum)
    if seed is not None:
        warnings.warn('dpsgd: "seed" is deprecated (as in Optax), use "key" (the same noise)', DeprecationWarning,
                      stacklevel=2)
        if key is not None:
            raise ValueError(f"dpsgd: pass one of key={describe(key)} or seed={describe(seed)}, not both")
        key = seed
    if key is None:
        warnings.warn("dpsgd: no key given, using key=0 (as Optax does); pass key= for your own noise", UserWarning,
                      stacklevel=2)
        key = 0
    tx = chain(differentially_private_aggregate(l2_norm_clip, noise_multiplier, key=key),
               trace(decay=momentum, nesterov=nesterov) if momentum is not None else identity(),
               scale_by_learning_rate(learning_rate))
    args = [describe(learning_rate), describe(l2_norm_clip), describe(noise_multiplier), f"key={describe(key)}"]
    if momentum is not None:
        args.append(f"momentum={describe(momentum)}")
    if nesterov:
        args.append("nesterov=True")
    return named(tx, lambda: f"dpsgd({', '.join(args)})")
