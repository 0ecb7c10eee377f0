import os
import shutil

import pytest

# Under pytest-xdist (``-n 2``: a process per core) each process computes on one thread, and so do
# the processes its tests start: two processes of two threads each on two cores only contend.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

from konkanivani.datatools.corpus import make_corpus

# The fixtures that synthesize a corpus or train a model: a test that uses one, itself or through
# another fixture, is slow. tone_words_model is test_word_times.py's (150 steps on long clips).
SLOW_FIXTURES = frozenset({"tiny_corpus", "tone_model", "tone_full_model", "tone_words_model"})


def pytest_collection_modifyitems(config, items):
    """Every test that needs the synthesized corpus (to train on it, or to decode it) or a model a
    fixture trains is slow."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    _skip_gpu_tests_without_gpus(items)


def _skip_gpu_tests_without_gpus(items):
    """A test marked ``gpu`` (``gpu(devices=2)``: two of them) is skipped, with one line saying why,
    where this machine has fewer CUDA GPUs."""
    marked = [
        (item, item.get_closest_marker("gpu")) for item in items if item.get_closest_marker("gpu")
    ]
    if not marked:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item, marker in marked:
        needed = marker.kwargs.get("devices", 1)
        if count == 0:
            item.add_marker(
                pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
            )
        elif count < needed:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {needed} CUDA GPUs, this machine has {count}")
            )


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real (espeak-ng) Konkani corpus small enough to train on in seconds."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is required for the end-to-end tests: apt-get install espeak-ng")
    out = tmp_path_factory.mktemp("corpus")
    make_corpus(
        out, seed=3, num_utterances=64, max_sentences=24, jobs=2, progress=False, festival_share=0
    )
    return out


@pytest.fixture(scope="session")
def tiny_run(tiny_corpus, tmp_path_factory):
    """The output directory of a short real training run of the tiny preset (for decoding tests)."""
    from konkanivani.config import TrainConfig
    from konkanivani.training.loop import train

    out = tmp_path_factory.mktemp("tiny_run")
    cfg = TrainConfig(
        train_manifest=str(tiny_corpus / "train.jsonl"),
        valid_manifest=str(tiny_corpus / "valid.jsonl"),
        output_dir=str(out),
        preset="tiny",
        vocab_size=48,
        batch_size=8,
        lr=3e-3,
        warmup_steps=10,
        epochs=12,
        num_workers=0,
        progress=False,
        keep_checkpoints=20,
        seed=11,
    )
    train(cfg)
    return out


@pytest.fixture(scope="session")
def tokenizer():
    """A unigram tokenizer of 40 pieces of konkani_texts.TEXTS, for tests of rows and batches."""
    from konkani_texts import TEXTS

    from konkanivani.data.tokenizer import train_tokenizer

    return train_tokenizer(TEXTS, vocab_size=40)


def _tone_model(streaming: bool):
    from serve_helpers import train_model
    from tone_speech import SENTENCES, speech

    return train_model([speech(s, seed=i) for i, s in enumerate(SENTENCES)], SENTENCES, streaming)


@pytest.fixture(scope="session")
def tone_model():
    """The Recognizer of a tiny model that has learned the four tone sentences (tone_speech.py, 120
    steps) for chunks of 1-8 frames and full context, with causal convolutions: trained once for
    every file that decodes with it (none changes it)."""
    return _tone_model(streaming=True)


@pytest.fixture(scope="session")
def tone_full_model():
    """The full-context (not streaming) tone model, as ``tone_model`` trained once."""
    return _tone_model(streaming=False)


@pytest.fixture(scope="session")
def tone_checkpoints(tone_model, tone_full_model, tmp_path_factory):
    """The two tone models saved as checkpoints: ``{"streaming": path, "full": path}``."""
    from serve_helpers import save_recognizer

    out = tmp_path_factory.mktemp("tone_models")
    return {"streaming": save_recognizer(tone_model, out / "streaming.pt"),
            "full": save_recognizer(tone_full_model, out / "full.pt")}
