"""What checkpoints and torch's optimizer interface read of an optimizer child: the contract below the wrappers and the formats."""
