"""JAX interop (``fx.interop``): trees, optimizer states, Flax naming and JAX functions across frameworks.

JAX is an optional extra (``pip install 'fxtrain[jax]'``): importing this package never imports JAX;
each function imports it when called and raises ``ImportError`` naming the extra when it is missing.
The linen adapters are pure tree conversions that produce (and read) the variables a ``flax.linen``
module would have, without Flax; the NNX functions and the Orbax checkpoints import ``flax`` and
``orbax.checkpoint`` (both in the ``jax`` extra) when called.

This file is the map of the package.
"""

# --- arrays: zero-copy trees through DLPack (fxtrain/interop/_arrays.py)
from fxtrain.interop._arrays import from_jax, to_jax

# --- optimizer states <-> Optax (fxtrain/interop/_optax_state.py)
from fxtrain.interop._optax_state import state_from_optax, state_to_optax

# --- Flax linen naming and layout (fxtrain/interop/_linen.py)
from fxtrain.interop._linen import from_linen, linen_names, to_linen

# --- Flax NNX modules and nnx.Optimizer states (fxtrain/interop/_nnx.py)
from fxtrain.interop._nnx import from_nnx, state_from_nnx_optimizer, state_to_nnx_optimizer, to_nnx

# --- Orbax checkpoints a JAX program restores, and reads the ones it writes (fxtrain/interop/_orbax.py)
from fxtrain.interop._orbax import load_orbax, save_orbax

# --- JAX functions inside a torch loss, with autograd (fxtrain/interop/_function.py)
from fxtrain.interop._function import jax_function

# --- safetensors files with state_dict names, loadable by transformers (fxtrain/interop/_safetensors.py)
from fxtrain.interop._safetensors import load_safetensors, save_safetensors

__all__ = [
    "to_jax", "from_jax", "state_to_optax", "state_from_optax", "to_linen", "from_linen", "linen_names",
    "jax_function", "from_nnx", "to_nnx", "state_from_nnx_optimizer", "state_to_nnx_optimizer",
    "save_safetensors", "load_safetensors",
    "save_orbax", "load_orbax",
]
