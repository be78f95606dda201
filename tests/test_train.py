"""The Hydra runner: configs compose and build, runs write their files, sweeps summarize, torchrun works."""

import csv
import json
import pathlib

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

import fxtrain as fx
import fxtrain.models
from fxtrain import build, train as runner, validate
from fxtrain.models import MLP
from fxtrain.report import read_jsonl
from tests import _formats
from tests._runner import CONF, cfg_of, isolate, load_checkpoint, run_main, torchrun_train  # noqa: F401 - isolate: autouse

FAST = ["trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=null"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def small_params():
    return fx.functional(MLP((2,), hidden=(3,), num_classes=2))[1]


# --- every config composes and builds ------------------------------------------------------------

def group_cases():
    cases = []
    for group in ("model", "data", "optim/transform", "schedule", "amp", "accumulate", "parallel", "trainer", "logger"):
        cases += [(group, option) for option in options(group)]
    return cases


@pytest.mark.parametrize("group, option", group_cases(), ids=lambda x: x.replace("/", "."))
def test_every_group_option_composes_and_builds(group, option, tmp_path):
    if group == "optim/transform":
        overrides = [f"optim/transform@optim.chain=[{option}]"]
    else:
        overrides = [f"{group}={option}"]
    if (group, option) in (("model", "transformer"), ("model", "moe"), ("data", "stdlib_text")):
        overrides = [f"model={option if group == 'model' else 'transformer'}", "data=stdlib_text", "data.max_bytes=20000"]
    if group == "data" and option in _formats.FORMATS:  # files in a format of fxtrain/sources.py: a generated fixture
        overrides = [*_formats.FORMATS[option](tmp_path / "fixture"), *[o for o in overrides if o != f"data={option}"]]
    cfg = cfg_of(*overrides)

    data = build.dataset(cfg.data) if group == "data" and option in _formats.FORMATS else build.instantiate(cfg.data, "data")
    model = build.model(cfg)
    logits = model(data.test[0][:4] if group == "data" and option in _formats.FORMATS else data.train[0][0])
    assert logits.shape[-1] == cfg.data.get("num_classes", cfg.data.get("vocab_size"))
    from fxtrain.loggers import open_loggers
    open_loggers(cfg.logger, tmp_path).close()  # every logger of the group builds (fxtrain/loggers.py)
    tx = build.stack(cfg)  # one process: every strategy's stack is the plain one (torchrun tests: test_train_parallel.py)
    params = build.cast_params(cfg, small_params())      # half-precision storage for amp=pure_*
    updates, _ = tx.update(fx.tree.map(torch.ones_like, params), tx.init(params), params)
    assert fx.tree.structure(updates) == fx.tree.structure(params)


def test_hydra_settings():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    assert cfg.hydra.job.chdir is False
    assert cfg.hydra.job_logging.formatters.console.format == "%(message)s"     # conf/hydra/job_logging/fxtrain.yaml
    assert cfg.hydra.callbacks.summary._target_ == "fxtrain.report.SweepSummary"


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_builds(experiment):
    cfg = cfg_of(f"experiment={experiment}")
    runner.settle_max_steps(cfg)  # an experiment given in epochs (mnist_port) gets its step count, as a run does
    model = build.model(cfg)
    tx = build.stack(cfg)
    _, params, _ = fx.functional(model)
    tx.init(params)
    assert cfg.optimized_metric in ("val_accuracy", "val_loss")  # selection reads the validation split


def test_hparams_search_needs_the_optuna_extra(capsys):
    assert options("hparams_search") == ["digits_optuna"]
    try:
        import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
    except ImportError:
        pass
    else:
        cfg = cfg_of("hparams_search=digits_optuna")
        assert cfg.optimized_metric == "val_accuracy"
        return
    assert run_main("hparams_search=digits_optuna") == (
        "Error: hparams_search=digits_optuna needs hydra-optuna-sweeper: pip install 'fxtrain[optuna]'")


# --- the chain -------------------------------------------------------------------------------------

def test_chain_order_follows_the_selection():
    cfg = cfg_of("optim/transform@optim.chain=[adamw,clip_by_global_norm]", "schedule=constant")
    assert list(cfg.optim.chain) == ["adamw", "clip_by_global_norm"]
    text = repr(build.stack(cfg))
    assert text.startswith("chain(inject_hyperparams(adamw)(") and text.endswith("clip_by_global_norm(1.0))")
    default = repr(build.stack(cfg_of()))
    assert default.startswith("chain(clip_by_global_norm(1.0), inject_hyperparams(adamw)(")


def test_override_of_a_chain_entry_reaches_the_transform():
    cfg = cfg_of("optim.chain.adamw.b2=0.95", "optim.chain.adamw.learning_rate=0.02", "schedule=constant")
    tx = build.stack(cfg)
    assert "b2=0.95" in repr(tx) and "learning_rate=0.02*constant_schedule(value=1.0)" in repr(tx)
    state = tx.init(small_params())
    hyper = state[1].hyperparams
    assert float(hyper["learning_rate"]) == pytest.approx(0.02) and float(hyper["b2"]) == pytest.approx(0.95)


def test_learning_rate_is_the_peak_of_the_schedule():
    cfg = cfg_of("optim.chain.adamw.learning_rate=0.5", "schedule=linear", "trainer.max_steps=10")
    tx = build.stack(cfg)
    params = small_params()
    state = tx.init(params)
    grads = fx.tree.map(torch.ones_like, params)
    for _ in range(5):
        _, state = tx.update(grads, state, params)
    assert float(state[1].hyperparams["learning_rate"]) == pytest.approx(0.5 * (1 - 4 / 10))


def test_a_key_the_target_does_not_take_names_key_and_transform():
    cfg = cfg_of("+optim.chain.adamw.lerning_rate=0.1")
    with pytest.raises(build.ConfigError, match=r"^optim\.chain\.adamw: lerning_rate is not an argument of "
                       r"fxtrain\.adamw \(did you mean learning_rate\?\); it takes learning_rate, b1, b2"):
        build.stack(cfg)
    with pytest.raises(build.ConfigError, match=r"^model: depth is not an argument of fxtrain.models.MLP"):
        build.model(cfg_of("+model.depth=3"))


def test_unknown_target_lists_what_exists():
    cfg = cfg_of("optim.chain.adamw._target_=fxtrain.adamz")
    with pytest.raises(build.ConfigError, match=r"optim\.chain\.adamw\._target_: fxtrain has no 'adamz' "
                       r"\(did you mean adam\?\); available: adam, .*adamw.* and \d+ more \(see fxtrain's __init__.py\)$"):
        build.stack(cfg)


def test_wrapper_groups_default_to_nothing_and_nest_in_the_recommended_order():
    cfg = cfg_of()
    assert cfg.amp.policy is None and cfg.accumulate.every == 1 and build.parallel_dims(cfg, 1).mesh_dims == ()
    assert repr(build.stack(cfg)).startswith("chain(clip_by_global_norm(1.0), ")
    text = repr(build.stack(cfg_of("amp=bf16", "accumulate=k4")))
    assert text.startswith("accumulate(every=4, amp_cast(policy='p=f32,c=bf16,o=f32', loss_scale=NoLossScale(), "
                           "chain(clip_by_global_norm(1.0), inject_hyperparams(adamw)(")
    # With accumulation the schedule is read at the batch count: its steps mean batches, like max_steps.
    assert "decay_steps=1000, end_value=0.0)@(4*count)" in text
    with pytest.raises(build.ConfigError, match=r"accumulate.every=4: trainer.max_steps=10 is not a multiple of it"):
        validate.check(cfg_of("accumulate=k4", "trainer.max_steps=10"))
    with pytest.raises(build.ConfigError, match=r"^amp: .*f17"):
        build.stack(cfg_of("amp.policy='p=f32,c=f17'"))


# --- bad input at start ------------------------------------------------------------------------------

def test_unknown_override_key_fails_at_start(capsys):
    code = run_main("trainer.max_stepz=3", *FAST)  # was: Hydra's five lines, "Could not override..."
    assert code.startswith("Error: trainer.max_stepz: not a setting fxtrain reads (did you mean trainer.max_steps?)")
    assert "Could not override" not in capsys.readouterr().err
    assert not pathlib.Path("outputs").exists() or not list(pathlib.Path("outputs").rglob("metrics.jsonl"))
    with pytest.raises(ConfigCompositionException, match="max_stepz"):
        cfg_of("trainer.max_stepz=3")


@pytest.mark.parametrize("arg, listed", [
    ("optim/transform@optim.chain=[clip_by_global_norm,adamz]",
     "no transform 'adamz' in optim/transform (did you mean adam?); available: adadelta, adagrad, adam, adamw, "
     "add_decayed_weights, clip, clip_by_global_norm, lion, rmsprop, sgd, trace (pkg://fxtrain.conf)"),
    ("model=mlpp", "no option 'mlpp' in model (did you mean mlp?); available: convnet, mlp, moe, resnet, transformer "
     "(pkg://fxtrain.conf)"),
])
def test_unknown_group_option_lists_the_available_ones(arg, listed):
    assert run_main(arg) == f"Error: {arg}: {listed}"


def test_unknown_optimized_metric_lists_the_metrics(tmp_path):
    cfg = cfg_of("experiment=smoke", "optimized_metric=acc", "trainer.max_steps=3", *FAST)
    with pytest.raises(build.ConfigError, match=r"optimized_metric=acc is not a metric of this run; it has: loss, "
                       r"grad_norm, .*learning_rate.*accuracy, test_loss, test_accuracy"):
        runner.train(cfg, tmp_path)


def test_shard_optimizer_needs_parallel_dp():
    with pytest.raises(build.ConfigError, match=r"^parallel.shard_optimizer=true needs data-parallel replicas alone "
                       r"\(parallel=dp.*but the layout is parallel.pp=1 parallel.dp_replicate=1"):
        build.stack(cfg_of("parallel.shard_optimizer=true"))
    with pytest.raises(build.ConfigError, match=r"^parallel.shard_optimizer=yes: expected true or false"):
        validate.check(cfg_of("parallel=dp", "parallel.shard_optimizer=yes"))
    build.stack(cfg_of("parallel=dp", "parallel.shard_optimizer=true"))  # one process: nothing to shard over


def test_several_ranks_need_a_strategy(monkeypatch):
    monkeypatch.setattr(runner.distributed, "rank_and_world", lambda: (0, 2))
    with pytest.raises(build.ConfigError, match=r"^parallel=none, but 2 processes run this script \(torchrun\): "
                                                r"pick a layout \(parallel=dp"):
        runner.train(cfg_of("experiment=smoke"))


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel=fsdp_tp"], 1, r"^parallel.dp_shard=-1 parallel.tp=2 needs several processes: launch with torchrun "
                              r".*or use parallel=none"),
    (["parallel=fsdp_tp", "parallel.tp=3"], 4, r"^parallel.dp_shard=-1 parallel.tp=3: tp=3 = 3 ranks does not divide "
                                               r"the world of 4"),
    (["parallel=tp", "parallel.dp_replicate=3", "parallel.tp=2"], 4, r"^parallel.dp_replicate=3 parallel.tp=2: "
                                                                     r"dp_replicate=3 x tp=2 = 6 ranks, but the world has 4"),
    (["parallel=dp", "data.batch_size=30"], 4, r"^data.batch_size=30 does not split evenly over the 4 ranks"),
    (["parallel=pp", "parallel.microbatches=3"], 2, r"^parallel.microbatches=3 does not divide the per-rank batch"),
    (["parallel=dp", "parallel.tp=-1"], 2, r"^parallel.dp_replicate=-1 parallel.tp=-1: dp_replicate=-1 and tp=-1: only one"),
])
def test_parallel_sizes_are_checked_against_the_world(overrides, world, message):
    with pytest.raises(build.ConfigError, match=message):
        build.parallel_dims(cfg_of("experiment=smoke", *overrides), world)


