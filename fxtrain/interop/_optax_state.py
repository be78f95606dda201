"""Optimizer states across frameworks: ``state_to_optax`` and ``state_from_optax``.

fxtrain's transforms keep Optax's state classes (same names, same fields, same nesting: a chain's state
is a tuple, a mask's inner state has ``MaskedNode`` where params are masked out), so converting a state
is a walk over two trees at once: the state to convert, and a freshly initialized state of the other
framework (``like``) that supplies the structure and the classes to build. Each node of ``like`` is
rebuilt with the matching node of the source; each array leaf is handed over through DLPack and takes
the dtype (and, into torch, the device) of the ``like`` leaf. Where the two trees do not line up the
error names the first path that differs (``1.inner_state.0.mu.w``), so a wrong ``like`` (another
optimizer, other params) is caught, never silently filled.

Nodes are matched by class name. Where the two libraries differ:

==================================  ==============================================================
fxtrain                             Optax
==================================  ==============================================================
``ClipByGlobalNormState(grad_norm)``  ``EmptyState()``; ``grad_norm`` is dropped, and comes back as zero
``InjectHyperparamsState``          ``InjectHyperparamsState`` or ``InjectStatefulHyperparamsState``
                                    (Optax >= 0.2.5); its ``hyperparams_states`` for plain schedules
                                    (``WrappedScheduleState(count)``) follow the outer ``count``
``AccumulateState(mini_step,        ``MultiStepsState(mini_step, gradient_step, inner_opt_state,
emitted, acc, inner_state)``        acc_grads, skip_state)``; ``acc`` is a running sum, ``acc_grads``
                                    a running mean (``use_grad_mean=True``, both defaults): converted
                                    as ``acc = acc_grads * mini_step``. At a window boundary
                                    (``mini_step == 0``) nothing is pending and the result is exact
                                    whatever the averaging.
==================================  ==============================================================

Transforms with no Optax counterpart (``amp_cast``'s loss scale) have no class to match and are
reported as a mismatch at their path.

Names. An Optax state keeps its params' names in every params-shaped tree (``mu``, ``nu``, ``trace``).
Those of a JAX program that trained a Flax module are Flax's (``{"Dense_0": {"kernel": ...}}``, kernels
``(in, out)``): ``state_from_optax(..., naming="linen", module=net)`` reads them into the torch names and
layouts of ``net`` (:func:`~fxtrain.interop.from_linen`). A state whose names share none with ``fx_like``'s is
refused naming both sides' names, not the transform.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch

from fxtrain import tree
from fxtrain._deferred import DTensor
from fxtrain.interop._arrays import dotted, owned, tensor_to_jax, to_torch
from fxtrain.interop._jax import is_jax_array, require
from fxtrain.interop._linen import from_linen, linen_names

__all__ = ["state_to_optax", "state_from_optax"]


def state_to_optax(fx_state: Any, optax_like: Any) -> Any:
    """An fxtrain optimizer state as the state of the matching Optax transform.

    Args:
      fx_state: the state of an fxtrain transform, e.g. ``fx.adamw(1e-3).init(params)`` after some steps.
        DTensor leaves contribute their full value (an all-gather, see :func:`to_jax`).
      optax_like: a state of the Optax counterpart, freshly initialized on the same params (converted
        with :func:`to_jax`): ``optax.adamw(1e-3).init(to_jax(params))``. Only its structure, classes
        and dtypes are used.

    Returns:
      A state with the classes of ``optax_like`` and the values of ``fx_state``, ready for
      ``optax_tx.update``. Its arrays share memory with ``fx_state`` (DLPack): a donated fxtrain step
      on ``fx_state`` afterwards would change them.

    Raises:
      ValueError: the trees differ; the message names the first path that does.

    Example:
        >>> import pytest; optax = pytest.importorskip("optax")
        >>> import torch, fxtrain as fx
        >>> from fxtrain.interop import state_to_optax, to_jax
        >>> params = {"w": torch.ones(3)}
        >>> tx, otx = fx.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9)
        >>> _, state = tx.update({"w": torch.ones(3)}, tx.init(params), params)
        >>> ostate = state_to_optax(state, otx.init(to_jax(params)))
        >>> type(ostate[0]).__module__.startswith("optax"), ostate[0].trace["w"].tolist()
        (True, [1.0, 1.0, 1.0])
    """
    require(what="fxtrain.interop.state_to_optax")
    return _Walk("state_to_optax", _leaf_to_jax).convert(fx_state, optax_like, ())


# naming= of state_from_optax -> linen_names' naming ("torch": the names fx_like has)
NAMINGS = {"torch": None, "linen": "compact", "compact": "compact", "attribute": "attribute", "nnx": "nnx"}


def state_from_optax(optax_state: Any, fx_like: Any, *, copy: bool = True, naming: str = "torch",
                     module: torch.nn.Module | None = None) -> Any:
    """An Optax optimizer state as the state of the matching fxtrain transform.

    Args:
      optax_state: the state of an Optax transform.
      fx_like: a state of the fxtrain counterpart freshly initialized on the same params, e.g.
        ``fx.adamw(1e-3).init(params)``; it gives the classes, dtypes and devices.
      naming: how ``optax_state`` names the params in its params-shaped trees (``mu``, ``nu``...):
        ``"torch"`` as ``fx_like`` does (the default); ``"linen"`` as a Flax linen ``@nn.compact`` module does
        (``Dense_0/kernel``, the state of ``optax_tx.init(variables["params"])``; ``"compact"`` is the same),
        ``"attribute"`` (a ``setup`` linen module) or ``"nnx"`` (:func:`~fxtrain.interop.linen_names`).
        Kernels come back in torch layouts.
      module: the torch module whose params ``fx_like`` was initialized on; needed by every ``naming`` but
        ``"torch"`` (its layers give the Flax names).
      copy: every tensor in memory torch owns (the default), so a donated step cannot write into the Optax
        state's arrays. ``False`` shares their memory where DLPack can (a donated step refuses those, see
        :mod:`fxtrain.interop._arrays`); two leaves that would share one buffer are copied even then, so an
        update never writes twice into one buffer.

    Returns:
      A state with the classes of ``fx_like`` and the values of ``optax_state``, ready for ``tx.update``
      or :func:`fxtrain.train_step`.

    Raises:
      ValueError: the trees differ; the message names the first path that does (where the names differ, the
        names each side has); or ``naming`` is unknown or lacks ``module``.

    Example:
        >>> import pytest; optax = pytest.importorskip("optax")
        >>> import torch, fxtrain as fx
        >>> from fxtrain.interop import state_from_optax, to_jax, to_linen
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> _, params, _ = fx.functional(net)
        >>> flax_params = to_linen(params, net)["params"]           # {"Dense_0": {"kernel": (3, 2), "bias"}}
        >>> ostate = optax.adam(0.1).init(flax_params)               # a linen-named state, as JAX keeps it
        >>> state = state_from_optax(ostate, fx.adam(0.1).init(params), naming="linen", module=net)
        >>> tuple(state[0].mu["0.weight"].shape)                     # torch's name and layout (out, in)
        (2, 3)
        >>> state_from_optax(ostate, fx.adam(0.1).init(params))
        Traceback (most recent call last):
        ...
        ValueError: state_from_optax: the names differ at '0.mu': the Optax state has ['Dense_0'], the fxtrain one ['0.bias', '0.weight']; a state of Flax params needs naming='linen' (or 'attribute', 'nnx') and module=, the torch module

    Without names to convert:

        >>> params = {"w": torch.ones(2)}
        >>> otx = optax.adam(0.1)
        >>> p = to_jax(params)
        >>> _, ostate = otx.update(p, otx.init(p), p)
        >>> state = state_from_optax(ostate, fx.adam(0.1).init(params))
        >>> type(state[0]).__name__, int(state[0].count), state[0].mu["w"].tolist()
        ('ScaleByAdamState', 1, [0.1..., 0.1...])
    """
    require(what="fxtrain.interop.state_from_optax")
    if naming not in NAMINGS:
        raise ValueError(f"state_from_optax: naming={naming!r}: expected one of {', '.join(map(repr, NAMINGS))}")
    if NAMINGS[naming] is not None and module is None:
        raise ValueError(f"state_from_optax: naming={naming!r} needs module=, the torch module whose params fx_like "
                         "was initialized on (its layers give the Flax names)")
    seen: set[int] = set()

    def leaf(src, like, where):
        t = _leaf_to_torch(src, like, where)
        t = owned(t) if copy else t
        ptr = t.data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        return t

    walk = _Walk("state_from_optax", leaf)
    if NAMINGS[naming] is not None:
        walk.rename = _FlaxNames(module, naming)
    return walk.convert(optax_state, fx_like, ())


class _FlaxNames:
    """A params-shaped tree of Flax names (``naming``) as ``module``'s torch names and layouts."""

    def __init__(self, module: torch.nn.Module, naming: str):
        self.module, self.naming = module, naming
        self.where = linen_names(module, naming=NAMINGS[naming])  # an unmapped layer fails here, by name
        self.keys = set(self.where)

    def __call__(self, src: Mapping, path: tuple) -> dict:
        try:
            return from_linen({"params": src}, self.module, naming=NAMINGS[self.naming], copy=False)
        except ValueError:
            expected = sorted({str(leaf.path[1]) for leaf in self.where.values()})
            raise ValueError(f"state_from_optax: naming={self.naming!r} does not fit the state at '{dotted(path)}': it "
                             f"has {_names(src)}, {type(self.module).__name__}'s {self.naming} names are "
                             f"{_names(expected)}; pass the naming the state was made with ('torch', 'linen', "
                             "'attribute' or 'nnx')") from None


