"""Hyperparameters in the optimizer state: ``inject_hyperparams`` (Optax's, on tensors)."""

from __future__ import annotations

import functools
import inspect
import numbers
import weakref
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import torch

from fxtrain import tree
from fxtrain._base import (FusedSpec, GradientTransformation, call_, describe, named, public_factory, traits,
                           with_traits)
from fxtrain.schedules import bind, value_at
from fxtrain.transforms._moments import counter, param_device, safe_increment_


class InjectHyperparamsState(NamedTuple):
    """State of :func:`inject_hyperparams`: update count, hyperparameters as 0-dim tensors, inner state.

    ``hyperparams`` holds the values used by the last update (at init: the values for the first one).
    Write into it to change a non-scheduled hyperparameter from the next update on.

    It reports every hyperparameter; :func:`fxtrain.train_step` shows only ``learning_rate`` and the
    scheduled ones in its metrics (the transform declares the others constant).

    Example:
        >>> import torch, fxtrain as fx
        >>> state = fx.inject_hyperparams(fx.sgd)(learning_rate=0.1).init({"w": torch.zeros(2)})
        >>> isinstance(state, fx.InjectHyperparamsState), state._fields
        (True, ('count', 'hyperparams', 'inner_state'))
    """

    count: torch.Tensor  # 0-dim int32
    hyperparams: dict[str, torch.Tensor]
    inner_state: Any

    def report(self) -> dict[str, torch.Tensor]:
        """The hyperparameters, so ``learning_rate`` (and the scheduled ones) show in the step's metrics."""
        return {k: torch.as_tensor(v) for k, v in self.hyperparams.items()}


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation], static_args: str | Iterable[str] = (),
                       hyperparam_dtype: torch.dtype | None = None) -> Callable[..., GradientTransformation]:
    r"""Moves the numeric hyperparameters of ``inner_factory`` into the state, and lets them be schedules.

    ``inject_hyperparams(adamw)(learning_rate=sched, weight_decay=1e-4)`` behaves like
    ``adamw(learning_rate=sched(t), weight_decay=1e-4)`` at update :math:`t`: each update evaluates the
    schedules at the count, reads the other numeric hyperparameters from ``state.hyperparams`` (so they
    can be changed mid-run by writing into it), rebuilds the inner transform with 0-dim tensor
    hyperparameters (cheap: factories are closures) and runs its kernel on the inner state. The values
    used are kept in ``state.hyperparams``. :func:`fxtrain.train_step` reports ``learning_rate`` and the
    scheduled ones as metrics; the others stay constant (unless written into the state), and the step
    leaves them out (read them from ``state.hyperparams``).

    As in Optax, callables are schedules unless named in ``static_args``; bools, strings, ``None`` and
    other non-numbers are static (passed unchanged), and so is a function the factory takes by default
    (``adopt``'s ``clip_value_fn``: Optax would call it as a schedule). Float values become tensors of ``hyperparam_dtype``,
    by default the widest floating dtype of the params but at least float32 (Optax would round, say,
    ``b2=0.999`` to 1.0 in bfloat16), and so do integers given for a float argument (``weight_decay=0``,
    ``learning_rate=1``: JAX would promote them in the math, torch's kernels take floats); integers for an
    argument that counts (an int default or annotation: ``ns_steps``, ``memory_size``) become int32
    tensors, as in Optax; tensors keep their dtype.

    The hyperparameters in the state are ordinary inputs of the pure ``update``: ``torch.func.grad``
    (or plain autograd) of a loss after some updates with respect to ``state.hyperparams["learning_rate"]``
    gives the hypergradient, and ``torch.func.vmap`` over a state whose hyperparameters are stacked runs an
    ensemble of settings in one call. A tensor given as a hyperparameter that requires grad stays in the
    graph (the state holds a differentiable copy). A hyperparameter must be a number or a 0-dim tensor,
    floating where the value given was floating.

    Where the inner optimizer has a fused torch kernel (``adam``, ``adamw``, ``sgd``: the runner's default
    stack), a step that owns its params runs that kernel with the state's values: the learning rate as a
    0-dim tensor (a schedule's value, computed on the device), the others as the host's copies of the
    state's values; a value the kernel does not cover (a scheduled ``b1``, ``eps_root`` written into the
    state) takes the foreach kernels (:mod:`fxtrain.transforms._fused`). The state is the same either way.

    Args:
      inner_factory: a transform factory, e.g. :func:`fxtrain.adamw`; its hyperparameters must accept
        0-dim tensors.
      static_args: names of callable arguments that are not schedules.
      hyperparam_dtype: dtype of the float hyperparameters, or ``None`` for the default above.

    Returns:
      A factory with the signature of ``inner_factory`` whose transforms have an
      :class:`InjectHyperparamsState`.

    Example:
        >>> import torch, fxtrain as fx
        >>> tx = fx.inject_hyperparams(fx.scale)(step_size=fx.linear_schedule(1.0, 0.0, 4))
        >>> tx
        inject_hyperparams(scale)(step_size=linear_schedule(init_value=1.0, end_value=0.0, transition_steps=4))
        >>> g = {"w": torch.ones(1)}
        >>> state = tx.init(g)
        >>> for _ in range(3):
        ...     u, state = tx.update(g, state, g)
        >>> u["w"].tolist(), float(state.hyperparams["step_size"]), int(state.count)
        ([0.5], 0.5, 3)

        Four learning rates in one vmapped call, and the gradient of a loss with respect to one:

        >>> tx = fx.inject_hyperparams(fx.sgd)(learning_rate=0.1)
        >>> p = {"w": torch.ones(2)}
        >>> states = fx.tree.map(lambda x: torch.stack([x] * 4), tx.init(p))
        >>> states.hyperparams["learning_rate"] = torch.tensor([0.1, 0.2, 0.3, 0.4])
        >>> u, _ = torch.func.vmap(tx.update, in_dims=(None, 0, None))(p, states, p)
        >>> u["w"][:, 0].tolist()
        [-0.1..., -0.2..., -0.3..., -0.4...]
        >>> def loss(lr):
        ...     state = tx.init(p)
        ...     state.hyperparams["learning_rate"] = lr
        ...     u, _ = tx.update(p, state, p)
        ...     return (fx.apply_updates(p, u)["w"] ** 2).sum()
        >>> float(torch.func.grad(loss)(torch.tensor(0.1)))   # d/dlr |w - lr w|^2 = -2 (1 - lr) |w|^2
        -3.6...
    """
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    if hyperparam_dtype is not None and not isinstance(hyperparam_dtype, torch.dtype):
        raise TypeError(f"inject_hyperparams: hyperparam_dtype must be a torch.dtype or None, "
                        f"got {hyperparam_dtype!r}")
    fname = getattr(inner_factory, "__name__", None) or repr(inner_factory)
    sig = inspect.signature(inner_factory)
    if not static <= set(sig.parameters):
        raise ValueError(f"inject_hyperparams({fname}): static_args {sorted(static - set(sig.parameters))} "
                         f"are not arguments of {fname}; its arguments are {', '.join(sig.parameters)}")
    options = [f"static_args={tuple(sorted(static))!r}"] if static else []
    options += [f"hyperparam_dtype={hyperparam_dtype}"] if hyperparam_dtype is not None else []
    head = f"inject_hyperparams({', '.join([fname] + options)})"

    @functools.wraps(inner_factory)
    def wrapped(*args, **kwargs) -> GradientTransformation:
        bound = bind(head, fname, sig, args, kwargs)
        label = f"{head}({', '.join(f'{k}={describe(v)}' for k, v in bound.arguments.items())})"
        bound.apply_defaults()
        schedules, numeric, other = {}, {}, {}
        for k, v in bound.arguments.items():
            if k in static or isinstance(v, bool) or (callable(v) and v is sig.parameters[k].default):
                other[k] = v  # a function the factory defaults to is not a schedule (adopt's clip_value_fn)
            elif callable(v):
                schedules[k] = v
            elif isinstance(v, (numbers.Number, torch.Tensor, np.ndarray, np.generic)):
                numeric[k] = _checked(head, f"hyperparameter {k}", v, _is_float(v))
            else:
                other[k] = v
        # Float hyperparameters stay float: a value written into the state later is checked against this.
        # An integer given where the factory takes a float (weight_decay=0, learning_rate=1: what Hydra
        # passes for "0") is a float too; integers stay integers only where the factory counts
        # (ns_steps=5, memory_size=10: an int default or an int annotation).
        floats = {k for k, v in numeric.items() if _is_float(v) or not _counts(sig.parameters[k], v)}
        # Built once now with plain values: checks the arguments early and gives the traits to forward.
        try:
            proto = inner_factory(**other, **numeric, **{k: f(0) for k, f in schedules.items()})
        except ValueError as e:
            raise ValueError(f"{head}: {e}") from None

        def current(state, params) -> dict:
            """Hyperparameters for the update at ``state.count``: stored values, then schedules evaluated."""
            memo = []  # the params' float dtype, found only if needed (not functools.cache: torch.compile
                       # cannot trace its construction, and this runs inside compiled steps)

            def dtype():
                if not memo:
                    memo.append(_float_dtype(params, hyperparam_dtype))
                return memo[0]

            device = state.count.device
            hps = {}
            for k, v in state.hyperparams.items():
                if k not in schedules:  # a scheduled value is overwritten below whatever the state holds
                    v = _checked(head, f"state.hyperparams[{k!r}]", v, k in floats)
                hps[k] = v if isinstance(v, torch.Tensor) else _as_hparam(v, dtype(), device, k in floats)
            for k, f in schedules.items():
                prev = hps.get(k)
                keep = isinstance(prev, torch.Tensor) and prev.is_floating_point()
                target = prev.dtype if keep else dtype()
                hps[k] = _as_hparam(_scheduled(f, state.count, target), target, device)
            return hps

        def init_fn(params):
            dtype, device = _float_dtype(params, hyperparam_dtype), param_device(params)
            count = counter(params)
            hps = {k: _as_hparam(v, dtype, device, k in floats, keep_tensor_dtype=True) for k, v in numeric.items()}
            hps.update({k: _as_hparam(_scheduled(f, count, dtype), dtype, device) for k, f in schedules.items()})
            inner_state = inner_factory(**other, **hps).init(params)
            for k, v in numeric.items():  # the host knows these values: a fused kernel reads them from here
                if not isinstance(v, torch.Tensor):
                    _remember(hps[k], v)
            return InjectHyperparamsState(count, hps, inner_state)

        def update_fn(updates, state, params=None, **extra_args):
            hps = current(state, params)
            inner = inner_factory(**other, **hps)  # cheap: factories are closures over the 0-dim tensors
            updates, inner_state = call_(inner, updates, state.inner_state, params, extra_args)
            return updates, InjectHyperparamsState(safe_increment_(state.count), hps, inner_state)

        def wrap_loss(loss_fn, state):
            inner = inner_factory(**other, **current(state, None))
            return inner.wrap_loss(loss_fn, state.inner_state)

        # Unscheduled hyperparameters never change by themselves: the step does not report them every step.
        constants = traits(proto).constant_reports | (frozenset(numeric) - {"learning_rate"})
        fused = _fused_spec(inner_factory, other, numeric, schedules, current)
        inherited = traits(proto)._replace(fused=fused, wrap_loss=None if proto.wrap_loss is None else wrap_loss,
                                           constant_reports=constants)
        return with_traits(named(GradientTransformation(init_fn, update_fn), label), **inherited._asdict())

    return wrapped


