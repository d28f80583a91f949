"""Sharded, resharding, atomic checkpoints of the model, optimizer and lr scheduler."""

from megatron_eopt.checkpointing.checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from megatron_eopt.checkpointing.ownership import DirectoryOwner
from megatron_eopt.checkpointing.storage import CheckpointError, has_checkpoints, latest_checkpoint

__all__ = ["CheckpointError", "DirectoryOwner", "LoadedCheckpoint", "has_checkpoints", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
