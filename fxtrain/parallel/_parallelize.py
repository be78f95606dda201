"""From ``cfg.parallel`` to a model on the run's mesh and a step: one short function per ``conf/parallel`` file.

Every strategy gives the runner the same :class:`Parallel`: ``(apply, params, buffers)`` as
:func:`fxtrain.functional` gives them, ``step(params, opt_state, buffers, batch) -> (params, opt_state,
buffers, metrics)`` on this rank's slice of a batch, and ``evaluate(params, buffers, test)``. The mesh
comes in once, as a :class:`fxtrain.distributed.ParallelDims`; the parallel machinery is torch's own
(``parallelize_module``, ``fully_shard``, ``torch.distributed.pipelining``), driven through
:mod:`fxtrain.parallel`'s adapters.

======== ============================================================ =====================================
strategy model                                                        step
======== ============================================================ =====================================
none     ``fx.functional``                                            ``fx.train_step``
dp       ``fx.parallel.data_parallel`` (Replicate params)             ``fx.train_step`` (Partial grads)
fsdp     ``fully_shard`` per block and root, ``fully_sharded``        ``fx.parallel.fully_sharded_step``
tp       ``fx.parallel.tensor_parallel(model, model.tp_plan())``      ``fx.train_step``
fsdp_tp  ``parallelize_module`` on tp, then ``fully_shard`` on dp     ``fx.parallel.fully_sharded_step``
pp       ``model.pipeline_stage(stage, n)``, ``PipelineStage``        ``fx.parallel.pipeline_step``
ep       ``fx.parallel.expert_parallel`` (MoE experts over ep)        ``fx.train_step``
======== ============================================================ =====================================
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from fxtrain import distributed, tasks, tree
from fxtrain._base import GradientTransformation
from fxtrain.amp import Uncast
from fxtrain.distributed import ParallelDims
from fxtrain.functional import functional
from fxtrain.parallel._data_parallel import data_parallel
from fxtrain.parallel._expert_parallel import expert_parallel
from fxtrain.parallel._fully_sharded import fully_sharded, fully_sharded_step
from fxtrain.parallel._pipeline import pipeline_step
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
                task: tasks.Task | None = None, pipeline: dict | None = None, mp_policy: Any = None) -> Parallel:
    """``model`` on ``dims.mesh`` as ``dims.strategy`` says, and its step with ``tx`` (see the module table).

    Args:
      model: the built model (on the run's device).
      tx: the transform stack.
      dims: the run's mesh object (built).
      task: the loss and metrics (:mod:`fxtrain.tasks`); ``None``: classification.
      pipeline: for ``pp``: ``{"schedule": "gpipe" | "1f1b", "microbatches": int}``.
      mp_policy: for ``fsdp`` and ``fsdp_tp``: FSDP's ``MixedPrecisionPolicy`` (the amp group's compute dtype).

    Raises:
      ValueError: the model cannot take the strategy (no TP plan, no pipeline split, no MoE layer),
        naming the model class and the fix.
    """
    build = _BUILDERS[dims.strategy]
    options = {"pp": {"pipeline": pipeline}, "fsdp": {"mp_policy": mp_policy}, "fsdp_tp": {"mp_policy": mp_policy}}
    return build(model, tx, dims, task or tasks.classification(), **options.get(dims.strategy, {}))


# --- one function per strategy -------------------------------------------------------------------------

def _none(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task) -> Parallel:
    apply, params, buffers = functional(model)
    return _autograd(apply, params, buffers, tx, task)


def _dp(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task) -> Parallel:
    apply, params, buffers = data_parallel(model, dims.mesh)
    return _autograd(apply, params, buffers, tx, task)


def _tp(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task) -> Parallel:
    apply, params, buffers = tensor_parallel(model, _plan(model, dims), dims.mesh)
    return _autograd(apply, params, buffers, tx, task)


def _ep(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task) -> Parallel:
    apply, params, buffers = expert_parallel(model, dims.mesh, ep="ep")
    return _autograd(apply, params, buffers, tx, task)


def _fsdp(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task, mp_policy: Any = None) -> Parallel:
    twin = _twin(model)
    _fully_shard(model, dims.mesh["dp"] if dims.mesh.ndim > 1 else dims.mesh, mp_policy)
    return _fully_sharded(model, tx, task, twin)


def _fsdp_tp(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task, mp_policy: Any = None) -> Parallel:
    from torch.distributed.tensor.parallel import parallelize_module

    plan = _plan(model, dims)
    twin = _twin(model)
    parallelize_module(model, dims.mesh["tp"], plan)
    _fully_shard(model, dims.mesh["dp"], mp_policy)
    return _fully_sharded(model, tx, task, twin)


def _pp(model: nn.Module, tx, dims: ParallelDims, task: tasks.Task, pipeline: dict | None = None) -> Parallel:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pipeline = pipeline or {}
    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    name = pipeline.get("schedule", "gpipe")
    if name not in schedules:
        raise ValueError(f"parallel.schedule={name}: expected one of {', '.join(schedules)}")
    if not hasattr(model, "pipeline_stage"):
        raise ValueError(f"parallel=pp: {type(model).__name__} has no pipeline split (pipeline_stage); use "
                         "model=transformer or model=moe")
    pp = dims.mesh["pp"] if dims.mesh.ndim > 1 else dims.mesh
    n, stage_index = pp.size(), pp.get_local_rank()
    module = model.pipeline_stage(stage_index, n)
    if dims.sizes.get("dp", 1) > 1:
        _fully_shard(module, dims.mesh["dp"])
    device = next(module.parameters()).device
    stage = PipelineStage(module, stage_index, n, device, group=pp.get_group())
    microbatches = int(pipeline.get("microbatches", 4))
    schedule = schedules[name](stage, n_microbatches=microbatches, loss_fn=lambda out, y: task.compute(out, y)[0])
    apply, params, buffers = (fully_sharded(module) if dims.sizes.get("dp", 1) > 1
                              else functional(module))
    train = pipeline_step(schedule, tx, pp_group=pp)
    first, last = stage_index == 0, stage_index == n - 1
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
            schedule.eval(xb if first else None, target=yb if last else None, losses=losses)
            if losses:  # the mean loss of each equal micro-batch: their mean is the batch's
                total += torch.stack([v.double() for v in losses]).mean() * yb.numel()
        # The last stage has it: summed over the pp group (its zeros elsewhere), every rank logs it.
        total = distributed.global_count(total, {}, groups=(pp,))
        return {"test_loss": float(total / y.numel())}

    return Parallel(apply, params, buffers, step, evaluate_pp)


_BUILDERS = {"none": _none, "dp": _dp, "fsdp": _fsdp, "tp": _tp, "fsdp_tp": _fsdp_tp, "pp": _pp, "ep": _ep}


# --- shared pieces -----------------------------------------------------------------------------------

def _autograd(apply: Callable, params: Any, buffers: Any, tx, task: tasks.Task) -> Parallel:
    """The strategies whose params are a pure function's (plain tensors or DTensors): ``fx.train_step``."""
    train = train_step(loss_function(apply, task), tx, has_aux=True)
    return Parallel(apply, params, buffers, _with_buffers(train), _evaluator(apply, task))


