"""fxtrain/schema.py: the runner's settings declared once. Generated over every declared field: its default is
conf/'s, a value of the wrong type and one out of its range are refused by fxtrain.validate.check in one line naming
the key; an unknown key, with or without +, from the command line, an experiment or the user's own config, is
refused in one line naming the nearest key; --help prints every field with its type, default and doc."""

from __future__ import annotations

import copy
import dataclasses
import math
import pathlib
import typing

import annotated_types
import pytest
from omegaconf import OmegaConf, open_dict
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

import fxtrain as fx
from fxtrain import build, schema, validate
from fxtrain import train as runner
from tests._runner import cfg_of, isolate, run_main  # noqa: F401 - isolate: autouse (runs in tmp_path)

# The conf/ file (and node in it) each declared node's defaults come from (a node's every option starts from these).
DEFAULTS_FROM = {"": ("train.yaml", ""), "trainer": ("trainer/default.yaml", ""), "amp": ("amp/off.yaml", ""),
                 "trainer.early_stopping": ("trainer/default.yaml", "early_stopping"),
                 "trainer.checkpoint": ("trainer/default.yaml", "checkpoint"),
                 "accumulate": ("accumulate/off.yaml", ""), "parallel": ("parallel/_degrees.yaml", ""),
                 "debug": ("debug/_settings.yaml", ""), "amp.loss_scale": ("amp/naive_fp16.yaml", "loss_scale"),
                 "amp.float8": ("amp/float8.yaml", "float8")}


def _fields() -> list[tuple[str, typing.Any]]:
    """``(key, model)`` of every declared field that holds a value (not a node of its own, not ``Any``)."""
    out = []
    for node, model in schema.node_models().items():
        for name, info in model.model_fields.items():
            key = f"{node}.{name}" if node else name
            members = [a for a in typing.get_args(info.annotation) or (info.annotation,) if a is not type(None)]
            if info.annotation is typing.Any or all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
                continue  # a _target_ node, or a node of its own
            out.append((key, model))
    return out


FIELDS = _fields()


def _bounds(annotation: typing.Any, metadata: list) -> list:
    """The annotated-types bounds of a field and of each member of its unions (a value just outside one bound may be
    inside another member's: the caller keeps the values the field refuses)."""
    found = [c for m in metadata for c in (m.metadata if isinstance(m, FieldInfo) else [m])
             if isinstance(c, annotated_types.BaseMetadata)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _bounds(typing.get_args(annotation)[0], [*found, *annotation.__metadata__])
    if typing.get_origin(annotation) is typing.Union:
        return [*found, *(b for a in typing.get_args(annotation) for b in _bounds(a, []))]
    return found


def _accepts(model: type[BaseModel], name: str, value: typing.Any) -> bool:
    try:
        model.model_validate({name: value})
    except ValidationError:
        return False
    return True


def _wrong_values(model: type[BaseModel], name: str) -> list:
    """Values of the wrong type for the field, then out of its range (from its declared bounds and choices)."""
    info = model.model_fields[name]
    wrong: list = [[1], "abc", 5]  # a list (no declared field takes one), a string, a whole number
    for bound in _bounds(info.annotation, info.metadata):
        outside = {annotated_types.Ge: lambda b: b.ge - 1, annotated_types.Gt: lambda b: b.gt,
                   annotated_types.Le: lambda b: b.le + 1, annotated_types.Lt: lambda b: b.lt}
        for kind, value in outside.items():
            if isinstance(bound, kind):
                wrong.append(value(bound))
    args = typing.get_args(info.annotation)
    if typing.get_origin(info.annotation) is typing.Literal or any(typing.get_origin(a) is typing.Literal for a in args):
        wrong.append("not_an_option")
    if any(a is float or typing.get_args(a)[:1] == (float,) for a in (info.annotation, *args)):
        wrong.append(math.nan)
    return [v for v in wrong if not _accepts(model, name, v)]


def _base(key: str) -> list[str]:
    """A config where ``key`` exists: its node's option picked (the loss scale's mapping, a debug option)."""
    if key.startswith("amp.loss_scale."):
        return ["amp=naive_fp16"]
    if key.startswith("amp.float8."):
        return ["amp=float8"]
    return ["debug=limit"] if key.startswith("debug.") else []


@pytest.fixture(scope="module")
def bases():
    return {}  # the composed configs, once per module (a copy per case)


@pytest.mark.parametrize("key", [k for k, _ in FIELDS])
def test_every_field_refuses_a_wrong_type_and_an_out_of_range_value_in_one_line_naming_the_key(key, bases):
    model = dict(FIELDS)[key]
    wrong = _wrong_values(model, key.rpartition(".")[2])
    assert wrong, f"{key}: no wrong value generated"
    base = tuple(_base(key))
    if base not in bases:
        bases[base] = cfg_of(*base)
    parent_key, _, leaf = key.rpartition(".")
    for value in wrong:
        cfg = copy.deepcopy(bases[base])
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        with open_dict(parent):
            parent[leaf] = value
        with pytest.raises(build.ConfigError) as e:
            validate.check(cfg)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"{key}="), (value, line)
        assert ": expected " in line, line


