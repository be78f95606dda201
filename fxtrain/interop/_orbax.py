"""Orbax checkpoints across frameworks: ``save_orbax`` and ``load_orbax``.

A JAX program keeps ``{"params": params, "opt_state": opt_state}`` and saves it with
``orbax.checkpoint.StandardCheckpointer``. On disk the tree has no classes: Orbax stores leaves by their
key path (``opt_state.1.0.mu.Dense_0.kernel``): a namedtuple's fields by name, a tuple's entries by
index, and a namedtuple with no fields (Optax's ``EmptyState``, ``MaskedNode``) as nothing at all. So
what crosses is the path of each array, and the two sides agree where fxtrain's state has Optax's field
names and nesting (it does: see :mod:`fxtrain.interop._optax_state`). Where they differ:
``ClipByGlobalNormState(grad_norm)`` is written as Optax's empty state (the norm comes back as zero);
``inject_hyperparams``' state is Optax's ``InjectStatefulHyperparamsState``, whose ``hyperparams_states``
holds a ``WrappedScheduleState(count)`` per hyperparameter given as a schedule: :func:`save_orbax` writes
them for the names in ``schedules`` (each counts the updates, as the outer ``count`` does) and
:func:`load_orbax` reads them back as that count. ``MultiSteps``, whose state has other fields, needs
the Optax state itself: pass ``optax_like`` to :func:`save_orbax`.

Params. Without ``module`` the params tree is written (and read) as it is. With ``module``, the params and
every params-shaped tree of the optimizer state (``mu``, ``nu``...) take the Flax names and layouts of
:func:`~fxtrain.interop.to_linen` (``naming="compact"`` or ``"attribute"``: the ``params`` collection of
a linen module) or of NNX (``naming="nnx"``: ``nnx.state(model, nnx.Param)`` as a pure dict).

Layouts. ``path`` is what ``StandardCheckpointer().save(path, tree)`` wrote (a directory holding ``_METADATA``),
an ``ocp.CheckpointManager`` directory (``<path>/<step>/default``, what ``manager.save(step,
args=ocp.args.StandardSave(tree))`` writes; ``step=`` picks one, the newest by default), or one of its step
directories (``<path>/<step>``). Anything else is refused in one line naming the path (:func:`orbax_dir`).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from fxtrain._base import EmptyState
from fxtrain.interop._arrays import array_to_torch, tensor_to_jax
from fxtrain.interop._jax import is_jax_array, require
from fxtrain.interop._linen import from_linen, linen_names, to_linen
from fxtrain.interop._optax_state import state_to_optax

__all__ = ["save_orbax", "load_orbax", "orbax_step", "orbax_dir"]  # orbax_step, orbax_dir: for fxtrain/run_hooks.py

ITEM = "default"  # the item a CheckpointManager saving one StandardSave tree names: <dir>/<step>/default


class InjectStatefulHyperparamsState(NamedTuple):
    """Optax's state of ``inject_hyperparams`` (>= 0.2.5), as :func:`save_orbax` writes it."""

    count: Any
    hyperparams: Any
    hyperparams_states: Any
    inner_state: Any


class WrappedScheduleState(NamedTuple):
    """Optax's state of a plain schedule inside ``inject_hyperparams``: the updates it has counted."""

    count: Any


def _ocp():
    require(what="fxtrain.interop (Orbax checkpoints)")
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - orbax-checkpoint comes with the jax extra
        raise ImportError("fxtrain.interop's Orbax functions need orbax-checkpoint: "
                          "pip install 'fxtrain[jax]'") from e
    return ocp


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _where(path: tuple) -> str:
    return ".".join(map(str, path)) or "<root>"


class _Names:
    """The params' names: torch ``{name: tensor}`` <-> Flax nested trees (or nothing without a module)."""

    def __init__(self, params: Mapping, module: nn.Module | None, naming: str):
        self.module, self.naming = module, naming
        self.keys = set(params) if module is not None else None
        if module is not None:
            linen_names(module, naming=naming)  # an unknown naming or an unmapped layer fails here, by name

    def is_params(self, node: Any) -> bool:
        return self.keys is not None and isinstance(node, Mapping) and set(node) == self.keys

    def to_flax(self, node: Mapping) -> dict:
        return to_linen(dict(node), self.module, naming=self.naming, as_jax=False)["params"]

    def from_flax(self, node: Any) -> dict:
        if self.naming == "nnx":  # Orbax gives NNX's int keys (list entries) back as strings
            node = _int_keys(node)
        return from_linen({"params": node}, self.module, naming=self.naming)


