#!/usr/bin/env bash
# Set up a machine for konkanivani: espeak-ng and festival's voices (demo corpus and tests), PyTorch + torchaudio when
# they are missing, and the package itself in editable mode.
#   training_scripts/setup_env.sh          # for training (with 8-bit AdamW from bitsandbytes)
#   training_scripts/setup_env.sh --dev    # also the test tools, and Debian's chromium with its driver (the
#                                          # server's page is tested in it; nothing downloads a browser)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras="[8bit]"
[ "${1:-}" = "--dev" ] && extras="[dev,8bit]"

# espeak-ng reads the demo corpus; festival's Marathi diphone voice reads its held-out split; festival's
# voices of other languages (Czech, Finnish, Italian, Catalan, US English) read 30% of its training
# split (without all of them, espeak-ng reads it all). konkanivani/datatools/voices.py names them with their
# Debian packages, one "package:folder" line each, the held-out voice first (it needs only Python).
VOICES=$("$PYTHON" konkanivani/datatools/voices.py)
HELDOUT_VOICE=${VOICES%%$'\n'*}
missing=""
command -v espeak-ng >/dev/null 2>&1 || missing="espeak-ng"
{ command -v text2wave >/dev/null 2>&1 && [ -d "/usr/share/festival/voices/${HELDOUT_VOICE#*:}" ]; } ||
    missing="$missing festival ${HELDOUT_VOICE%%:*}"
if [ "${1:-}" = "--dev" ] && ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
    # tests/test_serve_page.py drives Debian's browser (a Devanagari font for its screenshot)
    missing="$missing chromium chromium-driver fonts-lohit-deva"
fi
voices=""
for entry in $(printf '%s\n' "$VOICES" | tail -n +2); do
    [ -d "/usr/share/festival/voices/${entry#*:}" ] || voices="$voices ${entry%%:*}"
done
if [ -n "$missing$voices" ]; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
    if [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; then
        echo "installing${missing}${voices} (speech synthesis for the demo corpus; with --dev the browser of the page test)"
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
