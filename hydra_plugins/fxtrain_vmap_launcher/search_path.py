"""fxtrain's search-path plugin: for ``python -m fxtrain.train``, a user's configs come before fxtrain's own.

Hydra takes an option (``model/mlp.yaml``) from the first entry of its config search path that has it, and
puts the app's primary config directory first: ``pkg://fxtrain.conf``, then ``--config-dir``, then
``hydra.searchpath``. A user's ``conf/model/mlp.yaml`` (or ``conf/hparams_search/digits_optuna.yaml``)
named like one of fxtrain's was silently replaced by fxtrain's. This plugin puts the user's entries of the
command line before fxtrain's configs (:func:`fxtrain.build.user_configs_first`), so their option is the
one composed. Other Hydra apps (no ``pkg://fxtrain.conf`` as their primary configs) are left as they are.

Hydra imports this module whenever any Hydra app starts: fxtrain is imported only for fxtrain's own app.
"""

from __future__ import annotations

import sys

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.plugins.search_path_plugin import SearchPathPlugin

PRIMARY = "pkg://fxtrain.conf"  # fxtrain.build.PRIMARY_CONFIG: python -m fxtrain.train's primary configs


class UserConfigsFirst(SearchPathPlugin):
    """Puts ``--config-dir`` and ``hydra.searchpath`` of the command line before ``pkg://fxtrain.conf``."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if search_path.find_first_match(SearchPathQuery(provider="main", path=PRIMARY)) == -1:
            return
        from fxtrain import build

        try:
            build.user_configs_first(search_path, sys.argv[1:], PRIMARY)
        except build.ConfigError:  # a --config-dir that is not there: Hydra says so itself
            return
