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

# espeak-ng reads the demo corpus; festival's Marathi diphone voice reads its held-out split; festival's
# voices of other languages (Czech, Finnish, Italian, Catalan, US English) read 30% of its training
# split (demo_corpus.FESTIVAL_TRAIN_VOICES; without all of them, espeak-ng reads it all).
VOICES="festvox-czech-dita:czech/czech_dita festvox-czech-krb:czech/czech_krb festvox-czech-machac:czech/czech_machac
    festvox-czech-ph:czech/czech_ph festvox-suopuhe-lj:finnish/suo_fi_lj_diphone festvox-suopuhe-mv:finnish/hy_fi_mv_diphone
    festvox-italp16k:italian/lp_diphone festvox-itapc16k:italian/pc_diphone festvox-ca-ona-hts:catalan/upc_ca_ona_hts
    festvox-kallpc16k:english/kal_diphone festvox-kdlpc16k:english/ked_diphone"
missing=""
command -v espeak-ng >/dev/null 2>&1 || missing="espeak-ng"
{ command -v text2wave >/dev/null 2>&1 && [ -d /usr/share/festival/voices/marathi/marathi_NSK_diphone ]; } ||
    missing="$missing festival festvox-mr-nsk"
voices=""
for entry in $VOICES; do
    [ -d "/usr/share/festival/voices/${entry#*:}" ] || voices="$voices ${entry%%:*}"
done
if [ -n "$missing$voices" ]; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
    if [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; then
        echo "installing${missing}${voices} (speech synthesis for the demo corpus)"
        $sudo apt-get update -qq  # a fresh machine's package lists may be stale
        [ -z "$missing" ] || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing
        # The training voices are optional: without them espeak-ng reads the whole training split.
        [ -z "$voices" ] || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $voices ||
            echo "warning: festival's training voices did not install; the demo corpus will leave them out" >&2
    else
        echo "${missing# }${voices} missing and this user cannot install them: apt-get install${missing}${voices}" >&2
    fi
fi

# Keep a working torch/torchaudio pair (Colab's, say); otherwise install one that loads together.
if ! "$PYTHON" -c "import torch, torchaudio" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.14.1" "torchaudio==2.11.0"
fi
"$PYTHON" -m pip install --quiet -e ".${extras}"
