"""Re-runs the committed studies into a fresh directory and compares their tables with the committed ones.

    .venv/bin/python experiments/studies.py                      # every study below; `make studies`
    .venv/bin/python experiments/studies.py --only jax_parity --out /tmp/studies
    .venv/bin/python experiments/studies.py --compare-only /tmp/studies   # the comparison of an earlier rerun

Each study runs its README's command with ``--out <dir>/<study>`` (never over the committed results), then
every markdown table of its fresh ``results.md`` is compared cell by cell with the committed one: the text
must be the same (row labels, the **best** marker) and every number within ``ATOL + RTOL * |committed|``,
except in columns or rows of times, speeds and memory, which depend on the machine and its load. Columns or
rows that measure a difference or an error (``abs diff``, ``max relative difference``: what a parity study
is about) are compared by size instead: within a factor ``FACTOR`` of the committed value, or both below
``FLOOR`` (float32 rounding), so 9.4e-5 where 2.4e-7 is committed is a difference however small both are.
A study may declare its own ``Tolerance`` (``TOLERANCES``). The runs are seeded and single-threaded on CPU,
so a rerun on the same code gives the same digits; the tolerance only absorbs float rounding that differs
between CPUs. For lr_sweep, one test digit of one seed moves a mean over 3 seeds by 0.0007, far above it.
Exit status 1 names every cell that differs: re-run the study with ``--write`` (its README says how) and
commit the new results with the command that made them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ATOL, RTOL = 1e-4, 1e-3
FLOOR, FACTOR = 1e-6, 10.0
# Columns (or rows) that measure a difference or an error: compared by size (FLOOR, FACTOR).
ERRORS = re.compile(r"diff|error", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a rerun's numbers must be to the committed ones (the module docstring explains)."""

    atol: float = ATOL
    rtol: float = RTOL
    floor: float = FLOOR    # differences and errors both below it agree (float32 rounding)
    factor: float = FACTOR  # differences and errors above it agree within this factor

    def agree(self, rerun: float, committed: float, error: bool) -> bool:
        """Whether ``rerun`` reproduces ``committed``; ``error``: the cell measures a difference or an error.

        >>> Tolerance().agree(9.4e-5, 2.4e-7, error=True), Tolerance().agree(4.8e-7, 2.4e-7, error=True)
        (False, True)
        >>> Tolerance().agree(0.0764, 0.07639, error=False)
        True
        """
        if not error:
            return abs(rerun - committed) <= self.atol + self.rtol * abs(committed)
        if math.isnan(rerun) or math.isnan(committed):
            return math.isnan(rerun) and math.isnan(committed)
        small, large = sorted((abs(rerun), abs(committed)))
        return large < self.floor or (small > 0 and large <= self.factor * small)


TOLERANCES: dict[str, Tolerance] = {}  # study -> its own tolerance (default: Tolerance())
# Columns (or rows) whose numbers depend on the machine, not on the code: not compared.
MACHINE = re.compile(r"time|wall|\bms\b|us/|it/s|MiB|\bs\)|speed|rounds", re.IGNORECASE)  # not "params"
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")

# study -> commands ({py}: this Python, {out}: the study's fresh directory); each writes {out}/results.md.
STUDIES: dict[str, list[list[str]]] = {
    "lr_sweep": [  # 36 jobs of 300 steps, one process: ~45 s on 2 idle cores
        ["{py}", "-m", "fxtrain.train", "-m", "experiment=lr_sweep", "hydra.sweep.dir={out}/runs"],
        ["{py}", "experiments/lr_sweep/analyze.py", "{out}/runs", "--out", "{out}"],
    ],
    "jax_parity": [["{py}", "experiments/jax_parity/run.py", "--out", "{out}"]],  # ~15 s
    # JAX -> Orbax -> fxtrain and back, against the runs that never crossed: ~20 s
    "interop_roundtrip": [["{py}", "experiments/interop_roundtrip/run.py", "--out", "{out}"]],
    # lightning-hydra-template's MNIST example on digits, seeds 0, 1, 2 in one multirun: ~20 s
    "mnist_port": [["{py}", "experiments/mnist_port/run.py", "--out", "{out}"]],
}


def tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of ``text``: each a list of rows (the header first), each a list of cells."""
    found, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):  # the |---|---| line
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def compare(fresh: str, committed: str, tolerance: Tolerance = Tolerance()) -> list[str]:
    """The differences between the tables of two ``results.md`` texts, one line each (empty: they agree)."""
    new, old = tables(fresh), tables(committed)
    if len(new) != len(old):
        return [f"{len(new)} tables in the rerun, {len(old)} committed"]
    out = []
    for t, (a, b) in enumerate(zip(new, old)):
        if len(a) != len(b) or a[0] != b[0]:
            out.append(f"table {t + 1}: {len(a) - 1} rows with header {a[0]} in the rerun, "
                       f"{len(b) - 1} rows with header {b[0]} committed")
            continue
        header = a[0]
        for row_a, row_b in zip(a[1:], b[1:]):
            for col, (x, y) in enumerate(zip(row_a, row_b)):
                name = header[col] if col < len(header) else str(col)
                if MACHINE.search(name) or MACHINE.search(row_b[0]) or x == y:
                    continue
                error = bool(ERRORS.search(name) or ERRORS.search(row_b[0]))
                xs, ys = [float(v) for v in NUMBER.findall(x)], [float(v) for v in NUMBER.findall(y)]
                same_text = NUMBER.sub("#", x) == NUMBER.sub("#", y)
                if not same_text or len(xs) != len(ys) or not all(tolerance.agree(u, v, error) for u, v in zip(xs, ys)):
                    row = " | ".join(row_b[:max(1, min(col, 3))])  # the row's key columns (lr_sweep: lr, warmup, clip)
                    out.append(f"table {t + 1}, row {row!r}, column {name!r}: {x} (rerun) vs {y} (committed)")
    return out


def run(name: str, out: pathlib.Path) -> float:
    """Runs study ``name`` into ``out``; returns its wall time in seconds."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for command in STUDIES[name]:
        argv = [part.format(py=sys.executable, out=out) for part in command]
        print("$", " ".join(argv), flush=True)
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(STUDIES), help="these studies (default: all)")
    parser.add_argument("--out", type=pathlib.Path, help="the fresh directory (default: a new temporary one)")
    parser.add_argument("--compare-only", type=pathlib.Path, metavar="DIR",
                        help="compare the reruns already in DIR/<study>/results.md; run nothing")
    args = parser.parse_args(argv)
    names = args.only or sorted(STUDIES)
    base = args.compare_only or args.out or pathlib.Path(tempfile.mkdtemp(prefix="fxtrain-studies-"))
    failed = []
    for name in names:
        seconds = None if args.compare_only else run(name, base / name)
        diffs = compare((base / name / "results.md").read_text(),
                        (ROOT / "experiments" / name / "results.md").read_text(), TOLERANCES.get(name, Tolerance()))
        took = f" ({seconds:.0f} s)" if seconds is not None else ""
        print(f"{name}{took}: " + ("reproduces the committed results" if not diffs else
                                   f"{len(diffs)} differences from the committed results"), flush=True)
        for line in diffs:
            print("   ", line)
        failed += [name] * bool(diffs)
    print(f"reruns in {base}; tolerance {ATOL:g} + {RTOL:g} x |committed|, differences and errors within a factor "
          f"{FACTOR:g} or both below {FLOOR:g} (machine-dependent columns skipped)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
