import shutil

import pytest

from konkanivani.demo_corpus import make_corpus


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A real (espeak-ng) Konkani corpus small enough to train on in seconds."""
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is required for the end-to-end tests: apt-get install espeak-ng")
    out = tmp_path_factory.mktemp("corpus")
    make_corpus(out, seed=3, num_utterances=64, max_sentences=24, jobs=2, progress=False)
    return out
