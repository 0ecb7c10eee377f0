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
#   KONKANIVANI_RECIPE=t4 ./run_training_memory_optimized.sh  # the T4 recipe on a CPU all the same
#
# Without a CUDA GPU it trains the CPU recipe instead, configs/cpu_small.yaml (the small model,
# batches of 16, meant for a CPU; what it reaches in 30 minutes: docs/results.md), for 30 minutes
# unless --max_time says otherwise, into checkpoints/cpu_small, and says so in one line.
# KONKANIVANI_RECIPE=t4 or cpu_small chooses the recipe on any machine. Without a GPU, --resume
# goes on with the T4 recipe where its folder holds a run and the CPU recipe's holds none (a run
# this script started on a CPU before it chose the CPU recipe).
set -euo pipefail
cd "$(dirname "$0")"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PYTHON=${PYTHON:-python3}

RECIPE=${KONKANIVANI_RECIPE:-}
case "$RECIPE" in
    "" | t4 | cpu_small) ;;
    *)
        echo "error: KONKANIVANI_RECIPE=$RECIPE: give t4 (configs/t4.yaml) or cpu_small" \
            "(configs/cpu_small.yaml), or leave it unset for the one that fits this machine" >&2
        exit 2
        ;;
esac

if ! "$PYTHON" -c "import konkanivani.training.loop" >/dev/null 2>&1; then  # imports every dependency
    training_scripts/setup_env.sh
fi

T4_DIR=${OUTPUT_DIR:-checkpoints/konkanivani_t4}
CPU_DIR=${OUTPUT_DIR:-checkpoints/cpu_small}
holds_run() {  # what --resume latest resumes from: latest.pt, else a step file
    compgen -G "$1/latest.pt" >/dev/null || compgen -G "$1/step_*.pt" >/dev/null
}
resuming=false
for arg in "$@"; do
    case "$arg" in --resume | --resume=*) resuming=true ;; esac
done
cuda=false
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    cuda=true
fi
if [ -z "$RECIPE" ] && $cuda; then
    RECIPE=t4
elif [ -z "$RECIPE" ] && $resuming && [ "$T4_DIR" != "$CPU_DIR" ] && holds_run "$T4_DIR" &&
    ! holds_run "$CPU_DIR"; then
    RECIPE=t4
    echo "no CUDA GPU: --resume goes on with the T4 recipe's run in $T4_DIR" \
        "(KONKANIVANI_RECIPE=cpu_small for the CPU recipe, configs/cpu_small.yaml)" >&2
elif [ -z "$RECIPE" ]; then
    RECIPE=cpu_small
    echo "no CUDA GPU: training the CPU recipe (configs/cpu_small.yaml; what it reaches in 30" \
        "minutes: docs/results.md) for 30 minutes unless --max_time is given, into $CPU_DIR," \
        "not the T4 recipe, which is for a GPU: KONKANIVANI_RECIPE=t4 trains that one here" >&2
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

if [ "$RECIPE" = cpu_small ]; then
    # the budget its figures are for: a --max_time among the extra flags comes later and wins
    RECIPE_FLAGS=(--config configs/cpu_small.yaml --max_time 1800 --output_dir "$CPU_DIR")
    # its first epoch shortest first orders a manifest's rows: shards are read as they were written
    [ -z "$TRAIN_SHARDS" ] || RECIPE_FLAGS+=(--length_curriculum_epochs 0)
else
    RECIPE_FLAGS=(--config configs/t4.yaml --output_dir "$T4_DIR")
    # On a GPU: the card's memory (GPU_MEMORY_GB, else the recipe's 15 GB) and compiled layers.
    if $cuda; then
        RECIPE_FLAGS+=(--compile)
        [ -z "${GPU_MEMORY_GB:-}" ] || RECIPE_FLAGS+=(--gpu_memory_gb "$GPU_MEMORY_GB")
    fi
fi

exec "$PYTHON" training_scripts/train_konkanivani_asr.py "${RECIPE_FLAGS[@]}" \
    "${TRAIN_DATA[@]}" \
    --valid_manifest "$VALID_MANIFEST" \
    "$@"