def _fully_sharded(model: nn.Module, tx, task: tasks.Task, twin: nn.Module) -> Parallel:
    apply, params, buffers = fully_sharded(model)
    train = fully_sharded_step(loss_function(apply, task), tx, model, has_aux=True)
    twin_apply = functional(twin)[0]

    def evaluate_full(params, buffers, test, batch_size):
        # In the params' dtype, as every layout evaluates (see evaluate): FSDP's hooks would compute in its
        # MixedPrecisionPolicy's param_dtype, so the gathered params run through the model's plain twin.
        full = {k: v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v for k, v in params.items()}
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


def _plan(model: nn.Module, dims: ParallelDims) -> dict:
    if not hasattr(model, "tp_plan"):
        raise ValueError(f"parallel={dims.strategy}: {type(model).__name__} has no tensor-parallel plan (tp_plan); "
                         "use model=transformer or model=moe")
    return model.tp_plan()


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
    return x.full_tensor() if isinstance(x, torch.distributed.tensor.DTensor) else x


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
    amp policy's compute dtype: ``none``, ``dp``, ``tp`` and ``ep`` run this function; ``fsdp`` and ``fsdp_tp``
    run it on the gathered params (FSDP's hooks would compute in its ``MixedPrecisionPolicy``); ``pp`` runs the
    stages' forward on their own params. The same params give the same ``test_loss`` in every layout, up to
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
