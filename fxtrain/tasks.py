"""What a run optimizes and measures: the ``task`` config group (classification, regression, lm, or yours).

A :class:`Task` is a loss and metrics over a model's outputs and the batch's targets:

* ``loss(outputs, targets) -> 0-dim tensor``: the mean over the batch's examples; the step differentiates it.
* ``metrics(outputs, targets) -> {name: 0-dim tensor}``: batch means, logged with the loss in training,
  averaged over the validation split as ``val_<name>`` (with ``val_loss``) at every evaluation, and over the
  test split as ``test_<name>`` (with ``test_loss``) once, at the end, on the checkpoint ``trainer.test_ckpt``
  names (:func:`split_metrics`).
* ``optimized_metric``: what a run returns to a sweeper unless the config says otherwise
  (``optimized_metric`` in ``conf/train.yaml`` follows the task's).

The runner calls them on plain tensors (a tensor-parallel head's logits are gathered first) inside the
pure step, so they must be written with torch ops and no host syncs (``.item()``), as any loss under
``torch.func``. Bring your own with a config such as::

    # conf/task/huber.yaml in your --config-dir
    _target_: fxtrain.tasks.Task
    loss: mylib.losses.huber          # a dotted path, or a nested _target_ that returns the function
    metrics: mylib.losses.abs_error   # optional: returns {"mae": ...}
    optimized_metric: val_mae

or a ``_target_`` to a function of yours that returns a :class:`Task`.

:func:`evaluate` runs a task over a held-out split in chunks; :class:`EarlyStopping` follows any logged
metric (``trainer.early_stopping``); ``trainer.eval_hooks`` adds metrics of your own at every evaluation
(:class:`EvalContext`).

Example:
    >>> import torch
    >>> task = regression()
    >>> out, y = torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0])
    >>> float(task.loss(out, y)), {k: float(v) for k, v in task.metrics(out, y).items()}
    (2.5, {'mae': 1.5})
    >>> task.compute(out, y)[0].shape   # the loss the step differentiates, checked to be a scalar
    torch.Size([])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from fxtrain.errors import ConfigError

__all__ = ["Task", "classification", "regression", "lm", "evaluate", "EvalContext", "EarlyStopping"]

Metrics = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def _callable(value: Any, what: str) -> Callable | None:
    """``value`` as a function: a callable, or a dotted path (``mylib.losses.huber``) located with Hydra's utility."""
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        from hydra.utils import get_method

        try:
            return get_method(value)
        except Exception as e:  # Hydra raises ImportError or ValueError with the reason
            raise ValueError(f"{what}={value}: cannot import it ({str(e).splitlines()[0]})") from None
    raise ValueError(f"{what}={value!r}: expected a function or a dotted path to one (mylib.losses.huber)")


