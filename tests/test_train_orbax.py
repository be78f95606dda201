"""The runner and JAX: ``trainer.export=orbax`` writes what JAX restores, ``resume=orbax:PATH`` continues a
checkpoint JAX wrote (fxtrain/run_hooks.py), through ``python -m fxtrain.train``'s entry point."""

from __future__ import annotations

import json

import pytest

ocp = pytest.importorskip("orbax.checkpoint")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytestmark = pytest.mark.jax

import torch  # noqa: E402

from fxtrain import build  # noqa: E402
from fxtrain.interop import to_linen  # noqa: E402
from tests._runner import cfg_of, isolate, load_checkpoint, run_main  # noqa: E402,F401 - isolate: autouse

# A small MLP on digits; the schedule's length is given, so a 3-step run and a 6-step run share it.
FAST = ["trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=1", "model.hidden=[32]",
        "schedule.warmup_steps=2", "schedule.decay_steps=6"]


def final_state(run, steps: int):
    return load_checkpoint(run / "checkpoints" / f"step_{steps:07d}", cfg_of(*FAST, f"trainer.max_steps={steps}"))


def assert_equal_trees(a, b):
    import fxtrain as fx

    la, lb = fx.tree.leaves(a), fx.tree.leaves(b)
    assert fx.tree.structure(a) == fx.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y), (x, y)


def optax_counterpart():
    """The Optax stack of the run's ``stack`` line: chain(clip_by_global_norm(1.0), inject_hyperparams(adamw)(...))."""
    shape = optax.warmup_cosine_decay_schedule(0.0, 1.0, 2, 6, 0.0)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=lambda n: 3e-3 * shape(n), b1=0.9, b2=0.999,
                                                             eps=1e-8, weight_decay=1e-4))


def test_export_then_resume_continues_as_the_run_that_never_stopped(tmp_path, capsys):
    # fxtrain 3 steps -> trainer.export=orbax -> resume=orbax:PATH for 3 more, against 6 uninterrupted steps.
    # Tolerance: none. The crossing copies float32 arrays, and the optimizer state's count, hyperparameters and
    # moments all cross (only clip_by_global_norm's reported norm does not: Optax keeps no state there).
    assert run_main(*FAST, "trainer.max_steps=3", "trainer.export=orbax", "hydra.run.dir=first") == 0
    assert (tmp_path / "first" / "orbax" / "_CHECKPOINT_METADATA").exists()
    assert run_main(*FAST, "trainer.max_steps=6", "resume=orbax:first/orbax", "hydra.run.dir=second") == 0
    assert run_main(*FAST, "trainer.max_steps=6", "hydra.run.dir=whole") == 0
    log = (tmp_path / "second" / "train.log").read_text()
    assert "start  from the Orbax checkpoint first/orbax (step 3, recorded)" in log
    resumed, whole = final_state(tmp_path / "second", 6), final_state(tmp_path / "whole", 6)
    assert_equal_trees(resumed.params, whole.params)
    assert_equal_trees(resumed.opt_state[1], whole.opt_state[1])  # [0]: clip's reported grad_norm
    assert int(resumed.opt_state[1].count) == 6
    lines = [(tmp_path / run / "metrics.jsonl").read_text().splitlines() for run in ("second", "whole")]
    assert lines[0][-1].split('"time_s"')[0] == lines[1][-1].split('"time_s"')[0]  # the last logged metrics

    # JAX restores the export into Flax names and Optax's own init of the same stack, value for value.
    model = build.model(cfg_of(*FAST))
    first = final_state(tmp_path / "first", 3)
    params = to_linen(first.params, model)["params"]
    target = {"params": params, "opt_state": optax_counterpart().init(params)}
    restored = ocp.StandardCheckpointer().restore(tmp_path / "first" / "orbax",
                                                  jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), restored["params"], params))
    inject = restored["opt_state"][1]
    assert int(inject.count) == 3 and int(inject.hyperparams_states["learning_rate"].count) == 3
    mu = to_linen(first.opt_state[1].inner_state[0].mu, model)["params"]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), inject.inner_state[0].mu, mu))
    assert abs(float(inject.hyperparams["learning_rate"]) - float(first.opt_state[1].hyperparams["learning_rate"])) == 0

    # What a JAX program writes back (no step recorded): the run goes on from its optimizer's update count, the same.
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "from_jax", restored)
    checkpointer.wait_until_finished()
    assert run_main(*FAST, "trainer.max_steps=6", f"resume=orbax:{tmp_path / 'from_jax'}", "hydra.run.dir=third") == 0
    assert "(step 3, its optimizer's update count)" in (tmp_path / "third" / "train.log").read_text()
    assert_equal_trees(final_state(tmp_path / "third", 6).params, whole.params)


