"""Checkpoints: `store` (the directory on disk, without torch) and `pipeline` (saving and
loading a rank's state, `CheckpointManager`). Importing this package imports neither."""
