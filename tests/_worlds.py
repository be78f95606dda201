"""Multi-process test worlds: run every case of a test file in one gloo world per world size.

A test file registers its cases and hands them to pytest in three lines::

    CASES, case = _worlds.registry(worlds=(2, 4))     # @case() / @case(2): case_<name>(world) -> CASES

    test_case = _worlds.tests(__file__, CASES, timeout_s=240)   # one test per (world size, case)

    if __name__ == "__main__":
        _worlds.worker(CASES, *sys.argv[1:])

One world per size serves every file of the session: its ranks import each file that registered cases of
that size (``tests.<file>``, no pickling of test functions), join one gloo world, run the cases file by file
and write ``{file: {case: 'ok' | traceback}}``. Starting a rank costs seconds of CPU on a 2-core CI machine
(importing torch and fxtrain), a case milliseconds, so the suite starts one world per size, not one per
file and size. Under pytest-xdist the first worker to need a size runs its world and the others read its
results (a file lock in the session's shared temporary directory). A case that needs files shared by the ranks (checkpoints) writes under :data:`OUT_DIR`, its
file's own directory in the world's.

:func:`results` runs one file alone in its own world (tests/test_checkpoint.py's, which kills ranks).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT_DIR: pathlib.Path | None = None  # in a rank: the directory of this world's results (shared by the ranks)


def registry(worlds: tuple[int, ...]) -> tuple[dict, Callable]:
    """An empty ``{name: (fn(world), world sizes)}`` and its ``@case(*sizes)`` decorator (default ``worlds``).

    ``case_<name>`` functions are filed under ``<name>``; ``@case()`` runs at every size in ``worlds``.
    """
    cases: dict = {}

    def case(*sizes: int) -> Callable:
        def register(fn: Callable) -> Callable:
            cases[fn.__name__.removeprefix("case_")] = (fn, sizes or worlds)
            return fn
        return register

    return cases, case


def worker(cases: dict, rank: str, world: str, port: str, out_dir: str) -> None:
    """The rank entry point: joins the world, runs the cases for this world size, writes {case: 'ok' | traceback}."""
    global OUT_DIR
    rank, world, OUT_DIR = int(rank), int(world), pathlib.Path(out_dir)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    out = _run_cases(cases, world)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _run_cases(cases: dict, world: int, label: str = "") -> dict:
    """Runs the cases for this world size in the joined world: {case: 'ok' | traceback}."""
    out = {}
    for name, (fn, worlds) in cases.items():
        if world not in worlds:
            continue
        torch.manual_seed(0)
        print(f"case {label}{name}", flush=True)  # the log of a crashed or hung rank names its last case
        start = time.perf_counter()
        try:
            fn(world)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported by the pytest side, per case
            out[name] = traceback.format_exc()
        dist.barrier()
        print(f"  {time.perf_counter() - start:.1f} s", flush=True)  # where a world's time goes (the suite's budget)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_env() -> dict:
    """The environment for a test file run as a script: one thread, the repository importable (``tests._worlds``)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


_CACHE: dict = {}


def results(script: str, world: int, out_dir, timeout_s: float) -> list[dict]:
    """Runs ``script`` alone as ``world`` ranks (once per script and world size; its ``__main__`` calls
    :func:`worker`); each rank's {case: result}."""
    key = (script, world)
    if key not in _CACHE:
        _CACHE[key] = _spawn([script], world, out_dir, timeout_s)
    return _CACHE[key]


def check(res: list[dict], world: int, name: str) -> None:
    """Fails the calling test with the rank's traceback if case ``name`` failed (or a rank crashed)."""
    for rank, r in enumerate(res):
        if "__crash__" in r:
            pytest.fail(r["__crash__"])
        assert name in r, f"rank {rank} did not run {name}"
        if r[name] != "ok":
            pytest.fail(f"rank {rank} of {world}:\n{r[name]}")


# world size -> {script: (its cases, its timeout)}: every file of this session that registered cases
_FILES: dict[int, dict[str, tuple[dict, float]]] = {}