def _int_keys(node: Any) -> Any:
    if not isinstance(node, Mapping):
        return node
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in node.items()}


def save_orbax(path: str | os.PathLike, params: Any, opt_state: Any, tx: Any, step: int | None = None, *,
               module: nn.Module | None = None, naming: str = "compact", optax_like: Any = None,
               schedules: tuple[str, ...] = (), force: bool = False, manager: bool = False) -> None:
    """Writes params and an fxtrain optimizer state as an Orbax checkpoint a JAX program restores.

    The checkpoint is ``{"params": ..., "opt_state": ...}`` saved by ``ocp.StandardCheckpointer``: a JAX
    program restores it with ``ocp.StandardCheckpointer().restore(path, {"params": p, "opt_state":
    optax_tx.init(p)})`` where ``optax_tx`` is the Optax counterpart of ``tx`` (``optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(1e-3))`` for ``fx.chain(fx.clip_by_global_norm(1.0),
    fx.adamw(1e-3))``).

    Into a ``CheckpointManager`` directory (an existing one, or a new one with ``manager=True``) it writes step
    ``step`` as ``manager.save(step, args=ocp.args.StandardSave(tree))`` does (``<path>/<step>/default``), keeping
    the other steps: ``ocp.CheckpointManager(path).restore(step, args=ocp.args.StandardRestore(target))``
    restores it.

    Args:
      path: the checkpoint directory (made absolute; it must not exist unless ``force``), or a
        ``CheckpointManager`` directory.
      params: the params tree (``fx.functional``'s params, or any tree of tensors).
      opt_state: ``tx``'s state on ``params``.
      tx: the fxtrain transform; its ``init(params)`` must have ``opt_state``'s structure (checked).
      step: stored in the checkpoint's custom metadata (``{"step": step}``); in a ``CheckpointManager``
        directory, the step to write (needed).
      module: with it, the params and the state's params trees get Flax names and layouts (``naming``:
        ``"compact"``, ``"attribute"`` or ``"nnx"``; see the module docstring).
      optax_like: the Optax state ``optax_tx.init(...)`` on the saved params (JAX arrays, Flax names with
        ``module``): the state is then written with its classes (:func:`~fxtrain.interop.state_to_optax`),
        which the transforms whose Optax state has other fields need.
      schedules: the hyperparameters of ``inject_hyperparams`` that were given as schedules
        (``("learning_rate",)`` for ``inject_hyperparams(adamw)(learning_rate=schedule)``): written with
        Optax's ``hyperparams_states``, so that the Optax counterpart's ``init`` is the restore target.
      force: overwrite an existing checkpoint (in a ``CheckpointManager`` directory: that step).
      manager: write ``path`` as a ``CheckpointManager`` directory even if it does not exist yet.

    Raises:
      ValueError: ``opt_state`` is not a state of ``tx`` on ``params`` (the first path that differs is
        named), a params name does not fit ``module``, or ``path`` is taken (a checkpoint without ``force``,
        a directory that is no Orbax checkpoint) or is a ``CheckpointManager`` directory and ``step`` is missing,
        in one line naming it, before anything is written.

    Example:
        >>> import pytest; _ = pytest.importorskip("orbax.checkpoint")
        >>> import tempfile, os, torch, fxtrain as fx
        >>> from fxtrain.interop import save_orbax
        >>> params, tx = {"w": torch.ones(3)}, fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-3))
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> save_orbax(path, params, tx.init(params), tx, step=0)
        >>> sorted(os.listdir(path))[:2]
        ['_CHECKPOINT_METADATA', '_METADATA']
    """
    ocp = _ocp()
    target = pathlib.Path(os.path.abspath(os.fspath(path)))
    manager = manager or (target.is_dir() and not _is_item(target) and bool(_steps(target)))
    _check_target(path, target, step, force, manager)
    names = _Names(params, module, naming)
    _check(opt_state, tx.init(params), ())
    state = _fx_to_saved(opt_state, names, tuple(schedules))
    flax_params = names.to_flax(params) if module is not None else params
    state = state_to_optax(state, optax_like) if optax_like is not None else _tree_to_jax(state)
    saved = {"params": _tree_to_jax(flax_params), "opt_state": state}
    metadata = None if step is None else {"step": int(step)}
    if manager:
        with ocp.CheckpointManager(target) as checkpoints:
            if int(step) in checkpoints.all_steps():
                checkpoints.delete(int(step))  # force (checked above)
            # force: the manager's own policy (save intervals, steps after the latest) does not pick here, the caller does
            checkpoints.save(int(step), args=ocp.args.StandardSave(saved), custom_metadata=metadata, force=True)
            checkpoints.wait_until_finished()
        return
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(target, saved, force=force, custom_metadata=metadata)
    checkpointer.wait_until_finished()


