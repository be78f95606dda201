"""The documentation runs as a test: every fenced block of README.md, docs/**/*.md (the site's pages) and
experiments/**/README.md is parsed here (:func:`fenced_blocks`, one function of a path) and either executed
(Python blocks in this process, shell commands as subprocesses in a temporary directory) or listed below with the
reason it is not; the output a page shows is checked against what the code prints. A new block runs as written by
default, so it cannot be skipped by accident: to run it otherwise, list it in ``COMMANDS`` (shell), ``NOT_RUN`` (a
whole block) or ``OUTPUTS`` (a block showing output).

The numbers a page states in its prose and tables (times, ratios, accuracies, differences) are checked too
(:func:`stated_numbers`): a paragraph or table row that states one cites the committed table it comes from
(``experiments/.../results.md``, named in the row or in the paragraph above its table), and the number must be
there, to the digits shown.

Cost: the default run (1,000 steps) and the 4-job sweep run in full because the pages print their
numbers; every other training command runs with a few steps (``COMMANDS`` says which and why).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import dataclasses
import importlib.util
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import threading
import time

import pytest

from tests._runner import OWN_LIB, write_project

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The README and the site's pages; a page's YAML blocks are files (first line: ``# conf/model/gpt2.yaml``) that its
# shell blocks use, written into the page's own working directory.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
READMES = [*PAGES, *sorted((ROOT / "experiments").glob("**/README.md"))]
FEW = "trainer.max_steps=10"  # what "a few steps" appends to a training command whose numbers are not printed


@dataclasses.dataclass(frozen=True)
class Block:
    file: str   # relative to the checkout
    line: int   # of the opening fence
    lang: str   # the fence's info string: python, py, bash, or "" (output, a layout)
    text: str

    @property
    def label(self) -> str:
        """The block's first line: how the tables below name it (stable when text above it moves)."""
        return self.text.strip().splitlines()[0].strip()

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.lang or 'text'})"


def fenced_blocks(path: pathlib.Path) -> list[Block]:
    """Every ```-fenced block of a markdown file, in order."""
    blocks, opened, body = [], None, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if opened is None:
                opened, body = (number, line[3:].strip()), []
            else:
                blocks.append(Block(str(path.relative_to(ROOT)), opened[0], opened[1], "\n".join(body) + "\n"))
                opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{path}: a fence opened at line {opened[0]} is never closed"
    return blocks


BLOCKS = [b for path in READMES for b in fenced_blocks(path)]

# --- the tables: what is not run as written, and why ---------------------------------------------------

# Whole blocks that are not executed (file, first line) -> why.
NOT_RUN = {
    ("docs/parallel.md", "# under torchrun; the tested versions: tests/test_{tensor_parallel,fully_sharded,pipeline,expert_parallel}.py"):
        "a sketch of four torchrun programs (model, plan, mesh, schedule are the user's); the tests it names run "
        "each entry point on 2 and 4 gloo ranks",
    ("docs/parallel.md", "# in an sbatch script with #SBATCH --nodes=4 --ntasks=4 (one torchrun per node); /shared is mounted on every node"):
        "needs a Slurm cluster; its torchrun is the two-node line above, which tests/test_multinode.py runs",
}

# Shell commands (as written, comments and continuation lines joined) that are not run as written -> (what
# runs instead, or None for nothing, and why). Every other command of a shell block runs as written.
TORCHRUN = ("needs torchrun with 2-8 ranks for minutes; tests/test_train_parallel.py runs every layout under "
            "torchrun or in its 4-rank world, experiments/strategies/run.py the 8-rank 3-D one for 100 steps")
