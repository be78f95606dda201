"""The installed package runs: a wheel built from this tree carries conf/ as fxtrain.conf and trains from anywhere."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a source checkout holds that a build does not read (and that is large or machine-made).
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "outputs", "multirun", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", "experiments", "site")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel of this working tree, built from a copy (the build's own build/ and egg-info stay out of the checkout)."""
    src = tmp_path_factory.mktemp("src") / "fxtrain"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True)
    (found,) = out.glob("fxtrain-*.whl")
    return found


@pytest.mark.multiprocess
def test_the_wheel_ships_the_configs_and_the_launcher(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert configs and {f"fxtrain/conf/{c}" for c in configs} <= names
    assert {"fxtrain/conf/__init__.py", "fxtrain/train.py", "fxtrain/tasks.py",
            "hydra_plugins/fxtrain_vmap_launcher/vmap_launcher.py"} <= names
    requires = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: scikit-learn" in requires  # the default experiment's data needs it at run time


@pytest.mark.multiprocess
def test_the_installed_wheel_trains_from_an_unrelated_directory(wheel, tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    # Only the target's fxtrain: PYTHONPATH comes before this checkout's editable install, and the cwd is elsewhere.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HYDRA"))}
    env["PYTHONPATH"] = str(target)
    where = subprocess.run([sys.executable, "-c", "import fxtrain.conf, fxtrain.train as t; "
                            "print(fxtrain.conf.__file__); print(t.CONF_DIR)"],
                           cwd=elsewhere, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(pathlib.Path(w).is_relative_to(target) for w in where), where
    run = subprocess.run([sys.executable, "-m", "fxtrain.train", "experiment=smoke", "trainer.max_steps=5",
                          "trainer.progress=false", "hydra.run.dir=run"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((elsewhere / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 5
    assert not (elsewhere / "conf").exists()
