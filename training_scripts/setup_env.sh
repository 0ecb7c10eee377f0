#!/usr/bin/env bash
# Set up a machine for konkanivani: espeak-ng (demo corpus and tests), PyTorch + torchaudio when
# they are missing, and the package itself in editable mode.
#   training_scripts/setup_env.sh          # for training (with 8-bit AdamW from bitsandbytes)
#   training_scripts/setup_env.sh --dev    # also the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras="[8bit]"
[ "${1:-}" = "--dev" ] && extras="[dev,8bit]"

if ! command -v espeak-ng >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
    if [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; then
        echo "installing espeak-ng (speech synthesis for the demo corpus)"
        $sudo apt-get update -qq  # a fresh machine's package lists may be stale
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq espeak-ng
    else
        echo "espeak-ng is missing and this user cannot install it: apt-get install espeak-ng" >&2
    fi
fi

# Keep a working torch/torchaudio pair (Colab's, say); otherwise install one that loads together.
if ! "$PYTHON" -c "import torch, torchaudio" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.14.1" "torchaudio==2.11.0"
fi
"$PYTHON" -m pip install --quiet -e ".${extras}"
