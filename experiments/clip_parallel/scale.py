"""The seeds' scale study: does naive clipping fail under TP, PP, FSDP x TP and EP? fxtrain's clip vs torch's.

One tiny byte LM (``fxtrain.models.TransformerLM``; its MoE variant for EP) trained for ``--steps`` steps
under torchrun on gloo in four layouts, each twice from the same init on the same batches: once with
fxtrain's path for the layout and ``clip_by_global_norm``, once with ``torch.nn.utils.clip_grad_norm_`` as
users write it there (``_scale_rank.py`` says exactly what each does). Every step, rank 0 computes the
loss and the gradient norm a single float64 process gets for the same params on the same whole batch;
this script also trains the same model in one process (the reference curves), then writes the table
(``results.md``) and the figure (``scale.png``)::

    .venv/bin/python experiments/clip_parallel/scale.py      # all four layouts, 60 steps (~2.5 min on 2 cores)
    .venv/bin/python experiments/clip_parallel/scale.py --only tp pp --steps 20 --out /tmp/clip
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))
import _common  # noqa: E402 - experiments/bench/_common.py: free port, markdown table, results header
import _scale_rank as ranks  # noqa: E402 - the model, the batches, the float64 truth, the layouts

CASES = [  # (layout, title)
    ("tp", "TP"),
    ("pp", "PP"),
    ("fsdp_tp", "FSDP x TP"),
    ("ep", "EP (MoE)"),
]
WHAT_TORCH_DOES = {
    "tp": "one call for the DTensor params, one for the plain ones",
    "pp": "one call per stage, on its params",
    "fsdp_tp": "one call per mesh (params on dp x tp, params on dp)",
    "ep": "one call per rank, on its local grads (dense ones averaged, its own experts)",
}
TOL = 1e-5  # float32 rounding of a norm summed over ~60k elements, relative: "equal to the true norm"


def run_layout(layout: str, steps: int, out: Path) -> dict:
    """``torchrun --nproc-per-node N _scale_rank.py --layout L``; rank 0's JSON."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [str(torchrun), "--nproc-per-node", str(ranks.LAYOUTS[layout]), "--master-port", str(_common.free_port()),
           str(HERE / "_scale_rank.py"), "--layout", layout, "--steps", str(steps), "--out", str(out)]
    for attempt in (1, 2):  # a gloo rank of a loaded machine rarely aborts (SIGABRT): rerun once, loudly
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not done.returncode:
            return json.loads(out.read_text())
        print(f"scale.py: the {layout} run failed (attempt {attempt}):\n{done.stderr[-3000:]}", file=sys.stderr)
    raise SystemExit(f"scale.py: the {layout} run failed twice: {' '.join(cmd)}")


def ratios(variant: dict, j: int) -> list[float]:
    """The ``j``-th norm the variant clipped with at every step, divided by that step's true norm."""
    return [step[j] / t for step, t in zip(variant["reported"], variant["true_norm"])]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def table(results: dict, refs: dict) -> str:
    """One row per norm a clip used (fxtrain: one; torch: one per call, per rank where they differ)."""
    rows = []
    for layout, title in CASES:
        if layout not in results:
            continue
        res, ref = results[layout], refs[layout]
        for name, v in res["variants"].items():
            off = sum(any(abs(n / t - 1) > TOL for n in step) for step, t in zip(v["reported"], v["true_norm"]))
            gap = max(rel(a, b) for a, b in zip(v["loss"], ref["loss"]))
            drift = "n/a (stages)" if v["replica_drift"] is None else f"{v['replica_drift']:.1e}"
            for j, label in enumerate(v["labels"]):
                r = ratios(v, j)
                first = j == 0
                rows.append([f"{title}, {res['ranks']} ranks" if first else "",
                             ("fxtrain `clip_by_global_norm`" if name == "fxtrain" else
                              f"torch `clip_grad_norm_`: {WHAT_TORCH_DOES[layout]}") if first else "",
                             label, f"{min(r):.4f}", f"{statistics.median(r):.4f}", f"{max(r):.4f}",
                             f"{off} / {len(v['loss'])}" if first else "",
                             f"{v['loss'][-1]:.4f} ({ref['loss'][-1]:.4f})" if first else "",
                             f"{rel(v['loss'][-1], ref['loss'][-1]):.1e}" if first else "",
                             f"{gap:.1e}" if first else "", drift if first else ""])
    head = ["layout", "clip", "norm", "norm / true: min", "median", "max", f"steps off by > {TOL:g}",
            "final loss (1 process)", "rel. diff", "max rel. loss gap", "replica drift"]
    return _common.table(head, rows)