# --- the walk ----------------------------------------------------------------------------------------

def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, np.generic)) or is_jax_array(x)


class _Walk:
    """Rebuilds ``like`` with the values of ``src``; ``leaf(src, like, where)`` converts one array."""

    rename: Callable[[Mapping, tuple], dict] | None = None  # Flax names -> torch names, at params-shaped trees

    def __init__(self, fn: str, leaf: Callable[[Any, Any, str], Any]):
        self.fn, self.leaf = fn, leaf

    def fail(self, path: tuple, what: str) -> None:
        raise ValueError(f"{self.fn}: the states differ at '{dotted(path)}': {what} (is the `like` state "
                         "from the counterpart transform, initialized on the same params?)")

    def convert(self, src: Any, like: Any, path: tuple) -> Any:
        if like is None or src is None:
            if like is not src:
                self.fail(path, f"{_kind(src)} vs {_kind(like)}")
            return None
        if _is_namedtuple(like):
            return self.node(src, like, path)
        if isinstance(like, Mapping):
            if not isinstance(src, Mapping):
                self.fail(path, f"{_kind(src)} vs {_kind(like)}")
            if self.rename is not None and set(like) == self.rename.keys:
                src = self.rename(src, path)
            if src and like and not set(src) & set(like):  # nothing in common: named otherwise, not another transform
                hint = ("; a state of Flax params needs naming='linen' (or 'attribute', 'nnx') and module=, the torch "
                        "module") if self.fn == "state_from_optax" and self.rename is None else ""
                optax_side, fx_side = (src, like) if self.fn == "state_from_optax" else (like, src)
                raise ValueError(f"{self.fn}: the names differ at '{dotted(path)}': the Optax state has "
                                 f"{_names(optax_side)}, the fxtrain one {_names(fx_side)}{hint}")
            missing = [k for k in like if k not in src] + [k for k in src if k not in like]
            if missing:
                self.fail(path + (missing[0],), f"key {missing[0]!r} is in one state only")
            return type(like)((k, self.convert(src[k], v, path + (k,))) for k, v in like.items())
        if isinstance(like, (list, tuple)):
            if not isinstance(src, (list, tuple)) or _is_namedtuple(src):
                self.fail(path, f"{_kind(src)} vs {_kind(like)}")
            if len(src) != len(like):
                self.fail(path, f"{len(src)} entries vs {len(like)}")
            return type(like)(self.convert(s, x, path + (i,)) for i, (s, x) in enumerate(zip(src, like)))
        if _is_array(like):
            if not _is_array(src):
                self.fail(path, f"{_kind(src)} vs an array")
            if tuple(src.shape) != tuple(like.shape):
                self.fail(path, f"shape {tuple(src.shape)} vs {tuple(like.shape)}")
            return self.leaf(src, like, dotted(path))
        return src if type(src) is type(like) else self.fail(path, f"{_kind(src)} vs {_kind(like)}")

    def node(self, src: Any, like: Any, path: tuple) -> Any:
        if not _is_namedtuple(src):
            self.fail(path, f"{_kind(src)} vs {_kind(like)}")
        pair = (type(src).__name__, type(like).__name__)
        special = _SPECIAL.get(pair)
        if special is not None:
            return special(self, src, like, path)
        if pair[0] != pair[1] and frozenset(pair) not in _SAME:
            self.fail(path, f"{pair[0]} vs {pair[1]}")
        if src._fields != like._fields:
            self.fail(path, f"{pair[0]} fields {src._fields} vs {like._fields}")
        return type(like)(*(self.convert(getattr(src, f), getattr(like, f), path + (f,)) for f in like._fields))


