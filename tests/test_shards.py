"""Sharded datasets: writing them (atomic, resumable, checked rows), planning an epoch (every
utterance once, equal batch counts per process, resumable), reading them through a DataLoader,
bad shards, and training on them (learns, resumes exactly; 2 torchrun processes in
test_shards_distributed.py)."""
import io
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest
import soundfile as sf
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_args import tiny_args

from konkanivani.data.audio import load_audio
from konkanivani.data.dataset import ASRDataset
from konkanivani.data.frames import frames_of
from konkanivani.data.manifest import read_manifest
from konkanivani.data.shards import (
    LIST_NAME,
    Shard,
    ShardError,
    ShardPlan,
    ShardSet,
    ShardStream,
    decode_member,
    interleave,
    iter_shard,
    open_shards,
    shard_files,
)
from konkanivani.data.tokenizer import train_tokenizer
from konkanivani.datatools import shard_writer as shard_tools
from konkanivani.datatools.shard_writer import write_shards
from konkanivani.training.metrics_log import read_metrics

SCRIPT = Path(__file__).resolve().parents[1] / "training_scripts" / "train_konkanivani_asr.py"


@pytest.fixture(scope="module")
def shard_dir(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "train"
    report = write_shards(tiny_corpus / "train.jsonl", out, shard_size=10, progress=False)
    assert report.shards == 6 and report.written == 6 and not report.skipped
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return train_tokenizer(
        [row["text"] for _, row in read_manifest(tiny_corpus / "train.jsonl")], 48
    )


# ---- writing -------------------------------------------------------------------------------------

def test_shards_hold_every_row_losslessly_and_webdataset_reads_them(tiny_corpus, shard_dir):
    rows = [row for _, row in read_manifest(tiny_corpus / "train.jsonl")]
    listing = json.loads((shard_dir / LIST_NAME).read_text())
    assert listing["utterances"] == len(rows) == sum(e["utterances"] for e in listing["shards"])
    assert [e["utterances"] for e in listing["shards"]] == [10] * 5 + [len(rows) - 50]
    assert listing["hours"] == pytest.approx(sum(r["duration"] for r in rows) / 3600, abs=1e-4)
    assert (shard_dir / "text.txt").read_text().splitlines() == [r["text"] for r in rows]

    import webdataset as wds
    samples = list(
        wds.WebDataset(str(shard_dir / "shard-{000000..000005}.tar"), shardshuffle=False)
    )
    assert [s["__key__"] for s in samples] == [f"train-{i:08d}" for i in range(1, len(rows) + 1)]
    for sample, row in zip(samples, rows, strict=True):
        meta = json.loads(sample["json"])
        assert meta["text"] == row["text"] and meta["speaker"] == row["speaker"]
        assert meta["duration"] == pytest.approx(row["duration"], abs=1e-3)
    flac, _ = sf.read(io.BytesIO(samples[3]["flac"]), dtype="float32")
    # lossless
    assert torch.equal(torch.from_numpy(flac), load_audio(tiny_corpus / rows[3]["audio_filepath"]))


def test_opus_shards_are_a_fraction_of_the_bytes_and_read_as_flac_ones(tiny_corpus, shard_dir,
                                                                        tmp_path):
    out = tmp_path / "opus"
    report = write_shards(tiny_corpus / "train.jsonl", out, shard_size=10, progress=False,
                          audio_format="opus")
    assert report.shards == 6 and not report.skipped
    flac_bytes = sum(p.stat().st_size for p in shard_dir.glob("shard-*.tar"))
    opus_bytes = sum(p.stat().st_size for p in out.glob("shard-*.tar"))
    assert opus_bytes < 0.4 * flac_bytes
    rows = [row for _, row in read_manifest(tiny_corpus / "train.jsonl")]
    key, files = next(iter_shard(out / "shard-000000.tar"))
    assert key == "train-00000001" and set(files) == {"opus", "json"}
    wav, meta = decode_member(files, key)
    source = load_audio(tiny_corpus / rows[0]["audio_filepath"])
    assert meta["text"] == rows[0]["text"] and wav.shape == source.shape
    # lossy, but the same speech: the error well below the signal
    assert (wav - source).pow(2).mean() < 0.1 * source.pow(2).mean()
    # written again as FLAC into the same folder: no Opus shard is kept for a FLAC one
    again = write_shards(tiny_corpus / "train.jsonl", out, shard_size=10, progress=False)
    assert again.written == 6
    assert set(next(iter_shard(out / "shard-000000.tar"))[1]) == {"flac", "json"}
    with pytest.raises(ValueError, match="want one of flac, opus"):
        write_shards(tiny_corpus / "train.jsonl", out, shard_size=10, audio_format="mp3")


def test_bad_rows_are_counted_and_named_and_the_others_written(tiny_corpus, tmp_path):
    lines = (tiny_corpus / "train.jsonl").read_text().splitlines()[:6]
    broken = json.loads(lines[2]) | {"audio_filepath": "wavs/nowhere.wav"}
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "\n".join([lines[0], lines[1], json.dumps(broken), "{not json", lines[3]]) + "\n"
    )
    (tmp_path / "wavs").symlink_to(tiny_corpus / "wavs")
    report = write_shards(manifest, tmp_path / "out", shard_size=2, progress=False)
    assert report.utterances == 3 and report.shards == 2
    assert report.skipped == Counter({"audio file missing": 1, "not a JSON object line": 1})
    assert any(e.startswith(f"{manifest}:3: audio file missing") for e in report.examples)
    assert any(e.startswith(f"{manifest}:4: not a JSON") for e in report.examples)


