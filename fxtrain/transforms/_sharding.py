"""``sharded_apply``: elementwise math on the local shards of DTensor leaves (JAX's shard_map, torch's local_map).

An elementwise optimizer (Adam, Lion, momentum, weight decay) gives the same numbers on every piece of
a tensor as on the whole. Run through DTensor dispatch it pays Python overhead per op and per leaf; run
on the local pieces it is plain tensor math (``torch._foreach_*`` in place on ``_local_tensor`` when
donated; out of place on ``to_local()``, which autograd sees, in the pure update), and its state is born
sharded like the params. Three forms:

* ``sharded_apply(tx)``: ``tx.init`` and ``tx.update`` see the local pieces; state leaves shaped like
  params come back as DTensors with the param's mesh, placements, shape and stride (checkpointable as
  such). ``Partial`` gradients are reduced to the param's placement first
  (:func:`fxtrain.distributed.reduce_partials`, packed). A tree of plain leaves goes to ``tx`` itself,
  so it composes with ``torch.func`` (vmap, grad, jvp) exactly as ``tx`` does. With DTensor leaves the
  pure update is differentiable through the local math; through a collective (a ``Partial`` gradient,
  ZeRO) it raises instead of returning a gradient that skipped it.
* ``sharded_apply(tx, shard_over="dp")``: ZeRO-1/2 for leaves that are ``Replicate`` over the mesh dim
  named ``dp``: gradients are reduce-scattered to a ``Shard(0)`` over ``dp`` (a ``Partial`` gradient is
  summed and split in one collective per mesh and dtype, whatever the number of leaves), ``tx`` runs on
  this rank's rows with state of 1/n size (state DTensors ``Shard(0)`` over ``dp``), and the updates are
  all-gathered back to the param's ``Replicate`` placement. Row splits follow DTensor's own ``Shard(0)``
  convention (``ceil(rows / n)`` per rank, the last ones shorter or empty), and each rank's segment of
  the packed buffer is padded to one length (gloo's uneven all_gather is broken).
* ``sharded_apply(fn, in_placements=..., out_placements=...)``: a plain function of DTensor trees runs on
  the local pieces and its outputs are rewrapped.

A transform that reduces across elements (``clip_by_global_norm``, anything norm-based, ``stateless`` of
unknown nature) would silently compute a per-shard answer: it is refused when ``sharded_apply`` is built
(:func:`fxtrain.is_elementwise`). Put global clipping outside:
``chain(clip_by_global_norm(1.0), sharded_apply(adamw(...)))``.

Example:
    >>> import torch, fxtrain as fx
    >>> tx = fx.sharded_apply(fx.adamw(0.001))
    >>> tx
    sharded_apply(adamw(0.001))
    >>> params = {"w": torch.ones(2)}                      # plain leaves: exactly adamw
    >>> u, _ = tx.update({"w": torch.ones(2)}, tx.init(params), params)
    >>> u["w"].tolist()
    [-0.001..., -0.001...]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import optree
import torch

from fxtrain import distributed, tree
from fxtrain._base import (
    GradientTransformation, call_, forwarded, is_elementwise, public_factory, traits, transform, with_traits,
)
from fxtrain._deferred import DTensor, Replicate, Shard
from fxtrain.distributed._collectives import check_same_mesh, contiguous_stride, redistribute

__all__ = ["sharded_apply"]


# --- public entry point ------------------------------------------------------------------------------

def sharded_apply(tx: GradientTransformation | Callable, *, shard_over: str | None = None, in_placements: Any = None,
                  out_placements: Any = None, mesh: Any = None) -> GradientTransformation | Callable:
    """Runs an elementwise transform (or a function) on the local pieces of DTensor leaves.

    For a transform ``tx``, with ``x_local`` the piece of a DTensor leaf this rank holds::

        init(params)                    = rewrap(tx.init(local(params)))
        update(updates, state, params)  = rewrap(tx.update(local(reduce(updates)), local(state), local(params)))

    where ``rewrap`` gives DTensors the mesh, placements, shape and stride of the leaves they come from
    (``DTensor.from_local(..., run_check=False)``: no communication). No DTensor dispatch runs inside the
    update. With ``shard_over`` the leaves ``Replicate`` over that mesh dim are updated on 1/n of their
    rows (module docstring).

    Args:
      tx: an elementwise transform (``fx.is_elementwise(tx)``), or a function of DTensor trees (then see
        ``in_placements`` and ``out_placements``).
      shard_over: name of a mesh dim (``"dp"``) over which to shard the optimizer state of leaves that
        are ``Replicate`` there (ZeRO-1/2). Leaves on meshes without that dim, leaves sharded there, 0-dim
        leaves and leaves already sharded along dim 0 on another mesh dim get the plain local math.
      in_placements: function form only: per positional argument, ``None`` (any placements) or the
        placements every DTensor leaf of that argument must have; one placements tuple applies to all.
        A ``Partial`` leaf is reduced first unless ``Partial`` is what is asked for.
      out_placements: function form only: the placements given to every tensor output (a tuple of
        placements), one entry per output when ``fn`` returns a tuple, or ``None``: outputs stay local.
      mesh: function form only: the mesh of the outputs (default: the mesh of the DTensor inputs).

    Returns:
      A transform whose state is ``tx``'s with param-shaped leaves as DTensors, or (function form) the
        wrapped function.

    Raises:
      ValueError: ``tx`` is not elementwise (naming it), a gradient's placements differ from its param's
        (naming the leaf), or a function argument has other placements than declared.

    Example:
        >>> import torch, fxtrain as fx
        >>> fx.sharded_apply(fx.lion(1e-4), shard_over="dp")
        sharded_apply(shard_over='dp', lion(0.0001))
        >>> fx.sharded_apply(fx.clip_by_global_norm(1.0))
        Traceback (most recent call last):
        ...
        ValueError: sharded_apply: clip_by_global_norm(1.0) is not elementwise ...
        >>> double = fx.sharded_apply(lambda x: 2 * x, out_placements=None)
        >>> double(torch.ones(2)).tolist()                    # plain tensors: just the function
        [2.0, 2.0]
    """
    if isinstance(tx, GradientTransformation):
        if in_placements is not None or out_placements is not None or mesh is not None:
            raise TypeError("sharded_apply: in_placements, out_placements and mesh are for functions; a "
                            f"transform ({tx!r}) keeps the placements of its params")
        return _sharded_transform(tx, shard_over=shard_over)
    if not callable(tx):
        raise TypeError(f"sharded_apply: expected a GradientTransformation or a function, got {type(tx).__name__}")
    if shard_over is not None:
        raise TypeError("sharded_apply: shard_over is for transforms (optimizer state), not functions")
    return _local_map(tx, in_placements, out_placements, mesh)


public_factory(sharded_apply)  # the conformance test runs it like every public transform


def _refuse(tx: GradientTransformation) -> None:
    if not is_elementwise(tx):
        raise ValueError(
            f"sharded_apply: {tx!r} is not elementwise (it reduces across elements or leaves, e.g. a "
            "global norm, or is a stateless function of unknown nature): on local shards it would compute "
            "a per-shard answer. Apply it outside: chain(clip_by_global_norm(...), sharded_apply(adamw(...)))")


# --- the transform -------------------------------------------------------------------------------------

def _factory(tx: GradientTransformation, *, shard_over: str | None = None) -> GradientTransformation:
    _refuse(tx)

    def inner(updates, state, params, extra_args):
        return call_(tx, updates, state, params, extra_args)

    def init_fn(params):
        flat_p, pspec = tree.flatten(params)
        roles = _roles(flat_p, shard_over)
        local = tree.unflatten(pspec, [_local_param(x, role) for x, role in zip(flat_p, roles)])
        return _wrap_state(tx.init(local), flat_p, pspec, roles)

    def update_fn(updates, state, params=None, **extra_args):
        flat_u, uspec = tree.flatten(updates)
        flat_p, pspec = tree.flatten(params) if params is not None else ([None] * len(flat_u), None)
        flat_s, sspec = tree.flatten(state)
        if not any(isinstance(x, DTensor) for x in (*flat_u, *flat_p, *flat_s)):
            return inner(updates, state, params, extra_args)  # plain leaves: tx itself (composes with torch.func as it does)
        if tree.transformed():
            raise ValueError("DTensor leaves cannot go through a torch.func transform (vmap, grad, jvp): "
                             "torch.func does not support DTensor; use plain tensors there")
        if len(flat_p) != len(flat_u):
            raise ValueError(f"updates do not match params: the trees differ at '{tree.first_mismatch(updates, params)}'")
        roles = _roles([p if p is not None else u for p, u in zip(flat_p, flat_u)], shard_over)
        flat_u = _sync_grads(flat_u, roles, flat_p, lambda: tree.paths(updates))
        zero = _Zero.build(flat_u, roles) if any(r is not None for r in roles) else None
        local_u = [_piece(u) for u in flat_u]
        if zero is not None:
            _refuse_grad(local_u, "its ZeRO reduce-scatter and all-gather (shard_over) are outside autograd")
            zero.scatter(local_u)
        local_p = [_local_param(p, role) for p, role in zip(flat_p, roles)]
        local_s = [_piece(x) for x in flat_s]

        new_u, new_s = inner(tree.unflatten(uspec, local_u), tree.unflatten(sspec, local_s),
                             None if params is None else tree.unflatten(pspec, local_p), extra_args)

        out_u, out_uspec = tree.flatten(new_u)
        if zero is not None:
            out_u = zero.gather(out_u, flat_u)
        out_u = [_rewrap(n, old, lo) for n, old, lo in zip(out_u, flat_u, local_u)]
        out_s, out_sspec = tree.flatten(new_s)
        if out_sspec != sspec:
            raise ValueError(f"the state structure of {tx!r} changed inside sharded_apply")
        out_s = [_rewrap(n, old, lo) for n, old, lo in zip(out_s, flat_s, local_s)]
        return tree.unflatten(out_uspec, out_u), tree.unflatten(sspec, out_s)

    # Partial gradients come in unreduced (train_step skips its reduce_partials): ZeRO leaves are
    # reduce-scattered, the rest reduced here, packed.
    # ZeRO leaves need collectives: not nestable in a local map, hence not elementwise with shard_over.
    # Without shard_over the state is tx's, placed like the params: tx's fused kernel (if it declares one)
    # computes the same update on the same local pieces (fxtrain/transforms/_fused.py).
    return with_traits(GradientTransformation(init_fn, update_fn), partial_grads=True, elementwise=shard_over is None,
                       fused=traits(tx).fused if shard_over is None else None, **forwarded(tx))


_factory.__name__ = _factory.__qualname__ = "sharded_apply"
_sharded_transform = transform(elementwise=None)(_factory)


# --- leaves: roles, local pieces, rewrapping -------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Role:
    """A ZeRO leaf: ``Replicate`` over mesh dim ``dim`` of size ``n``; this rank holds rows [start, stop)."""

    dim: int
    n: int
    start: int
    stop: int


def _roles(flat: list, shard_over: str | None) -> list:
    return [_role(x, shard_over) for x in flat] if shard_over is not None else [None] * len(flat)


def _role(x: Any, shard_over: str) -> _Role | None:
    if not isinstance(x, DTensor):
        return None
    mesh = x.device_mesh
    names = mesh.mesh_dim_names or ()
    if shard_over not in names or x.ndim == 0 or mesh.get_coordinate() is None:
        return None
    d = names.index(shard_over)
    if not x.placements[d].is_replicate() and not x.placements[d].is_partial():
        return None  # already sharded over that dim (FSDP): the local math is enough
    if any(isinstance(p, Shard) and p.dim == 0 for p in x.placements):
        return None  # rows already split on another mesh dim: a Shard(0) over dp would mean another layout
    n = mesh.size(d)
    start, stop = _row_splits(x._local_tensor.shape[0], n)[mesh.get_local_rank(d)]
    return _Role(d, n, start, stop)


def _row_splits(rows: int, n: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of each of ``n`` ranks: DTensor's Shard(0) split, ``ceil(rows / n)`` per rank,
    the last ones shorter or empty."""
    c = -(-rows // n)
    return [(min(k * c, rows), min(k * c + c, rows)) for k in range(n)]


def _piece(x: Any) -> Any:
    """The local piece of a DTensor leaf; anything else as is.

    ``to_local()`` (an autograd Function, ~10 us) only where autograd must see it: a leaf that requires grad
    while recording. Otherwise ``_local_tensor`` itself: the view a donated update writes into, and what
    the pure update reads without writing (its math runs out of place).
    """
    if not isinstance(x, DTensor):
        return x
    return x.to_local() if x.requires_grad and torch.is_grad_enabled() else x._local_tensor


def _local_param(x: Any, role: _Role | None) -> Any:
    local = _piece(x)
    return local if role is None or not isinstance(x, DTensor) else local[role.start:role.stop]


def _refuse_grad(xs: Sequence, why: str) -> None:
    """Raises rather than let autograd skip a collective: the gradient would come back silently wrong."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs):
        raise ValueError(f"cannot differentiate through sharded_apply here: {why}; differentiate on one "
                         "process with plain tensors")


def _state_placements(x: DTensor, role: _Role | None) -> tuple:
    if role is None:
        return tuple(x.placements)
    return tuple(Shard(0) if d == role.dim else p for d, p in enumerate(x.placements))


def _wrap_state(state: Any, flat_p: list, pspec: Any, roles: list) -> Any:
    """``state`` with every leaf of a params-shaped subtree (``mu``, ``nu``...) made a DTensor like its param."""
    def wrap(node):
        flat, spec = tree.flatten(node)
        out = []
        for s, p, role in zip(flat, flat_p, roles):
            if isinstance(p, DTensor) and isinstance(s, torch.Tensor) and not isinstance(s, DTensor) \
                    and s.shape == _local_param(p, role).shape:
                placements = [q if not q.is_partial() else Replicate() for q in _state_placements(p, role)]
                s = DTensor.from_local(s, p.device_mesh, placements, run_check=False, shape=p.shape,
                                       stride=contiguous_stride(p.shape))
            out.append(s)
        return tree.unflatten(spec, out)

    # Optax's tree_map_params idea: a subtree with the params' structure holds per-param state.
    return optree.tree_map(wrap, state, is_leaf=lambda n: tree.structure(n) == pspec, none_is_leaf=True,
                           namespace="fxtrain")




def _rewrap(new: Any, old: Any, old_local: Any) -> Any:
    """``new`` (a local result) as a DTensor like ``old``; ``old`` itself when the kernel wrote in place."""
    if not isinstance(old, DTensor) or not isinstance(new, torch.Tensor) or isinstance(new, DTensor):
        return new
    if new is old_local:
        return old  # in place: the DTensor already holds the result, no from_local
    if new.dtype == old.dtype and new.shape == old_local.shape and new.stride() == old_local.stride() \
            and not (new.requires_grad and torch.is_grad_enabled()):
        # old's spec (mesh, placements, global shape, stride, dtype) describes new exactly: the DTensor
        # constructor takes it as is (~1 us), where from_local (an autograd Function, ~25 us) rebuilds it.
        return DTensor(new, old._spec, requires_grad=new.requires_grad)
    return DTensor.from_local(new, old.device_mesh, old.placements, run_check=False, shape=old.shape,
                              stride=old.stride())


def _sync_grads(flat_u: list, roles: list, flat_p: list, paths: Callable[[], list]) -> list:
    """Each gradient brought to the placements the local math needs, in one pass of bucketed collectives:
    its param's placements for plain local leaves (a slice, a reduce-scatter or an all-reduce, see
    :func:`fxtrain.distributed.match_placements`); for ZeRO leaves every ``Partial`` dim reduced except
    the dp one, which the ZeRO reduce-scatter handles."""
    targets = []
    for u, p, role in zip(flat_u, flat_p, roles):
        if not isinstance(u, DTensor):
            targets.append(None)
        elif role is None and isinstance(p, DTensor) and u.device_mesh is p.device_mesh:
            targets.append(p.placements)  # the common case, without comparing meshes
        elif role is not None:
            targets.append(tuple(q if d == role.dim or not q.is_partial() else Replicate()
                                 for d, q in enumerate(u.placements)))
        elif isinstance(p, DTensor):
            check_same_mesh(u, p, paths, len(targets))
            targets.append(p.placements)
        else:  # no param to follow: reduce Partial dims only
            targets.append(tuple(Replicate() if q.is_partial() else q for q in u.placements))
    if all(t is None or t == u.placements for u, t in zip(flat_u, targets)):
        return flat_u
    # Slices (Replicate -> Shard) are differentiable; reductions of Partial gradients are collectives.
    _refuse_grad([u for u, t in zip(flat_u, targets) if t is not None
                  and any(a.is_partial() and a != b for a, b in zip(u.placements, t))],
                 "Partial gradients are reduced by collectives outside autograd")
    return redistribute(flat_u, targets, paths)


# --- ZeRO: one reduce-scatter and one all-gather per (mesh, dp dim, dtype, reduce op) -------------------

@dataclasses.dataclass
class _Group:
    mesh: Any
    dim: int
    reduce_op: str | None  # the Partial op over dp, None for Replicate gradients
    positions: list  # leaf indices
    rows: list  # per leaf: [(start, stop) for every rank along dp]
    row_numel: list  # per leaf: elements per row of the local piece
    shapes: list  # per leaf: the local piece's shape
    seg: int = 0  # padded segment length (elements per rank)


class _Zero:
    """The packing of ZeRO leaves: rank-major segments of rows, each padded to one length."""

    def __init__(self, groups: list[_Group], n_leaves: int):
        self.groups = groups
        self.n_leaves = n_leaves
        self.mine: dict[int, tuple[int, int]] = {}

    @staticmethod
    def build(flat_u: list, roles: list) -> _Zero | None:
        groups: dict[tuple, _Group] = {}
        for i, (u, role) in enumerate(zip(flat_u, roles)):
            if role is None or u is None:
                continue
            p = u.placements[role.dim]
            op = p.reduce_op if p.is_partial() else None
            key = (id(u.device_mesh), role.dim, u.dtype, op)
            g = groups.get(key)
            if g is None:
                g = groups[key] = _Group(u.device_mesh, role.dim, op, [], [], [], [])
            shape = tuple(u._local_tensor.shape)
            g.positions.append(i)
            g.rows.append(_row_splits(shape[0], role.n))
            g.row_numel.append(math.prod(shape[1:]))
            g.shapes.append(shape)
        for g in groups.values():
            n = len(g.rows[0])
            g.seg = max(sum((r[k][1] - r[k][0]) * m for r, m in zip(g.rows, g.row_numel)) for k in range(n))
        return _Zero(list(groups.values()), len(flat_u)) if groups else None

    def scatter(self, local_u: list) -> None:
        """Replaces each ZeRO leaf's local gradient by this rank's rows of the reduced gradient."""
        for g in self.groups:
            n, r = len(g.rows[0]), g.mesh.get_local_rank(g.dim)
            flats = [local_u[i].reshape(-1) for i in g.positions]
            views = []
            for k in range(n):
                used = 0
                for f, rows, m in zip(flats, g.rows, g.row_numel):
                    views.append(f[rows[k][0] * m:rows[k][1] * m])
                    used += (rows[k][1] - rows[k][0]) * m
                if used < g.seg:
                    views.append(flats[0].new_zeros(g.seg - used))
            send = torch.cat(views)
            mine = distributed.reduce_scatter_flat(send, g.mesh, g.dim, reduce_op=g.reduce_op)
            sizes = [(rows[r][1] - rows[r][0]) * m for rows, m in zip(g.rows, g.row_numel)]
            pieces = torch.split(mine[:sum(sizes)], sizes)
            for i, piece, rows, shape in zip(g.positions, pieces, g.rows, g.shapes):
                local_u[i] = piece.view((rows[r][1] - rows[r][0],) + shape[1:])

    def gather(self, out_u: list, flat_u: list) -> list:
        """Each ZeRO leaf's update rows of every rank, all-gathered: DTensors ``Replicate`` over dp."""
        out_u = list(out_u)
        for g in self.groups:
            n, r = len(g.rows[0]), g.mesh.get_local_rank(g.dim)
            present = [out_u[i] for i in g.positions]
            used = sum(x.numel() for x in present)
            mine = present + ([present[0].new_zeros(g.seg - used)] if used < g.seg else [])
            full = distributed.all_gather_flat(torch.cat([x.reshape(-1) for x in mine]), g.mesh, g.dim)
            # Leaf-major order: leaf i is the concatenation of its rows from every rank's segment.
            offsets = [0] * n
            views = []
            for rows, m in zip(g.rows, g.row_numel):
                for k in range(n):
                    size = (rows[k][1] - rows[k][0]) * m
                    views.append(full[k * g.seg + offsets[k]:k * g.seg + offsets[k] + size])
                    offsets[k] += size
            flat = torch.cat(views)
            for i, piece, shape in zip(g.positions, torch.split(flat, [math.prod(s) for s in g.shapes]), g.shapes):
                u = flat_u[i]
                placements = tuple(Replicate() if d == g.dim else p for d, p in enumerate(u.placements))
                out_u[i] = DTensor.from_local(piece.view(shape), g.mesh, placements, run_check=False,
                                              shape=u.shape, stride=u.stride())
        return out_u


