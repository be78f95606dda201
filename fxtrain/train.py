"""The training script: ``python -m fxtrain.train [overrides]``, sweeps with ``-m``, data parallel under torchrun.

    python -m fxtrain.train                                   # digits MLP, about 10 s on 2 CPU cores
    python -m fxtrain.train experiment=stdlib_lm trainer.max_steps=100
    python -m fxtrain.train -m seed=1,2 optim.chain.adamw.learning_rate=1e-3,3e-3
    torchrun --nproc_per_node=2 -m fxtrain.train parallel=dp
    torchrun --nproc_per_node=2 -m fxtrain.train parallel=dp parallel.shard_optimizer=true   # ZeRO: 1/2 the state
    python -m fxtrain.train hydra.run.dir=outputs/run1 resume=auto   # start, or continue after a kill

:func:`train` reads top to bottom in execution order: config, build (data, model, transform stack,
step), resume, loop (step, log, eval, checkpoint), summary. Everything else is a library call. Each run
directory gets ``config.yaml`` (resolved), ``metrics.jsonl``, ``checkpoints/step_<N>/`` (:func:`fxtrain.save`
of a :class:`fxtrain.TrainState`: params, buffers, every transform state, the RNG states and the step,
which is also the data position), ``summary.json`` and ``train.log``; a sweep directory also gets
``summary.csv`` (see :mod:`fxtrain.report`). Under torchrun every rank runs the same code on the same
config, and only rank 0 writes or prints (checkpoints are written by all ranks together, through
``torch.distributed.checkpoint``).

**Resuming** (the ``resume`` key; checkpoints every ``trainer.checkpoint_every`` steps, the last
``trainer.keep_last`` kept):

* ``resume=auto`` continues the run *in its own directory*: the newest complete checkpoint under
  ``<run dir>/checkpoints`` is loaded and training goes on from the step after it. The run directory is
  Hydra's (``hydra.run.dir``, or the job's directory of a sweep), whose default is a new timestamp on
  every launch: give it explicitly (``hydra.run.dir=outputs/run1``) so that a relaunch finds the killed
  run. With no checkpoint there the run starts at step 0, so a preemptible job can always pass
  ``resume=auto``. A run whose ``summary.json`` says it completed ``trainer.max_steps`` steps is left
  alone: nothing is trained or written, and its recorded value is returned.
* ``resume=PATH``: a checkpoint directory (``.../checkpoints/step_<N>``) or a run directory (its newest
  checkpoint); training continues in this run's own directory. The checkpoint must be of this config (the
  config hash its manifest, or its run's ``run.json``, records): another run's is refused unless
  ``resume_force=true``.
* ``resume=orbax:PATH``: an Orbax checkpoint a JAX program wrote (params and Optax state), read into this run,
  which goes on from its step; ``trainer.export=orbax`` writes one into the run directory at the end
  (:mod:`fxtrain.interop.run_hooks`).

Both verify the checkpoint first (:func:`fxtrain.checkpoint.verify`; nothing in it is read by a loader that
runs code): ``resume=auto`` goes back past a newest checkpoint that does not verify to the previous one,
naming the damaged one in a warning (none verifying is an error, never a silent start at step 0). The world
size and the parallel layout are part of the run (recorded in ``run.json`` and every checkpoint's manifest):
resuming on another is refused unless ``resume_relayout=true`` (the checkpoint is resharded; the start line
says ``relayout from 2 ranks, parallel=dp [dp=2] to 1 process, parallel=none``).

In both cases ``metrics.jsonl`` is cut back to the checkpoint's step before training goes on (the lines
a killed run logged after its last checkpoint are logged again by the resumed one), so it holds every
logged step exactly once; ``summary.json`` and checkpoints after that step are removed
(:func:`fxtrain.rundir.rewind`). The resumed run computes what the uninterrupted one would have: same
batches (``data.train[step]``), same RNG, same optimizer state, bit for bit; only ``time_s`` restarts from 0.

**A run directory belongs to one run** (:mod:`fxtrain.rundir`): relaunching another config into it is
refused, and so is the same config with ``resume=null`` (use ``resume=auto``); one live process holds it
(a lock naming its pid and host); ``keep_last`` deletes only this run's older checkpoints.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import json
import logging
import math
import os
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import fxtrain as fx
from fxtrain.errors import ConfigError
from fxtrain import build, checkpoint, distributed, loggers, parallel, report, rundir, tasks, tree, validate
from fxtrain.interop import run_hooks as orbax_hooks  # resume=orbax:PATH, trainer.export=orbax
from fxtrain.models import count_params
from fxtrain.parallel import evaluate, loss_function  # noqa: F401 - the runner's loss and evaluation (fxtrain.sweep uses them)

log = logging.getLogger("fxtrain")
# conf/ at the repository root, installed as the package fxtrain.conf (pyproject.toml maps it): Hydra reads it as
# pkg://fxtrain.conf from a checkout and from a wheel alike; CONF_DIR is where it lies (for compose in tests).
CONF_DIR = pathlib.Path(str(importlib.resources.files("fxtrain.conf")))


def train(cfg: DictConfig, out_dir: str | pathlib.Path | None = None) -> float:
    """Trains the experiment ``cfg`` describes and returns ``float(metrics[cfg.optimized_metric])``.

    Args:
      cfg: a composed ``conf/train.yaml`` (Hydra hands it over; tests use ``hydra.compose``).
      out_dir: the run directory; ``None`` writes nothing. Only rank 0 writes.

    Raises:
      FloatingPointError: a non-finite loss or metric; training stops there, and ``metrics.jsonl`` and
        ``checkpoints/`` keep the last finite step.
      fxtrain.errors.ConfigError: a config that cannot be built, naming the key.
      fxtrain.rundir.RunDirError: ``out_dir`` holds another run, this run without ``resume``, or a live process.
    """
    build.settle_optimized_metric(cfg)  # the task's own where the config leaves it to the task (a _target_ function's)
    validate.check(cfg)  # every setting, before anything is written (fxtrain/validate.py)
    with rundir.claim(out_dir, cfg):  # one run, one live process per directory (fxtrain/rundir.py)
        return _train(cfg, out_dir)


def _train(cfg: DictConfig, out_dir: str | pathlib.Path | None) -> float:
    t0 = time.perf_counter()
    run = _setup(cfg, out_dir)
    if run.source == "completed":  # resume=auto on a finished run: leave it as it is
        run.say(f"resume=auto: {out_dir} completed {cfg.trainer.max_steps} steps already; nothing to do")
        return float(rundir.read_summary(out_dir)["value"])
    built = build_run(cfg, run.device, run.dims)
    start, params, opt_state, buffers = _resume(cfg, run, built)
    final = _loop(cfg, run, built, start, params, opt_state, buffers, t0)
    orbax_hooks.export(cfg, run.out, run.ckpt_dir, built.model, params, opt_state, buffers, built.tx)
    return finish_run(cfg, run.out, final, time.perf_counter() - t0, run.say)


class _Run(NamedTuple):
    """Where and how this process runs: what :func:`_setup` reads from the config and the environment once."""

    rank: int
    dims: distributed.ParallelDims  # the run's mesh object, built: handed to the model, stack, data and checkpoints
    device: torch.device
    out: pathlib.Path | None  # the run directory on rank 0 (the only writer of files other than checkpoints)
    ckpt_dir: pathlib.Path | None  # every rank writes its shards here
    source: pathlib.Path | str | None  # the checkpoint to resume from, or "completed"
    say: Callable[[str], Any]
    meta: dict[str, Any] | None = None  # recorded in every checkpoint's manifest: config hash, world size, layout
    note: str | None = None  # how the resume differs ("relayout from 2 ranks, parallel=dp [dp=2] to 1 process")


def _setup(cfg: DictConfig, out_dir: str | pathlib.Path | None) -> _Run:
    rank, world = distributed.rank_and_world()
    dims = build.parallel_dims(cfg, world)  # checked before anything is written
    say = log.info if rank == 0 else (lambda *args: None)
    out = pathlib.Path(out_dir) if out_dir is not None and rank == 0 else None
    ckpt_dir = pathlib.Path(out_dir) / "checkpoints" if out_dir is not None else None
    digest, flat = rundir.config_hash(cfg)
    meta = {"config_sha256": digest, "config": flat, "world_size": world, "layout": dims.describe()}
    source, note = _resume_plan(cfg, ckpt_dir, meta)
    device = distributed.device(cfg.trainer.device)
    if source != "completed":
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(_resolved_yaml(cfg))
        if device.type == "cpu" and cfg.trainer.cpu_threads:
            torch.set_num_threads(cfg.trainer.cpu_threads)
        dims = dims.build(device.type)
    return _Run(rank, dims, device, out, ckpt_dir, source, say, meta, note)


class Built(NamedTuple):
    """What :func:`build_run` builds: the data, the model on its mesh, the stack and its state, the step."""

    data: Any
    model: torch.nn.Module
    apply: Callable
    params: Any
    buffers: Any
    tx: fx.GradientTransformation
    opt_state: Any
    step: Callable  #: ``step(params, opt_state, buffers, batch) -> (params, opt_state, buffers, metrics)``
    evaluate: Callable  #: ``evaluate(params, buffers, test, batch_size) -> metrics``
    task: tasks.Task  #: the loss and metrics (``task`` group)


def build_run(cfg: DictConfig, device: torch.device, dims: distributed.ParallelDims | None = None,
              data: Any = None) -> Built:
    """What :func:`train` builds from ``cfg`` before its loop, in this order after ``torch.manual_seed(cfg.seed)``:
    the data, the model, the task (:mod:`fxtrain.tasks`), the stack (:func:`fxtrain.build.stack`), the model
    placed on ``dims``' mesh with its step (:func:`fxtrain.parallel.parallelize`) and the stack's state.

    The sweep launcher (``hydra/launcher=vmap``) builds each job of a group with it, so every job starts from
    exactly the params, state and RNG state its own run would. It passes ``data`` (built already, for the
    same ``cfg.data``) to share one dataset between jobs, when building it draws no torch random numbers.
    """
    dims = dims or distributed.ParallelDims.of(world=1)
    torch.manual_seed(cfg.seed)  # params init (the data has its own seeded order): the same on every rank
    data = build.dataset(cfg.data, _choice("data", "data")).to(device) if data is None else data
    model = build.instantiate(cfg.model, "model").to(device)
    task = build.task(cfg)
    tx = build.stack(cfg, dims)
    try:
        placed = parallel.parallelize(model, tx, dims, task=task, pipeline=_pipeline_options(cfg),
                                        mp_policy=build.mixed_precision(cfg, dims))
    except ValueError as e:
        raise ConfigError(f"{dims.describe()} model={_choice('model')}: {e}") from None
    params = build.cast_params(cfg, placed.params)  # bf16/fp16 storage for the pure half amp modes; else unchanged
    return Built(data, model, placed.apply, params, placed.buffers, tx, tx.init(params), placed.step, placed.evaluate,
                 task)


def _resume(cfg: DictConfig, run: _Run, built: Built) -> tuple[int, Any, Any, Any]:
    """``(start, params, opt_state, buffers)``: the checkpoint's, or step 0's; says the run's first lines."""
    start, params, opt_state, buffers, resumed = 0, built.params, built.opt_state, built.buffers, "from step 0"
    orbax = orbax_hooks.start(cfg, built.model, params, buffers, built.tx, run.dims.world)  # resume=orbax:PATH
    if orbax is not None:
        start, opt_state, resumed = orbax
    elif run.source is not None:
        state = fx.load(run.source, like=fx.TrainState(0, params, opt_state, fx.rng_state(), buffers),
                        saved_placements=True)  # a held gradient keeps its own (it may differ from its param's)
        # Into the built trees, in place: FSDP and pipeline stages compute with their modules' own tensors,
        # which these leaves are (a new tree would train a copy the module never sees).
        with torch.no_grad():
            tree.copy_(tree.leaves(params), tree.leaves(state.params))
            tree.copy_(tree.leaves(buffers), tree.leaves(state.buffers))
        start, opt_state = state.step, state.opt_state
        fx.set_rng_state(state.rng)
        if start > cfg.trainer.max_steps:
            raise ConfigError(f"resume: the checkpoint {run.source} is at step {start}, beyond "
                                    f"trainer.max_steps={cfg.trainer.max_steps}")
        resumed = f"from {run.source} (step {start})" + (f", {run.note}" if run.note else "")
    elif cfg.get("resume") == "auto":
        resumed = f"from step 0 (resume=auto: no checkpoint in {run.ckpt_dir})"
    rundir.rewind(run.out, start)  # no summary, no checkpoint or metrics.jsonl line after `start`: one timeline
    dims = run.dims
    where = str(run.out) if run.out is not None else "(not saved)"
    run.say(f"run    {where}" + (f"  [{dims.world} ranks, {dims.describe()}"
                                 + (", shard_optimizer" if cfg.parallel.get("shard_optimizer") else "") + "]"
                                 if dims.world > 1 else ""))
    for line in describe_run(built.data, built.model, params, built.tx, opt_state, run.device, task=built.task):
        run.say(line)
    run.say(f"start  {resumed}")
    return start, params, opt_state, buffers


