"""fx.functional on Hugging Face transformers models (tiny GPT-2 and BERT configs built here, no download).

The donated step with the recommended stack equals torch.optim's AdamW + clip_grad_norm_ over 20 steps
(float32, rtol 1e-5 and atol 1e-5 = lr x 1e-3: torch computes Adam's bias corrections in float64 on the host, fxtrain in float32);
the pure step vmaps as an ensemble and differentiates through updates; tied weights stay tied.
"""

from __future__ import annotations

import pytest
import torch

import fxtrain as fx
from fxtrain import tasks, tree
from fxtrain.testing import assert_trees_close

transformers = pytest.importorskip("transformers")

STEPS, LR, WD, CLIP = 20, 1e-2, 0.1, 1.0


def tiny_gpt2(attn="sdpa"):
    # under vmap, "eager" attention: SDPA's CPU kernel has no batching rule (a performance warning)
    cfg = transformers.GPT2Config(attn_implementation=attn, n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def tiny_bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


# the tied pair in each model: (the name fx.functional keeps, the name tied to it)
TIED = {"gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "bert": ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")}
MAKE = {"gpt2": tiny_gpt2, "bert": tiny_bert}


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(n)]


def loss_of(model, own_loss=False):
    """The model's loss (``labels=``), or with ``own_loss`` the next-token cross-entropy computed here in
    the model's dtype (transformers computes its loss in float32 even for a float64 model)."""
    apply, params, buffers = fx.functional(model)

    def loss_fn(params, ids):
        out, _ = apply(params, buffers, input_ids=ids, labels=None if own_loss else ids, train=True)
        if own_loss:
            return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return out.loss

    return loss_fn, params


def stack(lr=LR):
    return fx.chain(fx.clip_by_global_norm(CLIP), fx.adamw(lr, weight_decay=WD))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_donated_step_matches_torch_optim_and_keeps_ties(name):
    ref = MAKE[name]()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    model = MAKE[name]()
    loss_fn, params = loss_of(model)
    keep, tied = TIED[name]
    assert keep in params and tied not in params  # a tied pair is one leaf
    tx = stack()
    step, state = fx.train_step(loss_fn, tx), tx.init(params)
    for ids in batches(STEPS):
        params, state, metrics = step(params, state, ids)
        opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    assert_trees_close(without_key_bias(params), without_key_bias(dict(ref.named_parameters())), rtol=1e-5, atol=1e-5)
    sd = model.state_dict()  # the module shares the trees' storage: trained, and still tied
    assert sd[tied].data_ptr() == sd[keep].data_ptr() == params[keep].data_ptr()


def without_key_bias(params):
    """The attention key biases have a zero gradient in exact arithmetic (softmax ignores a shift shared
    by all keys), so Adam's step on them is lr x sign(rounding noise), different in any two programs;
    every other parameter is compared (GPT-2's fused c_attn bias keeps its query and value thirds)."""
    out = {}
    for k, v in params.items():
        if k.endswith("c_attn.bias"):
            n = v.shape[0] // 3
            out[k] = torch.cat([v[:n], v[2 * n:]]).detach()
        elif not k.endswith("key.bias"):
            out[k] = v.detach()
    return out


def run_pure(loss_fn, params, lr, data, eps_root=0.0):
    tx = fx.chain(fx.clip_by_global_norm(CLIP),
                  fx.inject_hyperparams(fx.adamw)(learning_rate=lr, weight_decay=WD, eps_root=eps_root))
    step, state = fx.train_step(loss_fn, tx, donate=False), tx.init(params)
    for ids in data:
        params, state, _ = step(params, state, ids)
    return params


def test_pure_step_vmaps_as_an_ensemble():
    # float64: in float32, Adam's first steps (lr x g / |g|) turn the batched kernels' rounding on
    # near-zero gradients into lr-sized differences; float64 leaves the comparison to the transforms
    loss_fn, params = loss_of(tiny_gpt2("eager").double())
    other = tree.map(lambda v: v + 0.01 * torch.randn_like(v), params)
    ens = tree.map(lambda a, b: torch.stack([a, b]), params, other)
    data, lr = batches(3), torch.tensor(LR, dtype=torch.float64)
    out = torch.func.vmap(lambda p: run_pure(loss_fn, p, lr, data))(ens)
    for i, member in enumerate([params, other]):
        alone = run_pure(loss_fn, member, lr, data)
        assert_trees_close(tree.map(lambda v: v[i], out), alone, rtol=1e-9, atol=1e-12)


def test_lr_hypergradient_through_updates_matches_finite_differences():
    # float64: finite differences resolve the hypergradient; eager attention: the CPU SDPA kernel has
    # no double backward (a gradient through updates differentiates a gradient)
    model = tiny_gpt2("eager").double()
    loss_fn, params = loss_of(model, own_loss=True)
    data, ids = batches(3), batches(1, seed=7)[0]

    def final_loss(lr):  # eps_root as Optax advises for meta-gradients through Adam: the unused position
        return loss_fn(run_pure(loss_fn, params, lr, data, eps_root=1e-16), ids)  # rows have v = 0 (d sqrt(v) = inf)

    lr = torch.tensor(LR, dtype=torch.float64)
    h = torch.func.grad(final_loss)(lr)
    eps = 1e-5  # inject_hyperparams keeps the rate in float32: a step float32 resolves to 1e-5 relative
    fd = (final_loss(lr + eps) - final_loss(lr - eps)) / (2 * eps)
    assert torch.isfinite(h) and h != 0
    torch.testing.assert_close(h.double(), fd, rtol=1e-3, atol=1e-8)


# --- the runner: a config-built transformers model with task=lm ---------------------------------------------

HF_GPT2_MODEL = ("model._target_=transformers.GPT2LMHeadModel", "~model.vocab_size", "~model.context",
                 "~model.d_model", "~model.n_layers", "~model.n_heads",
                 "+model.config._target_=transformers.GPT2Config", "+model.config.n_layer=2",
                 "+model.config.n_embd=32", "+model.config.n_head=2", "+model.config.vocab_size=${data.vocab_size}",
                 "+model.config.n_positions=${data.context}", "+model.config.bos_token_id=0",
                 "+model.config.eos_token_id=0")


def test_task_scores_a_model_output_by_its_logits():
    out = tiny_gpt2()(input_ids=torch.zeros(2, 5, dtype=torch.long))  # a ModelOutput, not a tensor
    loss, metrics = tasks.lm().compute(out, torch.zeros(2, 5, dtype=torch.long))
    assert loss.ndim == 0 and torch.equal(loss, tasks.lm().compute(out.logits, torch.zeros(2, 5, dtype=torch.long))[0])
    assert set(metrics) == {"accuracy"}


def test_runner_trains_a_transformers_model_with_task_lm(tmp_path, capsys):
    import json

    from tests._runner import run_main

    run = tmp_path / "run"
    code = run_main("experiment=tiny_lm", *HF_GPT2_MODEL, "trainer.max_steps=8", "trainer.eval_every=4",
                    "trainer.log_every=4", "schedule.warmup_steps=4", "data.max_bytes=30000", "trainer.device=cpu",
                    f"hydra.run.dir={run}")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "model  GPT2LMHeadModel: 35,712 params" in out  # tied head counted once
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["value"] < 5.545  # below log(256): uniform over bytes