# --- the function form ---------------------------------------------------------------------------------

def _local_map(fn: Callable, in_placements: Any, out_placements: Any, mesh: Any) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args):
        specs = _per_arg(in_placements, len(args))
        found = [mesh]
        local_args = []
        for a, (arg, want) in enumerate(zip(args, specs)):
            flat, spec = tree.flatten(arg)
            partial_ok = want is not None and any(p.is_partial() for p in want)
            if not partial_ok and any(isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)
                                      for x in flat):
                flat = tree.flatten(distributed.reduce_partials(tree.unflatten(spec, flat)))[0]
            out = []
            for path, x in zip(tree.paths(arg), flat):
                if isinstance(x, DTensor):
                    if want is not None and tuple(x.placements) != tuple(want):
                        raise ValueError(f"sharded_apply({_fname(fn)}): argument {a} at '{path}' has placements "
                                         f"{tuple(x.placements)}, in_placements asks for {tuple(want)}")
                    if found[0] is None:
                        found[0] = x.device_mesh
                    elif x.device_mesh != found[0]:
                        raise ValueError(f"sharded_apply({_fname(fn)}): argument {a} at '{path}' is on {x.device_mesh}, "
                                         f"another input on {found[0]}: one function runs on one mesh")
                    x = _piece(x)
                out.append(x)
            local_args.append(tree.unflatten(spec, out))
        result = fn(*local_args)
        if out_placements is None or found[0] is None:
            return result
        return _wrap_outputs(result, out_placements, found[0])

    return wrapped


def _is_placements(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(hasattr(p, "is_shard") for p in x)


def _per_arg(in_placements: Any, n: int) -> list:
    if in_placements is None:
        return [None] * n
    if _is_placements(in_placements):
        return [tuple(in_placements)] * n
    if len(in_placements) != n:
        raise ValueError(f"sharded_apply: in_placements has {len(in_placements)} entries for {n} arguments")
    return [None if p is None else tuple(p) for p in in_placements]


def _wrap_outputs(result: Any, out_placements: Any, mesh: Any) -> Any:
    def wrap(x, placements):
        if not isinstance(x, torch.Tensor) or placements is None:
            return x
        return DTensor.from_local(x, mesh, placements, run_check=False)

    if _is_placements(out_placements):
        return tree.map(lambda x: wrap(x, tuple(out_placements)), result)
    if not isinstance(result, tuple) or len(result) != len(out_placements):
        raise ValueError(f"sharded_apply: out_placements has {len(out_placements)} entries, the function "
                         f"returned {len(result) if isinstance(result, tuple) else 1} outputs")
    return tuple(tree.map(lambda x, p=p: wrap(x, p), r) for r, p in zip(result, out_placements))


def _fname(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
