"""fxtrain/interop/_safetensors.py: safetensors files with state_dict names, both ways with transformers."""

from __future__ import annotations

import pytest
import torch

import fxtrain as fx
from fxtrain.interop import load_safetensors, save_safetensors
from fxtrain.testing import assert_trees_close

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def gpt2():
    """A tiny GPT-2 (tied embeddings), trained 3 donated steps so its weights are not the init's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    apply, params, buffers = fx.functional(model)
    tx = fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2))
    step = fx.train_step(lambda p, ids: apply(p, buffers, input_ids=ids, labels=ids, train=True)[0].loss, tx)
    state, ids = tx.init(params), torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        params, state, _ = step(params, state, ids)
    return transformers, model, params, ids


def test_from_pretrained_loads_what_save_safetensors_wrote(gpt2, tmp_path, monkeypatch):
    transformers, model, params, ids = gpt2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model.config.save_pretrained(tmp_path)
    save_safetensors(tmp_path / "model.safetensors", params)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied back
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert_trees_close(dict(loaded.named_parameters()), params, rtol=0, atol=0)


def test_save_pretrained_file_loads_into_the_params_tree(gpt2, tmp_path):
    _, model, params, _ = gpt2
    model.save_pretrained(tmp_path)  # transformers' own writer
    back = load_safetensors(tmp_path / "model.safetensors", params)
    assert back.keys() == params.keys()
    assert_trees_close(back, params, rtol=0, atol=0)
    assert all(back[k].data_ptr() != params[k].data_ptr() for k in params)  # a new tree


def test_a_state_dict_with_tied_names_is_written_once(gpt2, tmp_path):
    transformers, model, params, _ = gpt2
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    save_safetensors(tmp_path / "sd.safetensors", sd)  # safetensors' save_file refuses shared tensors itself
    from safetensors import safe_open
    with safe_open(tmp_path / "sd.safetensors", framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys and meta["format"] == "pt"
    assert set(params) <= keys


def test_load_casts_to_like_and_refuses_by_name(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors(path, {"a": torch.arange(6.0).reshape(2, 3).t(), "b": torch.ones(2, dtype=torch.bfloat16)},
                     metadata={"step": "3"})
    got = load_safetensors(path, {"a": torch.zeros(3, 2), "b": torch.zeros(2)})
    assert got["b"].dtype == torch.float32 and torch.equal(got["a"], torch.arange(6.0).reshape(2, 3).t())
    with pytest.raises(KeyError, match="'c' is not in"):
        load_safetensors(path, {"a": torch.zeros(3, 2), "b": torch.zeros(2), "c": torch.zeros(1)})
    with pytest.raises(KeyError, match="has 'b' .* pass strict=False"):
        load_safetensors(path, {"a": torch.zeros(3, 2)})
    assert set(load_safetensors(path, {"a": torch.zeros(3, 2)}, strict=False)) == {"a"}
    with pytest.raises(ValueError, match=r"'a' has shape \(3, 2\) in the file, \(2, 3\) in like"):
        load_safetensors(path, {"a": torch.zeros(2, 3), "b": torch.zeros(2)})
    with pytest.raises(TypeError, match="entry 'x' must be a str name and a tensor"):
        save_safetensors(path, {"x": {"nested": torch.ones(1)}})


def test_bert_both_ways_with_transformers(gpt2, tmp_path, monkeypatch):
    transformers = gpt2[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).eval()
    _, params, buffers = fx.functional(model)  # the decoder weight is tied to the word embeddings: one leaf
    params = {k: v + 0.01 * torch.randn_like(v) for k, v in params.items()}  # not the init's values
    cfg.save_pretrained(tmp_path)
    save_safetensors(tmp_path / "model.safetensors", params)
    loaded = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.func.functional_call(model, {**params, **buffers}, (), {"input_ids": ids}).logits
        assert torch.equal(loaded(input_ids=ids).logits, ref)
    loaded.save_pretrained(tmp_path / "back")
    assert_trees_close(load_safetensors(tmp_path / "back" / "model.safetensors", params), params, rtol=0, atol=0)
