"""Everything that talks to torch.distributed lives here (meshes and process groups passed explicitly).

The one hard question this module answers: the L2 norm (and the finiteness) of a gradient tree whose
leaves are plain tensors and DTensors on any number of device meshes, with any placements, identical on
every rank and without gathering a gradient. The answer, used by :func:`global_norm`,
:func:`global_sum_sq` (for ``clip_by_global_norm`` and ``amp_cast``) and :func:`reduce_partials`:

1. **Plan** (once per leaf signature: DTensor specs, plain dtypes and shapes; cached). Each leaf goes to a
   *bucket* named by the process groups its squared sum must be summed over: the mesh dims whose
   placement is not ``Replicate`` (``Shard``, strided shards). ``Replicate`` dims are never reduced (that
   would count a replica twice); a plain tensor is taken as identical on every rank (bucket of no
   group). ``Partial`` leaves first need their values reduced (the norm of a sum is not the sum of norms).
2. **Local math**, in float32 (float64 for float64 leaves; bf16/fp16 accumulate in float32): one
   ``torch._foreach_norm`` over the large local pieces; small pieces of one bucket and dtype copied into
   one flat buffer and summed in one kernel (on CPU that beats a per-tensor norm below ~2k elements);
   ``Partial`` leaves of one (mesh, placements) packed into one buffer, all-reduced over their
   ``Partial`` dims and summed.
3. **Scalars.** A float64 vector of per-bucket sums of squares plus two counts (pieces whose norm is NaN
   and pieces whose norm is inf) takes one ``all_reduce(SUM)`` per process group (groups with the same
   ranks are one). Groups run in the order they first appear in the tree, mesh dims in order, so every
   rank walks the same sequence of mesh dims: summing over dp then tp is the sum over the mesh only if no
   rank does tp first (ordering groups by their rank lists breaks that: rank 0 would reduce (0, 1) first
   while rank 2 reduces (0, 2) first, mixing reduced and unreduced values; found by the 2-D tests). The
   counts are reduced over *every* mesh dim, ``Replicate`` ones included: a NaN on one replica is seen
   everywhere. They use SUM because gloo's ``all_reduce(MAX)`` drops NaN depending on rank order.
4. **Across groups.** Buckets are summed (powers, never norms), then ``(sum_sq, nan, inf)`` is summed over
   each of ``groups`` (process groups whose ranks hold disjoint parameters: pipeline stages, experts
   kept as plain tensors), and the root is taken once.

Communication never grows with the number of leaves: scalars of a group travel together.

Example:
    >>> import torch
    >>> from fxtrain.distributed import global_norm
    >>> float(global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0]), None]}))
    5.0
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from fxtrain import tree
from fxtrain._base import EmptyState, GradientTransformation, kernel, transform

__all__ = ["global_norm", "global_sum_sq", "GlobalSumSq", "to_local", "local_leaves", "reduce_partials"]

Group = Any  # a torch.distributed ProcessGroup, or a 1-D DeviceMesh

_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}  # avg: SUM, then divide
_MAX_PLANS = 64  # cached plans (one per leaf signature seen); more than that and the oldest goes


class GlobalSumSq(NamedTuple):
    """The result of :func:`global_sum_sq`, both 0-dim and identical on every rank."""

    sum_sq: torch.Tensor  #: sum of squares of every element of the tree (NaN/inf if any element is)
    nonfinite: torch.Tensor  #: 0 when every element on every rank is finite, > 0 otherwise


# --- public functions -----------------------------------------------------------------------------

# The local piece of a DTensor (a writable view), anything else as is: defined once, in fxtrain/tree.py.
to_local = tree.local


def local_leaves(t: Any) -> list[torch.Tensor]:
    """The non-``None`` leaves of ``t`` with each DTensor replaced by its local piece (a view of it).

    Writing into the returned tensors writes into the DTensors: this is how transforms scale or clamp
    DTensor gradients with one ``torch._foreach_*_`` call and no DTensor dispatch.

    >>> import torch
    >>> xs = local_leaves({"a": torch.ones(2), "b": None})
    >>> [x.tolist() for x in xs]
    [[1.0, 1.0]]
    """
    return [to_local(x) for x in tree.leaves(t)]


def global_sum_sq(t: Any, *, groups: Sequence[Group] = ()) -> GlobalSumSq:
    """Sum of squares and non-finite count of a tree of plain tensors and DTensors on any meshes.

    The reduction machinery behind :func:`global_norm`, exposed for transforms that must decide something
    about the whole tree on every rank at once (``amp_cast``: skip the step iff ``nonfinite > 0``).

    With ``x`` the full (logical) value of each leaf::

        sum_sq    = sum over leaves x, elements i of x_i ** 2
        nonfinite = 0 if every local piece on every rank holding a piece of the tree is finite, else > 0

    ``nonfinite`` counts the local partial sums (one per large leaf, one per pack of small leaves) that
    are not finite, summed over every process group of the plan (so one can be counted more than once:
    read it as a flag). A partial sum that overflows the accumulation dtype (float32: above ~3.4e38)
    counts as non-finite, as the norm would be.
    Plain leaves are taken as identical on every rank; one that is not finite on a single rank is seen by
    the ranks that share a mesh or a ``groups`` entry with it.

    Args:
      t: a pytree whose leaves are tensors, DTensors (any meshes, any placements) or ``None``.
      groups: process groups (or 1-D device meshes) whose ranks hold disjoint parts of the tree, for
        parameters that no DTensor mesh describes: pipeline stages, experts kept as plain tensors. The
        sums are added over each group, in the order given (which must be the same on every rank),
        after the mesh reductions. Never list a group over which some leaf is already a DTensor
        ``Shard`` or ``Replicate``: its pieces would be counted again.

    Returns:
      :class:`GlobalSumSq` ``(sum_sq, nonfinite)``: 0-dim, float32 (float64 if a leaf is float64) and
      float32, identical on every rank. ``sum_sq`` is NaN on every rank if an element anywhere is NaN,
      else inf if one is inf.

    Example:
        >>> import torch
        >>> s = global_sum_sq({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([float("inf")])})
        >>> float(s.sum_sq), float(s.nonfinite)
        (inf, 1.0)
    """
    return _global_sum_sq(tree.leaves(t), groups, counts=True)


def global_norm(t: Any, *, groups: Sequence[Group] = ()) -> torch.Tensor:
    """The L2 norm of a whole tree, as a 0-dim tensor identical on every rank (Optax's ``global_norm``).

    ``global_norm(t) = sqrt(sum over leaves x, elements i of x_i ** 2)`` where ``x`` is the full value of a
    DTensor leaf (``Shard``, strided shards, ``Replicate`` counted once, ``Partial`` reduced first), taken
    on any number of different meshes, and a plain tensor leaf is taken as identical on every rank.
    ``None`` leaves are skipped. One small ``all_reduce`` per process group involved, whatever the number
    of leaves; no host sync, no gradient gathered. How: see the module docstring.

    Args:
      t: a pytree whose leaves are tensors, DTensors or ``None``.
      groups: process groups whose ranks hold disjoint parameters (see :func:`global_sum_sq`).

    Returns:
      A 0-dim float32 tensor (float64 if a leaf is float64); NaN on every rank if any element on any rank
      is NaN, else inf if one is inf.

    Example:
        >>> import torch
        >>> float(global_norm([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.bfloat16)]))
        5.0
    """
    return _global_sum_sq(tree.leaves(t), groups, counts=False).sum_sq.sqrt()


def reduce_partials(t: Any) -> Any:
    """``t`` with every ``Partial`` DTensor leaf reduced: ``Replicate`` on those mesh dims, same value.

    For elementwise transforms that are not linear (``clip``): they must see the reduced values. Leaves
    of one (mesh, placements) are packed into one buffer and all-reduced together (one collective per
    ``Partial`` mesh dim of that group, not per leaf). Other leaves are returned as they are.

    >>> import torch
    >>> reduce_partials({"w": torch.ones(1)})["w"].tolist()
    [1.0]
    """
    flat, spec = tree.flatten(t)
    present = [x for x in flat if x is not None]
    if not any(isinstance(x, DTensor) for x in present):
        return t  # plain leaves: nothing to reduce (and under vmap/grad, nothing to plan)
    plan = _plan(present)
    if not plan.partials:
        return t
    _refuse_autodiff("reduce_partials", [present[i] for p in plan.partials for i in p.positions])
    local = [to_local(x) for x in present]
    out = list(present)
    for p in plan.partials:
        pieces = _unflat(_reduced_buffer(p, local), [local[i] for i in p.positions])
        for i, piece in zip(p.positions, pieces):
            x = present[i]
            out[i] = DTensor.from_local(
                piece.to(x.dtype), x.device_mesh, p.reduced_placements,
                run_check=False, shape=x.shape, stride=x.stride(),
            )
    it = iter(out)
    return tree.unflatten(spec, [None if x is None else next(it) for x in flat])


# --- the plan -------------------------------------------------------------------------------------

# Local pieces up to this many elements are flattened into one buffer per (bucket, dtype) and summed in
# one kernel; bigger ones go through one torch._foreach_norm. On CPU _foreach_norm costs ~1.5 us per
# tensor (one vector_norm each) and copying costs ~1 us per 1,500 floats: measured crossover ~2-4k
# elements, so the copy only ever touches the small leaves (biases, norms, experts' slices).
_PACK_MAX_NUMEL = 2048


@dataclasses.dataclass
class _Partial:
    """``Partial`` leaves of one (mesh, placements, accumulation dtype): reduced as one flat buffer."""

    positions: list[int]  # indices into the list of present leaves
    reductions: list[tuple[Any, Any, int]]  # (process group, ReduceOp, divisor) per Partial mesh dim
    acc: torch.dtype
    reduced_placements: tuple  # the placements once reduced: Partial -> Replicate
    mixed: bool = False  # leaves of several dtypes (bf16 and float32 under one accumulation dtype)


@dataclasses.dataclass
class _Plan:
    foreach: list[tuple[torch.dtype | None, list[int] | None]]  # (dtype= for _foreach_norm, positions or all)
    packs: list[tuple[torch.dtype, list[int] | None]]  # (acc dtype, small leaves of one bucket and dtype, or all)
    partials: list[_Partial]
    gather: torch.Tensor  # (buckets + 2, 3 * values) 0/1: local values and their nan/inf flags -> vector
    steps: list[tuple[Any, torch.Tensor | None]]  # (group, entries of the scalar vector, None for all)
    fold: torch.Tensor  # (3, buckets + 2) 0/1: vector -> (sum_sq, nan, inf)
    device: torch.device
    out_dtype: torch.dtype


_PLANS: dict[tuple, _Plan] = {}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _plan(leaves: list) -> _Plan:
    # The key is the DTensorSpec of each DTensor leaf (mesh, placements, shape, stride, dtype; its hash
    # is cached, and autograd hands out the same spec objects step after step) and (dtype, shape, device)
    # of each plain leaf. The plan behind it is built once.
    key = tuple(x._spec if isinstance(x, DTensor) else (x.dtype, x.shape, x.device) for x in leaves)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _build_plan(leaves)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan


def _group_key(pg: Any) -> tuple:
    # Groups with the same ranks are one group for a SUM: their scalars travel together.
    return tuple(dist.get_process_group_ranks(pg))


def _build_plan(leaves: list) -> _Plan:
    device = leaves[0].device if leaves else torch.device("cpu")
    big: dict[torch.dtype, list[int]] = {}  # accumulation dtype -> leaves normed one by one
    small: dict[tuple, list[int]] = {}  # (bucket, dtype) -> leaves flattened together
    leaf_bucket: dict[int, tuple] = {}  # leaf -> bucket: sorted keys of the groups its sum is summed over
    partials: dict[tuple, _Partial] = {}
    partial_bucket: dict[tuple, tuple] = {}
    groups: dict[tuple, Any] = {}  # group key -> process group, every mesh dim of size > 1, in order seen
    for i, x in enumerate(leaves):
        bucket: tuple = ()
        if isinstance(x, DTensor):
            mesh = x.device_mesh
            if mesh.get_coordinate() is None:  # this rank holds no piece of this mesh's leaves
                continue
            summed, reductions = [], []
            reduced = tuple(Replicate() if p.is_partial() else p for p in x.placements)
            for d, p in enumerate(x.placements):
                if mesh.size(d) == 1:
                    continue
                gk = _group_key(mesh.get_group(d))
                groups.setdefault(gk, mesh.get_group(d))
                if p.is_replicate():
                    continue  # every rank along d holds the same values: summing would count them twice
                if p.is_partial():
                    op = getattr(dist.ReduceOp, _REDUCE_OPS[p.reduce_op])
                    reductions.append((gk, op, mesh.size(d) if p.reduce_op == "avg" else 1))
                else:  # Shard, _StridedShard: disjoint pieces along d
                    summed.append(gk)
            bucket = tuple(sorted(set(summed)))
            if reduced != tuple(x.placements):  # Partial (on a dim of size 1 too: reduce_partials marks it)
                pkey = (id(mesh), x.placements, _acc(x.dtype))
                if pkey not in partials:
                    partials[pkey] = _Partial([], [(groups[g], op, div) for g, op, div in reductions],
                                              _acc(x.dtype), reduced)
                    partial_bucket[pkey] = bucket
                partials[pkey].positions.append(i)
                partials[pkey].mixed |= leaves[partials[pkey].positions[0]].dtype != x.dtype
                continue
            numel = x._local_tensor.numel()
        else:
            numel = x.numel()
        leaf_bucket[i] = bucket
        if numel <= _PACK_MAX_NUMEL:
            small.setdefault((bucket, x.dtype), []).append(i)
        else:
            big.setdefault(_acc(x.dtype), []).append(i)

    # Local values come out in this order: one per big leaf, one per pack, one per partial group.
    order = [leaf_bucket[i] for pos in big.values() for i in pos] + [b for b, _ in small]
    order += list(partial_bucket.values())
    bucket_index: dict[tuple, int] = {}
    for b in order:
        bucket_index.setdefault(b, len(bucket_index))
    nb, n = len(bucket_index), len(order)
    foreach = [(None if all(leaves[i].dtype == acc for i in pos) else acc,
                None if len(pos) == len(leaves) else pos) for acc, pos in big.items()]
    packs = [(_acc(dtype), None if len(pos) == len(leaves) else pos) for (_, dtype), pos in small.items()]

    steps = []
    for gk in groups:  # order of first appearance: the same on every rank, mesh dims in order
        entries = [j for b, j in bucket_index.items() if gk in b] + [nb, nb + 1]  # counts: every group
        steps.append((groups[gk], None if len(entries) == nb + 2 else torch.tensor(entries, device=device)))
    # The sums into buckets and across buckets are matrix-vector products with 0/1 matrices: one
    # deterministic kernel each (scatter-adds use atomics on GPU, and replicas must round alike).
    rows = [bucket_index[b] for b in order] + [nb] * n + [nb + 1] * n
    gather = torch.zeros(nb + 2, 3 * n, dtype=torch.float64)
    gather[rows, list(range(3 * n))] = 1.0
    fold = torch.zeros(3, nb + 2, dtype=torch.float64)
    fold[[0] * nb + [1, 2], list(range(nb + 2))] = 1.0
    out = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
    return _Plan(foreach=foreach, packs=packs, partials=list(partials.values()),
                 gather=gather.to(device), steps=steps, fold=fold.to(device), out_dtype=out,
                 device=device)


# --- execution ------------------------------------------------------------------------------------

def _flat(xs: list[torch.Tensor], acc: torch.dtype, mixed: bool = False) -> torch.Tensor:
    """A new 1-D buffer of dtype ``acc`` holding every element of ``xs`` (one C++ call for the list)."""
    if len(xs) == 1:
        return xs[0].reshape(-1).to(acc, copy=True)
    if mixed:
        return torch.cat([x.reshape(-1).to(acc) for x in xs])
    return torch._utils._flatten_dense_tensors(xs).to(acc)


def _unflat(buf: torch.Tensor, like: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of the 1-D ``buf`` shaped like ``like``, in order (the inverse of :func:`_flat`, dtype aside)."""
    return torch._utils._unflatten_dense_tensors(buf, like)


