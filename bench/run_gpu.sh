#!/usr/bin/env bash
# One batched GPU session: CUDA kernel and model invariants, then the engine benchmarks. Run on the GPU
# machine from the repository root with the golden cases in $DSFLASH_GOLDEN_DIR; results land in
# ${OUT:-bench/results}.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py 2>&1 | tail -4
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_cuda_model.py -s 2>&1 | grep -E "tier|passed|failed|Error" | tail -12
timeout 240 python -m dsflash.cli bench all --preset bench --experts 48 --device cuda --context 8192 \
  --rows 1,2,4,5,8 --lengths 8192 --reps 5 --reference-layers 3 --out "$out" 2>&1 | tail -14
