"""Every layout into every other (issue 39, item 4): each ``conf/parallel`` preset's checkpoint continued with
``resume_relayout=true`` on every other preset (and from and into one process), from a window's end and from
inside an accumulation window, compared with the uninterrupted run; into experiments/relayout/results.md.

    .venv/bin/python experiments/relayout/run.py --write              # every pair (`make relayout`)
    .venv/bin/python experiments/relayout/run.py --only fsdp,tp,none  # the pairs among these, printed
    .venv/bin/python experiments/relayout/run.py --out DIR --rerun ep_fsdp --write  # DIR's runs kept, but ep_fsdp's

The pairs are generated, not written: the presets are ``conf/parallel/*.yaml`` (tests/test_matrix.py's
``layout``: each on the smallest world in which every degree it sets splits the work, so a pair can change the
world size too: ``3d`` on 8 ranks into ``dp`` on 2), and a new preset enters without editing this file. Each
pair runs the first model both layouts take (the transformer; the MoE where a side has experts), or is listed
as having none. The runs are tests/test_train_resume_layouts.py's relayout config (the tiny LM, float32,
accumulate every 4, 12 steps, a checkpoint every 2): the source trains uninterrupted once on its layout; the
destination continues its checkpoint at step 8 (a window's end) and at step 10 (2 micro-batches' gradient sum
held) and must log what the uninterrupted run logged after it, loss and grad_norm within the layouts' own
float32 spread (``REL``), or refuse in one line before any step (a held sum into a layout that holds its sums in
another form per rank) and write nothing.

Each world size runs its layouts in one gloo world (tests/_worlds.py's spawn): first every source, then every
continuation into that size's layouts; one process's runs are in this process.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import resource
import shutil
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "relayout" / "results.md"
STEPS = ("boundary", "mid")


def _layouts(only: str = "") -> dict:
    """``{name: Layout}``: every preset (tests/test_matrix.py's registry) and ``none``, optionally restricted."""
    from tests import test_matrix as m

    names = [*m.presets("parallel")] + ([] if "none" in m.presets("parallel") else ["none"])
    keep = {n for n in only.split(",") if n}
    return {n: m.layout(n) for n in names if not keep or n in keep}


def _pairs(layouts: dict) -> list[tuple[str, str]]:
    return [(s, d) for s in layouts for d in layouts if s != d]


def _model(taken: dict, src: str, dst: str) -> str | None:
    """The first model both layouts take (tests/test_train_resume_layouts.py's MODELS order)."""
    from tests.test_train_resume_layouts import MODELS

    return next((m for m in MODELS if taken.get(f"{m}/{src}") is True and taken.get(f"{m}/{dst}") is True), None)


def _deviation(got: list[dict], want: list[dict]) -> tuple[float, float]:
    """The largest relative difference of loss and of grad_norm, step by step (``inf`` if the steps differ)."""
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return float("inf"), float("inf")
    return tuple(max((abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want)), default=0.0)
                 for k in ("loss", "grad_norm"))


def _kept(out: pathlib.Path, rerun: set, *names: str) -> bool:
    """Whether a run of an earlier call with the same ``--out`` stands (its log is there, no side is rerun)."""
    return (out / "metrics.jsonl").exists() and not rerun & set(names)


def _fresh(out: pathlib.Path) -> None:
    """An earlier call's run there (of a rerun layout) removed, by the first rank, before any rank starts."""
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _train_sources(layouts: dict, root: pathlib.Path, world: int, train, rerun: set = frozenset()) -> dict:
    """Trains every model on every layout of this world size (uninterrupted, a checkpoint every 2 steps);
    ``{model/layout: True | the refusal}``."""
    from fxtrain.errors import ConfigError
    from tests.test_train_resume_layouts import MODELS, RELAYOUT, _args

    taken = {}
    for name, lay in layouts.items():
        if lay.world != world:
            continue
        for model in MODELS:
            run = root / "src" / model / name
            if _kept(run, rerun, name) and (run / "summary.json").exists():
                taken[f"{model}/{name}"] = True
                continue
            try:
                _fresh(root / "src" / model / name)
                train(root / "src" / model / name, *_args(*RELAYOUT, *lay.overrides, f"model={model}"))
                taken[f"{model}/{name}"] = True
            except ConfigError as e:  # the layout does not take this model (no TP plan, no experts)
                taken[f"{model}/{name}"] = str(e).splitlines()[0]
    return taken