def _all_reduce_flat(xs: list[torch.Tensor], acc: torch.dtype, reductions: list, mixed: bool = False) -> torch.Tensor:
    """``xs`` packed into one new buffer of dtype ``acc`` and all-reduced in place, one collective per
    ``(process group, ReduceOp, divisor)`` of ``reductions`` (``reduce_partials`` and ``all_reduce_mean``)."""
    buf = _flat(xs, acc, mixed)
    for pg, op, div in reductions:
        dist.all_reduce(buf, op=op, group=pg)
        if div != 1:
            buf.div_(div)
    return buf


def _reduced_buffer(p: _Partial, local: list[torch.Tensor]) -> torch.Tensor:
    """The local pieces of ``p``'s leaves, flattened into one buffer and reduced over the Partial dims."""
    return _all_reduce_flat([local[i] for i in p.positions], p.acc, p.reductions, p.mixed)


def _as_group(g: Group) -> Any:
    return g.get_group() if hasattr(g, "get_group") else g


def _local_sums(plan: _Plan, local: list[torch.Tensor]) -> torch.Tensor:
    """1-D tensor of local sums of squares: one per big leaf, one per pack, one per partial group."""
    values = []
    for dtype, pos in plan.foreach:
        xs = local if pos is None else [local[i] for i in pos]
        values.append(torch.stack(torch._foreach_norm(xs, 2, dtype=dtype)).square())
    for acc, pos in plan.packs:
        # In place on our own copy (a second large temporary costs more than the math), pairwise sum.
        values.append(_flat(local if pos is None else [local[i] for i in pos], acc).pow_(2).sum().reshape(1))
    for p in plan.partials:
        values.append(_reduced_buffer(p, local).pow_(2).sum().reshape(1))
    if not values:
        return torch.zeros(0, dtype=plan.out_dtype, device=plan.device)
    return values[0] if len(values) == 1 else torch.cat([v.to(plan.out_dtype) for v in values])


