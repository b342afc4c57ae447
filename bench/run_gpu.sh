#!/usr/bin/env bash
# The GPU machine takes a working tree of at most 64 MiB: tests/golden (46 MB) and the shipped model
# dsflash/checkpoint/trained (30 MB) do not fit together, so move the one a call does not need out of the
# checkout for that call (runs with the golden cases: the model; training with --init: the golden cases).
# One batched GPU session: CUDA kernel and model invariants, then the engine benchmarks. Run on the GPU
# machine from the repository root with the golden cases in $DSFLASH_GOLDEN_DIR; results land in
# ${OUT:-bench/results}. `bench/run_gpu.sh tests`, `... bench` or `... ab` run one part; all = tests,
# bench, then the step benchmark without CUDA graphs and a profile of one graphed step (ab = the step
# benchmark with and without CUDA graphs, and the profile). `... open` runs the measurements the open
# questions of docs/perf-record.md need first: the prefill profile and the sparse-attention head split;
# `... prefill-gap` the prefill profile and prefill up to 512K tokens.
# `... patch FILE` A/Bs a variant of the kernel package dsflash/kernels/cuda/ against this tree (FILE: a copy
# of the package folder, or a patch from the repository root, applied with `git apply` or `patch -p1` to take
# the patched package, then reverted): the GEMM experiment (DIFF where the variant's bits differ) and the
# encoder prefill with each package (a single-module kernel file of the trees before the package: the GEMM
# experiment only). `... patch-step FILE...`: engine patches (git apply, in order): the CUDA kernel and model
# tests with them, the step benchmark before, with (twice) and after them, and the prefill before and with
# them, in one session (steps vary ~5 ms between machines).
# `... gap` (~9 minutes): where a 6.cuda1 step and prefill go, per shape: the plain GEMMs by K split, tile and
# precision (bench/experiments/plain_split.py), the FP8/FP4 decode tiles and expert slots
# (bench/experiments/decode_tiles.py), every kernel at M = 1 / 5 / 8192 against the ceilings (`dsflash.bench.kernels`)
# and the prefill profile. `... pdl` (~5 minutes): programmatic dependent launch (on by default on sm_90;
# kernels/cuda/common.py) against plain launches (DSFLASH_PDL=0) on the same card, steps alternating 0 1 twice
# and prefill each way, after the attention kernels' GPU tests and the CUDA model tests (the PDL bit test among
# them). `... side` the same for the side streams (DSFLASH_SIDE_STREAMS; kernels/cuda/side.py). `... fp8mma`
# (~6 minutes): the candidate numerics 6.cuda2's GEMM (bench/experiments/fp8_mma.py), then the decode tiles.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
part=${1:-all}
step="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192 --rows 1,2,4,5,8 --reps 5 --out $out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
if [ "$part" = all ] || [ "$part" = tests ]; then
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py 2>&1 \
    | grep -E "^E  |^tests/.*Error|FAILED|passed|failed" | tail -30
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_cuda_model.py -s 2>&1 \
    | grep -E "tier|passed|failed|Error|assert" | tail -15
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  timeout 200 python -m dsflash.cli bench all --preset bench --experts 48 --device cuda --context 8192,32768 \
    --rows 1,2,4,5,8 --lengths 8192 --reps 5 --reference-layers 3 --out "$out" 2>&1 | tail -14
fi
if [ "$part" = open ]; then
  timeout 150 python -m dsflash.cli bench profile --prefill --preset bench --experts 48 --device cuda \
    --context 8192 --out "$out" 2>&1 | head -45
  timeout 120 python bench/experiments/attn_heads.py 2>&1 | tee "$out/attn-heads.txt"
fi
if [ "$part" = prefill-gap ]; then  # the per-kernel prefill breakdown the gap explanation needs, and
  # prefill at the long lengths
  timeout 150 python -m dsflash.cli bench profile --prefill --preset bench --experts 48 --device cuda \
    --context 8192 --out "$out" 2>&1 | head -40
  timeout 300 python -m dsflash.cli bench prefill --preset bench --experts 48 --device cuda \
    --lengths 8192,131072,524288 --out "$out" 2>&1 | tail -5
fi
if [ "$part" = patch ]; then
  variant=/tmp/variant_cuda && rm -rf "$variant" "$variant.py"
  if [ -d "$2" ]; then cp -r "$2" "$variant"
  elif [[ "$2" == *.py ]]; then variant=$variant.py && cp "$2" "$variant"
  else { git apply "$2" || patch -p1 -s < "$2"; } && cp -r dsflash/kernels/cuda "$variant" \
         && { git apply -R "$2" || patch -R -p1 -s < "$2"; } || exit 1
  fi
  timeout 300 python bench/experiments/decode_gemm.py "$variant" 2>&1 | grep -v -i warn | tee "$out/decode-gemm-patch.txt"
  if [ -d "$variant" ]; then
    prefill="python -m dsflash.cli bench prefill --preset bench --experts 48 --device cuda --lengths 8192,32768"
    mkdir -p "$out/this" "$out/patched"
    timeout 90 $prefill --out "$out/this" 2>&1 | tail -3
    this=/tmp/this_cuda && rm -rf "$this" && mv dsflash/kernels/cuda "$this" && cp -r "$variant" dsflash/kernels/cuda
    timeout 90 $prefill --out "$out/patched" 2>&1 | tail -3
    rm -rf dsflash/kernels/cuda && mv "$this" dsflash/kernels/cuda
  fi
