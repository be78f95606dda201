"""Optax's ``contrib``: optimizers and wrappers from recent research, with Optax's names and numbers.

``fx.contrib.muon`` is ``optax.contrib.muon``. This file is the map: every public name and its module.
"""

from fxtrain.contrib._muon import *  # noqa: F401,F403 - explicit lists once the catalogue has landed
from fxtrain.contrib._prodigy import *  # noqa: F401,F403
from fxtrain.contrib._adopt import *  # noqa: F401,F403
from fxtrain.contrib._ademamix import *  # noqa: F401,F403
from fxtrain.contrib._schedule_free import *  # noqa: F401,F403
from fxtrain.contrib._sam import *  # noqa: F401,F403
from fxtrain.contrib._privacy import *  # noqa: F401,F403
from fxtrain.contrib._reduce_on_plateau import *  # noqa: F401,F403
from fxtrain.contrib._more import *  # noqa: F401,F403
