"""fxtrain: PyTorch training steps as pure functions over parameter pytrees, with Optax-style transforms.

This file is the map: every public name and the module it lives in.
"""

from fxtrain import tree

# --- core: protocol and combinators (fxtrain/_base.py)
from fxtrain._base import (
    EmptyState,
    GradientTransformation,
    Traits,
    apply_updates,
    apply_updates_,
    chain,
    identity,
    is_elementwise,
    named_chain,
    stateless,
    traits,
    transform,
    update_,
    with_traits,
)

# --- transforms and optimizers (fxtrain/transforms/, fxtrain/optimizers.py)
from fxtrain.optimizers import adagrad, adam, adamw, lion, rmsprop, sgd
from fxtrain.transforms._adam import ScaleByAdamState, scale_by_adam
from fxtrain.transforms._lion import ScaleByLionState, scale_by_lion
from fxtrain.transforms._masking import (
    MaskedNode,
    MaskedState,
    PartitionState,
    freeze,
    masked,
    multi_transform,
    partition,
    selective_transform,
)
from fxtrain.transforms._momentum import TraceState, trace
from fxtrain.transforms._rms import (
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByRssState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
)
from fxtrain.transforms._scaling import ScaleByScheduleState, scale, scale_by_learning_rate, scale_by_schedule
from fxtrain.transforms._weight_decay import WeightDecaySchedule, add_decayed_weights

# --- schedules and hyperparameter injection (fxtrain/schedules.py, fxtrain/transforms/_hyperparams.py)
from fxtrain.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    cosine_onecycle_schedule,
    exponential_decay,
    join_schedules,
    linear_onecycle_schedule,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_cosine_decay_schedule,
)
from fxtrain.transforms._conditionality import (
    ApplyIfFiniteState,
    ConditionallyMaskState,
    ConditionallyTransformState,
    apply_if_finite,
    conditionally_mask,
    conditionally_transform,
)
from fxtrain.transforms._hyperparams import InjectHyperparamsState, inject_hyperparams

# --- clipping and distributed norms (fxtrain/transforms/_clipping.py, fxtrain/distributed/)
from fxtrain.distributed import global_norm
from fxtrain.transforms._clipping import ClipByGlobalNormState, clip, clip_by_global_norm

# --- train step (fxtrain/step.py)
from fxtrain.step import train_step

# --- per-example gradients and clipping (fxtrain/per_example.py, fxtrain/transforms/_per_example.py)
from fxtrain.per_example import per_example_grads
from fxtrain.transforms._per_example import per_example_global_norm_clip

# --- functional models (fxtrain/functional.py)
from fxtrain.functional import functional

# --- mixed precision (fxtrain/amp.py)
from fxtrain.amp import (
    AmpCastState,
    DynamicLossScale,
    DynamicLossScaleState,
    NoLossScale,
    Policy,
    StaticLossScale,
    StaticLossScaleState,
    amp_cast,
    amp_preset,
)

# --- accumulation (fxtrain/transforms/_accumulation.py)
from fxtrain.transforms._accumulation import AccumulateState, accumulate, microbatch, skip_large_updates, skip_not_finite

# --- checkpointing (fxtrain/checkpoint.py)
from fxtrain.checkpoint import CheckpointError, TrainState, load, rng_state, save, set_rng_state

# --- JAX interop (fxtrain/interop/): JAX stays optional, imported only when an interop function runs
from fxtrain import interop

# --- sharded optimizer math (fxtrain/transforms/_sharding.py)
from fxtrain.transforms._sharding import sharded_apply

# --- issue 18's catalogue (explicit lists once it has landed)
from fxtrain.transforms._adaptive import *  # noqa: F401,F403
from fxtrain.transforms._factored import *  # noqa: F401,F403
from fxtrain.transforms._trust import *  # noqa: F401,F403
from fxtrain.transforms._sign import *  # noqa: F401,F403
from fxtrain.transforms._noise import *  # noqa: F401,F403
from fxtrain.transforms._linesearch import *  # noqa: F401,F403
from fxtrain.transforms._lbfgs import *  # noqa: F401,F403
from fxtrain.transforms._polyak import *  # noqa: F401,F403
from fxtrain.transforms._normalizing import *  # noqa: F401,F403
from fxtrain.transforms._simple import *  # noqa: F401,F403
from fxtrain.transforms._lookahead import *  # noqa: F401,F403
from fxtrain.transforms._flatten import *  # noqa: F401,F403
from fxtrain.transforms._monitoring import *  # noqa: F401,F403
from fxtrain.transforms._periodic import *  # noqa: F401,F403

# --- Optax's contrib (fxtrain/contrib/): fx.contrib.muon, fx.contrib.schedule_free_adamw...
from fxtrain import contrib

__version__ = "0.1.0"
