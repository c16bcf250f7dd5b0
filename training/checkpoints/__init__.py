"""Checkpoint store (no Django): see `training.checkpoints.store` for the API and its guarantees."""

from kernels.delta import CheckpointCorrupt
from training.checkpoints.store import (
    CheckpointMissing,
    CheckpointStore,
    LocalStorage,
    Storage,
    make_storage,
)

__all__ = ["CheckpointCorrupt", "CheckpointMissing", "CheckpointStore", "LocalStorage", "Storage", "make_storage"]
