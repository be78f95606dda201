"""Writes tests/cases/public_names.json: the public names of fxtrain and each of its public modules at landed
commits of the past (each day's last commit, or those named), read by importing that commit's own tree.

tests/test_public_names.py imports every name listed there from today's fxtrain: each still imports, either
where it is now or through a deprecation alias that names its new place.

    python tests/cases/_public_names.py               # each day's last commit before today
    python tests/cases/_public_names.py c559f74 ...   # these commits

A module's public names are its ``__all__``, else every name of ``dir()`` without a leading underscore that is
not a module and not an import from outside fxtrain (``torch``, ``NamedTuple``...).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = pathlib.Path(__file__).with_name("public_names.json")

# Run inside the old tree (python -c): prints {module: [names]} for fxtrain and its public modules.
READ = r"""
import importlib, json, pkgutil, types, warnings
warnings.simplefilter("ignore")
import fxtrain
def names(m):
    if hasattr(m, "__all__"):
        return sorted(set(m.__all__))
    out = []
    for k in dir(m):
        v = getattr(m, k)
        if k.startswith("_") or isinstance(v, types.ModuleType):
            continue
        home = getattr(v, "__module__", None) if isinstance(v, (type, types.FunctionType)) else None
        if home is not None and not home.startswith("fxtrain"):
            continue
        out.append(k)
    return sorted(out)
mods = {"fxtrain": names(fxtrain)}
for info in pkgutil.walk_packages(fxtrain.__path__, "fxtrain."):
    if any(p.startswith("_") for p in info.name.split(".")) or info.name.startswith("fxtrain.conf"):
        continue
    try:
        mods[info.name] = names(importlib.import_module(info.name))
    except Exception as e:  # an optional dependency missing on the machine that reads: say so
        mods[info.name] = {"error": repr(e)}
print(json.dumps(mods))
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def day_ends() -> list[str]:
    """The last commit of each day before today's (the landed points: the history has no tags or merges)."""
    today = git("log", "-1", "--format=%ad", "--date=format:%Y-%m-%d")
    last = {}
    for line in git("log", "--format=%H %ad", "--date=format:%Y-%m-%d").splitlines():
        sha, day = line.split()
        last.setdefault(day, sha)  # newest first: the first seen is the day's last
    return [last[d] for d in sorted(last) if d != today]


def read(commit: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        archive = pathlib.Path(tmp, "tree.tar")
        subprocess.run(["git", "archive", "-o", str(archive), commit, "fxtrain"], cwd=ROOT, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        out = subprocess.run([sys.executable, "-c", READ], cwd=tmp, capture_output=True, text=True, timeout=600,
                             env={"PYTHONPATH": tmp, "PATH": "/usr/bin:/bin"})
        if out.returncode:
            raise SystemExit(f"reading {commit}: {out.stderr[-2000:]}")
        return json.loads(out.stdout)


def main(commits: list[str]) -> None:
    points = []
    for c in commits or day_ends():
        sha = git("rev-parse", c)
        date = git("log", "-1", "--format=%cI", sha)
        print(f"reading {sha[:10]} ({date})", file=sys.stderr)
        points.append({"commit": sha, "date": date, "subject": git("log", "-1", "--format=%s", sha)[:120],
                       "modules": read(sha)})
    OUT.write_text(json.dumps({"generated_by": "tests/cases/_public_names.py",
                               "generated_at": datetime.date.today().isoformat(), "points": points}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
