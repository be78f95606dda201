"""The logger group: each logger writes what its own library reads back; open_loggers always keeps the record."""

import csv
import json
import math
import os
import struct
import sys

import pytest
from omegaconf import OmegaConf

from fxtrain import build, loggers
from fxtrain import train as runner
from fxtrain.loggers import CsvLogger, JsonlLogger, Loggers, TensorBoardLogger, open_loggers
from fxtrain.report import read_jsonl
from tests._runner import CONF, cfg_of, isolate  # noqa: F401 - isolate: autouse

NAN = float("nan")


def node(*names):
    """cfg.logger for ``names``, from conf/logger/<name>.yaml (each file holds its own named entry)."""
    return OmegaConf.merge(*(OmegaConf.load(CONF / "logger" / f"{name}.yaml") for name in names))


def read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


# --- open_loggers: the record, the group, closing --------------------------------------------------------

@pytest.mark.parametrize("names", [None, [], ["csv"], ["jsonl", "csv"], ["csv", "jsonl"]], ids=str)
def test_open_loggers_always_writes_the_record_once(names, tmp_path):
    with open_loggers(node(*names) if names else names, tmp_path) as group:
        group.log(1, {"loss": 2.0})
        group.log(2, {"loss": NAN, "test_loss": 1.5})
    writers = [name for name, logger in group.loggers.items() if isinstance(logger, JsonlLogger)]
    assert writers == [next(iter(group.loggers))]  # one, and first: it has the line if another logger fails
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and math.isnan(records[1]["loss"])


def test_compose_the_group_and_open_it(tmp_path):
    """'logger=[...]' picks several files of conf/logger; the composed node opens as is."""
    assert list(cfg_of("logger=[csv]").logger) == ["csv"]
    assert list(cfg_of("logger=csv").logger) == ["csv"]
    assert "logger" not in cfg_of("logger=[]")
    cfg = cfg_of("logger=[jsonl,tensorboard,csv]")
    assert list(cfg.logger) == ["jsonl", "tensorboard", "csv"]
    with open_loggers(cfg.logger, tmp_path, start=0, config=OmegaConf.to_container(cfg, resolve=True)) as group:
        group.log(1, {"loss": 1.0})
    assert repr(group) == "Loggers(jsonl, tensorboard, csv)"
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.csv").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


class Mine:
    """A user's logger: built with its config keys and dir, start, config."""

    def __init__(self, dir, every, start, config):
        self.every, self.start, self.config, self.logged = every, start, config, []

    def log(self, step, metrics):
        self.logged.append(step)

    def close(self):
        pass


def test_your_own_logger_class(tmp_path):
    cfg = cfg_of("logger=[csv]", "+logger.mine._target_=tests.test_loggers.Mine", "+logger.mine.every=2")
    with open_loggers(cfg.logger, tmp_path, start=3, config={"seed": 0}) as group:
        group.log(4, {"loss": 1.0})
    mine = group.loggers["mine"]
    assert (mine.every, mine.start, mine.config, mine.logged) == (2, 3, {"seed": 0}, [4])
    with pytest.raises(build.ConfigError, match=r"^logger.mine: tests.test_loggers.Mine needs every; "
                                                r"add logger.mine.every=\.\.\.$"):
        open_loggers({"mine": {"_target_": "tests.test_loggers.Mine"}}, tmp_path)


def test_a_logger_that_fails_to_build_closes_the_others(tmp_path, monkeypatch):
    closed, close = [], CsvLogger.close
    monkeypatch.setattr(CsvLogger, "close", lambda self: (closed.append(self.path.name), close(self)))
    bad = OmegaConf.merge(node("csv"), {"tb": {"_target_": "fxtrain.loggers.TensorBoardLogger", "sub_dir": "x"}})
    with pytest.raises(build.ConfigError, match=r"^logger.tb: sub_dir is not an argument of "
                                                r"fxtrain.loggers.TensorBoardLogger \(did you mean subdir\?\)"):
        open_loggers(bad, tmp_path)
    assert closed == ["metrics.csv"]
    with pytest.raises(build.ConfigError, match=r"^logger: expected named loggers .* put it under a name"):
        open_loggers({"_target_": "fxtrain.loggers.JsonlLogger"}, tmp_path)  # a config from before the group


def test_close_closes_every_logger_when_one_raises(tmp_path):
    class Failing:
        def log(self, step, metrics):
            pass

        def close(self):
            raise OSError("disk gone")

    first, last = JsonlLogger(tmp_path), CsvLogger(tmp_path)
    with pytest.raises(OSError, match="disk gone"):
        with Loggers({"jsonl": first, "failing": Failing(), "csv": last}):
            pass
    assert first._file.closed and last._file.closed


