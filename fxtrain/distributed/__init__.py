"""The engine layer of torch.distributed that transforms may use; meshes and groups are passed explicitly.

Nothing here drives a model or a step: the adapters that do (data, tensor, fully sharded, pipeline and expert
parallel) live one layer up, in :mod:`fxtrain.parallel`, above :mod:`fxtrain.step`.

* ``_norms``: the norm engine. :func:`global_norm`, :func:`global_sum_sq` and :func:`global_count` of a
  tree of plain tensors and DTensors on any number of meshes, exact and identical on every rank.
* ``_collectives``: moving gradients between layouts. :func:`match_placements` (each gradient to its
  param's placements: a slice, one bucketed reduce-scatter or all-reduce per process group),
  :func:`reduce_partials` (``Partial`` -> ``Replicate``), :func:`reduce_scatter_flat` and
  :func:`all_gather_flat` (ZeRO's packed buffers), :func:`broadcast_batch` (a batch read once, handed to the
  tp and pp peers that use it).
* ``_overlap``: :func:`overlap_reduction`, DDP's bucketed all-reduce of data-parallel gradients launched from
  hooks while the backward runs (the step's gradient engine uses it; :func:`reduction_buckets` sizes it).
* ``_mesh``: :class:`ParallelDims`, the one mesh object of a run (degrees per dim, the ``DeviceMesh``, which
  slice of a batch this rank reads).
* ``_runtime``: torchrun's world, the device, the run stamp, batch slices, metric averages.

Example:
    >>> import torch
    >>> from fxtrain.distributed import global_norm
    >>> float(global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0]), None]}))
    5.0
"""

from fxtrain._moved import moved_names
from fxtrain.distributed._collectives import (
    all_gather_flat, broadcast_batch, contiguous_stride, match_placements, reduce_partials, reduce_scatter_flat,
)
from fxtrain.distributed._mesh import DIMS, ParallelDims
from fxtrain.distributed._overlap import Overlap, overlap_reduction, reduction_buckets
from fxtrain.distributed._norms import GlobalSumSq, global_count, global_norm, global_sum_sq, local_leaves, to_local
from fxtrain.distributed._runtime import (
    device, gather_objects, init_from_env, mean_across_ranks, rank_and_world, shared_stamp, shutdown, world_mesh,
)

__all__ = [
    # norms
    "global_norm", "global_sum_sq", "global_count", "GlobalSumSq", "to_local", "local_leaves",
    # collectives
    "match_placements", "reduce_partials", "reduce_scatter_flat", "all_gather_flat", "contiguous_stride",
    # a batch handed to the ranks that use the same slice (tp, pp)
    "broadcast_batch",
    # the data-parallel all-reduce overlapped with the backward
    "overlap_reduction", "Overlap", "reduction_buckets",
    # the mesh of a run
    "ParallelDims", "DIMS",
    # runtime
    "init_from_env", "rank_and_world", "shared_stamp", "gather_objects", "world_mesh", "device", "mean_across_ranks", "shutdown",
]

# Names of earlier releases (tests/cases/public_names.json): the adapters moved one layer up, to fxtrain.parallel
# (issue 26); the others were replaced. Reading one warns (moved) or says what replaces it (removed).
__getattr__ = moved_names(__name__, {
    name: f"fxtrain.parallel.{name}" for name in (
        "data_parallel", "expert_parallel", "fully_sharded", "fully_sharded_step", "pipeline_step", "tensor_parallel")
}, removed={
    "STRATEGIES": "a layout is a set of degrees: fxtrain.distributed.ParallelDims (conf/parallel's presets)",
    "all_reduce_mean": "data-parallel gradients are reduced by the step (fxtrain.parallel.data_parallel); the mean "
                       "of a metric over ranks is fxtrain.distributed.mean_across_ranks",
    "local_batch": "a rank's slice of a batch is fxtrain.distributed.ParallelDims(...).local_batch(batch)",
    "on_dp_mesh": "ZeRO over data parallelism is fxtrain.parallel.data_parallel with "
                  "fxtrain.sharded_apply(tx, shard_over='dp')",
})
