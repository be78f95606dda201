"""Settings checked before a run writes anything, and the errors a user reads as one line.

* :func:`check` reads every setting of a composed config against its schema and raises
  :class:`fxtrain.errors.ConfigError` at the first bad one, with a message that names the key and the value
  as written, says why, and what to do::

      trainer.max_steps=abc: expected a positive whole number (optimizer steps, counted in batches; at most 2**31-1); e.g. trainer.max_steps=1000

  The schema: the config's own nodes (the top level, ``trainer``, ``trainer.early_stopping``, ``amp``,
  ``accumulate``, ``parallel``) take the keys their options in ``conf/`` give them (:func:`schema`): any other
  is refused with the nearest name (``+trainer.max_step=5``: did you mean trainer.max_steps?), and a key whose
  default there is a boolean takes only ``true`` or ``false``. A ``_target_`` node (``model``, ``data``,
  ``task``, ``schedule``, each ``optim.chain`` entry, each logger and eval hook) takes its target's arguments;
  fxtrain's own targets' values are checked by name (:data:`ARG_RULES`: ``b1`` in [0, 1), ``eps`` finite and
  >= 0, ``hidden`` a list of positive whole numbers...; an int is a float's value, ``weight_decay=0``), then
  by the library itself (each optimizer factory is called with the config's values, so
  ``optim.chain.adamw.learning_rate=-1`` is refused exactly as ``fx.adamw(-1)`` is; the model is built on the
  meta device). Settings that this run does not use (the loss scale without ``amp.policy``, early stopping's
  ``patience`` while its ``metric`` is null, ``parallel.tp`` under one process) are checked all the same.
  ``optimized_metric`` and ``trainer.early_stopping.metric`` must be metrics the run logs (the step's loss,
  the stack's reports such as ``grad_norm`` and ``learning_rate``, the task's declared metrics and their
  ``test_`` forms); with eval hooks, whose names are known once they ran, the runner checks at the first
  evaluation.
* The chain must descend: the product of the signs of its scaling entries is -1 (each optimizer negates the
  gradient once, a ``scale`` multiplies by its ``step_size``, the ``schedule`` is probed from step 0 to the
  last step; a wrapper's transforms count: ``apply_if_finite``'s ``inner`` optimizer descends). A chain without an optimizer (``[clip_by_global_norm]``, ``[add_decayed_weights]``), two
  optimizers, a negative ``scale`` or a zero learning rate would move the params along the gradient or
  not at all; such a chain runs only with ``trainer.allow_no_descent=true``.
* :func:`one_line_errors` is how ``python -m fxtrain.train`` reports them: a :class:`~fxtrain.errors.ConfigError`
  (or a full disk) prints as ``Error: <message>`` and exits 1, without a traceback; ``HYDRA_FULL_ERROR=1``
  shows the traceback. Any other exception keeps its traceback.

Example:
    >>> from hydra import compose, initialize_config_dir
    >>> from fxtrain import build, train
    >>> with initialize_config_dir(config_dir=str(train.CONF_DIR), version_base="1.3"):
    ...     cfg = compose("train", overrides=["trainer.log_every=0"])
    >>> check(cfg)
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: trainer.log_every=0: expected a positive whole number (steps between metrics.jsonl lines; at most 2**31-1); e.g. trainer.log_every=10
    >>> with initialize_config_dir(config_dir=str(train.CONF_DIR), version_base="1.3"):
    ...     cfg = compose("train", overrides=["+trainer.max_step=5"])
    >>> check(cfg)
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: trainer.max_step: not a setting fxtrain reads (did you mean trainer.max_steps?); trainer's settings are max_steps, max_epochs, log_every, eval_every, eval_batch_size, checkpoint_every, keep_last, checkpoint, test_ckpt, device, compile, cpu_threads, progress, heartbeat_s, allow_no_descent, early_stopping, eval_hooks, export, orbax_naming
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import functools
import importlib.resources
import inspect
import math
import os
import pathlib
import types
import typing
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import fxtrain as fx
from fxtrain import _base, build, checkpoint, distributed, parallel, tasks
from fxtrain import data as fxdata
from fxtrain.errors import ConfigError
from fxtrain.interop import run_hooks as orbax_hooks

__all__ = ["check", "Checked", "one_line_errors", "message", "DiskFull", "metric_names", "SCHEMA", "ARG_RULES",
           "check_launcher", "launcher_schema", "LauncherCheck", "typed_args", "annotation_rule"]

# (key, smallest value, what it counts, an example): the whole-number settings of the trainer group.
_TRAINER_COUNTS = [
    ("trainer.max_steps", 1, "optimizer steps, counted in batches", 1000),
    ("trainer.log_every", 1, "steps between metrics.jsonl lines", 10),
    ("trainer.eval_every", 1, "steps between evaluations", 100),
    ("trainer.eval_batch_size", 1, "examples per evaluation forward pass", 512),
    ("trainer.checkpoint_every", 0, "steps between checkpoints; 0: only at the end", 500),
    ("trainer.keep_last", 0, "the newest checkpoints kept; 0 to keep every checkpoint", 2),
]
# The data configs' whole-number settings (those a data config has are checked; the factory checks the rest).
_DATA_COUNTS = [
    ("batch_size", 1, "examples per step", 64),
    ("num_examples", 1, "examples generated", 512),
    ("context", 1, "tokens per window", 128),
    ("max_bytes", 1, "bytes of text", 1_000_000),
    ("eval_windows", 1, "held-out windows evaluated", 64),
    ("split_seed", None, "the train/test split's seed", 0),
]


class Checked(NamedTuple):
    """What :func:`check` built from a config on its way: the objects the run uses (built once)."""

    task: Any  #: the :class:`fxtrain.tasks.Task` of ``task``
    hooks: list[tuple[str, Callable]]  #: ``trainer.eval_hooks``, as :func:`fxtrain.build.eval_hooks` builds them
    stopper: Any  #: the :class:`fxtrain.tasks.EarlyStopping` of ``trainer.early_stopping``, or ``None``


def check(cfg: DictConfig) -> Checked:
    """Raises :class:`~fxtrain.errors.ConfigError` naming the first bad setting of ``cfg`` (see the module doc);
    returns the task, eval hooks and early stopping it built, which the run uses (:class:`Checked`)."""
    cfg = _resolved(cfg)
    _known_keys(cfg)  # a misspelled key (+trainer.max_step=5) is refused before any value is read
    for key, smallest, what, example in _TRAINER_COUNTS:  # max_steps first: the defaults of the others follow it
        _whole(cfg, key, smallest, what, example)
    _seed(cfg, "seed")
    _optional_whole(cfg, "trainer.cpu_threads", "torch CPU threads; null: torch's default")
    _epochs(cfg)
    _heartbeat(cfg)
    _debug(cfg)
    for key in ("trainer.progress", "trainer.allow_no_descent", "resume_force", "resume_relayout"):
        _flag(cfg, key)
    _device(cfg)
    _resume(cfg)
    orbax_hooks.check_settings(cfg)  # resume=orbax:PATH, trainer.export, trainer.orbax_naming
    _task_values(cfg)  # task.optimized_metric before the optimized_metric that follows it
    _text(cfg, "optimized_metric")
    _early_stopping_values(cfg)
    _selection(cfg)  # trainer.test_ckpt, trainer.checkpoint.best_by
    _amp(cfg)
    _accumulate(cfg)
    _parallel(cfg)
    _data(cfg)
    _model(cfg)
    _optim(cfg)
    _schedule(cfg)
    task = build.task(cfg)     # the task's loss and metrics import
    _hook_nodes(cfg)
    hooks = build.eval_hooks(cfg)  # each hook's _target_ and keys
    stopper = build.early_stopping(cfg)  # patience, mode, min_delta
    _loggers(cfg)
    _metrics(cfg, task, hooks)
    _descent(cfg)
    return Checked(task, hooks, stopper)


class _Node(dict):
    """A resolved config node: a plain dict read like a ``DictConfig`` (``node.key``, ``node.get``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _nodes(value: Any) -> Any:
    if isinstance(value, dict):
        return _Node({k: _nodes(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_nodes(v) for v in value]
    return value


def _resolved(cfg: DictConfig) -> Any:
    """``cfg`` with its interpolations resolved once, as plain nodes (OmegaConf parses an interpolation at each
    read), or ``cfg`` itself when one fails to resolve: the checks then read it key by key and name the one
    at fault (``trainer.max_steps=abc`` under ``log_every``'s default)."""
    if not isinstance(cfg, DictConfig):
        return cfg
    try:
        return _nodes(OmegaConf.to_container(cfg, resolve=True))
    except Exception:
        return cfg


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


# Checks that build something (the model on the meta device, the stack's reports, the schedule's probes)
# remember what they found for the same resolved settings: a sweep or a test checks many similar configs.
_MEMO: dict[tuple, Any] = {}


def _memo(key: tuple, make: Callable[[], Any]) -> Any:
    if key not in _MEMO:
        if len(_MEMO) > 256:
            _MEMO.clear()
        _MEMO[key] = make()
    return _MEMO[key]


# --- the schema: which keys there are --------------------------------------------------------------------
# The config's own nodes (not _target_ nodes, whose keys are their target's arguments): every key the
# options of conf/ give them (tests/test_settings_fuzz.py checks that this lists every one of them).
SCHEMA: dict[str, tuple[str, ...]] = {
    "": ("seed", "optimized_metric", "resume", "resume_force", "resume_relayout", "model", "data", "task", "optim",
         "schedule", "amp", "accumulate", "parallel", "trainer", "logger", "debug"),
    "optim": ("chain",),
    "trainer": ("max_steps", "max_epochs", "log_every", "eval_every", "eval_batch_size", "checkpoint_every", "keep_last",
                "checkpoint", "test_ckpt", "device", "compile", "cpu_threads", "progress", "heartbeat_s",
                "allow_no_descent", "early_stopping", "eval_hooks", "export", "orbax_naming"),
    "trainer.early_stopping": ("metric", "patience", "mode", "min_delta"),
    "trainer.checkpoint": ("best_by",),
    "debug": ("name", "checkpoints", "limit_train", "limit_val", "limit_test", "overfit_batches", "profile_steps",
              "profile_wait", "shorten", "shortened"),
    "amp": ("policy", "loss_scale", "float8"),
    "amp.float8": ("skip",),
    "accumulate": ("every", "mean", "accumulator_dtype"),
    "parallel": (*distributed.DIMS, "dp", "shard_optimizer", "schedule", "microbatches"),
}
# Nodes whose entries are named by the user, each a _target_ node: their keys are checked against the target.
TARGET_NODES = ("model", "data", "task", "schedule")
NAMED_TARGETS = ("optim.chain", "logger", "trainer.eval_hooks")

# Whole numbers count steps, examples, bytes, widths: the optimizer's step count is an int32 tensor, and no
# size of 2**31 or more fits a tensor on any machine fxtrain runs on, so larger values are typos.
MAX_COUNT = 2**31 - 1
# A static float16 loss scale above 2**24: every gradient above 65504 / 2**24 (about 0.004) overflows and
# its step is skipped (torch's GradScaler starts at 2**16).
MAX_STATIC_FP16_SCALE = 2.0**24


@functools.lru_cache(maxsize=None)
def schema() -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """``(keys, flags)``: :data:`SCHEMA` with every key that ``conf/train.yaml`` and the options of ``conf/trainer``,
    ``amp``, ``accumulate`` and ``parallel`` give these nodes, and the keys whose default there is a boolean.

    >>> keys, flags = schema()
    >>> "max_steps" in keys["trainer"], "trainer.progress" in flags
    (True, True)
    """
    conf = pathlib.Path(str(importlib.resources.files("fxtrain.conf")))
    keys = {node: list(names) for node, names in SCHEMA.items()}
    flags = set()

    def add(node_key: str, node: DictConfig) -> None:
        for name in node:
            if name in ("defaults", "hydra") or not isinstance(name, str):
                continue
            if name not in keys[node_key]:
                keys[node_key].append(name)
            key = f"{node_key}.{name}" if node_key else name
            child = node._get_node(name)
            if isinstance(child, DictConfig) and key in keys:
                add(key, child)
            elif not OmegaConf.is_config(child) and isinstance(child._value(), bool):
                flags.add(key)

    add("", OmegaConf.load(conf / "train.yaml"))
    for group in ("trainer", "amp", "accumulate", "parallel"):
        for option in sorted((conf / group).glob("*.yaml")):
            add(group, OmegaConf.load(option))
    add("debug", OmegaConf.load(conf / "debug" / "_settings.yaml"))  # the options themselves are _global_
    return {node: tuple(names) for node, names in keys.items()}, frozenset(flags)


def _known_keys(cfg: DictConfig) -> None:
    known, flags = schema()
    for node_key, keys in known.items():
        node = cfg if not node_key else _value(cfg, node_key)
        if not isinstance(node, Mapping):
            if node_key and node is not None:  # trainer=5: a node replaced by a value
                raise ConfigError(f"{node_key}={_show(node)}: expected a config node with the keys {', '.join(keys)}")
            continue
        for name in node:
            if name not in keys and not (not node_key and name == "hydra"):  # compose(..., return_hydra_config=True)
                key = f"{node_key}.{name}" if node_key else str(name)
                close = difflib.get_close_matches(str(name), keys, n=1)
                hint = f" (did you mean {node_key + '.' if node_key else ''}{close[0]}?)" if close else ""
                where = f"{node_key}'s settings" if node_key else "the top-level settings"
                raise ConfigError(f"{key}: not a setting fxtrain reads{hint}; {where} are {', '.join(keys)}")
    for key in sorted(flags):  # a boolean in conf/ is a boolean on the command line: nesterov=abc is not true
        _flag(cfg, key)


# --- one setting at a time ----------------------------------------------------------------------------

def _value(cfg: DictConfig, key: str, default: Any = None) -> Any:
    if not isinstance(cfg, DictConfig):  # resolved nodes
        node = cfg
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node
    try:
        return OmegaConf.select(cfg, key, default=default)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: {build.omegaconf_message(e)}") from None


def _show(value: Any) -> str:
    """A value as one writes it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (DictConfig, dict, list)) or OmegaConf.is_config(value):
        return str(_plain(value)).replace(" ", "")
    return str(value) if str(value) else "''"


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite number (an int is a float's value: ``weight_decay=0``)."""
    return _is_number(value) and math.isfinite(value)


def _whole(cfg: DictConfig, key: str, smallest: int | None, what: str, example: Any) -> None:
    value = _value(cfg, key)
    if _is_whole(value) and (smallest is None or value >= smallest) and value <= MAX_COUNT:
        return
    need = {None: "a whole number", 0: "a whole number >= 0", 1: "a positive whole number"}[smallest]
    raise ConfigError(f"{key}={_show(value)}: expected {need} ({what}; at most 2**31-1); e.g. {key}={example}")


def _seed(cfg: DictConfig, key: str) -> None:
    value = _value(cfg, key)
    if not (_is_whole(value) and 0 <= value < 2**64):  # what torch.manual_seed and numpy's generators take
        raise ConfigError(f"{key}={_show(value)}: expected a whole number (params init and batch order; 0 to "
                          f"2**64-1); e.g. {key}=0")


def _optional_whole(cfg: DictConfig, key: str, what: str) -> None:
    value = _value(cfg, key)
    if value is not None and not (_is_whole(value) and 1 <= value <= 1024):
        raise ConfigError(f"{key}={_show(value)}: expected a positive whole number or null ({what}; at most "
                          f"1024); e.g. {key}=1")


def _selection(cfg: DictConfig) -> None:
    """``trainer.test_ckpt`` and ``trainer.checkpoint.best_by``, or one line naming the key."""
    which = cfg.trainer.get("test_ckpt", "best")
    if which not in tasks.TEST_CKPTS:
        raise ConfigError(f"trainer.test_ckpt={which!r}: expected best (the best step by trainer.checkpoint.best_by) "
                          "or last (the params training ended with)")
    node = cfg.trainer.get("checkpoint") or {}
    name = node.get("best_by")
    if name is not None and not (isinstance(name, str) and name):
        raise ConfigError(f"trainer.checkpoint.best_by={name!r}: expected a logged metric name (val_accuracy, "
                          "val_loss...) or null (the optimized metric)")
    if tasks.reads_test(name):
        raise ConfigError(f"trainer.checkpoint.best_by={name}: the test split is evaluated once, at the end; choose "
                          f"by the validation split's val_{name.removeprefix('test_')}")


def _epochs(cfg: DictConfig) -> None:
    """``trainer.max_epochs``: null (the run is given in steps) or a positive whole number of passes."""
    value = _value(cfg, "trainer.max_epochs")
    if value is not None and not (_is_whole(value) and 1 <= value <= 10**6):
        raise ConfigError(f"trainer.max_epochs={_show(value)}: expected a positive whole number of passes over the "
                          "training split (at most 10**6) or null; e.g. trainer.max_epochs=5 trainer.max_steps=null")


def _heartbeat(cfg: DictConfig) -> None:
    """``trainer.heartbeat_s``: seconds between the lines a run without a progress bar says; 0 or null: none."""
    value = _value(cfg, "trainer.heartbeat_s")
    if value is not None and not (_is_real(value) and 0 <= value <= 86400):
        raise ConfigError(f"trainer.heartbeat_s={_show(value)}: expected seconds between heartbeat lines (0 to 86400; "
                          "0 or null: none); e.g. trainer.heartbeat_s=30")


def _debug(cfg: DictConfig) -> None:
    """The ``debug`` node (conf/debug/): each key's value, then the combinations a run cannot do."""
    node = _value(cfg, "debug")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"debug={_show(node)}: expected one of conf/debug/ (debug=fast, overfit, limit, profile)")
    name = node.get("name")
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise ConfigError(f"debug.name={_show(name)}: expected the option's name (fast) or null")
    _flag(cfg, "debug.checkpoints")
    _flag(cfg, "debug.shorten")
    shortened = node.get("shortened", {})
    shortened = {} if shortened is None else shortened  # null: nothing shortened
    if not (isinstance(shortened, Mapping) and all(k in SHORTENED and _is_whole(v) for k, v in shortened.items())):
        raise ConfigError(f"debug.shortened={_show(shortened)}: set by the run (what debug.shorten changed, "
                          f"{{key: whole number}} with keys among {', '.join(SHORTENED)}); leave it out")
    for key in ("limit_train", "limit_val", "limit_test"):
        try:
            fxdata.check_limit(f"debug.{key}", node.get(key))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for key, what, example in (("overfit_batches", "training batches reused every step; 0: off", 1),
                               ("profile_steps", "steps torch.profiler records; 0: off", 5),
                               ("profile_wait", "steps trained before the profiled ones", 3)):
        if key in node:  # +debug.limit_train=0.1 without an option: the others are their defaults
            _whole(cfg, f"debug.{key}", 0, what, example)
    if node.get("overfit_batches") and node.get("limit_train") is not None:
        raise ConfigError(f"debug.limit_train={_show(node['limit_train'])} and debug.overfit_batches="
                          f"{node['overfit_batches']}: overfitting reads its own batches; set one of them "
                          "(debug.limit_train=null)")
    steps, wait, profiled = _value(cfg, "trainer.max_steps"), node.get("profile_wait", 0), node.get("profile_steps", 0)
    if profiled and _is_whole(steps) and wait + profiled > steps:
        raise ConfigError(f"debug.profile_steps={profiled}: after debug.profile_wait={wait} steps the run has "
                          f"{max(steps - wait, 0)} left (trainer.max_steps={steps}); record fewer, or train longer")


SHORTENED = ("accumulate.every", "schedule.warmup_steps")  # what fxtrain.train.shorten_for_debug may shorten


def _flag(cfg: DictConfig, key: str) -> None:
    value = _value(cfg, key, default=False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={_show(value)}: expected true or false")


def _text(cfg: DictConfig, key: str) -> None:
    value = _value(cfg, key)
    if not (isinstance(value, str) and value.strip()):
        raise ConfigError(f"{key}={_show(value)}: expected a metric name, e.g. {key}=test_loss")


def _resume(cfg: DictConfig) -> None:
    value = _value(cfg, "resume")
    if value is None or value == "":  # resume= on the command line: null, as the runner reads it
        return
    if not (isinstance(value, str) and value.strip()):
        raise ConfigError(f"resume={_show(value)}: expected null (start at step 0), auto (this run's newest checkpoint) "
                          "or the path of a checkpoint or run directory")
    if value != "auto" and orbax_hooks.orbax_path(value) is None:  # orbax:PATH: orbax_hooks.check_settings
        path = pathlib.Path(value)
        if not ((path / checkpoint.MANIFEST).exists() or checkpoint.latest(path / "checkpoints")
                or checkpoint.latest(path)):
            raise ConfigError(f"resume={value}: no checkpoint there (expected a checkpoint directory such as "
                              "<run>/checkpoints/step_0000100, or a run directory that has checkpoints/; "
                              "resume=auto for this run's own)")


def _task_values(cfg: DictConfig) -> None:
    node = _value(cfg, "task")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"task={_show(node)}: expected a task config; pick one with task=regression (conf/task)")
    _target_values("task", build.resolve(node, "task"))


def _hook_nodes(cfg: DictConfig) -> None:
    hooks = _value(cfg, "trainer.eval_hooks")
    if hooks is None:
        return
    if not isinstance(hooks, Mapping):
        raise ConfigError(f"trainer.eval_hooks={_show(hooks)}: expected named hooks, each a _target_ node "
                          "(+trainer.eval_hooks.mine._target_=mylib.hook), or {} for none")
    for name, node in hooks.items():
        if not (isinstance(node, Mapping) and "_target_" in node):
            raise ConfigError(f"trainer.eval_hooks.{name}={_show(node)}: expected a _target_ node "
                              f"(+trainer.eval_hooks.{name}._target_=mylib.hook)")


def _device(cfg: DictConfig) -> None:
    name = _value(cfg, "trainer.device")
    if name == "auto":
        return
    try:
        if not isinstance(name, str):
            raise TypeError(name)
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"trainer.device={_show(name)}: not a device torch knows; use auto (CUDA when there is "
                          "one), cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build_kind = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError(f"trainer.device={name}: CUDA is not available here ({build_kind} "
                              f"{torch.__version__}); use trainer.device=cpu, or auto (CUDA when there is one)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"trainer.device={name}: there are {torch.cuda.device_count()} CUDA devices here "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); use one of them, or auto")


def _early_stopping_values(cfg: DictConfig) -> None:
    """Its values also while ``metric`` is null (early stopping off): a later ``metric=...`` must not meet them."""
    node = "trainer.early_stopping"
    metric = _value(cfg, f"{node}.metric")
    if metric is not None and not (isinstance(metric, str) and metric.strip()):
        raise ConfigError(f"{node}.metric={_show(metric)}: expected a metric name (test_loss, loss...) or null (off)")
    patience = _value(cfg, f"{node}.patience", default=5)
    if not (_is_whole(patience) and 1 <= patience <= MAX_COUNT):
        raise ConfigError(f"{node}.patience={patience!r}: expected a whole number >= 1 (logged values without "
                          "improvement before stopping)")
    mode = _value(cfg, f"{node}.mode", default="auto")
    if mode not in ("auto", "min", "max"):
        raise ConfigError(f"{node}.mode={mode!r}: expected auto, min or max")
    delta = _value(cfg, f"{node}.min_delta", default=0.0)
    if not (_is_real(delta) and delta >= 0):
        raise ConfigError(f"{node}.min_delta={_show(delta)}: expected a finite number >= 0 (the least change that "
                          "counts as an improvement)")


# --- amp, accumulate, parallel: checked whatever is active ------------------------------------------------

def _amp(cfg: DictConfig) -> None:
    policy = _value(cfg, "amp.policy")
    if policy is not None and not (isinstance(policy, str) and policy.strip()):
        raise ConfigError(f"amp.policy={_show(policy)}: expected a policy such as p=f32,c=bf16,o=f32, a preset name "
                          "(bf16, fp16...) or null (no mixed precision)")
    parsed = None
    if policy is not None:
        try:
            parsed = fx.Policy.parse(policy)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"amp.policy={_show(policy)}: {str(e).splitlines()[0]}") from None
    scale = _value(cfg, "amp.loss_scale")
    if isinstance(scale, Mapping):
        _loss_scale_fields(cfg)
        scale = dict(_plain(scale))
    elif scale is not None and not (isinstance(scale, str) and scale in ("none", "dynamic")):
        if not (_is_real(scale) and scale > 0):
            raise ConfigError(f"amp.loss_scale={_show(scale)}: expected null (the policy's default), none, dynamic, "
                              "a finite number > 0 (a static scale) or DynamicLossScale's settings")
        half = parsed is not None and torch.float16 in (parsed.compute_dtype, parsed.output_dtype, parsed.param_dtype)
        if half and scale > MAX_STATIC_FP16_SCALE:
            raise ConfigError(f"amp.loss_scale={_show(scale)}: a static float16 loss scale above 2**24 overflows every "
                              "gradient above 65504/2**24 and skips its step; use dynamic, or at most 16777216")
    try:  # the library's own checks, also for a loss scale that no policy uses (amp.policy=null)
        fx.amp_cast(fx.identity(), policy if policy is not None else "p=f32,c=f32,o=f32", loss_scale=scale)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"amp.loss_scale={_show(scale)}: {str(e).splitlines()[0]}") from None
    _float8(cfg)


