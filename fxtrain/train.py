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
  (:mod:`fxtrain.run_hooks`).

Both verify the checkpoint first (:func:`fxtrain.checkpoint.verify`; nothing in it is read by a loader that
runs code): ``resume=auto`` goes back past a newest checkpoint that does not verify to the previous one,
naming the damaged one in a warning (none verifying is an error, never a silent start at step 0). The world
size and the parallel layout are part of the run (recorded in ``run.json`` and every checkpoint's manifest):
resuming on another is refused unless ``resume_relayout=true`` (the checkpoint is resharded: every leaf's value
placed as the new layout's; the start line says ``relayout from 2 ranks, parallel=dp [dp=2] to 1 process,
parallel=none``). From inside an accumulation window (a held gradient sum) a relayout continues only into
layouts that hold their sums as plain tensors (``parallel=none``, ``parallel=pp``); into the others it is
refused before any step (resume from a window boundary instead).

In both cases ``metrics.jsonl`` is cut back to the checkpoint's step before training goes on (the lines
a killed run logged after its last checkpoint are logged again by the resumed one), so it holds every
logged step exactly once; ``summary.json`` and checkpoints after that step are removed
(:func:`fxtrain.rundir.rewind`). The resumed run computes what the uninterrupted one would have: same
batches (``data.train[step]``), same RNG, same optimizer state, bit for bit; only ``time_s`` restarts from 0.

**Debug runs** (the ``debug`` group, ``conf/debug/``; :func:`debug_settings`): ``debug=fast`` (3 steps, validation
and test on 2 batches, no checkpoints), ``overfit`` (one batch every step: :func:`fxtrain.data.overfit`), ``limit``
(fractions or counts of each split: :func:`fxtrain.data.limited`), ``profile`` (``torch.profiler`` over a few steps:
:class:`StepProfiler`). Without a progress bar a ``beat`` line comes every ``trainer.heartbeat_s`` seconds
(:class:`Heartbeat`).

**A run directory belongs to one run** (:mod:`fxtrain.rundir`): relaunching another config into it is
refused, and so is the same config with ``resume=null`` (use ``resume=auto``); one live process holds it
(a lock naming its pid and host); ``keep_last`` deletes only this run's older checkpoints. A launch is
refused (one line) or accepted before the directory gets its first file: the directory is checked, the resume's
checkpoint verified and loaded, the data split and the model built, and only then taken
(:meth:`fxtrain.rundir.Claim.accept`), so a refused launch writes nothing, into a fresh directory either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import importlib.util
import json
import logging
import math
import os
import pathlib
import shutil
import sys
import time
from typing import Any, Callable, NamedTuple, Protocol

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import fxtrain as fx
from fxtrain.errors import ConfigError
from fxtrain import (build, checkpoint, distributed, float8, loggers, parallel, report, rundir, schema, selection,
                     tasks, tree, validate)
from fxtrain import run_hooks as orbax_hooks  # resume=orbax:PATH, trainer.export=orbax
from fxtrain import data as fxdata
from fxtrain.data import batches_per_epoch
from fxtrain.models import count_params
from fxtrain.parallel import evaluate, loss_function  # noqa: F401 - the runner's loss and evaluation (experiments use them)

log = logging.getLogger("fxtrain")
# conf/ at the repository root, installed as the package fxtrain.conf (pyproject.toml maps it): Hydra reads it as
# pkg://fxtrain.conf from a checkout and from a wheel alike; CONF_DIR is where it lies (for compose in tests).
CONF_DIR = pathlib.Path(str(importlib.resources.files("fxtrain.conf")))


def train(cfg: DictConfig, out_dir: str | pathlib.Path | None = None,
          checked: validate.Checked | None = None) -> float:
    """Trains the experiment ``cfg`` describes and returns ``float(metrics[cfg.optimized_metric])``.

    Args:
      cfg: a composed ``conf/train.yaml`` (Hydra hands it over; tests use ``hydra.compose``).
      out_dir: the run directory; ``None`` writes nothing. Only rank 0 writes.
      checked: what :func:`fxtrain.validate.check` built from ``cfg`` (task, eval hooks, early stopping) when
        the caller checked it already (``python -m fxtrain.train`` does); ``None``: checked here.

    Raises:
      FloatingPointError: a non-finite loss or metric; training stops there, and ``metrics.jsonl`` and
        ``checkpoints/`` keep the last finite step.
      fxtrain.errors.ConfigError: a config that cannot be built, naming the key.
      fxtrain.rundir.RunDirError: ``out_dir`` holds another run, this run without ``resume``, or a live process.
    """
    if checked is None:
        checked = check(cfg)
    # One run, one live process per directory (fxtrain/rundir.py), taken once nothing can refuse the launch any more.
    with rundir.claim(out_dir, cfg, defer=True) as claimed:
        return _train(cfg, out_dir, checked, claimed)


def check(cfg: DictConfig) -> validate.Checked:
    """``cfg`` parsed and checked once, before anything is written: its ``optimized_metric`` settled (the task's
    own where the config leaves it to the task, a ``_target_`` function's) and :func:`fxtrain.validate.check`'s
    objects (the task, the eval hooks, early stopping), which the run uses."""
    build.settle_optimized_metric(cfg)
    settle_max_steps(cfg)
    shorten_for_debug(cfg)
    return validate.check(cfg)


def settle_max_steps(cfg: DictConfig) -> int:
    """``trainer.max_steps`` of a run given in epochs (``trainer.max_epochs``: epochs x the data's batches per epoch,
    :func:`fxtrain.data.batches_per_epoch`), set before anything reads it (schedules, warmup and the log and eval
    cadences interpolate ``${trainer.max_steps}``); returns it. Exactly one of the two is set, or one line."""
    epochs, steps = cfg.trainer.get("max_epochs"), cfg.trainer.get("max_steps")
    if epochs is None:
        if steps is None:
            raise ConfigError("trainer.max_steps=null and trainer.max_epochs=null: set one of them "
                              "(trainer.max_steps=1000, or trainer.max_epochs=5 trainer.max_steps=null)")
        return steps
    if steps is not None:
        raise ConfigError(f"trainer.max_epochs={epochs} and trainer.max_steps={steps}: set one of them "
                          f"(trainer.max_epochs={epochs} trainer.max_steps=null)")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ConfigError(f"trainer.max_epochs={epochs!r}: expected a positive whole number of passes over the "
                          "training split; e.g. trainer.max_epochs=5")
    per_epoch = batches_per_epoch(debug_data(cfg, build.dataset(cfg.data, "data")))
    if per_epoch is None:
        raise ConfigError(f"trainer.max_epochs={epochs}: data ({cfg.data.get('_target_')}) does not say how many "
                          "batches an epoch holds (an iterable without len()); give trainer.max_steps instead")
    with open_dict(cfg):
        cfg.trainer.max_steps = epochs * per_epoch
    return cfg.trainer.max_steps


