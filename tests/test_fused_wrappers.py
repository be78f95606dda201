"""The fused kernel under the wrappers of the runner's stack (fxtrain/transforms/_fused.py, fxtrain/amp.py,
fxtrain/transforms/_accumulation.py, fxtrain/_base.py's chain of one): generated from the registries.

Every ``conf/amp`` preset x every ``conf/accumulate`` preset x every optimizer of ``conf/optim/transform`` that
declares a fused torch kernel (``fx.traits(tx).fused``: adam, adamw, sgd), each as the runner builds it
(:func:`fxtrain.build.stack`: ``accumulate(amp_cast(chain(clip_by_global_norm, inject_hyperparams(opt))))``)
and as a chain of that optimizer alone (``optim.chain=[adam]``, mnist_port's). Each stack trains :data:`STEPS`
batches in one process with the fused kernel and with its foreach kernels (the same stack with its fused mark
taken off); the test counts torch's ``_fused_*`` calls (one per emitted update: ``STEPS / every``) and compares
the params, the loss-scale decisions and the metrics.

Tolerance: test_fused.py's through a model (``rtol=1e-4, atol=1e-6``: float64 bias corrections in torch's
kernel against float32 in fxtrain's, fed back through the loss) where params are float32; with half-precision
params (``pure_bf16``, ``pure_fp16``) the kernel computes in float32 and rounds once to the param dtype where the
foreach path rounds each op's result: K = 4 roundings (``4 * eps`` of the param dtype, as tests/test_matrix.py's
K), relative. Skip decisions (``skipped``, ``loss_scale``) must be identical.
"""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import fxtrain as fx
from fxtrain import build
from fxtrain._base import FUSED_KERNELS
from fxtrain import train as runner
from fxtrain.testing import assert_trees_close

CONF = pathlib.Path(runner.CONF_DIR)
STEPS = 16  # a multiple of every accumulate preset's window (8)
KERNELS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


def fused_optimizers() -> list[str]:
    """The ``conf/optim/transform`` entries whose factory declares a torch kernel with its configured arguments."""
    out = []
    for name in presets("optim/transform"):
        node = OmegaConf.to_container(OmegaConf.load(CONF / "optim" / "transform" / f"{name}.yaml")[name])
        tx = build.locate(node, name)(**{k: v for k, v in node.items() if k != "_target_"})
        if fx.traits(tx).fused is not None and fx.traits(tx).fused.name in FUSED_KERNELS:
            out.append(name)
    return out


@functools.cache
def cfg_of(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[*overrides, f"trainer.max_steps={STEPS}"])


CHAINS = {"clip": "[clip_by_global_norm,{}]", "alone": "[{}]"}
CELLS = [(amp, acc, opt, chain) for amp in presets("amp") for acc in presets("accumulate")
         for opt in fused_optimizers() for chain in CHAINS]


def covering() -> set[tuple[str, ...]]:
    """The fast suite's cells: every amp preset once, the other axes taken in turn (each value at least once);
    the whole product is ``slow`` (seconds a cell on 2 loaded cores)."""
    accs, opts, chains = presets("accumulate"), fused_optimizers(), list(CHAINS)
    return {(amp, accs[i % len(accs)], opts[i % len(opts)], chains[i % len(chains)])
            for i, amp in enumerate(presets("amp"))}


FAST = covering()


def overrides(amp: str, acc: str, opt: str, chain: str) -> tuple[str, ...]:
    out = [f"amp={amp}", f"accumulate={acc}", f"optim/transform@optim.chain={CHAINS[chain].format(opt)}"]
    if amp == "pure_fp16" and opt in ("adam", "adamw"):
        out.append(f"optim.chain.{opt}.eps=1e-4")  # conf/amp/pure_fp16.yaml: 1e-8 rounds to 0 in float16
    return tuple(out)


def loss_fn(params, batch):
    x, y = batch
    h = torch.tanh(F.linear(x, params["l1"]["w"], params["l1"]["b"]))
    return F.cross_entropy(F.linear(h, *params["l2"]).float(), y)