def test_a_killed_writer_leaves_only_whole_shards_and_a_rerun_keeps_them(
    tiny_corpus, tmp_path, monkeypatch
):
    clean = tmp_path / "clean"
    write_shards(tiny_corpus / "train.jsonl", clean, shard_size=10, progress=False)
    out = tmp_path / "out"
    encode, calls = shard_tools._encode, []

    def dies_in_shard_three(row, *args):
        calls.append(row.key)
        if len(calls) == 25:  # the 5th utterance of the third shard
            raise KeyboardInterrupt
        return encode(row, *args)

    monkeypatch.setattr(shard_tools, "_encode", dies_in_shard_three)
    with pytest.raises(KeyboardInterrupt):
        write_shards(tiny_corpus / "train.jsonl", out, shard_size=10, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        ".shards.progress.jsonl",
        "shard-000000.tar",
        "shard-000001.tar",
    ]
    with pytest.raises(ShardError):  # no list: nothing a reader could take for the whole set
        open_shards(str(out / LIST_NAME))

    monkeypatch.setattr(shard_tools, "_encode", encode)
    report = write_shards(tiny_corpus / "train.jsonl", out, shard_size=10, progress=False)
    assert report.written == 4 and report.shards == 6  # the two whole shards kept, not read again
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())
    for p in clean.iterdir():
        # the same bytes as one unbroken run
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name

    # other sizes: all anew
    again = write_shards(tiny_corpus / "train.jsonl", out, shard_size=20, progress=False)
    assert again.written == 3 and again.removed == [
        "shard-000003.tar",
        "shard-000004.tar",
        "shard-000005.tar",
    ]
    n = len(read_manifest(tiny_corpus / "train.jsonl"))
    assert [len(s) for s in open_shards(str(out)).shards] == [20, 20, n - 40]


def test_prepare_shards_command_refuses_the_manifests_own_folder(tiny_corpus, tmp_path):
    from konkanivani.cli.prepare import main
    with pytest.raises(SystemExit) as e:
        main(
            [
                "shards",
                str(tiny_corpus / "train.jsonl"),
                "--output_dir",
                str(tiny_corpus),
                "--shard_size",
                "5",
            ]
        )
    assert e.value.code == 2
    assert main(["shards", str(tiny_corpus / "train.jsonl"), "--output_dir", str(tmp_path / "s"),
                 "--shard_hours", "0.005", "--no_progress"]) == 0
    assert len(open_shards(str(tmp_path / "s")).shards) > 1


# The first run of two into one folder, held inside its first utterance until told to go on.
_HELD = """
import sys, time
from pathlib import Path
import konkanivani.datatools.shard_writer as shards
from konkanivani.cli.prepare import main
encode, started, go = shards._encode, Path(sys.argv[1]), Path(sys.argv[2])

def held(row, *args):
    started.touch()
    while not go.exists():
        time.sleep(0.05)
    return encode(row, *args)

shards._encode = held
sys.exit(main(sys.argv[3:]))
"""


