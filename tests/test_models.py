"""Built-in models: shapes, invariants (causality, BatchNorm buffers), and a few steps of training each."""

import pytest
import torch
import torch.nn.functional as F

import fxtrain as fx
from fxtrain.models import MLP, ResNet, TransformerLM, count_params


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
])
def test_bad_arguments_are_named(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_transformer_rejects_long_sequences():
    lm = TransformerLM(vocab_size=5, context=4, d_model=8, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match="longer than context=4"):
        lm(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("name", ["mlp", "resnet", "transformer"])
def test_each_model_learns_a_fixed_batch(name):
    torch.manual_seed(0)
    if name == "transformer":
        model = TransformerLM(vocab_size=16, context=8, d_model=16, n_layers=1, n_heads=2)
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