COMMANDS = {
    "make train": ("python -m fxtrain.train",
                   "make's recipe without building .venv (the suite runs in it); its output is checked below"),
    "make test": (None, "the test suite itself"),
    ".venv/bin/python -m fxtrain.train -m seed=1,2 optim.chain.adamw.learning_rate=1e-3,3e-3":
        (".venv/bin/python -m fxtrain.train -m seed=1,2 optim.chain.adamw.learning_rate=1e-3,3e-3 hydra/launcher=vmap",
         "its 4 jobs in one vmapped process: the numbers the page prints are checked, and the vmap launcher gives "
         "the basic launcher's to float32 rounding (docs/runner.md; tests/test_vmap_launcher.py) with less CPU time"),
    **{command: (None, TORCHRUN) for command in [
        "torchrun --nproc_per_node=2 -m fxtrain.train parallel=dp",
        "torchrun --nproc_per_node=2 -m fxtrain.train experiment=tiny_lm parallel=fsdp",
        "torchrun --nproc_per_node=2 -m fxtrain.train experiment=tiny_lm parallel=tp",
        "torchrun --nproc_per_node=4 -m fxtrain.train experiment=tiny_lm parallel=fsdp_tp",
        "torchrun --nproc_per_node=4 -m fxtrain.train experiment=tiny_lm parallel=hsdp",
        "torchrun --nproc_per_node=2 -m fxtrain.train experiment=tiny_lm parallel=pp",
        "torchrun --nproc_per_node=8 -m fxtrain.train experiment=tiny_lm parallel=3d",
        "torchrun --nproc_per_node=2 -m fxtrain.train experiment=tiny_lm parallel=ep model=moe",
        "torchrun --nproc_per_node=4 -m fxtrain.train experiment=tiny_lm parallel=fsdp_cp",
        "torchrun --nproc_per_node=4 -m fxtrain.train experiment=tiny_lm parallel.tp=2 parallel.dp_shard=-1"]},
    # docs/parallel.md "Beyond one machine": two launchers at once, and a rank killed mid-run; the test runs each line as written
    **{command: (None, "tests/test_multinode.py runs it (a free port, a tiny model, 24 steps)") for command in [
        "torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=localhost:29500 --rdzv-id=two_nodes "
        "-m fxtrain.train experiment=tiny_lm parallel=dp hydra.run.dir=outputs/two_nodes",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=1 -m fxtrain.train "
        "experiment=tiny_lm parallel=dp hydra.run.dir=outputs/restartable resume=auto trainer.checkpoint_every=100"]},
    # docs/huggingface.md: a transformers model from the page's conf/model/gpt2.yaml, 8 steps on 30 kB of text
    "python -m fxtrain.train --config-dir conf model=gpt2 data=stdlib_text task=lm":
        ("python -m fxtrain.train --config-dir conf model=gpt2 data=stdlib_text task=lm trainer.max_steps=8 "
         "trainer.eval_every=4 trainer.log_every=4 schedule.warmup_steps=4 data.max_bytes=30000",
         "8 steps: the page shows the run's first lines, which do not depend on its length"),
    **{command: (command.removeprefix("watch -n 5 "), "once, not every 5 s") for command in [
        "watch -n 5 .venv/bin/python -m fxtrain.report multirun/<date>/<time> --no-plot",
        "watch -n 5 python -m fxtrain.report multirun/<date>/<time> --no-plot"]},
    # Training commands whose numbers no page prints: a few steps (trainer.max_steps=10, appended or replacing
    # the page's value) show that they run.
    **{command: (re.sub(r" trainer\.max_steps=\d+|$", " " + FEW, command, count=1), "10 steps: no numbers printed")
       for command in [
        # the sweep recipe (docs/runner.md and experiments/README.md): 8 jobs of 300 steps
        ".venv/bin/python -m fxtrain.train -m optim.chain.adamw.learning_rate=3e-3,1e-2 "
        "optim.chain.clip_by_global_norm.max_norm=0.1,1.0 seed=0,1 trainer.max_steps=300",
        "python -m fxtrain.train -m optim.chain.adamw.learning_rate=3e-3,1e-2 "
        "optim.chain.clip_by_global_norm.max_norm=0.1,1.0 seed=0,1 trainer.max_steps=300",
        ".venv/bin/python -m fxtrain.train -m hydra/launcher=vmap optim.chain.adamw.learning_rate=1e-3,3e-3,1e-2 "
        "seed=0,1",
        # the own project (docs/data.md), in the project its layout block describes
        "python -m fxtrain.train --config-dir conf model=mine data=mine task=regression 'logger=[jsonl,tensorboard,csv]'",
        "python -m fxtrain.train -m 'hydra.searchpath=[file://conf]' model=mine,mlp data=mine task=huber",
        "python -m fxtrain.train +trainer.eval_hooks.cal._target_=mylib.calibration "
        "trainer.early_stopping.metric=val_loss trainer.early_stopping.patience=5"]},
}

