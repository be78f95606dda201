"""Collectives on gradient trees: ``Partial`` reduction, redistribution to a param's placements, ZeRO buffers.

Each function moves values between ranks in as few collectives as the layout allows: leaves that need
the same collective over the same process group travel in one flat buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fxtrain import tree
from fxtrain._deferred import DTensor, Replicate
from fxtrain.distributed._norms import REDUCE_OPS, acc_dtype, pack, to_local, unpack

__all__ = ["match_placements", "reduce_partials", "reduce_scatter_flat", "all_gather_flat"]


def reduce_partials(t: Any) -> Any:
    """``t`` with every ``Partial`` DTensor leaf reduced: ``Replicate`` on those mesh dims, same value.

    For elementwise transforms that are not linear (``clip``): they must see the reduced values. The
    :func:`match_placements` engine with ``Replicate`` as the target: leaves reduced over one process group
    travel in one buffer, one all-reduce per group and dtype, whatever their meshes and placements.
    Other leaves are returned as they are.

    >>> import torch
    >>> reduce_partials({"w": torch.ones(1)})["w"].tolist()
    [1.0]
    """
    flat, spec = tree.flatten(t)
    if not any(isinstance(x, DTensor) and any(p.is_partial() for p in x.placements) for x in flat):
        return t  # nothing to reduce (and under vmap/grad, nothing to plan)
    targets = [tuple(Replicate() if p.is_partial() else p for p in x.placements) if isinstance(x, DTensor)
               else None for x in flat]
    return tree.unflatten(spec, redistribute(flat, targets, lambda: tree.paths(t)))


def match_placements(grads: Any, params: Any) -> Any:
    """Each DTensor gradient in ``grads`` brought to the placements of its param, with the cheapest collectives.

    Per mesh dim, from the gradient's placement to the param's::

        Partial   -> Replicate   all-reduce, one flat buffer per (process group, dtype) for all such leaves
        Partial   -> Shard(k)    reduce-scatter, one padded rank-major buffer per (process group, dtype)
        Replicate -> Shard(k)    this rank's slice, no communication
        same      -> same        nothing (also any placement on a mesh dim of size 1)
        other     -> other       torch's ``DTensor.redistribute``, per leaf (Shard -> Replicate, strided...)

    Autograd produces all three mismatches with torch's own parallel modules: ``Replicate`` gradients for a
    ``Shard(0)`` embedding under ``RowwiseParallel`` (torch's optimizer copes through dispatch, fxtrain's
    local math must not), ``Partial`` ones for replicated params under data parallelism. Uneven shards
    follow DTensor's convention (``ceil(size / n)`` per rank, the last ones shorter or empty). Plain leaves
    and ``None`` pass through; ``params=None`` reduces ``Partial`` leaves only (:func:`reduce_partials`).

    Args:
      grads: a tree of tensors, DTensors or ``None``.
      params: the matching tree (same structure), or ``None``.

    Returns:
      ``grads`` with each DTensor leaf placed like its param (same mesh, same placements, same values).

    Raises:
      ValueError: naming the leaf path, when a gradient lives on another mesh than its param, its param is
        a plain tensor, or torch cannot redistribute it to its param's placements.

    Example:
        >>> import torch
        >>> match_placements({"w": torch.ones(2)}, {"w": torch.zeros(2)})["w"].tolist()   # plain: as is
        [1.0, 1.0]
    """
    flat, spec = tree.flatten(grads)
    if params is None or not any(isinstance(x, DTensor) for x in flat):
        return reduce_partials(grads)
    flat_p = tree.flatten(params)[0]
    if len(flat_p) != len(flat):
        raise ValueError(f"match_placements: grads and params differ at '{tree.first_mismatch(grads, params)}'")
    paths = lambda: tree.paths(grads)  # noqa: E731 - built only for an error message
    targets = []
    for i, (g, p) in enumerate(zip(flat, flat_p)):
        if not isinstance(g, DTensor):
            targets.append(None)
            continue
        if not isinstance(p, DTensor):
            raise ValueError(f"the gradient at '{paths()[i]}' is a DTensor on {g.device_mesh} but its param is "
                             "a plain tensor: build the param as a DTensor on that mesh, or compute with plain tensors")
        check_same_mesh(g, p, paths, i)
        targets.append(tuple(p.placements))
    return tree.unflatten(spec, redistribute(flat, targets, paths))


def check_same_mesh(g: DTensor, p: DTensor, paths: Callable[[], list], i: int) -> None:
    """Raises naming leaf ``i`` when gradient ``g`` and its param ``p`` live on different meshes."""
    if g.device_mesh != p.device_mesh:
        raise ValueError(f"the gradient at '{paths()[i]}' lives on {g.device_mesh} but its param on "
                         f"{p.device_mesh}: pass the params the loss computed with (same mesh)")


# --- the redistribution engine ------------------------------------------------------------------------
#
# Moves run stage by stage, one stage per mesh-dim position (dim 0 of every leaf's mesh, then dim 1...),
# so a leaf reduced over two dims is reduced over the first before the second, and every rank of a group
# walks the same sequence: buckets of a stage run in the order of their first leaf, the same tree on
# every rank that shares the mesh (as in the norm engine, fxtrain/distributed/_norms.py).

@dataclasses.dataclass
class _Move:
    """The leaves of one collective: ``kind`` 'reduce' (all-reduce) or 'scatter' (reduce-scatter)."""

    kind: str
    group: Any
    op: Any  # dist.ReduceOp
    div: int  # avg: divide by the group size after the SUM
    acc: torch.dtype
    n: int  # group size
    rank: int  # this rank's index in the group
    items: list  # (leaf index, tensor dim k for 'scatter', else None)
    key: tuple = ()  # (kind, group ranks, op, divisor, dtype): what leaves must share to share the buffer


@dataclasses.dataclass
class _Moves:
    stages: list  # per stage: a list of _Move and ('slice', leaf, k, n, rank) entries, in order
    collective_leaves: list[int]  # leaves moved by a collective (refused under autograd)
    changed: list[int]  # leaves whose placements change (relabels of size-1 dims included)
    fallback: list[int]  # leaves moved by DTensor.redistribute (moves with no bucketed collective here)


_MOVES: dict[tuple, _Moves] = {}


def redistribute(flat: list, targets: list, paths: Callable[[], list]) -> list:
    """The engine: each DTensor ``flat[i]`` brought to placements ``targets[i]`` (``None``: left as is);
    ``paths()`` names the leaves in errors. For transforms that choose targets of their own (``sharded_apply``'s
    ZeRO leaves keep their dp ``Partial``)."""
    key = tuple((x._spec, t) if t is not None else None for x, t in zip(flat, targets))
    moves = _MOVES.get(key)
    if moves is None:
        moves = _plan_moves(flat, targets)
        if len(_MOVES) >= 64:
            _MOVES.pop(next(iter(_MOVES)))
        _MOVES[key] = moves
    if not moves.changed:
        return flat
    if moves.collective_leaves:
        _refuse_autodiff("match_placements", [flat[i] for i in moves.collective_leaves])
    cur = {i: to_local(flat[i]) for i in moves.changed if i not in moves.fallback}
    for stage in moves.stages:
        for m in stage:
            if isinstance(m, tuple):  # ('slice', i, k, n, rank): Replicate -> Shard(k), no communication
                _, i, k, n, rank = m
                start, length = _chunk(cur[i].shape[k], n, rank)
                cur[i] = cur[i].narrow(k, start, length)
                if k != 0:
                    cur[i] = cur[i].contiguous()
            elif m.kind == "reduce":
                idx = [i for i, _ in m.items]
                like = [cur[i] for i in idx]
                buf = pack(like, m.acc, mixed=len({x.dtype for x in like}) > 1)
                dist.all_reduce(buf, op=m.op, group=m.group)
                if m.div != 1:
                    buf.div_(m.div)
                for i, piece in zip(idx, unpack(buf, like)):
                    cur[i] = piece.to(flat[i].dtype)
            else:
                _reduce_scatter(m, cur, flat)
    out = list(flat)
    for i, local in cur.items():
        x = flat[i]
        out[i] = DTensor.from_local(local, x.device_mesh, targets[i], run_check=False, shape=x.shape,
                                    stride=contiguous_stride(x.shape))
    for i in moves.fallback:
        try:
            out[i] = flat[i].redistribute(flat[i].device_mesh, targets[i])
        except Exception as e:  # noqa: BLE001 - re-raised naming the leaf
            raise ValueError(f"the gradient at '{paths()[i]}' has placements {tuple(flat[i].placements)} on "
                             f"{flat[i].device_mesh} and cannot be brought to its param's {targets[i]} ({e}); "
                             "bring it there in the loss, or build the param as the gradient comes") from None
    return out


def _plan_moves(flat: list, targets: list) -> _Moves:
    stages: list[list] = []
    collective: list[int] = []
    changed: list[int] = []
    fallback: list[int] = []
    for i, (x, want) in enumerate(zip(flat, targets)):
        if want is None or want == tuple(x.placements):
            continue
        changed.append(i)
        mesh = x.device_mesh
        # Dims of size 1 hold the whole tensor whatever their placement: a relabel, no data moves.
        todo = [(d, have, to) for d, (have, to) in enumerate(zip(x.placements, want))
                if have != to and mesh.size(d) > 1]
        native = all((have.is_replicate() and type(to).__name__ == "Shard")
                     or (have.is_partial() and have.reduce_op in ("sum", "avg")
                         and (to.is_replicate() or type(to).__name__ == "Shard"))
                     for _, have, to in todo)
        if not native:  # anything else (Shard -> Replicate, strided shards...): torch's own redistribute
            fallback.append(i)
            collective.append(i)
            continue
        for d, have, to in todo:
            while len(stages) <= d:
                stages.append([])
            n, rank = mesh.size(d), mesh.get_local_rank(d)
            if have.is_replicate():
                stages[d].append(("slice", i, to.dim, n, rank))
                continue
            kind = "scatter" if to.is_shard() else "reduce"
            group = mesh.get_group(d)
            op = getattr(dist.ReduceOp, REDUCE_OPS[have.reduce_op])
            div = n if have.reduce_op == "avg" else 1
            acc = acc_dtype(x.dtype)
            bkey = (kind, tuple(dist.get_process_group_ranks(group)), str(op), div, acc)
            move = next((m for m in stages[d] if isinstance(m, _Move) and m.key == bkey), None)
            if move is None:
                move = _Move(kind, group, op, div, acc, n, rank, [], bkey)
                stages[d].append(move)
            move.items.append((i, to.dim if to.is_shard() else None))
            collective.append(i)
    return _Moves([s for s in stages if s], collective, changed, fallback)


def _chunk(size: int, n: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's piece of ``size`` rows split over ``n`` ranks, DTensor's ``Shard`` rule."""
    per = -(-size // n)
    start = min(rank * per, size)
    return start, max(0, min(size, start + per) - start)


def _reduce_scatter(m: _Move, cur: dict, flat: list) -> None:
    """One reduce-scatter for the leaves of ``m``: each leaf's rows along its dim k padded to ``n`` equal
    chunks and laid out rank-major, so segment r of the buffer holds every leaf's chunk r."""
    moved = [cur[i].movedim(k, 0) for i, k in m.items]
    rows = []
    for x in moved:
        padded = x.new_zeros((-(-x.shape[0] // m.n) * m.n, *x.shape[1:]), dtype=m.acc)
        padded[: x.shape[0]] = x
        rows.append(padded.reshape(m.n, -1))
    send = (torch.cat(rows, dim=1) if len(rows) > 1 else rows[0]).reshape(-1)
    out = torch.empty(send.numel() // m.n, dtype=m.acc, device=send.device)
    dist.reduce_scatter_tensor(out, send, op=m.op, group=m.group)
    if m.div != 1:
        out.div_(m.div)
    offset = 0
    for (i, k), x, r in zip(m.items, moved, rows):
        per = -(-x.shape[0] // m.n)
        piece = out[offset:offset + r.shape[1]].reshape(per, *x.shape[1:])
        offset += r.shape[1]
        length = _chunk(x.shape[0], m.n, m.rank)[1]
        cur[i] = piece[:length].movedim(0, k).to(flat[i].dtype).contiguous()


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (what ``DTensor.from_local``'s ``stride=`` wants for a
    global shape): ``contiguous_stride((2, 3, 4)) == (12, 4, 1)``; a 0-size dim counts as 1."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


# --- flat-buffer collectives for sharded optimizer state (added for fxtrain/transforms/_sharding.py) ---
#
# ``sharded_apply(tx, shard_over="dp")`` (ZeRO-1/2) packs the gradients of many leaves into one buffer
# laid out rank-major, every rank's segment padded to the same length by the caller: gloo's uneven
# all_gather is broken, and one even collective per (mesh, dtype) beats one per leaf.

def reduce_scatter_flat(send: torch.Tensor, mesh: Any, dim: int, *, reduce_op: str | None = "sum") -> torch.Tensor:
    """This rank's segment of ``send`` (1-D, ``n`` equal segments, rank-major) summed over mesh dim ``dim``.

    ``reduce_op`` is the ``Partial`` op the segments carry (``"sum"`` or ``"avg"``); ``None`` means the
    buffer is already identical on every rank (``Replicate``): the segment is sliced with no communication.

    >>> import torch
    >>> from torch.distributed.device_mesh import DeviceMesh
    >>> reduce_scatter_flat(torch.arange(4.0), None, 0, reduce_op=None).tolist()   # one rank: the buffer
    [0.0, 1.0, 2.0, 3.0]
    """
    if mesh is None or mesh.size(dim) == 1:
        return send
    n, r = mesh.size(dim), mesh.get_local_rank(dim)
    seg = send.numel() // n
    if reduce_op is None:
        return send[r * seg:(r + 1) * seg]
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_flat: cannot reduce-scatter a Partial({reduce_op!r}) gradient")
    out = torch.empty(seg, dtype=send.dtype, device=send.device)
    dist.reduce_scatter_tensor(out, send, group=mesh.get_group(dim))
    if reduce_op == "avg":
        out.div_(n)
    return out


def all_gather_flat(piece: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """The 1-D ``piece`` of every rank along mesh dim ``dim``, concatenated in rank order (equal sizes).

    >>> import torch
    >>> all_gather_flat(torch.ones(2), None, 0).tolist()   # one rank: the piece itself
    [1.0, 1.0]
    """
    if mesh is None or mesh.size(dim) == 1:
        return piece
    out = torch.empty(piece.numel() * mesh.size(dim), dtype=piece.dtype, device=piece.device)
    dist.all_gather_into_tensor(out, piece.contiguous(), group=mesh.get_group(dim))
    return out


__all__ += ["reduce_scatter_flat", "all_gather_flat"]

def _refuse_autodiff(what: str, leaves: Sequence) -> None:
    """Collectives run outside autograd and have no batching rule: raise rather than return a detached
    (silently wrong) gradient or fail deep inside a torch.func transform."""
    if tree.transformed():
        raise ValueError(f"{what}: its collectives cannot run under a torch.func transform (vmap, grad, jvp)")
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
        raise ValueError(f"{what}: cannot differentiate through its collectives (they are outside autograd); "
                         "differentiate on one process")



# --- a batch handed by the rank that reads it to the ranks that use the same slice (tp, pp peers) -----------------

_BATCH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                 torch.int8, torch.uint8)
_MAX_DIMS, _MAX_TENSORS = 8, 8


def broadcast_batch(batch: tuple | None, mesh: Any, dims: Sequence[str]) -> tuple | None:
    """``batch`` (a tuple of tensors), read by the rank at coordinate 0 along every mesh dim of ``dims``, on every
    rank of its group along those dims; the others pass ``None`` and get it.

    The runner's data path for tp and pp peers, which use the same slice of a batch (Megatron-LM's
    ``broadcast_data`` from tensor-parallel rank 0; torchtitan reads it on every peer instead): one rank reads, so
    the items read per step across the ranks are the global batch. Per mesh dim in turn (a tree: along ``dims[0]``
    among the ranks at coordinate 0 along the later dims, then along ``dims[1]``...), over the mesh's own groups:
    one header of shapes and dtypes (81 int64, which the receivers read on the host: on the CPU where the group
    has gloo, as the runner's ``cpu:gloo,cuda:nccl`` groups do, so that no rank waits for its GPU; else on the
    mesh's device, as Megatron's sizes), then one broadcast per tensor on the mesh's device (NCCL on CUDA). A
    pipeline's middle stages get the batch too: they read its length, and a batch is small next to the
    activations a stage sends per micro-batch.

    >>> import torch
    >>> broadcast_batch((torch.ones(2), torch.zeros(2)), None, ())[0].tolist()   # no peers: the batch itself
    [1.0, 1.0]
    """
    if mesh is None or not dims:
        return batch
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    for i, d in enumerate(dims):
        if any(mesh.get_local_rank(later) != 0 for later in dims[i + 1:]):
            continue  # this rank's group along d holds no batch yet: it gets it along a later dim
        batch = _broadcast_tensors(batch, mesh.get_group(d), mesh.get_local_rank(d) == 0, device)
    return batch


def _broadcast_tensors(batch: tuple | None, group: Any, src: bool, device: torch.device) -> tuple:
    """``batch`` from the group's first rank (``src``) on every rank of ``group``: header, then each tensor."""
    header = torch.zeros(1 + _MAX_TENSORS * (2 + _MAX_DIMS), dtype=torch.int64)
    if src:
        batch = tuple(x.to(device).contiguous() for x in batch)
        bad = len(batch) > _MAX_TENSORS or any(x.dim() > _MAX_DIMS or x.dtype not in _BATCH_DTYPES for x in batch)
        header[0] = n = -1 if bad else len(batch)
        for j, x in enumerate(batch if not bad else ()):
            at = 1 + j * (2 + _MAX_DIMS)
            header[at:at + 2 + x.dim()] = torch.tensor([_BATCH_DTYPES.index(x.dtype), x.dim(), *x.shape])
    on_host = "gloo" in str(dist.get_backend(group))
    sent = header if on_host else header.to(device)
    dist.broadcast(sent, group=group, group_src=0)
    if not src:
        header = sent.cpu()  # the receivers' one wait: the shapes they allocate
        n = int(header[0])
    if n < 0:  # every rank of the group raises, none waits for tensors that do not come
        raise ValueError(f"broadcast_batch: a batch of at most {_MAX_TENSORS} tensors of at most {_MAX_DIMS} dims, "
                         f"dtypes {', '.join(str(t).removeprefix('torch.') for t in _BATCH_DTYPES)}, is handed to the "
                         "data peers (tp, pp); this one is not")
    if not src:
        rows = header[1:].view(_MAX_TENSORS, 2 + _MAX_DIMS)[:n].tolist()
        batch = tuple(torch.empty(r[2:2 + r[1]], dtype=_BATCH_DTYPES[r[0]], device=device) for r in rows)
    for x in batch:
        dist.broadcast(x, group=group, group_src=0)
    return batch


__all__ += ["broadcast_batch"]
