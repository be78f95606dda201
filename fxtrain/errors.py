"""The error types every layer may raise, at the bottom of the import graph (nothing here imports fxtrain).

* :class:`ConfigError`: a config that cannot be built; the message starts with the config key at fault.

Example:
    >>> from fxtrain.errors import ConfigError
    >>> try:
    ...     raise ConfigError("trainer.max_steps=0: expected a positive whole number of steps")
    ... except ValueError as e:  # a ConfigError is a ValueError
    ...     print(e)
    trainer.max_steps=0: expected a positive whole number of steps
"""

from hydra.errors import CompactHydraException

__all__ = ["ConfigError"]


class ConfigError(ValueError, CompactHydraException):
    """A config that cannot be built; the message starts with the config key at fault.

    Hydra prints a ``CompactHydraException`` as its message alone (the traceback with ``HYDRA_FULL_ERROR=1``);
    ``python -m fxtrain.train`` prints it as one line (:func:`fxtrain.validate.one_line_errors`).
    """