def _loop(cfg: DictConfig, run: _Run, built: Built, start: int, params: Any, opt_state: Any, buffers: Any,
          t0: float) -> dict[str, float]:
    """Steps ``start + 1 .. max_steps``: step, log, evaluate, checkpoint; stops early when
    ``trainer.early_stopping`` says so. Returns the last train and eval metrics (and ``"stopped_early"``)."""
    trainer, dims = cfg.trainer, run.dims
    constants = fx.traits(built.tx).constant_reports  # b1, eps...: constant, in config.yaml (strategies' own steps report them)
    hooks = build.eval_hooks(cfg)
    stopper = build.early_stopping(cfg)
    logger = (loggers.open_loggers(cfg.get("logger"), run.out, start=start,  # metrics.jsonl and the listed ones
                                   config=OmegaConf.to_container(cfg, resolve=True)) if run.out is not None else None)
    if stopper is not None and isinstance(run.source, pathlib.Path):  # the lines its checkpoint's run logged
        logged = report.read_jsonl(run.source.parent.parent / rundir.METRICS)  # <run>/checkpoints/step_N
        stopper.replay([r for r in logged if r.get("step", 0) <= start])
    max_steps = trainer.max_steps
    train_metrics: dict[str, float] = {}   # the last logged ones
    eval_metrics: dict[str, float] = {}
    stopped: dict[str, Any] = {}
    last_checkpoint = (start, run.source) if run.source is not None else None  # (step, path)

    def run_eval(step: int) -> dict[str, float]:
        metrics = built.evaluate(params, buffers, built.data.test, trainer.eval_batch_size)
        ctx = tasks.EvalContext(step, parallel.forward(built.apply, params, buffers), params, buffers, built.data,
                                built.task, trainer.eval_batch_size)
        mine = {k: v for name, hook in hooks for k, v in _hook_metrics(name, hook(ctx)).items()}
        # A hook may see only its rank's part: averaged, so every rank logs and early-stops on the same line.
        return {**metrics, **distributed.mean_across_ranks(mine, dims.world)}

    bar = tqdm(total=max_steps, initial=start, desc="train", disable=run.rank != 0 or not trainer.progress,
               dynamic_ncols=True)
    with logging_redirect_tqdm(), bar, (logger or contextlib.nullcontext()):
        if start == max_steps:  # killed after its last checkpoint, before its summary: evaluate again
            eval_metrics = run_eval(start)
        for i in range(start + 1, max_steps + 1):
            batch = dims.local_batch(built.data.train[i - 1])
            params, opt_state, buffers, metrics = built.step(params, opt_state, buffers, batch)
            bar.update()
            if i == start + 1:
                _check_metric_name(cfg.optimized_metric, _metric_names(_logged(metrics, constants)),
                                   deferred=bool(hooks))

            record: dict[str, float] = {}
            if i % trainer.log_every == 0 or i == max_steps:
                train_metrics = distributed.mean_across_ranks(_floats(_logged(metrics, constants)), dims.world)
                record.update(train_metrics)
            if i % trainer.eval_every == 0 or i == max_steps:
                eval_metrics = run_eval(i)
                record.update(eval_metrics)
                if hooks:  # the hooks' names are known now
                    _check_metric_name(cfg.optimized_metric, [*train_metrics, *eval_metrics])
            if record:
                _stop_if_not_finite(record, i, last_checkpoint)
                if stopper is not None and stopper.update(record, i) and i < max_steps:
                    stopped = {"step": i, **stopper.describe()}
                    run.say(f"stop   early at step {i}: {stopper.metric} has not improved on {stopper.best:.4g} "
                            f"(step {stopper.best_step}) for {stopper.patience} logged values")
                    if i % trainer.eval_every:  # the summary's test metrics are those of the params it stops with
                        eval_metrics = run_eval(i)
                        record.update(eval_metrics)
                record["time_s"] = round(time.perf_counter() - t0, 3)
                if logger is not None:
                    logger.log(i, record)
                bar.set_postfix({k: f"{record[k]:.4g}" for k in ("loss", "learning_rate", "test_accuracy")
                                 if k in record})

            if run.ckpt_dir is not None and ((trainer.checkpoint_every and i % trainer.checkpoint_every == 0)
                                             or i == max_steps or stopped):
                state = fx.TrainState(i, params, opt_state, fx.rng_state(), buffers)
                last_checkpoint = (i, save_checkpoint(run.ckpt_dir, state, trainer.keep_last, last_checkpoint, run.rank,
                                                      run.meta))
            if stopped:
                break
    final = {**train_metrics, **eval_metrics}
    if start == max_steps and run.out is not None:  # resumed at max_steps: the train metrics its last line logged
        final = {**_last_record(run.out / "metrics.jsonl", max_steps), **final}
    if stopped:
        final["stopped_early"] = stopped
    return final


