"""Pipeline step: fxtrain's pipeline_step against torch's imperative loop (issue 16, item 4).

Run by experiments/bench/parallel.py as ``torchrun --nproc-per-node 2 _parallel_pp.py --out FILE --steps S``
(the "pipeline" row). One model (embedding, 4 residual blocks with attention and MLP, LayerNorms, output
Linear; float32) split by the user into 2 stages (embedding + 2 blocks / 2 blocks + head), each side with
its own copy, ``PipelineStage`` and ``ScheduleGPipe`` (4 micro-batches) on the same pp group:

* fxtrain: ``fx.parallel.pipeline_step(schedule, chain(clip_by_global_norm(0.1, groups=(pp,)),
  adamw(1e-2)), pp_group=pp)``: the clip's norm is the full model's.
* torch (as users write it, torch's docs and torchtitan's loop): ``schedule.step``, then
  ``clip_grad_norm_(stage_module.parameters(), 0.1, foreach=True)``, ``AdamW(foreach=True).step()``,
  ``zero_grad``. Its norm is the stage's own (a different clip on each stage): the row's ``torch_ms``.
* torch, corrected by hand: the same, with the stage norms' squares all-reduced over the pp group before
  ``clip_grads_with_norm_``: the numbers fxtrain must reproduce (``max_rel_diff``) and a timing aside.

The schedule's point-to-point sends are the same on every side. Timing: ``_common.interleaved`` (one step of
each side per round, order rotating), wall clock, rank 0's medians over ``--steps`` rounds after 3 warmup
rounds. Communication: a ``TorchDispatchMode`` around one step of each side counts every ``c10d`` op it sees,
split into collectives (``allreduce_``, ...) and point-to-point (``send``, ``recv_``): the same counter on
every side (``CommDebugMode`` counts collectives only). ``max_rel_diff``: after all steps, max over params
of ``max|fx - torch| / max|torch|`` against the corrected torch loop (torch's clip divides by
``norm + 1e-6``, Optax's by ``norm``); the per-stage loop's distance is in the note.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

V, D, HEADS, S, B = 256, 64, 4, 32, 8  # vocab, width, heads, sequence, batch (--width scales V, D, S)
LR, WD, MAX_NORM, N_MICRO = 1e-2, 1e-2, 0.1, 4
SPLIT = [(0, 3), (3, 6)]  # module slices of the two stages


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.wqkv, self.wo = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.w1, self.w2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, D))
        return x + self.w2(nn.functional.gelu(self.w1(self.ffn_norm(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.output = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, x):
        return self.output(self.norm(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), Block(), Block(), Block(), Block(), Head())


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


class CountC10d(TorchDispatchMode):
    """Counts the ``c10d`` ops dispatched inside it: collectives and point-to-point apart."""

    P2P = {"send", "recv_", "recv_any_source_"}

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts["p2p" if func._opname in self.P2P else "collective"] += 1
            self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    global V, D, S
    import fxtrain as fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=64, help="model width D; vocab 4 D, sequence D / 2")
    args = ap.parse_args()
    V, D, S = 4 * args.width, args.width, args.width // 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"_parallel_pp.py runs on 2 ranks (2 stages), not {world}")
    pp = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    group = pp.get_group()

    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    batch = (tokens if rank == 0 else None, targets if rank == world - 1 else None)
    lo, hi = SPLIT[rank]
    full = model()

    def stage_schedule():
        module = copy.deepcopy(full[lo:hi])
        stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
        return module, ScheduleGPipe(stage, N_MICRO, loss_fn=loss)

    # fxtrain
    fx_module, fx_schedule = stage_schedule()
    tx = fx.chain(fx.clip_by_global_norm(MAX_NORM, groups=(pp,)), fx.adamw(LR, weight_decay=WD))
    step = fx.parallel.pipeline_step(fx_schedule, tx, pp_group=pp)
    params = dict(fx_module.named_parameters())
    fxs = {"params": params, "state": tx.init(params)}

    def fx_step():
        fxs["params"], fxs["state"], _ = step(fxs["params"], fxs["state"], batch)

    # torch, as users write it (per-stage clip), and corrected by hand (norm summed over the pp group)
    def torch_loop(correct: bool):
        module, schedule = stage_schedule()
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD, foreach=True)

        def torch_step():
            schedule.step(*([tokens] if rank == 0 else []), target=batch[1])
            ps = list(module.parameters())
            if correct:
                norm = torch.nn.utils.get_total_norm([p.grad for p in ps], foreach=True)
                sq = norm.square()
                dist.all_reduce(sq, group=group)
                torch.nn.utils.clip_grads_with_norm_(ps, MAX_NORM, sq.sqrt(), foreach=True)
            else:
                torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return module, torch_step

    torch_module, torch_step = torch_loop(correct=False)
    fixed_module, fixed_step = torch_loop(correct=True)
    fns = {"fxtrain": fx_step, "torch": torch_step, "torch_correct": fixed_step}
    times = _common.interleaved(fns, rounds=args.steps)

    counts = {}
    for name, fn in fns.items():
        with CountC10d() as c:
            fn()
        counts[name] = dict(c.counts)
        if rank == 0:
            print(name, counts[name], file=sys.stderr)

    def diff(module):
        d = 0.0
        for k, p in module.named_parameters():
            a, b = fxs["params"][k].detach(), p.detach()
            d = max(d, float((a - b).abs().max() / b.abs().max()))
        out = torch.tensor(d, dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out)

    d_fixed, d_stage = diff(fixed_module), diff(torch_module)
    if rank == 0:
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"strategy": "pipeline", "world": world, "fxtrain_ms": round(ms["fxtrain"], 3),
               "torch_ms": round(ms["torch"], 3), "ratio": round(ms["fxtrain"] / ms["torch"], 3),
               "fxtrain_collectives": counts["fxtrain"].get("collective", 0),
               "torch_collectives": counts["torch"].get("collective", 0), "max_rel_diff": d_fixed,
               "torch_correct_ms": round(ms["torch_correct"], 3),
               "torch_correct_collectives": counts["torch_correct"].get("collective", 0),
               "p2p_per_step": counts["fxtrain"].get("p2p", 0),
               "note": (f"V={V} D={D} S={S} B={B} f32, 2 stages, GPipe x {N_MICRO} micro-batches; "
                        "clip(0.1, groups=(pp,))+adamw vs schedule.step+clip_grad_norm_+AdamW(foreach), whose "
                        f"norm is per stage (params {d_stage:.2g} apart after the steps); max_rel_diff is "
                        f"against torch with the norm all-reduced by hand ({ms['torch_correct']:.1f} ms, ratio "
                        f"{ms['fxtrain'] / ms['torch_correct']:.2f}: the same communication); "
                        "fxtrain's collectives: the norm's all_reduce and the loss's (metrics identical on "
                        f"every rank; in flight during the update); p2p: {counts['fxtrain'].get('p2p', 0)} / {counts['torch'].get('p2p', 0)} "
                        "(fxtrain / torch) send+recv per step; counted: TorchDispatchMode over c10d ops, one step")}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
