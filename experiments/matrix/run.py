"""The whole product of tests/test_matrix.py (issue 35): every layout x amp x accumulate x optimizer kind x resume
cell, judged as the test judges it, into experiments/matrix/results.md.

    .venv/bin/python experiments/matrix/run.py --write                         # the whole product (`make matrix`)
    .venv/bin/python experiments/matrix/run.py --only 'parallel=pp,pp_tp;amp=bf16'   # a slice, printed
    .venv/bin/python experiments/matrix/run.py --pairwise                      # make test-all's all-pairs cover

The axes are the registries' (tests/test_matrix.py's module doc). Each world size runs its groups in one gloo
world (tests/_worlds.py, the ranks import tests/test_matrix.py with FXTRAIN_MATRIX=full); the one-process
references, the ``parallel=none`` groups and the relayouts to one process run in this process. ``--write``
writes the table (cell -> holds / refused + why / FAILS + numbers), the counts, the command and the date.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import os
import pathlib
import resource
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "matrix" / "results.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="cells whose values match, e.g. 'parallel=dp,fsdp;amp=bf16'")
    ap.add_argument("--pairwise", action="store_true", help="make test-all's all-pairs cover, not the product")
    ap.add_argument("--out", default=None, help="where the runs go (default: a fresh temporary directory); the "
                    "groups a call with the same --out ran already are not run again")
    ap.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per world (default: the test's)")
    args = ap.parse_args(argv)
    # the ranks import tests/test_matrix.py with this environment: the same cells there
    os.environ["FXTRAIN_MATRIX"] = "pairwise" if args.pairwise else "full"
    os.environ["FXTRAIN_MATRIX_ONLY"] = args.only
    sys.path.insert(0, str(ROOT))
    import json

    import torch

    from tests import _worlds
    from tests import test_matrix as m

    torch.set_num_threads(1)
    handlers = list(logging.getLogger().handlers)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="matrix-"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    script = str(ROOT / "tests" / "test_matrix.py")
    world_s: dict[int, float] = {}
    world_cpu: dict[int, float] = {}
    crashes: dict[int, str] = {}
    for world in sorted({g.world for g in m.GROUPS if g.world > 1}):
        t = time.time()
        n = sum(g.world == world for g in m.GROUPS)
        print(f"world {world}: {n} groups", flush=True)
        res = _worlds.results(script, world, _mkdir(out / f"world{world}"), args.timeout or m.WORLD_TIMEOUT_S)
        crashes.update({world: r["__crash__"] for r in res if "__crash__" in r})
        world_s[world] = time.time() - t
        world_cpu[world] = _cpu(resource.RUSAGE_CHILDREN) - sum(world_cpu.values())
    verdicts = {}
    shutil.rmtree(out / "one", ignore_errors=True)  # the layouts' runs of an earlier call are kept, not these
    one = _mkdir(out / "one")
    root_log = logging.getLogger()
    for cell in m.CELLS:
        for h in root_log.handlers[len(handlers):]:  # each run's train.log handler, once it is done
            h.close()
        del root_log.handlers[len(handlers):]
        group = m.group_of(cell)
        root = out / f"world{group.world}" / group.name if group.world > 1 else one / group.name
        if group.world == 1 and not (root / "result.json").exists():
            m.run_group(group, m.GROUPS[group], root)
        if not (root / "result.json").exists():
            why = crashes.get(group.world, "its world wrote no result").strip().splitlines()
            verdicts[m.cell_id(cell)] = (cell, m.Verdict("FAILS", f"no run: {why[-1][:200] if why else ''}"))
        else:
            runs = json.loads((root / "result.json").read_text())
            verdicts[m.cell_id(cell)] = (cell, m.judge(cell, runs, root, one))
        v = verdicts[m.cell_id(cell)][1]
        print(f"{m.cell_id(cell):45s} {v.kind:8s} {v.detail}", flush=True)
    total_s = time.time() - start
    cpu = {"worlds": sum(world_cpu.values()), "this process": _cpu(resource.RUSAGE_SELF)}
    counts = collections.Counter(v.kind for _, v in verdicts.values())
    print(f"{len(verdicts)} cells: " + ", ".join(f"{counts[k]} {k}" for k in ("holds", "refused", "FAILS"))
          + f" in {total_s:.0f} s; CPU s: {_shown(cpu)}; worlds wall s: {_shown(world_s)}, CPU s: {_shown(world_cpu)}")
    if args.write:
        RESULTS.write_text(table(m, verdicts, counts, args, total_s, world_s, world_cpu, cpu))
        print(f"wrote {RESULTS}")
    return 0


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _shown(d: dict) -> str:
    return ", ".join(f"{k}: {v:.0f}" for k, v in d.items())


def _mkdir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def table(m, verdicts: dict, counts, args, total_s: float, world_s: dict, world_cpu: dict, cpu: dict) -> str:
    """results.md: what ran, the counts, the failing and refused cells, then every group's row."""
    command = "make matrix" if not (args.only or args.pairwise) else (
        "python experiments/matrix/run.py --write" + (" --pairwise" if args.pairwise else "")
        + (f" --only '{args.only}'" if args.only else ""))
    axes = "\n".join(f"| {k} | {len(v)} | {', '.join(map(str, v))} |" for k, v in m.AXES.items())
    tol = ", ".join(f"{a} {m.tolerance(a):.2g}" for a in m.AXES["amp"])
    lines = [
        "# The layout x precision x accumulation x optimizer x resume matrix (tests/test_matrix.py)",
        "",
        f"Command: `{command}`; run on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{total_s:.0f} s wall on this machine's 2 CPU cores, shared with other work; CPU seconds: "
        f"{_shown(cpu)} (gloo worlds by size, wall: {_shown(world_s)}; CPU: {_shown(world_cpu)}).",
        "",
        f"**{len(verdicts)} cells: {counts['holds']} hold, {counts['refused']} refused, {counts['FAILS']} FAIL.**"
        + ("" if not (args.only or args.pairwise) else
           " A slice of the product: " + " ".join(x for x in ("the covering subset" if args.pairwise else "",
                                                               args.only) if x) + "."),
        "",
        "The axes, read from the registries when the test module is imported:",
        "",
        "| axis | count | values |",
        "| --- | --- | --- |",
        axes,
        "",
        "Optimizer kinds: " + "; ".join(f"`{k}` = `{' '.join(v)}`" for k, v in m.OPTIMIZERS.items()) + ".",
        "",
        f"Every run: `{' '.join(m.BASE)}`, {m.STEPS} batches, checkpoint at step {m.MID} (inside every "
        f"accumulation window). Layout worlds: " + ", ".join(f"{k} {v.world}" for k, v in m.LAYOUTS.items()) + ".",
        f"Compared per logged step (loss and grad_norm, relative) with one process in the same amp mode; "
        f"tolerance max({m.F32_FLOOR:g}, {m.K:g} x eps of the compute dtype): {tol}. `killed` must also equal the "
        f"uninterrupted run on its layout bit for bit; `relayout` is compared from step {m.MID + 1}.",
        "",
    ]
    fails = [(i, c, v) for i, (c, v) in verdicts.items() if v.kind == "FAILS"]
    if fails:
        lines += ["## FAILS", "", "| cell | known defect | what |", "| --- | --- | --- |"]
        lines += [f"| {i} | {m.known(c) or '**new**'} | {_cell_text(v.detail)} |" for i, c, v in fails]
        lines.append("")
    refusals = collections.defaultdict(list)
    for i, (c, v) in verdicts.items():
        if v.kind == "refused":
            refusals[v.detail].append(i)
    if refusals:
        lines += ["## Refused (one line, before training)", "", "| refusal | cells |", "| --- | --- |"]
        lines += [f"| {_cell_text(why)} | {len(ids)}: {', '.join(ids[:6])}{' ...' if len(ids) > 6 else ''} |"
                  for why, ids in sorted(refusals.items(), key=lambda kv: -len(kv[1]))]
        lines.append("")
    lines += ["## Every cell", "", "holds: the largest relative difference from one process (loss, grad_norm).", "",
              "| parallel | amp | accumulate | optimizer | " + " | ".join(m.AXES["resume"]) + " |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in m.AXES["resume"]) + " |"]
    rows: dict = {}
    for i, (c, v) in verdicts.items():
        rows.setdefault(m.group_of(c), {})[c["resume"]] = v
    for g, by in rows.items():
        cells = []
        for r in m.AXES["resume"]:
            v = by.get(r)
            cells.append("" if v is None else f"holds {v.deviation:.1e}" if v.kind == "holds"
                         else "refused" if v.kind == "refused" else f"**FAILS** {_cell_text(v.detail)[:90]}")
        lines.append(f"| {g.parallel} | {g.amp} | {g.accumulate} | {g.optimizer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