def _continue_into(layouts: dict, taken: dict, root: pathlib.Path, world: int, train,
                   rerun: set = frozenset()) -> dict:
    """Every source's checkpoints continued on each layout of this world size; ``{src->dst@step: verdict}``."""
    import torch

    from fxtrain.errors import ConfigError
    from tests.test_train_resume_layouts import BOUNDARY, MID, REL, RELAYOUT, _args, _records

    verdicts = {}
    for src, dst in _pairs(layouts):
        if layouts[dst].world != world:
            continue
        model = _model(taken, src, dst)
        if model is None:
            verdicts[f"{src}->{dst}"] = {"kind": "no model", "detail": "no model both layouts take"}
            continue
        source = root / "src" / model / src
        want_all = [r for r in _records(source) if "loss" in r]
        for label, step in zip(STEPS, (BOUNDARY, MID)):
            out = root / "to" / model / f"{src}-{dst}-{step}"
            args = [*_args(*RELAYOUT, *layouts[dst].overrides, f"model={model}"), "resume_relayout=true",
                    f"resume={source / 'checkpoints' / f'step_{step:07d}'}"]
            key = f"{src}->{dst}@{label}"
            try:
                if not _kept(out, rerun, src, dst):
                    _fresh(out)
                    train(out, *args)
            except ConfigError as e:
                written = (out / "metrics.jsonl").exists()
                verdicts[key] = {"kind": "FAILS" if written else "refused", "model": model,
                                 "detail": ("wrote metrics before refusing: " if written else "") + str(e)}
                continue
            except Exception:  # noqa: BLE001 - a traceback is a finding, recorded, not a stop of the study
                verdicts[key] = {"kind": "FAILS", "model": model, "detail": traceback.format_exc()[-600:]}
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()
                continue
            got = [r for r in _records(out) if "loss" in r]
            loss, norm = _deviation(got, [r for r in want_all if r["step"] > step])
            verdicts[key] = {"kind": "holds" if max(loss, norm) <= REL else "FAILS", "model": model,
                             "loss": loss, "grad_norm": norm}
    return verdicts


def _world_train(root: pathlib.Path):
    def train(out: pathlib.Path, *args: str) -> None:
        from tests.test_train_resume_layouts import _train

        _train(out, *args)

    return train


def _one_train(out: pathlib.Path, *args: str) -> None:
    from hydra.core.global_hydra import GlobalHydra

    from fxtrain import train as runner
    from tests._runner import cfg_of

    GlobalHydra.instance().clear()
    runner.train(cfg_of(*args), out)


