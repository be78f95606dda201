"""fxtrain on a CUDA device (``pytest -m cuda``; ``make gpu-check`` runs these first).

The CPU suite checks the same properties against the same references (test_fused.py, test_amp.py,
test_step_compile.py, test_vmap_launcher.py, test_train.py); here the kernels are CUDA's: torch's fused
optimizer kernels, float16/bfloat16 matmuls, inductor's GPU code, and the boundary between host and device
(a training step and its batch never wait for the GPU). The references run on the same device in the same
test: ``torch.optim``'s ``fused=True`` optimizers, ``torch.autocast`` with ``torch.amp.GradScaler``.

Every test skips where no CUDA device is visible, so the CPU suite collects this file and skips it.
"""

import json
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxtrain as fx
from fxtrain import float8 as fxfloat8, report, train as runner
from fxtrain.testing import assert_trees_close
from tests._runner import cfg_of, isolate, run_main  # noqa: F401 - isolate: autouse (runs write under tmp_path)
from tests.test_vmap_launcher import assert_same_sweep, sweep_of

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              # Inductor's imports warn about torch.jit (torch 2.13); warnings are errors elsewhere (pyproject).
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]

CUDA = torch.device("cuda")


# --- helpers --------------------------------------------------------------------------------------------

def _params():
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(32, 16, generator=g) / 4, torch.randn(4, 32, generator=g) / 4
    return {k: v.to(CUDA) for k, v in {"w1": w1, "b1": torch.zeros(32), "w2": w2, "b2": torch.zeros(4)}.items()}


def _loss(params, batch):
    x, y = batch
    h = torch.tanh(F.linear(x, params["w1"], params["b1"]))
    return F.cross_entropy(F.linear(h, params["w2"], params["b2"]).float(), y)  # the loss in float32, as autocast's


def _batches(n, inf_at=()):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
        if i in inf_at:
            x[3, 1] = float("inf")
        out.append((x.to(CUDA), y.to(CUDA)))
    return out


def _fx_run(tx, batches, *, donate=True, compile=False, loss_fn=_loss, after_warmup=None):
    """``fx.train_step`` over ``batches``: ``(params, opt_state, metrics of every step)``."""
    params = _params()
    state = tx.init(params)
    step = fx.train_step(loss_fn, tx, donate=donate, compile=compile)
    history = []
    for i, batch in enumerate(batches):
        if i == 4 and after_warmup is not None:
            after_warmup()
        params, state, metrics = step(params, state, batch)
        history.append(metrics)
    return params, state, history


def _torch_run(make_optimizer, batches, *, autocast=None, scaler=None):
    """The same training in plain torch: ``(params, losses, the scaler's scale after every step)``."""
    params = {k: v.clone().requires_grad_() for k, v in _params().items()}
    opt = make_optimizer(list(params.values()))
    losses, scales = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
            loss = _loss(params, batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        losses.append(loss.detach())
    return {k: v.detach() for k, v in params.items()}, losses, scales


# --- fused kernels ----------------------------------------------------------------------------------------

# fxtrain's optimizer, torch.optim's fused twin (same hyperparameters), and the torch kernel both call.
OPTIMIZERS = {
    "adam": (lambda: fx.adam(1e-2, b1=0.8, b2=0.99, eps=1e-6),
             lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, fused=True), "_fused_adam_"),
    "adamw": (lambda: fx.adamw(1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), "_fused_adamw_"),
    "sgd": (lambda: fx.sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True), "_fused_sgd_"),
    "sgd-momentum": (lambda: fx.sgd(0.1, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), "_fused_sgd_"),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_cuda_kernels_match_torch_optim_fused_and_the_pure_update(name, monkeypatch):
    make, make_torch, kernel = OPTIMIZERS[name]
    batches = _batches(10)
    devices = []
    real = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda params, *a, **k: devices.append(params[0].device.type) or
                        real(params, *a, **k))
    fused, _, _ = _fx_run(make(), batches)
    assert devices == ["cuda"] * 10  # the donated step ran torch's CUDA kernel on every step
    monkeypatch.undo()
    expected, _, _ = _torch_run(make_torch, batches)
    # The same kernel on the same gradients, with the step count as torch passes it (float32, on the device).
    assert_trees_close(fused, expected, rtol=1e-6, atol=1e-7)
    # Where autograd records, the pure step runs the out-of-place foreach math instead; float32 rounding (and
    # Adam's float32 bias corrections against the kernel's) feeds back through the model (test_fused.py's bar).
    pure, _, _ = _fx_run(make(), batches, donate=False)
    assert_trees_close(pure, fused, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping every step, and never
def test_clip_rides_in_the_cuda_kernel_as_in_the_pure_update(max_norm, monkeypatch):
    make = lambda: fx.chain(fx.clip_by_global_norm(max_norm), fx.adamw(1e-2, weight_decay=0.1))  # noqa: E731
    batches = _batches(10)
    scales = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, grad_scale=None, **k: scales.append(grad_scale) or
                        real(*a, grad_scale=grad_scale, **k))
    fused, _, history = _fx_run(make(), batches)
    monkeypatch.undo()
    assert len(scales) == 10 and all(s.device.type == "cuda" and s.dtype == torch.float32 for s in scales)
    pure, _, pure_history = _fx_run(make(), batches, donate=False)
    norms = torch.stack([m["grad_norm"] for m in history])
    torch.testing.assert_close(norms, torch.stack([m["grad_norm"] for m in pure_history]), rtol=1e-4, atol=0)
    assert (norms > max_norm).all() if max_norm < 1 else (norms < max_norm).all()
    assert_trees_close(pure, fused, rtol=1e-4, atol=1e-6)


