"""The compiled vmapped sweep, first and second time (issue 36, item 8): torch.compile's on-disk caches.

``hydra/launcher=vmap hydra.launcher.compile=true`` compiles the group's step and evaluation. Inductor's FX graph
cache and AOTAutograd's cache keep the compiled code on disk (:func:`fxtrain.sweep.compile_cache`,
``hydra.launcher.cache_dir``), so a second sweep of the same config and shapes, in a new process, loads it. Three
runs of the same sweep, each ``python -m fxtrain.train -m ...`` in a fresh process, one after the other:

* ``vmap, eager``: the launcher's default (no compilation), for reference;
* ``vmap, compile, first``: an empty cache directory (``hydra.launcher.cache_dir=<fresh dir>``);
* ``vmap, compile, second``: the same directory, filled by the first.

Columns: ``wall s`` (the whole command), ``train s`` (the vmapped group's ``time_s``: build, steps, evaluation,
checkpoints; compilation happens inside it), and the cache directory's size after the run.

Usage:
    python experiments/bench/compile_cache.py [--steps 200] [--threads 1] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import sweep as bench_sweep  # noqa: E402 - its sweep command and runner


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    grid = [bench_sweep.LRS]
    rows, commands = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        runs = [("vmap, eager", "vmap", []),
                ("vmap, compile, first (empty cache)", "vmap, compile", [f"hydra.launcher.cache_dir={cache}"]),
                ("vmap, compile, second (the same cache)", "vmap, compile", [f"hydra.launcher.cache_dir={cache}"])]
        for i, (name, variant, extra) in enumerate(runs):
            cmd = bench_sweep.command(variant, [*grid, *extra], args.steps, tmp / f"sweep{i}", args.threads)
            commands.append(shlex.join(["python", *cmd[1:-1]]))
            wall, train, _ = bench_sweep.run(cmd, bench_sweep.ROOT)
            rows.append([name, wall, train, f"{size_mib(cache):.1f}" if cache.exists() else "-"])
            print(rows[-1], flush=True)
    eager, first, second = rows
    table = _common.table(["run", "wall s", "train s", "cache MiB after"], rows)
    text = (f"# The compiled vmapped sweep, first and second time (issue 36, item 8)\n\n"
            f"Command: `python experiments/bench/compile_cache.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`"
            f"; load average at the start: {load}. The sweep: `8 lrs x {args.steps} steps` of the default digits "
            "experiment, each run a fresh process, one after the other:\n\n"
            + "\n".join(f"- `{c}`" for c in commands) + "\n\n" + table + "\n\n"
            f"Compilation's share of the group's train time: first {first[2] - eager[2]:.1f} s, second "
            f"{second[2] - eager[2]:.1f} s above the eager run's ({first[2] / max(second[2], 1e-9):.1f}x less "
            f"train time the second time).\n\n{_common.environment()}\n")
    print(text)
    if not args.no_write:
        print(_common.write_result("compile_cache", text))


if __name__ == "__main__":
    main()
