"""The runner's own settings, declared once: one pydantic model per config node, each field typed, bounded and
documented.

:class:`Settings` is the composed config's top level; its nodes are :class:`Trainer` (with
:class:`EarlyStopping` and :class:`BestCheckpoint`), :class:`Amp` (with :class:`LossScale`), :class:`Accumulate`,
:class:`Parallel` and :class:`Debug`. The ``_target_`` nodes (``model``, ``data``, ``task``, ``schedule``,
``optim.chain``'s entries, loggers) take their target's arguments and are checked by :mod:`fxtrain.validate`.

* :func:`check` validates a config's values (plain mappings) and raises :class:`fxtrain.errors.ConfigError` as
  one line naming the key, what the user wrote and what to do (:func:`message` translates pydantic's errors).
* :func:`expected` is the words for a type (``a positive whole number``); :func:`nearest` the closest key.
* :func:`describe` is the text of ``python -m fxtrain.train --help`` (``conf/hydra/help/fxtrain.yaml``).

Example:
    >>> check({"trainer": {"max_steps": 0}})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: trainer.max_steps=0: expected a positive whole number (optimizer steps, counted in batches; at most 2**31-1); e.g. trainer.max_steps=1000
    >>> check({"trainer": {"max_stpes": 5}})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: trainer.max_stpes: not a setting fxtrain reads (did you mean trainer.max_steps?); trainer's settings are max_steps, max_epochs, log_every, eval_every, eval_batch_size, checkpoint_every, keep_last, checkpoint, test_ckpt, device, compile, cpu_threads, progress, heartbeat_s, allow_no_descent, early_stopping, eval_hooks, export, orbax_naming
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
import typing
from typing import Annotated, Any, Callable, Literal, Mapping, Optional, Union

import annotated_types
from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from fxtrain.errors import ConfigError

__all__ = ["Settings", "Trainer", "EarlyStopping", "BestCheckpoint", "Amp", "LossScale", "Float8", "Accumulate", "Parallel",
           "Debug", "Launcher", "Executor", "WandbSettings", "TargetNode", "NESTED", "LAUNCHER", "ARGS", "MAX_COUNT",
           "check", "check_args", "check_value", "message", "unknown_key", "declared", "expected", "loose", "nearest",
           "describe", "show", "node_models", "Unreadable"]

# Whole numbers count steps, examples, bytes, widths: the optimizer's step count is an int32 tensor, and no size of
# 2**31 or more fits a tensor on any machine fxtrain runs on, so larger values are typos.
MAX_COUNT = 2**31 - 1
DTYPES = ("float32", "float64", "bfloat16", "float16", "f32", "f64", "bf16", "f16")
SHORTENED = ("accumulate.every", "schedule.warmup_steps")  # what fxtrain.train.shorten_for_debug may shorten

Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Name = Annotated[str, Field(pattern=r"\S")]  # a non-blank name
Degree = Union[Literal[-1], Count, None]


class _Node(BaseModel):
    """A node of the config: no key it does not declare, no coercion (``1`` is not ``true``), finite numbers."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class EarlyStopping(_Node):
    """``trainer.early_stopping``: stop when a logged metric stops improving (its values are checked while off too)."""

    metric: Optional[Name] = Field(None, description="the logged metric watched (val_loss, accuracy...); null: off")
    patience: Count = Field(5, description="logged values without improvement before stopping")
    mode: Literal["auto", "min", "max"] = Field("auto", description="auto: min for names with loss or error, else max")
    min_delta: float = Field(0.0, ge=0, description="the least change that counts as an improvement")


class BestCheckpoint(_Node):
    """``trainer.checkpoint``: which step ``checkpoints/best`` keeps."""

    best_by: Optional[Name] = Field(None, description="the logged metric choosing checkpoints/best; null: "
                                                      "optimized_metric")


