"""experiments/: study scripts leave their committed results alone unless asked (``--write``, or ``--out``
naming their directory), and ``make studies``' comparison (experiments/studies.py) on a tiny fake sweep."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
# script -> (its entry point, positional arguments it needs, the committed results it writes)
SCRIPTS = {
    "lr_sweep/analyze.py": ("main", ["no-such-sweep"], ["results.md", "heatmap.png"]),
    "resnet_clip_accumulate/run.py": ("main", [], ["results.md", "loss_curves.png"]),
    "tiny_lm/run.py": ("main", [], ["results.md", "val_loss.png"]),
    "jax_parity/run.py": ("main", [], ["results.md", "loss_curves.png"]),
    "amp/compare.py": ("main", [], ["results.md"]),
    "accumulation/accumulation.py": ("main", [], ["results.md"]),
    "clip_parallel/scale.py": ("main", [], ["results.md", "scale.png"]),
    "clip_parallel/run.py": ("parse", [], ["results_mlp.md"]),
    "strategies/run.py": ("main", [], ["results.md"]),
}


def load(script: str):
    """The study script as a module (its ``if __name__ == "__main__"`` part does not run)."""
    path = EXPERIMENTS / script
    spec = importlib.util.spec_from_file_location("study_" + script.replace("/", "_").removesuffix(".py"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digest(paths) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_study_refuses_to_run_without_being_told_where_to_write(script, capsys):
    entry, positional, results = SCRIPTS[script]
    committed = [EXPERIMENTS / script.split("/")[0] / name for name in results]
    before = digest(committed)
    with pytest.raises(SystemExit) as exit_info:  # before any work: parsing the arguments
        getattr(load(script), entry)(positional)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--out DIR writes a fresh copy" in err and f"--write replaces the committed results in experiments/{script.split('/')[0]}/" in err
    assert digest(committed) == before


def test_write_and_out_elsewhere_conflict(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("jax_parity/run.py").main(["--write", "--out", str(tmp_path)])
    assert "pass one of them" in capsys.readouterr().err


def fake_sweep(root: pathlib.Path) -> pathlib.Path:
    """An lr_sweep-shaped sweep directory: 2 learning rates x 2 seeds, finished, as fxtrain.train writes it."""
    for job, (lr, seed) in enumerate([(lr, seed) for lr in ("0.01", "0.1") for seed in (0, 1)]):
        d = root / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(
            f"- optim.chain.adamw.learning_rate={lr}\n- schedule.warmup_steps=0\n"
            f"- optim.chain.clip_by_global_norm.max_norm=1.0\n- seed={seed}\n")
        accuracy = (0.95 if lr == "0.01" else 0.9) + 0.002 * seed
        (d / "summary.json").write_text(json.dumps({"status": "completed", "optimized_metric": "test_accuracy",
                                                    "metrics": {"test_accuracy": accuracy, "test_loss": 1 - accuracy},
                                                    "step": 300, "time_s": 1.5}))
    return root


def test_studies_compare_a_rerun_with_the_committed_tables(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import studies
    finally:
        sys.path.remove(str(EXPERIMENTS))
    rerun = tmp_path / "rerun"
    load("lr_sweep/analyze.py").main([str(fake_sweep(tmp_path / "sweep")), "--out", str(rerun / "lr_sweep")])
    fresh = (rerun / "lr_sweep" / "results.md").read_text()
    assert "| 0.01 | 0 | 1 | 2 | 0.9510 ± 0.0014 **best** | 0.0490 ± 0.0014 |" in fresh

    assert studies.compare(fresh, fresh) == []
    assert studies.compare(fresh, fresh.replace("0.9510", "0.9511")) == []         # within 1e-4 + 1e-3 x 0.95
    committed = fresh.replace("0.9510 ± 0.0014", "0.9525 ± 0.0014")                 # a digit of one seed off
    assert studies.compare(fresh, committed) == [
        "table 1, row '0.01 | 0 | 1', column 'test_accuracy (mean ± sd)': 0.9510 ± 0.0014 **best** (rerun) vs "
        "0.9525 ± 0.0014 **best** (committed)"]
    assert studies.compare(fresh, fresh.replace(" **best**", "")) != []            # the best moved
    assert studies.compare(fresh.replace("1.5", "9.9"), fresh) == []               # no time column here

    # The command line: --compare-only reads <dir>/<study>/results.md against experiments/<study>/results.md.
    monkeypatch.setattr(studies, "ROOT", tmp_path / "checkout")
    (tmp_path / "checkout" / "experiments" / "lr_sweep").mkdir(parents=True)
    (tmp_path / "checkout" / "experiments" / "lr_sweep" / "results.md").write_text(committed)
    assert studies.main(["--only", "lr_sweep", "--compare-only", str(rerun)]) == 1
    assert "lr_sweep: 1 differences from the committed results" in capsys.readouterr().out
    (tmp_path / "checkout" / "experiments" / "lr_sweep" / "results.md").write_text(fresh)
    assert studies.main(["--only", "lr_sweep", "--compare-only", str(rerun)]) == 0
    assert "lr_sweep: reproduces the committed results" in capsys.readouterr().out