@pytest.mark.parametrize("layout,world", [("pp", 2), ("pp_tp", 4), ("pp_fsdp", 4), ("3d", 8), ("fsdp", 2),
                                          ("fsdp_tp", 4), ("hsdp", 4), ("ep_fsdp", 4),
                                          ("ep_tp", 4), ("pp_ep", 4)])
@pytest.mark.parametrize("amp", ["pure_bf16", "pure_fp16"])
def test_half_params_are_refused_where_the_modules_keep_float32(layout, world, amp):
    # matrix: the step computed with the modules' float32 tensors, not the cast copies, and raised at step 1
    with pytest.raises(build.ConfigError) as e:
        build.parallel_dims(cfg_of("experiment=smoke", f"parallel={layout}", f"amp={amp}"), world)
    message = str(e.value)
    assert "\n" not in message and message.startswith("amp.policy=p=") and "use amp=bf16" in message
    assert message.count(f"params are not supported under parallel ") == 1


@pytest.mark.parametrize("layout,world", [("ep", 2), ("dp", 2), ("tp", 2)])
def test_half_params_are_taken_where_the_step_reads_the_cast_tree(layout, world):
    # ep, dp, tp: the functional step computes with the params tree it is given (cast_params' copies); ep_fsdp's,
    # ep_tp's and pp_ep's experts and dense params are FSDP's (fully_shard_experts) and refused above
    build.parallel_dims(cfg_of("experiment=smoke", f"parallel={layout}", "amp=pure_bf16"), world)


