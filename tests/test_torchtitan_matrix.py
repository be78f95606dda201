"""The README's torchtitan matrix kept true (issue 39, item 6): every row's command composes and passes the
runner's checks on its world size (a row that trains), every test or study a row names as its evidence exists, and
every ``conf/parallel`` preset and pipeline schedule has a row. The rows' training against one process is the
named tests' (they run the layouts under the runner on gloo); the table states no number, so nothing here can
drift from a measurement.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
from hydra.core.global_hydra import GlobalHydra

from fxtrain import build, train as runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEADING = "## torchtitan's matrix"


@dataclasses.dataclass(frozen=True)
class Row:
    feature: str
    ranks: int
    overrides: tuple[str, ...]
    status: str
    evidence: tuple[str, ...]  # "tests/test_x.py::name" or a study's results file


def matrix_rows(text: str) -> list[Row]:
    """The rows of the README's table under :data:`HEADING`: ``| feature | ranks | `overrides` | status | evidence |``.

    >>> matrix_rows("## torchtitan's matrix\\n\\n| a | b | c | d | e |\\n|---|---|---|---|---|\\n"
    ...             "| FSDP | 2 | `parallel=fsdp` | trains | `tests/test_matrix.py` |\\n\\n## next\\n")
    [Row(feature='FSDP', ranks=2, overrides=('parallel=fsdp',), status='trains', evidence=('tests/test_matrix.py',))]
    """
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[1].isdigit():
            continue
        rows.append(Row(cells[0], int(cells[1]), tuple(cells[2].strip("`").split()), cells[3],
                        tuple(re.findall(r"`([^`]+)`", cells[4]))))
    return rows


ROWS = matrix_rows(README.read_text())


def test_the_table_is_there_and_covers_every_preset_and_schedule():
    """A new preset or schedule without a row fails here (the registries: conf/parallel, the schema's schedules)."""
    from typing import get_args

    from fxtrain.schema import Parallel

    assert len(ROWS) >= 20, ROWS
    said = {o for r in ROWS for o in r.overrides}
    presets = {p.stem for p in (runner.CONF_DIR / "parallel").glob("*.yaml") if not p.stem.startswith("_")}
    assert {p for p in presets if f"parallel={p}" not in said} <= {"none"}, sorted(said)
    schedules = get_args(Parallel.model_fields["schedule"].annotation)
    assert {s for s in schedules if f"parallel.schedule={s}" not in said} == set(), sorted(said)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.feature)
def test_row(row):
    """A row that trains composes (``experiment=tiny_lm`` + its overrides) and passes the runner's checks, its
    degrees a layout of its ranks; a refused row names why; every row's evidence exists (the named test or case
    in its file, or the study's results)."""
    from tests._runner import cfg_of

    assert row.status.startswith(("trains", "refused")), row
    if row.status.startswith("trains"):
        GlobalHydra.instance().clear()
        cfg = cfg_of("experiment=tiny_lm", *row.overrides)
        runner.check(cfg)
        assert build.parallel_dims(cfg, row.ranks).world == row.ranks
    else:
        assert len(row.status) > len("refused: ") + 10, row  # says why
    assert row.evidence, row
    for ref in row.evidence:
        path, _, name = ref.partition("::")
        assert (ROOT / path).is_file(), ref
        if name:
            assert re.search(rf"def (test_|case_)?{re.escape(name)}\b", (ROOT / path).read_text()), ref
