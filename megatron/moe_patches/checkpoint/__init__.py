"""Checkpoints of grouped expert parameters: per-expert keys for the model and for the
optimizers' states."""
