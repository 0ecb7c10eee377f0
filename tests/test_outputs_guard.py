"""No output destroys an input (issue 32): every tool's outputs are checked, before any decoding,
against every file the run reads (the checkpoint, the manifests and each audio file a folder or
manifest expands to) and against each other, with symlinks and hard links followed; outputs appear
whole or not at all. Each case hashes the input files before and after the run: the bytes must be
the same, whatever the exit status. And Ctrl-C ends every console script in one line with exit
status 130, also while its modules import.

Fast: an untrained tiny model and three clips of noise, no training."""
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from konkanivani.checkpoint import save_checkpoint
from konkanivani.cli import average, evaluate, export, plot, prepare, transcribe, validate
from konkanivani.config import model_config_from_preset
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.datatools.outputs import OutputError, check_outputs
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.model.asr import ASRModel

SR = 16000
TEXTS = ["हांव घरा वता", "तूं कितें करता", "आमी पणजेक गेलें"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """An untrained tiny checkpoint: decoding it is fast, and its text is whatever it is."""
    tokenizer = train_tokenizer(TEXTS * 4, vocab_size=30, model_type="char")
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size)
    path = tmp_path_factory.mktemp("model") / "model.pt"
    state = {"model_config": dataclasses.asdict(cfg), "model": ASRModel(cfg).state_dict(),
             "tokenizer": tokenizer.model_proto}
    return save_checkpoint(state, path)


