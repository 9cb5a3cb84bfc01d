"""Checkpoints: `tinker://` paths, metadata, the safe delete. Only this package touches their directories."""

from miles.checkpoints.manager import CheckpointHandle, CheckpointInfo, CheckpointManager
from miles.checkpoints.paths import (
    CheckpointExists,
    CheckpointNotFound,
    InvalidCheckpointName,
    TinkerPath,
    parse_checkpoint_id,
    parse_tinker_path,
)

__all__ = [
    "CheckpointExists",
    "CheckpointHandle",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "InvalidCheckpointName",
    "TinkerPath",
    "parse_checkpoint_id",
    "parse_tinker_path",
]
