"""fxtrain's experiment configs, installed as the package ``fxtrain.conf`` (Hydra reads ``pkg://fxtrain.conf``)."""
