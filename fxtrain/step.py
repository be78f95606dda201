"""The training step as a function: ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.

:func:`train_step` builds it from a loss function and a gradient transformation: forward and backward of
``tx.wrap_loss(loss_fn, opt_state)``, ``tx.update``, ``apply_updates``, then the metrics the stack reports. Donated
(the default) it updates the trees it is given in place, through a fused torch kernel where the stack declares one;
pure (``donate=False``) it composes with ``torch.func``. The essay (donation, composability, kernel choice,
compilation, the ``wrap_loss`` contract, gradients and their placements) is docs/functional-step.md.

Map:

* :func:`train_step`: the public entry point; picks the donated or the pure path once, when built.
* :func:`donated_step`: the in-place path (and ``compile=True``); :func:`check_owned` refuses memory torch did
  not allocate before anything is written.
* :func:`pure_gradients`: the pure step's gradient half (``torch.func.grad``; vmapped sweeps use it).
* :func:`call_objective`: runs the canonical loss ``fn(params, batch) -> (objective, (loss, aux))`` and names a
  ``wrap_loss`` that returns anything else.
* :func:`step_metrics`, :func:`detach_tree`: the metrics a step returns.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import optree
import torch

from fxtrain import distributed, tree
from fxtrain._base import GradientTransformation, apply_updates, apply_updates_, kernel, report, traits, update_, wrap_loss
from fxtrain._deferred import DTensor
from fxtrain.amp import uncast
from fxtrain.transforms import _fused

__all__ = ["train_step", "donated_step", "pure_gradients", "step_metrics", "call_objective", "detach_tree",
           "check_owned"]

Params = State = Batch = Any
Metrics = dict[str, Any]
Step = Callable[[Params, State, Batch], tuple[Params, State, Metrics]]


def train_step(loss_fn: Callable, tx: GradientTransformation, *, has_aux: bool = False,
               donate: bool = True, compile: bool = False) -> Step:  # noqa: A002 - the public argument name
    """Builds ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning a 0-dim floating-point tensor, or ``(loss, aux)``
        with ``has_aux=True``.
      tx: the gradient transformation; ``opt_state`` is ``tx.init(params)``. Its ``wrap_loss`` (if any)
        wraps the forward pass with the current state (see the module docstring for the contract).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (detached) comes back as ``metrics["aux"]``.
      donate: the step owns ``params`` and ``opt_state`` and updates them in place; the caller must not
        reuse them (the returned trees alias them). ``False`` makes the step pure, and composable with
        ``torch.func.vmap``/``grad``/``jvp`` and autograd (see **Composability** in the module docstring).
      compile: run the update half (the transformation and ``apply_updates_``) under ``torch.compile``,
        in place on the donated buffers (see **Compilation** in the module docstring). Needs
        ``donate=True``. The first calls compile (seconds); later ones reuse the compiled code.

    Raises:
      ValueError: ``compile=True`` with ``donate=False``; at call time, a donated (or compiled) step
        under a ``torch.func`` transform or given params that carry autograd history, params with no
        tensor leaf, or a loss from which no gradient reaches any leaf of params.

    Returns:
      ``step``. Its ``metrics`` hold ``loss`` (0-dim, detached, unscaled), ``aux`` with ``has_aux``, and
      what the stack reports from its new state (0-dim tensors, copied, so later donated steps do not
      change them). Nothing in a step synchronizes with the host.

    Example:
        >>> import torch, fxtrain as fx
        >>> def loss_fn(params, batch):
        ...     x, y = batch
        ...     return ((x @ params["w"] + params["b"] - y) ** 2).mean()
        >>> tx = fx.scale(-0.1)
        >>> step = fx.train_step(loss_fn, tx)
        >>> params = {"w": torch.zeros(3), "b": torch.zeros(())}
        >>> opt_state = tx.init(params)
        >>> batch = (torch.eye(3), torch.tensor([1.0, 2.0, 3.0]))
        >>> for _ in range(100):
        ...     params, opt_state, metrics = step(params, opt_state, batch)
        >>> round(metrics["loss"].item(), 4), [round(w, 2) for w in (params["w"] + params["b"]).tolist()]
        (0.0, [1.0, 2.0, 3.0])
    """
    if compile and not donate:
        raise ValueError("train_step: compile=True needs donate=True: a compiled update that may not write "
                         "into its inputs allocates every buffer afresh each step (an AdamW update at 50M "
                         "params measured about 9x slower than in place on CPU)")
    if donate:
        return donated_step(loss_fn, tx, has_aux=has_aux, compile=compile)
    return _pure_step(_canonical(loss_fn, has_aux), tx, has_aux, _sync(tx))


def _sync(tx: GradientTransformation) -> Callable:
    """``sync(grads, params)``: each DTensor gradient brought to its param's placements, once, unless ``tx``
    takes ``Partial`` gradients as they come (``accumulate``, ``sharded_apply``). It runs after ``_owned``:
    the leaves it returns are this step's own buffers, safe to update in place."""
    return _identity if traits(tx).partial_grads else distributed.match_placements