public_factory(inject_hyperparams)  # a public factory of transforms (see the conformance test)


# --- torch's fused kernels (fxtrain/transforms/_fused.py) with hyperparameters from the state ----------------

def _fused_spec(inner_factory: Callable, other: dict, numeric: dict, schedules: dict,
                current: Callable) -> FusedSpec | None:
    """The fused kernel of ``inner_factory``'s transforms, hyperparameters read from the state, or ``None``.

    torch's kernels take the learning rate as a 0-dim tensor (their ``tensor_lr`` overloads) and every other
    hyperparameter as a host number. So the learning rate comes from :func:`inject_hyperparams`' own
    ``current`` (its schedule evaluated at the state's count on the device, as the foreach path does) and the
    others from the host's copy of the state's values (:func:`_host_values`). The kernel is the one
    ``inner_factory`` declares for those numbers (``eps_root=0``, say, but not ``1e-8``), asked anew when
    they change, so a value written into the state that the kernel does not cover takes the foreach path.
    A scheduled hyperparameter other than the learning rate (its value is on the device every step) or one
    given as a tensor declares no kernel at all.
    """
    if set(schedules) - {"learning_rate"} or any(isinstance(v, torch.Tensor) for v in numeric.values()):
        return None
    injected = set(numeric) | set(schedules)
    placeholder = {"learning_rate": 1.0} if "learning_rate" in injected else {}  # the kernel gets the tensor
    specs: dict = {}  # host values -> the spec inner_factory declares for them

    def kernel(host: dict) -> FusedSpec | None:
        key = tuple(sorted(host.items()))
        if key not in specs:
            try:
                spec = traits(inner_factory(**other, **host, **placeholder)).fused
            except (TypeError, ValueError):  # the foreach path raises it, with inject_hyperparams' name
                spec = None
            plain = spec is not None and spec.states_of is None and spec.from_state is None \
                and spec.max_norm is None and spec.around is None
            specs[key] = spec if plain else None
        return specs[key]

    proto = kernel({k: v for k, v in numeric.items() if k != "learning_rate"})
    if proto is None:
        return None

    def from_state(state, params):
        hps = getattr(state, "hyperparams", None)
        if not isinstance(hps, dict) or set(hps) != injected \
                or any(isinstance(v, torch.Tensor) and (v.requires_grad or v.ndim) for v in hps.values()):
            return None  # the foreach path refuses these (or differentiates through them)
        lr = hps.get("learning_rate")
        if isinstance(lr, torch.Tensor) and lr.dtype != torch.float32 and tree.local(lr).device.type != "cpu":
            return None  # torch's CUDA kernels read a tensor lr as float32 (the CPU ones read its value)
        host = _host_values({k: v for k, v in hps.items() if k != "learning_rate"})
        spec = None if host is None else kernel(host)
        if spec is None or spec.name != proto.name:
            return None

        def record() -> dict:
            used = current(state, params)  # what the foreach path computes, at the same count
            state.hyperparams.update(used)
            with tree.donated():
                safe_increment_(state.count)
            return {"learning_rate": used["learning_rate"]} if "learning_rate" in used else {}

        return spec, state.inner_state, record

    return proto._replace(from_state=from_state)


