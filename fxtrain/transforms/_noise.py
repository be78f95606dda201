"""Gradient noise: ``add_noise`` and ``noisy_sgd`` (Optax's math and state fields).

torch cannot reproduce JAX's PRNG, so the noise comes from fxtrain's own counter-based generator: each
element's standard normal is a hash (splitmix64's finalizer, in int64 tensor arithmetic) of the key, the
update count, the leaf's position in the tree and the element's index, turned normal by Box-Muller. So:

* an update is a pure function of ``(state, updates)``: no generator object, no host sync; resuming from
  a saved state gives the same noise, on any device;
* under ``torch.func.vmap`` each member draws from its own state: members initialised with one key (the
  usual ``vmap(tx.init)``) get the same noise, as with ``jax.vmap``; give them different keys (a batched
  ``rng_key``) for independent noise;
* a DTensor leaf (``Shard``/``Replicate`` placements) gets the noise of the whole tensor, element for
  element: the same numbers as the unsharded tensor.

The state's ``rng_key`` keeps the key (Optax's holds a JAX key that it splits each step); only the
noise's distribution, not its values, can match Optax's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fxtrain import tree
from fxtrain._base import GradientTransformation, chain, check_learning_rate, check_nonnegative, transform

from fxtrain._deferred import DTensor, Replicate, Shard
from fxtrain.transforms._moments import LearningRate, Scalar, param_device, safe_increment_
from fxtrain.transforms._scaling import scale_by_learning_rate

__all__ = ["AddNoiseState", "add_noise", "noisy_sgd"]

class AddNoiseState(NamedTuple):
    """State of :func:`add_noise` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.add_noise(0.01, 0.55, 0).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.AddNoiseState), state._fields
        (True, ('count', 'rng_key'))
    """

    count: torch.Tensor  # 0-dim int32: updates so far
    rng_key: torch.Tensor  # 0-dim int64: the key; the noise of update t hashes (rng_key, t)


# --- the counter-based generator ----------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15 - 2 ** 64  # splitmix64's constants, as the int64 values of their bits
_M1, _M2 = 0xBF58476D1CE4E5B9 - 2 ** 64, 0x94D049BB133111EB - 2 ** 64
_LEAF_SHIFT = 40  # element indices below 2**40, leaf positions above


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplication wraps, as in C)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _indices(x: torch.Tensor) -> torch.Tensor:
    """Row-major indices of ``x``'s elements in the whole tensor (its global shape for a DTensor), flat."""
    if not isinstance(x, DTensor):
        return torch.arange(x.numel(), device=x.device)
    if any(type(p) not in (Shard.real(), Replicate.real()) for p in x.placements):  # not _StridedShard
        raise ValueError(f"add_noise: DTensor leaves with placements {x.placements} are not supported (only "
                         "Shard and Replicate); reduce Partial gradients first")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    local = tree.local(x)
    index = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for dim in reversed(range(len(shape))):  # a few dims: broadcast one arange per dim
        ix = torch.arange(offset[dim], offset[dim] + shape[dim], device=local.device)
        index = index + (ix * stride).view([-1] + [1] * (len(shape) - dim - 1))
        stride *= x.shape[dim]
    return index.expand(shape).reshape(-1)


def _standard_normal(key: torch.Tensor, count: torch.Tensor, xs: list[torch.Tensor], positions: list[int]
                    ) -> list[torch.Tensor]:
    """Standard normal noise shaped like the local pieces of ``xs`` (float32), a function of ``(key, count)``
    and, per element, of its leaf's position in the tree and its index in the leaf.

    One hash over every element at once (under ``vmap``, a batched key or count gives batched noise).
    """
    base = _mix(key.to(torch.int64) * _GOLDEN + count.to(torch.int64))
    ids = torch.cat([_indices(x) + (i << _LEAF_SHIFT) for x, i in zip(xs, positions)])
    h = _mix(base + ids)
    # two 24-bit uniforms in (0, 1) from one hash, then Box-Muller
    u1 = ((_shr(h, 40) & 0xFFFFFF).to(torch.float32) + 0.5) / 2 ** 24
    u2 = ((h & 0xFFFFFF).to(torch.float32) + 0.5) / 2 ** 24
    z = torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)
    sizes = [tree.local(x).numel() for x in xs]
    return [n.view(tree.local(x).shape) for n, x in zip(z.split(sizes), xs)]


