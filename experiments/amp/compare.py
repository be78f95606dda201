"""The seeds' AMP table redone with fx.amp_cast: fp32 vs bf16 vs fp16 (dynamic scale) vs naive, one model.

Every preset of ``fx.amp_preset`` trains the same MLP on scikit-learn's digits from the same init, with
the recommended stack ``amp_cast(chain(clip_by_global_norm(1.0), adamw(1e-3)), **amp_preset(name))``:

1. **Training runs**, one subprocess per preset (so peak memory is that preset's alone): ``--steps``
   steps; records peak RSS (and ``torch.cuda.max_memory_allocated`` on CUDA), RSS added by training
   (peak minus the RSS once data, model and stack are built), the final training loss (mean of the last
   20 steps), test loss/accuracy (forward in the policy's compute dtype, loss in float32), skipped steps
   and the final loss scale.
2. **Speed**, all presets in this one process, interleaved (one step of each per round, order rotating;
   ``experiments/bench/_common.py``), so a busy machine slows every preset alike: median ms per step.

Usage:
    .venv/bin/python experiments/amp/compare.py                       # CPU, writes results.md here
    .venv/bin/python experiments/amp/compare.py --device cuda --hidden 4096,4096 --batch 512
    .venv/bin/python experiments/amp/compare.py --steps 50 --rounds 5 --no-write   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain.data import digits
from fxtrain.models import MLP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402

PRESETS = ["off", "bf16", "fp16", "naive_fp16", "pure_bf16", "pure_fp16"]
SEEDS_NAME = {  # the seeds' names for each preset (fxtrain/amp.py's table)
    "off": "fp32 (O0)",
    "bf16": "torch-amp bf16 (O1-like)",
    "fp16": "torch-amp fp16 + GradScaler (O1-like; apex O2 masters)",
    "naive_fp16": "Megatron / ColossalAI naive amp",
    "pure_bf16": "pure half, bf16 (O3-like)",
    "pure_fp16": "pure half, fp16 (apex O3)",
}


def build(name: str, args):
    """(step, params, opt_state, data, policy) for one preset; the same init and batch order for all."""
    torch.manual_seed(0)
    data = digits(batch_size=args.batch, seed=0)
    model = MLP((1, 8, 8), hidden=tuple(args.hidden), num_classes=10).to(args.device)
    apply, params, buffers = fx.functional(model)
    kw = fx.amp_preset(name)
    policy = fx.Policy.parse(kw["policy"])
    params = policy.cast_to_param(params)  # pure presets store half params (no master copy)
    tx = fx.amp_cast(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-3)), **kw)

    def loss_fn(p, batch):
        x, y = batch
        logits, _ = apply(p, buffers, x, train=True)
        return F.cross_entropy(logits.float(), y)  # the loss in float32, as autocast's deny-list does

    step = fx.train_step(loss_fn, tx)
    return step, params, tx.init(params), data, policy, apply, buffers, tx


def batches(data, device):
    i = 0
    while True:
        x, y = data.train[i]
        yield x.to(device), y.to(device)
        i += 1


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def train(name: str, args) -> dict:
    """One preset's training run (meant to run in its own process)."""
    step, params, state, data, policy, apply, buffers, tx = build(name, args)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_start = current_rss_mib()
    losses, skipped = [], 0
    it = batches(data, args.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        params, state, m = step(params, state, next(it))
        losses.append(m["loss"])
        skipped += int(m["skipped"])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    x, y = data.test
    with torch.no_grad():
        logits, _ = apply(policy.cast_to_compute(params), buffers, policy.cast_to_compute(x.to(args.device)),
                          train=False)
        logits = logits.float()
        test_loss = float(F.cross_entropy(logits, y.to(args.device)))
        test_acc = float((logits.argmax(-1) == y.to(args.device)).float().mean())
    tail = [float(v) for v in losses[-20:]]
    return {
        "preset": name, "stack": repr(tx),
        "peak_rss_mib": _common.peak_rss_mib(), "rss_added_mib": _common.peak_rss_mib() - rss_start,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None,
        "steps_per_s_alone": args.steps / seconds,
        "final_train_loss": sum(tail) / len(tail), "test_loss": test_loss, "test_acc": test_acc,
        "skipped": skipped, "final_scale": float(state.loss_scale.scale),
        "first_nonfinite_loss": next((i for i, v in enumerate(losses) if not math.isfinite(float(v))), None),
    }


def timing(args) -> dict[str, dict]:
    """Median ms per step of every preset, interleaved in this process."""
    steps = {}
    for name in args.presets:
        step, params, state, data, *_ = build(name, args)
        it = batches(data, args.device)
        box = [params, state]

        def one(step=step, box=box, it=it):
            box[0], box[1], m = step(box[0], box[1], next(it))
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        steps[name] = one
    times = _common.interleaved(steps, rounds=args.rounds, warmup=3)
    return {name: _common.summary(t) for name, t in times.items()}


def update_timing(args) -> dict[str, dict]:
    """Median ms of the update alone (fixed gradients copied in, the donated kernel), with and without amp_cast.

    What skipping on device instead of a host sync costs: amp_cast copies the inner state and selects
    updates and state elementwise every update, overflow or not.
    """
    torch.manual_seed(0)
    model = MLP((1, 8, 8), hidden=tuple(args.hidden), num_classes=10).to(args.device)
    _, params, _ = fx.functional(model)
    grads = fx.tree.map(torch.randn_like, params)
    inner = lambda: fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-3))  # noqa: E731
    variants = {
        "chain(clip, adamw)": inner(),
        "amp_cast(.., loss_scale='none')": fx.amp_cast(inner(), **fx.amp_preset("bf16")),
        "amp_cast(.., DynamicLossScale())": fx.amp_cast(inner(), **fx.amp_preset("fp16")),
    }
    fns = {}
    for name, tx in variants.items():
        box = [tx.init(params), fx.tree.clone(grads)]

        def one(tx=tx, box=box):
            torch._foreach_copy_(fx.tree.leaves(box[1]), fx.tree.leaves(grads))
            _, box[0] = fx.update_(tx, box[1], box[0], params)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        fns[name] = one
    times = _common.interleaved(fns, rounds=args.rounds * 5, warmup=3)
    return {name: _common.summary(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps per preset")
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",")], default=[2048, 2048])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--presets", type=lambda s: s.split(","), default=PRESETS)
    p.add_argument("--no-write", action="store_true", help="print only")
    _common.add_output_args(p, HERE)  # results.md (results_cuda.md on CUDA)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one training run, JSON on stdout
    args = p.parse_args(argv)
    out = _common.output_dir(p, args, HERE) if not args.worker else None
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(train(args.worker, args)))
        return

    runs = {}
    for name in args.presets:
        cmd = [sys.executable, __file__, "--worker", name] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name}: {runs[name]}", file=sys.stderr)
    speed = timing(args)
    upd = update_timing(args)

    cuda = args.device.startswith("cuda")
    base = speed[args.presets[0]]["median"]
    headers = ["preset", "seeds' name", "peak RSS MiB", "RSS added MiB"] + (["CUDA peak MiB"] if cuda else []) + [
        "ms/step (median, IQR)", "it/s", f"vs {args.presets[0]}", "final train loss", "test loss", "test acc",
        "skipped", "final scale"]
    rows = []
    for name in args.presets:
        r, s = runs[name], speed[name]
        rows.append([f"`{name}`", SEEDS_NAME.get(name, ""), r["peak_rss_mib"], r["rss_added_mib"]]
                    + ([r["cuda_peak_mib"]] if cuda else [])
                    + [f"{s['median']:.1f} ({s['q1']:.1f}-{s['q3']:.1f})", 1e3 / s["median"], base / s["median"],
                       f"{r['final_train_loss']:.4f}", f"{r['test_loss']:.4f}", f"{r['test_acc']:.3f}",
                       r["skipped"], f"{r['final_scale']:g}"])
    params = sum(w * h for w, h in zip([64] + args.hidden, args.hidden + [10])) + sum(args.hidden) + 10
    text = "\n\n".join([
        f"# AMP presets: MLP 64-{'-'.join(map(str, args.hidden))}-10 ({params:,} params) on digits, batch "
        f"{args.batch}, {args.steps} steps, AdamW(1e-3) + clip 1.0, {args.device}",
        _common.table(headers, rows),
        "Update only (fixed gradients, donated kernel, interleaved):\n\n" + _common.table(
            ["update", "median ms", "IQR ms", "vs chain alone"],
            [[f"`{n}`", u["median"], f"{u['q1']:.2f}-{u['q3']:.2f}", u["median"] / upd["chain(clip, adamw)"]["median"]]
             for n, u in upd.items()]),
        "Stacks:\n\n" + "\n".join(f"- `{runs[n]['stack']}`" for n in args.presets),
        f"`vs {args.presets[0]}`: its median ms/step over this row's (> 1 is faster). Memory: one process per "
        "preset; `RSS added` = peak RSS minus the RSS once data, model and optimizer state were built. "
        "Speed: all presets in one process, interleaved over "
        f"{args.rounds} rounds.",
        _common.environment(),
    ])
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / ("results.md" if not cuda else "results_cuda.md")
        path.write_text(text + "\n")
        print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