def _hook_metrics(name: str, values: Any) -> dict[str, float]:
    """An eval hook's return value as ``{metric: float}``, or one line naming the hook."""
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ConfigError(f"trainer.eval_hooks.{name}: returned {type(values).__name__}; an eval hook returns "
                                "a dict of metric name -> number")
    try:
        return {k: float(v) for k, v in values.items()}
    except (TypeError, ValueError):
        bad = next(k for k, v in values.items() if not isinstance(v, (int, float, torch.Tensor)))
        raise ConfigError(f"trainer.eval_hooks.{name}: metric {bad} is {values[bad]!r}, not a number") from None


def _metric_names(train: dict[str, Any]) -> list[str]:
    """The metrics a run will have: its train ones, ``test_loss`` and ``test_<name>`` of the task's."""
    return [*train, "test_loss", *(f"test_{k}" for k in train if k not in ("loss", "grad_norm", "learning_rate"))]


def _pipeline_options(cfg: DictConfig) -> dict:
    return {"schedule": cfg.parallel.get("schedule", "gpipe"), "microbatches": cfg.parallel.get("microbatches", 4)}


def _choice(group: str, default: str = "?") -> str:
    """The option of ``group`` this run picked (``data=mine``: ``mine``), or ``default`` outside a Hydra run."""
    try:
        return str(HydraConfig.get().runtime.choices.get(group))
    except ValueError:  # composed outside a Hydra run (tests)
        return default


