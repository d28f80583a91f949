"""Sharded, resharding, atomic checkpoints of the model, optimizer and lr scheduler.

Our own checkpoint files; megatron-core's formats are in megatron_core_formats/. The names below
are imported on first use, as the package root's are, so importing one module of this package does
not import the whole checkpointing stack.
"""

from megatron_eopt.runtime.lazy_exports import lazy_exports

_LAZY = {
    "LoadedCheckpoint": "megatron_eopt.checkpointing.checkpoint",
    "PendingSave": "megatron_eopt.checkpointing.checkpoint",
    "load_checkpoint": "megatron_eopt.checkpointing.checkpoint",
    "new_save_group": "megatron_eopt.checkpointing.checkpoint",
    "save_checkpoint": "megatron_eopt.checkpointing.checkpoint",
    "start_save_checkpoint": "megatron_eopt.checkpointing.checkpoint",
    "DirectoryOwner": "megatron_eopt.checkpointing.directory_lock",
    "optimizer_load_planner": "megatron_eopt.checkpointing.dcp_optimizer_change",
    "checkpoint_optimizer_layout": "megatron_eopt.megatron_core_formats.dist_checkpointing",
    "megatron_core_state_dict": "megatron_eopt.megatron_core_formats.dist_checkpointing",
    "CheckpointError": "megatron_eopt.checkpointing.storage",
    "CheckpointSaveError": "megatron_eopt.checkpointing.storage",
    "has_checkpoints": "megatron_eopt.checkpointing.storage",
    "latest_checkpoint": "megatron_eopt.checkpointing.storage",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