def test_every_field_has_a_doc_and_conf_s_default():
    conf = runner.CONF_DIR
    checked = 0
    assert set(schema.node_models()) == set(DEFAULTS_FROM) | {"optim"}  # a new node is added here
    for node, (source, under) in DEFAULTS_FROM.items():
        values = OmegaConf.select(OmegaConf.load(conf / source), under) if under else OmegaConf.load(conf / source)
        for name, info in schema.node_models()[node].model_fields.items():
            assert info.description, f"{node}.{name}: no doc"
            if node == "amp.loss_scale":  # naive_fp16 sets some of them: the reference is fx.DynamicLossScale
                continue
            if name in values and not OmegaConf.is_dict(values._get_node(name)):
                given = values._get_node(name)._value()
                assert info.default == given, f"{node or 'top level'}.{name}: schema {info.default!r}, {source} {given!r}"
                checked += 1
    assert checked >= 45
    # amp.loss_scale's mapping is fx.DynamicLossScale's arguments, with its defaults
    fields = {f.name: f.default for f in dataclasses.fields(fx.DynamicLossScale)}
    assert {k: v.default for k, v in schema.LossScale.model_fields.items()} == fields
    assert set(OmegaConf.load(conf / "amp/naive_fp16.yaml").loss_scale) <= set(fields)


def test_a_nested_union_names_the_key_under_it():
    line = _refused("amp=naive_fp16", "+amp.loss_scale.backoff_factor=2.0")
    assert line == "amp.loss_scale.backoff_factor=2.0: expected a number in (0, 1) (multiplies the scale on a " \
                   "counted overflow); e.g. amp.loss_scale.backoff_factor=0.5"
    assert _refused("amp=naive_fp16", "+amp.loss_scale.hysterisis=2").startswith(
        "amp.loss_scale.hysterisis: not a setting fxtrain reads (did you mean amp.loss_scale.hysteresis?)")


def _refused(*overrides: str) -> str:
    with pytest.raises(build.ConfigError) as e:
        validate.check(cfg_of(*overrides))
    return str(e.value)


# --- unknown keys: with or without +, from the command line, an experiment, the user's own config --------------

NEAREST = "trainer.max_stpes: not a setting fxtrain reads (did you mean trainer.max_steps?); trainer's settings are"


@pytest.mark.parametrize("arg", ["trainer.max_stpes=5", "+trainer.max_stpes=5"])
def test_an_unknown_key_on_the_command_line_is_one_line_naming_the_nearest(arg, capsys):
    code = run_main(arg, "trainer.device=cpu")
    assert isinstance(code, str) and code.startswith(f"Error: {NEAREST}"), code
    assert "Could not override" not in capsys.readouterr().err
    assert not pathlib.Path("outputs").exists() or arg.startswith("+")  # without +: refused before Hydra runs


