"""mkdocs hooks (``hooks:`` in mkdocs.yml): the API reference, generated from the package at every build.

One page per module that defines a public name, holding the module's own docstring (its paragraph and map) and
every public name it defines, each under the name users import it by (``fxtrain.adamw``, ``fxtrain.contrib.muon``,
``fxtrain.tree.map``). A name added to ``fxtrain`` or to one of its public modules gets its entry without anyone
editing the docs; tests/test_docs.py checks that every public name has one in the built site.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import pathlib
import re
import types

from mkdocs.structure.files import File

PACKAGE = "fxtrain"
INDEX = "reference/index.md"


def public_names(module: types.ModuleType) -> list[str]:
    """``__all__`` where the module has one, else its names without a leading underscore."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return sorted(names)


def doors() -> dict[str, tuple[str, object]]:
    """Every public name of the package -> (the module that defines it, the object): ``fxtrain.X`` for the top-level
    names, ``fxtrain.S.X`` for the names that a public module ``S`` of the top level (or a private module inside
    its package) defines and the top level does not export. What a module imports from elsewhere (``typing.Any``,
    another fxtrain module's function) is documented where it is defined."""
    root = importlib.import_module(PACKAGE)
    found: dict[str, tuple[str, object]] = {}
    seen: set[int] = set()  # the top level's objects: fx.adamw, not fx.optimizers.adamw
    modules = []
    for name in public_names(root):
        obj = getattr(root, name)
        if isinstance(obj, types.ModuleType):
            modules.append(obj)
            found[f"{PACKAGE}.{name}"] = (obj.__name__, obj)
        else:
            found[f"{PACKAGE}.{name}"] = (defined_in(obj, PACKAGE), obj)
            seen.add(id(obj))
    for module in modules:
        for name in public_names(module):
            obj = getattr(module, name)
            home = getattr(obj, "__module__", None)  # None: a constant, documented with its module's docstring
            inside = isinstance(home, str) and (home == module.__name__ or home.startswith(module.__name__ + "."))
            if isinstance(obj, types.ModuleType) or id(obj) in seen or not inside:
                continue
            found[f"{module.__name__}.{name}"] = (home, obj)  # each name: tree.mul_ and tree.scale_ are one function
    return found


def defined_in(obj: object, default: str) -> str:
    """The module whose source defines ``obj`` (a constant or a typing alias: the module that exports it)."""
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) and module.startswith(PACKAGE) else default


def reference_pages() -> dict[str, str]:
    """``reference/<module>.md`` -> its markdown: the module's docstring, then its public names in source order."""
    by_module: dict[str, list[str]] = collections.defaultdict(list)
    found = doors()
    objects = {door: obj for door, (_, obj) in found.items()}
    for door, (home, obj) in found.items():
        if not isinstance(obj, types.ModuleType):
            by_module[home].append(door)
        else:
            by_module.setdefault(home, [])
    pages = {}
    for home in sorted(by_module):
        # the module's docstring as the page's title and introduction, then its names
        lines = [f"::: {home}", "    options:", "      members: false", "      heading_level: 1", ""]
        for door in sorted(by_module[home], key=lambda d: source_order(home, d)):
            if not readable(home, door):
                lines += [f"## `{door}` {{ #{door} }}", "", inspect.getdoc(objects[door]) or "", ""]
            else:
                lines += [f"::: {door}", ""]
        pages[f"reference/{home}.md"] = "\n".join(lines)
    return pages


def source_order(home: str, door: str) -> tuple[int, str]:
    """Where ``door``'s name is defined in ``home``'s source (its ``def``, ``class`` or assignment line), so a page
    reads as the module does; names without such a line go last, by name."""
    name = door.rsplit(".", 1)[1]
    match = re.search(rf"^(?:\s*(?:def|class)\s+|(?:\w+,\s*)*){re.escape(name)}\b", source(home), flags=re.M)
    return (match.start() if match else len(source(home)) + 1, name)


def readable(home: str, door: str) -> bool:
    """mkdocstrings reads the source, not the objects: it finds a ``def``, a ``class`` or ``name = ...``, not a
    name made at import time (``sqrt_, abs_ = map(_unary, ...)``), whose entry shows its runtime docstring."""
    name = door.rsplit(".", 1)[1]
    pattern = rf"^\s*(?:def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]"
    return re.search(pattern, source(home), flags=re.M) is not None


@functools.cache
def source(module: str) -> str:
    """The module's source text ("" where it has none)."""
    try:
        return importlib.import_module(module).__loader__.get_source(module) or ""
    except (AttributeError, ImportError):
        return ""


_PAGES: dict[str, str] = {}


def on_config(config):
    """Adds the reference to the nav: its index, the top-level modules, then a section per subpackage
    (``fxtrain.transforms``: its own page, then its modules by family name: ``_adam`` as ``adam``)."""
    _PAGES.clear()
    _PAGES.update(reference_pages())
    entries: list = [{"Overview": INDEX}]
    sections: dict[str, list] = {}
    for path in _PAGES:
        module = path.removeprefix("reference/").removesuffix(".md")
        package, _, rest = module.removeprefix(PACKAGE + ".").partition(".")
        if not rest and not is_package(module):
            entries.append({module: path})
            continue
        if package not in sections:
            sections[package] = []
            entries.append({f"{PACKAGE}.{package}": sections[package]})
        sections[package].append({rest.lstrip("_") or f"{PACKAGE}.{package}": path})
    config["nav"] = [*config["nav"], {"API reference": entries}]
    return config


def is_package(module: str) -> bool:
    return hasattr(importlib.import_module(module), "__path__")


# Figures the pages show that live with their study (docs/ path -> the repository's path).
ASSETS = {"assets/lr_sweep_curves.png": "experiments/lr_sweep/curves.png"}


def on_files(files, config):
    """The generated pages and the studies' figures join the files mkdocs builds (nothing is written into docs/)."""
    for path, text in _PAGES.items():
        files.append(File.generated(config, path, content=text))
    root = pathlib.Path(config["config_file_path"]).parent
    for path, source in ASSETS.items():
        files.append(File.generated(config, path, abs_src_path=str(root / source)))
    return files


def on_page_content(html, page, config, files):
    """Sphinx roles in docstrings (``:func:`x```) read as their code: the role's name is dropped."""
    return re.sub(r":(?:func|class|meth|mod|data|attr|obj|exc):(?=<code>)", "", html)