def _float8(cfg: DictConfig) -> None:
    """``amp.float8`` (``amp=float8``): null, or its ``skip`` a list of Linear layer names (checked against the model
    when it is built: :func:`fxtrain.build.float8`)."""
    node = _value(cfg, "amp.float8")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"amp.float8={_show(node)}: expected null (no float8) or a node with skip: [...] "
                          "(amp=float8 gives one)")
    skip = _value(cfg, "amp.float8.skip")
    if skip is not None and not (isinstance(skip, Sequence) and not isinstance(skip, str)
                                 and all(isinstance(s, str) and s for s in skip)):
        raise ConfigError(f"amp.float8.skip={_show(skip)}: expected a list of Linear layer names kept out of "
                          "float8, e.g. [head], or [] for none")


def _loss_scale_fields(cfg: DictConfig) -> None:
    fields = {f.name: f for f in dataclasses.fields(fx.DynamicLossScale)}
    node = _value(cfg, "amp.loss_scale")
    for name in node:
        key = f"amp.loss_scale.{name}"
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f" (did you mean amp.loss_scale.{close[0]}?)" if close else ""
            raise ConfigError(f"{key}: not a setting of DynamicLossScale{hint}; it takes {', '.join(fields)}")
        value = _value(cfg, key)
        if name in ("growth_interval", "hysteresis"):
            ok, need = _is_whole(value) and 1 <= value <= MAX_COUNT, "a whole number >= 1"
        elif name in ("min_scale", "max_scale"):
            ok, need = value is None or (_is_real(value) and value > 0), "a finite number > 0, or null"
        elif name == "backoff_factor":
            ok, need = _is_real(value) and 0 < value < 1, "a number between 0 and 1"
        elif name == "growth_factor":
            ok, need = _is_real(value) and value > 1, "a finite number > 1"
        else:
            ok, need = _is_real(value) and value > 0, "a finite number > 0"
        if not ok:
            raise ConfigError(f"{key}={_show(value)}: expected {need}")