# Blocks that need the own project (built from the layout block "myproj/" next to where they start) -> the
# directory they start in.
IN_PROJECT = {
    ("docs/data.md", "cd myproj"): ".",
    ("docs/data.md", "# in myproj/: mylib.calibration(ctx, **keys) -> {name: float}; early stopping follows any logged metric"):
        "myproj",
}

# Blocks without a language: what they show -> the command (of COMMANDS' keys or as written) whose output
# they are, with the parts that depend on the machine blanked, or None with the reason they are not output.


@dataclasses.dataclass(frozen=True)
class Output:
    command: str | None
    why: str
    skip_lines: str = r"^$"  # lines of the block not compared (a progress bar)
    machine: str = r"^$"     # the parts of a line that depend on the machine (times), blanked on both sides
    function: str | None = None  # "script.py:name": a study's function, called in this process, prints it


OUTPUTS = {
    ("docs/getting-started.md", "data   digits: 1,078 train examples, 449 test, batch 64, 270 validation"):
        Output("python -m fxtrain.train", "the default run's log (the time and the progress bar not compared)",
               skip_lines=r"^train:", machine=r"\bin [\d.]+ s\b"),
    ("docs/runner.md", "job  status     seed  optim.chain.adamw.learning_rate  val_accuracy  test_accuracy  test_loss  loss       accuracy  val_loss  step  time_s"):
        Output(".venv/bin/python -m fxtrain.train -m seed=1,2 optim.chain.adamw.learning_rate=1e-3,3e-3",
               "the 4-job sweep's table, its seeds grouped by configuration and the best one (time_s not compared); "
               "fxtrain.report prints it too",
               machine=r"(?<=1000)\s+[\d.]+$"),
    ("docs/data.md", "myproj/"): Output(None, "the own project's layout: built by the test from its comments (project())"),
    ("docs/huggingface.md", "model  GPT2LMHeadModel: 124,672 params on cpu"):
        Output("python -m fxtrain.train --config-dir conf model=gpt2 data=stdlib_text task=lm",
               "the run's model and task lines: the page's model config, found through --config-dir"),
    ("experiments/resnet_clip_accumulate/README.md",
     "iteration 1: [-0.064032, +0.052812, -0.017213, +0.046374]  held    emitted=0 loss=2.4183"):
        Output(None, "the ResNet study's accumulation check: its function, called here (the whole study takes "
                     "~1.5 min)", function="experiments/resnet_clip_accumulate/run.py:accumulation_check"),
}

# Comments after a print(...) in a Python block are its output, compared (numbers to the digits shown),
# except these, which describe it.
PROSE = {"the loss after 50 steps, per learning rate"}

# --- numbers: equal to the digits the page shows ------------------------------------------------------

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def same(expected: str, actual: str, rtol: float = 0.05) -> bool:
    """``actual`` reads as ``expected``: the same words, the same integers, and each decimal number equal to the
    digits the page shows once rounded, or within ``rtol`` (float rounding differs between CPUs and grows
    over 1,000 training steps)."""
    expected, actual = " ".join(expected.split()), " ".join(actual.split())
    if NUMBER.sub("#", expected) != NUMBER.sub("#", actual):
        return False
    for e, a in zip(NUMBER.findall(expected), NUMBER.findall(actual)):
        if not re.search(r"[.eE]", e):
            if e != a:
                return False
            continue
        mantissa, _, exponent = e.lower().partition("e")
        unit = 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))
        if not (abs(float(a) - float(e)) <= unit / 2 * (1 + 1e-9) or math.isclose(float(a), float(e), rel_tol=rtol)):
            return False
    return True


