"""notebooks/train_on_colab_t4.ipynb: a valid notebook whose cells, run in order on a CPU with the
tiny preset and a tiny demo corpus, make the corpus, train, resume, draw the curves and transcribe.
"""

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "train_on_colab_t4.ipynb"
SKIPPED_TAG = "colab-only"  # cells of IPython magics, which plain Python cannot run


def _notebook() -> dict:
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def _tags(cell: dict) -> list[str]:
    return cell["metadata"].get("tags", [])


def _code(cell: dict) -> str:
    return "".join(cell["source"])


def test_the_notebook_is_nbformat_4_with_empty_outputs_and_plain_python_cells():
    nb = _notebook()
    assert set(nb) == {"nbformat", "nbformat_minor", "metadata", "cells"}
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 5
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert nb["metadata"]["colab"]["gpuType"] == "T4"
    ids = [cell["id"] for cell in nb["cells"]]
    assert len(set(ids)) == len(ids)
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("markdown", "code")
        assert isinstance(cell["source"], list) and all(
            isinstance(line, str) for line in cell["source"]
        )
        if cell["cell_type"] == "code":
            assert set(cell) == {
                "cell_type",
                "id",
                "metadata",
                "source",
                "execution_count",
                "outputs",
            }
            assert cell["outputs"] == [] and cell["execution_count"] is None
        else:
            assert set(cell) == {"cell_type", "id", "metadata", "source"}
    code_cells = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    # the one cell to edit (and for this test to override) comes first
    assert "settings" in _tags(code_cells[0])
    skipped = [cell for cell in code_cells if SKIPPED_TAG in _tags(cell)]
    assert len(skipped) == 1 and "%tensorboard" in _code(skipped[0])
    for cell in code_cells:
        if cell not in skipped:  # no `!` lines or `%` magics: the test runs these with exec
            compile(_code(cell), f"{NOTEBOOK.name} cell {cell['id']}", "exec")
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(encoding="utf-8"), as_version=4))


@pytest.mark.slow
def test_the_notebook_trains_resumes_draws_and_transcribes_on_a_cpu(tmp_path, monkeypatch, capsys):
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is required for the end-to-end tests: apt-get install espeak-ng")
    # The tools the notebook starts import this checkout; the notebook writes only where its
    # settings say.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.chdir(tmp_path)
    # what a user would upload: 22.05 kHz, not from the corpus
    recording = tmp_path / "recording.wav"
    subprocess.run(
        ["espeak-ng", "-v", "mr", "-w", str(recording), "हांव पणजेक वता"], check=True, timeout=60
    )
    run_dir = tmp_path / "drive" / "runs" / "t4"
    settings = {
        "REPO_DIR": str(ROOT), "DATA": "demo", "DATA_DIR": str(tmp_path / "demo"),
        "DEMO_FLAGS": ["--num_utterances", "40", "--max_sentences", "20", "--jobs", "1"],
        "RUN_DIR": str(run_dir), "VALIDATE_EVERY_STEPS": 2, "MAX_STEPS": 3,
        "EXTRA_FLAGS": ["--preset", "tiny", "--num_workers", "0", "--no_progress"],
        "AUDIO": str(recording),
    }

    namespace = {"__name__": "__main__"}
    for cell in _notebook()["cells"]:
        if cell["cell_type"] != "code" or SKIPPED_TAG in _tags(cell):
            continue
        # the session ended after step 3; the settings now ask for 6 steps
        if "resume" in _tags(cell):
            assert (run_dir / "step_0000003.pt").is_file() and not (
                run_dir / "step_0000006.pt"
            ).exists()
            namespace["MAX_STEPS"] = 6
        exec(compile(_code(cell), f"{NOTEBOOK.name} cell {cell['id']}", "exec"), namespace)
        if "settings" in _tags(cell):
            assert set(settings) <= set(
                namespace
            ), "a setting the test overrides is gone from the notebook"
            namespace.update(settings)
    assert namespace["IN_COLAB"] is False

    out = capsys.readouterr().out
    assert (tmp_path / "demo" / "train.jsonl").is_file()
    for name in ("latest.pt", "best.pt", "config.yaml", "metrics.jsonl", "step_0000006.pt"):
        assert (run_dir / name).is_file(), name
    assert "resumed from" in out and "at step 3" in out
    metrics = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    assert max(row["step"] for row in metrics) == 6
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra (CI has it)
        assert (run_dir / "curves.png").stat().st_size > 0
        assert f"wrote {run_dir / 'curves.png'}" in out
    # path<TAB>text
    transcripts = [line for line in out.splitlines() if line.startswith(f"{recording}\t")]
    assert len(transcripts) == 1 and "1 of 1 files" in out
