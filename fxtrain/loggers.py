"""Metric loggers for the training script (the Hydra ``logger`` group): several at once, real libraries.

``'logger=[jsonl,tensorboard,csv]'`` picks any of ``conf/logger/*.yaml`` (each file is one named entry of
``cfg.logger``); :func:`open_loggers` builds them all as one :class:`Loggers`, which the training loop logs to
and closes however the loop ends. Only rank 0 opens loggers.

========================  =============================================  ======================
``logger=``               writes, under the run directory                needs
========================  =============================================  ======================
``jsonl``                 ``metrics.jsonl``: always written (below)      nothing
``csv``                   ``metrics.csv``: one column per metric         nothing
``tensorboard``           ``tensorboard/events.out.tfevents.*``          ``fxtrain[tensorboard]``
``wandb``                 ``wandb/offline-run-*`` (``mode: offline``)    ``fxtrain[wandb]``
``mlflow``                ``mlflow.db`` (a local SQLite store)           ``fxtrain[mlflow]``
========================  =============================================  ======================

``metrics.jsonl`` is the run's record: the report, the plots, ``resume`` and :mod:`fxtrain.rundir` read it, so
:func:`open_loggers` always writes it, whatever the list says. A logger is a class built with its config keys and
the keyword arguments ``dir`` (the run directory), ``start`` (the step training starts from: a resumed run's
later steps on disk are superseded) and ``config`` (the run's resolved config as a dict); it has
``log(step, metrics)`` (a dict of Python floats, non-finite ones included) and ``close()``. Your own class
works the same way (``+logger.mine._target_=mylib.MyLogger``, or a ``conf/logger/mine.yaml`` of your own).

The end-of-run test metrics (``test_loss``, ``test_<metric>``: the test split evaluated once, on the checkpoint
``trainer.test_ckpt`` names) are logged last, at the run's last step (``summary.json``'s ``step``), whichever
step that checkpoint is from (``summary.json``'s ``best_step`` says). That step was logged already: the
file loggers add them to its line (``metrics.jsonl`` and ``metrics.csv`` hold each step once), TensorBoard,
wandb and MLflow record them at that step.

Example:
    >>> import tempfile
    >>> from fxtrain.loggers import open_loggers
    >>> d = tempfile.mkdtemp()
    >>> node = {"csv": {"_target_": "fxtrain.loggers.CsvLogger"}}
    >>> with open_loggers(node, d) as loggers:
    ...     loggers.log(10, {"loss": 0.5, "learning_rate": 1e-3})
    >>> loggers
    Loggers(metrics.jsonl, csv)
    >>> print(loggers.loggers["metrics.jsonl"].path.read_text(), end="")
    {"step": 10, "loss": 0.5, "learning_rate": 0.001}
    >>> print(loggers.loggers["csv"].path.read_text(), end="")
    step,loss,learning_rate
    10,0.5,0.001
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import json
import os
import pathlib
import time
import warnings
from typing import Any, Literal, Mapping

from fxtrain.errors import ConfigError
from fxtrain import build, extras

__all__ = ["RECORD", "open_loggers", "Loggers", "JsonlLogger", "CsvLogger", "TensorBoardLogger", "WandbLogger",
           "MlflowLogger", "mlflow_file_store"]

RECORD = "metrics.jsonl"  # the run's record, in the run directory: always written


def open_loggers(node: Mapping | None, dir: str | os.PathLike, *, start: int = 0,
                 config: dict | None = None) -> "Loggers":
    """Builds every logger of ``node`` (``cfg.logger``: name -> ``_target_`` node) for the run directory ``dir``.

    Each is built with :func:`fxtrain.build.instantiate` (keys checked, errors name ``logger.<name>``) and
    ``dir``, ``start`` and ``config``. A :class:`JsonlLogger` writing ``dir/metrics.jsonl`` comes first,
    the user's ``jsonl`` entry or one added when the list leaves it out: the record is always written, once.
    If one logger fails to build, those built already are closed.

    Args:
      node: ``cfg.logger``, a DictConfig or dict of named ``_target_`` nodes; ``None`` or empty: the record only.
      dir: the run directory.
      start: the step training (re)starts from (``resume``): loggers that keep a history drop later steps.
      config: the resolved run config as a plain dict (wandb's config, MLflow's params).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> open_loggers(None, d).close()
    >>> two = {"jsonl": {"_target_": "fxtrain.loggers.JsonlLogger"}, "copy": {"_target_": "fxtrain.loggers.JsonlLogger"}}
    >>> open_loggers(two, d)
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: logger.jsonl and logger.copy both write .../metrics.jsonl: keep one
    """
    node = node or {}
    if "_target_" in node:  # a pre-multi-select config: logger: {_target_: ...}
        raise ConfigError(f"logger: expected named loggers ({{jsonl: {{_target_: ...}}, csv: ...}}, what "
                                f"'logger=[jsonl,csv]' composes), got one _target_ node ({node['_target_']}): put it "
                                "under a name, logger.<name>._target_")
    built: dict[str, Any] = {}
    try:
        for name, sub in node.items():
            built[name] = build.instantiate(sub, f"logger.{name}", dir=dir, start=start, config=config)
        writers: dict[pathlib.Path, str] = {}
        for name, logger in built.items():
            if isinstance(logger, JsonlLogger):
                other = writers.setdefault(logger.path.resolve(), name)
                if other != name:
                    raise ConfigError(f"logger.{other} and logger.{name} both write {logger.path}: keep one")
        record = writers.get((pathlib.Path(dir) / RECORD).resolve())
        if record is None:
            record, built[RECORD] = RECORD, JsonlLogger(dir)
    except BaseException:
        Loggers(built).close()
        raise
    return Loggers({record: built.pop(record), **built})


class Loggers:
    """Several loggers as one: ``log`` goes to each in order, ``close`` closes all even if one raises.

    Args:
      loggers: name -> logger (``log(step, metrics)``, ``close()``), in the order they log.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with Loggers({"jsonl": JsonlLogger(d), "csv": CsvLogger(d)}) as both:
    ...     both.log(1, {"loss": float("nan")})
    >>> print(both.loggers["csv"].path.read_text(), end="")
    step,loss
    1,nan
    """

    def __init__(self, loggers: dict[str, Any]):
        self.loggers = loggers

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for logger in self.loggers.values():
            logger.log(step, metrics)

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # runs every close, then raises the first failure
            for logger in reversed(self.loggers.values()):
                stack.callback(logger.close)

    def __enter__(self) -> "Loggers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Loggers({', '.join(self.loggers)})"


class _FileLogger:
    """What every logger shares: a context manager that closes it, and a repr naming where it writes (``path``)."""

    path: pathlib.Path

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


class JsonlLogger(_FileLogger):
    """Appends one JSON object per logged step to ``dir/filename``, flushed at once.

    Every line written survives a crash or a NaN stop. Non-finite values are written as JSON's
    ``NaN``/``Infinity`` extensions (Python's ``json`` reads them back). A log at the step of the file's last
    line adds its metrics to that line (rewritten atomically): the file holds each step once (the runner's
    end-of-run ``test_*`` join the last step's line).

    Args:
      dir: the run directory.
      filename: name of the file in ``dir``.
      start, config: unused: :func:`fxtrain.rundir.rewind` cuts ``metrics.jsonl`` back to ``start``.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with JsonlLogger(d) as logger:
    ...     logger.log(10, {"loss": 0.5, "learning_rate": 1e-3})
    ...     logger.log(10, {"test_loss": 0.75})
    >>> print(logger.path.read_text(), end="")
    {"step": 10, "loss": 0.5, "learning_rate": 0.001, "test_loss": 0.75}
    """

    def __init__(self, dir: str | os.PathLike, filename: str = RECORD, *, start: int = 0,
                 config: dict | None = None):
        del start, config
        self.path = pathlib.Path(dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        lines = self._lines()
        self._last_step = json.loads(lines[-1]).get("step") if lines else None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step == self._last_step:
            lines = self._lines()
            lines[-1] = json.dumps({**json.loads(lines[-1]), **metrics})
            self._file.close()
            _replace(self.path, "".join(line + "\n" for line in lines))
            self._file = open(self.path, "a", encoding="utf-8")
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        self._last_step = step

    def _lines(self) -> list[str]:
        """The file's complete lines (a line without its newline is one a killed run was writing)."""
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        return [line for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]

    def close(self) -> None:
        self._file.close()


def _replace(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically: a temporary file beside it, synced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)



class CsvLogger(_FileLogger):
    """A wide CSV, ``dir/filename``: a ``step`` column, then one column per metric in the order they appear.

    Rows are appended and flushed. A metric seen for the first time (the eval ones, a few steps in) widens
    the header: the file is rewritten with the extra column, earlier rows empty there, and replaced
    atomically. A log at the step of the last row fills that row (each step has one row). At ``start`` (a
    resumed run) rows after ``start`` and a half-written last line are dropped.

    Args:
      dir: the run directory.
      filename: name of the file in ``dir``.
      start: the step training starts from.
      config: unused.

    >>> import csv, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with CsvLogger(d) as logger:
    ...     logger.log(1, {"loss": 2.0})
    ...     logger.log(2, {"loss": 1.5, "test_loss": 1.75})
    >>> print(logger.path.read_text(), end="")
    step,loss,test_loss
    1,2.0,
    2,1.5,1.75
    >>> CsvLogger(d, start=1).close()  # resumed at step 1
    >>> list(csv.DictReader(logger.path.read_text().splitlines()))
    [{'step': '1', 'loss': '2.0', 'test_loss': ''}]
    """

    def __init__(self, dir: str | os.PathLike, filename: str = "metrics.csv", *, start: int = 0,
                 config: dict | None = None):
        del config
        self.path = pathlib.Path(dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None
        columns, rows = self._read()
        self._rewrite(columns, [row for row in rows if int(row["step"]) <= start])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        new = [k for k in metrics if k not in self._columns]
        if step == self._last_step:
            rows = self._read()[1]
            rows[-1].update(metrics)
            self._rewrite(self._columns + new, rows)
            return
        if new:
            self._rewrite(self._columns + new, self._read()[1])
        self._writer.writerow({"step": step, **metrics})
        self._file.flush()
        self._last_step = step

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        text = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        text = text[:text.rfind("\n") + 1]  # a line without its newline is one a killed run was writing
        reader = csv.DictReader(text.splitlines())
        rows = list(reader)
        return list(reader.fieldnames or ["step"]), rows

    def _rewrite(self, columns: list[str], rows: list[dict[str, Any]]) -> None:
        if self._file is not None:
            self._file.close()
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
        _replace(self.path, text.getvalue())
        self._columns, self._last_step = columns, int(rows[-1]["step"]) if rows else None
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, columns, restval="")

    def close(self) -> None:
        self._file.close()



class TensorBoardLogger(_FileLogger):
    """TensorBoard event files in ``dir/subdir``: one scalar series per metric name, flushed at every log.

    Written with ``torch.utils.tensorboard.SummaryWriter``; ``tensorboard --logdir outputs`` shows every run.
    A run resumed at ``start`` writes a new event file that purges the steps after ``start`` that an earlier
    launch wrote (``purge_step``), so TensorBoard shows each step once.

    Args:
      dir: the run directory.
      subdir: the event files' directory inside ``dir``.
      start: the step training starts from.
      config: unused.

    >>> import tempfile
    >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    >>> d = tempfile.mkdtemp()
    >>> with TensorBoardLogger(d) as logger:
    ...     logger.log(5, {"loss": 0.5})
    >>> events = EventAccumulator(str(logger.path)); _ = events.Reload()
    >>> [(e.step, e.value) for e in events.Scalars("loss")]
    [(5, 0.5)]
    """

    def __init__(self, dir: str | os.PathLike, subdir: str = "tensorboard", *, start: int = 0,
                 config: dict | None = None):
        del config
        extras.require("tensorboard", "logger=tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.path = pathlib.Path(dir) / subdir
        # TensorBoard hides the events at steps >= purge_step written before this file (by a launch killed
        # after its last checkpoint): the resumed run's steps replace them.
        self._writer = SummaryWriter(str(self.path), purge_step=start + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()



class WandbLogger(_FileLogger):
    """A Weights & Biases run, offline by default: its files go to ``dir/wandb/offline-run-*``, nothing is sent.

    ``wandb sync <dir>/wandb/offline-run-*`` uploads an offline run later. Each launch is its own wandb run
    (a resumed one's history starts after ``start``). The run's config is wandb's config.

    Args:
      dir: the run directory.
      project: the wandb project.
      name: the run's name; ``None``: the run directory.
      mode: ``"offline"``, ``"online"`` or ``"disabled"`` (wandb's modes).
      settings: ``wandb.Settings`` keys (conf/logger/wandb.yaml keeps the start local and quick).
      start: unused.
      config: the run's resolved config.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with WandbLogger(d, settings={"console": "off", "quiet": True}) as logger:
    ...     logger.log(1, {"loss": 0.5})
    >>> logger.run.offline, sorted(p.suffix for p in logger.path.glob("*.wandb"))
    (True, ['.wandb'])
    """

    def __init__(self, dir: str | os.PathLike, project: str = "fxtrain", name: str | None = None,
                 mode: Literal["offline", "online", "disabled"] = "offline", settings: dict | None = None, *,
                 start: int = 0, config: dict | None = None):
        del start
        wandb = extras.require("wandb", "logger=wandb", "wandb", "wandb")
        pathlib.Path(dir).mkdir(parents=True, exist_ok=True)
        # create_new: the vmap launcher runs several jobs' loggers in one process, each its own run.
        self.run = wandb.init(dir=str(dir), project=project, name=name or str(dir), mode=mode, config=config,
                              settings=settings or {}, reinit="create_new")
        self.path = pathlib.Path(self.run.dir).parent  # dir/wandb/offline-run-<time>-<id>

    @staticmethod
    def check_settings(settings: dict | None = None, **others: Any) -> None:
        """Raises ``ValueError("settings.<key>=<value>: ...")`` for a ``settings`` entry ``wandb.Settings`` refuses,
        before the run starts (:func:`fxtrain.validate.check` calls it); without wandb installed, nothing.

        >>> WandbLogger.check_settings({"console": "loud"})
        Traceback (most recent call last):
        ...
        ValueError: settings.console=loud: Input should be 'auto', 'off', 'wrap', 'redirect', 'wrap_raw' or 'wrap_emu'
        """
        del others
        try:
            import wandb
        except ImportError:  # the logger's own build names the extra (fxtrain[wandb])
            return
        try:
            wandb.Settings(**(settings or {}))
        except ValueError as e:  # pydantic's ValidationError: one line for its first error
            first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e).splitlines()[0]}
            where = ".".join(str(p) for p in first["loc"])
            value = (settings or {}).get(first["loc"][0]) if first["loc"] else settings
            value = value if isinstance(value, str) else json.dumps(value)
            raise ValueError(f"settings.{where}={value}: {first['msg']}" if where else f"settings: {first['msg']}") \
                from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()



class MlflowLogger(_FileLogger):
    """An MLflow run in a local SQLite store, ``dir/mlflow.db`` by default: metrics by step, the config as params.

    The params are the run's config flattened to dotted keys (``optim.chain.adamw.learning_rate``). Each
    launch is its own MLflow run in the experiment ``experiment``. SQLite is MLflow 3's local store: its own
    ``MlflowClient("sqlite:///<run dir>/mlflow.db")`` and ``mlflow ui --backend-store-uri
    sqlite:///<run dir>/mlflow.db`` read it with no extra environment (the ``file:`` store that MLflow 3
    deprecates, and 3.14 refuses without ``MLFLOW_ALLOW_FILE_STORE=true``, is still taken when
    ``tracking_uri`` names one, opted in around this logger's own calls).

    Args:
      dir: the run directory.
      experiment: the MLflow experiment's name (created when missing).
      run_name: the run's name; ``None``: the run directory.
      tracking_uri: ``None``: ``sqlite:///<dir>/mlflow.db``; or any MLflow tracking URI (a server, a shared store).
      start: unused.
      config: the run's resolved config.

    >>> import tempfile
    >>> from mlflow.tracking import MlflowClient
    >>> d = tempfile.mkdtemp()
    >>> with MlflowLogger(d, config={"optim": {"lr": 0.1}}) as logger:
    ...     logger.log(1, {"loss": 0.5})
    >>> client = MlflowClient(logger.tracking_uri)   # MLflow's own client, no environment to set
    >>> [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "loss")]
    [(1, 0.5)]
    >>> client.get_run(logger.run_id).data.params
    {'optim.lr': '0.1'}
    """

    def __init__(self, dir: str | os.PathLike, experiment: str = "fxtrain", run_name: str | None = None,
                 tracking_uri: str | None = None, *, start: int = 0, config: dict | None = None):
        del start
        extras.require("mlflow", "logger=mlflow", "mlflow", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri or f"sqlite:///{(pathlib.Path(dir) / 'mlflow.db').resolve()}"
        with _opted_in(self.tracking_uri):
            self._client = MlflowClient(self.tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
            self.run_id = self._client.create_run(experiment_id, run_name=run_name or str(dir)).info.run_id
            params = [Param(k, v) for k, v in _flat(config or {}).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per call
                self._client.log_batch(self.run_id, params=params[i:i + 100])

    @staticmethod
    def check_settings(tracking_uri: str | None = None, **others: Any) -> None:
        """Raises ``ValueError("tracking_uri=...: ...")`` for a tracking URI without a scheme, which MLflow would
        read as a path to its deprecated file store (:func:`fxtrain.validate.check` calls it before the run).

        >>> MlflowLogger.check_settings(tracking_uri="mlruns")
        Traceback (most recent call last):
        ...
        ValueError: tracking_uri=mlruns: expected a URI with a scheme: sqlite:///path/mlflow.db, http://host:5000, file:///path/mlruns, databricks; or null (sqlite:///<run dir>/mlflow.db)
        """
        del others
        if tracking_uri and tracking_uri not in ("databricks", "databricks-uc") and "://" not in tracking_uri:
            raise ValueError(f"tracking_uri={tracking_uri}: expected a URI with a scheme: sqlite:///path/mlflow.db, "
                             "http://host:5000, file:///path/mlruns, databricks; or null (sqlite:///<run dir>/mlflow.db)")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with _opted_in(self.tracking_uri):
            self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def close(self) -> None:
        with _opted_in(self.tracking_uri):
            self._client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MlflowLogger({self.tracking_uri!r})"


@contextlib.contextmanager
def _opted_in(tracking_uri: str):
    """Around this logger's MLflow calls: :func:`mlflow_file_store` for a ``file:`` store; for SQLite, silence
    SQLAlchemy 2.1's deprecation of the ``noload`` loader that MLflow's store models still use (a warning about
    MLflow's code, raised once per process when its tables are mapped, that a user cannot act on)."""
    with mlflow_file_store() if tracking_uri.startswith("file:") else contextlib.nullcontext():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The ``noload`` loader strategy is deprecated",
                                    category=DeprecationWarning)
            yield


@contextlib.contextmanager
def mlflow_file_store():
    """Lets MLflow open a file store (``file:`` tracking URIs) inside the block, where MLflow has deprecated it.

    MLflow 3.x deprecates the file store: 3.6-3.13 warn (a ``FutureWarning`` at every store it opens), 3.14 and
    later refuse it unless ``MLFLOW_ALLOW_FILE_STORE=true``. A run directory's own store, no server and nothing
    shared, was what :class:`MlflowLogger` wrote before it took SQLite; it opts in around its own calls only where
    ``tracking_uri`` names a ``file:`` store; a value you set yourself stays. Reading such a store back needs the
    same (``mlflow ui``: set the variable).

    >>> import os
    >>> with mlflow_file_store():
    ...     os.environ.get("MLFLOW_ALLOW_FILE_STORE", "true")
    'true'
    """
    unset = "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    if unset:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The filesystem tracking backend", category=FutureWarning)
            yield
    finally:
        if unset:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


def _flat(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: MLflow params are flat strings (YAML's spelling: null, true)."""
    flat: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v if isinstance(v, str) else json.dumps(v)
    return flat