class Trainer(_Node):
    """``trainer``: how long, how often to log, evaluate and checkpoint, where to run (conf/trainer/)."""

    max_steps: Count = Field(1000, description="optimizer steps, counted in batches")
    max_epochs: Optional[Annotated[int, Field(ge=1, le=10**6)]] = Field(
        None, description="passes over the training split, with trainer.max_steps=null; null: the run is given in "
                          "steps", examples=[5])
    log_every: Count = Field("${fxtrain.every:${trainer.max_steps},40}", description="steps between metrics.jsonl "
                             "lines; default: 40 per run", examples=[10])
    eval_every: Count = Field("${fxtrain.every:${trainer.max_steps},10}", description="steps between evaluations; "
                              "default: 10 per run", examples=[100])
    eval_batch_size: Count = Field(512, description="examples per evaluation forward pass")
    checkpoint_every: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        500, description="steps between checkpoints; 0: only at the end")
    keep_last: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        2, description="the newest checkpoints kept; 0 to keep every checkpoint")
    checkpoint: BestCheckpoint = Field(BestCheckpoint(), description="checkpoints/best")
    test_ckpt: Literal["best", "last"] = Field("best", description="the checkpoint the test split is evaluated on "
                                                                   "(best by trainer.checkpoint.best_by, or last)")
    device: Name = Field("auto", description="auto (CUDA when there is one), cpu, cuda or cuda:N")
    compile: bool = Field(False, description="torch.compile each model block and the step's update")
    cpu_threads: Optional[Annotated[int, Field(ge=1, le=1024)]] = Field(
        1, description="torch CPU threads; null: torch's default")
    progress: bool = Field(True, description="a tqdm progress bar (rank 0, when stderr is a terminal)")
    heartbeat_s: Optional[Annotated[float, Field(ge=0, le=86400)]] = Field(
        30, description="seconds between heartbeat lines without the bar; 0 or null: none")
    allow_no_descent: bool = Field(False, description="train a chain that does not step against the gradient")
    early_stopping: EarlyStopping = Field(EarlyStopping(), description="stop when a metric stops improving")
    eval_hooks: Optional[dict[str, Any]] = Field({}, description="your metrics at every evaluation: name -> "
                                                                 "_target_ node")
    export: Optional[str] = Field(None, description="orbax: write <run dir>/orbax at the end; null: no export")
    orbax_naming: str = Field("compact", description="the params' names in Orbax checkpoints: compact, attribute, "
                                                     "nnx or torch")


class LossScale(_Node):
    """``amp.loss_scale`` as a mapping: :class:`fxtrain.DynamicLossScale`'s arguments."""

    init_scale: float = Field(2.0**16, gt=0, description="the first scale")
    growth_factor: float = Field(2.0, gt=1, description="multiplies the scale after growth_interval finite updates")
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="multiplies the scale on a counted overflow")
    growth_interval: Count = Field(2000, description="finite updates in a row before a growth")
    hysteresis: Count = Field(1, description="overflows since the last growth that it takes to back off")
    min_scale: Optional[Annotated[float, Field(gt=0)]] = Field(None, description="floor of the scale; null: none")
    max_scale: Optional[Annotated[float, Field(gt=0)]] = Field(None, description="ceiling of the scale; null: none")


class Float8(_Node):
    """``amp.float8`` (``amp=float8``): torchao's float8 training of the model's Linear layers (fxtrain.float8)."""

    skip: Optional[list[Name]] = Field(["head"], description="Linear layers kept out of float8, by name: the output "
                                                         "head by default; null or [] for none",
                                       examples=[["head"]])


class Amp(_Node):
    """``amp``: mixed precision (fx.amp_cast), conf/amp/."""

    policy: Optional[Name] = Field(None, description="a jmp policy (p=f32,c=bf16,o=f32) or preset (bf16, fp16...); "
                                                     "null: no mixed precision")
    loss_scale: Union[None, Literal["none", "dynamic"], Annotated[float, Field(gt=0)], LossScale] = Field(
        None, union_mode="left_to_right", description="the loss scale (fx.amp_cast's loss_scale)",
        json_schema_extra={"expected": "null (the policy's default), none, dynamic, a finite number > 0 (a static "
                                       "scale) or DynamicLossScale's settings"})
    float8: Optional[Float8] = Field(None, description="float8 matmuls in the Linear layers (torchao, amp=float8); "
                                                      "null: none")


class Accumulate(_Node):
    """``accumulate``: gradient accumulation (fx.accumulate), conf/accumulate/."""

    every: Count = Field(1, description="batches per optimizer update", examples=[4])
    mean: bool = Field(True, description="average the micro-batch gradients (false: sum them)")
    accumulator_dtype: Optional[Literal[DTYPES]] = Field(None, description="dtype of the running sum; null: the "
                                                                            "gradients'")


