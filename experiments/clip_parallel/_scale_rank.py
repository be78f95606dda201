"""One layout of the scale study, run on every rank under torchrun: fxtrain's clip vs torch's, against the truth.

Run by ``scale.py`` as ``torchrun --nproc-per-node N _scale_rank.py --layout L --steps S --out FILE``:

* ``tp`` (2 ranks): ``parallelize_module`` with :func:`plan` (the blocks' Linears; norms and embeddings stay
  plain tensors, replicated);
* ``pp`` (2 ranks): a manual split after block 0, ``PipelineStage`` + ``ScheduleGPipe`` (4 micro-batches);
* ``fsdp_tp`` (4 ranks, dp x tp = 2 x 2): :func:`plan` on ``mesh["tp"]``, then ``fully_shard`` per block and
  at the root on ``mesh["dp"]``;
* ``ep`` (2 ranks): ``fx.parallel.expert_parallel`` of the MoE model (4 experts, top-2) on a 1-D ep mesh.

Each layout trains two copies of the model from the same init on the same batches:

* ``fxtrain``: the library's path for that layout (``tensor_parallel`` + ``train_step``, ``pipeline_step``,
  ``fully_sharded_step``, ``expert_parallel`` + ``train_step``) with ``chain(clip_by_global_norm(CLIP),
  sgd(LR, momentum=MOM))`` (``groups=(pp,)`` for the pipeline, as its docs ask); the norm it reports is
  ``metrics["grad_norm"]``.
* ``torch``: ``torch.nn.utils.clip_grad_norm_`` as users write it in that layout and ``torch.optim.SGD``
  (same lr and momentum; ``foreach=False``, since the foreach path refuses params on different meshes). What
  exactly is clipped in each layout is in :func:`torch_variant`; the norms it reports are every value
  ``clip_grad_norm_`` returned, on every rank (one per stage, per param group).

Before every step rank 0 gathers the full params of each copy and computes the loss and the gradient norm
a single float64 process gets on the whole batch (:class:`Truth`): the "true" norm of that step's gradients.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

V, T, D, LAYERS, HEADS, EXPERTS = 256, 32, 32, 2, 2, 4  # byte vocabulary, context, width, blocks, heads, MoE
BATCH, MICRO = 8, 4  # global batch (sequences), pipeline micro-batches
CLIP, LR, MOM = 0.25, 0.5, 0.9  # clip bound below every true norm of the 1-process runs (0.33-3.8): all clipped
LAYOUTS = {"tp": 2, "pp": 2, "fsdp_tp": 4, "ep": 2}  # layout -> ranks


def model(experts: int = 0) -> nn.Module:
    """The tiny byte LM, the same on every rank and in the reference (seeded), its head untied.

    ``TransformerLM`` ties the head to the embedding; a manual two-stage split puts them on different
    ranks, where tying needs its own all-reduce of the two gradients (Megatron's embedding group). The study
    is about the clip, so every layout and the reference train the untied model (the head starts as a copy).
    """
    from fxtrain.models import TransformerLM

    torch.manual_seed(0)
    m = TransformerLM(vocab_size=V, context=T, d_model=D, n_layers=LAYERS, n_heads=HEADS, experts=experts)
    m.head.weight = nn.Parameter(m.tok.weight.detach().clone())
    return m


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of BATCH windows of T bytes from Python's standard library (fxtrain.data)."""
    from fxtrain.data import stdlib_text

    data = stdlib_text(batch_size=BATCH, context=T, max_bytes=200_000, seed=0)
    return [data.train[k] for k in range(steps)]


def xent(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1))


def tx(groups: tuple = ()):
    import fxtrain as fx

    # sharded_apply: the momentum runs on each DTensor's local piece. Plain fx.sgd(momentum) refuses the tp
    # tree, whose leaves mix DTensors and plain tensors (its trace's torch._foreach_add_ raises "mixed
    # torch.Tensor and DTensor"); the recommended stack has the wrapper anyway, so every layout uses it.
    return fx.chain(fx.clip_by_global_norm(CLIP, groups=groups), fx.sharded_apply(fx.sgd(LR, momentum=MOM)))


