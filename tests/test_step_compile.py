"""Tests for train_step(compile=True) (fxtrain/step.py): eager numbers, no graph breaks, no recompiles.

Compilation is slow on CI's two cores: two tiny stacks, each compiled once per test.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxtrain as fx
from fxtrain.testing import assert_trees_close

# Inductor's imports warn about torch.jit (torch 2.13); warnings are errors elsewhere (pyproject).
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _full_stack():
    sched = fx.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10)
    inner = fx.chain(fx.clip_by_global_norm(0.5), fx.inject_hyperparams(fx.adamw)(learning_rate=sched, weight_decay=0.1))
    return fx.accumulate(fx.amp_cast(inner, policy="p=f32,c=bf16,o=f32"), every=2)


def _clip_adamw():
    return fx.chain(fx.clip_by_global_norm(0.5), fx.adamw(1e-2, weight_decay=0.1))


def _clip_nadam():  # no fused torch kernel computes it: compile=True compiles its foreach kernels
    return fx.chain(fx.clip_by_global_norm(0.5), fx.adam(1e-2, nesterov=True))


def _params():
    g = torch.Generator().manual_seed(0)
    return {"l1": {"w": torch.randn(8, 5, generator=g) / 3, "b": torch.zeros(8)}, "l2": [torch.randn(3, 8, generator=g) / 3, torch.zeros(3)]}


def _loss(params, batch):
    x, y = batch
    h = torch.tanh(F.linear(x, params["l1"]["w"], params["l1"]["b"]))
    return F.cross_entropy(F.linear(h, *params["l2"]), y)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _run(make, compile, steps=10, after_warmup=None):
    tx = make()
    params = _params()
    state = tx.init(params)
    step = fx.train_step(_loss, tx, compile=compile)
    history = []
    for i, batch in enumerate(_batches(steps)):
        if i == 4 and after_warmup is not None:
            after_warmup()
        params, state, metrics = step(params, state, batch)
        history.append(metrics)
    return params, state, history


# Compiled foreach graphs reorder float32 arithmetic only; clip+adamw runs torch's fused kernel either way
# (the same kernel twice: exact).
@pytest.mark.parametrize("make, tol", [(_full_stack, {"rtol": 1e-6, "atol": 1e-7}),
                                       (_clip_nadam, {"rtol": 1e-6, "atol": 1e-7}),
                                       (_clip_adamw, {"rtol": 0, "atol": 0})],
                         ids=["accumulate-amp-clip-injected-adamw", "clip-nadam", "clip-adamw-fused"])
def test_compiled_equals_eager_over_steps(make, tol):
    eager = _run(make, compile=False)
    compiled = _run(make, compile=True)
    assert_trees_close(compiled, eager, **tol)


def test_no_graph_breaks_and_no_recompiles_after_warmup():
    torch._dynamo.reset()
    counters.clear()
    seen = {}

    def after_warmup():
        seen["graphs"] = counters["stats"]["unique_graphs"]

    with torch._dynamo.config.patch(error_on_recompile=False):
        _run(_full_stack, compile=True, after_warmup=after_warmup)
    assert seen["graphs"] > 0
    assert counters["stats"]["unique_graphs"] == seen["graphs"]  # nothing compiled after 4 steps (2 emitted)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # And error_on_recompile agrees: a fresh run whose later steps would raise on any recompile.
    torch._dynamo.reset()

    def strict():
        torch._dynamo.config.error_on_recompile = True

    try:
        _run(_clip_nadam, compile=True, after_warmup=strict)
    finally:
        torch._dynamo.config.error_on_recompile = False


def test_a_stack_with_a_fused_kernel_takes_it_when_compiled(monkeypatch):
    # The fused kernel beats inductor's loops (experiments/bench/results/suite.md): compile=True keeps it.
    torch._dynamo.reset()
    counters.clear()
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or real(*a, **k))
    _run(_clip_adamw, compile=True, steps=3)
    assert len(calls) == 3 and counters["stats"]["unique_graphs"] == 0


def test_compile_needs_donation():
    with pytest.raises(ValueError, match="compile=True needs donate=True"):
        fx.train_step(_loss, fx.adamw(1e-3), donate=False, compile=True)