@dataclasses.dataclass(frozen=True)
class Task:
    """A loss and metrics over ``(outputs, targets)`` (see the module doc).

    Args:
      loss: ``loss(outputs, targets) -> 0-dim tensor``, the mean over the batch; a function or a dotted path.
      metrics: ``metrics(outputs, targets) -> {name: 0-dim tensor}`` (batch means), or ``None``.
      optimized_metric: the metric sweepers optimize by default (``val_loss``, ``val_<metric>``...).
      name: for messages and the run's ``task`` line; defaults to the loss function's name.
      metric_names: the names ``metrics`` returns (``("mae",)``), or ``None`` when not declared. Declared,
        ``optimized_metric`` and ``trainer.early_stopping.metric`` are checked against them (and the step's
        metrics) before a run starts; the built-in tasks declare theirs.

    >>> Task(loss="torch.nn.functional.l1_loss").name
    'l1_loss'
    """

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | str
    metrics: Metrics | str | None = None
    optimized_metric: str = "val_loss"
    name: str | None = None
    metric_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        loss = _callable(self.loss, "task.loss")
        if loss is None:
            raise ValueError("task.loss: a task needs a loss function")
        object.__setattr__(self, "loss", loss)
        object.__setattr__(self, "metrics", _callable(self.metrics, "task.metrics"))
        if self.name is None:
            object.__setattr__(self, "name", getattr(loss, "__name__", type(loss).__name__))
        if self.metric_names is not None:
            names = [self.metric_names] if isinstance(self.metric_names, str) else list(self.metric_names)
            if not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"task.metric_names={self.metric_names!r}: expected a list of metric names")
            object.__setattr__(self, "metric_names", tuple(names))
        if not (isinstance(self.optimized_metric, str) and self.optimized_metric):
            raise ValueError(f"task.optimized_metric={self.optimized_metric!r}: expected a metric name, e.g. val_loss")

    def compute(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)`` of one batch; raises :class:`~fxtrain.errors.ConfigError` naming the task and the
        shape if the loss is not a scalar.

        The check reads shapes only (no host sync), so it holds under ``vmap`` and ``torch.compile``.
        A model output that is not a tensor but carries ``logits`` (a Hugging Face ``transformers``
        ``ModelOutput``, e.g. ``GPT2LMHeadModel``'s) is scored by its logits.
        """
        if not isinstance(outputs, torch.Tensor) and isinstance(getattr(outputs, "logits", None), torch.Tensor):
            outputs = outputs.logits
        loss = self.loss(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(f"task={self.name}: its loss returned {shape} for outputs {tuple(outputs.shape)} and "
                             f"targets {tuple(targets.shape)}; a loss must be a 0-dim tensor, the mean over the "
                             "batch (reduce it, e.g. .mean())")
        metrics = self.metrics(outputs, targets) if self.metrics is not None else {}
        return loss, metrics

    def __repr__(self) -> str:
        return f"{self.name}, optimizes {self.optimized_metric}"


# --- the built-in tasks (conf/task/*.yaml) -------------------------------------------------------------

def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Classifier logits (B, C) or LM logits (B, T, V): one cross-entropy over the last dim, in float32 at least.
    if targets.is_floating_point():
        raise ConfigError(f"task=classification/lm: cross-entropy needs integer class targets, got {targets.dtype}; "
                          "for real-valued targets use task=regression")
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _accuracy(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (logits.argmax(-1) == targets).float().mean()}


def _like(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``outputs`` in ``targets``' shape when they hold one value per target ((B, 1) against (B,))."""
    if outputs.shape == targets.shape:
        return outputs
    if outputs.numel() != targets.numel():
        raise ConfigError(f"task=regression: outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} hold "
                          "different numbers of values; the model needs one output per target value "
                          "(e.g. num_classes: 1 for one target per example)")
    return outputs.reshape(targets.shape)


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(_like(outputs, targets).float(), targets.float())


def _mae(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"mae": (_like(outputs, targets).float() - targets.float()).abs().mean()}


def classification(optimized_metric: str = "val_accuracy") -> Task:
    """Cross-entropy on class logits ``(B, C)`` against integer targets ``(B,)``; metric ``accuracy``.

    >>> import torch
    >>> classification().compute(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0]))[1]["accuracy"]
    tensor(0.5000)
    """
    return Task(_cross_entropy, _accuracy, optimized_metric, name="classification", metric_names=("accuracy",))


def regression(optimized_metric: str = "val_loss") -> Task:
    """Mean squared error against real-valued targets (outputs ``(B, 1)`` match targets ``(B,)``); metric ``mae``.

    >>> import torch
    >>> float(regression().loss(torch.tensor([[1.0], [2.0]]), torch.tensor([1.0, 0.0])))
    2.0
    """
    return Task(_mse, _mae, optimized_metric, name="regression", metric_names=("mae",))


def lm(optimized_metric: str = "val_loss") -> Task:
    """Next-token cross-entropy on logits ``(B, T, V)`` against token ids ``(B, T)``; metric ``accuracy``
    (next-token). ``exp(test_loss)`` is the perplexity.

    >>> import torch
    >>> round(float(lm().loss(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]))), 4)   # log(4): uniform over 4
    1.3863
    """
    return Task(_cross_entropy, _accuracy, optimized_metric, name="lm", metric_names=("accuracy",))


# --- evaluation ------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(task: Task, forward: Callable[[torch.Tensor], torch.Tensor], test: tuple[torch.Tensor, torch.Tensor],
             batch_size: int) -> dict[str, float]:
    """``test_loss`` and ``test_<metric>`` of ``task`` over the whole split ``test``, in chunks of ``batch_size``.

    Each chunk's means are weighted by its number of examples (dim 0), so the result is the split's mean
    whatever the chunking; one host sync at the end.

    >>> import torch
    >>> x, y = torch.arange(5.0)[:, None], torch.arange(5.0)
    >>> evaluate(regression(), lambda xb: xb + 1, (x, y), batch_size=2)
    {'test_loss': 1.0, 'test_mae': 1.0}
    """
    x, y = test
    totals: dict[str, torch.Tensor] = {}
    for j in range(0, len(x), batch_size):
        yb = y[j:j + batch_size]
        loss, metrics = task.compute(forward(x[j:j + batch_size]), yb)
        for name, value in {"loss": loss, **metrics}.items():
            part = value.detach().double() * len(yb)
            totals[name] = totals[name] + part if name in totals else part
    values = torch.stack(list(totals.values())).div(len(y)).tolist()
    return {f"test_{name}": value for name, value in zip(totals, values)}


