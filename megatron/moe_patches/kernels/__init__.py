"""Hand-written GPU kernels (Triton) with pure-PyTorch twins that define their results.

Modules here import Triton only when a kernel is first launched, so they import on CPU-only
machines; the twins run anywhere."""
