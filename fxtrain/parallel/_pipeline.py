"""Pipeline parallel: a ``torch.distributed.pipelining`` schedule's forward and backward, then the stack.

:func:`pipeline_step` is :func:`fxtrain.train_step`'s sibling for a model split into stages. The user builds
the stages and the schedule as torch's docs show (``PipelineStage(stage_module, stage_index, num_stages,
device, group=pp_group)``, ``ScheduleGPipe(stage, n_microbatches, loss_fn=...)``, ``Schedule1F1B``, or a
multi-stage schedule such as ``ScheduleInterleaved1F1B``); the schedule runs the micro-batches, the
point-to-point sends between stages and the backward into the stage modules' ``.grad``, and fxtrain's
donated update half (:func:`fxtrain.step.donated_step`, the one ``train_step`` uses) then runs the stack on
this rank's stage params, in place.

What the step decides (the schedule owns the loss; global transforms must span the stages, checked on the first
call; params are the stage modules' own tensors; the loss it reports) and data parallelism across replicas:
docs/parallel.md ("Pipelines and the stack").
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxtrain import tree
from fxtrain._base import GradientTransformation, report
from fxtrain._deferred import FSDPModule
from fxtrain.step import donated_step

__all__ = ["pipeline_step"]

Step = Callable[[Any, Any, Any], tuple[Any, Any, dict]]

# The probe reruns a host-deciding stack (accumulate(every=k)) until it emits; k above this is refused.
_MAX_PROBE_CALLS = 1024


def pipeline_step(schedule: Any, tx: GradientTransformation, *, pp_group: Any,
                  compile: bool = False) -> Step:  # noqa: A002 - train_step's argument name
    """Builds ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` around a pipeline schedule.

    One call runs ``schedule.step`` (forward and backward of every micro-batch, gradients into the stage
    modules), then the stack on this rank's stage params, donated (in place, as ``train_step(donate=True)``:
    the returned trees alias the ones given). See the module docstring for what is checked and why.

    Args:
      schedule: a ``torch.distributed.pipelining`` training schedule built with a ``loss_fn``
        (``ScheduleGPipe``, ``Schedule1F1B``, or a multi-stage one: ``ScheduleInterleaved1F1B``...).
      tx: the gradient transformation; ``opt_state`` is ``tx.init(params)``. Its global transforms must
        sum over the pp group: ``clip_by_global_norm(max_norm, groups=(pp_group,))``.
      pp_group: the process group (or 1-D ``DeviceMesh``) of the pipeline's stages, the one the stages were
        built with (torch's default: the whole world).
      compile: as :func:`fxtrain.train_step`: the update half under ``torch.compile`` (stacks without a fused
        kernel).

    Returns:
      ``step``. ``params`` are this rank's stage parameters (any tree whose leaves are, or alias, every
      parameter of the schedule's stage modules on this rank). ``batch`` is ``(inputs, targets)``: the
      model's input (a tensor or a tuple of positional arguments) on the first stage and the loss target
      on the last, ``None`` where a stage has no use for it (a stage may also be given the whole batch).
      ``metrics`` hold ``loss`` (0-dim float64, identical on every rank) and what the stack reports.

    Raises:
      ValueError: a schedule without backward (no ``loss_fn``), a ``pp_group`` that is not the stages'
        group, a stack that scales the loss (``amp_cast`` with fp16's loss scale); at the first call (on every rank at once), params
        that are not the stage modules' parameters, or a stack whose reported values differ across stages
        (a global transform that sees only its own stage).

    Example (2 ranks under torchrun; not a doctest)::

        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        pp = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        rank = pp.get_local_rank()
        module = full_model[:3] if rank == 0 else full_model[3:]           # the user's split
        stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=pp.get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=cross_entropy)
        tx = fx.chain(fx.clip_by_global_norm(1.0, groups=(pp,)), fx.adamw(1e-3))
        step = fx.parallel.pipeline_step(schedule, tx, pp_group=pp)
        params = dict(module.named_parameters())
        opt_state = tx.init(params)
        for x, y in batches:
            params, opt_state, metrics = step(params, opt_state, (x, y))   # x used on stage 0, y on stage 1
    """
    stages = _stages(schedule)
    group = _group(pp_group, stages)
    if tx.wrap_loss is not None and _scales_the_loss(tx):
        raise ValueError("pipeline_step: amp_cast scales the loss (fp16), which the schedule's own loss_fn "
                         "cannot take; use bf16 (amp=bf16: no loss scale)")
    dtype = next((p.dtype for s in stages for p in s.submod.parameters() if p.is_floating_point()), torch.float32)
    casts = tx.wrap_loss is not None and _casts_the_params(tx, dtype)
    sharded = [s.stage_index for s in stages if isinstance(s.submod, FSDPModule)]
    if casts and sharded:
        # FSDP's pre-forward all-gathers its own params over whatever the cast put in the module: the casts
        # would never be differentiated (issue 35: parallel=pp_fsdp under bf16 trained on zero gradients).
        raise ValueError(f"pipeline_step: {tx!r} casts the params in its forward (amp_cast's compute dtype), but "
                         f"stage {sharded[0]}'s module is fully_shard-ed, whose all-gather replaces the casts: cast "
                         "with fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) and "
                         "amp_cast(policy='p=f32,c=f32,o=f32'), as the runner does")
    engine = _Engine(schedule, stages, group, tx if casts else None)
    update = donated_step(engine.forward, tx, compile=compile, grads=engine)

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict]:
        engine.check(params, opt_state, tx)
        out = update(params, opt_state, batch)
        engine.pending.wait()  # metrics["loss"], summed over the stages
        return out

    return step


class _Engine:
    """The gradient engine handed to ``donated_step``: the schedule's backward, then the stages' ``.grad``."""

    def __init__(self, schedule: Any, stages: list, group: Any, casting: GradientTransformation | None):
        self.schedule, self.stages, self.group = schedule, stages, group
        self.casting = casting  # the stack, where its wrap_loss casts the params (amp_cast): the cast step
        self.ranks = dist.get_process_group_ranks(group)
        self.checked_leaves: tuple = ()  # ids of the leaves last checked: a cheap per-call test
        self.sources: list[torch.Tensor] = []  # the stage parameter behind each leaf, in flatten order
        self.stack_checked = False
        self.pending: Any = None  # the loss's all_reduce, in flight during the update
        self.run: Any = None  # (inputs, targets, losses) of the step under way with a wrap_loss (amp_cast)

    def check(self, params: Any, opt_state: Any, tx: GradientTransformation) -> None:
        """Refuses params that are not the stages' own, or a stack that sees one stage; on every rank at once
        on the first call."""
        key = tuple(map(id, tree.leaves(params)))
        if key == self.checked_leaves:
            return
        sources, error = _sources(params, self.stages)
        if self.stack_checked:
            # Leaves changed after the first call, maybe on this rank only (a reload): no collective here,
            # since ranks that did not re-check would pair it with the schedule's next send.
            if error is not None:
                raise ValueError(error)
        else:
            self._agree(error, "its params")
            reports, probe_error = _report_vector(tx, params, opt_state, dist.get_rank(self.group))
            self._agree(probe_error, "the probe of the stack")
            _check_reports(tx, reports, self.group, self.ranks)
            self.stack_checked = True
        self.sources, self.checked_leaves = sources, key

    def _agree(self, error: str | None, what: str) -> None:
        # Every stage raises if one does: one that raised alone would leave the others blocked in the
        # schedule's point-to-point sends (or the probe's all_gather) until the process group times out.
        flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
        dist.all_reduce(flag, group=self.group)
        if error is not None:
            raise ValueError(error)
        if flag.item():
            raise ValueError(f"pipeline_step: another stage of the pp group (ranks {self.ranks}) refused {what}; "
                             "its error names the cause")

    def __call__(self, fn: Callable, params: Any, batch: Any, tx: GradientTransformation):
        inputs, targets = _split_batch(batch)
        for stage in self.stages:  # torch accumulates into .grad; stale gradients would add in
            stage.submod.zero_grad(set_to_none=True)
        losses: list = []
        del tx  # its wrap_loss, if it casts, is self.casting's; one that casts nothing is the identity here
        if self.casting is None:
            with torch.enable_grad():
                self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False)
        else:
            self._cast_step(fn, params, inputs, targets, losses)
        # Unused stage params get zeros, as train_step's autograd engine gives them (jax.grad's rule).
        grads = iter([torch.zeros_like(p) if p.grad is None else p.grad for p in self.sources])
        for stage in self.stages:  # the buffers are the step's now (they become the updates)
            stage.submod.zero_grad(set_to_none=True)
        flat, spec = tree.flatten(params)
        return tree.unflatten(spec, [None if x is None else next(grads) for x in flat]), self._loss(losses), None

    def _cast_step(self, fn: Callable, params: Any, inputs: tuple, targets: Any, losses: list) -> None:
        """The schedule's step under the stack's ``wrap_loss`` (``amp_cast``): ``fn`` casts the stage params (the
        modules' own, so the casts are differentiable and their gradients land in ``.grad`` in the params'
        dtype) and the floating inputs to the compute dtype, then calls :meth:`forward`, which runs the
        schedule with the stage modules computing with those casts, as ``amp_cast`` makes one process
        compute. A scaled loss (fp16's loss scale) cannot reach the schedule's own ``loss_fn``: refused."""
        flat, spec = tree.flatten(params)
        it = iter(self.sources)
        sources = tree.unflatten(spec, [None if x is None else next(it) for x in flat])
        self.run = (inputs, targets, losses)
        # torch divides the stage modules' .grad by n_microbatches at the end of the backward (scale_grads), but
        # under the casts those modules hold the casts (no .grad): the sum over the micro-batches would reach the
        # stack (issue 35: n_microbatches x the gradient under amp=bf16). The step divides the params' own.
        scale, self.schedule.scale_grads = self.schedule.scale_grads, False
        try:
            fn(sources, inputs)
        finally:
            self.run, self.schedule.scale_grads = None, scale
        if scale:
            torch._foreach_div_([tree.local(p.grad) for p in self.sources if p.grad is not None],
                                float(self.schedule._n_microbatches))

    def forward(self, params: Any, inputs: Any) -> torch.Tensor:
        """The loss function ``wrap_loss`` wraps: ``params`` and ``inputs`` as cast by it; runs the schedule."""
        if self.run is None:
            raise AssertionError("pipeline_step: the schedule computes the loss; this function runs inside its step")
        _, targets, losses = self.run
        cast = dict(zip(map(id, self.sources), [x for x in tree.leaves(params) if x is not None]))
        with contextlib.ExitStack() as stack, torch.enable_grad():
            for stage in self.stages:
                stack.enter_context(_computing_with(stage, cast))
            self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False)
        return torch.ones((), dtype=torch.float32)

    def _loss(self, losses: list) -> torch.Tensor:
        # The objective the gradients are of: the schedule scales them by 1/n_microbatches (scale_grads).
        if losses:
            stacked = torch.stack([x.detach().to(torch.float64) for x in losses])
            loss = stacked.mean() if self.schedule.scale_grads else stacked.sum()
        else:
            loss = torch.zeros((), dtype=torch.float64)
        # Only the last stage has it; summed with the others' zeros, every rank reports it (rank 0 logs).
        # In flight while the update runs (waited for by the step before it returns): measured ~3 ms of
        # gloo latency per step on a loaded 2-core machine when waited for here.
        self.pending = dist.all_reduce(loss, group=self.group, async_op=True)
        return loss


def _casts_the_params(tx: GradientTransformation, dtype: torch.dtype) -> bool:
    """Whether ``tx``'s ``wrap_loss`` hands the loss params of another dtype than it is given (amp_cast's compute
    dtype), asked on a one-leaf tree of the stages' ``dtype``."""
    seen, params = [], {"w": torch.zeros(1, dtype=dtype)}

    def loss(p: Any, batch: Any) -> tuple:
        seen.append(p["w"])
        one = torch.ones((), dtype=torch.float32)
        return one, (one, None)

    tx.wrap_loss(loss, tx.init(params))(params, ())
    return seen[0].dtype != params["w"].dtype


def _scales_the_loss(tx: GradientTransformation) -> bool:
    """Whether ``tx``'s ``wrap_loss`` multiplies the objective (amp_cast's loss scale), asked on a one-leaf tree."""
    one, params = torch.ones((), dtype=torch.float32), {"w": torch.zeros(1)}
    objective = tx.wrap_loss(lambda params, batch: (one, (one, None)), tx.init(params))(params, ())[0]
    return bool(objective != one)


@contextlib.contextmanager
def _computing_with(stage: Any, cast: dict) -> Any:
    """``stage``'s module computing with ``cast[id(param)]`` for its params (amp_cast's compute-dtype casts) and
    its floating inputs in their dtype; the activations it sends on travel in the params' dtype (exact: a bf16
    value is a float32 value), so the stages' buffers, shaped by the first step, serve evaluation too, which
    computes in the params' dtype. The last stage's output goes to the loss as it is, as in one process."""
    from torch.nn.utils.stateless import _reparametrize_module

    module = stage.submod
    named = {n: cast[id(p)] for n, p in module.named_parameters() if id(p) in cast}
    dtype = next((x.dtype for x in named.values() if x.is_floating_point()), None)
    master = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)

    def to(x: Any, d: Any) -> Any:
        return x.to(d) if isinstance(x, torch.Tensor) and x.is_floating_point() and d is not None else x

    hooks = [module.register_forward_pre_hook(lambda m, args: tuple(to(a, dtype) for a in args))]
    if not stage.is_last:
        hooks.append(module.register_forward_hook(
            lambda m, args, out: tuple(to(o, master) for o in out) if isinstance(out, tuple) else to(out, master)))
    masters = list(module.parameters())
    try:
        with _reparametrize_module(module, named):
            # Zero-bubble schedules split the backward: their weight half differentiates submod.parameters(), which
            # are the casts now, so the casts would take the weight gradients and the params none (measured:
            # interleaved_zb under amp=bf16 left every .grad empty). The params, whose casts are on the graph, take
            # them, in their own dtype, as the full backward of the other schedules gives them.
            module.parameters = lambda recurse=True: iter(masters)
            yield
    finally:
        module.__dict__.pop("parameters", None)
        for h in hooks:
            h.remove()


def _stages(schedule: Any) -> list:
    """The schedule's stages on this rank (``_stage`` / ``_stages``: torch keeps no public accessor)."""
    stages = [schedule._stage] if hasattr(schedule, "_stage") else list(getattr(schedule, "_stages", ()))
    if not stages:
        raise ValueError(f"pipeline_step: {type(schedule).__name__} is not a torch.distributed.pipelining "
                         "schedule with stages (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B...)")
    if getattr(schedule, "_loss_fn", None) is None:
        raise ValueError(f"pipeline_step: the {type(schedule).__name__} has no loss_fn, so it runs no backward: "
                         f"build it with {type(schedule).__name__}(stage, n_microbatches, loss_fn=...)")
    return stages


def _group(pp_group: Any, stages: list) -> Any:
    """``pp_group`` as a process group, checked to be the one the stages send over."""
    group = pp_group.get_group() if hasattr(pp_group, "get_group") else pp_group
    if group is None:
        raise ValueError("pipeline_step: pass pp_group= explicitly (the process group or 1-D DeviceMesh the "
                         "stages were built with; torch's default is the whole world: dist.group.WORLD)")
    ranks = dist.get_process_group_ranks(group)
    for stage in stages:
        theirs = dist.get_process_group_ranks(stage.group or dist.group.WORLD)
        if theirs != ranks:
            raise ValueError(f"pipeline_step: pp_group ({_name(pp_group)}) has ranks {ranks}, but stage "
                             f"{stage.stage_index} sends over ranks {theirs}: pass the group (or mesh) the "
                             "PipelineStage was built with (its group=)")
    return group


def _sources(params: Any, stages: list) -> tuple[list[torch.Tensor], str | None]:
    """The stage parameter each leaf of ``params`` is (or aliases), or the error naming the first misfit."""
    owned = {}  # (data_ptr, shape, stride, dtype) of each stage parameter's local tensor -> (name, param)
    for stage in stages:
        for name, p in stage.submod.named_parameters():
            owned[_alias_key(p)] = (f"stage {stage.stage_index} '{name}'", p)
    sources, seen = [], set()
    flat, _ = tree.flatten(params)
    for path, x in zip(tree.paths(params), flat):
        if x is None:
            continue
        hit = owned.get(_alias_key(x)) if isinstance(x, torch.Tensor) else None
        if hit is None:
            return [], (f"pipeline_step: params['{path}'] is not a parameter of the schedule's stage module(s) "
                        "on this rank, nor a view of one, so the schedule computes no gradient for it: pass "
                        "dict(stage_module.named_parameters()) (or fx.functional(stage_module)'s params)")
        sources.append(hit[1])
        seen.add(_alias_key(x))
    for key, (name, p) in owned.items():
        if key not in seen and p.requires_grad:
            return [], (f"pipeline_step: the parameter {name} of the schedule's stage module is not in params: "
                        "its gradient would be computed and never applied. Pass every parameter of the stage "
                        "module (dict(stage_module.named_parameters())), or freeze it (requires_grad_(False))")
    return sources, None


def _alias_key(x: torch.Tensor) -> tuple:
    local = tree.local(x)
    return local.data_ptr(), tuple(local.shape), local.stride(), local.dtype


def _split_batch(batch: Any) -> tuple[tuple, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError("pipeline_step: batch must be (inputs, targets): the model's input on the first stage "
                        "(a tensor or a tuple of arguments) and the loss target on the last, None elsewhere")
    inputs, targets = batch
    if inputs is None:
        return (), targets
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), targets


def _report_vector(tx: GradientTransformation, params: Any, opt_state: Any, group_rank: int
                   ) -> tuple[dict[str, float], str | None]:
    """What the stack reports after one pure update of the probe gradient (``inf`` on group rank 0 only).

    A stack that decides on the host (``accumulate``) runs until it emits, so its inner stack's reports
    are of an update that saw the probe. Nothing is written: ``tx.update`` is pure.
    """
    probe = tree.zeros_like(params)
    if group_rank == 0:
        first = next(iter(tree.leaves(probe)), None)
        if first is not None:
            tree.local(first).view(-1)[:1] = math.inf
    state, start = opt_state, report(opt_state).get("emitted")
    with torch.no_grad():
        for _ in range(_MAX_PROBE_CALLS):
            _, state = tx.update(probe, state, params)
            emitted = report(state).get("emitted")
            if start is None or emitted is None or int(emitted) != int(start):
                break
        else:
            return {}, (f"pipeline_step: {tx!r} emitted no update in {_MAX_PROBE_CALLS} calls, so the check "
                        "that its global transforms span the stages could not run")
    return {k: float(v) for k, v in report(state).items() if isinstance(v, torch.Tensor) and v.numel() == 1}, None


def _check_reports(tx: GradientTransformation, reports: dict[str, float], group: Any, ranks: list) -> None:
    keys = sorted(reports)
    mine = torch.tensor([reports[k] for k in keys], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered)
    same = torch.isclose(table, table[:1], rtol=0.0, atol=0.0, equal_nan=True).all(dim=0)
    if bool(same.all()):
        return
    k = int((~same).nonzero()[0])
    values = ", ".join(f"rank {r}: {v:g}" for r, v in zip(ranks, table[:, k].tolist()))
    raise ValueError(f"pipeline_step: {tx!r} reports '{keys[k]}' differently on the stages of the pp group "
                     f"({values}) for one gradient spread over them (zeros, and one inf on rank {ranks[0]}): a "
                     "global transform in it sees only its own stage. Build it with groups=(pp_group,), e.g. "
                     "clip_by_global_norm(max_norm, groups=(pp_group,))")


def _name(group: Any) -> str:
    if hasattr(group, "mesh_dim_names"):
        return f"DeviceMesh{tuple(group.mesh_dim_names or ())}"
    return "a process group"
