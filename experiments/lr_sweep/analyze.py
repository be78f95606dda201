"""Turns an lr_sweep directory into a results table (markdown) and a heatmap PNG.

    python experiments/lr_sweep/analyze.py experiments/lr_sweep/runs/<stamp> --write  # replaces results.md, heatmap.png here
    python experiments/lr_sweep/analyze.py SWEEP_DIR --out /tmp/mine --metric val_loss

Reads the sweep with ``fxtrain.report.collect`` (one row per job: its overrides and final metrics), groups
the jobs by everything they changed except ``seed``, and reports the mean and spread over seeds. The
heatmap has one row per learning rate and one column per (warmup, clip) pair. Works on any sweep of the
same three keys (a different grid, more seeds), and on a sweep still running (completed jobs only).

The metric that ranks (``**best**``) and colours the heatmap is the one the jobs optimized (their
``summary.json``'s ``optimized_metric``: the task's validation metric, ``val_accuracy``), as
``python -m fxtrain.report`` ranks them, in the direction :func:`fxtrain.tasks.lower_is_better` gives; the
second column is its test-split counterpart (``test_accuracy``), which is reported, never chosen by.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

from fxtrain.report import collect
from fxtrain.tasks import lower_is_better

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py
LR, WARMUP, CLIP = "optim.chain.adamw.learning_rate", "schedule.warmup_steps", "optim.chain.clip_by_global_norm.max_norm"


def _num(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def aggregate(rows: list[dict], metric: str) -> dict[tuple, list[float]]:
    """``{(lr, warmup, clip): [metric of each completed seed]}``, keys as numbers, sorted."""
    cells: dict[tuple, list[float]] = {}
    for row in rows:
        if row.get("status") != "completed" or not isinstance(row.get(metric), (int, float)):
            continue
        key = tuple(_num(row.get(k)) for k in (LR, WARMUP, CLIP))
        cells.setdefault(key, []).append(row[metric])
    return dict(sorted(cells.items(), key=lambda kv: tuple(map(str, kv[0])) if None in kv[0] else kv[0]))


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def declared_metric(sweep_dir: pathlib.Path, rows: list[dict]) -> str:
    """The metric the sweep's jobs optimized (the first ``optimized_metric`` their ``summary.json`` files name);
    ``val_accuracy``, the digits task's, for a sweep that has none yet."""
    for row in rows:
        try:
            name = json.loads((sweep_dir / str(row["job"]) / "summary.json").read_text()).get("optimized_metric")
        except (OSError, ValueError):
            continue
        if name:
            return name
    return "val_accuracy"


def counterpart(metric: str) -> str:
    """The second column beside ``metric``: the test split's form of a validation metric, else the other one of
    accuracy and loss (``val_accuracy`` -> ``test_accuracy``, ``test_accuracy`` -> ``test_loss``)."""
    if metric.startswith("val_"):
        return f"test_{metric.removeprefix('val_')}"
    return "test_loss" if metric != "test_loss" else "test_accuracy"


def table(cells: dict[tuple, list[float]], metric: str, second: dict[tuple, list[float]], second_name: str) -> str:
    best = (min if lower_is_better(metric) else max)(cells, key=lambda k: statistics.fmean(cells[k]))
    lines = [f"| learning_rate | warmup_steps | clip max_norm | seeds | {metric} (mean ± sd) | {second_name} (mean ± sd) |",
             "|---|---|---|---|---|---|"]
    for key, values in cells.items():
        m, s = _mean_sd(values)
        m2, s2 = _mean_sd(second.get(key, [math.nan]))
        mark = " **best**" if key == best else ""
        lines.append(f"| {key[0]:g} | {key[1]:g} | {key[2]:g} | {len(values)} | {m:.4f} ± {s:.4f}{mark} | "
                     f"{m2:.4f} ± {s2:.4f} |")
    return "\n".join(lines)


def heatmap(cells: dict[tuple, list[float]], metric: str, path: pathlib.Path, title: str) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({k[0] for k in cells})
    cols = sorted({(k[1], k[2]) for k in cells})
    grid = [[statistics.fmean(cells[(lr, *c)]) if (lr, *c) in cells else math.nan for c in cols] for lr in lrs]
    fig, ax = plt.subplots(figsize=(1.6 * len(cols) + 2.2, 0.8 * len(lrs) + 1.6))
    cmap = "viridis_r" if lower_is_better(metric) else "viridis"
    im = ax.imshow(grid, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(cols)), [f"warmup {w:g}\nclip {c:g}" for w, c in cols], fontsize=8)
    ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_ylabel("adamw learning_rate (peak)")
    lo, hi = im.get_clim()
    for i, lr in enumerate(lrs):
        for j, c in enumerate(cols):
            if (lr, *c) in cells:
                v = grid[i][j]
                ax.text(j, i, f"{v:.4f}", ha="center", va="center", fontsize=8,
                        color="white" if (v - lo) < 0.5 * (hi - lo) else "black")
    fig.colorbar(im, ax=ax, label=f"{metric} (mean over seeds)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=pathlib.Path)
    parser.add_argument("--metric", help="the metric that ranks and colours the heatmap (default: the one the jobs "
                                         "optimized, val_accuracy)")
    _common.add_output_args(parser, HERE)  # results.md and heatmap.png
    args = parser.parse_args(argv)
    out = _common.output_dir(parser, args, HERE)
    rows = collect(args.sweep_dir)
    metric = args.metric or declared_metric(args.sweep_dir, rows)
    cells = aggregate(rows, metric)
    if not cells:
        sys.exit(f"{args.sweep_dir}: no completed job has {metric} (yet)")
    other = counterpart(metric)
    seconds = sum(r.get("time_s", 0.0) for r in rows)
    done = sum(r.get("status") == "completed" for r in rows)
    text = table(cells, metric, aggregate(rows, other), other)
    out.mkdir(parents=True, exist_ok=True)
    png = heatmap(cells, metric, out / "heatmap.png",
                  f"{args.sweep_dir.name}: {done} jobs, digits MLP, 300 batches")
    report = f"{done} of {len(rows)} jobs completed, {seconds:.0f} s of training in all.\n\n{text}\n"
    _common.write_study_results(out, "experiments/lr_sweep/analyze.py", report, source=args.sweep_dir)
    print(report)
    print(f"heatmap: {png}")


if __name__ == "__main__":
    main()
