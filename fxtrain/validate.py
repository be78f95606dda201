"""Settings checked before a run writes anything, and the errors a user reads as one line.

* :func:`check` reads every setting of a composed config against its schema and raises
  :class:`fxtrain.errors.ConfigError` at the first bad one, with a message that names the key and the value
  as written, says why, and what to do::

      trainer.max_steps=abc: expected a positive whole number (optimizer steps, counted in batches; at most 2**31-1); e.g. trainer.max_steps=1000

  The runner's own nodes (the top level, ``trainer``, ``amp``, ``accumulate``, ``parallel``, ``debug``) are
  declared in :mod:`fxtrain.schema`: an unknown key is refused with the nearest name (``+trainer.max_step=5``:
  did you mean trainer.max_steps?), each value against its field's type and range. This module keeps the
  rules that relate several keys (``accumulate.every`` divides ``trainer.max_steps``, one degree takes the rest
  of the world...), and the environment's (the device, a checkpoint to resume). A ``_target_`` node (``model``,
  ``data``, ``task``, ``schedule``, each ``optim.chain`` entry, each logger and eval hook) takes its target's
  arguments; fxtrain's own targets' values are checked by name (:data:`fxtrain.schema.ARGS`: ``b1`` in [0, 1), ``eps``
  finite and >= 0...; an int is a float's value, ``weight_decay=0``), then by the library itself (each optimizer
  factory is called with the config's values, so ``optim.chain.adamw.learning_rate=-1`` is refused exactly as
  ``fx.adamw(-1)`` is; the model is built on the meta device). Settings that this run does not use are checked
  all the same.
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
    fxtrain.errors.ConfigError: trainer.log_every=0: expected a positive whole number (steps between metrics.jsonl lines; default: 40 per run; at most 2**31-1); e.g. trainer.log_every=10
    >>> with initialize_config_dir(config_dir=str(train.CONF_DIR), version_base="1.3"):
    ...     cfg = compose("train", overrides=["+trainer.max_step=5"])
    >>> check(cfg)
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: trainer.max_step: not a setting fxtrain reads (did you mean trainer.max_steps?); trainer's settings are max_steps, max_epochs, log_every, eval_every, eval_batch_size, checkpoint_every, keep_last, checkpoint, test_ckpt, device, compile, cpu_threads, progress, heartbeat_s, allow_no_descent, early_stopping, eval_hooks, export, orbax_naming
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import inspect
import math
import os
import pathlib
import typing
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import fxtrain as fx
from fxtrain import _base, build, checkpoint, distributed, parallel, schema, tasks
from fxtrain import data as fxdata
from fxtrain._moved import moved_names
from fxtrain.errors import ConfigError
from fxtrain import run_hooks as orbax_hooks

__all__ = ["check", "Checked", "one_line_errors", "message", "DiskFull", "metric_names",
           "check_launcher", "LauncherCheck"]
__getattr__ = moved_names(__name__, {}, {  # declared in fxtrain/schema.py since issue 38
    "SCHEMA": "the nodes are pydantic models, fxtrain.schema.node_models()",
    "ARG_RULES": "the arguments' types and ranges are annotations, fxtrain.schema.ARGS (fxtrain.schema.check_value)"})


class Checked(NamedTuple):
    """What :func:`check` built from a config on its way: the objects the run uses (built once)."""

    task: Any  #: the :class:`fxtrain.tasks.Task` of ``task``
    hooks: list[tuple[str, Callable]]  #: ``trainer.eval_hooks``, as :func:`fxtrain.build.eval_hooks` builds them
    stopper: Any  #: the :class:`fxtrain.tasks.EarlyStopping` of ``trainer.early_stopping``, or ``None``


def check(cfg: DictConfig) -> Checked:
    """Raises :class:`~fxtrain.errors.ConfigError` naming the first bad setting of ``cfg`` (see the module doc);
    returns the task, eval hooks and early stopping it built, which the run uses (:class:`Checked`)."""
    cfg = _resolved(cfg)
    _task_values(cfg)  # task.optimized_metric before the optimized_metric that follows it
    schema.check(_declared(cfg))  # the runner's own nodes: every key known, typed and in range (fxtrain/schema.py)
    _debug(cfg)
    _device(cfg)
    _resume(cfg)
    orbax_hooks.check_settings(cfg)  # resume=orbax:PATH, trainer.export, trainer.orbax_naming
    _selection(cfg)  # trainer.checkpoint.best_by
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


# --- the runner's own nodes: declared in fxtrain/schema.py -------------------------------------------------
MAX_COUNT = schema.MAX_COUNT
# A static float16 loss scale above 2**24: every gradient above 65504 / 2**24 (about 0.004) overflows and
# its step is skipped (torch's GradScaler starts at 2**16).
MAX_STATIC_FP16_SCALE = 2.0**24


def _declared(cfg: DictConfig, key: str = "") -> Any:
    """The values of the nodes :mod:`fxtrain.schema` declares, as plain mappings (a ``_target_`` node's left out: its
    own checks read it); a value that fails to resolve is an :class:`fxtrain.schema.Unreadable` holding its error."""
    node = cfg if not key else _value(cfg, key)
    models = schema.node_models()
    if key not in models or not isinstance(node, Mapping):
        return dict(node) if isinstance(node, _Node) else _plain(node)
    fields = models[key].model_fields
    out = {}
    for name in node:
        sub = f"{key}.{name}" if key else str(name)
        if name in fields and fields[name].annotation is Any:
            continue
        try:
            out[name] = _declared(cfg, sub)
        except ConfigError as e:
            out[name] = schema.Unreadable(e)
    return out


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


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite number (an int is a float's value: ``weight_decay=0``)."""
    return _is_number(value) and math.isfinite(value)