def donated_step(loss_fn: Callable, tx: GradientTransformation, *, has_aux: bool = False, compile: bool = False,
                 grads: Callable | None = None) -> Step:
    """The in-place step with a pluggable gradient engine: :func:`train_step` with ``donate=True``.

    ``grads(fn, params, batch, tx) -> (grads, loss, aux)`` computes the gradients of ``fn`` (the canonical loss,
    ``fn(params, batch) -> (objective, (loss, aux))``, already wrapped by the stack's ``wrap_loss``) with
    respect to ``params``; the default differentiates detached views with ``torch.autograd.grad``. The
    parallel engines in :mod:`fxtrain.distributed` (FSDP2 modules, pipeline schedules) pass their own
    (``loss.backward()`` through torch's hooks, then the params' ``.grad``); the update half is this one.

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.step import donated_step
        >>> step = donated_step(lambda p, b: (p["w"] * b).sum(), fx.sgd(0.5))
        >>> params, _, m = step({"w": torch.zeros(2)}, fx.sgd(0.5).init(None), torch.ones(2))
        >>> params["w"].tolist()
        [-0.5, -0.5]
    """
    return _donated_step(_canonical(loss_fn, has_aux), tx, has_aux, _sync(tx),
                         _CompiledUpdate(tx) if compile else None, grads or _engine(tx))


def _engine(tx: GradientTransformation, donated: bool = True) -> Callable:
    """The default gradient engine for ``tx``: :func:`_grad`, reducing data-parallel gradients while the backward
    runs unless ``tx`` takes them unreduced (``accumulate``: one reduction per window; ``sharded_apply``); decided
    once, when the step is built."""
    return functools.partial(_grad, donated=donated, overlap=not traits(tx).partial_grads)