def _check_target(path: Any, target: pathlib.Path, step: int | None, force: bool, manager: bool) -> None:
    """Refuses, before anything is written, a ``save_orbax`` destination that is taken or not understood."""
    if manager:
        if step is None:
            raise ValueError(f"save_orbax: '{path}' is a CheckpointManager directory: pass step= (the step to write)")
        if target.exists() and (not target.is_dir() or _is_item(target)):
            raise ValueError(f"save_orbax: '{path}' is not a CheckpointManager directory (it is "
                             f"{'one checkpoint' if target.is_dir() else 'a file'}); expected a new path or a directory "
                             "of step directories (<dir>/<step>/default)")
        if not force and int(step) in _steps(target):
            raise ValueError(f"save_orbax: '{path}' already holds step {step}; pass force=True to replace it")
    elif target.exists():
        if not (target.is_dir() and _is_item(target)):
            raise ValueError(f"save_orbax: '{path}' exists and is not an Orbax checkpoint; expected a new path, a "
                             "checkpoint to replace (force=True) or a CheckpointManager directory (manager=True)")
        if not force:
            raise ValueError(f"save_orbax: '{path}' already holds a checkpoint; pass force=True to replace it")


def load_orbax(path: str | os.PathLike, params: Any, tx: Any, *, step: int | None = None,
               module: nn.Module | None = None, naming: str = "compact") -> tuple[Any, Any]:
    """Reads an Orbax checkpoint a JAX program wrote as params and an fxtrain optimizer state.

    The checkpoint is what ``ocp.StandardCheckpointer().save(path, {"params": p, "opt_state": s})`` writes,
    ``s`` the state of the Optax counterpart of ``tx`` (see :func:`save_orbax`).

    Args:
      path: the checkpoint directory, a ``CheckpointManager`` directory or one of its step directories
        (:func:`orbax_dir`).
      params: a tree of torch tensors with the params' structure (``fx.functional``'s params): it gives
        the names, dtypes and devices; its values are not read.
      tx: the fxtrain transform whose state to build (``tx.init(params)`` gives the classes).
      step: in a ``CheckpointManager`` directory, the step to read (the newest by default).
      module: the checkpoint's params have Flax names and layouts (``naming`` as in :func:`save_orbax`).

    Returns:
      ``(params, opt_state)``: new tensors (copies of the restored arrays) in ``params``' structure, and
      ``tx``'s state, ready for :func:`fxtrain.train_step`.

    Raises:
      ValueError: ``path`` is no Orbax checkpoint, or has no step ``step`` (:func:`orbax_dir`), or the checkpoint's
        tree does not fit (the first path that differs is named).

    Example:
        >>> import pytest; _ = pytest.importorskip("orbax.checkpoint")
        >>> import tempfile, os, torch, fxtrain as fx
        >>> from fxtrain.interop import load_orbax, save_orbax
        >>> params, tx = {"w": torch.ones(3)}, fx.adam(0.1)
        >>> _, state = tx.update({"w": torch.ones(3)}, tx.init(params), params)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> save_orbax(path, params, state, tx)
        >>> p, s = load_orbax(path, {"w": torch.zeros(3)}, tx)
        >>> p["w"].tolist(), int(s[0].count)
        ([1.0, 1.0, 1.0], 1)
    """
    ocp = _ocp()
    where, _ = orbax_dir(path, step, who="load_orbax")
    raw = ocp.StandardCheckpointer().restore(where)
    if not isinstance(raw, Mapping) or set(raw) != {"params", "opt_state"}:
        found = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
        raise ValueError(f"load_orbax: '{path}' holds {found}, expected the keys ['opt_state', 'params']")
    names = _Names(params, module, naming)
    saved_params = names.from_flax(raw["params"]) if module is not None else raw["params"]
    new_params = _from_saved(saved_params, params, ("params",), names)
    opt_state = _from_saved(raw["opt_state"], tx.init(params), ("opt_state",), names)
    return new_params, opt_state



