"""Built-in models (fxtrain/models.py): shapes, invariants (causality, BatchNorm buffers), a few steps of
training each; and the parallel layouts of the TransformerLM, ``tp_plan`` and ``pipeline_stage`` (below).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxtrain as fx
from fxtrain.models import MLP, MoE, ResNet, TransformerLM, count_params, experts_forward
from tests import _worlds


def test_mlp_flattens_and_counts():
    m = MLP(input_shape=(1, 8, 8), hidden=(16, 16), num_classes=10)
    assert m(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert count_params(fx.functional(m)[1]) == 64 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10


def test_resnet_has_batchnorm_buffers_and_downsamples():
    m = ResNet(input_shape=(3, 16, 16), num_classes=5, width=4, blocks=(1, 2))
    _, params, buffers = fx.functional(m)
    assert any(k.endswith("running_mean") for k in buffers)
    assert m(torch.zeros(2, 3, 16, 16)).shape == (2, 5)
    assert m.stages[1].conv1.stride == (2, 2) and m.stages[2].conv1.stride == (1, 1)


def test_mlp_batchnorm_threads_its_statistics_and_evaluates_with_them():
    torch.manual_seed(0)
    plain, bn = MLP((1, 8, 8), hidden=(16, 8)), MLP((1, 8, 8), hidden=(16, 8), batchnorm=True)
    assert not fx.functional(plain)[2] and [type(m).__name__ for m in bn.net] == \
        ["Flatten", "Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d", "ReLU", "Linear"]
    apply, params, buffers = fx.functional(bn)
    x = torch.randn(32, 1, 8, 8) * 3 + 1
    _, trained = apply(params, buffers, x, train=True)
    # training: the batch's statistics; the running ones move by momentum 0.1, in the returned buffers only
    h = x.flatten(1) @ params["net.1.weight"].T + params["net.1.bias"]
    torch.testing.assert_close(trained["net.2.running_mean"], 0.1 * h.mean(0))
    assert int(trained["net.2.num_batches_tracked"]) == 1 and int(buffers["net.2.num_batches_tracked"]) == 0
    # evaluation: the running statistics, so one example gives the answer it gives inside any batch
    one, kept = apply(params, trained, x[:1], train=False)
    many, _ = apply(params, trained, x, train=False)
    torch.testing.assert_close(one, many[:1])
    assert all(torch.equal(kept[k], trained[k]) for k in kept)
    with pytest.raises(ValueError, match="batchnorm='yes'; expected true or false"):
        MLP((4,), batchnorm="yes")


def test_transformer_is_causal():
    torch.manual_seed(0)
    lm = TransformerLM(vocab_size=20, context=8, d_model=16, n_layers=2, n_heads=4).eval()
    idx = torch.randint(0, 20, (1, 8))
    changed = idx.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 20
    a, b = lm(idx), lm(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("build, match", [
    (lambda: MLP((4,), activation="swish"), "unknown activation 'swish'"),
    (lambda: TransformerLM(d_model=10, n_heads=4), "d_model=10 is not divisible by n_heads=4"),
    (lambda: ResNet(input_shape=(64,)), r"input_shape must be \(channels, height, width\)"),
    (lambda: MoE(8, 16, num_experts=4, top_k=5), "top_k=5 must be between 1 and num_experts=4"),
])
def test_bad_arguments_are_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_transformer_rejects_long_sequences():
    lm = TransformerLM(vocab_size=5, context=4, d_model=8, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="longer than context=4"):
        lm(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("name", ["mlp", "resnet", "transformer", "transformer_moe"])
def test_each_model_learns_a_fixed_batch(name):
    torch.manual_seed(0)
    if name.startswith("transformer"):
        experts = 4 if name == "transformer_moe" else 0
        model = TransformerLM(vocab_size=16, context=8, d_model=16, n_layers=1, n_heads=2, experts=experts)
        x = torch.randint(0, 16, (8, 9))
        x, y = x[:, :-1], x[:, 1:]
    else:
        model = (MLP((1, 8, 8), hidden=(32,), num_classes=4) if name == "mlp"
                 else ResNet((1, 8, 8), num_classes=4, width=4))
        x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))
    apply, params, buffers = fx.functional(model)

    def loss_fn(params, batch):
        buffers, x, y = batch
        logits, buffers = apply(params, buffers, x, train=True)
        return F.cross_entropy(logits.flatten(0, -2), y.flatten()), buffers

    tx = fx.adam(1e-2)
    step = fx.train_step(loss_fn, tx, has_aux=True)
    opt_state = tx.init(params)
    losses = []
    for _ in range(15):
        params, opt_state, metrics = step(params, opt_state, (buffers, x, y))
        buffers = metrics["aux"]
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses


# --- MoE ------------------------------------------------------------------------------------------------

def _moe_by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE's definition, one token and one chosen expert at a time (float64)."""
    out = torch.zeros_like(x)
    for t, token in enumerate(x):
        logits = moe.router.weight @ token
        top = logits.topk(moe.top_k).indices
        gates = logits[top].softmax(0)
        for g, e in zip(gates, top):
            h = F.gelu(token @ moe.w_in[e] + moe.b_in[e])
            out[t] += g * (h @ moe.w_out[e] + moe.b_out[e])
    return out


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_equals_its_definition_token_by_token(top_k):
    torch.manual_seed(0)
    moe = MoE(d_model=6, d_hidden=10, num_experts=4, top_k=top_k).double()
    x = torch.randn(3, 7, 6, dtype=torch.float64)
    torch.testing.assert_close(moe(x), _moe_by_token(moe, x.reshape(-1, 6)).reshape(3, 7, 6), rtol=1e-12, atol=1e-14)