def plan() -> dict:
    """Megatron's TP plan for TransformerLM's blocks; embeddings, LayerNorms and the head stay plain (replicated).

    q, k, v column-parallel (each rank whole heads), ``proj`` row-parallel, the MLP a column/row pair: the
    plan of torch's TP tutorial without sequence parallelism. The params are then a mix of DTensors (the
    blocks' Linears) and plain tensors (norms, embeddings, head), each plain one identical on every rank.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(),
            "blocks.*.attn.v": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
            "blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}


class Truth:
    """The loss and gradient norm one float64 process computes for given full params on the whole batch."""

    def __init__(self, experts: int):
        import fxtrain as fx

        self.apply, params, self.buffers = fx.functional(model(experts).double())
        self.names = set(params)

    def __call__(self, full: dict, batch: tuple) -> tuple[float, float]:
        if set(full) != self.names:
            raise ValueError(f"Truth: params {sorted(set(full) ^ self.names)} differ from the model's")
        xs = {k: v.detach().double().requires_grad_() for k, v in full.items()}
        loss = xent(self.apply(xs, self.buffers, batch[0], train=True)[0], batch[1])
        grads = torch.autograd.grad(loss, list(xs.values()))
        return float(loss.detach()), math.sqrt(sum(float(g.square().sum()) for g in grads))


def reference_run(experts: int, steps: int) -> dict:
    """The single-process run (fx.functional + train_step, float32, whole batch): losses, norms, true norms."""
    import fxtrain as fx

    torch.set_num_threads(1)
    apply, params, buffers = fx.functional(model(experts))
    t = tx()
    step = fx.train_step(lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1]), t)
    state, truth = t.init(params), Truth(experts)
    out = {"loss": [], "true_norm": [], "reported": []}
    for b in batches(steps):
        loss, norm = truth(params, b)
        params, state, metrics = step(params, state, b)
        out["loss"].append(loss)
        out["true_norm"].append(norm)
        out["reported"].append([float(metrics["grad_norm"])])
    return out


# --- the distributed copies: each (step(batch) -> reported norms on this rank, full() -> full params) ---

def full_tensors(named) -> dict:
    """Every param's full value (DTensors gathered: a collective, so every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in named}


def gathered_stages(named) -> dict:
    """The pipeline's full params: every stage's own, merged (its names are the model's)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v.detach().clone() for k, v in named})
    return {k: v for part in every for k, v in part.items()}


class First(nn.Module):
    """Stage 0 of the pipeline: embeddings and the first blocks (names as in TransformerLM)."""

    def __init__(self, m: nn.Module, split: int):
        super().__init__()
        self.tok, self.pos, self.blocks = m.tok, m.pos, m.blocks[:split]  # a Sequential slice keeps its keys

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))


class Last(nn.Module):
    """Stage 1: the remaining blocks, the final norm and the head."""

    def __init__(self, m: nn.Module, split: int):
        super().__init__()
        self.blocks, self.ln_f, self.head = m.blocks[split:], m.ln_f, m.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(x)))


def local_share(batch: tuple, index: int, parts: int) -> tuple:
    return tuple(x.chunk(parts)[index] for x in batch)


class Layout:
    """The mesh of a layout and the share of the batch each rank feeds."""

    def __init__(self, name: str):
        from torch.distributed.device_mesh import init_device_mesh

        self.name, self.rank, self.world = name, dist.get_rank(), dist.get_world_size()
        if self.world != LAYOUTS[name]:
            raise SystemExit(f"_scale_rank.py --layout {name} runs on {LAYOUTS[name]} ranks, not {self.world}")
        shape, names = ((2, 2), ("dp", "tp")) if name == "fsdp_tp" else ((self.world,), (name,))  # dims: tp, pp, ep
        self.mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    def share(self, batch: tuple) -> tuple:
        if self.name == "fsdp_tp":
            return local_share(batch, self.mesh["dp"].get_local_rank(), 2)
        if self.name == "ep":
            return local_share(batch, self.rank, self.world)
        return batch  # tp: every rank the whole batch; pp: split into micro-batches by the schedule


def fsdp_tp_model(mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    net = parallelize_module(model(), mesh["tp"], plan())
    for block in net.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    return net


def pipeline(layout: Layout):
    """(stage module, ScheduleGPipe) of this rank, on a fresh model."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    m = model()
    module = First(m, LAYERS // 2) if layout.rank == 0 else Last(m, LAYERS // 2)
    stage = PipelineStage(module, layout.rank, layout.world, torch.device("cpu"), group=layout.mesh.get_group())
    return module, ScheduleGPipe(stage, MICRO, loss_fn=xent)


def pp_batch(layout: Layout, batch: tuple) -> tuple:
    """The pipeline's inputs on the first stage, targets on the last, None elsewhere."""
    return (batch[0] if layout.rank == 0 else None, batch[1] if layout.rank == layout.world - 1 else None)


def fx_variant(layout: Layout):
    """fxtrain's path for the layout: ``(step(batch) -> [reported norm], full() -> full params)``."""
    import fxtrain as fx

    def loss_of(apply, buffers):
        return lambda p, b: xent(apply(p, buffers, b[0], train=True)[0], b[1])

    if layout.name == "pp":
        module, schedule = pipeline(layout)
        t = tx(groups=(layout.mesh,))
        step = fx.parallel.pipeline_step(schedule, t, pp_group=layout.mesh)
        params = dict(module.named_parameters())
        full = lambda: gathered_stages(state["params"].items())  # noqa: E731
    else:
        if layout.name == "tp":
            apply, params, buffers = fx.parallel.tensor_parallel(model(), plan(), layout.mesh)
        elif layout.name == "ep":
            apply, params, buffers = fx.parallel.expert_parallel(model(EXPERTS), layout.mesh)
        else:
            net = fsdp_tp_model(layout.mesh)
            apply, params, buffers = fx.parallel.fully_sharded(net)
        t = tx()
        if layout.name == "fsdp_tp":
            step = fx.parallel.fully_sharded_step(loss_of(apply, buffers), t, net)
        else:
            step = fx.train_step(loss_of(apply, buffers), t)
        full = lambda: full_tensors(state["params"].items())  # noqa: E731
    state = {"params": params, "opt": t.init(params)}

    def train(batch):
        b = pp_batch(layout, batch) if layout.name == "pp" else layout.share(batch)
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], b)
        return [float(metrics["grad_norm"])]

    return train, full, lambda: state["params"].items(), {}


