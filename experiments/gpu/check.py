"""``make gpu-check``: fxtrain measured on a CUDA GPU in one command (budget: 8 minutes on one GPU).

1. **Tests**: ``pytest -m cuda tests/test_cuda.py``: the fused adam/adamw/sgd kernels against torch.optim's
   ``fused=True`` and the pure update, amp fp16 step for step against ``torch.autocast`` + ``GradScaler``, bf16,
   the compiled step, the runner's step without host syncs, the vmapped sweep against the basic launcher.
2. **The seeds' AMP table** (``experiments/amp/compare.py --experiment``, its code, not a copy): ``off``,
   torch-amp ``fp16`` with GradScaler's rule, ``bf16``, ``naive_fp16``, ``pure_bf16`` on the ResNet and tiny
   LM experiments sized for a GPU (the overrides are in the table): CUDA peak memory, ms per step, loss.
3. **The vmapped-sweep speedup** (``experiments/bench/sweep.py``'s commands and timing): 8 learning rates x 200
   steps of the default experiment on the GPU, ``hydra/launcher=basic`` against ``hydra/launcher=vmap``.

Writes ``experiments/gpu/results/gpu_check.md`` (``--out DIR``: there instead; ``--no-write``: print only).
Without a CUDA device it prints one line and exits 0, which is what CI sees. Exit code 1 when a test failed.

Usage:
    make gpu-check
    .venv/bin/python experiments/gpu/check.py --phases amp,sweep --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import functools
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py (torch and the standard library only)
RESULTS = HERE / "results"
PHASES = ("tests", "amp", "sweep")
PRESETS = ["off", "fp16", "bf16", "naive_fp16", "pure_bf16"]  # the seeds' tutorial's rows
BUDGET_S = 480


class Sizes(NamedTuple):
    """What each phase runs: the AMP experiments (name -> Hydra overrides), steps and timing rounds per preset,
    the sweep's grid (after ``trainer.device``) and its steps per job."""

    experiments: dict[str, list[str]]
    steps: int
    rounds: int
    sweep: list[str]
    sweep_steps: int


@functools.cache
def _load(path: str):
    """A script of experiments/ (not a package) as a module, loaded once the check runs (CI's skip imports
    nothing but torch)."""
    spec = importlib.util.spec_from_file_location("gpu_check_" + Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compare():
    return _load("experiments/amp/compare.py")  # the AMP study (it puts experiments/bench on sys.path)


def _bench_sweep():
    return _load("experiments/bench/sweep.py")


def sizes(cpu_fallback: bool) -> Sizes:
    """The GPU's sizes, or toy sizes for ``--cpu-fallback`` (the same code paths on the CPU, for this script's
    tests; never a result)."""
    if cpu_fallback:
        return Sizes(
            experiments={"resnet_baseline": ["model.width=4", "data.batch_size=16"],
                         "tiny_lm": ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "data.context=16",
                                     "data.batch_size=4", "data.max_bytes=20000"]},
            steps=3, rounds=1, sweep=["experiment=smoke", "optim.chain.adamw.learning_rate=1e-3,3e-3"], sweep_steps=3)
    return Sizes(
        experiments={
            # The ResNet tutorial's model and stack (SGD 0.9, wd 5e-4, cosine) on CIFAR-sized inputs: the 8x8
            # digits leave a GPU idle, and an idle GPU shows no precision's cost or gain.
            "resnet_baseline": ["data=synthetic", "data.input_shape=[3,32,32]", "data.num_examples=8192",
                                "data.batch_size=256", "model.width=64"],
            # The tiny LM's stack (accumulate(4), clip + AdamW, warmup-cosine) with GPT-2-small-like blocks.
            "tiny_lm": ["model.d_model=512", "model.n_layers=6", "model.n_heads=8", "data.context=256",
                        "data.batch_size=32"],
        },
        steps=200, rounds=20, sweep=[_bench_sweep().LRS], sweep_steps=200)


# --- 1. tests --------------------------------------------------------------------------------------------

