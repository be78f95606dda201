"""Settings checked before a run writes anything, and the errors a user reads as one line.

* :func:`check` reads every ``trainer``, ``data`` and ``optim`` setting (and ``seed``, ``schedule``) of a
  composed config and raises :class:`fxtrain.build.ConfigError` at the first bad one, with a message that
  names the key and the value as written, says why, and what to do::

      trainer.max_steps=abc: expected a positive whole number (optimizer steps, counted in batches); e.g. trainer.max_steps=1000

  The optimizer entries get the library's own checks (each factory is called with the config's values, so
  ``optim.chain.adamw.learning_rate=-1`` is refused exactly as ``fx.adamw(-1)`` is), and a chain must
  descend: one entry at least takes a ``learning_rate`` (an optimizer: ``sgd``, ``adamw``...). A chain
  without one (``[clip_by_global_norm]``, ``[add_decayed_weights]``) moves the params along the gradient
  or only decays them; it runs only with ``trainer.allow_no_descent=true``.
* :func:`one_line_errors` is how ``python -m fxtrain.train`` reports them: a :class:`~fxtrain.build.ConfigError`
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
    fxtrain.build.ConfigError: trainer.log_every=0: expected a positive whole number (steps between metrics.jsonl lines); e.g. trainer.log_every=10
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import os
from typing import Any, Iterator

import torch
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fxtrain import build, distributed
from fxtrain.build import ConfigError

__all__ = ["check", "one_line_errors", "message", "DiskFull"]

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


def check(cfg: DictConfig) -> None:
    """Raises :class:`~fxtrain.build.ConfigError` naming the first bad setting of ``cfg`` (see the module doc)."""
    for key, smallest, what, example in _TRAINER_COUNTS:  # max_steps first: the defaults of the others follow it
        _whole(cfg, key, smallest, what, example)
    _whole(cfg, "seed", None, "params init and batch order", 0)
    _optional_whole(cfg, "trainer.cpu_threads", "torch CPU threads; null: torch's default")
    for key in ("trainer.progress", "trainer.allow_no_descent"):
        _flag(cfg, key)
    _device(cfg)
    _data(cfg)
    _optim(cfg)
    _schedule(cfg)
    build.task(cfg)            # the task's loss and metrics import
    build.eval_hooks(cfg)      # each hook's _target_ and keys
    build.early_stopping(cfg)  # patience, mode, min_delta


# --- one setting at a time ----------------------------------------------------------------------------

def _value(cfg: DictConfig, key: str, default: Any = None) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=default)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: {build._omegaconf_message(e)}") from None


def _show(value: Any) -> str:
    """A value as one writes it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (DictConfig, dict, list)) or OmegaConf.is_config(value):
        return str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value).replace(" ", "")
    return str(value) if str(value) else "''"


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(cfg: DictConfig, key: str, smallest: int | None, what: str, example: Any) -> None:
    value = _value(cfg, key)
    if _is_whole(value) and (smallest is None or value >= smallest):
        return
    need = {None: "a whole number", 0: "a whole number >= 0", 1: "a positive whole number"}[smallest]
    raise ConfigError(f"{key}={_show(value)}: expected {need} ({what}); e.g. {key}={example}")


def _optional_whole(cfg: DictConfig, key: str, what: str) -> None:
    value = _value(cfg, key)
    if value is not None and not (_is_whole(value) and value >= 1):
        raise ConfigError(f"{key}={_show(value)}: expected a positive whole number or null ({what}); e.g. {key}=1")


