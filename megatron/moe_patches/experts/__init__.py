"""The experts: the one patched experts class and its compute backends (TE, grouped_mm,
FP8 grouped GEMMs, the op fuser), their parameter layouts and their padding."""