def describe_run(data: Any, model: torch.nn.Module, params: Any, tx: fx.GradientTransformation, opt_state: Any,
                 device: torch.device, shards: int = 1, task: tasks.Task | None = None) -> list[str]:
    """The ``data``, ``model``, ``task``, ``stack`` and ``state`` lines a run prints at its start (and its
    train.log holds)."""
    return [f"data   {data}",
            f"model  {type(model).__name__}: {count_params(params):,} params on {device}",
            *([f"task   {task!r}"] if task is not None else []),
            f"stack  {tx!r}",
            f"state  {state_bytes(opt_state):,} bytes of optimizer state per rank" +
            (f" (sharded over {shards} ranks)" if shards > 1 else "")]


def finish_run(cfg: DictConfig, out: pathlib.Path | None, final: dict[str, float], elapsed: float,
               say: Callable[[str], Any]) -> float:
    """Writes ``summary.json`` (status completed; ``stopped_early`` when early stopping ended the run) into ``out``,
    says the ``done`` line and returns the optimized metric of ``final`` (the last train and eval metrics).

    Raises:
      FloatingPointError: the optimized metric is not finite (summary.json is written first).
    """
    final = dict(final)
    stopped = final.pop("stopped_early", None)
    steps = stopped["step"] if stopped else cfg.trainer.max_steps
    value = final[cfg.optimized_metric]
    if out is not None:
        summary = {"status": "completed", "step": steps, "time_s": round(elapsed, 2),
                   "optimized_metric": cfg.optimized_metric, "value": value, "metrics": final}
        if stopped:
            summary["stopped_early"] = stopped
        rundir.write_json(out / "summary.json", summary)  # atomic: a kill leaves the old one or the new one
    shown = [cfg.optimized_metric] + [k for k in ("test_accuracy", "test_loss", "loss") if k != cfg.optimized_metric]
    say(f"done   {steps} steps in {elapsed:.1f} s | " + " | ".join(f"{k} {final[k]:.4f}" for k in shown
                                                                   if k in final))
    if not math.isfinite(value):
        raise FloatingPointError(f"optimized_metric {cfg.optimized_metric} is {value}")
    return float(value)