def test_same_reads_numbers_to_the_digits_shown():
    assert same("0.052 0.418: x", "0.0521 0.4179: x") and same("test_loss 0.0769", "test_loss  0.07712")
    assert not same("best: job 0 (test_accuracy 0.98)", "best: job 1 (test_accuracy 0.98)")
    assert not same("7.91", "8.7") and not same("tensor(0.0003)", "tensor([0.0003])") and same("2.4e-07", "2.38e-7")
    assert not same("1,348 train examples", "1,349 train examples") and not same("0.0769", "0.0869")


def contains_in_order(expected: list[str], actual: list[str]) -> list[str]:
    """The expected lines that are not found (with :func:`same`) in ``actual`` after the previous one."""
    missing, at = [], 0
    for line in expected:
        found = next((i for i in range(at, len(actual)) if same(line, actual[i])), None)
        if found is None:
            missing.append(line)
        else:
            at = found + 1
    return missing


# --- numbers stated in prose and tables: equal to the committed table cited -----------------------------

CITED = re.compile(r"experiments/[\w./-]+?\.md")
# A measured number: a decimal (0.75, 1.3e-7, in 0.75x or 84.8% too), a ratio or a share (3x, 14%). Other integers
# (steps, ranks), sizes (5.3M params)
# and bare powers of ten (a tolerance: relative 1e-5) are not measurements; versions (torch 2.13) and code spans are
# not prose.
MEASURED = re.compile(r"(?<![\w.-])(?:\d+\.\d+(?:[eE][-+]?\d+)?(?![\w.]*\d)|\d+(?=x\b|%))")
NOT_MEASURED = re.compile(r"`[^`]*`|\d+\.\d+\.\d+|\d+(?:\.\d+)?[KMB]\b|"
                          r"\b(?:torch|Hydra|Python|python|CUDA|jax|Flax|Optax) \d+\.\d+|"
                          r"(?:target|goal|acceptance:?|<=|>=)\s*~?\d+\.?\d*(?:[eE][-+]?\d+)?x?")

# Paragraphs that state a number no table holds -> why (the page, the paragraph's first words).
NOT_TABLED = {
    ("docs/functional-step.md", "* AdamW: Optax adds"):
        "arithmetic, not a measurement: 1 - 0.999 in float32 against float64 (tests/test_fused.py bounds the update)",
}


@dataclasses.dataclass(frozen=True)
class Stated:
    file: str
    line: int
    text: str             # the paragraph or table row
    cited: tuple[str, ...]  # the committed tables it names, or its table's caption names

    @property
    def numbers(self) -> list[str]:
        return MEASURED.findall(NOT_MEASURED.sub(" ", self.text))


def stated_numbers(path: pathlib.Path) -> list[Stated]:
    """The paragraphs and table rows of a page (outside code blocks) that state a measured number, each with the
    committed tables it cites; a table row without a citation of its own takes its caption's (the paragraph
    just above the table)."""
    out, paragraph, start, fenced, caption = [], [], 0, False, ()
    name = str(path.relative_to(ROOT)) if ROOT in path.parents else path.name

    def close():
        nonlocal paragraph, caption
        if paragraph:
            text = " ".join(paragraph)
            caption = tuple(CITED.findall(text))
            out.append(Stated(name, start, text, caption))
        paragraph = []

    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            close()
            fenced = not fenced
        elif fenced or line.startswith("    "):
            continue
        elif line.startswith("|"):
            close()
            out.append(Stated(name, number, line, tuple(CITED.findall(line)) or caption))
        elif not line.strip() or line.startswith("#"):
            close()
            caption = () if line.startswith("#") else caption
        else:
            start = start if paragraph else number
            paragraph.append(line)
    close()
    return [s for s in out if s.numbers]


