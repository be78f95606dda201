"""Tensor parallelism on torch's own engine, and the data-parallel bridge that makes it 2-D (dp x tp).

``parallelize_module`` turns a module's params into DTensors on a 1-D tp mesh and hooks the activations'
layouts; fxtrain then only needs the module as a pure function (:func:`fxtrain.functional`). torch refuses
a 2-D mesh there, so for dp x tp :func:`tensor_parallel` parallelizes on the tp submesh and shows the step
each param lifted to the 2-D mesh (``Replicate`` over dp). Inside ``apply_fn`` a zero-communication view
brings each param down to the tp mesh, and its backward lifts the gradient back up as ``Partial("avg")``
over dp, the tp placement as autograd produced it. The step's :func:`match_placements` then reduces every
gradient over dp in one bucketed all-reduce per dp process group (and the tp ``Partial`` ones of
``SequenceParallel`` norms in one more over tp), where a per-leaf ``to_local(grad_placements=...)`` /
``from_local`` bridge would all-reduce inside autograd, one collective per leaf and mesh.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable

import torch
from torch import nn

from fxtrain._deferred import DTensor, Partial, Replicate
from fxtrain.functional import functional

__all__ = ["tensor_parallel"]


def tensor_parallel(module: nn.Module, plan: dict, mesh: Any, *, tp: str = "tp",
                    dp: str | None = "dp") -> tuple[Callable, dict, dict]:
    """Parallelizes ``module`` with torch's ``plan`` on ``mesh`` and returns it as ``(apply_fn, params, buffers)``.

    On a 1-D mesh (its one dim named ``tp``) this is ``parallelize_module(module, mesh, plan)`` followed by
    :func:`fxtrain.functional`: params are the DTensors (and plain tensors, for modules the plan leaves
    alone) torch built. On a 2-D mesh with dims ``dp`` and ``tp`` the plan is applied on ``mesh[tp]`` and
    every param is lifted to ``mesh``: placements ``Replicate()`` over ``dp`` and the param's tp placement
    (``Replicate()`` for a plain param). ``apply_fn`` computes with the tp-mesh views, and gradients come
    out of autograd as 2-D DTensors that are ``Partial("avg")`` over dp: each dp rank feeds its own slice
    of the batch (equal slices, a loss that is a mean over the slice), and the step reduces them in one
    bucketed all-reduce per dp group. Works with :func:`fxtrain.train_step` and the recommended stack
    (``chain(clip_by_global_norm(...), sharded_apply(adamw(...)))``), ``sharded_apply(..., shard_over=dp)``
    included (ZeRO over dp: optimizer state ``Shard(0)`` over dp where the tp layout leaves rows whole).

    A plain (unplanned) param is taken as identical on every tp rank: its module must see replicated
    activations (a norm ahead of a ``SequenceParallel`` region must itself be ``SequenceParallel``).

    Args:
      module: the model, on the mesh's device; modified in place by ``parallelize_module`` (as in torch).
      plan: torch's parallelize plan, ``{submodule path (fnmatch patterns allowed): ParallelStyle}``
        (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``...).
      mesh: a ``DeviceMesh``, 1-D (dim ``tp``) or 2-D (dims ``dp`` and ``tp``, in either order).
      tp: the name of the tensor-parallel mesh dim.
      dp: the name of the data-parallel mesh dim (2-D meshes only).

    Returns:
      ``(apply_fn, params, buffers)`` as from :func:`fxtrain.functional`:
      ``apply_fn(params, buffers, *args, train, **kwargs) -> (output, new_buffers)``.

    Raises:
      ValueError: a plan key that matches no submodule of ``module`` (naming the key), a mesh without the
        named dims or with more than two, or (at call time) a param that is not on the 2-D mesh.

    Example (on 4 ranks, ``torchrun --nproc-per-node 4``; not a doctest)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        apply, params, buffers = fx.parallel.tensor_parallel(mlp, plan, mesh)
        tx = fx.chain(fx.clip_by_global_norm(1.0), fx.sharded_apply(fx.adamw(1e-3)))
        step = fx.train_step(lambda p, b: loss(apply(p, buffers, b[0], train=True)[0], b[1]), tx)
        params, opt_state, metrics = step(params, tx.init(params), my_dp_slice_of_the_batch)

    >>> import torch
    >>> tensor_parallel(torch.nn.Linear(2, 2), {"w1": None}, mesh=None)
    Traceback (most recent call last):
    ...
    ValueError: tensor_parallel: the plan key 'w1' matches no submodule of Linear (its submodules: none); ...
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if not isinstance(module, nn.Module):
        raise TypeError(f"tensor_parallel expects an nn.Module, got {type(module).__name__}")
    if not isinstance(plan, dict):
        raise TypeError(f"tensor_parallel: plan must be a dict {{submodule path: ParallelStyle}} as "
                        f"parallelize_module takes, got {type(plan).__name__}")
    _check_plan(module, plan)
    names = _dim_names(mesh, tp, dp)
    if len(names) == 1:
        parallelize_module(module, mesh, plan)
        return functional(module)

    tp_mesh = mesh[tp]
    parallelize_module(module, tp_mesh, plan)
    inner, tp_params, buffers = functional(module)
    views = {k: _View.of(p, mesh, names.index(dp), names.index(tp), tp_mesh) for k, p in tp_params.items()}
    params = {k: views[k].lift(p) for k, p in tp_params.items()}

    def apply_fn(params: dict, buffers: dict, *args: Any, train: bool, **kwargs: Any):
        down = {}
        for k, p in params.items():  # one view per param, as functional_call swaps one tensor per param
            v = views.get(k)
            if v is None or not (isinstance(p, DTensor) and (p.device_mesh is mesh or p.device_mesh == mesh)):
                raise ValueError(f"tensor_parallel apply_fn: the param '{k}' is "
                                 f"{'not one of the module' if v is None else _where(p)}; pass the params "
                                 f"tensor_parallel returned (DTensors on {mesh}), or what the step made of them")
            down[k] = _ToTpMesh.apply(p, v)
        return inner(down, buffers, *args, train=train, **kwargs)

    apply_fn.__name__ = apply_fn.__qualname__ = inner.__name__
    return apply_fn, params, buffers


