"""Data parallelism on torch's DTensor: replicated params, each rank its slice of the batch.

:func:`data_parallel` is :func:`fxtrain.functional` for a data-parallel module: the params are
``Replicate`` DTensors on the dp mesh (views of the module's own storage), and ``apply_fn`` computes with
their local tensors through a view whose backward marks each gradient ``Partial("avg")`` over dp. The
step averages them while the backward still runs (:func:`fxtrain.distributed.overlap_reduction`: DDP's
buckets, launched from hooks as their gradients come in, waited on right after the backward);
``accumulate`` outermost sums micro-batches locally and reduces once per window (the functional
``no_sync``); ``sharded_apply(..., shard_over="dp")`` reduce-scatters instead (ZeRO-1/2). One
mechanism serves plain dp and the dp dim of every 2-D layout (:func:`fxtrain.parallel.tensor_parallel`
uses the same kind of view).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fxtrain._deferred import DTensor, Partial, Replicate
from fxtrain.functional import functional

__all__ = ["data_parallel"]


def data_parallel(module: nn.Module, mesh: Any) -> tuple[Callable, dict, dict]:
    """``module`` as ``(apply_fn, params, buffers)`` with its params replicated over the 1-D ``mesh``.

    Each rank feeds ``apply_fn`` its own slice of the batch (equal slices, a loss that is a mean over the
    slice); the gradient of a param is then ``Partial("avg")``: its reduced value is the gradient of the
    whole batch. Buffers stay plain tensors, one per rank (BatchNorm statistics follow each rank's slice,
    as in DDP without SyncBatchNorm).

    Args:
      module: the model, on the mesh's device.
      mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks.

    Returns:
      ``(apply_fn, params, buffers)`` as from :func:`fxtrain.functional`; ``params`` are ``Replicate``
      DTensors sharing storage with the module.

    Raises:
      ValueError: ``mesh`` is not 1-D, or (at call time) a param is not a DTensor on ``mesh``.

    Example (2 ranks under torchrun; not a doctest)::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        apply, params, buffers = fx.parallel.data_parallel(model, mesh)
        step = fx.train_step(lambda p, b: loss(apply(p, buffers, b[0], train=True)[0], b[1]), tx)
        params, opt_state, metrics = step(params, tx.init(params), my_slice_of_the_batch)
    """
    if getattr(mesh, "ndim", None) != 1:
        raise ValueError(f"data_parallel: expected a 1-D DeviceMesh over the data-parallel ranks, got {mesh}")
    inner, local, buffers = functional(module)
    params = {k: DTensor.from_local(p, mesh, (Replicate(),), run_check=False, shape=p.shape, stride=p.stride())
              for k, p in local.items()}

    def apply_fn(params: dict, buffers: dict, *args: Any, train: bool, **kwargs: Any):
        for k, p in params.items():
            if not (isinstance(p, DTensor) and p.device_mesh == mesh):
                raise ValueError(f"data_parallel apply_fn: the param '{k}' is not a DTensor on {mesh}; pass the "
                                 "params data_parallel returned, or what the step made of them")
        return inner({k: _Local.apply(p) for k, p in params.items()}, buffers, *args, train=train, **kwargs)

    apply_fn.__name__ = apply_fn.__qualname__ = inner.__name__
    return apply_fn, params, buffers


class _Local(torch.autograd.Function):
    """A replicated param's local tensor, no communication; the backward returns the local gradient as
    ``Partial("avg")`` over the mesh, left to the step to reduce in its buckets."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:
        ctx.mesh, ctx.shape, ctx.stride = x.device_mesh, x.shape, x.stride()
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None
        return DTensor.from_local(grad, ctx.mesh, (Partial("avg"),), run_check=False, shape=ctx.shape,
                                  stride=ctx.stride)
