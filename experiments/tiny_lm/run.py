"""A tiny byte-level transformer LM (experiment=tiny_lm), on 1 process and on 2 data-parallel ranks, compared.

    .venv/bin/python experiments/tiny_lm/run.py                       # ~2-3 min on 2 CPU cores
    .venv/bin/python experiments/tiny_lm/run.py trainer.max_steps=80  # overrides go to both runs
    .venv/bin/python experiments/tiny_lm/run.py --only-report         # re-plot runs/1rank and runs/2ranks

Runs the two commands of the README one after the other, into ``runs/1rank`` and ``runs/2ranks``
(git-ignored; an existing run directory is replaced), then writes ``results.md`` (validation loss of both
at every evaluation, and their difference) and ``val_loss.png`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys

from fxtrain.report import read_jsonl

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py
RUNS = {  # run directory: command (after the python interpreter)
    "1rank": ["-m", "fxtrain.train", "experiment=tiny_lm"],
    "2ranks": ["-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "fxtrain.train", "experiment=tiny_lm",
               "parallel=dp", "parallel.shard_optimizer=true"],  # AdamW state sharded over the 2 ranks
}


def run(name: str, overrides: list[str], runs: pathlib.Path) -> None:
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, *RUNS[name], f"hydra.run.dir={out}", *overrides]
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def _summary(runs: pathlib.Path, name: str) -> dict:
    return json.loads((runs / name / "summary.json").read_text())


def table(curves: dict[str, list[dict]]) -> str:
    one = {r["step"]: r for r in curves["1rank"] if "val_loss" in r}
    two = {r["step"]: r for r in curves["2ranks"] if "val_loss" in r}
    lines = ["| batch | optimizer updates | val loss, 1 rank | val loss, 2 ranks (dp, sharded state) | difference |",
             "|---|---|---|---|---|"]
    for step in sorted(set(one) & set(two)):
        a, b = one[step]["val_loss"], two[step]["val_loss"]
        lines.append(f"| {step} | {step // 4} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    styles = {"1rank": dict(color="C0", label="1 process"), "2ranks": dict(color="C3", label="2 ranks, dp + sharded AdamW state")}
    for name, records in curves.items():
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        ax.plot(*zip(*train), color=styles[name]["color"], alpha=0.3, lw=0.8)
        ax.plot(*zip(*val), marker="o" if name == "1rank" else "x", ls="-" if name == "1rank" else "--",
                **{**styles[name], "label": styles[name]["label"] + " (validation)"})
    ax.plot([], [], color="gray", alpha=0.4, label="training loss (micro-batch)")
    ax.set(xlabel="batch (4 per optimizer update)", ylabel="cross-entropy (nats/byte)",
           title="tiny_lm: 2-layer d=64 byte LM, bf16 amp_cast, accumulate(4), AdamW")
    ax.title.set_fontsize(9)
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    parser.add_argument("--only-report", action="store_true", help="table and plot of the runs already there")
    _common.add_output_args(parser, HERE)  # results.md and val_loss.png
    parser.add_argument("--runs", type=pathlib.Path, default=HERE / "runs", help="where the two run directories go")
    args = parser.parse_args(argv)
    args.out = _common.output_dir(parser, args, HERE)
    if not args.only_report:
        for name in RUNS:
            run(name, args.overrides, args.runs.resolve())
    curves = {name: read_jsonl(args.runs / name / "metrics.jsonl") for name in RUNS}
    times = {name: _summary(args.runs, name)["time_s"] for name in RUNS}
    text = table(curves)
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(curves, args.out / "val_loss.png")
    _common.write_study_results(args.out, "experiments/tiny_lm/run.py",
                                f"{text}\n\nWall time: 1 rank {times['1rank']:.0f} s, 2 ranks {times['2ranks']:.0f} s.\n")
    print(f"\n{text}\nwall time (s): {times}\nplot: {png}")


if __name__ == "__main__":
    main()
