"""torch's fused optimizer kernels as a kernel choice of the donated step: ``adam``, ``adamw``, ``sgd``,
alone or after ``clip_by_global_norm``, inside ``amp_cast``, ``accumulate``, ``inject_hyperparams`` and chains.

No second copy of the math lives here: a transform *declares* which torch kernel (``torch._fused_adamw_``,
``_fused_adam_``, ``_fused_sgd_``) computes exactly its chain, for the arguments that kernel covers;
:func:`fxtrain._base.merge_traits` combines the declarations (a clip rides in the kernel's ``grad_scale``); the
donated step asks :func:`step_` to run update and apply as that one call where the leaves allow it, else it takes
the foreach kernels (same state, same numbers to float32 rounding). Hyperparameters in the state, wrappers,
numerics and parallel layouts: docs/functional-step.md ("Fused kernels").

Map: :func:`declare` (a transform states its kernel), :func:`spec` (the kernel a stack declares, or ``None``),
:func:`applies` / :func:`step_` / :func:`bind` (whether the leaves allow it; one call; bound once for a loop).

Example:
    >>> import torch, fxtrain as fx
    >>> from fxtrain.transforms import _fused
    >>> tx = fx.adamw(0.1)
    >>> params = {"w": torch.ones(2)}
    >>> state = tx.init(params)
    >>> _fused.spec(tx).name, _fused.spec(fx.adamw(0.1, mask={"w": False})) is None
    ('adamw', True)
    >>> ref, _ = tx.update({"w": torch.tensor([1.0, -1.0])}, state, params)
    >>> _fused.step_(tx, {"w": torch.tensor([1.0, -1.0])}, state, params)
    True
    >>> torch.allclose(params["w"], 1 + ref["w"])
    True

    The default stack, clip then AdamW, is one kernel call too:

    >>> tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.1))
    >>> _fused.spec(tx).name, _fused.spec(tx).max_norm
    ('adamw', 1.0)
    >>> state = tx.init(params)
    >>> _fused.step_(tx, {"w": torch.tensor([3.0, -4.0])}, state, params), float(state[0].grad_norm)
    (True, 5.0)

    The recommended stack's wrappers too: a float16 loss scale whose overflow decision is the kernel's ``found_inf``:

    >>> tx = fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(0.1)), "fp16")
    >>> state, before = tx.init(params), params["w"].clone()
    >>> _fused.step_(tx, {"w": torch.tensor([float("inf"), 1.0])}, state, params), int(state.skipped)
    (True, 1)
    >>> torch.equal(params["w"], before), int(state.inner_state[1][0].count), float(state.loss_scale.scale)
    (True, 0, 32768.0)

    And the runner's, with a scheduled learning rate kept in the state:

    >>> tx = fx.chain(fx.clip_by_global_norm(1.0),
    ...               fx.inject_hyperparams(fx.adamw)(learning_rate=fx.linear_schedule(0.1, 0.0, 10)))
    >>> state = tx.init(params)
    >>> _fused.step_(tx, {"w": torch.tensor([3.0, -4.0])}, state, params), int(state[1].count)
    (True, 1)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch


from fxtrain import distributed, tree
from fxtrain._base import FUSED_KERNELS, FusedSpec, GradientTransformation, traits, with_traits
from fxtrain._deferred import DTensor
from fxtrain.transforms._momentum import TraceState

__all__ = ["applies", "bind", "declare", "spec", "step_"]

def declare(tx: GradientTransformation, name: str, *, covered: bool = True, groups: Sequence[Any] = (),
            **hyperparams: Any) -> GradientTransformation:
    """Marks ``tx`` as computed exactly by torch's fused ``name`` (a kernel, or the prefix ``clip_by_global_norm``).

    The mark is set only when ``covered`` (the caller's arguments are ones the kernel computes) and every
    hyperparameter is a plain number (the fused kernels take floats; a tensor or a schedule given to the
    optimizer itself stays on the foreach path, ``inject_hyperparams`` declares its own spec; bools are
    flags). ``groups``: a clip's process groups, passed to the norm as they are. Returns ``tx``.
    """
    if covered and all(isinstance(v, (bool, int, float)) for v in hyperparams.values()):
        return with_traits(tx, fused=FusedSpec(name, dict(hyperparams), groups=tuple(groups)))
    return tx


def spec(tx: GradientTransformation) -> FusedSpec | None:
    """The :class:`FusedSpec` declared for ``tx``, or ``None``."""
    return traits(tx).fused


def step_(tx: GradientTransformation, grads: Any, state: Any, params: Any) -> bool:
    """Runs ``tx``'s update *and* ``apply_updates_`` as one fused kernel, in place on ``params`` and ``state``.

    Returns ``False`` (and touches nothing) when :func:`applies` is false; the caller then runs the
    foreach kernels. ``grads`` are donated: with a clip the kernel writes the clipped gradients into them.
    """
    plan = bind(tx, grads, state, params)
    if plan is None:
        return False
    plan()
    return True


def applies(tx: GradientTransformation, grads: Any, state: Any, params: Any) -> bool:
    """Whether :func:`step_` would run a fused kernel on these trees (metadata only, no sync)."""
    return bind(tx, grads, state, params) is not None


def bind(tx: GradientTransformation, grads: Any, state: Any, params: Any) -> Callable[[], None] | None:
    """A thunk that runs :func:`step_`'s kernel on these trees, or ``None`` where none applies (:func:`applies`).

    The checks run once, here; each call of the thunk is one update, reading whatever ``grads`` hold then and
    writing ``params`` and ``state`` in place. So a caller that keeps its trees (a vmapped sweep binds each
    member's slices of the group's batched trees once, :class:`fxtrain.sweep.MemberKernels`) pays the checks
    once instead of every step. Hyperparameters that ``inject_hyperparams`` keeps in the state are read from it
    at each call, as :func:`step_` reads them.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx, params, grads = fx.sgd(0.5), {"w": torch.zeros(2)}, {"w": torch.ones(2)}
        >>> update = bind(tx, grads, tx.init(params), params)
        >>> update(); update(); params["w"].tolist()
        [-1.0, -1.0]
    """
    return _bind(spec(tx), grads, state, params)


def _bind(s: FusedSpec | None, grads: Any, state: Any, params: Any,
          pre: Callable | None = None) -> Callable[[], None] | None:
    """:func:`bind` for a spec; ``pre`` (a wrapper's, see :func:`fxtrain._base.fused_around`) runs on the placed
    gradients before the clip and gives the kernel's ``found_inf``."""
    if s is None or s.name not in FUSED_KERNELS:
        return None
    if s.around is not None:  # a wrapper (amp_cast, accumulate, a chain of one): its update around its child's kernel
        return s.around(grads, state, params,
                        lambda g, st, p, pre=pre: _bind(s.inner, g, st, p, pre))
    clip_state = None
    if s.states_of is not None:
        try:
            clip_state, state = s.states_of(state)
        except (KeyError, TypeError, ValueError):  # not this combinator's state: the foreach path names it
            return None
        if not isinstance(getattr(clip_state, "grad_norm", None), torch.Tensor):
            return None
    record = dict  # hyperparameters kept in the state (inject_hyperparams): none here
    if s.from_state is not None:
        found = s.from_state(state, params)
        if found is None:
            return None
        inner, state, record = found
        s = inner._replace(max_norm=s.max_norm, groups=s.groups)
    if s.name in ("adam", "adamw"):
        g, p, mu, nu = tree.align(grads, params, state[0].mu, state[0].nu, what="params")
        if not _allowed(g, p, mu, nu) or not _distinct(g, clip_state):
            return None
        count = tree.local(state[0].count)
        fused = torch._fused_adamw_ if s.name == "adamw" else torch._fused_adam_

        def run():
            hp = {**s.hyperparams, **record()}
            count.add_(1)
            if p:
                lg, scale, found_inf = _grads(g, p, s, clip_state, pre)
                steps = [count.to(torch.float32)] * len(p)  # read, not written, by the kernel
                fused(_locals(p), lg, _locals(mu), _locals(nu), [], steps, lr=_lr(hp, p), beta1=hp["b1"],
                      beta2=hp["b2"], weight_decay=hp.get("weight_decay", 0.0), eps=hp["eps"], amsgrad=False,
                      maximize=False, grad_scale=scale, found_inf=found_inf)
        return run
    if isinstance(state[0], TraceState):  # sgd with momentum (never 0: sgd declares no kernel then)
        g, p, bufs = tree.align(grads, params, state[0].trace, what="params")
        ok = _allowed(g, p, bufs)
    else:
        (g, p), bufs = tree.align(grads, params, what="params"), []
        ok = _allowed(g, p)
    if not ok or not _distinct(g, clip_state):
        return None

    def run():
        hp = {**s.hyperparams, **record()}
        if p:
            lg, scale, found_inf = _grads(g, p, s, clip_state, pre)
            torch._fused_sgd_(_locals(p), lg, _locals(bufs), weight_decay=0.0, momentum=hp["momentum"],
                              lr=_lr(hp, p), dampening=0.0, nesterov=hp["nesterov"], maximize=False,
                              is_first_step=False, grad_scale=scale, found_inf=found_inf)
    return run


def _lr(hp: dict, p: list) -> float | torch.Tensor:
    """The kernel's ``lr``: a number, or a 0-dim tensor (torch's ``tensor_lr`` overloads) on the params' device."""
    lr = hp["learning_rate"]
    if isinstance(lr, torch.Tensor):
        # A copy on another device is queued, not waited for (torch.optim's fused Adam does the same).
        return tree.local(lr).to(tree.local(p[0]).device, non_blocking=True)
    return lr


def _grads(g: list, p: list, s: FusedSpec, clip_state: Any,
           pre: Callable | None = None) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
    """The kernel's gradients (local pieces, placed like their params), ``grad_scale`` and ``found_inf``.

    DTensor gradients are first brought to their params' placements (:func:`fxtrain.distributed.match_placements`:
    ``Partial`` ones reduced in one bucketed collective per process group; FSDP's ``Shard(0)`` ones are already
    there), so each rank's kernel updates its own piece of every param exactly once, with the gradient of the
    whole batch: elementwise math on local pieces is the math on the whole tensor. The clip's norm is taken
    of the placed DTensors, so it sums every shard over its mesh and every mesh once. A wrapper's ``pre``
    (``amp_cast``: unscale, overflow) runs on the placed gradients first, as its foreach update runs after the
    step's reduction; its ``found_inf`` makes the kernel skip the update.
    """
    if any(isinstance(x, DTensor) for x in g):
        g = distributed.match_placements(g, p)
    local = [x if x.is_contiguous() else x.contiguous() for x in _locals(g)]  # a Shard(1) slice is strided
    if pre is None:
        return local, _grad_scale(g, s, clip_state), None
    # Contiguous copies (of strided slices) are what the kernel reads: pre writes those, the clip reads them.
    g = [_relocal(x, y) if isinstance(x, DTensor) and x._local_tensor is not y else (x if isinstance(x, DTensor) else y)
         for x, y in zip(g, local)]
    found_inf = pre(local, g)
    return local, _grad_scale(g, s, clip_state), found_inf


def _relocal(x: Any, local: torch.Tensor) -> Any:
    """The DTensor ``x`` around another local piece (its contiguous copy), for a norm that must read the copy."""
    return DTensor.from_local(local, x.device_mesh, x.placements, shape=x.shape, stride=x.stride(),
                              run_check=False)


def _locals(xs: list) -> list:
    """The local pieces (``_local_tensor``: views the kernel writes into) of DTensor leaves; plain ones as they are."""
    return [x._local_tensor if isinstance(x, DTensor) else x for x in xs]


def _grad_scale(g: list, s: FusedSpec, clip_state: Any) -> torch.Tensor | None:
    """``clip_by_global_norm``'s coefficient as the kernels' divisor, its state updated; ``None`` unclipped.

    Optax's rule ``coef = 1 if norm < max_norm else max_norm / norm`` inverted: NaN and inf norms give the
    foreach path's NaN and zero-times-inf updates.
    """
    max_norm = s.max_norm
    if max_norm is None:
        return None
    # Plain tensors: one packed/foreach pass; a collective only over the clip's groups (pipeline stages).
    norm = distributed.global_norm(g, groups=s.groups)
    clip_state.grad_norm.copy_(norm)
    # max(1, norm / max_norm): exactly 1.0 below max_norm; NaN stays NaN (clamp propagates it).
    return (norm / max_norm).clamp_(min=1.0).to(torch.float32)  # the kernels read a float32 scale


def _allowed(g: list, p: list, *states: list) -> bool:
    """Metadata only, no sync: floating tensors on one device, leafwise one dtype; params and state contiguous.

    A DTensor param needs a DTensor gradient on its mesh (any placements: the kernel's caller places it) and
    state DTensors placed exactly like it (``sharded_apply``'s, or ``zeros_like`` of the param), so that the
    local pieces line up element for element. Plain params need plain leaves throughout.
    """
    if not p:
        return True
    device = tree.local(p[0]).device
    for row in zip(g, p, *states):
        x = row[1]
        dtype = x.dtype
        if isinstance(x, DTensor):
            grad, mesh, placements = row[0], x.device_mesh, x.placements
            if not (isinstance(grad, DTensor) and grad.device_mesh == mesh and grad.shape == x.shape) \
                    or not all(isinstance(y, DTensor) and y.device_mesh == mesh and y.placements == placements
                               for y in row[2:]):
                return False
        elif any(isinstance(y, DTensor) for y in row):
            return False
        for y in row:
            local = tree.local(y)
            if type(local) is not torch.Tensor and not isinstance(local, torch.nn.Parameter):
                return False
            if y.dtype != dtype or local.device != device or not y.is_floating_point():
                return False
            if y is not row[0] and not local.is_contiguous():  # gradients are placed (and made contiguous) first
                return False
    return True


def _distinct(g: list, clip_state: Any) -> bool:
    """No two gradients overlap in memory, where the kernel writes them (a clip): autograd may hand one buffer
    to two leaves (``(a + b).sum()``), which would be divided twice. Disjoint slices of one buffer are fine
    (FSDP2's reduce-scatter leaves a module's gradients so). Metadata only; a step copies overlapping
    gradients before it asks (:func:`fxtrain.step.train_step`, as for its foreach kernels)."""
    if clip_state is None or len(g) < 2:
        return True
    spans = sorted((x.untyped_storage().data_ptr(), x.data_ptr(), x.data_ptr() + x.numel() * x.element_size())
                   for x in _locals(g))
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))
