"""fxtrain: PyTorch training steps as pure functions over parameter pytrees, with Optax-style transforms.

This file is the map: every public name and the module it lives in.
"""

from fxtrain import tree

# --- core: protocol and combinators (fxtrain/_base.py)
from fxtrain._base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    apply_updates_,
    chain,
    identity,
    is_elementwise,
    named_chain,
    stateless,
    transform,
    update_,
)

# --- transforms and optimizers (fxtrain/transforms/, fxtrain/optimizers.py)
from fxtrain.transforms._scaling import scale

# --- schedules and hyperparameter injection (fxtrain/schedules.py, fxtrain/transforms/_hyperparams.py)

# --- clipping and distributed norms (fxtrain/transforms/_clipping.py, fxtrain/distributed.py)

# --- train step (fxtrain/step.py)

# --- functional models (fxtrain/functional.py)

__version__ = "0.1.0"
