"""From config to objects: instantiate ``_target_`` nodes with checked keys, and build the transform stack.

The training script calls these; they are the one place where a config error is turned into a message
that names what the user wrote: the config key, the transform, the argument, the options there are.

* :func:`instantiate` is ``hydra.utils.instantiate`` for our configs, with every node's keys checked
  against its target's signature first (``optim.chain.adamw: lerning_rate is not an argument of
  fxtrain.adamw (did you mean learning_rate?)``), not a ``TypeError`` from deep inside.
* :func:`stack` builds the transform stack from ``optim.chain`` (order kept), the ``schedule`` group and
  the wrapper groups (``amp``, ``accumulate``, ``parallel``); :func:`parallel_dims` reads ``parallel``.
* :func:`check_overrides` checks command-line group choices (``model=mlpp``,
  ``optim/transform@optim.chain=[adamz]``) before Hydra composes, and lists the options of the group.

Example:
    >>> from omegaconf import OmegaConf
    >>> from fxtrain import build
    >>> build.instantiate(OmegaConf.create({"_target_": "fxtrain.clip", "max_delta": 1.0}), "optim.chain.clip")
    clip(1.0)
    >>> build.instantiate(OmegaConf.create({"_target_": "fxtrain.clip", "max_dleta": 1.0}), "optim.chain.clip")
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: optim.chain.clip: max_dleta is not an argument of fxtrain.clip (did you mean max_delta?); it takes max_delta
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.resources
import inspect
import pathlib
import re
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import fxtrain as fx
from fxtrain import data, distributed, extras, float8 as float8_training, schema, tasks
from fxtrain._moved import moved_names
from fxtrain.errors import ConfigError

__all__ = ["ConfigError", "instantiate", "target", "check_args", "stack", "MODEL_SETTINGS", "model_node", "model", "parallel_dims", "single_process_note", "check_microbatches", "check_override_keys", "mixed_precision", "cast_params", "float8",
           "check_overrides", "search_path", "dataset", "data_keys", "floats_where_expected", "DATA_KEYS", "task",
           "eval_hooks", "early_stopping", "ScaledSchedule", "user_search_path", "user_configs_first",
           "settle_optimized_metric"]


# --- step counts that follow the run's length ---------------------------------------------------------
# conf/schedule/*.yaml and conf/trainer/default.yaml give defaults as parts of trainer.max_steps, so that a
# short run (trainer.max_steps=10) warms up and evaluates in proportion instead of failing or evaluating once.

def _fraction_of(fraction: float, steps: int) -> int:
    """``${fxtrain.fraction:0.05,${trainer.max_steps}}``: ``floor(fraction * steps)`` (warmup: 50 of 1000, 0 of 10)."""
    _check_steps(steps)
    return int(round(float(fraction) * steps, 6))


def _every_for(steps: int, points: int) -> int:
    """``${fxtrain.every:${trainer.max_steps},10}``: the period giving about ``points`` events in ``steps``
    (``ceil(steps / points)``, at least 1): 10 evaluations whether the run is 30 or 3000 steps long."""
    _check_steps(steps)
    return max(1, -(-steps // int(points)))


def _check_steps(steps: Any) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(f"trainer.max_steps={steps}: expected a positive whole number of steps")


OmegaConf.register_new_resolver("fxtrain.fraction", _fraction_of, replace=True)
OmegaConf.register_new_resolver("fxtrain.every", _every_for, replace=True)


# --- instantiate ------------------------------------------------------------------------------------

def instantiate(node: DictConfig | dict, key: str, **given: Any) -> Any:
    """Builds ``node`` (a ``_target_`` config) after checking its keys against the target's signature.

    Nested ``_target_`` nodes are built first, each checked the same way. ``given`` adds arguments from
    the code (the run directory, say); they are checked too.

    Args:
      node: the config node, e.g. ``cfg.model``.
      key: where it sits in the config (``"model"``), for messages.
      given: extra keyword arguments.
    """
    return _build(resolve(node, key), key, given)


# Keys of the model node that the runner reads, not arguments of the model's _target_ (conf/train.yaml gives them
# their defaults): what fxtrain.parallel.parallelize does to the built model.
MODEL_SETTINGS = ("activation_checkpoint",)


def model_node(node: DictConfig | dict) -> dict:
    """The model node without :data:`MODEL_SETTINGS`: the ``_target_`` node that builds the model.

    >>> model_node({"_target_": "fxtrain.models.MLP", "activation_checkpoint": "none", "input_shape": [4]})
    {'_target_': 'fxtrain.models.MLP', 'input_shape': [4]}
    """
    spec = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else dict(node)
    return {k: v for k, v in spec.items() if k not in MODEL_SETTINGS}


def model(cfg: DictConfig) -> torch.nn.Module:
    """The model ``cfg.model`` describes (its :data:`MODEL_SETTINGS` left to the runner), built with checked keys."""
    return _build(model_node(resolve(cfg.model, "model")), "model", {})


def target(node: DictConfig | dict, key: str) -> tuple[Callable, dict]:
    """The located ``_target_`` of ``node`` and its other keys (resolved, nested targets built), checked."""
    return _parts(resolve(node, key), key, {})


def resolve(node: DictConfig | dict, key: str) -> dict:
    """The node of a ``_target_`` (``key`` names it in messages) as a plain dict, interpolations resolved;
    one that fails to resolve, or has no ``_target_``, is a ConfigError naming ``key``.

    >>> resolve({"_target_": "fxtrain.adamw", "learning_rate": 0.1}, "optim.chain.adamw")
    {'_target_': 'fxtrain.adamw', 'learning_rate': 0.1}
    """
    try:
        spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: {omegaconf_message(e)}") from None
    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(f"{key}: expected a node with a _target_ (what to build), got {spec!r}")
    return spec


def _parts(spec: dict, key: str, given: dict) -> tuple[Callable, dict]:
    fn = locate(spec, key)
    kwargs = {k: _build_nested(v, f"{key}.{k}") for k, v in spec.items() if k != "_target_"}
    kwargs.update(given)
    check_args(fn, kwargs, key, spec["_target_"])
    return fn, kwargs


def _build(spec: dict, key: str, given: dict) -> Any:
    fn, kwargs = _parts(spec, key, given)
    try:
        return fn(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} ({spec['_target_']}): {e}") from e


def _build_nested(value: Any, key: str) -> Any:
    if isinstance(value, dict) and "_target_" in value:
        return _build(value, key, {})
    if isinstance(value, dict):
        return {k: _build_nested(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_build_nested(v, f"{key}.{i}") for i, v in enumerate(value)]
    return value


def locate(spec: dict, key: str) -> Callable:
    """The callable ``spec["_target_"]`` names (a dotted path); one that does not import or exist is a
    ConfigError naming ``key`` and the nearest names there.

    >>> locate({"_target_": "fxtrain.adamw"}, "optim.chain.adamw").__name__
    'adamw'
    """
    path = spec["_target_"]
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}._target_: expected a dotted path like fxtrain.adamw, got {path!r}")
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}._target_: cannot import {module_name} ({e})") from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        options = sorted(n for n in dir(module) if not n.startswith("_") and _buildable(getattr(module, n)))
        close = difflib.get_close_matches(name, options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if len(options) > 12:  # fxtrain has ~170 names: the nearest ones, and where the rest are listed
            near = difflib.get_close_matches(name, options, n=6, cutoff=0.4) or options[:6]
            listing = f"{', '.join(near)} and {len(options) - len(near)} more (see {module_name}'s __init__.py)"
        else:
            listing = ", ".join(options)
        raise ConfigError(f"{key}._target_: {module_name} has no {name!r}{hint}; available: {listing}")
    return fn


def _buildable(obj: Any) -> bool:
    # Functions and classes a config could target; not modules, nor state NamedTuples (tuple subclasses).
    return callable(obj) and not inspect.ismodule(obj) and not (inspect.isclass(obj) and issubclass(obj, tuple))


def check_args(fn: Callable, kwargs: dict, key: str, label: str) -> None:
    """Raises :class:`ConfigError` naming ``key``, the argument and ``label`` if ``fn`` does not take ``kwargs``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: let the call report
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for k in kwargs:
        if k not in valid:
            close = difflib.get_close_matches(k, valid, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{key}: {k} is not an argument of {label}{hint}; it takes {', '.join(valid)}")
    missing = [n for n, p in params.items()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs]
    if missing:
        raise ConfigError(f"{key}: {label} needs {', '.join(missing)}; add {key}.{missing[0]}=...")


def omegaconf_message(e: OmegaConfBaseException) -> str:
    """The first line of an OmegaConf error's own message (without its ``full_key``/``object_type`` lines).

    >>> from omegaconf import OmegaConf
    >>> try:
    ...     OmegaConf.create({"a": "${b}"}).a
    ... except Exception as e:
    ...     print(omegaconf_message(e))
    Interpolation key 'b' not found
    """
    msg = getattr(e, "msg", None) or str(e)
    return msg.splitlines()[0]


# --- the task and what runs around evaluations ---------------------------------------------------

# What the runner makes of any data source (fxtrain.data.from_source); a target that takes one of them gets it.
DATA_KEYS = ("batch_size", "test_fraction", "val_fraction", "split_seed", "seed", "test_batches", "input_shape",
             "num_classes", *data.LOADER_KEYS)


def dataset(node: DictConfig | dict, name: str = "data") -> Any:
    """The run's :class:`fxtrain.data.Dataset` from the data config ``node``, whatever its ``_target_`` returns.

    The target gets the keys its signature takes (all of them with ``**kwargs``); the runner's keys
    (:data:`DATA_KEYS`: ``batch_size``,
    ``test_fraction``, ``val_fraction``, ``split_seed``, ``seed``, ``test_batches``, the facts ``input_shape``,
    ``num_classes`` and the loader's ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers``) go to :func:`fxtrain.data.from_source`, which splits, shuffles and checks what the
    target returned: a ``Dataset``, tensors ``(x, y)``, a map-style dataset or an iterable of batches.
    Any other key is an error naming it.

    >>> node = {"_target_": "sklearn.datasets.make_regression", "n_samples": 40, "n_features": 3,  # (X, y) arrays
    ...         "batch_size": 8, "test_fraction": 0.25}
    >>> dataset(node, "mine")
    mine: 30 train examples, 10 test, batch 8
    >>> dataset({**node, "batch_sise": 8}, "mine")
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: data: batch_sise is not an argument of sklearn.datasets.make_regression nor a runner key (did you mean batch_size?); the runner's keys are batch_size, test_fraction, val_fraction, split_seed, seed, test_batches, input_shape, num_classes, num_workers, prefetch_factor, pin_memory, persistent_workers
    """
    spec = resolve(node, "data")
    fn, takes = data_keys(spec)
    own = {k: v for k, v in spec.items() if k != "_target_" and (takes is None or k in takes or k not in DATA_KEYS)}
    runner = {k: spec[k] for k in DATA_KEYS if k in spec}  # also when the target took them: the facts are checked
    made = _build({"_target_": spec["_target_"], **own}, "data", {})
    try:
        return data.from_source(made, name=name, **runner)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"data ({spec['_target_']}): {e}") from None


