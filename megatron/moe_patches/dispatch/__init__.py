"""Token dispatch: the patched dispatchers, the fused permute+pad step, the symmetric-memory
exchange and HybridEP's block counts."""
