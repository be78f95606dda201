"""lightning-hydra-template's MNIST example on digits (experiment=mnist_port), 3 seeds, then results.md.

    .venv/bin/python experiments/mnist_port/run.py --write             # replaces results.md here (~20 s)
    .venv/bin/python experiments/mnist_port/run.py --out /tmp/mnist    # a fresh copy (make studies)

Runs ``python -m fxtrain.train -m experiment=mnist_port seed=0,1,2`` (one process, jobs one after another)
into ``<out>/runs`` (or ``--runs``), then writes ``results.md``: per seed the best epoch by val_accuracy, its
validation metrics and the test metrics of that checkpoint (``trainer.test_ckpt=best``), with mean ± sd
over the seeds; and the validation curve per epoch, averaged over the seeds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys

from fxtrain.report import read_jsonl

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py: where results go
from omegaconf import OmegaConf  # noqa: E402

SEEDS = "0,1,2"
COMMAND = ["-m", "fxtrain.train", "-m", "experiment=mnist_port", f"seed={SEEDS}", "trainer.progress=false"]


def sweep(runs: pathlib.Path, overrides: list[str]) -> None:
    """The seeds' multirun into ``runs`` (replaced if it exists)."""
    shutil.rmtree(runs, ignore_errors=True)
    argv = [sys.executable, *COMMAND, f"hydra.sweep.dir={runs}", *overrides]
    print("$ " + " ".join(argv[1:]), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)


def jobs(runs: pathlib.Path) -> tuple[list[tuple[int, dict, list[dict]]], int]:
    """``(seed, summary.json, metrics.jsonl records)`` of each completed job of the sweep, by seed, and the
    batches per epoch (every job trains on the same split: its ``trainer.max_steps`` over ``max_epochs``)."""
    found, per_epoch = [], set()
    for summary_path in sorted(runs.glob("*/summary.json")):
        summary = json.loads(summary_path.read_text())
        if summary.get("status") != "completed":
            raise SystemExit(f"{summary_path.parent}: status {summary.get('status')!r}; see its train.log")
        config = OmegaConf.load(summary_path.parent / "config.yaml")
        epochs = config.trainer.max_epochs
        per_epoch.add(config.trainer.max_steps // epochs if epochs else config.trainer.max_steps)
        found.append((int(config.seed), summary, read_jsonl(summary_path.parent / "metrics.jsonl")))
    if not found:
        raise SystemExit(f"{runs}: no job directories with a summary.json")
    if len(per_epoch) != 1:
        raise SystemExit(f"{runs}: the jobs differ in batches per epoch ({sorted(per_epoch)}): not one port's seeds")
    return sorted(found, key=lambda job: job[0]), per_epoch.pop()


def _pm(values: list[float], digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def seed_table(found: list[tuple[int, dict, list[dict]]], per_epoch: int) -> str:
    """Per seed: the best epoch by val_accuracy, its validation metrics and the test metrics of its checkpoint."""
    keys = ["val_accuracy", "val_loss", "test_accuracy", "test_loss"]
    lines = ["| seed | best epoch (step) | " + " | ".join(keys) + " | plateau_scale at the end |",
             "|---|---|---|---|---|---|---|"]
    for seed, summary, _ in found:
        m, step = summary["metrics"], summary["best_step"]
        lines.append(f"| {seed} | {step // per_epoch} ({step}) | " + " | ".join(f"{m[k]:.4f}" for k in keys)
                     + f" | {m['plateau_scale']:g} |")
    columns = [[summary["metrics"][k] for _, summary, _ in found] for k in keys]
    lines.append(f"| mean ± sd ({len(found)} seeds) |  | " + " | ".join(_pm(c) for c in columns) + " |  |")
    return "\n".join(lines)


def epoch_table(found: list[tuple[int, dict, list[dict]]], per_epoch: int) -> str:
    """The validation metrics after each epoch, mean ± sd over the seeds."""
    curves = [{r["step"]: r for r in records if "val_accuracy" in r} for _, _, records in found]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    lines = ["| epoch | step | val_accuracy | val_loss |", "|---|---|---|---|"]
    for step in steps:
        acc, loss = ([c[step][k] for c in curves] for k in ("val_accuracy", "val_loss"))
        lines.append(f"| {step / per_epoch:g} | {step} | {_pm(acc)} | {_pm(loss)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every seed's run")
    parser.add_argument("--runs", type=pathlib.Path, help="the sweep directory (default: <out>/runs)")
    parser.add_argument("--only-report", action="store_true", help="the tables of the runs already in --runs")
    _common.add_output_args(parser, HERE)
    args = parser.parse_args(argv)
    out = _common.output_dir(parser, args, HERE)
    runs = (args.runs or out / "runs").resolve()
    if not args.only_report:
        sweep(runs, args.overrides)
    found, per_epoch = jobs(runs)
    body = (f"{seed_table(found, per_epoch)}\n\nValidation after each epoch ({per_epoch} batches), mean ± sd over "
            f"the seeds:\n\n{epoch_table(found, per_epoch)}\n\n"
            f"Training time per run (s): {', '.join(str(s['time_s']) for _, s, _ in found)}.\n")
    path = _common.write_study_results(out, "experiments/mnist_port/run.py", body)
    print(f"\n{body}\nwritten: {path}")


if __name__ == "__main__":
    main()
