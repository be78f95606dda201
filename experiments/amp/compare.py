"""The seeds' AMP table redone with fx.amp_cast: fp32 vs bf16 vs fp16 (dynamic scale) vs naive, one model.

Every preset of ``fx.amp_preset`` trains the same model from the same init on the same batches, with the
recommended stack ``amp_cast(chain(clip_by_global_norm(1.0), adamw(1e-3)), **amp_preset(name))`` around
an MLP on scikit-learn's digits, or, with ``--experiment NAME``, as ``python -m fxtrain.train
experiment=NAME amp=<preset>`` builds it (the runner's data, model, stack and step; ``--override`` adds
Hydra overrides, e.g. ``model.width=64``):

1. **Training runs**, one subprocess per preset (so peak memory is that preset's alone; ``--in-process``
   trains them one after another in this process instead, where only ``torch.cuda.max_memory_allocated``
   stays per preset): ``--steps`` steps; records peak RSS (and the CUDA peak on CUDA), RSS added by
   training (peak minus the RSS once data, model and stack are built), the final training loss (mean of
   the last 20 steps), test loss/accuracy, skipped steps and the final loss scale.
2. **Speed**, all presets in this one process, interleaved (one step of each per round, order rotating;
   ``experiments/bench/_common.py``), so a busy machine slows every preset alike: median ms per step.

Usage:
    .venv/bin/python experiments/amp/compare.py --write               # CPU, replaces results.md here
    .venv/bin/python experiments/amp/compare.py --device cuda --hidden 4096,4096 --batch 512 --write
    .venv/bin/python experiments/amp/compare.py --steps 50 --rounds 5 --no-write   # a quick look
    .venv/bin/python experiments/amp/compare.py --experiment tiny_lm --steps 40 --rounds 5 --no-write
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import fxtrain as fx
from fxtrain import train as runner
from fxtrain.data import digits
from fxtrain.models import MLP, count_params

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


class Workload(NamedTuple):
    """One preset, built and ready to train."""

    step: Callable[[tuple, Any], tuple[tuple, dict]]  #: ``step(carry, batch) -> (carry, metrics)``, donated
    carry: tuple  #: what the step threads: ``(params, opt_state)``, and the buffers for an experiment
    batches: Iterator  #: the training batches in order, on the device
    test: Callable[[tuple], dict]  #: ``test(carry) -> {"test_loss": ..., "test_accuracy": ...}``
    stack: str  #: the stack's repr


def build(name: str, args) -> Workload:
    """Preset ``name`` on the MLP, or on ``--experiment``; the same init and batch order for all presets."""
    return (_experiment if args.experiment else _mlp)(name, args)


def _mlp(name: str, args) -> Workload:
    torch.manual_seed(0)
    data = digits(batch_size=args.batch, seed=0).to(args.device)
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

    train_step = fx.train_step(loss_fn, tx)

    def step(carry, batch):
        params, state, metrics = train_step(*carry, batch)
        return (params, state), metrics

    def test(carry):  # forward in the policy's compute dtype, loss in float32
        x, y = data.test
        with torch.no_grad():
            logits = apply(policy.cast_to_compute(carry[0]), buffers, policy.cast_to_compute(x), train=False)[0].float()
        return {"test_loss": float(F.cross_entropy(logits, y)), "test_accuracy": float((logits.argmax(-1) == y).float().mean())}

    return Workload(step, (params, tx.init(params)), iter(data.train), test, repr(tx))


def _experiment(name: str, args) -> Workload:
    """What ``python -m fxtrain.train experiment=<args.experiment> amp=<name> <args.override>`` trains."""
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={args.experiment}", f"amp={name}",
                                          f"trainer.device={args.device}", *args.override])
    built = runner.build_run(cfg, torch.device(args.device))

    def step(carry, batch):
        params, state, buffers, metrics = built.step(*carry, batch)
        return (params, state, buffers), metrics

    def test(carry):  # the runner's evaluation: in the params' dtype (float32 masters for the mixed presets)
        params, _, buffers = carry
        return built.evaluate(params, buffers, built.data.test, cfg.trainer.eval_batch_size)

    return Workload(step, (built.params, built.opt_state, built.buffers), iter(built.data.train), test,
                    repr(built.tx))


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def train(name: str, args) -> dict:
    """One preset's training run (in its own process, or in this one with ``--in-process``)."""
    w = build(name, args)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_start = current_rss_mib()
    carry, history = w.carry, []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        carry, m = w.step(carry, next(w.batches))
        history.append(m)  # 0-dim tensors: read after the clock stops, so no step waits for the host
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    losses = [float(m["loss"]) for m in history]
    tail = losses[-20:]
    test = w.test(carry)
    return {
        "preset": name, "stack": w.stack, "params": count_params(carry[0]),
        "peak_rss_mib": _common.peak_rss_mib(), "rss_added_mib": _common.peak_rss_mib() - rss_start,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None,
        "steps_per_s_alone": args.steps / seconds,
        "final_train_loss": sum(tail) / len(tail), "test_loss": test["test_loss"],
        "test_acc": test.get("test_accuracy", float("nan")),
        "skipped": sum(int(m.get("skipped", 0)) for m in history),
        "final_scale": float(history[-1].get("loss_scale", 1.0)),
        "first_nonfinite_loss": next((i for i, v in enumerate(losses) if not math.isfinite(v)), None),
    }


