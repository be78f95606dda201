"""From ``cfg.parallel``'s degrees to a model on the run's mesh and a step: one composition of torch's engines.

Every layout gives the runner the same :class:`Parallel`: ``(apply, params, buffers)`` as
:func:`fxtrain.functional` gives them, ``step(params, opt_state, buffers, batch) -> (params, opt_state,
buffers, metrics)`` on this rank's slice of a batch, and ``evaluate(params, buffers, test)``. The mesh
comes in once, as a :class:`fxtrain.distributed.ParallelDims`; :func:`parallelize` asks it which degrees are
on and composes torch's own machinery in torchtitan's order, each on its sub-mesh:

1. ``pp``: the model is cut into its stage (``model.pipeline_stage``), or its ``stages_per_rank`` virtual stages,
   which the rest applies to; a ``torch.distributed.pipelining`` schedule runs them (``fx.parallel.pipeline_step``;
   the schedules: :mod:`fxtrain.parallel._pipeline_schedules`).
2. ``tp``: ``parallelize_module`` with ``model.tp_plan()`` on the tp mesh.
3. ``dp_shard`` (and ``dp_replicate``, HSDP): ``fully_shard`` per block and root on the ``dp_shard`` mesh or
   the 2-D ``(dp_replicate, dp_shard)`` one; the step is ``fx.parallel.fully_sharded_step``.
   ``dp_replicate`` alone: replicated DTensor params (``fx.parallel.data_parallel``, or
   ``fx.parallel.tensor_parallel``'s dp x tp bridge), gradients reduced by ``fx.train_step``.
4. ``ep``: the MoE layers' experts ``Shard(0)`` over ep. Alone (or with ``dp_replicate``):
   ``fx.parallel.expert_parallel``. With ``dp_shard``, ``tp`` or ``pp`` (torchtitan's EP x FSDP / TP / PP):
   ``fx.parallel.fully_shard_experts`` on the model or its stage, after tp's ``parallelize_module``: each MoE
   layer ``fully_shard``-ed over dp_shard, the dense params over dp_shard x ep; the step is FSDP's.
5. ``cp``: FSDP over ``dp_shard x cp``, its step run on each rank's part of the sequences under torch's
   ``context_parallel`` (``fx.parallel.context_parallel``).

With none on, the model is ``fx.functional``'s and the step ``fx.train_step``. Activation checkpointing and
``torch.compile`` of the blocks (:mod:`fxtrain.parallel._blocks`; ``activation_checkpoint=``, ``compile=``) come
after tensor parallel and before FSDP, as in torchtitan; ``compile=True`` also compiles the step's update half
where the stack has no fused kernel (``fx.train_step(compile=True)``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from fxtrain import distributed, tasks, tree
from fxtrain._base import GradientTransformation
from fxtrain._deferred import DTensor
from fxtrain.amp import Uncast
from fxtrain.distributed import ParallelDims
from fxtrain.functional import functional
from fxtrain.parallel._blocks import checkpoint_blocks, checkpointed_blocks, compile_blocks, compile_refusal
from fxtrain.parallel._context_parallel import context_parallel, context_parallel_refusal
from fxtrain.parallel._data_parallel import data_parallel
from fxtrain.parallel._expert_parallel import expert_mesh, expert_parallel, fully_shard_experts
from fxtrain.parallel._fully_sharded import fully_sharded, fully_sharded_step
from fxtrain.parallel._pipeline import pipeline_step
from fxtrain.parallel._pipeline_schedules import (build_schedule, evaluate_step, schedule_refusal,
                                                  stage_indices)
from fxtrain.parallel._tensor_parallel import tensor_parallel
from fxtrain.step import train_step

__all__ = ["Parallel", "parallelize", "loss_function", "evaluate", "forward"]


class Parallel(NamedTuple):
    """A model placed on the run's mesh, with the step and evaluation that drive it."""

    apply: Callable  #: ``apply(params, buffers, x, train) -> (output, new_buffers)``
    params: Any
    buffers: Any
    step: Callable  #: ``step(params, opt_state, buffers, batch) -> (params, opt_state, buffers, metrics)``
    evaluate: Callable  #: ``evaluate(params, buffers, test, batch_size) -> {"test_loss": ..., ...}``


