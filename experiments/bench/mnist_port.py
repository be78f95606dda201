"""The runner's own cost (issue 36, item 5): pytorch/examples' MNIST three ways, time per epoch.

pytorch/examples' ``mnist/main.py`` (its ``Net``: ``fxtrain.models.ConvNet``; ``Adadelta(lr=1.0)``, ``StepLR(step_size=1,
gamma=0.7)``, batch 64, a ``loss.item()`` every 10 batches, an evaluation after every epoch) on scikit-learn's 8x8
digits, the split ``experiment=examples_mnist`` trains on (``conf/experiment/examples_mnist.yaml``), three ways:

* ``torch loop``: the example's own ``train()`` / ``test()``: ``zero_grad``, forward, ``F.nll_loss``, ``backward``,
  ``optimizer.step()``, ``scheduler.step()`` after each epoch; ``model.eval()`` and ``torch.no_grad()`` for the
  evaluation (validation split, batches of 1000).
* ``fxtrain library``: the same loop with fxtrain as a library: ``fx.functional(model)``, ``fx.adadelta(1.0 x
  fx.exponential_decay(...))``, ``fx.train_step(loss_fn, tx)`` (donated), ``float(metrics["loss"])`` every 10 steps,
  the same evaluation through ``apply(..., train=False)``.
* ``runner``: ``fxtrain.train.train(cfg, run_dir)``, in this process, with ``cfg`` composed from
  ``experiment=examples_mnist trainer.progress=false`` (what ``python -m fxtrain.train experiment=examples_mnist``
  runs): its loop, log lines, validation each epoch, ``checkpoints/best``, ``metrics.jsonl`` into a temporary run
  directory on the same disk.
* ``runner, best saved at each improvement (before)``: the same with ``checkpoints/best`` saved (fsync'ed) at every
  improvement of the validation accuracy, as the runner did before issue 36: what the deferred write saves.

Time per epoch, start-up excluded: each variant stamps the clock when each epoch's first batch starts (the runner's
through a wrapper of ``RunSteps.advance``), and an epoch's time is the next stamp minus its own, so it holds the
epoch's steps, its log lines, its evaluation and whatever the loop does after them (the runner: ``checkpoints/best``
and ``metrics.jsonl``). Epochs 2 .. N-1 count: the first warms up, the last one's end is the end of the run (the
runner's final checkpoint and test pass). Wall clock and this process's CPU time (one thread: waiting for a core
that others hold is not counted). Rounds interleave the three (one whole run of each per round, the order rotating),
and each round gives each variant's median epoch; the ratios are per round (same minutes), then their median.
Besides the epochs, ``in the step`` sums the time inside the training step's calls (the rest of an epoch is
``beyond`` it: batches, log lines, evaluation, the runner's loop and files).

Usage:
    python experiments/bench/mnist_port.py [--rounds 7] [--epochs 14] [--step-rounds 300] [--no-write] [--profile]

Then a table of the training step alone, one layer added per row from the torch loop's step to the runner's, in
interleaved rounds of single calls (CPU time): what the epochs' ``CPU in the step`` is made of.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import copy
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

import fxtrain as fx  # noqa: E402
from fxtrain import build, selection, train as runner  # noqa: E402
from fxtrain.models import ConvNet  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOG_INTERVAL = 10  # the example's --log-interval: a loss.item() every 10 batches
TARGETS = {"runner": 1.05, "fxtrain library": 1.03}  # per epoch, x the torch loop (issue 36, item 5)
BEFORE = "runner, best saved at each improvement (before)"
Stamps = list[tuple[float, float, float, float]]  # at each epoch's start, and at the end: wall, CPU, and the wall
# and CPU seconds spent inside the training step so far (zero_grad .. optimizer.step; fx.train_step's call; the
# runner's built step), so that an epoch splits into its steps and what the loop does beyond them


class StepClock:
    """Sums the wall and CPU seconds spent inside the wrapped step function."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            self.wall += time.perf_counter() - w
            self.cpu += time.process_time() - c
            return out
        return timed

    def stamp(self) -> tuple[float, float, float, float]:
        return time.perf_counter(), time.process_time(), self.wall, self.cpu


