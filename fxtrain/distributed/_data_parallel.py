"""Data parallelism on plain tensors: a gradient all-reduce transform, and ZeRO views on a dp mesh.

``parallel=dp`` keeps plain params and batches; :func:`all_reduce_mean` averages gradients in one packed
all-reduce, and :func:`on_dp_mesh` shows an optimizer the same tensors as DTensors on a 1-D ``dp`` mesh
so ``sharded_apply(..., shard_over="dp")`` can shard its state (ZeRO-1/2).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, kernel, transform
from fxtrain.distributed._collectives import _refuse_autodiff, reduce_partials
from fxtrain.distributed._norms import _all_reduce_flat, _unflat, to_local

__all__ = ["all_reduce_mean", "on_dp_mesh"]


@transform(elementwise=False)
def all_reduce_mean(world_size: int) -> GradientTransformation:
    """Averages the gradients across all ranks of the default process group (one all_reduce per update).

    Data parallelism on plain tensors: every rank computes the gradient of its share of the batch, and
    after this transform every rank holds the gradient of the whole batch (equal shares assumed).
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return tree.put(updates, updates, _all_reduce_mean_(tree.leaves(updates), world_size)), state

    return GradientTransformation(init_fn, update_fn)


def _all_reduce_mean_(leaves: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """Every plain tensor in ``leaves`` averaged over all ranks: written into ``leaves`` (op layer: in place
    when donated, new tensors inside :func:`fxtrain.tree.functional`); returns the results."""
    if not leaves:
        return leaves
    _refuse_autodiff("all_reduce_mean", leaves)
    # One flat buffer (in the leaves' promoted dtype), one collective: per-leaf all_reduces cost a
    # round trip each.
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in leaves))
    mixed = any(g.dtype != dtype for g in leaves)
    flat = _all_reduce_flat(leaves, dtype, [(None, dist.ReduceOp.SUM, world_size)], mixed)
    return tree.copy_(leaves, list(_unflat(flat, leaves)))


@transform(elementwise=False)
def on_dp_mesh(tx: GradientTransformation, mesh: Any, *, reduce_first: bool = False) -> GradientTransformation:
    """Runs ``tx`` on DTensor views of data-parallel params and gradients: ZeRO-1/2 for ``parallel=dp``.

    Under plain data parallelism every rank holds all params as plain tensors and the gradient of its
    share of the batch. ``tx`` sees them on the 1-D ``mesh`` (one dim, named ``"dp"``), with no copy::

        params  -> DTensor(Replicate())                      the same on every rank
        updates -> DTensor(Partial("avg"))                   their mean is the whole batch's gradient
        updates -> mean over ranks, DTensor(Replicate())     with reduce_first (one packed all_reduce)

    and its updates come back as plain tensors (``Replicate``, ``Partial`` ones reduced first). Inside,
    ``sharded_apply(optimizer, shard_over="dp")`` reduce-scatters the gradients (or slices them, when
    already reduced), keeps state for 1/n of the rows (``Shard(0)`` DTensors: checkpointed sharded) and
    all-gathers the updates. ``reduce_first`` is for chains that begin with a global transform such as
    ``clip_by_global_norm``: its norm of ``Partial`` gradients would all-reduce them anyway, and a reduce-
    scatter after that would move them a second time; one all_reduce, then slices, is cheaper.

    Args:
      tx: the transform (a chain with ``sharded_apply(..., shard_over=<the mesh's dim name>)`` entries).
      mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks (:func:`world_mesh` with ``name="dp"``).
      reduce_first: average the gradients over ranks before ``tx`` (see above).

    Returns:
      A transform on plain tensors whose state is ``tx``'s (with DTensor leaves).
    """
    inner = kernel(tx)
    n = mesh.size()
    grads = (Replicate(),) if reduce_first else (Partial("avg"),)

    def view(t, placements):
        return tree.map(lambda x: DTensor.from_local(x, mesh, placements, run_check=False), t)

    def init_fn(params):
        return tx.init(view(params, (Replicate(),)))

    def update_fn(updates, state, params=None):
        if reduce_first:
            updates = tree.put(updates, updates, _all_reduce_mean_(tree.leaves(updates), n))
        params = None if params is None else view(params, (Replicate(),))
        updates, state = inner(view(updates, grads), state, params)
        return tree.map(to_local, reduce_partials(updates)), state

    return GradientTransformation(init_fn, update_fn)
