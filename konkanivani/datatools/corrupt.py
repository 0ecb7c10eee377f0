"""A noisy, reverberant copy of a manifest, for testing in harder conditions (the demo corpus's
``test_noisy`` split): the online augmentation of ``data.augment``, applied once and written out."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import soundfile as sf

from ..config import AugmentConfig
from ..data.audio import load_audio
from ..data.augment import Augmenter
from ..data.frames import SAMPLE_RATE
from ..data.manifest import read_manifest
from .outputs import child

__all__ = ["corrupt_manifest"]


def corrupt_manifest(
    src_manifest: str | Path,
    out_dir: str | Path,
    name: str,
    seed: int = 0,
    snr_db: tuple[float, float] = (5.0, 20.0),
    reverb: bool = True,
    noise_dir: Optional[str | Path] = None,
    rir_dir: Optional[str | Path] = None,
) -> Path:
    """Write a noisy (and, with ``reverb``, reverberant) copy of ``src_manifest`` for testing in
    harder conditions; return the new manifest, ``OUT_DIR/NAME.jsonl``.

    Every utterance is reverberated (synthetic rooms, or RIRs from ``rir_dir``) and gets noise at
    an SNR drawn uniformly from ``snr_db`` (generated coloured/babble-like noise, or excerpts of the
    files in ``noise_dir``), then is written as 16 kHz 16-bit PCM to ``OUT_DIR/NAME/<n>_<stem>.wav``
    (peak-limited to avoid clipping). The manifest keeps each row's text and other keys, with the
    audio path relative to ``OUT_DIR`` and the duration of the new file. The same seed gives the
    same files. A row whose audio cannot be read is an error naming the manifest and line.
    """
    src_manifest, out_dir = Path(src_manifest), Path(out_dir)
    if not snr_db[0] <= snr_db[1]:
        raise ValueError(f"snr_db must be (low, high) with low <= high, got {snr_db}")
    augmenter = Augmenter(
        AugmentConfig(
            noise_prob=1.0,
            noise_snr_low_db=snr_db[0],
            noise_snr_high_db=snr_db[1],
            reverb_prob=float(reverb),
            noise_dir=str(noise_dir or ""),
            rir_dir=str(rir_dir or ""),
            seed=seed,
        )
    )
    # a plain name: it stays in out_dir
    child(out_dir, name, "name").mkdir(parents=True, exist_ok=True)
    rows = []
    for n, (line_no, row) in enumerate(read_manifest(src_manifest)):
        audio = Path(str(row.get("audio_filepath", "")))
        audio = audio if audio.is_absolute() else src_manifest.parent / audio
        try:
            wav = load_audio(audio)
        except RuntimeError as e:
            raise RuntimeError(f"{src_manifest}:{line_no}: {e}") from e
        wav = augmenter.waveform(wav, 0, n)
        peak = float(wav.abs().max())
        wav = wav * (0.99 / peak) if peak > 0.99 else wav
        relative = Path(name) / f"{n:05d}_{audio.stem}.wav"
        sf.write(out_dir / relative, wav.numpy(), SAMPLE_RATE, subtype="PCM_16")
        rows.append(
            {
                **row,
                "audio_filepath": relative.as_posix(),
                "duration": round(len(wav) / SAMPLE_RATE, 4),
            }
        )
    manifest = out_dir / f"{name}.jsonl"
    manifest.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return manifest
