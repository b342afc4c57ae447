#!/usr/bin/env bash
# Routed experts resident vs pinned host vs disk on one H200 (issue 17 item 7), from the repository root:
# `dsflash bench tiers` writes an encoder slice of the bench preset with the released 384 routed experts to
# ${DIR:-/tmp/dsflash-bench-tiers}: layers 0-1 with their 2 x 384 experts (13.4 GiB) plus the embedding, layer
# 1's Engram table and layer 2's cache writer, ~17 GiB in three safetensors files, flushed and dropped from the
# page cache. Then per tier (gpu, host, disk; the device expert cache: one layer's bank, 6.7 GiB, half the
# experts) the prefill at 8K and 32K tokens and steps of L = 1 and 5 rows after 8K, results in ${OUT:-
# bench/results}/tiers-bench-e384-l2-DATE.{json,md}, rewritten after every measurement. The checkpoint is
# removed at the end (KEEP=1 keeps it for another run, which then skips the writing). ~4-6 minutes, most of it
# the disk tier's reads (a 32K prefill reads every expert of both layers once per 8K chunk: ~54 GiB).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
dir=${DIR:-/tmp/dsflash-bench-tiers}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
df -h "$(dirname "$dir")" | tail -1
free -g | head -2
timeout ${LIMIT:-420} python -m dsflash.cli bench tiers --preset bench --experts 384 --layers 2 --dir "$dir" \
  --tiers ${TIERS:-gpu,host,disk,engram-host,engram-disk} --lengths ${LENGTHS:-8192,32768} --context 8192 --rows 1,5 --reps 5 --out "$out" 2>&1 \
  | grep -v -i warn | tail -20
rc=${PIPESTATUS[0]}
[ "${KEEP:-0}" = 1 ] || rm -rf "$dir"
exit "$rc"