_DTYPES = ("float32", "float64", "bfloat16", "float16", "f32", "f64", "bf16", "f16")


def _accumulate(cfg: DictConfig) -> None:
    every = _value(cfg, "accumulate.every", default=1)
    if not (_is_whole(every) and 1 <= every <= MAX_COUNT):
        raise ConfigError(f"accumulate.every={_show(every)}: expected a positive whole number (batches per optimizer "
                          "update); e.g. accumulate.every=4")
    _flag(cfg, "accumulate.mean")
    dtype = _value(cfg, "accumulate.accumulator_dtype")
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"accumulate.accumulator_dtype={_show(dtype)}: expected null (the gradients' dtype) or one "
                          f"of {', '.join(_DTYPES)}")
    max_steps = cfg.trainer.max_steps
    if max_steps % every:
        raise ConfigError(f"accumulate.every={every}: trainer.max_steps={max_steps} is not a multiple of it (both "
                          "count batches); make max_steps a multiple")


def _parallel(cfg: DictConfig) -> None:
    dp = _value(cfg, "parallel.dp")
    if dp is not None:
        raise ConfigError(f"parallel.dp={_show(dp)}: the data-parallel degree is now parallel.dp_replicate (replicated "
                          "params, parallel=dp) or parallel.dp_shard (FSDP, parallel=fsdp)")
    free = []
    for dim in distributed.DIMS:
        size = _value(cfg, f"parallel.{dim}")
        if size is not None and not (_is_whole(size) and (size == -1 or 1 <= size <= MAX_COUNT)):
            raise ConfigError(f"parallel.{dim}={_show(size)}: expected a positive whole number of ranks, or -1 (the "
                              "rest of the world)")
        if size == -1:
            free.append(f"parallel.{dim}=-1")
    if len(free) > 1:
        raise ConfigError(f"{' and '.join(free)}: only one degree can take the rest of the world; give the others a "
                          "size (e.g. parallel.dp_replicate=2)")
    _flag(cfg, "parallel.shard_optimizer")
    schedule = _value(cfg, "parallel.schedule", default="gpipe")  # absent: the runner's default
    if schedule not in ("gpipe", "1f1b"):  # null too: the pipeline would look up a schedule named None
        raise ConfigError(f"parallel.schedule={_show(schedule)}: expected gpipe or 1f1b (the pipeline schedule)")
    micro = _value(cfg, "parallel.microbatches", default=4)
    if not (_is_whole(micro) and 1 <= micro <= MAX_COUNT):  # null too: int(None) where the pipeline reads it
        raise ConfigError(f"parallel.microbatches={_show(micro)}: expected a positive whole number (micro-batches "
                          "per batch)")
    # Checked whatever the layout, as the other settings are: a batch splits into at most data.batch_size
    # micro-batches of one example. Only the preset's own default is left alone where no pipeline can read it
    # (parallel.pp=1), so that a small data.batch_size is not refused for a setting the user never wrote.
    batch = _value(cfg, "data.batch_size")
    unread = _value(cfg, "parallel.pp", default=1) == 1 and micro == _parallel_default("microbatches")
    if _is_whole(micro) and _is_whole(batch) and 1 <= batch < micro and not unread:  # data.batch_size < 1: _data
        raise ConfigError(f"parallel.microbatches={micro}: a batch of data.batch_size={batch} examples splits into at "
                          f"most {batch} micro-batches (the pipeline's, parallel.pp > 1); pick a divisor of the "
                          f"per-rank batch, e.g. parallel.microbatches={max(d for d in range(1, min(batch, 4) + 1) if batch % d == 0)}")