def data_keys(spec: dict) -> tuple[Callable, set[str] | None]:
    """Checks the keys of the resolved data config ``spec``: its target's arguments and :data:`DATA_KEYS`.

    Returns the target and the arguments it takes (``None``: any). Nothing is built.

    >>> data_keys({"_target_": "fxtrain.data.digits", "batch_sise": 8})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: data: batch_sise is not an argument of fxtrain.data.digits nor a runner key (did you mean batch_size?); the runner's keys are batch_size, test_fraction, val_fraction, split_seed, seed, test_batches, input_shape, num_classes, num_workers, prefetch_factor, pin_memory, persistent_workers
    """
    fn = locate(spec, "data")
    takes = _arguments(fn)
    for k in spec:
        if takes is not None and k != "_target_" and k not in takes and k not in DATA_KEYS:
            close = difflib.get_close_matches(k, [*takes, *DATA_KEYS], n=1)
            raise ConfigError(f"data: {k} is not an argument of {spec['_target_']} nor a runner key"
                              + (f" (did you mean {close[0]}?)" if close else "")
                              + f"; the runner's keys are {', '.join(DATA_KEYS)}")
    return fn, takes


_FLOAT_ANNOTATION = re.compile(r"\b(float|Scalar|LearningRate|Value)\b")