_DEGREE = "a positive whole number of ranks, or -1 (the rest of the world)"


class Parallel(_Node):
    """``parallel``: the parallel degrees (their product is the world size) and pipeline settings, conf/parallel/."""

    pp: Degree = Field(1, description="pipeline stages", json_schema_extra={"expected": _DEGREE})
    dp_replicate: Degree = Field(1, description="replicas of the params", json_schema_extra={"expected": _DEGREE})
    dp_shard: Degree = Field(1, description="FSDP ranks", json_schema_extra={"expected": _DEGREE})
    ep: Degree = Field(1, description="expert-parallel ranks", json_schema_extra={"expected": _DEGREE})
    cp: Degree = Field(1, description="context-parallel ranks", json_schema_extra={"expected": _DEGREE})
    tp: Degree = Field(1, description="tensor-parallel ranks", json_schema_extra={"expected": _DEGREE})
    shard_optimizer: bool = Field(False, description="ZeRO-1/2 over dp_replicate")
    schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "interleaved_zb", "zbv"] = Field(
        "gpipe", description="the pipeline schedule (pp > 1)")
    stages_per_rank: Count = Field(1, description="virtual pipeline stages per pp rank (interleaved schedules: 2+, "
                                                  "zbv: 2)")
    microbatches: Count = Field(4, description="micro-batches per batch under pp > 1")
    dp: None = Field(None, description="the key before degrees: use parallel.dp_replicate (replicated params, "
                                       "parallel=dp) or parallel.dp_shard (FSDP, parallel=fsdp)")


Limit = Union[Annotated[float, Field(gt=0, le=1)], Count, None]
_LIMIT = {"expected": "a fraction in (0, 1] (0.1: a tenth) or a whole number of batches >= 1 (5), or null (all)"}


class Debug(_Node):
    """``debug``: what a debug run does differently (debug=fast, overfit, limit, profile: conf/debug/)."""

    name: Optional[Name] = Field(None, description="the option, said on the run's debug line")
    checkpoints: bool = Field(True, description="false: no checkpoint written")
    limit_train: Limit = Field(None, description="training batches per epoch", json_schema_extra=_LIMIT)
    limit_val: Limit = Field(None, description="validation rows, in batches", json_schema_extra=_LIMIT)
    limit_test: Limit = Field(None, description="test rows, in batches", json_schema_extra=_LIMIT)
    overfit_batches: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        0, description="training batches reused every step; 0: off", examples=[1])
    profile_steps: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        0, description="steps torch.profiler records; 0: off", examples=[5])
    profile_wait: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        0, description="steps trained before the profiled ones", examples=[3])
    shorten: bool = Field(False, description="shorten warmup and accumulation that do not fit trainer.max_steps")
    shortened: Optional[dict[Literal[SHORTENED], int]] = Field(
        {}, description="set by the run: what debug.shorten changed",
        json_schema_extra={"expected": f"what the run sets ({{key: whole number}}, keys among "
                                       f"{', '.join(SHORTENED)}); leave it out"})


class Optim(_Node):
    """``optim``: the transform stack."""

    chain: Any = Field(None, description="named transforms, in order: 'optim/transform@optim.chain=[clip,adamw]'")


_NODE = "a _target_ node of its group"


class Settings(_Node):
    """The composed config's top level (conf/train.yaml); each group's node is its own model or a _target_ node."""

    seed: Annotated[int, Field(ge=0, le=2**64 - 1)] = Field(0, description="params init and batch order")
    optimized_metric: Name = Field("${oc.select:task.optimized_metric,val_loss}", description="the metric returned "
                                   "to sweepers, a key of summary.json's metrics", examples=["val_loss"])
    resume: Optional[str] = Field(None, description="null: step 0; auto: this run's newest checkpoint; or a "
                                                    "checkpoint or run directory")
    resume_force: bool = Field(False, description="resume=PATH may load a checkpoint of another config")
    resume_relayout: bool = Field(False, description="resume on another world size or parallel layout")
    model: Any = Field(None, description=_NODE)
    data: Any = Field(None, description=_NODE)
    task: Any = Field(None, description=_NODE)
    optim: Optim = Field(Optim(), description="the transform stack")
    schedule: Any = Field(None, description=_NODE)
    amp: Amp = Field(Amp(), description="mixed precision")
    accumulate: Accumulate = Field(Accumulate(), description="gradient accumulation")
    parallel: Parallel = Field(Parallel(), description="parallel degrees")
    trainer: Trainer = Field(Trainer(), description="the loop")
    logger: Any = Field(None, description="named loggers, each a _target_ node")
    debug: Optional[Debug] = Field(None, description="a debug run's settings")
    hydra: Any = Field(None, description="Hydra's own node (compose(..., return_hydra_config=True))")


