"""A Griffe extension for the API reference (mkdocs.yml's ``extensions``): fxtrain's doctests render as code.

Google style reads a doctest as code only inside an ``Examples:`` section; fxtrain's docstrings head theirs
``Example:`` (an admonition to Google style) or put them after ``Returns:`` with no heading, and markdown then reads
their ``>>>`` lines as quotes and their outputs (``[1.0, 0.75]``) as links. Each run of doctest lines (from a
``>>>`` line to the next blank one) becomes a fenced ``pycon`` block, and ``Example:`` reads as ``Examples:``, in
the text mkdocstrings renders; the source is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example( \(.*\))?:\s*$", re.M)
_DOCTEST = re.compile(r"^([ \t]*)>>> .*(?:\n\1.*\S.*)*", re.M)  # a >>> line and the lines after it, to a blank one


def fenced(text: str) -> str:
    """``text`` with each doctest run inside a ```` ```pycon ```` fence at the run's indentation."""
    return _DOCTEST.sub(lambda m: f"{m.group(1)}```pycon\n{m.group(0)}\n{m.group(1)}```", text)


class Doctests(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        del kwargs
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fenced(_HEADING.sub(r"\1Examples:", obj.docstring.value))
