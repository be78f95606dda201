"""Experts with FSDP, TP and PP, and issue 39's 8-rank rows, against one process (`experiment=tiny_lm amp=off
accumulate=off`).

Each row is one `torchrun ... -m fxtrain.train` run (gloo, CPU, one thread per rank) of the same config as the
single-process run of its model (`model=moe` for the rows with `ep`, the dense transformer otherwise); the table
gives the largest relative difference of the logged per-step loss and grad_norm from that run's, over every step,
the final test_loss and the wall time. Usage::

    .venv/bin/python experiments/experts/run.py --write              # 100 steps, writes results.md here
    .venv/bin/python experiments/experts/run.py --steps 20 --no-write
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402

_spec = importlib.util.spec_from_file_location("strategies_run", HERE.parent / "strategies" / "run.py")
strategies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(strategies)

MOE = ["model=moe"]
RUNS = [  # (label, torchrun ranks or 0 for one process, overrides)
    ("one process", 0, []),
    ("parallel.dp_replicate=2 parallel.dp_shard=2 parallel.tp=2 (HSDP x TP)", 8,
     ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"]),
    ("model=moe (one process)", 0, MOE),
    ("parallel=ep_fsdp model=moe (ep=2 x dp_shard=2)", 4, ["parallel=ep_fsdp", *MOE]),
    ("parallel=ep_tp model=moe (ep=2 x tp=2)", 4, ["parallel=ep_tp", *MOE]),
    ("parallel=pp_ep model=moe (pp=2 x ep=2)", 4, ["parallel=pp_ep", *MOE]),
    ("parallel.pp=2 parallel.tp=2 parallel.ep=2 model=moe", 8, ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2", *MOE]),
]


def run(ranks: int, overrides: list[str], steps: int, cwd: Path) -> tuple[list[dict], dict, float]:
    """(every logged step's record, the summary's metrics, wall seconds) of one run: experiments/strategies' launch,
    logging every step."""
    metrics, seconds = strategies.run(ranks, ["trainer.log_every=1", *overrides], steps, cwd)
    records = [json.loads(line) for line in (cwd / "out" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], metrics, seconds


def spread(got: list[dict], ref: list[dict], key: str) -> float:
    """The largest relative difference of ``key`` over the steps both logged (every step must be there)."""
    assert [r["step"] for r in got] == [r["step"] for r in ref], "the runs logged other steps"
    return max(abs(g[key] - r[key]) / abs(r[key]) for g, r in zip(got, ref))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-write", action="store_true")
    _common.add_output_args(ap, HERE)  # results.md
    args = ap.parse_args(argv)
    out, rows, ref = _common.output_dir(ap, args, HERE), [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, ranks, overrides) in enumerate(RUNS):
            (Path(tmp) / str(i)).mkdir()
            records, metrics, seconds = run(ranks, overrides, args.steps, Path(tmp) / str(i))
            base = ref.setdefault("moe" if "moe" in label else "dense", records)
            rows.append([label, ranks or 1, f"{metrics['loss']:.6f}", f"{spread(records, base, 'loss'):.1e}",
                         f"{spread(records, base, 'grad_norm'):.1e}", f"{metrics['test_loss']:.4f}",
                         f"{seconds:.0f}"])
            print(rows[-1], flush=True)
    body = report(rows, args.steps)
    print(body)
    if out is not None:
        print("wrote", _common.write_study_results(out, "experiments/experts/run.py", body))


def report(rows: list[list], steps: int) -> str:
    """results.md's text: the environment, the command and the table of ``rows``."""
    headers = ["run", "ranks", "final train loss", "max rel. diff of loss, any step",
               "max rel. diff of grad_norm, any step", "test_loss", "wall s"]
    return (f"# Experts with FSDP, TP and PP, and the 8-rank rows, against one process\n\n{_common.environment()}\n\n"
            f"Command: `.venv/bin/python experiments/experts/run.py --write --steps {steps}` "
            f"(`experiment=tiny_lm amp=off accumulate=off trainer.max_steps={steps} trainer.log_every=1`; "
            "the MoE rows are compared with the one-process MoE run)\n\n" + _common.table(headers, rows) + "\n")


if __name__ == "__main__":
    main()
