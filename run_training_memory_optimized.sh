#!/usr/bin/env bash
# The T4 recipe (15 GB), configs/t4.yaml: medium-size model (d=192, 8 encoder + 4 decoder layers),
# fp16 autocast with GradScaler, CUDA cache released every 50 batches, character tokens. On a GPU
# the batches fill 15 GB (GPU_MEMORY_GB=N for another size: a larger card is capped there) and the
# layers are compiled (--compile); on a CPU, micro-batches of 2 utterances accumulated 4 times and a
# validation every 200 steps. This script adds an allocator that grows segments instead of
# fragmenting, sets up what is missing and makes the demo corpus.
#
#   ./run_training_memory_optimized.sh                       # demo corpus, made under data/demo if missing
#   ./run_training_memory_optimized.sh --resume latest       # extra flags pass through
#   ./run_training_memory_optimized.sh --overwrite           # start over (the old run is moved aside)
#   TRAIN_MANIFEST=my/train.jsonl VALID_MANIFEST=my/valid.jsonl ./run_training_memory_optimized.sh
#   TRAIN_SHARDS=/content/drive/MyDrive/shards/shards.json VALID_MANIFEST=my/valid.jsonl ./run_training_memory_optimized.sh
#       (tar shards from konkanivani-prepare shards: far faster than loose files on a Drive mount)
#
# Without a GPU it runs on the CPU (fp32 unless the CPU computes bf16 fast).
set -euo pipefail
cd "$(dirname "$0")"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import konkanivani.training.loop" >/dev/null 2>&1; then  # imports every dependency
    training_scripts/setup_env.sh
fi

TRAIN_MANIFEST=${TRAIN_MANIFEST:-}
TRAIN_SHARDS=${TRAIN_SHARDS:-}
VALID_MANIFEST=${VALID_MANIFEST:-}
if [ -z "$TRAIN_MANIFEST" ] && [ -z "$TRAIN_SHARDS" ]; then
    command -v espeak-ng >/dev/null 2>&1 || training_scripts/setup_env.sh
    "$PYTHON" training_scripts/make_demo_corpus.py --output_dir data/demo  # returns at once when the corpus is there
    TRAIN_MANIFEST=data/demo/train.jsonl
    VALID_MANIFEST=${VALID_MANIFEST:-data/demo/valid.jsonl}
fi

TRAIN_DATA=(--train_manifest "$TRAIN_MANIFEST")
if [ -n "$TRAIN_SHARDS" ]; then
    TRAIN_DATA=(--train_shards "$TRAIN_SHARDS")
fi

# On a GPU: the card's memory (GPU_MEMORY_GB, else the recipe's 15 GB) and compiled layers.
GPU_FLAGS=()
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    GPU_FLAGS=(--compile)
    [ -z "${GPU_MEMORY_GB:-}" ] || GPU_FLAGS+=(--gpu_memory_gb "$GPU_MEMORY_GB")
fi

exec "$PYTHON" training_scripts/train_konkanivani_asr.py --config configs/t4.yaml \
    "${TRAIN_DATA[@]}" \
    ${GPU_FLAGS[@]+"${GPU_FLAGS[@]}"} \
    --valid_manifest "$VALID_MANIFEST" \
    --output_dir "${OUTPUT_DIR:-checkpoints/konkanivani_t4}" \
    "$@"
