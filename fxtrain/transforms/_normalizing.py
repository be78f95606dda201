"""Transforms that normalize by a norm, an RMS or a mean: per block (each leaf), per unit, or global.

``clip_by_block_rms``, ``adaptive_grad_clip``, ``centralize``, ``normalize_by_update_norm``,
``scale_by_param_block_norm``, ``scale_by_param_block_rms``, ``scale_by_distance_over_gradients`` and
``per_example_layer_norm_clip`` (Optax's math, state and defaults).

A *block* is one leaf of the tree (a weight matrix, a bias). Per-block norms come from one
``torch._foreach_norm`` (in place, a donated step) or one ``torch.linalg.vector_norm`` per leaf (out of
place, under ``torch.func`` and autograd: differentiable, batchable), stacked into one vector, so the
per-block math is a few kernels whatever the number of leaves. A DTensor leaf's norm is the full tensor's
(DTensor reduces its pieces: one all-reduce per DTensor leaf); the coefficients are then plain tensors
that scale the local pieces, so every placement (``Partial`` too: scaling is linear) is kept.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import torch

from fxtrain import distributed, tree
from fxtrain._base import (EmptyState, GradientTransformation, Updates, check_needs_params, check_nonnegative, describe,
                           named, transform)
from fxtrain._deferred import DTensor
from fxtrain.transforms._moments import Scalar, as_dtype, param_device
from fxtrain.transforms._per_example import check_batch_axis, clip_sum

__all__ = [
    "clip_by_block_rms", "adaptive_grad_clip", "centralize", "normalize_by_update_norm",
    "scale_by_param_block_norm", "scale_by_param_block_rms", "ScaleByDistanceOverGradientsState",
    "scale_by_distance_over_gradients", "per_example_layer_norm_clip",
]


# --- per-block norms ------------------------------------------------------------------------------

def _acc(xs: Sequence[torch.Tensor]) -> torch.dtype:
    """Norms accumulate in float32, float64 if a leaf is (complex leaves: their real dtype)."""
    wide = any(x.dtype in (torch.float64, torch.complex128) for x in xs)
    return torch.float64 if wide else torch.float32


def _real_views(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Complex leaves as real views (``torch.view_as_real``, no copy): same norm, and one norm dtype fits all."""
    return [torch.view_as_real(x) if x.is_complex() else x for x in xs]



def block_norms(xs: Sequence[torch.Tensor], *, rms: bool = False) -> torch.Tensor:
    """The L2 norm of each tensor of ``xs`` (a DTensor's full norm), as one plain vector; with ``rms``, the
    root mean square ``sqrt(mean(|x|^2))`` (the norm over ``sqrt(numel)``).

    In place (a donated update, or ``no_grad``): one ``torch._foreach_norm``. Out of place: one
    ``torch.linalg.vector_norm`` per leaf, whose gradient is 0 at 0 (not NaN). float32 or wider.

    >>> block_norms([torch.tensor([3.0, 4.0]), torch.ones(2, 2)]).tolist()
    [5.0, 2.0]
    >>> block_norms([torch.tensor([3.0, 4.0]), torch.ones(2, 2)], rms=True).tolist()
    [3.535533905029297, 1.0]
    """
    acc = _acc(xs)
    roots = [math.sqrt(x.numel()) for x in xs] if rms else None
    if tree.is_functional():
        norms = [tree.full(torch.linalg.vector_norm(x, dtype=None if x.is_complex() else acc)) for x in xs]
        if rms:
            norms = [n / r for n, r in zip(norms, roots)]
    else:
        norms = [tree.full(n) for n in torch._foreach_norm(_real_views(xs), 2, dtype=acc)]
        if rms:
            torch._foreach_div_(norms, roots)  # Python numbers: nothing to copy to the device
    return torch.stack(norms).to(acc)


def _safe_min(x: torch.Tensor, lo: Scalar) -> torch.Tensor:
    """``lo`` where ``x <= lo``, else ``x`` (Optax's ``safe_norm``: the gradient is 0 below ``lo``, not NaN)."""
    return torch.where(x <= lo, lo, x)


