"""Helpers for the GPU tests and benchmarks; not a patch."""
