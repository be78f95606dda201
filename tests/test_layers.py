"""The layer contract of DESIGN.md section 2, enforced: `lint-imports` (import-linter) with the contracts in
pyproject.toml ([tool.importlinter]): fxtrain's layers from the runner down to tree.py, no upward import (a
function-local one included: grimp sees every import), no import cycle inside a package. And no module imports
another module's private name (an AST scan of fxtrain/): what the library's wrappers need is public API."""

import ast
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


# --- no module imports another module's private name (DESIGN.md section 2) ----------------------------------

# Files whose private imports are another engineer's work in progress, each with why; the test fails when one
# is clean (delete its entry then).
PENDING: dict[str, str] = {}


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(root: pathlib.Path, dotted: str) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: pathlib.Path) -> list[str]:
    """``file:line: module.name`` for every use of another fxtrain module's private name under ``root/fxtrain``:
    ``from fxtrain.x import _y`` and ``x._y`` where ``x`` is a bound fxtrain module. Private *modules*
    (``from fxtrain.transforms import _adam``) are not names and pass."""
    out = []
    for path in sorted((root / "fxtrain").rglob("*.py")):
        me, rel = _module_name(root, path), path.relative_to(root).as_posix()
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
        modules = {}  # a local name bound to an fxtrain module -> that module
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if not base.startswith("fxtrain"):
                    continue
                for alias in node.names:
                    if _is_module(root, f"{base}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif _private(alias.name) and base != me:
                        out.append(f"{rel}:{node.lineno}: {base}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fxtrain"):
                        modules[alias.asname or "fxtrain"] = alias.name if alias.asname else "fxtrain"
        for node in nodes:
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                owner = ".".join([modules[value.id], *chain])
                if _is_module(root, owner) and owner != me and not _is_module(root, f"{owner}.{node.attr}"):
                    out.append(f"{rel}:{node.lineno}: {owner}.{node.attr}")
    return out


def test_no_module_imports_another_modules_private_name():
    found = private_imports(ROOT)
    offending = [f for f in found if f.split(":")[0] not in PENDING]
    assert not offending, ("private names used across modules (give the name a public one and a docstring, "
                           "DESIGN.md section 2):\n" + "\n".join(offending))
    stale = set(PENDING) - {f.split(":")[0] for f in found}
    assert not stale, f"clean now, remove from PENDING: {sorted(stale)}"


def test_a_private_import_fails_naming_it(tmp_path):
    shutil.copytree(ROOT / "fxtrain", tmp_path / "fxtrain", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "fxtrain" / "transforms" / "_lion.py", "a") as f:
        f.write("\n\nfrom fxtrain._base import _Update  # noqa: E402,F401\n"
                "from fxtrain.transforms import _adam  # noqa: E402  (a private module: allowed)\n\n\n"
                "def _sneaky():\n    return tree._some_helper, _adam._private, _adam.scale_by_adam\n")
    found = [f for f in private_imports(tmp_path) if f.startswith("fxtrain/transforms/_lion.py")]
    lines = len((tmp_path / "fxtrain" / "transforms" / "_lion.py").read_text().splitlines())
    assert found == [f"fxtrain/transforms/_lion.py:{lines - 5}: fxtrain._base._Update",
                     f"fxtrain/transforms/_lion.py:{lines}: fxtrain.tree._some_helper",
                     f"fxtrain/transforms/_lion.py:{lines}: fxtrain.transforms._adam._private"], found