@pytest.mark.parametrize("overrides, expected", [
    (["resume=orbax:"], "Error: resume=orbax:: expected orbax:PATH, the directory of an Orbax checkpoint "
                        "(resume=orbax:/path/to/ckpt)"),
    (["resume=orbax:nowhere"], "Error: resume=orbax:nowhere: nowhere is not a directory; expected the one "
                               "ocp.StandardCheckpointer().save(path, {'params': ..., 'opt_state': ...}) wrote"),
    (["trainer.export=zip"], "Error: trainer.export=zip: expected orbax (write <run dir>/orbax at the end: params and "
                             "optimizer state a JAX program restores) or null"),
    (["trainer.orbax_naming=flax"], "Error: trainer.orbax_naming=flax: expected compact (Flax linen's names, "
                                    "Dense_0/kernel), attribute, nnx, or torch (the model's named_parameters names)"),
])
def test_bad_orbax_settings_are_one_line_before_anything_is_written(overrides, expected, tmp_path, capsys):
    assert run_main(*FAST, "trainer.max_steps=3", "hydra.run.dir=run", *overrides) == expected
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # a refused launch leaves nothing, not even Hydra's empty directory


def test_a_checkpoint_that_does_not_fit_the_run_is_refused_naming_the_leaf(tmp_path, capsys):
    assert run_main(*FAST, "trainer.max_steps=3", "trainer.export=orbax", "hydra.run.dir=first") == 0
    code = run_main(*FAST, "trainer.max_steps=6", "model.hidden=[16]", "resume=orbax:first/orbax", "hydra.run.dir=b")
    assert code.startswith("Error: resume=orbax:first/orbax: from_linen: 'params/Dense_0/kernel' gives 'net.1.weight' "
                           "the shape (32, 64), expected (16, 64); it must hold this run's model"), code
    assert code.endswith("change model, optim or trainer.orbax_naming to match it"), code
    code = run_main(*FAST, "trainer.max_steps=6", "optim/transform@optim.chain=[clip_by_global_norm,sgd]",
                    "resume=orbax:first/orbax", "hydra.run.dir=c")
    assert code.startswith("Error: resume=orbax:first/orbax: load_orbax: the checkpoint differs at 'opt_state.1"), code
    code = run_main(*FAST, "trainer.max_steps=3", "resume=orbax:first/orbax", "hydra.run.dir=d")
    assert code == ("Error: resume=orbax:first/orbax: the checkpoint is at step 3 (recorded), trainer.max_steps=3 "
                    "leaves nothing to train; raise trainer.max_steps"), code
    code = run_main(*FAST, "trainer.max_steps=6", "resume=orbax:first", "hydra.run.dir=e")  # the run, not its export
    assert code.startswith("Error: resume=orbax:first: 'first' is not an Orbax checkpoint (it holds "), code
    assert code.endswith("(an fxtrain run's checkpoint: resume=PATH)"), code
    no_hidden = [o for o in FAST if not o.startswith("model.")]
    code = run_main(*no_hidden, "trainer.max_steps=3", "model=resnet", "trainer.export=orbax", "hydra.run.dir=f")
    assert code.startswith("Error: trainer.export=orbax: ResNet has buffers (stages.0.bn1.num_batches_tracked, "), code
    assert "Traceback" not in capsys.readouterr().err


def test_jax_and_orbax_write_no_lines_into_the_run_log(tmp_path, capsys):
    # JAX said "Unable to initialize backend 'tpu': ... libtpu.so" (INFO, as its backends start) and Orbax "Read
    # Metadata=...", "Created BasePyTreeCheckpointHandler..." (absl INFO) into the console and train.log, which show
    # INFO (conf/hydra/job_logging/fxtrain.yaml now keeps those loggers at WARNING). JAX's backends are cleared
    # first, so that they start again inside this run, as in a fresh process.
    from jax.extend.backend import clear_backends

    clear_backends()
    assert run_main(*FAST, "trainer.max_steps=3", "trainer.export=orbax", "hydra.run.dir=first") == 0
    assert run_main(*FAST, "trainer.max_steps=4", "resume=orbax:first/orbax", "hydra.run.dir=second") == 0
    shown = capsys.readouterr().out + "".join((tmp_path / run / "train.log").read_text() for run in ("first", "second"))
    assert "export " in shown and "start  from the Orbax checkpoint first/orbax (step 3, recorded)" in shown
    for noise in ("backend 'tpu'", "libtpu", "Read Metadata", "CheckpointHandler", "[process="):
        assert noise not in shown, shown


def test_resume_reads_a_checkpoint_manager_directory_at_its_newest_step(tmp_path):
    # What a JAX training loop keeps: ocp.CheckpointManager steps (<dir>/<step>/default). resume=orbax:<dir> reads the
    # newest; its step is the step directory's number. (Was refused: the directory has no _CHECKPOINT_METADATA.)
    assert run_main(*FAST, "trainer.max_steps=3", "trainer.export=orbax", "hydra.run.dir=first") == 0
    tree = ocp.StandardCheckpointer().restore(tmp_path / "first" / "orbax")
    with ocp.CheckpointManager(tmp_path / "jax_run") as manager:
        for step in (1, 3):  # the same tree twice: only the newest step's number tells them apart
            manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    assert run_main(*FAST, "trainer.max_steps=6", "resume=orbax:jax_run", "hydra.run.dir=second") == 0
    assert "start  from the Orbax checkpoint jax_run (step 3, recorded)" in (tmp_path / "second" / "train.log").read_text()
    assert json.loads((tmp_path / "second" / "summary.json").read_text())["status"] == "completed"