@functools.lru_cache(maxsize=None)
def _parallel_default(key: str) -> Any:
    """``key``'s default in ``conf/parallel/_degrees.yaml``, which every parallel preset starts from."""
    conf = pathlib.Path(str(importlib.resources.files("fxtrain.conf")))
    return OmegaConf.load(conf / "parallel" / "_degrees.yaml").get(key)


# --- _target_ nodes: their keys are their target's arguments, checked by name --------------------------------
# Rules for the arguments of fxtrain's own targets, by name: (check, what is expected). Numbers are finite;
# an int is accepted where a float is expected (build converts it). A user's target gets its signature only.

def _real(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    def ok(v: Any) -> bool:
        return (_is_real(v) and (lo is None or (v > lo if lo_open else v >= lo))
                and (hi is None or (v < hi if hi_open else v <= hi)))
    if lo is not None and hi is not None:
        text = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f"a finite number {'>' if lo_open else '>='} {lo:g}"
    else:
        text = "a finite number"
    return ok, text


def _count(lo: int):
    return (lambda v: _is_whole(v) and lo <= v <= MAX_COUNT), f"a whole number >= {lo} (up to 2**31-1)"


def _counts(lo: int, empty: bool):
    return ((lambda v: isinstance(v, (list, tuple)) and (empty or len(v) > 0)
             and all(_is_whole(x) and lo <= x <= MAX_COUNT for x in v)),
            f"a{'' if empty else ' non-empty'} list of whole numbers >= {lo}")


def _optional(rule):
    ok, text = rule
    return (lambda v: v is None or ok(v)), f"{text}, or null"


def _choice(*options: str):
    return (lambda v: v in options), f"one of {', '.join(options)}"


_FLAG = ((lambda v: isinstance(v, bool)), "true or false")
_NAME = ((lambda v: isinstance(v, str) and bool(v.strip())), "a non-empty name")
_PATH = ((lambda v: isinstance(v, str) and bool(v.strip())), "a non-empty path")
_NAMES = ((lambda v: _NAME[0](v) or (isinstance(v, (list, tuple)) and len(v) > 0 and all(_NAME[0](x) for x in v))),
          "a non-empty name or list of names")
_PATHS = ((lambda v: _PATH[0](v) or (isinstance(v, (list, tuple)) and len(v) > 0 and all(_PATH[0](x) for x in v))),
          "a non-empty path, pattern or URL, or a list of them")
_FILES = ((lambda v: _PATHS[0](v) or (isinstance(v, Mapping) and len(v) > 0 and all(_PATHS[0](x) for x in v.values()))),
          "a path, a glob, a list of them, or {split: files}")
_NODE = ((lambda v: isinstance(v, Mapping) and "_target_" in v), "a _target_ node (your function returning it)")
_MOMENT = _real(0, 1, hi_open=True)
_MULTIPLE = _real(0)  # a schedule's multiple of the learning rate

ARG_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    # transforms and optimizers; the sign of learning_rate and step_size is the descent check's
    "learning_rate": _real(), "step_size": _real(),
    "b1": _MOMENT, "b2": _MOMENT, "decay": _MOMENT, "momentum": _optional(_MOMENT), "rho": _MOMENT,
    "eps": _real(0), "eps_root": _real(0), "weight_decay": _real(0), "initial_accumulator_value": _real(0),
    "max_norm": _real(0, lo_open=True), "max_delta": _real(0, lo_open=True),
    "nesterov": _FLAG, "centered": _FLAG, "flip_sign": _FLAG,
    # schedules: multiples of the optimizer's learning_rate
    "value": _MULTIPLE, "init_value": _MULTIPLE, "peak_value": _MULTIPLE, "end_value": _MULTIPLE,
    "alpha": _real(0, 1), "exponent": _real(0, lo_open=True), "power": _real(0, lo_open=True),
    "warmup_steps": _count(0), "decay_steps": _count(1), "transition_steps": _count(1), "decay_rate": _real(0),
    # models
    "input_shape": _counts(1, empty=False), "hidden": _counts(1, empty=True), "blocks": _counts(1, empty=False),
    "num_classes": _count(1), "width": _count(1), "vocab_size": _count(1), "context": _count(1),
    "d_model": _count(1), "n_layers": _count(1), "n_heads": _count(1), "experts": _count(1), "top_k": _count(1),
    "activation": _choice("relu", "gelu", "tanh", "silu"),
    # data
    "batch_size": _count(1), "num_examples": _count(2), "max_bytes": _count(1), "eval_windows": _count(1),
    "test_batches": _count(1), "test_fraction": _real(0, 1, lo_open=True, hi_open=True), "noise": _real(0),
    "val_fraction": _real(0, 1, hi_open=True),
    # data formats (fxtrain/sources.py); their Literal choices (order, dtype, builder) are the annotations'
    "dir": _PATH, "path": _PATH, "train_file": _PATH, "val_file": _optional(_PATH), "test_file": _optional(_PATH),
    "from_disk": _optional(_PATH), "data_files": _optional(_FILES), "cache_dir": _optional(_PATH),
    "input": _NAMES, "target": _optional(_NAME), "split": _NAME, "test_split": _optional(_NAME),
    "val_split": _optional(_NAME), "train_shards": _PATHS, "test_shards": _PATHS, "val_shards": _optional(_PATHS),
    "train": _NODE, "test": _NODE, "val": _optional(_NODE), "stride": _count(1), "eval_examples": _count(1),
    "read_threads": _count(0),
    "split_seed": ((lambda v: _is_whole(v) and 0 <= v < 2**64), "a whole number from 0 to 2**64-1"),
    "seed": ((lambda v: _is_whole(v) and 0 <= v < 2**64), "a whole number from 0 to 2**64-1"),
    # tasks and loggers
    "optimized_metric": _NAME, "filename": _NAME, "subdir": _NAME, "experiment": _NAME, "project": _NAME,
}
FLAGS = frozenset(n for n, rule in ARG_RULES.items() if rule is _FLAG)
NUMBERS = frozenset(("learning_rate", "step_size", "b1", "b2", "decay", "momentum", "eps", "eps_root", "weight_decay",
                     "rho", "initial_accumulator_value", "max_norm", "max_delta", "value", "init_value", "peak_value",
                     "end_value", "alpha", "exponent", "power", "warmup_steps", "decay_steps", "transition_steps",
                     "decay_rate"))
