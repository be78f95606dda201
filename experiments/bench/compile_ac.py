"""``trainer.compile`` and ``model.activation_checkpoint`` (issue 36, item 3): step time eager against compiled per
layout, and the peak memory and time of activation checkpointing.

Both tables build the runner's own run (:func:`fxtrain.train.build_run` of ``experiment=tiny_lm``'s config with the
overrides below, ``amp=off accumulate=off``) and time its step, so what is measured is what
``python -m fxtrain.train ... trainer.compile=true`` runs:

* **compile**: per layout, the eager run and the compiled run (each block ``torch.compile``-d, the update half
  compiled where the stack has no fused kernel) are built in the same process (each rank of a gloo world, one
  thread per rank) and timed in interleaved rounds (``_common.interleaved``), after warm-up steps that compile;
  the first steps' time (compilation) is reported apart. One process in this process; the layouts as
  ``--world`` ranks of this script (``--rank-worker``).
* **activation checkpointing** (one process, eager): a GPT-2-shaped LM (more blocks and a longer context than
  tiny_lm, so activations outweigh the params), ``none``/``selective``/``full``. Memory is counted by a dispatch
  mode (:class:`Storages`: the bytes of the tensor storages torch ops create during one steady step, so
  deterministic, not RSS): *peak growth* of the step over what was live before it, in units of P (the params'
  bytes), and *activations*: the bytes autograd keeps for the backward pass after the forward
  (``saved_tensors_hooks``), in MiB and in P. Time: the same step, interleaved rounds; the ratio to ``none``.

Usage::

    .venv/bin/python experiments/bench/compile_ac.py                    # writes results/compile_ac.md
    .venv/bin/python experiments/bench/compile_ac.py --layouts none,dp,fsdp,tp,pp --rounds 20 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The compile table's run: tiny_lm's model and data, small enough that a 2-core machine compiles it in minutes.
COMPILE_RUN = ["experiment=tiny_lm", "amp=off", "accumulate=off", "data.max_bytes=200000", "data.eval_windows=16",
               "model.d_model=64", "model.n_heads=4", "model.n_layers=4", "data.batch_size=16",
               "trainer.max_steps=1000", "trainer.checkpoint_every=0"]
# The memory table's model: GPT-2's shape scaled to a CPU (8 blocks, context 256).
AC_RUN = ["experiment=tiny_lm", "amp=off", "accumulate=off", "data.max_bytes=400000", "data.eval_windows=16",
          "model.d_model=128", "model.n_heads=4", "model.n_layers=8", "data.context=256", "data.batch_size=8",
          "trainer.max_steps=1000", "trainer.checkpoint_every=0"]
LAYOUT_WORLD = {"none": 1, "dp": 2, "fsdp": 2, "tp": 2, "pp": 2, "none+lion": 1}
# Rows beyond the layouts: a stack without a fused kernel, where trainer.compile also compiles the update half.
ROW_OVERRIDES = {"none+lion": ["parallel=none", "optim/transform@optim.chain=[clip_by_global_norm,lion]",
                               "~optim.chain.adamw"]}


class Storages(TorchDispatchMode):
    """Bytes of the tensor storages torch ops create inside the block: ``live`` now, ``peak`` the most at once
    (storages that existed before count 0: ``peak`` is the growth above them)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(x.untyped_storage()) for x in optree.tree_leaves((args, kwargs)) if type(x) is torch.Tensor}
        for x in optree.tree_leaves(out):
            if type(x) is not torch.Tensor:
                continue
            storage = x.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._seen:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def _built(overrides: list[str], dims=None):
    from hydra import compose, initialize_config_dir

    from fxtrain import train as runner

    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    checked = runner.check(cfg)
    built = runner.build_run(cfg, torch.device("cpu"), dims, task=checked.task)
    return cfg, built


class Stepper:
    """One built run's step, called on the next batch each time (its state carried)."""

    def __init__(self, built, dims):
        self.built, self.dims, self.i = built, dims, 0
        self.params, self.state, self.buffers = built.params, built.opt_state, built.buffers

    def __call__(self):
        batch = self.dims.local_batch(self.built.data.train[self.i]) if self.dims else self.built.data.train[self.i]
        self.params, self.state, self.buffers, metrics = self.built.step(self.params, self.state, self.buffers, batch)
        self.i += 1
        return metrics


def compile_row(layout: str, rounds: int, warmup: int, dims=None) -> dict:
    """Eager and compiled step of ``layout`` in this process (a rank of its world, or one process)."""
    steps, first = {}, {}
    for name, extra in (("eager", []), ("compiled", ["trainer.compile=true"])):
        _, built = _built([*COMPILE_RUN, *ROW_OVERRIDES.get(layout, [f"parallel={layout}"]), *extra], dims)
        steps[name] = Stepper(built, dims)
        t0 = time.perf_counter()
        for _ in range(2):  # the compiled one compiles here (the second call sees the caches the first filled)
            steps[name]()
        first[name] = time.perf_counter() - t0
    times = _common.interleaved(steps, rounds=rounds, warmup=warmup)
    s = {k: _common.summary(v) for k, v in times.items()}
    return {"layout": layout, "eager_ms": s["eager"]["median"], "compiled_ms": s["compiled"]["median"],
            "eager_iqr": (s["eager"]["q1"], s["eager"]["q3"]), "compiled_iqr": (s["compiled"]["q1"], s["compiled"]["q3"]),
            "first_two_s": first["compiled"], "first_two_eager_s": first["eager"]}


