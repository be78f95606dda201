"""Every pipeline schedule of the runner (``parallel.schedule``, fxtrain/parallel/_pipeline_schedules.py) against one
process: generated over the schema's list of schedules, in one 2-rank gloo world (tests/_worlds.py).

Each schedule trains the tiny LM with 4 blocks on ``pp=2`` (the looped schedules with ``stages_per_rank=2``: 4
stages, rank 0 holding stages 0 and 2, or 0 and 3 in zbv's V) x {accumulate off, every 4} x {float32, amp=bf16},
and its logged loss and grad_norm, every step, and its test_loss are compared with the one-process run of the
same config computed on the rank. Tolerances, relative: float32 1e-4 (the layouts' summation order, as
tests/test_train_parallel.py), bf16 tests/test_matrix.py's rule ``max(1e-4, 4 * eps(bfloat16))`` = 3.1e-2; the
defect they guard against (issue 35: pipelines under bf16 applied n_microbatches x the gradient) is a factor of
2 in grad_norm here. The bf16 accumulate run is also killed after step 3's checkpoint (inside the window) and
resumed with ``resume=auto``: its log equals the uninterrupted one bit for bit. The checkpoints of virtual stages
are continued on another schedule in the world and in one process here (:func:`test_continued_in_one_process`).
"""

from __future__ import annotations

import json
import os
import sys
import typing

import pytest
import torch

from fxtrain import schema
from tests import _worlds
from tests.test_train_resume_layouts import (TINY, _mid_window_resume, _records, _train, assert_steps_close,
                                           one_process_run)

CASES, case = _worlds.registry(worlds=(2,))

SCHEDULES = typing.get_args(schema.Parallel.model_fields["schedule"].annotation)
ONE_STAGE = ("gpipe", "1f1b")  # the rest loop over virtual stages: stages_per_rank=2
FOUR = [*TINY, "model.n_layers=4", "parallel=pp", "parallel.microbatches=2"]
F32, BF16 = 1e-4, max(1e-4, 4 * torch.finfo(torch.bfloat16).eps)
MID = 3  # _mid_window_resume's checkpoint: 3 of accumulate's 4 micro-batches held


def layout(name: str) -> list[str]:
    return [*FOUR, f"parallel.schedule={name}", f"parallel.stages_per_rank={1 if name in ONE_STAGE else 2}"]


_REFS: dict = {}


def one_process(*overrides: str) -> tuple[list[dict], float]:
    """The one-process run of a config on this rank (test_train_resume_layouts' one_process_run): each step's
    loss and grad_norm, and the final test_loss; computed once per config for every case of the world."""
    if overrides not in _REFS:
        _REFS[overrides] = one_process_run(*overrides)
    return _REFS[overrides]


def _schedule_case(name: str):
    def run(world):
        for accumulate in ("off", "k4"):
            for amp in ("off", "bf16"):
                args = [*layout(name), f"amp={amp}", f"accumulate={accumulate}"]
                if (amp, accumulate) == ("bf16", "k4"):  # killed inside the window and resumed: bit for bit
                    _mid_window_resume(name, *args[len(TINY):])
                    out = _worlds.OUT_DIR / name / "whole"
                else:  # a window of 4 batches twice, or 4 updates
                    if accumulate == "off":
                        args += ["trainer.max_steps=4", "trainer.eval_every=4"]
                    out = _worlds.OUT_DIR / name / f"{amp}-{accumulate}"
                    _train(out, *args, "trainer.checkpoint_every=0")
                if torch.distributed.get_rank():  # the runs' files are rank 0's: it compares them
                    continue
                ref, ref_test = one_process(*(a for a in args if not a.startswith("parallel")))
                rel = F32 if amp == "off" else BF16
                assert_steps_close(f"{name} amp={amp} accumulate={accumulate}",
                                   [r for r in _records(out) if "loss" in r], ref, rel, rel)
                test = json.loads((out / "summary.json").read_text())["metrics"]["test_loss"]
                assert test == pytest.approx(ref_test, rel=rel), (name, amp, accumulate, test, ref_test)

    run.__name__ = f"case_{name}"
    return case()(run)


# make test: the schedules with virtual stages (interleaved1f1b, interleaved_zb, zbv); gpipe and 1f1b each cost as
# much again and have their own fast tests against one process (test_pipeline.py; test_train_resume_layouts.py's
# bf16 and mid-window cases; test_matrix.py's pp cells). make test-all (FXTRAIN_SLOW): every schedule.
TRAINED = [s for s in SCHEDULES if os.environ.get("FXTRAIN_SLOW") or s not in ("gpipe", "1f1b")]
for _name in TRAINED:
    _schedule_case(_name)


