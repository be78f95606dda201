"""fxtrain.report: rows from job directories, the table, summary.csv, the plot and the command."""

import csv
import json

import pytest

from fxtrain import report
from tests._runner import isolate, run_main  # noqa: F401 - isolate: autouse (cwd, Hydra's state, logging)


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


# --- the plot ----------------------------------------------------------------------------------------

def grid_sweep(root, grid, steps=60, fail=(), first=0):
    """A sweep over every combination of ``grid`` (key -> values), as fxtrain writes it. The loss falls
    faster with a larger learning rate, later with a longer warmup, to a floor that a large learning rate
    raises and clipping lowers; test accuracy every 10 steps. Jobs are numbered from ``first``; those in
    ``fail`` end in NaN at step 20."""
    import itertools
    import math
    import random

    for job, values in enumerate(itertools.product(*grid.values()), first):
        o = dict(zip(grid, values))
        rng = random.Random(job)
        lr, warmup = float(o.get("optim.chain.adamw.learning_rate", 0.003)), int(o.get("warmup", 0))
        floor = 0.02 + lr * (0.3 if o.get("clip", "none") != "none" else 1.0)
        curve = []
        for s in range(1, (20 if job in fail else steps) + 1):
            loss = 2.3 * math.exp(-0.3 * lr ** 0.5 * max(0, s - warmup / 2)) + floor
            r = {"step": s, "loss": loss * (1 + (0.05 + 0.3 * lr) * rng.random()), "learning_rate": lr}
            if s % 10 == 0:
                r["test_accuracy"] = 1 / (1 + loss) - 0.01 * rng.random()
            curve.append(r)
        if job in fail:
            curve[-1]["loss"] = float("nan")
            summary = {"status": "failed", "error": "FloatingPointError: loss is nan", "optimized_metric": "test_accuracy"}
        else:
            summary = completed(curve[-1]["test_accuracy"], curve[-1]["loss"])
        make_job(root, str(job), ["data=digits", *(f"{k}={v}" for k, v in o.items())], summary, curve)
    return root


GRID36 = {"optim.chain.adamw.learning_rate": ["1e-3", "3e-3", "3e-2"], "warmup": [0, 10, 50],
          "clip": ["none", "1.0"], "seed": [0, 1]}


def job_lines(ax):
    return {line.get_gid(): line for line in ax.get_lines() if str(line.get_gid()).startswith("job ")}


def overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_many_jobs_colours_by_value(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import BoundaryNorm, LogNorm, Normalize

    # 3 learning rates x 3 warmups x 2 clips x 2 seeds, and a job at a 4th learning rate that fails.
    sweep = grid_sweep(tmp_path, GRID36)
    grid_sweep(sweep, {k: v[-1:] for k, v in GRID36.items()} | {"optim.chain.adamw.learning_rate": ["1.0"]},
               fail={36}, first=36)
    rows = report.collect(sweep)
    jobs = {f"job {r['job']}" for r in rows}
    assert len(jobs) == 37
    fig = report.figure(sweep)
    fig.draw_without_rendering()
    assert not fig.legends and not any(ax.get_legend() for ax in fig.axes)  # colours say the value, not a legend
    panels, bars = fig.axes[:9], fig.axes[9:]
    # A row per varied key but seed (its spread shows as repeated points); its colorbar says the values.
    assert [ax.get_xlabel() for ax in panels[2::3]] == ["learning_rate", "warmup", "clip"]
    assert [bar.get_ylabel() for bar in bars] == ["learning_rate", "warmup", "clip"]
    lr_bar, warmup_bar, clip_bar = (bar._colorbar for bar in bars)
    assert isinstance(lr_bar.norm, LogNorm) and type(warmup_bar.norm) is Normalize   # 1e-3..1 spans decades
    assert isinstance(clip_bar.norm, BoundaryNorm)                                    # words: a colour each
    assert [t.get_text() for t in clip_bar.ax.get_yticklabels()] == ["1.0", "none"]
    # Seeds repeat each configuration: the best is the configuration with the best mean, all its seeds black.
    best = report.by_config(rows, "test_accuracy", list(GRID36))[0]
    best_jobs = {f"job {r['job']}" for r in best["jobs"]}
    assert len(best_jobs) == 2
    for row_axes in zip(panels[0::3], panels[1::3]):
        for ax in row_axes:
            lines = job_lines(ax)
            assert set(lines) == jobs                                          # every job's curve is drawn
            tops = [lines.pop(j) for j in best_jobs]
            assert all(t.get_color() == "black" and t.get_linewidth() > max(l.get_linewidth() for l in lines.values())
                       for t in tops)
            assert lines["job 36"].get_linestyle() == "--"                     # the failed one: dashed grey
            assert {l.get_linestyle() for k, l in lines.items() if k != "job 36"} == {"-"}
        assert row_axes[0].get_yscale() == "log"
    # Colours follow the value: jobs differing only in seed share a colour in the learning-rate row.
    lr_lines = job_lines(panels[0])
    assert lr_lines["job 0"].get_color() == lr_lines["job 1"].get_color() != lr_lines["job 12"].get_color()
    finals = job_lines(panels[2])
    assert len(finals) == 37 and all(finals[j].get_marker() == "*" for j in best_jobs)
    assert finals["job 36"].get_marker() == "x"
    title = fig._suptitle.get_text()
    assert f"{sweep}: 37 jobs (1 failed: grey, dashed)" in title and "every job: data=digits" in title
    label = " ".join(f"{k.split('.')[-1]}={best[k]}" for k in GRID36 if k != "seed")
    assert f"best (black): {label}, test_accuracy {report._pm(best)}" in title


def test_plot_eight_jobs_has_no_legend_over_the_panels(tmp_path):
    pytest.importorskip("matplotlib")
    sweep = grid_sweep(tmp_path, {"optim.chain.adamw.learning_rate": ["1e-3", "3e-3"], "warmup": [0, 10],
                                  "seed": [0, 1]})
    fig = report.figure(sweep)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    assert not any(overlaps(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])  # panels, colorbars apart
    assert all(len(job_lines(ax)) == 8 for ax in fig.axes[:6])
    assert not fig.legends
    fig_box = fig.bbox
    assert all(fig_box.x0 <= b.x0 and b.x1 <= fig_box.x1 for b in boxes)                # nothing cut off


def test_plot_few_jobs_legend_beside_the_panels(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    fig = report.figure(sweep)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == ["seed=1 learning_rate=0.001", "seed=1 learning_rate=0.003 (best)",
                     "seed=2 learning_rate=0.001 (incomplete)", "seed=2 learning_rate=inf (failed)"]  # logged nothing
    box = legend.get_window_extent(renderer)
    others = [ax.get_tightbbox(renderer) for ax in fig.axes] + [fig._suptitle.get_window_extent(renderer)]
    assert not any(overlaps(box, other) for other in others)
    assert box.x1 <= fig.bbox.x1
    title = fig._suptitle.get_text()
    assert "4 jobs (1 failed, 1 incomplete: grey, dashed)" in title.replace("\n", " ")
    # One job: no legend, the title says what it ran.
    one = tmp_path / "one"
    grid_sweep(one, {"seed": [0]})
    fig = report.figure(one)
    assert not fig.legends and [len(ax.get_lines()) for ax in fig.axes] == [1, 1]
    assert report.plot(one, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_best_is_the_lowest_error_and_the_highest_accuracy():
    # A task may declare any metric (fxtrain/tasks.py's example: test_mae): an error ranks lowest-first.
    rows = [{"job": j, "status": "completed", "test_mae": v, "test_rmse": v, "test_ppl": v, "val_error_rate": v,
             "test_accuracy": v, "test_within_half": v} for j, v in enumerate([0.3, 0.1, 0.2])]
    for metric in ("test_mae", "test_rmse", "test_ppl", "val_error_rate"):
        assert report.best(rows, metric)["job"] == 1, metric
    for metric in ("test_accuracy", "test_within_half"):
        assert report.best(rows, metric)["job"] == 0, metric


# --- the metric a task declares ranks every sweep -------------------------------------------------

def accuracy_task():
    """A task built by a ``_target_`` function of the user's: it declares test_accuracy, its config cannot."""
    from fxtrain import tasks

    base = tasks.classification()
    return tasks.Task(base.loss, base.metrics, optimized_metric="test_accuracy", name="mine")


@pytest.mark.parametrize("launcher", ["basic", "vmap"])
def test_the_metric_a_task_function_declares_ranks_the_sweep(launcher, tmp_path, monkeypatch, capsys):
    # The header said "optimizes test_accuracy" while summary.json's value, the sweep's best: line and the plot
    # ranked by test_loss (conf/train.yaml's optimized_metric reads only the task config's key).
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "mine.yaml").write_text("_target_: tests.test_report.accuracy_task\n")
    monkeypatch.chdir(tmp_path)
    assert run_main("-m", "--config-dir", "conf", "task=mine", "seed=0,1,2", f"hydra/launcher={launcher}",
                    "experiment=smoke", "trainer.max_steps=4", "trainer.cpu_threads=1", "hydra.sweep.dir=sweep") == 0
    rows = report.collect("sweep")
    for job in ("0", "1", "2"):
        summary = json.loads((tmp_path / "sweep" / job / "summary.json").read_text())
        assert summary["optimized_metric"] == "test_accuracy"
        assert summary["value"] == summary["metrics"]["test_accuracy"]
        assert "task   mine, optimizes test_accuracy" in (tmp_path / "sweep" / job / "train.log").read_text()
    top = max(rows, key=lambda r: (r["test_accuracy"], -r["test_loss"]))  # highest accuracy; ties: lowest test_loss
    assert report.best(rows, "test_accuracy") == top
    # Three seeds of one configuration: nothing to choose between, their mean +- std by the declared metric's
    # validation form (issue 35: the test split is shown, never what ranks).
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("best: ", "seeds: "))]
    assert printed == [line for line in report.describe("sweep").splitlines() if line.startswith(("best: ", "seeds: "))]
    assert printed == [f"seeds: one configuration, val_accuracy {report._pm(report.by_config(rows, 'val_accuracy', ['seed'])[0])}"]
    assert "seeds of one configuration: val_accuracy" in report.figure("sweep")._suptitle.get_text()
    assert "ranked by val_accuracy: test_accuracy is the test split's" in report.describe("sweep")


