"""The recommended stack's step, torch's fused kernel against its foreach kernels (issue 36, item 1).

The DESIGN's recommended stack as the runner builds it for ``experiment=tiny_lm`` (conf/ through
fxtrain/build.py): ``accumulate(amp_cast(chain(clip_by_global_norm(1.0), inject_hyperparams(adamw)(warmup_cosine)),
"bf16"), every=4)``, and the float16 variant (``amp=fp16``: dynamic loss scaling, the overflow decision reaching
the kernel as its ``found_inf``), on step.py's MLP (784-1024-1024-1024-10, batch 128 per micro-batch, float32
master params, CPU). Each variant is timed per window (4 micro-steps, one update), in interleaved rounds in this one
process (_common.py), next to the same stack with its fused mark taken off (``fx.with_traits(tx, fused=None)``:
the foreach kernels every wrapped stack ran before), and the bare ``chain(clip, adamw)`` fused and foreach.

Usage:
    python experiments/bench/step_recommended.py [--rounds 30] [--threads 1] [--clock cpu]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import step  # noqa: E402

import fxtrain as fx  # noqa: E402

EVERY = 4


def recommended(amp: str, fused: bool) -> fx.GradientTransformation:
    lr = fx.warmup_cosine_decay_schedule(0.0, step.LR, warmup_steps=50, decay_steps=1000)
    tx = fx.accumulate(fx.amp_cast(fx.chain(
        fx.clip_by_global_norm(step.MAX_NORM),
        fx.inject_hyperparams(fx.adamw)(learning_rate=lr, weight_decay=step.WEIGHT_DECAY)), amp), every=EVERY)
    return tx if fused else fx.with_traits(tx, fused=None)


def window(fx_step: step.FxStep, feed) -> callable:
    def run():
        for _ in range(EVERY):
            fx_step(next(feed))
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = [(torch.randn(step.BATCH, step.SIZES[0]), torch.randint(0, step.SIZES[-1], (step.BATCH,)))
               for _ in range(64)]
    pairs = {f"accumulate(k={EVERY}) amp_cast({amp}) clip + inject_hyperparams(adamw)": amp for amp in ("bf16", "fp16")}
    fns = {}
    for name, amp in pairs.items():
        for fused in (True, False):
            fns[f"{name}, {'fused' if fused else 'foreach'}"] = window(
                step.FxStep(step.make_model(), True, recommended(amp, fused)), itertools.cycle(batches))
    bare = {"chain(clip, adamw), fused": step.make_tx(),
            "chain(clip, adamw), foreach": fx.with_traits(step.make_tx(), fused=None)}
    for name, tx in bare.items():
        fns[f"{name} (x{EVERY} steps)"] = window(step.FxStep(step.make_model(), True, tx), itertools.cycle(batches))
    load0 = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    stats = {k: _common.summary(v) for k, v in _common.interleaved(fns, rounds=args.rounds, clock=clock).items()}
    rows = [[k, s["median"], f"{s['q1']:.1f}-{s['q3']:.1f}", s["min"]] for k, s in stats.items()]
    ratios = []
    for name in [*pairs, "chain(clip, adamw)"]:
        f = next(k for k in stats if k.startswith(name + ", fused") or k.startswith(name + ", fused ("))
        r = next(k for k in stats if k.startswith(name + ", foreach"))
        ratios.append([name, stats[f]["median"] / stats[r]["median"], stats[f]["min"] / stats[r]["min"]])
    text = "\n\n".join([
        "# The recommended stack's step: fused kernel vs foreach kernels",
        f"Command: `{' '.join(['python experiments/bench/step_recommended.py'] + sys.argv[1:])}`; load average at "
        f"the start: {load0}.",
        f"MLP {'-'.join(map(str, step.SIZES))}, batch {step.BATCH} per micro-batch, float32 master params, CPU; "
        f"milliseconds per window of {EVERY} micro-steps (one update), {args.rounds} interleaved rounds"
        + (" (CPU time of this process)." if args.clock == "cpu" else " (wall time)."),
        _common.table(["variant", "median ms", "IQR ms", "min ms"], rows),
        "Fused / foreach, side by side:",
        _common.table(["stack", "on medians", "on minimums"], ratios),
        _common.environment(),
    ])
    print(text)
    if not args.no_write:
        print(f"\nwritten to {_common.write_result('step_recommended', text)}")


if __name__ == "__main__":
    main()
