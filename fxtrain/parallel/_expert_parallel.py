"""Expert parallelism: the experts of :class:`fxtrain.models.MoE` layers sharded over a mesh dim named ``ep``.

Layout (torchtitan's and Megatron's)::

    expert params  (w_in, b_in, w_out, b_out: [E, ...])   DTensor on mesh: Shard(0) on ep, Replicate elsewhere
    dense params   (router, attention, norms, embedding)   DTensor on the dp mesh: all ranks of mesh, Replicate
                                                           (shard_dense=True: Shard(0), ZeRO-3 / FSDP's layout)

Every rank holds its own share of the batch. In a call, each MoE layer routes its rank's tokens, all-gathers
tokens, gates and choices over the ep group, runs its ``E / ep`` experts on every gathered token routed to
them, and reduce-scatters the gated sums back to the tokens' ranks (Megatron's all-gather token dispatcher).
Both collectives are autograd-aware (their backward passes are each other), so one ``backward`` gives
every gradient; expert gradients come out ``Shard(0)`` on ep and ``Partial("avg")`` on the other mesh dims,
dense ones ``Partial("avg")`` on the dp mesh, and the step reduces them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxtrain._deferred import DTensor, Partial, Replicate, Shard
from fxtrain.distributed import DIMS, ParallelDims
from fxtrain.functional import ApplyFn, Buffers, Params, functional
from fxtrain.models import MoE, experts_forward

__all__ = ["expert_parallel", "fully_shard_experts"]


def expert_parallel(module: nn.Module, mesh: Any, *, ep: str = "ep",
                    shard_dense: bool = False) -> tuple[ApplyFn, Params, Buffers]:
    """``fx.functional`` for a module with :class:`fxtrain.models.MoE` layers, their experts sharded over ``ep``.

    Each MoE layer's ``E`` experts are split into ``mesh[ep].size()`` contiguous blocks, one per ep rank
    (``Shard(0)`` of the stacked ``[E, ...]`` weights; ``Replicate`` on the other dims of ``mesh``, which
    are data parallel). Every other param is dense: a ``Replicate`` DTensor on the dp mesh, the 1-D mesh
    of all ranks of ``mesh`` (``mesh`` itself when it is 1-D, else its flattened form). Each rank feeds
    ``apply_fn`` its own equal share of the batch (every rank of an ep group the same number of tokens),
    and its loss is that share's mean; the gradients are then those of the mean over all ranks: dense ones
    ``Partial("avg")``, expert ones ``Shard(0)`` on ep and ``Partial("avg")`` elsewhere, reduced by the
    step. Train with ``fx.train_step`` and ``chain(clip_by_global_norm(c), sharded_apply(adamw(...)))``:
    the global norm sums dense and expert params over their own meshes.

    Args:
      module: an ``nn.Module`` holding at least one :class:`fxtrain.models.MoE`, built the same on every
        rank (seed before building). Like :func:`fxtrain.functional`, the params share its storage (the
        expert ones: this rank's rows).
      mesh: a ``DeviceMesh`` over the ranks, with a dim named ``ep``: e.g. ``init_device_mesh("cpu",
        (dp, ep), mesh_dim_names=("dp", "ep"))`` or ``("ep",)`` alone.
      ep: the name of the expert-parallel mesh dim.
      shard_dense: shard the dense params too: ``Shard(0)`` over the dp mesh (FSDP's layout; with ep the
        runner's ``ep x dp_shard``). ``apply_fn`` all-gathers each one (a blocking gloo/NCCL collective, as
        FSDP's unsharded forward) and its backward reduce-scatters the gradient, which comes out ``Shard(0)``
        like the param: every rank keeps and updates ``1 / ranks`` of each dense param and its state.

    Returns:
      ``(apply_fn, params, buffers)`` like :func:`fxtrain.functional`: ``apply_fn(params, buffers, *args,
      train, **kwargs)`` runs ``module`` on this rank's share with the experts dispatched over ep;
      ``params`` are DTensors as above (the expert ones this rank's ``E / ep`` rows), ``buffers`` plain.

    Raises:
      ValueError: ``mesh`` has no dim named ``ep``, ``module`` has no MoE layer, or a layer's number of
        experts is not divisible by the ep size (naming the layer).

    Example (on every rank of a 4-rank world, e.g. ``torchrun --nproc-per-node 4``)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        apply, params, buffers = fx.parallel.expert_parallel(TransformerLM(experts=4), mesh)
        tx = fx.chain(fx.clip_by_global_norm(1.0), fx.sharded_apply(fx.adamw(1e-3)))
        step = fx.train_step(lambda p, b: lm_loss(apply(p, buffers, b[0], train=True)[0], b[1]), tx)
        params, state, metrics = step(params, tx.init(params), local_batch)   # this rank's share

    >>> import torch
    >>> from fxtrain.parallel import expert_parallel
    >>> expert_parallel(torch.nn.Linear(2, 2), None)
    Traceback (most recent call last):
    ...
    ValueError: expert_parallel: Linear has no fxtrain.models.MoE layer; ...
    """

    layers = _moe_layers(module, mesh, ep, "expert_parallel")
    names = tuple(mesh.mesh_dim_names)
    n = mesh[ep].size()
    inner, full, buffers = functional(module)
    # One process group over all of mesh's ranks, so a dense gradient is averaged in one all-reduce, not
    # one per mesh dim. _flatten is torch's own way (private in 2.13; torchtitan relies on it) and is
    # cached on the root mesh: a second call reuses the group.
    dp_mesh = mesh if mesh.ndim == 1 else mesh._flatten()
    axis = names.index(ep)
    expert = tuple(Shard(0) if d == axis else Replicate() for d in range(mesh.ndim))
    # The gradient of the mean loss over all ranks. A dense param's local gradient is its rank's share
    # only: the mean over ranks (Partial "avg"). An expert's local gradient already sums the shares of its
    # whole ep group (the dispatch's backward brings their token gradients here), so it is scaled by
    # 1 / ep (_ScaleGrad) and averaged over the remaining (dp) dims.
    expert_grad = tuple(Shard(0) if d == axis else Partial("avg") for d in range(mesh.ndim))
    dense_grad = (Partial("avg"),)
    expert_names = {f"{name}.{p}" if name else p for name, layer in layers.items() for p in layer.expert_params}
    rank = mesh[ep].get_local_rank()
    # No communication: every rank built the same module, so each takes its rows (a view, like
    # fx.functional's params share the module's storage).
    params = {k: DTensor.from_local(v.chunk(n)[rank], mesh, expert, run_check=False, shape=v.shape,
                                    stride=v.stride()) if k in expert_names
              else _dense(v, dp_mesh, shard_dense) for k, v in full.items()}
    dispatch = _AllGatherDispatch(mesh, axis, rank)
    if shard_dense:  # the local shard's gradient is reduce-scattered by _GatherRows' backward: Shard(0) as it is
        dense_grad = (Shard(0),)
    plan = [(k, expert_grad, 1.0 / n) if k in expert_names else (k, dense_grad, None) for k in params]
    dense_group = dp_mesh.get_group() if shard_dense else None

    def apply_fn(params: Params, buffers: Buffers, *args: Any, train: bool, **kwargs: Any):
        local = {k: _local(k, params[k], grads, scale) for k, grads, scale in plan}
        if dense_group is not None:
            local = {k: v if k in expert_names else _GatherRows.apply(v, params[k].shape, dense_group)
                     for k, v in local.items()}
        for layer in layers.values():
            layer.dispatch = dispatch
        try:
            return inner(local, buffers, *args, train=train, **kwargs)
        finally:
            for layer in layers.values():
                layer.dispatch = None

    return apply_fn, params, buffers


def fully_shard_experts(module: nn.Module, mesh: Any, *, ep: str = "ep", mp_policy: Any = None) -> Any:
    """torchtitan's expert parallel under FSDP2: each MoE layer's experts ``Shard(0)`` over ``ep``, then
    ``fully_shard`` on its data-parallel ranks, with the router left to the dense params' FSDP units.

    For every :class:`fxtrain.models.MoE` layer of ``module`` (in place): the stacked expert params become
    DTensors of this rank's ``E / ep`` rows on ``mesh[ep]``; the layer is ``fully_shard``-ed on
    ``mesh["dp_shard"]`` (the ranks that hold the same experts and read other tokens: FSDP shards those rows
    further over them and reduce-scatters their gradients, its FSDP x EP path, as under FSDP x TP), after its
    router on the dense mesh (``mesh``'s data dims flattened: every rank reads its own tokens), so that the
    layer's own FSDP unit holds the experts alone. Each layer's dispatch is set to the all-gather token
    dispatcher over ep (:func:`expert_parallel`'s), which takes the unsharded experts' local rows and scales
    their gradients by ``1 / ep`` (they sum the tokens of the whole ep group). The caller then
    ``fully_shard``-s the blocks and the root on the dense mesh returned, and trains with
    :func:`fxtrain.parallel.fully_sharded_step`: every param is then FSDP's.

    Args:
      module: an ``nn.Module`` holding at least one MoE, built the same on every rank.
      mesh: the run's ``DeviceMesh``, with a dim named ``ep`` and one named ``dp_shard`` (FSDP's; of size 1
        where only ep reads other tokens: :func:`expert_mesh`), optionally ``dp_replicate`` (HSDP: the
        experts' FSDP mesh is then ``mesh["dp_replicate", "dp_shard"]``) and ``tp`` (the attention's,
        parallelized before on ``mesh["tp"]``).
      ep: the name of the expert-parallel mesh dim.
      mp_policy: FSDP's ``MixedPrecisionPolicy`` of the run (``None``: FSDP's default); the MoE units keep
        their compute dtype (no output cast).

    Returns:
      The dense params' FSDP mesh: ``dp_shard`` and ``ep`` flattened (``dp_shard_ep``), 2-D with
      ``dp_replicate`` for HSDP.

    Raises:
      ValueError: as :func:`expert_parallel`, naming the layer or the mesh's dims.

    Example (on every rank of a 4-rank world; not a doctest)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        dense = fully_shard_experts(model, mesh)
        for block in model.blocks:
            fully_shard(block, mesh=dense)
        fully_shard(model, mesh=dense)
        apply, params, buffers = fx.parallel.fully_sharded(model)

    >>> fully_shard_experts(torch.nn.Linear(2, 2), None)
    Traceback (most recent call last):
    ...
    ValueError: fully_shard_experts: Linear has no fxtrain.models.MoE layer; ...
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = _moe_layers(module, mesh, ep, "fully_shard_experts")
    names = tuple(mesh.mesh_dim_names)
    flat = mesh[tuple(d for d in names if d in ("dp_shard", ep))]._flatten(f"dp_shard_{ep}")
    hsdp = "dp_replicate" in names
    dense = mesh["dp_replicate", f"dp_shard_{ep}"] if hsdp else flat
    experts = mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"]
    ep_mesh = mesh[ep]
    n, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    inner = dataclasses.replace(mp_policy or MixedPrecisionPolicy(), output_dtype=None)
    dispatch = _LocalExperts(ep_mesh)
    for layer in layers.values():
        for k in layer.expert_params:
            full = getattr(layer, k).detach()
            rows = DTensor.from_local(full.chunk(n)[rank].clone(), ep_mesh, (Shard(0),), run_check=False,
                                      shape=full.shape, stride=full.stride())
            setattr(layer, k, nn.Parameter(rows))
        layer.dispatch = dispatch
        fully_shard(layer.router, mesh=dense, mp_policy=inner)
        fully_shard(layer, mesh=experts, mp_policy=inner)
    return dense


def expert_mesh(dims: ParallelDims) -> Any:
    """The mesh :func:`fully_shard_experts` takes for a run's degrees: the run's own, or, where ``dp_shard`` is 1
    (ep with tp or pp), one over the same ranks with a ``dp_shard`` dim of size 1 (the experts' FSDP mesh), in
    :data:`fxtrain.distributed.DIMS` order; the tp mesh of ``parallelize_module`` must come from it too (FSDP
    composes a DTensor param's mesh with its own only under one root mesh)."""
    if dims.enabled("dp_shard"):
        return dims.mesh
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(d for d in DIMS if dims.enabled(d) or d == "dp_shard")
    return init_device_mesh(dims.mesh.device_type, tuple(dims.degrees[d] for d in names), mesh_dim_names=names)


def _moe_layers(module: nn.Module, mesh: Any, ep: str, caller: str) -> dict[str, MoE]:
    """``module``'s MoE layers by name, checked against ``mesh``'s ``ep`` dim (see :func:`expert_parallel`)."""
    layers = {name: m for name, m in module.named_modules() if isinstance(m, MoE)}
    if not layers:
        raise ValueError(f"{caller}: {type(module).__name__} has no fxtrain.models.MoE layer; use "
                         "fx.functional for a dense module, or build its MLPs as MoE(...)")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if ep not in names:
        raise ValueError(f"{caller}: the mesh has dims {names}, none named {ep!r}; pass "
                         f"ep=<its expert dim> or build it with init_device_mesh(..., mesh_dim_names=(..., {ep!r}))")
    n = mesh[ep].size()
    for name, layer in layers.items():
        if layer.num_experts % n:
            raise ValueError(f"{caller}: MoE layer '{name}' has {layer.num_experts} experts, not "
                             f"divisible by the {ep!r} mesh dim's size {n}; use a multiple of {n} experts or "
                             "a smaller ep dim")
    return layers


def _local(name: str, p: Any, grad_placements: tuple, scale: float | None) -> torch.Tensor:
    """This rank's piece of param ``p``, whose gradient comes back as a DTensor with ``grad_placements``."""
    if not isinstance(p, DTensor):
        raise ValueError(f"expert_parallel's apply_fn: param '{name}' is a plain tensor; pass the params tree "
                         "that expert_parallel returned (DTensors), as the step updates it")
    x = p.to_local(grad_placements=grad_placements)
    return x if scale is None else _ScaleGrad.apply(x, scale)


def _dense(v: torch.Tensor, dp_mesh: Any, shard: bool) -> DTensor:
    """A dense param on the dp mesh: ``Replicate`` (a view of ``v``), or this rank's ``Shard(0)`` rows (torch's
    ``chunk`` split, as ``distribute_tensor`` makes it; a copy, so the module's full tensor can be freed)."""
    if not shard:
        return DTensor.from_local(v, dp_mesh, (Replicate(),), run_check=False)
    rows = _rows(v.shape[0], dp_mesh.size())[dp_mesh.get_local_rank()]
    return DTensor.from_local(v[rows].clone(), dp_mesh, (Shard(0),), run_check=False, shape=v.shape,
                              stride=v.stride())


def _rows(n: int, ranks: int) -> list[slice]:
    """Each rank's rows of ``n`` under ``Shard(0)``: ``torch.chunk``'s split (the last ones may be short or empty)."""
    size = -(-n // ranks)
    return [slice(min(r * size, n), min((r + 1) * size, n)) for r in range(ranks)]


class _GatherRows(torch.autograd.Function):
    """A ``Shard(0)`` param's full tensor from every rank's rows (all-gather, padded to equal chunks); the
    backward averages the full gradient over the ranks and hands each its rows (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: torch.Size, group: Any) -> torch.Tensor:
        ranks = dist.get_world_size(group)
        size = -(-shape[0] // ranks)
        ctx.group, ctx.rows, ctx.size, ctx.n = group, x.shape[0], size, shape[0]
        padded = x.new_zeros((size, *shape[1:]))
        padded[:x.shape[0]] = x
        return _gather(padded, group)[:shape[0]]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ranks = dist.get_world_size(ctx.group)
        padded = g.new_zeros((ctx.size * ranks, *g.shape[1:]))
        padded[:ctx.n] = g
        return _scatter(padded, ctx.group)[:ctx.rows] / ranks, None, None


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class _AllGatherDispatch:
    """Megatron's all-gather token dispatcher over one mesh dim: every rank of the group sees every token.

    The tokens' gradients flow back through the collectives (all-gather's backward is a reduce-scatter and
    the other way round). all_gather / reduce_scatter rather than all-to-all: no host sync for split sizes
    and the same collectives on gloo, at the price of moving every token to every ep rank. The collectives
    are blocking calls inside two small autograd functions: torch's functional collectives (async tensors
    waited for later) corrupted the heap of gloo ranks now and then (``malloc(): unaligned tcache chunk``,
    about one 4-rank world in ten on this CPU).
    """

    def __init__(self, mesh: Any, axis: int, rank: int):
        self.group, self.rank = mesh.get_group(axis), rank

    def __call__(self, tokens, gates, chosen, weights):
        every = [_AllGather.apply(t, self.group) for t in (tokens, gates, chosen)]
        mine = experts_forward(*every, weights, first=self.rank * weights[0].shape[0])
        return _ReduceScatter.apply(mine, self.group)


class _LocalExperts:
    """The dispatcher of a module whose expert params are DTensors, ``Shard(0)`` on the ep mesh (FSDP's
    unsharded ones under :func:`fully_shard_experts`): their local rows, whose gradients come back ``Shard(0)``
    and scaled by ``1 / ep`` (as :func:`expert_parallel`'s), through the all-gather dispatcher."""

    def __init__(self, ep_mesh: Any):
        self.dispatch = _AllGatherDispatch(ep_mesh, 0, ep_mesh.get_local_rank())
        self.scale = 1.0 / ep_mesh.size()

    def __call__(self, tokens, gates, chosen, weights):
        local = [_ScaleGrad.apply(w.to_local(grad_placements=(Shard(0),)), self.scale) for w in weights]
        return self.dispatch(tokens, gates, chosen, local)


def _gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return _scatter(g, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group), None