# --- seeds: jobs that differ only in a seed key are repeats of one configuration -------------------------

SEEDED = {  # (learning_rate, seed) -> final test_accuracy: 0.1's luckiest seed beats every 0.3 job
    ("0.1", "1"): 0.95, ("0.1", "2"): 0.70, ("0.1", "3"): 0.72,
    ("0.3", "1"): 0.86, ("0.3", "2"): 0.84, ("0.3", "3"): 0.85,
}


@pytest.fixture
def seeded(tmp_path):
    for job, ((lr, seed), acc) in enumerate(SEEDED.items()):
        curve = [{"step": s, "loss": 1.0 / s, "test_accuracy": acc - 0.1 / s} for s in (1, 5, 10)]
        make_job(tmp_path, str(job), [f"optim.chain.adamw.learning_rate={lr}", f"seed={seed}"],
                 completed(acc, 1.0 - acc if lr == "0.1" else 0.5), curve)
    return tmp_path


def test_seeds_group_into_configurations_ranked_by_mean(seeded):
    rows = report.collect(seeded)
    assert report.best(rows, "test_accuracy")["job"] == "0"         # the luckiest job is lr=0.1's seed 1
    groups = report.by_config(rows, "test_accuracy", ["optim.chain.adamw.learning_rate", "seed"])
    assert [g["optim.chain.adamw.learning_rate"] for g in groups] == ["0.3", "0.1"]
    assert [g["n"] for g in groups] == [3, 3]
    assert groups[0]["mean"] == pytest.approx(0.85) and groups[0]["std"] == pytest.approx(0.01)
    assert groups[1]["mean"] == pytest.approx(0.79) and groups[1]["std"] == pytest.approx(0.1389, abs=1e-4)
    text = report.describe(seeded)
    assert "by configuration (test_accuracy over seed, best first):" in text
    assert "best: optim.chain.adamw.learning_rate=0.3 (test_accuracy 0.85 +- 0.01, n=3)" in text
    assert "best: job" not in text
    table = text.split("by configuration")[1].splitlines()[1:]
    assert table[0].split() == ["optim.chain.adamw.learning_rate", "test_accuracy", "mean", "std", "n", "jobs"]
    assert table[2].split()[:4] == ["0.3", "0.85", "0.01", "3"] and table[2].split()[4:] == ["3", "4", "5"]


