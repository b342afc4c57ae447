"""Numerics shared by every backend. NUMERICS_VERSION keys every cache and snapshot: bump it whenever
any arithmetic changes (a rounding point, a summation order, an index layout)."""

NUMERICS_VERSION = 2  # 2: narrow bf16/fp32 GEMMs on CUDA sum K in splits fixed by the weight's shape