def parallelize(model: nn.Module, tx: GradientTransformation, dims: ParallelDims, *,
                task: tasks.Task | None = None, pipeline: dict | None = None, mp_policy: Any = None,
                activation_checkpoint: str = "none", compile: bool = False) -> Parallel:  # noqa: A002
    """``model`` on ``dims.mesh`` as its degrees say, and its step with ``tx`` (see the module docstring).

    Args:
      model: the built model (on the run's device).
      tx: the transform stack.
      dims: the run's mesh object (built).
      task: the loss and metrics (:mod:`fxtrain.tasks`); ``None``: classification.
      pipeline: under ``pp``: ``{"schedule": "gpipe" | "1f1b" | "interleaved1f1b" | "interleaved_zb" | "zbv",
        "stages_per_rank": int, "microbatches": int}`` (:mod:`fxtrain.parallel._pipeline_schedules`).
      mp_policy: under ``dp_shard`` (whole models and pipeline stages): FSDP's ``MixedPrecisionPolicy`` (the amp
        group's compute dtype; :func:`fxtrain.build.mixed_precision`).
      activation_checkpoint: ``none``, ``full`` or ``selective``: the model's (or stage's) blocks checkpointed
        (:func:`fxtrain.parallel.checkpoint_blocks`).
      compile: each block ``torch.compile``-d (:func:`fxtrain.parallel.compile_blocks`), and the step's update
        half where the stack has no fused kernel.

    Raises:
      ValueError: the model cannot take a degree (no TP plan, no pipeline split, no MoE layer), naming the
        model class and the fix, or a combination the runner does not compose, naming the degrees.

    Example:
        >>> import fxtrain as fx
        >>> from fxtrain.models import MLP
        >>> placed = parallelize(MLP((4,), (8,), 2), fx.sgd(0.1), ParallelDims.of(world=1))
        >>> sorted(placed.params)[:2]
        ['net.1.bias', 'net.1.weight']
    """
    task = task or tasks.classification()
    _check(model, dims)
    blocks = _Blocks(activation_checkpoint, compile)
    checkpointed_blocks(model, activation_checkpoint)  # refused before any engine touches the model
    refused = compile_refusal(model) if compile else None
    if refused:
        raise ValueError(refused)
    if compile and activation_checkpoint != "none" and dims.enabled("tp"):
        # Measured on torch 2.13 (CPU, gloo), the checkpoint eager around the compiled block or traced inside it:
        # AOT autograd's forward saves a DeviceMesh beside the tensors, which the checkpoint's saved-tensor
        # bookkeeping asserts on ("expected all tensors_saved_with_vc_check to be Tensors"). Each alone works.
        raise ValueError(f"{dims.describe()}: trainer.compile=true with model.activation_checkpoint="
                         f"{activation_checkpoint}: torch cannot compile a checkpointed tensor-parallel block (its "
                         "compiled forward saves a DeviceMesh that the checkpoint cannot hold, torch 2.13); use one "
                         "of the two: trainer.compile=false or model.activation_checkpoint=none")
    if dims.enabled("pp"):
        return _pipelined(model, tx, dims, task, pipeline or {}, mp_policy, blocks)
    if dims.enabled("ep") and dims.params_sharded:
        # torchtitan's EP x FSDP (x TP): experts Shard(0) over ep, fully_shard-ed over dp_shard, the rest over every
        # data rank (dp_shard x ep), the attention tensor-parallel first.
        twin = _twin(model)
        _experts_placed(model, dims, model.tp_plan() if dims.enabled("tp") else None, mp_policy, blocks)
        return _fully_sharded(model, tx, task, twin, compile)
    if dims.enabled("ep"):
        # Experts over ep; the dense params replicated over the data ranks.
        blocks(model)
        apply, params, buffers = expert_parallel(model, dims.mesh, ep="ep")
        return _autograd(apply, params, buffers, tx, task, compile)
    if dims.params_sharded:
        twin = _twin(model)
        _placed(model, dims, model.tp_plan() if dims.enabled("tp") else None, mp_policy, blocks)
        placed = _fully_sharded(model, tx, task, twin, compile)
        if dims.enabled("cp"):
            return placed._replace(step=context_parallel(placed.step, model, dims.submesh("cp")))
        return placed
    if dims.enabled("tp"):
        mesh = dims.submesh(*(d for d in ("dp_replicate", "tp") if dims.enabled(d)))
        apply, params, buffers = tensor_parallel(model, model.tp_plan(), mesh, dp="dp_replicate")
    elif dims.enabled("dp_replicate"):
        apply, params, buffers = data_parallel(model, dims.submesh("dp_replicate"))
    else:
        apply, params, buffers = functional(model)
    blocks(model)  # after tensor parallel's parallelize_module (its hooks stay outside the compiled forward)
    return _autograd(apply, params, buffers, tx, task, compile)