def test_metric_changes_the_best_line_too(seeded, capsys):
    # test_loss: lr=0.1's seeds have 0.10, 0.60, 0.56 (mean 0.42), lr=0.3's 1.0 each: 0.1 is best by loss.
    assert "best: optim.chain.adamw.learning_rate=0.1 (test_loss 0.42 +- 0.2778, n=3)" in report.describe(seeded, "test_loss")
    report.main([str(seeded), "--metric", "test_loss", "--no-plot"])
    assert "best: optim.chain.adamw.learning_rate=0.1 (test_loss" in capsys.readouterr().out


def test_seed_keys_name_what_repeats(seeded, capsys):
    # With no seed keys every job is its own configuration, and the best is the luckiest job.
    report.main([str(seeded), "--seed-keys", "data.seed", "--no-plot"])
    out = capsys.readouterr().out
    assert "by configuration" not in out and "best: job 0 (test_accuracy 0.95)" in out


def test_plot_of_seeds_shows_mean_and_std_per_value(seeded):
    pytest.importorskip("matplotlib")
    fig = report.figure(seeded)
    panels = fig.axes[:3]                                               # one row: learning_rate (seed left out)
    assert panels[2].get_xlabel() == "learning_rate"
    bars = [c for c in panels[2].containers]                            # errorbar containers: one per value
    assert len(bars) == 2
    means = sorted(bar.lines[0].get_ydata()[0] for bar in bars)
    assert means == pytest.approx([0.79, 0.85])
    lines = job_lines(panels[1])
    assert {k for k, l in lines.items() if l.get_color() == "black"} == {"job 3", "job 4", "job 5"}  # best config's seeds
    assert "best (black): learning_rate=0.3, test_accuracy 0.85 +- 0.01, n=3" in fig._suptitle.get_text()


# --- a task's declared metrics (issue 35): every val_*/test_* a column, ranked by validation --------------------

def test_every_declared_metric_gets_its_val_and_test_columns_ranked_by_validation(tmp_path):
    """Before: summary.csv kept a fixed list (val_accuracy, test_accuracy, test_loss, loss, accuracy, val_loss):
    a custom task's test_mae and test_max_err were missing, and --metric=test_mae ranked by the test split."""
    sweep = tmp_path / "sweep"
    for job, (val, test) in enumerate([(0.3, 0.1), (0.2, 0.4)]):  # job 1 is better on validation, worse on test
        make_job(sweep, str(job), [f"optim.chain.adamw.learning_rate=0.{job + 1}"], {
            "status": "completed", "step": 10, "optimized_metric": "val_loss",
            "metrics": {"val_loss": 1.0 + job, "test_loss": 1.0, "loss": 1.0, "val_mae": val, "test_mae": test,
                        "mae": 0.5, "val_max_err": 2.0, "test_max_err": 3.0, "max_err": 1.0, "grad_norm": 0.1}})
    report.write_csv(report.collect(sweep), sweep / "summary.csv")
    with open(sweep / "summary.csv") as f:
        header = next(csv.reader(f))
    assert header == ["job", "status", "optim.chain.adamw.learning_rate", "val_loss", "test_loss", "loss", "val_mae", "test_mae", "mae",
                      "val_max_err", "test_max_err", "max_err", "step"]
    text = report.describe(sweep, metric="test_mae")
    assert "ranked by val_mae: test_mae is the test split's" in text
    assert "best: job 1 (val_mae 0.2): optim.chain.adamw.learning_rate=0.2" in text  # job 0 has the better test_mae
