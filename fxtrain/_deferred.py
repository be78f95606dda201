"""torch.distributed's heavy classes and modules, named without importing them until they can matter.

``torch.distributed.tensor`` costs about 0.5 s at start-up (a third of ``import fxtrain`` on a quiet machine), and
``torch.distributed.fsdp`` and ``torch.distributed.checkpoint`` import it. Yet a ``DTensor`` (or a ``Replicate``
placement, or an ``FSDPModule``) cannot exist until its module has been imported, so "is ``x`` a ``DTensor``" has
a free answer while it has not: no. The stand-ins here are that one question, asked by ``isinstance``, so the
modules that check for a DTensor on every leaf keep their ``isinstance(x, DTensor)`` and pay one dictionary look-up
on a program that never shards anything. Anything else asked of a stand-in (``DTensor.from_local``, ``Shard(0)``)
imports the real module, as a program that builds a DTensor would have anyway.

Example:
    >>> import sys, torch
    >>> from fxtrain._deferred import DTensor, Replicate
    >>> isinstance(torch.zeros(2), DTensor)                  # answered without importing torch.distributed.tensor
    False
    >>> Replicate() == sys.modules["torch.distributed.tensor"].Replicate()  # building one imports the real class
    True
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

__all__ = ["DTensor", "Partial", "Replicate", "Shard", "FSDPModule", "deferred_module"]


class _Deferred(type):
    """The metaclass of a stand-in: ``isinstance``/``issubclass`` look in ``sys.modules`` only; everything else
    (calling it, its attributes) is the real class, imported on first use."""

    _module: str

    def real(cls) -> type:
        """The real class (imports its module)."""
        return getattr(importlib.import_module(cls._module), cls.__name__)

    def __instancecheck__(cls, x: Any) -> bool:
        module = sys.modules.get(cls._module)
        return module is not None and isinstance(x, getattr(module, cls.__name__))

    def __subclasscheck__(cls, c: type) -> bool:
        module = sys.modules.get(cls._module)
        return module is not None and issubclass(c, getattr(module, cls.__name__))

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls.real()(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # copy, pickle and typing probe dunders: not forwarded
            raise AttributeError(name)
        return getattr(cls.real(), name)


class DTensor(metaclass=_Deferred):
    """Stands for ``torch.distributed.tensor.DTensor``."""

    _module = "torch.distributed.tensor"


class Partial(metaclass=_Deferred):
    """Stands for ``torch.distributed.tensor.Partial``."""

    _module = "torch.distributed.tensor"


class Replicate(metaclass=_Deferred):
    """Stands for ``torch.distributed.tensor.Replicate``."""

    _module = "torch.distributed.tensor"


class Shard(metaclass=_Deferred):
    """Stands for ``torch.distributed.tensor.Shard``."""

    _module = "torch.distributed.tensor"


class FSDPModule(metaclass=_Deferred):
    """Stands for ``torch.distributed.fsdp.FSDPModule``."""

    _module = "torch.distributed.fsdp"


class _DeferredModule(ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__dict__["_name"]), attr)


def deferred_module(name: str) -> ModuleType:
    """A stand-in for module ``name`` that imports it at the first attribute read (``dcp.save``), not before.

    Example:
        >>> dcp = deferred_module("torch.distributed.checkpoint")
        >>> dcp.FileSystemWriter.__name__
        'FileSystemWriter'
    """
    return _DeferredModule(name)