# Host copies of hyperparameter tensors: id(tensor) -> (weak reference, version counter, value). An entry
# holds while its tensor lives and is not written into (an in-place write bumps the version; a new tensor in
# the state has a new id), so only a value the host has not seen is read (see _host_values).
_HOST: dict[int, tuple[weakref.ref, int, Any]] = {}


def _remember(t: torch.Tensor, value: Any) -> None:
    """Records that ``t`` (a 0-dim tensor just made from ``value``) holds ``value`` rounded to its dtype."""
    local = tree.local(t)
    try:
        version = local._version
    except RuntimeError:  # an inference tensor keeps no version counter: never trusted
        return
    key = id(local)
    ref = weakref.ref(local, lambda r: _HOST.pop(key) if _HOST.get(key, (None,))[0] is r else None)
    # Rounded on the host (a CPU tensor), as the state's tensor holds it: float32's 0.999 is 0.99900001...
    _HOST[key] = (ref, version, torch.tensor(value, dtype=local.dtype).item())


def _host_values(hps: dict) -> dict | None:
    """The values of 0-dim hyperparameters (tensors or numbers) as host numbers, or ``None`` if one is not a number.

    A tensor's value is known on the host when :func:`_remember` saw it; the ones it did not (loaded from a
    checkpoint, or written into the state) are read once, all in one transfer, and remembered: a resumed run
    waits for its device once, at its first step, and never again.
    """
    out, unknown = {}, {}
    for k, v in hps.items():
        if not isinstance(v, torch.Tensor):
            if not isinstance(v, numbers.Real):
                return None
            out[k] = v
            continue
        local = tree.local(v)
        entry = _HOST.get(id(local))
        try:
            fresh = entry is not None and entry[0]() is local and entry[1] == local._version
        except RuntimeError:
            fresh = False
        if fresh:
            out[k] = entry[2]
        else:
            unknown[k] = local
    if unknown:
        device = next(iter(unknown.values())).device
        values = torch.stack([x.detach().to(device, torch.float64) for x in unknown.values()]).tolist()
        for (k, x), value in zip(unknown.items(), values):
            if not x.is_floating_point():
                value = int(value)
            _remember(x, value)
            out[k] = value
    return out


