"""Choosing by validation, testing once: the best step of a run and the test split's evaluation at its end.

A run evaluates its **validation** split (``data.val``; ``val_loss``, ``val_<metric>``) every
``trainer.eval_every`` steps; early stopping, ``optimized_metric`` and every sweeper read those. :class:`Best`
follows ``trainer.checkpoint.best_by`` (default: the optimized metric, in the direction
:func:`fxtrain.tasks.lower_is_better` gives) and keeps the best step's state: in memory, and as
``checkpoints/best`` in the run directory (:func:`fxtrain.save`, its step and value in the manifest's ``meta``),
which ``trainer.keep_last`` never deletes and a resumed run reads back (:meth:`Best.resume`: the best so far
survives a restart; a best from after the resumed step is of a timeline that is being redone, and is dropped).

Map: :func:`best_by` (the metric followed), :class:`Best` (follow, keep, write, resume), :func:`state_to_test` and
:func:`describe_tested` (the checkpoint the test split reads, and why). When
``checkpoints/best`` is written and what a kill loses, the test split and its ``tested`` record, sources without a
validation split: docs/reliability.md ("The best checkpoint and the test").

Example:
    >>> best = Best("val_loss")
    >>> [best.update({"val_loss": v}, step) for step, v in ((10, 0.9), (20, 0.5), (30, 0.7))]
    [True, True, False]
    >>> best.step, best.value
    (20, 0.5)
"""

from __future__ import annotations

import logging
import math
import pathlib
import shutil
from typing import Any

import torch

import fxtrain as fx
from fxtrain import checkpoint, rundir, tasks, tree

BEST = "best"  # checkpoints/best: the best step's checkpoint (never pruned: not a step_<N> name)
TEST_CKPTS = tasks.TEST_CKPTS


def best_by(cfg: Any) -> str:
    """The metric ``trainer.checkpoint.best_by`` names, or the run's ``optimized_metric`` (its validation form when
    it names a test metric: the best step is chosen on validation).

    >>> from omegaconf import OmegaConf
    >>> best_by(OmegaConf.create({"optimized_metric": "test_accuracy", "trainer": {"checkpoint": {"best_by": None}}}))
    'val_accuracy'
    """
    node = cfg.trainer.get("checkpoint") or {}
    name = node.get("best_by") or cfg.optimized_metric
    return f"val_{name.removeprefix('test_')}" if tasks.reads_test(name) else name