def init_params():
    g = torch.Generator().manual_seed(0)
    return {"l1": {"w": torch.randn(8, 5, generator=g) / 3, "b": torch.zeros(8)},
            "l2": [torch.randn(3, 8, generator=g) / 3, torch.zeros(3)]}


class KernelCalls:
    """Counts torch's fused optimizer kernel calls (``torch._fused_adamw_``...) while active."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in KERNELS:
            real = getattr(torch, name)
            monkeypatch.setattr(torch, name, functools.partial(self._spy, name, real))

    def _spy(self, name, real, *args, **kwargs):
        self.calls.append(name)
        return real(*args, **kwargs)


def train(tx, cfg, steps=STEPS, scale=1.0):
    """``steps`` donated steps; the params, state and per-step metrics. ``scale`` multiplies the batches' inputs."""
    params = build.cast_params(cfg, init_params())
    state = tx.init(params)
    step = fx.train_step(loss_fn, tx)
    g = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        batch = (torch.randn(16, 5, generator=g) * scale, torch.randint(0, 3, (16,), generator=g))
        params, state, metrics = step(params, state, batch)
        history.append({k: v.clone() for k, v in metrics.items()})
    return params, state, history


def tolerance(params) -> float:
    dtype = fx.tree.leaves(params)[0].dtype
    return max(1e-4, 4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("amp,acc,opt,chain", [
    pytest.param(*c, id="-".join(c), marks=() if c in FAST else pytest.mark.slow) for c in CELLS])
def test_wrapped_stack_runs_the_fused_kernel_once_per_update(amp, acc, opt, chain, monkeypatch):
    cfg = cfg_of(*overrides(amp, acc, opt, chain))
    every = cfg.accumulate.every
    tx = build.stack(cfg)
    assert fx.traits(tx).fused is not None, f"{tx!r} declares no fused kernel"
    calls = KernelCalls(monkeypatch)
    p_fused, s_fused, h_fused = train(tx, cfg)
    if fx.tree.leaves(p_fused)[0].dtype in (torch.float16, torch.bfloat16):
        # Pure half precision: torch's kernel computes in float32 and rounds once, the foreach path rounds every
        # op in the params' dtype (float16 SGD ends a whole update apart): amp_cast keeps the foreach path.
        assert calls.calls == [], (tx, calls.calls)
    else:
        assert len(calls.calls) == STEPS // every, (tx, calls.calls)
        assert set(calls.calls) == {f"_fused_{fx.traits(tx).fused.name}_"}
    calls.calls.clear()
    p_ref, s_ref, h_ref = train(fx.with_traits(build.stack(cfg), fused=None), cfg)
    assert calls.calls == []
    for a, b in zip(h_fused, h_ref):  # the same decisions, step by step
        for k in ("skipped", "loss_scale", "emitted"):
            if k in a:
                assert torch.equal(a[k], b[k]), (k, h_fused, h_ref)
    tol = tolerance(p_ref)
    assert_trees_close(p_fused, p_ref, rtol=tol, atol=tol * 1e-2)


@pytest.mark.parametrize("acc", [pytest.param(a, marks=() if a == "k4" else pytest.mark.slow)
                                 for a in presets("accumulate")])
def test_overflow_skips_inside_the_kernel_as_the_foreach_path_skips(acc, monkeypatch):
    # fp16 compute, dynamic scale: a non-finite input in step 3 (and so in its window) makes the kernel skip
    # (found_inf), the counts and injected learning rate stay where they were, the clip reports the inf norm.
    cfg = cfg_of(*overrides("fp16", acc, "adamw", "clip"))
    every = cfg.accumulate.every

    def run(tx):
        params = init_params()
        state, step = tx.init(params), fx.train_step(loss_fn, tx)
        g = torch.Generator().manual_seed(1)
        history = []
        for i in range(STEPS):
            x = torch.randn(16, 5, generator=g)
            if i == 2:
                x[0, 0] = float("inf")
            params, state, metrics = step(params, state, (x, torch.randint(0, 3, (16,), generator=g)))
            history.append({k: v.clone() for k, v in metrics.items()})
        return params, state, history

    calls = KernelCalls(monkeypatch)
    p_fused, s_fused, h_fused = run(build.stack(cfg))
    assert len(calls.calls) == STEPS // every
    p_ref, s_ref, h_ref = run(fx.with_traits(build.stack(cfg), fused=None))
    skipped = [int(h["skipped"]) for h in h_fused]
    assert skipped == [int(h["skipped"]) for h in h_ref] and 1 in skipped
    for a, b in zip(h_fused, h_ref):
        assert torch.equal(a["loss_scale"], b["loss_scale"])
        assert torch.equal(a["grad_norm"].isfinite(), b["grad_norm"].isfinite())
    # the optimizer's count and the injected hyperparameters: the foreach path's, after the skipped update too
    counts = [x for x in fx.tree.leaves(s_fused) if x.ndim == 0 and not x.is_floating_point()]
    counts_ref = [x for x in fx.tree.leaves(s_ref) if x.ndim == 0 and not x.is_floating_point()]
    assert [int(x) for x in counts] == [int(x) for x in counts_ref]
    assert_trees_close(p_fused, p_ref, rtol=1e-4, atol=1e-6)


def test_pure_step_runs_the_wrapped_kernel_on_copies_bit_exactly(monkeypatch):
    # donate=False under no_grad runs the donated kernels on copies (fxtrain/step.py): the same bits as
    # donate=True, the caller's params and state untouched, the kernel called on each emitting call.
    cfg = cfg_of(*overrides("fp16", "k4", "adamw", "clip"))
    calls = KernelCalls(monkeypatch)
    p_don, s_don, _ = train(build.stack(cfg), cfg)
    assert len(calls.calls) == STEPS // 4
    tx = build.stack(cfg)
    params = init_params()
    state = tx.init(params)
    before = fx.tree.clone((params, state))
    step = fx.train_step(loss_fn, tx, donate=False)
    g = torch.Generator().manual_seed(1)
    p, s = params, state
    with torch.no_grad():
        for _ in range(STEPS):
            p, s, _ = step(p, s, (torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)))
    assert len(calls.calls) == 2 * (STEPS // 4)
    assert_trees_close((params, state), before, rtol=0, atol=0)
    assert_trees_close(p, p_don, rtol=0, atol=0)
    acc = lambda t: t._replace(acc=None)  # noqa: E731 - between windows the accumulator holds no meaningful values
    assert_trees_close(acc(s), acc(s_don), rtol=0, atol=0)


def test_a_chain_with_a_transform_after_the_optimizer_keeps_the_foreach_path():
    # experiment=mnist_port: optim.chain=[adam, reduce_on_plateau]. The plateau's factor scales Adam's update
    # after the kernel would have applied it (and reads the loss, value=): no kernel computes the pair, so the
    # chain declares none (folding the factor into the kernel's tensor learning rate is not done).
    tx = build.stack(cfg_of("experiment=mnist_port"))
    assert fx.traits(tx).fused is None, tx
    assert fx.traits(build.stack(cfg_of("experiment=mnist_port", "~optim.chain.reduce_on_plateau"))).fused.name == "adam"


@pytest.mark.parametrize("mean", [True, False])
def test_accumulator_dtype_and_sum_windows_take_the_kernel_with_the_foreach_numbers(mean, monkeypatch):
    # A float64 running sum (conf/accumulate's accumulator_dtype) is rounded once into the gradients, which the
    # kernel then reads; mean=False hands it the sum.
    cfg = cfg_of(*overrides("off", "k4", "adamw", "clip"))

    def make():
        return fx.accumulate(fx.chain(fx.clip_by_global_norm(1.0), fx.adamw(1e-2, weight_decay=0.1)), every=4,
                             mean=mean, accumulator_dtype=torch.float64)

    calls = KernelCalls(monkeypatch)
    p_fused, s_fused, _ = train(make(), cfg)
    assert len(calls.calls) == STEPS // 4
    p_ref, s_ref, _ = train(fx.with_traits(make(), fused=None), cfg)
    assert_trees_close(p_fused, p_ref, rtol=1e-4, atol=1e-6)
    assert s_fused.acc["l1"]["w"].dtype == torch.float64
