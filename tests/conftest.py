import shutil

import pytest

from konkanivani.datatools.corpus import make_corpus


def pytest_collection_modifyitems(config, items):
    """Every test that needs the synthesized corpus (to train on it, or to decode it) is slow."""
    for item in items:
        if "tiny_corpus" in getattr(item, "fixturenames", ()):
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