def timing(args) -> dict[str, dict]:
    """Median ms per step of every preset, interleaved in this process."""
    steps = {}
    for name in args.presets:
        w = build(name, args)
        box = [w.carry]

        def one(w=w, box=box):
            box[0], _ = w.step(box[0], next(w.batches))
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps per preset")
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    p.add_argument("--hidden", type=lambda s: [int(v) for v in s.split(",")], default=[2048, 2048],
                   help="the MLP's hidden widths")
    p.add_argument("--batch", type=int, default=128, help="the MLP's batch")
    p.add_argument("--experiment", help="a conf/experiment config (resnet_baseline, tiny_lm) instead of the MLP")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override for --experiment (repeatable)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--presets", type=lambda s: s.split(","), default=PRESETS)
    p.add_argument("--in-process", action="store_true",
                   help="train every preset in this process (no per-preset RSS; the CUDA peak stays per preset)")
    p.add_argument("--no-write", action="store_true", help="print only")
    _common.add_output_args(p, HERE)  # results.md (results_cuda.md on CUDA)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one training run, JSON on stdout
    return p


def measure(args, argv: list[str]) -> tuple[dict, dict, dict]:
    """``(runs, speed, update)``: every preset's training run, the interleaved step times and, for the MLP,
    the update-only times. ``argv``: the command line, passed on to the worker processes."""
    runs = {}
    for name in args.presets:
        if args.in_process:
            runs[name] = train(name, args)
            gc.collect()  # the previous preset's trees, before the next one's peak is measured
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        else:
            cmd = [sys.executable, __file__, "--worker", name, *argv]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name] = json.loads(out.strip().splitlines()[-1])
        print(f"{name}: {runs[name]}", file=sys.stderr)
    return runs, timing(args), (update_timing(args) if not args.experiment else {})


def report(args, runs: dict, speed: dict, upd: dict) -> str:
    """The markdown report of :func:`measure`'s results."""
    cuda = args.device.startswith("cuda")
    rss = not args.in_process
    base = speed[args.presets[0]]["median"]
    headers = (["preset", "seeds' name"] + (["peak RSS MiB", "RSS added MiB"] if rss else [])
               + (["CUDA peak MiB"] if cuda else [])
               + ["ms/step (median, IQR)", "it/s", f"vs {args.presets[0]}", "final train loss", "test loss", "test acc",
                  "skipped", "final scale"])
    rows = []
    for name in args.presets:
        r, s = runs[name], speed[name]
        rows.append([f"`{name}`", SEEDS_NAME.get(name, "")] + ([r["peak_rss_mib"], r["rss_added_mib"]] if rss else [])
                    + ([r["cuda_peak_mib"]] if cuda else [])
                    + [f"{s['median']:.1f} ({s['q1']:.1f}-{s['q3']:.1f})", 1e3 / s["median"], base / s["median"],
                       f"{r['final_train_loss']:.4f}", f"{r['test_loss']:.4f}", f"{r['test_acc']:.3f}",
                       r["skipped"], f"{r['final_scale']:g}"])
    params = runs[args.presets[0]]["params"]
    if args.experiment:
        what = f"experiment={args.experiment} {' '.join(args.override)}".strip() + f" ({params:,} params), the runner's stack"
    else:
        what = (f"MLP 64-{'-'.join(map(str, args.hidden))}-10 ({params:,} params) on digits, batch {args.batch}, "
                "AdamW(1e-3) + clip 1.0")
    parts = [f"# AMP presets: {what}, {args.steps} steps, {args.device}", _common.table(headers, rows)]
    if upd:
        parts.append("Update only (fixed gradients, donated kernel, interleaved):\n\n" + _common.table(
            ["update", "median ms", "IQR ms", "vs chain alone"],
            [[f"`{n}`", u["median"], f"{u['q1']:.2f}-{u['q3']:.2f}", u["median"] / upd["chain(clip, adamw)"]["median"]]
             for n, u in upd.items()]))
    memory = ("one process per preset; `RSS added` = peak RSS minus the RSS once data, model and optimizer state were "
              "built" if rss else "every preset in this process, one after another (`torch.cuda.max_memory_allocated`"
              " since the preset was built)")
    parts += ["Stacks:\n\n" + "\n".join(f"- `{runs[n]['stack']}`" for n in args.presets),
              f"`vs {args.presets[0]}`: its median ms/step over this row's (> 1 is faster). Memory: {memory}. "
              f"Speed: all presets in one process, interleaved over {args.rounds} rounds.",
              _common.environment()]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    out = _common.output_dir(p, args, HERE) if not args.worker else None
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(train(args.worker, args)))
        return
    text = report(args, *measure(args, argv))
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = "results" + (f"_{args.experiment}" if args.experiment else "")
        path = out / (stem + ("_cuda" if args.device.startswith("cuda") else "") + ".md")
        path.write_text(text + "\n")
        print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