class _Blocks(NamedTuple):
    """The per-block wrappers of a run, applied to the model (or a pipeline stage) in torchtitan's order."""

    activation_checkpoint: str = "none"
    compile: bool = False

    def __call__(self, module: nn.Module) -> None:
        checkpoint_blocks(module, self.activation_checkpoint)
        if self.compile:
            compile_blocks(module)


def _check(model: nn.Module, dims: ParallelDims) -> None:
    """Refuses what the model or the composition cannot take, before any mesh is used."""
    name, shown = type(model).__name__, dims.describe()
    if dims.enabled("tp") and not hasattr(model, "tp_plan"):
        raise ValueError(f"{shown}: {name} has no tensor-parallel plan (tp_plan); use model=transformer or model=moe")
    if dims.enabled("pp") and not hasattr(model, "pipeline_stage"):
        raise ValueError(f"{shown}: {name} has no pipeline split (pipeline_stage); use model=transformer or model=moe")
    refused = context_parallel_refusal(model, dims.degrees["cp"], getattr(model, "context", None))
    if refused:
        raise ValueError(refused)
    if dims.enabled("cp") and (dims.enabled("pp") or dims.enabled("ep")):
        raise ValueError(f"{shown}: context parallel composes with dp_replicate, dp_shard and tp here; set "
                         "parallel.pp and parallel.ep to 1 (or parallel.cp to 1)")
    if dims.enabled("pp") and dims.enabled("dp_replicate") and not dims.params_sharded:
        raise ValueError(f"{shown}: pipeline replicas are FSDP-sharded stages; use parallel.dp_shard for them "
                         "(parallel.dp_replicate with dp_shard > 1 is HSDP per stage)")


