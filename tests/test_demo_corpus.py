import json

import soundfile as sf

from konkanivani.data import read_manifest
from konkanivani.demo_corpus import make_corpus


def _rows(corpus, split):
    return [row for _, row in read_manifest(corpus / f"{split}.jsonl")]


def test_manifests_audio_and_held_out_test_split(tiny_corpus):
    rows = {s: _rows(tiny_corpus, s) for s in ("train", "valid", "test")}
    assert sum(map(len, rows.values())) == 64
    for split, split_rows in rows.items():
        assert split_rows, split
        for row in split_rows:
            info = sf.info(str(tiny_corpus / row["audio_filepath"]))
            assert info.samplerate == 16000 and info.channels == 1
            assert abs(info.frames / 16000 - row["duration"]) < 1e-3
            assert 0.5 < row["duration"] < 10 and row["text"].strip()
    seen = rows["train"] + rows["valid"]
    assert {r["text"] for r in seen}.isdisjoint(r["text"] for r in rows["test"])
    assert {r["speaker"] for r in seen}.isdisjoint(r["speaker"] for r in rows["test"])
    assert len({r["speaker"] for r in rows["train"]}) >= 6


def test_deterministic_for_a_seed_and_reused_when_present(tiny_corpus, tmp_path):
    again = make_corpus(tmp_path, seed=3, num_utterances=64, max_sentences=24, jobs=1, progress=False)
    assert not again["skipped"]
    for split in ("train", "valid", "test"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (tiny_corpus / f"{split}.jsonl").read_bytes()
    first = _rows(tmp_path, "train")[0]["audio_filepath"]
    assert (tmp_path / first).read_bytes() == (tiny_corpus / first).read_bytes()
    assert make_corpus(tmp_path, seed=3, num_utterances=64, max_sentences=24, progress=False)["skipped"]
    info = json.loads((tmp_path / "corpus_info.json").read_text())
    assert info["seed"] == 3