def torch_variant(layout: Layout):
    """``clip_grad_norm_`` as users write it in the layout, and ``torch.optim.SGD``: ``(step, full, notes)``.

    * tp: ``loss.backward()`` on the parallelized module; ``clip_grad_norm_(model.parameters())`` raises
      (DTensor and plain params mixed), so the DTensor params and the plain ones are clipped by two calls.
    * pp: torch's docs' and torchtitan's loop: ``schedule.step``, then ``clip_grad_norm_`` on this stage's
      parameters (each stage its own norm).
    * fsdp_tp: ``loss.backward()``; ``clip_grad_norm_(model.parameters())`` raises (params on the dp mesh and
      on the dp x tp mesh), so the params are grouped by mesh and each group clipped by one call.
    * ep: a hand-written (Megatron-style) loop on local tensors: the same forward and dispatch
      (``expert_parallel``'s apply), dense gradients averaged over the ranks as DDP does (the experts' are
      each rank's own), then ``clip_grad_norm_`` on this rank's local gradients and SGD on its local params.
    """
    notes: dict = {}
    if layout.name == "pp":
        module, schedule = pipeline(layout)
        params = list(module.parameters())
        opt = torch.optim.SGD(params, lr=LR, momentum=MOM, foreach=False)

        def train(batch):
            x, y = pp_batch(layout, batch)
            schedule.step(*([x] if x is not None else []), target=y)
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return [float(norm)]

        return train, lambda: gathered_stages(module.named_parameters()), module.named_parameters, notes

    if layout.name == "ep":
        return _torch_ep(layout, notes)

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    net = parallelize_module(model(), layout.mesh, plan()) if layout.name == "tp" else fsdp_tp_model(layout.mesh)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOM, foreach=False)
    if layout.name == "tp":
        groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        notes["groups"] = ["DTensor params", "plain params"]
    else:
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault(p.device_mesh.mesh_dim_names, []).append(p)
        order = sorted(by_mesh, key=len, reverse=True)  # the dp x tp group first, as TP's DTensor group
        groups = [by_mesh[k] for k in order]
        notes["groups"] = [f"params on the {' x '.join(k)} mesh" for k in order]

    def train(batch):
        x, y = layout.share(batch)
        xent(net(x), y).backward()
        if "clip_grad_norm_" not in notes:  # what the one-line call does here (it raises before clipping)
            try:
                # max_norm=inf: the call users write, with a coefficient clamped to 1 (grads unchanged)
                norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
                notes["clip_grad_norm_"] = f"returned {float(_value(norm)):.6g}"
            except Exception as e:  # noqa: BLE001 - recorded as the finding
                notes["clip_grad_norm_"] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        norms = [float(_value(torch.nn.utils.clip_grad_norm_(g, CLIP))) for g in groups]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norms

    return train, lambda: full_tensors(net.named_parameters()), net.named_parameters, notes


