"""Sweep summaries: ``summary.csv`` and its table, and ``python -m fxtrain.report SWEEP_DIR``.

A sweep directory (``multirun/DATE/TIME``) holds one directory per job, each with ``.hydra/overrides.yaml``
(what the job changed), ``metrics.jsonl`` (the curves) and ``summary.json`` (final metrics, or why it
failed). :func:`collect` turns them into one row per job; the :class:`SweepSummary` Hydra callback
writes those rows to ``summary.csv`` after every job and prints them as a table when the sweep ends;
``python -m fxtrain.report SWEEP_DIR`` prints the same table and plots the curves to a PNG (matplotlib:
``pip install 'fxtrain[plot]'``).

Seeds: jobs that differ only in seed keys (``seed``, ``data.seed``, ``data.split_seed``; ``--seed-keys`` to
name others) are repeats of one configuration. :func:`by_config` groups them and ranks the configurations
by the mean of the metric (with its standard deviation and ``n``); the ``best:`` line names the best
configuration, not its luckiest seed, and the plot draws mean +- std per value.

Example:
    >>> from fxtrain.report import format_table
    >>> print(format_table([{"job": "0", "status": "completed", "seed": "1", "test_accuracy": 0.97123}]))
    job  status     seed  test_accuracy
    ---  ---------  ----  -------------
    0    completed  1     0.9712
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import re
import statistics
import sys
from typing import Any, NamedTuple

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fxtrain import distributed, tasks
from fxtrain._base import describe as describe_value

__all__ = ["collect", "metric_columns", "ranked_by", "read_jsonl", "format_table", "write_csv", "plot", "figure", "best", "by_config", "describe",
           "SEED_KEYS", "SweepSummary", "finish_sweep", "main"]

_FINAL = ("val_accuracy", "test_accuracy", "test_loss", "loss", "accuracy", "val_loss")  # after the optimized one
SEED_KEYS = ("seed", "data.seed", "data.split_seed")  # overrides whose jobs are repeats of one configuration


def collect(sweep_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """One row per job directory of ``sweep_dir``, in job order: ``job``, ``status``, the job's overrides
    (one column per key), its final metrics (the optimized one first), ``tested`` for a job whose ``test_*`` are
    of another checkpoint than ``trainer.test_ckpt`` names (``last (step 20)`` where the best was asked for and
    there was none; summary.json's ``tested`` says why), ``step``, ``time_s`` and ``error``.

    A single run directory (with ``metrics.jsonl`` in it) gives one row.
    """
    sweep_dir = pathlib.Path(sweep_dir)
    if (sweep_dir / "metrics.jsonl").exists() or (sweep_dir / "summary.json").exists():
        jobs = [sweep_dir]
    else:
        jobs = sorted((d for d in sweep_dir.iterdir() if d.is_dir() and _is_job(d)), key=_job_order)
    rows = []
    for d in jobs:
        summary = _read_json(d / "summary.json")
        row: dict[str, Any] = {"job": d.name, "status": summary.get("status", "incomplete")}
        row.update(_overrides(d))
        metrics = summary.get("metrics", {})
        for k in metric_columns(summary.get("optimized_metric"), metrics):
            row[k] = metrics[k]
        tested = summary.get("tested")
        if isinstance(tested, dict) and {"checkpoint", "step"} <= set(tested) \
                and ", but " in str(tested.get("why")):  # test_* of another checkpoint than trainer.test_ckpt's
            row["tested"] = f"{tested['checkpoint']} (step {tested['step']})"
        if "step" in summary:
            row["step"] = summary["step"]
        if "time_s" in summary:
            row["time_s"] = summary["time_s"]
        if "error" in summary:
            row["error"] = summary["error"]
        rows.append(row)
    return rows


def metric_columns(optimized: str | None, metrics: dict[str, Any]) -> list[str]:
    """The metric columns of a job's row: the optimized metric, the usual ones (:data:`_FINAL`), then every other
    metric its task declares, found as the held-out splits' names in ``metrics`` (summary.json's): ``val_<m>``,
    ``test_<m>`` and the training ``<m>``. A custom task's ``mae`` gets ``val_mae``, ``test_mae``, ``mae``.

    >>> metric_columns("val_loss", {"val_loss": 1, "test_loss": 1, "loss": 1, "test_mae": 1, "val_mae": 1, "mae": 1,
    ...                             "grad_norm": 1})
    ['val_loss', 'test_loss', 'loss', 'val_mae', 'test_mae', 'mae']
    """
    declared = dict.fromkeys(k.partition("_")[2] for k in metrics if k.partition("_")[0] in tasks.SPLITS)
    extra = [k for m in declared for k in (*(f"{split}_{m}" for split in tasks.SPLITS), m)]
    return [k for k in dict.fromkeys([optimized, *_FINAL, *extra]) if k is not None and k in metrics]


def _is_job(d: pathlib.Path) -> bool:
    return any((d / f).exists() for f in (".hydra", "summary.json", "metrics.jsonl", "config.yaml"))


def _job_order(d: pathlib.Path) -> tuple:
    return (0, int(d.name), "") if d.name.isdigit() else (1, 0, d.name)


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` in order (``[]`` when there is none).

    A line that does not parse (the one a killed run was writing) is skipped.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _overrides(d: pathlib.Path) -> dict[str, str]:
    path = d / ".hydra" / "overrides.yaml"
    if not path.exists():
        return {}
    out = {}
    for item in OmegaConf.load(path):
        key, _, value = str(item).partition("=")
        out[key] = value
    return out


def _columns(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns and k != "error"]
    if any("error" in row for row in rows):
        columns.append("error")
    return columns


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return "" if v is None else _value(v)


_LONG_FLOAT = re.compile(r"[-+]?\d*\.\d{10,}(?:[eE][-+]?\d+)?|[-+]?\d\.\d{9,}[eE][-+]?\d+")


def _value(v: Any) -> str:
    """An override's value as the table shows it: a float a sweeper drew (Optuna's ``0.0007247031607588866``) as the
    shortest decimal that is the same float32 (``0.000724703``, :func:`fxtrain.describe`); anything else as written.

    >>> _value("0.0007247031607588866"), _value("0.001"), _value("[32,64]"), _value(64)
    ('0.000724703', '0.001', '[32,64]', '64')
    """
    text = str(v)
    return describe_value(float(text)) if _LONG_FLOAT.fullmatch(text) else text


def _short(text: Any, width: int = 72) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= width else text[:width - 3] + "..."


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned plain-text table (floats to 4 significant digits, errors shortened)."""
    if not rows:
        return "(no jobs)"
    columns = _columns(rows)
    cells = [[_fmt(row.get(c)) if c != "error" else _short(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def write_csv(rows: list[dict[str, Any]], path: str | pathlib.Path) -> pathlib.Path:
    """Writes the rows to ``path`` (one column per key of any row), atomically: jobs of a submitit launcher
    rewrite it concurrently, and a reader sees the old file or the new one, never a partial one."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)
    return path


def best(rows: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The completed row with the best ``metric``: lowest for losses and errors (``test_loss``, ``test_mae``,
    ``test_mse``, a perplexity...), highest otherwise (``test_accuracy``). Ties (many jobs at test_accuracy
    1.0) go to the lowest ``val_loss``, then ``loss``, then the first job (never a test metric: choosing by the
    test split would tune on it).

    >>> rows = [{"job": 0, "status": "completed", "test_accuracy": 1.0, "val_loss": 0.3, "test_mae": 0.2},
    ...         {"job": 1, "status": "completed", "test_accuracy": 1.0, "val_loss": 0.1, "test_mae": 0.4}]
    >>> best(rows, "test_accuracy")["job"], best(rows, "test_mae")["job"]
    (1, 0)
    """
    done = [r for r in rows if r.get("status") == "completed" and isinstance(r.get(metric), (int, float))
            and math.isfinite(r[metric])]
    if not done:
        return None
    sign = 1 if tasks.lower_is_better(metric) else -1

    def rank(r: dict) -> tuple:
        ties = [r.get(k) if isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) else math.inf
                for k in ("val_loss", "loss")]  # never test_loss: the test split does not choose
        return (sign * r[metric], *ties)

    return min(done, key=rank)


def by_config(rows: list[dict[str, Any]], metric: str, varied: list[str],
              seed_keys: tuple[str, ...] = SEED_KEYS) -> list[dict[str, Any]]:
    """The jobs grouped by configuration (their ``varied`` overrides other than ``seed_keys``), best first.

    Each group is a dict: the configuration's overrides, ``n`` (completed jobs with a finite ``metric``),
    ``mean`` and ``std`` of ``metric`` over them (sample std; 0.0 for one job), and ``jobs`` (every job of the
    configuration, in job order). Groups rank by ``mean``, lowest first where :func:`fxtrain.tasks.lower_is_better`,
    else highest (the one direction rule), ties to the larger ``n``; groups without a completed job come last.

    >>> rows = [{"job": j, "status": "completed", "lr": lr, "seed": s, "val_accuracy": a}
    ...         for j, (lr, s, a) in enumerate([("0.1", "1", 0.90), ("0.1", "2", 0.70), ("0.3", "1", 0.85),
    ...                                          ("0.3", "2", 0.83)])]
    >>> [(g["lr"], round(g["mean"], 3), round(g["std"], 3), g["n"]) for g in by_config(rows, "val_accuracy", ["lr", "seed"])]
    [('0.3', 0.84, 0.014, 2), ('0.1', 0.8, 0.141, 2)]
    >>> best(rows, "val_accuracy")["job"]   # the luckiest single job is the other configuration's
    0
    """
    keys = [k for k in varied if k not in seed_keys]
    groups: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        config = tuple((k, row.get(k)) for k in keys)
        groups.setdefault(config, {**dict(config), "jobs": []})["jobs"].append(row)
    sign = 1 if tasks.lower_is_better(metric) else -1
    for g in groups.values():
        values = [r[metric] for r in g["jobs"] if r.get("status") == "completed" and _finite(r.get(metric))]
        g["n"] = len(values)
        g["mean"] = statistics.fmean(values) if values else None
        g["std"] = statistics.stdev(values) if len(values) > 1 else 0.0 if values else None
    return sorted(groups.values(), key=lambda g: (g["mean"] is None, sign * (g["mean"] or 0.0), -g["n"]))


def _seeded(rows: list[dict], metric: str, varied: list[str], seed_keys: tuple[str, ...]) -> bool:
    """Whether seeds repeat a configuration: a seed key varies and some configuration has two completed jobs."""
    if not any(k in seed_keys for k in varied):
        return False
    return any(g["n"] > 1 for g in by_config(rows, metric, varied, seed_keys))


def _config_label(group: dict, keys: list[str], names: dict[str, str] | None = None) -> str:
    return " ".join(f"{(names or {}).get(k, k)}={_value(group[k])}" for k in keys if group.get(k) is not None)


def _pm(group: dict) -> str:
    return f"{_fmt(group['mean'])} +- {_fmt(group['std'])}, n={group['n']}"


def _metric_of(sweep_dir: pathlib.Path, rows: list[dict]) -> str | None:
    for d in [sweep_dir, *(sweep_dir / str(r["job"]) for r in rows)]:
        name = _read_json(d / "summary.json").get("optimized_metric")
        if name:
            return name
    return None


def ranked_by(metric: str | None, rows: list[dict]) -> str | None:
    """What ranks the jobs when ``metric`` is asked for: a test split's metric is shown but its validation form
    ranks (choosing by the test split would tune on it), where the jobs have one.

    >>> ranked_by("test_mae", [{"val_mae": 0.1, "test_mae": 0.2}]), ranked_by("test_mae", [{"test_mae": 0.2}])
    ('val_mae', 'test_mae')
    """
    if metric is None or not tasks.reads_test(metric):
        return metric
    val = f"val_{metric.removeprefix('test_')}"
    return val if any(val in row for row in rows) else metric


def describe(sweep_dir: str | pathlib.Path, metric: str | None = None,
             seed_keys: tuple[str, ...] = SEED_KEYS) -> str:
    """The table of :func:`collect`, overrides shared by every job on one line, the best and failures.

    ``summary.csv`` has every column; the table leaves out the overrides that are the same in every job
    (``trainer.max_steps=200`` given to the whole sweep) and lists them once below. ``metric`` (default: the
    optimized one the jobs recorded) is what ranks. Where seeds repeat configurations (:func:`by_config`: a
    seed key varies and a configuration has two completed jobs), a
    second table ranks the configurations by their mean, and ``best:`` names the best configuration with
    its mean +- std over seeds; otherwise ``best:`` names the best job.
    """
    sweep_dir = pathlib.Path(sweep_dir)
    rows = collect(sweep_dir)
    varied, shared = _split_overrides(sweep_dir, rows)
    metric = metric or _metric_of(sweep_dir, rows)
    if metric:
        for row in rows:  # the ranked metric as a column, also one the summary leaves out (--metric)
            job = _job(sweep_dir, row, metric)
            if job.final is not None and metric not in row:
                row[metric] = job.final
    text = format_table([{k: v for k, v in row.items() if k not in shared} for row in rows])
    if shared:
        text += "\nevery job: " + " ".join(f"{k}={_value(v)}" for k, v in shared.items())
    shown, metric = metric, ranked_by(metric, rows)
    if shown != metric:
        text += f"\nranked by {metric}: {shown} is the test split's, shown but never what chooses"
    if metric and _seeded(rows, metric, varied, seed_keys):
        keys = [k for k in varied if k not in seed_keys]
        groups = by_config(rows, metric, varied, seed_keys)
        table = [{**{k: g[k] for k in keys}, f"{metric} mean": g["mean"], "std": g["std"], "n": g["n"],
                  "jobs": " ".join(str(r["job"]) for r in g["jobs"])} for g in groups]
        text += f"\n\nby configuration ({metric} over {', '.join(k for k in seed_keys if k in varied)}, best first):\n"
        text += format_table(table)
        if groups and groups[0]["n"] and keys:
            text += f"\nbest: {_config_label(groups[0], keys)} ({metric} {_pm(groups[0])})"
        elif groups and groups[0]["n"]:  # seeds of one configuration: nothing to choose between
            text += f"\nseeds: one configuration, {metric} {_pm(groups[0])}"
    elif metric:
        top = best(rows, metric)
        if top is not None:
            changed = " ".join(f"{k}={_value(top[k])}" for k in varied if k in top)
            text += f"\nbest: job {top['job']} ({metric} {_fmt(top[metric])})" + (f": {changed}" if changed else "")
    failed = [r["job"] for r in rows if r["status"] != "completed"]
    if failed:
        text += f"\nnot completed: job {', '.join(map(str, failed))}"
    return text


def _split_overrides(sweep_dir: pathlib.Path, rows: list[dict]) -> tuple[list[str], dict[str, str]]:
    """Override keys that differ between jobs, and those set to one value in every job (with that value)."""
    keys: list[str] = []
    for row in rows:
        job = sweep_dir / str(row["job"])
        keys += [k for k in _overrides(job if job.is_dir() else sweep_dir) if k not in keys]
    if len(rows) < 2:
        return keys, {}
    shared = {k: rows[0].get(k) for k in keys if all(r.get(k) == rows[0].get(k) for r in rows)}
    return [k for k in keys if k not in shared], shared


# --- the plot ------------------------------------------------------------------------------------

_FEW_JOBS = 6  # up to this many jobs: a colour and a legend entry per job; more: colour by each varied value


def plot(sweep_dir: str | pathlib.Path, path: str | pathlib.Path | None = None,
         metric: str | None = None, seed_keys: tuple[str, ...] = SEED_KEYS) -> pathlib.Path:
    """Saves :func:`figure` of ``sweep_dir`` to a PNG and returns its path (default ``SWEEP_DIR/curves.png``).

    Needs matplotlib (``pip install 'fxtrain[plot]'``).

    Example:
        >>> import pathlib, shutil, tempfile
        >>> sweep = pathlib.Path(tempfile.mkdtemp())
        >>> for job, lr in enumerate(["0.001", "0.01"]):
        ...     (sweep / str(job) / ".hydra").mkdir(parents=True)
        ...     _ = (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- lr={lr}\\n")
        ...     _ = (sweep / str(job) / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\\n')
        >>> plot(sweep).name
        'curves.png'
        >>> shutil.rmtree(sweep)
    """
    sweep_dir = pathlib.Path(sweep_dir)
    path = pathlib.Path(path) if path is not None else sweep_dir / "curves.png"
    figure(sweep_dir, metric, seed_keys).savefig(path, dpi=110)
    return path


def figure(sweep_dir: str | pathlib.Path, metric: str | None = None, seed_keys: tuple[str, ...] = SEED_KEYS) -> Any:
    """The sweep's training loss and ``metric`` (default: the optimized one) against step, as a matplotlib Figure.

    Up to 6 jobs: one colour per job, named in a legend beside the panels. More: one row of panels per
    varied override (``seed`` left out when others vary: its spread shows in every row), each job's curves
    coloured by that override's value (a colorbar: log-scaled for values like learning rates 1e-3,3e-3,1e-2,
    a colour per name for words), and a third panel of the final ``metric`` against the value (one point per job, so
    seeds are repeated points). In both, the best job (:func:`best`) is thick and black and named in the
    title; failed or unfinished jobs are grey and dashed (and a grey x on the final panel), counted in the
    title with the overrides every job shares. Where seeds repeat configurations (:func:`by_config`), the
    per-value panels are drawn whatever the number of jobs, each value's mean +- std over its jobs is a bar on
    the final panel, and "best" is the configuration with the best mean (all its seeds black).

    Example:
        >>> import pathlib, shutil, tempfile
        >>> sweep = pathlib.Path(tempfile.mkdtemp())
        >>> (sweep / "0" / ".hydra").mkdir(parents=True)
        >>> _ = (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- seed=1\\n")
        >>> _ = (sweep / "0" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "test_accuracy": 0.5}\\n')
        >>> fig = figure(sweep)
        >>> [(ax.get_ylabel(), ax.get_yscale()) for ax in fig.axes]
        [('loss', 'log'), ('test_accuracy', 'linear')]
        >>> shutil.rmtree(sweep)
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'fxtrain[plot]'") from None
    sweep_dir = pathlib.Path(sweep_dir)
    rows = collect(sweep_dir)
    metric = metric or _metric_of(sweep_dir, rows) or "test_accuracy"
    varied, shared = _split_overrides(sweep_dir, rows)
    jobs = [_job(sweep_dir, row, metric) for row in rows]
    finals = [{**j.row, metric: j.final} for j in jobs]
    rank = ranked_by(metric, finals)  # a test metric is drawn; its validation form chooses the best
    seeded = _seeded(finals, rank, varied, seed_keys)
    if seeded:  # the best configuration: every seed of it
        groups = by_config(finals, rank, varied, seed_keys)
        top = groups[0] if groups and groups[0]["n"] else None
        best_jobs = {r["job"] for r in top["jobs"]} if top else set()
    else:
        top = best(finals, rank)
        best_jobs = {top["job"]} if top is not None else set()
    kinds = ["best" if j.row["job"] in best_jobs else
             "done" if j.row["status"] == "completed" else "failed" for j in jobs]
    keys = [k for k in varied if k not in seed_keys] or varied or ["job"]
    if len(jobs) <= _FEW_JOBS and not seeded:
        fig = Figure(figsize=(12, 4.2), layout="constrained")
        _per_job(fig, jobs, kinds, varied, metric)
    else:
        fig = Figure(figsize=(14, 0.9 + 2.8 * len(keys)), layout="constrained")
        _per_value(fig, jobs, kinds, keys, metric, _short_names(keys))
    FigureCanvasAgg(fig)  # a canvas of its own: no pyplot, no global backend switch
    fig.suptitle(_title(sweep_dir, jobs, shared, top, varied, rank if seeded else metric, seeded), fontsize=10)
    return fig


class _Job(NamedTuple):
    row: dict[str, Any]      # collect()'s row
    records: list[dict]      # its metrics.jsonl
    final: float | None      # the plotted metric at the end: summary.json's, else the last one logged


def _job(sweep_dir: pathlib.Path, row: dict, metric: str) -> _Job:
    d = sweep_dir / str(row["job"])
    records = read_jsonl((d if d.is_dir() else sweep_dir) / "metrics.jsonl")
    logged = [r[metric] for r in records if _finite(r.get(metric))]
    final = row[metric] if _finite(row.get(metric)) else logged[-1] if logged else None
    return _Job(row, records, final)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _per_job(fig: Any, jobs: list[_Job], kinds: list[str], varied: list[str], metric: str) -> None:
    """Few jobs: loss and metric panels, a colour per job, the legend right of the panels."""
    from matplotlib.lines import Line2D

    axes = fig.subplots(1, 2)
    names = _short_names(varied)
    handles = []  # one entry per job, also for a job that has logged nothing yet
    for i, (job, kind) in enumerate(zip(jobs, kinds)):
        label = " ".join(f"{names[k]}={job.row[k]}" for k in varied if k in job.row) or f"job {job.row['job']}"
        label += {"best": " (best)", "failed": f" ({job.row['status']})", "done": ""}[kind]
        for ax, key in zip(axes, ("loss", metric)):
            _curve(ax, job, key, f"C{i}", kind)
        handles.append(Line2D([], [], label=label, **{"color": f"C{i}", **_STYLE[kind]}))
    _label_curves(axes, metric)
    if len(jobs) > 1:
        fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)


def _per_value(fig: Any, jobs: list[_Job], kinds: list[str], keys: list[str], metric: str,
               names: dict[str, str]) -> None:
    """Many jobs: a row per varied key, curves coloured by its value, the final metric against it."""
    axes = fig.subplots(len(keys), 3, squeeze=False, width_ratios=[1, 1, 0.8])
    for row_axes, key in zip(axes, keys):
        scale = _scale([j.row.get(key) for j in jobs])
        colours = [scale.colour(j.row.get(key)) for j in jobs]
        for job, kind, colour in zip(jobs, kinds, colours):
            _curve(row_axes[0], job, "loss", colour, kind, smooth=True)  # 36 noisy losses read as one tangle
            _curve(row_axes[1], job, metric, colour, kind)
        _label_curves(row_axes, metric)
        _finals(row_axes[2], jobs, kinds, colours, key, scale, names[key], metric)
        bar = fig.colorbar(scale.mappable, ax=list(row_axes), ticks=scale.ticks, aspect=25, pad=0.01)
        if scale.ticks is not None:
            bar.set_ticklabels(scale.labels, fontsize=8)
            bar.minorticks_off()
        bar.set_label(names[key])
    for ax in axes[:-1, :2].flat:
        ax.set_xlabel("")
    axes[0, 0].set_title("training loss (smoothed)", fontsize=9)
    axes[0, 1].set_title(metric, fontsize=9)
    axes[0, 2].set_title(f"final {metric} (bars: mean +- std)", fontsize=9)


_STYLE = {  # how a job's curve is drawn, by what became of it
    "best": dict(color="black", linewidth=2.6, alpha=1.0, zorder=4),
    "done": dict(linewidth=1.1, alpha=0.75, zorder=2),
    "failed": dict(color="0.55", linewidth=1.0, alpha=0.8, linestyle="--", zorder=1),
}


def _curve(ax: Any, job: _Job, key: str, colour: Any, kind: str, smooth: bool = False) -> None:
    pts = [(r["step"], r[key]) for r in job.records if "step" in r and _finite(r.get(key))]
    if smooth:
        pts = [(step, y) for step, y in pts if y > 0]
    if pts:
        steps, ys = zip(*pts)
        ax.plot(steps, _smoothed(ys) if smooth else ys, **{"color": colour, **_STYLE[kind]},
                gid=f"job {job.row['job']}", marker="." if len(pts) < 20 else None, markersize=4)


def _smoothed(ys: list[float]) -> list[float]:
    """An exponential moving average of the log of positive ``ys`` (a loss spans decades) over about
    sqrt(len(ys))/2 points (3 of 36, 16 of 1000), debiased at the start as TensorBoard's.

    Example:
        >>> [round(y, 3) for y in _smoothed([1.0, 0.01] * 100)][-2:]  # near their geometric mean, 0.1
        [0.119, 0.084]
        >>> _smoothed([1.0, 0.5])
        [1.0, 0.5]
    """
    beta = 1 - 1 / max(1.0, math.sqrt(len(ys)) / 2)
    out, avg = [], 0.0
    for i, y in enumerate(ys, 1):
        avg = beta * avg + (1 - beta) * math.log(y)
        out.append(math.exp(avg / (1 - beta ** i)))
    return out


def _label_curves(axes: Any, metric: str) -> None:
    for ax, key in zip(axes, ("loss", metric)):
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if any(y > 0 for line in axes[0].get_lines() for y in line.get_ydata()):
        axes[0].set_yscale("log", nonpositive="mask")  # a loss of exactly 0 leaves a gap, not a spike


def _finals(ax: Any, jobs: list[_Job], kinds: list[str], colours: list, key: str, scale: "_Scale",
            name: str, metric: str) -> None:
    """The final metric against ``key``'s value: a point per job, the best a black star, failures grey x's."""
    xs = _spread([scale.position.get(str(j.row[key])) if j.row.get(key) is not None else None for j in jobs],
                 scale.log)
    for job, kind, colour, x in zip(jobs, kinds, colours, xs):
        if x is None:
            continue
        if kind == "failed" or job.final is None:  # no final value: a mark on the bottom edge
            ax.plot(x, 0.03, "x", color="0.45", transform=ax.get_xaxis_transform(), clip_on=False, zorder=3,
                    gid=f"job {job.row['job']}")
        elif kind == "best":
            ax.plot(x, job.final, "*", color="black", markersize=14, zorder=4, gid=f"job {job.row['job']}")
        else:
            ax.plot(x, job.final, "o", color=colour, markeredgecolor="white", markersize=7, alpha=0.85,
                    gid=f"job {job.row['job']}")
    at: dict[float, list[float]] = {}  # each value's finals: their mean +- std, a bar beside the points
    for job, kind in zip(jobs, kinds):
        x = scale.position.get(str(job.row[key])) if job.row.get(key) is not None else None
        if x is not None and kind != "failed" and job.final is not None:
            at.setdefault(x, []).append(job.final)
    for x, values in at.items():
        if len(values) > 1:
            ax.errorbar(x, statistics.fmean(values), yerr=statistics.stdev(values), fmt="_", color="0.2",
                        markersize=16, capsize=5, elinewidth=1.4, zorder=5, gid=f"mean {x:g}")
    if scale.log:
        ax.set_xscale("log")
    if scale.ticks is not None:
        wide = sum(len(label) + 2 for label in scale.labels) > 40
        ax.set_xticks(scale.ticks, scale.labels, fontsize=8, rotation=30 if wide else 0, ha="right" if wide else "center")
        ax.minorticks_off()
    t = sorted({math.log(x) if scale.log else x for x in scale.position.values()})
    pad = max(0.35 * min((b - a for a, b in zip(t, t[1:])), default=1.0), 0.05 * (t[-1] - t[0]))  # room for _spread
    lo, hi = t[0] - pad, t[-1] + pad
    ax.set_xlim(*((math.exp(lo), math.exp(hi)) if scale.log else (lo, hi)))
    ax.set_xlabel(name)
    ax.set_ylabel(f"final {metric}")
    ax.grid(alpha=0.3)


def _spread(xs: list[float | None], log: bool) -> list[float | None]:
    """``xs`` with the jobs that share a value spread side by side over 30% of the gap between values (on a
    log axis if ``log``), so that equal results (seeds reaching 1.0) stay countable.

    Example:
        >>> _spread([1.0, 2.0, 1.0, None], log=False)
        [0.85, 2.0, 1.15, None]
    """
    groups: dict[float, list[int]] = {}  # value (log if log) -> the jobs at it
    for i, x in enumerate(xs):
        if x is not None:
            groups.setdefault(math.log(x) if log else x, []).append(i)
    values = sorted(groups)
    gap = min((b - a for a, b in zip(values, values[1:])), default=1.0)
    out = list(xs)
    for v, members in groups.items():
        for k, i in enumerate(members):
            w = v + 0.3 * gap * (k / (len(members) - 1) - 0.5) if len(members) > 1 else v
            out[i] = math.exp(w) if log else w
    return out


class _Scale(NamedTuple):
    """How one override's values become colours and positions (on the colorbar and the final panel's x)."""
    mappable: Any                  # the ScalarMappable the colorbar shows
    position: dict[str, float]     # value (as in the overrides) -> number on the colorbar and x axis
    ticks: list[float] | None      # where to label the values (None: matplotlib's own ticks)
    labels: list[str] | None
    log: bool                      # numbers on a log axis

    def colour(self, value: Any) -> Any:
        x = self.position.get(str(value)) if value is not None else None
        return "0.55" if x is None else self.mappable.to_rgba(x)


def _scale(values: list[Any]) -> _Scale:
    """Numbers on a colormap (log-scaled when they sit evenly on a log axis: see :func:`_log_spaced`);
    words, or a single number, a colour each."""
    import numpy as np
    from matplotlib import cm, colormaps, colors

    present = sorted({str(v) for v in values if v is not None})
    numbers = {v: _number(v) for v in present}
    numeric = all(x is not None for x in numbers.values()) and len(set(numbers.values())) >= 2
    if numeric:
        position = dict(numbers)
        log = _log_spaced(sorted(set(position.values())))
        lo, hi = min(position.values()), max(position.values())
        norm = colors.LogNorm(lo, hi) if log else colors.Normalize(lo, hi)
        cmap = colors.ListedColormap(colormaps["viridis"](np.linspace(0.0, 0.88, 256)))  # no pale yellow end
    else:
        position = {v: float(i) for i, v in enumerate(present)}
        n, log = len(present), False
        cmap = colors.ListedColormap(colormaps["tab10" if n <= 10 else "tab20"].colors[:n] if n <= 20 else
                                     colormaps["viridis"](np.linspace(0.0, 0.88, n)))
        norm = colors.BoundaryNorm(np.arange(n + 1) - 0.5, n)
    label_of: dict[float, str] = {}
    for v, x in position.items():
        label_of.setdefault(x, v)
    ticks: list[float] | None = sorted(label_of)
    if numeric and len(ticks) > 8:  # a random search's values: matplotlib's own ticks
        ticks = None
    elif len(ticks) > 24:
        ticks = ticks[:: math.ceil(len(ticks) / 24)]
    labels = None if ticks is None else [label_of[x] for x in ticks]
    return _Scale(cm.ScalarMappable(norm=norm, cmap=cmap), position, ticks, labels, log)


def _log_spaced(xs: list[float]) -> bool:
    """Whether the sorted numbers ``xs`` span a decade or more and sit more evenly on a log axis than on a
    linear one (the median nearer the middle): learning rates ``1e-3,3e-3,1e-2`` do, a weight decay drawn
    uniformly from 0.001..0.1 does not.

    Example:
        >>> _log_spaced([1e-3, 3e-3, 1e-2]), _log_spaced([0.001, 0.03, 0.05, 0.08, 0.1]), _log_spaced([0, 10, 50])
        (True, False, False)
    """
    lo, hi, median = xs[0], xs[-1], statistics.median(xs)
    if lo <= 0 or hi / lo < 10:
        return False
    linear = abs(median - (lo + hi) / 2) / (hi - lo)
    return abs(math.log(median / lo) / math.log(hi / lo) - 0.5) <= linear


def _number(text: str) -> float | None:
    try:
        x = float(text)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def _short_names(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix naming each key among ``keys``: ``optim.chain.adamw.learning_rate`` is
    ``learning_rate`` unless another key ends so too."""
    names = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            name = ".".join(parts[-n:])
            if sum(k == name or k.endswith("." + name) for k in keys) == 1:
                break
        names[key] = name
    return names


def _title(sweep_dir: pathlib.Path, jobs: list[_Job], shared: dict, top: dict | None, varied: list[str],
           metric: str, seeded: bool = False) -> str:
    statuses = [j.row["status"] for j in jobs if j.row["status"] != "completed"]
    status = ", ".join(f"{statuses.count(s)} {s}" for s in sorted(set(statuses))) + ": grey, dashed"
    lines = [f"{sweep_dir}: {len(jobs)} job{'s' * (len(jobs) != 1)}" + (f" ({status})" if statuses else "")]
    if shared:
        lines.append(_short("every job: " + " ".join(f"{k}={v}" for k, v in shared.items()), 150))
    if top is not None and seeded:
        keys = [k for k in varied if k in top and k != "jobs"]
        label = _config_label(top, keys, _short_names(varied))
        lines.append(f"best (black): {label}, {metric} {_pm(top)}" if label else
                     f"seeds of one configuration: {metric} {_pm(top)}")
    elif top is not None:
        names = _short_names(varied)
        changed = " ".join(f"{names[k]}={top[k]}" for k in varied if k in top)
        lines.append(f"best (black): job {top['job']}, {metric} {_fmt(top[metric])}" + (f": {changed}" if changed else ""))
    return "\n".join(lines)


# --- the Hydra callback --------------------------------------------------------------------------

_open_sweep: pathlib.Path | None = None  # the sweep in progress, whose table is still to be printed


class SweepSummary(Callback):
    """Hydra callback: rewrites ``summary.csv`` in the sweep directory after each job, reports a failed
    job as it ends, and prints the table when the sweep ends (configured in ``conf/train.yaml``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _open_sweep
        if distributed.rank_and_world()[0] == 0:  # under torchrun, rank 0 alone writes and prints
            _open_sweep = pathlib.Path(config.hydra.sweep.dir)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        hydra_cfg = job_return.hydra_cfg.hydra if job_return.hydra_cfg is not None else None
        if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN or distributed.rank_and_world()[0] != 0:
            return
        sweep_dir = _sweep_dir_of(hydra_cfg)
        write_csv(collect(sweep_dir), sweep_dir / "summary.csv")
        if job_return.status.name == "FAILED":
            error = job_return._return_value
            print(f"[fxtrain] job {hydra_cfg.job.num} failed ({' '.join(job_return.overrides)}): "
                  f"{type(error).__name__}: {error}", file=sys.stderr)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        finish_sweep()


def _sweep_dir_of(hydra_cfg: DictConfig) -> pathlib.Path:
    # The job's output dir minus its subdir. Not hydra.sweep.dir: resolving it again now would re-read
    # ${now:...} and name a directory that does not exist.
    out, subdir = str(hydra_cfg.runtime.output_dir), str(hydra_cfg.sweep.subdir)
    return pathlib.Path(out[: -len(subdir)] if out.endswith(subdir) else out).resolve()


def finish_sweep() -> None:
    """Writes ``summary.csv`` and prints the table of the sweep in progress, if any (once)."""
    global _open_sweep
    sweep_dir, _open_sweep = _open_sweep, None
    if sweep_dir is None or not sweep_dir.is_dir():
        return
    write_csv(collect(sweep_dir), sweep_dir / "summary.csv")
    print(f"\nsweep {sweep_dir} (summary.csv):\n{describe(sweep_dir)}")


# --- python -m fxtrain.report ------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    """``python -m fxtrain.report SWEEP_DIR [--metric NAME] [--seed-keys K,K] [--out PNG] [--no-plot]``.

    ``--metric`` changes every part of the output: the ranked column, the ``best:`` line and the plot."""
    parser = argparse.ArgumentParser(prog="python -m fxtrain.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=pathlib.Path, help="a multirun directory (or a single run's)")
    parser.add_argument("--metric", help="the metric to rank by and plot (default: the optimized one)")
    parser.add_argument("--out", type=pathlib.Path, help="PNG path (default: SWEEP_DIR/curves.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.add_argument("--seed-keys", default=",".join(SEED_KEYS),
                        help=f"overrides whose jobs repeat one configuration (default: {','.join(SEED_KEYS)})")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    seed_keys = tuple(k.strip() for k in args.seed_keys.split(",") if k.strip())
    print(describe(args.sweep_dir, args.metric, seed_keys))
    if not args.no_plot:
        try:
            print(f"curves: {plot(args.sweep_dir, args.out, args.metric, seed_keys)}")
        except ImportError as e:
            print(f"curves: not plotted ({e})")


if __name__ == "__main__":
    main()