def test_a_second_prepare_shards_into_the_same_folder_is_refused_in_one_line(tiny_corpus, shard_dir,
                                                                             tmp_path):
    out, started, go = tmp_path / "out", tmp_path / "started", tmp_path / "go"
    args = ["shards", str(tiny_corpus / "train.jsonl"), "--output_dir", str(out),
            "--shard_size", "10", "--no_progress"]
    corpus = _files(tiny_corpus)
    first = subprocess.Popen([sys.executable, "-c", _HELD, str(started), str(go), *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # up to 2 minutes for it to start writing (it checks every row first)
            if started.exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert started.exists(), first.communicate()[1][-3000:]
        writing = _files(out)
        second = subprocess.run([sys.executable, "-m", "konkanivani.cli.prepare", *args],
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        refusal = (f"error: {re.escape(str(out))}: another konkanivani-prepare shards is writing "
                   rf"this folder \(pid {first.pid}, started [-0-9: ]+\); wait for it to end, or "
                   "give another --output_dir")
        assert re.fullmatch(refusal, second.stderr.strip()), second.stderr
        assert _files(out) == writing  # the first's half-written shard left alone
        go.touch()
        stdout, stderr = first.communicate(timeout=300)
    finally:
        go.touch()
        first.kill() if first.poll() is None else None
    assert first.returncode == 0, stderr[-3000:]
    assert stdout.startswith(f"wrote {out / LIST_NAME}: 6 shards (6 written now")
    assert _files(out) == _files(shard_dir)  # whole, byte for byte what one run alone writes
    assert _files(tiny_corpus) == corpus


# ---- the plan ------------------------------------------------------------------------------------

def _fake_set(counts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shards = [
        Shard(
            Path(f"s{i}.tar"),
            f"s{i}.tar",
            0,
            tuple(f"k{i}_{j}" for j in range(n)),
            tuple(float(1 + 9 * torch.rand(1, generator=gen)) for _ in range(n)),
        )
        for i, n in enumerate(counts)
    ]
    return ShardSet(shards, "fake")


def _plans(shards, world, streams, **kw):
    frames = [frames_of(d) for d in shards.durations()]
    return [
        ShardPlan(shards, frames, rank=r, world=world, streams=streams, **kw) for r in range(world)
    ]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=7).filter(lambda c: sum(c) >= 6),
    world=st.integers(1, 3),
    streams=st.integers(1, 3),
    buffer=st.integers(1, 20),
    epoch=st.integers(0, 3),
    budget=st.sampled_from([0, 1200, 3000]),
)
def test_every_utterance_once_per_epoch_and_as_many_batches_in_every_process(
    counts, world, streams, buffer, epoch, budget
):
    shards = _fake_set(counts)
    plans = _plans(shards, world, streams, buffer=buffer, max_frames=budget, batch_size=3)
    for p in plans:
        p.set_epoch(epoch)
    batches = [p.epoch_batches() for p in plans]
    seen = [i for rank in batches for b in rank for i in b]
    assert sorted(seen) == list(range(len(shards)))  # all of them, once
    assert len({len(rank) for rank in batches}) == 1  # no process waits for another at the end
    for rank in batches:
        for b in rank:
            assert (
                not budget
                or len(b) <= 1
                or len(b) * max(frames_of(shards.durations()[i]) for i in b) <= budget
            )
    again = _plans(shards, world, streams, buffer=buffer, max_frames=budget, batch_size=3)
    for p, q in zip(plans, again):
        q.set_epoch(epoch)
        assert q.epoch_batches() == p.epoch_batches()  # a pure function of its inputs


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(1, 25), min_size=1, max_size=6), streams=st.integers(1, 4),
       start=st.integers(0, 40))
def test_after_a_resume_the_workers_in_turn_give_the_rest_of_the_epoch_in_order(
    counts, streams, start
):
    """A fresh DataLoader takes its workers' batches in turn from worker 0; ``work`` gives worker w
    the stream that makes that the unbroken epoch's order."""
    plan = _plans(_fake_set(counts), 1, streams, buffer=7, batch_size=2)[0]
    plan.set_epoch(1)
    whole = plan.epoch_batches()
    start = min(start, len(whole))
    plan.set_epoch(1, start)
    assert len(plan) == len(whole) - start
    assert interleave([plan.work(w).batches for w in range(streams)]) == whole[start:]


