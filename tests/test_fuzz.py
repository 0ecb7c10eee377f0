"""Property tests: the manifest reader, the row checks and text normalization take any input
without crashing, and normalization has the form it promises."""
import json
import tempfile
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from konkani_texts import TEXTS

from konkanivani.data.manifest import ManifestError, check_row, iter_manifest, read_manifest
from konkanivani.data.tokenizer import (
    BLANK_ID,
    SOS_EOS_ID,
    normalize_text,
)

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def audio_dir():
    with tempfile.TemporaryDirectory() as d:
        sf.write(Path(d) / "a.wav", 0.1 * np.sin(np.arange(16000) / 8), 16000)
        yield Path(d)


@SETTINGS
@given(st.lists(st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")), max_size=8))
def test_manifest_reader_reports_every_bad_line_and_nothing_else(tmp_path, lines):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    items = list(iter_manifest(path))
    numbers = [n for n, _ in items]
    assert numbers == sorted(set(numbers)) and all(1 <= n <= len(lines) for n in numbers)
    for n, item in items:
        assert isinstance(item, dict) or (
            isinstance(item, ManifestError) and f"{path}:{n}:" in str(item)
        )
    if any(isinstance(item, ManifestError) for _, item in items):
        with pytest.raises(ManifestError, match="validate_manifest.py"):
            read_manifest(path)
    else:
        assert read_manifest(path) == items


_JSON = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_ROWS = st.fixed_dictionaries({}, optional={
    "audio_filepath": st.sampled_from(["a.wav", "missing.wav", "", "/"]) | _JSON,
    "duration": st.floats(allow_nan=True, allow_infinity=True) | _JSON,
    "text": st.sampled_from(TEXTS) | st.text(max_size=40) | _JSON,
})


@SETTINGS
@given(_ROWS, st.floats(-1, 5))
def test_row_check_never_raises(audio_dir, tokenizer, row, tolerance):
    json.dumps(row)  # rows come from JSON; the strategy stays inside it
    check = check_row(row, audio_dir, tokenizer, duration_tolerance=tolerance, decode=True)
    if check.error is None:
        assert check.tokens and check.audio_path == audio_dir / "a.wav" and check.duration == 1.0
    else:
        reason, detail = check.error
        assert reason and isinstance(detail, str)


@SETTINGS
@given(st.text(max_size=80))
def test_normalized_text_is_canonical(tokenizer, text):
    norm = normalize_text(text)
    assert normalize_text(norm) == norm
    assert norm == norm.strip() and "  " not in norm
    assert all(ch == " " or not ch.isspace() for ch in norm)
    assert not any(
        unicodedata.category(ch)[0] in "PS" or unicodedata.category(ch) == "Cf" for ch in norm
    )
    # text becomes pieces of the vocabulary (<unk> for what it lacks), never the blank or <sos/eos>
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size and i not in (BLANK_ID, SOS_EOS_ID) for i in ids)