# --- where the libraries differ ------------------------------------------------------------------------

# Class names that are the same thing in the two libraries (same fields).
_SAME = {frozenset({"MultiTransformState", "PartitionState"})}


def _clip_to_empty(walk: _Walk, src: Any, like: Any, path: tuple) -> Any:
    return type(like)()  # Optax keeps no norm


def _empty_to_clip(walk: _Walk, src: Any, like: Any, path: tuple) -> Any:
    return type(like)(grad_norm=torch.zeros_like(like.grad_norm))


def _inject(walk: _Walk, src: Any, like: Any, path: tuple) -> Any:
    """fxtrain's InjectHyperparamsState <-> Optax's stateful one (extra ``hyperparams_states``).

    Optax wraps each plain schedule in a ``WrappedScheduleState(count)`` that counts updates as the outer
    ``count`` does; fxtrain's schedules read the outer count. Other stateful schedules have no
    counterpart.
    """
    for side in (src, like):
        for k, v in (getattr(side, "hyperparams_states", None) or {}).items():
            if type(v).__name__ != "WrappedScheduleState":
                walk.fail(path + ("hyperparams_states", k),
                          f"the stateful schedule state {type(v).__name__} has no fxtrain counterpart")
    fields = {f: walk.convert(getattr(src, f), getattr(like, f), path + (f,))
              for f in ("count", "hyperparams", "inner_state")}
    if "hyperparams_states" in like._fields:
        fields["hyperparams_states"] = type(like.hyperparams_states)(
            (k, v._replace(count=walk.convert(src.count, v.count, path + ("count",))))
            for k, v in like.hyperparams_states.items())
    return type(like)(**fields)