def _global_sum_sq(leaves: list, groups: Sequence[Group], counts: bool) -> GlobalSumSq:
    if tree.is_functional() and not groups and not any(isinstance(x, DTensor) for x in leaves):
        # The composable path (vmap, grad, jvp): Optax's sum of |x|^2, leaf by leaf, no packing.
        wide = any(x.dtype == torch.float64 for x in leaves)
        value = tree.sum_sq(leaves, torch.float64 if wide else torch.float32)
        return GlobalSumSq(value, (~value.isfinite()).float() if counts else torch.zeros(()))
    if torch.is_grad_enabled() and any(x.requires_grad for x in leaves):
        raise NotImplementedError(
            "the global norm of DTensor leaves (or over process groups) is not differentiable: its "
            "collectives are outside autograd; differentiate on one process with plain tensors")
    plan = _plan(leaves)
    value = _local_sums(plan, [to_local(x) for x in leaves])

    if not plan.steps and not groups:  # nothing to communicate: the single-process path
        bad = (~value.isfinite()).sum(dtype=torch.float32) if counts else torch.zeros(())
        return GlobalSumSq(value.sum(), bad)

    # [per-bucket sums of squares..., nan count, inf count] in float64, one all_reduce per group.
    # Non-finite values travel as counts only (0 * inf in the 0/1 products below would spread NaN into
    # every entry, counts included); the verdict is rebuilt from the counts at the end.
    v = value.double()
    entries = torch.cat([v.nan_to_num(0.0, 0.0, 0.0), v.isnan(), v.isinf()])  # flags promoted to float64
    vec = torch.mv(plan.gather, entries)
    for pg, idx in plan.steps:
        if idx is None:
            dist.all_reduce(vec, group=pg)
        else:
            sub = vec.index_select(0, idx)
            dist.all_reduce(sub, group=pg)
            vec.index_copy_(0, idx, sub)
    total = torch.mv(plan.fold, vec)
    for g in groups:
        dist.all_reduce(total, group=_as_group(g))
    sum_sq, nan, inf = total.unbind()
    # Every rank saw the same counts: make the non-finite verdict, not only the local sum, identical.
    sum_sq = torch.where(nan > 0, torch.nan, torch.where(inf > 0, torch.inf, sum_sq))
    return GlobalSumSq(sum_sq.to(plan.out_dtype), (nan + inf).float())