fi
if [ "$part" = patch-step ]; then  # engine patches (git apply, in order): the CUDA kernel and model tests with
  # them, and the step benchmark (steps and drafts) before, with (twice) and after them, in one session
  shift
  quick="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192 --rows 1,5,8 --reps 7"
  prefill="python -m dsflash.cli bench prefill --preset bench --experts 48 --device cuda --lengths 8192,32768"
  mkdir -p "$out/this" "$out/patched" "$out/patched2" "$out/after"
  timeout 100 $quick --out "$out/this" 2>&1 | grep "^| [0-9]"
  timeout 100 $prefill --out "$out/this" 2>&1 | grep "^| [0-9]"
  for p in "$@"; do git apply "$p" || exit 1; done
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py 2>&1 | grep -E "^E  |FAILED|passed|failed" | tail -12
  timeout 100 python -m pytest -q -p no:cacheprovider tests/test_cuda_model.py 2>&1 | tail -3
  timeout 100 $quick --out "$out/patched" 2>&1 | grep "^| [0-9]"
  timeout 100 $quick --out "$out/patched2" 2>&1 | grep "^| [0-9]"
  timeout 100 $prefill --out "$out/patched" 2>&1 | grep "^| [0-9]"
  for ((i = $#; i >= 1; i--)); do git apply -R "${!i}"; done
  timeout 100 $quick --out "$out/after" 2>&1 | grep "^| [0-9]"
fi
if [ "$part" = pdl ] || [ "$part" = side ]; then
  var=DSFLASH_PDL && [ "$part" = side ] && var=DSFLASH_SIDE_STREAMS
  quick="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192 --rows 1,5,8 --reps 7"
  prefill="python -m dsflash.cli bench prefill --preset bench --experts 48 --device cuda --lengths 8192,32768"
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py -k "attention_indices or packed_fp4" \
    2>&1 | grep -E "^E  |FAILED|passed|failed" | tail -6
  timeout 300 python -m pytest -q -p no:cacheprovider tests/test_cuda_model.py 2>&1 \
    | grep -E "tier|FAILED|passed|failed|Error" | tail -8
  for round in a b; do
    for flag in 0 1; do
      mkdir -p "$out/$part$flag$round" && echo "$var=$flag ($round)"
      env "$var=$flag" timeout 100 $quick --out "$out/$part$flag$round" 2>&1 | grep "^| [0-9]"
    done
  done
  for flag in 0 1; do env "$var=$flag" timeout 100 $prefill --out "$out/$part${flag}a" 2>&1 | grep "^| [0-9]"; done
fi
if [ "$part" = fp8mma ]; then  # the candidate numerics 6.cuda2 (bench/experiments/fp8_mma.py): bits against the CPU
  # reference and across row counts, time against 6.cuda1 per shape; then the decode tiles (8-row tiles among them)
  timeout 300 python bench/experiments/fp8_mma.py 2>&1 | grep -v -i warn | tee "$out/fp8-mma.txt"
  timeout 200 python bench/experiments/decode_tiles.py > "$out/decode-tiles.md" 2>&1; grep -E "8x64|^\| expert" "$out/decode-tiles.md"
fi
if [ "$part" = gap ]; then
  timeout 110 python bench/experiments/plain_split.py 2>&1 | grep -v -i warn | tee "$out/plain-split.txt"
  timeout 170 python bench/experiments/decode_tiles.py > "$out/decode-tiles.md" 2>&1; tail -30 "$out/decode-tiles.md"
  timeout 150 python -m dsflash.bench.kernels --m 1,5,8192 --out "$out" 2>&1 | tail -60
  timeout 100 python -m dsflash.cli bench profile --prefill --preset bench --experts 48 --device cuda \
    --context 8192 --out "$out" 2>&1 | head -45
fi
if [ "$part" = all ] || [ "$part" = ab ]; then
  [ "$part" = ab ] && timeout 200 $step 2>&1 | tail -12
  timeout 120 $step --eager 2>&1 | tail -12
  timeout 60 python -m dsflash.cli bench profile --preset bench --experts 48 --device cuda --context 2048 \
    --rows 1 --out "$out" 2>&1 | head -40
fi