def _scale_blocks(updates: Updates, local: list[torch.Tensor], coefs: torch.Tensor, *, divide: bool = False
                  ) -> Updates:
    """``updates`` with local piece ``i`` times (or over) ``coefs[i]``; written in place when donated."""
    cs = list(coefs.unbind())
    return tree.put(updates, updates, tree.div_(local, cs) if divide else tree.scale_(local, cs))


def _empty_init(params: Any) -> EmptyState:
    del params
    return EmptyState()


# --- per-block clipping and scaling ---------------------------------------------------------------

@transform(elementwise=False)
def clip_by_block_rms(threshold: Scalar) -> GradientTransformation:
    r"""Scales each block (leaf) down so that its RMS is at most ``threshold`` (Optax's ``clip_by_block_rms``).

    .. math:: u = \frac{g}{\max\left(1, \operatorname{rms}(g) / \tau\right)}, \qquad
        \operatorname{rms}(g) = \sqrt{\operatorname{mean}(|g|^2)} \text{ over the leaf.}

    Args:
      threshold: the largest RMS :math:`\tau` a leaf may have (a number or a 0-dim tensor, >= 0).

    Returns:
      A stateless transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.clip_by_block_rms(1.0)
        >>> u, _ = tx.update({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.5])}, tx.init(None))
        >>> [round(x, 4) for x in u["a"].tolist()], u["b"].tolist()   # rms(a) = 3.54 is brought to 1
        ([0.8485, 1.1314], [0.5])
    """
    check_nonnegative("clip_by_block_rms", threshold=threshold)

    def update_fn(updates, state, params=None):
        del params
        g = tree.leaves(updates)
        if not g:
            return updates, state
        denominators = torch.clamp_min(block_norms(g, rms=True) / threshold, 1.0)
        return _scale_blocks(updates, distributed.local_leaves(updates), denominators, divide=True), state

    return GradientTransformation(_empty_init, update_fn)


@transform(elementwise=False)
def scale_by_param_block_norm(min_scale: Scalar = 1e-3) -> GradientTransformation:
    r"""Multiplies each block's update by the L2 norm of its param (Optax's ``scale_by_param_block_norm``).

    .. math:: u = g \cdot \max\left(\lVert p \rVert_2, s_{min}\right) \text{ per leaf.}

    Args:
      min_scale: the smallest factor :math:`s_{min}` (a number or a 0-dim tensor, >= 0).

    Returns:
      A stateless transform; ``update`` needs the params.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_param_block_norm()
        >>> params = {"w": torch.tensor([3.0, 4.0]), "b": torch.zeros(2)}
        >>> u, _ = tx.update({"w": torch.ones(2), "b": torch.ones(2)}, tx.init(params), params)
        >>> u["w"].tolist(), u["b"].tolist()
        ([5.0, 5.0], [0.0010000000474974513, 0.0010000000474974513])
    """
    check_nonnegative("scale_by_param_block_norm", min_scale=min_scale)

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_param_block_norm", params)
        g, p = tree.align(updates, params, what="params")
        if not g:
            return updates, state
        return _scale_blocks(updates, distributed.local_leaves(updates), _safe_min(block_norms(p), min_scale)), state

    return GradientTransformation(_empty_init, update_fn)