class Executor(BaseModel):
    """``hydra.launcher.executor``: ``submitit.AutoExecutor(folder, cluster).update_parameters(<the others>)``; any of
    submitit's parameters may be added (``+hydra.launcher.executor.slurm_mail_user=...``)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    cluster: Literal["local", "slurm", "debug"] = Field("local", description="submitit's executor")
    folder: Name = Field("${hydra.sweep.dir}/.submitit/%j", description="where submitit keeps its logs")
    name: Optional[Name] = Field("${hydra.job.name}", description="the job's name")
    timeout_min: Optional[Annotated[int, Field(ge=0, le=MAX_COUNT)]] = Field(60, description="the group is killed "
                                                                                          "after this long")
    nodes: Optional[Literal[1]] = Field(1, description="a vmapped group is one process: one node")
    tasks_per_node: Optional[Literal[1]] = Field(1, description="a vmapped group is one process: one task")
    cpus_per_task: Optional[Annotated[int, Field(ge=1, le=MAX_COUNT)]] = Field(None, description="CPUs per group")
    gpus_per_node: Optional[Annotated[int, Field(ge=0, le=MAX_COUNT)]] = Field(None, description="GPUs per group")
    mem_gb: Optional[Annotated[float, Field(gt=0)]] = Field(None, description="memory per group")
    stderr_to_stdout: bool = Field(False, description="one log file per job")
    slurm_partition: Optional[str] = Field(None, description="sbatch --partition")
    slurm_account: Optional[str] = Field(None, description="sbatch --account")
    slurm_qos: Optional[str] = Field(None, description="sbatch --qos")
    slurm_constraint: Optional[str] = Field(None, description="sbatch --constraint")
    slurm_exclude: Optional[str] = Field(None, description="sbatch --exclude")
    slurm_array_parallelism: Count = Field(256, description="at most this many groups running at once")
    slurm_setup: Optional[list[str]] = Field(None, description="shell lines run before the job")
    slurm_additional_parameters: Optional[dict[str, Any]] = Field({}, description="any other sbatch option")
    slurm_max_num_timeout: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        0, description="requeues on timeout or preemption")


LAUNCHER = "hydra_plugins.fxtrain_vmap_launcher.vmap_launcher.VmapLauncher"


class Launcher(_Node):
    """``hydra.launcher`` of ``hydra/launcher=vmap`` and its submitit forms (conf/hydra/launcher/)."""

    target: Literal[LAUNCHER] = Field(LAUNCHER, alias="_target_", description="the launcher")
    max_group_size: Optional[Count] = Field(None, description="jobs per vmapped process at most; null: no limit")
    executor: Optional[Executor] = Field(None, description="null: every group in this process; submitit's settings")
    compile: bool = Field(False, description="torch.compile each group's vmapped step and evaluation")
    cache_dir: Optional[str] = Field(None, description="where compiled code is kept across processes")


class WandbSettings(BaseModel):
    """``logger.wandb.settings``: ``wandb.Settings``' arguments (any of them; those conf/logger/wandb.yaml sets typed)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    console: Name = Field("off", description="wandb's console capture; off: train.log keeps the output")
    quiet: bool = Field(True, description="no wandb lines on the console")
    x_disable_stats: bool = Field(True, description="no system-metrics sampler process")


# The mapping arguments of fxtrain's loggers whose entries are declared: {target: {argument: model}}.
NESTED = {"fxtrain.loggers.WandbLogger": {"settings": WandbSettings}}


