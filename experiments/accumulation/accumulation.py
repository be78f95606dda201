"""Gradient accumulation with fx.accumulate and fx.split_backward against one big batch (issue 6).

Two parts:

1. The seeds' demonstration: a small model trained with ``accumulate(sgd, every=4)``; every call
   prints the first elements of a weight, which change only on every 4th call.
2. The table: MLP 784-256-256-10 (ReLU, cross-entropy), ``chain(clip_by_global_norm(1.0),
   adamw(1e-3))``, a batch of B examples per update. For k in {1, 2, 4, 8}:

   * ``one batch``: one ``train_step`` call on the B examples (the reference, the same for every k);
   * ``accumulate``: k calls on B/k examples with ``accumulate(tx, every=k)`` (one update);
   * ``split_backward``: one call on the B examples with ``fx.split_backward(loss_fn, k)``.

   Time per example: interleaved rounds in this process (``experiments/bench/_common.py``), medians.
   Peak memory: params + optimizer state (+ the accumulator), counted from the tensors, plus the peak
   RSS during 3 updates above the RSS between updates (activations, gradients, temporaries), each
   variant in a fresh subprocess after one warm-up update (``MALLOC_MMAP_THRESHOLD_`` fixed so freed
   tensors go back to the OS and RSS follows live memory). The batch itself is not counted.
   A last table: the cost of a held (non-emitting) call's update alone, fx.accumulate against an
   Optax-style MultiSteps written with fxtrain (inner transform on every call, selected with ``where``).

Usage:
    python experiments/accumulation/accumulation.py [--rounds 30] [--batch 4096] [--threads 1] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402

import fxtrain as fx  # noqa: E402

SIZES = (784, 256, 256, 10)
KS = (1, 2, 4, 8)


# --- model ------------------------------------------------------------------------------------------

def make_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"layers": [{"w": torch.randn(n_out, n_in, generator=g) * n_in ** -0.5, "b": torch.zeros(n_out)}
                       for n_in, n_out in zip(SIZES[:-1], SIZES[1:])]}


def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
    x, y = batch
    *hidden, last = params["layers"]
    for layer in hidden:
        x = torch.relu(F.linear(x, layer["w"], layer["b"]))
    return F.cross_entropy(F.linear(x, last["w"], last["b"]), y)


def make_batch(n: int, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g)


def make_tx() -> fx.GradientTransformation:
    return fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-3))


class Variant:
    """One update's worth of work: ``__call__`` runs it (k step calls for accumulate, one otherwise)."""

    def __init__(self, kind: str, k: int, batch_size: int):
        tx, loss, self.calls = make_tx(), loss_fn, 1
        if kind == "accumulate":
            tx, self.calls = fx.accumulate(tx, every=k), k
        elif kind == "split_backward":
            loss = fx.split_backward(loss_fn, k)
        self.params = make_params()
        self.state = tx.init(self.params)
        self.step = fx.train_step(loss, tx)
        x, y = make_batch(batch_size)
        self.batches = list(zip(x.chunk(self.calls), y.chunk(self.calls)))

    def __call__(self):
        for b in self.batches:
            self.params, self.state, _ = self.step(self.params, self.state, b)


# --- 1. the demonstration ------------------------------------------------------------------------------