@transform(elementwise=False)
def scale_by_param_block_rms(min_scale: Scalar = 1e-3) -> GradientTransformation:
    r"""Multiplies each block's update by the RMS of its param (Optax's ``scale_by_param_block_rms``).

    .. math:: u = g \cdot \max\left(\sqrt{\operatorname{mean}(|p|^2)}, s_{min}\right) \text{ per leaf.}

    Args:
      min_scale: the smallest factor :math:`s_{min}` (a number or a 0-dim tensor, >= 0).

    Returns:
      A stateless transform; ``update`` needs the params.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_param_block_rms()
        >>> params = {"w": torch.tensor([3.0, -3.0])}
        >>> u, _ = tx.update({"w": torch.ones(2)}, tx.init(params), params)
        >>> u["w"].tolist()
        [3.0, 3.0]
    """
    check_nonnegative("scale_by_param_block_rms", min_scale=min_scale)

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_param_block_rms", params)
        g, p = tree.align(updates, params, what="params")
        if not g:
            return updates, state
        return _scale_blocks(updates, distributed.local_leaves(updates), _safe_min(block_norms(p, rms=True), min_scale)), state

    return GradientTransformation(_empty_init, update_fn)


@transform(elementwise=False)
def normalize_by_update_norm(scale_factor: Scalar = 1.0, eps: Scalar = 1e-6) -> GradientTransformation:
    r"""Divides the updates by their global L2 norm (Optax's ``normalize_by_update_norm``).

    .. math:: u = \frac{s\, g}{\lVert g \rVert_2 + \epsilon}, \qquad \lVert g \rVert_2 \text{ over all leaves.}

    The norm is :func:`fxtrain.global_norm`'s (DTensor leaves on any meshes and placements).

    Args:
      scale_factor: the factor :math:`s` (any sign: ``-1.0`` descends; a number or a 0-dim tensor).
      eps: added to the norm, so that zero updates stay zero (>= 0).

    Returns:
      A stateless transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.normalize_by_update_norm(scale_factor=-1.0, eps=0.0)
        >>> tx
        normalize_by_update_norm(scale_factor=-1.0, eps=0.0)
        >>> u, _ = tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init(None))
        >>> [round(x, 4) for x in u["a"].tolist() + u["b"].tolist()]
        [-0.6, -0.8]
    """
    # scale_factor may be negative: only its form (a number or a 0-dim float tensor) is checked
    sign_free = abs(scale_factor) if isinstance(scale_factor, (int, float)) else scale_factor
    check_nonnegative("normalize_by_update_norm", scale_factor=sign_free, eps=eps)

    def update_fn(updates, state, params=None):
        del params
        if not tree.leaves(updates):
            return updates, state
        # Complex leaves as real views: the norm engine's packed path reads real values only (torch 2.13).
        denominator = (distributed.global_norm(_real_views(tree.leaves(updates))) + eps) / scale_factor
        return tree.put(updates, updates, tree.div_(distributed.local_leaves(updates), denominator)), state

    return GradientTransformation(_empty_init, update_fn)


# --- per-unit: adaptive gradient clipping and centralization ---------------------------------------

def _unit_axes(shape: torch.Size, axis: int | tuple[int, ...] | None, path: str) -> tuple[int, ...]:
    """The axes a unit's norm reduces (Optax's ``unitwise_norm`` conventions; JAX layouts, see AGC)."""
    ndim = len(shape)
    if axis is not None:
        return (axis,) if isinstance(axis, int) else tuple(axis)
    if sum(d != 1 for d in shape) <= 1:  # scalars and vectors (after squeezing size-1 dims): the whole leaf
        return tuple(range(ndim))
    if ndim in (2, 3):  # dense (in, out) and multi-head dense kernels
        return (0,)
    if ndim in (4, 5):  # convolution kernels, (H, W, I, O) and (D, H, W, I, O)
        return tuple(range(ndim - 1))
    raise ValueError(f"adaptive_grad_clip: the param at '{path}' has shape {tuple(shape)}; with more than 5 "
                     "dims pass axis= (the dims one unit's norm is taken over)")


