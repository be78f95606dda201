"""hydra/launcher=vmap against Hydra's basic launcher on the default experiment (issue 14's sweep benchmark).

The default digits experiment (``make train``'s config: MLP 64-256-256-10, clip + AdamW, warmup-cosine,
batch 64, one CPU thread per run as ``trainer.cpu_threads`` says), 200 steps per job, two sweeps:

* ``8 learning rates``: ``optim.chain.adamw.learning_rate=1e-3,2e-3,3e-3,5e-3,7e-3,1e-2,2e-2,3e-2``
* ``16 seeds``: ``seed=0,1,...,15`` (a batch per job: each seed has its own batch order)
* ``8 learning rates, smoke``: the same 8 learning rates on ``experiment=smoke`` (MLP 64-32-10, batch 32,
  synthetic data), where a step is mostly per-op overhead rather than arithmetic: the case vmap speeds up
  on a CPU

Each sweep runs as the user runs it, ``python -m fxtrain.train -m hydra/launcher=<basic|vmap> ...`` in a
fresh process, both launchers in the same rounds (the order alternating), medians over rounds. Columns:

* ``wall s``: the whole command, process start to exit (Python and torch imports, Hydra composing every
  job's config, training, evaluation, checkpoints, summaries).
* ``train s``: the part the launcher changes: the basic launcher's jobs' ``time_s`` summed (each from
  the start of ``fxtrain.train.train`` to its summary: build, 200 steps, evaluation, checkpoint), against
  the vmapped group's ``time_s`` (the same, once for all jobs).
* ``max |diff|``: the largest difference of any job's final ``test_loss``/``loss`` between the launchers.

A second table times what vmap changes, the training steps alone, in this process (interleaved rounds,
one CPU thread as the config says): 8 jobs x 25 steps of the donated ``fx.train_step`` the basic
launcher's runs take, against one call of :func:`fxtrain.sweep.vmapped_steps` (the vmapped group's 25 steps,
as ``train_group`` runs them between two logged steps), per step of all 8 jobs.

Usage:
    python experiments/bench/sweep.py [--rounds 3] [--steps 200] [--step-rounds 20] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LRS = "optim.chain.adamw.learning_rate=1e-3,2e-3,3e-3,5e-3,7e-3,1e-2,2e-2,3e-2"
SWEEPS = {
    "8 learning rates": [LRS],
    "16 seeds": ["seed=" + ",".join(map(str, range(16)))],
    # The overhead-bound case: a tiny MLP (hidden [32], batch 32), logging/eval/checkpoints as the default's.
    "8 learning rates, smoke": ["experiment=smoke", LRS, "trainer.log_every=25", "trainer.eval_every=250",
                                "trainer.checkpoint_every=500"],
}
LAUNCHERS = ("basic", "vmap")
GOAL, FLOOR = 5.0, 3.0  # issue 14: vmap sweep at least 3x (goal 5x) faster than the basic launcher


def command(launcher: str, grid: list[str], steps: int, sweep_dir: Path) -> list[str]:
    return [sys.executable, "-m", "fxtrain.train", "-m", f"hydra/launcher={launcher}", *grid,
            f"trainer.max_steps={steps}", "trainer.progress=false", f"hydra.sweep.dir={sweep_dir}"]


def run(cmd: list[str], cwd: Path) -> tuple[float, float, dict[str, dict]]:
    """Runs one sweep; returns (wall seconds, train seconds, {job: summary.json})."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    sweep_dir = Path(cmd[-1].split("=", 1)[1])
    summaries = {d.name: json.loads((d / "summary.json").read_text())
                 for d in sorted(sweep_dir.iterdir()) if (d / "summary.json").exists()}
    if "hydra/launcher=vmap" in cmd and "as one process" not in proc.stdout:
        raise RuntimeError(f"the vmap launcher did not batch the jobs:\n{proc.stdout[-3000:]}")
    times = [s["time_s"] for s in summaries.values()]
    return wall, (max(times) if "hydra/launcher=vmap" in cmd else sum(times)), summaries