# --- mixed precision ------------------------------------------------------------------------------------

def test_fp16_amp_cast_matches_autocast_and_gradscaler_step_for_step():
    # 2**24 overflows float16 gradients at once (natural backoffs), growth every 3 finite steps, infs injected.
    init, inject = 2.0 ** 24, (9, 10, 17)
    batches = _batches(24, inf_at=inject)
    tx = fx.amp_cast(fx.sgd(0.05), "p=f32,c=f16,o=f32",
                     loss_scale=fx.DynamicLossScale(init_scale=init, growth_interval=3))
    params, _, history = _fx_run(tx, batches)
    scaler = torch.amp.GradScaler("cuda", init_scale=init, growth_interval=3)
    expected, _, scales = _torch_run(lambda ps: torch.optim.SGD(ps, lr=0.05), batches, autocast=torch.float16,
                                     scaler=scaler)
    assert [float(m["loss_scale"]) for m in history] == scales
    previous = [init] + scales[:-1]
    skipped = [int(m["skipped"]) for m in history]
    assert skipped == [int(s < p) for s, p in zip(scales, previous)]
    assert set(inject) <= {i for i, s in enumerate(skipped) if s}  # the injected infs were skipped
    assert len([i for i, s in enumerate(skipped) if s and i not in inject]) >= 2  # and natural overflows
    assert any(s > p for s, p in zip(scales, previous))  # the scale grew back at least once
    # torch.optim.SGD adds -lr * g in one kernel (a fused multiply-add), fxtrain multiplies then adds: one
    # float32 rounding apart per step.
    assert_trees_close(params, expected, rtol=1e-5, atol=1e-6)


def test_bf16_amp_cast_computes_in_bf16_keeps_float32_masters_and_follows_autocast():
    seen = []

    def loss_fn(params, batch):
        seen.append((params["w1"].dtype, batch[0].dtype))
        return _loss(params, batch)

    batches = _batches(10)
    tx = fx.amp_cast(fx.adamw(1e-2, weight_decay=0.1), "p=f32,c=bf16,o=f32")
    params, state, history = _fx_run(tx, batches, loss_fn=loss_fn)
    assert set(seen) == {(torch.bfloat16, torch.bfloat16)}
    assert {x.dtype for x in fx.tree.leaves((params, state)) if x.is_floating_point()} == {torch.float32}
    assert {x.device.type for x in fx.tree.leaves(params)} == {"cuda"}
    assert sum(int(m.get("skipped", 0)) for m in history) == 0
    expected, losses, _ = _torch_run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), batches,
                                     autocast=torch.bfloat16)
    # The same bf16 ops as autocast's (F.linear and tanh in bf16, the loss in float32). A float32 rounding
    # difference of a master weight can move its bf16 copy by one bf16 step (2**-8 relative), which Adam turns
    # into an update at most lr apart for that element; 10 steps of lr=1e-2 stay within 5e-4.
    torch.testing.assert_close(torch.stack([m["loss"] for m in history]), torch.stack(losses), rtol=1e-2, atol=1e-3)
    assert_trees_close(params, expected, rtol=1e-3, atol=5e-4)


# --- the compiled step ----------------------------------------------------------------------------------

def _amp_accumulated(policy="p=f32,c=bf16,o=f32", **amp):
    """clip + AdamW with an injected schedule under amp_cast, in an accumulation window of 2."""
    sched = fx.cosine_decay_schedule(1e-2, decay_steps=10)
    inner = fx.chain(fx.clip_by_global_norm(0.5), fx.inject_hyperparams(fx.adamw)(learning_rate=sched, weight_decay=0.1))
    return fx.accumulate(fx.amp_cast(inner, policy, **amp), every=2)


