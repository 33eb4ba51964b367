"""Checkpoints: saving and loading, the manifest written beside them and resuming a run."""