def rank_worker(args) -> None:
    """A rank of a layout's world: joins gloo, builds the layout's mesh, times its row; rank 0 writes it."""
    import torch.distributed as dist

    from fxtrain import build
    from fxtrain import train as runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg, _ = None, None
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*COMPILE_RUN, f"parallel={args.layout}"])
    dims = build.parallel_dims(cfg, dist.get_world_size()).build("cpu")
    row = compile_row(args.layout, args.rounds, args.warmup, dims)
    if dist.get_rank() == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def layout_row(layout: str, rounds: int, warmup: int) -> dict | None:
    world = LAYOUT_WORLD[layout]
    if world == 1:
        return compile_row(layout, rounds, warmup)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.jsonl"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               f"--master-port={_common.free_port()}", __file__, "--rank-worker", "--layout", layout,
               "--rounds", str(rounds), "--warmup", str(warmup), "--out", str(out)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode or not out.exists():
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return {"layout": layout, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
        return json.loads(out.read_text().splitlines()[0])


def ac_rows(rounds: int) -> list[dict]:
    """Peak memory growth, activations and time of one steady step per ``model.activation_checkpoint`` mode."""
    from fxtrain.models import count_params

    steps, rows = {}, {}
    for mode in ("none", "selective", "full"):
        _, built = _built([*AC_RUN, f"model.activation_checkpoint={mode}"])
        step = steps[mode] = Stepper(built, None)
        p_bytes = sum(p.numel() * p.element_size() for p in optree.tree_leaves(built.params))
        for _ in range(2):  # the optimizer state exists; what the step keeps from one call to the next is there
            step()
        with Storages() as mem:
            step()
        kept: dict[int, int] = {}

        def pack(t):
            kept[id(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        x, y = built.data.train[step.i]
        loss_fn_apply = built.apply
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            params = {k: v.detach().requires_grad_() for k, v in built.params.items()}
            loss_fn_apply(params, built.buffers, x, train=True)
        rows[mode] = {"mode": mode, "params": count_params(built.params), "P": p_bytes, "peak": mem.peak,
                      "activations": sum(kept.values())}
    times = _common.interleaved(steps, rounds=rounds, warmup=1)
    for mode, t in times.items():
        rows[mode]["ms"] = _common.summary(t)["median"]
    return list(rows.values())


def render(compile_rows: list[dict], ac: list[dict], argv: list[str], load: tuple) -> str:
    mib = 2**20
    out = ["# trainer.compile and model.activation_checkpoint (issue 36, item 3)", "",
           f"Command: `.venv/bin/python experiments/bench/compile_ac.py {' '.join(argv)}`".rstrip() + "", "",
           _common.environment(),
           f"- machine load (1-minute load average) at start and end: {load[0]:.1f}, {load[1]:.1f} "
           f"(on {os.cpu_count()} cores; other processes share them: ratios of interleaved rounds are what holds)", ""]
    if compile_rows:
        out += ["## Eager vs compiled step, per layout", "",
                f"`{' '.join(COMPILE_RUN)}` (+ `parallel=<layout>`), gloo ranks with one thread each. Median of "
                "interleaved rounds, milliseconds per step (rank 0); *first two steps*: the compiled run's first two "
                "calls (compilation), eager's beside it. The stack is tiny_lm's (clip + AdamW: torch's fused kernel, "
                "which the compiled update half does not replace); `none+lion`: a stack without a fused kernel "
                "(`optim.chain=[clip_by_global_norm,lion]`), whose update half runs compiled.", ""]
        rows = []
        for r in compile_rows:
            if "error" in r:
                rows.append([r["layout"], LAYOUT_WORLD[r["layout"]], "-", "-", "-", f"failed: {r['error']}"])
                continue
            rows.append([r["layout"], LAYOUT_WORLD[r["layout"]], f"{r['eager_ms']:.1f}", f"{r['compiled_ms']:.1f}",
                         f"{r['compiled_ms'] / r['eager_ms']:.2f}x",
                         f"{r['first_two_s']:.1f} s (eager {r['first_two_eager_s']:.2f} s)"])
        out += [_common.table(["layout", "ranks", "eager ms", "compiled ms", "compiled / eager", "first two steps"],
                              rows), ""]
    if ac:
        none = next(r for r in ac if r["mode"] == "none")
        out += ["## Activation checkpointing: peak memory and time of one step (one process, eager)", "",
                f"`{' '.join(AC_RUN)}`: {none['params']:,} params, P = {none['P'] / mib:.1f} MiB. *Peak growth*: the "
                "most bytes of new tensor storages live at once during one steady step, above what was live before "
                "it (params, optimizer state, batch); *activations*: what autograd keeps for the backward pass after "
                "the forward. Time: median of interleaved rounds.", ""]
        rows = [[r["mode"], f"{r['peak'] / r['P']:.2f}P", f"{r['peak'] / mib:.1f}", f"{r['activations'] / mib:.1f}",
                 f"{r['activations'] / r['P']:.2f}P", f"{r['ms']:.1f}", f"{r['ms'] / none['ms']:.2f}x"] for r in ac]
        out += [_common.table(["activation_checkpoint", "peak growth", "peak MiB", "activations MiB",
                               "activations", "step ms", "time vs none"], rows), ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="none,dp,fsdp,tp,pp")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the compile table")
    parser.add_argument("--no-ac", action="store_true", help="skip the activation checkpointing table")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        return rank_worker(args)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    ac = [] if args.no_ac else ac_rows(args.rounds)
    rows = [] if args.no_compile else [layout_row(x, args.rounds, args.warmup) for x in args.layouts.split(",")]
    text = render(rows, ac, sys.argv[1:], (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_write:
        print(_common.write_result("compile_ac", text))


if __name__ == "__main__":
    main()