def test_a_plan_differs_from_epoch_to_epoch_and_splits_few_shards_among_many_processes():
    shards = _fake_set([40])  # one shard, three processes: each takes every third utterance
    plans = _plans(shards, 3, 1, buffer=10, batch_size=4)
    for p in plans:
        p.set_epoch(0)
    assert {i % 3 for b in plans[1].epoch_batches() for i in b} == {1}
    a = plans[0].epoch_batches()
    plans[0].set_epoch(1)
    assert plans[0].epoch_batches() != a and sorted(sum(a, [])) == sorted(
        sum(plans[0].epoch_batches(), [])
    )


# ---- reading -------------------------------------------------------------------------------------

def _loader(plan, tokenizer, workers):
    from torch.utils.data import DataLoader
    return DataLoader(
        ShardStream(plan, tokenizer, ASRDataset([])), batch_size=None, num_workers=workers
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_the_dataloader_gives_the_plans_batches_with_their_features_and_tokens(
    shard_dir, tokenizer, tiny_corpus, workers
):
    shards = open_shards(str(shard_dir))
    plan = _plans(shards, 1, workers, buffer=8, max_frames=2000)[0]
    plan.set_epoch(2)
    batches = list(_loader(plan, tokenizer, workers))
    assert [b.indices for b in batches] == plan.epoch_batches() and not any(
        b.missing for b in batches
    )
    rows = [row for _, row in read_manifest(tiny_corpus / "train.jsonl")]
    b = batches[1]
    i = b.indices[0]
    # set index = manifest row
    assert b.tokens[0, :b.token_lens[0]].tolist() == tokenizer.encode(rows[i]["text"])
    plan.set_epoch(2, 3)  # resumed after 3 batches
    assert [b.indices for b in _loader(plan, tokenizer, workers)] == [
        b.indices for b in batches[3:]
    ]


def _copy_shards(shard_dir, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for p in shard_dir.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    return out


def _member_offset(path, name):
    with tarfile.open(path) as tar:
        return tar.getmember(name).offset_data


def test_a_corrupt_member_is_skipped_and_counted_and_a_truncated_shard_ends_with_a_warning(
        shard_dir, tokenizer, tmp_path, caplog):
    out = _copy_shards(shard_dir, tmp_path)
    first = out / "shard-000000.tar"
    data = bytearray(first.read_bytes())
    at = _member_offset(first, "train-00000003.flac")
    data[at:at + 64] = b"\x00" * 64  # the FLAC header gone: it does not decode
    first.write_bytes(bytes(data))
    second = out / "shard-000001.tar"
    cut = _member_offset(second, "train-00000016.flac") + 100
    second.write_bytes(second.read_bytes()[:cut])  # cut short in the middle of its 6th utterance
    shards = open_shards(str(out), check_files=False)  # the list still says the whole sizes
    plan = _plans(shards, 1, 1, buffer=64, batch_size=4)[0]
    with caplog.at_level("WARNING", logger="konkanivani"):
        batches = list(_loader(plan, tokenizer, 0))
    missing = sorted(i for b in batches for i in b.missing)
    # the corrupt one; the truncated shard's 6th to 10th
    assert missing == [2] + list(range(15, 20))
    assert sum(len(b) for b in batches) == len(shards) - 6
    log = caplog.text
    assert "shard-000001.tar: shard truncated or corrupt after 5 utterances" in log
    assert "shard-000000.tar:train-00000003" in log
    assert "1 audio unreadable" in log and "5 missing from their shard" in log


def test_a_missing_shard_or_one_that_differs_from_its_list_is_one_line_before_training(
    shard_dir, tmp_path
):
    out = _copy_shards(shard_dir, tmp_path)
    second = out / "shard-000001.tar"
    second.write_bytes(second.read_bytes()[:-1024])
    with pytest.raises(
        ShardError, match=r"shard-000001.tar: \d+ bytes, but .*shards.json lists \d+"
    ):
        open_shards(str(out / LIST_NAME))
    second.unlink()
    with pytest.raises(ShardError, match="shard-000001.tar: shard missing"):
        open_shards(str(out))
    with pytest.raises(ShardError, match="shard missing"):
        open_shards(str(out / "shard-{000000..000002}.tar"))


def _files(folder):
    """Every file under ``folder`` (links followed) and its bytes: what a run must leave as is."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _edit_list(folder, edit):
    listing = json.loads((folder / LIST_NAME).read_text())
    edit(listing["shards"])
    (folder / LIST_NAME).write_text(json.dumps(listing))


def _key_twice_in_a_shard(out):
    _edit_list(out, lambda shards: shards[1]["keys"].__setitem__(3, shards[1]["keys"][2]))
    return str(out / LIST_NAME), r"key train-00000013 is in shard-000001.tar 2 times: keys must be"


def _key_in_two_shards(out):
    _edit_list(out, lambda shards: shards[2]["keys"].__setitem__(0, shards[1]["keys"][4]))
    return str(out / LIST_NAME), "key train-00000015 is in both shard-000001.tar and shard-000002"


def _entry_twice(out):
    _edit_list(out, lambda shards: shards.append(dict(shards[0])))
    return str(out / LIST_NAME), "shard-000000.tar is listed twice: it would be trained twice"


def _two_entries_one_file(out):
    (out / "again.tar").symlink_to(out / "shard-000003.tar")
    _edit_list(out, lambda shards: shards.insert(1, dict(shards[3], path="again.tar")))
    return str(out / LIST_NAME), "again.tar and shard-000003.tar are the same file"


def _pattern_twice(out):
    return str(out / "shard-{000000,000001,000000}.tar"), "shard-000000.tar is listed twice"


def _list_file_twice(out):
    again = f"{out}/../{out.name}/shard-000002.tar"  # another spelling of the same file
    (out / "list.txt").write_text(f"shard-000002.tar\nshard-000004.tar\n{again}\n")
    return str(out / "list.txt"), r"shard-000002.tar and /.*/\.\./copy/shard-000002.tar are the"


def _key_twice_in_a_tar(out):
    tar_path = out / "shard-000004.tar"
    with tarfile.open(tar_path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(tar_path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members + members[:2]:  # the first utterance again at the end
            tar.addfile(m, io.BytesIO(data))
    return str(out / "shard-{000003..000004}.tar"), r"key train-00000041 is in .*shard-000004.tar 2"


@pytest.mark.parametrize("fault", [_key_twice_in_a_shard, _key_in_two_shards, _entry_twice,
                                   _two_entries_one_file, _pattern_twice, _list_file_twice,
                                   _key_twice_in_a_tar])
def test_a_key_or_a_shard_found_twice_is_one_line_before_training(shard_dir, tmp_path, fault):
    """A key twice made a worker's KeyError (and a hang); a shard twice was trained twice."""
    out = _copy_shards(shard_dir, tmp_path)
    spec, message = fault(out)
    before = _files(out)
    with pytest.raises(ShardError, match=message) as e:
        open_shards(spec)
    assert "\n" not in str(e.value)
    assert _files(out) == before


def test_a_duplicated_key_stops_konkanivani_train_in_one_line(tiny_corpus, shard_dir, tmp_path):
    out = _copy_shards(shard_dir, tmp_path)
    spec, _ = _key_twice_in_a_shard(out)
    before, corpus = _files(out), _files(tiny_corpus)
    result = _train(tiny_args(tiny_corpus, tmp_path / "run", "--train_shards", spec,
                              "--num_workers", "2"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"error: {spec}: key train-00000013 is in shard-000001.tar 2 times: keys " \
        "must be unique; write the shards again with konkanivani-prepare shards"
    assert "Traceback" not in result.stderr and sum("error" in line.lower() for line in lines) == 1
    assert not (tmp_path / "run").exists()
    assert _files(out) == before and _files(tiny_corpus) == corpus


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_duration_in_the_list_stops_konkanivani_train_in_one_line(
    tiny_corpus, shard_dir, tmp_path, bad
):
    """json reads NaN and Infinity; they reached frames_of as a traceback."""
    out = _copy_shards(shard_dir, tmp_path)
    _edit_list(out, lambda shards: shards[2]["durations"].__setitem__(4, bad))
    assert ("NaN" if bad != bad else "Infinity") in (out / LIST_NAME).read_text()
    before, corpus = _files(out), _files(tiny_corpus)
    result = _train(tiny_args(tiny_corpus, tmp_path / "run", "--train_shards", str(out)))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"error: {out / LIST_NAME}: shard entry 3 is malformed (key " \
        f"train-00000025 has the duration {bad!r}, not a finite number of seconds)"
    assert "Traceback" not in result.stderr and sum("error" in line.lower() for line in lines) == 1
    assert not (tmp_path / "run").exists()
    assert _files(out) == before and _files(tiny_corpus) == corpus


def test_a_nan_duration_in_a_members_json_is_read_from_its_audio(shard_dir, tmp_path):
    """A brace pattern lists a shard's utterances from their JSON members: a NaN or infinite
    duration there is no duration, and the audio's header gives it, as for a missing one."""
    out = _copy_shards(shard_dir, tmp_path)
    listed = open_shards(str(out / LIST_NAME))
    _with_json(out / "shard-000001.tar", "train-00000012", lambda m: {**m, "duration": math.nan})
    _with_json(out / "shard-000001.tar", "train-00000013", lambda m: {**m, "duration": math.inf})
    scanned = open_shards(str(out / "shard-{000000..000005}.tar"))
    assert [s.keys for s in scanned.shards] == [s.keys for s in listed.shards]
    assert scanned.durations() == pytest.approx(listed.durations(), abs=1e-5)


def test_shard_files_names_every_file_a_run_reads_without_opening_a_shard(shard_dir, tmp_path):
    """What konkanivani-train --overwrite must not move: the list, its shards, text.txt."""
    tars = sorted(shard_dir.glob("*.tar"))
    texts = shard_dir / "text.txt"
    assert shard_files(str(shard_dir)) == [shard_dir / LIST_NAME, *tars, texts]
    assert shard_files(str(shard_dir / LIST_NAME)) == [shard_dir / LIST_NAME, *tars, texts]
    assert shard_files(str(shard_dir / "shard-{000000..000005}.tar")) == [*tars, texts]
    (tmp_path / "list.txt").write_text("".join(f"{p}\n" for p in tars))
    assert shard_files(str(tmp_path / "list.txt")) == [tmp_path / "list.txt", *tars, texts]


def _with_json(path, key, change):
    """Shard ``path`` again with member ``KEY.json`` changed by ``change``; its new size."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members:
            if m.name == f"{key}.json":
                data = json.dumps(change(json.loads(data))).encode()
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    return path.stat().st_size


def test_durations_that_contradict_the_audio_are_skipped_counted_and_named(shard_dir, tokenizer,
                                                                           tmp_path, caplog):
    """As a manifest's row is: beyond the tolerance (0.5 s) the member is left out, whether the
    list or its JSON says it; within it, kept."""
    out = _copy_shards(shard_dir, tmp_path)
    sizes = {2: _with_json(out / "shard-000002.tar", "train-00000023",
                           lambda m: {**m, "duration": m["duration"] + 4}),
             3: _with_json(out / "shard-000003.tar", "train-00000032",
                           lambda m: {**m, "duration": "long"})}

    def edit(shards):
        shards[0]["durations"][1] += 5.0  # utterance 1
        shards[0]["durations"][4] += 0.3  # utterance 4: within the tolerance
        for s, size in sizes.items():
            shards[s]["bytes"] = size
    _edit_list(out, edit)
    before = _files(out)
    shards = open_shards(str(out))
    plan = _plans(shards, 1, 1, buffer=64, batch_size=4)[0]
    with caplog.at_level("WARNING", logger="konkanivani"):
        batches = list(_loader(plan, tokenizer, 0))
    # the list's, the JSON's, the JSON's not a number
    assert sorted(i for b in batches for i in b.missing) == [1, 22, 31]
    assert sum(len(b) for b in batches) == len(shards) - 3
    log = caplog.text
    assert "shard-000000.tar:train-00000002: duration mismatch (listed as" in log
    assert "shard-000002.tar:train-00000023: duration mismatch (its JSON says" in log
    assert "shard-000003.tar:train-00000032: duration not a number (its JSON says 'long')" in log
    assert "2 duration mismatch" in log and "1 duration not a number" in log
    assert "train-00000005" not in log
    stream = ShardStream(plan, tokenizer, ASRDataset([]), duration_tolerance=-1)  # not compared
    from torch.utils.data import DataLoader
    assert not any(b.missing for b in DataLoader(stream, batch_size=None))
    assert _files(out) == before


# A DataLoader worker that raises (here every member it decodes, a stand-in for any fault of ours):
# the script runs konkanivani-train, or train() keeping the error as an uncaught one is kept until
# the interpreter's exit (which used to wait for the workers for ever).
_RAISING = """
import sys, time
from pathlib import Path
from torch.utils.data import get_worker_info
import konkanivani.data.shards as shards
decode, first = shards.decode_member, Path(sys.argv[1])

def raises(files, where):
    if get_worker_info() is not None:  # in a worker only: CMVN reads in the main process
        first.exists() or first.write_text(str(time.time()))
        raise KeyError(where)
    return decode(files, where)

shards.decode_member = raises
if sys.argv[2] == "cli":
    from konkanivani.cli.train import main
    sys.exit(main(sys.argv[3:]))
import multiprocessing
from konkanivani.cli.train import parse_args
from konkanivani.config import TrainConfig, dataclass_from_args
from konkanivani.training.loop import train
try:
    train(dataclass_from_args(TrainConfig, parse_args(sys.argv[3:])))
except Exception as e:
    kept = e
print("workers alive:", len(multiprocessing.active_children()))
"""


@pytest.mark.parametrize("how", ["cli", "kept"])
def test_a_worker_that_raises_ends_training_in_one_line_at_once(tiny_corpus, shard_dir, tmp_path,
                                                                how):
    before = _files(shard_dir)
    first = tmp_path / "first_raise"
    args = tiny_args(tiny_corpus, tmp_path / "run", "--train_shards", str(shard_dir / LIST_NAME),
                     "--num_workers", "2")
    result = subprocess.run([sys.executable, "-c", _RAISING, str(first), how, *args],
                            capture_output=True, text=True, timeout=300)  # it used to hang here
    ended = time.time()
    assert ended - float(first.read_text()) < 60  # from the fault to the end: seconds, not for ever
    lines = result.stderr.strip().splitlines()
    if how == "cli":
        assert result.returncode == 2, result.stderr[-3000:]
        assert re.fullmatch(r"error: (shard-00000\d\.tar:train-\d{8}): reading failed \(KeyError: "
                            r"'\1', at <string>:\d+\); in DataLoader worker process [01]",
                            lines[-1]), lines
        assert "Traceback" not in result.stderr
        assert sum("error" in line.lower() for line in lines) == 1
    else:  # the workers ended with the error, not at the interpreter's exit
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip() == "workers alive: 0"
    assert _files(shard_dir) == before


def test_brace_patterns_and_list_files_find_what_the_list_holds(shard_dir, tmp_path):
    listed = open_shards(str(shard_dir / LIST_NAME))
    pattern = open_shards(str(shard_dir / "shard-{000000..000005}.tar"))
    (tmp_path / "list.txt").write_text(
        "".join(f"{shard_dir}/shard-{i:06d}.tar\n" for i in range(6))
    )
    from_file = open_shards(str(tmp_path / "list.txt"))
    for other in (pattern, from_file):
        assert [s.keys for s in other.shards] == [s.keys for s in listed.shards]
        assert other.durations() == pytest.approx(listed.durations(), abs=1e-5)


# ---- training ------------------------------------------------------------------------------------

def _train(args):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900
    )
    return result


def test_a_missing_shard_stops_training_before_it_starts(tiny_corpus, shard_dir, tmp_path):
    out = _copy_shards(shard_dir, tmp_path)
    (out / "shard-000004.tar").unlink()
    result = _train(
        tiny_args(tiny_corpus, tmp_path / "run", "--train_shards", str(out / LIST_NAME))
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        f"error: {out / 'shard-000004.tar'}: shard missing (listed in {out / LIST_NAME})"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_training_on_shards_learns_and_a_resume_mid_epoch_goes_on_with_the_same_batches(
        tiny_corpus, shard_dir, tmp_path):
    common = (
        "--train_shards",
        str(shard_dir / LIST_NAME),
        "--num_workers",
        "2",
        "--shuffle_buffer",
        "16",
        "--max_batch_frames",
        "3000",
        "--save_every_steps",
        "5",
        "--keep_checkpoints",
        "10",
    )
    whole = tmp_path / "whole"
    result = _train(tiny_args(tiny_corpus, whole, *common, "--max_steps", "40"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"train shards {shard_dir / LIST_NAME}: 6 shards, {len(open_shards(str(shard_dir)))}"
        " utterances"
        in result.stderr
    )
    rows = read_metrics(whole / "metrics.jsonl")
    train, valid = rows["train"], rows["valid"]
    # it learns
    assert sum(r["loss"] for r in train[-10:]) < 0.85 * sum(r["loss"] for r in train[:10])
    # an epoch is 4 steps: 10 epochs
    assert valid[-1]["loss"] < 0.9 * valid[0]["loss"] and len(valid) == 10

    split = tmp_path / "split"
    first = _train(tiny_args(tiny_corpus, split, *common, "--max_steps", "13"))
    assert first.returncode == 0, first.stderr[-3000:]
    state = torch.load(split / "latest.pt", weights_only=True)
    assert state["batches_done"] > 0  # stopped inside an epoch
    assert (
        state["data_position"][0]["kind"] == "shards" and state["data_position"][0]["streams"] == 2
    )
    second = _train(
        tiny_args(tiny_corpus, split, *common, "--max_steps", "40", "--resume", "latest")
    )
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = read_metrics(split / "metrics.jsonl")["train"], train
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5), (ra, rb)
    wa, wb = torch.load(split / "latest.pt", weights_only=True), torch.load(
        whole / "latest.pt", weights_only=True
    )
    for name, tensor in wb["model"].items():
        torch.testing.assert_close(wa["model"][name], tensor, rtol=0, atol=1e-6)


# ---- two processes under torchrun ----------------------------------------------------------------

TRACED = Path(__file__).resolve().parent / "traced_run.py"


def _torchrun_traced(trace, args):
    trace.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(TRACED),
            str(trace),
            "--",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _trace(trace, rank):
    return [json.loads(line) for line in (trace / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_torchrun_processes_see_every_utterance_once_an_epoch_and_resume_on_the_same_batches(
        tiny_corpus, tmp_path):
    shards = tmp_path / "shards"
    # 4 whole + 1 shared by both
    write_shards(tiny_corpus / "train.jsonl", shards, shard_size=12, progress=False)
    total = len(open_shards(str(shards)))
    common = (
        "--train_shards",
        str(shards / LIST_NAME),
        "--num_workers",
        "2",
        "--shuffle_buffer",
        "10",
        "--gradient_accumulation_steps",
        "1",
        "--no_preflight",
        "--save_every_steps",
        "4",
        "--epochs",
        "2",
    )
    whole = tmp_path / "whole"
    result = _torchrun_traced(whole / "trace", tiny_args(tiny_corpus, whole / "run", *common))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    traces = [_trace(whole / "trace", r) for r in (0, 1)]
    # the same steps: nobody waits
    assert [t["step"] for t in traces[0]] == [t["step"] for t in traces[1]]
    for epoch in (0, 1):
        seen = [
            i
            for t in traces
            for row in t
            if row["epoch"] == epoch
            for b in row["batches"]
            for i in b
        ]
        assert sorted(seen) == list(range(total)), epoch  # every utterance, once
    assert traces[0][0]["batches"] != traces[0][len(traces[0]) // 2]["batches"]

    split = tmp_path / "split"
    steps = len(traces[0])
    first = _torchrun_traced(
        split / "trace", tiny_args(tiny_corpus, split / "run", *common, "--max_steps", "5")
    )
    assert first.returncode == 0, first.stderr[-3000:]
    state = torch.load(split / "run" / "latest.pt", weights_only=True)
    assert state["step"] == 5 and state["batches_done"] > 0 and len(state["data_position"]) == 2
    second = _torchrun_traced(
        split / "trace", tiny_args(tiny_corpus, split / "run", *common, "--resume", "latest")
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from latest at step 5" in second.stderr
    for r in (0, 1):
        # the same batches, step by step, in both processes
        assert _trace(split / "trace", r) == traces[r]
    a, b = (torch.load(d / "run" / "latest.pt", weights_only=True) for d in (split, whole))
    assert a["step"] == b["step"] == steps
    for name, tensor in b["model"].items():
        torch.testing.assert_close(a["model"][name], tensor, rtol=0, atol=1e-6)