def _train(cfg: DictConfig, out_dir: str | pathlib.Path | None, checked: validate.Checked,
           claimed: rundir.Claim) -> float:
    t0 = time.perf_counter()
    run = plan_run(cfg, out_dir)
    if run.source == "completed":  # resume=auto on a finished run: leave it as it is
        run.say(f"resume=auto: {out_dir} completed {cfg.trainer.max_steps} steps already; nothing to do")
        return float(rundir.read_summary(out_dir)["value"])
    run = place_run(cfg, run)
    built = build_run(cfg, run.device, run.dims, task=checked.task)
    state, resumed = load_start(cfg, run, built)
    claimed.accept()  # nothing refused the launch (resume, data, model, layout): the directory gets its first files
    write_config(cfg, run)
    for line in begin_run(cfg, run, built, state, resumed):
        run.say(line)
    steps = RunSteps(built, run.dims, state, cfg.trainer.eval_batch_size)
    member = Member(cfg, run, checked.hooks, checked.stopper)
    loop(steps, [member], state.step, cfg.trainer, t0)
    if member.error is not None:
        raise member.error
    run.say(steps.data_line())
    return close_run(cfg, run, built, steps.state(cfg.trainer.max_steps, 0), member.final, time.perf_counter() - t0,
                     member.best, member.logger)


class Run(NamedTuple):
    """Where and how one run goes: what :func:`plan_run` reads from the config and the environment once."""

    rank: int
    dims: distributed.ParallelDims  # the run's mesh object (built by start_run): the model, stack, data, checkpoints
    device: torch.device
    out: pathlib.Path | None  # the run directory on rank 0 (the only writer of files other than checkpoints)
    ckpt_dir: pathlib.Path | None  # every rank writes its shards here
    source: pathlib.Path | str | None  # the checkpoint to resume from, or "completed"
    say: Callable[[str], Any]
    meta: dict[str, Any] | None = None  # recorded in every checkpoint's manifest: config hash, world size, layout
    note: str | None = None  # how the resume differs ("relayout from 2 ranks, parallel=dp [dp=2] to 1 process")


def plan_run(cfg: DictConfig, out_dir: str | pathlib.Path | None, say: Callable[[str], Any] | None = None) -> Run:
    """The :class:`Run` of ``cfg`` in ``out_dir`` (``say``: where its lines go; rank 0's log by default), its
    checkpoint to resume from checked (:func:`resume_plan`). Writes nothing."""
    rank, world = distributed.rank_and_world()
    dims = build.parallel_dims(cfg, world)  # checked before anything is written
    say = say or (log.info if rank == 0 else (lambda *args: None))
    out = pathlib.Path(out_dir) if out_dir is not None and rank == 0 else None
    keeps = debug_settings(cfg)["checkpoints"]  # debug.checkpoints=false: none written, none resumed
    ckpt_dir = pathlib.Path(out_dir) / "checkpoints" if out_dir is not None and keeps else None
    digest, flat = rundir.config_hash(cfg)
    meta = {"config_sha256": digest, "config": flat, "world_size": world, "layout": dims.describe()}
    source, note = resume_plan(cfg, ckpt_dir, meta)
    return Run(rank, dims, distributed.device(cfg.trainer.device), out, ckpt_dir, source, say, meta, note)


def start_run(cfg: DictConfig, run: Run) -> Run:
    """Writes ``config.yaml`` (resolved) into the run directory, sets ``trainer.cpu_threads`` and builds the
    mesh: the :class:`Run` that :func:`build_run` builds on (:func:`place_run`, then :func:`write_config`)."""
    write_config(cfg, run)
    return place_run(cfg, run)


def place_run(cfg: DictConfig, run: Run) -> Run:
    """Sets ``trainer.cpu_threads`` and builds the mesh: the :class:`Run` that :func:`build_run` builds on.
    Writes nothing."""
    if run.device.type == "cpu" and cfg.trainer.cpu_threads:
        torch.set_num_threads(cfg.trainer.cpu_threads)
    return run._replace(dims=run.dims.build(run.device.type))


def write_config(cfg: DictConfig, run: Run) -> None:
    """Writes ``config.yaml`` (resolved) into the run directory (none without one)."""
    if run.out is not None:
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "config.yaml").write_text(resolved_yaml(cfg))


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
    sharded: bool = False  #: ``data.train[k]`` is this rank's share already (:func:`fxtrain.data.for_rank`)

    def batch(self, k: int, dims: distributed.ParallelDims) -> Any:
        """This rank's batch of step ``k`` on ``dims``: ``data.train[k]`` where the data is split per rank already
        (``sharded``), else this rank's slice of the global batch (``dims.local_batch``). Ranks that use the same
        slice (tp and pp peers) read it once: the first of their group reads it and broadcasts it to the others
        (:func:`fxtrain.distributed.broadcast_batch`), which read nothing."""
        if not dims.reads_data:
            return distributed.broadcast_batch(None, dims.mesh, dims.data_peers)
        batch = self.data.train[k] if self.sharded else dims.local_batch(self.data.train[k])
        return distributed.broadcast_batch(batch, dims.mesh, dims.data_peers)


def build_run(cfg: DictConfig, device: torch.device, dims: distributed.ParallelDims | None = None,
              data: Any = None, task: tasks.Task | None = None) -> Built:
    """What :func:`train` builds from ``cfg`` before its loop, in this order after ``torch.manual_seed(cfg.seed)``:
    the data, the model, the task (:mod:`fxtrain.tasks`), the stack (:func:`fxtrain.build.stack`), the model
    placed on ``dims``' mesh with its step (:func:`fxtrain.parallel.parallelize`) and the stack's state.

    ``task``: the one :func:`check` built (``None`` builds it). The sweep launcher (``hydra/launcher=vmap``)
    builds each job of a group with it, so every job starts from exactly the params, state and RNG state its
    own run would. It passes ``data`` (built already, for the same ``cfg.data``) to share one dataset between
    jobs, when building it draws no torch random numbers. A debug run's limits apply to either
    (:func:`debug_data`).
    """
    dims = dims or distributed.ParallelDims.of(world=1)
    torch.manual_seed(cfg.seed)  # params init (the data has its own seeded order): the same on every rank
    data = build.dataset(cfg.data, choice("data", "data")).to(device) if data is None else data
    data = debug_data(cfg, data)  # debug.limit_*, debug.overfit_batches
    # each data-parallel rank reads only its share of every global batch (where the source can split itself)
    data, sharded = fxdata.for_rank(data, dims.data_rank, dims.data_world)
    if dims.data_world > 1:
        _check_whole_reads(data, sharded, dims)
    model = build.model(cfg).to(device)
    build.float8(cfg, model, device)  # amp=float8: Float8Linear layers, before the model is placed
    task = build.task(cfg) if task is None else task
    tx = build.stack(cfg, dims)
    try:
        placed = parallel.parallelize(model, tx, dims, task=task, pipeline=_pipeline_options(cfg),
                                        mp_policy=build.mixed_precision(cfg, dims),
                                        activation_checkpoint=cfg.model.get("activation_checkpoint", "none"),
                                        compile=bool(cfg.trainer.get("compile", False)))
    except ValueError as e:
        # the layout once (parallelize's own checks start with it), the model's option where a Hydra run has one
        layout, shown, text = dims.describe(), choice("model", ""), str(e)
        text = text[len(layout) + 2:] if text.startswith(layout + ": ") else text
        raise ConfigError(f"{layout}{f' model={shown}' if shown else ''}: {text}") from None
    params = build.cast_params(cfg, placed.params)  # bf16/fp16 storage for the pure half amp modes; else unchanged
    return Built(data, model, placed.apply, params, placed.buffers, tx, tx.init(params), placed.step, placed.evaluate,
                 task, sharded)