OPTIONAL_NUMBERS = frozenset(("momentum",))


def _is_fxtrain(spec: dict) -> bool:
    return isinstance(spec.get("_target_"), str) and spec["_target_"].split(".")[0] == "fxtrain"


def _target_values(key: str, spec: dict, skip: tuple[str, ...] = ()) -> None:
    """The values of an fxtrain target's arguments against :data:`ARG_RULES` (and bool/int annotations)."""
    if not _is_fxtrain(spec):
        return
    for name, value in spec.items():
        if name == "_target_" or name in skip or (isinstance(value, dict) and "_target_" in value):
            continue
        rule = ARG_RULES.get(name)
        if rule is not None and not rule[0](value):
            raise ConfigError(f"{key}.{name}={_show(value)}: expected {rule[1]}")
        if rule is None and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}.{name}={_show(value)}: expected a finite number")
    # The others against the target's annotations (batchnorm: bool takes true or false, not 1).
    typed_args(key, build.locate(spec, key), {k: v for k, v in spec.items() if k != "_target_" and k not in skip
                                              and k not in ARG_RULES and not (isinstance(v, dict) and "_target_" in v)})


def _data(cfg: DictConfig) -> None:
    node = _value(cfg, "data")
    if not isinstance(node, Mapping):
        raise ConfigError(f"data={_show(node)}: expected a data config; pick one with data=digits (conf/data)")
    for name, smallest, what, example in _DATA_COUNTS:
        if name in node and name != "split_seed":
            _whole(cfg, f"data.{name}", smallest, what, example)
    if "test_fraction" in node:
        value = _value(cfg, "data.test_fraction")
        if not (_is_number(value) and 0 < value < 1):
            raise ConfigError(f"data.test_fraction={_show(value)}: expected a number between 0 and 1 (the share "
                              "held out for evaluation); e.g. data.test_fraction=0.25")
    _val_fraction(cfg, node)
    try:  # the loader's settings (map-style sources' workers), each named in one line
        fxdata.check_loader(**{k: _value(cfg, f"data.{k}") for k in fxdata.LOADER_KEYS if k in node}, prefix="data.")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    spec = build.resolve(node, "data")
    build.data_keys(spec)
    _target_values("data", spec)
    for name, value in spec.items():  # a nested _target_ (data=grain's pipelines): its keys and values, unbuilt
        if isinstance(value, Mapping) and "_target_" in value:
            fn = build.locate(value, f"data.{name}")
            build.check_args(fn, {k: v for k, v in value.items() if k != "_target_"}, f"data.{name}", value["_target_"])
            _target_values(f"data.{name}", value)


def _val_fraction(cfg: DictConfig, node: Mapping) -> None:
    """``data.val_fraction``: a share in [0, 1) that leaves training rows beside ``data.test_fraction``."""
    if "val_fraction" not in node:
        return
    value, test = _value(cfg, "data.val_fraction"), node.get("test_fraction", 0)
    if not (_is_number(value) and 0 <= value < 1 and (not _is_number(test) or value + test < 1)):
        raise ConfigError(f"data.val_fraction={_show(value)}: expected a number from 0 (no validation split) up to "
                          f"below 1 - data.test_fraction ({test}); e.g. data.val_fraction=0.15")


def _model(cfg: DictConfig) -> None:
    """The model's values, then the model built on the meta device (no memory, no random numbers drawn):
    its own checks (``d_model`` divisible by ``n_heads``, ``top_k`` <= ``experts``) before anything is written."""
    node = _value(cfg, "model")
    if not isinstance(node, Mapping):
        raise ConfigError(f"model={_show(node)}: expected a model config; pick one with model=mlp (conf/model)")
    mode = node.get("activation_checkpoint", "none")
    if mode not in parallel.AC_MODES:
        raise ConfigError(f"model.activation_checkpoint={_show(mode)}: expected none, full (recompute every block in "
                          "the backward pass) or selective (every other block); e.g. model.activation_checkpoint=full")
    spec = build.model_node(build.resolve(node, "model"))
    for name in spec:  # model.activation_checkpointing=full: the runner's key, not an argument the model lacks
        close = difflib.get_close_matches(str(name), build.MODEL_SETTINGS, n=1, cutoff=0.8)
        if close and name != "_target_":
            raise ConfigError(f"model.{name}: not a setting fxtrain reads (did you mean model.{close[0]}?)")
    build.target(spec, "model")  # its keys against the target's signature
    _target_values("model", spec)
    data = _value(cfg, "data")
    if _is_fxtrain(spec) and isinstance(data, Mapping):  # the data's facts, which the model's defaults follow
        data = _plain(data)
        # num_classes is the data's class count only where the task reads targets as classes (classification):
        # a regression on the same data has one output (model.num_classes=1) whatever data.num_classes says.
        task = _value(cfg, "task")
        classes = not isinstance(task, Mapping) or task.get("_target_") == "fxtrain.tasks.classification"
        for name, fits, need in (("num_classes", lambda m, d: m == d, "equal to"),
                                 ("input_shape", lambda m, d: list(m) == list(d), "equal to"),
                                 ("vocab_size", lambda m, d: m >= d, "at least"),
                                 ("context", lambda m, d: m >= d, "at least")):
            if name == "num_classes" and not classes:
                continue
            if name in spec and name in data and not fits(spec[name], data[name]):
                raise ConfigError(f"model.{name}={_show(spec[name])}: the data has data.{name}={_show(data[name])}; "
                                  f"the model's must be {need} it (its default, ${{data.{name}}}, follows the data)")
    if _is_fxtrain(spec):
        def meta() -> str | None:
            with torch.device("meta"):
                model = build.instantiate(spec, "model")
            try:
                parallel.checkpointed_blocks(model, mode)  # a model with blocks to checkpoint, no buffers in them
            except ValueError as e:
                return str(e)
            return parallel.compile_refusal(model) if compiled else None  # a layer torch cannot compile
        compiled = _value(cfg, "trainer.compile", default=False) is True
        refused = _memo(("model", repr(spec), mode, compiled), meta)
        if refused:
            raise ConfigError(refused)


