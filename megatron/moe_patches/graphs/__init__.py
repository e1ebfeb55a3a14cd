"""CUDA graphs of the dropless MoE layer (alone, or each transformer layer whole) and their
install behind megatron-core's graph entry points."""