def _key(key) -> int | torch.Tensor:
    """The seed of ``key``: an int, or a 0-dim integer tensor kept as a tensor (never read on the host:
    ``inject_hyperparams`` rebuilds the transform with its int32 tensor of the key at every update)."""
    if key is None:
        return 0
    if isinstance(key, torch.Generator):
        return key.initial_seed()
    if isinstance(key, torch.Tensor) and key.ndim == 0 and not (key.is_floating_point() or key.is_complex()
                                                                 or key.dtype == torch.bool):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    raise TypeError(f"add_noise: key must be an int, a 0-dim integer tensor or a torch.Generator, got {key!r}")


# Not elementwise: an element's noise is a function of its index in the whole leaf (a local shard's
# indices would repeat the same noise on every shard).
@transform(elementwise=False)
def add_noise(eta: Scalar, gamma: Scalar, key: int | torch.Generator | None = None) -> GradientTransformation:
    r"""Adds annealed Gaussian noise to the updates (Optax's ``add_noise``).

    .. math:: u_t = g_t + \sigma_t\, \xi_t, \qquad \sigma_t^2 = \frac{\eta}{t^\gamma}, \qquad
        \xi_t \sim \mathcal{N}(0, I)

    for the :math:`t`-th update (:math:`t = 1, 2, \dots`). The noise is a function of ``key`` and
    :math:`t` (see the module docstring): the same key gives the same noise, and resuming from a saved
    state continues the sequence exactly. Its values differ from Optax's (another generator); its
    distribution is the same.

    Args:
      eta: :math:`\eta`, the variance of the first update's noise.
      gamma: :math:`\gamma`, the decay exponent of the variance.
      key: the noise's key: an int (Optax's ``key=0`` style), a 0-dim integer tensor or a
        ``torch.Generator`` (its initial seed); ``None``: 0.

    Returns:
      A transform with state :class:`AddNoiseState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.add_noise(eta=0.01, gamma=0.55, key=0)
        >>> g = {"w": torch.zeros(10_000)}
        >>> u, state = tx.update(g, tx.init(g))
        >>> round(float(u["w"].std()), 2), int(state.count)   # sqrt(0.01 / 1 ** 0.55)
        (0.1, 1)

    References:
      Neelakantan et al., `Adding Gradient Noise Improves Learning for Very Deep Networks
      <https://arxiv.org/abs/1511.06807>`_, 2015.
    """
    check_nonnegative("add_noise", eta=eta, gamma=gamma)
    seed = _key(key)

    def init_fn(params):
        device = param_device(params)
        return AddNoiseState(count=torch.zeros((), dtype=torch.int32, device=device),
                             rng_key=torch.as_tensor(seed, device=device).to(torch.int64, copy=True))

    def update_fn(updates, state, params=None):
        del params
        count = safe_increment_(state.count)
        flat = tree.flatten(updates)[0]
        positions = [i for i, x in enumerate(flat) if x is not None]  # frozen leaves keep others' noise
        (g,) = tree.align(updates)
        if not g:
            return updates, state._replace(count=count)
        std = torch.sqrt(eta / count.to(torch.float32) ** gamma)
        noise = _standard_normal(state.rng_key, count, g, positions)
        noise = [n.to(x.dtype) for n, x in zip(noise, g)]
        g = tree.add_([tree.local(x) for x in g], noise, std)  # on local pieces: placements kept
        return tree.put(updates, updates, g), AddNoiseState(count, state.rng_key)

    return GradientTransformation(init_fn, update_fn)


@transform(elementwise=None)
def noisy_sgd(learning_rate: LearningRate, eta: Scalar = 0.01, gamma: Scalar = 0.55,
              key: int | torch.Generator | None = None) -> GradientTransformation:
    r"""SGD with annealed Gaussian gradient noise (Optax's ``noisy_sgd``).

    .. math:: \theta_{t+1} = \theta_t - \eta_t^{lr} \left(g_t + \sigma_t \xi_t\right), \qquad
        \sigma_t^2 = \frac{\eta}{t^\gamma}

    Args:
      learning_rate: a number, a 0-dim tensor or a schedule.
      eta: :math:`\eta`, the variance of the first update's noise.
      gamma: :math:`\gamma`, the decay exponent of the variance.
      key: the noise's key (see :func:`add_noise`).

    Returns:
      ``chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate))``.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.noisy_sgd(0.1, eta=0.0)   # no noise: plain SGD
        >>> params = {"w": torch.ones(2)}
        >>> u, _ = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> u["w"].tolist()
        [-0.1..., -0.1...]

    References:
      Neelakantan et al., `Adding Gradient Noise Improves Learning for Very Deep Networks
      <https://arxiv.org/abs/1511.06807>`_, 2015.
    """
    check_learning_rate("noisy_sgd", learning_rate=learning_rate, eta=eta, gamma=gamma)
    return chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate))