def floats_where_expected(fn: Callable, kwargs: dict) -> dict:
    """``kwargs`` with each ``int`` made a ``float`` where ``fn`` expects a float (its annotation names one and no
    ``int``, or it has no annotation and a float default): YAML and Hydra read ``weight_decay: 0`` as an int.

    >>> import fxtrain as fx
    >>> floats_where_expected(fx.adamw, {"learning_rate": 1, "weight_decay": 0, "b1": 0})
    {'learning_rate': 1.0, 'weight_decay': 0.0, 'b1': 0.0}
    >>> floats_where_expected(fx.models.MLP, {"hidden": [8], "num_classes": 3})   # ints stay ints
    {'hidden': [8], 'num_classes': 3}
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    out = dict(kwargs)
    for k, v in kwargs.items():
        p = params.get(k)
        if type(v) is not int or p is None:
            continue
        if p.annotation is p.empty:
            floaty = isinstance(p.default, float)
        else:
            text = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", str(p.annotation))
            floaty = bool(_FLOAT_ANNOTATION.search(text)) and not re.search(r"\bint\b", text)
        if floaty:
            out[k] = float(v)
    return out


def _arguments(fn: Callable) -> set[str] | None:
    """The keyword arguments ``fn`` takes, or ``None`` when it takes any (``**kwargs``) or has no signature."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def task(cfg: DictConfig) -> Any:
    """The run's :class:`fxtrain.tasks.Task` from ``cfg.task`` (classification when the config has none).

    >>> from omegaconf import OmegaConf
    >>> task(OmegaConf.create({"task": {"_target_": "fxtrain.tasks.regression"}})).name
    'regression'
    """
    node = cfg.get("task")
    if node is None:
        return tasks.classification()
    built = instantiate(node, "task")
    if not isinstance(built, tasks.Task):
        raise ConfigError(f"task ({node.get('_target_')}): returned {type(built).__name__}, expected a "
                          "fxtrain.tasks.Task; point _target_ at fxtrain.tasks.Task with loss: and metrics: "
                          "(dotted paths to your functions), or at a function of yours that returns one")
    return built


def settle_optimized_metric(cfg: DictConfig) -> str:
    """Sets ``cfg.optimized_metric`` to the metric the run's task declares where the config leaves it to the
    task, and returns it: what ``summary.json``'s value, the sweep's ``best:``, the report and the plot rank by.

    ``conf/train.yaml``'s default, ``${oc.select:task.optimized_metric,val_loss}``, reads the task config's
    key; a task built by a ``_target_`` function of yours declares its metric in the :class:`fxtrain.tasks.Task`
    it returns, which the config cannot see (the run header said ``optimizes test_accuracy`` while
    everything ranked by ``test_loss``). A value the config sets itself (``optimized_metric=test_loss``, an
    ``hparams_search`` file's) is kept.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"task": {"_target_": "fxtrain.tasks.classification"},
    ...                         "optimized_metric": "${oc.select:task.optimized_metric,val_loss}"})
    >>> settle_optimized_metric(cfg), cfg.optimized_metric
    ('val_accuracy', 'val_accuracy')
    """
    if OmegaConf.is_interpolation(cfg, "optimized_metric") and "optimized_metric" not in (cfg.get("task") or {}):
        cfg.optimized_metric = task(cfg).optimized_metric
    return str(cfg.optimized_metric)


def eval_hooks(cfg: DictConfig) -> list[tuple[str, Callable]]:
    """``[(name, hook)]`` of ``trainer.eval_hooks``: each ``hook(ctx)`` calls its ``_target_`` with ``ctx`` (an
    :class:`fxtrain.tasks.EvalContext`) and the node's other keys, which are checked against its signature.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"trainer": {"eval_hooks": {"pi": {"_target_": "builtins.dict", "pi": 3.14}}}})
    >>> [(name, hook({"step": 3})) for name, hook in eval_hooks(cfg)]   # dict(ctx, pi=3.14)
    [('pi', {'step': 3, 'pi': 3.14})]
    """
    hooks = []
    for name, node in (cfg.trainer.get("eval_hooks") or {}).items():
        key = f"trainer.eval_hooks.{name}"
        spec = resolve(node, key)
        fn = locate(spec, key)
        kwargs = {k: _build_nested(v, f"{key}.{k}") for k, v in spec.items() if k != "_target_"}
        check_args(functools.partial(fn, None), kwargs, key, spec["_target_"])  # the context is its first argument
        hooks.append((str(name), lambda ctx, fn=fn, kwargs=kwargs: fn(ctx, **kwargs)))
    return hooks


def early_stopping(cfg: DictConfig) -> Any:
    """The :class:`fxtrain.tasks.EarlyStopping` of ``trainer.early_stopping``, or ``None`` when its ``metric`` is null."""
    node = cfg.trainer.get("early_stopping")
    if node is None or node.get("metric") is None:
        return None
    options = dict(node.items())
    check_args(tasks.EarlyStopping, options, "trainer.early_stopping", "early stopping")
    try:
        return tasks.EarlyStopping(**{**options, "metric": str(node.metric)})
    except ValueError as e:
        raise ConfigError(str(e)) from None


# --- the transform stack ------------------------------------------------------------------------