@pytest.mark.parametrize("arg, line", [
    ("model.hiden=[8]", "Error: model.hiden=[8]: the config has no key model.hiden (did you mean model.hidden?); "
                        "fix the name, or add a key with +model.hiden=[8]"),
    ("optim.chain.adamw.lerning_rate=0.1", "Error: optim.chain.adamw.lerning_rate=0.1: the config has no key "
                                           "optim.chain.adamw.lerning_rate (did you mean "
                                           "optim.chain.adamw.learning_rate?)"),
    ("modle.hidden=[8]", "Error: modle: not a setting fxtrain reads (did you mean model?)"),
    ("debug.limit_train=0.5", "Error: debug.limit_train=0.5: the config has no key debug.limit_train; fix the name, "
                              "or add a key with +debug.limit_train=0.5"),  # no debug option picked
    ("amp.loss_scale.init_scale=8.0", "Error: amp.loss_scale.init_scale=8.0: amp.loss_scale=null has no keys; set "
                                      "it to a node first"),  # amp=off: the loss scale is null
])
def test_an_unknown_key_of_a_target_node_without_plus_names_the_nearest_of_the_composed_config(arg, line, capsys):
    code = run_main(arg)
    assert isinstance(code, str) and code.startswith(line), code
    assert "Could not override" not in capsys.readouterr().err


def test_an_unknown_key_in_an_experiment_or_the_users_own_config_is_one_line_naming_the_nearest(tmp_path):
    conf = tmp_path / "conf"
    for name, text in {"experiment/typo.yaml": "# @package _global_\ntrainer:\n  max_stpes: 5\n",
                       "amp/mine.yaml": "policy: bf16\npolcy: bf16\n",
                       "model/mine.yaml": "_target_: fxtrain.models.MLP\ninput_shape: [64]\nhiden: [8]\n"}.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    code = run_main("--config-dir", str(conf), "experiment=typo", "trainer.device=cpu")
    assert isinstance(code, str) and code.startswith(f"Error: {NEAREST}"), code
    code = run_main("--config-dir", str(conf), "amp=mine", "trainer.device=cpu")
    assert code.startswith("Error: amp.polcy: not a setting fxtrain reads (did you mean amp.policy?)"), code
    code = run_main("--config-dir", str(conf), "model=mine", "trainer.device=cpu")
    assert "model: hiden is not an argument of fxtrain.models.MLP" in code and "(did you mean hidden?)" in code, code
    code = run_main("--config-dir", str(conf), "amp=mine", "amp.polcy=fp16")  # the user's own key, without +
    assert code.startswith("Error: amp.polcy: not a setting fxtrain reads (did you mean amp.policy?)"), code


def test_known_keys_and_additions_pass_the_entry_check():
    build.check_override_keys(["trainer.max_steps=5", "model.hidden=[8]", "+model.extra=1", "++trainer.seed2=1",
                               "optim.chain.adamw.learning_rate=1e-3", "~trainer.export", "-m", "seed=0,1"])
    build.check_override_keys(["-m", "model=mlp,resnet", "model.hiden=[8]"])  # a sweep over groups: Hydra checks each


# --- --help ------------------------------------------------------------------------------------------------

def test_help_prints_every_declared_field_with_its_type_default_and_doc(capsys):
    assert run_main("--help") == 0
    out = capsys.readouterr().out
    assert "== Configuration groups ==" in out and "--hydra-help" in out
    for node, model in schema.node_models().items():
        assert f"== {node or 'top level'} ==" in out
    assert "  max_steps: a positive whole number (at most 2**31-1) = 1000  optimizer steps, counted in batches" in out
    assert "  mode: one of auto, min, max = auto  auto: min for names with loss or error, else max" in out
    assert "  log_every: a positive whole number (at most 2**31-1) = ${fxtrain.every:${trainer.max_steps},40}" in out
    shown = sum(1 for key, _ in FIELDS if f"  {key.rpartition('.')[2]}: " in out)
    assert shown == len(FIELDS)
    assert run_main("--hydra-help") == 0
    assert "Hydra (" in capsys.readouterr().out  # Hydra's own help stays reachable