@pytest.fixture
def data(tmp_path, model):
    """DATA/model.pt, DATA/clips/{a,b,c}.wav (0.5 s of seeded noise each) and DATA/test.jsonl
    listing the clips by relative path."""
    root = tmp_path / "data"
    (root / "clips").mkdir(parents=True)
    shutil.copy(model, root / "model.pt")
    rows = []
    for i, name in enumerate("abc"):
        noise = np.random.default_rng(i).integers(-4000, 4000, SR // 2).astype(np.int16)
        sf.write(root / "clips" / f"{name}.wav", noise, SR, subtype="PCM_16")
        rows.append({"audio_filepath": f"clips/{name}.wav", "duration": 0.5, "text": TEXTS[i]})
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (root / "test.jsonl").write_text(lines, encoding="utf-8")
    return root


def _digests(root):
    """SHA-256 of every regular file under ``root`` (symlinks not followed), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _status(main, argv):
    """A tool's exit status, whether it returns it or its parser exits."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if a model is loaded or a row is checked: the refusal must come first."""
    def never(*args, **kwargs):
        raise AssertionError("the output was refused only after the work had started")

    monkeypatch.setattr(Recognizer, "from_checkpoint", never)
    monkeypatch.setattr(validate, "check_row", never)


# (tool, its arguments with D for the data folder, what the one line must name)
REFUSED = {
    "transcribe FOLDER --output FOLDER/b.wav": (
        transcribe, ["D/model.pt", "D/clips", "--output", "D/clips/b.wav"], "clips/b.wav"),
    "transcribe MANIFEST --output a listed wav": (
        transcribe, ["D/model.pt", "D/test.jsonl", "--output", "D/clips/c.wav"], "clips/c.wav"),
    "evaluate --output a listed wav": (
        evaluate, ["D/model.pt", "D/test.jsonl", "--output", "D/clips/a.wav"], "clips/a.wav"),
    "evaluate --report a listed wav": (
        evaluate, ["D/model.pt", "D/test.jsonl", "--report", "D/clips/b.wav"], "clips/b.wav"),
    "validate --output a listed wav": (
        validate, ["D/test.jsonl", "--output", "D/clips/a.wav"], "clips/a.wav"),
    "evaluate --output X --report X": (
        evaluate, ["D/model.pt", "D/test.jsonl", "--output", "D/x.txt", "--report", "D/x.txt"],
        "are the same file"),
    "evaluate --output X --report X, X already there": (
        evaluate, ["D/model.pt", "D/test.jsonl", "--output", "D/old.txt", "--report", "D/old.txt"],
        "are the same file"),
    "transcribe --output a symlink to an audio file": (
        transcribe, ["D/model.pt", "D/clips", "--output", "D/link.wav"], "link.wav"),
    "evaluate --report a hard link to the manifest": (
        evaluate, ["D/model.pt", "D/test.jsonl", "--report", "D/hard.md"], "hard.md"),
    "transcribe --output a symlink to the checkpoint": (
        transcribe, ["D/model.pt", "D/clips/a.wav", "--output", "D/model-link.pt"],
        "model-link.pt"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_output_that_is_an_input_is_refused_before_any_work_and_every_input_kept(
        case, data, capsys, no_decoding):
    tool, argv, named = REFUSED[case]
    (data / "old.txt").write_text("an earlier result\n", encoding="utf-8")
    (data / "link.wav").symlink_to(data / "clips" / "b.wav")
    (data / "model-link.pt").symlink_to(data / "model.pt")
    os.link(data / "test.jsonl", data / "hard.md")
    before = _digests(data)
    status = _status(tool.main, [a.replace("D/", f"{data}/") for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and named in err[0], err
    assert any(why in err[0] for why in ("never rewrites its own input", "a file of its own"))
    assert _digests(data) == before  # the clips, the manifest, the checkpoint: byte for byte
    assert (data / "link.wav").is_symlink() and not (data / "x.txt").exists()


@pytest.mark.parametrize("tool", [transcribe, evaluate])
def test_an_output_in_a_folder_not_made_yet_is_written_there_when_the_run_ends(tool, data,
                                                                              tmp_path):
    before = _digests(data)
    out = tmp_path / "results" / "today" / "out.jsonl"
    assert tool.main([str(data / "model.pt"), str(data / "test.jsonl"), "--output", str(out),
                      "--method", "greedy"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 3
    assert _digests(data) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no temporary file left


@pytest.mark.parametrize("tool", [transcribe, evaluate])
def test_an_output_that_cannot_be_written_is_one_line_before_any_decoding(tool, data, tmp_path,
                                                                          capsys, no_decoding):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder", encoding="utf-8")
    before = _digests(data)
    argv = [data / "model.pt", data / "test.jsonl", "--output", blocker / "out.jsonl"]
    status = _status(tool.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and f"{blocker} is not a folder" in err[0], err
    assert _digests(data) == before
    assert blocker.read_text(encoding="utf-8") == "a file, not a folder"


def test_an_interrupted_transcription_leaves_the_old_output_whole(data, monkeypatch, capsys):
    out = data / "out.jsonl"
    out.write_text('{"an earlier": "result"}\n', encoding="utf-8")
    before = _digests(data)
    real = Recognizer.transcribe

    def ctrl_c_after_the_first(self, paths, *args, **kwargs):
        for transcript in real(self, paths, *args, **kwargs):
            yield transcript  # written to the output's temporary file
            raise KeyboardInterrupt

    monkeypatch.setattr(Recognizer, "transcribe", ctrl_c_after_the_first)
    assert transcribe.main([str(data / "model.pt"), str(data / "clips"), "--method", "greedy",
                            "--output", str(out)]) == 130
    assert "konkanivani-transcribe: interrupted (Ctrl-C)" in capsys.readouterr().err
    assert _digests(data) == before  # the old output too
    assert not list(data.glob(".out.jsonl.tmp*"))


def test_the_other_tools_ask_the_same_place(data, tmp_path, capsys):
    """average, plot, export and prepare shards: an output that is an input is one line, exit 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0, "lr": 0.001}\n',
                                       encoding="utf-8")
    (data / "avg.pt").symlink_to(data / "model.pt")
    shutil.copy(data / "model.pt", data / "clips" / "model.torchscript.pt")
    before, run_before = _digests(data), _digests(run)
    cases = [
        (average, ["--inputs", data / "model.pt", data / "model.pt", "--output", data / "avg.pt"],
         "avg.pt"),
        (plot, [run, "-o", run / "metrics.jsonl"], "metrics.jsonl"),
        (export, [data / "clips" / "model.torchscript.pt", "--format", "torchscript",
                  "--output_dir", data / "clips"], "model.torchscript.pt"),
        (prepare, ["shards", data / "test.jsonl", "--output_dir", data / "clips",
                   "--shard_size", "2"],
         "clips/a.wav"),
    ]
    for tool, argv, named in cases:
        status = _status(tool.main, argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and named in err[0], (tool.__name__, err)
    assert _digests(data) == before and _digests(run) == run_before
    assert not list((data / "clips").glob("shard-*"))
    assert not (data / "clips" / "shards.json").exists()


def test_check_outputs_follows_links_and_allows_what_no_input_is(tmp_path):
    source = tmp_path / "a.wav"
    source.write_bytes(b"RIFF")
    os.link(source, tmp_path / "hard.wav")
    (tmp_path / "soft.wav").symlink_to("a.wav")
    for output in ("hard.wav", "soft.wav", "./a.wav", "../" + tmp_path.name + "/a.wav"):
        with pytest.raises(OutputError, match="never rewrites its own input"):
            check_outputs({"--output": tmp_path / output}, [source])
    allowed = {"--output": tmp_path / "new" / "out.jsonl", "--report": tmp_path / "r.md"}
    check_outputs(allowed, [source])
    with pytest.raises(OutputError, match="holds .*a.wav"):
        check_outputs({}, [source], folders={"--output_dir": tmp_path})


# ---- Ctrl-C at any moment ----------------------------------------------------------------------

SCRIPTS_MODULE = "konkanivani.cli.scripts"


def test_the_console_scripts_start_without_importing_torch():
    """What lets them handle Ctrl-C at once: the entry module and the packages above it are
    light."""
    code = (f"import sys, {SCRIPTS_MODULE}\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == "[]"


def _script(name):
    path = Path(sys.executable).parent / name
    assert path.is_file(), f"{path}: the console script is not installed (pip install -e .)"
    assert f"from {SCRIPTS_MODULE} import" in path.read_text(encoding="utf-8"), (
        f"{path} predates the entry points of cli/scripts.py: reinstall (pip install -e .)")
    return path


def _blocked_folder(tmp_path):
    """A folder for konkanivani-prepare folder whose transcript is a FIFO with no writer: reading it
    waits for ever, so a Ctrl-C after the imports finds the tool still at work."""
    source = tmp_path / "src"
    source.mkdir()
    sf.write(source / "x.wav", np.zeros(SR // 10, dtype=np.int16), SR, subtype="PCM_16")
    os.mkfifo(source / "x.txt")
    return source


def _blocked_clips(tmp_path):
    """A folder for konkanivani-transcribe whose one clip is a FIFO with no writer (same reason)."""
    clips = tmp_path / "clips"
    clips.mkdir()
    os.mkfifo(clips / "x.wav")
    return clips


COMMANDS = {  # each still running seconds after its imports end
    "konkanivani-prepare": lambda tmp, model: ["folder", _blocked_folder(tmp),
                                               "--output_dir", tmp / "out"],
    "konkanivani-demo-corpus": lambda tmp, model: ["--output_dir", tmp / "corpus", "--jobs", "1"],
    "konkanivani-transcribe": lambda tmp, model: [model, _blocked_clips(tmp)],
}


# prepare at more moments: a KeyboardInterrupt raised inside torch's import, 0.2 to 0.35 s in,
# was now and then lost or hung the import (cli/scripts.py exits at once instead)
MOMENTS = [("konkanivani-prepare", delay) for delay in (0.0, 0.2, 0.35, 0.5, 1.0, 1.5)]
MOMENTS += [(name, delay) for name in ("konkanivani-demo-corpus", "konkanivani-transcribe")
            for delay in (0.0, 0.5, 1.5)]


@pytest.mark.slow
@pytest.mark.parametrize("name, delay", MOMENTS)
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(name, delay, model, tmp_path):
    """SIGINT as soon as the entry point runs (the tool's imports just begun), and up to 1.5 s
    later: during torch's import, or in the tool's work. ``-X importtime`` reports each import as it
    ends, so the moment the tool's imports begin is known and the test does not race Python's own
    start-up (a Ctrl-C inside it is Python's to report, before any code of the package runs)."""
    argv = [sys.executable, "-X", "importtime", _script(name), *COMMANDS[name](tmp_path, model)]
    # SIGINT as an interactive shell leaves it (a test run in the background may inherit it ignored)
    proc = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.split("|")[-1].strip() == SCRIPTS_MODULE:
                # an import that ends inside the entry point: its handling is on
                seen.append(proc.stderr.readline())
                break
        time.sleep(delay)
        assert proc.poll() is None, "".join(seen)[-2000:]
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(seen) + rest
    said = [line for line in err.splitlines()
            if line.strip() and not line.startswith("import time:")]
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert said[-1] == f"{name}: interrupted (Ctrl-C)", said
    assert sum("interrupted" in s for s in said) == 1, said
