"""fxtrain/build.py: the stack a config describes (the override checks are in test_build_overrides.py)."""

from __future__ import annotations

from tests._runner import cfg_of

from fxtrain import build
from fxtrain.distributed import ParallelDims


def test_amp_policy_off_under_fsdp_builds_a_stack_that_casts_nothing():
    # FSDP layouts rewrite amp.policy to the params' dtype; 'off' has none (it keeps every dtype) and raised a
    # KeyError there once Policy.parse('off') became Policy(None, None, None).
    fsdp = ParallelDims.of(world=2, dp_shard=2)  # not built: the stack only asks it questions
    tx = build.stack(cfg_of("experiment=smoke", "amp.policy=off"), fsdp)
    assert repr(tx).startswith("amp_cast(policy='off'")
    assert build.stack(cfg_of("experiment=smoke", "amp=bf16"), fsdp).__repr__().startswith("amp_cast(policy='p=f32,c=f32,o=f32'")
