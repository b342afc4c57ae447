#!/usr/bin/env bash
# The GPU machine takes a working tree of at most 64 MiB: tests/golden (46 MB) and the shipped model
# dsflash/checkpoint/trained (30 MB) do not fit together, so move the one a call does not need out of the
# checkout for that call (runs with the golden cases: the model; training with --init: the golden cases).
# Issue 21's training run on one H200 in one device call (at most 600 s), from the repository root. Carry the
# data as `.train-gpu`: what `dsflash train-data --out .train-data` wrote, less the text (the train/validation/
# test *.tokens.npy, engram_map.json, facts.json, manifest.json, tokens.json, tokenizer.json; ~16 MB):
#   mkdir -p .train-gpu && cp .train-data/{engram_map.json,facts.json,manifest.json,tokenizer.json,tokens.json,*.npy} .train-gpu/
# and run `bash bench/run_train.sh [TRAIN OPTIONS]` with carry [".train-gpu"] (e.g. `--init dsflash/checkpoint/trained` goes on
# training the shipped model; `--ranks N` runs N data-parallel processes, rank r on GPU r mod the GPUs there).
# Writes $OUT/run/: the checkpoint in shards of at most
# 15 MiB (the GPU machine returns files of at most 16 MiB, 8 of them), train.json, loss.csv, loss.png. The
# checkpoint's tokenizer.json is the data's and stays behind (the ninth file): on the dev machine
#   cp .train-data/tokenizer.json RUN/checkpoint/ && python3 -m dsflash.train.ship RUN --data .train-data
# puts it into dsflash/checkpoint/trained/ (then set the gates' bounds in tests/test_quality.py).
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:?run on the device machine, where OUT is set}/run
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -m dsflash.train.train_cmd --data .train-gpu --out "$out" --budget "${BUDGET:-540}" --seq-len 16384 "$@" \
  2>&1 | grep -v -i warn | awk 'NR % 25 == 1 || /val_loss|wrote/'
rm "$out/checkpoint/tokenizer.json"
ls -l "$out" "$out/checkpoint"