def compose(epochs: int, seed: int = 0):
    """``experiment=examples_mnist`` as ``python -m fxtrain.train`` composes it, quiet, ``epochs`` long."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=["experiment=examples_mnist", f"trainer.max_epochs={epochs}",
                                                 "trainer.progress=false", "trainer.heartbeat_s=0", f"seed={seed}"])


def torch_loop(data, epochs: int, seed: int) -> Stamps:
    """pytorch/examples' mnist/main.py: train() and test() each epoch, then scheduler.step()."""
    torch.manual_seed(seed)
    model = ConvNet(tuple(data.train[0][0].shape[1:]))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    per_epoch, stamps, clock = len(data.train), [], StepClock()

    @clock.wrap
    def step(x, y):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    for epoch in range(epochs):
        stamps.append(clock.stamp())
        model.train()
        for batch_idx in range(per_epoch):
            x, y = data.train[epoch * per_epoch + batch_idx]
            loss = step(x, y)
            if batch_idx % LOG_INTERVAL == 0:
                loss.item()
        model.eval()
        x, y = data.validation
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(x), 1000):
                output = model(x[i:i + 1000])
                test_loss += F.nll_loss(output, y[i:i + 1000], reduction="sum").item()
                correct += output.argmax(dim=1).eq(y[i:i + 1000]).sum().item()
        scheduler.step()
    stamps.append(clock.stamp())
    return stamps


def library_loop(data, epochs: int, seed: int) -> Stamps:
    """The same loop with fxtrain as a library: fx.functional, fx.adadelta with a staircase schedule, fx.train_step."""
    torch.manual_seed(seed)
    apply, params, buffers = fx.functional(ConvNet(tuple(data.train[0][0].shape[1:])))
    per_epoch, stamps, clock = len(data.train), [], StepClock()
    tx = fx.adadelta(fx.exponential_decay(1.0, per_epoch, 0.7, staircase=True))

    def loss_fn(params, batch):
        x, y = batch
        output, _ = apply(params, buffers, x, train=True)
        return F.nll_loss(output, y)

    step, opt_state = clock.wrap(fx.train_step(loss_fn, tx)), tx.init(params)
    for epoch in range(epochs):
        stamps.append(clock.stamp())
        for batch_idx in range(per_epoch):
            params, opt_state, metrics = step(params, opt_state, data.train[epoch * per_epoch + batch_idx])
            if batch_idx % LOG_INTERVAL == 0:
                float(metrics["loss"])
        x, y = data.validation
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(x), 1000):
                output, _ = apply(params, buffers, x[i:i + 1000], train=False)
                test_loss += F.nll_loss(output, y[i:i + 1000], reduction="sum").item()
                correct += output.argmax(dim=1).eq(y[i:i + 1000]).sum().item()
    stamps.append(clock.stamp())
    return stamps


def runner_run(epochs: int, seed: int, where: Path, save_at_improvement: bool = False) -> Stamps:
    """``fxtrain.train.train`` on ``experiment=examples_mnist`` into a fresh run directory under ``where``;
    ``save_at_improvement``: ``checkpoints/best`` saved at each improvement, as before issue 36 (``Best.keep``
    followed by ``Best.write``, the reference of tests/test_train_splits.py)."""
    cfg = compose(epochs, seed)
    per_epoch = runner.settle_max_steps(copy.deepcopy(cfg)) // epochs
    stamps: Stamps = []
    clock, advance, build_run, keep = StepClock(), runner.RunSteps.advance, runner.build_run, selection.Best.keep

    def stamped(self, first, end):
        if first % per_epoch == 0:  # the first batch of an epoch
            stamps.append(clock.stamp())
        return advance(self, first, end)

    def timed_build(*args, **kwargs):
        built = build_run(*args, **kwargs)
        return built._replace(step=clock.wrap(built.step))

    def keep_and_save(self, *args, **kwargs):
        keep(self, *args, **kwargs)
        self.write()

    out = Path(tempfile.mkdtemp(prefix="run-", dir=where))
    runner.RunSteps.advance, runner.build_run = stamped, timed_build
    if save_at_improvement:
        selection.Best.keep = keep_and_save
    try:
        with _quiet():
            runner.train(cfg, out)
    finally:
        runner.RunSteps.advance, runner.build_run, selection.Best.keep = advance, build_run, keep
        shutil.rmtree(out, ignore_errors=True)
    return stamps


@contextlib.contextmanager
def _quiet():
    """The run's lines (log.info) not printed: the table is the output."""
    import logging

    logger, level = logging.getLogger("fxtrain"), logging.getLogger("fxtrain").level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def epoch_times(stamps: Stamps) -> list[list[float]]:
    """Per epoch 2 .. N-1 (the first warms up; the last ends with the run's own end): wall, CPU, wall in the step,
    CPU in the step, seconds."""
    inner = stamps[1:-1]
    return [[b[k] - a[k] for a, b in zip(inner, inner[1:])] for k in range(4)]


