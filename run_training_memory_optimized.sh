#!/usr/bin/env bash
# The T4 recipe (15 GB): medium-size model (d=192, 8 encoder + 4 decoder layers), micro-batches of
# 2 utterances accumulated 4 times (an effective batch of 8), fp16 autocast with GradScaler, CUDA
# cache released every 50 batches, and an allocator that grows segments instead of fragmenting.
# It validates every 200 steps (a quarter to a third of a demo epoch), so a score and best.pt exist
# long before the first epoch ends.
# Tokens are characters: on small Devanagari corpora they generalize to unseen words far better
# than subword pieces (see the README's learning curve).
#
#   ./run_training_memory_optimized.sh                       # demo corpus, made under data/demo if missing
#   ./run_training_memory_optimized.sh --resume latest       # extra flags pass through
#   ./run_training_memory_optimized.sh --overwrite           # start over (the old run is moved aside)
#   TRAIN_MANIFEST=my/train.jsonl VALID_MANIFEST=my/valid.jsonl ./run_training_memory_optimized.sh
#
# Without a GPU it runs on the CPU (fp32 unless the CPU computes bf16 fast).
set -euo pipefail
cd "$(dirname "$0")"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import konkanivani.train" >/dev/null 2>&1; then  # imports every dependency
    training_scripts/setup_env.sh
fi

TRAIN_MANIFEST=${TRAIN_MANIFEST:-}
VALID_MANIFEST=${VALID_MANIFEST:-}
if [ -z "$TRAIN_MANIFEST" ]; then
    command -v espeak-ng >/dev/null 2>&1 || training_scripts/setup_env.sh
    "$PYTHON" training_scripts/make_demo_corpus.py data/demo  # returns at once when the corpus is there
    TRAIN_MANIFEST=data/demo/train.jsonl
    VALID_MANIFEST=${VALID_MANIFEST:-data/demo/valid.jsonl}
fi

exec "$PYTHON" training_scripts/train_konkanivani_asr.py \
    --train_manifest "$TRAIN_MANIFEST" \
    --valid_manifest "$VALID_MANIFEST" \
    --output_dir "${OUTPUT_DIR:-checkpoints/konkanivani_t4}" \
    --preset medium --d_model 192 --encoder_layers 8 --decoder_layers 4 \
    --tokenizer_type char \
    --batch_size 2 --gradient_accumulation_steps 4 \
    --mixed_precision \
    --empty_cache_every 50 \
    --num_workers 2 \
    --validate_every_steps 200 \
    "$@"