def _selection(cfg: DictConfig) -> None:
    """``trainer.checkpoint.best_by``: not a test split's metric."""
    name = (cfg.trainer.get("checkpoint") or {}).get("best_by")
    if tasks.reads_test(name):
        raise ConfigError(f"trainer.checkpoint.best_by={name}: the test split is evaluated once, at the end; choose "
                          f"by the validation split's val_{name.removeprefix('test_')}")


def _debug(cfg: DictConfig) -> None:
    """The ``debug`` node's combinations a run cannot do (its values: :class:`fxtrain.schema.Debug`)."""
    node = _value(cfg, "debug")
    if node is None:
        return
    if node.get("overfit_batches") and node.get("limit_train") is not None:
        raise ConfigError(f"debug.limit_train={schema.show(node['limit_train'])} and debug.overfit_batches="
                          f"{node['overfit_batches']}: overfitting reads its own batches; set one of them "
                          "(debug.limit_train=null)")
    steps, wait, profiled = _value(cfg, "trainer.max_steps"), node.get("profile_wait", 0), node.get("profile_steps", 0)
    if profiled and _is_whole(steps) and wait + profiled > steps:
        raise ConfigError(f"debug.profile_steps={profiled}: after debug.profile_wait={wait} steps the run has "
                          f"{max(steps - wait, 0)} left (trainer.max_steps={steps}); record fewer, or train longer")


def _resume(cfg: DictConfig) -> None:
    """``resume=PATH``: a checkpoint is there (its type: :class:`fxtrain.schema.Settings`)."""
    value = _value(cfg, "resume")
    if not value:  # resume= on the command line: null, as the runner reads it
        return
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
        raise ConfigError(f"task={schema.show(node)}: expected a task config; pick one with task=regression (conf/task)")
    _target_values("task", build.resolve(node, "task"))