@pytest.mark.parametrize("name, extra", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_package_names_the_extra(name, extra, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # what `import name` meets when it is not installed
    with pytest.raises(build.ConfigError) as e:
        open_loggers(node("jsonl", name), tmp_path)
    assert str(e.value) == f"logger={name} needs {name}: pip install 'fxtrain[{extra}]'"


# --- each logger, read back by its own library -----------------------------------------------------------

def test_csv_widens_on_a_new_metric_and_cuts_on_resume(tmp_path):
    with CsvLogger(tmp_path) as logger:
        logger.log(1, {"loss": 3.0, "learning_rate": 0.1})
        logger.log(2, {"loss": 2.0, "learning_rate": 0.1, "test_loss": 2.5})  # the eval metrics join later
        logger.log(3, {"loss": NAN, "learning_rate": 0.1})
        logger.log(4, {"loss": 1.0, "learning_rate": 0.1})
    columns, rows = read_csv(tmp_path / "metrics.csv")
    assert columns == ["step", "loss", "learning_rate", "test_loss"]
    assert [r["test_loss"] for r in rows] == ["", "2.5", "", ""]
    assert math.isnan(float(rows[2]["loss"])) and float(rows[3]["loss"]) == 1.0
    assert not list(tmp_path.glob(".*.tmp"))

    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("5,0.")  # a killed run's half-written line
    with CsvLogger(tmp_path, start=2) as logger:  # resumed from step 2's checkpoint
        logger.log(3, {"loss": 1.5, "learning_rate": 0.1, "grad_norm": 0.5})
    columns, rows = read_csv(tmp_path / "metrics.csv")
    assert columns == ["step", "loss", "learning_rate", "test_loss", "grad_norm"]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == [("1", "3.0", ""), ("2", "2.0", ""),
                                                                      ("3", "1.5", "0.5")]


def test_tensorboard_events_read_by_tensorboard_and_resume_without_duplicates(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(tag):
        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars(tag)]

    with TensorBoardLogger(tmp_path) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": 1.0 / step, **({"test_loss": 2.0 * step} if step % 2 == 0 else {})})
        assert scalars("loss") == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25)]  # flushed at each log
    assert scalars("test_loss") == [(2, 4.0), (4, 8.0)]

    with TensorBoardLogger(tmp_path, start=2) as logger:  # killed after step 4, resumed from step 2's checkpoint
        logger.log(3, {"loss": 9.0, "grad_norm": NAN})
    assert scalars("loss") == [(1, 1.0), (2, 0.5), (3, 9.0)]
    assert scalars("test_loss") == [(2, 4.0)]
    assert [(s, math.isnan(v)) for s, v in scalars("grad_norm")] == [(3, True)]