def worker(rank: str, world: str, port: str, out_dir: str, phase: str, root: str, only: str, rerun: str) -> None:
    """A rank of one world size: ``phase`` ``train`` (the sources) or ``continue`` (into this size's layouts)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tests import _worlds

    rank_, world_, root_ = int(rank), int(world), pathlib.Path(root)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank_, world_size=world_,
                            timeout=timedelta(seconds=120))
    _worlds.OUT_DIR = root_
    layouts, rerun_ = _layouts(only), {n for n in rerun.split(",") if n}
    if phase == "train":
        out = _train_sources(layouts, root_, world_, _world_train(root_), rerun_)
    else:
        out = _continue_into(layouts, json.loads((root_ / "taken.json").read_text()), root_, world_,
                             _world_train(root_), rerun_)
    with open(os.path.join(out_dir, f"rank{rank_}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="the layouts whose pairs run, e.g. 'fsdp,tp,none'")
    ap.add_argument("--out", default=None, help="where the runs go (default: a fresh temporary directory)")
    ap.add_argument("--rerun", default="", help="with --out: the layouts whose runs of an earlier call are run "
                    "again (after a change to them); the others' are kept")
    ap.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--timeout", type=float, default=5400, help="seconds per world and phase")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from tests import _worlds

    torch.set_num_threads(1)
    root = pathlib.Path(args.out or tempfile.mkdtemp(prefix="relayout-"))
    root.mkdir(parents=True, exist_ok=True)
    layouts = _layouts(args.only)
    worlds = sorted({lay.world for lay in layouts.values() if lay.world > 1})
    start, wall, crashes = time.time(), {}, {}
    rerun = {n for n in args.rerun.split(",") if n}
    taken = _train_sources(layouts, root, 1, _one_train, rerun)
    entry = [str(pathlib.Path(__file__).resolve()), "worker"]
    for phase in ("train", "continue"):
        if phase == "continue":
            (root / "taken.json").write_text(json.dumps(taken))
        results = {}
        for world in worlds:
            t = time.time()
            print(f"{phase}: world {world}", flush=True)
            out_dir = root / f"{phase}{world}"
            out_dir.mkdir(exist_ok=True)
            res = _worlds._spawn(entry, world, out_dir, args.timeout, [phase, str(root), args.only, args.rerun])
            crashes.update({f"{phase} world {world}": r["__crash__"] for r in res if "__crash__" in r})
            results.update(next((r for r in res if "__crash__" not in r), {}))
            wall[f"{phase} {world}"] = time.time() - t
        if phase == "train":
            taken.update(results)
    verdicts = _continue_into(layouts, taken, root, 1, _one_train, rerun)
    verdicts.update(results)
    total = time.time() - start
    cpu = sum(_cpu(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    counts = collections.Counter(v["kind"] for v in verdicts.values())
    for key, v in sorted(verdicts.items()):
        print(f"{key:32s} {_cell(v)}", flush=True)
    print(f"{len(verdicts)} continuations: " + ", ".join(f"{n} {k}" for k, n in counts.items())
          + f"; {total:.0f} s wall, {cpu:.0f} CPU s")
    for where, text in crashes.items():
        print(f"CRASH {where}: {text[-800:]}")
    if args.write:
        RESULTS.write_text(table(layouts, taken, verdicts, counts, args, total, cpu, wall, crashes))
        print(f"wrote {RESULTS}")
    return 1 if crashes or counts["FAILS"] else 0


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _cell(v: dict) -> str:
    if v["kind"] == "holds":
        return f"holds {max(v['loss'], v['grad_norm']):.1e}"
    if v["kind"] == "FAILS" and "loss" in v:
        return f"**FAILS** loss {v['loss']:.1e}, grad_norm {v['grad_norm']:.1e}"
    return v["kind"] if v["kind"] != "FAILS" else "**FAILS** " + v["detail"].strip().splitlines()[-1][:120]


def table(layouts: dict, taken: dict, verdicts: dict, counts, args, total: float, cpu: float, wall: dict,
          crashes: dict) -> str:
    """results.md: the command, the counts, the refusals, then one table per resume point (source rows,
    destination columns)."""
    from tests.test_train_resume_layouts import BOUNDARY, MID, REL, RELAYOUT

    command = "make relayout" if not args.only else f"python experiments/relayout/run.py --write --only {args.only}"
    names = list(layouts)
    lines = [
        "# Every layout into every other (experiments/relayout/run.py)",
        "",
        f"Command: `{command}`; run on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{total:.0f} s wall on this machine's 2 CPU cores ({cpu:.0f} CPU s; gloo worlds by phase and size, wall s: "
        + ", ".join(f"{k}: {v:.0f}" for k, v in wall.items()) + ").",
        "",
        f"**{len(verdicts)} continuations of {len(_pairs(layouts))} ordered pairs: "
        + ", ".join(f"{counts[k]} {k}" for k in ("holds", "refused", "no model", "FAILS")) + ".**"
        + (f" Crashed worlds: {', '.join(crashes)}." if crashes else ""),
        "",
        "Layouts (each on the smallest world in which every degree its preset sets splits the work): "
        + ", ".join(f"`{n}` {lay.world}" for n, lay in layouts.items()) + ".",
        f"Every run: `{' '.join(RELAYOUT)}`. The source trains uninterrupted; the destination resumes its checkpoint "
        f"at step {BOUNDARY} (a window's end, `boundary`) or {MID} (inside a window, 2 micro-batches' gradient sum "
        f"held, `mid`) with `resume_relayout=true`. `holds x`: the largest relative difference (loss, grad_norm) "
        f"from the uninterrupted run's steps after it, within {REL:g} (the layouts' own float32 spread); "
        "`refused`: one line before any step, nothing written; `no model`: no model both layouts take.",
        "",
    ]
    refused = collections.defaultdict(list)
    for key, v in verdicts.items():
        if v["kind"] == "refused":
            why = v["detail"].split(", which ", 1)[-1].split(";")[0] if "inside an" in v["detail"] else v["detail"]
            refused[why[:160]].append(key)
    if refused:
        lines += ["## Refused", "", "| why (the refusal's words) | continuations |", "| --- | --- |"]
        lines += [f"| {why.replace('|', '/')} | {len(keys)}: {', '.join(sorted(keys)[:5])}"
                  f"{' ...' if len(keys) > 5 else ''} |"
                  for why, keys in sorted(refused.items(), key=lambda x: -len(x[1]))]
        lines.append("")
    models = [f"`{k}`: {v}" for k, v in sorted(taken.items()) if v is not True]
    if models:
        lines += ["Models a layout refuses (so its pairs run the other model): " + "; ".join(models) + ".", ""]
    for label in STEPS:
        lines += [f"## From step {BOUNDARY if label == 'boundary' else MID} ({label})", "",
                  "| from \\ into | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
        for src in names:
            cells = []
            for dst in names:
                v = verdicts.get(f"{src}->{dst}@{label}", verdicts.get(f"{src}->{dst}"))
                cells.append("" if v is None else _cell(v).replace("|", "/"))
            lines.append(f"| **{src}** | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.path.insert(0, str(ROOT))
        worker(*sys.argv[2:])
    else:
        sys.exit(main())
