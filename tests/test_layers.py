"""The layer contract of DESIGN.md section 2, enforced: `lint-imports` (import-linter) with the contracts in
pyproject.toml ([tool.importlinter]): fxtrain's layers from the runner down to tree.py, no upward import (a
function-local one included: grimp sees every import), no import cycle inside a package."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = pathlib.Path(sys.executable).with_name("lint-imports")


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_library_keeps_its_layers():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout


def test_an_upward_import_fails_naming_it(tmp_path):
    # tree.py, the bottom of the graph, imports the runner inside a function: the contract names that import.
    shutil.copytree(ROOT / "fxtrain", tmp_path / "fxtrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "fxtrain" / "tree.py", "a") as f:
        f.write("\n\ndef _sneaky():\n    from fxtrain import train  # noqa: F401\n")
    out = lint(tmp_path)
    assert out.returncode == 1
    assert "fxtrain.tree is not allowed to import fxtrain.train" in out.stdout
    assert "fxtrain.tree -> fxtrain.train" in out.stdout
