"""Per-example gradients: ``torch.func.vmap(torch.func.grad(loss))`` over the batch's leading dim.

The building block of per-example clipping and DP-SGD (Abadi et al., 2016), the way JAX users write
``jax.vmap(jax.grad(loss), in_axes=(None, 0))``. The gradients have a leading batch axis; a transform
that reduces it (:func:`fxtrain.per_example_global_norm_clip`, which clips each example's gradient and
sums them) goes first in the stack, then the stack runs as usual on the reduced updates:

    >>> import torch, fxtrain as fx
    >>> def loss_fn(params, batch):
    ...     x, y = batch
    ...     return ((x @ params["w"] - y) ** 2).mean()
    >>> params = {"w": torch.zeros(3)}
    >>> batch = (torch.eye(3) * 10, torch.ones(3))   # 3 examples, each gradient of norm 20
    >>> grads = fx.per_example_grads(loss_fn)(params, batch)
    >>> grads["w"].shape                               # one gradient per example
    torch.Size([3, 3])
    >>> tx = fx.chain(fx.per_example_global_norm_clip(1.0), fx.scale(-0.1 / 3))  # clip, sum, mean, step
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> [round(u, 4) for u in fx.apply_updates(params, updates)["w"].tolist()]
    [0.0333, 0.0333, 0.0333]

``train_step`` has no per-example mode: compose :func:`per_example_grads` with ``tx.update`` (or
:func:`fxtrain.update_`) and :func:`fxtrain.apply_updates` as above; docs/functional-step.md shows a full step.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from fxtrain import tree
from fxtrain._deferred import DTensor

__all__ = ["per_example_grads"]


def per_example_grads(loss_fn: Callable, *, has_aux: bool = False) -> Callable:
    """Builds ``grads_fn(params, batch) -> grads``: the gradient of ``loss_fn`` for each example, stacked.

    Each example is the slice ``i`` along dim 0 of every tensor leaf of ``batch`` (a tensor, a tuple of
    tensors or any tree; non-tensor leaves go unchanged to every example). ``loss_fn`` sees it as a batch
    of one (the leading dim kept, of size 1), so the ``loss_fn`` of :func:`fxtrain.train_step` works
    unchanged. Built on ``torch.func.vmap(torch.func.grad(...), in_dims=(None, 0))``: it composes with an
    outer ``vmap`` (an ensemble) or ``grad``.

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning a 0-dim floating-point tensor, or ``(loss, aux)``
        with ``has_aux=True`` (``aux`` a tree of tensors).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``grads_fn`` then returns ``(grads, aux)`` with each
        tensor of ``aux`` stacked over examples.

    Returns:
      ``grads_fn``. Its ``grads`` are shaped like ``params`` with a leading batch axis on every leaf
      (``None`` leaves stay ``None``); params the loss does not use get zeros, as in ``jax.grad``.

    Raises:
      ValueError: ``batch`` has no tensor leaf, leaves of different lengths along dim 0, or the params
        hold DTensors (``torch.func.grad`` does not support them).

    Example:
        >>> import torch, fxtrain as fx
        >>> loss_fn = lambda p, b: (p["w"] * b).sum()
        >>> fx.per_example_grads(loss_fn)({"w": torch.ones(2)}, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))["w"]
        tensor([[1., 2.],
                [3., 4.]])
    """
    name = getattr(loss_fn, "__qualname__", None) or repr(loss_fn)

    def grads_fn(params: Any, batch: Any) -> Any:
        leaves, spec = optree.tree_flatten(params, none_is_leaf=False, namespace="fxtrain")
        if any(isinstance(p, DTensor) for p in leaves):
            raise ValueError("per_example_grads: params hold DTensors, which torch.func.grad does not support; "
                             "compute per-example gradients on plain tensors")
        flat, batch_spec = tree.flatten(batch)
        where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        _check_batch(batch, flat, where)

        def one(xs, example):
            full = list(flat)
            for i, x in zip(where, example):
                full[i] = x.unsqueeze(0)  # a batch of one
            out = loss_fn(optree.tree_unflatten(spec, xs), tree.unflatten(batch_spec, full))
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise TypeError(f"per_example_grads: loss_fn {name} must return (loss, aux) with has_aux=True")
                loss, aux = out
            else:
                loss, aux = out, ()  # vmap returns tensors only: an empty aux
            if not (isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_floating_point()):
                raise ValueError(f"per_example_grads: loss_fn {name} must return a 0-dim floating-point tensor "
                                 f"per example, got {_describe(loss)}")
            return loss, aux

        per_example = torch.func.vmap(torch.func.grad(one, has_aux=True), in_dims=(None, 0))
        grads, aux = per_example(leaves, [flat[i] for i in where])
        grads = optree.tree_unflatten(spec, grads)
        return (grads, aux) if has_aux else grads

    return grads_fn


def _check_batch(batch: Any, flat: list, where: list[int]) -> None:
    """Every tensor leaf has a leading dim, all of one length; errors name the leaf."""
    if not where:
        raise ValueError("per_example_grads: batch has no tensor leaf to split into examples")
    paths = tree.paths(batch)
    sizes = {}
    for i in where:
        if flat[i].ndim == 0:
            raise ValueError(f"per_example_grads: batch leaf '{paths[i]}' is 0-dim; every tensor leaf needs a "
                             "leading batch dim")
        sizes.setdefault(flat[i].shape[0], paths[i])
    if len(sizes) > 1:
        raise ValueError("per_example_grads: batch leaves differ in length along dim 0: "
                         + ", ".join(f"'{p}' has {n}" for n, p in sizes.items()))


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
