"""Multi-process test worlds: run every case of a test file in one gloo world per world size.

A test file registers its cases and hands them to pytest in three lines::

    CASES, case = _worlds.registry(worlds=(2, 4))     # @case() / @case(2): case_<name>(world) -> CASES

    test_case = _worlds.tests(__file__, CASES, timeout_s=240)   # one test per (world size, case)

    if __name__ == "__main__":
        _worlds.worker(CASES, *sys.argv[1:])

Each rank runs the file as a script (no pickling of test functions, so pytest's import mode does not
matter), joins a gloo world, runs the cases for its world size and writes ``{case: 'ok' | traceback}``.
One spawn runs many cases: starting a world costs seconds on a 2-core CI machine, a case milliseconds.
A case that needs files shared by the ranks (checkpoints) writes under :data:`OUT_DIR`, the directory
its pytest side passed to :func:`results`.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
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
    out = {}
    for name, (fn, worlds) in cases.items():
        if world not in worlds:
            continue
        torch.manual_seed(0)
        print(f"case {name}", flush=True)  # the log of a crashed or hung rank names its last case
        try:
            fn(world)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported by the pytest side, per case
            out[name] = traceback.format_exc()
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


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
    """Runs ``script`` as ``world`` ranks (once per script and world size); each rank's {case: result}."""
    key = (script, world)
    if key in _CACHE:
        return _CACHE[key]
    env = script_env()
    port = _free_port()
    logs = [open(os.path.join(out_dir, f"log{r}.txt"), "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, script, str(r), str(world), str(port), str(out_dir)],
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
    _CACHE[key] = out
    return out


def check(res: list[dict], world: int, name: str) -> None:
    """Fails the calling test with the rank's traceback if case ``name`` failed (or a rank crashed)."""
    for rank, r in enumerate(res):
        if "__crash__" in r:
            pytest.fail(r["__crash__"])
        assert name in r, f"rank {rank} did not run {name}"
        if r[name] != "ok":
            pytest.fail(f"rank {rank} of {world}:\n{r[name]}")


def tests(script: str, cases: dict, timeout_s: float) -> Callable:
    """The pytest side of ``cases``: one test per (world size, case), each world spawned once (cached).

    Assign it to a ``test_*`` name in the test module (``test_case = _worlds.tests(__file__, CASES, 240)``).
    """
    @pytest.mark.slow
    @pytest.mark.parametrize("world,name", [(w, n) for n, (_, ws) in cases.items() for w in ws])
    def test_case(tmp_path_factory, world, name):
        check(results(script, world, tmp_path_factory.mktemp(f"world{world}"), timeout_s), world, name)

    return test_case
