"""Context parallel (`parallel.cp`, issue 39) against one process: each cp preset, 100 steps, amp off and bf16.

Each preset is one `torchrun ... -m fxtrain.train` run (gloo, CPU, one thread per rank) of the same config as the
single-process run: the tiny LM on sequences of 32 bytes, which each cp rank holds 16 of (torch's head-tail load
balance: chunks r and 3 - r of 4). The table gives, over the 100 logged steps, the largest relative distance of
the loss and of grad_norm from the single-process run's of the same step (the issue's acceptance: within 2e-3
after 100 steps, amp off and on), the final loss and the wall time; ``parallel=fsdp`` on 4 ranks (no cp) is the
control: under bf16 every layout's grad_norm parts from one process's by bf16 rounding in another order. Usage::

    .venv/bin/python experiments/context_parallel/run.py --write         # 100 steps, replaces results.md here
    .venv/bin/python experiments/context_parallel/run.py --steps 10 --no-write

tests/test_context_parallel.py's slow test runs :func:`deviations` for each preset and amp mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402

ARGS = ["experiment=tiny_lm", "data.max_bytes=60000", "data.eval_windows=16", "model.d_model=32", "model.n_heads=2",
        "data.batch_size=8", "data.context=32", "accumulate=off", "trainer.log_every=1", "trainer.checkpoint_every=0",
        "schedule.warmup_steps=10", "hydra.run.dir=out"]
PRESETS = {"fsdp_cp": 4, "hsdp_cp": 8, "fsdp_tp_cp": 8}  # the smallest world where every degree is above 1
# The control: FSDP on 4 ranks without cp, whose distance from one process is the layouts' own spread (under bf16
# the runs part by bf16 rounding in another order, whatever the layout).
CONTROL = {"fsdp": 4}
AMPS = ("off", "bf16")


def train(ranks: int, overrides: list[str], steps: int, cwd: Path) -> tuple[list[dict], float]:
    """The logged steps (loss, grad_norm) of one run in ``cwd``: one process (``ranks=0``) or torchrun, and its wall
    time."""
    cwd.mkdir(parents=True, exist_ok=True)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    subprocess.run([*launcher, "-m", "fxtrain.train", *ARGS, f"trainer.max_steps={steps}",
                    f"trainer.eval_every={steps}", *overrides], cwd=cwd, check=True, capture_output=True, env=env)
    lines = (cwd / "out" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r], time.perf_counter() - t0


def deviations(got: list[dict], ref: list[dict]) -> dict[str, float]:
    """The largest relative distance of ``loss`` and ``grad_norm`` over the steps, and the final loss's."""
    if [r["step"] for r in got] != [r["step"] for r in ref]:
        raise ValueError(f"the runs logged different steps: {[r['step'] for r in got]} vs {[r['step'] for r in ref]}")
    rel = lambda k, g, r: abs(g[k] - r[k]) / abs(r[k])  # noqa: E731
    return {"loss": max(rel("loss", g, r) for g, r in zip(got, ref)),
            "grad_norm": max(rel("grad_norm", g, r) for g, r in zip(got, ref)),
            "final": rel("loss", got[-1], ref[-1])}


NOTE = ("Wall times on the 2-core machine shared with other jobs: not comparable between rows. The `parallel=fsdp` "
        "rows (4 ranks, no cp) are the control: under bf16 its grad_norm parts from one process's as far as the cp "
        "layouts' do (bf16 rounding in another order, from the loss spike near step 45 on), while every loss stays "
        "within the issue's 2e-3.\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fxtrain_context_parallel"), help="the runs' directories")
    _common.add_output_args(ap, HERE)  # results.md
    args = ap.parse_args(argv)
    out = _common.output_dir(ap, args, HERE)
    rows = ["| run | ranks | amp | final loss | max rel. diff loss | max rel. diff grad_norm | wall s |",
            "|---|---|---|---|---|---|---|"]
    for amp in AMPS:
        ref, wall = train(0, [f"amp={amp}"], args.steps, args.work / f"none-{amp}")
        rows.append(f"| one process | 1 | {amp} | {ref[-1]['loss']:.6f} | 0.0e+00 | 0.0e+00 | {wall:.0f} |")
        for preset, ranks in {**PRESETS, **CONTROL}.items():
            got, wall = train(ranks, [f"parallel={preset}", f"amp={amp}"], args.steps, args.work / f"{preset}-{amp}")
            d = deviations(got, ref)
            rows.append(f"| parallel={preset} | {ranks} | {amp} | {got[-1]['loss']:.6f} | {d['loss']:.1e} | "
                        f"{d['grad_norm']:.1e} | {wall:.0f} |")
            print(rows[-1], flush=True)
    body = (f"# Context parallel against one process ({args.steps} steps)\n\n{_common.environment()}\n\n"
            f"Command: `.venv/bin/python experiments/context_parallel/run.py --steps {args.steps}` "
            f"(`{' '.join(ARGS[:-1])}`)\n\n" + "\n".join(rows) + "\n\n" + NOTE)
    print(body)
    if out is not None:
        print("wrote", _common.write_study_results(out, "experiments/context_parallel/run.py", body))


if __name__ == "__main__":
    main()
