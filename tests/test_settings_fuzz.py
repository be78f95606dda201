"""Every setting fuzzed: each leaf key of the composed configs x {wrong type, negative, zero, NaN, inf, huge, empty,
unknown sibling} is refused by fxtrain.validate.check with one line naming the key, or legitimately accepted.

In process, on hydra.compose'd configs (no process per case): 0 tracebacks (any other exception fails), 0
silently wrong (an accepted case must be in ACCEPTED below, with its reason). The numbers are printed
(``pytest -s``): commands, accepted, refused naming the key. On the 8 configs below: 1,752 commands, 99 accepted
(each with its reason), 1,653 refused naming the key; the validate.py of issue 25's main gave 10 tracebacks and
accepted 1,026 outside this list (before its run directory was written, where they failed later or trained
something else).
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import math
import pathlib

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from fxtrain import build, distributed, validate
from fxtrain import train as runner
from tests._runner import cfg_of, isolate  # noqa: F401 - isolate: autouse (runs in tmp_path)

# The composed configs fuzzed: the default, the experiments, and the options whose keys the default lacks.
BASES = {
    "default": [],
    "tiny_lm": ["experiment=tiny_lm"],
    "digits_resnet": ["experiment=digits_resnet"],
    "moe_pp_fp16": ["model=moe", "data=stdlib_text", "task=lm", "parallel=pp", "amp=naive_fp16", "accumulate=k4",
                    "schedule=linear", "optim/transform@optim.chain=[clip,trace,sgd]"],
    "others": ["data=synthetic", "schedule=constant", "parallel=fsdp_tp", "amp=fp16",
               "optim/transform@optim.chain=[add_decayed_weights,rmsprop]", "logger=[jsonl,csv]"],
    "more": ["schedule=cosine", "parallel=ep", "optim/transform@optim.chain=[lion]", "amp=pure_bf16"],
    "adagrad": ["optim/transform@optim.chain=[clip_by_global_norm,adagrad]", "parallel=dp", "amp=bf16"],
    "adam": ["optim/transform@optim.chain=[adam]", "parallel=tp", "trainer.early_stopping.metric=val_loss"],
    "debug_limit": ["debug=limit"],  # the debug node's keys (fractions)
    "debug_profile": ["debug=profile", "debug.limit_val=2", "debug.limit_test=1"],  # counts, profiling
}
CASES = ("wrong_type", "negative", "zero", "nan", "inf", "huge", "empty", "unknown", "null", "one")

# (key pattern, case): why accepting it is right. Anything accepted that is not here fails the test.
ACCEPTED = {
    ("seed", "zero"): "any seed from 0 to 2**64-1 seeds torch and numpy",
    ("seed", "huge"): "any seed from 0 to 2**64-1 seeds torch and numpy",
    ("data.seed", "zero"): "a seed",
    ("data.seed", "huge"): "a seed",
    ("data.split_seed", "zero"): "a seed",
    ("trainer.checkpoint.best_by", "wrong_type"): "a name: refused in one line at the first evaluation unless the run logs it",
    ("data.val_fraction", "zero"): "no validation split: the run says so once and validates on the test split",
    ("data.split_seed", "huge"): "a seed",
    ("resume", "empty"): "resume= is null, as the runner reads it",
    ("trainer.checkpoint_every", "zero"): "documented: 0 = only at the end",
    ("trainer.keep_last", "zero"): "documented: 0 = keep every checkpoint",
    ("trainer.early_stopping.min_delta", "zero"): "any improvement counts",
    ("trainer.early_stopping.min_delta", "huge"): "a choice: only improvements that large count (no upper bound)",
    ("model.hidden", "empty"): "hidden=[]: a linear model, a legitimate baseline",
    ("amp.float8.skip", "empty"): "skip=[]: every Linear torchao can convert runs in float8, the head too",
    ("optim.chain.*.learning_rate", "huge"): "no upper bound on a learning rate; a diverging run stops at its "
                                             "first non-finite loss (train.py)",
    ("optim.chain.*.weight_decay", "zero"): "no decay",
    ("optim.chain.*.weight_decay", "huge"): "no upper bound (it multiplies the learning rate)",
    ("optim.chain.*.eps", "zero"): "allowed by Adam/RMSprop (torch.optim too); the denominator is then sqrt(v)",
    ("optim.chain.*.eps", "huge"): "no upper bound: a large eps makes the step lr*m/eps (momentum SGD)",
    ("optim.chain.*.b1", "zero"): "no first-moment averaging (RMSprop-like)",
    ("optim.chain.*.b2", "zero"): "the second moment is the last gradient's square",
    ("optim.chain.*.decay", "zero"): "no averaging (rmsprop: the last square; trace: no momentum)",
    ("optim.chain.*.momentum", "zero"): "plain SGD",
    ("optim.chain.*.rho", "zero"): "no averaging (adadelta: the last square, as b2=0 for Adam)",
    ("optim.chain.*.initial_accumulator_value", "zero"): "Adagrad from 0 (eps keeps it finite)",
    ("optim.chain.*.initial_accumulator_value", "huge"): "no upper bound",
    ("optim.chain.*.max_norm", "huge"): "clipping that never binds",
    ("optim.chain.*.max_delta", "huge"): "clipping that never binds",
    ("schedule.init_value", "zero"): "warmup from 0 (a schedule that is 0 at every probed step is refused)",
    ("schedule.init_value", "huge"): "multiples of the learning rate have no upper bound (like learning_rate)",
    ("schedule.peak_value", "huge"): "multiples of the learning rate have no upper bound (like learning_rate)",
    ("schedule.value", "huge"): "multiples of the learning rate have no upper bound (like learning_rate)",
    ("schedule.end_value", "zero"): "decay to 0",
    ("schedule.end_value", "huge"): "multiples of the learning rate have no upper bound",
    ("schedule.alpha", "zero"): "cosine to 0",
    ("schedule.warmup_steps", "zero"): "no warmup",
    ("schedule.decay_steps", "huge"): "a decay longer than the run, not yet at its end when it stops",
    ("schedule.transition_steps", "huge"): "a decay longer than the run",
    ("schedule.decay_rate", "zero"): "Optax's exponential_decay: rate 0 holds init_value, no decay (documented)",
    ("amp.loss_scale", "huge"): "a static scale of 1e12 is finite in float32/bfloat16 (refused under float16)",
    ("amp.loss_scale.max_scale", "huge"): "a ceiling that never binds",
    ("amp.loss_scale.init_scale", "huge"): "dynamic: it backs off on overflow",
    ("amp.loss_scale.growth_factor", "huge"): "no upper bound",
    ("amp.loss_scale.growth_interval", "huge"): "never grows: a choice",
    ("amp.loss_scale.hysteresis", "huge"): "never backs off: a choice (Megatron's naive amp)",
    ("data.noise", "zero"): "noise-free prototypes",
    ("data.noise", "huge"): "noise std has no upper bound",
    ("parallel.*", "negative"): "documented: -1 = the rest of the world",
    ("trainer.heartbeat_s", "zero"): "documented: 0 = no heartbeat lines",
    ("debug.overfit_batches", "zero"): "documented: 0 = off",
    ("debug.profile_steps", "zero"): "documented: 0 = off",
    ("debug.profile_wait", "zero"): "profile from the first step",
}


# null: every key that takes it, and why (a key left out here refuses null naming itself).
ACCEPTED.update({(key, "null"): why for key, why in {
    "resume": "null: start at step 0 (documented)",
    "trainer.max_epochs": "null: the run is given in steps",
    "amp.float8.skip": "null: no Linear layer kept out of float8, as []",
    "trainer.cpu_threads": "null: torch's default",
    "trainer.heartbeat_s": "null: no heartbeat lines",
    "trainer.early_stopping.metric": "null: early stopping off",
    "trainer.checkpoint.best_by": "null: the optimized metric",
    "trainer.export": "null: no export",
    "amp.policy": "null: no mixed precision",
    "amp.loss_scale": "null: the policy's default",
    "amp.loss_scale.min_scale": "null: no floor", "amp.loss_scale.max_scale": "null: no ceiling",
    "accumulate.accumulator_dtype": "null: the gradients' dtype",
    "parallel.dp": "null: the default (the key before degrees)",
    **{f"parallel.{d}": "null: the degree is 1 (ParallelDims.of)" for d in distributed.DIMS},
    "debug.name": "null: a custom debug run", "debug.shortened": "null: nothing shortened", "debug.limit_*": "null: the whole split",
    "optim.chain.*.momentum": "null: no momentum (sgd)",
    "trainer.eval_hooks": "null: no hooks",
    "logger.*.run_name": "null: the run directory", "logger.*.tracking_uri": "null: <run dir>/mlflow.db",
    "logger.*.name": "null: the run directory", "logger.*.settings": "null: wandb's defaults",
    # data formats (fxtrain/sources.py)
    "data.val_file": "null: no validation file (validation reads the test split, and the run says so)",
    "data.test_file": "null: the validation file is the test split (nanoGPT writes no test.bin)",
    "data.val_shards": "null: no validation shards (validation reads the test split, and the run says so)",
    "data.val": "null: no validation pipeline (validation reads the test split, and the run says so)",
    "data.from_disk": "null: data_files names the data (one of the two; both null is refused where it is built)",
    "data.data_files": "null: from_disk names the data (one of the two; both null is refused where it is built)",
    "data.builder": "null: the builder follows the files' suffix (an unknown suffix is refused where it is built)",
    "data.target": "null: the next token of the input column (a language model)",
    "data.test_split": "null: the runner holds out test_fraction of the training split",
    "data.val_split": "null: no validation split of the files' own",
    "data.cache_dir": "null: Hugging Face's own cache",
}.items()})
ACCEPTED[("data.read_threads", "zero")] = "Grain reads in the training thread (documented)"
ACCEPTED.update({(key, "wrong_type"): f"{what} (the fuzz's wrong type for a null default is a string); {where}"
                 for key, what, where in (
    ("data.from_disk", "a path", "a missing directory is refused where it is built"),
    ("data.cache_dir", "a path", "Hugging Face makes it"),
    ("data.test_file", "a file name", "a missing file is refused where it is built"),
    ("data.val_shards", "a shard pattern", "a missing shard is refused where it is built"),
    ("data.test_split", "a split name", "one the data lacks is refused where it is built, naming its splits"),
    ("data.val_split", "a split name", "one the data lacks is refused where it is built, naming its splits"))})
ACCEPTED.update({
    ("logger.*.run_name", "wrong_type"): "a name (the fuzz's wrong type for a null default is a string)",
    ("logger.*.run_name", "empty"): "'' is the run directory, as null",
    ("logger.*.name", "wrong_type"): "a name (the fuzz's wrong type for a null default is a string)",
    ("logger.*.name", "empty"): "'' is the run directory, as null",
    ("logger.*.tracking_uri", "empty"): "'' is <run dir>/mlflow.db, as null",
})
ACCEPTED.update({
    ("optim.chain.reduce_on_plateau.patience", "zero"): "reduce at the first evaluation without improvement (>= 0)",
    ("optim.chain.reduce_on_plateau.patience", "huge"): "never reduces: a choice",
    ("optim.chain.reduce_on_plateau.cooldown", "zero"): "no cooldown",
    ("optim.chain.reduce_on_plateau.cooldown", "huge"): "one reduction at most: a choice",
    ("optim.chain.reduce_on_plateau.atol", "zero"): "relative tolerance only",
    ("optim.chain.reduce_on_plateau.atol", "huge"): "no upper bound",
    ("optim.chain.reduce_on_plateau.min_scale", "zero"): "no floor",
    ("optim.chain.reduce_on_plateau.accumulation_size", "huge"): "one decision per that many updates: never, a choice",
})
# one: 1 where a boolean goes (every boolean refuses it: 1 == True in Python), fuzzed on boolean keys only.


def _leaves(node: DictConfig, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k in node:
        child = node._get_node(k)
        key = f"{prefix}{k}"
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation() and len(child):
            out += _leaves(child, key + ".")
        else:
            out.append((key, child._value() if not isinstance(child, (DictConfig, ListConfig)) else child))
    return out


def _value(case: str, original: object) -> object:
    as_list = isinstance(original, ListConfig)
    number = {"negative": -1, "zero": 0, "nan": math.nan, "inf": math.inf,
              "huge": 1e30 if isinstance(original, float) else 10**12}.get(case)
    if case == "wrong_type":
        return True if isinstance(original, str) and not str(original).startswith("${") else "abc"
    if case == "empty":
        return [] if as_list else ""
    if case == "null":
        return None
    if case == "one":
        return 1
    return [number] if as_list else number


def _accepted_reason(key: str, case: str) -> str | None:
    for (pattern, c), reason in ACCEPTED.items():
        if c == case and fnmatch.fnmatchcase(key, pattern):
            return reason
    return None


def _names(key: str, message: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    return key in message or (bool(parent) and parent in message and leaf in message)


def _fuzz(base: list[str], skip: dict | None = None) -> dict[str, list]:
    """Every case of every leaf of ``cfg_of(*base)`` (those with the same value in ``skip`` left out)."""
    cfg = cfg_of(*base)
    runner.check(cfg)  # the base config itself is fine (max_steps of a run given in epochs settled)
    out: dict[str, list] = {"refused": [], "accepted": [], "tracebacks": [], "silent": [], "unnamed": []}
    for key, original in _leaves(cfg):
        if skip is not None and key in skip and repr(skip[key]) == repr(original):
            continue
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        for case in CASES:
            if case == "one" and not isinstance(original, bool):
                continue
            where = f"{key}x" if case == "unknown" else key
            # In place and put back (a deep copy per case would take most of the time).
            with open_dict(parent):
                parent[where.rpartition(".")[2]] = 1 if case == "unknown" else _value(case, original)
            try:
                validate.check(cfg)
            except build.ConfigError as e:
                message = str(e)
                if "\n" in message or not _names(where, message):
                    out["unnamed"].append((where, case, message))
                else:
                    out["refused"].append((where, case))
            except Exception as e:  # noqa: BLE001 - any other exception is a traceback for the user
                out["tracebacks"].append((where, case, f"{type(e).__name__}: {e}"))
            else:
                if _accepted_reason(key, case) is None:
                    out["silent"].append((where, case))
                else:
                    out["accepted"].append((where, case))
            finally:
                with open_dict(parent):
                    if case == "unknown":
                        del parent[where.rpartition(".")[2]]
                    else:
                        parent[leaf] = original
    return out


def _takes_learning_rate(option: pathlib.Path) -> bool:
    node = OmegaConf.load(option)
    spec = next(iter(node.values())) if "_target_" not in node else node
    return "learning_rate" in inspect.signature(build.locate(OmegaConf.to_container(spec), option.stem)).parameters


@functools.lru_cache(maxsize=None)
def _preset_bases() -> dict[str, list[str]]:
    """Every option of every config group of conf/ (hydra's and hparams_search's aside): a preset added there is
    fuzzed the day it is added. Each is composed as the command line picks it (a transform with an optimizer
    after it when it is none itself, so that the chain descends); one that only validates beside other choices
    (model=transformer needs text data) takes the first experiment under which the option validates (token files: model=transformer task=lm)."""
    conf = runner.CONF_DIR
    out = {}
    for option in sorted(conf.rglob("*.yaml")):
        group = option.parent.relative_to(conf).as_posix()
        if group == "." or group.split("/")[0] in ("hydra", "hparams_search") or option.stem.startswith("_"):
            continue
        if group == "optim/transform":
            chain = option.stem if _takes_learning_rate(option) else f"{option.stem},sgd"
            choice = f"optim/transform@optim.chain=[{chain}]"
        else:
            choice = f"logger=[{option.stem}]" if group == "logger" else f"{group}={option.stem}"
        experiments = [[f"experiment={e.stem}"] for e in sorted((conf / "experiment").glob("*.yaml"))]
        for context in [[], *experiments, ["model=transformer", "task=lm"]]:  # the last: token data's own model
            try:
                validate.check(cfg_of(*context, choice))
            except build.ConfigError:
                continue
            out[f"{group}/{option.stem}"] = [*context, choice]
            break
        else:
            out[f"{group}/{option.stem}"] = [choice]  # fails in the test, naming the option that validates nowhere
    return out


@pytest.fixture
def parse_once(monkeypatch):
    """OmegaConf parses an interpolation string at every resolution (ANTLR, about 1 ms): the fuzz resolves the
    same few strings thousands of times. Parsing is a pure function of the string and the parse tree is only
    read by the resolution, so the cases see the same values; this only makes the test fast."""
    import omegaconf.base

    monkeypatch.setattr(omegaconf.base, "parse", functools.lru_cache(maxsize=256)(omegaconf.base.parse))


@pytest.mark.parametrize("name", list(BASES))
@pytest.mark.usefixtures("parse_once")
def test_every_setting_is_refused_naming_its_key_or_legitimately_accepted(name):
    # The first two fuzz every key; the others only the keys they add or change (the options' own keys).
    found = _fuzz(BASES[name], None if name in ("default", "tiny_lm") else dict(_leaves(cfg_of())))
    total = sum(len(v) for v in found.values())
    print(f"\n{name}: {total} commands, {len(found['accepted'])} accepted (legit), {len(found['refused'])} refused "
          f"naming the key, {len(found['tracebacks'])} tracebacks, {len(found['silent'])} silently accepted, "
          f"{len(found['unnamed'])} not naming the key")
    assert not found["tracebacks"], found["tracebacks"][:10]
    assert not found["silent"], found["silent"]
    assert not found["unnamed"], found["unnamed"][:10]
    assert total > (400 if name in ("default", "tiny_lm") else 20)



@pytest.mark.parametrize("name", sorted(_preset_bases()))
@pytest.mark.usefixtures("parse_once")
def test_every_key_of_every_preset_is_refused_naming_it_or_legitimately_accepted(name):
    """The config tree as the generator: each option's own keys (those the default config lacks or sets
    otherwise), every case, validation only."""
    found = _fuzz(_preset_bases()[name], dict(_leaves(cfg_of())))
    assert not found["tracebacks"], found["tracebacks"][:10]
    assert not found["silent"], found["silent"]
    assert not found["unnamed"], found["unnamed"][:10]
