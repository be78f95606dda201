"""fxtrain.report: rows from job directories, the table, summary.csv, the plot and the command."""

import csv
import json

import pytest

from fxtrain import report


def make_job(sweep, job, overrides, summary, curve=()):
    d = sweep / job
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curve))
    return d


def completed(acc, loss):
    return {"status": "completed", "step": 10, "time_s": 1.5, "optimized_metric": "test_accuracy", "value": acc,
            "metrics": {"loss": loss, "learning_rate": 0.0, "test_loss": loss * 2, "test_accuracy": acc}}


@pytest.fixture
def sweep(tmp_path):
    curve = [{"step": s, "loss": 1.0 / s, "test_accuracy": 0.5 + s / 40} for s in (1, 5, 10)]
    make_job(tmp_path, "0", ["seed=1", "optim.chain.adamw.learning_rate=0.001", "data=digits"], completed(0.91, 0.2), curve)
    make_job(tmp_path, "1", ["seed=1", "optim.chain.adamw.learning_rate=0.003", "data=digits"], completed(0.95, 0.1), curve)
    make_job(tmp_path, "10", ["seed=2", "optim.chain.adamw.learning_rate=inf", "data=digits"],
             {"status": "failed", "error": "FloatingPointError: loss is nan at step 2: " + "x" * 100})
    make_job(tmp_path, "2", ["seed=2", "optim.chain.adamw.learning_rate=0.001", "data=digits"], None)   # running
    (tmp_path / "multirun.yaml").write_text("{}")
    return tmp_path


def test_collect_rows_in_job_order(sweep):
    rows = report.collect(sweep)
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]
    assert [r["status"] for r in rows] == ["completed", "completed", "incomplete", "failed"]
    assert rows[1] == {"job": "1", "status": "completed", "seed": "1", "optim.chain.adamw.learning_rate": "0.003",
                       "data": "digits", "test_accuracy": 0.95, "test_loss": 0.2, "loss": 0.1, "step": 10, "time_s": 1.5}
    assert report.best(rows, "test_accuracy")["job"] == "1"
    assert report.best(rows, "test_loss")["job"] == "1"


def test_table_and_csv(sweep, tmp_path):
    rows = report.collect(sweep)
    table = report.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["job", "status", "seed", "optim.chain.adamw.learning_rate", "data", "test_accuracy",
                                "test_loss", "loss", "step", "time_s", "error"]
    assert lines[3].split()[:6] == ["1", "completed", "1", "0.003", "digits", "0.95"]
    assert lines[-1].endswith("...") and len(lines[-1].split("FloatingPointError")[1]) < 80   # shortened
    path = report.write_csv(rows, tmp_path / "s.csv")
    back = list(csv.DictReader(path.read_text().splitlines()))
    assert back[3]["error"].endswith("x" * 100)                                               # full in the CSV
    text = report.describe(sweep)
    # The printed table leaves out what every job shares, and says it once.
    assert text.splitlines()[0].split()[:5] == ["job", "status", "seed", "optim.chain.adamw.learning_rate", "test_accuracy"]
    assert "\nevery job: data=digits\n" in text
    assert "best: job 1 (test_accuracy 0.95): seed=1 optim.chain.adamw.learning_rate=0.003" in text
    assert "not completed: job 2, 10" in text


def test_single_run_directory(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(completed(0.9, 0.3)))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    rows = report.collect(tmp_path)
    assert len(rows) == 1 and rows[0]["test_accuracy"] == 0.9


def test_command_prints_the_table_and_plots(sweep, capsys):
    pytest.importorskip("matplotlib")
    report.main([str(sweep)])
    out = capsys.readouterr().out
    assert out.startswith("job  status") and f"curves: {sweep / 'curves.png'}" in out
    assert (sweep / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_command_rejects_a_missing_directory(tmp_path, capsys):
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "nope")])
    assert "is not a directory" in capsys.readouterr().err


def test_format_empty():
    assert report.format_table([]) == "(no jobs)"
