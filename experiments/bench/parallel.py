"""fxtrain's step on torch's own parallel modules against torch's imperative loop (issue 16).

One row per strategy, each from its case script run under ``torchrun`` (gloo, CPU, one thread per rank):

* ``_parallel_tp.py``: "TP" (2 ranks, ``parallelize_module``) and "2-D" (4 ranks, dp x tp = 2 x 2);
* ``_parallel_fsdp.py``: "FSDP2" (2 ranks, ``fully_shard``), "HSDP" (4 ranks, ``fully_shard`` on a 2 x 2
  ``(dp_replicate, dp_shard)`` mesh), "DP" (2 ranks, Replicate params against DDP) and "EP" (2 ranks, MoE
  experts sharded over ep against DDP with every expert on every rank);
* ``_parallel_pp.py``: "pipeline" (2 ranks, ``ScheduleGPipe``, 4 micro-batches).

Each case times both sides in one run, one step of each per round with the order rotating, and reports
rank 0's medians, the collectives per step (counted the same way on both sides; each case's docstring
says how) and how far the params end apart. Usage::

    .venv/bin/python experiments/bench/parallel.py              # all rows, writes results/parallel.md
    .venv/bin/python experiments/bench/parallel.py --only TP --steps 10 --no-write

Goals (issue 26): TP <= 0.6x torch's time, FSDP2 <= 1.0x, 2-D <= 0.9x, collectives never more than torch's;
(issue 36, with the data-parallel reduction overlapped with the backward): DP, HSDP and pipeline <= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent
CASES = [  # (row label, script, ranks, extra arguments)
    ("TP", "_parallel_tp.py", 2, []),
    ("2-D", "_parallel_tp.py", 4, []),
    ("FSDP2", "_parallel_fsdp.py", 2, ["--layout", "fsdp"]),
    ("HSDP", "_parallel_fsdp.py", 4, ["--layout", "hsdp"]),
    ("DP", "_parallel_fsdp.py", 2, ["--layout", "dp"]),
    ("EP", "_parallel_fsdp.py", 2, ["--layout", "ep"]),
    ("pipeline", "_parallel_pp.py", 2, []),
]
GOALS = {"TP": 0.6, "FSDP2": 1.0, "2-D": 0.9, "DP": 1.0, "HSDP": 1.0, "pipeline": 1.0}  # issues 26 and 36


def run_case(script: str, ranks: int, steps: int, out: Path, extra: list[str]) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [str(torchrun), "--nproc-per-node", str(ranks), "--master-port", str(_common.free_port()),
           str(HERE / script), "--out", str(out), "--steps", str(steps), *extra]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="timed rounds per case (after 3 warmup rounds)")
    ap.add_argument("--only", nargs="*", help="row labels to run (default: all)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, script, ranks, extra in CASES:
            if args.only and label not in args.only:
                continue
            out = Path(tmp) / f"{label}.jsonl"
            run_case(script, ranks, args.steps, out, extra)
            rows += [json.loads(line) for line in out.read_text().splitlines() if line.strip()]

    table = _common.table(
        ["strategy", "ranks", "fxtrain ms", "torch ms", "ratio", "goal", "collectives fxtrain / torch",
         "max rel diff"],
        [[r["strategy"], r["world"], f"{r['fxtrain_ms']:.1f}", f"{r['torch_ms']:.1f}", f"{r['ratio']:.2f}",
          f"<= {GOALS[r['strategy']]}" if r["strategy"] in GOALS else "-",
          f"{r['fxtrain_collectives']} / {r['torch_collectives']}", f"{r['max_rel_diff']:.1e}"] for r in rows])
    notes = "\n".join(f"- **{r['strategy']}**: {r.get('note', '')}" for r in rows)
    text = (f"# Parallel steps: fxtrain vs torch's imperative loop\n\n{_common.environment()}\n\n"
            f"Command: `.venv/bin/python experiments/bench/parallel.py --steps {args.steps}`\n\n"
            f"{table}\n\n{notes}\n")
    print(text)
    if not args.no_write:
        print("wrote", _common.write_result("parallel", text))


if __name__ == "__main__":
    main()