def test_a_layout_the_model_cannot_take_is_named_once():
    # outside a Hydra run there is no model option to name (it read "model=?"); the layout is named once
    cfg = cfg_of("experiment=smoke", "parallel=tp")
    with pytest.raises(build.ConfigError) as e:
        runner.build_run(cfg, torch.device("cpu"), runner.distributed.ParallelDims.of(world=2, tp=2))
    assert str(e.value).startswith("parallel tp=2: MLP has no tensor-parallel plan (tp_plan); use model=transformer")


def test_parallel_sizes_resolve_the_rest_of_the_world():
    dims = build.parallel_dims(cfg_of("experiment=smoke", "parallel=fsdp_tp"), 4)
    assert (dims.mesh_dims, dims.data_world) == (("dp_shard", "tp"), 2)
    assert build.parallel_dims(cfg_of("experiment=smoke", "parallel=dp"), 1).mesh_dims == ()  # one rank: plain
    assert build.parallel_dims(cfg_of("experiment=smoke", "parallel=ep"), 2).mesh_dims == ("ep",)


# --- a run ----------------------------------------------------------------------------------------

def test_smoke_run_writes_config_metrics_checkpoint_summary(tmp_path):
    cfg = cfg_of("experiment=smoke", "trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=3",
                 "trainer.checkpoint_every=4", *FAST)
    value = runner.train(cfg, tmp_path)

    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [2, 3, 4, 6]
    for r in lines:
        if r["step"] % 2 == 0:
            assert {"loss", "learning_rate", "grad_norm", "accuracy", "time_s"} <= set(r)
            assert "b1" not in r                        # constant injected hyperparameters stay in config.yaml
    assert {"val_loss", "val_accuracy"} <= set(lines[1]) and "loss" not in lines[1]
    assert {"loss", "val_accuracy"} <= set(lines[-1])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 6
    assert value == summary["value"] == summary["metrics"]["val_accuracy"] == max(r["val_accuracy"] for r in lines
                                                                                 if "val_accuracy" in r)
    assert {"test_loss", "test_accuracy"} <= set(summary["metrics"])  # the test split, once, on the best step
    config = (tmp_path / "config.yaml").read_text()
    assert "decay_steps: 6" in config and "${" not in config           # resolved
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "step_0000004", "step_0000006"]
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "step_0000006", cfg)
    assert ckpt.step == 6 and set(ckpt.params) == {"net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"}


