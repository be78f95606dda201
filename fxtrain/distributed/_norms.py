"""The norm engine: one L2 norm (and finiteness verdict) of a tree of tensors and DTensors on any meshes.

The L2 norm and the finiteness of a gradient tree whose leaves are plain tensors and DTensors on any number of
meshes, with any placements, identical on every rank without gathering a gradient: leaves planned into buckets by
the process groups their squares are summed over (never a ``Replicate`` dim), local sums in float32, one
``all_reduce(SUM)`` of scalars per group (NaN and inf counted, not maxed), powers summed across ``groups``, the root
taken once. The four steps and why each is so: docs/stack.md ("How the global norm is computed").

Map: :func:`global_norm`, :func:`global_sum_sq` (``clip_by_global_norm``, ``amp_cast``; :class:`GlobalSumSq`),
:func:`global_count`; :func:`local_leaves`, :func:`acc_dtype`, :func:`pack` / :func:`unpack` (the local math).

Example:
    >>> import torch
    >>> from fxtrain.distributed import global_norm
    >>> float(global_norm({"a": torch.tensor([3.0]), "b": [torch.tensor([4.0]), None]}))
    5.0
"""


from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from fxtrain import tree
from fxtrain._deferred import DTensor, Replicate

__all__ = ["global_norm", "global_sum_sq", "global_count", "GlobalSumSq", "to_local", "local_leaves"]

Group = Any  # a torch.distributed ProcessGroup, or a 1-D DeviceMesh

#: ``Partial(reduce_op)`` -> the name of the ``dist.ReduceOp`` that reduces it (avg: SUM, then divide)
REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
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


def _as_real(x: torch.Tensor) -> torch.Tensor:
    """A complex leaf as its real and imaginary parts (a view): their squares sum to ``|x|^2``."""
    return torch.view_as_real(x) if x.is_complex() else x


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions of ``dtype`` values accumulate in: float64 for float64, else float32."""
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
                    op = getattr(dist.ReduceOp, REDUCE_OPS[p.reduce_op])
                    reductions.append((gk, op, mesh.size(d) if p.reduce_op == "avg" else 1))
                else:  # Shard, _StridedShard: disjoint pieces along d
                    summed.append(gk)
            bucket = tuple(sorted(set(summed)))
            if reduced != tuple(x.placements):  # Partial (on a dim of size 1 too)
                pkey = (id(mesh), x.placements, acc_dtype(x.dtype))
                if pkey not in partials:
                    partials[pkey] = _Partial([], [(groups[g], op, div) for g, op, div in reductions],
                                              acc_dtype(x.dtype))
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
            big.setdefault(acc_dtype(x.dtype), []).append(i)

    # Local values come out in this order: one per big leaf, one per pack, one per partial group.
    order = [leaf_bucket[i] for pos in big.values() for i in pos] + [b for b, _ in small]
    order += list(partial_bucket.values())
    bucket_index: dict[tuple, int] = {}
    for b in order:
        bucket_index.setdefault(b, len(bucket_index))
    nb, n = len(bucket_index), len(order)
    foreach = [(None if all(leaves[i].dtype == acc for i in pos) else acc,
                None if len(pos) == len(leaves) else pos) for acc, pos in big.items()]
    packs = [(acc_dtype(dtype), None if len(pos) == len(leaves) else pos) for (_, dtype), pos in small.items()]

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

def pack(xs: list[torch.Tensor], acc: torch.dtype, mixed: bool = False) -> torch.Tensor:
    """A new 1-D buffer of dtype ``acc`` holding every element of ``xs`` (one C++ call for the list)."""
    if len(xs) == 1:
        return xs[0].reshape(-1).to(acc, copy=True)
    if mixed:
        return torch.cat([x.reshape(-1).to(acc) for x in xs])
    return torch._utils._flatten_dense_tensors(xs).to(acc)


def unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of the 1-D ``buf`` shaped like ``like``, in order (the inverse of :func:`pack`, dtype aside)."""
    return torch._utils._unflatten_dense_tensors(buf, like)


def _all_reduce_flat(xs: list[torch.Tensor], acc: torch.dtype, reductions: list, mixed: bool = False) -> torch.Tensor:
    """``xs`` packed into one new buffer of dtype ``acc`` and all-reduced in place, one collective per
    ``(process group, ReduceOp, divisor)`` of ``reductions`` (the norm of ``Partial`` leaves)."""
    buf = pack(xs, acc, mixed)
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
        values.append(pack(local if pos is None else [local[i] for i in pos], acc).pow_(2).sum().reshape(1))
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
    value = _local_sums(plan, [_as_real(to_local(x)) for x in leaves])

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


# --- a local count summed over every rank holding a piece of a tree (amp_cast's found-inf flag) ------

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

