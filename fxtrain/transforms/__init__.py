"""Gradient transformations, one module per family (Optax names, arguments, defaults and math)."""
