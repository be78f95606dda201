"""Choosing by validation, testing once: the best step of a run and the test split's evaluation at its end.

A run evaluates its **validation** split (``data.val``; ``val_loss``, ``val_<metric>``) every
``trainer.eval_every`` steps; early stopping, ``optimized_metric`` and every sweeper read those. :class:`Best`
follows ``trainer.checkpoint.best_by`` (default: the optimized metric, in the direction
:func:`fxtrain.tasks.lower_is_better` gives) and keeps the best step's state: in memory, and as
``checkpoints/best`` in the run directory (:func:`fxtrain.save`, its step and value in the manifest's ``meta``),
which ``trainer.keep_last`` never deletes and a resumed run reads back (:meth:`Best.resume`: the best so far
survives a restart; a best from after the resumed step is of a timeline that is being redone, and is dropped).

The **test** split is evaluated once, when training ends, on the checkpoint ``trainer.test_ckpt`` names:
``best`` (default) or ``last`` (:func:`state_to_test`); ``test_loss``, ``test_<metric>`` go into ``summary.json``
beside the best step's ``val_*`` metrics and ``best_step``.

A data source without a validation split (``data.val_fraction=0``, an iterable of batches) is validated on
its test split (:attr:`fxtrain.data.Dataset.validation`), as runs were before there were three splits; its
``data`` line says so, and the numbers it chooses by have seen the test set.

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
        """Keeps ``state`` (the new best step's) as a copy, and as ``ckpt_dir/best`` when there is a run directory."""
        self.state = fx.TrainState(state.step, _copy(state.params), None, None, _copy(state.buffers))
        if ckpt_dir is not None:
            record = {"step": self.step, "metric": self.metric, "value": self.value, "metrics": self.metrics}
            rundir.save(ckpt_dir / BEST, state, {**(meta or {}), "best": record},
                        "the previous best checkpoint is intact")  # a full disk: one line, a failed summary

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
            recorded = {}
        if recorded.get("metric") != self.metric or not isinstance(recorded.get("step"), int) \
                or recorded["step"] > start:
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


def state_to_test(which: str, best: Best | None, last: fx.TrainState) -> tuple[fx.TrainState, str]:
    """The state ``trainer.test_ckpt`` names and how to say it: the best step's (``best``; the last one when no
    step logged the metric), or ``last``."""
    if which == "best" and best is not None and best.state is not None:
        return best.state, f"best ({best.describe()})"
    if which == "best":
        return last, f"last (step {last.step}: no step logged {best.metric if best else 'the best_by metric'})"
    return last, f"last (step {last.step})"


def _copy(values: Any) -> Any:
    """A detached copy of a tree's tensors (they go on training in place)."""
    return tree.map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, values)
