"""Benchmark: fx.global_norm vs torch.nn.utils.get_total_norm on 1,000 DTensor leaves on one mesh.

Question: how much faster is fxtrain's global norm than PyTorch's on a DTensor gradient tree, where
torch works at all (one mesh)? Target: at least 10x. Both are timed side by side in one run, in
interleaved rounds (fx, torch, fx, torch...), each round the slowest rank's time, reported as medians.
Also shown: a tree on two meshes, where torch raises.

    .venv/bin/python experiments/bench/global_norm.py                # world 2, writes global_norm.md
    .venv/bin/python experiments/bench/global_norm.py --world 4 --rounds 21

The script launches ``--world`` gloo ranks on this machine (one CPU thread each) and rank 0 writes the
markdown table next to this file (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="gloo ranks to launch")
    p.add_argument("--leaves", type=int, default=1000, help="DTensor leaves in the tree")
    p.add_argument("--shapes", default="8x8,32x32,64x128", help="global leaf shapes, Shard(0) over the mesh")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds; medians over them")
    p.add_argument("--reps", type=int, default=5, help="calls per round (timed together)")
    p.add_argument("--out", default=os.path.join(HERE, "global_norm.md"), help="markdown table written by rank 0")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Starts ``args.world`` copies of this script as ranks and waits for them."""
    return max(_common.spawn_ranks(__file__, args.world,
                                   lambda rank, port: [*sys.argv[1:], "--rank", str(rank), "--port", str(port)]))


def timed(fn, reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call of ``fn``, each the slowest rank's (every rank starts together).

    CPU time (this process, all threads) leaves out the time a rank sits descheduled or waits for a
    peer, which dominates wall time on an oversubscribed machine; both are reported.
    """
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    dt = torch.tensor([(time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt[0]), float(dt[1])


def medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def run(args: argparse.Namespace) -> None:
    import fxtrain as fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    w = args.world
    mesh = init_device_mesh("cpu", (w,), mesh_dim_names=("x",))
    rows = []
    for spec in args.shapes.split(","):
        shape = tuple(int(n) for n in spec.split("x"))
        g = torch.Generator().manual_seed(0)
        grads = [distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)]) for _ in range(args.leaves)]
        ours, theirs = fx.global_norm(grads), torch.nn.utils.get_total_norm(grads).full_tensor()  # warm up
        agree = abs(float(ours) - float(theirs)) <= 1e-5 * float(theirs)
        fx_t, torch_t = [], []
        for _ in range(args.rounds):  # interleaved, so drift in machine load hits both alike
            fx_t.append(timed(lambda: fx.global_norm(grads), args.reps))
            torch_t.append(timed(lambda: torch.nn.utils.get_total_norm(grads).full_tensor(), args.reps))
        (a, ac), (b, bc) = medians(fx_t), medians(torch_t)
        rows.append((f"1-D ({w},)", f"{args.leaves} x {spec}", f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", f"**{b / a:.1f}x**",
                     f"{ac * 1e3:.2f}", f"{bc * 1e3:.2f}", f"**{bc / ac:.1f}x**",
                     "yes" if agree else f"NO ({float(ours)} vs {float(theirs)})"))

    # Two meshes: torch's stack of per-leaf norms needs one mesh; fxtrain reduces per mesh dim.
    mesh2 = init_device_mesh("cpu", (w // 2 or 1, 2 if w > 1 else 1), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(1)
    mixed = [distribute_tensor(torch.randn(32, 32, generator=g), mesh if i % 2 else mesh2,
                               [Shard(0)] if i % 2 else [Replicate(), Shard(1)]) for i in range(args.leaves)]
    fx.global_norm(mixed)
    a, ac = medians([timed(lambda: fx.global_norm(mixed), args.reps) for _ in range(args.rounds)])
    try:
        torch.nn.utils.get_total_norm(mixed)
        verdict = "runs"
    except Exception as e:  # noqa: BLE001 - the failure is the measurement
        verdict = f"raises: {str(e).splitlines()[0][:70]}"
    rows.append((f"1-D ({w},) + 2-D {tuple(mesh2.shape)}", f"{args.leaves} x 32x32", f"{a * 1e3:.2f}", verdict, "",
                 f"{ac * 1e3:.2f}", "", "", ""))

    if args.rank == 0:
        load = os.getloadavg()[0]
        head = ("mesh", "leaves x global shape", "fx wall ms", "torch wall ms", "speedup (wall)",
                "fx CPU ms", "torch CPU ms", "speedup (CPU)", "same norm")
        lines = [
            f"# fx.global_norm vs torch.nn.utils.get_total_norm ({w} gloo ranks, 1 CPU thread each)",
            "",
            f"torch {torch.__version__}; fx = `fx.global_norm(grads)`, torch = "
            "`torch.nn.utils.get_total_norm(grads).full_tensor()`; leaves Shard(0) over the mesh. Median over "
            f"{args.rounds} interleaved rounds of {args.reps} calls, slowest rank per round; CPU = process time "
            "(all threads), which leaves out time spent descheduled or waiting for a peer.",
            f"Command: `.venv/bin/python experiments/bench/global_norm.py --world {w} --rounds {args.rounds}`; "
            f"machine: {os.cpu_count()} CPUs, 1-minute load average {load:.1f} at the end of the run.",
            "",
            _common.table(list(head), [list(r) for r in rows]),
            "",
            "Where the time goes. torch's path dispatches `_foreach_norm` and `stack` through DTensor "
            "(sharding propagation over 1,000 operands) and reduces with a redistribute. fxtrain reads the "
            "local pieces and does plain-tensor work: one `_foreach_norm` over the large pieces, one copy + "
            "one sum for the small ones, then one all_reduce of 3 numbers. On CPU that local work has a "
            "floor (a `_foreach_norm` is a loop of per-tensor kernels, ~1.3 us each; packing costs a copy), "
            "about 1 ms for 1,000 tiny leaves on an idle core, so the speedup is largest for small leaves "
            "and shrinks as both sides become bound by the same memory traffic. On a machine shared with "
            "other jobs (load well above the core count) both columns inflate and, in our runs, the ratio "
            "fell with load: a single-rank run at a quieter moment measured fx 1.0 ms vs torch 7.7 ms for "
            "1,000 8x4 leaves (7.7x). The 10x target was not reached on this 2-core CPU machine.",
        ]
        text = "\n".join(lines) + "\n"
        print(text)
        with open(args.out, "w") as f:
            f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    if args.rank is None:
        sys.exit(launch(args))
    run(args)
