"""The runner's pipeline schedules (``parallel.schedule``): torch's own classes, the stages each rank holds, and
what each schedule refuses, in one line, before a stage is cut.

``gpipe`` and ``1f1b`` run one stage per rank; the looped ones run ``parallel.stages_per_rank`` virtual stages
per rank (``pp * stages_per_rank`` stages in all): ``interleaved1f1b`` and ``interleaved_zb`` (zero bubble, its
backward split into input and weight gradients) loop over the ranks (rank ``r`` holds stages ``r, r + pp,
...``), ``zbv`` holds two stages in a V (rank ``r``: stages ``r`` and ``2 * pp - 1 - r``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

__all__ = ["SCHEDULES", "schedule_refusal", "stage_indices", "build_schedule", "evaluate_step"]


class _Kind(NamedTuple):
    cls: str  # the torch.distributed.pipelining class
    looped: bool  # several stages per rank (PipelineScheduleMulti)
    v_shape: bool = False  # rank r holds r and 2 * pp - 1 - r (zbv), else r, r + pp, ...
    zero_bubble: bool = False  # backward split into input and weight gradients


SCHEDULES = {
    "gpipe": _Kind("ScheduleGPipe", looped=False),
    "1f1b": _Kind("Schedule1F1B", looped=False),
    "interleaved1f1b": _Kind("ScheduleInterleaved1F1B", looped=True),
    "interleaved_zb": _Kind("ScheduleInterleavedZeroBubble", looped=True, zero_bubble=True),
    "zbv": _Kind("ScheduleZBVZeroBubble", looped=True, v_shape=True, zero_bubble=True),
}


def schedule_refusal(name: str, pp: int, stages_per_rank: int, microbatches: int,
                     compile: bool = False) -> str | None:  # noqa: A002 - the runner's argument name
    """Why ``parallel.schedule=name`` cannot run ``stages_per_rank`` stages on each of ``pp`` ranks with
    ``microbatches`` micro-batches (and ``compile``-d blocks: ``trainer.compile``), or ``None``: torch's own rules,
    checked before anything is built.

    >>> schedule_refusal("interleaved1f1b", 2, 2, 4) is None
    True
    >>> schedule_refusal("zbv", 2, 3, 4)
    'parallel.schedule=zbv holds exactly 2 stages per rank (a V), but parallel.stages_per_rank=3: set parallel.stages_per_rank=2'
    """
    kind = SCHEDULES.get(name)
    if kind is None:
        return f"parallel.schedule={name}: expected one of {', '.join(SCHEDULES)}"
    if not kind.looped and stages_per_rank != 1:
        return (f"parallel.schedule={name} runs one stage per rank, but parallel.stages_per_rank={stages_per_rank}: "
                "use parallel.schedule=interleaved1f1b, interleaved_zb or zbv, or parallel.stages_per_rank=1")
    if kind.v_shape and stages_per_rank != 2:
        return (f"parallel.schedule={name} holds exactly 2 stages per rank (a V), but parallel.stages_per_rank="
                f"{stages_per_rank}: set parallel.stages_per_rank=2")
    if kind.looped and stages_per_rank < 2:
        return (f"parallel.schedule={name} interleaves virtual stages, but parallel.stages_per_rank="
                f"{stages_per_rank}: set parallel.stages_per_rank=2 (or more), or use parallel.schedule=1f1b")
    if name == "1f1b" and microbatches < pp:
        return (f"parallel.schedule=1f1b needs at least as many micro-batches as stages, but parallel.microbatches="
                f"{microbatches} < parallel.pp={pp}: raise parallel.microbatches")
    if kind.zero_bubble and compile:
        # torch's zero-bubble constructors refuse compiled stage modules ("not supported with stage modules that
        # have used torch.compile"; its TODO: no input/weight backward split under torch.compile)
        return (f"parallel.schedule={name} splits the backward into input and weight gradients, which torch 2.13 "
                "does not do through torch.compile: use trainer.compile=false or parallel.schedule=interleaved1f1b")
    rounds = max(1, microbatches // pp)  # torch's rule for the interleaved ones (flexible rounds of pp)
    if kind.looped and not kind.v_shape and microbatches % rounds:
        return (f"parallel.schedule={name} runs the micro-batches in rounds of parallel.pp={pp}, but "
                f"parallel.microbatches={microbatches} is not a multiple of its {rounds} rounds: make it a "
                f"multiple of {pp}")
    return None


def stage_indices(name: str, rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages rank ``rank`` of ``pp`` holds under schedule ``name`` (``pp * stages_per_rank`` stages).

    >>> stage_indices("interleaved1f1b", 0, 2, 2), stage_indices("zbv", 0, 2, 2), stage_indices("zbv", 1, 2, 2)
    ([0, 2], [0, 3], [1, 2])
    """
    if SCHEDULES[name].v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]


def build_schedule(name: str, stages: list, microbatches: int, loss_fn: Callable) -> Any:
    """torch's schedule ``name`` over this rank's ``stages`` (``PipelineStage`` s, in :func:`stage_indices`' order)."""
    from torch.distributed import pipelining

    kind = SCHEDULES[name]
    cls = getattr(pipelining, kind.cls)
    return cls(stages if kind.looped else stages[0], n_microbatches=microbatches, loss_fn=loss_fn)


def evaluate_step(schedule: Any, *inputs: Any, target: Any, losses: list) -> None:
    """``schedule.eval``: the training schedule's own forward of every micro-batch (no gradient), its losses into
    ``losses`` on the last stage.

    torch 2.13's looped schedules keep their backward actions in evaluation, where they compute nothing, but
    between two stages of one rank (zbv's V) the backward hands its (absent) input gradient to the previous
    stage, which asserts ("can't steal_bwd_input if this stage doesn't have backward"): the actions run without
    those, forward and communication only.
    """
    with _forward_only(schedule):
        schedule.eval(*inputs, target=target, losses=losses)


@contextlib.contextmanager
def _forward_only(schedule: Any) -> Any:
    order = getattr(schedule, "pipeline_order_with_comms", None)  # torch's runtime (looped) schedules
    if not order:
        yield
        return
    from torch.distributed.pipelining.schedules import _ComputationType as Act

    backward = (Act.FULL_BACKWARD, Act.BACKWARD_INPUT, Act.BACKWARD_WEIGHT, Act.REDUCE_GRAD, Act.SEND_B, Act.RECV_B)
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a is None or a.computation_type not in backward] for rank, actions in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order
