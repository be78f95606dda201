"""Float8 training through torchao (the ``float8`` extra): a model's ``nn.Linear`` layers as ``Float8Linear``.

torchtitan's float8 converter, for fxtrain's models: :func:`convert` swaps every ``nn.Linear`` that torchao can
run in float8 (both dims multiples of 16, :func:`convertible`) for torchao's ``Float8Linear`` (tensorwise dynamic
scaling: e4m3 input and weight, e5m2 output gradient), before the model is placed on the run's mesh. Its
matmuls then run in float8 and everything else as the amp policy says (the runner's ``amp=float8``: bf16
compute, float32 master params, as torchtitan's float8 + bf16). On hardware without float8 matmuls (CPU,
CUDA below SM89) torchao emulates them (``Float8LinearConfig(emulate=True)``: the same quantization, the
matmul in high precision), as torchtitan's CPU tests do; :func:`hardware_float8` says which.

Example:
    >>> import torch
    >>> from fxtrain import float8
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    >>> float8.convert(model, device=torch.device("cpu"))   # the last one: 10 is no multiple of 16
    ['0']
    >>> type(model[0]).__name__, type(model[2]).__name__
    ('Float8Linear', 'Linear')
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import nn

from fxtrain import extras

__all__ = ["MULTIPLE", "convert", "convertible", "hardware_float8", "note", "torchao_float8"]

MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both dims of a weight divisible by 16


def torchao_float8(what: str = "amp=float8") -> ModuleType:
    """``torchao.float8``, imported quietly; a missing torchao is the one line naming ``what`` and the extra.

    Importing torchao logs two warnings on a CPU build ("Failed to load ... _C_mxfp8", "... _C_cutlass_90a":
    CUDA kernels) and torch's pytree logs one about its Enum constants; none says anything about a run, so
    those two loggers are held at ERROR while it imports (a Python warning still surfaces).
    """
    with _quiet("torchao", "torch.utils._pytree"):
        return extras.require("torchao.float8", what, "torchao", "float8")


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def hardware_float8(device: torch.device) -> bool:
    """Whether ``device`` multiplies in float8 (CUDA SM89 and later); elsewhere torchao emulates.

    >>> hardware_float8(torch.device("cpu"))
    False
    """
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def convertible(module: nn.Module, fqn: str, skip: Sequence[str] = ()) -> bool:
    """torchtitan's filter: an ``nn.Linear`` whose dims are both multiples of 16, not named in ``skip``.

    >>> convertible(torch.nn.Linear(32, 64), "mlp.0"), convertible(torch.nn.Linear(32, 10), "out")
    (True, False)
    >>> convertible(torch.nn.Linear(32, 64), "head", skip=["head"])
    False
    """
    return (isinstance(module, nn.Linear) and fqn not in skip
            and module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0)


def convert(model: nn.Module, *, device: torch.device, skip: Sequence[str] = ()) -> list[str]:
    """Swaps ``model``'s :func:`convertible` Linear layers for torchao's ``Float8Linear``, in place; returns their names.

    The weights and biases stay the same ``Parameter`` objects (tied weights stay tied). Emulated where
    ``device`` has no float8 matmuls (:func:`hardware_float8`).

    Args:
      model: the built model, before it is placed on a mesh.
      device: where it trains.
      skip: names of Linear layers to keep in the compute dtype (torchtitan's ``filter_fqns``: the output head).

    Raises:
      ValueError: no Linear layer is convertible (naming the model and why), or a name in ``skip`` is no
        Linear layer of the model.
      fxtrain.errors.ConfigError: torchao is not installed (``pip install 'fxtrain[float8]'``).
    """
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = [s for s in skip if s not in linears]
    if unknown:
        raise ValueError(f"amp.float8.skip names {', '.join(unknown)}, which {type(model).__name__} has no nn.Linear "
                         f"of; its Linear layers are {', '.join(sorted(linears)) or 'none'}")
    names = [n for n, m in model.named_modules() if convertible(m, n, skip)]
    if not names:
        odd = sorted(linears - set(skip))
        why = (f"no Linear layer has both dims multiples of {MULTIPLE} ({', '.join(odd)})" if odd
               else "it has no nn.Linear layer" + (" outside amp.float8.skip" if skip else ""))
        raise ValueError(f"amp=float8: {type(model).__name__} has nothing to train in float8: {why}; use amp=bf16, "
                         f"or a model with such layers (model=transformer with model.d_model a multiple of {MULTIPLE})")
    ao = torchao_float8()
    config = ao.Float8LinearConfig(emulate=not hardware_float8(device))
    chosen = set(names)
    ao.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    return names


def note(model: nn.Module) -> str:
    """What :func:`convert` did to ``model``, for the run's ``model`` line: ``", 8 Linear layers in float8
    (emulated)"``, or ``""``.

    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    >>> note(model), (convert(model, device=torch.device("cpu")), note(model))[1]
    ('', ', 1 Linear layer in float8 (emulated)')
    """
    linear = sys.modules.get("torchao.float8.float8_linear")  # not imported: nothing was converted
    found = [m for m in model.modules() if linear is not None and isinstance(m, linear.Float8Linear)]
    if not found:
        return ""
    emulated = " (emulated)" if all(m.config.emulate for m in found) else ""
    return f", {len(found)} Linear layer{'s' if len(found) > 1 else ''} in float8{emulated}"