def _check_whole_reads(data: fxdata.Dataset, sharded: bool, dims: distributed.ParallelDims) -> None:
    """Refuses, in one line and on every rank, a stream that every data-parallel rank reads whole (it does not
    split by rank) when the ranks read different first global batches: each would keep its share of another
    batch. One all-gather of a number per rank, at start-up (:func:`fxtrain.data.whole_batch_fingerprint`)."""
    seen = distributed.gather_objects(fxdata.whole_batch_fingerprint(data, sharded))
    if len({s for s in seen if s is not None}) > 1:
        raise ConfigError(f"data: {data.name}'s training stream is not split by rank (each of the {dims.data_world} "
                          "data-parallel ranks reads the whole batch and keeps its share), and the ranks read "
                          "different first batches: its order differs between processes. Seed its shuffles, give it "
                          "shard(rank, world) (or use a grain.MapDataset, which fxtrain splits by rank), or train on "
                          "one data-parallel rank")


def load_start(cfg: DictConfig, run: Run, built: Built) -> tuple[fx.TrainState, str]:
    """The state training starts from, the checkpoint's (``resume``) or step 0's, and how (for the ``start``
    line). The checkpoint is read into ``built``'s params and buffers in place and its RNG state set; writes
    nothing."""
    start, params, opt_state, buffers, resumed = 0, built.params, built.opt_state, built.buffers, "from step 0"
    orbax = orbax_hooks.start(cfg, built.model, params, buffers, built.tx, run.dims.world)  # resume=orbax:PATH
    if orbax is not None:
        start, opt_state, resumed = orbax
    elif isinstance(run.source, pathlib.Path):
        # On the same layout a held gradient keeps its placements (they may differ from its param's); on another
        # (resume_relayout: run.note), every leaf's value is placed as this layout's tree, and a pipeline stage
        # reads its part of a whole model's checkpoint.
        relayout = run.note is not None
        try:
            state = fx.load(run.source, like=fx.TrainState(0, params, opt_state, fx.rng_state(), buffers),
                            saved_placements=not relayout, part=relayout and run.dims.enabled("pp"))
        except fx.CheckpointError as e:  # another model's or stack's checkpoint: a refused launch, in one line
            raise rundir.RunDirError(f"resume={cfg.get('resume')}: {e}") from None
        # Into the built trees, in place: FSDP and pipeline stages compute with their modules' own tensors,
        # which these leaves are (a new tree would train a copy the module never sees).
        with torch.no_grad():
            tree.copy_(tree.leaves(params), tree.leaves(state.params))
            tree.copy_(tree.leaves(buffers), tree.leaves(state.buffers))
        start, opt_state = state.step, state.opt_state
        if relayout:
            _check_held_relayout(cfg, run, start)
        _resume_data(run, built.data, start)
        fx.set_rng_state(state.rng)
        if start > cfg.trainer.max_steps:
            raise ConfigError(f"resume: the checkpoint {run.source} is at step {start}, beyond "
                                    f"trainer.max_steps={cfg.trainer.max_steps}")
        resumed = f"from {run.source} (step {start})" + (f", {run.note}" if run.note else "")
    elif cfg.get("resume") == "auto":
        resumed = f"from step 0 (resume=auto: no checkpoint in {run.ckpt_dir})"
    return fx.TrainState(start, params, opt_state, fx.rng_state(), buffers), resumed


def _resume_data(run: Run, data: Any, start: int) -> None:
    """Puts a training stream at the checkpoint's position (the state its checkpoint recorded for this rank), or
    refuses the resume in one line where it has no state (fxtrain does not replay a stream). Batches addressed by
    step (tensors, map-style, windows) need nothing: the step is their position, and the loader starts there."""
    refusal = fxdata.resume_refusal(data, start)
    if refusal is not None:
        raise ConfigError(f"resume: {refusal}")
    if start == 0 or fxdata.stream_state(data) is None:
        return
    recorded = checkpoint.verify(run.source)["meta"].get("data")
    if recorded is None:
        raise ConfigError(f"resume: the checkpoint {run.source} records no position of {data.name}'s training stream "
                          "(written before streams recorded one); start afresh (resume=null)")
    states = recorded["states"]
    read = [s for s in states if s is not None]  # None: a rank that received its batches from a tp or pp peer
    if run.note is None and len(states) == run.dims.world:  # the same layout: each rank its own position
        state = states[run.rank]
    elif all(s == read[0] for s in read):  # another layout: every rank that read was at the same position
        state = read[0]
    else:
        raise ConfigError(f"resume: the checkpoint {run.source} holds {len(states)} ranks' positions in "
                          f"{data.name}'s training stream, each its own share, which do not carry over to another "
                          "layout: resume on the checkpoint's layout, or start afresh (resume=null)")
    if state is not None:  # None: this rank receives its batches from a peer (the same layout), and reads none
        fxdata.load_stream_state(data, state)


def _check_held_relayout(cfg: DictConfig, run: Run, step: int) -> None:
    """Refuses a relayout from inside an accumulation window into a layout whose gradients are not plain tensors.

    A checkpoint inside a window holds the sum of its first micro-batches' gradients, loaded here as its value
    placed like this layout's params. Plain-tensor layouts (one process, pipeline stages) add the next
    gradients to it as they are. The others hold their sums in another form than their params: data-parallel
    replicas as per-rank ``Partial`` terms, FSDP as each rank's unsharded sum, tensor parallel with some
    gradients ``Replicate`` beside ``Shard`` params; the value would be counted once per rank or not fit
    (issue 35: tp -> dp mid-window crashed at its first step, or added the held sum twice).
    """
    every = cfg.accumulate.every
    plain = not any(run.dims.enabled(d) for d in ("dp_replicate", "dp_shard", "cp", "tp", "ep"))
    if every > 1 and step % every and not plain:
        raise ConfigError(f"resume_relayout=true: the checkpoint {run.source} is at step {step}, inside an "
                          f"accumulation window (accumulate.every={every}: {step % every} micro-batches' gradient "
                          f"sum held), which {run.dims.describe()} cannot continue exactly (it holds the sum in "
                          "another form per rank); resume from a checkpoint at a window boundary (a step that is "
                          f"a multiple of {every}; trainer.checkpoint_every={every} writes them), on the "
                          "checkpoint's own layout, or into parallel=none or parallel=pp")


def begin_run(cfg: DictConfig, run: Run, built: Built, state: fx.TrainState, resumed: str,
              where: str | None = None) -> list[str]:
    """Cuts the run directory back to ``state.step`` (:func:`fxtrain.rundir.rewind`: one timeline) and returns
    the run's first lines: ``run`` (``where``: how it runs, default its layout), ``debug`` (a debug run's),
    ``data``, ``model``, ``task``, ``stack``, ``state`` and ``start``."""
    rundir.rewind(run.out, state.step)  # no summary, no checkpoint or metrics.jsonl line after the start
    dims = run.dims
    if where is None and dims.world > 1:
        where = (f"{dims.world} ranks, {dims.describe()}"
                 + (", shard_optimizer" if cfg.parallel.get("shard_optimizer") else ""))
    where = where or build.single_process_note(cfg, dims)  # parallel=tp on one process: nothing is split, say so
    described = describe_run(built.data, built.model, state.params, built.tx, state.opt_state, run.device,
                             task=built.task)
    if dims.data_world > 1 and not built.sharded:  # the data line says what the ranks read
        described[0] += (f"; not split by rank: each of {dims.data_world} data-parallel ranks reads the whole batch "
                         "and keeps its share")
    return [f"run    {run.out if run.out is not None else '(not saved)'}" + (f"  [{where}]" if where else ""),
            *debug_lines(cfg), *described, run_length(cfg, built.data), f"start  {resumed}"]