def check_args(key: str, fn: Callable, kwargs: Mapping[str, Any]) -> None:
    """Each of ``kwargs`` against the annotation of ``fn``'s parameter of that name, strictly (``bool`` takes true or
    false, not 1), or against its default's type where it has none (a number): a new argument of a logger or
    launcher is checked the day it is added, with no rule to write. An annotation pydantic cannot read states none.

    >>> def log(uri: str | None = None, every: int = 1): ...
    >>> check_args("logger.mine", log, {"uri": 5})
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: logger.mine.uri=5: expected a string, or null
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
        kind = hints.get(name, Any)
        if kind is Any or _adapter(kind) is None:  # a number or a tensor: a config holds no tensor, so its default's type
            default = params[name].default if name in params else None
            kind = bool if isinstance(default, bool) else float if isinstance(default, (int, float)) else Any
        check_value(f"{key}.{name}", kind, value)


def check_value(key: str, annotation: Any, value: Any, loosely: bool = False) -> None:
    """Raises :class:`~fxtrain.errors.ConfigError` unless ``value`` is an ``annotation`` (strictly; one pydantic
    cannot read states no rule); ``loosely``: its type alone (:func:`loose`), the message saying the whole rule.

    >>> check_value("optim.chain.adamw.b1", ARGS["b1"], 1.5)
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: optim.chain.adamw.b1=1.5: expected a number in [0, 1)
    """
    adapter = _adapter(loose(annotation) if loosely else annotation)
    if adapter is None:
        return
    try:
        adapter.validate_python(value)
    except ValidationError:
        raise ConfigError(_expected_line(key, value, FieldInfo.from_annotation(annotation))) from None


_ADAPTERS: dict[str, TypeAdapter | None] = {}


def _adapter(annotation: Any) -> TypeAdapter | None:
    key = repr(annotation)
    if key not in _ADAPTERS:
        _ADAPTERS[key] = None  # an annotation pydantic cannot validate (a protocol, a tensor) states no rule
        for config in ({"config": ConfigDict(strict=True, allow_inf_nan=False)}, {}):  # a model has its own config
            try:
                _ADAPTERS[key] = TypeAdapter(annotation, **config)
                break
            except Exception:  # noqa: BLE001
                continue
    return _ADAPTERS[key]


# --- the arguments of fxtrain's own targets (transforms, schedules, models, data, tasks, loggers), by name -------
# An int is a float's value (weight_decay=0); a target's other arguments are checked against its annotations.
Moment = Annotated[float, Field(ge=0, lt=1)]
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Multiple = Annotated[float, Field(ge=0, description="a multiple of the optimizer's learning_rate")]
Sizes = Annotated[list[Count], Field(min_length=1)]
Names = Union[Name, Annotated[list[Name], Field(min_length=1)]]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]


class TargetNode(BaseModel):
    """A ``_target_`` node: your function (``_target_: mylib.pipeline``) and its arguments."""

    model_config = ConfigDict(extra="allow", strict=True)

    target: str = Field(alias="_target_", description="the dotted path of the function")


ARGS: dict[str, Any] = {
    # transforms and optimizers; the sign of learning_rate and step_size is the descent check's
    "learning_rate": float, "step_size": float, "b1": Moment, "b2": Moment, "decay": Moment, "rho": Moment,
    "momentum": Optional[Moment], "eps": NonNegative, "eps_root": NonNegative, "weight_decay": NonNegative,
    "initial_accumulator_value": NonNegative, "max_norm": Positive, "max_delta": Positive,
    "nesterov": bool, "centered": bool, "flip_sign": bool,
    # schedules: multiples of the optimizer's learning_rate
    "value": Multiple, "init_value": Multiple, "peak_value": Multiple, "end_value": Multiple,
    "alpha": Annotated[float, Field(ge=0, le=1)], "exponent": Positive, "power": Positive,
    "warmup_steps": Annotated[int, Field(ge=0, le=MAX_COUNT)], "decay_steps": Count, "transition_steps": Count,
    "decay_rate": NonNegative,
    # models
    "input_shape": Sizes, "hidden": list[Count], "blocks": Sizes, "num_classes": Count, "width": Count,
    "vocab_size": Count, "d_model": Count, "n_layers": Count, "n_heads": Count, "experts": Count, "top_k": Count,
    "activation": Literal["relu", "gelu", "tanh", "silu"],
    # data (data.batch_size and the others of fxtrain.build.DATA_KEYS whatever the target)
    "batch_size": Annotated[int, Field(ge=1, le=MAX_COUNT, description="examples per step")],
    "num_examples": Annotated[int, Field(ge=2, le=MAX_COUNT, description="examples generated")],
    "context": Annotated[int, Field(ge=1, le=MAX_COUNT, description="tokens per window")],
    "max_bytes": Annotated[int, Field(ge=1, le=MAX_COUNT, description="bytes of text")],
    "eval_windows": Annotated[int, Field(ge=1, le=MAX_COUNT, description="held-out windows evaluated")],
    "test_batches": Count, "noise": NonNegative,
    "test_fraction": Annotated[float, Field(gt=0, lt=1, description="the share held out for evaluation")],
    "val_fraction": Annotated[float, Field(ge=0, lt=1, description="the share held out for validation")],
    # data formats (fxtrain/sources.py); their Literal choices (order, dtype, builder) are the annotations'
    "dir": Name, "path": Name, "train_file": Name, "val_file": Optional[Name], "test_file": Optional[Name],
    "from_disk": Optional[Name], "cache_dir": Optional[Name],
    "data_files": Optional[Union[Names, Annotated[dict[str, Names], Field(min_length=1)]]],
    "input": Names, "target": Optional[Name], "split": Name, "test_split": Optional[Name], "val_split": Optional[Name],
    "train_shards": Names, "test_shards": Names, "val_shards": Optional[Names],
    "train": TargetNode, "test": TargetNode, "val": Optional[TargetNode], "stride": Count, "eval_examples": Count,
    "read_threads": Annotated[int, Field(ge=0, le=MAX_COUNT)], "split_seed": Seed, "seed": Seed,
    # tasks and loggers
    "optimized_metric": Name, "filename": Name, "subdir": Name, "experiment": Name, "project": Name,
}


def loose(annotation: Any) -> Any:
    """``annotation`` without its bounds (``Optional[Moment]`` -> ``Optional[float]``): the type alone.

    >>> loose(Optional[Moment]) == Optional[float]
    True
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return loose(args[0])
    if origin in (Union, types.UnionType):
        return Union[tuple(loose(a) for a in args)]
    return annotation


