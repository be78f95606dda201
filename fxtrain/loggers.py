"""Metric loggers for the training script (the Hydra ``logger`` group).

A logger has ``log(step, metrics)`` (a dict of Python floats) and ``close()``, and is a context manager
(the training loop closes it however the loop ends). Only rank 0 builds one.

Example:
    >>> import json, tempfile
    >>> from fxtrain.loggers import JsonlLogger
    >>> d = tempfile.mkdtemp()
    >>> with JsonlLogger(d) as logger:
    ...     logger.log(10, {"loss": 0.5, "learning_rate": 1e-3})
    >>> print(logger.path.read_text(), end="")
    {"step": 10, "loss": 0.5, "learning_rate": 0.001}
"""

from __future__ import annotations

import json
import pathlib

__all__ = ["JsonlLogger"]


class JsonlLogger:
    """Appends one JSON object per logged step to ``dir/filename``, flushed at once.

    Every line written survives a crash or a NaN stop. Non-finite values are written as JSON's
    ``NaN``/``Infinity`` extensions (Python's ``json`` reads them back).

    Args:
      dir: the run directory.
      filename: name of the file in ``dir``.
    """

    def __init__(self, dir: str | pathlib.Path, filename: str = "metrics.jsonl"):
        self.path = pathlib.Path(dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "JsonlLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"JsonlLogger({str(self.path)!r})"
