"""Resume inside an accumulation window, under every parallel layout (fxtrain/train.py, fxtrain/parallel/_parallelize.py,
fxtrain/checkpoint.py): one 2-rank gloo world runs, per layout, the tiny LM uninterrupted and then killed after a
checkpoint taken mid-window (accumulate every 4, checkpoint at step 3) and resumed with ``resume=auto``. The
resumed run logs and ends bit for bit where the uninterrupted one does: same layout on both sides, so the same
kernels run in the same order, and only what the checkpoint held can make a difference.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import torch

import fxtrain as fx
from tests import _worlds

CASES, case = _worlds.registry(worlds=(2,))

TINY = ["experiment=tiny_lm", "data.max_bytes=20000", "data.eval_windows=16", "model.d_model=16", "model.n_heads=2",
        "model.n_layers=2", "data.batch_size=8", "data.context=16", "trainer.max_steps=8", "trainer.log_every=1",
        "trainer.eval_every=8", "trainer.keep_last=0", "schedule.warmup_steps=1", "amp=off"]
LAYOUTS = {"dp": ["parallel=dp"], "fsdp": ["parallel=fsdp"], "tp": ["parallel=tp"], "fsdp_tp": ["parallel=fsdp_tp"],
           "pp": ["parallel=pp", "parallel.microbatches=2"], "ep": ["parallel=ep", "model=moe"]}


def _records(run: pathlib.Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"} for line in lines]


def _train(out: pathlib.Path, *overrides: str) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fxtrain import train as runner

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    runner.train(cfg, out)
    torch.distributed.barrier()  # rank 0 writes the run's files: every rank reads them after


def _mid_window_resume(name: str, *overrides: str) -> None:
    root = _worlds.OUT_DIR / name
    rank = torch.distributed.get_rank()
    _train(root / "whole", *TINY, *overrides, "trainer.checkpoint_every=0")
    args = [*TINY, *overrides, "trainer.checkpoint_every=3", "resume=auto"]
    _train(root / "killed", *args)
    torch.distributed.barrier()
    if rank == 0:  # killed after step 3's checkpoint (3 of 4 micro-batches of the window held)
        for later in ("step_0000006", "step_0000008"):
            shutil.rmtree(root / "killed" / "checkpoints" / later)
        (root / "killed" / "summary.json").unlink()
    torch.distributed.barrier()
    _train(root / "killed", *args)
    whole, resumed = _records(root / "whole"), _records(root / "killed")
    assert resumed == whole, (name, [r.get("grad_norm") for r in whole], [r.get("grad_norm") for r in resumed])
    if name == "pp":  # every stage's params and state are in the checkpoint: resume=PATH from it, into a new run
        _train(root / "path", *TINY, *overrides, "trainer.checkpoint_every=3",
               f"resume={root / 'killed' / 'checkpoints' / 'step_0000003'}")
        assert _records(root / "path") == whole[3:]  # its log starts after the checkpoint
        # fx.load into the whole model's state (what one process builds): every stage's leaves, bit for bit
        from hydra.core.global_hydra import GlobalHydra

        from tests._runner import cfg_of, load_checkpoint

        GlobalHydra.instance().clear()
        cfg = cfg_of(*TINY, *overrides)
        whole_state = load_checkpoint(root / "whole" / "checkpoints" / "step_0000008", cfg)
        resumed_state = load_checkpoint(root / "killed" / "checkpoints" / "step_0000008", cfg)
        for path, x, y in zip(fx.tree.paths(whole_state), fx.tree.leaves(whole_state), fx.tree.leaves(resumed_state)):
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), path


@case()
def case_eval_precision_and_pp_amp(world):
    """Under tiny_lm's bf16 amp, every layout evaluates the same params (step 4: the first update has learning
    rate 0) to the one-process test_loss, in float32 (bf16 evaluation was 4e-4 away); parallel=pp trains with
    the bf16 preset, its first loss the one-process amp step's."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fxtrain import train as runner

    amp = [t for t in TINY if t != "amp=off"] + ["trainer.max_steps=4", "trainer.eval_every=4",
                                                  "trainer.checkpoint_every=0"]
    refs = {}
    for model in ("transformer", "moe"):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*amp, f"model={model}"])
        built = runner.build_run(cfg, torch.device("cpu"))
        test_loss = built.evaluate(built.params, built.buffers, built.data.test, cfg.trainer.eval_batch_size)["test_loss"]
        first = built.step(built.params, built.opt_state, built.buffers, built.data.train[0])[3]["loss"]
        refs[model] = (test_loss, float(first))
    root = _worlds.OUT_DIR / "eval"
    got = {}
    for name, overrides in LAYOUTS.items():
        _train(root / name, *amp, *overrides)
        summary = json.loads((root / name / "summary.json").read_text())["metrics"]
        model = "moe" if "model=moe" in overrides else "transformer"
        got[name] = (summary["test_loss"], _records(root / name)[0]["loss"], refs[model])
    for name, (test_loss, first, (ref_test, ref_first)) in got.items():
        assert abs(test_loss - ref_test) <= 2e-6 * ref_test, (name, test_loss, ref_test)
    pp_first, ref_first = got["pp"][1], got["pp"][2][1]
    assert abs(pp_first - ref_first) <= 2e-6 * ref_first, (pp_first, ref_first)


