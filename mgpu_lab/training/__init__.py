"""The training step: mixed precision, gradient accumulation, activation
checkpointing, resumable training state."""
