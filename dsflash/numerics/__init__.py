"""Numerics shared by every backend. NUMERICS_VERSION keys every cache and snapshot: bump it whenever
any arithmetic changes (a rounding point, a summation order, an index layout)."""

NUMERICS_VERSION = 3  # 3: CUDA FP8/FP4 GEMMs sum K in ranges fixed by the weight's shape (docs/numerics.md)
