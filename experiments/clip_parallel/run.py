"""Gradient clipping under tensor x data parallelism: is the clipped norm the single-device one, every step?

A small MLP, written as a pure function of a parameter tree, trained for a few steps on 4 CPU ranks
(gloo) laid out as a (dp=2, tp=2) mesh: weights column/row-sharded over tp and replicated over dp, the
batch sharded over dp. Autograd then hands back gradients that are ``Partial`` over dp and ``Shard`` or
``Replicate`` over tp. The optimizer is ``chain(clip_by_global_norm(5.0), scale(-lr))``. Rank 0 trains
the same model on one device (plain tensors, the whole batch) alongside and prints both norms per step,
with the norm a per-rank clip (``clip_grad_norm_`` on the local shards) would have used.

    .venv/bin/python experiments/clip_parallel/run.py --write    # prints the table, replaces results_mlp.md here
    .venv/bin/python experiments/clip_parallel/run.py --out /tmp/clip_mlp   # a fresh copy
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py: rank launcher, markdown table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    p.add_argument("--max-norm", type=float, default=5.0, help="clip_by_global_norm bound")
    p.add_argument("--batch", type=int, default=32, help="global batch (split over dp)")
    _common.add_output_args(p, Path(HERE))  # results_mlp.md, written by rank 0
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = _common.output_dir(p, args, Path(HERE))
    return args


def launch() -> int:
    return max(_common.spawn_ranks(__file__, WORLD,
                                   lambda rank, port: [*sys.argv[1:], "--rank", str(rank), "--port", str(port)]))


def init_params(seed: int = 0) -> dict:
    """MLP 16 -> 64 -> 64 -> 8 as a plain tree of full tensors (the single-device model)."""
    g = torch.Generator().manual_seed(seed)

    def w(o, i):
        return torch.randn(o, i, generator=g) * (2.0 / i) ** 0.5

    return {"fc1": {"w": w(64, 16), "b": torch.zeros(64)}, "fc2": {"w": w(64, 64), "b": torch.zeros(64)},
            "head": {"w": w(8, 64), "b": torch.zeros(8)}}


def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
    x, y = batch
    h = torch.relu(x @ params["fc1"]["w"].T + params["fc1"]["b"])
    h = torch.relu(h @ params["fc2"]["w"].T + params["fc2"]["b"])
    return ((h @ params["head"]["w"].T + params["head"]["b"] - y) ** 2).mean()


def batches(steps: int, batch: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g)
        yield x, torch.sin(3 * x[:, :8]) * 4  # a target far from the init: early gradients get clipped


def loss_and_grads(params: dict, batch: tuple) -> tuple[torch.Tensor, dict]:
    """The loss and its gradient tree (plain or DTensor leaves alike: autograd.grad over detached views)."""
    import fxtrain as fx

    leaves, spec = fx.tree.flatten(params)
    leaves = [p.detach().requires_grad_() for p in leaves]
    loss = loss_fn(fx.tree.unflatten(spec, leaves), batch)
    return loss, fx.tree.unflatten(spec, list(torch.autograd.grad(loss, leaves)))


def run(args: argparse.Namespace) -> None:
    import fxtrain as fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    # Megatron layout: fc1 column-parallel, fc2 row-parallel, head replicated; everything replicated over dp.
    layout = {"fc1": {"w": [R, S0], "b": [R, S0]}, "fc2": {"w": [R, S1], "b": [R, R]},
              "head": {"w": [R, S0], "b": [R, R]}}
    full = init_params()
    params = {k: {n: distribute_tensor(full[k][n], mesh, layout[k][n]) for n in full[k]} for k in full}
    tx = fx.chain(fx.clip_by_global_norm(args.max_norm), fx.scale(-args.lr))
    state, ref_state = tx.init(params), tx.init(full)
    ref = fx.tree.clone(full)
    rows = []
    for step, (x, y) in enumerate(batches(args.steps, args.batch)):
        # Distributed step: batch over dp, replicated over tp.
        batch = (distribute_tensor(x, mesh, [S0, R]), distribute_tensor(y, mesh, [S0, R]))
        loss, grads = loss_and_grads(params, batch)
        placements = sorted({str(tuple(g.placements)) for g in fx.tree.leaves(grads)})
        # What clip_grad_norm_ on this rank's local shards would see (Partial not reduced, shards alone).
        naive = torch.tensor([math.sqrt(sum(float(g.to_local().double().square().sum()) for g in fx.tree.leaves(grads)))], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
        dist.all_gather(every, naive)
        naive = (min(float(v) for v in every), max(float(v) for v in every))
        exact = math.sqrt(sum(float(g.full_tensor().double().square().sum()) for g in fx.tree.leaves(grads)))
        updates, state = tx.update(grads, state, params)
        params = fx.apply_updates(params, updates)
        norm = float(state[0].grad_norm)

        # Single-device reference, same init and whole batch.
        _, ref_grads = loss_and_grads(ref, (x, y))
        ref_updates, ref_state = tx.update(ref_grads, ref_state, ref)
        ref = fx.apply_updates(ref, ref_updates)
        ref_norm = float(ref_state[0].grad_norm)
        rows.append((step, float(loss.detach().full_tensor()), norm, ref_norm, abs(norm - ref_norm) / ref_norm,
                     abs(norm - exact) / exact, naive, norm >= args.max_norm))

    drift = max(float((a.full_tensor() - b).abs().max()) for a, b in zip(fx.tree.leaves(params), fx.tree.leaves(ref)))
    if args.rank == 0:
        head = ("step", "loss", "grad_norm, 4 ranks (fx)", "grad_norm, 1 device", "rel. diff",
                "rel. diff vs fp64 of full grads", "per-rank local norms (min-max)", "clipped")
        cells = [[s, f"{lo:.4f}", f"{n:.6f}", f"{r:.6f}", f"{d:.1e}", f"{e:.1e}", f"{nv[0]:.3f}-{nv[1]:.3f}",
                  "yes" if c else "no"] for s, lo, n, r, d, e, nv, c in rows]
        lines = [
            _common.table(list(head), cells),
            "",
            f"Gradient placements on the (dp=2, tp=2) mesh: {', '.join(placements)}.",
            f"Largest parameter difference after {args.steps} steps, 4 ranks vs 1 device: {drift:.1e}.",
        ]
        text = "\n".join(lines) + "\n"
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results_mlp.md", "w") as f:
            f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    if args.rank is None:
        sys.exit(launch())
    run(args)