def _placed(module: nn.Module, dims: ParallelDims, plan: dict | None, mp_policy: Any = None,
            blocks: Callable[[nn.Module], None] | None = None) -> None:
    """``module`` (the model, or its pipeline stage) through torch's engines in torchtitan's order:
    ``parallelize_module`` with ``plan`` on tp, the per-block wrappers (``blocks``: checkpointing, compile), then
    ``fully_shard`` on dp_shard (HSDP's 2-D mesh with dp_replicate)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if dims.enabled("tp"):
        parallelize_module(module, dims.submesh("tp"), plan)
    if blocks is not None:
        blocks(module)
    if dims.params_sharded:
        _fully_shard(module, dims.fsdp_mesh, mp_policy)


def _experts_placed(module: nn.Module, dims: ParallelDims, plan: dict | None, mp_policy: Any,
                    blocks: Callable[[nn.Module], None]) -> None:
    """:func:`_placed` for a module with MoE layers under ep (torchtitan's order): ``parallelize_module`` with
    ``plan`` on tp, the per-block wrappers, then the experts ``Shard(0)`` over ep and ``fully_shard``-ed over
    dp_shard (:func:`fxtrain.parallel.fully_shard_experts`), the blocks and root over dp_shard x ep."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = expert_mesh(dims)  # one root mesh for the tp, ep and FSDP meshes, which FSDP composes
    if plan is not None:
        parallelize_module(module, mesh["tp"], plan)
    blocks(module)
    _fully_shard(module, fully_shard_experts(module, mesh, mp_policy=mp_policy), mp_policy)


def _stage_plan(model: nn.Module) -> dict:
    """The TP plan of a pipeline stage: the blocks' entries of Megatron's plan without sequence parallel, so the
    activations the stages send each other stay plain, whole tensors (a DTensor cannot travel through the
    schedule's sends); the embeddings, the final norm and the tied head stay plain params on every tp rank."""
    return {k: v for k, v in model.tp_plan(sequence_parallel=False).items() if k.startswith("blocks.")}


def _pipelined(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task, pipeline: dict, mp_policy: Any = None,
               blocks: _Blocks = _Blocks()) -> Parallel:
    from torch.distributed.pipelining import PipelineStage

    name, per = pipeline.get("schedule", "gpipe"), int(pipeline.get("stages_per_rank", 1))
    size, microbatches = dims.degrees["pp"], int(pipeline.get("microbatches", 4))
    n = size * per  # stages in all: stages_per_rank virtual stages on each pp rank
    refused = schedule_refusal(name, size, per, microbatches, compile=blocks.compile)
    if refused is None and n > getattr(model, "n_layers", n):
        refused = (f"parallel.pp={size} x parallel.stages_per_rank={per} = {n} stages need at least one block "
                   f"each, but model.n_layers={model.n_layers}: raise model.n_layers or lower them")
    if refused:
        raise ValueError(f"{dims.describe()}: {refused}")
    pp = dims.submesh("pp")
    indices = stage_indices(name, pp.get_local_rank(), size, per)
    plan = _stage_plan(model) if dims.enabled("tp") else None
    modules = [model.pipeline_stage(i, n) for i in indices]
    for module in modules:
        (_experts_placed if dims.enabled("ep") else _placed)(module, dims, plan, mp_policy, blocks)
    device = next(modules[0].parameters()).device
    stages = [PipelineStage(m, i, n, device, group=pp.get_group()) for i, m in zip(indices, modules)]
    schedule = build_schedule(name, stages, microbatches, lambda out, y: task.compute(out, y)[0])
    # This rank's stages' params in one tree (the model's names: the stages' are disjoint), as one stage's are.
    placed = [fully_sharded(m) if dims.params_sharded else functional(m) for m in modules]
    apply = placed[0][0]
    params = {k: v for _, p, _ in placed for k, v in p.items()}
    buffers = {k: v for _, _, b in placed for k, v in b.items()}
    train = pipeline_step(schedule, tx, pp_group=pp, compile=blocks.compile)
    first, last = 0 in indices, n - 1 in indices
    seen: list[int] = []  # the per-rank batch size: a stage's buffers are shaped by its first micro-batches

    def step(params, opt_state, buffers, batch):
        x, y = batch
        seen[:] = [len(y)]
        params, opt_state, metrics = train(params, opt_state, (x if first else None, y if last else None))
        return params, opt_state, buffers, metrics

    def evaluate_pp(params, buffers, test, batch_size):
        del params, buffers  # the stage modules hold them (the step wrote into their storage)
        x, y = test
        # The stages exchange activations in buffers shaped at the first step: evaluate in batches of that size.
        batch_size = seen[0] if seen else batch_size
        if len(x) % batch_size:
            raise ValueError(f"parallel=pp evaluates in batches of the training batch ({batch_size} per rank), "
                             f"but the test split has {len(x)} examples: make data.eval_windows a multiple of it")
        total = torch.zeros((), dtype=torch.float64)
        for j in range(0, len(x), batch_size):
            xb, yb = x[j:j + batch_size], y[j:j + batch_size]
            losses: list = []
            # The training schedule's own eval (forward only): a second schedule over the same stage
            # left it in a state that changed the next training steps (1.8% of the loss after 100).
            evaluate_step(schedule, xb if first else None, target=yb if last else None, losses=losses)
            if losses:  # the mean loss of each equal micro-batch: their mean is the batch's
                total += torch.stack([v.double() for v in losses]).mean() * yb.numel()
        # The last stage has it: summed over the pp group (its zeros elsewhere), every rank logs it.
        total = distributed.global_count(total, {}, groups=(pp,))
        return {"test_loss": float(total / y.numel())}

    return Parallel(apply, params, buffers, step, evaluate_pp)


# --- shared pieces -----------------------------------------------------------------------------------

def _autograd(apply: Callable, params: Any, buffers: Any, tx, task: tasks.Task, compile: bool = False) -> Parallel:  # noqa: A002
    """The layouts whose params are a pure function's (plain tensors or DTensors): ``fx.train_step``."""
    train = train_step(loss_function(apply, task), tx, has_aux=True, compile=compile)
    return Parallel(apply, params, buffers, _with_buffers(train), _evaluator(apply, task))


def _fully_sharded(model: nn.Module, tx, task: tasks.Task, twin: nn.Module, compile: bool = False) -> Parallel:  # noqa: A002
    apply, params, buffers = fully_sharded(model)
    train = fully_sharded_step(loss_function(apply, task), tx, model, has_aux=True, compile=compile)
    twin_apply = functional(twin)[0]

    def evaluate_full(params, buffers, test, batch_size):
        # In the params' dtype, as every layout evaluates (see evaluate): FSDP's hooks would compute in its
        # MixedPrecisionPolicy's param_dtype, so the gathered params run through the model's plain twin.
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in params.items()}
        return evaluate(twin_apply, full, buffers, test, batch_size, task)

    return Parallel(apply, params, buffers, _with_buffers(train), evaluate_full)


def _twin(model: nn.Module) -> nn.Module:
    """The model's structure without storage (meta device), taken before torch's parallel modules change it:
    evaluation runs it with the full params (``fx.functional``'s apply)."""
    # Each param and buffer copied once, to the meta device: tied params stay tied, nothing is allocated.
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
                    if isinstance(t, nn.Parameter) else torch.empty_like(t, device="meta"))
            for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


