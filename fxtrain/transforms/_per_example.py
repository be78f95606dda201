"""Per-example clipping: updates with a leading batch axis, each example clipped, then summed.

The transforms here take per-example gradients (:func:`fxtrain.per_example_grads`: every leaf has a
leading batch axis) and return updates *without* that axis, so they go first in a stack. The result has
a new shape, so the donated and the pure paths run the same out-of-place code (nothing to write in
place); it is plain torch, so ``vmap``, ``grad`` and ``jvp`` see it.
"""

from __future__ import annotations

from typing import Any

import torch

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, check_nonnegative, describe, named

__all__ = ["per_example_global_norm_clip", "clip_sum"]


def per_example_global_norm_clip(l2_norm_clip: Any) -> GradientTransformation:
    r"""Clips each example's gradient to global L2 norm ``l2_norm_clip``, then sums over the batch axis.

    Optax's ``per_example_global_norm_clip`` as a transform (Optax ships it as a function of the
    gradients, :func:`clip_sum` here). For per-example gradients :math:`g_i` (every leaf of ``updates``
    has a leading batch axis of the same length :math:`B`):

    .. math:: u = \sum_{i=1}^{B} \min\left(1, \frac{c}{\lVert g_i \rVert}\right) g_i

    where :math:`\lVert g_i \rVert` is the L2 norm of example :math:`i`'s gradient over all leaves and
    :math:`c` is ``l2_norm_clip``; a multiplier that comes out NaN (``0 / 0``, a NaN norm) is 1, as in
    Optax. Stateless. DP-SGD (Abadi et al., 2016) adds Gaussian noise of scale
    ``noise_multiplier * l2_norm_clip`` to ``u`` and divides by :math:`B` (Optax's ``contrib.dpsgd``);
    for the mean without noise chain ``fx.scale(1 / B)``.

    Args:
      l2_norm_clip: the maximum L2 norm of each example's gradient: a number or a 0-dim tensor
        (differentiable, batchable).

    Returns:
      A :class:`fxtrain.GradientTransformation` whose ``update`` returns updates shaped like the params
      (the batch axis summed away). It is not elementwise (a norm over all leaves per example).

    Raises:
      ValueError: at update, a leaf without a leading batch axis or with another length than the others
        (named by path).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.per_example_global_norm_clip(1.25)
        >>> tx
        per_example_global_norm_clip(1.25)
        >>> grads = {"w": torch.tensor([[0.0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])}   # norms 0, 5, 5, 5
        >>> tx.update(grads, tx.init(None))[0]["w"].tolist()
        [1.75, 1.75, 1.75]

    References:
      Abadi et al., `Deep Learning with Differential Privacy <https://arxiv.org/abs/1607.00133>`_, 2016.
    """
    check_nonnegative("per_example_global_norm_clip", l2_norm_clip=l2_norm_clip)

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        flat, spec = tree.flatten(updates)
        present = [x for x in flat if x is not None]
        check_batch_axis(updates, flat)
        summed, _ = clip_sum(present, l2_norm_clip)
        it = iter(summed)
        return tree.unflatten(spec, [None if x is None else next(it) for x in flat]), state

    # Not @transform: that registers a public factory for the conformance test, whose checks (updates
    # shaped like the gradients) a transform that sums away an axis cannot pass. The label is formatted
    # when first read (a tensor's repr reads its value).
    label = lambda: f"per_example_global_norm_clip({describe(l2_norm_clip)})"  # noqa: E731
    return named(GradientTransformation(init_fn, update_fn), label)


def clip_sum(grads: list[torch.Tensor], l2_norm_clip: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Optax's ``per_example_global_norm_clip(grads, l2_norm_clip)`` function: ``(clipped_sum, num_clipped)``.

    ``grads``: a list of tensors, each with the same leading batch axis. Norms are accumulated in float32
    or wider; each sum is returned in its gradient's dtype. ``num_clipped`` is a 0-dim int64 tensor.

    >>> import torch
    >>> s, n = clip_sum([torch.tensor([[0.0, 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])], 0.0)
    >>> s[0].tolist(), int(n)
    ([0.0, 0.0, 0.0], 3)
    """
    if not grads:
        return [], torch.zeros((), dtype=torch.int64)
    acc = torch.promote_types(torch.float32, grads[0].dtype)
    n = grads[0].shape[0]
    sq = sum((g.reshape(n, -1).to(acc) ** 2).sum(1) for g in grads)
    # Optax: nan_to_num(min(c / norm, 1), nan=1). Zero norms are replaced before the sqrt, so the gradient
    # of this expression stays finite there (sqrt'(0) = inf times the zero from `where` would be NaN).
    # A zero (or NaN) norm gives 1, as Optax's c / 0 does.
    positive = sq > 0
    norms = torch.where(positive, sq, torch.ones_like(sq)).sqrt()
    multipliers = torch.where(positive, torch.nan_to_num(torch.clamp(l2_norm_clip / norms, max=1.0), nan=1.0), 1.0)
    num_clipped = (multipliers < 1.0).sum()
    summed = [torch.tensordot(multipliers.to(torch.promote_types(acc, g.dtype)), g.to(acc), dims=1).to(g.dtype)
              for g in grads]
    return summed, num_clipped


def check_batch_axis(updates: Any, flat: list, owner: str = "per_example_global_norm_clip") -> None:
    """Every leaf has a leading batch axis, all of one length (metadata only); errors name ``owner`` and the
    leaf. Shared by the transforms that take per-example gradients (``per_example_layer_norm_clip``, DP-SGD)."""
    paths, first = None, None
    for i, x in enumerate(flat):
        if x is None:
            continue
        n = x.shape[0] if x.ndim else None
        if first is None and n is not None:
            first = (n, i)
        if n is None or n != first[0]:
            paths = tree.paths(updates)
            what = "has no batch axis (0-dim)" if n is None else \
                f"has {n} examples on axis 0, '{paths[first[1]]}' has {first[0]}"
            owned = f"{owner} expects" if owner else "expects"
            raise ValueError(f"{owned} per-example gradients (a leading batch axis on every leaf, see "
                             f"fx.per_example_grads): '{paths[i]}' {what}")
