"""TP and 2-D (dp x tp) steps: fxtrain's train_step against torch's imperative loop (issue 16, item 3).

Run by experiments/bench/parallel.py as ``torchrun --nproc-per-node N _parallel_tp.py --out FILE --steps S``:
2 ranks give the "TP" row (a 1-D tp mesh), 4 ranks the "2-D" row (dp x tp = 2 x 2). Both sides train one
model (2 transformer-ish blocks: embedding, LayerNorms, attention, MLP, output Linear; float32) parallelized
by torch's own ``parallelize_module`` with torchtitan's plan (sequence-parallel norms, so every param is a
DTensor and torch's ``clip_grad_norm_`` accepts them):

* fxtrain: ``fx.parallel.tensor_parallel(model, plan, mesh)`` + ``fx.train_step`` with
  ``chain(clip_by_global_norm(0.1), sharded_apply(adamw(1e-2)))``; on 2-D the dp bridge lifts params to the
  2-D mesh and the step all-reduces their dp gradients in one bucket.
* torch: the same plan on a copy, ``loss.backward()``, ``clip_grad_norm_(0.1, foreach=True)``,
  ``torch.optim.AdamW(foreach=True)``; on 2-D ``replicate`` (torch's DDP on FSDP's engine, which takes TP
  params on the tp submesh) over ``mesh["dp"]``, as torchtitan's DDP x TP.

Each rank feeds its dp slice of one fixed batch. Timing: ``_common.interleaved`` (one step of each side per
round, order rotating), wall clock, rank 0's medians over ``--steps`` rounds after 3 warmup rounds; inside
the same steps a clock around forward + backward (fxtrain: ``donated_step``, the engine of
``train_step(donate=True)``, with its default gradient function timed) splits off the update half.
Collectives: ``CommDebugMode`` around one step of each side (it counts c10d ops and functional
collectives alike), after warmup. ``max_rel_diff``: after all steps, max over params of
``max|fx - torch| / max|torch|`` (torch's clip divides by ``norm + 1e-6``, Optax's by ``norm``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

V, D, HEADS, S, B = 256, 64, 4, 32, 8  # vocab, width, heads, sequence, global batch (--width scales V, D, S)
LR, WD, MAX_NORM = 1e-2, 1e-2, 0.1


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, D // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.w2(nn.functional.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(D), Attention()
        self.ffn_norm, self.feed_forward = nn.LayerNorm(D), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def plan() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": gather,
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": gather,
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def model() -> Model:
    torch.manual_seed(0)
    return Model()


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def main() -> None:
    global V, D, S
    import fxtrain as fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=64, help="model width D; vocab 4 D, sequence D / 2")
    args = ap.parse_args()
    V, D, S = 4 * args.width, args.width, args.width // 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 2:
        strategy, mesh = "TP", init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    elif world == 4:
        strategy, mesh = "2-D", init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    else:
        raise SystemExit(f"_parallel_tp.py runs on 2 (TP) or 4 (dp x tp) ranks, not {world}")

    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    if mesh.ndim == 2:  # this rank's dp slice
        n, r = mesh.size(0), mesh.get_local_rank(0)
        tokens, targets = tokens.tensor_split(n)[r], targets.tensor_split(n)[r]

    # fxtrain: train_step's donated step, its default gradient engine wrapped by a clock that splits each
    # step into forward + backward and the update half (same code path as fx.train_step(donate=True))
    from fxtrain.step import _grad, donated_step

    fb: dict[str, list[float]] = {"fxtrain": [], "torch": []}

    def timed_grad(*a):
        t0 = time.perf_counter()
        out = _grad(*a)
        fb["fxtrain"].append(time.perf_counter() - t0)
        return out

    apply, params, buffers = fx.parallel.tensor_parallel(model(), plan(), mesh)
    tx = fx.chain(fx.clip_by_global_norm(MAX_NORM), fx.sharded_apply(fx.adamw(LR, weight_decay=WD)))
    step = donated_step(lambda p, b: loss(apply(p, buffers, b[0], train=True)[0], b[1]), tx, grads=timed_grad)
    fxs = {"params": params, "state": tx.init(params)}

    def fx_step():
        fxs["params"], fxs["state"], _ = step(fxs["params"], fxs["state"], (tokens, targets))

    # torch
    net = model()
    parallelize_module(net, mesh["tp"] if mesh.ndim == 2 else mesh, plan())
    if mesh.ndim == 2:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(net, mesh=mesh["dp"])
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def torch_step():
        t0 = time.perf_counter()
        loss(net(tokens), targets).backward()
        fb["torch"].append(time.perf_counter() - t0)
        torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = _common.interleaved({"fxtrain": fx_step, "torch": torch_step}, rounds=args.steps)
    # the forward + backward share of the timed steps (warmup calls dropped): the update half is the rest
    fb_ms = {k: statistics.median(v[-args.steps:]) * 1e3 for k, v in fb.items()}
    counts = {}
    for name, fn in (("fxtrain", fx_step), ("torch", torch_step)):
        with CommDebugMode() as comm:
            fn()
        counts[name] = comm.get_total_counts()
        if rank == 0:
            print(name, {str(k): v for k, v in comm.get_comm_counts().items()}, file=sys.stderr)

    full = lambda x: x.full_tensor() if isinstance(x, DTensor) else x  # noqa: E731
    diff = 0.0
    for k, p in net.named_parameters():
        a, b = full(fxs["params"][k]).detach(), full(p).detach()
        diff = max(diff, float((a - b).abs().max() / b.abs().max()))

    if rank == 0:
        fx_ms, torch_ms = statistics.median(times["fxtrain"]) * 1e3, statistics.median(times["torch"]) * 1e3
        row = {"strategy": strategy, "world": world, "fxtrain_ms": round(fx_ms, 3), "torch_ms": round(torch_ms, 3),
               "ratio": round(fx_ms / torch_ms, 3), "fxtrain_collectives": counts["fxtrain"],
               "torch_collectives": counts["torch"], "max_rel_diff": diff,
               "note": (f"V={V} D={D} S={S} B={B} f32, torchtitan SP plan; clip(0.1)+sharded_apply(adamw) vs "
                        "clip_grad_norm_+AdamW(foreach)" + ("; torch dp: replicate()" if mesh.ndim == 2 else "")
                        + f"; median fwd+bwd within the steps {fb_ms['fxtrain']:.1f} / {fb_ms['torch']:.1f} ms "
                        f"(fxtrain / torch), the rest (update half) ~{fx_ms - fb_ms['fxtrain']:.1f} / "
                        f"{torch_ms - fb_ms['torch']:.1f} ms"
                        + "; collectives: CommDebugMode, one step")}
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
