"""CUDA graphs of the dropless MoE layer and their install behind megatron-core's graph entry
points."""