def run_length(cfg: DictConfig, data: Any) -> str:
    """The ``steps`` line: the run's length in steps and in epochs (``trainer.max_epochs`` or ``max_steps``).

    >>> from omegaconf import OmegaConf
    >>> from fxtrain.data import synthetic
    >>> run_length(OmegaConf.create({"trainer": {"max_steps": 15, "max_epochs": None}}), synthetic(num_examples=256))
    'steps  15 = 2.5 epochs of 6 batches'
    """
    steps, per_epoch = cfg.trainer.max_steps, batches_per_epoch(data)
    if per_epoch is None:
        return f"steps  {steps} (epochs: the data does not say its length)"
    epochs = cfg.trainer.get("max_epochs") or f"{steps / per_epoch:.3g}"
    return f"steps  {steps} = {epochs} epochs of {per_epoch} batches"


# --- debug runs (the debug group: conf/debug/) -----------------------------------------------------------

# What a run without debug=... has; conf/debug/_settings.yaml gives every debug option these keys.
DEBUG_DEFAULTS = {name: info.default for name, info in schema.Debug.model_fields.items()}
PROFILE_TRACE = "profile_trace.json"  # debug=profile's chrome trace, in the run directory
KINETO_QUIET = "6"  # KINETO_LOG_LEVEL that keeps torch.profiler's engine from writing to stderr


def debug_settings(cfg: DictConfig) -> dict[str, Any]:
    """The ``debug`` node of ``cfg`` (``debug=fast``, ``overfit``, ``limit``, ``profile``) over
    :data:`DEBUG_DEFAULTS`: what a run does differently. Checked by :func:`fxtrain.validate.check`.

    >>> from omegaconf import OmegaConf
    >>> debug_settings(OmegaConf.create({"debug": {"name": "fast", "checkpoints": False}}))["checkpoints"]
    False
    >>> debug_settings(OmegaConf.create({}))["overfit_batches"]
    0
    """
    node = cfg.get("debug") or {}
    return {**DEBUG_DEFAULTS, **{k: node[k] for k in node}}


