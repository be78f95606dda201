"""The optional extras: which package each optional choice needs, and the one line that installs it.

Every optional launcher, sweeper, logger and data format, selected without its package, stops before the run with the same
kind of line, ``<choice> needs <package>: pip install 'fxtrain[<extra>]'``: :func:`check_choice` for a choice on
the command line (called by :func:`fxtrain.build.check_overrides` before Hydra composes anything, so Hydra's
"Could not find" and a launcher's traceback never show), :func:`require` where a choice made in a config file
is built (the loggers, the data formats of :mod:`fxtrain.sources`).

Example:
    >>> from fxtrain.extras import check_choice, require
    >>> check_choice("hydra/launcher", "vmap", "hydra/launcher=vmap")   # no extra needed
    >>> require("json", "logger=jsonl", "json", "none").__name__        # found: the module
    'json'
    >>> require("no_such_module", "logger=mine", "no_such_module", "mine")
    Traceback (most recent call last):
    ...
    fxtrain.errors.ConfigError: logger=mine needs no_such_module: pip install 'fxtrain[mine]'
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

from fxtrain.errors import ConfigError

__all__ = ["OPTIONAL", "check_choice", "require", "installed"]

# (config group, option) -> (the module it imports, the package that holds it, the extra that installs it);
# option None: every option of the group.
_SUBMITIT = ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher", "submitit")
_OPTUNA = ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper", "optuna")
OPTIONAL: dict[tuple[str, str | None], tuple[str, str, str]] = {
    ("hydra/launcher", "submitit_local"): _SUBMITIT,
    ("hydra/launcher", "submitit_slurm"): _SUBMITIT,
    ("hydra/launcher", "vmap_submitit_local"): ("submitit", "submitit", "submitit"),
    ("hydra/launcher", "vmap_submitit_slurm"): ("submitit", "submitit", "submitit"),
    ("hydra/sweeper", "optuna"): _OPTUNA,
    ("hparams_search", None): _OPTUNA,
    ("logger", "tensorboard"): ("tensorboard", "tensorboard", "tensorboard"),
    ("logger", "wandb"): ("wandb", "wandb", "wandb"),
    ("logger", "mlflow"): ("mlflow", "mlflow", "mlflow"),
    ("data", "hf"): ("datasets", "datasets", "hf"),
    ("data", "webdataset"): ("webdataset", "webdataset", "webdataset"),
    ("data", "grain"): ("grain", "grain", "grain"),
    ("amp", "float8"): ("torchao", "torchao", "float8"),
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it; a ``None`` in ``sys.modules`` is a missing one)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing (no hydra_plugins namespace at all)
        return False


def check_choice(group: str, option: str, arg: str) -> None:
    """Raises the one line naming ``arg`` (what the user wrote) and the extra to install, if ``group=option``
    needs a package that is missing."""
    need = OPTIONAL.get((group, option)) or OPTIONAL.get((group, None))
    if need is not None and not installed(need[0]):
        module, package, extra = need
        raise ConfigError(f"{arg} needs {package}: pip install 'fxtrain[{extra}]'")


def require(module: str, what: str, package: str, extra: str) -> ModuleType:
    """Imports ``module`` for ``what`` (a choice such as ``logger=wandb``), or raises the one line that says
    which extra installs ``package``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs {package}: pip install 'fxtrain[{extra}]'") from None