def shown_in(number: str, text: str) -> bool:
    """``text`` holds ``number`` to the digits shown (0.75 for a table's 0.753; 4.3e-7 for 4.31e-07)."""
    return any(same(number, found, rtol=0.0) for found in NUMBER.findall(text))


def test_stated_numbers_reads_paragraphs_rows_and_captions(tmp_path):
    page = tmp_path / "probe.md"
    page.write_text("A ratio of 0.75x (target <= 0.95), 3x, 14%, in torch 2.13, `lr=0.003`, 5.3M params.\n\nThe table "
                    "(`experiments/x/results.md`):\n\n| a | b |\n|---|---|\n| 1.3e-7 | 8 |\n\n```\n0.5\n```\n")
    stated = stated_numbers(page)
    assert [(s.line, s.numbers, s.cited) for s in stated] == [(1, ["0.75", "3", "14"], ()),
                                                              (7, ["1.3e-7"], ("experiments/x/results.md",))]
    assert shown_in("0.75", "| 0.753 |") and shown_in("4.3e-7", "4.31e-07") and not shown_in("0.75", "0.76 0.7")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_a_page_states_is_in_the_table_it_cites(page):
    problems = []
    for stated in stated_numbers(page):
        key = next((k for k in NOT_TABLED if k[0] == stated.file and stated.text.startswith(k[1])), None)
        if key:
            continue
        if not stated.cited:
            problems.append(f"{stated.file}:{stated.line} states {', '.join(stated.numbers)} and cites no committed "
                            f"table (name its experiments/.../*.md): {stated.text[:120]}")
            continue
        missing = [str(ROOT / c) for c in stated.cited if not (ROOT / c).is_file()]
        if missing:
            problems.append(f"{stated.file}:{stated.line} cites {', '.join(missing)}, which does not exist")
            continue
        tables = "\n".join((ROOT / c).read_text() for c in stated.cited)
        wrong = [n for n in stated.numbers if not shown_in(n, tables)]
        if wrong:
            problems.append(f"{stated.file}:{stated.line} states {', '.join(wrong)}, which {', '.join(stated.cited)} "
                            f"does not hold: {stated.text[:120]}")
    assert not problems, "\n".join(problems)


def test_every_not_tabled_entry_names_a_paragraph():
    texts = {(s.file, s.text) for page in PAGES for s in stated_numbers(page)}
    for file, first in NOT_TABLED:
        assert any(f == file and text.startswith(first) for f, text in texts), (file, first)


# --- running shell commands ---------------------------------------------------------------------------

