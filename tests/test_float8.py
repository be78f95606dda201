"""Tests for fxtrain/float8.py and the runner's ``amp=float8`` (torchao's Float8Linear, emulated on CPU as torchtitan's
float8 tests run): the runner against a hand-written torchao + torch.optim loop, FSDP on 2 ranks against one process,
the refusals and the missing extra. Every layout x float8 against one process: tests/test_matrix.py's ``amp`` axis."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from fxtrain import build, float8
from fxtrain.errors import ConfigError
from fxtrain.models import TransformerLM
from tests import _worlds
from tests._runner import cfg_of, isolate, run_main  # noqa: F401 - isolate: the autouse fixture

# experiment=tiny_lm cut down to seconds: every Linear of the blocks 32-wide or 128-wide (all convertible), a constant
# learning rate, no accumulation, every step logged.
RUN = ["experiment=tiny_lm", "amp=float8", "accumulate=off", "schedule=constant", "~schedule.warmup_steps",
       "data.max_bytes=20000", "data.eval_windows=16", "data.batch_size=8", "data.context=16", "model.d_model=32",
       "model.n_heads=2", "trainer.max_steps=8", "trainer.log_every=1", "trainer.eval_every=8",
       "trainer.checkpoint_every=0"]
# Tolerances, measured (8 steps, load ~10 on 2 cores) against the hand-written loop below. Step 1 (the same params and
# batch): the same emulated float8 kernels, so the loss is bit-exact and the grad_norm differs by float32 summation
# order only (9e-8); the same loop without float8 (bf16 matmuls) is off by 3.9e-5 in the loss and 3.3e-3 in the
# grad_norm there. Later steps: AdamW's float32 arithmetic in another order moves a weight by an ulp, which can move
# an e4m3 rounding (1/16 of that element): loss within 4.3e-5, grad_norm within 5.2e-4 over the 8 steps.
STEP1_NORM_REL, LOSS_REL, NORM_REL = 1e-6, 2e-4, 2e-3


def _logged(run) -> list[tuple[float, float]]:
    """The (loss, grad_norm) of every logged training step of a run."""
    lines = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [(r["loss"], r["grad_norm"]) for r in lines if "loss" in r]


def hand_written(cfg, *, to_float8: bool) -> list[tuple[float, float]]:
    """The run of ``cfg`` without fxtrain's step: the same TransformerLM, converted by torchao directly (torchtitan's
    filter: dims multiples of 16, not the head), trained on the runner's batches by torch.optim.AdamW in a plain loop,
    forward on a bf16 copy of the float32 params (amp=float8's bf16 policy), loss in float32."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(cfg.seed)
    data = build.dataset(cfg.data)  # the runner's order: data, then the model's init
    m = cfg.model
    model = TransformerLM(vocab_size=256, context=m.context, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads)
    if to_float8:
        convert_to_float8_training(model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda mod, fqn: (
            fqn != "head" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0))
    adamw = cfg.optim.chain.adamw
    opt = torch.optim.AdamW(model.parameters(), lr=adamw.learning_rate, betas=(adamw.b1, adamw.b2), eps=adamw.eps,
                            weight_decay=adamw.weight_decay)
    logged = []
    for k in range(cfg.trainer.max_steps):
        x, y = data.train[k]
        bf16 = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
        logits = torch.func.functional_call(model, bf16, (x,))
        loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.chain.clip_by_global_norm.max_norm)
        opt.step()
        logged.append((loss.item(), norm.item()))
    return logged


def test_tiny_lm_in_float8_trains_as_torchao_and_torch_optim_do(tmp_path, capsys):
    assert run_main(*RUN, f"hydra.run.dir={tmp_path}") == 0
    assert "model  TransformerLM: 34,176 params on cpu, 12 Linear layers in float8 (emulated)" in capsys.readouterr().out
    got = _logged(tmp_path)
    assert got[-1][0] < got[0][0] - 0.1  # it trains
    cfg = cfg_of(*RUN)
    want, bf16 = hand_written(cfg, to_float8=True), hand_written(cfg, to_float8=False)
    assert got[0][0] == want[0][0] and got[0][1] == pytest.approx(want[0][1], rel=STEP1_NORM_REL)
    assert got[0][0] != bf16[0][0] and got[0][1] != pytest.approx(bf16[0][1], rel=100 * STEP1_NORM_REL)  # float8 ran
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in want], rel=LOSS_REL)
    assert [norm for _, norm in got] == pytest.approx([norm for _, norm in want], rel=NORM_REL)


