"""sharded_apply(adamw) against adamw through DTensor dispatch, and optimizer-state bytes per rank (issue 7).

Timing: 64 leaves of 32x32 float32, ``Shard(0)`` over a 1-D mesh of 2 gloo ranks on CPU. Variants, timed
in interleaved rounds in the same processes (see _common.py; every rank runs the same order, so the
collectives-free updates stay in step):

* ``adamw (DTensor dispatch)``: ``fx.adamw(1e-3)``'s kernel on the DTensor leaves: every
  ``torch._foreach_*`` goes through DTensor's dispatch (sharding propagation per op, per leaf list).
* ``sharded_apply(adamw)``: the same math on the local pieces, rewrapped.

Donated (``fx.update_`` under ``no_grad``, as ``train_step`` runs its update half), pure (``tx.update``
with autograd recording: out of place, differentiable), and donated update + ``apply_updates_``, the whole
update half, next to what ``train_step`` now runs for this stack: torch's fused AdamW kernel on the local
pieces (``fxtrain/transforms/_fused.py``). Ratio = median of the dispatch variant / median of the row.

Memory: the same 64 leaves ``Replicate`` over a ``dp`` mesh of 1, 2 and 4 ranks; bytes of the local
pieces of every optimizer-state leaf on one rank, with and without ``shard_over="dp"``.

Usage:
    python experiments/bench/sharded.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

LEAVES, SHAPE = 64, (32, 32)


def _worker(rank: int, world: int, port: int, out: str, rounds: int) -> None:
    import fxtrain as fx
    from fxtrain.transforms import _fused
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(SHAPE, generator=g) for _ in range(LEAVES)]
    result: dict = {"world": world}

    # Optimizer-state bytes per rank, measured from the state trees.
    rep = [distribute_tensor(x.clone(), mesh, [Replicate()]) for x in full]
    for name, tx in (("adamw", fx.sharded_apply(fx.adamw(1e-3))),
                     ("adamw shard_over='dp'", fx.sharded_apply(fx.adamw(1e-3), shard_over="dp"))):
        state = tx.init(rep)
        result[name] = sum(x.numel() * x.element_size() for x in fx.distributed.local_leaves(state))

    if world == 2:
        params = [distribute_tensor(x.clone(), mesh, [Shard(0)]) for x in full]
        grads = [distribute_tensor(x.clone() * 0.1, mesh, [Shard(0)]) for x in full]
        plain, sharded = fx.adamw(1e-3), fx.sharded_apply(fx.adamw(1e-3))
        s_plain, s_sharded = plain.init(params), sharded.init(params)
        # Same numbers first (one pure update each).
        u1, _ = plain.update(grads, s_plain, params)
        u2, _ = sharded.update(grads, s_sharded, params)
        result["max_abs_diff"] = max(float((a.to_local() - b.to_local()).abs().max()) for a, b in zip(u1, u2))
        g1 = [fx.tree.clone(x) for x in grads]
        g2 = [fx.tree.clone(x) for x in grads]
        g3 = [fx.tree.clone(x) for x in grads]
        p1, p2, p3 = ([fx.tree.clone(x) for x in params] for _ in range(3))
        s3 = sharded.init(params)

        def donated(tx, g, state, ps=None):
            # As train_step runs its update half: under no_grad, the update (and with ps the add) in place.
            with torch.no_grad():
                u, _ = fx.update_(tx, g, state, params if ps is None else ps)
                if ps is not None:
                    fx.apply_updates_(ps, u)

        def fused_step():
            with torch.no_grad():
                assert _fused.step_(sharded, g3, s3, p3)  # the fused AdamW kernel on the local pieces

        variants = {
            "adamw (DTensor dispatch), donated": lambda: donated(plain, g1, s_plain),
            "sharded_apply(adamw), donated": lambda: donated(sharded, g2, s_sharded),
            "adamw (DTensor dispatch), pure": lambda: plain.update(grads, s_plain, params),
            "sharded_apply(adamw), pure": lambda: sharded.update(grads, s_sharded, params),
            "adamw (DTensor dispatch), donated + apply": lambda: donated(plain, g1, s_plain, p1),
            "sharded_apply(adamw), donated + apply": lambda: donated(sharded, g2, s_sharded, p2),
            "fused kernel on local pieces, update + apply": fused_step,
        }
        times = _common.interleaved(variants, rounds=rounds)
        result["times"] = {k: _common.summary(v) for k, v in times.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        codes = _common.spawn_ranks(__file__, world, lambda rank, port: ["--worker", str(rank), str(world), str(port),
                                                                          out, str(rounds)],
                                    env={"PYTHONWARNINGS": "ignore"})
        if any(codes):
            raise RuntimeError(f"world {world}: ranks exited with {codes}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    runs = {w: _spawn(w, args.rounds) for w in (1, 2, 4)}

    t = runs[2]["times"]
    rows = []
    for mode in ("donated", "pure", "donated + apply"):
        base = t[f"adamw (DTensor dispatch), {mode}"]["median"]
        names = [f"adamw (DTensor dispatch), {mode}", f"sharded_apply(adamw), {mode}"]
        if mode == "donated + apply":
            names.append("fused kernel on local pieces, update + apply")
        for name in names:
            s = t[name]
            rows.append([name, s["median"], f"{s['q1']:.2f}-{s['q3']:.2f}", s["min"], f"{base / s['median']:.2f}x"])
    mem = []
    for w, r in runs.items():
        a, z = r["adamw"], r["adamw shard_over='dp'"]
        mem.append([w, a, z, f"{z / a:.3f}"])
    text = "\n\n".join([
        "# sharded_apply: local-shard optimizer math and optimizer-state sharding",
        f"Update of {LEAVES} leaves of {SHAPE[0]}x{SHAPE[1]} float32, Shard(0) over 2 gloo ranks (CPU, one thread "
        f"per rank), {args.rounds} interleaved rounds; ms per update on rank 0. Speed-up = median of the "
        "DTensor-dispatch variant / median of this variant. Max |difference| of one update: "
        f"{runs[2]['max_abs_diff']:.1e}.",
        _common.table(["variant", "median ms", "IQR ms", "min ms", "speed-up vs dispatch"], rows),
        "Optimizer-state bytes per rank (adamw: mu and nu plus an int32 count), the same 64 leaves "
        "Replicate over a dp mesh, measured from the local pieces of the state tree:",
        _common.table(["ranks", "sharded_apply(adamw)", "sharded_apply(adamw, shard_over='dp')", "ratio"], mem),
        "Command: `python experiments/bench/sharded.py`",
        _common.environment(),
    ])
    print(text)
    print(f"\nwritten to {_common.write_result('sharded', text)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
    else:
        main()
