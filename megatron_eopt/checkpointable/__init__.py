"""What checkpoints read of an optimizer child: the contract below the wrappers and the formats."""