def plot(results: dict, refs: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(k, t) for k, t in CASES if k in results]
    fig, axes = plt.subplots(3, len(shown), figsize=(4.6 * len(shown), 11), squeeze=False, sharex=True)
    reds = ["tab:red", "tab:orange", "tab:purple", "tab:brown"]
    for col, (layout, title) in enumerate(shown):
        res, ref = results[layout], refs[layout]
        fx, th = res["variants"]["fxtrain"], res["variants"]["torch"]
        top, middle, bottom = axes[0, col], axes[1, col], axes[2, col]
        steps = range(len(ref["loss"]))
        top.plot(steps, ref["loss"], color="black", lw=2.5, alpha=0.35, label="1 process (fxtrain clip)")
        top.plot(steps, fx["loss"], color="tab:blue", lw=1.2, label=f"{res['ranks']} ranks, fxtrain clip")
        top.plot(steps, th["loss"], color="tab:red", lw=1.2, ls="--",
                 label=f"{res['ranks']} ranks, torch clip_grad_norm_")
        top.set_title(f"{title}, {res['ranks']} ranks")
        top.set_ylabel("training loss (float64, whole batch)")
        top.legend(fontsize=8)
        middle.axhline(0.0, color="black", lw=0.8)
        middle.plot(steps, [a - b for a, b in zip(fx["loss"], ref["loss"])], color="tab:blue", lw=1.5,
                    label="fxtrain clip")
        middle.plot(steps, [a - b for a, b in zip(th["loss"], ref["loss"])], color="tab:red", lw=1.2, ls="--",
                    label="torch clip_grad_norm_")
        middle.set_ylabel("loss minus the 1-process loss")
        middle.legend(fontsize=8)
        bottom.axhline(1.0, color="black", lw=0.8)
        bottom.plot(steps, [s[0] / t for s, t in zip(fx["reported"], fx["true_norm"])], color="tab:blue", lw=1.5,
                    label="fxtrain: grad_norm")
        for j, label in enumerate(th["labels"]):
            bottom.plot(steps, [s[j] / t for s, t in zip(th["reported"], th["true_norm"])], color=reds[j % len(reds)],
                        lw=1, ls="--", marker=".", ms=3, label=f"torch: {label}")
        bottom.set_ylim(0, max(1.15, 1.05 * max(s[j] / t for s, t in zip(th["reported"], th["true_norm"])
                                                for j in range(len(th["labels"])))))
        bottom.set_xlabel("step")
        bottom.set_ylabel("norm clipped with / true global norm")
        bottom.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Clipping at {ranks.CLIP} (active every step), SGD lr {ranks.LR} momentum {ranks.MOM}: "
                 "the norm each clip uses, and the loss it trains to", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def notes(results: dict) -> str:
    lines = []
    for layout, title in CASES:
        if layout in results:
            v = results[layout]["variants"]["torch"]
            said = v["notes"].get("clip_grad_norm_")
            if said:
                true = "" if "raises" in said else f" (true norm {v['true_norm'][0]:.6g})"
                lines.append(f"- {title}: `clip_grad_norm_(model.parameters(), ...)` {said}{true}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="training steps per run")
    ap.add_argument("--only", nargs="*", choices=[k for k, _ in CASES], help="layouts to run (default: all)")
    _common.add_output_args(ap, HERE)  # results.md and scale.png
    args = ap.parse_args(argv)
    args.out = _common.output_dir(ap, args, HERE)
    t0 = time.perf_counter()
    layouts = [k for k, _ in CASES if not args.only or k in args.only]
    dense = ranks.reference_run(0, args.steps) if set(layouts) - {"ep"} else None
    refs = {k: ranks.reference_run(ranks.EXPERTS, args.steps) if k == "ep" else dense for k in layouts}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            start = time.perf_counter()
            results[layout] = run_layout(layout, args.steps, Path(tmp) / f"{layout}.json")
            results[layout]["seconds"] = time.perf_counter() - start
    seconds = time.perf_counter() - t0
    floor = max(abs(n / t - 1) for ref in refs.values() for s, t in zip(ref["reported"], ref["true_norm"]) for n in s)
    body = "\n".join([
        "# Clipping under TP, PP, FSDP x TP and EP: the norm each clip uses vs the true global norm\n",
        _common.environment(),
        f"- command: `.venv/bin/python experiments/clip_parallel/scale.py --steps {args.steps}"
        + (f" --only {' '.join(layouts)}" if args.only else "") + f"` ({seconds:.0f} s: "
        + ", ".join(f"{k} {r['seconds']:.0f} s" for k, r in results.items()) + ", the rest the 1-process runs)",
        f"- model: TransformerLM(vocab {ranks.V}, context {ranks.T}, d_model {ranks.D}, {ranks.LAYERS} layers, "
        f"{ranks.HEADS} heads; EP: {ranks.EXPERTS} experts, top-2), head untied, float32; batch {ranks.BATCH} x "
        f"{ranks.T} bytes of the stdlib; clip {ranks.CLIP}, SGD lr {ranks.LR} momentum {ranks.MOM}",
        f"- true norm: float64, one process, the run's own params gathered before each step, whole batch; the "
        f"1-process float32 run's own grad_norm is within {floor:.1e} of it\n",
        table(results, refs),
        "",
        "What one `clip_grad_norm_` call over all params does at step 0:",
        "",
        notes(results),
        "",
        "![loss curves and norm ratios](scale.png)",
    ])
    print(body)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, refs, args.out / "scale.png")
    print("wrote", _common.write_study_results(args.out, "experiments/clip_parallel/scale.py", body))
    return results


if __name__ == "__main__":
    main()