def orbax_step(path: str | os.PathLike, step: int | None = None) -> int | None:
    """The step an Orbax checkpoint records (``custom_metadata={"step": n}``, as :func:`save_orbax` writes it),
    or ``None`` when it records none. In a ``CheckpointManager`` directory: the step directory's number
    (``step``, else the newest).

    Example:
        >>> import pytest; _ = pytest.importorskip("orbax.checkpoint")
        >>> import tempfile, os, torch, fxtrain as fx
        >>> from fxtrain.interop import save_orbax
        >>> from fxtrain.interop._orbax import orbax_step
        >>> params, tx = {"w": torch.ones(3)}, fx.sgd(0.1)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> save_orbax(path, params, tx.init(params), tx, step=50)
        >>> orbax_step(path)
        50
    """
    where, numbered = orbax_dir(path, step, who="orbax_step")
    if numbered is not None:
        return numbered
    metadata = _ocp().StandardCheckpointer().metadata(where)
    recorded = (getattr(metadata, "custom_metadata", None) or {}).get("step")
    return None if recorded is None else int(recorded)


def orbax_dir(path: str | os.PathLike, step: int | None = None, *,
              who: str = "load_orbax") -> tuple[pathlib.Path, int | None]:
    """The directory ``ocp.StandardCheckpointer().restore`` reads for ``path``, and its step number where it
    is a step of a ``CheckpointManager`` (else ``None``).

    ``path`` is what ``StandardCheckpointer().save`` wrote (it holds ``_METADATA``), a ``CheckpointManager``
    directory (step ``step``, the newest by default) or one of its step directories, whose item is ``default``
    (what a manager saving one tree names it) or its only one.

    Raises:
      ValueError: in one line naming ``path`` and what was expected: it does not exist or is none of these,
        the manager has no step ``step`` (its steps are named), a step holds several items and none is
        ``default``, or ``step`` is given for a path that is not a manager's.

    Example:
        >>> import pytest; _ = pytest.importorskip("orbax.checkpoint")
        >>> import tempfile, os, torch, fxtrain as fx
        >>> from fxtrain.interop import save_orbax
        >>> from fxtrain.interop._orbax import orbax_dir
        >>> params, tx, root = {"w": torch.ones(3)}, fx.sgd(0.1), tempfile.mkdtemp()
        >>> for n in (10, 20):
        ...     save_orbax(os.path.join(root, "run"), params, tx.init(params), tx, step=n, manager=True)
        >>> where, step = orbax_dir(os.path.join(root, "run"))
        >>> os.path.relpath(where, root), step
        ('run/20/default', 20)
        >>> orbax_dir(os.path.join(root, "run"), step=15)
        Traceback (most recent call last):
        ...
        ValueError: load_orbax: '.../run' has no step 15 (its steps: 10, 20); pass one of them, or none for the newest
    """
    target = pathlib.Path(os.path.abspath(os.fspath(path)))
    expected = ("expected an Orbax checkpoint: what StandardCheckpointer().save wrote (a directory holding _METADATA), "
                "a CheckpointManager directory (<dir>/<step>/default) or one of its step directories")
    if not target.is_dir():
        raise ValueError(f"{who}: '{path}' {'is not a directory' if target.exists() else 'does not exist'}; {expected}")
    if _is_item(target):
        if step is not None:
            raise ValueError(f"{who}: '{path}' is one checkpoint, not a CheckpointManager directory: step={step} "
                             "picks nothing there; drop step, or pass the manager's directory")
        return target, None
    number = _step_number(target.name)
    if number is not None and _items(target):  # a step directory
        if step is not None and step != number:
            raise ValueError(f"{who}: '{path}' is the step directory of step {number}, step={step} asks for another; "
                             "pass the manager's directory with step, or drop step")
        return _item(path, target, who), number
    steps = _steps(target)
    if not steps:
        held = sorted(p.name for p in target.iterdir())
        raise ValueError(f"{who}: '{path}' is not an Orbax checkpoint (it holds "
                         f"{', '.join(held[:5]) + (', ...' if len(held) > 5 else '') if held else 'nothing'}); {expected}")
    if step is None:
        step = max(steps)
    elif step not in steps:
        raise ValueError(f"{who}: '{path}' has no step {step} (its steps: {', '.join(map(str, sorted(steps)))}); "
                         "pass one of them, or none for the newest")
    return _item(path, steps[step], who), step


