#!/usr/bin/env bash
# Set up a machine for konkanivani: espeak-ng and festival's voices (demo corpus and tests), PyTorch + torchaudio when
# they are missing, and the package itself in editable mode.
#   training_scripts/setup_env.sh          # for training (with 8-bit AdamW from bitsandbytes)
#   training_scripts/setup_env.sh --dev    # also the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras="[8bit]"
[ "${1:-}" = "--dev" ] && extras="[dev,8bit]"

# espeak-ng reads the demo corpus; festival's Marathi diphone voice reads its held-out split, and its
# voices of other languages (Czech, Finnish, Italian, Catalan, US English) read the corpus's
# --festival_share of the training split.
FESTIVAL_VOICES="festvox-mr-nsk festvox-czech-dita festvox-czech-krb festvox-czech-machac festvox-czech-ph
    festvox-suopuhe-lj festvox-suopuhe-mv festvox-italp16k festvox-itapc16k festvox-ca-ona-hts festvox-kallpc16k
    festvox-kdlpc16k"
missing=""
command -v espeak-ng >/dev/null 2>&1 || missing="espeak-ng"
command -v text2wave >/dev/null 2>&1 || missing="$missing festival"
for voice in $FESTIVAL_VOICES; do
    dpkg-query -W -f='${Status}' "$voice" 2>/dev/null | grep -q "ok installed" || missing="$missing $voice"
done
if [ -n "$missing" ]; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
    if [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; then
        echo "installing ${missing# } (speech synthesis for the demo corpus)"
        $sudo apt-get update -qq  # a fresh machine's package lists may be stale
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing
    else
        echo "${missing# } missing and this user cannot install it: apt-get install ${missing# }" >&2
    fi
fi

# Keep a working torch/torchaudio pair (Colab's, say); otherwise install one that loads together.
if ! "$PYTHON" -c "import torch, torchaudio" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.14.1" "torchaudio==2.11.0"
fi
"$PYTHON" -m pip install --quiet -e ".${extras}"
