"""fxtrain/interop/_linen.py: Flax linen names and layouts; a linen-style forward gives torch's outputs.

The first checks write linen forward passes in jax.numpy, reading the converted variables as
flax.linen's Dense/Conv/LayerNorm/Embed do; the rest run flax.linen itself (the jax extra installs it):
Flax's init gives the tree to_linen gives, Flax's apply gives torch's outputs, and Flax's init loads
into torch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxtrain.interop import from_jax, from_linen, linen_names, to_linen
from fxtrain.models import MLP, ResNet, TransformerLM
from fxtrain.testing import assert_trees_close

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytestmark = pytest.mark.jax


def dense(v, x):
    return x @ v["kernel"] + v["bias"]


def linen_mlp(variables, x, n_layers):
    p = variables["params"]
    x = x.reshape(x.shape[0], -1)
    for i in range(n_layers - 1):
        x = jax.nn.relu(dense(p[f"Dense_{i}"], x))
    return dense(p[f"Dense_{n_layers - 1}"], x)


def test_mlp_same_outputs_from_converted_params():
    torch.manual_seed(0)
    net = MLP(input_shape=(1, 8, 8), hidden=(32, 16), num_classes=10)
    params = dict(net.named_parameters())
    variables = to_linen(params, net)
    assert sorted(variables["params"]) == ["Dense_0", "Dense_1", "Dense_2"]
    assert variables["params"]["Dense_0"]["kernel"].shape == (64, 32)  # (in, out); torch weight is (32, 64)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        expected = net(x)
    got = from_jax(linen_mlp(variables, jnp.asarray(x.numpy()), 3))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.conv = nn.Conv2d(6, 4, kernel_size=3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):  # ids: (B, H, W) token ids -> (B, 3)
        x = self.embed(ids).permute(0, 3, 1, 2)  # NCHW
        x = self.conv(x).permute(0, 2, 3, 1)  # NHWC
        return self.head(torch.relu(self.norm(x)).mean(dim=(1, 2)))


def linen_convnet(variables, ids):
    p = variables["params"]
    x = p["Embed_0"]["embedding"][ids]  # NHWC, as flax.linen.Embed
    x = jax.lax.conv_general_dilated(x, p["Conv_0"]["kernel"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["Conv_0"]["bias"]
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    x = (x - mean) / jnp.sqrt(var + 1e-5) * p["LayerNorm_0"]["scale"] + p["LayerNorm_0"]["bias"]
    return dense(p["Dense_0"], jax.nn.relu(x).mean(axis=(1, 2)))


def test_conv_layernorm_embed_layouts_give_the_same_outputs():
    torch.manual_seed(0)
    net = ConvNet()
    variables = to_linen(dict(net.named_parameters()), net)
    assert variables["params"]["Conv_0"]["kernel"].shape == (3, 3, 6, 4)  # HWIO; torch is OIHW (4, 6, 3, 3)
    assert set(variables["params"]["LayerNorm_0"]) == {"scale", "bias"}
    assert set(variables["params"]["Embed_0"]) == {"embedding"}
    ids = torch.randint(0, 11, (2, 5, 5))
    with torch.no_grad():
        expected = net(ids)
    got = from_jax(linen_convnet(variables, jnp.asarray(ids.numpy().astype("int32"))))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_with_flax_linen_mlp():
    linen = pytest.importorskip("flax.linen")

    class FlaxMLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            x = linen.relu(linen.Dense(32)(x))
            return linen.Dense(10)(x)

    net = MLP(input_shape=(1, 8, 8), hidden=(32,), num_classes=10)
    x = torch.randn(3, 1, 8, 8)
    fresh = FlaxMLP().init(jax.random.key(0), jnp.zeros((1, 1, 8, 8)))
    variables = to_linen(dict(net.named_parameters()), net)
    assert jax.tree.structure(fresh) == jax.tree.structure(variables)
    got = from_jax(FlaxMLP().apply(variables, jnp.asarray(x.numpy())))
    with torch.no_grad():
        torch.testing.assert_close(got, net(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("naming", ["compact", "attribute"])
@pytest.mark.parametrize("make", [lambda: ResNet(width=4), lambda: TransformerLM(64, 8, 16, 2, 2), ConvNet],
                         ids=["resnet", "transformer", "convnet"])
def test_round_trip_is_exact(make, naming):
    net = make()
    params = {k: p.detach() for k, p in net.named_parameters()}
    back = from_linen(to_linen(params, net, naming=naming), net, naming=naming)
    assert list(back) == list(params)
    assert_trees_close(back, params, rtol=0, atol=0)
    assert all(t.is_contiguous() for t in back.values())


def test_names_nested_scopes_tied_weights_and_batch_stats():
    lm = TransformerLM(64, 8, 16, 1, 2)
    names = {k: "/".join(v.path) for k, v in linen_names(lm).items()}
    assert names["blocks.0.attn.q.weight"] == "params/_TransformerBlock_0/_Attention_0/Dense_0/kernel"
    assert names["blocks.0.mlp.2.bias"] == "params/_TransformerBlock_0/Dense_1/bias"
    assert "head.weight" not in names  # tied to tok.weight: once, under its first name
    attr = {k: "/".join(v.path) for k, v in linen_names(lm, naming="attribute").items()}
    assert attr["blocks.0.ln1.weight"] == "params/blocks_0/ln1/scale"
    net = ResNet(width=4)
    from fxtrain import functional

    _, params, buffers = functional(net)
    v = to_linen(params, net, buffers=buffers, as_jax=False)
    assert torch.equal(v["batch_stats"]["BatchNorm_0"]["var"], buffers["stem.1.running_var"])
    assert set(v["params"]["BatchNorm_0"]) == {"scale", "bias"}
    zero_copy = to_linen(params, net)["params"]["BatchNorm_0"]["scale"]  # same layout: shared buffer
    assert zero_copy.unsafe_buffer_pointer() == params["stem.1.weight"].data_ptr()


def test_errors_name_the_path():
    net = nn.Sequential(nn.Linear(3, 4), nn.ConvTranspose2d(4, 2, 3))
    with pytest.raises(ValueError, match=r"no Flax linen layout for ConvTranspose2d at '1'"):
        to_linen(dict(net.named_parameters()), net)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    v = to_linen(dict(mlp.named_parameters()), mlp, as_jax=False)
    with pytest.raises(ValueError, match=r"'extra.weight' is not a parameter of Sequential"):
        to_linen({"extra.weight": torch.zeros(1)}, mlp)
    del v["params"]["Dense_1"]["bias"]
    with pytest.raises(ValueError, match=r"'2.bias' expects 'params/Dense_1/bias'.*no 'params/Dense_1/bias'"):
        from_linen(v, mlp)
    v = to_linen(dict(mlp.named_parameters()), mlp, as_jax=False)
    v["params"]["Dense_0"]["kernel"] = torch.zeros(4, 3)  # torch layout given where linen's is expected
    with pytest.raises(ValueError, match=r"'params/Dense_0/kernel' gives '0.weight' the shape \(3, 4\), expected \(4, 3\)"):
        from_linen(v, mlp)
    v = to_linen(dict(mlp.named_parameters()), mlp, as_jax=False)
    v["params"]["Dense_7"] = {"kernel": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"'params/Dense_7/kernel' is not a parameter of Sequential"):
        from_linen(v, mlp)


# --- against flax.linen itself: init gives the tree to_linen gives; apply gives torch's outputs ---------

TOL = dict(rtol=1e-5, atol=1e-5)  # float32 rounding: the two frameworks sum in different orders


def _channels_last(x):
    return x.movedim(1, -1)


def _linen_cases():
    linen = pytest.importorskip("flax.linen")
    ident = lambda x: x  # noqa: E731
    return {
        "dense": (lambda: nn.Linear(5, 7), lambda: linen.Dense(7), (3, 5), ident),
        "conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), lambda: linen.Conv(4, (3,)), (2, 3, 9), _channels_last),
        "conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), lambda: linen.Conv(4, (3, 3)), (2, 3, 6, 5),
                   _channels_last),
        "conv3d": (lambda: nn.Conv3d(2, 3, (3, 1, 3), stride=(1, 2, 1)),
                   lambda: linen.Conv(3, (3, 1, 3), strides=(1, 2, 1), padding="VALID"), (2, 2, 5, 6, 4),
                   _channels_last),
        "layernorm": (lambda: nn.LayerNorm(6), lambda: linen.LayerNorm(epsilon=1e-5), (3, 4, 6), ident),
        "groupnorm": (lambda: nn.GroupNorm(2, 6), lambda: linen.GroupNorm(num_groups=2, epsilon=1e-5), (3, 6, 5),
                      _channels_last),
        "rmsnorm": (lambda: nn.RMSNorm(6, eps=1e-6), lambda: linen.RMSNorm(epsilon=1e-6), (3, 4, 6), ident),
    }


def _perturbed(module):
    with torch.no_grad():  # norms init to ones/zeros: make every leaf matter
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module


@pytest.mark.parametrize("case", ["dense", "conv1d", "conv2d", "conv3d", "layernorm", "groupnorm", "rmsnorm"])
def test_against_flax_linen_layers(case):
    make_torch, make_flax, shape, layout = _linen_cases()[case]
    torch.manual_seed(0)
    net, fnet = _perturbed(make_torch()), make_flax()
    x = torch.randn(*shape)
    xj = jnp.asarray(layout(x).numpy())
    fresh = fnet.init(jax.random.key(0), xj)
    variables = to_linen(dict(net.named_parameters()), net)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, fresh)
    with torch.no_grad():
        expected = layout(net(x))
    torch.testing.assert_close(from_jax(fnet.apply(variables, xj)), expected, **TOL)
    # and back: Flax's own init, loaded into torch, computes what Flax computes
    net.load_state_dict(from_linen(fresh, net))
    with torch.no_grad():
        torch.testing.assert_close(layout(net(x)), from_jax(fnet.apply(fresh, xj)), **TOL)


def test_against_flax_linen_embed():
    linen = pytest.importorskip("flax.linen")
    torch.manual_seed(0)
    net, fnet = nn.Embedding(11, 6), linen.Embed(11, 6)
    ids = torch.randint(0, 11, (3, 4))
    idsj = jnp.asarray(ids.numpy().astype("int32"))
    fresh = fnet.init(jax.random.key(0), idsj)
    variables = to_linen(dict(net.named_parameters()), net)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, fresh)
    with torch.no_grad():
        assert torch.equal(from_jax(fnet.apply(variables, idsj)), net(ids))  # a gather: exact
    net.load_state_dict(from_linen(fresh, net))
    with torch.no_grad():
        assert torch.equal(net(ids), from_jax(fnet.apply(fresh, idsj)))


def test_against_flax_linen_batchnorm_with_batch_stats():
    linen = pytest.importorskip("flax.linen")
    from fxtrain import functional

    torch.manual_seed(0)
    net = _perturbed(nn.BatchNorm2d(4))
    x = torch.randn(8, 4, 3, 3)
    net(x * 2 + 1)  # running statistics away from their init
    _, params, buffers = functional(net)
    variables = to_linen(params, net, buffers=buffers)
    xj = jnp.asarray(_channels_last(x).numpy())
    fnet = linen.BatchNorm(use_running_average=True, epsilon=1e-5)
    fresh = fnet.init(jax.random.key(0), xj)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, fresh)
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(from_jax(fnet.apply(variables, xj)), _channels_last(net(x)), **TOL)
    # training mode: same normalization (by the batch's biased variance) and the same running mean with
    # Flax's momentum 0.9 = torch's 0.1; torch's running var takes the unbiased batch variance, Flax's the
    # biased one (the two differ by n / (n - 1) in the new term)
    net.train()
    train = linen.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)
    out, new = train.apply(variables, xj, mutable=["batch_stats"])
    before = buffers["running_var"].clone()
    with torch.no_grad():
        torch.testing.assert_close(from_jax(out), _channels_last(net(x)), **TOL)
    torch.testing.assert_close(from_jax(new["batch_stats"]["mean"]), net.running_mean, **TOL)
    n = x.numel() / x.shape[1]
    torch.testing.assert_close((from_jax(new["batch_stats"]["var"]) - 0.9 * before) * n / (n - 1),
                               net.running_var - 0.9 * before, **TOL)


def _mha_check(net, fnet, q, k, v):
    qj, kj, vj = (jnp.asarray(t.numpy()) for t in (q, k, v))
    fresh = fnet.init(jax.random.key(0), qj, kj, vj)
    variables = to_linen(dict(net.named_parameters()), net)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, fresh)
    with torch.no_grad():
        expected, _ = net(q, k, v, need_weights=False)
    torch.testing.assert_close(from_jax(fnet.apply(variables, qj, kj, vj)), expected, **TOL)
    net.load_state_dict(from_linen(fresh, net))
    with torch.no_grad():
        torch.testing.assert_close(net(q, k, v, need_weights=False)[0], from_jax(fnet.apply(fresh, qj, kj, vj)),
                                   **TOL)
    back = from_linen(to_linen(dict(net.named_parameters()), net, as_jax=False), net)
    assert all(torch.equal(back[n], p) for n, p in net.named_parameters())


def test_against_flax_multi_head_attention():
    linen = pytest.importorskip("flax.linen")
    torch.manual_seed(0)
    net = _perturbed(nn.MultiheadAttention(8, 2, batch_first=True))  # one in_proj_weight (24, 8)
    q, kv = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    _mha_check(net, linen.MultiHeadDotProductAttention(num_heads=2), q, kv, kv)
    # kdim/vdim: separate q/k/v_proj_weight; no biases
    net = nn.MultiheadAttention(8, 4, kdim=5, vdim=6, bias=False, batch_first=True)
    _mha_check(net, linen.MultiHeadDotProductAttention(num_heads=4, use_bias=False),
               torch.randn(2, 3, 8), torch.randn(2, 4, 5), torch.randn(2, 4, 6))


def test_against_flax_linen_compact_attention_block():
    linen = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8))

        def forward(self, x):
            h = self.ln(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(x)

    class FlaxBlock(linen.Module):
        @linen.compact
        def __call__(self, x):
            h = linen.LayerNorm(epsilon=1e-5)(x)
            x = x + linen.MultiHeadDotProductAttention(num_heads=2)(h)
            h = linen.gelu(linen.Dense(16)(x))  # Dense_0 (compact names count in creation order)
            return x + linen.Dense(8)(h)

    torch.manual_seed(0)
    net = _perturbed(Block())
    x = torch.randn(2, 5, 8)
    xj = jnp.asarray(x.numpy())
    fresh = FlaxBlock().init(jax.random.key(0), xj)
    variables = to_linen(dict(net.named_parameters()), net)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, fresh)
    with torch.no_grad():
        torch.testing.assert_close(from_jax(FlaxBlock().apply(variables, xj)), net(x), **TOL)


def test_attention_errors_name_the_path():
    net = nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"MultiheadAttention at '0' has add_bias_kv=True"):
        to_linen(dict(net.named_parameters()), net)
