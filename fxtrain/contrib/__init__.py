"""Optax's ``contrib``: optimizers and wrappers from recent research, with Optax's names and numbers.

``fx.contrib.muon`` is ``optax.contrib.muon``. This file is the map: every public name and its module.
"""

from fxtrain.contrib._muon import MuonDimensionNumbers, MuonState, muon, scale_by_muon
from fxtrain.contrib._prodigy import ProdigyState, prodigy
from fxtrain.contrib._adopt import adopt, scale_by_adopt
from fxtrain.contrib._ademamix import (
    ScaleByAdemamixState,
    ScaleBySimplifiedAdEMAMixState,
    ademamix,
    scale_by_ademamix,
    scale_by_simplified_ademamix,
    simplified_ademamix,
)
from fxtrain.contrib._schedule_free import (
    ScheduleFreeState,
    schedule_free,
    schedule_free_adamw,
    schedule_free_eval_params,
    schedule_free_sgd,
)
from fxtrain.contrib._sam import NormalizeState, SAMState, normalize, sam
from fxtrain.contrib._privacy import DifferentiallyPrivateAggregateState, differentially_private_aggregate, dpsgd
from fxtrain.contrib._reduce_on_plateau import ReduceLROnPlateauState, reduce_on_plateau
from fxtrain.contrib._cocob import COCOBState, cocob, scale_by_cocob
from fxtrain.contrib._complex_valued import (
    SplitRealAndImaginaryArrays,
    SplitRealAndImaginaryState,
    split_real_and_imaginary,
)
from fxtrain.contrib._dadapt_adamw import DAdaptAdamWState, dadapt_adamw
from fxtrain.contrib._dog import DoGState, DoWGState, dog, dowg, scale_by_dog, scale_by_dowg
from fxtrain.contrib._madgrad import MadgradState, madgrad, scale_by_madgrad
from fxtrain.contrib._mechanic import MechanicState, mechanize
from fxtrain.contrib._momo import MomoAdamState, MomoState, momo, momo_adam