def write_failure(out: pathlib.Path, cfg: DictConfig, error: BaseException) -> None:
    """Writes the ``summary.json`` of a failed run (``status: failed`` and the error), which summary.csv shows."""
    if isinstance(error, rundir.RunDirError):  # a refused launch: the directory is another run's
        return
    failed = {"status": "failed", "error": f"{type(error).__name__}: {error}", "optimized_metric": cfg.optimized_metric}
    rundir.write_json(out / "summary.json", failed)


def state_bytes(opt_state: Any) -> int:
    """Bytes of ``opt_state`` this rank holds: local pieces of DTensor leaves (sharded state counts 1/n)."""
    return sum(x.numel() * x.element_size() for x in distributed.local_leaves(opt_state))


def save_checkpoint(directory: pathlib.Path, state: fx.TrainState, keep_last: int,
                    previous: tuple[int, pathlib.Path] | None, rank: int,
                    meta: dict[str, Any] | None = None) -> pathlib.Path:
    """Writes ``state`` to ``directory/step_<N>`` (:func:`fxtrain.save`: atomic; ``meta`` into its manifest),
    refusing non-finite params, then deletes older ones beyond the newest ``keep_last`` (``0`` keeps all;
    :func:`fxtrain.rundir.prune`). Every rank calls it.

    Raises:
      fxtrain.CheckpointError: the save failed (a full disk: its ``OSError`` is the cause, so the runner
        reports it as one line); the previous checkpoint is intact. DCP reports a failed write as a
        ``BaseException``, which would pass by every handler meant for errors: it is turned into this one.
    """
    if not bool(tree.all_finite(distributed.local_leaves(state.params))):
        _raise_not_finite(f"params are not finite after step {state.step}", previous)
    target = directory / f"step_{state.step:07d}"
    try:
        path = fx.save(target, state, meta=meta)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is not an Exception
        cause = checkpoint.first_failure(e)
        kept = (f"the last checkpoint is step {previous[0]} ({previous[1]}), intact" if previous
                else "no checkpoint was written yet")
        raise checkpoint.CheckpointError(f"could not write the checkpoint {target}: {type(cause).__name__}: "
                                         f"{(str(cause).splitlines() or [''])[0]}; {kept}") from cause
    if rank == 0:
        rundir.prune(directory, keep_last, state.step)
    return path


