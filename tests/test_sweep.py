"""fxtrain.sweep.plan: which jobs of a multirun share a vmapped group, and the note each job records about why it
runs alone or in which group (one line per reason: the key as the sweep wrote it, its values, why it splits).

Plan-level only (no training): the end-to-end checks that a group's jobs equal the basic launcher's are in
tests/test_vmap_launcher.py.
"""

import copy
import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from fxtrain import sweep
from tests._runner import CONF, isolate  # noqa: F401 - isolate: autouse (Hydra's global state)

FAST = ["experiment=smoke", "trainer.device=cpu", "trainer.cpu_threads=1", "trainer.progress=false"]


def jobs_of(*per_job):
    """One sweep.Job per list of overrides (job i: FAST + per_job[i]), as the launcher builds them. Hydra composes
    each distinct config once (a second or so on a loaded machine): ``seed=N`` is set on a copy."""
    composed = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for o in per_job:
            rest = tuple(x for x in o if not x.startswith("seed="))
            if rest not in composed:
                composed[rest] = compose("train", overrides=[*FAST, *rest])
    jobs = []
    for i, o in enumerate(per_job):
        cfg = copy.deepcopy(composed[tuple(x for x in o if not x.startswith("seed="))])
        for x in o:
            if x.startswith("seed="):
                cfg.seed = int(x.split("=")[1])
        jobs.append(sweep.Job(i, cfg, pathlib.Path(str(i)), list(o)))
    return jobs


def grid(*axes):
    """The jobs of ``-m axis1 axis2 ...`` (``key=a,b`` each), in Hydra's order: the first axis varies slowest."""
    options = [[f"{a.split('=', 1)[0]}={v}" for v in _values(a.split("=", 1)[1])] for a in axes]
    return jobs_of(*map(list, itertools.product(*options)))


def _values(text):
    out, depth, cur = [], 0, ""
    for ch in text:  # split on commas outside brackets: [a,b],[c]
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def members(groups):
    return [[j.num for j in g.jobs] for g in groups]


# One key that splits two jobs: each job's group names it with both values and says why, in one line.
REASONS = [
    ("data.batch_size=16,32", "apart by data.batch_size: 16 here, 32 in group 2: the batch size gives every tensor"),
    ("model.hidden=[32],[64]", "apart by model.hidden: [32] here, [64] in group 2: another model config changes the "
                               "params' shapes"),
    ("amp=off,bf16", "apart by amp: off here, bf16 in group 2: amp sets the step's dtypes"),
    ("accumulate=off,k4", "apart by accumulate: off here, k4 in group 2: accumulate sets how many micro-batches"),
    ("data.num_examples=384,512", "apart by data.num_examples: 384 here, 512 in group 2: another data config gives "
                                  "other batches"),
    ("trainer.eval_batch_size=64,128", "apart by trainer.eval_batch_size: 64 here, 128 in group 2: a setting of the run "
                                       "that one vmapped process shares"),
    ("schedule=cosine,linear", "apart by schedule: cosine here, linear in group 2: another schedule function"),
    ("optim.chain.adamw.weight_decay=0.1,high", "apart by optim.chain.adamw.weight_decay: 0.1 here, high in group 2: "
                                                "optim.chain.adamw.weight_decay=high is not a number"),
]


@pytest.mark.parametrize("axis, note", REASONS, ids=[r[0].split("=")[0] for r in REASONS])
def test_each_key_that_splits_jobs_is_named_with_its_values_and_why(axis, note):
    groups, notes = sweep.plan(grid(axis, "seed=0,1"))
    assert members(groups) == [[0, 1], [2, 3]]
    assert all(g.sequential is None and list(g.batched) == ["seed"] for g in groups)
    assert len(groups[0].reasons) == 1 and groups[0].reasons[0].startswith(note), groups[0].reasons
    other = groups[1].reasons[0]
    assert other.startswith(f"apart by {note.split()[2]} ") and " in group 1: " in other, other
    assert notes == [f"group {n}: {line}" for n, g in enumerate(groups, 1) for line in (g.header(), *g.reasons)]
    assert sweep.job_notes(groups[1], groups[1].jobs[1]) == [
        "group  job 3 in group 2: jobs 2,3 as one vmapped process, batched over seed=0,1", f"group  {other}"]


def test_a_schedule_step_count_splits_with_the_stacks_own_words():
    groups, _ = sweep.plan(grid("schedule=warmup_cosine", "schedule.warmup_steps=2,3"))
    assert members(groups) == [[0], [1]]
    assert groups[0].reasons == [
        "apart by schedule.warmup_steps: 2 here, 3 in group 2: the stack takes schedule.warmup_steps only as a Python "
        "number (schedule (fxtrain.warmup_cosine_decay_schedule): warmup_cosine_decay_schedule: warmup_steps must be "
        "an integer number of steps, got Tensor tensor(2.))"]
    assert sweep.job_notes(groups[1], groups[1].jobs[0])[0] == "group  job 1 alone (group 2)"


