"""Every study in experiments/ runs end to end in a smoke mode (a few steps, tiny), so none of them can rot.

Each test drives the study the way its README does (the same configs, the same scripts), with overrides
that make it take seconds: the lr_sweep multirun and its table/heatmap, the ResNet variants' sweep with
the accumulation check and plot, the tiny LM on 1 process and on 2 torchrun ranks.
"""

import importlib.util
import json
import pathlib

import pytest
import torch
from hydra import compose, initialize_config_dir

import fxtrain as fx
from fxtrain import build, report, tasks, train as runner
from tests._runner import CONF, cfg_of, isolate, load_checkpoint, run_main  # noqa: F401 - isolate: autouse

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = ["trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=1"]


def study(path):
    """A study script (experiments/ is not a package) loaded as a module."""
    spec = importlib.util.spec_from_file_location(path.replace("/", "_").removesuffix(".py"), ROOT / "experiments" / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- experiments/lr_sweep ----------------------------------------------------------------------------

def test_lr_sweep_multirun_table_and_heatmap(tmp_path):
    # The README's sweep with the grid cut to 2 x 1 x 2 points (command-line values replace the config's
    # lists) and 6 batches per job, then analyze.py on its directory.
    sweep_dir = tmp_path / "sweep"
    assert run_main("-m", "experiment=lr_sweep", f"hydra.sweep.dir={sweep_dir}", *FAST, "seed=0",
                    "optim.chain.adamw.learning_rate=1e-3,1e-2", "schedule.warmup_steps=2",
                    "optim.chain.clip_by_global_norm.max_norm=0.1,1.0", "trainer.max_steps=6",
                    "trainer.eval_every=3", "trainer.log_every=3") == 0
    rows = report.collect(sweep_dir)
    assert [r["status"] for r in rows] == ["completed"] * 4
    assert (sweep_dir / "summary.csv").exists()

    analyze = study("lr_sweep/analyze.py")
    out = tmp_path / "out"
    analyze.main([str(sweep_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert "4 of 4 jobs completed" in text and text.count("**best**") == 1
    assert (out / "heatmap.png").stat().st_size > 5_000


def test_lr_sweep_config_is_the_grid_of_the_readme():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=lr_sweep"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    grid = [len(str(v).split(",")) for v in params.values()]
    assert list(params) == ["optim.chain.adamw.learning_rate", "schedule.warmup_steps",
                            "optim.chain.clip_by_global_norm.max_norm", "seed"] and grid == [3, 2, 2, 3]
    assert cfg.hydra.sweep.dir.startswith("experiments/lr_sweep/runs/")


# --- experiments/resnet_clip_accumulate ----------------------------------------------------------------

VARIANTS = ["resnet_baseline", "resnet_clip", "resnet_accumulate", "resnet_bf16"]


def test_resnet_variants_differ_from_the_baseline_in_one_thing_each():
    stacks = {v: repr(build.stack(cfg_of(f"experiment={v}"))) for v in VARIANTS}
    base = stacks["resnet_baseline"]
    assert base.startswith("chain(add_decayed_weights(weight_decay=0.0005), inject_hyperparams(sgd)(")
    assert "cosine_decay_schedule" in base and "momentum=0.9" in base
    assert stacks["resnet_clip"] == base.replace("chain(", "chain(clip_by_global_norm(0.1), ", 1)
    assert stacks["resnet_accumulate"].startswith("accumulate(every=4, chain(add_decayed_weights")
    assert stacks["resnet_bf16"].startswith("amp_cast(policy='p=f32,c=bf16,o=f32'")


def test_resnet_study_sweep_check_and_plot(tmp_path):
    run = study("resnet_clip_accumulate/run.py")
    check = run.accumulation_check(iterations=8)
    marks = [line.split("]")[1].split()[0] for line in check.splitlines() if line.startswith("iteration")]
    assert marks == ["held", "held", "held", "UPDATED"] * 2

    sweep_dir = run.sweep([*FAST, "trainer.max_steps=8", "trainer.eval_every=4", "trainer.log_every=4"],
                          tmp_path / "sweep", seeds="0")
    jobs = run._jobs(sweep_dir)
    assert list(jobs) == list(run.VARIANTS)
    assert all(row["status"] == "completed" for runs in jobs.values() for row, _ in runs), run.table(jobs)
    assert "| accumulate(every=4) | 2 | 1 of 1 |" in run.table(jobs)  # 8 batches, 2 optimizer updates
    assert run.plot(jobs, tmp_path / "curves.png").stat().st_size > 5_000


# --- experiments/tiny_lm --------------------------------------------------------------------------------

def test_tiny_lm_config():
    cfg = cfg_of("experiment=tiny_lm")
    text = repr(build.stack(cfg))
    assert text.startswith("accumulate(every=4, amp_cast(policy='p=f32,c=bf16,o=f32'")
    assert "inject_hyperparams(adamw)(learning_rate=0.003*warmup_cosine_decay_schedule(" in text
    assert cfg.optimized_metric == "val_loss" and cfg.model._target_ == "fxtrain.models.TransformerLM"


@pytest.mark.multiprocess
@pytest.mark.slow  # fast suite: the tiny LM under every layout preset in tests/test_matrix.py's each-value cover
def test_tiny_lm_one_rank_and_two_ranks(tmp_path):
    # Both README commands (1 process; torchrun with 2 ranks), 8 batches on a small corpus, then the report.
    run = study("tiny_lm/run.py")
    run.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path), "trainer.max_steps=8",
              "trainer.eval_every=4", "trainer.log_every=4", "schedule.warmup_steps=4", "data.max_bytes=30000",
              "trainer.device=cpu"])
    one, two = (json.loads((tmp_path / "runs" / n / "summary.json").read_text()) for n in ("1rank", "2ranks"))
    assert one["status"] == two["status"] == "completed"
    assert two["value"] == pytest.approx(one["value"], abs=2e-2)  # bf16 rounding differs with the local batch
    assert "| 8 | 2 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "val_loss.png").stat().st_size > 5_000


# --- experiments/clip_parallel ----------------------------------------------------------------------------

def test_clip_parallel_truth_is_the_one_process_norm_and_the_clip_is_active():
    # The scale study's yardstick: float64 on one process; the float32 1-process run's own norm agrees with it.
    ranks = study("clip_parallel/_scale_rank.py")
    ref = ranks.reference_run(experts=0, steps=3)
    assert all(abs(n / t - 1) < 1e-5 for (n,), t in zip(ref["reported"], ref["true_norm"])), ref
    assert min(ref["true_norm"]) > ranks.CLIP  # every step clipped: a wrong norm would change the update


@pytest.mark.multiprocess
def test_clip_parallel_scale_study_pipeline_layout(tmp_path):
    # The README's command cut to one layout (2 torchrun ranks) and 3 steps, then its table and figure.
    scale = study("clip_parallel/scale.py")
    pp = scale.main(["--only", "pp", "--steps", "3", "--out", str(tmp_path)])["pp"]["variants"]
    fx_, torch_ = pp["fxtrain"], pp["torch"]
    assert all(abs(n / t - 1) < scale.TOL for (n,), t in zip(fx_["reported"], fx_["true_norm"]))
    for stages, t in zip(torch_["reported"], torch_["true_norm"]):  # each stage's norm is its share of the truth
        assert max(stages) < 0.999 * t and abs(sum(n * n for n in stages) / t**2 - 1) < 1e-4, (stages, t)
    assert torch_["labels"] == ["stage 0 (rank 0)", "stage 1 (rank 1)"]
    row = "| PP, 2 ranks | fxtrain `clip_by_global_norm` | grad_norm | 1.0000 |"
    assert row in (tmp_path / "results.md").read_text()
    assert (tmp_path / "scale.png").stat().st_size > 5_000


# --- experiments/mnist_port ------------------------------------------------------------------------------

def test_mnist_port_config_is_the_templates_mnist_example():
    cfg = cfg_of("experiment=mnist_port", *FAST)
    runner.settle_max_steps(cfg)
    stack = repr(build.stack(cfg))
    assert stack.startswith("chain(inject_hyperparams(adam)(learning_rate=0.001*constant_schedule(value=1.0)")
    assert stack.endswith("reduce_on_plateau(patience=11, accumulation_size=11))"), stack  # factor 0.1: default
    model = build.model(cfg)
    assert [type(m).__name__ for m in model.net] == ["Flatten"] + ["Linear", "BatchNorm1d", "ReLU"] * 3 + ["Linear"]
    assert [m.out_features for m in model.net if isinstance(m, torch.nn.Linear)] == [64, 128, 64, 10]
    # 10 epochs of 11 batches of 128 (1,412 training digits), one evaluation and one plateau decision per epoch
    assert (cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.data.batch_size) == (110, 11, 128)
    assert (cfg.trainer.checkpoint.best_by, cfg.trainer.test_ckpt) == ("val_accuracy", "best")


def test_mnist_port_tests_the_best_checkpoint_by_val_accuracy_with_its_batchnorm_statistics(tmp_path):
    cfg = cfg_of("experiment=mnist_port", "trainer.max_epochs=4", "trainer.eval_every=11", *FAST)
    runner.train(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    evals = [r for r in report.read_jsonl(tmp_path / "metrics.jsonl") if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [11, 22, 33, 44]  # once per epoch
    best = max(evals, key=lambda r: r["val_accuracy"])  # the first of equals, as ModelCheckpoint keeps it
    assert summary["best_step"] == best["step"] and summary["metrics"]["val_accuracy"] == best["val_accuracy"]

    # The test metrics are those of checkpoints/best, evaluated by hand in eval mode (BatchNorm's running
    # statistics, which the checkpoint carries as buffers, updated once per training batch up to the best step).
    state = load_checkpoint(tmp_path / "checkpoints" / "best", cfg)
    assert state.step == best["step"]
    counts = {int(v) for k, v in state.buffers.items() if k.endswith("num_batches_tracked")}
    assert counts == {best["step"]} and all(v.abs().sum() > 0 for k, v in state.buffers.items() if "running_mean" in k)
    apply, _, _ = fx.functional(build.model(cfg))
    x, y = build.dataset(cfg.data, "data").test
    with torch.no_grad():
        logits, buffers = apply(state.params, state.buffers, x, train=False)
    accuracy = float((logits.argmax(-1) == y).float().mean())
    assert summary["metrics"]["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert summary["metrics"]["test_loss"] == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert all(torch.equal(buffers[k], state.buffers[k]) for k in buffers)  # evaluation leaves the statistics alone


def test_mnist_port_reduce_on_plateau_in_the_runner_matches_torch_reduce_lr_on_plateau(tmp_path):
    # One decision per batch (accumulation_size=1) on the training loss the runner hands the stack, patience 2 in
    # Optax's count: torch's ReduceLROnPlateau(patience=1) fed the same losses gives the same learning-rate factors.
    cfg = cfg_of("experiment=mnist_port", "trainer.max_epochs=3", "trainer.log_every=1",
                 "optim.chain.reduce_on_plateau.patience=2", "optim.chain.reduce_on_plateau.accumulation_size=1",
                 *FAST)
    runner.train(cfg, tmp_path)
    records = [r for r in report.read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 34))
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd, mode="min", factor=0.1, patience=1, threshold=1e-4)
    expected = []
    for r in records:
        scheduler.step(r["loss"])
        expected.append(sgd.param_groups[0]["lr"])
    assert min(expected) < 1, "no plateau in 33 batches: the test checks nothing"
    assert [r["plateau_scale"] for r in records] == pytest.approx(expected, rel=1e-6)
