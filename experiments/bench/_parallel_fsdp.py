"""Benchmark cases on torch's data-parallel engines: fxtrain's step against torch's imperative loop.

Run (the driver ``experiments/bench/parallel.py`` does this)::

    torchrun --nproc-per-node 2 experiments/bench/_parallel_fsdp.py --out results.jsonl --steps 20 [--layout fsdp]

``--layout``: ``fsdp`` (FSDP2, ``fully_shard`` on every block and on the root), ``hsdp`` (the same on a
``(dp_replicate=2, dp_shard)`` mesh: sharded within a replica group, replicated across; 4 ranks), ``dp``
(``fx.parallel.data_parallel``'s Replicate params against ``DistributedDataParallel``) and ``ep`` (an MoE
TransformerLM, experts ``Shard(0)`` over ep through ``fx.parallel.expert_parallel``, against DDP with every
expert on every rank: torch has no expert-parallel training loop of its own). Both sides train their own
copy of the same model (same initial weights, float32, gloo on CPU, one thread per rank) on the same batch,
one step of each per round in alternating order (``_common.interleaved``'s rotation, timed on the wall
clock and the CPU clock):

* fxtrain: ``chain(clip_by_global_norm(1.0), sharded_apply(adamw(1e-3, weight_decay=0.1)))`` through
  ``fx.parallel.fully_sharded_step`` (FSDP layouts) or ``fx.train_step``; the donated step runs torch's
  fused AdamW kernel on the local pieces (fxtrain/transforms/_fused.py);
* torch (torchtitan's loop): ``loss.backward()``, ``clip_grad_norm_(1.0)``, ``AdamW(foreach=True).step()``,
  ``zero_grad(set_to_none=True)``.

Collectives per step are counted on one extra step of each side with ``CommDebugMode``, which sees c10d
calls (FSDP's all-gathers and reduce-scatters, fxtrain's norm all-reduce) and DTensor's functional
collectives (``clip_grad_norm_``'s) alike; both sides are counted the same way, by kind. Under FSDP layouts the optimizer half alone (what differs) is timed
too, on gradients left by one backward, and reported in the note. Rank 0 appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxtrain as fx  # noqa: E402
from fxtrain.models import TransformerLM, count_params  # noqa: E402

CONFIG = dict(vocab_size=256, context=32, d_model=192, n_layers=4, n_heads=4)  # 1.8M params
BATCH, SEQ = 4, 32  # per rank
LR, WD, CLIP = 1e-3, 0.1, 1.0

_KIND = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "_allgather_base_": "all_gather",
         "all_gather_into_tensor": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter"}


def build(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TransformerLM(**CONFIG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def xent(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def collectives(fn) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return sum(v for k, v in comm.get_comm_counts().items() if str(k).split(".")[-1] in _KIND)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="fsdp")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # torch's notes on this model, the same for both sides: TransformerLM returns a view (a 3-D Linear), and
    # FSDP's backward hooks fire without inputs that require grad.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message="Full backward hook is firing.*")
    rank, world = fx.distributed.init_from_env()
    mesh = _mesh(args.layout, world)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own slice of the global batch
    idx = torch.randint(CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    target = torch.randint(CONFIG["vocab_size"], (BATCH, SEQ), generator=g)

    fxtrain_step, torch_step, pairs, fsdp_models = _sides(args.layout, mesh, idx, target)
    times, cpu = _timed({"fxtrain": fxtrain_step, "torch": torch_step}, rounds=args.steps, warmup=3)
    counts = {"fxtrain": collectives(fxtrain_step), "torch": collectives(torch_step)}

    # Same number of steps on the same batch: the params agree up to the two optimizers' rounding (clip by
    # norm against norm + 1e-6). Per leaf: |a - b|_2 / |b|_2, over the leaves whose gradient is not zero in
    # exact arithmetic: softmax ignores a bias added to every key, so the attention key biases' gradients are
    # rounding noise (~1e-10) that each Adam normalises into steps of lr, whatever the two sides compute.
    rel = 0.0
    with torch.no_grad():
        for name, p, q in pairs():
            if name.endswith("attn.k.bias"):
                continue
            a, b = _full(p), _full(q)
            rel = max(rel, float((a - b).norm() / b.norm().clamp_min(1e-12)))

    # The optimizer half alone, on one backward's gradients (what differs between the two sides).
    update = _optimizer_halves(*fsdp_models, idx, target, rounds=max(args.steps, 10)) if fsdp_models else None

    if rank == 0:
        fx_ms = statistics.median(times["fxtrain"]) * 1e3
        torch_ms = statistics.median(times["torch"]) * 1e3
        halves = (f"optimizer half alone: fxtrain {update['fxtrain']:.2f} ms, torch {update['torch']:.2f} ms; "
                  if update else "")
        row = {
            "strategy": LAYOUTS[args.layout][0], "world": world,
            "fxtrain_ms": round(fx_ms, 2), "torch_ms": round(torch_ms, 2), "ratio": round(fx_ms / torch_ms, 3),
            "fxtrain_collectives": counts["fxtrain"], "torch_collectives": counts["torch"],
            "max_rel_diff": float(f"{rel:.3g}"),
            "note": (f"TransformerLM {_size(args.layout)} f32, {LAYOUTS[args.layout][1]}, batch {BATCH}x{SEQ}/rank; "
                     "fxtrain chain(clip(1.0), sharded_apply(adamw)) (the fused AdamW kernel on the local pieces) "
                     f"vs clip_grad_norm_+AdamW(foreach); {halves}"
                     f"CPU time per step (rank 0, waits excluded): fxtrain {cpu['fxtrain']:.1f} ms, "
                     f"torch {cpu['torch']:.1f} ms; max_rel_diff is per-leaf relative L2 (attention key biases left "
                     "out: zero gradient in exact arithmetic); collectives by CommDebugMode (c10d and functional, "
                     "same counting)"),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row))
    dist.barrier()
    fx.distributed.shutdown()


LAYOUTS = {  # --layout: (row label, what each side runs)
    "fsdp": ("FSDP2", "fully_shard per block + root on both sides"),
    "hsdp": ("HSDP", "fully_shard per block + root on a (dp_replicate=2, dp_shard) mesh on both sides"),
    "dp": ("DP", "fx.parallel.data_parallel + train_step vs DistributedDataParallel"),
    "ep": ("EP", "MoE (4 experts, top 2): fx.parallel.expert_parallel (experts Shard(0) over ep) vs "
                 "DistributedDataParallel with every expert on every rank (torch has no expert-parallel loop)"),
}
EXPERTS = 4


def _mesh(layout: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("ep" if layout == "ep" else "dp",))


def _lm(layout: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return TransformerLM(**CONFIG, experts=EXPERTS if layout == "ep" else 0)


def _size(layout: str) -> str:
    return f"{count_params(dict(_lm(layout).named_parameters())) / 1e6:.2f}M params"


def _full(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _sides(layout: str, mesh, idx: torch.Tensor, target: torch.Tensor):
    """``(fxtrain_step, torch_step, pairs, fsdp_models)``: one step of each side, ``pairs()`` yielding
    ``(name, fxtrain param, torch param)``, and for FSDP layouts what :func:`_optimizer_halves` needs."""
    tx = fx.chain(fx.clip_by_global_norm(CLIP), fx.sharded_apply(fx.adamw(LR, weight_decay=WD)))
    if layout in ("fsdp", "hsdp"):
        model = build(mesh)
        apply, params, buffers = fx.parallel.fully_sharded(model)
        step = fx.parallel.fully_sharded_step(lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1]), tx,
                                              model)
        torch_model = build(mesh)
    else:
        model = _lm(layout)
        parallel = fx.parallel.data_parallel if layout == "dp" else fx.parallel.expert_parallel
        apply, params, buffers = parallel(model, mesh)
        step = fx.train_step(lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1]), tx)
        torch_model = torch.nn.parallel.DistributedDataParallel(_lm(layout))
    state = {"params": params, "opt": tx.init(params)}
    opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def fxtrain_step():
        state["params"], state["opt"], _ = step(state["params"], state["opt"], (idx, target))

    def torch_step():
        xent(torch_model(idx), target).backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def pairs():
        mine = getattr(torch_model, "module", torch_model)
        return [(n, state["params"][n], q) for n, q in mine.named_parameters()]

    fsdp_models = (model, state, tx, torch_model, opt) if layout in ("fsdp", "hsdp") else ()
    return fxtrain_step, torch_step, pairs, fsdp_models


def _timed(fns: dict, rounds: int, warmup: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``_common.interleaved``'s rotation, timing each call on both clocks: wall seconds per call, and the
    median CPU milliseconds (which other processes on a shared machine do not inflate)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    wall: dict = {n: [] for n in names}
    cpu: dict = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, {n: statistics.median(v) * 1e3 for n, v in cpu.items()}


def _optimizer_halves(model, state, tx, torch_model, opt, idx, target, rounds: int) -> dict[str, float]:
    """Median ms of the update half of each side, from gradients kept aside (cloned in, not timed)."""
    from fxtrain._base import apply_updates_, update_
    from fxtrain.step import _owned
    from fxtrain.transforms import _fused

    xent(model(idx), target).backward()
    fx_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    xent(torch_model(idx), target).backward()
    torch_grads = [p.grad.detach().clone() for p in torch_model.parameters()]
    torch_model.zero_grad(set_to_none=True)
    out = {"fxtrain": [], "torch": []}
    for _ in range(rounds):
        grads = {n: g.clone() for n, g in fx_grads.items()}
        t0 = time.perf_counter()
        with torch.no_grad():  # what the donated step runs after the backward (fxtrain/step.py)
            grads = _owned(grads)
            if not _fused.step_(tx, grads, state["opt"], state["params"]):
                updates, state["opt"] = update_(tx, grads, state["opt"], state["params"])
                apply_updates_(state["params"], updates)
        out["fxtrain"].append(time.perf_counter() - t0)
        for p, g in zip(torch_model.parameters(), torch_grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["torch"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


if __name__ == "__main__":
    main()
