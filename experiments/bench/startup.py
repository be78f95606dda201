"""Start-up (issue 36, item 6): ``import fxtrain`` and ``import fxtrain.train`` against ``import torch``, and the time
from ``python -m fxtrain.train`` to its first header line.

Every timing is a fresh process (``python -c "<statement>"``, wall clock from spawn to exit), so the file cache is
warm but nothing is imported. Rounds interleave the statements (the order rotating every round) and the table
reports medians and quartiles: on a machine shared with other work, a slow spell hits every statement alike.
The goal: each fxtrain import <= 0.3 s above ``import torch``; the first line of ``python -m fxtrain.train`` within
3 s (it runs ``trainer.max_steps=1`` in a temporary directory; the whole run's time is reported too).

Usage:
    python experiments/bench/startup.py [--rounds 15] [--run-rounds 5] [--baseline DIR] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STATEMENTS = {
    "python": "pass",
    "import torch": "import torch",
    "import fxtrain": "import fxtrain",
    "import fxtrain.train": "import fxtrain.train",
}


def _env(root: Path = ROOT) -> dict:  # with cwd=root: `python -c` puts its cwd first on sys.path
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) that the live process ``pid`` has used so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_statement(statement: str, root: Path = ROOT) -> tuple[float, float]:
    """Wall and CPU seconds of ``python -c statement`` (``root`` first on the path), spawn to exit."""
    t0, c0 = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-c", statement], cwd=root, env=_env(root), check=True)
    return time.perf_counter() - t0, _children_cpu() - c0


def time_increment(module: str, root: Path = ROOT) -> tuple[float, float]:
    """Wall and CPU seconds of ``import module`` in a fresh process that has imported torch already: the cost
    above torch measured inside one process (the spread of torch's own import time between processes left out)."""
    code = ("import time, torch; w, c = time.perf_counter(), time.process_time(); "
            f"import {module}; print(time.perf_counter() - w, time.process_time() - c)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=_env(root), check=True, capture_output=True,
                         text=True)
    wall, cpu = map(float, out.stdout.split())
    return wall, cpu


def time_run(workdir: str) -> tuple[float, float, float]:
    """Seconds from spawning ``python -m fxtrain.train trainer.max_steps=1`` to its first line (wall and CPU),
    and to its exit (wall)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fxtrain.train", "trainer.max_steps=1"], cwd=workdir, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()
    t_first, cpu_first = time.perf_counter() - t0, _cpu_of(proc.pid)
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise RuntimeError(f"python -m fxtrain.train trainer.max_steps=1 failed (first line: {first!r})")
    return t_first, cpu_first, time.perf_counter() - t0


def _commit(root: Path) -> str:
    out = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return out.stdout.strip()[:80] or "(not a git checkout)"


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    return tuple(statistics.quantiles(xs, n=4)) if len(xs) > 1 else (xs[0],) * 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="fresh processes per import statement")
    parser.add_argument("--run-rounds", type=int, default=5, help="runs of python -m fxtrain.train (0: none)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout (e.g. `git worktree add /tmp/before main`): its imports timed too")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    load_before = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    runs = {name: (statement, ROOT) for name, statement in STATEMENTS.items()}
    if args.baseline:
        runs.update({f"{name} (baseline)": (STATEMENTS[name], args.baseline)
                     for name in STATEMENTS if "fxtrain" in name})
    increments = {f"{m}{label}": (m, root) for m in ("fxtrain", "fxtrain.train")
                  for label, root in [("", ROOT), *([(" (baseline)", args.baseline)] if args.baseline else [])]}
    inc_wall: dict[str, list[float]] = {name: [] for name in increments}
    inc_cpu: dict[str, list[float]] = {name: [] for name in increments}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            w, c = time_statement(*runs[name])
            wall[name].append(w)
            cpu[name].append(c)
        for name, (module, root) in increments.items():
            w, c = time_increment(module, root)
            inc_wall[name].append(w)
            inc_cpu[name].append(c)
    torch_wall, torch_cpu = statistics.median(wall["import torch"]), statistics.median(cpu["import torch"])
    rows = []
    for name in names:
        q1, med, q3 = quartiles(wall[name])
        c = statistics.median(cpu[name])
        rows.append([f"`{name}`", med, q1, q3, med - torch_wall, c, c - torch_cpu, c / torch_cpu])
    text = ["# Start-up", "", _common.environment(), f"- load average at the start: {load_before}",
            f"- command: `python experiments/bench/startup.py {' '.join(sys.argv[1:])}`",
            *([f"- baseline: {args.baseline} at `{_commit(args.baseline)}`"] if args.baseline else []),
            "", f"Fresh processes, {args.rounds} interleaved rounds, seconds (goal: fxtrain's imports <= 0.3 s above "
            "`import torch`). Wall clock from spawn to exit, and the process's CPU time (user + system), which moves "
            "much less with the load than the wall clock does.", "",
            _common.table(["statement", "wall median s", "q1", "q3", "wall above torch s", "CPU median s",
                           "CPU above torch s", "CPU x torch"], rows)]

    inc_rows = [[f"`import {name}`", statistics.median(inc_wall[name]), *quartiles(inc_wall[name])[::2],
                 statistics.median(inc_cpu[name])] for name in increments]
    text += ["", "Above torch inside one process (`import torch`, then the clock, then `import fxtrain...`), same "
             "rounds:", "",
             _common.table(["after import torch", "wall median s", "q1", "q3", "CPU median s"], inc_rows)]

    if args.run_rounds:
        firsts, cpus, totals = [], [], []
        with tempfile.TemporaryDirectory() as workdir:
            for _ in range(args.run_rounds):
                first, first_cpu, total = time_run(workdir)
                firsts.append(first)
                cpus.append(first_cpu)
                totals.append(total)
        run_rows = [["first line (`run ...`), wall", statistics.median(firsts), *quartiles(firsts)[::2]],
                    ["first line (`run ...`), CPU of the process", statistics.median(cpus), *quartiles(cpus)[::2]],
                    ["exit, wall", statistics.median(totals), *quartiles(totals)[::2]]]
        text += ["", f"`python -m fxtrain.train trainer.max_steps=1` (default config, digits), {args.run_rounds} runs, "
                 "seconds from spawn (goal: first line within 3 s).", "",
                 _common.table(["until", "median s", "q1", "q3"], run_rows)]
    report = "\n".join(text)
    print(report)
    if not args.no_write:
        print(f"\nwrote {_common.write_result('startup', report)}")


if __name__ == "__main__":
    main()