def shorten_for_debug(cfg: DictConfig) -> dict[str, tuple[int, int]]:
    """With ``debug.shorten`` (``debug=fast``, ``profile``, ``overfit``): ``schedule.warmup_steps`` and
    ``accumulate.every`` that do not fit ``trainer.max_steps`` shortened in ``cfg`` so that any experiment
    runs in a debug run's few steps; returns ``{key: (the config's value, the run's)}``, also kept in
    ``debug.shortened`` (the ``debug`` line says it, ``config.yaml`` records it). A warmup as long as the run
    becomes half of it; an accumulation that does not divide the run, the largest divisor below it.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"debug": {"shorten": True}, "trainer": {"max_steps": 3},
    ...                         "accumulate": {"every": 4}, "schedule": {"warmup_steps": 80}})
    >>> shorten_for_debug(cfg)
    {'accumulate.every': (4, 3), 'schedule.warmup_steps': (80, 1)}
    """
    steps = cfg.trainer.max_steps
    if debug_settings(cfg)["shorten"] is not True or type(steps) is not int or steps < 1:  # validate names the key
        return {}
    changed = {}
    every = OmegaConf.select(cfg, "accumulate.every")
    if type(every) is int and every > 1 and steps % every:
        changed["accumulate.every"] = (every, max(d for d in range(1, min(every, steps) + 1) if steps % d == 0))
    warmup = OmegaConf.select(cfg, "schedule.warmup_steps") if OmegaConf.is_dict(cfg.get("schedule")) else None
    if type(warmup) is int and warmup >= steps:
        changed["schedule.warmup_steps"] = (warmup, steps // 2)
    with open_dict(cfg):
        for key, (_, value) in changed.items():
            OmegaConf.update(cfg, key, value)
        if changed:
            cfg.debug.shortened = {**(cfg.debug.get("shortened") or {}), **{k: was for k, (was, _) in changed.items()}}
    return changed


def debug_data(cfg: DictConfig, data: fxdata.Dataset) -> fxdata.Dataset:
    """``data`` as a debug run reads it: ``debug.overfit_batches`` (:func:`fxtrain.data.overfit`) or the
    ``debug.limit_*`` of each split (:func:`fxtrain.data.limited`); ``data`` itself otherwise."""
    debug = debug_settings(cfg)
    try:
        if debug["overfit_batches"]:
            return fxdata.overfit(data, debug["overfit_batches"])
        limits = {k: debug[k] for k in ("limit_train", "limit_val", "limit_test") if debug[k] is not None}
        return fxdata.limited(data, **limits, eval_batch_size=cfg.trainer.eval_batch_size) if limits else data
    except ValueError as e:
        raise ConfigError(f"debug.{e}") from None


def debug_lines(cfg: DictConfig) -> list[str]:
    """A debug run's ``debug`` line (none for a run): which option and what it changes.

    >>> from omegaconf import OmegaConf
    >>> debug_lines(OmegaConf.create({"debug": {"name": "fast", "checkpoints": False, "limit_val": 2}}))
    ['debug  debug=fast: no checkpoints (nothing for resume=auto), limit_val=2']
    """
    debug = debug_settings(cfg)
    if debug == DEBUG_DEFAULTS:
        return []
    said = [] if debug["checkpoints"] else ["no checkpoints (nothing for resume=auto)"]
    if debug["overfit_batches"]:
        said.append(f"overfit {debug['overfit_batches']} training batch(es), which validation and test read too")
    said += [f"{k}={debug[k]}" for k in ("limit_train", "limit_val", "limit_test") if debug[k] is not None]
    if debug["profile_steps"]:
        first = debug["profile_wait"] + 1
        said.append(f"torch.profiler over steps {first}..{first + debug['profile_steps'] - 1} ({PROFILE_TRACE})")
    if debug["shortened"]:
        said.append(f"shortened to fit trainer.max_steps={cfg.trainer.max_steps}: " + ", ".join(
            f"{k} {was} -> {OmegaConf.select(cfg, k)}" for k, was in debug["shortened"].items()))
    return [f"debug  debug={debug['name'] or 'custom'}: " + ", ".join(said)]


class Heartbeat:
    """A ``beat`` line at least every ``every`` seconds of training when no progress bar shows (``trainer.progress
    =false``, stderr not a terminal, a launcher's log): the step, the time since the run started, steps per
    second since the loop did, and the last logged loss. ``every`` 0 or ``None``: no line."""

    def __init__(self, every: float | None, start: int, max_steps: int, say: Callable[[str], Any], t0: float):
        self.every, self.start, self.max_steps, self.say, self.t0 = every, start, max_steps, say, t0
        self.began = time.perf_counter()
        self.due = self.began + every if every else math.inf

    def __call__(self, step: int, loss: float | None) -> None:
        now = time.perf_counter()
        if now < self.due:
            return
        self.due = now + self.every
        rate = (step - self.start) / max(now - self.began, 1e-9)
        shown = f"{loss:.4g}" if loss is not None else "- (none logged yet)"
        self.say(f"beat   step {step}/{self.max_steps} | {now - self.t0:.1f} s | {rate:.3g} steps/s | loss {shown}")


class StepProfiler:
    """``debug.profile_steps``: ``torch.profiler`` records steps ``start + wait + 1`` on (at least ``steps`` of
    them: a vmapped group advances several at once), then writes the chrome trace ``profile_trace.json`` into
    each run directory of ``outs`` (``chrome://tracing``, https://ui.perfetto.dev) and says the top ops."""

    def __init__(self, steps: int, wait: int, start: int, outs: list[pathlib.Path], say: Callable[[str], Any],
                 device: torch.device):
        self.steps, self.first, self.outs, self.say, self.device = steps, start + wait, outs, say, device
        self.profile: torch.profiler.profile | None = None
        self.began: int | None = None
        self.done = steps == 0

    def before(self, first: int) -> None:
        """Starts recording when the steps from ``first + 1`` on are to be recorded."""
        if self.done or self.profile is not None or first < self.first:
            return
        # kineto (torch.profiler's engine) writes its own lines to stderr ("USDT:... profiler_start", "STAGE:...");
        # it reads KINETO_LOG_LEVEL once, when the process first profiles: 6 is above its highest level (USDT, 5).
        # A KINETO_LOG_LEVEL of the user's own is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile, self.began = torch.profiler.profile(activities=activities), first
        self.profile.start()

    def after(self, end: int, last: bool = False) -> None:
        """Stops once ``steps`` steps are recorded (or ``last``: the loop ends), then writes and says."""
        if self.profile is None or self.done or (end - self.began < self.steps and not last):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profile.stop()
        self.done = True
        if self.outs:  # a trace is exported once: a vmapped group's other jobs get a copy of it
            self.profile.export_chrome_trace(str(self.outs[0] / PROFILE_TRACE))
            for out in self.outs[1:]:
                shutil.copyfile(self.outs[0] / PROFILE_TRACE, out / PROFILE_TRACE)
        by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = self.profile.key_averages().table(sort_by=by, row_limit=12)
        where = ", ".join(str(out / PROFILE_TRACE) for out in self.outs) or "(no run directory)"
        self.say(f"profile steps {self.began + 1}..{end}: {where}; top ops by {by}:\n{table}")


# --- the loop: one run, or the members of a vmapped group (fxtrain.sweep) ---------------------------

class Steps(Protocol):
    """What :func:`loop` drives: one run's params (:class:`RunSteps`) or a vmapped group's, stacked with a leading
    member axis (:mod:`fxtrain.sweep`). Member ``j`` is ``0`` for a run."""

    desc: str  #: the progress bar's label
    longest: int  #: the most steps one :meth:`advance` runs (it stops earlier where anything is logged or saved)
    constants: set[str]  #: reports of the stack that are constant (``b1``, ``eps``...): never logged

    def advance(self, first: int, end: int) -> dict[str, Any]:
        """Trains steps ``first + 1 .. end`` (batches ``data.train[first:end]``); returns the last one's metrics."""

    def logged(self, metrics: dict[str, Any], j: int) -> dict[str, float]:
        """Member ``j``'s train metrics of a log line (floats, less the constants; averaged over ranks)."""

    def evaluate(self, step: int, j: int, hooks: list[tuple[str, Callable]]) -> dict[str, float]:
        """Member ``j``'s eval metrics now: the task's and each eval hook's."""

    def state(self, step: int, j: int) -> fx.TrainState:
        """Member ``j``'s :class:`fxtrain.TrainState` now (what its checkpoint holds)."""


class RunSteps:
    """The :class:`Steps` of one run: its built step on this rank's slice of each batch, one step per call."""

    desc, longest = "train", 1

    def __init__(self, built: Built, dims: distributed.ParallelDims, state: fx.TrainState, eval_batch_size: int):
        self.built, self.dims, self.eval_batch_size = built, dims, eval_batch_size
        self.params, self.opt_state, self.buffers = state.params, state.opt_state, state.buffers
        self.constants = fx.traits(built.tx).constant_reports  # b1, eps...: constant, in config.yaml
        self.waited = self.stepped = 0.0  # seconds waiting for batches, and in advance() in all

    def advance(self, first: int, end: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        for i in range(first + 1, end + 1):
            t = time.perf_counter()
            batch = self.built.batch(i - 1, self.dims)
            self.waited += time.perf_counter() - t
            self.params, self.opt_state, self.buffers, metrics = self.built.step(self.params, self.opt_state,
                                                                                 self.buffers, batch)
        self.stepped += time.perf_counter() - t0
        return metrics

    def data_line(self) -> str:
        """How much of the training loop waited for batches (the run's ``loader`` line at its end)."""
        share = self.waited / self.stepped if self.stepped else 0.0
        return (f"loader waited {share:.1%} of the training steps' time for batches ({self.waited:.2f} s of "
                f"{self.stepped:.2f} s)")

    def data_state(self) -> dict[str, Any] | None:
        """Every rank's position in a training stream, for the checkpoint (``None``: batches addressed by step); a
        rank that receives its batches from a tp or pp peer (:meth:`Built.batch`) reads none and records ``None``."""
        state = fxdata.stream_state(self.built.data)
        if state is None:
            return None
        return {"states": distributed.gather_objects(state if self.dims.reads_data else None)}

    def logged(self, metrics: dict[str, Any], j: int) -> dict[str, float]:
        return host_metrics(metrics, self.constants, self.dims.world)

    def evaluate(self, step: int, j: int, hooks: list[tuple[str, Callable]]) -> dict[str, float]:
        return evaluate_run(self.built, self.params, self.buffers, step, hooks, self.eval_batch_size, self.dims.world)

    def state(self, step: int, j: int) -> fx.TrainState:
        return fx.TrainState(step, self.params, self.opt_state, fx.rng_state(), self.buffers)


@dataclasses.dataclass
class Member:
    """One run in :func:`loop`: its config, directory and early stopping, and what it logged. A run is one
    member; a vmapped group has one per job, which fails or stops early alone (``error``, ``final``)."""

    cfg: DictConfig
    run: Run
    hooks: list[tuple[str, Callable]] = dataclasses.field(default_factory=list)  #: trainer.eval_hooks, built
    stopper: tasks.EarlyStopping | None = None  #: trainer.early_stopping, built
    best: selection.Best | None = None  #: the best step by trainer.checkpoint.best_by, its state kept
    train_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  #: the last logged ones
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    stopped: dict[str, Any] = dataclasses.field(default_factory=dict)  #: where early stopping ended it
    last_checkpoint: tuple[int, pathlib.Path] | None = None  #: ``(step, path)``
    record: dict[str, float] = dataclasses.field(default_factory=dict)  #: the last metrics.jsonl line
    logger: loggers.Loggers | None = None  #: metrics.jsonl and the configured loggers, open in the loop
    final: dict[str, Any] | None = None  #: the last train and eval metrics (and ``stopped_early``) once done
    last: fx.TrainState | None = None  #: its state where it ended (its max_steps, or where it stopped early)
    error: BaseException | None = None  #: why it failed
    cadence: Cadence | None = None  #: its ``trainer`` cadences, read once by :func:`loop`


class Cadence(NamedTuple):
    """A run's step counts, read once from its ``trainer`` node for the loop: the default cadences are resolver
    interpolations (``${fxtrain.every:${trainer.max_steps},40}``) that OmegaConf would parse again at every read,
    which read at every step cost more than a small model's step.

    >>> from omegaconf import OmegaConf
    >>> Cadence.of(OmegaConf.create({"max_steps": 30, "log_every": 5, "eval_every": 7, "checkpoint_every": 0}))
    Cadence(max_steps=30, log_every=5, eval_every=7, checkpoint_every=0)
    """

    max_steps: int
    log_every: int
    eval_every: int
    checkpoint_every: int  # 0: only at the end

    @classmethod
    def of(cls, trainer: DictConfig) -> Cadence:
        return cls(trainer.max_steps, trainer.log_every, trainer.eval_every, trainer.checkpoint_every or 0)


def loop(steps: Steps, members: list[Member], start: int, trainer: DictConfig, t0: float) -> None:
    """Steps ``start + 1 .. trainer.max_steps`` of every member: step, log, evaluate, checkpoint. A member ends
    alone at its own ``trainer.max_steps`` (the members of a vmapped group may differ in it and in their log, eval
    and checkpoint cadences, each read from the member's config), where ``trainer.early_stopping`` says so, or
    where a loss or metric is not finite (its ``error``). Sets each member's ``final`` and ``last`` (or ``error``).

    Without a progress bar (``trainer.progress=false`` or stderr not a terminal) a :class:`Heartbeat` line comes
    every ``trainer.heartbeat_s`` seconds; a debug run's ``debug.profile_steps`` are recorded
    (:class:`StepProfiler`). The loggers of a member that finished stay open for :func:`close_run`, which logs
    the end-of-run test metrics to them and closes them; those of a member that failed are closed here."""
    for m in members:
        m.cadence = Cadence.of(m.cfg.trainer)
    ends, lead = [m.cadence.max_steps for m in members], members[0]
    max_steps = max(ends)
    alive = list(range(len(members)))
    quiet = lead.run.rank != 0 or not trainer.progress or not sys.stderr.isatty()
    bar = tqdm(total=max_steps, initial=start, desc=steps.desc, dynamic_ncols=True, disable=quiet)
    beat = Heartbeat(trainer.get("heartbeat_s", 30) if lead.run.rank == 0 and quiet else None, start, max_steps,
                     log.info, t0)  # live, also for a vmapped group (whose jobs' lines wait for its end)
    debug = debug_settings(lead.cfg)
    profiler = StepProfiler(debug["profile_steps"] if lead.run.rank == 0 else 0, debug["profile_wait"], start,
                            [m.run.out for m in members if m.run.out is not None], lead.run.say, lead.run.device)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(logging_redirect_tqdm())
            stack.enter_context(bar)
            for j, m in enumerate(members):
                _open_member(m, start)
                m.best = selection.Best(selection.best_by(m.cfg))
                m.best.resume(m.run.ckpt_dir, start, steps.state(start, j), m.run.rank)  # the best so far survives
            for j in [j for j in alive if ends[j] == start]:  # killed after its last checkpoint, before its summary
                members[j].eval_metrics = steps.evaluate(start, j, members[j].hooks)
                members[j].last = steps.state(start, j)
                alive.remove(j)
            i = start
            while alive:
                first, i = i, min(next_event(i, members[j].cadence, steps.longest) for j in alive)
                profiler.before(first)
                metrics = steps.advance(first, i)
                profiler.after(i, last=i == max_steps)
                bar.update(i - first)
                if first == start:
                    names = _metric_names([k for k in metrics if k not in steps.constants])
                    _check_metric_names(members[alive[0]].cfg, names, deferred=bool(members[alive[0]].hooks))
                for j in list(alive):
                    try:
                        done = _member_step(steps, members[j], j, i, metrics, t0) or i == ends[j]
                    except FloatingPointError as e:
                        members[j].error, done = e, True
                        _write_best_of_failed(members[j])
                    if done:
                        alive.remove(j)
                        if members[j].error is None:  # its state now: a group's stacked params go on for the others
                            members[j].last, members[j].final = steps.state(i, j), _final(members[j], start, ends[j])
                said = [m.train_metrics["loss"] for m in members if m.error is None and "loss" in m.train_metrics]
                beat(i, min(said) if said else None)  # a group: its lowest
                if quiet:  # no bar to show it on (formatting it anyway cost ~1% of a small CNN's step)
                    pass
                elif len(members) == 1:
                    bar.set_postfix({k: f"{members[0].record[k]:.4g}" for k in ("loss", "learning_rate",
                                                                               "val_accuracy")
                                     if k in members[0].record})
                elif alive and (i % lead.cadence.log_every == 0 or i == max_steps):
                    losses = [members[j].train_metrics["loss"] for j in alive if "loss" in members[j].train_metrics]
                    bar.set_postfix({"loss": f"{min(losses, default=math.inf):.4g}", "jobs": len(alive)})
            profiler.after(i, last=True)  # a run that stopped early
    except BaseException:
        _close_loggers(members)
        raise
    for m, end in zip(members, ends):
        if m.error is None and m.final is None:
            m.final = _final(m, start, end)
    _close_loggers([m for m in members if m.error is not None])


def _close_loggers(members: list[Member]) -> None:
    """Closes these members' loggers (every one, even when one raises). A member that finished its loop keeps its
    loggers open for :func:`close_run`, which logs the end-of-run test metrics to them and closes them."""
    with contextlib.ExitStack() as stack:
        for m in members:
            if m.logger is not None:
                stack.callback(m.logger.close)
                m.logger = None


def _open_member(m: Member, start: int) -> None:
    """``metrics.jsonl`` and the configured loggers from ``start`` on (open until :func:`close_run`, or closed by
    the loop for a member that failed); early stopping fed the lines logged up to ``start`` by the run whose
    checkpoint this one resumes."""
    if m.run.out is not None:
        m.logger = loggers.open_loggers(
            m.cfg.get("logger"), m.run.out, start=start, config=OmegaConf.to_container(m.cfg, resolve=True))
    if isinstance(m.run.source, pathlib.Path):
        m.last_checkpoint = (start, m.run.source)
        if m.stopper is not None:  # the lines its checkpoint's run logged: <run>/checkpoints/step_N
            logged = report.read_jsonl(m.run.source.parent.parent / rundir.METRICS)
            m.stopper.replay([r for r in logged if r.get("step", 0) <= start])


def _member_step(steps: Steps, m: Member, j: int, i: int, metrics: dict[str, Any], t0: float) -> bool:
    """Member ``j`` after step ``i``: its log line, evaluation, early stopping and checkpoint (on its own config's
    cadences); whether early stopping ended it."""
    cadence, record = m.cadence, {}
    max_steps = cadence.max_steps
    if i % cadence.log_every == 0 or i == max_steps:
        m.train_metrics = steps.logged(metrics, j)
        record.update(m.train_metrics)
    if i % cadence.eval_every == 0 or i == max_steps:
        m.eval_metrics = steps.evaluate(i, j, m.hooks)
        record.update(m.eval_metrics)
        if m.hooks:  # the hooks' names are known now
            _check_metric_names(m.cfg, [*m.train_metrics, *m.eval_metrics])
    if record:
        _stop_if_not_finite(record, i, m.last_checkpoint)
        if m.stopper is not None and m.stopper.update(record, i) and i < max_steps:
            m.stopped = {"step": i, **m.stopper.describe()}
            m.run.say(f"stop   early at step {i}: {m.stopper.metric} has not improved on {m.stopper.best:.4g} "
                      f"(step {m.stopper.best_step}) for {m.stopper.patience} logged values")
            if i % cadence.eval_every:  # the summary's test metrics are those of the params it stops with
                m.eval_metrics = steps.evaluate(i, j, m.hooks)
                record.update(m.eval_metrics)
        if m.best is not None and m.best.update(record, i):  # kept in memory, written with the next checkpoint
            # with the stream's position after step i: a resume from checkpoints/best continues the stream there
            m.best.keep(steps.state(i, j), m.run.ckpt_dir, m.run.rank, _checkpoint_meta(steps, m))
        record["time_s"] = round(time.perf_counter() - t0, 3)
        if m.logger is not None:
            m.logger.log(i, record)
        m.record = record
    if m.run.ckpt_dir is not None and ((cadence.checkpoint_every and i % cadence.checkpoint_every == 0)
                                       or i == max_steps or m.stopped):
        if m.best is not None:  # checkpoints/best first, never behind step_<N> (see fxtrain/selection.py)
            m.best.write()
        m.last_checkpoint = (i, save_checkpoint(m.run.ckpt_dir, steps.state(i, j), m.cfg.trainer.keep_last,
                                                m.last_checkpoint, m.run.rank, _checkpoint_meta(steps, m)))
    return bool(m.stopped)


def _checkpoint_meta(steps: Steps, m: Member) -> dict[str, Any] | None:
    """What a checkpoint of member ``m`` records besides its state: the run's meta and, for a training stream,
    every rank's position in it now (``data``; a collective: every rank calls it at the same step)."""
    data = steps.data_state() if hasattr(steps, "data_state") else None
    return m.run.meta if data is None else {**(m.run.meta or {}), "data": data}


def _write_best_of_failed(m: Member) -> None:
    """A member that failed on a non-finite loss or metric: the best it kept since its last checkpoint written as
    ``checkpoints/best`` (the run's best finite state; its summary says it failed). Every rank fails at the same
    step there (the record is averaged over ranks before the check), so every rank writes. A failing write is
    a warning: the run's error is the non-finite value."""
    if m.best is None:
        return
    try:
        m.best.write()
    except checkpoint.CheckpointError as e:
        log.warning(f"{e} (while stopping on a non-finite value)")


def _final(m: Member, start: int, max_steps: int) -> dict[str, Any]:
    """The metrics a member's summary holds: its last train and eval ones (and ``stopped_early``)."""
    final = {**m.train_metrics, **m.eval_metrics}
    if start == max_steps and m.run.out is not None:  # resumed at max_steps: the train metrics its last line logged
        final = {**_last_record(m.run.out / rundir.METRICS, max_steps), **final}
    if m.stopped:
        final["stopped_early"] = m.stopped
    return final


def next_event(step: int, cadence: Cadence, longest: int) -> int:
    """The first step after ``step`` that logs, evaluates or checkpoints (or the last), at most ``longest`` on.

    >>> next_event(0, Cadence(max_steps=30, log_every=5, eval_every=7, checkpoint_every=0), 50)
    5
    """
    every = [n for n in (cadence.log_every, cadence.eval_every, cadence.checkpoint_every) if n]
    for i in range(step + 1, min(step + longest, cadence.max_steps)):
        if any(i % n == 0 for n in every):
            return i
    return min(step + longest, cadence.max_steps)


def host_metrics(metrics: dict[str, Any], constants: set[str], world: int = 1) -> dict[str, float]:
    """A step's metrics as a log line holds them: Python floats (one host sync), less the constant reports,
    averaged over ``world`` ranks.

    >>> import torch
    >>> host_metrics({"loss": torch.tensor(0.5), "b1": 0.9}, {"b1"})
    {'loss': 0.5}
    """
    return distributed.mean_across_ranks(_floats(_logged(metrics, constants)), world)


def evaluate_run(built: Built, params: Any, buffers: Any, step: int, hooks: list[tuple[str, Callable]],
                 batch_size: int, world: int = 1) -> dict[str, float]:
    """The eval metrics of ``params`` after ``step``: the task's on the validation split ``built.data.validation``
    (``val_loss``, ``val_<metric>``) and each eval hook's (:class:`fxtrain.tasks.EvalContext`), averaged over
    ``world`` ranks."""
    metrics = tasks.split_metrics(built.evaluate(params, buffers, built.data.validation, batch_size), "val")
    if not hooks:
        return metrics
    ctx = tasks.EvalContext(step, parallel.forward(built.apply, params, buffers), params, buffers, built.data,
                            built.task, batch_size)
    mine = {k: v for name, hook in hooks for k, v in _hook_metrics(name, hook(ctx)).items()}
    # A hook may see only its rank's part: averaged, so every rank logs and early-stops on the same line.
    return {**metrics, **distributed.mean_across_ranks(mine, world)}


def close_run(cfg: DictConfig, run: Run, built: Built, state: fx.TrainState, final: dict[str, Any],
              elapsed: float, best: selection.Best | None = None, logger: loggers.Loggers | None = None) -> float:
    """The end of a run that trained: ``trainer.export=orbax``'s export (of ``state``'s structure), the test split
    evaluated once on the checkpoint ``trainer.test_ckpt`` names (:func:`evaluate_test`) and its ``test_*`` logged
    to ``logger``, the run's loggers that the loop left open (its :class:`Member`'s; closed here), at the run's
    last step, then :func:`finish_run`. Returns the optimized metric."""
    with logger if logger is not None else contextlib.nullcontext():
        orbax_hooks.export(cfg, run.out, run.ckpt_dir, built.model, state.params, state.opt_state, state.buffers,
                           built.tx)
        tested = evaluate_test(cfg, run, built, state, best)
        if logger is not None:  # at the last step, which every logger has logged already: its line holds them
            last = (final.get("stopped_early") or {}).get("step", cfg.trainer.max_steps)
            logger.log(last, {k: v for k, v in tested.items() if tasks.reads_test(k)})
    return finish_run(cfg, run.out, {**final, **tested}, elapsed, run.say)


def evaluate_test(cfg: DictConfig, run: Run, built: Built, last: fx.TrainState,
             best: selection.Best | None) -> dict[str, Any]:
    """The test split's metrics (``test_loss``, ``test_<metric>``) of the state ``trainer.test_ckpt`` names, with
    the best step's validation metrics and ``best_step`` (summary.json's); says the ``test`` line."""
    state, tested = selection.state_to_test(cfg.trainer.get("test_ckpt", "best"), best, last)
    metrics = tasks.split_metrics(built.evaluate(state.params, state.buffers, built.data.test,
                                                 cfg.trainer.eval_batch_size), "test")
    which = (f"best ({best.describe()})" if tested["checkpoint"] == "best" and best is not None
             else selection.describe_tested(tested))
    run.say(f"test   {which}: " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    chosen = {k: v for k, v in (best.metrics if best is not None else {}).items() if k.startswith("val_")}
    return {**chosen, **metrics, "best_step": best.step if best is not None else None, "which_tested": which,
            "tested": tested}


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


def _metric_names(train: list[str]) -> list[str]:
    """The metrics a run will have: its train ones, ``val_*`` and ``test_*`` (loss and the task's) of each split."""
    task = [k for k in train if k not in ("loss", "grad_norm", "learning_rate")]
    return [*train, *(f"{split}_{k}" for split in tasks.SPLITS for k in ("loss", *task))]


def _pipeline_options(cfg: DictConfig) -> dict:
    return {"schedule": cfg.parallel.get("schedule", "gpipe"), "microbatches": cfg.parallel.get("microbatches", 4),
            "stages_per_rank": cfg.parallel.get("stages_per_rank", 1)}


def choice(group: str, default: str = "?") -> str:
    """The option of ``group`` this run picked (``data=mine``: ``mine``), or ``default`` outside a Hydra run."""
    try:
        return str(HydraConfig.get().runtime.choices.get(group))
    except ValueError:  # composed outside a Hydra run (tests)
        return default


NO_VALIDATION = " (no validation split: validation reads the test split, so what the run chooses has seen it)"


def describe_run(data: Any, model: torch.nn.Module, params: Any, tx: fx.GradientTransformation, opt_state: Any,
                 device: torch.device, shards: int = 1, task: tasks.Task | None = None) -> list[str]:
    """The ``data``, ``model``, ``task``, ``stack`` and ``state`` lines a run prints at its start (and its
    train.log holds)."""
    return [f"data   {data}" + (NO_VALIDATION if getattr(data, "val", False) is None else ""),
            f"model  {type(model).__name__}: {count_params(params):,} params on {device}{float8.note(model)}{parallel.wrapped_note(model)}",
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
    best_step, which, tested = final.pop("best_step", None), final.pop("which_tested", None), final.pop("tested", None)
    steps = stopped["step"] if stopped else cfg.trainer.max_steps
    value = final[cfg.optimized_metric]
    if out is not None:
        summary = {"status": "completed", "step": steps, "time_s": round(elapsed, 2),
                   "optimized_metric": cfg.optimized_metric, "value": value, "metrics": final}
        if stopped:
            summary["stopped_early"] = stopped
        if tested is not None:  # which checkpoint the test_* are of, and why (the last one, when best was asked)
            summary.update(best_step=best_step, test_ckpt=which, tested=tested)
        rundir.write_json(out / "summary.json", summary)  # atomic: a kill leaves the old one or the new one
    shown = [cfg.optimized_metric] + [k for k in ("val_accuracy", "test_accuracy", "test_loss", "loss")
                                      if k != cfg.optimized_metric]
    say(f"done   {steps} steps in {elapsed:.1f} s | " + " | ".join(f"{k} {final[k]:.4f}" for k in shown
                                                                   if k in final)
        + (f" | tested {selection.describe_tested(tested)}" if tested is not None else ""))
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
    path = rundir.save(target, state, meta, f"the last checkpoint is step {previous[0]} ({previous[1]}), intact"
                       if previous else "no checkpoint was written yet")
    if rank == 0:
        rundir.prune(directory, keep_last, state.step)
    return path


def resume_plan(cfg: DictConfig, ckpt_dir: pathlib.Path | None,
                 meta: dict[str, Any] | None = None) -> tuple[pathlib.Path | str | None, str | None]:
    """``(source, note)``: the checkpoint ``cfg.resume`` asks for (``None`` to start at step 0, ``"completed"``
    for a finished run under ``resume=auto``; see the module doc), checked, and how the resume differs from the
    run that wrote the checkpoint (a re-layout), for the start line.

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
        try:  # the checkpoint's run's run.json: a regular file there, or none (a FIFO must not hang the resume)
            with checkpoint.open_file(path.parent.parent / rundir.OWNER, path.parent.parent) as fh:
                there = json.loads(fh.read().decode("utf-8")).get("config")
        except (OSError, ValueError, AttributeError):  # CheckpointError is a ValueError
            there = None
    if not isinstance(there, dict) or force:
        return
    _, flat = rundir.config_hash(cfg)
    diff = rundir.differing(there, flat, cfg)
    if diff and all(k.startswith("parallel.") for k in diff):  # the layout alone: resume_relayout is the key
        shown = ", ".join(f"{k}={there[k]} there, {flat[k]} here" for k in diff[:3])
        raise rundir.RunDirError(f"resume={cfg.resume}: the checkpoint was trained on another parallel layout "
                                 f"({shown}{', ...' if len(diff) > 3 else ''}), which changes what the run computes "
                                 "(batches per rank, reduction order), so it is not resumed silently; launch on "
                                 "that layout, or pass resume_relayout=true to continue it on this one (its "
                                 "checkpoint is resharded)")
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
    """Metrics as Python floats: one host sync per device that holds some (on a GPU the step's metrics are on
    it, and a transform's host counters, such as accumulate's ``emitted``, on the CPU)."""
    names = [k for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.ndim == 0]
    out: dict[str, float] = {}
    for device in dict.fromkeys(metrics[k].device for k in names):
        here = [k for k in names if metrics[k].device == device]
        out.update(zip(here, torch.stack([metrics[k].detach().float() for k in here]).tolist()))
    out.update({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return {k: out[k] for k in metrics if k in out}


def _stop_if_not_finite(record: dict[str, float], step: int, checkpoint: tuple[int, pathlib.Path] | None) -> None:
    bad = [k for k in ("loss", "val_loss") if k in record and not math.isfinite(record[k])]
    if bad:
        _raise_not_finite(f"{bad[0]} is {record[bad[0]]} at step {step}", checkpoint)


def _raise_not_finite(what: str, checkpoint: tuple[int, pathlib.Path] | None) -> None:
    kept = (f"the last good checkpoint is step {checkpoint[0]} ({checkpoint[1]})" if checkpoint
            else "no checkpoint was written yet")
    raise FloatingPointError(f"{what}: training stopped. metrics.jsonl ends at the last logged finite step and "
                             f"{kept}. With half-precision params (amp=pure_fp16, pure_bf16) the params "
                             "themselves overflow or stop moving: prefer amp=fp16 or amp=bf16 (float32 master "
                             "weights); otherwise a lower optim.chain.<name>.learning_rate often helps.")


def _check_metric_name(name: str, available: list[str], deferred: bool = False, key: str = "optimized_metric") -> None:
    """Refuses an ``optimized_metric`` the run does not have (``deferred``: eval hooks may add it, checked later)."""
    if name not in available and not deferred:
        raise ConfigError(f"{key}={name} is not a metric of this run; "
                                f"it has: {', '.join(available)}")


def _check_metric_names(cfg: DictConfig, available: list[str], deferred: bool = False) -> None:
    """``optimized_metric`` and an explicit ``trainer.checkpoint.best_by`` (a name no step logs would leave the
    best checkpoint empty and test the last one in silence)."""
    _check_metric_name(cfg.optimized_metric, available, deferred)
    chosen = (cfg.trainer.get("checkpoint") or {}).get("best_by")
    if chosen is not None:
        _check_metric_name(chosen, available, deferred, key="trainer.checkpoint.best_by")


def resolved_yaml(cfg: DictConfig) -> str:
    """``cfg`` as ``config.yaml`` holds it, every interpolation resolved; one that fails is a ConfigError.

    >>> from omegaconf import OmegaConf
    >>> print(resolved_yaml(OmegaConf.create({"steps": 10, "decay": "${steps}"})).strip())
    steps: 10
    decay: 10
    """
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
            checked = check(cfg)  # a bad setting writes nothing where a run is, not even a failed summary.json
        except ConfigError as e:
            if distributed.rank_and_world()[0] == 0:
                if multirun:  # a sweep job's own new directory: say why there
                    rundir.write_refused(out, cfg, e)
                else:  # a refused launch leaves nothing, not even the directory Hydra made for it
                    rundir.withdraw(out)
            raise
        try:
            return train(cfg, out, checked)
        except Exception as e:
            if distributed.rank_and_world()[0] == 0:
                if rundir.accepted(out):  # a failed job still says why in its directory (and summary.csv)
                    write_failure(out, cfg, e)
                elif multirun:  # refused before its directory was taken: a sweep job's own new one says why
                    rundir.write_refused(out, cfg, e, "refused" if isinstance(e, ConfigError) else "failed")
                else:  # a refused launch leaves nothing, not even the directory Hydra made for it
                    rundir.withdraw(out)
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
        build.check_override_keys(argv)  # trainer.max_stpes=5: the nearest key, not Hydra's five lines
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