# --- a local count summed over every rank holding a piece of a tree (added for fxtrain/amp.py) -------

def global_count(count: torch.Tensor, t: Any, *, groups: Sequence[Group] = ()) -> torch.Tensor:
    """``count`` (a 0-dim tensor computed locally) summed over every rank that holds a piece of ``t``.

    The lean sibling of :func:`global_sum_sq`'s ``nonfinite`` for a flag a transform already has:
    ``amp_cast`` gets "a non-finite value was found" for free from the unscale kernel and only needs every
    rank to agree on it. One ``all_reduce(SUM)`` of one number per process group of ``t``'s plan (every
    mesh dim of size > 1 of every DTensor leaf, ``Replicate`` and ``Partial`` ones included: a flag raised
    on one replica or by one partial sum must be seen by all), then over each of ``groups``; no norm is
    taken and no ``Partial`` value is reduced. Summed over several groups in turn, a rank can be counted
    more than once: read the result as a flag (0 or not). Without communication (plain leaves, no
    ``groups``) it is ``count`` itself.

    Args:
      count: 0-dim tensor, this rank's count (e.g. a float32 found-inf flag).
      t: the tree whose meshes say who must agree (leaves: tensors, DTensors or ``None``).
      groups: more process groups (or 1-D meshes) to sum over, as in :func:`global_sum_sq`.

    Returns:
      A 0-dim tensor of ``count``'s dtype and device, identical on every rank concerned.

    Example:
        >>> import torch
        >>> float(global_count(torch.tensor(1.0), {"w": torch.ones(2)}))
        1.0
    """
    plan = _plan(tree.leaves(t))
    if not plan.steps and not groups:
        return count
    total = count.detach().reshape(1).to(torch.float64, copy=True)  # exact sums of small integers
    for pg, _ in plan.steps:
        dist.all_reduce(total, group=pg)
    for g in groups:
        dist.all_reduce(total, group=_as_group(g))
    return total.reshape(()).to(count.dtype)