def test_convert_keeps_what_torchao_cannot_run_and_ties():
    model = TransformerLM(vocab_size=256, context=8, d_model=16, n_layers=1, n_heads=2)
    names = float8.convert(model, device=torch.device("cpu"), skip=["head"])
    assert names == ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn.proj", "blocks.0.mlp.0",
                     "blocks.0.mlp.2"]
    assert type(model.head) is torch.nn.Linear and model.head.weight is model.tok.weight  # tied, kept
    assert all(getattr(model.get_submodule(n), "config").emulate for n in names)


# --- refusals: one line, nothing written ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, line", [
    (["model.d_model=8", "model.n_heads=2"],
     "Error: amp=float8: TransformerLM has nothing to train in float8: no Linear layer has both dims multiples of 16 "
     "(blocks.0.attn.k, blocks.0.attn.proj, blocks.0.attn.q, blocks.0.attn.v, blocks.0.mlp.0, blocks.0.mlp.2, "
     "blocks.1.attn.k, blocks.1.attn.proj, blocks.1.attn.q, blocks.1.attn.v, blocks.1.mlp.0, blocks.1.mlp.2); use "
     "amp=bf16, or a model with such layers (model=transformer with model.d_model a multiple of 16)"),
    (["amp.float8.skip=[haed]"],
     "Error: amp.float8.skip names haed, which TransformerLM has no nn.Linear of; its Linear layers are "
     "blocks.0.attn.k, blocks.0.attn.proj, blocks.0.attn.q, blocks.0.attn.v, blocks.0.mlp.0, blocks.0.mlp.2, "
     "blocks.1.attn.k, blocks.1.attn.proj, blocks.1.attn.q, blocks.1.attn.v, blocks.1.mlp.0, blocks.1.mlp.2, head"),
    (["amp.float8.skip=head"], ("Error: amp.float8.skip=head: expected a list, each a non-blank string, or null "
                                 "(Linear layers kept out of float8, by name: the output head by default; null or [] "
                                 "for none)")),
    (["+amp.float8.skp=[head]"],
     "Error: amp.float8.skp: not a setting fxtrain reads (did you mean amp.float8.skip?); amp.float8's settings are skip"),
], ids=["nothing_to_convert", "skip_names_no_linear", "skip_not_a_list", "unknown_key"])
def test_refused_in_one_line_before_anything_is_written(overrides, line, tmp_path, capsys):
    assert run_main(*RUN, *overrides, f"hydra.run.dir={tmp_path}/run") == line
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_missing_torchao_is_the_line_that_installs_it(monkeypatch):
    # amp=float8 on the command line: fxtrain.extras' check (tests/test_extras.py); from a config file (an experiment
    # of the user's): here, where the model is converted
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import torchao.float8` meets when not installed
    model = TransformerLM(vocab_size=256, context=8, d_model=16, n_layers=1, n_heads=2)
    with pytest.raises(ConfigError, match=r"^amp=float8 needs torchao: pip install 'fxtrain\[float8\]'$"):
        build.float8(cfg_of(*RUN), model, torch.device("cpu"))
    assert type(model.blocks[0].attn.q) is torch.nn.Linear


def test_other_amp_modes_convert_nothing():
    model = TransformerLM(vocab_size=256, context=8, d_model=16, n_layers=1, n_heads=2)
    assert build.float8(cfg_of("amp=bf16"), model, torch.device("cpu")) == [] and float8.note(model) == ""


# --- FSDP on 2 ranks against one process -------------------------------------------------------------------------

CASES, case = _worlds.registry(worlds=(2,))


@case()
def case_fsdp_float8_matches_one_process(world):
    """parallel=fsdp under amp=float8 logs one process's float8 run step by step: FSDP all-gathers the float32 shards
    cast to bf16 (its MixedPrecisionPolicy), Float8Linear quantizes the gathered weight as one process's. Measured over
    4 steps: loss 2.7e-4, grad_norm 3.7e-3 relative (bf16 alone under fsdp: 1e-5 and 6e-4; an activation rounded in
    bf16 in another summation order moves its e4m3 rounding, 1/16 of it); a missed float8 cast or scale misses by
    factors."""
    from tests.test_train_resume_layouts import _records, _train, assert_steps_close, one_process_metrics

    run = [o for o in RUN if not o.startswith("trainer.max_steps")] + ["trainer.max_steps=4", "trainer.eval_every=4"]
    _train(_worlds.OUT_DIR / "fsdp", *run, "parallel=fsdp")
    got = [r for r in _records(_worlds.OUT_DIR / "fsdp") if "loss" in r]
    assert_steps_close("fsdp float8", got, one_process_metrics(*run), 1e-3, 1e-2)
    assert math.isfinite(got[-1]["loss"])


test_case = _worlds.tests(__file__, CASES, timeout_s=300)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