def test_several_keys_each_get_their_line():
    groups, _ = sweep.plan(grid("amp=off,bf16", "model.hidden=[32],[64]", "optim.chain.adamw.learning_rate=0.01,0.03"))
    assert members(groups) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r.split(":")[0] for r in groups[3].reasons] == ["apart by amp", "apart by model.hidden"]
    assert groups[3].reasons[0].startswith("apart by amp: bf16 here, off in groups 1,2: ")
    assert groups[3].reasons[1].startswith("apart by model.hidden: [64] here, [32] in groups 1,3: ")
    assert groups[3].batched == {"optim.chain.adamw.learning_rate": [0.01, 0.03]}


# --- trainer.max_steps: one group, each member stopping at its own step --------------------------------

def test_max_steps_batches_when_the_schedule_does_not_follow_it():
    groups, notes = sweep.plan(grid("schedule=constant", "trainer.max_steps=20,30", "seed=0,1"))
    assert members(groups) == [[0, 1, 2, 3]] and groups[0].sequential is None
    assert groups[0].batched == {"seed": [0, 1, 0, 1], "trainer.max_steps": [20, 20, 30, 30]}
    assert groups[0].values == {} and groups[0].reasons == []
    assert notes == ["group 1: jobs 0,1,2,3 as one vmapped process, batched over seed=0,1,0,1, "
                     "trainer.max_steps=20,20,30,30"]
    # the cadences that follow max_steps by default (trainer.log_every=${fxtrain.every:...}) are per member too
    groups, _ = sweep.plan(jobs_of(["schedule=constant", "trainer.max_steps=20", "trainer.log_every=4"],
                                   ["schedule=constant", "trainer.max_steps=30", "trainer.log_every=6"]))
    assert members(groups) == [[0, 1]] and list(groups[0].batched) == ["trainer.log_every", "trainer.max_steps"]


def test_early_stopping_and_best_by_batch_each_member_on_its_own():
    groups, notes = sweep.plan(grid("trainer.early_stopping.metric=loss", "trainer.early_stopping.patience=2,5",
                                    "trainer.checkpoint.best_by=val_loss,val_accuracy"))
    assert members(groups) == [[0, 1, 2, 3]] and groups[0].sequential is None and groups[0].reasons == []
    assert groups[0].batched == {"trainer.checkpoint.best_by": ["val_loss", "val_accuracy", "val_loss", "val_accuracy"],
                                 "trainer.early_stopping.patience": [2, 2, 5, 5]}


def test_max_steps_splits_where_the_schedule_length_follows_it_and_says_so():
    # experiment=smoke's cosine: schedule.decay_steps=${trainer.max_steps}, a Python int the schedule refuses as a tensor
    groups, _ = sweep.plan(grid("trainer.max_steps=20,30", "optim.chain.adamw.learning_rate=0.01,0.03"))
    assert members(groups) == [[0, 1], [2, 3]]
    assert groups[0].reasons == [
        "apart by trainer.max_steps: 20 here, 30 in group 2 (schedule.decay_steps follows it): the stack takes "
        "schedule.decay_steps only as a Python number (schedule (fxtrain.cosine_decay_schedule): "
        "cosine_decay_schedule: decay_steps must be an integer number of steps, got Tensor tensor(20.))"]


# --- the chain's structure -----------------------------------------------------------------------------

def test_each_structure_of_the_chain_is_its_own_group():
    chains = "optim/transform@optim.chain=[clip_by_global_norm,adamw],[sgd],[adamw,clip_by_global_norm]"
    groups, _ = sweep.plan(grid(chains, "seed=0,1"))
    assert members(groups) == [[0, 1], [2, 3], [4, 5]]  # [a,b] and [b,a] hold the same keys: apart all the same
    assert all(list(g.batched) == ["seed"] for g in groups)
    assert groups[2].reasons == [
        "apart by optim/transform@optim.chain: [adamw,clip_by_global_norm] here, [clip_by_global_norm,adamw] in "
        "group 1, [sgd] in group 2: the chain's structure (its transforms and their order) is the step's code: "
        "each structure is a group"]
    # the numbers of one structure batch within its group
    groups, _ = sweep.plan(jobs_of(*[[f"optim/transform@optim.chain={c}", f"optim.chain.sgd.learning_rate={lr}"]
                                     for c in ("[sgd]", "[clip_by_global_norm,sgd]") for lr in (0.1, 0.2)]))
    assert members(groups) == [[0, 1], [2, 3]]
    assert groups[0].values == {"optim.chain.sgd.learning_rate": [0.1, 0.2]}
    assert [r.split(":")[0] for r in groups[0].reasons] == ["apart by optim/transform@optim.chain"]