def _donated_step(canonical: Callable, tx: GradientTransformation, has_aux: bool, sync: Callable,
                  compiled: _CompiledUpdate | None, grad: Callable) -> Step:
    """The in-place step: autograd on detached views (or ``grad``), then the fused, compiled or foreach kernels."""
    fused = _fused.spec(tx) is not None  # decided once; whether the leaves allow it, per call (metadata)
    extra, constants = _extra_args(tx), traits(tx).constant_reports
    owned = []  # set once the first call's trees were found to be torch's own (checked once per step function)

    def step(params: Params, opt_state: State, batch: Batch) -> tuple[Params, State, Metrics]:
        if tree.transformed():
            option = "compile=True" if compiled is not None else "donate=True"
            raise ValueError(f"train_step({option}) updates its params and state in place, which torch.func "
                             "transforms (vmap, grad, jvp...) cannot batch or differentiate: build the step "
                             f"with donate=False to use it under one (stack: {tx!r})")
        if not owned:
            check_owned(params, opt_state)
            owned.append(True)
        fn = wrap_loss(tx, canonical, opt_state)
        grads, loss, aux = grad(fn, params, batch, tx)
        # Nothing was written before this point: a failure above leaves the inputs as they were.
        with torch.no_grad():
            grads = _owned(grads)
            # A fused torch kernel, where the stack declares one and the leaves allow it, also beats the
            # compiled update (inductor's loops: 74 against 42 ms for clip + AdamW at 50M params). On DTensor
            # leaves it runs on the local pieces and places the gradients itself (its collectives are the
            # sync's): no sync before it, else a data-parallel step would all-reduce its gradients twice.
            if fused and _fused.step_(tx, grads, opt_state, params):
                pass
            elif compiled is not None:
                params, opt_state = compiled(sync(grads, params), opt_state, params, **extra(loss))
            else:
                updates, opt_state = update_(tx, sync(grads, params), opt_state, params, **extra(loss))
                params = apply_updates_(params, updates)
        return params, opt_state, _metrics(loss, aux, opt_state, has_aux, constants)

    return step


def check_owned(params: Params, opt_state: State) -> None:
    """Refuses, in one line naming the leaf, params or state that a donated step would write into while another
    library owns their memory (:func:`fxtrain.tree.borrowed`: numpy arrays, JAX/Flax arrays through DLPack,
    buffers, file records); metadata only. A donated step runs it on its first call, before anything is
    written, as :func:`fxtrain.parallel` steps do through :func:`donated_step`.

    >>> import numpy as np, torch
    >>> from fxtrain.step import check_owned
    >>> check_owned({"w": torch.ones(2)}, ())
    >>> check_owned({"w": torch.as_tensor(np.ones(2))}, ())
    Traceback (most recent call last):
    ...
    ValueError: train_step(donate=True) would write in place into params 'w', whose memory torch did not allocate ...
    """
    for what, t in (("params", params), ("opt_state", opt_state)):
        path = tree.first_borrowed(t)
        if path is not None:
            raise ValueError(
                f"train_step(donate=True) would write in place into {what} '{path}', whose memory torch did not "
                "allocate (a numpy array through torch.as_tensor/from_numpy, a JAX/Flax array through DLPack, "
                "torch.frombuffer, or a torch.load/safetensors record) and another library may still read: copy "
                f"it first ({what} = fx.tree.clone({what})) or build the step with donate=False")


def _pure_step(canonical: Callable, tx: GradientTransformation, has_aux: bool, sync: Callable) -> Step:
    """The composable step: differentiable and batchable where the caller records or transforms.

    Where a ``torch.func`` transform is active, or autograd records and something requires grad (an input's
    leaf, per call; a tensor the stack closes over, seen once by :func:`_holds_grad`), gradients come from
    ``torch.func.grad`` and the update runs out of place (``tx.update``, ``apply_updates``), so ``vmap`` batches
    it and ``grad`` / ``backward`` see it. Otherwise nothing can differentiate it: the donated step's gradients
    and kernels run on this step's own buffers and copies (the fused kernel where it applies), the same bits
    as ``donate=True``.
    """
    fused = _fused.spec(tx) is not None
    extra, constants = _extra_args(tx), traits(tx).constant_reports
    engine = _engine(tx, donated=False)
    held = []  # [whether the stack closes over a tensor that requires grad], found on the first call that asks

    def hyper_grad() -> bool:
        if not held:
            held.append(_holds_grad(tx))
        return held[0]

    def step(params: Params, opt_state: State, batch: Batch) -> tuple[Params, State, Metrics]:
        fn = wrap_loss(tx, canonical, opt_state)
        # Under a torch.func transform (a vmapped sweep builds a step per call) the stack is never walked.
        if tree.transformed() or hyper_grad() or (torch.is_grad_enabled() and _requires_grad(params, opt_state, batch)):
            grads, loss, aux = _pure_grad(fn, params, batch, tx)
            updates, opt_state = tx.update(sync(grads, params), opt_state, params, **extra(loss))
            return apply_updates(params, updates), opt_state, _metrics(loss, aux, opt_state, has_aux, constants)
        # Nothing can differentiate or batch the step: the donated step's gradients (autograd over detached views,
        # which writes nothing) and its kernels on this step's own gradient buffers and a copy of the state, then
        # a copy of the params; the new trees are the only parameter-sized allocations (out of place, every op of
        # every transform allocated its result).
        grads, loss, aux = engine(fn, params, batch, tx)
        with torch.no_grad():
            grads, opt_state = _owned(grads), tree.clone(opt_state)
            if fused and _fused.applies(tx, grads, opt_state, params):
                params = tree.clone(params)
                _fused.step_(tx, grads, opt_state, params)
            else:
                updates, opt_state = update_(tx, sync(grads, params), opt_state, params, **extra(loss))
                del grads  # the updates live in these buffers now
                params = apply_updates(params, updates)  # copies; None updates (a held micro-step) keep the param
        return params, opt_state, _metrics(loss, aux, opt_state, has_aux, constants)

    return step