class NanAfter(torch.nn.Module):
    """An MLP whose output turns NaN after `after` training forward passes (a counter buffer)."""

    def __init__(self, input_shape, hidden, num_classes, activation, after=4):
        super().__init__()
        self.net = MLP(input_shape, hidden, num_classes, activation)
        self.after = after
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.calls += 1
        out = self.net(x)
        # Added, not selected with where: where's gradient would be NaN already (0 * NaN) for the other branch.
        return out + torch.where(self.calls > self.after, float("nan"), 0.0)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setattr(fxtrain.models, "NanAfter", NanAfter, raising=False)
    cfg = cfg_of("experiment=smoke", "model._target_=fxtrain.models.NanAfter", "trainer.log_every=1",
                 "trainer.checkpoint_every=2", *FAST)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 5: training stopped\. metrics\.jsonl ends at "
                       r"the last logged finite step and the last good checkpoint is step 4 \(.*checkpoints/step_0000004\)\. "
                       r"With half-precision params \(amp=pure_fp16, pure_bf16\).*prefer amp=fp16 or amp=bf16"):
        runner.train(cfg, tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    ckpt = load_checkpoint(fx.checkpoint.latest(tmp_path / "checkpoints"), cfg)
    assert ckpt.step == 4 and int(ckpt.buffers["calls"]) == 4
    assert all(bool(torch.isfinite(p).all()) for p in ckpt.params.values())
    assert not (tmp_path / "summary.json").exists()


def test_hydra_app_run(capsys):
    assert run_main("experiment=smoke", "trainer.max_steps=3", "hydra.run.dir=run") == 0
    out = capsys.readouterr().out
    assert "stack  chain(clip_by_global_norm(1.0), inject_hyperparams(adamw)(learning_rate=0.01*cosine_decay_schedule(" in out
    assert "done   3 steps in" in out and "test_accuracy" in out
    run = pathlib.Path("run")
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "train.log"} <= {p.name for p in run.iterdir()}
    assert "stack  chain(" in (run / "train.log").read_text()