def demonstration(k: int = 4, calls: int = 9) -> str:
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    tx = fx.accumulate(fx.sgd(0.1), every=k)
    state = tx.init(params)
    step = fx.train_step(lambda p, batch: ((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2).mean(), tx)
    lines = [f"accumulate(sgd(0.1), every={k}): w[0] after each call", ""]
    prev = params["w"][0].clone()
    for i in range(1, calls + 1):
        batch = (torch.randn(4, 3), torch.randn(4, 2))
        params, state, m = step(params, state, batch)
        w0 = params["w"][0]
        what = "UPDATED" if not torch.equal(w0, prev) else "held"
        lines.append(f"call {i}: w[0] = [{w0[0]:+.6f}, {w0[1]:+.6f}]  {what:7s}  "
                     f"mini_step={int(state.mini_step)} emitted={int(m['emitted'])} loss={float(m['loss']):.4f}")
        prev = w0.clone()
    return "\n".join(lines)


# --- 2. time and memory --------------------------------------------------------------------------------

def measure_memory(kind: str, k: int, batch_size: int) -> float:
    """Peak memory (MiB) of one variant in a fresh process: params + optimizer state + the step's peak."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    out = subprocess.run([sys.executable, __file__, "--memory-child", kind, str(k), str(batch_size)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def memory_child(kind: str, k: int, batch_size: int) -> None:
    v = Variant(kind, k, batch_size)
    v()  # one update first: lazy one-time allocations (thread pools, the autograd engine) are not the step's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _status_mib("VmRSS")
    for _ in range(3):
        v()
    state = sum(x.numel() * x.element_size() for x in fx.tree.leaves((v.params, v.state))
                if isinstance(x, torch.Tensor)) / 2 ** 20
    print(json.dumps({"peak_mib": state + _status_mib("VmHWM") - before}))


class OptaxStyle:
    """Optax's MultiSteps written with fxtrain: the inner transform runs on every call, results picked by where."""

    def __init__(self, inner, k, params):
        self.inner, self.k = inner, k
        self.state = (torch.zeros((), dtype=torch.int32), fx.tree.zeros_like(params), inner.init(params))

    def __call__(self, grads, params):
        mini, acc, inner_state = self.state
        fx.tree.add_(fx.tree.leaves(acc), fx.tree.leaves(grads))
        emit = mini == self.k - 1
        mean = fx.tree.map(lambda a: a / self.k, acc)
        updates, new_inner = fx.update_(self.inner, mean, fx.tree.clone(inner_state), params)
        updates = fx.tree.map(lambda u: torch.where(emit, u, 0), updates)
        inner_state = fx.tree.where(emit, new_inner, inner_state)
        fx.tree.scale_(fx.tree.leaves(acc), (~emit).float())
        self.state = ((mini + 1) % self.k, acc, inner_state)
        return updates


def held_call_costs(rounds: int) -> list[list]:
    params = make_params()
    grads = fx.tree.map(torch.randn_like, params)
    big_k = 10 ** 9  # never emits: every call is a held one
    acc_tx = fx.accumulate(make_tx(), every=big_k)
    acc_state = [acc_tx.init(params)]
    optax_style = OptaxStyle(make_tx(), big_k, params)
    full_tx = make_tx()
    full_state = [full_tx.init(params)]

    def fx_held():
        acc_state[0] = fx.update_(acc_tx, fx.tree.clone(grads), acc_state[0], params)[1]

    def optax_held():
        fx.apply_updates_(params, optax_style(fx.tree.clone(grads), params))

    def full_update():
        u, full_state[0] = fx.update_(full_tx, fx.tree.clone(grads), full_state[0], params)
        fx.apply_updates_(params, fx.tree.map(torch.zeros_like, u))  # zero updates: params unchanged

    def copy_only():
        fx.tree.clone(grads)

    times = _common.interleaved({"copy": copy_only, "fx": fx_held, "optax": optax_held, "full": full_update},
                                rounds=rounds * 5, warmup=3)
    copy = _common.summary(times["copy"])["median"]
    rows = [
        ["fx.accumulate, held call (one add into the accumulator)", _common.summary(times["fx"])["median"] - copy],
        ["Optax-style MultiSteps, held call (inner runs, then where)",
         _common.summary(times["optax"])["median"] - copy],
        ["for scale: the emitted update alone (clip + adamw + apply)", _common.summary(times["full"])["median"] - copy],
    ]
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4096, help="examples per update (B)")
    # One thread by default: on a shared, loaded machine two OpenMP threads stall at every barrier, which
    # penalizes many small calls (large k) far more than one big one (measured: 2.8x at k=8, spread 85%).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--memory-child", nargs=3, metavar=("KIND", "K", "BATCH"), help=argparse.SUPPRESS)
    _common.add_output_args(ap, HERE)  # results.md
    args = ap.parse_args(argv)
    out = _common.output_dir(ap, args, HERE) if not args.memory_child else None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        kind, k, b = args.memory_child
        memory_child(kind, int(k), int(b))
        return

    demo = demonstration()
    print(demo, "\n")

    B = args.batch
    variants = {("one batch", 1): Variant("one batch", 1, B)}
    for k in KS:
        variants[("accumulate", k)] = Variant("accumulate", k, B)
        variants[("split_backward", k)] = Variant("split_backward", k, B)
    times = _common.interleaved({f"{kind} {k}": v for (kind, k), v in variants.items()}, rounds=args.rounds,
                                warmup=2)
    us = {name: _common.summary(t)["median"] * 1e3 / B for name, t in times.items()}  # microseconds/example
    spread = sorted((s["q3"] - s["q1"]) / s["median"] for s in map(_common.summary, times.values()))
    mem = {key: measure_memory(key[0], key[1], B) for key in variants}
    base_t, base_m = us["one batch 1"], mem[("one batch", 1)]
    rows = [[k, f"{base_t:.1f}", f"{us[f'accumulate {k}']:.1f} ({us[f'accumulate {k}'] / base_t:.2f}x)",
             f"{us[f'split_backward {k}']:.1f} ({us[f'split_backward {k}'] / base_t:.2f}x)",
             f"{base_m:.0f}", f"{mem[('accumulate', k)]:.0f}", f"{mem[('split_backward', k)]:.0f}"] for k in KS]
    table = _common.table(
        ["k", "one batch of B: us/example", "accumulate, k x B/k: us/example", "split_backward(k): us/example",
         "one batch: peak MiB", "accumulate: peak MiB", "split_backward: peak MiB"], rows)
    held = _common.table(["update work of one call (no forward/backward)", "ms"], held_call_costs(args.rounds))

    report = "\n\n".join([
        "# Gradient accumulation: results",
        _common.environment(),
        f"## The seeds' demonstration\n\n```\n{demo}\n```",
        f"## k micro-batches against one batch (B = {B}, MLP {'-'.join(map(str, SIZES))}, "
        f"clip_by_global_norm(1.0) + adamw(1e-3), float32, eager, {args.rounds} rounds)\n\n{table}\n\n"
        f"Timing spread: interquartile range / median of a variant's update time, median over variants "
        f"{spread[len(spread) // 2]:.0%}, largest {spread[-1]:.0%}.",
        f"## What a held call costs\n\n{held}",
    ])
    print(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
