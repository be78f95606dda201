"""hydra/launcher=vmap against Hydra's basic launcher on the default experiment (issues 14 and 28).

The default digits experiment (``make train``'s config: MLP 64-256-256-10, clip + AdamW, warmup-cosine,
batch 64, one CPU thread per process as ``trainer.cpu_threads`` says, for both launchers; ``--threads 2``: both
cores), two sweeps:

* ``8 lrs x 200 steps``: ``optim.chain.adamw.learning_rate=1e-3,2e-3,3e-3,5e-3,7e-3,1e-2,2e-2,3e-2`` (goal: 2x)
* ``16 jobs (8 lrs x 2 seeds) x 1000 steps``: the same learning rates, ``seed=0,1`` (goal: 3x)

Each sweep runs as the user runs it, ``python -m fxtrain.train -m hydra/launcher=<basic|vmap> ...`` in a
fresh process, both launchers in the same rounds (the order alternating), medians over rounds. Columns:

* ``wall s``: the whole command, process start to exit (Python and torch imports, Hydra composing every
  job's config, training, evaluation, checkpoints, summaries).
* ``train s``: the part the launcher changes: the basic launcher's jobs' ``time_s`` summed (each from
  the start of ``fxtrain.train.train`` to its summary: build, steps, evaluation, checkpoints), against
  the vmapped groups' ``time_s`` (the same, once per group).
* ``rel diff, steps <= 30``: the largest relative difference of any logged metric of any job between the
  launchers over the first 30 steps (the launcher test's bar: 2e-5); ``max |diff| final``: of the final
  ``val_loss``/``test_loss`` (large learning rates amplify float32 rounding over hundreds of steps).
* ``vmap, compile``: ``hydra.launcher.compile=true``, its compilation included.

A second table times the training step alone, in this process (interleaved rounds, one CPU thread): 8 jobs
of the donated ``fx.train_step`` the basic launcher's runs take, against the vmapped group's step
(:func:`fxtrain.sweep.vmapped_steps`, eager and ``compile=True``, 25 steps a call as ``train_group`` runs them),
per step of all 8 jobs, beside the arithmetic bound: the 8 models' forward and backward FLOPs over the
matmul throughput measured in the same process (a batched matmul of the MLP's widest layer). Then what the
fixed costs of a group are: the vmapped evaluation of 8 jobs against 8 evaluations, the dataset built once
against once per job, and the seconds the compiled step takes to compile.

Usage:
    python experiments/bench/sweep.py [--rounds 1] [--step-rounds 20] [--no-compile] [--no-write]
        [--sweeps "8 lrs x 200 steps"] [--launchers basic,vmap] [--no-steps]
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
SWEEPS = {  # name: (grid, steps, goal: vmap's wall speedup, issue 28)
    "8 lrs x 200 steps": ([LRS], 200, 2.0),
    "16 jobs (8 lrs x 2 seeds) x 1000 steps": ([LRS, "seed=0,1"], 1000, 3.0),
}
# The launchers: Hydra's basic one and the vmap launcher (eager, its default; experiments/gpu/check.py runs these
# two), and in this script's tables also the vmap launcher compiled (hydra.launcher.compile=true).
LAUNCHERS = {"basic": ["hydra/launcher=basic"], "vmap": ["hydra/launcher=vmap"]}
VARIANTS = {**LAUNCHERS, "vmap, compile": ["hydra/launcher=vmap", "hydra.launcher.compile=true"]}
FINALS = ("val_loss", "test_loss")
EARLY = 30  # the launcher test's horizon: its bar (relative 2e-5) holds over the first 30 steps


def early_diff(a: list[dict], b: list[dict]) -> float:
    """The largest relative difference of any logged float of two jobs' metrics.jsonl lines up to step EARLY."""
    pairs = [(x[k], y[k]) for x, y in zip(a, b) if x["step"] <= EARLY for k in x if k not in ("step", "time_s")]
    return max((abs(u - v) / max(abs(u), 1e-6) for u, v in pairs), default=0.0)


def command(launcher: str, grid: list[str], steps: int, sweep_dir: Path, threads: int = 1) -> list[str]:
    return [sys.executable, "-m", "fxtrain.train", "-m", *VARIANTS[launcher], *grid,
            f"trainer.max_steps={steps}", f"trainer.cpu_threads={threads}", "trainer.progress=false",
            f"hydra.sweep.dir={sweep_dir}"]