def _requires_grad(*trees: Any) -> bool:
    """Whether a tensor leaf of ``trees`` requires grad (metadata only)."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree.leaves(trees))


def _holds_grad(tx: GradientTransformation) -> bool:
    """Whether ``tx`` may compute with a tensor that requires grad which its inputs do not show: a hyperparameter
    tensor (``fx.sgd(lr)``), one a schedule closes over, or a module-level tensor a function reads. Checked once,
    when a pure step is built, by walking the kernels' closures (and, for functions outside fxtrain, the globals
    they name); something it cannot look into (a callable object) counts as holding one."""
    seen: set[int] = set()

    def walk(x: Any) -> bool:
        if id(x) in seen or x is None or isinstance(x, (bool, int, float, complex, str, bytes, type)):
            return False
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            return x.requires_grad
        if isinstance(x, GradientTransformation):
            return walk(kernel(x)) or walk(x.init)
        if isinstance(x, functools.partial):
            return walk(x.func) or any(map(walk, x.args)) or any(map(walk, x.keywords.values()))
        if inspect.ismethod(x):
            return walk(x.__func__) or walk(x.__self__)
        if inspect.isfunction(x):
            cells = [c.cell_contents for c in x.__closure__ or () if _filled(c)]
            if not (x.__module__ or "").startswith("fxtrain"):  # a user's function may read a global tensor
                g = x.__globals__
                cells += [g[n] for n in _names(x.__code__) if n in g and not inspect.ismodule(g[n])]
            return any(map(walk, cells + list(x.__defaults__ or ()) + list((x.__kwdefaults__ or {}).values())))
        if isinstance(x, (list, tuple, dict, set, frozenset)):  # NamedTuples (states, hyperparams) included
            return any(map(walk, x.values() if isinstance(x, dict) else x))
        if inspect.isbuiltin(x) or inspect.ismodule(x) or isinstance(x, (torch.dtype, torch.device)):
            return False
        fields = [getattr(x, k) for k in getattr(type(x), "__slots__", ()) if hasattr(x, k)]
        fields += list(vars(x).values()) if hasattr(x, "__dict__") else []
        if fields:
            return any(map(walk, fields))
        return callable(x) and not (type(x).__module__ or "").startswith(("fxtrain", "torch"))

    return walk(tx)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


def _names(code: Any) -> list[str]:
    """The global names ``code`` and the functions nested in it read."""
    names = list(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            names += _names(c)
    return names


def pure_gradients(loss_fn: Callable, tx: GradientTransformation, *,
                   has_aux: bool = False) -> Callable[[Params, State, Batch], tuple[Any, torch.Tensor, Any]]:
    """The gradient half of ``train_step(loss_fn, tx, donate=False)``: ``grads(params, opt_state, batch) -> (grads,
    loss, aux)``, the gradients its step updates with (``tx``'s ``wrap_loss`` around ``loss_fn`` with ``opt_state``)
    and the loss and ``aux``, detached. Pure and batchable: under ``torch.func.vmap`` it gives every member's
    gradients of an ensemble at once, for an update half the caller runs itself (a vmapped sweep runs torch's fused
    kernel on each member's slices, :class:`fxtrain.sweep.MemberKernels`); :func:`step_metrics` then gives the
    step's metrics.

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.step import pure_gradients
        >>> grads = pure_gradients(lambda p, b: (p["w"] * b).sum(), fx.sgd(0.1))
        >>> g, loss, aux = grads({"w": torch.ones(2)}, None, torch.tensor([1.0, 2.0]))
        >>> g["w"].tolist(), float(loss), aux
        ([1.0, 2.0], 3.0, None)
    """
    canonical = _canonical(loss_fn, has_aux)
    return lambda params, opt_state, batch: _pure_grad(wrap_loss(tx, canonical, opt_state), params, batch, tx)


def step_metrics(loss: torch.Tensor, aux: Any, opt_state: State, tx: GradientTransformation, *,
                 has_aux: bool = False) -> Metrics:
    """The metrics :func:`train_step`'s step returns after updating to ``opt_state``: ``loss``, ``aux`` (with
    ``has_aux``) and what ``tx`` reports from the state, less the constants it declares; for a step assembled
    from :func:`pure_gradients` and an update of the caller's.

    Example:
        >>> import torch, fxtrain as fx
        >>> from fxtrain.step import step_metrics
        >>> tx = fx.chain(fx.clip_by_global_norm(1.0), fx.sgd(0.1))
        >>> sorted(step_metrics(torch.tensor(0.5), None, tx.init({"w": torch.ones(2)}), tx))
        ['grad_norm', 'loss']
    """
    return _metrics(loss, aux, opt_state, has_aux, traits(tx).constant_reports)


def _extra_args(tx: GradientTransformation) -> Callable[[torch.Tensor], dict]:
    """The extra update arguments the step passes: ``value=loss`` to a stack that reads extra arguments
    (``reduce_on_plateau``, ``polyak_sgd``: Optax's ``value``), nothing otherwise; decided when the step is built."""
    if traits(tx).extra_args:
        return lambda loss: {"value": loss}
    return lambda loss: {}


def _metrics(loss: torch.Tensor, aux: Any, opt_state: State, has_aux: bool, constants: frozenset) -> Metrics:
    """``loss``, ``aux`` and the state's reports, less the ``constants`` the stack declares."""
    metrics = {"loss": loss}
    if has_aux:
        metrics["aux"] = aux
    for name, value in report(opt_state).items():
        if name in constants:
            continue
        # Copies: a donated next step overwrites the state tensors these may be views of.
        metrics.setdefault(name, value.detach().clone() if isinstance(value, torch.Tensor) else value)
    return metrics


def _identity(grads: Any, params: Params) -> Any:
    del params
    return grads


class _CompiledUpdate:
    """``update_`` then ``apply_updates_`` under ``torch.compile``: the donated update half of a step.

    Traced as one graph per stack, so inductor fuses the transforms' foreach passes and the final add
    into a few loops that write the param and state buffers in place. Built on the first call, when the
    state shows whether the outermost transform decides on the host (``accumulate``); see the module
    docstring. Adam's bias corrections are 0-dim tensors fed to ``Scalar`` foreach overloads, which
    dynamo reads as data-dependent scalars: ``capture_scalar_outputs`` keeps them in the graph.
    """

    def __init__(self, tx: GradientTransformation):
        self.tx, self.fn = tx, None

    def __call__(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> tuple[Any, Any]:
        if self.fn is None:
            self.fn = self._build(state)
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return self.fn(grads, state, params, **extra_args)

    def _build(self, state: Any) -> Callable:
        from torch._dynamo.eval_frame import skip_code

        tx, top = self.tx, kernel(self.tx)
        if not traits(tx).host:
            def traced(grads, state, params, **extra_args):
                updates, state = update_(tx, grads, state, params, **extra_args)
                return apply_updates_(params, updates), state
            return torch.compile(_own_code(traced), dynamic=False)

        def hosted(grads, state, params, **extra_args):
            updates, state = top(grads, state, params, **extra_args)  # non-empty only if tx reads them
            if all(u is None for u in tree.flatten(updates)[0]):  # a held micro-batch: nothing to apply
                return params, state
            return apply_updates_(params, updates), state

        # accumulate decides on the host (reads of its CPU counters) whether this call emits. Those frames
        # run in Python, and so do the helpers of the module that defines it (its own bookkeeping: e.g. a
        # tree_unflatten of None leaves crashes dynamo's optree support, torch 2.13); the frames they call
        # elsewhere (the inner stack's kernel, the final add) compile one by one.
        hosted = _own_code(hosted)
        helpers = vars(sys.modules[top.__module__]).values() if top.__module__ in sys.modules else ()
        for code in (hosted.__code__, top.__code__,
                     *(f.__code__ for f in helpers if inspect.isfunction(f) and f.__module__ == top.__module__)):
            skip_code(code)
        return torch.compile(hosted, dynamic=False)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: dynamo caches compiled graphs per code object and guards on the
    closure (``tx``), so without this every new step would count as a recompile of one shared entry, and
    the 9th step built in a process would silently run eagerly (``recompile_limit``)."""
    fn.__code__ = fn.__code__.replace()
    return fn


def _canonical(loss_fn: Callable, has_aux: bool) -> Callable:
    """The user's ``loss_fn`` in canonical form ``(params, batch) -> (objective, (loss, aux))``, checked."""
    name = _name(loss_fn)

    def fn(params, batch):
        out = loss_fn(params, uncast(batch))  # state that rode through amp_cast uncast: the value itself
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"train_step: loss_fn {name} must return (loss, aux) when has_aux=True, "
                                f"got {_describe(out)}")
            loss, aux = out
        elif isinstance(out, tuple):
            raise TypeError(f"train_step: loss_fn {name} returned a tuple of {len(out)}; pass has_aux=True "
                            "to train_step if it returns (loss, aux), or return the loss alone")
        else:
            loss, aux = out, None
        _check_scalar(loss, f"the loss returned by loss_fn {name}")
        return loss, (loss, aux)

    return fn


def _grad(fn: Callable, params: Params, batch: Batch, tx: GradientTransformation, donated: bool = True,
          overlap: bool = False):
    """The donated step's gradients: ``torch.autograd.grad`` over detached views of the param leaves.

    Returns the gradients (a tree like ``params``) and ``fn``'s (loss, aux), detached. ``donated=False`` (a pure
    step where nothing records) takes params with autograd history too: nothing is written into them. With
    ``overlap``, data-parallel ``Partial`` gradients are all-reduced in buckets launched from hooks while the
    backward runs (:func:`fxtrain.distributed.overlap_reduction`) and come back placed like their params.
    """
    # none_is_leaf=False: None leaves (frozen/absent) are not differentiated and come back as None.
    leaves, spec = optree.tree_flatten(params, none_is_leaf=False, namespace="fxtrain")
    try:
        xs = [_detached_view(p) if donated else p.detach().requires_grad_() for p in leaves]
    except (AttributeError, RuntimeError):
        raise TypeError(f"train_step: params must hold floating-point tensors or None; {_bad_leaf(params)}") from None
    if not xs:
        raise ValueError(_NO_PARAMS)
    with torch.enable_grad():
        objective, (loss, aux) = call_objective(fn, optree.tree_unflatten(spec, xs), batch, tx)
    reducing = distributed.overlap_reduction(xs) if overlap else None
    grads = _grads_reaching(objective, xs)
    if reducing is not None:
        grads = reducing.finish(grads)
    return optree.tree_unflatten(spec, grads), loss.detach(), detach_tree(aux)


def _grads_reaching(objective: torch.Tensor, xs: list, create_graph: bool = False) -> list:
    """``torch.autograd.grad(objective, xs)``; zeros for leaves the loss does not use (as ``jax.grad``), and an
    error when it uses none: the loss may still require grad (a module's own ``nn.Parameter``), and zeros
    everywhere would make a step that trains nothing look like one that works."""
    if not objective.requires_grad:
        raise ValueError(_CONSTANT_LOSS)
    grads = torch.autograd.grad(objective, xs, allow_unused=True, create_graph=create_graph)
    if all(g is None for g in grads):
        raise ValueError(_CONSTANT_LOSS)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs)]