def _optim(cfg: DictConfig) -> None:
    chain = _value(cfg, "optim.chain")
    # An entry without _target_ is a setting left for a transform the chain does not list (an experiment's
    # optim.chain.adamw.learning_rate after optim/transform@optim.chain=[sgd]).
    names = [n for n in chain if isinstance(chain[n], Mapping) and "_target_" in chain[n]] \
        if isinstance(chain, Mapping) else []
    if not names:
        raise ConfigError("optim.chain=[]: no transform, so nothing would update the params; pick some, e.g. "
                          "'optim/transform@optim.chain=[clip_by_global_norm,adamw]'")
    for name in chain:
        if name not in names:
            raise ConfigError(f"optim.chain.{name}={_show(chain[name])}: {name} is not in the chain "
                              f"(optim/transform@optim.chain=[{','.join(names)}]); add it there, or remove the "
                              f"setting with '~optim.chain.{name}'")
    for name in names:
        key = f"optim.chain.{name}"
        factory, kwargs = build.target(chain[name], key)  # keys checked against the factory's signature
        spec = build.resolve(chain[name], key)
        if "learning_rate" in _arguments(factory):
            lr = kwargs.get("learning_rate")
            if not _is_real(lr):
                # fx.adam(None) leaves the updates unscaled: params would move by +1 along Adam's direction.
                raise ConfigError(f"{key}.learning_rate={_show(lr)}: expected a number >= 0 (the schedule's peak); "
                                  f"e.g. {key}.learning_rate=1e-3")
        if _is_fxtrain(spec):
            _types(key, spec)
        try:
            factory(**kwargs)  # the library's own checks, on the config's plain values (ints where floats go too)
        except (TypeError, ValueError) as e:
            raise ConfigError(_library_message(key, kwargs, e)) from None
        _target_values(key, spec)


def _types(key: str, spec: dict) -> None:
    """Types first, so that the library's checks see numbers: a flag is a bool (``nesterov=abc`` is not read as
    true), a number is finite; the ranges of :data:`ARG_RULES` follow the library's own checks."""
    for name, value in spec.items():
        if name in FLAGS and not isinstance(value, bool):
            raise ConfigError(f"{key}.{name}={_show(value)}: expected true or false")
        if name in NUMBERS and not (_is_real(value) or (value is None and name in OPTIONAL_NUMBERS)):
            raise ConfigError(f"{key}.{name}={_show(value)}: expected {ARG_RULES[name][1]}")


def _arguments(factory: Any) -> set[str]:
    try:
        return set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return set()


def _library_message(key: str, kwargs: dict, error: Exception) -> str:
    """``optim.chain.sgd.momentum=-0.9: sgd: momentum=-0.9 must be >= 0``: the key of the argument the library names."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    for arg, value in kwargs.items():
        if f"{arg}=" in text or f"{arg} " in text:
            return f"{key}.{arg}={_show(value)}: {text}; change {key}.{arg}"
    return f"{key}: {text}"


# --- the schedule -----------------------------------------------------------------------------------

def _schedule(cfg: DictConfig) -> None:
    node = _value(cfg, "schedule")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"schedule={_show(node)}: expected a schedule config; pick one with schedule=cosine "
                          "(conf/schedule)")
    max_steps = cfg.trainer.max_steps
    warmup = _value(cfg, "schedule.warmup_steps") if "warmup_steps" in node else None
    if warmup is not None:
        if not (_is_whole(warmup) and warmup >= 0):
            raise ConfigError(f"schedule.warmup_steps={_show(warmup)}: expected a whole number >= 0 (steps); "
                              "e.g. schedule.warmup_steps=50")
        if warmup >= max_steps:
            raise ConfigError(f"schedule.warmup_steps={warmup}: warmup must end before the run does "
                              f"(trainer.max_steps={max_steps}); lower it, or leave it out: the default is 5% of "
                              "the run")
    for name in node:  # a negative value of the shape turns the learning rate negative: ascent
        value = _value(cfg, f"schedule.{name}")
        if name.endswith("value") or name == "alpha":
            if _is_number(value) and value < 0:
                raise ConfigError(f"schedule.{name}={_show(value)}: the schedule multiplies the optimizer's "
                                  "learning_rate, and a negative multiple would climb the loss; use a value >= 0")
    spec = build.resolve(node, "schedule")
    if _is_fxtrain(spec):
        _types("schedule", spec)
    _target_values("schedule", spec)
    build.instantiate(node, "schedule")


def _multiples(cfg: DictConfig) -> list[tuple[int, float]]:
    """``(step, multiple)`` of the schedule at step 0, its quarters and its last step (all 1 without one)."""
    max_steps = cfg.trainer.max_steps
    steps = sorted({0, 1, max_steps // 4, max_steps // 2, 3 * max_steps // 4, max_steps - 1, max_steps})
    if cfg.get("schedule") is None:
        return [(s, 1.0) for s in steps]
    spec = build.resolve(cfg.schedule, "schedule")

    def probe() -> list[tuple[int, float]]:
        shape = build.instantiate(spec, "schedule")
        return [(s, float(shape(s))) for s in steps]
    return _memo(("schedule", repr(spec), max_steps), probe)


# --- what the chain does to the gradient ---------------------------------------------------------------

def _descent(cfg: DictConfig) -> None:
    """The chain must step against the gradient: the product of the signs of its scaling entries is -1.

    An entry that takes a ``learning_rate`` (an optimizer, ``scale_by_learning_rate``) multiplies by
    ``-learning_rate * schedule`` (``+`` with ``flip_sign=false``); ``scale`` by its ``step_size``; the
    others keep the direction. Two optimizers in one chain flip twice (an ascent), a negative ``scale``
    flips once, a zero learning rate (or a schedule that is 0 at every probed step) moves nothing.
    """
    chain = cfg.optim.chain
    names = [n for n in chain if "_target_" in chain[n]]
    multiples = _multiples(cfg)
    for step, multiple in multiples:
        if not math.isfinite(multiple) or multiple < 0:
            raise ConfigError(f"schedule: the learning-rate multiple at step {step} is {multiple:g}, which would "
                              f"{'climb the loss' if multiple < 0 else 'not train'}; change the schedule's values "
                              f"({_settings(cfg, 'schedule')})")
    moves = any(m > 0 for _, m in multiples)
    sign, flips, lr_entries = 1, [], []
    for key, factory, kwargs in (e for name in names for e in _entries(f"optim.chain.{name}", chain[name])):
        if "learning_rate" in _arguments(factory):
            lr = kwargs["learning_rate"]
            lr_entries.append(f"{key}.learning_rate={_show(lr)}")
            if lr == 0 or not moves:
                if _value(cfg, "trainer.allow_no_descent", default=False):
                    continue
                where = (f"{key}.learning_rate=0" if lr == 0 else
                         f"{key}.learning_rate={_show(lr)} times the schedule ({_settings(cfg, 'schedule')}), 0 at "
                         "every probed step")
                raise ConfigError(f"{where}: the params would not move; use a learning rate > 0 (or "
                                  "trainer.allow_no_descent=true)")
            entry = -1 if kwargs.get("flip_sign", True) is not False else 1
        elif factory is getattr(fx, "scale", None) and _is_number(kwargs.get("step_size")):
            entry = 1 if kwargs["step_size"] > 0 else -1 if kwargs["step_size"] < 0 else 0
            if entry != 1:
                flips.append(f"{key}.step_size={_show(kwargs['step_size'])}")
        else:
            continue
        sign *= entry
    if sign == -1 or _value(cfg, "trainer.allow_no_descent", default=False):
        return
    listed = ",".join(names)
    if not lr_entries:
        raise ConfigError(f"optim.chain=[{listed}]: no entry takes a learning_rate, so nothing steps against "
                          "the gradient (the params would move along it, or only decay); add an optimizer "
                          f"('optim/transform@optim.chain=[{listed},sgd]'), or pass "
                          "trainer.allow_no_descent=true if that is what you want")
    culprits = flips or lr_entries[1:]
    would = "not move the params" if sign == 0 else "climb the loss"
    raise ConfigError(f"{culprits[0]}: the chain [{listed}] would {would} "
                      f"(its entries' signs: {' '.join([*lr_entries, *flips])}; each optimizer negates the gradient "
                      "once); keep one optimizer and positive scales, or pass trainer.allow_no_descent=true")


def _entries(key: str, node: Any) -> Iterator[tuple[str, Callable, dict]]:
    """``(key, factory, kwargs)`` of a chain entry, then of the transforms it wraps, depth first
    (``optim.chain.apply_if_finite.inner``: the optimizer inside the wrapper)."""
    factory, kwargs = build.target(node, key)
    yield key, factory, kwargs
    for name, value in build.resolve(node, key).items():
        many = isinstance(value, list)
        for i, sub in enumerate(value if many else [value]):
            if isinstance(sub, Mapping) and "_target_" in sub:
                yield from _entries(f"{key}.{name}" + (f".{i}" if many else ""), sub)


def _settings(cfg: DictConfig, key: str) -> str:
    node = _plain(_value(cfg, key))
    return " ".join(f"{key}.{k}={_show(v)}" for k, v in node.items() if k != "_target_")


# --- loggers and metrics ----------------------------------------------------------------------------

def _loggers(cfg: DictConfig) -> None:
    node = _value(cfg, "logger")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"logger={_show(node)}: expected named loggers; pick them with 'logger=[jsonl,csv]'")
    if "_target_" in node:
        return  # open_loggers names this layout
    for name in node:
        key = f"logger.{name}"
        if not (isinstance(node[name], Mapping) and "_target_" in node[name]):
            raise ConfigError(f"{key}={_show(node[name])}: expected a logger, a _target_ node; pick loggers with "
                              "'logger=[jsonl,csv]' (conf/logger)")
        spec = build.resolve(node[name], key)
        fn = build.locate(spec, key)
        kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        build.check_args(fn, {**kwargs, "dir": ".", "start": 0, "config": {}}, key, spec["_target_"])
        _target_values(key, spec)
        if _is_fxtrain(spec):
            typed_args(key, fn, kwargs)
            _nested_values(key, kwargs, _option_schema("logger").get(spec["_target_"], {}))
            own = getattr(fn, "check_settings", None)  # a logger's own rules (MLflow's URI, wandb.Settings)
            if own is not None:
                try:
                    own(**kwargs)
                except ValueError as e:
                    raise ConfigError(f"{key}.{str(e).splitlines()[0]}") from None


def annotation_rule(annotation: Any) -> tuple[Callable[[Any], bool], str] | None:
    """The rule a parameter's annotation states (``str``, ``bool``, ``int``, ``float``, ``dict``, ``list``,
    ``Literal[...]`` and their unions with ``None``), or ``None`` for one it does not (``os.PathLike``...).

    >>> ok, text = annotation_rule(int | None)
    >>> ok(3), ok(None), ok(True), text
    (True, True, False, 'a whole number, or null')
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rules = [annotation_rule(a) for a in args if a is not type(None)]
        if not rules or any(r is None for r in rules):
            return None
        optional = type(None) in args
        return ((lambda v: (optional and v is None) or any(r[0](v) for r in rules)),
                " or ".join(r[1] for r in rules) + (", or null" if optional else ""))
    if origin is typing.Literal:
        return _choice(*args)
    return _SIMPLE_RULES.get(origin or annotation)