def _hook_nodes(cfg: DictConfig) -> None:
    hooks = _value(cfg, "trainer.eval_hooks") or {}  # a mapping: fxtrain.schema.Trainer
    for name, node in hooks.items():
        if not (isinstance(node, Mapping) and "_target_" in node):
            raise ConfigError(f"trainer.eval_hooks.{name}={schema.show(node)}: expected a _target_ node "
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
        raise ConfigError(f"trainer.device={schema.show(name)}: not a device torch knows; use auto (CUDA when there is "
                          "one), cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build_kind = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError(f"trainer.device={name}: CUDA is not available here ({build_kind} "
                              f"{torch.__version__}); use trainer.device=cpu, or auto (CUDA when there is one)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"trainer.device={name}: there are {torch.cuda.device_count()} CUDA devices here "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); use one of them, or auto")


# --- amp, accumulate, parallel: checked whatever is active ------------------------------------------------

def _amp(cfg: DictConfig) -> None:
    """``amp.policy`` parsed, a static loss scale against it, then the library's own checks (types: :class:`Amp`)."""
    policy = _value(cfg, "amp.policy")
    parsed = None
    if policy is not None:
        try:
            parsed = fx.Policy.parse(policy)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"amp.policy={schema.show(policy)}: {str(e).splitlines()[0]}") from None
    scale = _value(cfg, "amp.loss_scale")
    if isinstance(scale, Mapping):
        scale = dict(_plain(scale))
    elif _is_number(scale):
        half = parsed is not None and torch.float16 in (parsed.compute_dtype, parsed.output_dtype, parsed.param_dtype)
        if half and scale > MAX_STATIC_FP16_SCALE:
            raise ConfigError(f"amp.loss_scale={schema.show(scale)}: a static float16 loss scale above 2**24 overflows every "
                              "gradient above 65504/2**24 and skips its step; use dynamic, or at most 16777216")
    try:  # the library's own checks, also for a loss scale that no policy uses (amp.policy=null)
        fx.amp_cast(fx.identity(), policy if policy is not None else "p=f32,c=f32,o=f32", loss_scale=scale)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"amp.loss_scale={schema.show(scale)}: {str(e).splitlines()[0]}") from None


def _accumulate(cfg: DictConfig) -> None:
    """``accumulate.every`` against ``trainer.max_steps`` (types: :class:`fxtrain.schema.Accumulate`)."""
    every = _value(cfg, "accumulate.every", default=1)
    max_steps = cfg.trainer.max_steps
    if max_steps % every:
        raise ConfigError(f"accumulate.every={every}: trainer.max_steps={max_steps} is not a multiple of it (both "
                          "count batches); make max_steps a multiple")


def _parallel(cfg: DictConfig) -> None:
    """One degree at most takes the rest of the world; micro-batches that a batch holds (types: :class:`Parallel`)."""
    free = [f"parallel.{dim}=-1" for dim in distributed.DIMS if _value(cfg, f"parallel.{dim}") == -1]
    if len(free) > 1:
        raise ConfigError(f"{' and '.join(free)}: only one degree can take the rest of the world; give the others a "
                          "size (e.g. parallel.dp_replicate=2)")
    # Checked whatever the layout, as the other settings are (on one data rank here; build.parallel_dims checks the
    # run's). Only the preset's own default is left alone where no pipeline can read it (parallel.pp=1), so that a
    # small data.batch_size is not refused for a setting the user never wrote.
    micro, batch = _value(cfg, "parallel.microbatches", default=4), _value(cfg, "data.batch_size")
    unread = _value(cfg, "parallel.pp", default=1) == 1 and micro == schema.Parallel.model_fields["microbatches"].default
    if _is_whole(batch) and batch >= 1 and not unread:  # data.batch_size < 1: _data
        build.check_microbatches(micro, batch, 1)


# --- _target_ nodes: their keys are their target's arguments (fxtrain's own by name: fxtrain.schema.ARGS) ------

def _is_fxtrain(spec: dict) -> bool:
    return isinstance(spec.get("_target_"), str) and spec["_target_"].split(".")[0] == "fxtrain"