def step_rows(rounds: int) -> list[list]:
    """ms per step of 8 jobs: 8 donated train_steps vs one vmapped step, default and smoke experiments."""
    import torch
    from hydra import compose, initialize_config_dir

    import fxtrain as fx
    from fxtrain import sweep, train as runner

    lrs = [float(v) for v in LRS.split("=", 1)[1].split(",")]
    k, rows = 25, []
    torch.set_num_threads(1)
    for name, overrides in (("default (digits MLP)", []), ("smoke", ["experiment=smoke"])):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfgs = [compose("train", overrides=[*overrides, f"optim.chain.adamw.learning_rate={lr}",
                                                "trainer.device=cpu"]) for lr in lrs]
        runs = [runner.build_run(c, torch.device("cpu")) for c in cfgs]
        data = runs[0][0]
        xs, ys = (torch.stack(t) for t in zip(*(data.train[i] for i in range(k))))
        jobs = [[fx.train_step(runner.loss_function(r[2]), r[5], has_aux=True, donate=True), r[3], r[6], r[4]]
                for r in runs]
        group = [sweep.stack_trees([r[3] for r in runs]), sweep.stack_trees([r[6] for r in runs]),
                 sweep.stack_trees([r[4] for r in runs])]
        hp = sweep.hyperparams({"optim.chain.adamw.learning_rate": lrs})
        run = sweep.vmapped_steps(cfgs[0], runs[0][2], batch_per_job=False)

        def basic():
            for job in jobs:
                step, params, state, buffers = job
                for i in range(k):
                    params, state, _ = step(params, state, (buffers, xs[i], ys[i]))
                job[1:3] = params, state

        def vmapped():
            group[0], group[1], group[2], _ = run(hp, *group, xs, ys)

        times = _common.interleaved({"basic": basic, "vmap": vmapped}, rounds=rounds, warmup=1)
        med = {v: _common.summary(t)["median"] / k for v, t in times.items()}
        rows += [[name, "basic: 8 donated steps", med["basic"], "1.00x"],
                 [name, "vmap: one vmapped step, N=8", med["vmap"], f"{med['basic'] / med['vmap']:.2f}x"]]
        print(f"steps {name}: basic {med['basic']:.2f} ms, vmap {med['vmap']:.2f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-rounds", type=int, default=20)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    steps = step_rows(args.step_rounds)

    walls = {(s, la): [] for s in SWEEPS for la in LAUNCHERS}
    trains = {(s, la): [] for s in SWEEPS for la in LAUNCHERS}
    diffs = {s: 0.0 for s in SWEEPS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            for name, grid in SWEEPS.items():
                finals = {}
                for launcher in (LAUNCHERS if r % 2 == 0 else LAUNCHERS[::-1]):
                    cmd = command(launcher, grid, args.steps, tmp / f"r{r}-{re.sub(r'[^a-z0-9]+', '_', name)}-{launcher}")
                    wall, train, summaries = run(cmd, tmp)
                    walls[name, launcher].append(wall)
                    trains[name, launcher].append(train)
                    finals[launcher] = summaries
                    print(f"round {r} {name:16s} {launcher:5s}: wall {wall:6.2f} s, train {train:6.2f} s", flush=True)
                for job, s in finals["basic"].items():
                    for k in ("test_loss", "loss"):
                        diffs[name] = max(diffs[name], abs(s["metrics"][k] - finals["vmap"][job]["metrics"][k]))

    rows = []
    for name in SWEEPS:
        med = {la: (statistics.median(walls[name, la]), statistics.median(trains[name, la])) for la in LAUNCHERS}
        for la in LAUNCHERS:
            rows.append([name, la, med[la][0], med[la][1],
                         f"{med['basic'][0] / med[la][0]:.2f}x", f"{med['basic'][1] / med[la][1]:.2f}x",
                         f"{diffs[name]:.1e}" if la == "vmap" else ""])
    cmd = shlex.join(["python", "experiments/bench/sweep.py", *sys.argv[1:]])
    text = "\n".join([
        "# hydra/launcher=vmap against the basic launcher",
        "",
        f"Command: `{cmd}` ({args.rounds} rounds, medians; each sweep is "
        f"`python -m fxtrain.train -m hydra/launcher=<basic|vmap> <grid> trainer.max_steps={args.steps} "
        "trainer.progress=false` in a fresh process, the default digits experiment).",
        "",
        _common.table(["sweep", "launcher", "wall s", "train s", "wall speedup", "train speedup", "max |diff|"], rows),
        "",
        f"Goal: {GOAL:g}x, at least {FLOOR:g}x. `wall`: the whole command; `train`: the basic launcher's jobs' "
        "`time_s` summed against the vmapped group's (build, steps, evaluation, checkpoints). `max |diff|`: "
        "the largest difference of a job's final test_loss or loss between the launchers.",
        "",
        "The training steps alone (in one process, one thread, medians of interleaved rounds, ms per step of all "
        "8 learning rates; each call runs 25 steps):",
        "",
        _common.table(["experiment", "variant", "ms per step", "speedup"], steps),
        "",
        "Reading. A vmapped group saves what its jobs repeat per operation (Python, dispatch, kernel launches), "
        "not their arithmetic: the batched matmuls do every job's FLOPs and the optimizer update runs over N "
        "times the state. Profile of one vmapped step (default MLP, N=8, one thread, torch.profiler): the batched "
        "matmuls (forward and backward, 8 jobs x ~32 MFLOP) are about 30% of it, the optimizer's out-of-place "
        "elementwise ops (add, mul, sqrt, addcmul, div over 8 x 85k floats, a new tensor each: the pure path "
        "that vmap needs) about 55%; the basic launcher's donated steps run one fused AdamW kernel in place "
        "instead. Each of those 2 MiB tensors used to be a fresh mmap (zeroed pages); the launcher now has glibc "
        "serve them from the heap (`fxtrain.sweep._reuse_freed_memory`; A/B in one process: 12-14 ms a vmapped "
        "step before, 9.5-10 ms after). What is left is arithmetic and the pure update: in one process (load ~2), "
        "the vmapped gradient alone (`vmap(grad_and_value(loss))`, no optimizer) takes 4.4 ms of a 9.3 ms vmapped "
        "step at N=8, so even a free update would leave the default steps about 2.5x faster than 8 donated "
        "steps (~11 ms), not 5x; vmapping the gradient and running each job's donated update on its slice "
        "measured 10.7 ms (8 unfused clip+AdamW updates cost more than one vmapped one). The smoke MLP's step (2.4k params, batch 32) is mostly per-operation "
        "cost, and one vmapped step replaces 8. Per job with either launcher: process start and imports "
        "(torch, sklearn), Hydra composing every job's config twice (sweeper and launcher), `run_job` "
        "(`.hydra/`, the summary callback), a checkpoint, evaluation; the vmapped group builds every job as "
        "its own run would. Final losses of the learning-rate sweeps differ "
        "by more than float32 rounding only for the largest learning rates, whose runs amplify the last-bit "
        "differences of batched matmuls step after step (relative 1e-7 per step at the start, measured).",
        "",
        _common.environment(),
    ])
    print("\n" + text)
    if not args.no_write:
        print(f"\nwrote {_common.write_result('sweep', text)}")


if __name__ == "__main__":
    main()