def _detached_view(p: torch.Tensor) -> torch.Tensor:
    if p.grad_fn is not None:
        # Writing into it would change, behind autograd's back, a value a graph was built from.
        raise ValueError("train_step(donate=True) got params that autograd is tracking (they come out of a "
                         "differentiable computation) and would overwrite them in place: build the step with "
                         "donate=False to differentiate through it")
    return p.detach().requires_grad_()


_CONSTANT_LOSS = ("train_step: no gradient reaches any leaf of params: the loss does not depend on params. If "
                  "loss_fn calls an nn.Module, it computes with the module's own parameters: use "
                  "`apply, params, buffers = fx.functional(module)` and compute with the params the step passes")
_NO_PARAMS = ("train_step: params hold no tensor to differentiate (every leaf is None or the tree is empty), so "
              "the step would train nothing; pass the trees from `fx.functional(module)`")


def call_objective(fn: Callable, params: Params, batch: Batch, tx: GradientTransformation):
    """``fn(params, batch)``, checked to be ``(objective, (loss, aux))`` with a scalar objective (for gradient
    engines such as :func:`fxtrain.parallel.fully_sharded_step`'s: the step's own check of a wrapped loss)."""
    out = fn(params, batch)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple) and len(out[1]) == 2):
        raise TypeError(f"train_step: the wrap_loss of {tx!r} must return a loss function giving "
                        f"(objective, (loss, aux)), got {_describe(out)} (see fxtrain/step.py)")
    _check_scalar(out[0], f"the objective returned by the wrap_loss of {tx!r}")
    return out


