"""fxtrain/build.py: the stack a config describes, and ``check_overrides``: the command line's group choices,
checked before Hydra composes."""

from __future__ import annotations

import pathlib
import sys

import pytest
from omegaconf import OmegaConf

from fxtrain import build
from fxtrain.distributed import ParallelDims
from tests._runner import cfg_of, isolate, run_main  # noqa: F401 - isolate: autouse (cwd, Hydra's state, logging)


def test_amp_policy_off_under_fsdp_builds_a_stack_that_casts_nothing():
    # FSDP layouts rewrite amp.policy to the params' dtype; 'off' has none (it keeps every dtype) and raised a
    # KeyError there once Policy.parse('off') became Policy(None, None, None).
    fsdp = ParallelDims.of(world=2, dp_shard=2)  # not built: the stack only asks it questions
    tx = build.stack(cfg_of("experiment=smoke", "amp.policy=off"), fsdp)
    assert repr(tx).startswith("amp_cast(policy='off'")
    assert build.stack(cfg_of("experiment=smoke", "amp=bf16"), fsdp).__repr__().startswith("amp_cast(policy='p=f32,c=f32,o=f32'")


# --- check_overrides ----------------------------------------------------------------------------------------

TINY = ["data=synthetic", "model.hidden=[8]", "trainer.max_steps=2", "trainer.progress=false", "trainer.device=cpu",
        "trainer.cpu_threads=1"]


def test_a_structure_sweep_of_the_chain_is_checked_option_by_option():
    build.check_overrides(["-m", "optim/transform@optim.chain=[clip_by_global_norm,adamw],[sgd]"])
    build.check_overrides(["-m", "optim/transform@optim.chain=choice([sgd],[trace,sgd])", "model=glob(*)"])
    with pytest.raises(build.ConfigError, match=r"^optim/transform@optim.chain=\[sgd\],\[clip,adamz\]: no transform "
                                                r"'adamz' in optim/transform \(did you mean adam"):
        build.check_overrides(["-m", "optim/transform@optim.chain=[sgd],[clip,adamz]"])


def test_a_structure_sweep_gives_each_job_its_chain():
    # Hydra accepts a sweep over the chain's structure; the override check used to refuse it (it split "[a,b],[c,d]"
    # on commas and looked for an option named "b]").
    assert run_main("-m", "optim/transform@optim.chain=[clip_by_global_norm,adamw],[sgd]", *TINY,
                    "hydra.sweep.dir=sweep") == 0
    chains = [list(OmegaConf.load(pathlib.Path("sweep", job, "config.yaml")).optim.chain) for job in ("0", "1")]
    assert chains == [["clip_by_global_norm", "adamw"], ["sgd"]]
    for job in ("0", "1"):
        assert "done   2 steps" in pathlib.Path("sweep", job, "train.log").read_text()


def test_the_search_path_of_another_command_line_is_hydras_own(monkeypatch):
    # fxtrain's search-path plugin reads this process's command line, which may be pytest's (-rA, -c FILE): one
    # Hydra cannot parse adds no entries, and stops nothing.
    assert build.user_search_path(["-rA", "-c", "pyproject.toml"]) == []
    monkeypatch.setattr(sys, "argv", ["pytest", "-rA"])
    build.check_overrides(["model=mlp"])
    assert run_main("-rA", "--cfg", "job") == 2  # the runner's own command line: Hydra's usage error, as before