_SIMPLE_RULES: dict[Any, tuple[Callable[[Any], bool], str]] = {
    str: ((lambda v: isinstance(v, str)), "a string"),
    bool: ((lambda v: isinstance(v, bool)), "true or false"),
    int: (_is_whole, "a whole number"),
    float: (_is_real, "a finite number"),
    dict: ((lambda v: isinstance(v, Mapping)), "a mapping ({key: value, ...})"),
    list: ((lambda v: isinstance(v, (list, tuple))), "a list"),
}


def typed_args(key: str, fn: Callable, kwargs: Mapping) -> None:
    """Each of ``kwargs`` against the annotation of ``fn``'s parameter of that name (:func:`annotation_rule`):
    a new argument of a logger or launcher is checked the day it is added, with no rule to write.

    >>> from fxtrain.loggers import MlflowLogger
    >>> typed_args("logger.mlflow", MlflowLogger, {"tracking_uri": 5})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: logger.mlflow.tracking_uri=5: expected a string, or null
    """
    try:
        hints = typing.get_type_hints(fn.__init__ if isinstance(fn, type) else fn)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate states no rule
        hints = {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    for name, value in kwargs.items():
        rule = annotation_rule(hints[name]) if name in hints else None
        if rule is None and name in params:  # `Any` (a number or a tensor): a config holds no tensor, so its default's type
            default = params[name].default
            rule = (_FLAG if isinstance(default, bool) else (_is_real, "a finite number") if _is_number(default)
                    else None)
        if rule is not None and not rule[0](value):
            raise ConfigError(f"{key}.{name}={_show(value)}: expected {rule[1]}")


# --- hydra.launcher: generated from conf/hydra/launcher -------------------------------------------------

def launcher_schema() -> dict[str, dict[str, list[Any]]]:
    """``{_target_: {key: [defaults]}}`` of the launchers ``conf/hydra/launcher/*.yaml`` configure, every key at
    every depth (``executor.timeout_min``) with the defaults its options give it: what :func:`check_launcher`
    checks a ``hydra.launcher`` node against, so that a key added there is checked the day it is added.

    >>> sorted(launcher_schema()["hydra_plugins.fxtrain_vmap_launcher.vmap_launcher.VmapLauncher"])[:4]
    ['_target_', 'cache_dir', 'compile', 'executor']
    """
    return _option_schema("hydra/launcher")


@functools.lru_cache(maxsize=None)
def _option_schema(group: str) -> dict[str, dict[str, list[Any]]]:
    """``{_target_: {key: [defaults]}}`` of the ``_target_`` nodes the options of ``conf/<group>`` configure (an
    option's one node under its name too: ``conf/logger/csv.yaml`` is ``csv: {_target_: ...}``)."""
    out: dict[str, dict[str, list[Any]]] = {}
    conf = pathlib.Path(str(importlib.resources.files("fxtrain.conf"))) / group

    def add(keys: dict[str, list[Any]], node: DictConfig, prefix: str) -> None:
        for name in node:
            child = node._get_node(name)
            key = f"{prefix}{name}"
            value = None if child._is_interpolation() else _plain(child._value()) if not OmegaConf.is_config(
                child) or not child._is_none() else None
            keys.setdefault(key, []).append(value)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
                add(keys, child, f"{key}.")

    for option in sorted(conf.glob("*.yaml")):
        node = OmegaConf.load(option)
        for spec in [node, *(node[k] for k in node if OmegaConf.is_dict(node[k]))]:
            target = spec.get("_target_") if OmegaConf.is_dict(spec) else None
            if isinstance(target, str):
                add(out.setdefault(target, {}), spec, "")
    return out


def _nested_values(key: str, spec: Mapping, schema: Mapping[str, list[Any]]) -> None:
    """The entries of a target's mapping arguments (``logger.wandb.settings.quiet``) against the type of their
    defaults in the options of conf/ (:func:`_rule_of_defaults`): a boolean there takes true or false, not 1."""
    def walk(node: Mapping, prefix: str) -> None:
        for name, value in node.items():
            where = f"{prefix}{name}"
            rule = _rule_of_defaults(schema.get(where, []))
            if rule is not None and not rule[0](value):
                raise ConfigError(f"{key}.{where}={_show(value)}: expected {rule[1]}")
            if isinstance(value, Mapping):
                walk(value, f"{where}.")
    for name, value in spec.items():
        if isinstance(value, Mapping) and not (name == "_target_"):
            walk(value, f"{name}.")


def _rule_of_defaults(defaults: list[Any]) -> tuple[Callable[[Any], bool], str] | None:
    """The type every non-null default of a key shares (a bool, a whole number >= 0, a string, a mapping), and
    null where a default is null; ``None`` when the defaults state no type (all null, or mixed)."""
    kinds = {type(d) for d in defaults if d is not None}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    rule = {bool: _FLAG, int: ((lambda v: _is_whole(v) and 0 <= v <= MAX_COUNT), "a whole number >= 0"),
            str: ((lambda v: isinstance(v, str) and bool(v)), "a non-empty string"),
            dict: ((lambda v: isinstance(v, Mapping)), "a mapping ({key: value, ...})"),
            list: ((lambda v: isinstance(v, (list, tuple))), "a list")}.get(kind)
    return _optional(rule) if rule is not None and None in defaults else rule


@functools.lru_cache(maxsize=None)
def _submitit_types() -> dict[str, tuple[Callable[[Any], bool], str]]:
    """The rules of the parameters every submitit executor shares (``timeout_min``, ``mem_gb``...), from the types
    submitit itself asserts when a launch sets them; none without submitit (the launch names the extra)."""
    try:
        import submitit
        typed = submitit.AutoExecutor._typed_parameters()  # what AutoExecutor.update_parameters asserts
    except (ImportError, AttributeError):
        return {}
    rules = {}
    for name, kind in typed.items():
        rule = _SIMPLE_RULES.get(kind)
        if kind is float:  # submitit takes an int or a float there
            rule = (_is_real, "a number")
        if rule is not None:
            rules[name] = rule
    return rules


def check_launcher(node: Any) -> None:
    """Raises :class:`~fxtrain.errors.ConfigError` naming the first bad ``hydra.launcher.*`` setting of a launcher
    that ``conf/hydra/launcher`` configures (another launcher's are its own business).

    Generated, like the rest: a key none of its options has is refused with the nearest name (the executor's
    keys excepted: any of submitit's parameters goes there); the values of the launcher's arguments against
    their annotations (``compile: bool`` takes true or false, not 1), the others against the type of their
    defaults there (``executor.timeout_min`` a whole number); then the launcher's own rules
    (``check_settings``: one process per group...).

    >>> check_launcher({"_target_": "hydra_plugins.fxtrain_vmap_launcher.vmap_launcher.VmapLauncher", "compile": 1})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: hydra.launcher.compile=1: expected true or false
    """
    node = _plain(node)
    if not isinstance(node, Mapping) or node.get("_target_") not in launcher_schema():
        return
    keys = launcher_schema()[node["_target_"]]
    fn = build.locate(node, "hydra.launcher")
    args = {k: v for k, v in node.items() if k != "_target_"}
    for name in args:
        if name not in keys:
            top = sorted(k for k in keys if "." not in k and k != "_target_")
            close = difflib.get_close_matches(str(name), top, n=1)
            hint = f" (did you mean hydra.launcher.{close[0]}?)" if close else ""
            raise ConfigError(f"hydra.launcher.{name}: not a setting of this launcher{hint}; it takes {', '.join(top)}")
    typed_args("hydra.launcher", fn, args)
    executor = args.get("executor")
    if isinstance(executor, Mapping):
        shared = _submitit_types()
        for name, value in executor.items():
            rule = _rule_of_defaults(keys.get(f"executor.{name}", []))
            if rule is None and name in shared:
                rule = _optional(shared[name])  # null: submitit's default
            if rule is not None and not rule[0](value):
                raise ConfigError(f"hydra.launcher.executor.{name}={_show(value)}: expected {rule[1]}")
    own = getattr(fn, "check_settings", None)
    if own is not None:
        try:
            own(**args)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None


class LauncherCheck(Callback):
    """Hydra callback (``hydra.callbacks.launcher`` in ``conf/train.yaml``): :func:`check_launcher` on the
    multirun's ``hydra.launcher`` before the sweeper builds the launcher, so that a bad setting is one line
    (``Error: hydra.launcher.compile=1: expected true or false``) and nothing is launched or written."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with one_line_errors():
            check_launcher(config.hydra.get("launcher"))


STEP_METRICS = ("loss",)  # every step's; the stack's reports (grad_norm, learning_rate...) are found by building it


def metric_names(cfg: DictConfig, task: Any) -> list[str] | None:
    """The metrics a run of ``cfg`` logs, in the runner's order, or ``None`` when its task does not declare them.

    The step's loss and the task's metrics, the reports of the transform stack (built on a small tensor:
    ``grad_norm``, ``learning_rate``, ``loss_scale``, ``skipped``... less the constants), then ``val_loss``
    and ``val_<metric>`` of the task's (every evaluation), and ``test_loss`` and ``test_<metric>`` (the end).
    """
    declared = getattr(task, "metric_names", None)
    if declared is None:
        return None

    def reports() -> list[str]:
        tx = build.stack(cfg)
        with torch.random.fork_rng(devices=[]):
            state = tx.init({"w": torch.zeros(2)})
        return [k for k in _base.report(state) if k not in fx.traits(tx).constant_reports]
    # What build.stack reads: the chain, the schedule and the wrappers' groups.
    made = _memo(("reports", *(repr(_plain(_value(cfg, k))) for k in
                               ("optim", "schedule", "amp", "accumulate", "parallel", "trainer.max_steps"))), reports)
    train = [*STEP_METRICS, *made, *(m for m in declared if m not in made)]
    return [*dict.fromkeys(train), *(f"{split}_{m}" for split in tasks.SPLITS for m in ("loss", *declared))]


def _metrics(cfg: DictConfig, task: Any, hooks: list) -> None:
    """``optimized_metric`` and ``trainer.early_stopping.metric`` against what the run logs (an eval hook's names
    are known only once it ran: with hooks, the runner checks at the first evaluation)."""
    stop = _value(cfg, "trainer.early_stopping.metric")
    if tasks.reads_test(stop):
        raise ConfigError(f"trainer.early_stopping.metric={stop}: the test split is evaluated once, at the end; "
                          f"stop on the validation split's val_{stop.removeprefix('test_')}")
    if hooks:
        return
    names = metric_names(cfg, task)
    if names is None:
        return
    for key in ("optimized_metric", "trainer.early_stopping.metric"):
        name = _value(cfg, key)
        if name is None or name in names:
            continue
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}={name} is not a metric of this run; it has: {', '.join(names)}{hint}")


# --- errors a user reads ----------------------------------------------------------------------------

class DiskFull(CompactHydraException, OSError):
    """A full disk, reported by a job of a multirun as its one line."""


def message(error: BaseException) -> str | None:
    """The one line to print for ``error``, or ``None`` for an unexpected exception (it keeps its traceback).

    A :class:`~fxtrain.errors.ConfigError` is its message; a full disk (``ENOSPC`` anywhere in the chain of
    causes: torch.save reports it as a ``RuntimeError``) says where and what to do.
    """
    if isinstance(error, ConfigError):
        return str(error)
    chain, seen = [], error
    while seen is not None and len(chain) < 64:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    full = [e for e in chain if isinstance(e, OSError) and e.errno == errno.ENOSPC]  # the OSError names the file
    full = full or [e for e in chain if "No space left on device" in str(e)]  # torch.save: a RuntimeError's text
    if not full:
        return None
    where = f" writing {full[0].filename}" if isinstance(full[0], OSError) and full[0].filename else ""
    return (f"no space left on the device{where}: the run stopped, its complete checkpoints are intact; free "
            "some space and relaunch with resume=auto, or write elsewhere (hydra.run.dir=...)")


@contextlib.contextmanager
def one_line_errors(multirun: bool = False) -> Iterator[None]:
    """Reports a setting's error (and a full disk) as one line: ``Error: <message>`` on stderr, exit status 1.

    Hydra would print ``Error executing job`` and the traceback. ``HYDRA_FULL_ERROR=1`` keeps that
    traceback. In a multirun the error is raised on as a ``CompactHydraException`` instead, so that the
    other jobs still run and Hydra prints the failed job's overrides and this line. Under torchrun only
    rank 0 prints.
    """
    try:
        yield
    except Exception as e:
        line = message(e)
        if line is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if multirun:
            if isinstance(e, CompactHydraException):
                raise
            raise DiskFull(line) from e
        raise SystemExit(f"Error: {line}" if distributed.rank_and_world()[0] == 0 else 1) from None
