"""torch's parallel engines driving fxtrain's functional step: the layer above :mod:`fxtrain.step`.

torchtitan-style, one module per parallelism; the collectives, norms and the mesh they use are
:mod:`fxtrain.distributed`'s (the engine layer below the transforms).

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
  mesh, tokens dispatched by an autograd-aware all-gather / reduce-scatter; :func:`fully_shard_experts`,
  torchtitan's EP x FSDP2 (experts ``Shard(0)`` over ep, each MoE layer ``fully_shard``-ed on its own mesh).
* ``_context_parallel``: :func:`context_parallel`, a step run on each cp rank's part of the sequences under
  torch's ``context_parallel`` (ring attention; the CPU SDPA kernel entered by :func:`cpu_ring_attention`).
* ``_blocks``: per-block activation checkpointing and ``torch.compile`` (torchtitan's ``apply_ac`` and
  ``apply_compile``): :func:`checkpoint_blocks`, :func:`compile_blocks`.
* ``_parallelize``: the runner's layout building: :func:`parallelize` (a model on the run's mesh and its
  step, from a :class:`fxtrain.distributed.ParallelDims`), :func:`evaluate`, :func:`loss_function`.

Example:
    >>> import torch
    >>> from fxtrain.parallel import data_parallel
    >>> data_parallel(torch.nn.Linear(2, 2), None)
    Traceback (most recent call last):
    ...
    ValueError: data_parallel: expected a 1-D DeviceMesh over the data-parallel ranks, got None
"""

from fxtrain.parallel._blocks import (
    AC_MODES, blocks_of, checkpoint_blocks, checkpointed_blocks, compile_blocks, compile_refusal, wrapped_note,
)
from fxtrain.parallel._context_parallel import context_parallel, context_parallel_refusal, cpu_ring_attention
from fxtrain.parallel._data_parallel import data_parallel
from fxtrain.parallel._expert_parallel import expert_parallel, fully_shard_experts
from fxtrain.parallel._fully_sharded import fully_sharded, fully_sharded_step
from fxtrain.parallel._parallelize import Parallel, evaluate, forward, loss_function, parallelize
from fxtrain.parallel._pipeline import pipeline_step
from fxtrain.parallel._tensor_parallel import tensor_parallel

__all__ = [
    "data_parallel", "expert_parallel", "fully_shard_experts", "tensor_parallel", "fully_sharded", "fully_sharded_step",
    "pipeline_step", "context_parallel", "context_parallel_refusal", "cpu_ring_attention",
    # per-block wrappers
    "AC_MODES", "blocks_of", "checkpoint_blocks", "checkpointed_blocks", "compile_blocks", "compile_refusal",
    "wrapped_note",
    # the runner's layouts
    "Parallel", "parallelize", "evaluate", "forward", "loss_function",
]