def split_comment(line: str) -> tuple[str, str]:
    """``code  # comment`` -> (code, comment): a ``#`` that starts a word outside quotes starts the comment."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:].strip()
    return line, ""


def commands(block: Block) -> list[tuple[str, str]]:
    """The block's commands as a shell reads them (a line ending in a backslash continues on the next), each
    as (the command, whitespace collapsed, without its comment; the comment)."""
    out, pending = [], ""
    for line in block.text.splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        code, comment = split_comment(pending + line)
        pending = ""
        if code.strip():
            out.append((" ".join(code.split()), comment))
    return out


@dataclasses.dataclass
class Ran:
    argv: list[str]
    returncode: int
    output: str
    seconds: float
    sweep_dir: pathlib.Path | None
    cpu_s: float = 0.0  # the command's CPU time (user + system): what the load of other processes hardly inflates


_RAN: dict[tuple[str, str], concurrent.futures.Future] = {}  # (cwd, command) -> its run: once per session
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)  # two commands at a time (2 cores)
_STAMPS = iter(range(10 ** 6))


def run_command(command: str, cwd: pathlib.Path, last_sweep: pathlib.Path | None, wait: bool = True) -> Ran:
    """Runs one command of a page as a subprocess in ``cwd`` (``python``/``.venv/bin/python``: this interpreter;
    ``multirun/<date>/<time>``: the last sweep of the block), each training run in a directory of its own.
    A command that two blocks show (or an output block and a shell block) runs once."""
    if last_sweep is not None:
        command = command.replace("multirun/<date>/<time>", str(last_sweep.relative_to(cwd)))
    try:
        argv = shlex.split(command)
    except ValueError as e:  # an unbalanced quote, a trailing backslash
        return Ran([command], 2, f"the shell cannot read it: {e}", 0.0, None)
    if argv[0] in ("python", ".venv/bin/python"):
        argv[0] = sys.executable
    key = (str(cwd), shlex.join(argv))
    if key not in _RAN:
        _RAN[key] = _POOL.submit(_run, argv, cwd)
    return _RAN[key].result() if wait else None


def _run(argv: list[str], cwd: pathlib.Path) -> Ran:
    stamp = f"readme{next(_STAMPS)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FXTRAIN_", "HYDRA_"))}
    env.update(FXTRAIN_RUN_STAMP=stamp, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
        return Ran(argv, 127, f"{argv[0]}: command not found", 0.0, None)
    timer = threading.Timer(600, proc.kill)
    timer.start()
    try:
        output = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, with its resource usage
    finally:
        timer.cancel()
        proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Ran(argv, proc.returncode, output, time.perf_counter() - t0,
               cwd / "multirun" / stamp if "-m" in argv[3:] or "--multirun" in argv else None,
               cpu_s=usage.ru_utime + usage.ru_stime)


# --- the own project ----------------------------------------------------------------------------------

def flow_mapping(text: str) -> str:
    """``a: 1, b: [2, 3], c: ${x.y[0]}`` (a layout comment) as block YAML, one key a line."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[{" and 1 or 0
        depth -= ch in "]}" and 1 or 0
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    items.append(current.strip())
    return "\n".join(items) + "\n"


def project(root: pathlib.Path) -> pathlib.Path:
    """The project of the docs' layout block, in ``root/myproj``: each ``conf/...yaml`` file holds what its
    comment says; ``mylib`` (tests/_runner.py's OWN_LIB) has the functions the comments name."""
    (layout,) = [b for b in BLOCKS if b.label == "myproj/"]
    base = root / "myproj"
    if base.exists():
        return base
    configs = {}
    for line in layout.text.splitlines()[1:]:
        path, _, comment = line.strip().partition("#")
        path = path.strip()
        if path.startswith("conf/") and path.endswith(".yaml"):
            configs[path.removeprefix("conf/")] = flow_mapping(comment.strip())
        elif path == "mylib/__init__.py":
            names = set(re.findall(r"(?:class|def) (\w+)", comment))
            assert names <= set(re.findall(r"^(?:class|def) (\w+)", OWN_LIB, flags=re.M)), names
        else:
            raise AssertionError(f"docs/data.md's myproj/ layout names {path!r}: teach project() to write it")
    return write_project(base, configs)


# --- the tests ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    """Where shell blocks run; the long runs whose output a page shows start at once, two at a time."""
    root = tmp_path_factory.mktemp("readme")
    for (page, _), shown in OUTPUTS.items():
        if shown.command:
            run_command(COMMANDS.get(shown.command, (shown.command,))[0], page_dir(page, root), None, wait=False)
    return root