def _dim_names(mesh: Any, tp: str, dp: str | None) -> tuple:
    if not hasattr(mesh, "mesh_dim_names"):
        raise ValueError(f"tensor_parallel: mesh must be a DeviceMesh, got {type(mesh).__name__}: build one with "
                         f"init_device_mesh(device, (dp, tp), mesh_dim_names=('{dp}', '{tp}'))")
    names = tuple(mesh.mesh_dim_names or ())
    want = (tp,) if mesh.ndim == 1 else (dp, tp)
    if mesh.ndim > 2 or len(names) != mesh.ndim or any(n not in names for n in want):
        raise ValueError(f"tensor_parallel: the mesh {mesh} has dims {names or 'unnamed'}, it needs {want} "
                         f"(1-D: tensor parallel; 2-D: dp x tp): build it with init_device_mesh(..., "
                         f"mesh_dim_names=('{dp}', '{tp}')) or pass tp=/dp= with its names")
    return names


def _check_plan(module: nn.Module, plan: dict) -> None:
    """Refuses plan keys that match nothing: ``parallelize_module`` only warns and skips them, leaving that
    part of the model unsharded (its params plain, its activations of the wrong layout) in silence."""
    for key in plan:
        if key == "":
            continue
        found = [module]
        for token in key.split("."):
            found = [c for m in found for name, c in m.named_children() if fnmatch.fnmatchcase(name, token)]
            if not found:
                break
        if not found:
            children = sorted(n for n, _ in module.named_modules() if n)
            shown = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "") or "none"
            raise ValueError(f"tensor_parallel: the plan key '{key}' matches no submodule of "
                             f"{type(module).__name__} (its submodules: {shown}); fix the key or drop it")


def _where(p: Any) -> str:
    return f"a DTensor on {p.device_mesh}" if isinstance(p, DTensor) else f"a plain {type(p).__name__}"


@dataclasses.dataclass(frozen=True)
class _View:
    """How one param lives on the 2-D mesh and on the tp mesh (``tp_placement`` None: a plain param)."""

    mesh: Any
    dp: int  # mesh dim index of dp
    tp: int  # mesh dim index of tp
    tp_mesh: Any
    tp_placement: Any

    @staticmethod
    def of(p: torch.Tensor, mesh: Any, dp: int, tp: int, tp_mesh: Any) -> _View:
        return _View(mesh, dp, tp, tp_mesh, p.placements[0] if isinstance(p, DTensor) else None)

    def placements(self, on_dp: Any, on_tp: Any) -> tuple:
        out = [None, None]
        out[self.dp], out[self.tp] = on_dp, on_tp
        return tuple(out)

    def lift(self, p: torch.Tensor) -> DTensor:
        local = p._local_tensor if isinstance(p, DTensor) else p
        return DTensor.from_local(local, self.mesh, self.placements(Replicate(), self.tp_placement or Replicate()),
                                  run_check=False, shape=p.shape, stride=p.stride())


class _ToTpMesh(torch.autograd.Function):
    """A 2-D param seen on the tp mesh (or as a plain tensor), no communication either way.

    The backward lifts the gradient back to the 2-D mesh with its tp placement as autograd made it
    (``Replicate`` for a ``Shard(0)`` embedding, ``Partial`` for a ``SequenceParallel`` norm) and
    ``Partial("avg")`` over dp; reducing it is left to the step, which buckets every leaf together.
    """

    @staticmethod
    def forward(ctx, x: DTensor, view: _View) -> torch.Tensor:
        ctx.view, ctx.shape, ctx.stride = view, x.shape, x.stride()
        local = x._local_tensor
        if view.tp_placement is None:
            return local.view_as(local)
        return DTensor.from_local(local, view.tp_mesh, (view.tp_placement,), run_check=False, shape=x.shape,
                                  stride=x.stride())

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None
        view = ctx.view
        if isinstance(grad, DTensor) and grad.placements[0].is_replicate() and view.tp_placement.is_shard():
            # RowwiseParallel's embedding: a Replicate gradient for a Shard(0) weight. Keeping this rank's rows
            # is a local slice (no communication) and spares the dp all-reduce tp - 1 of every tp pieces.
            grad = grad.redistribute(view.tp_mesh, (view.tp_placement,))
        local, on_tp = (grad._local_tensor, grad.placements[0]) if isinstance(grad, DTensor) else (grad, Replicate())
        placements = view.placements(Partial("avg"), on_tp)
        return DTensor.from_local(local, view.mesh, placements, run_check=False, shape=ctx.shape,
                                  stride=ctx.stride), None
