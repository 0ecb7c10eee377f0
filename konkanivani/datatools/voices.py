"""Festival's voices of the demo corpus, with the Debian packages that install them: the one place
that names them. Standard library only, so that ``training_scripts/setup_env.sh`` can run this file
before anything is installed::

    python3 konkanivani/datatools/voices.py   # one "package:folder" line per voice, the held-out
    one first
"""
from __future__ import annotations

import sys
from typing import NamedTuple

__all__ = [
    "FESTIVAL_TRAIN_VOICES",
    "FESTIVAL_VOICE",
    "FESTIVAL_VOICE_FOLDER",
    "FESTIVAL_VOICE_PACKAGE",
    "FestivalVoice",
]

# The held-out voice source: festival's Marathi diphone voice (one real speaker's recordings), never
# in training.
FESTIVAL_VOICE = "voice_marathi_NSK_diphone"
FESTIVAL_VOICE_FOLDER = "marathi/marathi_NSK_diphone"
FESTIVAL_VOICE_PACKAGE = "festvox-mr-nsk"


class FestivalVoice(NamedTuple):
    """A festival voice of another language that reads Konkani in training: `language` is the
    transliteration (a key of transliterate.SPELLINGS, or "en" for US English phones)."""

    voice: str  # festival's voice function, e.g. voice_czech_dita
    language: str
    encoding: str  # of the spelled text given to text2wave
    folder: str  # the voice's folder under festival's voices/
    package: str  # the Debian package that installs it
    # False: the voice keeps its own tempo (festival's HTS voices ignore the stretch)
    stretches: bool = True


# Training voices: each one speaker's recordings (diphones, or an HTS model for Catalan), none of
# them the held-out NSK speaker. training_scripts/setup_env.sh installs their Debian packages (it
# runs this file for the list).
FESTIVAL_TRAIN_VOICES = {
    "festival:cs_dita": FestivalVoice(
        "voice_czech_dita", "cs", "iso-8859-2", "czech/czech_dita", "festvox-czech-dita"
    ),
    "festival:cs_krb": FestivalVoice(
        "voice_czech_krb", "cs", "iso-8859-2", "czech/czech_krb", "festvox-czech-krb"
    ),
    "festival:cs_machac": FestivalVoice(
        "voice_czech_machac", "cs", "iso-8859-2", "czech/czech_machac", "festvox-czech-machac"
    ),
    "festival:cs_ph": FestivalVoice(
        "voice_czech_ph", "cs", "iso-8859-2", "czech/czech_ph", "festvox-czech-ph"
    ),
    "festival:fi_lj": FestivalVoice(
        "voice_suo_fi_lj_diphone",
        "fi",
        "iso-8859-15",
        "finnish/suo_fi_lj_diphone",
        "festvox-suopuhe-lj",
    ),
    "festival:fi_mv": FestivalVoice(
        "voice_hy_fi_mv_diphone",
        "fi",
        "iso-8859-15",
        "finnish/hy_fi_mv_diphone",
        "festvox-suopuhe-mv",
    ),
    "festival:it_lp": FestivalVoice(
        "voice_lp_diphone", "it", "ascii", "italian/lp_diphone", "festvox-italp16k"
    ),
    "festival:it_pc": FestivalVoice(
        "voice_pc_diphone", "it", "ascii", "italian/pc_diphone", "festvox-itapc16k"
    ),
    "festival:ca_ona": FestivalVoice(
        "voice_upc_ca_ona_hts",
        "ca",
        "iso-8859-1",
        "catalan/upc_ca_ona_hts",
        "festvox-ca-ona-hts",
        stretches=False,
    ),
    "festival:en_kal": FestivalVoice(
        "voice_kal_diphone", "en", "ascii", "english/kal_diphone", "festvox-kallpc16k"
    ),
    "festival:en_ked": FestivalVoice(
        "voice_ked_diphone", "en", "ascii", "english/ked_diphone", "festvox-kdlpc16k"
    ),
}


def main() -> int:
    for package, folder in [(FESTIVAL_VOICE_PACKAGE, FESTIVAL_VOICE_FOLDER),
                            *((v.package, v.folder) for v in FESTIVAL_TRAIN_VOICES.values())]:
        print(f"{package}:{folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