def _unit_norms(xs: list[torch.Tensor], axes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The L2 norm of each unit, keeping dims (broadcastable against the leaf). One kernel per leaf: the
    reduced axes differ by leaf, and no foreach op reduces over axes."""
    acc = _acc(xs)
    return [torch.linalg.vector_norm(x, dim=a, keepdim=True, dtype=None if x.is_complex() or x.dtype == acc else acc)
            for x, a in zip(xs, axes)]


@transform(elementwise=False)
def adaptive_grad_clip(clipping: Scalar, eps: Scalar = 1e-3, axis: int | tuple[int, ...] | None = None
                       ) -> GradientTransformation:
    r"""Clips each unit's update to at most ``clipping`` times its param's norm (AGC; Optax's).

    For each unit (a slice of a leaf, see below) with update :math:`g` and param :math:`p`:

    .. math::
        m = c \max(\lVert p \rVert, \epsilon), \qquad
        u = g \text{ if } \lVert g \rVert < m \text{, else } g \,\frac{m}{\max(\lVert g \rVert, 10^{-6})}.

    Units follow Optax's ``unitwise_norm``, written for JAX layouts: a vector (or scalar) is one unit; a
    2-D or 3-D leaf reduces axis 0 (a JAX dense kernel ``(in, out)``: one unit per output); 4-D and 5-D
    leaves (convolution kernels ``(H, W, I, O)``, ``(D, H, W, I, O)``) reduce all but the last axis.
    **torch layouts differ**: ``nn.Linear.weight`` is ``(out, in)``, so pass ``axis=1`` for one unit per
    output neuron there, and ``axis=(1, 2, 3)`` for ``nn.Conv2d.weight`` ``(O, I, H, W)``.

    Args:
      clipping: the largest ratio :math:`c` of update norm to param norm (a number or a 0-dim tensor).
      eps: the smallest param norm :math:`\epsilon`, so zero-initialized params can still move.
      axis: the axes one unit's norm is taken over, for every leaf; ``None``: the conventions above
        (leaves of more than 5 dims then need ``axis``).

    Returns:
      A stateless transform; ``update`` needs the params.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.adaptive_grad_clip(0.5)
        >>> params, grads = {"w": torch.ones(2, 2)}, {"w": torch.tensor([[3.0, 0.1], [4.0, 0.1]])}
        >>> u, _ = tx.update(grads, tx.init(params), params)   # column norms 5 and 0.14; the bound is 0.71
        >>> [[round(x, 4) for x in row] for row in u["w"].tolist()]
        [[0.4243, 0.1], [0.5657, 0.1]]

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without Normalization
      <https://arxiv.org/abs/2102.06171>`_, 2021.
    """
    check_nonnegative("adaptive_grad_clip", clipping=clipping, eps=eps)

    def update_fn(updates, state, params=None):
        check_needs_params("adaptive_grad_clip", params)
        g, p = tree.align(updates, params, what="params")
        if not g:
            return updates, state
        present = [path for path, x in zip(tree.paths(updates), tree.flatten(updates)[0]) if x is not None]
        axes = [_unit_axes(x.shape, axis, path) for x, path in zip(g, present)]
        g_norm, p_norm = _unit_norms(g, axes), _unit_norms(p, axes)
        # Small per-unit tensors of per-leaf shapes, and torch.where has no foreach form: one expression per
        # leaf. The factor is exactly 1 where nothing is clipped, so g * factor is Optax's select.
        bounds = [clipping * torch.clamp_min(n, eps) for n in p_norm]
        factors = [torch.where(n < m, 1.0, m / torch.clamp_min(n, 1e-6)) for n, m in zip(g_norm, bounds)]
        return tree.put(updates, updates, _mul_(g, factors)), state

    return GradientTransformation(_empty_init, update_fn)


def _placed_like(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``r`` with ``x``'s placements: DTensor may choose others for a product (Replicate for a shard of one
    element); going back from those is a local slice."""
    if isinstance(r, DTensor) and r.placements != x.placements:
        return r.redistribute(x.device_mesh, x.placements)
    return r


def _mul_(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """``xs[i] * ys[i]``, ``ys`` broadcasting (in place when donated), keeping each ``xs`` dtype."""
    return _binary_(torch.mul, torch._foreach_mul_, xs, ys)


def _sub_(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """``xs[i] - ys[i]``, ``ys`` broadcasting (in place when donated), keeping each ``xs`` dtype."""
    return _binary_(torch.sub, torch._foreach_sub_, xs, ys)


def _binary_(op, foreach_op_, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain leaves take one foreach call; DTensor leaves go through DTensor dispatch one by one, which
    places each (reduced, maybe ``Partial``) operand against its leaf; results keep the leaf's placements."""
    if tree.is_functional():
        return [_placed_like(op(x, y).to(x.dtype), x) for x, y in zip(xs, ys)]
    plain = [i for i, x in enumerate(xs) if not isinstance(x, DTensor)]
    if plain:
        foreach_op_([xs[i] for i in plain], [ys[i].to(xs[i].dtype) for i in plain])
    for x, y in zip(xs, ys):  # out of place, then into the local piece: DTensor refuses some in-place
        if isinstance(x, DTensor):  # placements (a 1-element Shard(0) times a Replicate factor)
            tree.local(x).copy_(tree.local(_placed_like(op(x, y).to(x.dtype), x)))
    return xs


@transform(elementwise=False)
def centralize() -> GradientTransformation:
    r"""Subtracts from each update its mean over all axes but the first (gradient centralization; Optax's).

    .. math:: u_{i,\dots} = g_{i,\dots} - \operatorname{mean}_{\dots}\, g_{i,\dots}
        \text{ for leaves of 2 dims or more; other leaves pass unchanged.}

    Returns:
      A stateless transform.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.centralize()
        >>> u, _ = tx.update({"w": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])}, tx.init(None))
        >>> u["w"].tolist()
        [[-1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]]

    References:
      Yong et al., `Gradient Centralization: A New Optimization Technique for Deep Neural Networks
      <https://arxiv.org/abs/2004.01461>`_, 2020.
    """
    def update_fn(updates, state, params=None):
        del params
        g = tree.leaves(updates)
        multi = [x for x in g if x.ndim > 1]
        # One mean per leaf (no foreach op reduces over axes); DTensor reduces across shards if it must.
        means = [x.mean(dim=tuple(range(1, x.ndim)), keepdim=True) for x in multi]
        centered = iter(_sub_(multi, means))
        return tree.put(updates, updates, [next(centered) if x.ndim > 1 else x for x in g]), state

    return GradientTransformation(_empty_init, update_fn)


# --- DoG ------------------------------------------------------------------------------------------

class ScaleByDistanceOverGradientsState(NamedTuple):
    """State of :func:`scale_by_distance_over_gradients` (Optax's field names).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.scale_by_distance_over_gradients().init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.ScaleByDistanceOverGradientsState), state._fields
        (True, ('max_dist', 'grad_sum_of_squares', 'init_params'))
    """

    max_dist: Updates  # per leaf, 0-dim (param dtype): the largest distance from the initial params so far
    grad_sum_of_squares: Updates  # per leaf, shape (1,), float32: the sum of squared gradient norms
    init_params: Updates  # the initial params, in param_dtype


@transform(elementwise=False)
def scale_by_distance_over_gradients(reps_rel: Scalar = 1e-6, eps: Scalar = 1e-8,
                                     param_dtype: torch.dtype | str | None = torch.float32,
                                     global_scale: Scalar = 1.0) -> GradientTransformation:
    r"""Layer-wise DoG, a learning-rate-free step size: distance travelled over gradient norms (Optax's).

    Per leaf (Layer-wise DoG, "LDoG" in the paper), with :math:`p_0` the initial params:

    .. math::
        d_t = \max\left(d_{t-1}, \lVert p_t - p_0 \rVert\right), \quad d_0 = r_{rel} (1 + \lVert p_0 \rVert),
        \qquad G_t = G_{t-1} + \lVert g_t \rVert^2, \qquad
        u_t = s \frac{d_t}{\sqrt{G_t + \epsilon}}\, g_t.

    Keeps one copy of the params (``init_params``) and two scalars per leaf. The authors recommend
    averaging the iterates. Use ``global_scale=-1.0`` to descend (or chain ``scale(-1.0)``).

    Args:
      reps_rel: sets the first step's distance :math:`d_0`; the paper recommends ``1e-4`` for models
        with batch norm, ``1e-6`` otherwise.
      eps: added under the square root, against division by zero.
      param_dtype: dtype of ``init_params`` (a ``torch.dtype`` or its name; ``None``: the params').
      global_scale: the factor :math:`s`, typically ``1.0`` or ``-1.0``.

    Returns:
      A transform with state :class:`ScaleByDistanceOverGradientsState`; ``update`` needs the params.
      Updates keep the gradients' dtype and shape (Optax's 0-dim leaves come back with shape ``(1,)``).

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.scale_by_distance_over_gradients(reps_rel=0.1, eps=0.0)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> u, state = tx.update({"w": torch.tensor([1.0, 0.0])}, tx.init(params), params)
        >>> [round(x, 4) for x in u["w"].tolist()]   # d_0 = 0.1 * (1 + 5), G_1 = 1
        [0.6, 0.0]

    References:
      Ivgi et al., `DoG is SGD's Best Friend: A Parameter-Free Dynamic Step Size Schedule
      <https://arxiv.org/abs/2302.12022>`_, 2023.
    """
    check_nonnegative("scale_by_distance_over_gradients", reps_rel=reps_rel, eps=eps)
    sign_free = abs(global_scale) if isinstance(global_scale, (int, float)) else global_scale
    check_nonnegative("scale_by_distance_over_gradients", global_scale=sign_free)
    param_dtype = as_dtype(param_dtype, "scale_by_distance_over_gradients: param_dtype")

    def init_fn(params):
        device = param_device(params)
        return ScaleByDistanceOverGradientsState(
            max_dist=tree.map(lambda x: (reps_rel * (1 + tree.full(torch.linalg.vector_norm(x)))).to(x.dtype), params),
            grad_sum_of_squares=tree.map(lambda x: torch.zeros(1, dtype=torch.float32, device=device), params),
            init_params=tree.clone(tree.cast(params, param_dtype)))

    def update_fn(updates, state, params=None):
        check_needs_params("scale_by_distance_over_gradients", params)
        g, p, d, sos, p0 = tree.align(updates, params, state.max_dist, state.grad_sum_of_squares,
                                      state.init_params)
        if not g:
            return updates, state
        # A temporary p - p0 (promoted where param_dtype differs from the params').
        diff = [a - b for a, b in zip(p, p0)] if tree.is_functional() else torch._foreach_sub(p, p0)
        acc = _acc(g)
        new_d = torch.maximum(torch.stack(d).to(acc), block_norms(diff).to(acc))
        new_sos = torch.stack(sos).to(acc) + block_norms(g).to(acc).square().unsqueeze(1)  # (leaves, 1)
        eta = global_scale * (new_d / torch.sqrt(new_sos.squeeze(1) + eps))
        d, sos = tree.copy_(d, list(new_d.unbind())), tree.copy_(sos, list(new_sos.unbind()))
        g = _scale_blocks(updates, distributed.local_leaves(updates), eta)
        return g, ScaleByDistanceOverGradientsState(
            tree.put(state.max_dist, updates, d), tree.put(state.grad_sum_of_squares, updates, sos),
            state.init_params)

    return GradientTransformation(init_fn, update_fn)


# --- per-example, per-layer clipping --------------------------------------------------------------

def layer_clip_sum(grads: list[torch.Tensor], global_l2_norm_clip: Scalar, uniform: bool = True
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Optax's ``per_example_layer_norm_clip(grads, global_l2_norm_clip, uniform)`` function.

    Each of the ``K`` layers (tensors of ``grads``, each with the same leading batch axis) is clipped per
    example as :func:`fxtrain.transforms._per_example.clip_sum` does, to its own bound: ``C / sqrt(K)``
    (``uniform``) or ``C * sqrt(D_i / D)`` (``D_i``: the layer's parameters, ``D``: all of them).

    Returns:
      ``(clipped_sums, num_clipped)``: the per-example sums (no batch axis) and, per layer, a 0-dim int64
      count of the examples clipped.

    >>> import torch
    >>> sums, n = layer_clip_sum([torch.tensor([[0.5], [1.5], [-2.0], [3.0]]), torch.ones(4, 18)], 2 ** 0.5)
    >>> sums[0].tolist(), [int(c) for c in n]
    ([1.5], [3, 4])
    """
    if not grads:
        return [], []
    if uniform:
        fractions = [1.0 / len(grads)] * len(grads)
    else:
        total = sum(g[0].numel() for g in grads)
        fractions = [g[0].numel() / total for g in grads]
    # One clip_sum per layer: each layer's per-example norms are their own reduction (no foreach op).
    out = [clip_sum([g], global_l2_norm_clip * f ** 0.5) for g, f in zip(grads, fractions)]
    return [s[0] for s, _ in out], [n for _, n in out]


def per_example_layer_norm_clip(global_l2_norm_clip: Scalar, uniform: bool = True) -> GradientTransformation:
    r"""Clips each example's gradient layer by layer, then sums over the batch axis (Optax's, as a transform).

    Optax ships ``per_example_layer_norm_clip`` as a function of the gradients (:func:`layer_clip_sum`
    here, which also counts the clipped examples). For per-example gradients (every leaf has a leading
    batch axis of length :math:`B`; see :func:`fxtrain.per_example_grads`) and :math:`K` leaves (layers):

    .. math::
        u_k = \sum_{b=1}^{B} \min\left(1, \frac{C_k}{\lVert g_{k,b} \rVert}\right) g_{k,b}, \qquad
        C_k = \frac{C}{\sqrt K} \text{ (uniform) or } C \sqrt{D_k / D},

    :math:`D_k` being layer :math:`k`'s number of parameters and :math:`D` the total. A multiplier that
    comes out NaN (``0 / 0``) is 1, as in Optax. With one leaf it is
    :func:`fxtrain.per_example_global_norm_clip`. Stateless; goes first in a chain (the updates it returns
    have no batch axis).

    Args:
      global_l2_norm_clip: the overall clip norm :math:`C` (a number or a 0-dim tensor).
      uniform: every layer gets :math:`C / \sqrt K`; otherwise a share proportional to its size.

    Returns:
      A transform whose ``update`` returns updates shaped like the params. Not elementwise.

    Raises:
      ValueError: at update, a leaf without a leading batch axis or with another length than the others.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.per_example_layer_norm_clip(2 ** 0.5)   # two layers: each clipped to norm 1
        >>> grads = {"a": torch.tensor([[0.5], [1.5], [-2.0], [3.0]]), "b": torch.zeros(4, 2)}
        >>> u, _ = tx.update(grads, tx.init(None))
        >>> u["a"].tolist(), u["b"].tolist()
        ([1.5], [0.0, 0.0])

    References:
      McMahan et al., `Learning Differentially Private Recurrent Language Models
      <https://arxiv.org/abs/1710.06963>`_, 2017.
    """
    check_nonnegative("per_example_layer_norm_clip", global_l2_norm_clip=global_l2_norm_clip)

    def update_fn(updates, state, params=None):
        del params
        flat, spec = tree.flatten(updates)
        check_batch_axis(updates, flat, "per_example_layer_norm_clip")
        summed, _ = layer_clip_sum([x for x in flat if x is not None], global_l2_norm_clip, uniform)
        it = iter(summed)
        return tree.unflatten(spec, [None if x is None else next(it) for x in flat]), state

    # Not @transform, like per_example_global_norm_clip: the conformance checks (updates shaped like the
    # gradients) do not fit a transform that sums away an axis. The label is formatted when first read.
    def label() -> str:
        extra = "" if uniform else ", uniform=False"
        return f"per_example_layer_norm_clip({describe(global_l2_norm_clip)}{extra})"

    return named(GradientTransformation(_empty_init, update_fn), label)