def _fp16_accumulated():  # torch's CUDA amp kernels (unscale, scale update) in the compiled update
    return _amp_accumulated("p=f32,c=f16,o=f32", loss_scale=fx.DynamicLossScale(init_scale=2.0 ** 12, growth_interval=2))


LION_LR = 1e-3


def _clip_lion():  # no fused torch kernel computes it: compile=True compiles its foreach kernels
    return fx.chain(fx.clip_by_global_norm(0.5), fx.lion(LION_LR, weight_decay=0.1))


@pytest.mark.parametrize("make", [_amp_accumulated, _fp16_accumulated], ids=["bf16", "fp16"])
def test_the_recommended_stack_runs_the_cuda_kernel_on_each_emitting_call(make, monkeypatch):
    # accumulate(amp_cast(clip + inject_hyperparams(adamw)), every=2): one _fused_adamw_ per window, fp16's
    # overflow decision as its found_inf (a CUDA tensor the kernel reads on the device), the foreach path's numbers
    # (tests/test_fused_wrappers.py on the CPU) and its skip decisions.
    batches = _batches(10, inf_at=(5,) if make is _fp16_accumulated else ())  # bf16 does not skip: NaN both ways
    found = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, found_inf=None, **k: found.append(found_inf) or
                        real(*a, found_inf=found_inf, **k))
    fused, _, history = _fx_run(make(), batches)
    monkeypatch.undo()
    assert len(found) == 5
    if make is _fp16_accumulated:
        assert all(f.device.type == "cuda" and f.dtype == torch.float32 for f in found)
    ref, _, ref_history = _fx_run(fx.with_traits(make(), fused=None), batches)
    assert [int(m.get("skipped", 0)) for m in history] == [int(m.get("skipped", 0)) for m in ref_history]
    assert_trees_close(fused, ref, rtol=1e-4, atol=1e-6)


def test_compiled_step_equals_eager_on_cuda_fp16_accumulated():
    batches = _batches(10)
    eager = _fx_run(_fp16_accumulated(), batches)[:2]
    torch._dynamo.reset()
    compiled = _fx_run(_fp16_accumulated(), batches, compile=True)[:2]
    # Inductor computes an fp16 chain of ops in float32 and rounds once at the store; eager rounds after every
    # op: gradients one fp16 rounding apart (2**-10 relative, seen: 3e-3 relative on a near-zero element of an
    # H200's run). Adam normalizes, so a step moves a param by at most lr * that: 10 steps of lr <= 1e-2 stay
    # within 1e-4; the moments within two fp16 roundings of their size.
    assert_trees_close(compiled[0], eager[0], rtol=0, atol=1e-4)
    assert_trees_close(compiled[1], eager[1], rtol=2 ** -9, atol=1e-6)


def test_compiled_step_equals_eager_on_cuda_clip_lion():
    # In lockstep: every step starts both from the compiled run's params and state, so a flipped sign does
    # not move the later gradients (10 steps apart, one flip became 20 elements on an H200).
    torch._dynamo.reset()
    compiled = fx.train_step(_loss, _clip_lion(), donate=False, compile=True)
    eager = fx.train_step(_loss, _clip_lion(), donate=False)
    params = _params()
    state = _clip_lion().init(params)
    flips = 0
    for batch in _batches(10):
        p_c, s_c, _ = compiled(params, state, batch)
        p_e, s_e, _ = eager(params, state, batch)
        # Lion's momentum is a float32 EMA of the clipped gradient: a few roundings apart.
        assert_trees_close(s_c, s_e, rtol=1e-5, atol=1e-7)
        # Its step is lr * sign(c): a rounding of a near-zero c flips one element's step by 2 lr, nothing else.
        for x, y in zip(fx.tree.leaves(p_c), fx.tree.leaves(p_e)):
            diff = (x - y).abs()
            moved = diff > 1e-6
            flips += int(moved.sum())
            assert float(diff.max()) <= 2 * LION_LR * 1.01
        params, state = p_c, s_c
    assert flips <= 4, flips  # of 10 steps x every element


