"""Moved: the runner's Orbax hooks (``resume=orbax:PATH``, ``trainer.export=orbax``) are runner code, now
:mod:`fxtrain.run_hooks` (issue 38). Their old names here resolve with a DeprecationWarning naming the new place
for one more release, without an import of the runner from the interop layer (fxtrain/_moved.py).
"""

from fxtrain._moved import moved_names

__all__: list[str] = []

__getattr__ = moved_names(__name__, {name: f"fxtrain.run_hooks.{name}" for name in (
    "EXPORT_DIR", "NAMINGS", "ORBAX", "check_settings", "export", "orbax_path", "start")})