def _pure_grad(fn: Callable, params: Params, batch: Batch, tx: GradientTransformation):
    """The pure step's gradients, differentiable and batchable: ``torch.func.grad`` on plain tensors.

    ``torch.func.grad`` composes with an outer ``vmap`` or ``grad`` and, where the params require grad,
    leaves its gradients differentiable with respect to them. DTensor leaves take ``torch.autograd.grad``
    (``torch.func`` raises on DTensor parameters, torch 2.13), with ``create_graph`` where something upstream
    requires grad. Returns the gradients, the loss (detached) and aux (detached).
    """
    leaves, spec = optree.tree_flatten(params, none_is_leaf=False, namespace="fxtrain")
    dtensor = False
    for p in leaves:  # metadata only
        if isinstance(p, DTensor):
            dtensor = True
        elif not (isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex())):
            raise TypeError(f"train_step: params must hold floating-point tensors or None; {_bad_leaf(params)}")
    if not leaves:
        raise ValueError(_NO_PARAMS)
    if dtensor:
        return _autograd_grad(fn, leaves, spec, batch, tx)

    outs = []  # (loss, aux) flattened: torch.func returns only the tensors of an aux through the transform

    def objective(xs):
        value, out = call_objective(fn, optree.tree_unflatten(spec, xs), batch, tx)
        if not value.requires_grad:  # inside grad: True exactly when it depends on xs
            raise ValueError(_CONSTANT_LOSS)
        outs[:] = optree.tree_flatten(out, none_is_leaf=True, namespace="fxtrain")
        return value, [x for x in outs[0] if isinstance(x, torch.Tensor)]

    grads, tensors = torch.func.grad(objective, has_aux=True)(leaves)
    it = iter(tensors)
    loss, aux = optree.tree_unflatten(outs[1], [next(it) if isinstance(x, torch.Tensor) else x for x in outs[0]])
    return optree.tree_unflatten(spec, grads), loss.detach(), detach_tree(aux)