class ScaledSchedule:
    """``peak * shape(every * count)``: an optimizer's ``learning_rate`` (peak) times the ``schedule`` group's shape.

    ``count`` is the optimizer's update count; with gradient accumulation an update takes ``every``
    batches, so the shape is read at the batch count and its steps (``warmup_steps``, ``decay_steps``)
    mean batches, like every other step count in the config.

    >>> import fxtrain as fx
    >>> lr = ScaledSchedule(0.1, fx.linear_schedule(1.0, 0.0, 10))
    >>> lr, round(float(lr(5)), 6)
    (0.1*linear_schedule(init_value=1.0, end_value=0.0, transition_steps=10), 0.05)
    >>> ScaledSchedule(0.1, fx.linear_schedule(1.0, 0.0, 10), every=4)
    0.1*linear_schedule(init_value=1.0, end_value=0.0, transition_steps=10)@(4*count)
    """

    def __init__(self, peak: float, shape: Callable, every: int = 1):
        self.peak, self.shape, self.every = peak, shape, every

    def __call__(self, count):
        return self.peak * self.shape(count * self.every if self.every != 1 else count)

    def __repr__(self) -> str:
        at = f"@({self.every}*count)" if self.every != 1 else ""
        peak = "peak" if isinstance(self.peak, torch.Tensor) else fx.describe(float(self.peak))  # a tensor: a vmapped sweep's
        return f"{peak}*{self.shape!r}{at}"


def stack(cfg: DictConfig, dims: distributed.ParallelDims | None = None,
          values: dict[str, Any] | None = None) -> fx.GradientTransformation:
    """The gradient transformation a config describes: ``accumulate(amp_cast(chain(*optim.chain)))``, each
    part only when configured.

    * ``fx.chain`` of the ``optim.chain`` entries in order. An entry whose target takes a
      ``learning_rate`` is built with :func:`fxtrain.inject_hyperparams` and ``learning_rate = value *
      schedule(batches)`` (the ``schedule`` group gives the shape, the entry the peak), so the step
      reports ``learning_rate``.
    * With a parallel layout (``dims``, several ranks) the params are DTensors: each run of consecutive
      elementwise entries (the optimizers) becomes one ``fx.sharded_apply`` (plain local math, state
      sharded like the params), with ``shard_over="dp"`` under ``parallel.shard_optimizer=true`` (ZeRO-1/2:
      every rank keeps 1/dp of the state); global ones (``clip_by_global_norm``) stay as they are. The
      gradients' data-parallel reduction is the step's (their ``Partial`` placements), not the chain's.
    * ``amp.policy``: :func:`fxtrain.amp_cast` around the chain (the DESIGN's recommended order).
    * ``accumulate.every > 1``: :func:`fxtrain.accumulate` outermost.

    ``values`` replaces the numbers of some ``optim.chain.<name>.<arg>`` and ``schedule.<arg>`` keys
    (dotted keys as in the config): ``hydra/launcher=vmap`` builds one stack for a group of jobs inside
    ``torch.func.vmap`` with each job's value as a 0-dim tensor there (:mod:`fxtrain.sweep`).
    """
    chain_cfg, every = cfg.optim.get("chain"), cfg.accumulate.every  # checked by fxtrain.validate.check
    values = values or {}
    shape = (instantiate(cfg.schedule, "schedule", **_values_under(values, "schedule"))
             if cfg.get("schedule") is not None else None)
    # Pipeline stages hold disjoint params: a global transform (clip_by_global_norm) sums over the pp group.
    stages = {"groups": dims.norm_groups} if dims is not None and dims.norm_groups else {}
    txs = [_transform(node, f"optim.chain.{name}", shape, every,
                      {**_values_under(values, f"optim.chain.{name}"), **_accepted(node, stages)})
           for name, node in chain_cfg.items()]
    shard = cfg.parallel.get("shard_optimizer", False)
    if shard and not _replicas_only(cfg.parallel):
        shown = " ".join(f"parallel.{d}={cfg.parallel.get(d, 1)}" for d in distributed.DIMS)
        raise ConfigError(f"parallel.shard_optimizer=true needs data-parallel replicas alone (parallel=dp: it shards "
                          f"the optimizer state over dp_replicate), but the layout is {shown}")
    if dims is not None and dims.mesh is not None:
        over = "dp_replicate" if shard and dims.enabled("dp_replicate") else None
        txs = _shard_elementwise(txs, list(chain_cfg), over)
    tx = fx.chain(*txs)
    if cfg.amp.policy is not None:
        kwargs = {"policy": cfg.amp.policy}
        if dims is not None and fsdp_casts(dims):
            # FSDP casts the params once per all-gather (MixedPrecisionPolicy, see fxtrain/parallel/_parallelize.py);
            # amp_cast keeps loss scaling, the overflow check and skipping, computing in the params' dtype.
            policy = _call(_wrapper("Policy", "amp.policy").parse, "amp.policy", cfg.amp.policy)
            p = policy.param_dtype  # None: amp.policy=off, which keeps every dtype
            kwargs["policy"] = "off" if p is None else f"p={_short(p)},c={_short(p)},o={_short(p)}"
        if dims is not None and dims.data_world > 1 and not dims.enabled("pp") and not fsdp_casts(dims):
            # Each data rank differentiates its share's mean: its backward at one process's magnitude.
            kwargs["data_ranks"] = dims.data_world
        if cfg.amp.loss_scale is not None:
            loss_scale = cfg.amp.loss_scale
            kwargs["loss_scale"] = OmegaConf.to_container(loss_scale) if isinstance(loss_scale, DictConfig) else loss_scale
        tx = _call(_wrapper("amp_cast", "amp.policy"), "amp", tx, **kwargs)
    if every > 1:
        tx = _call(_wrapper("accumulate", "accumulate.every"), "accumulate", tx, every=every,
                   mean=cfg.accumulate.mean, accumulator_dtype=cfg.accumulate.get("accumulator_dtype"))
    return tx


def _replicas_only(node: DictConfig) -> bool:
    """Whether ``cfg.parallel`` asks for data-parallel replicas (``dp_replicate`` not 1) and nothing else."""
    return node.get("dp_replicate", 1) != 1 and all(node.get(d, 1) == 1 for d in distributed.DIMS if d != "dp_replicate")