def _target_values(key: str, spec: dict, skip: tuple[str, ...] = ()) -> None:
    """The values of an fxtrain target's arguments against :data:`fxtrain.schema.ARGS`, the others against the
    target's annotations (batchnorm: bool takes true or false, not 1)."""
    if not _is_fxtrain(spec):
        return
    args = {k: v for k, v in spec.items() if k != "_target_" and k not in skip and not (isinstance(v, dict) and
                                                                                     "_target_" in v)}
    for name, value in args.items():
        if name in schema.ARGS:
            schema.check_value(f"{key}.{name}", schema.ARGS[name], value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}.{name}={schema.show(value)}: expected a finite number")
    schema.check_args(key, build.locate(spec, key), {k: v for k, v in args.items() if k not in schema.ARGS})


def _data(cfg: DictConfig) -> None:
    node = _value(cfg, "data")
    if not isinstance(node, Mapping):
        raise ConfigError(f"data={schema.show(node)}: expected a data config; pick one with data=digits (conf/data)")
    for name in ("batch_size", "num_examples", "context", "max_bytes", "eval_windows", "test_fraction"):
        if name in node:  # the runner's keys, and the facts the model follows, whatever the target
            schema.check_value(f"data.{name}", schema.ARGS[name], _value(cfg, f"data.{name}"))
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
        raise ConfigError(f"data.val_fraction={schema.show(value)}: expected a number from 0 (no validation split) up to "
                          f"below 1 - data.test_fraction ({test}); e.g. data.val_fraction=0.15")