__all__ += ["global_count"]


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


# --- process runtime: torchrun ranks, the device, plain data parallelism (used by fxtrain.train) -----
# Process-group setup from torchrun's environment, one shared run stamp, a gradient all-reduce transform
# for ``parallel=dp`` on plain tensors, and metric averaging for logs.

__all__ += ["init_from_env", "rank_and_world", "shared_stamp", "world_mesh", "device", "local_batch",
            "all_reduce_mean", "mean_across_ranks", "shutdown"]


def init_from_env() -> tuple[int, int]:
    """Joins the process group torchrun describes (``WORLD_SIZE`` > 1); returns ``(rank, world_size)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # gloo for CPU tensors always; NCCL for CUDA tensors when this build has it.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return rank_and_world()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shared_stamp() -> str:
    """A ``YYYY-MM-DD/HH-MM-SS`` stamp taken on rank 0 and given to every rank (one run directory for all)."""
    stamp = [datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return stamp[0]


def world_mesh(device_type: str, name: str | None = None):
    """A 1-D ``DeviceMesh`` over all ranks (its repr names the ranks, unlike a process group's).

    ``name`` names its one dim (``"dp"``: what ``sharded_apply(..., shard_over="dp")`` looks for).
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=(name,) if name else None)


def device(name: str) -> torch.device:
    """``auto``: this rank's CUDA device when there is one, else CPU; anything else as ``torch.device``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(name)


def local_batch(batch: tuple, rank: int, world: int) -> tuple:
    """This rank's contiguous 1/world slice of every tensor in a global batch (the batch itself for one rank)."""
    if world == 1:
        return batch
    n = len(batch[0])
    if n % world:
        raise ValueError(f"data.batch_size={n} does not split evenly over {world} ranks (parallel=dp)")
    return tuple(x.tensor_split(world)[rank] for x in batch)