def tests(script: str, cases: dict, timeout_s: float) -> Callable:
    """The pytest side of ``cases``: one test per (world size, case); one world per size runs the cases of
    every file of the session that has that size (spawned once, shared by the pytest-xdist workers).

    Assign it to a ``test_*`` name in the test module (``test_case = _worlds.tests(__file__, CASES, 240)``);
    ``timeout_s`` is this file's share of its worlds' time limit.
    """
    script = str(pathlib.Path(script).resolve())
    for _, sizes in cases.values():
        for world in sizes:
            _FILES.setdefault(world, {})[script] = (cases, timeout_s)

    @pytest.mark.multiprocess
    @pytest.mark.parametrize("world,name", [(w, n) for n, (_, ws) in cases.items() for w in ws])
    def test_case(tmp_path_factory, world, name):
        shared = shared_results(world, tmp_path_factory)
        if any("__crash__" in r for r in shared):
            # A rank of the shared world died (once: a segfault in gloo's transport thread, no Python error), which
            # ends every file's cases: this file's run again in a world of their own (the file's __main__), so a
            # crash fails only the file whose case causes it.
            shared = [r if "__crash__" in r else {script: r}
                      for r in results(script, world, tmp_path_factory.mktemp(f"world{world}"), timeout_s)]
        check([r if "__crash__" in r else r.get(script, {}) for r in shared], world, name)

    return test_case


def shared_results(world: int, tmp_path_factory) -> list[dict]:
    """Each rank's ``{script: {case: result}}`` of the one world of size ``world`` that runs every registered
    file: run by the first caller of the session (all pytest-xdist workers together), read by the others."""
    files, out_dir = sorted(_FILES[world]), _shared_dir(world, tmp_path_factory)
    key, shared = out_dir.name, out_dir.parent
    if key in _CACHE:
        return _CACHE[key]
    with open(shared / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = out_dir / "results.json"
        if not done.exists():
            out_dir.mkdir(exist_ok=True)
            timeout_s = sum(t for _, t in _FILES[world].values())
            res = _spawn(["-m", "tests._worlds", "files"], world, out_dir, timeout_s, files)
            done.write_text(json.dumps(res))
        _CACHE[key] = json.loads(done.read_text())
    return _CACHE[key]


def out_dir(world: int, script: str, tmp_path_factory) -> pathlib.Path:
    """The directory the cases of ``script`` (a test file's ``__file__``) wrote under (:data:`OUT_DIR`) in the
    shared world of size ``world``, which runs first if it has not: for a test of this process that reads what
    a world's case left (checkpoints to continue in one process)."""
    shared_results(world, tmp_path_factory)
    return _shared_dir(world, tmp_path_factory) / pathlib.Path(script).stem


def _shared_dir(world: int, tmp_path_factory) -> pathlib.Path:
    """The session's directory of the shared world of size ``world`` (named by the files it runs)."""
    files = sorted(_FILES[world])
    key = f"worlds{world}-" + hashlib.sha1("\n".join(files).encode()).hexdigest()[:12]
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: one basetemp per worker
    return shared / key


def _spawn(entry: list[str], world: int, out_dir, timeout_s: float, extra: list[str] = ()) -> list[dict]:
    """``python *entry <rank> <world> <port> <out_dir> *extra`` as ``world`` ranks; each rank's results (or
    ``{"__crash__": its log's end}``)."""
    env = script_env()
    port = _free_port()
    logs = [open(os.path.join(out_dir, f"log{r}.txt"), "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, *entry, str(r), str(world), str(port), str(out_dir), *extra],
                              env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    out = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                out.append(json.load(f))
        else:
            logs[r].seek(0)
            out.append({"__crash__": f"rank {r} wrote no results (exit {procs[r].returncode}):\n{logs[r].read()[-4000:]}"})
    for f in logs:
        f.close()
    return out


def _fresh_dispatch() -> None:
    """Empties torch's DTensor sharding-propagation caches (Python and C++), so that each file's DTensors
    come out on its own meshes, as in a world of that file alone.

    The caches key on ``DTensorSpec``, which compares meshes by value (ranks, layout, dim names): an op on
    a mesh built by a later file that equals one built by an earlier file returns the earlier file's mesh
    object in its output spec. Tests that check ``state.device_mesh is param.device_mesh`` (test_sharding)
    then fail only when merged. Within one file the meshes a case compares are the file's own.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def files_worker(rank: str, world: str, port: str, out_dir: str, *scripts: str) -> None:
    """The rank entry point of a shared world: imports each test file (registering its cases), joins the world,
    runs every file's cases for this world size, each file's under its own :data:`OUT_DIR`, and writes
    ``{script: {case: 'ok' | traceback}}``."""
    for script in scripts:
        importlib.import_module(f"tests.{pathlib.Path(script).stem}")
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    global OUT_DIR
    out = {}
    for script in scripts:
        cases, _ = _FILES[world][script]
        _fresh_dispatch()
        OUT_DIR = pathlib.Path(out_dir) / pathlib.Path(script).stem
        OUT_DIR.mkdir(exist_ok=True)
        out[script] = _run_cases(cases, world, label=f"{pathlib.Path(script).name}::")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests import _worlds  # the module the test files register with (this one runs as __main__)

    assert sys.argv[1] == "files", sys.argv
    _worlds.files_worker(*sys.argv[2:])