def _accumulate_to_multisteps(walk: _Walk, src: Any, like: Any, path: tuple) -> Any:
    mini_step = walk.convert(src.mini_step, like.mini_step, path + ("mini_step",))
    acc = walk.convert(src.acc, like.acc_grads, path + ("acc",))
    n = int(src.mini_step)
    jax = require()
    acc = jax.tree.map(lambda a: a / n if n else jax.numpy.zeros_like(a), acc)  # running sum -> mean
    return type(like)(
        mini_step=mini_step,
        gradient_step=walk.convert(src.emitted, like.gradient_step, path + ("emitted",)),
        inner_opt_state=walk.convert(src.inner_state, like.inner_opt_state, path + ("inner_state",)),
        acc_grads=acc,
        skip_state=like.skip_state,
    )


def _multisteps_to_accumulate(walk: _Walk, src: Any, like: Any, path: tuple) -> Any:
    if src.skip_state != () and src.skip_state is not None:
        walk.fail(path + ("skip_state",), "MultiSteps' should_skip_update_fn has no fxtrain counterpart")
    n = int(src.mini_step)
    acc = walk.convert(src.acc_grads, like.acc, path + ("acc_grads",))
    # running mean -> sum; new tensors: never write into the JAX buffers
    acc = tree.map(lambda a: a * n if n else torch.zeros_like(a), acc)
    return type(like)(
        mini_step=walk.convert(src.mini_step, like.mini_step, path + ("mini_step",)),
        emitted=walk.convert(src.gradient_step, like.emitted, path + ("gradient_step",)),
        acc=acc,
        inner_state=walk.convert(src.inner_opt_state, like.inner_state, path + ("inner_opt_state",)),
    )


_SPECIAL = {
    ("ClipByGlobalNormState", "EmptyState"): _clip_to_empty,
    ("EmptyState", "ClipByGlobalNormState"): _empty_to_clip,
    ("InjectHyperparamsState", "InjectStatefulHyperparamsState"): _inject,
    ("InjectStatefulHyperparamsState", "InjectHyperparamsState"): _inject,
    ("AccumulateState", "MultiStepsState"): _accumulate_to_multisteps,
    ("MultiStepsState", "AccumulateState"): _multisteps_to_accumulate,
}


# --- leaves ---------------------------------------------------------------------------------------------

def _leaf_to_jax(src: Any, like: Any, where: str) -> Any:
    jnp = require("jax.numpy")
    if isinstance(src, torch.Tensor):
        if isinstance(src, DTensor):  # its full value (see to_jax)
            src = src.full_tensor()
        out = tensor_to_jax(src, where=where)
    else:
        out = jnp.asarray(src)
    return out if out.dtype == like.dtype else out.astype(like.dtype)


def _names(keys: Any, most: int = 6) -> str:
    """``['Dense_0', 'Dense_1']``: the first ``most`` keys, sorted, as an error names them."""
    names = sorted(map(str, keys))
    return str(names[:most])[:-1] + (", ...]" if len(names) > most else "]")


def _leaf_to_torch(src: Any, like: Any, where: str) -> torch.Tensor:
    if not isinstance(like, torch.Tensor):
        raise ValueError(f"state_from_optax: at '{where}' the fxtrain state holds {_kind(like)}, not a tensor")
    if isinstance(like, DTensor):
        raise ValueError(f"state_from_optax: '{where}' is a DTensor in the fxtrain state; convert into a state "
                         "of plain tensors, then distribute it (fxtrain.sharded_apply keeps states local)")
    if not isinstance(src, torch.Tensor):  # a tensor already: a Flax-named tree read by from_linen
        src = to_torch(np.asarray(src) if not is_jax_array(src) else src, copy=False)
    return src.to(device=like.device, dtype=like.dtype)


def _kind(x: Any) -> str:
    if x is None:
        return "None"
    if _is_array(x):
        return f"an array of shape {tuple(x.shape)}"
    return type(x).__name__