@transform(elementwise=False)
def all_reduce_mean(world_size: int) -> GradientTransformation:
    """Averages the gradients across all ranks of the default process group (one all_reduce per update).

    Data parallelism on plain tensors: every rank computes the gradient of its share of the batch, and
    after this transform every rank holds the gradient of the whole batch (equal shares assumed).
    """
    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return tree.put(updates, updates, _all_reduce_mean_(tree.leaves(updates), world_size)), state

    return GradientTransformation(init_fn, update_fn)


def _all_reduce_mean_(leaves: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """Every plain tensor in ``leaves`` averaged over all ranks: written into ``leaves`` (op layer: in place
    when donated, new tensors inside :func:`fxtrain.tree.functional`); returns the results."""
    if not leaves:
        return leaves
    _refuse_autodiff("all_reduce_mean", leaves)
    # One flat buffer (in the leaves' promoted dtype), one collective: per-leaf all_reduces cost a
    # round trip each.
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in leaves))
    mixed = any(g.dtype != dtype for g in leaves)
    flat = _all_reduce_flat(leaves, dtype, [(None, dist.ReduceOp.SUM, world_size)], mixed)
    return tree.copy_(leaves, list(_unflat(flat, leaves)))


def _refuse_autodiff(what: str, leaves: Sequence) -> None:
    """Collectives run outside autograd and have no batching rule: raise rather than return a detached
    (silently wrong) gradient or fail deep inside a torch.func transform."""
    if tree.transformed():
        raise ValueError(f"{what}: its collectives cannot run under a torch.func transform (vmap, grad, jvp)")
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
        raise ValueError(f"{what}: cannot differentiate through its collectives (they are outside autograd); "
                         "differentiate on one process")