def variants(data, epochs: int, seed: int, where: Path) -> dict[str, Callable[[], Stamps]]:
    return {"torch loop": lambda: torch_loop(data, epochs, seed),
            "fxtrain library": lambda: library_loop(data, epochs, seed),
            "runner": lambda: runner_run(epochs, seed, where),
            BEFORE: lambda: runner_run(epochs, seed, where, save_at_improvement=True)}


def step_variants(data, epochs: int, seed: int) -> dict[str, Callable[[], None]]:
    """One training step each, from the torch loop's to the runner's, each adding one layer: what the epochs'
    ``CPU in the step`` is made of."""
    cfg = compose(epochs, seed)
    runner.settle_max_steps(cfg)
    built = runner.build_run(cfg, torch.device("cpu"), data=data)
    batches = [data.train[k] for k in range(len(data.train) * 4)]
    at = [0]

    def batch():
        at[0] = (at[0] + 1) % len(batches)
        return batches[at[0]]

    torch.manual_seed(seed)
    model = ConvNet(tuple(batches[0][0].shape[1:]))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)

    def torch_step():
        x, y = batch()
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        optimizer.step()

    def library(tx):
        torch.manual_seed(seed)
        apply, params, buffers = fx.functional(ConvNet(tuple(batches[0][0].shape[1:])))

        def loss_fn(params, b):
            return F.nll_loss(apply(params, buffers, b[0], train=True)[0], b[1])

        state, step = [params, tx.init(params)], fx.train_step(loss_fn, tx)

        def call():
            state[0], state[1], _ = step(state[0], state[1], batch())
        return call

    trees = [built.params, built.opt_state, built.buffers]

    def runner_step():
        trees[0], trees[1], trees[2], _ = built.step(*trees, batch())

    schedule = fx.exponential_decay(1.0, len(data.train), 0.7, staircase=True)
    return {"torch loop: zero_grad, forward, backward, Adadelta.step": torch_step,
            "fx.train_step, fx.adadelta(1.0)": library(fx.adadelta(1.0)),
            "fx.train_step, fx.adadelta(schedule) (the library loop's)": library(fx.adadelta(schedule)),
            "fx.train_step, the runner's stack (inject_hyperparams(adadelta), schedule)": library(built.tx),
            "the runner's built step (+ the task's loss and accuracy, buffers, its wrapper)": runner_step}


def step_table(data, epochs: int, seed: int, rounds: int) -> str:
    """The step variants, ``rounds`` interleaved rounds, CPU time: median ms and x the torch loop's step."""
    times = _common.interleaved(step_variants(data, epochs, seed), rounds=rounds, clock=time.process_time)
    stats = {name: _common.summary(t) for name, t in times.items()}
    ref = next(iter(stats.values()))["median"]
    rows = [[name, s["median"], f"{s['q1']:.2f}-{s['q3']:.2f}", s["median"] / ref] for name, s in stats.items()]
    return _common.table(["one training step (CPU time)", "median ms", "IQR ms", "x torch loop"], rows)


def profile_runner(epochs: int, seed: int, where: Path) -> str:
    """cProfile of one runner run (after a warm-up run): the 25 functions with most cumulative time."""
    runner_run(epochs, seed, where)
    prof = cProfile.Profile()
    prof.enable()
    runner_run(epochs, seed, where)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (each runs every variant once)")
    ap.add_argument("--epochs", type=int, default=14, help="epochs per run (the example's 14)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-rounds", type=int, default=300, help="interleaved rounds of the steps-alone table")
    ap.add_argument("--profile", action="store_true", help="cProfile one runner run instead of timing")
    ap.add_argument("--no-write", action="store_true", help="print only; leave results/mnist_port.md alone")
    args = ap.parse_args()
    if args.epochs < 4:
        ap.error(f"--epochs {args.epochs}: at least 4 (epochs 2 .. N-1 are timed)")
    torch.set_num_threads(1)  # the runner's trainer.cpu_threads=1, for all of them
    where = Path(tempfile.mkdtemp(prefix="mnist_port-"))
    try:
        if args.profile:
            print(profile_runner(args.epochs, args.seed, where))
            return
        cfg = compose(args.epochs, args.seed)
        data = build.dataset(cfg.data, "data")
        load0 = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        fns = variants(data, args.epochs, args.seed, where)
        for fn in fns.values():  # warm-up: imports, first-call paths, the file cache
            fn()
        names = list(fns)
        # per variant, per round: the medians over its epochs of (wall, CPU, wall in the step, CPU in the step), s
        per_round: dict[str, list[list[float]]] = {n: [] for n in names}
        walls: dict[str, list[float]] = {n: [] for n in names}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                columns = epoch_times(fns[name]())
                walls[name] += columns[0]
                per_round[name].append([statistics.median(c) for c in columns])
        elapsed = time.perf_counter() - t0
        steps = step_table(data, args.epochs, args.seed, args.step_rounds)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    text = report(args, data, per_round, walls, load0, elapsed, steps)
    print(text)
    if not args.no_write:
        print(f"written: {_common.write_result('mnist_port', text)}")