def fsdp_casts(dims: distributed.ParallelDims) -> bool:
    """Whether FSDP's ``MixedPrecisionPolicy`` casts the params: FSDP-sharded models and pipeline stages (FSDP's
    all-gather replaces whatever ``amp_cast`` would cast, so its casts never reach the gradients: issue 35's
    ``pp_fsdp`` under bf16 trained nothing). Unsharded pipeline stages are cast by ``amp_cast`` through
    :func:`fxtrain.parallel.pipeline_step`."""
    return dims.params_sharded


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}[dtype]


def mixed_precision(cfg: DictConfig, dims: distributed.ParallelDims) -> Any:
    """FSDP's ``MixedPrecisionPolicy`` for ``amp.policy`` under FSDP (:func:`fsdp_casts`; compute dtype for the
    all-gathered params, float32 gradient reduction), or ``None``."""
    if cfg.amp.policy is None or not fsdp_casts(dims):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = _call(_wrapper("Policy", "amp.policy").parse, "amp.policy", cfg.amp.policy)
    if policy.compute_dtype == policy.param_dtype:
        return None
    # Blocks hand bf16 activations to each other; the root's output (the logits) gets the output dtype.
    return MixedPrecisionPolicy(param_dtype=policy.compute_dtype, reduce_dtype=torch.float32,
                                output_dtype=policy.output_dtype)


def parallel_dims(cfg: DictConfig, world: int) -> distributed.ParallelDims:
    """The run's :class:`fxtrain.distributed.ParallelDims` from ``cfg.parallel``'s degrees (not built), checked
    against the world size; a mismatch names the ``parallel.*`` keys."""
    node = cfg.parallel
    degrees = {d: node.get(d) for d in distributed.DIMS}
    given = " ".join(f"parallel.{d}={v}" for d, v in degrees.items() if v not in (1, None))
    if world > 1 and not given:
        raise ConfigError(f"parallel=none, but {world} processes run this script (torchrun): pick a layout "
                          "(parallel=dp, fsdp, hsdp, tp, fsdp_tp, pp, ep...) or degrees (parallel.dp_shard=-1 ...)")
    try:
        dims = distributed.ParallelDims.of(world=world, **degrees)
    except ValueError as e:
        if world == 1:
            raise ConfigError(f"{given} needs several processes: launch with torchrun (torchrun --nproc_per_node=2 "
                              "-m fxtrain.train ...), or use parallel=none") from None
        raise ConfigError(f"{given or 'parallel=none'}: {e}") from None
    _half_params(cfg, dims)
    batch = cfg.data.get("batch_size")
    if isinstance(batch, int) and batch % dims.data_world:
        raise ConfigError(f"data.batch_size={batch} does not split evenly over the {dims.data_world} ranks that read "
                          f"different slices ({dims.describe()}): make it a multiple of {dims.data_world}")
    if dims.enabled("pp") and isinstance(batch, int):
        check_microbatches(node.get("microbatches", 1), batch, dims.data_world)
    return dims


def check_microbatches(micro: int, batch: int, ranks: int) -> None:
    """Raises :class:`ConfigError` unless ``micro`` (``parallel.microbatches``) divides the per-rank batch of
    ``batch`` (``data.batch_size``) over ``ranks`` data-parallel ranks.

    >>> check_microbatches(4, 64, 2)
    >>> check_microbatches(3, 64, 2)
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: parallel.microbatches=3 does not divide the per-rank batch of 32 (data.batch_size=64 over 2 data ranks): pick a divisor, e.g. parallel.microbatches=2
    """
    share = batch // ranks
    if share % micro:
        divisor = max(d for d in range(1, min(share, micro) + 1) if share % d == 0)
        raise ConfigError(f"parallel.microbatches={micro} does not divide the per-rank batch of {share} "
                          f"(data.batch_size={batch} over {ranks} data rank{'s' if ranks > 1 else ''}): pick a "
                          f"divisor, e.g. parallel.microbatches={divisor}")


def single_process_note(cfg: DictConfig, dims: distributed.ParallelDims) -> str | None:
    """What the ``run`` line says when a layout's ``-1`` degrees took the rest of a world of one process
    (``parallel=tp`` without torchrun): nothing is split, and how to get the layout; ``None`` otherwise.

    The presets' degrees are ``-1`` by design, so that one command runs on one process and on N (the same
    curve); explicit sizes (``parallel.tp=2``) on one process are refused by :func:`parallel_dims`.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"parallel": {"tp": -1, "pp": 1}})
    >>> single_process_note(cfg, distributed.ParallelDims.of(world=1, tp=-1))
    '1 process: parallel.tp=-1 takes the rest of a world of 1, so nothing is split (tp=1); launch with torchrun --nproc_per_node=N for tp=N'
    """
    free = [d for d in distributed.DIMS if cfg.parallel.get(d) == -1]
    if dims.world != 1 or not free:
        return None
    return (f"1 process: parallel.{free[0]}=-1 takes the rest of a world of 1, so nothing is split ({free[0]}=1); "
            f"launch with torchrun --nproc_per_node=N for {free[0]}=N")


def _half_params(cfg: DictConfig, dims: distributed.ParallelDims) -> None:
    """Refuses half-precision params (``amp=pure_bf16``, ``pure_fp16``) where the step computes with the model's
    own float32 tensors (pipeline stages, FSDP's sharded modules), which :func:`cast_params`' copies would miss."""
    policy = cfg.amp.get("policy")
    if policy is None or not (dims.enabled("pp") or fsdp_casts(dims)):
        return
    p = _call(_wrapper("Policy", "amp.policy").parse, "amp.policy", policy).param_dtype
    if p in (torch.bfloat16, torch.float16):
        where = "pipeline stages" if dims.enabled("pp") else "FSDP's sharded modules"
        raise ConfigError(f"amp.policy={policy}: {_short(p)} params are not supported under {dims.describe()} "
                          f"({where} keep float32 params); use amp=bf16 (float32 params, bf16 compute), or a layout "
                          "without pp or dp_shard (parallel=dp, tp, ep)")