def run_tests(timeout: float = 300) -> dict:
    """``pytest -m cuda tests/test_cuda.py`` in a fresh process: counts, failures, seconds."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfE", "--tb=short", "-m", "cuda",
           "tests/test_cuda.py"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines() or [""]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                                     lines[-1])}
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if proc.returncode not in (0, 1) and not failures:  # pytest itself failed (collection, usage)
        failures = [f"pytest exited with {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}"]
    return {"command": "pytest -m cuda tests/test_cuda.py", "counts": counts, "failures": failures,
            "seconds": time.perf_counter() - t0, "ok": proc.returncode == 0, "log": proc.stdout + proc.stderr}


# --- 2. the AMP table ------------------------------------------------------------------------------------

def amp_rows(device: str, sizes: Sizes, presets: list[str]) -> list[dict]:
    """Every preset on every experiment: compare.py's measurement, each experiment's presets in one process."""
    rows = []
    for experiment, overrides in sizes.experiments.items():
        argv = ["--experiment", experiment, "--device", device, "--steps", str(sizes.steps), "--rounds",
                str(sizes.rounds), "--presets", ",".join(presets), "--in-process", "--no-write",
                *(f"--override={o}" for o in overrides)]
        compare = _compare()
        args = compare.parser().parse_args(argv)
        runs, speed, _ = compare.measure(args, argv)
        base = speed[presets[0]]["median"]
        rows += [{"experiment": experiment, "overrides": overrides, "preset": name, "params": runs[name]["params"],
                  **runs[name], "ms": speed[name], "vs_base": base / speed[name]["median"]} for name in presets]
    return rows


# --- 3. the vmapped sweep ----------------------------------------------------------------------------------

def sweep_rows(device: str, sizes: Sizes) -> dict:
    """One sweep with each launcher (bench/sweep.py's command and run): wall and train seconds, speedups,
    and the largest difference of a job's final loss or test_loss between them."""
    bench_sweep = _bench_sweep()
    grid = [*sizes.sweep, f"trainer.device={device}"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for launcher in bench_sweep.LAUNCHERS:
            cmd = bench_sweep.command(launcher, grid, sizes.sweep_steps, Path(tmp) / launcher)
            out[launcher] = bench_sweep.run(cmd, Path(tmp))  # (wall s, train s, {job: summary.json})
    basic, vmap = out["basic"], out["vmap"]
    diff = max(abs(s["metrics"][k] - vmap[2][job]["metrics"][k]) for job, s in basic[2].items()
               for k in ("test_loss", "loss"))
    return {"grid": grid, "steps": sizes.sweep_steps, "jobs": len(basic[2]), "diff": diff,
            "rows": [[la, out[la][0], out[la][1], f"{basic[0] / out[la][0]:.2f}x", f"{basic[1] / out[la][1]:.2f}x"]
                     for la in bench_sweep.LAUNCHERS]}


# --- the report ------------------------------------------------------------------------------------------

def report(device: str, results: dict, seconds: dict[str, float], command: str, errors: dict[str, str]) -> str:
    """The markdown report: the machine, the tests' line, the AMP table, the sweep table, and any phase's error."""
    compare = _compare()
    total = sum(seconds.values())
    if device == "cuda":
        machine = (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, torch {torch.__version__}")
    else:
        machine = f"CPU fallback (toy sizes, a check of the script, not a result), torch {torch.__version__}"
    parts = [f"# fxtrain on a GPU: `make gpu-check`",
             f"Command: `{command}`. {machine}. Total {total:.0f} s "
             f"({', '.join(f'{k} {v:.0f} s' for k, v in seconds.items())}; budget {BUDGET_S} s"
             + (", **over budget**" if total > BUDGET_S else "") + ")."]
    if "tests" in results:
        t = results["tests"]
        counts = ", ".join(f"{n} {w}" for w, n in t["counts"].items()) or "no tests ran"
        parts.append(f"Tests: `{t['command']}`: {counts} in {t['seconds']:.0f} s."
                     + "".join(f"\n- {line}" for line in t["failures"]))
    if "amp" in results:
        rows = results["amp"]
        base = rows[0]["preset"]
        table = _common.table(
            ["experiment", "preset", "seeds' name", "params", "CUDA peak MiB", "ms/step (median, IQR)", f"vs {base}",
             "final train loss", "test loss", "skipped", "final scale"],
            [[r["experiment"], f"`{r['preset']}`", compare.SEEDS_NAME.get(r["preset"], ""), f"{r['params']:,}",
              "" if r["cuda_peak_mib"] is None else r["cuda_peak_mib"],
              f"{r['ms']['median']:.2f} ({r['ms']['q1']:.2f}-{r['ms']['q3']:.2f})", r["vs_base"],
              f"{r['final_train_loss']:.4f}", f"{r['test_loss']:.4f}", r["skipped"], f"{r['final_scale']:g}"]
             for r in rows])
        shown = {r["experiment"]: r["overrides"] for r in rows}
        steps = results["amp_steps"]
        parts.append("The seeds' AMP table (`experiments/amp/compare.py --experiment NAME --in-process`): each "
                     f"preset trains {steps} steps as `python -m fxtrain.train experiment=NAME amp=PRESET` builds "
                     "it, one preset after another in one process (CUDA peak: `torch.cuda.max_memory_allocated` "
                     "from the preset's build to its last step); ms/step: all presets interleaved, median and "
                     f"quartiles; `vs {base}` > 1 is faster; final train loss: mean of the last 20 steps; test "
                     "loss: the runner's evaluation.\n\n" + table + "\n\nOverrides: "
                     + "; ".join(f"{e}: `{' '.join(o)}`" for e, o in shown.items()))
    if "sweep" in results:
        s = results["sweep"]
        parts.append(f"The vmapped sweep (`experiments/bench/sweep.py`'s command): `python -m fxtrain.train -m "
                     f"hydra/launcher=<basic|vmap> {' '.join(s['grid'])} trainer.max_steps={s['steps']}`, "
                     f"{s['jobs']} jobs, one run each; max |diff| of a job's final loss or test_loss between the "
                     f"launchers: {s['diff']:.1e}.\n\n"
                     + _common.table(["launcher", "wall s", "train s", "wall speedup", "train speedup"], s["rows"]))
    parts += [f"**The {phase} phase failed**: {error}" for phase, error in errors.items()]
    parts.append(_common.environment())
    return "\n\n".join(parts) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", type=lambda s: s.split(","), default=list(PHASES),
                   help=f"comma list of {', '.join(PHASES)} (default: all)")
    p.add_argument("--presets", type=lambda s: s.split(","), default=PRESETS, help="amp presets, the first the baseline")
    p.add_argument("--out", type=Path, help=f"write gpu_check.md there (default: {RESULTS.relative_to(ROOT)}/)")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--cpu-fallback", action="store_true",
                   help="run on the CPU at toy sizes (a check of this script for its tests; needs --out or --no-write)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        p.error(f"--phases {','.join(args.phases)}: {', '.join(unknown)} is not a phase; choose from {', '.join(PHASES)}")
    if not args.cpu_fallback and not torch.cuda.is_available():
        why = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"gpu-check: skipped, no CUDA device here ({why} {torch.__version__})")
        return 0
    if args.cpu_fallback and args.out is None and not args.no_write:
        p.error("--cpu-fallback measures toy sizes on the CPU: pass --out DIR or --no-write (it never replaces "
                f"{RESULTS.relative_to(ROOT)}/)")
    device, sized = ("cpu", sizes(True)) if args.cpu_fallback else ("cuda", sizes(False))
    results: dict = {}
    seconds: dict[str, float] = {}
    errors: dict[str, str] = {}
    for phase in [ph for ph in PHASES if ph in args.phases]:
        t0 = time.perf_counter()
        print(f"gpu-check: {phase} ...", file=sys.stderr, flush=True)
        try:
            if phase == "tests":
                results["tests"] = run_tests()
            elif phase == "amp":
                results["amp"], results["amp_steps"] = amp_rows(device, sized, args.presets), sized.steps
            else:
                results["sweep"] = sweep_rows(device, sized)
        except Exception as e:  # noqa: BLE001 - one phase's failure is reported; the others still run
            traceback.print_exc()
            errors[phase] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        seconds[phase] = time.perf_counter() - t0
    text = report(device, results, seconds, shlex.join(["python", "experiments/gpu/check.py", *argv]), errors)
    print(text)
    if not args.no_write:
        out = args.out or RESULTS
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text)
        if results.get("tests", {}).get("failures"):  # the failures' short tracebacks, beside the report
            (out / "gpu_check_tests.log").write_text(results["tests"]["log"])
        print(f"written to {out / 'gpu_check.md'}")
    return 0 if not errors and results.get("tests", {"ok": True})["ok"] else 1

if __name__ == "__main__":
    sys.exit(main())