@case()
def case_relayout_between_schedules(world):
    """A checkpoint of virtual stages taken inside a window (interleaved1f1b's, step 3) continued on one stage per
    rank (gpipe), and zbv's V on interleaved_zb's loop: the held sums are plain tensors on both sides, so each
    continues like the uninterrupted run of its source (bf16, in another order: the tolerance of bf16)."""
    for src, dst in (("interleaved1f1b", "gpipe"), ("zbv", "interleaved_zb")):
        source, out = _worlds.OUT_DIR / src / "killed", _worlds.OUT_DIR / f"{src}-{dst}"
        args = [*layout(dst), "amp=bf16", "accumulate=k4", "trainer.checkpoint_every=3", "resume_relayout=true",
                f"resume={source / 'checkpoints' / f'step_{MID:07d}'}"]
        _train(out, *args)
        want = [r for r in _records(source) if r["step"] > MID and "loss" in r]
        got = [r for r in _records(out) if "loss" in r]
        assert [r["step"] for r in got] == [r["step"] for r in want], (src, dst)
        assert_steps_close(f"{src} -> {dst}", got, want, BF16, BF16)


REFUSED = {  # (schedule, stages_per_rank, microbatches, n_layers) -> the line, on pp=2
    ("interleaved1f1b", 1, 2, 4): "parallel.schedule=interleaved1f1b interleaves virtual stages, but "
                                  "parallel.stages_per_rank=1: set parallel.stages_per_rank=2",
    ("zbv", 3, 2, 6): "parallel.schedule=zbv holds exactly 2 stages per rank (a V), but parallel.stages_per_rank=3: "
                      "set parallel.stages_per_rank=2",
    ("1f1b", 2, 2, 4): "parallel.schedule=1f1b runs one stage per rank, but parallel.stages_per_rank=2",
    ("1f1b", 1, 1, 4): "parallel.schedule=1f1b needs at least as many micro-batches as stages, but "
                       "parallel.microbatches=1 < parallel.pp=2",
    ("interleaved_zb", 2, 5, 4): "parallel.schedule=interleaved_zb runs the micro-batches in rounds of parallel.pp=2, "
                                 "but parallel.microbatches=5 is not a multiple of its 2 rounds: make it a multiple of 2",
    ("interleaved1f1b", 2, 2, 2): "parallel.pp=2 x parallel.stages_per_rank=2 = 4 stages need at least one block "
                                  "each, but model.n_layers=2: raise model.n_layers or lower them",
    ("zbv", 2, 2, 4, "compile"): "parallel.schedule=zbv splits the backward into input and weight gradients, which "
                                 "torch 2.13 does not do through torch.compile: use trainer.compile=false",
}


@pytest.mark.parametrize("setting", REFUSED, ids=lambda s: "-".join(map(str, s)))
def test_refused_before_a_stage_is_cut(setting):
    """What a schedule cannot run is refused in one line naming the setting and the fix, before any mesh is used
    (the dims here are not even built); torch's own rules, checked ahead of its constructors."""
    import fxtrain as fx
    from fxtrain import parallel
    from fxtrain.distributed import ParallelDims
    from fxtrain.models import TransformerLM

    name, per, micro, layers, *compiled = setting
    model = TransformerLM(vocab_size=16, context=8, d_model=8, n_heads=2, n_layers=layers)
    with pytest.raises(ValueError) as e:
        parallel.parallelize(model, fx.sgd(0.1), ParallelDims.of(world=2, pp=2), compile=bool(compiled),
                             pipeline={"schedule": name, "stages_per_rank": per, "microbatches": micro})
    assert str(e.value).startswith("parallel pp=2: ") and REFUSED[setting] in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@case()
def case_runner_refuses_in_one_line(world):
    """Under the runner the refusal is its one-line ConfigError, and the run directory stays empty."""
    from fxtrain.errors import ConfigError

    out = _worlds.OUT_DIR / "refused"
    with pytest.raises(ConfigError) as e:
        _train(out, *layout("zbv"), "parallel.stages_per_rank=3", "model.n_layers=6")
    assert REFUSED["zbv", 3, 2, 6] in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


test_case = _worlds.tests(__file__, CASES, timeout_s=600)


@pytest.mark.multiprocess
def test_continued_in_one_process(tmp_path_factory, tmp_path):
    """Each schedule's checkpoint inside the window (step 3, bf16) continued in one process (resume_relayout=true):
    every stage's params, optimizer state and held sums read into the whole model, each step like the
    uninterrupted run of the schedule within bf16's tolerance."""
    from hydra.core.global_hydra import GlobalHydra

    from fxtrain import train as runner
    from tests._runner import cfg_of

    root = _worlds.out_dir(2, __file__, tmp_path_factory)
    for name in TRAINED:
        source = root / name / "whole"
        killed = root / name / "killed" / "checkpoints" / f"step_{MID:07d}"
        args = [*(a for a in layout(name) if not a.startswith("parallel")), "amp=bf16", "accumulate=k4",
                "trainer.checkpoint_every=3", "parallel=none", f"resume={killed}", "resume_relayout=true"]
        GlobalHydra.instance().clear()
        runner.train(cfg_of(*args), tmp_path / name)
        want = [r for r in _records(source) if r["step"] > MID and "loss" in r]
        got = [r for r in _records(tmp_path / name) if "loss" in r]
        assert [r["step"] for r in got] == [r["step"] for r in want], name
        assert_steps_close(name, got, want, BF16, BF16)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
