"""Everything that talks to torch.distributed lives in this package; meshes and groups are passed explicitly.

The map, by concern (torchtitan-style: one module per parallelism, plus the shared engines):

* ``_norms``: the norm engine. :func:`global_norm`, :func:`global_sum_sq` and :func:`global_count` of a
  tree of plain tensors and DTensors on any number of meshes, exact and identical on every rank.
* ``_collectives``: moving gradients between layouts. :func:`match_placements` (each gradient to its
  param's placements: a slice, one bucketed reduce-scatter or all-reduce per process group),
  :func:`reduce_partials` (``Partial`` -> ``Replicate``), :func:`reduce_scatter_flat` and
  :func:`all_gather_flat` (ZeRO's packed buffers).
* ``_mesh``: :class:`ParallelDims`, the one mesh object of a run (sizes per dim, the ``DeviceMesh``, which
  slice of a batch this rank reads).
* ``_data_parallel``: :func:`data_parallel`, replicated DTensor params whose gradients come out
  ``Partial("avg")`` over dp (reduced by the step, bucketed; ZeRO through ``sharded_apply(shard_over="dp")``).
* ``_tensor_parallel``: torch's ``parallelize_module`` under the functional step, 1-D or dp x tp with
  the dp bridge built in (:func:`tensor_parallel`).
* ``_fully_sharded``: FSDP2 under the functional step. :func:`fully_sharded` (a ``fully_shard``-ed module's
  sharded params and a function that runs it) and :func:`fully_sharded_step` (FSDP's backward and hooks,
  then fxtrain's stack on the sharded ``.grad``; ``accumulate`` with FSDP's gradient-sync switch).
* ``_pipeline``: :func:`pipeline_step`, a ``torch.distributed.pipelining`` schedule's forward/backward, then
  the stack on this rank's stage params, in place (global transforms checked to span the pp group).
* ``_expert_parallel``: :func:`expert_parallel`, ``fx.functional`` for a module with
  :class:`fxtrain.models.MoE` layers: experts ``Shard(0)`` over a mesh dim ``ep``, dense params on the dp
  mesh, tokens dispatched by an autograd-aware all-gather / reduce-scatter.
* ``_runtime``: torchrun's world, the device, the run stamp, batch slices, metric averages.

Example:
    >>> import torch
    >>> from fxtrain.distributed import global_norm
    >>> float(global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0]), None]}))
    5.0
"""

from fxtrain.distributed._collectives import (
    all_gather_flat, contiguous_stride, match_placements, reduce_partials, reduce_scatter_flat,
)
from fxtrain.distributed._data_parallel import data_parallel
from fxtrain.distributed._expert_parallel import expert_parallel
from fxtrain.distributed._mesh import STRATEGIES, ParallelDims
from fxtrain.distributed._fully_sharded import fully_sharded, fully_sharded_step
from fxtrain.distributed._norms import GlobalSumSq, global_count, global_norm, global_sum_sq, local_leaves, to_local
from fxtrain.distributed._tensor_parallel import tensor_parallel
from fxtrain.distributed._pipeline import pipeline_step
from fxtrain.distributed._runtime import (
    device, init_from_env, mean_across_ranks, rank_and_world, shared_stamp, shutdown, world_mesh,
)

__all__ = [
    # norms
    "global_norm", "global_sum_sq", "global_count", "GlobalSumSq", "to_local", "local_leaves",
    # collectives
    "match_placements", "reduce_partials", "reduce_scatter_flat", "all_gather_flat", "contiguous_stride",
    # the mesh of a run
    "ParallelDims", "STRATEGIES",
    # data parallel
    "data_parallel",
    # expert parallel
    "expert_parallel",
    # tensor parallel
    "tensor_parallel",
    # fully sharded (FSDP2)
    "fully_sharded", "fully_sharded_step",
    # pipeline parallel
    "pipeline_step",
    # runtime
    "init_from_env", "rank_and_world", "shared_stamp", "world_mesh", "device", "mean_across_ranks", "shutdown",
]