class Unreadable:
    """A value that failed to resolve (``${trainer.max_steps}`` under ``trainer.max_steps=abc``): its error is said
    once no declared key before it is wrong."""

    def __init__(self, error: ConfigError):
        self.error = error


@functools.lru_cache(maxsize=None)
def node_models(model: type[BaseModel] = Settings, prefix: str = "") -> dict[str, type[BaseModel]]:
    """``{key: model}`` of ``model`` and its nodes (``""``, ``"trainer"``, ``"trainer.early_stopping"``...).

    >>> sorted(node_models())[:4]
    ['', 'accumulate', 'amp', 'amp.float8']
    """
    out = {prefix: model}
    for name, info in model.model_fields.items():
        for sub in _models_in(info.annotation):
            out.update(node_models(sub, f"{prefix}.{name}" if prefix else name))
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def check(values: Mapping[str, Any], model: type[BaseModel] = Settings, prefix: str = "") -> None:
    """Raises :class:`~fxtrain.errors.ConfigError` for the first wrong setting of ``values`` (the config as plain
    mappings, interpolations resolved; ``model`` at ``prefix``, the top level by default): an unknown key first
    (before any value is read), then values in the order of the fields.

    >>> check({"compile": 1}, Launcher, "hydra.launcher")
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: hydra.launcher.compile=1: expected true or false (torch.compile each group's vmapped step and evaluation)
    """
    try:
        model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(message(e, values, model, prefix)) from None


def message(error: ValidationError, values: Mapping[str, Any], model: type[BaseModel] = Settings,
            prefix: str = "") -> str:
    """The one line for pydantic's ``error`` on ``values`` (``model``'s at ``prefix``): ``key=value: expected ...
    (doc); e.g. key=example``, or for an unknown key ``key: not a setting fxtrain reads (did you mean ...?);
    <node>'s settings are ...``."""
    errors = error.errors()
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    first = unknown[0] if unknown else errors[0]
    path = _field_path(first["loc"], values)
    if not unknown:  # a union's member that went deeper (amp.loss_scale.hysteresis) names the key the user wrote
        same = [e for e in errors if _field_path(e["loc"], values)[:len(path)] == path]
        path = max((_field_path(e["loc"], values) for e in same), key=len)
    key = ".".join(map(str, (*([prefix] if prefix else []), *path)))
    value = _at(values, path)
    if isinstance(value, Unreadable):
        return str(value.error)
    if unknown:
        return unknown_key(key, model, prefix)
    parent, _, name = key.rpartition(".")
    return _expected_line(key, value, node_models(model, prefix)[parent].model_fields[name])


