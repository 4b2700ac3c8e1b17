"""The training step: mixed precision, gradient accumulation, activation
recompute, resumable training state."""
