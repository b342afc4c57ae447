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
# `... cuda1` applies bench/experiments/cuda1_gemm.patch (issue 22's GEMMs, CUDA numerics 6.cuda1) and runs, in
# ~9 minutes: main's prefill and step (the same card), then with the patch the CUDA kernel tests, the model tests
# (golden tiers, invariants), the prefill and step benchmarks and the decode-tile experiment (the shipped model
# moved out first: the 64 MiB limit), results of each tree in $out/main and $out/cuda1; `... cuda1-more` one-row
# step profiles with the patch and without it; `... cuda1-quick` (~3 minutes) the patch's steps and its
# decode-tile and expert bit tests, then main's steps. `... patch-step bench/experiments/fused_rms.patch` tests and
# times the RMS kernels that sum their row's squares themselves (issue 22 item 4: one launch an RMSNorm and mix
# scale instead of two; it applies with or without the cuda1 patch); `... patch-step bench/experiments/range_sums.patch`
# the GEMMs' K-range sums by each tile's last program instead of a second launch (item 4). `... pdl` (~6 minutes): programmatic dependent
# launch (DSFLASH_PDL=1, kernels/cuda/common.py) and with the decode GEMMs' weight prefetch before the wait
# (DSFLASH_PDL=prefetch) against plain launches on the same card, steps alternating 0 1 prefetch twice, prefill
# each way, after the CUDA model tests with prefetch (the PDL bit test first). `... pdl-quick` (~4 minutes) the
# new attention kernels' GPU tests, the model tests with prefetch and steps at L = 1, 5 each way. `DSFLASH_PDL=1 bash
# bench/run_gpu.sh patch-step ...` measures patches with it.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
part=${1:-all}
step="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192 --rows 1,2,4,5,8 --reps 5 --out $out"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
attention_kernel_tests() {  # the attention index kernels' GPU twins (pdl, pdl-quick)
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py -k "attention_indices or packed_fp4" \
    2>&1 | grep -E "^E  |FAILED|passed|failed" | tail -6
}
model_tests_with_prefetch() {  # golden tiers, invariants and the PDL bit test with the weight prefetch on
  DSFLASH_PDL=prefetch timeout 200 python -m pytest -q -p no:cacheprovider tests/test_cuda_model.py 2>&1 \
    | grep -E "tier|FAILED|passed|failed|Error" | tail -8
}
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
if [ "$part" = pdl ]; then
  quick="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192 --rows 1,5,8 --reps 7"
  prefill="python -m dsflash.cli bench prefill --preset bench --experts 48 --device cuda --lengths 8192,32768"
  attention_kernel_tests
  model_tests_with_prefetch
  for round in a b; do
    for flag in 0 1 prefetch; do
      mkdir -p "$out/pdl$flag$round" && echo "DSFLASH_PDL=$flag ($round)"
      DSFLASH_PDL=$flag timeout 100 $quick --out "$out/pdl$flag$round" 2>&1 | grep "^| [0-9]"
    done
  done
  for flag in 0 1 prefetch; do DSFLASH_PDL=$flag timeout 100 $prefill --out "$out/pdl${flag}a" 2>&1 | grep "^| [0-9]"; done
fi
if [ "$part" = pdl-quick ]; then  # ~4 minutes: the new attention kernels' GPU tests, the CUDA model tests with
  # prefetch on, then one- and five-row steps with the switch 0, 1, prefetch, 0
  quick="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192 --rows 1,5 --reps 5"
  attention_kernel_tests
  model_tests_with_prefetch
  for run in 0 1 prefetch 0b; do
    mkdir -p "$out/pdlq$run" && echo "DSFLASH_PDL=${run%b}"
    DSFLASH_PDL=${run%b} timeout 60 $quick --out "$out/pdlq$run" 2>&1 | grep "^| [0-9]"
  done
fi
if [ "$part" = all ] || [ "$part" = ab ]; then
  [ "$part" = ab ] && timeout 200 $step 2>&1 | tail -12
  timeout 120 $step --eager 2>&1 | tail -12
  timeout 60 python -m dsflash.cli bench profile --preset bench --experts 48 --device cuda --context 2048 \
    --rows 1 --out "$out" 2>&1 | head -40
fi
if [ "$part" = cuda1 ] || [ "$part" = cuda1-quick ] || [ "$part" = cuda1-more ]; then
  # issue 22's 6.cuda1 against main in one call (a call may land on an H100 or an H200)
  prefill="python -m dsflash.cli bench prefill --preset bench --experts 48 --device cuda --lengths 8192,32768"
  steps="python -m dsflash.cli bench step --preset bench --experts 48 --device cuda --context 8192"
  profile="python -m dsflash.cli bench profile --preset bench --experts 48 --device cuda --context 2048 --rows 1"
  mkdir -p "$out/main" "$out/cuda1"
fi
if [ "$part" = cuda1 ]; then  # main's prefill and step, then the patch's tests, prefill, step and decode tiles
  timeout 80 $prefill --out "$out/main" 2>&1 | grep -E "^\| [0-9]"
  timeout 80 $steps --rows 1,5,8 --reps 7 --out "$out/main" 2>&1 | grep -E "^\| [0-9]"
  git apply bench/experiments/cuda1_gemm.patch || exit 1
  DSFLASH_TOL_REPORT=$out/kernels-tolerances-cuda1.jsonl timeout 170 python -m pytest -q -p no:cacheprovider \
    tests/test_kernels_cuda.py > "$out/kernel-tests-cuda1.log" 2>&1
  grep -E "^E  |FAILED|passed|failed" "$out/kernel-tests-cuda1.log" | cut -c1-200 | tail -14
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_cuda_model.py 2>&1 | grep -E "tier|FAILED|passed|failed" | tail -8
  timeout 80 $prefill --out "$out/cuda1" 2>&1 | grep -E "^\| [0-9]"
  timeout 80 $steps --rows 1,5,8 --reps 7 --out "$out/cuda1" 2>&1 | grep -E "^\| [0-9]"
  timeout 160 python bench/experiments/decode_tiles.py > "$out/decode-tiles-cuda1.md" 2>&1
  git apply -R bench/experiments/cuda1_gemm.patch
fi
if [ "$part" = cuda1-quick ]; then  # ~3 minutes: the patch's one- and five-row steps and the bit tests of the
  # decode tiles and routed experts, then main's steps
  git apply bench/experiments/cuda1_gemm.patch || exit 1
  timeout 60 $steps --rows 1,5 --reps 5 --out "$out/cuda1" 2>&1 | grep -E "^\| [0-9]"
  timeout 90 python -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py -k "tiles or expert" 2>&1 | tail -3
  git apply -R bench/experiments/cuda1_gemm.patch
  timeout 60 $steps --rows 1,5 --reps 5 --out "$out/main" 2>&1 | grep -E "^\| [0-9]"
fi
if [ "$part" = cuda1-more ]; then  # a one-row step profile of 6.cuda1, then main's (after `cuda1`)
  git apply bench/experiments/cuda1_gemm.patch || exit 1
  timeout 60 $profile --out "$out/cuda1" 2>&1 | grep -E "_kernel|Self CUDA time" | head -8
  git apply -R bench/experiments/cuda1_gemm.patch
  timeout 60 $profile --out "$out/main" 2>&1 | grep -E "_kernel|Self CUDA time" | head -8
fi