def unknown_key(key: str, model: type[BaseModel] = Settings, prefix: str = "") -> str | None:
    """The one line for ``key`` (dotted) when a node declared here lacks it, with the nearest name; else ``None``.

    >>> print(unknown_key("amp.polcy"))
    amp.polcy: not a setting fxtrain reads (did you mean amp.policy?); amp's settings are policy, loss_scale, float8
    >>> unknown_key("model.hiden") is None, unknown_key("trainer.max_steps") is None
    (True, True)
    """
    parent, _, name = key.rpartition(".")
    model = node_models(model, prefix).get(parent)
    if model is None or name in model.model_fields or model.model_config.get("extra") != "forbid":
        return None
    fields = [f for f in model.model_fields if f != "hydra"]
    close = nearest(name, fields)
    hint = f" (did you mean {parent + '.' if parent else ''}{close}?)" if close else ""
    where = f"{parent}'s settings" if parent else "the top-level settings"
    return f"{key}: not a setting fxtrain reads{hint}; {where} are {', '.join(fields)}"


def declared(key: str) -> bool:
    """Whether ``key`` (dotted) is a field of a node declared here that every config has (not a ``_target_`` node's
    argument, nor a key of ``debug`` or of ``amp.loss_scale``'s mapping, there only with some options).

    >>> declared("trainer.early_stopping.patience"), declared("model.hidden"), declared("debug.limit_train")
    (True, False, False)
    """
    model: Any = Settings
    for part in key.split("."):
        info = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if info is None:
            return False
        model = info.annotation
    return not (isinstance(model, type) and issubclass(model, BaseModel))


def _field_path(loc: tuple, values: Mapping[str, Any]) -> tuple:
    """``loc`` without pydantic's union tags (``('amp', 'loss_scale', 'LossScale', 'hysteresis')``): the keys."""
    path: tuple = ()
    node: Any = values
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            path, node = (*path, part), node[part]
        elif not isinstance(node, Mapping) or isinstance(part, int):
            break  # a union's tag (LossScale, float...) is skipped, a list's index ends the key
    return path or loc[:1]


def _at(values: Mapping[str, Any], path: tuple) -> Any:
    node: Any = values
    for part in path:
        node = node[part]
    return node


def _expected_line(key: str, value: Any, info: FieldInfo) -> str:
    need, bound = expected(info.annotation, info.metadata, split=True)
    need = (info.json_schema_extra or {}).get("expected", need)
    doc = "; ".join(p for p in (info.description, bound) if p)
    example = (info.examples or [info.default])[0]
    shown = f"; e.g. {key}={show(example)}" if example is not None and not _is_interpolation(example) and \
        isinstance(example, (int, float, str)) and not isinstance(example, bool) and example not in ("", 0) else ""
    return f"{key}={show(value)}: expected {need}" + (f" ({doc})" if doc else "") + shown


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def show(value: Any) -> str:
    """A value as one writes it on the command line (``null``, ``true``, ``[1,2]``, ``''``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, (dict, list, tuple)):
        return str(value).replace(" ", "")
    return str(value) if str(value) else "''"


def _pretty(n: float) -> str:
    for base, ks in ((2, range(16, 65)), (10, range(6, 31))):
        for k in ks:
            if n in (base**k, base**k - 1):
                return f"{base}**{k}" + ("-1" if n == base**k - 1 else "")
    return f"{n:g}"


def expected(annotation: Any, metadata: list | tuple = (), split: bool = False) -> Any:
    """What a value of ``annotation`` (with pydantic/annotated-types ``metadata``) is, in words; with ``split``,
    ``(kind, bound)``: the bound (``at most 2**31-1``) said apart, beside a field's doc.

    >>> expected(Optional[Count]), expected(Literal["gpipe", "1f1b"]), expected(float, [annotated_types.Ge(0)])
    ('a positive whole number (at most 2**31-1), or null', 'one of gpipe, 1f1b', 'a finite number >= 0')
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return expected(args[0], [*metadata, *_constraints(annotation.__metadata__)], split)
    if origin in (Union, types.UnionType):
        parts = [expected(a, metadata) for a in args if a is not type(None)]
        text = " or ".join(parts) + (", or null" if type(None) in args else "")
        return (text, "") if split else text
    if origin is Literal:
        text = "one of " + ", ".join(show(a) for a in args) if len(args) > 1 else show(args[0])
        return (text, "") if split else text
    lo = hi = lo_open = hi_open = None
    for m in _constraints(metadata):
        if isinstance(m, (annotated_types.Ge, annotated_types.Gt)):
            lo, lo_open = (m.ge, False) if isinstance(m, annotated_types.Ge) else (m.gt, True)
        elif isinstance(m, (annotated_types.Le, annotated_types.Lt)):
            hi, hi_open = (m.le, False) if isinstance(m, annotated_types.Le) else (m.lt, True)
    kind, bound = _words(annotation, lo, hi, lo_open, hi_open)
    if annotation is str and any(getattr(m, "pattern", None) for m in _constraints(metadata)):
        kind = "a non-blank string"
    if split:
        return kind, bound
    return f"{kind} ({bound})" if bound else kind


