"""Tests for fxtrain/distributed/_tensor_parallel.py: torch's ``parallelize_module`` under the functional step.

A 2-block transformer-ish model (embedding, LayerNorms, attention, MLP, output Linear) in float64 is
parallelized by torch's own ``parallelize_module`` with a torchtitan-style plan (sequence-parallel norms)
and a Megatron-style one (plain norms beside DTensors), on 2 ranks (TP) and 4 ranks (dp x tp, 2 x 2), and
trained 3 steps with the README's stack; the params must equal a single-process fxtrain run of the same
model on the full batch, computed in the same test (1e-12: float64, reduction orders differ).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 240
V, D, HEADS, S, B = 32, 16, 4, 8, 4  # vocab, width, heads, sequence, global batch
TOL = 1e-12


# --- the model and its plans ---------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        hd = D // HEADS
        # -1 heads: under TP each rank holds HEADS / tp of them (wq/wk/wv colwise)
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
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


def model() -> Model:
    torch.manual_seed(0)
    m = Model().double()
    with torch.no_grad():  # LayerNorm params away from (1, 0), so their gradients matter to the check
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def sp_plan() -> dict:
    """torchtitan's plan: sequence-parallel norms and residual stream, Shard(1) between blocks."""
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


def plain_norm_plan() -> dict:
    """Megatron's plan without sequence parallelism: norms stay plain nn.LayerNorm params beside DTensors."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "tok": RowwiseParallel(input_layouts=Replicate()),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def loss_of(apply, buffers):
    def loss_fn(params, batch):
        tokens, targets = batch
        logits, _ = apply(params, buffers, tokens, train=True)
        return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
    return loss_fn


def stacks() -> dict:
    import fxtrain as fx

    return {
        "clip+sharded_adamw": lambda: fx.chain(fx.clip_by_global_norm(0.1), fx.sharded_apply(fx.adamw(1e-2))),
        "clip+zero_adamw": lambda: fx.chain(fx.clip_by_global_norm(0.1),
                                            fx.sharded_apply(fx.adamw(1e-2), shard_over="dp")),
        "zero_adamw": lambda: fx.sharded_apply(fx.adamw(1e-2), shard_over="dp"),
    }


def train(apply, params, buffers, tx, data, steps: int = 3):
    import fxtrain as fx

    step = fx.train_step(loss_of(apply, buffers), tx)
    state = tx.init(params)
    for _ in range(steps):
        params, state, metrics = step(params, state, data)
    return params, state, metrics


_REFERENCE: dict = {}


def reference(stack: str) -> tuple[dict, dict]:
    """A single-process fxtrain run of the same model on the full batch: (params, last metrics)."""
    import fxtrain as fx

    if stack not in _REFERENCE:
        apply, params, buffers = fx.functional(model())
        params, _, metrics = train(apply, params, buffers, stacks()[stack](), batch())
        _REFERENCE[stack] = params, metrics
    return _REFERENCE[stack]


def full(x):
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def assert_close_to(params: dict, ref: dict) -> None:
    assert params.keys() == ref.keys()
    for k in ref:
        got = full(params[k])
        assert got.dtype == torch.float64 and torch.allclose(got, ref[k], rtol=TOL, atol=TOL), \
            (k, (got - ref[k]).abs().max().item())


_MESHES: dict = {}


def mesh(world: int, kind: str):
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESHES:
        _MESHES["tp"] = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        if world == 4:
            _MESHES["dp_tp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _MESHES[kind]


def local_slice(data, m):
    """This rank's dp slice of the batch (the whole batch on a 1-D tp mesh)."""
    if m.ndim == 1:
        return data
    n, r = m.size(0), m.get_local_rank(0)
    return tuple(x.tensor_split(n)[r] for x in data)


