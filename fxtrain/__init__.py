"""fxtrain: PyTorch training steps as pure functions over parameter pytrees, with Optax-style transforms.

This file is the map: every public name and the module it lives in.
"""

from fxtrain import tree
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
from fxtrain.transforms._scaling import scale

__version__ = "0.1.0"
