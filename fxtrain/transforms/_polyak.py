"""(being written: issue 18's catalogue)."""

__all__: list[str] = []