class Best:
    """The best step by ``metric`` so far, its value, its logged metrics and its state (params and buffers).

    Args:
      metric: a logged metric (``val_accuracy``); read from each logged line that holds it.
      lower: whether lower is better; ``None``: :func:`fxtrain.tasks.lower_is_better`.
    """

    def __init__(self, metric: str, lower: bool | None = None):
        self.metric = metric
        self.lower = tasks.lower_is_better(metric) if lower is None else lower
        self.step: int | None = None
        self.value: float | None = None
        self.metrics: dict[str, float] = {}  # the best step's logged metrics
        self.state: fx.TrainState | None = None  # a copy of the best step's state
        self.pending: tuple[pathlib.Path, dict[str, Any]] | None = None  # where write() puts self.state, its meta
        self.dropped: str | None = None  # why a resume did not take the best so far (checkpoints/best), if it did not

    def update(self, record: dict[str, float], step: int) -> bool:
        """Reads one logged line; ``True`` when it is a new best (ties keep the earlier step)."""
        value = record.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        if self.value is not None and (value >= self.value if self.lower else value <= self.value):
            return False
        self.step, self.value, self.metrics = step, float(value), dict(record)
        return True

    def keep(self, state: fx.TrainState, ckpt_dir: pathlib.Path | None, rank: int,
             meta: dict[str, Any] | None = None) -> None:
        """Keeps ``state`` (the new best step's) as a copy; with a run directory, the whole state (optimizer state
        and RNG too) until :meth:`write` writes it as ``ckpt_dir/best``. Writes nothing."""
        del rank  # every rank keeps its own part, and writes it in write()
        if ckpt_dir is None:
            self.state, self.pending = fx.TrainState(state.step, _copy(state.params), None, None,
                                                     _copy(state.buffers)), None
            return
        self.state = _copy(state)
        record = {"step": self.step, "metric": self.metric, "value": self.value, "metrics": self.metrics}
        self.pending = (ckpt_dir / BEST, {**(meta or {}), "best": record})

    def write(self) -> bool:
        """Writes the best kept since the last write as ``checkpoints/best`` (:func:`fxtrain.save`, atomic); whether
        there was one. Every rank calls it, at the same step (the runner: before each regular checkpoint).

        Raises:
          fxtrain.CheckpointError: the save failed (a full disk); the previous ``checkpoints/best`` is intact and
            this best stays pending.

        Example:
            >>> import tempfile, torch
            >>> best, out = Best("val_loss"), pathlib.Path(tempfile.mkdtemp())
            >>> best.update({"val_loss": 0.5}, 3)
            True
            >>> best.keep(fx.TrainState(3, {"w": torch.ones(2)}, None), out, rank=0)
            >>> (out / BEST).exists(), best.write(), (out / BEST).exists(), best.write()
            (False, True, True, False)
        """
        if self.pending is None:
            return False
        target, meta = self.pending
        rundir.save(target, self.state, meta, "the previous best checkpoint is intact")  # a full disk: one line
        self.pending = None
        # Written: the test reads params and buffers alone; the optimizer state's copy is let go.
        self.state = fx.TrainState(self.state.step, self.state.params, None, None, self.state.buffers)
        return True

    def resume(self, ckpt_dir: pathlib.Path | None, start: int, like: fx.TrainState, rank: int) -> None:
        """The best so far of the run a resume continues: ``ckpt_dir/best`` if it is from step ``start`` or before
        (and by this metric), read into a copy of ``like``'s structure; a later one is removed (rank 0)."""
        path = None if ckpt_dir is None else ckpt_dir / BEST
        if path is None or not path.is_dir():
            return
        try:
            recorded = checkpoint.verify(path)["meta"].get("best") or {}
        except (checkpoint.CheckpointError, OSError) as e:
            logging.getLogger("fxtrain").warning(f"checkpoint {path} is damaged ({e}): dropped; the best step is "
                                                 f"chosen from step {start} on")
            recorded, self.dropped = {}, f"checkpoints/best was damaged and dropped at the resume from step {start}"
        if recorded.get("metric") != self.metric or not isinstance(recorded.get("step"), int) \
                or recorded["step"] > start:
            if self.dropped is None:
                self.dropped = (f"checkpoints/best (step {recorded['step']}) is from after the resumed step {start}"
                                if isinstance(recorded.get("step"), int) and recorded.get("metric") == self.metric
                                else f"checkpoints/best was not chosen by {self.metric}") + ": dropped"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            return
        # fx.load may read into the template's tensors: copies, not the run's live ones.
        template = fx.TrainState(like.step, _copy(like.params), _copy(like.opt_state), like.rng, _copy(like.buffers))
        state = fx.load(path, like=template, saved_placements=True)
        self.step, self.value, self.metrics = recorded["step"], float(recorded["value"]), dict(recorded["metrics"])
        self.state = fx.TrainState(state.step, state.params, None, None, state.buffers)

    def describe(self) -> str:
        """``val_accuracy 0.9712 at step 300`` for the run's lines."""
        return f"{self.metric} {self.value:.4g} at step {self.step}" if self.step is not None else f"no {self.metric}"


def state_to_test(which: str, best: Best | None, last: fx.TrainState) -> tuple[fx.TrainState, dict[str, Any]]:
    """The state ``trainer.test_ckpt`` names, and what summary.json's ``tested`` says of it: ``{"step",
    "checkpoint": "best" | "last", "why"}``. ``best`` is the best step's, or the last one when there is no best
    step (no step logged the metric since the run, or its resume, began; the why says which).

    >>> last = fx.TrainState(8, {}, None)
    >>> state_to_test("best", Best("val_loss"), last)[1]
    {'step': 8, 'checkpoint': 'last', 'why': 'trainer.test_ckpt=best, but no step logged val_loss: the last step was tested'}
    """
    if which == "best" and best is not None and best.state is not None:
        why = f"trainer.test_ckpt=best: {best.describe()}"
        if best.dropped:
            why += f" (chosen after the resume: {best.dropped})"
        return best.state, {"step": best.step, "checkpoint": "best", "why": why}
    if which == "best":
        metric = best.metric if best is not None else "the best_by metric"
        reason = (f"{best.dropped}, and no step logged {metric} since" if best is not None and best.dropped
                  else f"no step logged {metric}")
        return last, {"step": last.step, "checkpoint": "last",
                      "why": f"trainer.test_ckpt=best, but {reason}: the last step was tested"}
    return last, {"step": last.step, "checkpoint": "last", "why": "trainer.test_ckpt=last"}


def describe_tested(tested: dict[str, Any]) -> str:
    """summary.json's ``tested`` as the run's lines say it: ``best (step 12)``, or ``last (step 20: why)`` when it
    is not what ``trainer.test_ckpt`` asked for by name.

    >>> describe_tested({"step": 20, "checkpoint": "last", "why": "trainer.test_ckpt=last"})
    'last (step 20)'
    """
    said = tested["why"] in ("trainer.test_ckpt=last",) or tested["why"].startswith("trainer.test_ckpt=best:")
    return f"{tested['checkpoint']} (step {tested['step']}" + (")" if said else f": {tested['why']})")


def _copy(values: Any) -> Any:
    """A detached copy of a tree's tensors (they go on training in place)."""
    return tree.map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, values)