def report(args, data, per_round, walls, load0: str, elapsed: float, steps: str) -> str:
    ref = per_round["torch loop"]
    ratio = {n: [a[0] / b[0] for a, b in zip(rows, ref)] for n, rows in per_round.items()}
    cpu_ratio = {n: [a[1] / b[1] for a, b in zip(rows, ref)] for n, rows in per_round.items()}
    med = {n: [statistics.median(r[k] for r in rows) * 1e3 for k in range(4)] for n, rows in per_round.items()}
    rows = []
    for name in per_round:
        q = _common.summary(walls[name])
        wall, cpu, _, step_cpu = med[name]
        rows.append([name, wall, f"{q['q1']:.1f}-{q['q3']:.1f}", cpu, step_cpu, cpu - step_cpu,
                     statistics.median(ratio[name]), statistics.median(cpu_ratio[name]),
                     ", ".join(f"{x:.3f}" for x in ratio[name]), ", ".join(f"{x:.3f}" for x in cpu_ratio[name])])
    verdicts = []
    for name, target in TARGETS.items():
        got, got_cpu = statistics.median(ratio[name]), statistics.median(cpu_ratio[name])
        verdicts.append(f"- {name} / torch loop, per epoch (median of the per-round ratios): wall {got:.3f}, CPU "
                        f"{got_cpu:.3f}; target <= {target}: {'met' if max(got, got_cpu) <= target else '**MISSED**'}")
    if BEFORE in per_round:
        now = [a[0] / b[0] for a, b in zip(per_round["runner"], per_round[BEFORE])]
        now_cpu = [a[1] / b[1] for a, b in zip(per_round["runner"], per_round[BEFORE])]
        saved = [b[0] - a[0] for a, b in zip(per_round["runner"], per_round[BEFORE])]
        verdicts.append(f"- runner / {BEFORE}, per epoch: wall {statistics.median(now):.3f}, CPU "
                        f"{statistics.median(now_cpu):.3f} ({statistics.median(saved) * 1e3:.1f} ms of wall time an "
                        "epoch saved, median of the rounds)")
    per_epoch = len(data.train)
    return "\n\n".join([
        "# The runner's own cost: pytorch/examples' MNIST on digits, three ways (issue 36, item 5)",
        f"Command: `{' '.join(['python experiments/bench/mnist_port.py', *sys.argv[1:]])}` ({elapsed:.0f} s of timed "
        f"rounds); load average at the start: {load0}.",
        f"`fxtrain.models.ConvNet` (pytorch/examples' `Net`, 53,002 params on 1x8x8), Adadelta(lr=1.0), StepLR(gamma=0.7) "
        f"per epoch, batch 64 ({per_epoch} batches an epoch), validation after each epoch ({len(data.validation[0])} "
        f"digits, batches of 1000); {args.epochs} epochs a run, epochs 2..{args.epochs - 1} timed; "
        f"{args.rounds} interleaved rounds; one torch thread; milliseconds per epoch (medians over the rounds of each "
        "round's median epoch). `in the step`: CPU time inside the training step's calls; `beyond`: the rest of the "
        "epoch's CPU time (batches, log lines, evaluation, and for the runner its loop, metrics.jsonl and "
        "checkpoints/best).",
        _common.table(["variant", "wall ms", "wall IQR ms (all epochs)", "CPU ms", "CPU in the step", "CPU beyond",
                       "wall x torch loop", "CPU x torch loop", "wall ratio per round", "CPU ratio per round"], rows),
        "\n".join(verdicts),
        f"The training step alone, from the torch loop's to the runner's, one layer added per row ({args.step_rounds} "
        "interleaved rounds, CPU time of one call, same batches):",
        steps,
        "The ratios are the claim: each round runs the four one after another, so a busy spell of the shared machine "
        "(2 cores, 5 engineers) moves all four; the absolute milliseconds move with the load, the CPU times much "
        "less (one thread: time spent waiting for a core is not counted, an fsync's wait neither).",
        _common.environment(),
    ])


if __name__ == "__main__":
    main()