# --- one by one ------------------------------------------------------------------------------------------

def test_groups_that_run_one_by_one_say_why():
    groups, notes = sweep.plan(grid("seed=0,1,2"), max_group_size=2)
    assert members(groups) == [[0, 1], [2]]
    assert groups[1].reasons == ["apart by hydra.launcher.max_group_size=2: jobs 0,1,2 could be one group; they run "
                                 "2 at a time (also group 1)"]
    groups, _ = sweep.plan(grid("seed=0,1"), world=2)
    assert groups[0].header() == ("jobs 0,1 one by one: 2 processes run the sweep (torchrun); the vmap launcher "
                                  "batches jobs in one process")
    groups, _ = sweep.plan(grid("parallel=none,dp", "seed=0,1"))
    assert groups[1].header().startswith("jobs 2,3 one by one: parallel.dp_replicate=-1 (the vmap launcher batches")
    assert groups[1].reasons[0].startswith("apart by parallel: dp here, none in group 1: the parallel layout")


# --- the compile cache across processes (hydra.launcher.cache_dir) ---------------------------------

def test_compile_cache_directory_given_then_environment_then_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert sweep.compile_cache() == tmp_path / "xdg" / "fxtrain" / "compile"  # not torch's /tmp default
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert sweep.compile_cache() == tmp_path / "env"  # the user's own setting wins over the default
    given = sweep.compile_cache(tmp_path / "given")
    assert given == tmp_path / "given" and given.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(given)  # what torch reads at each lookup


def test_a_bad_cache_dir_is_refused_in_one_line():
    from fxtrain import validate
    from fxtrain.errors import ConfigError

    target = "hydra_plugins.fxtrain_vmap_launcher.vmap_launcher.VmapLauncher"
    with pytest.raises(ConfigError, match=r"^hydra.launcher.cache_dir=3: expected a string, or null \(where compiled code"):
        validate.check_launcher({"_target_": target, "compile": True, "cache_dir": 3})
    with pytest.raises(ConfigError, match=r"^hydra.launcher.cache_dir=' ': expected a directory path or null "):
        validate.check_launcher({"_target_": target, "compile": True, "cache_dir": " "})
    validate.check_launcher({"_target_": target, "compile": True, "cache_dir": "~/.cache/mine"})


_COMPILE_ONCE = """
import json, sys, torch
from torch._dynamo.utils import counters
from fxtrain import sweep
sweep.compile_cache(sys.argv[1])
sweep.Compiled(lambda t: {"y": (t["x"] * 2 + 1).sin()}, "cache test", "a tiny graph")({"x": torch.ones(4)})
print(json.dumps({k: v for g in ("inductor", "aot_autograd") for k, v in counters[g].items()}))
"""


@pytest.mark.slow  # two processes that import inductor; the first compiles C++ (about 20 s on a quiet 2-core machine)
def test_a_second_process_loads_the_compiled_graph_from_the_cache(tmp_path):
    """What makes the second sweep of the same shapes compile in seconds: a new process finds inductor's compiled
    graph (FX graph cache) and AOTAutograd's artifact in the directory the first one filled; nothing compiles."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pathlib.Path(__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)

    def run():
        out = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, str(tmp_path / "cache")], env=env,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first.get("fxgraph_cache_miss") == 1 and first.get("autograd_cache_miss") == 1
    assert any((tmp_path / "cache").rglob("*"))
    assert second.get("fxgraph_cache_hit") == 1 and second.get("autograd_cache_hit") == 1
    assert "fxgraph_cache_miss" not in second and "autograd_cache_miss" not in second


@pytest.mark.parametrize("setting, why", [
    ("trainer.compile=true", "trainer.compile=true (the per-block compiled forward does not run under vmap"),
    ("model.activation_checkpoint=full", "model.activation_checkpoint=full (a checkpointed block does not run under"),
])
def test_compiled_or_checkpointed_jobs_run_one_by_one_saying_why(setting, why):
    """The runner's per-block wrappers (fxtrain/parallel/_blocks.py) do not run under vmap: such jobs are not batched,
    and the group says so rather than fail at its first vmapped step."""
    model = ["experiment=tiny_lm"] if "checkpoint" in setting else []  # a model with blocks
    groups, _ = sweep.plan(grid(*model, setting, "seed=0,1"))
    assert len(groups) == 1 and groups[0].sequential.startswith(why), groups[0].sequential