def wandb_records(path):
    """The records of a ``run-<id>.wandb`` file, parsed with wandb's own protobuf ``Record``.

    The file is wandb's LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def test_wandb_offline_run_holds_the_history_and_config(tmp_path):
    config = {"optim": {"chain": {"adamw": {"learning_rate": 0.003}}}, "seed": 0}
    with open_loggers(node("wandb"), tmp_path, config=config) as group:
        group.log(1, {"loss": 2.0, "learning_rate": 0.003})
        group.log(2, {"loss": NAN, "test_accuracy": 0.5})
    import wandb

    wandb.teardown()  # finish() returns before wandb-core (its own process) has written the file: wait for it
    run = group.loggers["wandb"].run
    assert run.settings.mode == "offline" and group.loggers["wandb"].path.parent == tmp_path / "wandb"
    (path,) = group.loggers["wandb"].path.glob("run-*.wandb")
    records = list(wandb_records(path))
    history = [{name: json.loads(item.value_json) for item in r.history.item
                if not (name := item.key or ".".join(item.nested_key)).startswith("_")}  # _step, _runtime...
               for r in records if r.HasField("history")]
    assert [r.history.step.num for r in records if r.HasField("history")] == [1, 2]
    assert history[0] == {"loss": 2.0, "learning_rate": 0.003}
    assert history[1]["test_accuracy"] == 0.5 and math.isnan(history[1]["loss"])
    (run_record,) = [r.run for r in records if r.HasField("run")]
    logged = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert logged["optim"] == config["optim"] and logged["seed"] == 0
    assert run_record.display_name == str(tmp_path)


def test_mlflow_store_read_back_by_mlflow_without_environment(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3.14+ refuses a file: store without it

    config = {"optim": {"chain": {"adamw": {"learning_rate": 0.003, "b1": 0.9}}}, "resume": None, "data": {}}
    with open_loggers(node("mlflow"), tmp_path, config=config) as group:
        for step in (1, 2, 3):
            group.log(step, {"loss": 1.0 / step, "grad_norm": NAN if step == 3 else 1.0})
    logger = group.loggers["mlflow"]
    assert logger.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(logger.tracking_uri)  # MLflow's own client, as a user opens it: no environment
    loss = client.get_metric_history(logger.run_id, "loss")
    grad_norm = client.get_metric_history(logger.run_id, "grad_norm")
    run = client.get_run(logger.run_id)
    assert [(m.step, m.value) for m in loss] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert math.isnan(grad_norm[-1].value)
    assert run.data.params == {"optim.chain.adamw.learning_rate": "0.003", "optim.chain.adamw.b1": "0.9",
                               "resume": "null", "data": "{}"}
    assert run.info.status == "FINISHED" and run.info.run_name == str(tmp_path)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ


# --- the runner ---------------------------------------------------------------------------------------------

def test_a_run_writes_every_logger_of_the_list(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = cfg_of("data=synthetic", "trainer.max_steps=6", "trainer.eval_every=3", "logger=[jsonl,tensorboard,csv]",
                 "trainer.progress=false", "trainer.device=cpu", "trainer.cpu_threads=null")
    runner.train(cfg, tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    columns, rows = read_csv(tmp_path / "run" / "metrics.csv")
    assert set(columns) == {"step", *(k for r in records for k in r)}
    assert [{k: float(v) for k, v in row.items() if v} for row in rows] == records  # the same numbers
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [
        (r["step"], pytest.approx(r["val_loss"])) for r in records if "val_loss" in r]
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in records]


# --- the end-of-run test metrics reach every logger -------------------------------------------------------

def test_a_log_at_the_last_step_joins_its_line(tmp_path):
    with open_loggers(node("jsonl", "csv"), tmp_path) as group:
        group.log(1, {"loss": 2.0})
        group.log(2, {"loss": 1.0, "val_loss": 1.5})
        group.log(2, {"test_loss": 1.25})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0},
                                                      {"step": 2, "loss": 1.0, "val_loss": 1.5, "test_loss": 1.25}]
    columns, rows = read_csv(tmp_path / "metrics.csv")
    assert columns == ["step", "loss", "val_loss", "test_loss"]
    assert rows == [{"step": "1", "loss": "2.0", "val_loss": "", "test_loss": ""},
                    {"step": "2", "loss": "1.0", "val_loss": "1.5", "test_loss": "1.25"}]
    # reopened at that step (a run killed after its last step, before its summary, resumes there and tests again)
    with open_loggers(node("jsonl", "csv"), tmp_path, start=2) as group:
        group.log(2, {"test_loss": 1.25, "test_accuracy": 0.5})
    assert read_jsonl(tmp_path / "metrics.jsonl")[1:] == [{"step": 2, "loss": 1.0, "val_loss": 1.5, "test_loss": 1.25,
                                                           "test_accuracy": 0.5}]
    assert [r["step"] for r in read_csv(tmp_path / "metrics.csv")[1]] == ["1", "2"]
    assert not list(tmp_path.glob(".*.tmp"))


def logged_test_metrics(name, run):
    """``{metric: [(step, value)]}`` of the test_* metrics that logger ``name`` wrote in ``run``, read back by its own
    library (or as the file it writes)."""
    if name == "jsonl":
        return {k: [(r["step"], v)] for r in read_jsonl(run / "metrics.jsonl") for k, v in r.items()
                if k.startswith("test_")}
    if name == "csv":
        _, rows = read_csv(run / "metrics.csv")
        return {k: [(int(r["step"]), float(v))] for r in rows for k, v in r.items() if k.startswith("test_") and v}
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        return {k: [(e.step, e.value) for e in events.Scalars(k)] for k in events.Tags()["scalars"]
                if k.startswith("test_")}
    if name == "mlflow":
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
        (found,) = client.search_runs([client.get_experiment_by_name("fxtrain").experiment_id])
        return {k: [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, k)]
                for k in found.data.metrics if k.startswith("test_")}
    import wandb

    wandb.teardown()  # wandb-core writes the file after finish() returns
    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    out = {}
    for record in wandb_records(path):
        if record.HasField("history"):
            for item in record.history.item:
                if (key := item.key or ".".join(item.nested_key)).startswith("test_"):
                    out.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return out


@pytest.mark.parametrize("name", ["jsonl", "csv", "tensorboard", "mlflow", "wandb"])
def test_every_logger_records_the_end_of_run_test_metrics_at_the_last_step(name, tmp_path):
    cfg = cfg_of("data=synthetic", "data.num_examples=256", "model.hidden=[16]", "trainer.max_steps=6",
                 "trainer.eval_every=2", f"logger=[{name}]", "trainer.progress=false", "trainer.device=cpu")
    runner.train(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    tested = {k: v for k, v in summary["metrics"].items() if k.startswith("test_")}
    assert set(tested) == {"test_loss", "test_accuracy"} and summary["step"] == 6
    assert logged_test_metrics(name, tmp_path / "run") == {  # logged once, at the run's last step
        k: [(6, pytest.approx(v, rel=1e-6))] for k, v in tested.items()}


def test_an_early_stopped_run_logs_its_test_metrics_at_the_step_it_stopped(tmp_path):
    cfg = cfg_of("data=synthetic", "data.num_examples=256", "model.hidden=[16]", "trainer.max_steps=40",
                 "trainer.log_every=2", "trainer.eval_every=2", "trainer.early_stopping.metric=loss",
                 "trainer.early_stopping.patience=1", "trainer.early_stopping.min_delta=10", "logger=[jsonl,csv]",
                 "trainer.progress=false", "trainer.device=cpu")
    runner.train(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = summary["stopped_early"]["step"]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert stopped < 40 and records[-1]["step"] == stopped
    assert records[-1]["test_accuracy"] == summary["metrics"]["test_accuracy"]
    assert logged_test_metrics("csv", tmp_path)["test_accuracy"] == [(stopped, summary["metrics"]["test_accuracy"])]
