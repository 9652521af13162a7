"""The train stage, trainer, callbacks, launchers, checkpoints. In the stage keys."""