def _words(annotation: Any, lo: Any, hi: Any, lo_open: Any, hi_open: Any) -> tuple[str, str]:
    if annotation is bool:
        return "true or false", ""
    if annotation is int:
        kind = {None: "a whole number", 0: "a whole number >= 0", 1: "a positive whole number"}.get(
            lo, f"a whole number >= {lo}")
        return kind, f"at most {_pretty(hi)}" if hi is not None else ""
    if annotation is float:
        if lo is not None and hi is not None:
            return f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}", ""
        if lo is not None:
            return f"a finite number {'>' if lo_open else '>='} {lo:g}", ""
        return "a finite number", ""
    if annotation is str:
        return "a string", ""
    if annotation is type(None):
        return "null", ""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        keys = [info.alias or name for name, info in annotation.model_fields.items()]
        return f"a node with the keys {', '.join(keys)}" + (" and its own" if annotation.model_config.get(
            "extra") == "allow" else ""), ""
    origin, args = typing.get_origin(annotation) or annotation, typing.get_args(annotation)
    if origin is list and args:
        return f"a list, each {expected(args[0])}", ""
    return {dict: "a mapping ({key: value, ...})", list: "a list"}.get(origin, "anything"), ""


def _constraints(metadata: Any) -> list:
    """annotated-types constraints, also those inside a ``Field(...)`` of an ``Annotated``."""
    out = []
    for m in metadata:
        out.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return out


def nearest(name: str, names: list[str] | tuple[str, ...]) -> str | None:
    """The name of ``names`` closest to ``name`` (difflib), or ``None``.

    >>> nearest("max_stpes", list(Trainer.model_fields))
    'max_steps'
    """
    close = difflib.get_close_matches(str(name), list(names), n=1)
    return close[0] if close else None


def describe() -> str:
    """Every declared setting as ``key: type = default  doc``, node by node: the text ``--help`` prints.

    >>> print(describe().splitlines()[1])
      seed: a whole number >= 0 (at most 2**64-1) = 0  params init and batch order
    """
    lines = []
    nodes = {**node_models(), **node_models(Launcher, "hydra.launcher"), "logger.wandb.settings": WandbSettings}
    for key, model in nodes.items():
        lines.append(f"== {key or 'top level'} == {model.__doc__.splitlines()[0]}")
        for name, info in model.model_fields.items():
            members = [a for a in typing.get_args(info.annotation) or (info.annotation,) if a is not type(None)]
            if name == "hydra" or all(m in _models_in(info.annotation) for m in members):
                continue  # a node: its own section
            need = (info.json_schema_extra or {}).get("expected") or expected(info.annotation, info.metadata)
            lines.append(f"  {info.alias or name}: {need} = {show(info.default)}  {info.description}")
    lines.append("== the arguments of fxtrain's own targets (optim.chain.*, schedule, model, data...), by name ==")
    lines += [f"  {name}: {expected(kind)}" for name, kind in ARGS.items()]
    return "\n".join(lines)


def _help() -> str:
    return describe().replace("$", "$$")  # the help template is a string.Template


OmegaConf.register_new_resolver("fxtrain.settings_help", _help, replace=True)