def _resume_source(cfg: DictConfig, ckpt_dir: pathlib.Path | None) -> pathlib.Path | str | None:
    """The checkpoint ``cfg.resume`` asks for, ``None`` to start at step 0, or ``"completed"`` (see the module doc)."""
    return _resume_plan(cfg, ckpt_dir)[0]


def _resume_plan(cfg: DictConfig, ckpt_dir: pathlib.Path | None,
                 meta: dict[str, Any] | None = None) -> tuple[pathlib.Path | str | None, str | None]:
    """``(source, note)``: :func:`_resume_source`'s answer, checked, and how the resume differs from the run that
    wrote the checkpoint (a re-layout), for the start line.

    ``resume=auto`` takes the newest checkpoint that verifies (a damaged one is named in a warning, and the
    previous one is taken); ``resume=PATH`` refuses a checkpoint of another config unless ``resume_force=true``.
    Both refuse another world size or layout than the checkpoint's unless ``resume_relayout=true``.

    Raises:
      fxtrain.rundir.RunDirError: a checkpoint that does not verify (none does, for ``resume=auto``), of
        another config, or of another layout; nothing was written.
      fxtrain.errors.ConfigError: ``resume=PATH`` with no checkpoint there, or ``resume_force`` not a boolean.
    """
    resume = cfg.get("resume")
    if resume in (None, "") or orbax_hooks.orbax_path(resume) is not None:  # orbax: read in _resume
        return None, None
    if meta is None:
        world = distributed.rank_and_world()[1]
        meta = {"world_size": world, "layout": build.parallel_dims(cfg, world).describe()}
    if resume == "auto":
        if ckpt_dir is None:
            return None, None
        try:
            done = rundir.read_summary(ckpt_dir.parent) or {}
        except rundir.RunDirError as e:  # the newest checkpoint has what it lacks: go on from there
            log.warning(f"{e}; resume=auto goes on from the newest checkpoint and writes it again")
            done = {}
        if done:
            finished = done.get("step") == cfg.trainer.max_steps or "stopped_early" in done
            if done.get("status") == "completed" and finished and "value" in done:
                return "completed", None
        found, manifest = _newest_verified(ckpt_dir)
    else:
        path = pathlib.Path(str(resume))
        if (path / checkpoint.MANIFEST).exists():
            found = path
        else:
            found = checkpoint.latest(path / "checkpoints") or checkpoint.latest(path)
        if found is None:
            raise ConfigError(f"resume={resume}: no checkpoint there (expected a checkpoint directory such as "
                                    "<run>/checkpoints/step_0000100, or a run directory that has checkpoints/)")
        manifest = _verified(found, f"resume={resume}")
        _check_same_config(cfg, found, manifest)
    if found is None:
        return None, None
    recorded = manifest["meta"] if "world_size" in manifest["meta"] else {"world_size": manifest["world_size"]}
    note = rundir.check_layout(f"the checkpoint {found}", recorded, meta, cfg)
    return found, note