def _model(cfg: DictConfig) -> None:
    """The model's values, then the model built on the meta device (no memory, no random numbers drawn):
    its own checks (``d_model`` divisible by ``n_heads``, ``top_k`` <= ``experts``) before anything is written."""
    node = _value(cfg, "model")
    if not isinstance(node, Mapping):
        raise ConfigError(f"model={schema.show(node)}: expected a model config; pick one with model=mlp (conf/model)")
    mode = node.get("activation_checkpoint", "none")
    if mode not in parallel.AC_MODES:
        raise ConfigError(f"model.activation_checkpoint={schema.show(mode)}: expected none, full (recompute every block in "
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
                raise ConfigError(f"model.{name}={schema.show(spec[name])}: the data has data.{name}={schema.show(data[name])}; "
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
            raise ConfigError(f"optim.chain.{name}={schema.show(chain[name])}: {name} is not in the chain "
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
                raise ConfigError(f"{key}.learning_rate={schema.show(lr)}: expected a number >= 0 (the schedule's peak); "
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
    true), a number is finite; the ranges of :data:`fxtrain.schema.ARGS` follow the library's own checks."""
    for name, value in spec.items():
        if name in schema.ARGS:
            schema.check_value(f"{key}.{name}", schema.ARGS[name], value, loosely=True)


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
            return f"{key}.{arg}={schema.show(value)}: {text}; change {key}.{arg}"
    return f"{key}: {text}"


# --- the schedule -----------------------------------------------------------------------------------

def _schedule(cfg: DictConfig) -> None:
    node = _value(cfg, "schedule")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"schedule={schema.show(node)}: expected a schedule config; pick one with schedule=cosine "
                          "(conf/schedule)")
    spec = build.resolve(node, "schedule")
    if _is_fxtrain(spec):
        _types("schedule", spec)
    warmup, max_steps = spec.get("warmup_steps"), cfg.trainer.max_steps
    if _is_whole(warmup) and warmup >= max_steps:
        raise ConfigError(f"schedule.warmup_steps={warmup}: warmup must end before the run does "
                          f"(trainer.max_steps={max_steps}); lower it, or leave it out: the default is 5% of the run")
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
            lr_entries.append(f"{key}.learning_rate={schema.show(lr)}")
            if lr == 0 or not moves:
                if _value(cfg, "trainer.allow_no_descent", default=False):
                    continue
                where = (f"{key}.learning_rate=0" if lr == 0 else
                         f"{key}.learning_rate={schema.show(lr)} times the schedule ({_settings(cfg, 'schedule')}), 0 at "
                         "every probed step")
                raise ConfigError(f"{where}: the params would not move; use a learning rate > 0 (or "
                                  "trainer.allow_no_descent=true)")
            entry = -1 if kwargs.get("flip_sign", True) is not False else 1
        elif factory is getattr(fx, "scale", None) and _is_number(kwargs.get("step_size")):
            entry = 1 if kwargs["step_size"] > 0 else -1 if kwargs["step_size"] < 0 else 0
            if entry != 1:
                flips.append(f"{key}.step_size={schema.show(kwargs['step_size'])}")
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
    return " ".join(f"{key}.{k}={schema.show(v)}" for k, v in node.items() if k != "_target_")


# --- loggers and metrics ----------------------------------------------------------------------------

def _loggers(cfg: DictConfig) -> None:
    node = _value(cfg, "logger")
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"logger={schema.show(node)}: expected named loggers; pick them with 'logger=[jsonl,csv]'")
    if "_target_" in node:
        return  # open_loggers names this layout
    for name in node:
        key = f"logger.{name}"
        if not (isinstance(node[name], Mapping) and "_target_" in node[name]):
            raise ConfigError(f"{key}={schema.show(node[name])}: expected a logger, a _target_ node; pick loggers with "
                              "'logger=[jsonl,csv]' (conf/logger)")
        spec = build.resolve(node[name], key)
        fn = build.locate(spec, key)
        kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        build.check_args(fn, {**kwargs, "dir": ".", "start": 0, "config": {}}, key, spec["_target_"])
        _target_values(key, spec)
        if _is_fxtrain(spec):
            schema.check_args(key, fn, kwargs)
            for name, model in schema.NESTED.get(spec["_target_"], {}).items():  # wandb's settings
                if isinstance(kwargs.get(name), Mapping):
                    schema.check(kwargs[name], model, f"{key}.{name}")
            own = getattr(fn, "check_settings", None)  # a logger's own rules (MLflow's URI, wandb.Settings)
            if own is not None:
                try:
                    own(**kwargs)
                except ValueError as e:
                    raise ConfigError(f"{key}.{str(e).splitlines()[0]}") from None


@functools.lru_cache(maxsize=None)
def _submitit_types() -> dict[str, Any]:
    """The types of the parameters every submitit executor shares (``timeout_min``, ``mem_gb``...), as submitit itself
    asserts them when a launch sets them; none without submitit (the launch names the extra)."""
    try:
        import submitit
        typed = submitit.AutoExecutor._typed_parameters()  # what AutoExecutor.update_parameters asserts
    except (ImportError, AttributeError):
        return {}
    return {name: typing.Optional[float if kind is float else kind] for name, kind in typed.items()}  # null: its default


def check_launcher(node: Any) -> None:
    """Raises :class:`~fxtrain.errors.ConfigError` naming the first bad ``hydra.launcher.*`` setting of the launcher
    that ``conf/hydra/launcher`` configures (another launcher's are its own business): its keys and values against
    :class:`fxtrain.schema.Launcher`, an executor key that schema leaves open against submitit's own types, then the
    launcher's own rules (``check_settings``: one process per group...).

    >>> check_launcher({"_target_": schema.LAUNCHER, "compile": 1})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: hydra.launcher.compile=1: expected true or false (torch.compile each group's vmapped step and evaluation)
    """
    node = _plain(node)
    if not isinstance(node, Mapping) or node.get("_target_") != schema.LAUNCHER:
        return
    schema.check(node, schema.Launcher, "hydra.launcher")
    executor = node.get("executor") or {}
    for name, value in executor.items():
        if name not in schema.Executor.model_fields and name in _submitit_types():
            schema.check_value(f"hydra.launcher.executor.{name}", _submitit_types()[name], value)
    fn = build.locate(node, "hydra.launcher")
    try:
        fn.check_settings(**{k: v for k, v in node.items() if k != "_target_"})
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
