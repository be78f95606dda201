"""Sweep summaries: ``summary.csv`` and its table, and ``python -m fxtrain.report SWEEP_DIR``.

A sweep directory (``multirun/DATE/TIME``) holds one directory per job, each with ``.hydra/overrides.yaml``
(what the job changed), ``metrics.jsonl`` (the curves) and ``summary.json`` (final metrics, or why it
failed). :func:`collect` turns them into one row per job; the :class:`SweepSummary` Hydra callback
writes those rows to ``summary.csv`` after every job and prints them as a table when the sweep ends;
``python -m fxtrain.report SWEEP_DIR`` prints the same table and plots the curves to a PNG (matplotlib:
``pip install 'fxtrain[plot]'``).

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
import pathlib
import sys
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fxtrain import distributed

__all__ = ["collect", "read_jsonl", "format_table", "write_csv", "plot", "best", "SweepSummary", "finish_sweep", "main"]

_FINAL = ("test_accuracy", "test_loss", "loss", "accuracy")  # final metrics shown after the optimized one


def collect(sweep_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """One row per job directory of ``sweep_dir``, in job order: ``job``, ``status``, the job's overrides
    (one column per key), its final metrics (the optimized one first), ``step``, ``time_s`` and ``error``.

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
        for k in [summary.get("optimized_metric"), *_FINAL]:
            if k is not None and k in metrics:
                row[k] = metrics[k]
        if "step" in summary:
            row["step"] = summary["step"]
        if "time_s" in summary:
            row["time_s"] = summary["time_s"]
        if "error" in summary:
            row["error"] = summary["error"]
        rows.append(row)
    return rows


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
    return "" if v is None else str(v)


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
    """Writes the rows to ``path`` (one column per key of any row)."""
    path = pathlib.Path(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows))
        writer.writeheader()
        writer.writerows(rows)
    return path


def best(rows: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The completed row with the best ``metric``: lowest for losses and errors, highest otherwise."""
    done = [r for r in rows if r.get("status") == "completed" and isinstance(r.get(metric), (int, float))
            and math.isfinite(r[metric])]
    if not done:
        return None
    lower = "loss" in metric or "error" in metric
    return (min if lower else max)(done, key=lambda r: r[metric])


def _metric_of(sweep_dir: pathlib.Path, rows: list[dict]) -> str | None:
    for d in [sweep_dir, *(sweep_dir / str(r["job"]) for r in rows)]:
        name = _read_json(d / "summary.json").get("optimized_metric")
        if name:
            return name
    return None


def describe(sweep_dir: str | pathlib.Path) -> str:
    """The table of :func:`collect`, overrides shared by every job on one line, the best job and failures.

    ``summary.csv`` has every column; the table leaves out the overrides that are the same in every job
    (``trainer.max_steps=200`` given to the whole sweep) and lists them once below.
    """
    sweep_dir = pathlib.Path(sweep_dir)
    rows = collect(sweep_dir)
    varied, shared = _split_overrides(sweep_dir, rows)
    text = format_table([{k: v for k, v in row.items() if k not in shared} for row in rows])
    if shared:
        text += "\nevery job: " + " ".join(f"{k}={v}" for k, v in shared.items())
    metric = _metric_of(sweep_dir, rows)
    top = best(rows, metric) if metric else None
    if top is not None:
        changed = " ".join(f"{k}={top[k]}" for k in varied if k in top)
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


def plot(sweep_dir: str | pathlib.Path, path: str | pathlib.Path | None = None,
         metric: str | None = None) -> pathlib.Path:
    """Plots every job's training loss and ``metric`` (default: the optimized one) against step to a PNG.

    Returns the PNG's path (default ``SWEEP_DIR/curves.png``). Needs matplotlib (``fxtrain[plot]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'fxtrain[plot]'") from None
    sweep_dir = pathlib.Path(sweep_dir)
    rows = collect(sweep_dir)
    metric = metric or _metric_of(sweep_dir, rows) or "test_accuracy"
    path = pathlib.Path(path) if path is not None else sweep_dir / "curves.png"
    varied, _ = _split_overrides(sweep_dir, rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        job = sweep_dir / str(row["job"]) if (sweep_dir / str(row["job"])).is_dir() else sweep_dir
        lines = read_jsonl(job / "metrics.jsonl")
        label = " ".join(f"{k}={row[k]}" for k in varied if k in row) or f"job {row['job']}"
        for ax, key in zip(axes, ("loss", metric)):
            pts = [(r["step"], r[key]) for r in lines if key in r]
            if pts:
                ax.plot(*zip(*pts), label=label, marker="." if len(pts) < 20 else None)
    for ax, key in zip(axes, ("loss", metric)):
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(str(sweep_dir))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    """``python -m fxtrain.report SWEEP_DIR [--metric NAME] [--out PNG] [--no-plot]``."""
    parser = argparse.ArgumentParser(prog="python -m fxtrain.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=pathlib.Path, help="a multirun directory (or a single run's)")
    parser.add_argument("--metric", help="the metric to plot next to the loss (default: the optimized one)")
    parser.add_argument("--out", type=pathlib.Path, help="PNG path (default: SWEEP_DIR/curves.png)")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    print(describe(args.sweep_dir))
    if not args.no_plot:
        try:
            print(f"curves: {plot(args.sweep_dir, args.out, args.metric)}")
        except ImportError as e:
            print(f"curves: not plotted ({e})")


if __name__ == "__main__":
    main()
