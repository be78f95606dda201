"""The documentation site (mkdocs.yml, docs/): it builds with warnings as errors (a broken link, a page missing from
the nav, a docstring mkdocstrings cannot read), and its API reference, which docs/_hooks.py generates from the
package, has an entry for every public name. The pages' code blocks and numbers: tests/test_readme.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

import fxtrain

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """``make docs``'s build, into a temporary directory (a few seconds: mkdocstrings reads the package's source)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # mkdocs-material's banner, not a warning
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def public(module: types.ModuleType) -> list[str]:
    return list(getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")])


def test_every_page_is_built(site):
    pages = sorted(p.relative_to(ROOT / "docs") for p in (ROOT / "docs").glob("**/*.md"))
    assert len(pages) >= 12
    for page in pages:
        built = site / page.with_suffix("") / "index.html" if page.stem != "index" else site / page.with_suffix(".html")
        assert built.is_file(), f"docs/{page} has no page in the site ({built.relative_to(site)})"


def test_every_public_name_has_a_reference_entry(site):
    """Each name of ``fxtrain`` (``fx.adamw``) and each name that a public module of it defines (``fx.contrib.muon``,
    ``fx.tree.map``) has an entry (an anchor with its full name) on a reference page."""
    anchors = set()
    for page in (site / "reference").glob("**/*.html"):
        anchors |= set(re.findall(r'id="(fxtrain(?:\.\w+)*)"', page.read_text()))
    # what `import fxtrain` itself makes public (in a fresh process: an earlier test of this worker importing, say,
    # fxtrain.build would add that module to the package's attributes here)
    names = subprocess.run([sys.executable, "-c", "import fxtrain, json; print(json.dumps(list(getattr(fxtrain, "
                            "'__all__', None) or [n for n in vars(fxtrain) if not n.startswith('_')])))"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    top = {name: getattr(fxtrain, name) for name in json.loads(names)}
    expected = {f"fxtrain.{name}" for name in top}
    documented = {id(obj) for obj in top.values() if not isinstance(obj, types.ModuleType)}  # fx.adamw: the entry
    for obj in (obj for obj in top.values() if isinstance(obj, types.ModuleType)):
        for inner in public(obj):  # what the module (or a private module of its package) defines
            value = getattr(obj, inner)
            home = getattr(value, "__module__", None) or ""
            inside = home == obj.__name__ or home.startswith(obj.__name__ + ".")
            if not isinstance(value, types.ModuleType) and id(value) not in documented and inside:
                expected.add(f"{obj.__name__}.{inner}")
    assert len(expected) > 250, len(expected)
    missing = sorted(expected - anchors)
    assert not missing, f"{len(missing)} public names have no entry in the reference: {missing[:20]}"
