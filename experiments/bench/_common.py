"""Shared helpers for the benchmarks in this folder (and the studies next to it): interleaved timing,
medians, markdown, environment, launching gloo ranks, the header of a study's ``results.md``.

Timings on a shared machine drift with whatever else runs. Every benchmark here therefore times all
its variants in one process, one call of each per round, rotating the order every round, and reports
medians and quartiles over rounds: a slow spell hits every variant alike and the ratios stay honest.

Scripts elsewhere in ``experiments/`` import it the way the benchmarks do:
``sys.path.insert(0, str(<experiments>/bench)); import _common``.
"""

from __future__ import annotations

import argparse

import datetime
import gc
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def interleaved(fns: dict[str, Callable[[], Any]], *, rounds: int, warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each function: ``rounds`` rounds, each calling every function once.

    The order rotates each round so no variant always runs right after the same neighbour. ``clock``:
    wall time by default; ``time.process_time`` counts this process's CPU time instead, which time spent
    waiting for a core that other processes hold does not inflate (meaningful with one thread per process).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    gc.collect()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return times


def summary(seconds: list[float]) -> dict[str, float]:
    """Minimum, median and quartiles in milliseconds."""
    q1, med, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else (seconds[0],) * 3
    return {"min": min(seconds) * 1e3, "median": med * 1e3, "q1": q1 * 1e3, "q3": q3 * 1e3}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats printed with 2 decimals."""
    def cell(x: Any) -> str:
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def environment() -> str:
    """One markdown line per fact that a reader needs to compare runs."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- torch {torch.__version__}, {torch.get_num_threads()} threads, python {platform.python_version()}",
        f"- cpu: {cpu} ({os.cpu_count()} cores visible), load average at the end: {load}",
    ])


def write_result(name: str, text: str) -> Path:
    """Writes ``results/<name>.md`` next to this file and returns its path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def add_output_args(parser: argparse.ArgumentParser, here: Path) -> None:
    """``--out DIR`` and ``--write``: where a study writes its results (see :func:`output_dir`)."""
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the results (a fresh copy; the committed ones stay as they are)")
    parser.add_argument("--write", action="store_true",
                        help=f"replace the committed results in {_rel(here)} (they are what its README shows)")


def output_dir(parser: argparse.ArgumentParser, args: argparse.Namespace, here: Path) -> Path | None:
    """Where the results go: ``--out DIR``, or the committed directory ``here`` with ``--write`` (or ``--out``
    naming it); ``None`` with ``--no-write``. Without any, the study refuses before doing any work (exit 2):
    a rerun never replaces committed results unless asked (``make studies`` compares reruns with them)."""
    if getattr(args, "no_write", False):
        return None
    if args.write and args.out is not None and args.out.resolve() != here.resolve():
        parser.error(f"--write replaces the committed results in {_rel(here)}, --out {args.out} writes elsewhere: "
                     "pass one of them")
    if args.write:
        return here
    if args.out is None:
        parser.error(f"where should the results go? --out DIR writes a fresh copy (e.g. --out /tmp/{here.name}); "
                     f"--write replaces the committed results in {_rel(here)}")
    return args.out


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[2])) + "/"
    except ValueError:
        return str(path)


def write_study_results(out_dir: Path, script: str, body: str, source: Any = None) -> Path:
    """Writes ``out_dir/results.md``: a comment naming ``script``, the date, ``source`` and torch, then ``body``."""
    origin = f" from {source}" if source is not None else ""
    header = f"<!-- written by {script} on {datetime.date.today()}{origin}, torch {torch.__version__} -->\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.md"
    path.write_text(header + (body if body.endswith("\n") else body + "\n"))
    return path


# --- multi-process runs ------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(script: str | Path, world: int, argv: Callable[[int, int], list[str]],
                env: dict[str, str] | None = None) -> list[int]:
    """Runs ``world`` copies of ``script`` on this machine, one CPU thread each, and waits for all of them.

    ``argv(rank, port)`` gives each copy's arguments; ``port`` is one free port for their rendezvous.
    Returns the exit codes, by rank.
    """
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, str(script), *argv(rank, port)], env=env) for rank in range(world)]
    return [p.wait() for p in procs]