def run(cmd: list[str], cwd: Path) -> tuple[float, float, dict[str, dict]]:
    """Runs one sweep; returns (wall seconds, train seconds, {job: summary.json})."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    sweep_dir = Path(cmd[-1].split("=", 1)[1])
    summaries = {d.name: {**json.loads((d / "summary.json").read_text()),
                          "records": [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]}
                 for d in sorted(sweep_dir.iterdir()) if (d / "summary.json").exists()}
    if "hydra/launcher=vmap" in cmd and "as one process" not in proc.stdout:
        raise RuntimeError(f"the vmap launcher did not batch the jobs:\n{proc.stdout[-3000:]}")
    times = [s["time_s"] for s in summaries.values()]
    # A vmapped group's jobs share one time_s: count each group once.
    return wall, (sum(set(times)) if "hydra/launcher=vmap" in cmd else sum(times)), summaries


def step_rows(rounds: int, compile: bool, threads: int = 1) -> tuple[list[list], list[list]]:  # noqa: A002
    """ms per step of 8 jobs (donated, vmapped, vmapped compiled, the arithmetic bound), and the fixed costs."""
    import torch
    from hydra import compose, initialize_config_dir

    import fxtrain as fx
    from fxtrain import build, sweep, train as runner

    lrs = [float(v) for v in LRS.split("=", 1)[1].split(",")]
    k, n = 25, len(lrs)
    torch.set_num_threads(threads)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfgs = [compose("train", overrides=[f"optim.chain.adamw.learning_rate={lr}", "trainer.device=cpu"])
                for lr in lrs]
    build.dataset(cfgs[0].data, "digits")  # imports (sklearn) paid once by either launcher
    t = time.perf_counter()
    data = build.dataset(cfgs[0].data, "digits")
    data_s = time.perf_counter() - t
    runs = [runner.build_run(c, torch.device("cpu"), data=data) for c in cfgs]
    xs, ys = (torch.stack(t) for t in zip(*(data.train[i] for i in range(k))))
    jobs = [[r.step, r.params, r.opt_state, r.buffers] for r in runs]
    states = [fx.TrainState(0, r.params, r.opt_state, fx.rng_state(), r.buffers) for r in runs]
    hp = sweep.hyperparams({"optim.chain.adamw.learning_rate": lrs})
    groups = {"vmap": sweep.GroupSteps(cfgs[0], runs, states, hp, shared_data=True),
              "vmap, update under vmap": sweep.GroupSteps(cfgs[0], runs, states, hp, shared_data=True, kernels=False)}
    compile_s = None
    if compile:
        groups["vmap, compile=True"] = sweep.GroupSteps(cfgs[0], runs, states, hp, shared_data=True, compile=True)
        t = time.perf_counter()
        groups["vmap, compile=True"].advance(0, 1)
        groups["vmap, compile=True"].evaluate(1, 0, [])
        compile_s = time.perf_counter() - t

    def basic():
        for job in jobs:
            step, params, state, buffers = job
            for i in range(k):
                params, state, buffers, _ = step(params, state, buffers, (xs[i], ys[i]))
            job[1:] = params, state, buffers

    fns = {"basic": basic, **{name: (lambda g=g: g.advance(0, k)) for name, g in groups.items()}}
    # The arithmetic bound: forward + backward = 3x the forward's 2*B*in*out FLOPs per layer, 8 models, at the
    # matmul throughput of the widest layer batched over the 8 jobs (what the vmapped step runs).
    widths = [64, *cfgs[0].model.hidden, 10]
    flops = n * 3 * sum(2 * xs.shape[1] * a * b for a, b in zip(widths, widths[1:]))
    a, b = torch.randn(n, xs.shape[1], widths[1]), torch.randn(n, widths[1], widths[2])
    fns["matmul"] = lambda: [torch.bmm(a, b) for _ in range(k)]
    times = _common.interleaved(fns, rounds=rounds, warmup=1)
    med = {v: _common.summary(t)["median"] / k for v, t in times.items()}
    gflops = 2 * n * xs.shape[1] * widths[1] * widths[2] / (med["matmul"] * 1e-3) / 1e9
    bound = flops / (gflops * 1e9) * 1e3
    rows = [[f"basic: {n} donated steps", med["basic"], "1.00x", f"{med['basic'] / bound:.1f}x"]]
    rows += [[f"{name}: one vmapped step, N={n}", med[name], f"{med['basic'] / med[name]:.2f}x",
              f"{med[name] / bound:.1f}x"] for name in groups]
    rows.append([f"arithmetic bound: {flops / 1e6:.0f} MFLOP at {gflops:.1f} GFLOP/s (bmm)", bound, "", "1.0x"])
    for row in rows:
        print("steps", row, flush=True)

    # Fixed costs a group pays once: evaluation (one vmapped call against one per job) and the dataset.
    group = groups["vmap"]
    evals = _common.interleaved({
        "per job": lambda: [runner.evaluate_run(r, sweep.pick(group.params, j), sweep.pick(group.buffers, j), 0, [],
                                                cfgs[0].trainer.eval_batch_size) for j, r in enumerate(runs)],
        "vmapped": group.evaluate_all}, rounds=rounds, warmup=1)
    ev = {v: _common.summary(t)["median"] for v, t in evals.items()}
    fixed = [[f"evaluation of {n} jobs (validation split, {len(data.validation[1])} examples)",
              f"{ev['per job']:.1f} ms ({n} calls)", f"{ev['vmapped']:.1f} ms (one vmapped call)",
              f"{ev['per job'] - ev['vmapped']:.1f} ms per evaluation"],
             [f"dataset (digits) for {n} jobs", f"{n * data_s * 1e3:.0f} ms ({n} builds)",
              f"{data_s * 1e3:.0f} ms (once)", f"{(n - 1) * data_s * 1e3:.0f} ms per group"]]
    if compile_s is not None:
        fixed.append([f"compiling the vmapped step and evaluation (N={n})", "0 (eager)", f"{compile_s:.1f} s",
                      f"-{compile_s:.1f} s per process (inductor's cache warm or cold as found)"])
    for row in fixed:
        print("fixed", row, flush=True)
    return rows, fixed


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--step-rounds", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="leave the compiled step out of the step table")
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help="which sweeps, comma-separated names")
    parser.add_argument("--launchers", default=",".join(VARIANTS), help="which launchers (basic first)")
    parser.add_argument("--no-steps", action="store_true", help="leave the step table out")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="trainer.cpu_threads of both launchers")
    args = parser.parse_args()
    for name in set(SWEEPS) - set(args.sweeps.split(",")):
        del SWEEPS[name]
    for name in set(VARIANTS) - set(args.launchers.split(",")):
        del VARIANTS[name]
    loads = [f"start {load()}"]
    steps, fixed = ([], []) if args.no_steps else step_rows(args.step_rounds, compile=not args.no_compile,
                                                                 threads=args.threads)
    loads.append(f"after the step table {load()}")

    walls = {(s, la): [] for s in SWEEPS for la in VARIANTS}
    trains = {(s, la): [] for s in SWEEPS for la in VARIANTS}
    diffs = {(s, la): 0.0 for s in SWEEPS for la in VARIANTS}
    early = {(s, la): 0.0 for s in SWEEPS for la in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            for name, (grid, n_steps, _) in SWEEPS.items():
                finals = {}
                for launcher in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                    where = re.sub(r'[^a-z0-9]+', '_', f"r{r}-{name}-{launcher}")
                    cmd = command(launcher, grid, n_steps, tmp / where, args.threads)
                    wall, train, summaries = run(cmd, tmp)
                    walls[name, launcher].append(wall)
                    trains[name, launcher].append(train)
                    finals[launcher] = summaries
                    print(f"round {r} {name}: {launcher:13s} wall {wall:6.2f} s, train {train:6.2f} s, load {load()}",
                          flush=True)
                for la, job in ((la, job) for la in finals for job in finals["basic"]):
                    a, b = finals["basic"][job], finals[la][job]
                    diffs[name, la] = max(diffs[name, la], *(abs(a["metrics"][k] - b["metrics"][k]) for k in FINALS))
                    early[name, la] = max(early[name, la], early_diff(a["records"], b["records"]))
            loads.append(f"after round {r} {load()}")

    rows = []
    for name, (_, _, goal) in SWEEPS.items():
        med = {la: (statistics.median(walls[name, la]), statistics.median(trains[name, la])) for la in VARIANTS}
        for la in VARIANTS:
            speed = med["basic"][0] / med[la][0]
            rows.append([name, la, med[la][0], med[la][1], f"{speed:.2f}x", f"{med['basic'][1] / med[la][1]:.2f}x",
                         f"{goal:g}x ({'met' if speed >= goal else f'missed by {goal / speed:.2f}x'})"
                         if la != "basic" else "", f"{early[name, la]:.1e}" if la != "basic" else "",
                         f"{diffs[name, la]:.1e}" if la != "basic" else ""])
    cmd = shlex.join(["python", "experiments/bench/sweep.py", *sys.argv[1:]])
    text = "\n".join([
        "# hydra/launcher=vmap against the basic launcher",
        "",
        f"Command: `{cmd}` ({args.rounds} round(s), medians; each sweep is `python -m fxtrain.train -m "
        f"hydra/launcher=<basic|vmap> <grid> trainer.max_steps=<steps> trainer.cpu_threads={args.threads} "
        "trainer.progress=false` "
        "in a fresh process, the default digits experiment, the same thread count for both launchers).",
        "",
        _common.table(["sweep", "launcher", "wall s", "train s", "wall speedup", "train speedup", "goal",
                       f"rel diff, steps <= {EARLY}", "max |diff| final val/test loss"], rows),
        "",
        "`wall`: the whole command; `train`: the basic launcher's jobs' `time_s` summed against the vmapped "
        "groups' (build, steps, evaluation, checkpoints). `rel diff, steps <= 30`: the largest relative difference "
        "of any logged metric of any job between the launchers over the first 30 steps (the launcher test's bar: "
        "2e-5); `max |diff| final`: the largest absolute difference of a job's final val_loss or test_loss.",
        "",
        f"The training step alone (one process, {args.threads} thread(s), medians of interleaved rounds, ms per step "
        "of all 8 learning rates; each call runs 25 steps), against the arithmetic bound of 8 models' forward and backward:",
        "",
        _common.table(["variant", "ms per step", "speedup", "x the bound"], steps),
        "",
        "Fixed costs a vmapped group pays once instead of once per job:",
        "",
        _common.table(["what", "per job", "per group", "saved"], fixed),
        "",
        "Load average (1, 5, 15 min): " + "; ".join(loads) + ".",
        "",
        _common.environment(),
    ])
    print("\n" + text)
    if not args.no_write:
        print(f"\nwrote {_common.write_result('sweep', text)}")


if __name__ == "__main__":
    main()
