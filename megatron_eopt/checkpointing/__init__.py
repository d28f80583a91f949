"""Sharded, resharding, atomic checkpoints of the model, optimizer and lr scheduler."""

from megatron_eopt.checkpointing.checkpoint import (
    LoadedCheckpoint,
    PendingSave,
    load_checkpoint,
    new_save_group,
    save_checkpoint,
    start_save_checkpoint,
)
from megatron_eopt.checkpointing.ownership import DirectoryOwner
from megatron_eopt.checkpointing.storage import CheckpointError, CheckpointSaveError, has_checkpoints, latest_checkpoint

__all__ = ["CheckpointError", "CheckpointSaveError", "DirectoryOwner", "LoadedCheckpoint", "has_checkpoints", "latest_checkpoint", "PendingSave", "load_checkpoint", "new_save_group",
           "save_checkpoint", "start_save_checkpoint"]