def _is_item(directory: pathlib.Path) -> bool:
    """What ``StandardCheckpointer().save`` wrote (a manager's ``<step>/default`` too)."""
    return (directory / "_METADATA").is_file()


def _items(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in directory.iterdir() if p.is_dir() and _is_item(p))


def _step_number(name: str) -> int | None:
    try:
        return _ocp().utils.step_from_checkpoint_name(name)
    except ValueError:
        return None


def _steps(directory: pathlib.Path) -> dict[int, pathlib.Path]:
    """A ``CheckpointManager`` directory's finalized steps (none for any other directory)."""
    if not directory.is_dir():
        return {}
    found = {_step_number(p.name): p for p in _ocp().utils.checkpoint_steps_paths(directory)}
    return {n: p for n, p in found.items() if n is not None and _items(p)}


def _item(path: Any, step_dir: pathlib.Path, who: str) -> pathlib.Path:
    """A step's item: ``default`` (a manager saving one tree), or its only one."""
    items = _items(step_dir)
    if (step_dir / ITEM) in items:
        return step_dir / ITEM
    if len(items) == 1:
        return items[0]
    raise ValueError(f"{who}: '{path}' holds the items {', '.join(p.name for p in items)} in step directory "
                     f"'{step_dir.name}' and none is named {ITEM}; pass the item's directory "
                     f"('{step_dir / items[0].name}')")

# --- fxtrain -> the saved tree ------------------------------------------------------------------------

def _check(state: Any, like: Any, path: tuple) -> None:
    """``state`` has ``like``'s structure (classes, keys, lengths, shapes)."""
    if _is_namedtuple(like) or isinstance(like, (tuple, list)):
        if type(state) is not type(like) or len(state) != len(like):
            raise ValueError(f"save_orbax: opt_state at '{_where(path)}' is {type(state).__name__}, tx.init(params) "
                             f"gives {type(like).__name__}: is opt_state a state of tx on these params?")
        keys = like._fields if _is_namedtuple(like) else range(len(like))
        for k, s, x in zip(keys, state, like):
            _check(s, x, path + (k,))
    elif isinstance(like, Mapping):
        if not isinstance(state, Mapping) or set(state) != set(like):
            raise ValueError(f"save_orbax: opt_state at '{_where(path)}' has other keys than tx.init(params): "
                             "is opt_state a state of tx on these params?")
        for k in like:
            _check(state[k], like[k], path + (k,))
    elif isinstance(like, torch.Tensor) and tuple(state.shape) != tuple(like.shape):
        raise ValueError(f"save_orbax: opt_state at '{_where(path)}' has the shape {tuple(state.shape)}, "
                         f"tx.init(params) gives {tuple(like.shape)}")


def _fx_to_saved(node: Any, names: _Names, schedules: tuple[str, ...]) -> Any:
    def walk(x: Any) -> Any:
        return _fx_to_saved(x, names, schedules)

    if names.is_params(node):
        return names.to_flax(node)
    if _is_namedtuple(node):
        if type(node).__name__ == "ClipByGlobalNormState":
            return EmptyState()  # Optax's clip_by_global_norm keeps no state
        if type(node).__name__ == "InjectHyperparamsState":
            wrapped = {k: WrappedScheduleState(node.count) for k in schedules if k in node.hyperparams}
            return InjectStatefulHyperparamsState(node.count, walk(node.hyperparams), wrapped, walk(node.inner_state))
        return type(node)(*(walk(x) for x in node))
    if isinstance(node, (tuple, list)):
        return type(node)(walk(x) for x in node)
    if isinstance(node, Mapping):
        return {k: walk(v) for k, v in node.items()}
    return node