def test_moe_gradients_reach_the_router_and_only_the_chosen_experts():
    torch.manual_seed(0)
    moe = MoE(d_model=4, d_hidden=8, num_experts=6, top_k=2).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    moe(x).square().sum().backward()
    chosen = set(moe.router(x).topk(2).indices.flatten().tolist())
    assert len(chosen) < 6  # 3 tokens x 2 choices leave some of the 6 experts idle
    for e in range(6):
        assert (moe.w_in.grad[e].abs().sum() > 0) == (e in chosen), e
    assert moe.router.weight.grad.abs().sum() > 0  # through the gates


def test_experts_split_over_blocks_sum_to_all_experts():
    """What expert parallelism relies on: each block of experts computed apart, the outputs added."""
    torch.manual_seed(0)
    moe = MoE(d_model=4, d_hidden=8, num_experts=6, top_k=3).double()
    x = torch.randn(9, 4, dtype=torch.float64)
    logits, chosen = moe.router(x).topk(3)
    gates = logits.softmax(-1)
    weights = (moe.w_in, moe.b_in, moe.w_out, moe.b_out)
    parts = [experts_forward(x, gates, chosen, [w[i:i + 2] for w in weights], first=i) for i in (0, 2, 4)]
    torch.testing.assert_close(sum(parts), moe(x), rtol=1e-12, atol=1e-14)
    assert all(p.abs().sum() > 0 for p in parts)


def test_transformer_experts_default_is_the_dense_model():
    torch.manual_seed(0)
    dense = TransformerLM(vocab_size=16, context=8, d_model=16, n_layers=2, n_heads=2)
    torch.manual_seed(0)
    same = TransformerLM(vocab_size=16, context=8, d_model=16, n_layers=2, n_heads=2, experts=0)
    assert all(torch.equal(a, b) for a, b in zip(dense.state_dict().values(), same.state_dict().values()))
    moe = TransformerLM(vocab_size=16, context=8, d_model=16, n_layers=2, n_heads=2, experts=4)
    assert isinstance(moe.blocks[1].mlp, MoE) and moe.blocks[1].mlp.w_in.shape == (4, 16, 64)


