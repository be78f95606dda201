"""The runner's parallel layouts against one process: `experiment=tiny_lm amp=off accumulate=off`.

Each layout (a `conf/parallel` preset of degrees) is one `torchrun ... -m fxtrain.train` run (gloo, CPU, one thread per rank) of the same config
as the single-process run; the table gives each final loss, its relative distance from the single-process
one (the issue's acceptance: within 2e-3 after 100 steps) and the wall time. Usage::

    .venv/bin/python experiments/strategies/run.py                 # 100 steps, writes results.md here
    .venv/bin/python experiments/strategies/run.py --steps 20 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402

RUNS = [  # (label, torchrun ranks or 0 for one process, overrides)
    ("one process", 0, []),
    ("parallel=dp", 2, ["parallel=dp"]),
    ("parallel=fsdp", 2, ["parallel=fsdp"]),
    ("parallel=tp", 2, ["parallel=tp"]),
    ("parallel=pp", 2, ["parallel=pp"]),
    ("parallel=fsdp_tp (dp_shard=2 x tp=2)", 4, ["parallel=fsdp_tp"]),
    ("parallel=hsdp (dp_replicate=2 x dp_shard=2)", 4, ["parallel=hsdp"]),
    ("parallel=pp_fsdp (pp=2 x dp_shard=2)", 4, ["parallel=pp_fsdp"]),
    ("parallel=pp_tp (pp=2 x tp=2)", 4, ["parallel=pp_tp"]),
    ("parallel=3d (pp=2 x dp_shard=2 x tp=2)", 8, ["parallel=3d"]),
    ("model=moe (one process)", 0, ["model=moe"]),
    ("parallel=ep model=moe", 2, ["parallel=ep", "model=moe"]),
    ("parallel=ep_fsdp model=moe (ep=2 x dp_shard=2)", 4, ["parallel=ep_fsdp", "model=moe"]),
]


def run(ranks: int, overrides: list[str], steps: int, cwd: Path) -> tuple[dict, float]:
    args = ["experiment=tiny_lm", "amp=off", "accumulate=off", f"trainer.max_steps={steps}",
            "trainer.checkpoint_every=0", "hydra.run.dir=out", *overrides]
    launcher = ([str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={ranks}"]
                if ranks else [sys.executable])
    t0 = time.perf_counter()
    subprocess.run([*launcher, "-m", "fxtrain.train", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads((cwd / "out" / "summary.json").read_text())["metrics"], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-write", action="store_true")
    _common.add_output_args(ap, HERE)  # results.md
    args = ap.parse_args(argv)
    out = _common.output_dir(ap, args, HERE)
    rows, ref = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, ranks, overrides) in enumerate(RUNS):
            cwd = Path(tmp) / str(i)
            cwd.mkdir()
            metrics, seconds = run(ranks, overrides, args.steps, cwd)
            base = ref.setdefault("moe" if "moe" in label else "dense", metrics)
            rel = abs(metrics["loss"] - base["loss"]) / base["loss"]
            rows.append([label, ranks or 1, f"{metrics['loss']:.6f}", f"{rel:.1e}", f"{metrics['test_loss']:.4f}",
                         f"{seconds:.0f}"])
    table = _common.table(["run", "ranks", "final train loss", "rel. diff from one process", "test_loss",
                           "wall s"], rows)
    body = (f"# The runner's parallel layouts against one process\n\n{_common.environment()}\n\n"
            f"Command: `.venv/bin/python experiments/strategies/run.py --steps {args.steps}` "
            f"(`experiment=tiny_lm amp=off accumulate=off trainer.max_steps={args.steps}`; the MoE runs are "
            "compared with the one-process MoE run)\n\n" + table + "\n")
    print(body)
    if out is not None:
        print("wrote", _common.write_study_results(out, "experiments/strategies/run.py", body))


if __name__ == "__main__":
    main()