def _tree_to_jax(node: Any) -> Any:
    jnp = require("jax.numpy")
    if isinstance(node, torch.Tensor):
        return tensor_to_jax(node.detach().contiguous().clone(), where="save_orbax")
    if _is_namedtuple(node):
        return node if not node._fields else type(node)(*(_tree_to_jax(x) for x in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_tree_to_jax(x) for x in node)
    if isinstance(node, Mapping):
        return {k: _tree_to_jax(v) for k, v in node.items()}
    if isinstance(node, (np.ndarray, np.generic, int, float)):
        return jnp.asarray(node)
    return node


# --- the restored tree -> fxtrain ---------------------------------------------------------------------

def _from_saved(src: Any, like: Any, path: tuple, names: _Names) -> Any:
    """Rebuilds ``like`` (an fxtrain tree) from Orbax's restored tree: dicts for namedtuples, lists for
    tuples, ``None`` for empty namedtuples."""
    def fail(what: str):
        raise ValueError(f"load_orbax: the checkpoint differs at '{_where(path)}': {what} (is it the state of "
                         "the Optax counterpart of tx, on params of this structure?)")

    if names.is_params(like) and path[0] == "opt_state":
        src = names.from_flax(src)
    if _is_namedtuple(like):
        if type(like).__name__ == "ClipByGlobalNormState" and src is None:
            return type(like)(grad_norm=torch.zeros_like(like.grad_norm))
        if not like._fields:
            return like if src is None or src == {} or src == [] else fail(f"{_kind(src)} where nothing is kept")
        if not isinstance(src, Mapping):
            fail(f"{_kind(src)} where {type(like).__name__}'s fields are")
        if type(like).__name__ == "InjectHyperparamsState" and "hyperparams_states" in src:
            src = _drop_schedule_states(src, path)
        if set(src) != set(like._fields):
            fail(f"fields {sorted(src)}, {type(like).__name__} has {sorted(like._fields)}")
        return type(like)(*(_from_saved(src[f], getattr(like, f), path + (f,), names) for f in like._fields))
    if isinstance(like, (tuple, list)):
        if not isinstance(src, (tuple, list)) or len(src) != len(like):
            fail(f"{_kind(src)} where {len(like)} entries are")
        return type(like)(_from_saved(s, x, path + (i,), names) for i, (s, x) in enumerate(zip(src, like)))
    if isinstance(like, Mapping):
        if not isinstance(src, Mapping) or set(src) != set(like):
            other = sorted(set(src) ^ set(like), key=str) if isinstance(src, Mapping) else None
            fail(f"key {other[0]!r} is in one tree only" if other else f"{_kind(src)} where a dict is")
        return type(like)((k, _from_saved(src[k], v, path + (k,), names)) for k, v in like.items())
    if isinstance(like, torch.Tensor):
        if src is None or not hasattr(src, "shape"):
            fail(f"{_kind(src)} where an array is")
        if tuple(src.shape) != tuple(like.shape):
            fail(f"shape {tuple(src.shape)}, expected {tuple(like.shape)}")
        if isinstance(src, torch.Tensor):  # a params tree, through from_linen
            t = src
        else:
            t = array_to_torch(src) if is_jax_array(src) else torch.as_tensor(np.array(src))
        return t.to(device=like.device, dtype=like.dtype, copy=True)
    return src if like is None or type(src) is type(like) else fail(f"{_kind(src)} vs {_kind(like)}")


def _drop_schedule_states(src: Mapping, path: tuple) -> dict:
    """Optax's ``InjectStatefulHyperparamsState`` as fxtrain's: each ``WrappedScheduleState`` counts the updates,
    as the outer ``count`` does (fxtrain evaluates its schedules at that count)."""
    for name, state in (src["hyperparams_states"] or {}).items():
        if not (isinstance(state, Mapping) and set(state) == {"count"}):
            raise ValueError(f"load_orbax: the checkpoint differs at '{_where(path + ('hyperparams_states', name))}': "
                             f"{_kind(state)} where a WrappedScheduleState(count) is (a stateful schedule fxtrain "
                             "has no counterpart for)")
    return {k: v for k, v in src.items() if k != "hyperparams_states"}


def _kind(x: Any) -> str:
    if x is None:
        return "nothing"
    if hasattr(x, "shape"):
        return f"an array of shape {tuple(x.shape)}"
    return type(x).__name__