def test_moe_config_composes_and_builds_the_tiny_lm():
    from fxtrain import build
    from tests._runner import cfg_of

    cfg = cfg_of("experiment=tiny_lm", "model=moe")  # the command line's model=moe beats the experiment's
    lm = build.model(cfg)
    assert isinstance(lm, TransformerLM) and lm.n_heads == cfg.model.n_heads == 4
    assert all(isinstance(b.mlp, MoE) and b.mlp.num_experts == 4 and b.mlp.top_k == 2 for b in lm.blocks)
    assert lm(torch.zeros(2, cfg.data.context, dtype=torch.long)).shape == (2, cfg.data.context, cfg.data.vocab_size)


def test_attention_splits_heads_from_separate_q_k_v():
    # q, k, v are three Linears (tensor parallelism splits each by heads): with the rows of one fused
    # (3 * d_model) Linear, [q; k; v], they compute exactly what it computed.
    torch.manual_seed(0)
    lm = TransformerLM(vocab_size=16, context=8, d_model=16, n_layers=1, n_heads=4)
    torch.manual_seed(0)
    fused = torch.nn.Linear(16, 48)
    attn = lm.blocks[0].attn
    x = torch.randn(2, 8, 16)
    q, k, v = (t.view(2, 8, 4, 4).transpose(1, 2) for t in fused(x).split(16, dim=2))
    with torch.no_grad():
        for lin, w, b in zip((attn.q, attn.k, attn.v), fused.weight.chunk(3), fused.bias.chunk(3)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16)
        assert torch.equal(attn(x), attn.proj(y))


# --- tp_plan and pipeline_stage on 2 and 4 gloo ranks (tests/_worlds.py) ------------------------------------
# Tests for the parallel layouts of fxtrain/models.py's TransformerLM: ``tp_plan`` and ``pipeline_stage``.
#
# The built-in LM in float64 (LayerNorm params moved off (1, 0) so their gradients matter) is parallelized
# with its own plan by ``fx.parallel.tensor_parallel`` on 2 ranks (tp, with and without sequence
# parallelism) and 4 (dp x tp, 2 x 2), and split by its own ``pipeline_stage`` into torch's
# ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` under ``fx.parallel.pipeline_step`` on 2 ranks
# and 4 (uneven: 5 blocks); each trains 3 clipped AdamW steps and must equal a single-process fxtrain run of
# the same model on the full batch, computed in the same test (1e-12: float64, reduction orders differ).
# The tied head is the delicate part: one DTensor under TP, one owner (the first stage) under PP.

CASES, case = _worlds.registry(worlds=(2, 4))
TIMEOUT_S = 240
V, T, B = 32, 8, 4  # vocabulary, tokens, global batch
MAX_NORM, LR = 0.1, 1e-2  # the gradients' norm is ~1: every step clips
TOL = 1e-12


def model(n_layers: int = 2, n_heads: int = 4, d_model: int = 16):
    from fxtrain.models import TransformerLM

    torch.manual_seed(0)
    m = TransformerLM(vocab_size=V, context=T, d_model=d_model, n_layers=n_layers, n_heads=n_heads).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".ln" in name or name.startswith("ln_f"):
                p.add_(0.1 * torch.randn_like(p))
    return m


def batches(n: int = 3) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(n)]