def test_the_readmes_have_blocks_and_every_table_entry_names_one():
    assert len([b for b in BLOCKS if b.lang == "python"]) >= 7 and len([b for b in BLOCKS if b.lang == "bash"]) >= 8
    keys = {(b.file, b.label) for b in BLOCKS}
    for table in (NOT_RUN, OUTPUTS, IN_PROJECT):
        assert set(table) <= keys, set(table) - keys
    shown = {c for b in BLOCKS if b.lang in ("bash", "sh") for c, _ in commands(b)}
    assert set(COMMANDS) <= shown, set(COMMANDS) - shown
    shown |= {run for run, _ in COMMANDS.values() if run}
    assert {o.command for o in OUTPUTS.values() if o.command} <= shown, "an output names a command no block shows"
    assert {b.lang for b in BLOCKS} <= {"python", "py", "bash", "yaml", ""}, "a block in a language this test cannot run"
    assert not [b for b in BLOCKS if b.lang == "yaml" and not b.file.startswith("docs/")], "YAML files: docs pages only"


def run_python(block: Block, monkeypatch, tmp_path) -> dict[int, list[str]]:
    """Executes a Python block in this process (in ``tmp_path``); returns what each print line printed."""
    monkeypatch.chdir(tmp_path)
    name = f"<{block}>"
    printed: dict[int, list[str]] = {}

    def recording_print(*args, sep=" ", end="\n", file=None, flush=False):
        frame = sys._getframe(1)
        if frame.f_code.co_filename == name and file is None:
            printed.setdefault(frame.f_lineno, []).append(sep.join(map(str, args)))
        builtins.print(*args, sep=sep, end=end, file=file, flush=flush)

    exec(compile(block.text, name, "exec"), {"__name__": "__readme__", "print": recording_print})
    return printed


def expected_prints(text: str) -> dict[int, str]:
    """Line of a ``print(...)`` -> the output its comment shows (``# out``, on the line or the next one; the text
    before a ``: `` that explains it)."""
    lines, out = text.splitlines(), {}
    for number, line in enumerate(lines, 1):
        if not line.lstrip().startswith("print("):
            continue
        comment = line.split(")  #", 1)[1].strip() if ")  #" in line else None
        if comment is None and number < len(lines) and lines[number].startswith("# "):
            comment = lines[number][2:].strip()
        if comment is not None and comment not in PROSE:
            out[number] = comment.split(": ")[0]
    return out