SPLITS = ("val", "test")  # the held-out splits: validation (every evaluation), test (once, at the end)
TEST_CKPTS = ("best", "last")  # what trainer.test_ckpt may name: the best step by trainer.checkpoint.best_by, or the last


def split_metrics(metrics: dict[str, float], split: str) -> dict[str, float]:
    """:func:`evaluate`'s ``test_*`` metrics named for the split they were computed on (``val_loss``...).

    >>> split_metrics({"test_loss": 0.5, "test_accuracy": 0.9}, "val")
    {'val_loss': 0.5, 'val_accuracy': 0.9}
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    return {f"{split}_{k.removeprefix('test_')}" if k.startswith("test_") else k: v for k, v in metrics.items()}


def reads_test(metric: str | None) -> bool:
    """Whether ``metric`` is a test-split metric (``test_*``), which exists only once training ended.

    >>> reads_test("test_accuracy"), reads_test("val_accuracy"), reads_test(None)
    (True, False, False)
    """
    return isinstance(metric, str) and metric.startswith("test_")


class EvalContext(NamedTuple):
    """What an evaluation hook (``trainer.eval_hooks``) is called with, at every evaluation.

    A hook is ``hook(ctx, **its config keys) -> {name: float}``; the names join the evaluation's metrics
    (``metrics.jsonl``, loggers, early stopping, ``optimized_metric``).
    """

    step: int
    forward: Callable[[torch.Tensor], torch.Tensor]  #: ``forward(x) -> outputs`` in eval mode, the current params
    params: Any
    buffers: Any
    data: Any  #: the run's :class:`fxtrain.data.Dataset` (``data.validation``: the split evaluations read)
    task: Task
    batch_size: int  #: ``trainer.eval_batch_size``


# --- early stopping -----------------------------------------------------------------------------

# Words of a metric's name that make lower better, besides "loss" and "error" (val_mae, val_rmse, test_ppl).
_LOWER_IS_BETTER = {"err", "mae", "mse", "rmse", "nll", "perplexity", "ppl", "regret"}


def lower_is_better(metric: str) -> bool:
    """Whether a lower ``metric`` is better: losses and errors (``test_loss``, ``test_mae``, a perplexity...).

    The one rule behind early stopping's ``mode=auto`` and every ranking (:func:`fxtrain.report.best`).

    >>> [lower_is_better(m) for m in ("test_loss", "val_mae", "test_ppl", "test_accuracy")]
    [True, True, True, False]
    """
    name = metric.lower()
    return "loss" in name or "error" in name or bool(_LOWER_IS_BETTER & set(name.split("_")))


class EarlyStopping:
    """Stops a run when ``metric`` has not improved by more than ``min_delta`` for ``patience`` logged values.

    Any metric a run logs can be followed (train or test, or an eval hook's); it is read each time a
    ``metrics.jsonl`` line holds it. ``mode`` ``min``, ``max`` or ``auto`` (``min`` where
    :func:`lower_is_better`, else ``max``). :meth:`replay` rebuilds the state from the logged lines, so a
    resumed run stops where the uninterrupted one would.

    >>> stop = EarlyStopping("val_loss", patience=2)
    >>> [stop.update({"val_loss": v}) for v in (1.0, 0.5, 0.6, 0.55)]
    [False, False, False, True]
    >>> stop.best, stop.best_step
    (0.5, None)
    """

    def __init__(self, metric: str, patience: int = 5, mode: str = "auto", min_delta: float = 0.0):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"trainer.early_stopping.mode={mode!r}: expected auto, min or max")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"trainer.early_stopping.patience={patience!r}: expected a whole number >= 1 "
                             "(logged values without improvement before stopping)")
        if not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"trainer.early_stopping.min_delta={min_delta!r}: expected a number >= 0")
        self.metric, self.patience, self.min_delta = metric, patience, float(min_delta)
        self.lower = lower_is_better(metric) if mode == "auto" else mode == "min"
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0  # logged values since the best

    def update(self, record: dict[str, float], step: int | None = None) -> bool:
        """Reads ``record`` (one logged line); ``True`` when the run should stop here."""
        if self.metric not in record:
            return False
        value = float(record[self.metric])
        better = self.best is None or (value < self.best - self.min_delta if self.lower
                                       else value > self.best + self.min_delta)
        if better and math.isfinite(value):
            self.best, self.best_step, self.bad = value, step, 0
        else:
            self.bad += 1
        return self.bad >= self.patience

    def replay(self, records: list[dict]) -> None:
        """Feeds the lines a resumed run logged before its checkpoint (``metrics.jsonl``, in order)."""
        for record in records:
            self.update(record, record.get("step"))

    def describe(self) -> dict[str, Any]:
        """What ``summary.json`` records of a stop: the metric, its best value and step, the patience."""
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "patience": self.patience}
