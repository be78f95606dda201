"""FSDP2 under the functional step: a ``fully_shard``-ed module driven by :func:`fxtrain.train_step`'s update half.

``fully_shard`` owns the parameters of the modules it wraps: its pre-forward hook all-gathers the
sharded parameters and puts the unsharded ones into the module, its post-backward hook reduce-scatters
their gradients (bucketed, one collective per FSDP module) into the sharded parameters' ``.grad``. A
pure function of a params tree cannot take part: whatever ``functional_call`` passes is replaced by
FSDP's own all-gathered tensors, so no gradient reaches it (issue 16: step 0 learned nothing, step 1
crashed). So the division of labour is torch's, as in torchtitan: FSDP computes the gradients of the
module's own sharded parameters; fxtrain runs the stack on them and writes the update into them.

* :func:`fully_sharded` is :func:`fxtrain.functional` for such a module: ``(apply_fn, params, buffers)``,
  where ``params`` are the module's own sharded DTensor parameters (detached, same storage), so the
  donated update writes in place where FSDP's next all-gather reads.
* :func:`fully_sharded_step` is ``train_step(donate=True)`` with a gradient engine that runs
  ``objective.backward()`` (FSDP's hooks do the communication), hands the ``.grad`` DTensors to the
  shared update half (:func:`fxtrain.step.donated_step`) and clears them, as ``zero_grad(set_to_none=True)``.

What clipping, the optimizers, mixed precision and accumulation each do with FSDP2, and what they must not:
docs/parallel.md ("FSDP2 and the stack").

Example (two ranks; not a doctest)::

    import torch, torch.nn.functional as F, fxtrain as fx
    from torch.distributed.fsdp import fully_shard

    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    apply, params, buffers = fx.parallel.fully_sharded(model)

    def loss_fn(params, batch):
        x, y = batch
        logits, _ = apply(params, buffers, x, train=True)
        return F.cross_entropy(logits, y)

    tx = fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.sharded_apply(fx.adamw(1e-3))), every=4)
    step = fx.parallel.fully_sharded_step(loss_fn, tx, model)
    opt_state = tx.init(params)
    for batch in loader:
        params, opt_state, metrics = step(params, opt_state, batch)
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from fxtrain import tree
from fxtrain._deferred import DTensor, FSDPModule
from fxtrain.distributed import contiguous_stride
from fxtrain.functional import fully_sharded_modules, module_label
from fxtrain.step import call_objective, detach_tree, donated_step
from fxtrain.transforms._accumulation import window_position

__all__ = ["fully_sharded", "fully_sharded_step"]

Params = Buffers = dict[str, torch.Tensor]


def fully_sharded(module: nn.Module) -> tuple[Callable, Params, Buffers]:
    """:func:`fxtrain.functional` for a ``fully_shard``-ed module: its sharded params, and a function that runs it.

    ``apply_fn(params, buffers, *args, train, **kwargs) -> (output, new_buffers)`` runs ``module(*args,
    **kwargs)`` through FSDP's hooks, which compute with the module's own (all-gathered) parameters;
    ``params`` must therefore be the tree returned here (a donated step returns the same tree), and is
    checked to be. Buffers (FSDP leaves them unsharded) are threaded as in :func:`fxtrain.functional`: copied
    in train mode, the updated copies returned. Differentiating ``apply_fn`` with respect to ``params`` is
    not possible (FSDP's gradients land in the parameters' ``.grad``): train with :func:`fully_sharded_step`.

    Args:
      module: a module on which ``torch.distributed.fsdp.fully_shard`` was called (on it or on submodules
        that together hold every parameter), in its final dtype and device: ``module.to(...)`` afterwards
        gives it new parameters and the returned tree would no longer be them.

    Returns:
      ``(apply_fn, params, buffers)``. ``params`` are the module's ``named_parameters()`` as detached
      DTensors sharing storage with the sharded parameters (``Shard(0)`` on the FSDP mesh, composed with
      the TP placements under FSDP x TP); calling ``fully_sharded`` again gives the same leaves.

    Raises:
      TypeError: ``module`` is not an ``nn.Module`` or nothing in it is ``fully_shard``-ed.
      ValueError: naming the parameter, when one is not managed by ``fully_shard`` (its gradient would
        never be reduced across ranks).

    Example (two ranks; not a doctest)::

        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        apply, params, buffers = fx.parallel.fully_sharded(model)
        params["fc.weight"].placements       # (Shard(dim=0),)
        logits, _ = apply(params, buffers, x, train=False)
    """
    owner = _owner(module)
    label = owner.label

    def apply_fn(params: Params, buffers: Buffers, *args: Any, train: bool, **kwargs: Any) -> tuple[Any, Buffers]:
        if not isinstance(train, bool):
            raise TypeError(f"fully_sharded({label}) apply_fn: train must be True or False, got {train!r}")
        owner.check(params, "apply_fn")
        if train and buffers:
            buffers = tree.clone(buffers)  # as fx.functional: the forward pass may update them in place
        was_training = module.training
        module.train(train)
        try:
            # Buffers only: the parameters are FSDP's to place. strict=False: the params are not passed.
            out = functional_call(module, buffers, args, kwargs, strict=False) if buffers else module(*args, **kwargs)
        finally:
            module.train(was_training)
        return out, buffers

    apply_fn.__name__ = apply_fn.__qualname__ = f"apply_{label}"
    return apply_fn, dict(owner.tree), {n: b.detach() for n, b in module.named_buffers()}


def fully_sharded_step(loss_fn: Callable, tx: Any, module: nn.Module, *, has_aux: bool = False,
                       compile: bool = False) -> Callable:  # noqa: A002 - train_step's argument name
    """``train_step(loss_fn, tx, donate=True)`` for a ``fully_shard``-ed module: FSDP's backward, fxtrain's stack.

    Each call runs ``tx.wrap_loss(loss_fn)`` (amp_cast's loss scale) and ``objective.backward()``, so FSDP's
    hooks all-gather the parameters and reduce-scatter their gradients bucketed per FSDP module, exactly as
    under ``torch.optim``; then it takes the sharded ``.grad`` of every parameter (clearing it), and the
    update half of :func:`fxtrain.train_step` (the same code: ``update_``, ``apply_updates_``) writes the
    new values into the sharded parameters in place. The collectives per step are FSDP2's plus those of the
    stack (one all-reduce for ``clip_by_global_norm``, as ``clip_grad_norm_``). Where ``tx`` is an
    outermost :func:`fxtrain.accumulate`, calls it holds run with ``set_requires_gradient_sync(False)``
    (no reduce-scatter; FSDP sums the unsharded gradients locally) and the emitting call reduces the
    window's sum once. See this module's docstring for what FSDP's ``MixedPrecisionPolicy`` and
    ``amp_cast`` each do.

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning a scalar loss (or ``(loss, aux)`` with ``has_aux``),
        computing through the ``apply_fn`` of :func:`fully_sharded(module) <fully_sharded>` with the
        ``params`` it is given.
      tx: the gradient transformation, e.g. ``chain(clip_by_global_norm(1.0), sharded_apply(adamw(1e-3)))``.
      module: the ``fully_shard``-ed module ``loss_fn`` runs.
      has_aux: as :func:`fxtrain.train_step`: ``loss_fn`` returns ``(loss, aux)``; ``metrics["aux"]``.
      compile: as :func:`fxtrain.train_step`: the update half under ``torch.compile`` (stacks without a fused
        kernel).

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, donated: ``params`` is the tree
      from :func:`fully_sharded` and comes back as the same tree, updated in place.

    Raises:
      TypeError, ValueError: as :func:`fully_sharded` for ``module``; at call time, ``params`` that are not
        the module's own (naming the first leaf that differs), an ``amp_cast`` that casts params, a loss
        from which no gradient reaches any parameter.

    Example (two ranks; not a doctest)::

        apply, params, buffers = fx.parallel.fully_sharded(model)
        tx = fx.chain(fx.clip_by_global_norm(1.0), fx.sharded_apply(fx.adamw(1e-3)))
        step = fx.parallel.fully_sharded_step(lambda p, b: F.mse_loss(apply(p, buffers, b[0], train=True)[0], b[1]),
                                                 tx, model)
        params, opt_state, metrics = step(params, tx.init(params), batch)
    """
    engine = _Engine(_owner(module))
    inner = donated_step(loss_fn, tx, has_aux=has_aux, compile=compile, grads=engine)

    def step(params: Params, opt_state: Any, batch: Any) -> tuple[Params, Any, dict]:
        # Before the forward pass: whether FSDP's backward must reduce-scatter (read on the host from
        # accumulate's CPU counters, so no sync), and whether this is a window's first held call.
        engine.position = position = window_position(tx, opt_state)
        if position is not None and 0 < position[0] and position[0] + 1 >= position[1]:
            # The window's last call: its held sums go back to FSDP, whose reduce-scatter adds this call's
            # gradients and reduces the window once; accumulate adds them to zeros, as when FSDP held them.
            engine.owner.put_held(tree.leaves(opt_state.acc))
            opt_state = opt_state._replace(acc=tree.unflatten(engine.owner.spec, list(tree.zeros_like(engine.owner.leaves))))
        return inner(params, opt_state, batch)

    step.__qualname__ = step.__name__ = f"fully_sharded_step({engine.owner.label})"
    return step


# --- the module's parameters --------------------------------------------------------------------------

class _Owner:
    """What fxtrain holds of one ``fully_shard``-ed module: its sharded parameters and the leaves handed out."""

    def __init__(self, module: nn.Module):
        self.label = module_label(module)
        self.fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
        managed = {id(fp.sharded_param) for m in self.fsdp for g in m._get_fsdp_state()._fsdp_param_groups
                   for fp in g.fsdp_params}
        named = list(module.named_parameters())
        for name, p in named:
            if id(p) not in managed:
                raise ValueError(f"fully_sharded({self.label}): the parameter '{name}' is not managed by fully_shard "
                                 f"(a {type(p).__name__} outside every FSDP module), so its gradient would never be "
                                 f"reduced across ranks: call fully_shard on {self.label} itself too (after its "
                                 "submodules), or on the submodule that holds it")
        # Both in the tree's flatten order (optree sorts dict keys): the nn.Parameters whose .grad FSDP
        # writes, and the leaves handed out (detached: same storage, no autograd identity).
        self.tree = {n: p.detach() for n, p in named}
        self.leaves, self.spec = tree.flatten(self.tree)
        self.names = tree.paths(self.tree)
        self.params = tree.flatten(dict(named))[0]
        by_param = {id(fp.sharded_param): fp for m in self.fsdp for g in m._get_fsdp_state()._fsdp_param_groups
                    for fp in g.fsdp_params}
        self.fsdp_params = [by_param[id(p)] for p in self.params]

    def take_held(self, zeros: bool) -> list:
        """The gradient sums FSDP holds after a held call (``set_requires_gradient_sync(False)``: each rank's
        unsharded, unreduced sum), taken out of FSDP as ``Partial("avg")`` DTensors of the params' global shapes
        on their meshes, so that they are ``accumulate``'s state (saved in checkpoints, exactly) and FSDP holds
        nothing between calls. A parameter without one: zeros when ``zeros``, else ``None``."""
        from torch.distributed.tensor import Partial

        out = []
        for fp, leaf in zip(self.fsdp_params, self.leaves):
            unsharded = getattr(fp, "_unsharded_param", None)
            g = fp.unsharded_accumulated_grad
            if g is None and unsharded is not None:
                g = unsharded.grad
            fp.unsharded_accumulated_grad = None
            if unsharded is not None:
                unsharded.grad = None
            if g is None:
                if not zeros:
                    out.append(None)
                    continue
                dtype = fp.reduce_dtype or fp.param_dtype or fp.orig_dtype
                local, inner = torch.zeros(fp._orig_size, dtype=dtype, device=leaf.device), None
                if fp.is_dtensor:
                    inner = fp._unsharded_dtensor_spec.placements
            elif isinstance(g, DTensor):
                local, inner = g._local_tensor, g.placements
            else:
                local, inner = g, None
            mesh = leaf.device_mesh
            placements = (Partial("avg"),) * (mesh.ndim - len(inner or ())) + tuple(inner or ())
            out.append(DTensor.from_local(local, mesh, placements, run_check=False, shape=leaf.shape,
                                          stride=contiguous_stride(leaf.shape)))
        return out

    def put_held(self, held: list) -> None:
        """Gives FSDP back the sums :meth:`take_held` took (the window's last call reduces them with its own)."""
        for fp, x in zip(self.fsdp_params, held):
            local = x._local_tensor if isinstance(x, DTensor) else x
            if fp.is_dtensor:
                spec = fp._unsharded_dtensor_spec
                inner = x.placements[x.device_mesh.ndim - spec.mesh.ndim:]
                local = DTensor.from_local(local, spec.mesh, inner, run_check=False, shape=x.shape,
                                           stride=contiguous_stride(x.shape))
            fp.unsharded_accumulated_grad = local
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    def check(self, params: Any, where: str) -> list:
        """The leaves of ``params``, checked to be the ones handed out (identity: one C-level pass)."""
        flat, spec = tree.flatten(params)
        if spec == self.spec and all(map(operator.is_, flat, self.leaves)):
            return flat
        raise ValueError(self._why(params, flat, spec, where))

    def _why(self, params: Any, flat: list, spec: Any, where: str) -> str:
        head = f"fully_sharded({self.label}) {where}"
        fix = (f"pass the params tree that fx.parallel.fully_sharded({self.label}) returned (the step returns "
               "the same tree): FSDP computes with the module's own sharded parameters, and the update must be "
               "written into them")
        if spec != self.spec:
            where_ = tree.first_mismatch(params, self.tree)
            return f"{head}: params differ from {self.label}'s parameters at '{where_}'; {fix}"
        path, x, mine = next((n, x, m) for n, x, m in zip(self.names, flat, self.leaves) if x is not m)
        if isinstance(x, torch.Tensor) and x.dtype != mine.dtype:
            return (f"{head}: params['{path}'] is {x.dtype} but {self.label}'s parameter is {mine.dtype}: amp_cast "
                    "casts params for the forward pass, which FSDP's hooks would undo. Let FSDP cast "
                    "(fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...))) and keep amp_cast for loss "
                    f"scaling only, with a policy whose compute dtype is {mine.dtype} (e.g. 'p=f32,c=f32,o=f32')")
        if isinstance(x, torch.Tensor) and x.requires_grad and _same_storage(x, mine):
            return (f"{head}: params['{path}'] requires grad: something differentiates apply_fn with respect to "
                    "params (fx.train_step, torch.func), but FSDP's hooks replace them with their own all-gathered "
                    "parameters, so no gradient would reach them. Build the step with "
                    f"fx.parallel.fully_sharded_step(loss_fn, tx, module), which runs FSDP's backward")
        return f"{head}: params['{path}'] is not {self.label}'s parameter '{path}'; {fix}"

    def set_sync(self, sync: bool) -> None:
        """``set_requires_gradient_sync(sync)`` on every FSDP module: set on every call (a flag per param group),
        so a switch the user flipped between steps cannot leave a window unreduced."""
        for m in self.fsdp:
            m.set_requires_gradient_sync(sync, recurse=False)


def _same_storage(x: torch.Tensor, y: torch.Tensor) -> bool:
    a, b = (t._local_tensor if isinstance(t, DTensor) else t for t in (x, y))
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _owner(module: nn.Module) -> _Owner:
    """The :class:`_Owner` of ``module``, built once: ``fully_sharded`` and the step must hand out one tree."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_sharded expects the fully_shard-ed nn.Module, got {type(module).__name__}")
    if module not in _OWNERS:
        if not fully_sharded_modules(module):
            raise TypeError(f"fully_sharded({module_label(module)}): nothing in it is fully_shard-ed; call "
                            "torch.distributed.fsdp.fully_shard on it first, or use fx.functional for a plain module")
        _OWNERS[module] = _Owner(module)
    return _OWNERS[module]


# --- the gradient engine ------------------------------------------------------------------------------

class _Engine:
    """``grads(fn, params, batch, tx)`` for :func:`fxtrain.step.donated_step`: FSDP's backward, the ``.grad``s."""

    def __init__(self, owner: _Owner):
        self.owner = owner
        self.position: tuple[int, int] | None = None  # (calls held so far, window length) of an accumulate

    def __call__(self, fn: Callable, params: Params, batch: Any, tx: Any) -> tuple[Any, torch.Tensor, Any]:
        owner = self.owner
        owner.check(params, "step")
        held = self.position is not None and self.position[0] + 1 < self.position[1]
        owner.set_sync(not held)
        with torch.enable_grad():
            objective, (loss, aux) = call_objective(fn, params, batch, tx)
        if not objective.requires_grad:
            raise ValueError(self._no_gradient())
        objective.backward()
        grads = [p.grad for p in owner.params]
        for p in owner.params:  # zero_grad(set_to_none=True): FSDP assigns a fresh .grad next time
            p.grad = None
        if held:
            # FSDP summed this micro-batch's gradients unsharded and unreduced: taken out as accumulate's
            # Partial accumulator (the first held call's become it, the next ones add to it), and given back
            # to FSDP at the window's last call (see step), whose reduce-scatter reduces the window's sum.
            grads = owner.take_held(zeros=self.position[0] == 0)
        elif all(g is None for g in grads):
            raise ValueError(self._no_gradient())
        else:  # a parameter the loss did not use: a zero gradient, as train_step's own engine gives
            grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, owner.leaves)]
        return tree.unflatten(owner.spec, grads), loss.detach(), detach_tree(aux)


    def _no_gradient(self) -> str:
        label = self.owner.label
        return (f"fully_sharded_step({label}): no gradient reaches any parameter of {label}: loss_fn must run the "
                f"apply_fn of fx.parallel.fully_sharded(module) for the module given to the step ({label})")