def _flag(cfg: DictConfig, key: str) -> None:
    value = _value(cfg, key, default=False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={_show(value)}: expected true or false")


def _device(cfg: DictConfig) -> None:
    name = _value(cfg, "trainer.device")
    if name == "auto":
        return
    try:
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


def _data(cfg: DictConfig) -> None:
    node = _value(cfg, "data")
    if not isinstance(node, DictConfig):
        raise ConfigError(f"data={_show(node)}: expected a data config; pick one with data=digits (conf/data)")
    for name, smallest, what, example in _DATA_COUNTS:
        if name in node:
            _whole(cfg, f"data.{name}", smallest, what, example)
    if "test_fraction" in node:
        value = _value(cfg, "data.test_fraction")
        if not (_is_number(value) and 0 < value < 1):
            raise ConfigError(f"data.test_fraction={_show(value)}: expected a number between 0 and 1 (the share "
                              "held out for evaluation); e.g. data.test_fraction=0.25")


# --- the optimizer ----------------------------------------------------------------------------------

def _optim(cfg: DictConfig) -> None:
    chain = _value(cfg, "optim.chain")
    # An entry without _target_ is a setting left for a transform the chain does not list (an experiment's
    # optim.chain.adamw.learning_rate after optim/transform@optim.chain=[sgd]).
    names = [n for n in chain if "_target_" in chain[n]] if isinstance(chain, DictConfig) else []
    if not names:
        raise ConfigError("optim.chain=[]: no transform, so nothing would update the params; pick some, e.g. "
                          "'optim/transform@optim.chain=[clip_by_global_norm,adamw]'")
    for name in chain:
        if name not in names:
            raise ConfigError(f"optim.chain.{name}={_show(chain[name])}: {name} is not in the chain "
                              f"(optim/transform@optim.chain=[{','.join(names)}]); add it there, or remove the "
                              f"setting with '~optim.chain.{name}'")
    descends = False
    for name in names:
        key = f"optim.chain.{name}"
        factory, kwargs = build.target(chain[name], key)  # keys checked against the factory's signature
        takes_lr = "learning_rate" in _arguments(factory)
        if takes_lr:
            lr = kwargs.get("learning_rate")
            if not _is_number(lr):
                # fx.adam(None) leaves the updates unscaled: params would move by +1 along Adam's direction.
                raise ConfigError(f"{key}.learning_rate={_show(lr)}: expected a number >= 0 (the schedule's peak); "
                                  f"e.g. {key}.learning_rate=1e-3")
            descends = descends or kwargs.get("flip_sign", True) is not False
        try:
            factory(**kwargs)  # the library's own checks (signs, ranges), on the config's plain values
        except (TypeError, ValueError) as e:
            raise ConfigError(_library_message(key, kwargs, e)) from None
    if not descends and not _value(cfg, "trainer.allow_no_descent", default=False):
        raise ConfigError(f"optim.chain=[{','.join(names)}]: no entry takes a learning_rate, so nothing steps against "
                          "the gradient (the params would move along it, or only decay); add an optimizer "
                          f"('optim/transform@optim.chain=[{','.join(names)},sgd]'), or pass "
                          "trainer.allow_no_descent=true if that is what you want")


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
    shape = build.instantiate(node, "schedule")
    for step in sorted({0, 1, max_steps // 2, max_steps - 1, max_steps}):
        multiple = float(shape(step))
        if multiple < 0:
            raise ConfigError(f"schedule: the learning-rate multiple at step {step} is {multiple:g} (< 0), which "
                              "would climb the loss; change the schedule's values")


# --- errors a user reads ----------------------------------------------------------------------------

class DiskFull(CompactHydraException, OSError):
    """A full disk, reported by a job of a multirun as its one line."""


def message(error: BaseException) -> str | None:
    """The one line to print for ``error``, or ``None`` for an unexpected exception (it keeps its traceback).

    A :class:`~fxtrain.build.ConfigError` is its message; a full disk (``ENOSPC`` anywhere in the chain of
    causes: torch.save reports it as a ``RuntimeError``) says where and what to do.
    """
    if isinstance(error, ConfigError):
        return str(error)
    seen: BaseException | None = error
    while seen is not None:
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or "No space left on device" in str(seen):
            where = f" writing {seen.filename}" if isinstance(seen, OSError) and seen.filename else ""
            return (f"no space left on the device{where}: the run stopped, its complete checkpoints are intact; free "
                    "some space and relaunch with resume=auto, or write elsewhere (hydra.run.dir=...)")
        seen = seen.__cause__ or seen.__context__
    return None


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
