"""Sweeps as vmapped groups: the engine of ``hydra/launcher=vmap``.

The launcher (``hydra_plugins/fxtrain_vmap_launcher``) hands every job of a multirun to :func:`plan`, which
groups the jobs that differ only in values a vmapped step can take as inputs (numbers of the chain and schedule,
seeds, the loop's per-job settings) and says why the others stand apart, and to :func:`train_group`, which trains
one group as one process: every job's gradients in one ``torch.func.vmap`` call, then each job's own fused kernel
on its slice, in :func:`fxtrain.train.loop` with a member per job, so each job keeps its own run's outputs. What
can be batched, why a job runs where it runs, compilation and the numbers: docs/runner.md ("How the launcher
works").

Map:

* :func:`plan`, :class:`Job`, :class:`Group`, :func:`job_notes`, :data:`LOOP_KEYS`: grouping and its notes.
* :func:`train_group`, :class:`Result`: one group trained; :class:`GroupSteps` the loop's steps for it,
  :class:`MemberKernels` each job's fused kernel on its slice.
* :func:`vmapped_steps`, :class:`NotBatchable`: ``torch.func.vmap`` over the whole pure step, and what refuses it.
* :class:`Compiled`, :func:`compile_cache`: ``hydra.launcher.compile=true`` and its cache on disk.
* :func:`hyperparams`, :func:`vmap_trees`, :func:`stack_trees`, :func:`pick`: batched trees and each job's slice.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import itertools
import logging
import operator
import os
import pathlib
import time
import types
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

import fxtrain as fx
from fxtrain import build, distributed, parallel, rundir, tasks, tree, validate
from fxtrain import train as runner
from fxtrain.step import pure_gradients, step_metrics
from fxtrain.transforms import _fused

__all__ = ["Job", "Group", "Result", "NotBatchable", "plan", "job_notes", "LOOP_KEYS", "CHAIN", "train_group", "GroupSteps", "hyperparams",
           "vmapped_steps", "stack_trees", "pick", "vmap_trees"]

log = logging.getLogger("fxtrain")


class NotBatchable(RuntimeError):
    """A group that cannot be trained as one vmapped process; the message says why (the jobs then run one by one)."""


@dataclasses.dataclass
class Job:
    """One job of a multirun.

    Attributes:
      num: Hydra's job number (``hydra.job.num``).
      cfg: its task config (no ``hydra`` node), fully resolved.
      out: its run directory (``hydra.runtime.output_dir``).
      overrides: its command-line overrides (``hydra.overrides.task``), for messages.
    """

    num: int
    cfg: DictConfig
    out: pathlib.Path
    overrides: list[str]


@dataclasses.dataclass
class Group:
    """Jobs that :func:`train_group` can train together, and why they are a group apart.

    Attributes:
      jobs: in job order.
      values: ``{config key: one number per job}`` for the stack keys whose values differ in the group.
      sequential: why these jobs run one by one (with the task function), or ``None`` to vmap them.
      name: ``group 2`` (:func:`plan` numbers its groups by their first job).
      batched: ``{config key: one value per job}`` for every key whose values differ in the group (stack keys,
        seeds, the loop's per-job settings such as ``trainer.max_steps``).
      reasons: one line per reason that keeps these jobs apart from the other jobs of the launch: the key or keys
        (as the sweep wrote them), their values here and elsewhere, and why they cannot be batched.
    """

    jobs: list[Job]
    values: dict[str, list[float]]
    sequential: str | None = None
    name: str = ""
    batched: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    reasons: list[str] = dataclasses.field(default_factory=list)

    def label(self) -> str:
        """``jobs 0,2,4`` for messages."""
        return "job" + ("s " if len(self.jobs) > 1 else " ") + ",".join(str(j.num) for j in self.jobs)

    def header(self) -> str:
        """How this group runs, in one line: ``jobs 0,1 as one vmapped process, batched over seed=0,1``, ``job 4
        alone``, or ``jobs 2,3 one by one: <why>``."""
        if len(self.jobs) == 1:
            return f"{self.label()} alone"
        if self.sequential is not None:
            return f"{self.label()} one by one: {self.sequential}"
        over = ", ".join(f"{k}={','.join(_show(v) for v in vs)}" for k, vs in self.batched.items())
        return f"{self.label()} as one vmapped process, batched over {over or 'nothing (identical jobs)'}"


def job_notes(group: Group, job: Job) -> list[str]:
    """The lines ``job``'s ``train.log`` records about its group (``group  ...``): how it runs, then one line per
    reason that keeps it apart from other jobs of its launch.

    >>> import pathlib
    >>> job = Job(3, None, pathlib.Path("3"), [])
    >>> job_notes(Group([job], {}, "a group of one", "group 2", reasons=["apart by model: resnet here, mlp in group 1"]), job)
    ['group  job 3 alone (group 2)', 'group  apart by model: resnet here, mlp in group 1']
    """
    head = group.header() if len(group.jobs) > 1 else f"job {job.num} alone"
    where = f"job {job.num} in {group.name}: " if len(group.jobs) > 1 else ""
    return [f"group  {where}{head}" + (f" ({group.name})" if len(group.jobs) == 1 and group.name else ""),
            *(f"group  {r}" for r in group.reasons)]


@dataclasses.dataclass
class Result:
    """What one job of a vmapped group returned: its optimized metric or its error, and the lines its run logs."""

    value: float | None = None
    error: BaseException | None = None
    lines: list[str] = dataclasses.field(default_factory=list)


# --- grouping -------------------------------------------------------------------------------------

#: The trainer settings :func:`fxtrain.train.loop` reads per member: jobs that differ only in these (and in batchable
#: values) share a group, each member logging, evaluating, checkpointing and stopping on its own. ``max_epochs``
#: becomes each job's ``max_steps`` when its run is checked.
LOOP_KEYS = ("trainer.max_steps", "trainer.max_epochs", "trainer.log_every", "trainer.eval_every",
             "trainer.checkpoint_every", "trainer.keep_last", "trainer.test_ckpt", "trainer.checkpoint.best_by",
             "trainer.early_stopping.metric", "trainer.early_stopping.patience", "trainer.early_stopping.mode",
             "trainer.early_stopping.min_delta")

#: The chain's structure (its transforms' names, in order), a key of its own in :func:`plan`'s view of a config:
#: ``[a,b]`` and ``[b,a]`` hold the same keys and values, yet build different stacks.
CHAIN = "optim.chain"

_MISSING = object()  # a key a job's config does not have

# Why a key that differs between jobs splits them, by its config node (first match); stack keys refused as tensors
# and non-numbers say their own reason.
_WHY = (
    (CHAIN, "the chain's structure (its transforms and their order) is the step's code: each structure is a group"),
    ("optim.chain.", "the transform's setting is not a number it takes as a tensor"),
    ("schedule._target_", "another schedule function is other code in the step"),
    ("schedule.", "the schedule takes it as a Python value, not as a tensor"),
    ("data.batch_size", "the batch size gives every tensor of the step its shape"),
    ("data.", "another data config gives other batches (shapes, contents or order) that jobs cannot share"),
    ("model.", "another model config changes the params' shapes or the model's code"),
    ("task.", "another task changes the loss and metrics the step computes"),
    ("amp.", "amp sets the step's dtypes and loss scaling, which vmap cannot vary per job"),
    ("accumulate.", "accumulate sets how many micro-batches make an update: the step's own structure"),
    ("parallel.", "the parallel layout places every tensor; a vmapped group runs in one process"),
    ("trainer.", "a setting of the run that one vmapped process shares"),
    ("", "a setting one vmapped process shares"),
)


def _stack_key(key: str) -> bool:
    """``optim.chain.<name>.<arg>`` or ``schedule.<arg>``: a key :func:`fxtrain.build.stack` takes in ``values``."""
    parts = key.split(".")
    if parts[-1] == "_target_":
        return False
    return (len(parts) == 4 and parts[:2] == ["optim", "chain"]) or (len(parts) == 2 and parts[0] == "schedule")


def _seed_key(key: str) -> bool:
    return key in ("seed", "data.seed")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v: Any) -> str:
    """A config value as an override writes it: ``[clip_by_global_norm,adamw]``, ``null``, ``0.001``."""
    if v is _MISSING:
        return "unset"
    if isinstance(v, bool) or v is None:
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_show(x)}" for k, x in v.items()) + "}"
    return str(v)


def _partition(values: list[Any]) -> tuple[int, ...]:
    """Which groups share a value: each group's index of the first group with its value (``[a, b, a] -> (0, 1, 0)``)."""
    first: dict[Any, int] = {}
    return tuple(first.setdefault(v, n) for n, v in enumerate(values))


def _flat(cfg: DictConfig) -> dict[str, Any]:
    """``{dotted key: value}`` of the resolved config, with :data:`CHAIN` the chain's names in order; lists are
    values (compared whole)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
        else:
            out[prefix] = node

    container = OmegaConf.to_container(cfg, resolve=True)
    walk(container, "")
    chain = (container.get("optim") or {}).get("chain") if isinstance(container.get("optim"), dict) else None
    if isinstance(chain, dict):
        out[CHAIN] = list(chain)
    return out


def _package(override: str) -> str:
    """The config node an override sets: ``model`` for ``model=resnet``, ``optim.chain`` for
    ``optim/transform@optim.chain=[sgd]``, ``data.batch_size`` for ``data.batch_size=64``."""
    key = override.lstrip("+~").split("=", 1)[0]
    return key.split("@", 1)[1] if "@" in key else key.replace("/", ".")


def _override_of(job: Job, key: str, value: Any) -> str:
    """The override of ``job`` that set ``key`` (as the user wrote it), else ``key=value``."""
    for o in job.overrides:
        if o.lstrip("+~").split("=", 1)[0] == key:
            return o
    return f"{key}={_show(value)}"


def hyperparams(values: dict[str, Sequence[float]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``values`` as float32 tensors of shape ``(N,)``: what vmap hands the stack, one 0-dim value per job.

    float32 as torch itself rounds a Python float that meets a float32 tensor (``lr * schedule(count)``).
    """
    return {k: torch.tensor([float(v) for v in vs], dtype=torch.float32, device=device) for k, vs in values.items()}


def plan(jobs: Sequence[Job], max_group_size: int | None = None, world: int = 1) -> tuple[list[Group], list[str]]:
    """Splits ``jobs`` into groups that differ only in batchable values; returns ``(groups, notes)``.

    A key whose values differ between jobs keeps them in one group when it is ``seed``/``data.seed``, one of
    :data:`LOOP_KEYS` (``trainer.max_steps``: each member stops at its own step), or a stack key
    (``optim.chain.<name>.<arg>``, ``schedule.<arg>``) whose values are all numbers and which the stack accepts as
    a 0-dim tensor (tried once, outside vmap). Any other difference (the chain's structure, model, data, ``amp``,
    ``accumulate``, a schedule's step counts, other ``trainer.*``...) puts the jobs in different groups.

    Every group gets a ``name`` (``group 1``, ``group 2``... by first job), its ``batched`` values and its
    ``reasons``: one line per reason that keeps it apart from the other groups, naming the key or keys (the
    override that set them where the sweep wrote one) with their value here and in the other groups, and why
    they cannot be batched. ``notes`` holds each group's lines for the launcher's log: its header
    (:meth:`Group.header`) and its reasons.

    Args:
      jobs: the jobs of one launch, in job order.
      max_group_size: at most this many jobs per group (memory); ``None``: no limit.
      world: processes running the launcher (``torchrun``); more than one runs every job one by one.

    Example:
        >>> import pathlib
        >>> from omegaconf import OmegaConf
        >>> cfgs = [{"seed": s, "data": {"batch_size": b}, "parallel": {}} for b in (64, 128) for s in (0, 1)]
        >>> jobs = [Job(i, OmegaConf.create(c), pathlib.Path(str(i)), []) for i, c in enumerate(cfgs)]
        >>> groups, notes = plan(jobs)
        >>> [g.label() for g in groups]
        ['jobs 0,1', 'jobs 2,3']
        >>> groups[1].reasons
        ['apart by data.batch_size: 128 here, 64 in group 1: the batch size gives every tensor of the step its shape']
    """
    flats = [_flat(job.cfg) for job in jobs]
    keys = sorted({k for f in flats for k in f})
    differ = [k for k in keys if len({repr(f.get(k, _MISSING)) for f in flats}) > 1]
    why = {key: _unbatchable(jobs, flats, key) for key in differ}  # None: batchable
    # A batchable key splits jobs only where some set it and others do not (a transform in some chains only).
    classes: dict[tuple, list[int]] = {}
    for i, f in enumerate(flats):
        sig = tuple(repr(f.get(k, _MISSING)) if why[k] is not None else k in f for k in differ)
        classes.setdefault(sig, []).append(i)
    size = max_group_size or len(jobs)
    chunks = sorted((members[at:at + size] for members in classes.values() for at in range(0, len(members), size)),
                    key=lambda c: c[0])
    groups = []
    for n, chunk in enumerate(chunks, start=1):
        batched = {k: [flats[i][k] for i in chunk] for k in differ
                   if why[k] is None and len({repr(flats[i].get(k, _MISSING)) for i in chunk}) > 1}
        if batched.get("data.seed") == batched.get("seed"):  # data.seed=${seed}: one key to name
            batched.pop("data.seed", None)
        group = Group([jobs[i] for i in chunk], {k: vs for k, vs in batched.items() if _stack_key(k)},
                      name=f"group {n}", batched=batched)
        group.sequential = _sequential_reason(group, world)
        groups.append(group)
    for at, (g, chunk) in enumerate(zip(groups, chunks)):
        g.reasons = _reasons(at, chunks, groups, flats, differ, why)
        whole = next(m for m in classes.values() if chunk[0] in m)
        if len(whole) > len(chunk):
            others = [h.name for h, c in zip(groups, chunks) if c is not chunk and c[0] in whole]
            g.reasons.append(f"apart by hydra.launcher.max_group_size={size}: jobs {','.join(map(str, whole))} "
                             f"could be one group; they run {size} at a time (also {', '.join(others)})")
    notes = [f"{g.name}: {line}" for g in groups for line in (g.header(), *g.reasons)]
    return groups, notes


def _unbatchable(jobs: Sequence[Job], flats: list[dict[str, Any]], key: str) -> str | None:
    """Why jobs whose values of ``key`` differ cannot share a group, or ``None`` where a group takes them."""
    if _seed_key(key) or key in LOOP_KEYS:
        return None
    if len({repr(f[key]) for f in flats if key in f}) == 1:  # set in some jobs only: split by that, said apart
        return None
    if _stack_key(key):
        present = [(i, f[key]) for i, f in enumerate(flats) if key in f]
        bad = next(((i, v) for i, v in present if not _number(v)), None)
        if bad is not None:
            return f"{_override_of(jobs[bad[0]], key, bad[1])} is not a number"
        refused = _refuses_tensor(jobs[present[0][0]].cfg, key, present[0][1])
        if refused is None:
            return None
        return f"the stack takes {key} only as a Python number ({refused})"
    return next(text for prefix, text in _WHY if key == prefix or key.startswith(prefix))


def _reasons(at: int, chunks: list[list[int]], groups: list[Group], flats: list[dict[str, Any]],
             differ: list[str], why: dict[str, str | None]) -> list[str]:
    """The lines that say why group ``at`` is apart from the others: one per set of keys that split the groups
    alike (``trainer.max_steps`` and the ``schedule.decay_steps`` that follows it are one reason)."""
    def shown(k: str, chunk: list[int]) -> str:
        return ",".join(dict.fromkeys(_show(flats[i].get(k, _MISSING)) for i in chunk))

    alike: dict[tuple, list[str]] = {}  # keys that split the groups the same way: one reason
    for k in differ:  # a batchable key splits only by being set in some groups and not in others
        values = [shown(k, c) if why[k] is not None else shown(k, c) == "unset" for c in chunks]
        if len(set(values)) > 1:
            alike.setdefault(_partition(values), []).append(k)
    lines = []
    for split, ks in alike.items():
        if all(why[k] is None for k in ks) and any(
                any(why[k] is not None for k in other) and _refines(finer, split) for finer, other in alike.items()):
            continue  # keys of a transform in some chains only: the chain's structure says it
        name, values, follow = _cause(ks, split, chunks, groups, flats, differ, why)
        elsewhere: dict[str, list[str]] = {}
        for n, group in enumerate(groups):
            if split[n] != split[at]:
                elsewhere.setdefault(values[n], []).append(group.name)
        others = ", ".join(f"{v} in {ns[0] if len(ns) == 1 else 'groups ' + ','.join(n.split()[-1] for n in ns)}"
                           for v, ns in elsewhere.items())
        causes = sorted((k for k in ks if why[k] is not None), key=lambda k: (k != CHAIN, not _stack_key(k)))
        reason = why[causes[0]] if causes else "set in some of these jobs only"
        lines.append(f"apart by {name}: {values[at]} here, {others}{follow}: {reason}")
    return lines


def _refines(finer: tuple[int, ...], coarser: tuple[int, ...]) -> bool:
    """Whether groups that share a value in ``finer`` always share one in ``coarser``."""
    return all(coarser[n] == coarser[m] for n in range(len(finer)) for m in range(n) if finer[n] == finer[m])


def _cause(ks: list[str], split: tuple[int, ...], chunks: list[list[int]], groups: list[Group],
           flats: list[dict[str, Any]], differ: list[str], why: dict[str, str | None]) -> tuple[str, list[str], str]:
    """What to name for keys ``ks`` that split the groups as ``split`` does: ``(name, its value per group, a
    remark)``. The node of an override the sweep varies that way (``model`` for ``model=mlp,resnet``, the chain for
    ``optim/transform@optim.chain=[a],[b]``); else a batchable key that varies that way between groups and not
    within one (``trainer.max_steps``, which ``schedule.decay_steps`` follows); else the first of ``ks``."""
    swept = {_package(o): o.lstrip("+~").split("=", 1)[0] for g in groups for o in g.jobs[0].overrides if "=" in o}
    for node, written in swept.items():
        covered = [k for k in ks if k == node or k.startswith(node + ".")]
        values = [next((o.split("=", 1)[1] for o in g.jobs[0].overrides if "=" in o and _package(o) == node),
                       "default") for g in groups]
        if covered and _partition(values) == split:
            rest = [k for k in ks if k not in covered]
            return written, values, f" (and {_listed(rest)})" if rest else ""
    for k in differ:
        if why[k] is None and all(k in f for f in flats):
            values = [",".join(dict.fromkeys(_show(flats[i][k]) for i in c)) for c in chunks]
            if all(len({repr(flats[i][k]) for i in c}) == 1 for c in chunks) and _partition(values) == split:
                return k, values, f" ({_listed(ks)} follow{'s' if len(ks) == 1 else ''} it)"
    key = sorted(ks, key=lambda k: (why[k] is None, k != CHAIN))[0]
    rest = [k for k in ks if k != key and not k.startswith(key + ".")]
    values = [",".join(dict.fromkeys(_show(flats[i].get(key, _MISSING)) for i in c)) for c in chunks]
    return key, values, f" (and {_listed(rest)})" if rest else ""


def _listed(keys: list[str]) -> str:
    """``a, b, c...``: at most three keys named."""
    return ", ".join(keys[:3]) + ("..." if len(keys) > 3 else "")


def _refuses_tensor(cfg: DictConfig, key: str, value: float) -> str | None:
    """Why :func:`fxtrain.build.stack` cannot take ``key`` as a 0-dim tensor, or ``None`` if it can.

    ``None`` too when the config does not build with the number itself: that error is the jobs' own (their
    runs report it), not a reason to split them. A job given in epochs has no ``trainer.max_steps`` yet (its run
    settles it): the stack is built with one update's steps instead, a length every stack accepts.
    """
    if cfg.trainer.get("max_steps") is None:
        cfg = copy.deepcopy(cfg)
        cfg.trainer.max_steps = cfg.accumulate.get("every", 1)
    try:
        build.stack(cfg, values={key: torch.tensor(float(value), dtype=torch.float32)})
    except (TypeError, ValueError) as e:
        try:
            build.stack(cfg)
        except (TypeError, ValueError):
            return None
        return str(e).splitlines()[0]
    return None


def _sequential_reason(group: Group, world: int) -> str | None:
    cfg = group.jobs[0].cfg
    if len(group.jobs) == 1:
        return "a group of one"
    if world > 1:
        return f"{world} processes run the sweep (torchrun); the vmap launcher batches jobs in one process"
    layout = {d: cfg.parallel.get(d, 1) for d in distributed.DIMS}
    if any(v != 1 for v in layout.values()):
        shown = " ".join(f"parallel.{d}={v}" for d, v in layout.items() if v != 1)
        return f"{shown} (the vmap launcher batches jobs of parallel=none only)"
    if OmegaConf.select(cfg, "trainer.compile", default=False):
        return ("trainer.compile=true (the per-block compiled forward does not run under vmap; "
                "hydra.launcher.compile=true compiles a vmapped group's step)")
    mode = OmegaConf.select(cfg, "model.activation_checkpoint", default="none")
    if mode != "none":
        return f"model.activation_checkpoint={mode} (a checkpointed block does not run under vmap)"
    return None


# --- vmap over fxtrain trees ------------------------------------------------------------------------

def vmap_trees(fn: Callable, in_dims: Sequence[int | None]) -> Callable:
    """``torch.func.vmap(fn, in_dims)`` for arguments and results that are fxtrain pytrees (optree).

    ``torch.func.vmap`` walks torch's own pytrees; fxtrain's trees are optree's (namespace ``fxtrain``).
    The tensor leaves of each argument go through vmap with that argument's ``in_dim`` (``0``: every
    tensor leaf has the batch axis first; ``None``: shared), other leaves (``None``, Python numbers) are
    constants; the tensor leaves of the result come back with the batch axis first.

    Example:
        >>> import torch
        >>> f = vmap_trees(lambda p, x: {"y": p["w"] * x, "k": None}, in_dims=(0, None))
        >>> f({"w": torch.tensor([1.0, 2.0])}, torch.tensor(3.0))
        {'y': tensor([3., 6.]), 'k': None}
    """

    def call(*args):
        flats = [tree.flatten(a) for a in args]
        tensors = [[x for x in flat if isinstance(x, torch.Tensor)] for flat, _ in flats]
        out_spec: list = []

        def inner(*leaves):
            rebuilt = []
            for (flat, spec), ts in zip(flats, leaves):
                it = iter(ts)
                rebuilt.append(tree.unflatten(spec, [next(it) if isinstance(x, torch.Tensor) else x for x in flat]))
            out_flat, spec = tree.flatten(fn(*rebuilt))
            out_spec[:] = [spec, [None if isinstance(x, torch.Tensor) else x for x in out_flat],
                           [isinstance(x, torch.Tensor) for x in out_flat]]
            return [x for x in out_flat if isinstance(x, torch.Tensor)]

        result = iter(torch.func.vmap(inner, in_dims=tuple(in_dims))(*tensors))
        spec, constants, is_tensor = out_spec
        return tree.unflatten(spec, [next(result) if t else c for c, t in zip(constants, is_tensor)])

    return call


def stack_trees(trees: Sequence[Any], what: str = "tree") -> Any:
    """The trees stacked leafwise (a new leading axis, one entry per job); non-tensor leaves must be equal and
    stay as they are.

    Raises:
      NotBatchable: the trees differ in structure, or a leaf in dtype or shape (named by its path in ``what``).
    """
    flats = [tree.flatten(t) for t in trees]
    spec = flats[0][1]
    for flat, other in flats[1:]:
        if other != spec:
            raise NotBatchable(f"the jobs' {what} trees differ in structure")
    out = []
    for path, leaves in zip(tree.paths(trees[0]), zip(*(flat for flat, _ in flats))):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if any(x.dtype != first.dtype or x.shape != first.shape for x in leaves):
                raise NotBatchable(f"{what} leaf '{path}' differs in dtype or shape between jobs "
                                   f"({', '.join(f'{x.dtype}{tuple(x.shape)}' for x in leaves)})")
            out.append(torch.stack(leaves))
        else:
            if any(x != first for x in leaves):
                raise NotBatchable(f"{what} leaf '{path}' is {first!r} in one job and not in another")
            out.append(first)
    return tree.unflatten(spec, out)


def vmapped_steps(cfg: DictConfig, apply: Callable, batch_per_job: bool, task: Any = None,
                  compile: bool = False) -> Callable:  # noqa: A002 - train_step's argument name
    """The steps of every job of a group as one vmapped call: ``run(hp, params, opt_state, buffers, xs, ys) ->
    (params, opt_state, buffers, metrics)``.

    Each job (vmap over the leading axis of ``hp``, ``params``, ``opt_state`` and ``buffers``, stacked with
    :func:`stack_trees`) runs ``fx.train_step(loss_fn, tx, has_aux=True, donate=False)`` on the batches
    ``xs[k], ys[k]`` in order, ``tx`` built once per call by :func:`fxtrain.build.stack` with its own
    ``hp`` values (0-dim tensors) and ``loss_fn`` the one :func:`fxtrain.train.train` uses. ``metrics`` are
    the last step's. ``xs, ys``: ``(K, ...)`` shared by every job, or ``(N, K, ...)`` with ``batch_per_job``;
    ``task``: the group's (built from ``cfg`` when ``None``).

    ``compile=True``: one step of the group (this function at ``K = 1``) is traced into one graph and compiled
    (:class:`Compiled`), and the ``K`` steps of a call run it in a Python loop: the hyperparameters and every
    state are graph inputs, so no step, chunk length or later group of the same config and shapes compiles again.
    Where tracing or compiling fails, the steps run as without it (one line says why).
    """
    loss_fn = parallel.loss_function(apply, build.task(cfg) if task is None else task)
    _reuse_freed_memory()

    def steps(hp, params, opt_state, buffers, xs, ys):
        tx = build.stack(cfg, values=hp)
        step = fx.train_step(loss_fn, tx, has_aux=True, donate=False)
        for k in range(xs.shape[0]):  # under vmap: the Python loop runs once for all jobs
            params, opt_state, metrics = step(params, opt_state, (fx.amp.Uncast(buffers), xs[k], ys[k]))
            aux = metrics.pop("aux")
            buffers = aux.pop("buffers")  # in their own dtype: amp_cast passes Uncast state through
            metrics.update(aux)
        return params, opt_state, buffers, metrics

    run = vmap_trees(steps, in_dims=(0, 0, 0, 0) + ((0, 0) if batch_per_job else (None, None)))
    if not compile:
        return run
    one = Compiled(run, None, "the vmapped step")
    at = 1 if batch_per_job else 0  # the steps' axis of xs, ys

    def stepwise(hp, params, opt_state, buffers, xs, ys):
        one.key = one.key or ("train", _graph_key(cfg, hp), batch_per_job)
        for k in range(xs.shape[at]):
            step = (slice(None),) * at + (slice(k, k + 1),)  # K = 1: the shape every call traces with
            params, opt_state, buffers, metrics = one(hp, params, opt_state, buffers, xs[step], ys[step])
        return params, opt_state, buffers, metrics

    return stepwise


def compile_cache(where: str | os.PathLike | None = None) -> pathlib.Path:
    """Points ``torch.compile``'s on-disk caches at ``where`` for this process and returns the directory (created).

    Inductor's FX graph cache and AOTAutograd's cache (both on by default in torch 2.13) keep what a compilation
    produced under this directory, keyed by torch on the traced graph, its inputs' shapes and dtypes, torch's
    version and its configuration: the graph a group's step traces to is the same for the same config and shapes
    (:class:`Compiled`: the hyperparameters and states are inputs), so a later sweep, in another process or on
    another machine that shares the directory, loads the compiled code instead of compiling it again. ``None``:
    ``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/fxtrain/compile`` (``~/.cache/fxtrain/compile``):
    a directory that outlives the machine's ``/tmp`` (torch's own default, ``/tmp/torchinductor_<user>``, is
    emptied at reboots and is per node on a cluster). ``hydra.launcher.cache_dir`` sets it for a vmapped sweep.

    >>> import os, tempfile
    >>> before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    >>> where = compile_cache(tempfile.mkdtemp())
    >>> os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(where), where.is_dir()
    (True, True)
    >>> _ = os.environ.pop("TORCHINDUCTOR_CACHE_DIR") if before is None else os.environ.update(TORCHINDUCTOR_CACHE_DIR=before)
    """
    if where is None:
        where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or pathlib.Path(
            os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache", "fxtrain", "compile")
    path = pathlib.Path(where).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)  # read by torch at each lookup and write
    return path


def _graph_key(cfg: DictConfig, batched: Sequence[str]) -> str:
    """What a group's traced step depends on besides its inputs: the stack's and the loss's config, less the values
    of the ``batched`` keys (inputs, as the params are); the seeds and the loop's settings are not in the step.
    Groups of one sweep that differ only in those share one compiled step."""
    nodes = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
             for k in ("optim", "schedule", "amp", "accumulate", "model", "task") if k in cfg}
    for key in batched:
        *path, last = key.split(".")
        node = nodes
        for part in path:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and last in node:
            node[last] = "<batched>"
    return repr(nodes)