def call_study(function: str) -> Ran:
    """``path/script.py:name``: the study script loaded as a module (experiments/ is no package), ``name()``'s text."""
    path, name = function.split(":")
    spec = importlib.util.spec_from_file_location("readme_" + pathlib.Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    t0 = time.perf_counter()
    return Ran([function], 0, getattr(module, name)(), time.perf_counter() - t0, None)


def files_of(page: str) -> dict[str, str]:
    """The YAML blocks of a docs page, the files its shell blocks use: path (their first line, ``# conf/x.yaml``)
    -> text."""
    files = {}
    for b in BLOCKS:
        if b.file == page and b.lang == "yaml":
            named = re.fullmatch(r"#\s*([\w./-]+\.ya?ml)", b.label)
            assert named and not named.group(1).startswith(("/", "..")), \
                f"{b}: a YAML block names its file, relative, on its first line (# conf/model/mine.yaml)"
            files[named.group(1)] = b.text
    return files


def page_dir(page: str, root: pathlib.Path) -> pathlib.Path:
    """Where a page's commands run: a page with YAML files in a directory of its own (the files written there), the
    others in ``root``."""
    files = files_of(page) if page.startswith("docs/") else {}
    if not files:
        return root
    cwd = root / pathlib.Path(page).stem
    for path, text in files.items():
        (cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (cwd / path).write_text(text)
    return cwd


def check_shell(block: Block, root: pathlib.Path) -> list[str]:
    """Runs a shell block's commands in order; returns one line per problem."""
    cwd = page_dir(block.file, root)
    if (block.file, block.label) in IN_PROJECT:
        project(root)
        cwd = root / IN_PROJECT[block.file, block.label]
    problems, last_sweep = [], None
    for command, comment in commands(block):
        if command.startswith("cd "):
            cwd = cwd / command[3:].strip()
            continue
        run, _ = COMMANDS.get(command, (command, "as written"))
        if run is None:
            continue
        ran = run_command(run, cwd, last_sweep)
        if ran.returncode != 0:
            problems.append(f"{block}: `{command}` exited {ran.returncode}:\n{ran.output[-3000:]}")
            continue
        last_sweep = ran.sweep_dir or last_sweep
        produced = re.match(r"-> (\S+)", comment)
        if produced and last_sweep is not None:
            path = cwd / produced.group(1).replace("multirun/<date>/<time>", str(last_sweep.relative_to(cwd)))
            if not path.exists():
                problems.append(f"{block}: `{command}` did not write {produced.group(1)}")
    return problems


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_readme_block(block, request, monkeypatch, tmp_path):
    key = (block.file, block.label)
    if key in NOT_RUN:
        pytest.skip(NOT_RUN[key])
    if block.lang == "yaml":  # a file a shell block of its page uses: it parses, and names what it builds
        import yaml

        text = yaml.safe_load(block.text)
        assert isinstance(text, dict), f"{block}: expected a config (a mapping)"
        assert files_of(block.file), block
        return
    if block.lang in ("python", "py"):
        printed = run_python(block, monkeypatch, tmp_path)
        assert printed, f"{block}: prints nothing (every example prints what it shows)"
        for line, shown in expected_prints(block.text).items():
            assert line in printed, f"{block}: the print on its line {line} did not run"
            assert same(shown, printed[line][-1]), f"{block} line {line}: prints {printed[line][-1]!r}, the page shows {shown!r}"
        return
    workdir = request.getfixturevalue("workdir")  # shell blocks and their outputs (the long runs start here)
    if block.lang in ("bash", "sh"):
        problems = check_shell(block, workdir)
        assert not problems, "\n".join(problems)
    else:
        assert key in OUTPUTS, f"{block}: a block without a language: list it in OUTPUTS (which command prints it)"
        shown = OUTPUTS[key]
        if shown.function:
            ran = call_study(shown.function)
        elif shown.command:
            ran = run_command(COMMANDS.get(shown.command, (shown.command,))[0], page_dir(block.file, workdir), None)
        else:
            pytest.skip(shown.why)
        assert ran.returncode == 0, ran.output[-3000:]
        blank = lambda lines: [re.sub(shown.machine, "", line) for line in lines if not re.match(shown.skip_lines, line)]  # noqa: E731
        missing = contains_in_order(blank(block.text.splitlines()), blank(re.split(r"[\r\n]+", ran.output)))
        assert not missing, f"{block}: `{shown.command}` does not print these lines of the page:\n" + "\n".join(missing) + \
            "\n--- it printed:\n" + ran.output[-4000:]


def test_the_first_promise_is_what_the_default_run_prints(workdir):
    # README's first line: `make train  # ... ~N% test accuracy in ~T s ...`. N is the test accuracy the default run
    # prints, rounded to a whole percent; T its time, to a factor of 1.5 either way: measured as the run's CPU time
    # (one thread: trainer.cpu_threads=1), which other processes' load hardly changes, where its wall time can double.
    ((_, promise),) = [(c, comment) for b in BLOCKS if b.file == "README.md" and b.lang == "bash"
                       for c, comment in commands(b) if c == "make train" and "test accuracy" in comment]
    stated = re.search(r"~(\d+)% test accuracy in ~(\d+) s\b", promise)
    assert stated, f"README's first promise states no accuracy and time: {promise!r}"
    ran = run_command(COMMANDS["make train"][0], workdir, None)
    assert ran.returncode == 0, ran.output[-3000:]
    printed = re.search(r"^done .*\| test_accuracy ([\d.]+)", ran.output, flags=re.M)
    assert printed, ran.output[-3000:]
    assert round(100 * float(printed.group(1))) == int(stated.group(1)), (printed.group(0), promise)
    seconds = float(stated.group(2))
    assert seconds / 1.5 <= ran.cpu_s <= seconds * 1.5, f"the default run took {ran.cpu_s:.1f} s of CPU: {promise!r}"