# --- multirun -----------------------------------------------------------------------------------

def test_multirun_two_jobs_write_directories_and_summary(capsys):
    code = run_main("-m", "experiment=smoke", "seed=1,2", "trainer.max_steps=4")
    assert code == 0
    [sweep] = pathlib.Path("multirun").glob("*/*")                  # the default, timestamped directory
    for job in ("0", "1"):
        assert (sweep / job / "metrics.jsonl").exists() and (sweep / job / "config.yaml").exists()
    rows = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert [(r["job"], r["status"], r["seed"]) for r in rows] == [("0", "completed", "1"), ("1", "completed", "2")]
    assert all(0 <= float(r["test_accuracy"]) <= 1 for r in rows)
    out = capsys.readouterr().out
    assert f"sweep {sweep} (summary.csv):" in out
    assert "job  status     seed  val_accuracy  test_accuracy  test_loss  loss" in out  # chosen by val_accuracy
    assert "every job: experiment=smoke trainer.max_steps=4" in out
    assert "seeds: one configuration, val_accuracy" in out  # two seeds of one configuration (fxtrain.report)


def test_multirun_failing_job_is_reported_and_the_others_finish(capsys):
    code = run_main("-m", "experiment=smoke", "schedule=constant", "optim.chain.adamw.learning_rate=1e30,0.01",
                    "trainer.max_steps=4", "trainer.log_every=1", "hydra.sweep.dir=sweep")
    assert code == 1
    rows = list(csv.DictReader(pathlib.Path("sweep/summary.csv").read_text().splitlines()))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "failed"), ("1", "completed")]
    assert rows[0]["error"].startswith("FloatingPointError: loss is nan at step 2")
    captured = capsys.readouterr()
    assert ("[fxtrain] job 0 failed (experiment=smoke schedule=constant optim.chain.adamw.learning_rate=1e+30 "
            "trainer.max_steps=4 trainer.log_every=1): FloatingPointError: loss is nan at step 2") in captured.err
    assert "not completed: job 0" in captured.out


# --- torchrun -------------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_torchrun_two_ranks_data_parallel(tmp_path):
    args = ["experiment=smoke", "trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=6"]
    stdout, run = torchrun_train(tmp_path, "parallel=dp", *args)    # one summary.json: one run directory
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1                    # one directory, all ranks
    assert stdout.count("stack  chain(clip_by_global_norm(1.0), sharded_apply(") == 1    # rank 0 prints
    assert "[2 ranks, parallel dp_replicate=2]" in stdout
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [2, 4, 6]               # rank 0 writes
    assert (run / "train.log").read_text().count("stack  ") == 1
    # Same numbers as one process on the whole batch (the mean of two half-batch gradients).
    single = runner.train(cfg_of(*args, *FAST), tmp_path / "single")
    dp = json.loads((run / "summary.json").read_text())["metrics"]
    ref = json.loads((tmp_path / "single" / "summary.json").read_text())["metrics"]
    assert abs(dp["test_accuracy"] - single) <= 1 / 128          # at most one of the 128 test examples differs
    for k in ("loss", "test_loss"):
        assert dp[k] == pytest.approx(ref[k], rel=1e-4)


