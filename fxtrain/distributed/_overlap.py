"""Data-parallel gradient all-reduce overlapped with the backward pass: DDP's bucketed reducer for gradient trees.

A step's backward hands each param's gradient to autograd as soon as it is computed. A replicated param's
gradient comes out ``Partial`` over the data-parallel mesh dim (each rank's unreduced share); the reduction
of the last layers' gradients can run while autograd still computes the first layers'. :func:`overlap_reduction` does
what torch's DDP ``Reducer`` does for ``nn.Module`` params, for the leaves a step differentiates: a hook per
leaf copies its gradient into a bucket (about ``bucket_mb``, the first one smaller, in the order the gradients
came on the step that planned them) and launches the bucket's all-reduce (``async_op=True``) once all of its
gradients are in and every bucket before it has been launched (every rank launches the same collectives in
the same order); :meth:`Overlap.finish`, right after the backward, launches what is left, waits, divides
(``Partial("avg")``: the same SUM then division as :func:`fxtrain.distributed.match_placements`) and returns
the gradients with that mesh dim ``Replicate``.

As DDP rebuilds its buckets after its first iteration from the order gradients became ready, the first step
of a tree of params (a new signature) overlaps nothing: it records which leaves come back ``Partial`` on a
mesh dim where their param is ``Replicate`` (the first such dim: match_placements' stages run in dim order)
and in which order; the plan is built from that and used from the second step on. What else a gradient needs
(a SequenceParallel norm's ``Partial`` over tp, a reduce-scatter, a slice) is left to the step's
:func:`~fxtrain.distributed.match_placements` after the backward, as are all leaves of a gradient tree the
stack takes unreduced (``accumulate``: one reduction per window, of the window's sum). A gradient that comes
in another layout than the plan says (another model whose params have the same layout) stops the launches
at that leaf, on every rank alike, and the next step plans again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.distributed as dist

from fxtrain._deferred import DTensor
from fxtrain.distributed._collectives import contiguous_stride
from fxtrain.distributed._norms import acc_dtype

__all__ = ["overlap_reduction", "Overlap", "reduction_buckets"]

# DDP's defaults (torch.nn.parallel.DistributedDataParallel's bucket_cap_mb and its first bucket): a small
# first bucket starts communicating early in the backward, the others amortize a collective's latency.
_SIZES = [25 * 2**20, 1 * 2**20]  # [bytes per bucket, bytes of the first bucket]
_MAX_PLANS = 64
_PLANS: dict[tuple, Any] = {}


@contextlib.contextmanager
def reduction_buckets(mb: float, first_mb: float | None = None) -> Iterator[None]:
    """Within the block, steps plan their overlapped reduction with buckets of about ``mb`` MiB (the first one
    ``first_mb``, default the same): DDP's ``bucket_cap_mb``. Outside, 25 and 1 MiB, DDP's defaults.

    >>> from fxtrain.distributed import reduction_buckets
    >>> with reduction_buckets(4):
    ...     pass
    """
    old = list(_SIZES)
    _SIZES[:] = [int(mb * 2**20), int((mb if first_mb is None else first_mb) * 2**20)]
    try:
        yield
    finally:
        _SIZES[:] = old


@dataclasses.dataclass
class _Bucket:
    group: Any
    div: int
    acc: torch.dtype
    leaves: list[int]  # leaf indices, in the order their gradients came on the planning step
    offsets: list[int]  # leaf k's elements are buffer[offsets[k]:offsets[k + 1]]
    numel: int


@dataclasses.dataclass
class _Plan:
    """Per signature of the leaves: ``None`` while learning, then buckets and what each leaf becomes."""

    buckets: list[_Bucket] | None = None
    slot: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # leaf -> (bucket, position)
    have: dict[int, Any] = dataclasses.field(default_factory=dict)  # leaf -> the gradient's DTensorSpec
    want: dict[int, tuple] = dataclasses.field(default_factory=dict)  # leaf -> its placements once reduced
    local_shape: dict[int, torch.Size] = dataclasses.field(default_factory=dict)  # leaf -> the gradient's local piece
    seen: list[int] = dataclasses.field(default_factory=list)  # learning: the leaves, in the order their gradients came


def overlap_reduction(xs: list) -> Overlap | None:
    """Hooks on the leaves ``xs`` about to be differentiated (``torch.autograd.grad(loss, xs)``) that all-reduce
    their ``Partial`` gradients in buckets while the backward runs; ``None`` when no leaf is a DTensor replicated
    over a mesh dim of more than one rank (nothing to reduce). Call :meth:`Overlap.finish` on the gradients
    autograd returns.

    >>> import torch
    >>> overlap_reduction([torch.ones(2, requires_grad=True)]) is None   # plain tensors: nothing to overlap
    True
    """
    if not any(isinstance(x, DTensor) and any(p.is_replicate() and x.device_mesh.size(d) > 1
                                              for d, p in enumerate(x.placements)) for x in xs):
        return None
    key = (tuple(_SIZES), *(x._spec if isinstance(x, DTensor) else None for x in xs))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        plan = _PLANS[key] = _Plan()
    return Overlap(plan, xs, key)


class Overlap:
    """One backward's reduction in flight: the hooks' buckets, launched collectives and their handles."""

    def __init__(self, plan: _Plan, xs: list, key: tuple):
        self.plan, self.xs, self.key = plan, xs, key
        self.learning = plan.buckets is None
        if self.learning:
            plan.seen = []
        else:
            self._start()
        self.handles = [x.register_hook(self._hook(i)) for i, x in enumerate(xs) if isinstance(x, DTensor)
                        and (self.learning or i in plan.slot)]

    def _start(self) -> None:
        buckets = self.plan.buckets
        self.bufs = [torch.empty(b.numel, dtype=b.acc, device=_local(self.xs[b.leaves[0]]).device) for b in buckets]
        self.slots = [buf.split([e - s for s, e in zip(b.offsets, b.offsets[1:])]) for buf, b in zip(self.bufs, buckets)]
        self.missing = [len(b.leaves) for b in buckets]
        self.works: list = []
        self.filled: set[int] = set()
        self.broken = False

    def _hook(self, i: int):
        def hook(g: Any) -> None:
            if self.learning:
                self.plan.seen.append(i)
            else:
                self._ready(i, g)
        return hook

    def _ready(self, i: int, g: Any) -> None:
        plan = self.plan
        if self.broken:
            return
        if not isinstance(g, DTensor) or g.placements != plan.have[i].placements or g.shape != plan.have[i].shape:
            # Another model with params of the same layout, or one that computes differently this step: launch
            # nothing more (every rank runs the same graph, so every rank stops at this leaf), leave the gradients
            # of the buckets not launched to match_placements after the backward, and plan again next step.
            self.broken = True
            return
        b, pos = plan.slot[i]
        self.slots[b][pos].copy_(g._local_tensor.reshape(-1))
        self.missing[b] -= 1
        self.filled.add(i)
        self._launch()

    def _launch(self, until: int | None = None) -> None:
        """Launches, in bucket order, every bucket that is full (or, up to ``until``, every bucket) and whose
        predecessors are launched: every rank runs the same collectives in the same order."""
        buckets = self.plan.buckets
        while len(self.works) < len(buckets) and not self.broken:
            b = len(self.works)
            if self.missing[b] and (until is None or b >= until):
                return
            bucket = buckets[b]
            self.works.append(dist.all_reduce(self.bufs[b], op=dist.ReduceOp.SUM, group=bucket.group, async_op=True))

    def finish(self, grads: list) -> list:
        """``grads`` (autograd's, for ``xs`` in order) with the planned leaves all-reduced and placed like their
        params; the others as they are (for the step's :func:`~fxtrain.distributed.match_placements`)."""
        for h in self.handles:
            h.remove()
        plan = self.plan
        if self.learning:
            # The plan's buckets reduce this step's gradients too, after the backward: every step then sums each
            # element in the same buffer position (gloo's ring, NCCL's, round by position), so a run resumed at
            # any step (which plans again) reduces bit for bit as the uninterrupted one.
            self._build(grads)
            self._start()
            for i in plan.slot:
                self._ready(i, grads[i])
        if self.broken:
            _PLANS[self.key] = _Plan()
        for b, bucket in enumerate(plan.buckets):  # leaves whose hook did not fire (unused on this rank): zeros
            if self.missing[b]:
                for pos, i in enumerate(bucket.leaves):
                    if i not in self.filled:
                        self.slots[b][pos].zero_()
                self.missing[b] = 0
        self._launch(until=len(plan.buckets))
        out = list(grads)
        for b, (bucket, work) in enumerate(zip(plan.buckets, self.works)):
            work.wait()
            buf = self.bufs[b]
            if bucket.div != 1:
                buf.div_(bucket.div)
            for pos, i in enumerate(bucket.leaves):
                spec = plan.have[i]
                piece = self.slots[b][pos].view(plan.local_shape[i])
                out[i] = DTensor.from_local(piece.to(spec.tensor_meta.dtype), spec.mesh, plan.want[i], run_check=False,
                                            shape=spec.shape, stride=contiguous_stride(spec.shape))
        return out

    def _build(self, grads: list) -> None:
        """The plan, from the learning step's gradients: the leaves reduced over one mesh dim (``Partial`` sum or
        avg there, the param ``Replicate``, every other dim as the param's) in the order they came, bucketed per
        (process group, divisor, accumulation dtype) by size."""
        plan, xs = self.plan, self.xs
        first, rest = _SIZES[1], _SIZES[0]
        open_: dict[tuple, int] = {}  # (group ranks, divisor, dtype) -> the bucket being filled
        buckets: list[_Bucket] = []
        for i in plan.seen:
            x, g = xs[i], grads[i]
            if not isinstance(g, DTensor) or g.device_mesh != x.device_mesh:
                continue
            # The first mesh dim that reduces Partial -> Replicate (match_placements' stages run in dim order); the
            # other dims' moves (a SequenceParallel norm's Partial over tp) are left to match_placements after it.
            d = next((d for d, (have, want) in enumerate(zip(g.placements, x.placements))
                      if have.is_partial() and have.reduce_op in ("sum", "avg") and want.is_replicate()
                      and x.device_mesh.size(d) > 1), None)
            if d is None:
                continue
            have = g.placements[d]
            group = x.device_mesh.get_group(d)
            div = x.device_mesh.size(d) if have.reduce_op == "avg" else 1
            acc = acc_dtype(g.dtype)
            key = (tuple(dist.get_process_group_ranks(group)), div, acc)
            if key not in open_:
                open_[key] = len(buckets)
                buckets.append(_Bucket(group, div, acc, [], [0], 0))
            b = open_[key]
            bucket = buckets[b]
            plan.slot[i] = (b, len(bucket.leaves))
            plan.have[i], plan.local_shape[i] = g._spec, g._local_tensor.shape
            plan.want[i] = (*g.placements[:d], x.placements[d], *g.placements[d + 1:])
            bucket.leaves.append(i)
            bucket.numel += g._local_tensor.numel()
            bucket.offsets.append(bucket.numel)
            if bucket.numel * acc.itemsize >= (first if b == 0 else rest):  # full, as DDP closes a bucket
                del open_[key]
        plan.seen = []
        plan.buckets = buckets


def _local(x: Any) -> torch.Tensor:
    return x._local_tensor if isinstance(x, DTensor) else x
