"""The seeds' ResNet tutorial setups with fxtrain: baseline, clip_by_global_norm(0.1), accumulate(4), amp_cast bf16.

    .venv/bin/python experiments/resnet_clip_accumulate/run.py                  # ~1.5 min on 2 CPU cores
    .venv/bin/python experiments/resnet_clip_accumulate/run.py --only-report runs/<stamp>   # re-plot a sweep

1. The accumulation check, printed as in the seeds' accumulation chapter: the ResNet of
   ``experiment=resnet_accumulate`` trained batch by batch, the first elements of a parameter printed after
   every iteration; they change on every 4th iteration only.
2. The four variants x 3 seeds as one Hydra multirun (``conf/experiment/resnet_*.yaml``) into
   ``runs/<stamp>/`` (git-ignored), with ``summary.csv`` there.
3. ``results.md`` (the check's printout and the table) and ``loss_curves.png`` (every variant in one plot),
   written next to this file.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import fxtrain as fx
from fxtrain import build, report, train as runner

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py
VARIANTS = {  # label: experiment config
    "baseline": "resnet_baseline",
    "clip_by_global_norm(0.1)": "resnet_clip",
    "accumulate(every=4)": "resnet_accumulate",
    "amp_cast bf16": "resnet_bf16",
}


# --- 1. the accumulation check ---------------------------------------------------------------------

def accumulation_check(iterations: int = 9, param: str = "head.weight") -> str:
    """Trains ``experiment=resnet_accumulate`` for a few batches; after each one prints ``param[0, :4]``."""
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=resnet_accumulate", "trainer.device=cpu"])
    torch.manual_seed(cfg.seed)
    data = build.instantiate(cfg.data, "data")
    apply, params, buffers = fx.functional(build.model(cfg))
    tx = build.stack(cfg)
    opt_state = tx.init(params)

    def loss_fn(params, batch):  # the training script's loss (fxtrain/train.py)
        buffers, x, y = batch
        logits, buffers = apply(params, buffers, x, train=True)
        return F.cross_entropy(logits, y), buffers

    step = fx.train_step(loss_fn, tx, has_aux=True)
    lines = [f"stack: {tx!r}", f"{param}[0, :4] after each iteration (batch of {cfg.data.batch_size}):"]
    before = params[param][0, :4].clone()
    for i in range(1, iterations + 1):
        params, opt_state, metrics = step(params, opt_state, (buffers, *data.train[i - 1]))
        buffers = metrics["aux"]
        now = params[param][0, :4]
        changed = "UPDATED" if not torch.equal(now, before) else "held"
        values = ", ".join(f"{v:+.6f}" for v in now.tolist())
        lines.append(f"iteration {i}: [{values}]  {changed:7s} emitted={int(metrics['emitted'])} "
                     f"loss={float(metrics['loss']):.4f}")
        before = now.clone()
    return "\n".join(lines)


# --- 2. the sweep ------------------------------------------------------------------------------------

def sweep(overrides: list[str], sweep_dir: pathlib.Path | None = None, seeds: str = "0,1,2") -> pathlib.Path:
    """The four variants x ``seeds`` as one multirun into ``sweep_dir`` (default ``runs/<stamp>``); returns it."""
    sweep_dir = sweep_dir or HERE / "runs" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    try:
        runner.main(["-m", "experiment=" + ",".join(VARIANTS.values()), f"seed={seeds}", f"hydra.sweep.dir={sweep_dir}",
                     *overrides])
    except SystemExit as e:  # Hydra exits on a failed job; the others' results are still there
        print(f"sweep ended with {e.code!r}", file=sys.stderr)
    return sweep_dir


# --- 3. table and plot -------------------------------------------------------------------------------

def _jobs(sweep_dir: pathlib.Path) -> dict[str, list[tuple[dict, list[dict]]]]:
    """``{label: [(collect() row, metrics.jsonl records) per seed]}`` in VARIANTS order."""
    labels = {v: k for k, v in VARIANTS.items()}
    out: dict[str, list] = {}
    for row in report.collect(sweep_dir):
        label = labels.get(row.get("experiment"), row.get("experiment"))
        out.setdefault(label, []).append((row, report.read_jsonl(sweep_dir / str(row["job"]) / "metrics.jsonl")))
    return {k: out[k] for k in [*VARIANTS, *out] if k in out}


def _mean_sd(values: list[float]) -> str:
    if not values:
        return ""
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def table(jobs: dict) -> str:
    lines = ["| variant | optimizer updates | seeds | train loss, last 50 batches | test_loss | test_accuracy | "
             "batches clipped | time per run (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, runs in jobs.items():
        done = [(row, records) for row, records in runs if row["status"] == "completed"]
        steps = int(done[0][0].get("step", 0)) if done else 0
        every = 4 if "accumulate" in label else 1
        train = [statistics.fmean(r["loss"] for r in records if "loss" in r and r["step"] > steps - 50)
                 for _, records in done]
        clipped = ""
        if "clip" in label:  # grad_norm is logged every trainer.log_every batches: the share of those above the bound
            norms = [r["grad_norm"] for _, records in done for r in records if "grad_norm" in r]
            clipped = f"{sum(n > 0.1 for n in norms) / len(norms):.0%} (median norm {statistics.median(norms):.2f})"
        times = [row["time_s"] for row, _ in done]
        lines.append(f"| {label} | {steps // every} | {len(done)} of {len(runs)} | {_mean_sd(train)} | "
                     f"{_mean_sd([row['test_loss'] for row, _ in done])} | "
                     f"{_mean_sd([row['test_accuracy'] for row, _ in done])} | {clipped} | "
                     f"{statistics.fmean(times):.1f} |" if done else f"| {label} | | 0 of {len(runs)} | | | | | |")
    return "\n".join(lines)


def plot(jobs: dict, path: pathlib.Path) -> pathlib.Path:
    """Training loss and test accuracy against batches, every variant in one figure (each variant's first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, runs in jobs.items():
        records = runs[0][1]
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_accuracy"]) for r in records if "val_accuracy" in r]
        if train:
            ax_loss.plot(*zip(*train), label=label, lw=1.2)
        if val:
            ax_acc.plot(*zip(*val), label=label, marker=".")
    ax_loss.set(xlabel="batch", ylabel="training loss (batch mean)", yscale="log", title="training loss (seed 0)")
    ax_acc.set(xlabel="batch", ylabel="validation accuracy", title="validation accuracy, 270 digits (seed 0)")
    ax_acc.set_ylim(0.8, 1.0)
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    ax_acc.legend(fontsize=8, loc="lower right")
    fig.suptitle("ResNet + BatchNorm on 8x8 digits, SGD(0.9) + wd 5e-4, cosine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every variant (trainer.max_steps=...)")
    parser.add_argument("--only-report", type=pathlib.Path, metavar="SWEEP_DIR", help="table and plot of a finished sweep")
    _common.add_output_args(parser, HERE)  # results.md and loss_curves.png
    parser.add_argument("--seeds", default="0,1,2", help="seeds of every variant (default 0,1,2)")
    args = parser.parse_args(argv)
    args.out = _common.output_dir(parser, args, HERE)

    check = accumulation_check()
    print(check)
    sweep_dir = args.only_report or sweep(args.overrides, seeds=args.seeds)
    jobs = _jobs(sweep_dir)
    text = table(jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(jobs, args.out / "loss_curves.png")
    _common.write_study_results(args.out, "experiments/resnet_clip_accumulate/run.py",
                                f"{text}\n\nThe accumulation check:\n\n```\n{check}\n```\n", source=sweep_dir.name)
    print(f"\n{text}\ncurves: {png}")


if __name__ == "__main__":
    main()