class Collectives:
    """Records each torch.distributed collective as (name, ranks of its group) while active."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
             "reduce_scatter", "all_to_all_single")

    def __enter__(self):
        self.calls, self.saved = [], {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in self.saved.items():
            def wrapped(*args, _fn=fn, _n=n, group=None, **kwargs):
                world = dist.get_world_size()
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world))
                self.calls.append((_n, ranks))
                return _fn(*args, group=group, **kwargs)
            setattr(dist, n, wrapped)
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


# --- cases ------------------------------------------------------------------------------------------------

def check_against_reference(world, kind, plan, stack):
    import fxtrain as fx

    m = mesh(world, kind)
    apply, params, buffers = fx.parallel.tensor_parallel(model(), plan(), m)
    made = stacks()[stack]
    got, state, metrics = train(apply, params, buffers, made(), local_slice(batch(), m))
    ref, ref_metrics = reference(stack)
    assert_close_to(got, ref)
    # clip + Adam hide a gradient off by a constant factor; the reported norm does not
    if "grad_norm" in ref_metrics:
        norm, ref_norm = float(metrics["grad_norm"]), float(ref_metrics["grad_norm"])
        assert abs(norm - ref_norm) <= TOL * ref_norm, (norm, ref_norm)
    return got, state


@case(2)
def case_tp_sp_plan_matches_one_process(world):
    from torch.distributed.tensor import DTensor

    got, _ = check_against_reference(world, "tp", sp_plan, "clip+sharded_adamw")
    assert all(isinstance(p, DTensor) for p in got.values())  # every param is torch's DTensor (SP norms too)


@case(2)
def case_tp_plain_norms_match_one_process_where_torch_clip_raises(world):
    import fxtrain as fx
    from torch.distributed.tensor import DTensor

    got, _ = check_against_reference(world, "tp", plain_norm_plan, "clip+sharded_adamw")
    assert not isinstance(got["norm.weight"], DTensor) and isinstance(got["output.weight"], DTensor)

    # torch's own path on the same parallelized module: its clip_grad_norm_ cannot take the mix
    net = model()
    fx.parallel.tensor_parallel(net, plain_norm_plan(), mesh(world, "tp"))
    tokens, targets = batch()
    nn.functional.cross_entropy(net(tokens).reshape(-1, V), targets.reshape(-1)).backward()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    # fxtrain's norm of the same gradients is the single-process one
    ref_net = model()
    nn.functional.cross_entropy(ref_net(tokens).reshape(-1, V), targets.reshape(-1)).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref_net.parameters()])
    grads = fx.distributed.match_placements({k: p.grad for k, p in net.named_parameters()},
                                            dict(net.named_parameters()))
    assert abs(float(fx.global_norm(grads)) - float(expected)) <= TOL * float(expected)


@case(4)
def case_2d_sp_plan_matches_one_process(world):
    from torch.distributed.tensor import Replicate

    got, _ = check_against_reference(world, "dp_tp", sp_plan, "clip+sharded_adamw")
    m = mesh(world, "dp_tp")
    assert all(p.device_mesh == m and p.placements[0] == Replicate() for p in got.values())


@case(4)
def case_2d_plain_norms_match_one_process(world):
    check_against_reference(world, "dp_tp", plain_norm_plan, "clip+sharded_adamw")


@case(4)
def case_2d_zero_over_dp_matches_one_process(world):
    from torch.distributed.tensor import Shard

    for stack in ("clip+zero_adamw", "zero_adamw"):
        _, state = check_against_reference(world, "dp_tp", sp_plan, stack)
        mu = state[1][0].mu if stack == "clip+zero_adamw" else state[0].mu
        # rowwise weights keep whole rows on tp: their Adam state is split over dp (ZeRO)
        assert mu["layers.0.feed_forward.w2.weight"].placements == (Shard(0), Shard(1)), stack


@case(4)
def case_2d_gradients_reduced_in_one_all_reduce_per_dp_group(world):
    import fxtrain as fx
    from torch.distributed.tensor import Partial, Shard

    m = mesh(world, "dp_tp")
    apply, params, buffers = fx.parallel.tensor_parallel(model(), sp_plan(), m)
    xs = {k: p.detach().requires_grad_() for k, p in params.items()}
    loss = loss_of(apply, buffers)(xs, local_slice(batch(), m))
    grads = dict(zip(xs, torch.autograd.grad(loss, list(xs.values()))))
    assert all(g.placements[0] == Partial("avg") for g in grads.values())
    # the embedding's Replicate gradient arrives as this rank's rows (sliced before the dp all-reduce);
    # sequence-parallel norms' as autograd made them, Partial over tp
    assert grads["tok.weight"].placements == (Partial("avg"), Shard(0))
    assert grads["norm.weight"].placements == (Partial("avg"), Partial("sum"))
    with Collectives() as c:
        out = fx.distributed.match_placements(grads, params)
    dp_ranks = tuple(m["dp"].mesh.tolist())
    tp_ranks = tuple(m["tp"].mesh.tolist())
    # every leaf over dp in one bucket; the Partial (sum) SequenceParallel norm gradients over tp in one more
    assert sorted(c.calls) == sorted([("all_reduce", dp_ranks), ("all_reduce", tp_ranks)]), c.calls
    assert all(g.placements == params[k].placements for k, g in out.items())


@case(2)
def case_bad_plan_key_and_mesh_named(world):
    import fxtrain as fx

    with pytest.raises(ValueError, match=r"plan key 'layers\.\*\.mlp' matches no submodule of Model .*fix the key"):
        fx.parallel.tensor_parallel(model(), {**sp_plan(), "layers.*.mlp": None}, mesh(world, "tp"))
    with pytest.raises(ValueError, match=r"has dims \('tp',\), it needs \('model',\).*mesh_dim_names"):
        fx.parallel.tensor_parallel(model(), sp_plan(), mesh(world, "tp"), tp="model")


@case(4)
def case_bad_2d_mesh_and_params_named(world):
    import fxtrain as fx

    m = mesh(world, "dp_tp")
    with pytest.raises(ValueError, match=r"has dims \('dp', 'tp'\), it needs \('data', 'tp'\)"):
        fx.parallel.tensor_parallel(model(), sp_plan(), m, dp="data")
    apply, params, buffers = fx.parallel.tensor_parallel(model(), sp_plan(), m)
    tp_params = {k: v.to_local() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"param 'tok.weight' is a plain Tensor; pass the params tensor_parallel"):
        apply(tp_params, buffers, batch()[0], train=True)


def test_plan_key_refused_without_a_mesh():
    import fxtrain as fx

    with pytest.raises(ValueError, match=r"^tensor_parallel: the plan key 'layers\.1\.ffn' matches no submodule of "
                                         r"Model \(its submodules: layers, layers\.0, "):
        fx.parallel.tensor_parallel(Model(), {"layers.1.ffn": None}, None)
    with pytest.raises(ValueError, match="mesh must be a DeviceMesh, got NoneType"):
        fx.parallel.tensor_parallel(Model(), {"layers.1": None}, None)


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