def _with_buffers(train: Callable) -> Callable:
    def step(params, opt_state, buffers, batch):
        # Buffers (BatchNorm statistics) ride as Uncast: amp_cast leaves them in their own dtype.
        params, opt_state, metrics = train(params, opt_state, (Uncast(buffers), *batch))
        aux = metrics.pop("aux")
        buffers = aux.pop("buffers")
        metrics.update(aux)
        return params, opt_state, buffers, metrics

    return step


def _fully_shard(model: nn.Module, mesh: Any, mp_policy: Any = None) -> None:
    """torchtitan's wrapping: each transformer block its own FSDP unit (its all-gather overlaps the previous
    block's compute), then the root for the rest (embeddings, final norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    # Blocks keep their compute dtype between them (torchtitan's); only the root casts its output.
    inner = dataclasses.replace(mp_policy, output_dtype=None)
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh, mp_policy=inner)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def loss_function(apply: Callable, task: tasks.Task | None = None) -> Callable:
    """The loss the runner differentiates: ``loss_fn(params, (buffers, x, y)) -> (loss, aux)``, where ``aux``
    holds the task's batch metrics (``accuracy``...) and the new ``buffers``.

    >>> import torch
    >>> apply, params, buffers = functional(torch.nn.Linear(3, 2))
    >>> loss, aux = loss_function(apply)(params, ({}, torch.ones(4, 3), torch.tensor([0, 1, 0, 1])))
    >>> loss.shape, sorted(aux)
    (torch.Size([]), ['accuracy', 'buffers'])
    """
    task = task or tasks.classification()

    def loss_fn(params, batch):
        # BatchNorm statistics come back from apply as new buffers, carried out of the step in aux.
        buffers, x, y = batch
        outputs, buffers = apply(_like_statistics(params, buffers), buffers, x, train=True)
        loss, metrics = task.compute(_full(outputs), y)
        return loss, {**metrics, "buffers": buffers}

    return loss_fn


def _full(x: torch.Tensor) -> torch.Tensor:
    """Logits as a plain tensor (a tensor-parallel head may hand back a DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def _like_statistics(params: dict, buffers: dict) -> dict:
    """BatchNorm's weight and bias in its running statistics' dtype: CPU BatchNorm refuses a bf16/f16 weight
    beside float32 statistics (amp keeps statistics float32, see ``Uncast``); the cast is
    differentiable, as ``torch.autocast`` keeps those params."""
    dtypes = {k.rpartition(".")[0]: b.dtype for k, b in buffers.items() if k.endswith("running_mean")}
    if not dtypes:
        return params
    return {k: p.to(dtypes.get(k.rpartition(".")[0], p.dtype)) for k, p in params.items()}


def _evaluator(apply: Callable, task: tasks.Task) -> Callable:
    def run(params, buffers, test, batch_size):
        return evaluate(apply, params, buffers, test, batch_size, task)

    return run


def evaluate(apply, params, buffers, test: tuple[torch.Tensor, torch.Tensor], batch_size: int,
             task: tasks.Task | None = None) -> dict[str, float]:
    """The task's ``test_loss`` and ``test_<metric>`` (classification: ``test_accuracy``) on the whole held-out
    split: :func:`fxtrain.tasks.evaluate` of :func:`forward`.

    **One precision in every layout**: evaluation computes in the params' dtype (the float32 master weights
    under ``amp=bf16``/``fp16``; bf16/fp16 for the pure half modes, whose params are stored so), never in the
    amp policy's compute dtype: layouts of DTensor params (``dp_replicate``, ``tp``, ``ep``) run this function;
    FSDP-sharded ones (``dp_shard``) run it on the gathered params (FSDP's hooks would compute in its
    ``MixedPrecisionPolicy``); pipelines (``pp``) run the stages' forward on their own params. The same params give the same ``test_loss`` in every layout, up to
    the summation order of sharded matmuls."""
    return tasks.evaluate(task or tasks.classification(), forward(apply, params, buffers), test, batch_size)


def forward(apply: Callable, params: Any, buffers: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f(x) -> outputs``: the model in eval mode (running BatchNorm statistics) with ``params``, without
    gradients; floating inputs in the params' dtype (the pure half amp modes store bf16/fp16 params).

    >>> apply, params, buffers = functional(torch.nn.Linear(3, 2))
    >>> forward(apply, params, buffers)(torch.ones(4, 3)).shape
    torch.Size([4, 2])
    """
    stats = _like_statistics(params, buffers)
    dtype = tree.leaves(params)[0].dtype

    @torch.no_grad()
    def f(x: torch.Tensor) -> torch.Tensor:
        return _full(apply(stats, buffers, x.to(dtype) if x.is_floating_point() else x, train=False)[0])

    return f
