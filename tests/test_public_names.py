"""Earlier releases' public names still import (issue 35 item 6): fxtrain/_moved.py's aliases.

tests/cases/public_names.json holds the public names of fxtrain and of each of its public modules at the landed
commits of the past (each day's last commit; written by tests/cases/_public_names.py, which imports each
commit's own tree). Every one of them, read from its old module today, is either still there (no warning), or
moved (a DeprecationWarning naming the new place, which holds the same object and lists it in its ``__all__``),
or in REMOVED below: replaced by something else, and reading it says by what.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pathlib
import re
import subprocess
import types

import pytest

DATA = json.loads((pathlib.Path(__file__).parent / "cases" / "public_names.json").read_text())
NAMES: dict[str, set[str]] = {}
for point in DATA["points"]:
    for module, names in point["modules"].items():
        NAMES.setdefault(module, set()).update(names)

# Public names replaced by other API (the first day's, 11-22, and issue 38's), each with what replaces it: reading one
# raises an AttributeError that says so (a name missing here and from fxtrain fails the test).
REMOVED = {
    "fxtrain.build.constant_hyperparams": "fx.traits(tx).constant_reports",
    "fxtrain.distributed.STRATEGIES": "ParallelDims",
    "fxtrain.distributed.all_reduce_mean": "mean_across_ranks",
    "fxtrain.distributed.local_batch": "local_batch(batch)",
    "fxtrain.distributed.on_dp_mesh": "shard_over='dp'",
    # issue 38: the settings declared as pydantic models
    "fxtrain.validate.SCHEMA": "fxtrain.schema.node_models()",
    "fxtrain.validate.ARG_RULES": "fxtrain.schema.ARGS",
}


def test_the_names_come_from_landed_commits():
    assert len(DATA["points"]) >= 3 and all(re.fullmatch(r"[0-9a-f]{40}", p["commit"]) for p in DATA["points"])
    assert "fully_sharded" in NAMES["fxtrain.distributed"] and "parallelize" in NAMES["fxtrain.strategies"]
    git = subprocess.run(["git", "cat-file", "-e", DATA["points"][0]["commit"]], cwd=pathlib.Path(__file__).parent,
                         capture_output=True)
    if git.returncode not in (0, 128):  # 128: not a git checkout (an sdist): nothing to check against
        pytest.fail(f"{DATA['points'][0]['commit']} is not a commit of this repository")


@pytest.mark.parametrize("module", sorted(NAMES))
def test_every_earlier_public_name_still_imports(module):
    mod = importlib.import_module(module)
    for name in sorted(NAMES[module]):
        old = f"{module}.{name}"
        if old in REMOVED:
            with pytest.raises(AttributeError, match=f"{re.escape(old)} was removed: .*{re.escape(REMOVED[old])}"):
                getattr(mod, name)
            continue
        if name in vars(mod):
            getattr(mod, name)  # still here: no warning (pytest turns any into an error)
            continue
        with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to ") as caught:
            obj = getattr(mod, name)
        new = re.search(r"moved to (\S+):", str(caught[0].message)).group(1)
        home, _, attr = new.rpartition(".")
        new_mod = importlib.import_module(home)
        assert getattr(new_mod, attr) is obj and attr in new_mod.__all__, f"{old} -> {new}"


def test_documented_fsdp_code_of_last_week_runs_with_a_warning():
    """`fx.distributed.fully_sharded` (the README of 11-23) was an AttributeError: now the same function."""
    import fxtrain as fx
    from fxtrain import parallel

    with pytest.warns(DeprecationWarning, match="fxtrain.distributed.fully_sharded moved to "
                                                "fxtrain.parallel.fully_sharded"):
        assert fx.distributed.fully_sharded is parallel.fully_sharded
    with pytest.warns(DeprecationWarning, match="fxtrain.strategies.parallelize moved to fxtrain.parallel.parallelize"):
        from fxtrain.strategies import parallelize  # noqa: F401
    with pytest.raises(AttributeError, match="module 'fxtrain.distributed' has no attribute 'nope'"):
        fx.distributed.nope  # noqa: B018


# --- the public face has edges (issue 38 item 3): fxtrain.__all__ and fx.extend ----------------------------------

INIT = pathlib.Path(__file__).parents[1] / "fxtrain" / "__init__.py"


def imported_by_the_map() -> set[str]:
    """The public names fxtrain/__init__.py's top-level import statements bind: the map a reader sees."""
    names = set()
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name for alias in node.names)
    return {name for name in names if not name.startswith("_")}


def test_star_import_gives_exactly_all():
    import fxtrain

    namespace: dict = {}
    exec("from fxtrain import *", namespace)  # noqa: S102
    assert set(namespace) - {"__builtins__"} == set(fxtrain.__all__)
    assert len(fxtrain.__all__) == len(set(fxtrain.__all__)) and "moved_names" not in fxtrain.__all__


def test_all_is_what_the_map_imports():
    """``__all__`` is generated from the map: a submodule bound as a side effect of importing another, or a name
    imported and not meant public, shows up here as a difference."""
    import fxtrain

    listed, imported = set(fxtrain.__all__), imported_by_the_map()
    assert listed == imported, f"in __all__ only: {sorted(listed - imported)}; imported only: {sorted(imported - listed)}"


def has_example(obj: object) -> bool:
    return ">>>" in (inspect.getdoc(obj) or "")


@pytest.mark.parametrize("module", ["fxtrain", "fxtrain.extend"])
def test_every_public_name_has_a_docstring_with_an_example(module):
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if isinstance(obj, types.ModuleType):
            assert (obj.__doc__ or "").strip(), f"{module}.{name} has no module docstring"
        elif not has_example(obj):
            missing.append(name)
    assert not missing, f"{len(missing)} public names of {module} have no docstring example: {missing}"


def test_the_extension_api_lives_in_extend_and_its_old_names_warn():
    """``fx.combine`` and the rest of the wrapper-writing machinery moved to ``fx.extend``; the old names are the
    same objects for one more release, with a DeprecationWarning naming the new place."""
    import fxtrain as fx

    assert "combine" in fx.extend.__all__ and "combine" not in fx.__all__ and "extend" in fx.__all__
    for name in ("call", "call_", "check_learning_rate", "check_needs_params", "check_nonnegative", "combine",
                 "forwarded", "kernel"):
        with pytest.warns(DeprecationWarning, match=f"fxtrain.{name} moved to fxtrain.extend.{name}: import it"):
            assert getattr(fx, name) is getattr(fx.extend, name)
    assert fx.describe is fx.extend.describe  # the runner's stack line prints with it: it stays, no warning
