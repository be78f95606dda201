"""Built-in models: shapes, invariants (causality, BatchNorm buffers), and a few steps of training each."""

import pytest
import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain.models import MLP, MoE, ResNet, TransformerLM, count_params, experts_forward


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
    lm = build.instantiate(cfg.model, "model")
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
