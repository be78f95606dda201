"""The runner's Orbax hooks (``python -m fxtrain.train``): ``resume=orbax:PATH`` and ``trainer.export=orbax``.

* ``resume=orbax:PATH`` starts a run from an Orbax checkpoint a JAX program wrote with
  ``ocp.StandardCheckpointer().save(PATH, {"params": p, "opt_state": s})``, or from the newest step of an
  ``ocp.CheckpointManager`` directory PATH (or its step directory ``PATH/<step>``) that saved that tree with
  ``ocp.args.StandardSave``: :func:`fxtrain.interop.load_orbax`
  reads the params into the run's model and ``s`` as the state of the run's stack, and training goes on
  from the checkpoint's step (its ``custom_metadata={"step": n}``, which ``trainer.export`` writes; else
  the update count its optimizer state keeps; else 0) to ``trainer.max_steps``. ``s`` is the state of the
  Optax counterpart of the run's ``stack`` line: for the default stack,
  ``optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=lambda n:
  3e-3 * schedule(n), b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4))`` (the runner injects every
  learning rate, times the ``schedule`` group's shape). The torch RNG starts from ``seed`` (a checkpoint of
  JAX arrays holds none).
* ``trainer.export=orbax`` writes ``<run dir>/orbax`` when training ends (:func:`fxtrain.interop.save_orbax`,
  from the run's last checkpoint): ``{"params", "opt_state"}`` that a JAX program restores with
  ``ocp.StandardCheckpointer().restore(path, {"params": p, "opt_state": optax_tx.init(p)})``, the step in
  its custom metadata; ``resume=orbax:<run dir>/orbax`` continues it in fxtrain as the run would have gone on.

Both name the params as ``trainer.orbax_naming`` says: ``compact`` (Flax linen's ``Dense_0/kernel``, the
kernel transposed: :func:`fxtrain.interop.to_linen`), ``attribute``, ``nnx``, or ``torch`` (the model's
``named_parameters()`` names and layouts). They run in one process, on models without buffers (an Orbax
``{params, opt_state}`` checkpoint has no place for BatchNorm statistics); anything else is refused in one
line before training, as is a checkpoint whose tree does not fit the run (naming the first path that
differs).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import pathlib
from typing import Any

import torch
from torch import nn

from fxtrain import checkpoint, tree
from fxtrain._base import GradientTransformation
from fxtrain.errors import ConfigError
from fxtrain.interop._linen import linen_names
from fxtrain.interop._orbax import load_orbax, orbax_dir, orbax_step, save_orbax

__all__ = ["ORBAX", "NAMINGS", "EXPORT_DIR", "orbax_path", "check_settings", "start", "export"]

log = logging.getLogger("fxtrain")
ORBAX = "orbax:"  # resume=orbax:PATH
NAMINGS = ("compact", "attribute", "nnx", "torch")  # trainer.orbax_naming
EXPORT_DIR = "orbax"  # trainer.export=orbax writes <run dir>/orbax


def orbax_path(resume: Any) -> pathlib.Path | None:
    """The checkpoint ``resume=orbax:PATH`` names, or ``None`` for any other ``resume``.

    >>> orbax_path("orbax:/tmp/jax_run/ckpt"), orbax_path("auto")
    (PosixPath('/tmp/jax_run/ckpt'), None)
    """
    if not (isinstance(resume, str) and resume.startswith(ORBAX)):
        return None
    return pathlib.Path(resume[len(ORBAX):])


def check_settings(cfg: Any) -> None:
    """Refuses, in one line naming the key, a bad ``trainer.export``, ``trainer.orbax_naming`` or
    ``resume=orbax:PATH`` (no path, not an Orbax checkpoint, orbax-checkpoint not installed).

    Raises:
      fxtrain.errors.ConfigError: the first bad setting.
    """
    trainer = cfg.get("trainer") or {}
    naming, exported = trainer.get("orbax_naming", "compact"), trainer.get("export")
    if naming not in NAMINGS:
        raise ConfigError(f"trainer.orbax_naming={naming}: expected compact (Flax linen's names, Dense_0/kernel), "
                          "attribute, nnx, or torch (the model's named_parameters names)")
    if exported not in (None, "orbax"):
        raise ConfigError(f"trainer.export={exported}: expected orbax (write <run dir>/{EXPORT_DIR} at the end: params "
                          "and optimizer state a JAX program restores) or null")
    resume = cfg.get("resume")
    path = orbax_path(resume)
    if exported is None and path is None:
        return
    who = f"resume={resume}" if path is not None else "trainer.export=orbax"
    if importlib.util.find_spec("orbax") is None or importlib.util.find_spec("orbax.checkpoint") is None:
        raise ConfigError(f"{who}: needs orbax-checkpoint, which is not installed: pip install 'fxtrain[jax]'")
    if path is None:
        return
    if resume == ORBAX or not resume[len(ORBAX):].strip():
        raise ConfigError(f"resume={resume}: expected orbax:PATH, the directory of an Orbax checkpoint "
                          "(resume=orbax:/path/to/ckpt)")
    if not path.is_dir():
        raise ConfigError(f"resume={resume}: {path} is not a directory; expected the one "
                          "ocp.StandardCheckpointer().save(path, {'params': ..., 'opt_state': ...}) wrote")
    try:
        orbax_dir(path, who=f"resume={resume}")
    except ValueError as e:
        raise ConfigError(f"{e} (an fxtrain run's checkpoint: resume=PATH)") from None


def start(cfg: Any, model: nn.Module, params: Any, buffers: Any, tx: GradientTransformation,
          world: int) -> tuple[int, Any, str] | None:
    """Before training: checks that ``resume=orbax:PATH`` and ``trainer.export=orbax`` can run here and, for
    ``resume=orbax:PATH``, loads the checkpoint into ``params`` (in place: the model's own tensors) and
    returns ``(step, opt_state, how)`` (``how`` for the run's start line); ``None`` without ``resume=orbax``.

    Raises:
      fxtrain.errors.ConfigError: several ranks, a model with buffers, params ``trainer.orbax_naming`` does
        not name, or a checkpoint that does not fit the run (the first path that differs), at or past
        ``trainer.max_steps``.
    """
    path = orbax_path(cfg.get("resume"))
    if path is None and cfg.trainer.get("export") != "orbax":
        return None
    who = f"resume={cfg.resume}" if path is not None else "trainer.export=orbax"
    if world > 1:
        raise ConfigError(f"{who}: runs in one process, this launch has {world} ranks; run it in one process and "
                          "go on from its checkpoint with resume=PATH resume_relayout=true")
    held = tree.paths(buffers)
    if held:
        raise ConfigError(f"{who}: {type(model).__name__} has buffers ({', '.join(map(str, held[:3]))}"
                          f"{', ...' if len(held) > 3 else ''}), which an Orbax {{params, opt_state}} checkpoint "
                          "does not hold; use the run's own checkpoints (resume=PATH) for this model")
    naming = cfg.trainer.get("orbax_naming", "compact")
    module = None if naming == "torch" else model
    if module is not None:
        try:
            linen_names(module, naming=naming)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"trainer.orbax_naming={naming}: {_line(e)}; trainer.orbax_naming=torch names the "
                              "params as the model's named_parameters do") from None
    if path is None:
        return None
    try:
        with _quiet():
            loaded, opt_state = load_orbax(path, params, tx, module=module, naming=naming)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{who}: {_line(e)}; it must hold this run's model (trainer.orbax_naming={naming} names) "
                          "and the state of the Optax counterpart of the stack this run prints (see "
                          "fxtrain/run_hooks.py), or change model, optim or trainer.orbax_naming to "
                          "match it") from None
    step, source = orbax_step(path), "recorded"
    if step is None:
        counts = _counts(opt_state)
        step, source = (max(counts), "its optimizer's update count") if counts else (0, "none recorded")
    if step >= cfg.trainer.max_steps:
        raise ConfigError(f"{who}: the checkpoint is at step {step} ({source}), trainer.max_steps="
                          f"{cfg.trainer.max_steps} leaves nothing to train; raise trainer.max_steps")
    with torch.no_grad():
        tree.copy_(tree.leaves(params), tree.leaves(loaded))
    return step, opt_state, f"from the Orbax checkpoint {path} (step {step}, {source})"


def export(cfg: Any, out: pathlib.Path | None, ckpt_dir: pathlib.Path | None, model: nn.Module, params: Any,
           opt_state: Any, buffers: Any, tx: GradientTransformation) -> pathlib.Path | None:
    """With ``trainer.export=orbax``, writes ``out/orbax`` from the run's last checkpoint in ``ckpt_dir``
    (``params``, ``opt_state``, ``buffers``: trees of its structure) and returns it; else ``None``."""
    if cfg.trainer.get("export") != "orbax" or out is None or ckpt_dir is None:
        return None
    last = checkpoint.latest(ckpt_dir)
    state = checkpoint.load(last, like=checkpoint.TrainState(0, params, opt_state, checkpoint.rng_state(), buffers))
    naming = cfg.trainer.get("orbax_naming", "compact")
    target = out / EXPORT_DIR
    # The runner injects every learning rate as a schedule (fxtrain.build.stack): Optax keeps its count.
    schedules = ("learning_rate",) if cfg.get("schedule") is not None else ()
    with _quiet():
        save_orbax(target, state.params, state.opt_state, tx, step=state.step,
                   module=None if naming == "torch" else model, naming=naming, schedules=schedules, force=True)
    log.info(f"export {target} (Orbax, step {state.step}, {naming} names)")
    return target


@contextlib.contextmanager
def _quiet():
    """Orbax's progress lines (absl INFO) kept out of the run's log, which shows INFO."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        absl.setLevel(level)


def _counts(state: Any) -> list[int]:
    """The update counts an optimizer state keeps (``ScaleByAdamState.count``...)."""
    found = []
    if isinstance(state, tuple) and hasattr(type(state), "_fields"):
        count = getattr(state, "count", None)
        if isinstance(count, torch.Tensor) and count.ndim == 0:
            found.append(int(count))
    if isinstance(state, (tuple, list)):
        for x in state:
            found += _counts(x)
    return found


def _line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0].strip("'\"")