def _shard_elementwise(txs: list, names: list[str], shard_over: str | None) -> list:
    """``txs`` with each run of consecutive elementwise transforms in one ``sharded_apply(..., shard_over=...)``.

    One wrapper per run: with ``shard_over`` each costs a reduce-scatter (or slice) and an all-gather.
    """
    if shard_over is not None and not any(fx.is_elementwise(tx) for tx in txs):
        raise ConfigError(f"parallel.shard_optimizer=true: no entry of optim.chain ({', '.join(names)}) is "
                          "elementwise, so there is no optimizer state to shard")
    out, run = [], []
    for tx in [*txs, None]:
        if tx is not None and fx.is_elementwise(tx):
            run.append(tx)
            continue
        if run:
            out.append(fx.sharded_apply(run[0] if len(run) == 1 else fx.chain(*run), shard_over=shard_over))
            run = []
        if tx is not None:
            out.append(tx)
    return out


def float8(cfg: DictConfig, model: torch.nn.Module, device: torch.device) -> list[str]:
    """``amp.float8`` (``amp=float8``): the model's convertible Linear layers swapped for torchao's ``Float8Linear``
    in place, before the model is placed (:func:`fxtrain.float8.convert`); returns their names (none without it).

    Every layout composes: Float8Linear takes DTensor weights and activations, and computes each tensorwise scale
    from the whole tensor's amax (a reduction over its shards), so tensor parallel's plain ``ColwiseParallel`` /
    ``RowwiseParallel`` and FSDP's all-gathered weights quantize as one process does (tests/test_matrix.py: every
    layout preset, 3d's 8 ranks too, within 3e-3 of one process over 8 steps, bf16's own spread 1.4e-3; killed and
    resumed bit-exactly, relayouted into one process). torchao's float8 TP styles and FSDP
    float8 all-gather would only move the cast before the communication (less traffic), which fxtrain does not do.
    ``trainer.compile=true`` composes too, emulated (torchtitan calls emulation eager-only; on torch 2.13 with
    torchao 0.18 the compiled blocks log the eager losses to 1e-6). Refused in one line: a model with nothing to
    convert, an ``amp.float8.skip`` entry that names no Linear layer; torchao missing is the line that installs it.
    """
    node = cfg.amp.get("float8")
    if node is None:
        return []
    try:  # skip's type: fxtrain.validate; its names: convert, against the model
        return float8_training.convert(model, device=device, skip=list(node.get("skip") or []))
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cast_params(cfg: DictConfig, params: Any) -> Any:
    """``params`` in the storage dtype of ``amp.policy`` (the pure half modes keep no float32 copy).

    Mixed modes (``p=f32``) and ``amp=off`` leave them as they are.
    """
    if cfg.amp.policy is None:
        return params
    return _call(_wrapper("Policy", "amp.policy").parse, "amp.policy", cfg.amp.policy).cast_to_param(params)


