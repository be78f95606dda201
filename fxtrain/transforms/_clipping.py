"""Clipping transforms: ``clip`` (by value) and ``clip_by_global_norm``.

Both work on plain tensors and on DTensor leaves. The norm and every collective behind it live in
:mod:`fxtrain.distributed`; this module only turns the norm into Optax's clipping rule.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from fxtrain import distributed, tree
from fxtrain._base import EmptyState, GradientTransformation, check_nonnegative, transform
from fxtrain.transforms import _fused


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: the pre-clip global norm of the last update (0-dim).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.clip_by_global_norm(1.0).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ClipByGlobalNormState), state._fields
        (True, ('grad_norm',))
    """

    grad_norm: torch.Tensor

    def report(self) -> dict[str, torch.Tensor]:
        """``{"grad_norm": ...}`` for :func:`fxtrain.train_step`'s metrics."""
        return {"grad_norm": self.grad_norm}


@transform(elementwise=False)
def clip_by_global_norm(max_norm: float, *, groups: Sequence[Any] = ()) -> GradientTransformation:
    """Scales updates down so that their global L2 norm is at most ``max_norm`` (Optax's ``clip_by_global_norm``).

    With ``g = ||updates||_2`` over every element of every leaf (DTensor shards on any mix of meshes
    included, see :func:`fxtrain.distributed.global_norm`)::

        updates <- updates                   if g < max_norm
        updates <- updates * max_norm / g    otherwise

    The coefficient is a 0-dim tensor identical on every rank (no host sync); it multiplies the local
    pieces in place, so placements (``Partial`` too: the scaling is linear), meshes, shapes and strides are
    kept. A non-finite norm gives non-finite updates on every rank, as in Optax.

    Args:
      max_norm: the largest global norm an update may have (>= 0).
      groups: process groups (or 1-D meshes) whose ranks hold disjoint parameters, such as pipeline
        stages; see :func:`fxtrain.distributed.global_sum_sq`. Not needed for DTensor leaves.

    Returns:
      A transform whose state :class:`ClipByGlobalNormState` holds the pre-clip norm, reported as
      ``grad_norm`` in :func:`fxtrain.train_step`'s metrics.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.clip_by_global_norm(1.0)
        >>> tx
        clip_by_global_norm(1.0)
        >>> u, s = tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init(None))
        >>> u["a"].tolist(), u["b"].tolist(), float(s.grad_norm)
        ([0.6000000238418579], [0.800000011920929], 5.0)

    References:
      Pascanu et al., `On the difficulty of training Recurrent Neural Networks
      <https://arxiv.org/abs/1211.5063>`_, 2012
    """
    check_nonnegative("clip_by_global_norm", max_norm=max_norm)

    def init_fn(params):
        # The norm's dtype and device, so the state keeps them from init on: float64 only for float64 trees; on
        # the params' device, where a donated step writes the norm into it (on the host, that copy would make
        # every step on a GPU wait for it).
        leaves = [x for x in tree.leaves(params) if isinstance(x, torch.Tensor)]
        wide = any(x.dtype == torch.float64 for x in leaves)
        device = leaves[0].device if leaves else None
        return ClipByGlobalNormState(torch.zeros((), dtype=torch.float64 if wide else torch.float32, device=device))

    def update_fn(updates, state, params=None):
        del params, state
        local = distributed.local_leaves(updates)
        g = distributed.global_norm(updates, groups=groups)
        # Optax: select(g < max_norm, t, t / g * max_norm). One 0-dim coefficient, chosen on device.
        # A number max_norm enters as a tensor: under torch.func.jvp (torch 2.13) `number / 0-dim tensor`
        # gets a float64 tangent, which later ops (lerp) refuse; the division rounds the same either way.
        bound = max_norm if isinstance(max_norm, torch.Tensor) else torch.full_like(g, max_norm)
        coef = torch.where(g < max_norm, 1.0, bound / g)
        return tree.put(updates, updates, tree.scale_(local, coef)), ClipByGlobalNormState(g)

    return _fused.declare(GradientTransformation(init_fn, update_fn), "clip_by_global_norm", groups=groups,
                          max_norm=max_norm)


@transform(elementwise=True)
def clip(max_delta: float) -> GradientTransformation:
    """Clips every element of the updates to ``[-max_delta, max_delta]`` (Optax's ``clip``).

    ``updates <- min(max(updates, -max_delta), max_delta)`` elementwise; NaN stays NaN. DTensor leaves are
    clipped on their local pieces; a ``Partial`` gradient is reduced first (clamping is not linear, so
    clamping the partial sums would be wrong) and comes back ``Replicate`` on those mesh dims.

    Args:
      max_delta: the largest absolute value an update element may have (>= 0).

    Returns:
      A stateless transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.clip(1.0)
        >>> tx.update({"w": torch.tensor([-3.0, 0.5, 2.0])}, tx.init(None))[0]["w"].tolist()
        [-1.0, 0.5, 1.0]
    """
    check_nonnegative("clip", max_delta=max_delta)

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        updates = distributed.reduce_partials(updates)
        local = distributed.local_leaves(updates)
        return tree.put(updates, updates, tree.clamp_(local, -max_delta, max_delta)), state

    return GradientTransformation(init_fn, update_fn)