def mean_across_ranks(metrics: dict[str, float], world: int) -> dict[str, float]:
    """The average over ranks of each (float) metric; identical on every rank. For logs, not the hot path."""
    if world == 1 or not metrics:
        return metrics
    values = torch.tensor(list(metrics.values()), dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(metrics, (values / world).tolist()))


def shutdown() -> None:
    """Leaves the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- parallel=dp with parallel.shard_optimizer=true: ZeRO over plain data parallelism (fxtrain.build) ---
# The loop keeps plain params and batches (the models, evaluation and checkpoints of params stay as they
# are); only the optimizer sees DTensors, so ``sharded_apply(..., shard_over="dp")`` can shard its state.

__all__ += ["on_dp_mesh"]


@transform(elementwise=False)
def on_dp_mesh(tx: GradientTransformation, mesh: Any, *, reduce_first: bool = False) -> GradientTransformation:
    """Runs ``tx`` on DTensor views of data-parallel params and gradients: ZeRO-1/2 for ``parallel=dp``.

    Under plain data parallelism every rank holds all params as plain tensors and the gradient of its
    share of the batch. ``tx`` sees them on the 1-D ``mesh`` (one dim, named ``"dp"``), with no copy::

        params  -> DTensor(Replicate())                      the same on every rank
        updates -> DTensor(Partial("avg"))                   their mean is the whole batch's gradient
        updates -> mean over ranks, DTensor(Replicate())     with reduce_first (one packed all_reduce)

    and its updates come back as plain tensors (``Replicate``, ``Partial`` ones reduced first). Inside,
    ``sharded_apply(optimizer, shard_over="dp")`` reduce-scatters the gradients (or slices them, when
    already reduced), keeps state for 1/n of the rows (``Shard(0)`` DTensors: checkpointed sharded) and
    all-gathers the updates. ``reduce_first`` is for chains that begin with a global transform such as
    ``clip_by_global_norm``: its norm of ``Partial`` gradients would all-reduce them anyway, and a reduce-
    scatter after that would move them a second time; one all_reduce, then slices, is cheaper.

    Args:
      tx: the transform (a chain with ``sharded_apply(..., shard_over=<the mesh's dim name>)`` entries).
      mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks (:func:`world_mesh` with ``name="dp"``).
      reduce_first: average the gradients over ranks before ``tx`` (see above).

    Returns:
      A transform on plain tensors whose state is ``tx``'s (with DTensor leaves).
    """
    inner = kernel(tx)
    n = mesh.size()
    grads = (Replicate(),) if reduce_first else (Partial("avg"),)

    def view(t, placements):
        return tree.map(lambda x: DTensor.from_local(x, mesh, placements, run_check=False), t)

    def init_fn(params):
        return tx.init(view(params, (Replicate(),)))

    def update_fn(updates, state, params=None):
        if reduce_first:
            updates = tree.put(updates, updates, _all_reduce_mean_(tree.leaves(updates), n))
        params = None if params is None else view(params, (Replicate(),))
        updates, state = inner(view(updates, grads), state, params)
        return tree.map(to_local, reduce_partials(updates)), state

    return GradientTransformation(init_fn, update_fn)