def cross_entropy(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def stack(groups=()):
    import fxtrain as fx

    # A tensor learning rate keeps every side on the foreach AdamW (tests/test_pipeline.py says why).
    return fx.chain(fx.clip_by_global_norm(MAX_NORM, groups=groups),
                    fx.sharded_apply(fx.adamw(torch.tensor(LR, dtype=torch.float64))))


def train(apply, params, buffers, tx, data):
    import fxtrain as fx

    def loss_fn(params, batch):
        tokens, targets = batch
        return cross_entropy(apply(params, buffers, tokens, train=True)[0], targets)

    step, state, metrics = fx.train_step(loss_fn, tx), tx.init(params), []
    for batch in data:
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return params, metrics


_REFERENCE: dict = {}


def reference(n_layers: int = 2) -> tuple[dict, list]:
    """A single-process fxtrain run of the same model on the full batches: (params, metrics per step)."""
    import fxtrain as fx

    if n_layers not in _REFERENCE:
        _REFERENCE[n_layers] = train(*fx.functional(model(n_layers)), stack(), batches())
    return _REFERENCE[n_layers]


def assert_matches_reference(params: dict, metrics: list, ref_params: dict, ref_metrics: list, dp=None) -> None:
    """``params`` (this rank's, by the model's names) and every step's loss and clip norm equal the reference's.

    ``dp``: the data-parallel mesh whose ranks each report the loss of their own slice (their mean is the
    reference's, equal slices of a mean loss).
    """
    from torch.distributed.tensor import DTensor

    assert params and set(params) <= set(ref_params)
    for k, p in params.items():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        assert got.dtype == torch.float64
        err = float((got - ref_params[k]).abs().max())
        assert err <= TOL * max(1.0, float(ref_params[k].abs().max())), (k, err)
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        loss = m["loss"].detach().double().clone()
        if dp is not None:
            dist.all_reduce(loss, group=dp.get_group())
            loss /= dp.size()
        assert math.isclose(float(loss), float(r["loss"]), rel_tol=TOL), (i, float(loss), float(r["loss"]))
        assert math.isclose(float(m["grad_norm"]), float(r["grad_norm"]), rel_tol=TOL), (i, float(m["grad_norm"]))
    assert float(ref_metrics[0]["grad_norm"]) > MAX_NORM  # the clip acted


_MESHES: dict = {}


def mesh(shape: tuple, names: tuple):
    from torch.distributed.device_mesh import init_device_mesh

    if names not in _MESHES:
        _MESHES[names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[names]


# --- tensor parallel --------------------------------------------------------------------------------

def tensor_parallel_run(m, plan, on, data):
    import fxtrain as fx

    apply, params, buffers = fx.parallel.tensor_parallel(m, plan, on)
    if on.ndim == 2:  # this rank's dp slice of every batch
        n, r = on.size(0), on.get_local_rank(0)
        data = [tuple(x.tensor_split(n)[r] for x in batch) for batch in data]
    return train(apply, params, buffers, stack(), data)


@case(2)
def case_tp_plans_match_one_process(world):
    from torch.distributed.tensor import DTensor, Shard

    ref = reference()
    for sequence_parallel in (True, False):
        m = model()
        params, metrics = tensor_parallel_run(m, m.tp_plan(sequence_parallel=sequence_parallel),
                                              mesh((world,), ("tp",)), batches())
        assert_matches_reference(params, metrics, *ref)
        # the tie survived: one Shard(0) DTensor (vocabulary rows) serves the embedding and the head
        assert m.head.weight is m.tok.weight and "head.weight" not in params
        assert params["tok.weight"].placements == (Shard(0),)
        assert params["blocks.0.attn.q.weight"].to_local().shape == (8, 16)  # 2 of the 4 heads here
        assert isinstance(params["ln_f.weight"], DTensor) == sequence_parallel


@case(4)
def case_dp_x_tp_plan_matches_one_process(world):
    from torch.distributed.tensor import Replicate

    m = model()
    on = mesh((2, 2), ("dp", "tp"))
    params, metrics = tensor_parallel_run(m, m.tp_plan(), on, batches())
    assert_matches_reference(params, metrics, *reference(), dp=on["dp"])
    assert all(p.device_mesh == on and p.placements[0] == Replicate() for p in params.values())


@case(2)
def case_tp_refuses_heads_that_do_not_divide(world):
    import fxtrain as fx
    from fxtrain.models import TransformerLM

    m = model(n_heads=3, d_model=12)
    with pytest.raises(ValueError, match=r"^TransformerLM.tp_plan: model.n_heads=3 is not divisible by the tp "
                                         r"size 2; pick n_heads a multiple of parallel.tp$"):
        fx.parallel.tensor_parallel(m, m.tp_plan(), mesh((world,), ("tp",)))
    # MoE blocks: the attention's plan without sequence parallel; the MoE runs whole on every tp rank
    plan = TransformerLM(vocab_size=V, context=T, d_model=16, n_layers=1, n_heads=4, experts=4).tp_plan()
    assert not any(".mlp" in k for k in plan) and "blocks.*.ln1" not in plan and "blocks.*.attn.proj" in plan


# --- pipeline parallel ------------------------------------------------------------------------------

def pipeline_run(schedule_cls, n_layers: int, world: int, n_micro: int = 2):
    import fxtrain as fx
    from torch.distributed.pipelining import PipelineStage

    pp = mesh((world,), ("pp",))
    rank = dist.get_rank()
    stage_module = model(n_layers).pipeline_stage(rank, world)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"), group=pp.get_group())
    schedule = schedule_cls(stage, n_micro, loss_fn=cross_entropy)
    tx = stack(groups=(pp,))
    params = dict(stage_module.named_parameters())
    step, state, metrics = fx.parallel.pipeline_step(schedule, tx, pp_group=pp), tx.init(params), []
    for batch in batches():
        params, state, m = step(params, state, batch)
        metrics.append(m)
    return stage_module, params, metrics


@case(2)
def case_pipeline_stages_match_one_process(world):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    for schedule_cls in (ScheduleGPipe, Schedule1F1B):
        stage_module, params, metrics = pipeline_run(schedule_cls, 2, world)
        assert_matches_reference(params, metrics, *reference(2))
        # the first stage owns tok.weight (embedding and head); the last holds no copy of it
        assert ("tok.weight" in params) == (dist.get_rank() == 0) and "head.weight" not in params


@case(4)
def case_uneven_pipeline_passes_the_tied_weight_through(world):
    from torch.distributed.pipelining import ScheduleGPipe

    stage_module, params, metrics = pipeline_run(ScheduleGPipe, 5, world)
    assert_matches_reference(params, metrics, *reference(5))
    assert list(stage_module.blocks._modules) == [["0", "1"], ["2"], ["3"], ["4"]][dist.get_rank()]
    names = [None] * world
    dist.all_gather_object(names, sorted(params))
    assert sorted(n for ns in names for n in ns) == sorted(reference(5)[0])  # the stages hold every param once


# --- single process ---------------------------------------------------------------------------------

def test_stages_hold_the_models_params_once_and_compose_to_it():
    import fxtrain as fx

    m = model(n_layers=3)
    stages = [m.pipeline_stage(i, 3) for i in range(3)]
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(fx.functional(m)[1])
    x = batches(1)[0][0]
    out = stages[0](x)
    for s in stages[1:]:
        out = s(*out) if isinstance(out, tuple) else s(out)
    assert torch.equal(out, m(x))


def test_pipeline_stage_refuses_more_stages_than_blocks():
    with pytest.raises(ValueError, match=r"^TransformerLM.pipeline_stage: parallel.pp=3 stages need at least one "
                                         r"block each, but model.n_layers=2; lower parallel.pp or raise "
                                         r"model.n_layers$"):
        model(n_layers=2).pipeline_stage(0, 3)
    with pytest.raises(ValueError, match=r"stage=2 is not in 0..1"):
        model(n_layers=2).pipeline_stage(2, 2)


# --- the pytest side: one spawned world per world size runs every case (tests/_worlds.py) ----------------

test_case = _worlds.tests(__file__, CASES, TIMEOUT_S)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