def _verified(path: pathlib.Path, who: str) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` once :func:`fxtrain.checkpoint.verify` accepts it, or one line."""
    try:
        return checkpoint.verify(path)
    except (checkpoint.CheckpointError, OSError) as e:
        raise rundir.RunDirError(f"{who}: {e}") from None


def _newest_verified(ckpt_dir: pathlib.Path) -> tuple[pathlib.Path | None, dict[str, Any]]:
    """The newest checkpoint of ``ckpt_dir`` that verifies and its manifest (``(None, {})`` when there is none);
    a damaged newer one is named in a warning. None verifying is an error, never a silent start at step 0."""
    found = checkpoint.candidates(ckpt_dir)
    first = None
    for i, path in enumerate(found):
        try:
            manifest = checkpoint.verify(path)
        except (checkpoint.CheckpointError, OSError) as e:
            first = first or e
            if i + 1 == len(found):
                raise rundir.RunDirError(f"resume=auto: {first}" + (f" (and every older checkpoint in {ckpt_dir} "
                                                                    "too)" if i else "")) from None
            log.warning(f"resume=auto: {e}; going on from the previous checkpoint, {found[i + 1].name} (the damaged "
                        "one is removed when training goes on past it)")
            continue
        return path, manifest
    return None, {}


def _check_same_config(cfg: DictConfig, path: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Refuses ``resume=PATH`` to a checkpoint of another config (recorded in its manifest, or in its run's
    ``run.json``) unless ``resume_force=true``: its state would continue under this run's name."""
    force = cfg.get("resume_force", False)
    if not isinstance(force, bool):
        raise ConfigError(f"resume_force={force!r}: expected true (resume=PATH may load a checkpoint of "
                                "another config) or false")
    there = manifest["meta"].get("config")
    if not isinstance(there, dict):
        try:
            there = json.loads((path.parent.parent / rundir.OWNER).read_text()).get("config")
        except (OSError, ValueError, AttributeError):
            there = None
    if not isinstance(there, dict) or force:
        return
    _, flat = rundir.config_hash(cfg)
    diff = rundir.differing(there, flat, cfg)
    if diff:
        shown = ", ".join(f"{k}={there[k]} there, {flat[k]} here" for k in diff[:3])
        raise rundir.RunDirError(f"resume={cfg.resume}: the checkpoint is of another config ({shown}"
                                 f"{', ...' if len(diff) > 3 else ''}): resuming it would continue another run's state "
                                 "under this run's name; launch with that config, or pass resume_force=true to continue "
                                 "its state under this config")


def _last_record(path: pathlib.Path, step: int) -> dict[str, float]:
    return {k: v for r in report.read_jsonl(path) if r.get("step") == step
            for k, v in r.items() if k not in ("step", "time_s")}


def _logged(metrics: dict[str, Any], constants: set[str]) -> dict[str, Any]:
    """The metrics a log line holds: all but the constant injected hyperparameters."""
    return {k: v for k, v in metrics.items() if k not in constants}


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Metrics as Python floats: one host sync for all the tensor ones."""
    names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.ndim == 0]
    values = torch.stack([metrics[k].detach().float() for k in names]).tolist() if names else []
    out = dict(zip(names, values))
    out.update({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: out[k] for k in metrics if k in out}


def _stop_if_not_finite(record: dict[str, float], step: int, checkpoint: tuple[int, pathlib.Path] | None) -> None:
    bad = [k for k in ("loss", "test_loss") if k in record and not math.isfinite(record[k])]
    if bad:
        _raise_not_finite(f"{bad[0]} is {record[bad[0]]} at step {step}", checkpoint)


def _raise_not_finite(what: str, checkpoint: tuple[int, pathlib.Path] | None) -> None:
    kept = (f"the last good checkpoint is step {checkpoint[0]} ({checkpoint[1]})" if checkpoint
            else "no checkpoint was written yet")
    raise FloatingPointError(f"{what}: training stopped. metrics.jsonl ends at the last logged finite step and "
                             f"{kept}. With half-precision params (amp=pure_fp16, pure_bf16) the params "
                             "themselves overflow or stop moving: prefer amp=fp16 or amp=bf16 (float32 master "
                             "weights); otherwise a lower optim.chain.<name>.learning_rate often helps.")


def _check_metric_name(name: str, available: list[str], deferred: bool = False) -> None:
    """Refuses an ``optimized_metric`` the run does not have (``deferred``: eval hooks may add it, checked later)."""
    if name not in available and not deferred:
        raise ConfigError(f"optimized_metric={name} is not a metric of this run; "
                                f"it has: {', '.join(available)}")


def _resolved_yaml(cfg: DictConfig) -> str:
    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).splitlines()[0]) from None


# --- the Hydra app --------------------------------------------------------------------------------

@hydra.main(version_base="1.3", config_path=build.PRIMARY_CONFIG, config_name="train")
def _task(cfg: DictConfig) -> float:
    """Hydra's task function: one run (one job of a sweep) in Hydra's output directory."""
    out = pathlib.Path(HydraConfig.get().runtime.output_dir)
    # A setting's error prints as one line, without a traceback (HYDRA_FULL_ERROR=1 shows it).
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    with validate.one_line_errors(multirun=multirun):
        try:
            validate.check(cfg)  # a bad setting writes nothing where a run is, not even a failed summary.json
        except ConfigError as e:
            if multirun and distributed.rank_and_world()[0] == 0:  # a sweep job's own new directory: say why there
                rundir.write_refused(out, cfg, e)
            raise
        try:
            return train(cfg, out)
        except Exception as e:
            if distributed.rank_and_world()[0] == 0:  # a failed job still says why in its directory (and summary.csv)
                write_failure(out, cfg, e)
            raise


def _expose_launcher() -> None:
    """Puts fxtrain's launcher directory on ``hydra_plugins.__path__``, where Hydra's plugin scan lists it.

    An editable install (``pip install -e .``, what ``make`` does) reaches ``hydra_plugins.fxtrain_vmap_launcher``
    through setuptools' import hook, which the scan (``pkgutil.iter_modules``) cannot list: from outside the
    checkout, ``hydra/launcher=vmap`` would be an unknown plugin. A wheel install needs nothing.
    """
    import hydra_plugins

    spec = importlib.util.find_spec("hydra_plugins.fxtrain_vmap_launcher")
    if spec is not None and spec.origin is not None:
        where = str(pathlib.Path(spec.origin).parent.parent)
        if where not in list(hydra_plugins.__path__):
            hydra_plugins.__path__.append(where)


def main(argv: list[str] | None = None) -> None:
    """``python -m fxtrain.train [overrides]``: checks group choices, joins torchrun's group, runs Hydra."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _expose_launcher()
    try:
        build.check_overrides(argv)  # every entry of Hydra's search path: --config-dir, hydra.searchpath
    except ConfigError as e:
        raise SystemExit(f"Error: {e}") from None
    rank, world = distributed.init_from_env()
    if world > 1:
        # One run directory for all ranks (no per-rank timestamps); only rank 0 writes Hydra's files and logs.
        os.environ["FXTRAIN_RUN_STAMP"] = distributed.shared_stamp()
        if rank > 0:
            argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "fxtrain.train", *argv]
    try:
        _task()
    finally:
        sys.argv = saved_argv
        report.finish_sweep()  # the summary table of a sweep that stopped on a failed job
        distributed.shutdown()


if __name__ == "__main__":
    main()
