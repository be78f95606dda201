"""Tests for fxtrain/parallel/_context_parallel.py: ``parallel.cp``, torch's context parallel under the runner.

* The attention (2 ranks): torch's ``context_parallel`` with the CPU kernel entered (``cpu_ring_attention``) gives
  plain SDPA's output and q/k/v gradients on the whole sequences, computed in the same process (float32 to 1e-6;
  bf16 to its rounding), with either k/v rotation (``set_rotate_method``).
* The runner (4 ranks, fast): ``parallel=fsdp_cp`` (dp_shard=2 x cp=2) logs one process's loss and grad_norm at
  every step in float32 (1e-4 relative, the other layouts' float32 agreement), and resumes bit-exactly from a
  checkpoint inside tiny_lm's accumulation window under bf16. tests/test_matrix.py runs every cp preset under
  bf16 against one process, and its relayout cells continue their checkpoints in one process.
* The issue's figure (slow): each preset 100 steps against one process, the loss of every step within 2e-3
  relative, amp off and bf16 (experiments/context_parallel/results.md holds the measured table, and the control
  that sets grad_norm's bound under bf16).
* Refusals, in one line before anything trains: a model without attention, ``data.context`` not a multiple of
  ``2 * cp`` (torch's load balancing), cp with pp or ep.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests import _worlds

CASES, case = _worlds.registry(worlds=(2,))
B, H, T, D = 2, 4, 16, 8  # SDPA's (batch, heads, sequence, head_dim); T splits into 2 * cp = 4 chunks


@case(2)
def case_ring_attention_equals_sdpa(world):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

    from fxtrain.parallel import cpu_ring_attention

    cpu_ring_attention()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        torch.manual_seed(0)
        q, k, v, g = (torch.randn(B, H, T, D, dtype=dtype) for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*whole, is_causal=True)
        ref.backward(g)
        for rotate in ("allgather", "alltoall"):
            set_rotate_method(rotate)
            parts = [t.clone() for t in (q, k, v, g)]
            with context_parallel(mesh, buffers=parts, buffer_seq_dims=[2] * 4, no_restore_buffers=set(parts)):
                cq, ck, cv, cg = parts
                assert cq.shape == (B, H, T // world, D)  # this rank's load-balanced chunks
                for t in (cq, ck, cv):
                    t.requires_grad_()
                out = F.scaled_dot_product_attention(cq, ck, cv, is_causal=True)
                out.backward(cg)
                got = context_parallel_unshard(mesh, [out.detach(), cq.grad, ck.grad, cv.grad], [2] * 4)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref, *(t.grad for t in whole)]):
                torch.testing.assert_close(a.float(), b.detach().float(), rtol=tol, atol=tol, msg=(dtype, rotate, name))
    set_rotate_method("allgather")  # torch's default, for the cases after this one


# --- the runner on 4 ranks ----------------------------------------------------------------------------------

@case(4)
def case_fsdp_cp_matches_one_process(world):
    from tests.test_train_resume_layouts import (TINY, _mid_window_resume, _records, _train, assert_steps_close,
                                                 one_process_metrics)

    exact = [*TINY, "accumulate=off", "trainer.max_steps=4", "trainer.eval_every=4",
             "trainer.checkpoint_every=0"]
    out, ref = _worlds.OUT_DIR / "fsdp_cp", one_process_metrics(*exact)
    _train(out, *exact, "parallel=fsdp_cp")
    got = [r for r in _records(out) if "loss" in r]
    assert_steps_close("fsdp_cp", got, ref, 1e-4, 1e-4)
    assert json.loads((out / "run.json").read_text())["layout"] == "parallel dp_shard=2 x cp=2"
    # tiny_lm's own bf16 amp and accumulate(every=4), killed after step 3 (inside a window): bit-exact
    _mid_window_resume("fsdp_cp_resume", "parallel=fsdp_cp", "amp=bf16")
    # The 8-rank presets' compositions on 4 ranks (their runs: the slow figure below, test_matrix's pairwise cover):
    # HSDP with cp as the shard dim, and tp x cp (FSDP over cp alone).
    for name, degrees in (("hsdp_cp", ["parallel.dp_replicate=2", "parallel.cp=2"]),
                          ("tp_cp", ["parallel.tp=2", "parallel.cp=2"])):
        _train(_worlds.OUT_DIR / name, *exact, *degrees)
        got = [r for r in _records(_worlds.OUT_DIR / name) if "loss" in r]
        assert_steps_close(name, got, ref, 1e-4, 1e-4)


test_case = _worlds.tests(__file__, CASES, timeout_s=600)


# --- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,degrees,message", [
    ("mlp", {"dp_shard": 2, "cp": 2}, "parallel.cp=2: MLP has no sequence attention to split; use model=transformer "
                                      "(or model=moe), or parallel.cp=1"),
    ("context", {"dp_shard": 2, "cp": 2}, "parallel.cp=2: data.context=10 does not split into 2 * cp = 4 equal "
                                          "chunks (torch load-balances causal attention so); make it a multiple of 4"),
    ("transformer", {"pp": 2, "cp": 2}, "parallel pp=2 x cp=2: context parallel composes with dp_replicate, "
                                        "dp_shard and tp here; set parallel.pp and parallel.ep to 1 (or "
                                        "parallel.cp to 1)"),
    ("moe", {"ep": 2, "cp": 2}, "parallel ep=2 x cp=2: context parallel composes with dp_replicate, dp_shard and "
                                "tp here; set parallel.pp and parallel.ep to 1 (or parallel.cp to 1)"),
])
def test_refused_before_any_mesh_is_used(model, degrees, message):
    import fxtrain as fx
    from fxtrain.distributed import ParallelDims
    from fxtrain.models import MLP, TransformerLM

    built = {"mlp": lambda: MLP((4,), (8,), 2), "context": lambda: TransformerLM(context=10, d_model=8, n_heads=2),
             "transformer": lambda: TransformerLM(context=16, d_model=8, n_heads=2),
             "moe": lambda: TransformerLM(context=16, d_model=8, n_heads=2, experts=2)}[model]()
    # the mesh is not built: the refusal comes first
    with pytest.raises(ValueError) as e:
        fx.parallel.parallelize(built, fx.sgd(0.1), ParallelDims.of(world=4, **degrees))
    assert str(e.value) == message


# --- the issue's figure: 100 steps against one process, amp off and bf16 (slow) ----------------------------

# issue 39: "equal to one process within 2e-3 relative after 100 steps, amp off and on": the loss of every step and
# the last. grad_norm: 2e-3 in float32 (measured at most 2.2e-5); under bf16 the runs part by bf16 rounding in
# another order, cp or not (experiments/context_parallel/results.md: parallel=fsdp on 4 ranks, no cp, 0.23 at
# some step, fsdp_cp 0.19), so its bound there is that spread's.
FIGURE_REL = {"off": {"loss": 2e-3, "final": 2e-3, "grad_norm": 2e-3},
              "bf16": {"loss": 2e-3, "final": 2e-3, "grad_norm": 0.3}}


def _study():
    """experiments/context_parallel/run.py, loaded as a module (experiments/ is no package)."""
    import importlib.util

    path = _worlds.ROOT / "experiments" / "context_parallel" / "run.py"
    spec = importlib.util.spec_from_file_location("context_parallel_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("amp", ["off", "bf16"])
@pytest.mark.parametrize("preset", ["fsdp_cp", "hsdp_cp", "fsdp_tp_cp"])
def test_hundred_steps_equal_one_process(tmp_path, preset, amp):
    study = _study()
    ref, _ = study.train(0, [f"amp={amp}"], 100, tmp_path / "one")
    got, _ = study.train(study.PRESETS[preset], [f"parallel={preset}", f"amp={amp}"], 100, tmp_path / "cp")
    assert len(got) == 100
    worst = study.deviations(got, ref)
    assert all(worst[k] <= bound for k, bound in FIGURE_REL[amp].items()), (preset, amp, worst)


if __name__ == "__main__":
    _worlds.worker(CASES, *sys.argv[1:])