BF16 = {**LAYOUTS, "pp_1f1b": ["parallel=pp", "parallel.microbatches=2", "parallel.schedule=1f1b"]}


def one_process_metrics(*overrides: str) -> list[dict]:
    """The loss and grad_norm of every step of the one-process run of a config, computed on this rank (the
    runner's build and step on each whole batch)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fxtrain import train as runner

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(runner.CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "parallel=none"])
    built = runner.build_run(cfg, torch.device("cpu"))
    params, state, buffers, out = built.params, built.opt_state, built.buffers, []
    for i in range(cfg.trainer.max_steps):
        params, state, buffers, metrics = built.step(params, state, buffers, built.data.train[i])
        out.append({k: float(metrics[k]) for k in ("loss", "grad_norm")})
    return out


def assert_steps_close(name: str, got: list[dict], ref: list[dict], loss_rel: float, norm_rel: float) -> None:
    """Per step, the layout's logged loss and grad_norm against one process's, within relative tolerances."""
    assert len(got) == len(ref), (name, len(got), len(ref))
    for i, (g, r) in enumerate(zip(got, ref)):
        for key, rel in (("loss", loss_rel), ("grad_norm", norm_rel)):
            assert abs(g[key] - r[key]) <= rel * abs(r[key]), (name, i + 1, key, g[key], r[key])


@case()
def case_bf16_layouts_match_one_process(world):
    """Under amp=bf16 (tiny_lm's preset), every layout logs one process's bf16 run, step by step: loss and
    grad_norm, every step an update (accumulate off). The layouts differ from one process by bf16 rounding in
    another order (measured: loss 1e-5, grad_norm 6e-4 relative), not by a factor: issue 35's pp and pp_tp
    applied n_microbatches x the gradient (grad_norm 2x here) under bf16 with gpipe and 1f1b."""
    amp = [t for t in TINY if t != "amp=off"] + ["accumulate=off", "trainer.max_steps=4", "trainer.eval_every=4",
                                                  "trainer.checkpoint_every=0"]
    refs = {model: one_process_metrics(*amp, f"model={model}") for model in ("transformer", "moe")}
    root = _worlds.OUT_DIR / "bf16"
    for name, overrides in BF16.items():
        _train(root / name, *amp, *overrides)
        got = [r for r in _records(root / name) if "loss" in r]
        assert_steps_close(name, got, refs["moe" if "model=moe" in overrides else "transformer"], 2e-4, 1e-2)


def _layout_case(name: str):
    def run(world):
        _mid_window_resume(name, *LAYOUTS[name])

    run.__name__ = f"case_{name}"
    return case()(run)


for _name in LAYOUTS:
    _layout_case(_name)


test_case = _worlds.tests(__file__, CASES, timeout_s=600)


def test_none_resumes_mid_window_bit_exact(tmp_path):
    """parallel=none, one process: the same check."""
    from tests._runner import cfg_of
    from fxtrain import train as runner

    runner.train(cfg_of(*TINY, "trainer.checkpoint_every=0"), tmp_path / "whole")
    args = [*TINY, "trainer.checkpoint_every=3", "resume=auto"]
    runner.train(cfg_of(*args), tmp_path / "killed")
    for later in ("step_0000006", "step_0000008"):
        shutil.rmtree(tmp_path / "killed" / "checkpoints" / later)
    (tmp_path / "killed" / "summary.json").unlink()
    runner.train(cfg_of(*args), tmp_path / "killed")
    assert _records(tmp_path / "killed") == _records(tmp_path / "whole")


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