def _autograd_grad(fn: Callable, leaves: list, spec: Any, batch: Batch, tx: GradientTransformation):
    """``torch.autograd.grad`` for DTensor params; differentiable when params or batch require grad."""
    upstream = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in [*leaves, *tree.leaves(batch)])
    # Leaves that require grad are differentiated as they are (create_graph keeps the graph to them);
    # the others through detached views, as in the donated step.
    xs = [p if upstream and p.requires_grad else p.detach().requires_grad_() for p in leaves]
    with torch.enable_grad():
        objective, (loss, aux) = call_objective(fn, optree.tree_unflatten(spec, xs), batch, tx)
    grads = _grads_reaching(objective, xs, create_graph=upstream)
    return optree.tree_unflatten(spec, grads), loss.detach(), detach_tree(aux)


def _owned(grads: Any) -> Any:
    """``grads`` as buffers a donated update may overwrite, copying only the few that are not.

    ``torch.autograd.grad`` can return one tensor for two leaves (``(a + b).sum()``), views of one buffer,
    or a stride-0 expand (``w.sum()``); writing into those in place would corrupt the other leaves or fail.
    This is what ``AccumulateGrad`` checks before it steals a gradient buffer for ``.grad``.
    """
    flat, spec = tree.flatten(grads)
    local = iter(distributed.local_leaves(flat))
    # Byte ranges already handed out, per storage: disjoint slices of one buffer are fine (FSDP2's
    # reduce-scatter leaves every gradient of a module as a slice of one buffer: copying those cost ~3% of
    # a step); a range that overlaps one seen before is not.
    taken: dict[int, list[tuple[int, int]]] = {}
    for i, g in enumerate(flat):
        if g is None:
            continue
        x = next(local)
        start = x.data_ptr()
        end = start + x.numel() * x.element_size()
        ranges = taken.setdefault(x.untyped_storage().data_ptr(), [])
        # A gradient in memory another library owns (a JAX function's output through DLPack) is copied too:
        # the update is written into the gradient buffers.
        if not x.is_contiguous() or any(start < e and s < end for s, e in ranges) or tree.borrowed(x):
            flat[i] = g.clone()
        else:
            ranges.append((start, end))
    return tree.unflatten(spec, flat)


def _check_scalar(x: Any, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"train_step: {what} must be a 0-dim tensor, got {_describe(x)}")
    if x.ndim != 0:
        raise ValueError(f"train_step: {what} must be a scalar (0-dim), got shape {tuple(x.shape)}; "
                         "reduce it (e.g. .mean())")
    if not x.is_floating_point():
        raise TypeError(f"train_step: {what} must be floating-point, got {x.dtype}")


def detach_tree(aux: Any) -> Any:
    """``aux`` with every tensor detached (``None`` stays ``None``)."""
    if aux is None:
        return None
    return optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux, namespace="fxtrain")


def _bad_leaf(params: Params) -> str:
    flat, _ = tree.flatten(params)
    for path, x in zip(tree.paths(params), flat):
        if x is not None and not (isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())):
            return f"'{path}' is {_describe(x)}"
    return "a leaf cannot require gradients"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    if isinstance(x, tuple):
        return f"a tuple of {len(x)}"
    return type(x).__name__


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