class Compiled:
    """``fn(*trees) -> tree`` run as a compiled graph: traced once per ``key``, input structure and input shapes
    (``make_fx``: the Python around the tensor ops, a stack built from its config included, runs only then), then
    ``torch.compile``d (inductor; CUDA graphs on a GPU, ``mode="reduce-overhead"``). Graphs are kept per process,
    so a second group of the same config and shapes runs the first one's. Tensor leaves are the graph's inputs (no
    value is specialized: hyperparameters come as tensors); other leaves must equal the traced ones (they are part
    of the cache key). Where tracing, compiling or the first run fails, ``fn`` runs eagerly from then on and one line
    says why.

    Example:
        >>> import torch
        >>> double = Compiled(lambda t: {"y": t["x"] * 2}, "doc", "doubling")
        >>> double({"x": torch.ones(2)})["y"].tolist()
        [2.0, 2.0]
    """

    graphs: dict[Any, tuple[Callable, Any]] = {}  # per process: (key, structure, shapes) -> (compiled, out structure)

    def __init__(self, fn: Callable, key: Any, what: str):
        self.fn, self.key, self.what, self.eager = fn, key, what, False

    def __call__(self, *args: Any) -> Any:
        if self.eager:
            return self.fn(*args)
        leaves, spec = tree.flatten(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        key = (self.key, spec, tuple((x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in leaves))
        try:
            if key not in self.graphs:
                self.graphs[key] = _trace(self.fn, leaves, spec)
            graph, (out_spec, constants) = self.graphs[key]
            out = iter(graph(*tensors))
        except Exception as e:  # noqa: BLE001 - compilation is an optimization: the eager path gives the same numbers
            self.graphs.pop(key, None)
            self.eager = True
            log.warning(f"vmap   {self.what} runs eagerly: torch.compile failed ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
            return self.fn(*args)
        return tree.unflatten(out_spec, [next(out) if c is _TENSOR else c for c in constants])


_TENSOR = object()  # where a traced function's output has a tensor


def _trace(fn: Callable, leaves: list, spec: Any) -> tuple[Callable, tuple[Any, list]]:
    """``fn`` over these inputs' structure as one FX graph of tensor ops (fake tensors: a host read raises, it
    is never baked in), compiled; and the structure of its output (``(spec, leaves or _TENSOR)``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    out: list = []

    def flat(*tensors):
        it = iter(tensors)
        result, out_spec = tree.flatten(fn(*tree.unflatten(spec, [next(it) if isinstance(x, torch.Tensor) else x
                                                                  for x in leaves])))
        out[:] = [out_spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in result]]
        return [x for x in result if isinstance(x, torch.Tensor)]

    graph = make_fx(flat, tracing_mode="fake")(*(x for x in leaves if isinstance(x, torch.Tensor)))
    cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in leaves)
    return torch.compile(graph, dynamic=False, mode="reduce-overhead" if cuda else None), tuple(out)


def _chunk_metrics(apply: Callable, task: Any) -> Callable:
    """``(params, buffers, x, y) -> (loss, metrics)`` of one evaluation chunk, as :func:`fxtrain.train.evaluate_run`
    computes it for one run (:func:`fxtrain.parallel.forward`: eval mode, the params' dtype, no gradients)."""

    def metrics(params, buffers, x, y):
        return task.compute(parallel.forward(apply, params, buffers)(x), y)

    return metrics


def _dataset_without_rng(cfg: DictConfig, device: torch.device) -> Any:
    """``cfg.data`` built as :func:`fxtrain.train.build_run` builds it, or ``None`` if that draws torch random
    numbers (then every job must build its own, or the params init after it would change)."""
    torch.manual_seed(cfg.seed)
    before = torch.get_rng_state()
    data = build.dataset(cfg.data, runner.choice("data", "data")).to(device)
    return data if torch.equal(before, torch.get_rng_state()) else None


def pick(stacked: Any, j: int) -> Any:
    """Job ``j``'s tree out of a stacked one (tensor leaves copied: checkpoints get storage of their own)."""
    return tree.map(lambda x: x[j].clone() if isinstance(x, torch.Tensor) else x, stacked)


# --- training a group -------------------------------------------------------------------------------

def train_group(group: Group, compile: bool = False) -> list[Result]:  # noqa: A002 - train_step's argument name
    """Trains the jobs of ``group`` as one vmapped process; one :class:`Result` per job, in order.

    Writes each job's ``config.yaml``, ``metrics.jsonl``, checkpoints and ``summary.json`` (or the
    failed summary) into its directory as :func:`fxtrain.train.train` would; each job's lines (``run``,
    ``stack``, ``done``...) come back in its result for its ``train.log``. A job whose loss or metric turns
    non-finite fails alone (its error in its result); the others go on. ``compile``: the group's step and
    evaluation run compiled (:func:`vmapped_steps`; ``hydra.launcher.compile``).

    Raises:
      NotBatchable: before anything is written: the group cannot be trained vmapped (the message says why).
      fxtrain.rundir.RunDirError: a job's directory refuses it (the jobs then run one by one, and say why).
    """
    with contextlib.ExitStack() as claims:  # every job's directory, as train() claims its own (fxtrain/rundir.py)
        for job in group.jobs:
            claims.enter_context(rundir.claim(job.out, job.cfg))
        return _train_group(group, compile)


_MALLOPT_DONE = False


def _reuse_freed_memory() -> None:
    """glibc only, once per process: serve allocations up to 32 MiB from the heap and keep up to 64 MiB of freed
    memory there, instead of an ``mmap``/``munmap`` (and zeroed pages, a page fault per 4 KiB) per tensor.

    The vmapped step is the pure, out-of-place path: every elementwise op of the optimizer update allocates a
    new ``(N, ...)`` tensor (2 MiB for the default MLP's 256x256 weight at N=8), just above glibc's dynamic
    mmap threshold, so each one was a fresh mapping. Measured on the default digits MLP, N=8, one thread:
    about 12-14 ms a vmapped step before, 9.5-10 ms after (experiments/bench/results/sweep.md). Numbers are
    unchanged (only where memory comes from). Elsewhere (no glibc), nothing changes.
    """
    global _MALLOPT_DONE
    if _MALLOPT_DONE:
        return
    _MALLOPT_DONE = True
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
    mallopt(m_trim_threshold, 64 << 20)


def _train_group(group: Group, compile: bool = False) -> list[Result]:  # noqa: A002
    t0 = time.perf_counter()
    jobs = group.jobs
    results = {job.num: Result() for job in jobs}
    device = distributed.device(jobs[0].cfg.trainer.device)
    if device.type == "cpu" and jobs[0].cfg.trainer.cpu_threads:
        torch.set_num_threads(jobs[0].cfg.trainer.cpu_threads)

    # --- every job checked, built and resumed as its own run would be (fxtrain.train); nothing written ---
    live: list[_Job] = []
    datasets: dict[str, Any] = {}  # one dataset per data config, when building it draws no torch random numbers
    for job in jobs:
        checked = runner.check(job.cfg)  # a bad setting: the jobs run one by one, and each says why
        run = runner.plan_run(job.cfg, job.out, say=results[job.num].lines.append)
        if run.source == "completed":  # resume=auto on a finished run: left as it is, as train() does
            value = rundir.read_summary(job.out)["value"]
            results[job.num] = Result(float(value), None, [f"resume=auto: {job.out} completed "
                                                           f"{job.cfg.trainer.max_steps} steps already; nothing to do"])
            continue
        key = repr(OmegaConf.to_container(job.cfg.data))
        if key not in datasets:
            datasets[key] = _dataset_without_rng(job.cfg, device)
        built = runner.build_run(job.cfg, device, run.dims, data=datasets[key], task=checked.task)
        state, resumed = runner.load_start(job.cfg, run, built)
        live.append(_Job(job, run, checked, built, state, resumed))
    if not live:
        return [results[job.num] for job in jobs]
    starts = sorted({m.state.step for m in live})
    if len(starts) > 1:
        raise NotBatchable(f"the jobs resume from different steps ({', '.join(map(str, starts))})")
    start, cfg = starts[0], live[0].job.cfg
    kept = [i for i, job in enumerate(jobs) if any(job is m.job for m in live)]
    hp = hyperparams({k: [vs[i] for i in kept] for k, vs in group.values.items()}, device)
    steps = GroupSteps(cfg, [m.built for m in live], [m.state for m in live], hp,
                       shared_data=all(m.job.cfg.data == cfg.data for m in live), compile=compile)

    # --- the first update, before anything is written: can this group be vmapped at all? --------
    if start < cfg.trainer.max_steps:
        try:  # accumulate emits at its every-th call
            steps.probe(start, min(start + cfg.accumulate.every, cfg.trainer.max_steps))
        except Exception as e:  # noqa: BLE001 - any failure means: run these jobs as the basic launcher does
            raise NotBatchable(f"the vmapped step raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    # --- the loop every run runs (fxtrain.train.loop), one member per job ------------------------
    members = [runner.Member(m.job.cfg, m.run, m.checked.hooks, m.checked.stopper) for m in live]
    try:
        for m, member in zip(live, members):  # every job's directory, as train() starts it
            m.run = member.run = runner.start_run(m.job.cfg, m.run)
            others = ",".join(str(o.job.num) for o in live if o is not m)
            results[m.job.num].lines.extend(runner.begin_run(m.job.cfg, m.run, m.built, m.state, m.resumed,
                                                             where=f"vmap: one process with jobs {others}"))
        batched = ", ".join(group.batched) or "nothing"
        log.info(f"vmap   jobs {','.join(str(m.job.num) for m in live)} as one process: {len(live)} jobs, batched over "
                 f"{batched}; {'one batch for all' if steps.shared else 'a batch per job'}")
        runner.loop(steps, members, start, cfg.trainer, t0)
    except Exception as e:  # noqa: BLE001 - a failure of the group is every unfinished job's failure
        for member in members:
            if member.final is None and member.error is None:
                member.error = e

    # --- summaries --------------------------------------------------------------------------------------
    elapsed = time.perf_counter() - t0
    for m, member in zip(live, members):
        result = results[m.job.num]
        if member.error is None:
            try:
                result.value = runner.close_run(m.job.cfg, m.run, m.built, member.last,
                                                member.final, elapsed, member.best, member.logger)
                continue
            except (FloatingPointError, KeyError) as e:
                member.error = e
        result.error = member.error
        runner.write_failure(m.job.out, m.job.cfg, member.error)
    return [results[job.num] for job in jobs]


@dataclasses.dataclass
class _Job:
    """A job of a group that trains: what its own run would have built before its loop."""

    job: Job
    run: runner.Run
    checked: validate.Checked
    built: runner.Built
    state: fx.TrainState  # where it starts
    resumed: str  # how, for its start line


class MemberKernels:
    """The update half of a vmapped group's step as torch's fused kernel (:mod:`fxtrain.transforms._fused`): one
    kernel call per member, on that member's slices of the group's batched params and state, in place.

    Under ``vmap`` the pure update runs every elementwise op of the optimizer out of place, a new ``(N, ...)``
    tensor per op and leaf through vmap's batching rules: on the default stack (clip + AdamW) that was about 60%
    of the vmapped step. torch's kernels take one learning rate per call, and the members' differ, so each
    member's own stack (``txs[j]``, its run's, the one the basic launcher's run updates with) is bound once
    (:func:`fxtrain.transforms._fused.bind`) to views ``x[j]`` of the batched trees and to a gradient buffer of
    the group's; a step copies the vmapped gradients into that buffer and calls the N bound kernels. A value a
    member's state gets anew (``inject_hyperparams``' learning rate at the new count) is copied back into the
    batched state, so the batched trees hold what each member's own fused step would hold.

    :meth:`bind` returns ``None`` where a member's stack declares no kernel, touches the forward pass
    (``wrap_loss``: amp, SAM...), or its leaves do not allow one; the group then takes the vmapped update.

    Example:
        >>> import torch, fxtrain as fx
        >>> txs = [fx.adam(0.1), fx.adam(0.2)]
        >>> params = {"w": torch.ones(2, 3)}  # two members' (3,) params
        >>> state = stack_trees([tx.init({"w": torch.ones(3)}) for tx in txs])
        >>> kernels = MemberKernels.bind(txs, params, state)
        >>> kernels({"w": torch.ones(2, 3)})
        >>> [round(w, 4) for w in params["w"][:, 0].tolist()]  # Adam's first step moves a param by its learning rate
        [0.9, 0.8]
    """

    def __init__(self, plans: list[Callable[[], None]], grads: list[torch.Tensor], members: list[tuple[Any, list]]):
        self.plans, self.grads, self.members = plans, grads, members

    @classmethod
    def bind(cls, txs: Sequence[Any], params: Any, opt_state: Any) -> MemberKernels | None:
        """The kernels of ``txs[j]`` bound to member ``j``'s slices of ``params`` and ``opt_state`` (batched trees,
        updated in place from then on), or ``None`` where one does not apply."""
        if any(_fused.spec(tx) is None or tx.wrap_loss is not None for tx in txs):
            return None
        grads = tree.map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, params)
        plans, members = [], []
        for j, tx in enumerate(txs):
            p, s, g = (tree.map(lambda x: x[j] if isinstance(x, torch.Tensor) else x, t)
                       for t in (params, opt_state, grads))
            plan = _fused.bind(tx, g, s, p)
            if plan is None:
                return None
            plans.append(plan)
            members.append((s, tree.leaves(s)))
        return cls(plans, [x for x in tree.leaves(grads) if isinstance(x, torch.Tensor)], members)

    def __call__(self, grads: Any) -> None:
        """One update of every member with ``grads`` (batched like the params)."""
        torch._foreach_copy_(self.grads, [x for x in tree.leaves(grads) if isinstance(x, torch.Tensor)])
        for plan in self.plans:
            plan()
        # A leaf a kernel's bookkeeping replaced (not wrote into) goes into its slice of the batched state: found
        # by identity, in C (compress over map(is_not)), and copied in one foreach call for all members.
        changed = []
        for state, views in self.members:
            leaves = tree.leaves(state)
            changed.extend(itertools.compress(zip(views, leaves), map(operator.is_not, leaves, views)))
        if changed:
            torch._foreach_copy_(*map(list, zip(*changed)))


class GroupSteps:
    """The :class:`fxtrain.train.Steps` of a vmapped group: the members' params, optimizer states and buffers
    stacked (:func:`stack_trees`), each call of :meth:`advance` up to 50 steps; evaluation and checkpoints per
    member (:func:`pick`), as the member's own run makes them.

    A step is the gradients of every member under ``vmap`` (:func:`fxtrain.step.pure_gradients`), then each
    member's fused kernel on its slices (:class:`MemberKernels`), where the stack declares one and ``compile`` is
    off; otherwise one :func:`vmapped_steps` call (forward, backward and the pure update under ``vmap``, compiled
    with ``compile``). ``kernels=False`` takes the latter always (the benchmark's reference)."""

    longest = 50

    def __init__(self, cfg: DictConfig, built: Sequence[runner.Built], states: Sequence[fx.TrainState],
                 hp: dict[str, torch.Tensor], shared_data: bool, compile: bool = False,  # noqa: A002
                 kernels: bool = True):
        self.desc, self.built, self.hp, self.shared = f"train x{len(built)}", list(built), hp, shared_data
        self.params = stack_trees([s.params for s in states], "params")
        self.opt_state = stack_trees([s.opt_state for s in states], "optimizer state")
        self.buffers = stack_trees([s.buffers for s in states], "buffers")
        self.rngs = [s.rng for s in states]  # a vmapped step draws no random numbers (vmap refuses a model that does)
        self.constants = fx.traits(built[0].tx).constant_reports
        self.eval_batch_size = cfg.trainer.eval_batch_size
        # The jobs' modules differ only in their tensors, which the trees carry: the first job's apply serves all.
        self.vmapped = vmapped_steps(cfg, built[0].apply, batch_per_job=not shared_data, task=built[0].task,
                                     compile=compile)
        self.kernels = MemberKernels.bind([b.tx for b in built], self.params, self.opt_state) \
            if kernels and not compile else None
        if self.kernels is not None:  # wrap_loss is None (bind checks): the gradients do not read the state
            grads = pure_gradients(parallel.loss_function(built[0].apply, built[0].task), built[0].tx, has_aux=True)
            self.gradients = vmap_trees(lambda p, b, x, y: grads(p, None, (fx.amp.Uncast(b), x, y)),
                                        in_dims=(0, 0) + ((None, None) if shared_data else (0, 0)))
        self.evaluated: tuple[int, list[dict[str, float]]] | None = None  # (step, every member's task metrics)
        # The validation examples on a job axis of their own (1: tasks.evaluate chunks dim 0) when jobs have their own.
        forward = vmap_trees(_chunk_metrics(built[0].apply, built[0].task), in_dims=(0, 0) + ((None, None) if shared_data
                                                                                           else (1, 1)))
        self.forward = Compiled(forward, ("eval", _graph_key(cfg, hp), shared_data), "the vmapped evaluation") \
            if compile else forward

    def batches(self, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches of steps first+1..end (data.train[first:end]), stacked: (K, ...) or, a batch per job, (N, K, ...)."""
        per_job = [tuple(torch.stack(t) for t in zip(*(b.data.train[i] for i in range(first, end))))
                   for b in (self.built[:1] if self.shared else self.built)]
        return per_job[0] if self.shared else tuple(torch.stack(t) for t in zip(*per_job))

    def probe(self, first: int, end: int) -> None:
        """Runs steps first+1..end and drops what they return (the step is pure): raises where vmap cannot. With
        the members' kernels, the vmapped gradients of step first+1 (the kernels' leaves were checked at bind)."""
        xs, ys = self.batches(first, end)
        if self.kernels is None:
            self.vmapped(self.hp, self.params, self.opt_state, self.buffers, xs, ys)
        else:
            self.gradients(self.params, self.buffers, *self._batch(xs, ys, 0))

    def advance(self, first: int, end: int) -> dict[str, Any]:
        self.evaluated = None
        xs, ys = self.batches(first, end)
        if self.kernels is None:
            self.params, self.opt_state, self.buffers, metrics = self.vmapped(self.hp, self.params, self.opt_state,
                                                                          self.buffers, xs, ys)
            return metrics
        for k in range(end - first):
            grads, loss, aux = self.gradients(self.params, self.buffers, *self._batch(xs, ys, k))
            self.kernels(grads)  # params and opt_state in place
            self.buffers = aux.pop("buffers")  # in their own dtype: amp_cast passes Uncast state through
        metrics = step_metrics(loss, aux, self.opt_state, self.built[0].tx)
        metrics.update(aux)
        return metrics

    def _batch(self, xs: torch.Tensor, ys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``k``'s batch of :meth:`batches`' stack: ``(B, ...)`` for all, or ``(N, B, ...)`` a batch per job."""
        return (xs[k], ys[k]) if self.shared else (xs[:, k], ys[:, k])

    def logged(self, metrics: dict[str, Any], j: int) -> dict[str, float]:
        return runner.host_metrics(pick(metrics, j), self.constants)

    def evaluate(self, step: int, j: int, hooks: list[tuple[str, Callable]]) -> dict[str, float]:
        """Member ``j``'s eval metrics: the task's from one vmapped evaluation of every member at this step (the
        first member asking runs it), each eval hook's on ``j``'s own params as its run calls it."""
        if self.evaluated is None or self.evaluated[0] != step:
            self.evaluated = step, self.evaluate_all()
        metrics = dict(self.evaluated[1][j])
        if hooks:  # the task's metrics are computed above; the hooks' need the member's own params
            ctx_metrics = runner.evaluate_run(self.built[j], pick(self.params, j), pick(self.buffers, j), step, hooks,
                                              self.eval_batch_size)
            metrics.update({k: v for k, v in ctx_metrics.items() if k not in metrics})
        return metrics

    def evaluate_all(self) -> list[dict[str, float]]:
        """Every member's ``val_*`` metrics on its validation split, as :func:`fxtrain.train.evaluate_run` computes
        them (:func:`fxtrain.tasks.evaluate`: the same chunks, the same weighting), in one vmapped forward per chunk."""
        splits = [b.data.validation for b in (self.built[:1] if self.shared else self.built)]
        if len({tuple(t.shape for t in split) for split in splits}) > 1:  # the jobs' splits differ in size
            return [runner.evaluate_run(b, pick(self.params, j), pick(self.buffers, j), 0, [], self.eval_batch_size)
                    for j, b in enumerate(self.built)]
        x, y = splits[0] if self.shared else (torch.stack(t, dim=1) for t in zip(*splits))
        # tasks.evaluate over the group: its "task" computes every member's (loss, metrics) of a chunk, shape (N,)
        # each, from the vmapped forward; it weighs the chunks as for one run and returns a list of N per metric.
        params, buffers = self.params, self.buffers
        group = types.SimpleNamespace(compute=lambda xb, yb: self.forward(params, buffers, xb, yb))
        per_metric = tasks.evaluate(group, lambda xb: xb, (x, y), self.eval_batch_size)
        return [tasks.split_metrics({k: v[j] for k, v in per_metric.items()}, "val") for j in range(len(self.built))]

    def state(self, step: int, j: int) -> fx.TrainState:
        return fx.TrainState(step, pick(self.params, j), pick(self.opt_state, j), self.rngs[j], pick(self.buffers, j))