def _call(fn: Callable, key: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from e


def _values_under(values: dict[str, Any], key: str) -> dict[str, Any]:
    """The entries of ``values`` for the arguments of the node at ``key`` (``"schedule"``: its ``peak_value``...)."""
    return {k[len(key) + 1:]: v for k, v in values.items() if k.startswith(key + ".") and "." not in k[len(key) + 1:]}


def _accepted(node: DictConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``extra`` that ``node``'s target takes as arguments (``groups`` for global transforms)."""
    if not extra:
        return {}
    fn = locate(resolve(node, "optim.chain"), "optim.chain")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in extra.items() if k in params}


def _transform(node: DictConfig, key: str, shape: Callable | None, every: int,
               given: dict[str, Any]) -> fx.GradientTransformation:
    factory, kwargs = _parts(resolve(node, key), key, given)
    kwargs = floats_where_expected(factory, kwargs)  # weight_decay=0 from the command line: 0.0
    if "learning_rate" in kwargs and shape is not None:
        lr = kwargs.pop("learning_rate")
        if isinstance(lr, torch.Tensor) and lr.ndim == 0 and lr.is_floating_point():
            peak = lr  # one job's value in a vmapped sweep (stack's ``values``)
        elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
            peak = float(lr)
        else:
            raise ConfigError(f"{key}.learning_rate: expected a number (the schedule's peak), got {lr!r}")
        try:
            return fx.inject_hyperparams(factory)(learning_rate=ScaledSchedule(peak, shape, every), **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{key} ({node._target_}): {e}") from e
    try:
        tx = factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key} ({node._target_}): {e}") from e
    if not isinstance(tx, fx.GradientTransformation):
        raise ConfigError(f"{key}: {node._target_} built a {type(tx).__name__}, not a GradientTransformation")
    return tx


def _wrapper(name: str, key: str) -> Callable:
    fn = getattr(fx, name, None)
    if fn is None:
        raise ConfigError(f"{key} needs fx.{name}, which this version of fxtrain does not have yet; "
                          f"leave {key.split('.')[0]} at its default")
    return fn


# --- command-line group choices ---------------------------------------------------------------------

PRIMARY_CONFIG = "pkg://fxtrain.conf"  # conf/ at the repository root, installed as the package fxtrain.conf
_CHOICE = re.compile(r"^(?:\+\+|\+|~)?(?P<group>[\w/]+)(?:@[\w.]+)?=(?P<value>.*)$")


USER_CONFIGS = "fxtrain: yours first"  # the provider of the user's entries that precede fxtrain's configs


def search_path(argv: list[str], primary: str = PRIMARY_CONFIG) -> tuple[Any, list[str]]:
    """The config search path ``python -m fxtrain.train argv`` composes from, and its overrides:
    ``(ConfigRepository, overrides)``.

    Built as Hydra builds it (its own pieces, with fxtrain's search-path plugin): Hydra's configs, the
    user's entries (:func:`user_search_path`), the ``primary`` configs (fxtrain's ``conf/``), the other
    search-path plugins' (Hydra lists the user's entries once more there, after ours: they find nothing new).

    >>> repo, overrides = search_path(["-m", "model=mlp,resnet"])
    >>> overrides, repo.group_exists("model"), "mlp" in repo.get_group_options("model")
    (['model=mlp,resnet'], True, True)
    """
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    return ConfigRepository(_search_path(argv, primary)), list(args.overrides)


def _search_path(argv: list[str], primary: str) -> Any:
    from hydra._internal.utils import create_config_search_path

    path = create_config_search_path(primary)
    path.get_path()[:] = [e for e in path.get_path() if e.provider != USER_CONFIGS]  # put there for sys.argv
    user_configs_first(path, argv, primary)
    return path


def user_configs_first(path: Any, argv: list[str], primary: str = PRIMARY_CONFIG) -> None:
    """Puts the user's entries of the command line ``argv`` (:func:`user_search_path`) before ``primary`` in
    Hydra's ``path`` (a ``ConfigSearchPath``), so that a user's option shadows fxtrain's of the same name.

    Hydra takes an option (``model/mlp.yaml``) from the first search-path entry that has it, and puts the
    app's primary config directory (``pkg://fxtrain.conf`` for ``python -m fxtrain.train``) before
    ``--config-dir`` and ``hydra.searchpath``: a user's ``conf/model/mlp.yaml`` or
    ``conf/hparams_search/<name>.yaml`` was silently replaced by fxtrain's. fxtrain's search-path plugin
    (``hydra_plugins/fxtrain_vmap_launcher/search_path.py``) calls this for the runner's command line; a
    search path without ``primary`` (another Hydra app, a compose by directory) is left as it is.

    >>> from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    >>> path = ConfigSearchPathImpl()
    >>> path.append("hydra", "pkg://hydra.conf"); path.append("main", "pkg://fxtrain.conf")
    >>> user_configs_first(path, ["hydra.searchpath=[pkg://mine.conf]", "model=mlp"])
    >>> [e.path for e in path.get_path()]
    ['pkg://hydra.conf', 'pkg://mine.conf', 'pkg://fxtrain.conf']
    """
    from hydra.core.config_search_path import SearchPathQuery

    main = SearchPathQuery(provider="main", path=primary)
    if path.find_first_match(main) == -1:
        return
    for entry in user_search_path(argv, primary):  # each before primary: their order kept
        path.prepend(provider=USER_CONFIGS, path=entry, anchor=main)


def user_search_path(argv: list[str], primary: str = PRIMARY_CONFIG) -> list[str]:
    """The config search-path entries of the user's command line ``argv``, in Hydra's order: ``--config-dir``,
    then ``hydra.searchpath`` (from the command line, or else the primary config's, as Hydra reads it).

    >>> user_search_path(["--config-dir", "/", "hydra.searchpath=[pkg://mine.conf]", "model=mlp"])
    ['file:///', 'pkg://mine.conf']
    """
    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.plugins import Plugins
    from hydra.errors import HydraException

    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        args, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError:  # not a command line Hydra runs (this process's: pytest -rA): no entries of it
        return []
    entries = []
    if args.config_dir is not None:
        where = pathlib.Path(args.config_dir).expanduser().resolve()
        if not where.is_dir():
            raise ConfigError(f"--config-dir {args.config_dir}: no such directory ({where})")
        entries.append(f"file://{where}")
    try:
        for o in OverridesParser.create().parse_overrides([a for a in args.overrides if a.startswith("hydra.searchpath=")]):
            return [*entries, *(str(v) for v in o.value())]
    except HydraException as e:
        raise ConfigError(f"hydra.searchpath: {e}") from None
    Plugins.instance()  # registers Hydra's config sources (pkg://, file://)
    path = ConfigSearchPathImpl()  # where the primary config is looked for (no plugins: they may call this)
    for entry in ["pkg://hydra.conf", *entries, primary, "structured://"]:
        path.append("fxtrain", entry)
    primary_cfg = ConfigRepository(path).load_config(args.config_name or "train")
    return [*entries, *(OmegaConf.select(primary_cfg.config, "hydra.searchpath") or [] if primary_cfg else [])]


def check_overrides(argv: list[str], primary: str = PRIMARY_CONFIG) -> None:
    """Checks the group choices of the command line ``argv`` against every entry of Hydra's search path.

    Hydra reports an unknown option of a multi-select group (``optim/transform@optim.chain=[adamz]``)
    without listing the options; this lists them for every group, from every search-path entry (fxtrain's
    ``conf/``, ``--config-dir``, ``hydra.searchpath``), with the closest one, and names the optional extra
    that a launcher, sweeper, logger or ``hparams_search`` needs when it is missing (:mod:`fxtrain.extras`). Options of a user's own groups are options like ours.

    >>> check_overrides(["seed=1", "model=resnet"])   # fine
    >>> check_overrides(["-m", "model=mlp,resnett"])
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: model=mlp,resnett: no option 'resnett' in model (did you mean resnet?); available: convnet, mlp, moe, resnet, transformer (pkg://fxtrain.conf)
    """
    from hydra.core.object_type import ObjectType

    repo, overrides = search_path(argv, primary)
    for arg in overrides:
        m = _CHOICE.match(arg)
        for option in _named_options(arg) if m else ():
            extras.check_choice(m["group"], option, arg)  # an optional launcher, sweeper or logger: its extra
        if not m or m["group"].startswith("hydra") or not repo.group_exists(m["group"]):
            continue
        group = m["group"]
        kind = "transform" if group == "optim/transform" else "option"
        options = repo.get_group_options(group, ObjectType.CONFIG)
        if _is_null(arg):  # Hydra's own answer is a ValueError traceback from its defaults list
            listed = ", ".join(o for o in options if not o.startswith("_"))
            empty = " or [] for none" if group == "logger" else ""
            raise ConfigError(f"{arg}: {group} is a config group; it takes an option ({listed}){empty}, not null; "
                              f"leave {arg.partition('=')[0]} out for its default")
        for value in _named_options(arg):
            if value not in options:
                close = difflib.get_close_matches(value, options, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                where = "; ".join(f"{', '.join(found)} ({source.full_path()})" for source in repo.get_sources()
                                  if source.is_group(group) and (found := sorted(
                                      source.list(group, ObjectType.CONFIG))))
                raise ConfigError(f"{arg}: no {kind} {value!r} in {group}{hint}; available: {where}")


def check_override_keys(argv: list[str], primary: str = PRIMARY_CONFIG) -> None:
    """Refuses a plain override (no ``+``) of a key the config lacks, in one line naming the nearest key, before
    Hydra's five lines ("Could not override 'trainer.max_stpes'..." without a name to use).

    A key of a node :mod:`fxtrain.schema` declares is checked against its fields; any other (``model.hiden``,
    ``optim.chain.adamw.lerning_rate``) against the config the command line composes (its experiment, the user's
    own config and groups), composed once more here only for such keys.

    >>> check_override_keys(["trainer.max_steps=5", "model.hidden=[8]"])   # fine
    >>> check_override_keys(["trainer.max_stpes=5"])
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: trainer.max_stpes: not a setting fxtrain reads (did you mean trainer.max_steps?); trainer's settings are max_steps, max_epochs, log_every, eval_every, eval_batch_size, checkpoint_every, keep_last, checkpoint, test_ckpt, device, compile, cpu_threads, progress, heartbeat_s, allow_no_descent, early_stopping, eval_hooks, export, orbax_naming
    >>> check_override_keys(["model.hiden=[8]"])
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: model.hiden=[8]: the config has no key model.hiden (did you mean model.hidden?); fix the name, or add a key with +model.hiden=[8]
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException
    from hydra.types import RunMode

    args, _ = get_args_parser().parse_known_args(argv)
    try:
        parsed = OverridesParser.create().parse_overrides(list(args.overrides))
    except HydraException:
        return  # Hydra says what is wrong with the grammar
    repo, rest = None, []
    chosen = {o.key_or_group for o in parsed if "." not in o.key_or_group}  # group choices (debug=fast...)
    for o in parsed:
        key = o.key_or_group
        if o.type != OverrideType.CHANGE or key.startswith("hydra") or "/" in key:
            continue
        if "." not in key and key not in schema.Settings.model_fields:  # seed=1, or a group of the user's
            repo = repo or search_path(argv, primary)[0]
            if repo.group_exists(key):
                continue
        line = schema.unknown_key(key) or schema.unknown_key(key.split(".")[0])  # modle.hidden: modle
        if line is not None:
            raise ConfigError(line)
        if schema.declared(key) or (key.split(".")[0] in chosen and key.startswith("debug.")):
            continue
        if not _in_conf(key.rpartition(".")[2]) or key.startswith(("debug.", "amp.loss_scale.")):
            rest.append(o)  # a name no option of conf/ has (model.hiden), a node only some options have: composed
    if not rest or any(o.is_sweep_override() and "." not in o.key_or_group for o in parsed):
        return  # a sweep over groups composes several configs: Hydra checks each
    keep = [o.input_line for o in parsed if o not in rest and not o.is_sweep_override()
            and not o.key_or_group.startswith("hydra")]
    try:
        cfg = ConfigLoaderImpl(config_search_path=_search_path(argv, primary)).load_configuration(
            args.config_name or "train", keep, run_mode=RunMode.RUN)
    except (HydraException, OmegaConfBaseException):
        return  # Hydra names what else is wrong
    for o in rest:
        node, path = cfg, o.key_or_group.split(".")
        for depth, part in enumerate(path):
            where = ".".join(path[:depth])
            if OmegaConf.is_list(node):
                break  # model.hidden.0=8: Hydra checks the index
            if not OmegaConf.is_dict(node):  # amp.loss_scale.init_scale=8.0 where amp.loss_scale is null
                raise ConfigError(f"{o.input_line}: {where}={schema.show(node._value())} has no keys; set it to a "
                                  f"node first ({where}={{{part}: ...}}), or pick an option that has one")
            if part not in node:
                close = schema.nearest(part, [str(k) for k in node])
                hint = f" (did you mean {where + '.' if where else ''}{close}?)" if close else ""
                raise ConfigError(f"{o.input_line}: the config has no key {o.key_or_group}{hint}; fix the name, or "
                                  f"add a key with +{o.input_line}")
            node = node._get_node(part)


@functools.lru_cache(maxsize=None)
def _conf_text() -> str:
    """The options of fxtrain's conf/, one text: a plain override whose last name is a key there is left to Hydra
    (composing the config at each launch to check it costs about a second on a busy machine)."""
    return "\n".join(p.read_text() for p in pathlib.Path(str(importlib.resources.files("fxtrain.conf"))).rglob("*.yaml"))


def _in_conf(name: str) -> bool:
    return re.search(rf"^[ -]*{re.escape(name)}:", _conf_text(), re.MULTILINE) is not None


def _is_null(arg: str) -> bool:
    """Whether the override ``arg`` sets its key to null (``logger=null``, or null among a sweep's values), read
    with Hydra's override grammar.

    >>> _is_null("logger=null"), _is_null("logger=[]"), _is_null("model=mlp,null"), _is_null("model=mlp,moe")
    (True, False, True, False)
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
    except HydraException:
        return False
    if override.is_delete():
        return False
    value = override.value()
    values = (getattr(value, "list", None) or []) if override.is_sweep_override() else [value]
    return any(v is None for v in values)


def _named_options(arg: str) -> list[str]:
    """The options a group override names, read with Hydra's own override grammar: ``model=a``, a list
    ``optim/transform@optim.chain=[a,b]``, and sweeps of either (``model=a,b``, ``choice(...)``, the structure
    sweep ``'optim/transform@optim.chain=[a,b],[c,d]'``); ``null`` names none, nor does a ``glob(...)``
    (Hydra matches it against the options). One Hydra cannot parse names none: Hydra says what is wrong.

    >>> _named_options("optim/transform@optim.chain=[sgd],[clip,adamw]")
    ['sgd', 'clip', 'adamw']
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
    except HydraException:
        return []
    value = override.value()
    values = (getattr(value, "list", None) or []) if override.is_sweep_override() else [value]  # glob, range: none
    return [str(name) for v in values for name in (v if isinstance(v, list) else [v]) if name is not None]


# Names of earlier releases (tests/cases/public_names.json) that were replaced: reading one says by what.
__getattr__ = moved_names(__name__, {}, removed={
    "constant_hyperparams": "the hyperparameters a stack keeps constant are fx.traits(tx).constant_reports"})