def _value(x):
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _torch_ep(layout: Layout, notes: dict):
    import fxtrain as fx
    from fxtrain.distributed import reduce_partials

    apply, params, buffers = fx.parallel.expert_parallel(model(EXPERTS), layout.mesh)
    names = list(params)
    # nn.Parameters over this rank's local pieces (same storage): SGD updates the DTensors' values in place
    local = [nn.Parameter(params[k]._local_tensor, requires_grad=False) for k in names]
    opt = torch.optim.SGD(local, lr=LR, momentum=MOM, foreach=False)

    def train(batch):
        xs = {k: v.detach().requires_grad_() for k, v in params.items()}
        x, y = layout.share(batch)
        grads = torch.autograd.grad(xent(apply(xs, buffers, x, train=True)[0], y), list(xs.values()))
        reduced = reduce_partials(grads)  # dense: averaged over the ranks (DDP's all-reduce); experts: own rows
        if "clip_grad_norm_" not in notes:  # torch's norm of the DTensor gradients themselves, for the record
            notes["clip_grad_norm_"] = ("on the DTensor gradients (dense and experts on one 1-D mesh object) "
                                        f"returns {float(_value(torch.nn.utils.get_total_norm(reduced))):.6g}")
        for p, g in zip(local, reduced):
            p.grad = g.to_local()
        norm = torch.nn.utils.clip_grad_norm_(local, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return [float(norm)]

    return train, lambda: full_tensors(params.items()), params.items, notes


def replica_drift(named) -> float:
    """Largest difference between ranks' copies of the params meant to be identical on every rank.

    Those are the plain params of TP and the ``Replicate`` DTensors (EP's dense params); ``full_tensor``
    of a ``Replicate`` DTensor reads this rank's copy and would hide a drift, so the local copies are
    all-gathered and compared with rank 0's. (Not for the pipeline, whose stages hold different params.)
    """
    from torch.distributed.tensor import DTensor

    drift = torch.zeros((), dtype=torch.float64)
    for _, p in sorted(named(), key=lambda kv: kv[0]):
        if isinstance(p, DTensor):
            if not all(q.is_replicate() for q in p.placements) or p.device_mesh.size() != dist.get_world_size():
                continue
            p = p._local_tensor
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, p.detach().contiguous())
        drift = torch.maximum(drift, max((c - copies[0]).abs().max() for c in copies).double())
    return float(drift)


def _labelled(variant: str, layout: Layout, per_rank: list, notes: dict) -> dict:
    """The distinct norms each step reported, and what each is: values equal on every rank are kept once."""
    flat = [[n for r in step for n in r] for step in per_rank]
    if variant == "torch" and layout.name == "pp":  # each stage its own norm
        return {"reported": flat, "labels": [f"stage {r} (rank {r})" for r in range(layout.world)]}
    if variant == "torch" and layout.name == "ep":  # each rank its own norm
        return {"reported": flat, "labels": [f"rank {r}'s local grads" for r in range(layout.world)]}
    groups = ["grad_norm"] if variant == "fxtrain" else notes["groups"]
    if all(math.isclose(a, b, rel_tol=1e-6) for step in per_rank for r in step for a, b in zip(r, step[0])):
        return {"reported": [step[0] for step in per_rank], "labels": groups}
    return {"reported": flat, "labels": [f"rank {r}: {g}" for r in range(layout.world) for g in groups]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=list(LAYOUTS), required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", required=True, help="JSON written by rank 0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layout = Layout(args.layout)
    truth = Truth(EXPERTS if args.layout == "ep" else 0) if layout.rank == 0 else None
    data = batches(args.steps)
    result = {"layout": args.layout, "ranks": layout.world, "variants": {}}
    for name, build in (("fxtrain", fx_variant), ("torch", torch_variant)):
        train, full, named, notes = build(layout)
        rows = {"loss": [], "true_norm": [], "reported": [], "per_rank": []}
        for b in data:
            params = full()
            norms = train(b)
            every = [None] * layout.world
            dist.all_gather_object(every, norms)
            if truth is not None:
                loss, norm = truth(params, b)
                rows["loss"].append(loss)
                rows["true_norm"].append(norm)
                rows["per_rank"].append(every)
        reported = _labelled(name, layout, rows.pop("per_rank"), notes)
        drift = None if args.layout == "pp" else replica_drift(named)
        result["variants"][name] = {**rows, **reported, "notes": notes, "replica_drift": drift}
    if layout.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown: on this loaded machine a gloo rank now and then aborted there
    # ("terminate called without an active exception", SIGABRT) after its work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