@pytest.mark.multiprocess
def test_torchrun_data_parallel_on_a_users_data_and_task(tmp_path):
    # Any data source (here scikit-learn's make_regression: numpy (X, y)) is split and batched by the runner and
    # each rank takes its half of every global batch: the same numbers as one process, for task=regression.
    args = ["experiment=smoke", "task=regression", "data._target_=sklearn.datasets.make_regression",
            "~data.num_examples", "+data.n_samples=256", "+data.n_features=64", "data.noise=0.1",
            "+data.random_state=0", "data.input_shape=[64]", "data.num_classes=1", "trainer.max_steps=6",
            "trainer.log_every=2", "trainer.eval_every=6"]
    stdout, run = torchrun_train(tmp_path, "parallel=dp", *args)
    assert "data   synthetic: 192 train examples, 64 test, batch 32 (no validation split" in stdout  # named by its data= choice
    assert "task   regression, optimizes val_loss" in stdout
    runner.train(cfg_of(*args, *FAST), tmp_path / "single")
    dp = json.loads((run / "summary.json").read_text())["metrics"]
    ref = json.loads((tmp_path / "single" / "summary.json").read_text())["metrics"]
    assert {"loss", "mae", "test_loss", "test_mae"} <= set(dp)
    for k in ("loss", "mae", "test_loss", "test_mae"):
        assert dp[k] == pytest.approx(ref[k], rel=1e-4)


def state_bytes_line(stdout):
    (line,) = [line for line in stdout.splitlines() if line.startswith("state  ")]
    return int(line.split()[1].replace(",", ""))


@pytest.mark.multiprocess
def test_torchrun_sharded_optimizer_state_matches_plain_dp_with_half_the_state(tmp_path):
    args = ["experiment=smoke", "trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=6", "parallel=dp"]
    plain_out, plain = torchrun_train(tmp_path / "plain", *args)
    zero_out, zero = torchrun_train(tmp_path / "zero", *args, "parallel.shard_optimizer=true")
    assert "sharded_apply(shard_over='dp_replicate', inject_hyperparams(adamw)" in zero_out
    # adamw's mu and nu are split in two; the step count and injected hyperparameters (a few bytes) are not.
    full, half = state_bytes_line(plain_out), state_bytes_line(zero_out)
    assert full / 2 <= half <= full / 2 + 64, (full, half)
    # Same numbers: the gradients are averaged alike, and adamw is elementwise on any slice of the rows.
    ref = read_jsonl(plain / "metrics.jsonl")
    got = read_jsonl(zero / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [2, 4, 6]
    for r, g in zip(ref, got):
        for k in r.keys() - {"time_s"}:
            assert g[k] == pytest.approx(r[k], rel=1e-5, abs=1e-7), (r["step"], k)
    # The checkpoint holds the state as DTensor shards; one process loads it whole (torch.distributed.checkpoint
    # reshards), into the stack it would build itself.
    state = load_checkpoint(zero / "checkpoints" / "step_0000006", cfg_of(*args[:2]))
    assert state.step == 6
    mu = state.opt_state[1].inner_state[0].mu       # chain(clip_by_global_norm, inject_hyperparams(adamw))
    assert {k: v.shape for k, v in mu.items()} == {k: v.shape for k, v in state.params.items()}
    assert all(bool((v != 0).any()) for v in mu.values())     # both halves of every row range were saved


def test_a_run_without_a_progress_bar_formats_no_postfix_for_it(tmp_path, monkeypatch):
    # The loop formatted the bar's postfix (loss, learning rate) after every step even with the bar disabled:
    # about 1% of a small CNN's step (experiments/bench/mnist_port.py, issue 36 item 5).
    import tqdm.std

    calls = []
    monkeypatch.setattr(tqdm.std.tqdm, "set_postfix", lambda self, *args, **kwargs: calls.append(args))
    runner.train(cfg_of("experiment=smoke", "trainer.max_steps=4", "trainer.progress=false"), tmp_path)
    assert calls == []