def _scheduled(schedule: Callable, count: torch.Tensor, dtype: torch.dtype) -> Any:
    """``schedule(count)`` computed in ``dtype``, float32 at least (a float64 run keeps float64 values)."""
    return value_at(schedule, count, torch.promote_types(dtype, torch.float32))


def _float_dtype(params: Any, override: torch.dtype | None) -> torch.dtype:
    if override is not None:
        return override
    dtypes = [x.dtype for x in tree.leaves(params) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def _is_float(v: Any) -> bool:
    """Whether a numeric hyperparameter value is a floating (or complex) one, as opposed to an integer."""
    if isinstance(v, torch.Tensor):
        return v.is_floating_point() or v.is_complex()
    if isinstance(v, (np.ndarray, np.generic)):
        return not np.issubdtype(np.asarray(v).dtype, np.integer)
    return not isinstance(v, numbers.Integral)


# Annotations that admit a float: an integer given for such an argument becomes a float hyperparameter.
_FLOATING = frozenset({"float", "complex", "Scalar", "LearningRate", "ScalarOrSchedule", "Number", "numbers.Number",
                       "numbers.Real", "Any", "typing.Any"})


def _counts(param: inspect.Parameter, v: Any) -> bool:
    """Whether an integer value ``v`` of the factory argument ``param`` stays an integer: a Python or NumPy
    integer (not an integer tensor, kept as given) for an argument whose default is an int (not a bool) or
    whose annotation names ``int`` and no floating type (``int | torch.Generator | None``, a noise ``key``,
    counts: a float key was a TypeError at the first update)."""
    if isinstance(v, torch.Tensor):
        return True
    default = param.default
    if isinstance(default, numbers.Integral) and not isinstance(default, bool):
        return True
    note = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
    kinds = {t.strip() for t in note.split("|")} - {"None"}
    return "int" in kinds and not kinds & _FLOATING


def _checked(owner: str, what: str, v: Any, is_float: bool) -> Any:
    """``v`` if it can be a hyperparameter (``what`` names it): a number, or a 0-dim tensor (floating if
    ``is_float``).

    Under ``torch.func.vmap`` a batched hyperparameter is 0-dim inside the vmapped function, as it should.
    """
    if isinstance(v, (np.ndarray, np.generic)) and np.ndim(v) != 0:
        raise ValueError(f"{owner}: {what} must be a number or a 0-dim tensor, got an array of "
                         f"shape {np.shape(v)} (to batch it, vmap the update over the state with in_dims=0)")
    if not isinstance(v, torch.Tensor):
        return v
    if v.ndim != 0:
        raise ValueError(f"{owner}: {what} must be a number or a 0-dim tensor, got a tensor of "
                         f"shape {tuple(v.shape)} (to batch it, vmap the update over the state with in_dims=0)")
    if is_float and not (v.is_floating_point() or v.is_complex()):
        raise ValueError(f"{owner}: {what} must be floating-point (its value was), got a tensor of "
                         f"dtype {v.dtype}")
    return v


def _as_hparam(v: Any, dtype: torch.dtype, device: torch.device, is_float: bool = True,
               keep_tensor_dtype: bool = False) -> torch.Tensor:
    """A value as a 0-dim tensor on ``device``: floats in ``dtype``, ints in int32 (floats if ``is_float``).

    A tensor is never detached: one that requires grad (a hyperparameter being differentiated) stays in
    the graph, through a differentiable copy (the state owns its own buffer, as ``init`` must not alias
    the caller's tensor). A tensor given by the user keeps its dtype (``keep_tensor_dtype``, as Optax
    keeps a typed array).
    """
    if isinstance(v, torch.Tensor):
        cast = v.is_floating_point() and not keep_tensor_dtype
        return v.to(device=device, dtype=dtype if cast else v.dtype, copy=True)
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and not is_float:
        return torch.tensor(int(v), dtype=torch.int32, device=device)
    v = np.asarray(v)
    if np.issubdtype(v.dtype, np.integer) and not is_float:
        return torch.tensor(v.item(), dtype=torch.int32, device=device)
    return torch.tensor(float(v), dtype=dtype, device=device)