def test_compiled_step_on_cuda_has_no_graph_breaks_and_no_recompiles_after_warmup():
    torch._dynamo.reset()
    counters.clear()
    warm = []  # graphs compiled by the first 4 steps (2 emitted)
    # bf16, as test_step_compile.py's contract. (With a dynamic loss scale the update graph-breaks, on the CPU too:
    # "Untraceable C tp_hash" of a PyTreeSpec; its numbers are the eager ones, test_compiled_step_equals_eager.)
    _fx_run(_amp_accumulated(), _batches(10), compile=True,
            after_warmup=lambda: warm.append(counters["stats"]["unique_graphs"]))
    assert warm[0] > 0 and counters["stats"]["unique_graphs"] == warm[0]
    assert not sum(counters["graph_break"].values()), dict(counters["graph_break"])


# --- the runner -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("experiment", ["digits_mlp", "resnet_baseline", "tiny_lm"])
def test_a_training_step_and_its_batch_never_wait_for_the_gpu(experiment):
    # What the runner's loop does every step (fxtrain/train.py: the batch, then the step), with torch's sync
    # debug mode raising on anything that makes the host wait for the device (.item(), .cpu(), a copy from
    # pageable memory, nonzero...). Logging and evaluation sync, every trainer.log_every/eval_every steps.
    cfg = cfg_of(f"experiment={experiment}", "trainer.device=cuda")
    built = runner.build_run(cfg, CUDA)
    params, state, buffers = built.params, built.opt_state, built.buffers
    for i in range(8):  # the first steps create cuBLAS handles and the like; the first update of an accumulated
        # window (tiny_lm's accumulate(4)) builds global_norm's gather plan, copying its indices to the device once
        params, state, buffers, _ = built.step(params, state, buffers, built.data.train[i])
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings():  # torch calls the mode a prototype; under filterwarnings=error that
            warnings.filterwarnings("ignore", "Synchronization debug mode", UserWarning)  # raised after setting it
            torch.cuda.set_sync_debug_mode("error")
        for i in range(8, 16):
            params, state, buffers, metrics = built.step(params, state, buffers, built.data.train[i])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert {x.device.type for x in fx.tree.leaves(params)} == {"cuda"}
    assert torch.isfinite(metrics["loss"]).item()


def test_the_runner_trains_on_cuda_and_logs_steps_between_accumulated_updates():
    # log_every=3 under accumulate(every=4): most logged steps emit no update, so their metrics mix the
    # device's tensors with the host's counters (emitted): one log line must read both.
    assert run_main("experiment=tiny_lm", "trainer.device=cuda", "trainer.max_steps=12", "trainer.log_every=3",
                    "trainer.eval_every=6", "schedule.warmup_steps=2", "model.d_model=32", "data.max_bytes=200000",
                    "hydra.run.dir=run") == 0
    run = pathlib.Path("run")
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert [r["step"] for r in report.read_jsonl(run / "metrics.jsonl") if "loss" in r] == [3, 6, 9, 12]
    assert "params on cuda" in (run / "train.log").read_text()


def test_vmapped_sweep_on_cuda_matches_the_basic_launcher(capsys):
    grid = ["trainer.device=cuda", "optim.chain.adamw.learning_rate=3e-3,1e-2,3e-2", "seed=0,1"]
    basic = sweep_of("basic", *grid)
    vmapped = sweep_of("vmap", *grid)
    assert "jobs 0,1,2,3,4,5 as one process" in capsys.readouterr().out
    assert_same_sweep(basic, vmapped, 6)  # test_vmap_launcher.py's bars: relative 2e-5 on every logged float


# --- amp=float8 (fxtrain/float8.py): torchao's float8 matmuls where the GPU has them ---------------------------

@pytest.mark.skipif(not torch.cuda.is_available() or not fxfloat8.hardware_float8(torch.device("cuda")),
                    reason="needs a CUDA device with float8 matmuls (SM89 or later)")
def test_hardware_float8_computes_what_the_emulation_does():
    # On SM89+ convert picks torch._scaled_mm; the emulation quantizes the same way and multiplies in high precision:
    # the same forward and gradient up to the matmul's accumulation order (bf16 output: its eps, 7.8e-3). The
    # tolerances are that reasoning's, not measured: no session with a GPU has run this yet (make gpu-check runs it).
    torch.manual_seed(0)
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for device in (torch.device("cuda"), torch.device("cpu")):  # cpu: emulated, then run on the GPU
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)).to(torch.bfloat16)
        fxfloat8.convert(model, device=device)
        assert model[0].config.emulate is (device.type == "cpu")
        y = model.cuda()(x)
        (grad,) = torch.autograd.grad(y.float().square().sum(), x)
        outs.append((y.float(), grad.float()))
    (real, real_grad), (emulated, emulated_grad) = outs
    torch.testing.assert_close(real, emulated, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(real_grad, emulated_grad, rtol=5e-2, atol=5e-2)
