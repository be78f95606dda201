"""fxtrain's Hydra launcher plugin: ``hydra/launcher=vmap`` (see :mod:`.vmap_launcher` and :mod:`fxtrain.sweep`)."""
