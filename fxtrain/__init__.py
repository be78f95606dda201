"""fxtrain: PyTorch training steps as pure functions over parameter pytrees, with Optax-style transforms.

This file is the map: every public name and the module it lives in.
"""

from fxtrain._moved import moved_names as _moved_names

# --- the public modules: fx.tree.map, fx.testing.check_transform, fx.distributed.ParallelDims...
from fxtrain import (
    amp,
    checkpoint,
    distributed,
    errors,
    models,
    optimizers,
    per_example,
    schedules,
    step,
    tasks,
    testing,
    transforms,
    tree,
)

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
    named,
    named_chain,
    stateless,
    traits,
    transform,
    update_,
    with_traits,
)

# --- writing your own transforms: fx.extend.combine, fx.extend.call... (fxtrain/extend.py); describe stays here too
# (the runner prints hyperparameters with fx.describe)
from fxtrain import extend
from fxtrain._base import describe

# --- transforms and optimizers (fxtrain/transforms/, fxtrain/optimizers.py)
from fxtrain.optimizers import adagrad, adam, adamw, lion, nadam, nadamw, polyak_sgd, rmsprop, sgd
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
from fxtrain.transforms._accumulation import (
    AccumulateState,
    AccumulationType,
    Accumulator,
    accumulate,
    microbatch,
    skip_large_updates,
    skip_not_finite,
    split_backward,
)

# --- checkpointing (fxtrain/checkpoint.py)
from fxtrain.checkpoint import CheckpointError, TrainState, load, rng_state, save, set_rng_state

# --- torch's parallel engines under the functional step (fxtrain/parallel/): fx.parallel.fully_sharded_step...
from fxtrain import parallel

# --- JAX interop (fxtrain/interop/): JAX stays optional, imported only when an interop function runs
from fxtrain import interop

# --- sharded optimizer math (fxtrain/transforms/_sharding.py)
from fxtrain.transforms._sharding import sharded_apply

# --- the Optax catalogue: one module per family (fxtrain/transforms/)
from fxtrain.transforms._adaptive import (
    ScaleByAdaDeltaState,
    ScaleByAdanState,
    ScaleByAmsgradState,
    ScaleByBeliefState,
    ScaleByNovogradState,
    ScaleByOptimisticGradientState,
    adabelief,
    adadelta,
    adamax,
    adamaxw,
    adan,
    amsgrad,
    novograd,
    optimistic_adam,
    optimistic_adam_v2,
    optimistic_gradient_descent,
    radam,
    scale_by_adadelta,
    scale_by_adamax,
    scale_by_adan,
    scale_by_amsgrad,
    scale_by_belief,
    scale_by_novograd,
    scale_by_optimistic_gradient,
    scale_by_radam,
    scale_by_yogi,
    yogi,
)
from fxtrain.transforms._factored import (
    FactoredState,
    ScaleBySM3State,
    adafactor,
    scale_by_factored_rms,
    scale_by_sm3,
    sm3,
)
from fxtrain.transforms._trust import fromage, lamb, lars, scale_by_trust_ratio
from fxtrain.transforms._sign import ScaleByRpropState, rprop, scale_by_rprop, scale_by_sign, sign_sgd, signum
from fxtrain.transforms._noise import AddNoiseState, add_noise, noisy_sgd
from fxtrain.transforms._linesearch import (
    BacktrackingLinesearchInfo,
    ScaleByBacktrackingLinesearchState,
    ScaleByZoomLinesearchState,
    ZoomLinesearchInfo,
    scale_by_backtracking_linesearch,
    scale_by_zoom_linesearch,
    value_and_grad_from_state,
)
from fxtrain.transforms._lbfgs import ScaleByLBFGSState, lbfgs, scale_by_lbfgs
from fxtrain.transforms._polyak import scale_by_polyak
from fxtrain.transforms._normalizing import (
    ScaleByDistanceOverGradientsState,
    adaptive_grad_clip,
    centralize,
    clip_by_block_rms,
    normalize_by_update_norm,
    per_example_layer_norm_clip,
    scale_by_distance_over_gradients,
    scale_by_param_block_norm,
    scale_by_param_block_rms,
)
from fxtrain.transforms._simple import EmaState, ZeroNansState, ema, set_to_zero, stateless_with_tree_map, zero_nans
from fxtrain.transforms._lookahead import LookaheadParams, LookaheadState, lookahead
from fxtrain.transforms._flatten import flatten
from fxtrain.transforms._monitoring import MonitorState, SnapshotState, measure_with_ema, monitor, snapshot
from fxtrain.transforms._periodic import ApplyEvery, apply_every, incremental_update, periodic_update

# --- Optax's contrib (fxtrain/contrib/): fx.contrib.muon, fx.contrib.schedule_free_adamw...
from fxtrain import contrib

__version__ = "0.1.0"

# The extension API's old top-level names, for one more release (issue 38): they moved to fx.extend.
__getattr__ = _moved_names(__name__, {name: f"fxtrain.extend.{name}" for name in (
    "call", "call_", "check_learning_rate", "check_needs_params", "check_nonnegative", "combine", "forwarded",
    "kernel")})

# The public names: every name this map imports (tests/test_public_names.py checks it against the imports above).
__all__ = sorted(name for name in globals() if not name.startswith("_"))
