import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from konkanivani.checkpoint import load_checkpoint
from konkanivani.config_file import load_config_file

ROOT = Path(__file__).resolve().parents[1]
from konkanivani.cli import train as cli  # noqa: E402

GUIDE_FLAGS = [
    "--batch_size",
    "2",
    "--gradient_accumulation_steps",
    "4",
    "--mixed_precision",
    "--device",
    "cpu",
    "--d_model",
    "192",
    "--encoder_layers",
    "8",
    "--decoder_layers",
    "4",
    "--resume",
    "latest",
    "--num_workers",
    "2",
    "--preset",
    "medium",
    "--epochs",
    "3",
    "--max_steps",
    "10",
    "--lr",
    "5e-4",
    "--output_dir",
    "x",
    "--empty_cache_every",
    "50",
    "--save_every_steps",
    "100",
    "--keep_checkpoints",
    "2",
    "--seed",
    "7",
]


def test_flags_people_already_type_are_accepted():
    args = cli.parse_args(
        ["--train_manifest", "t.jsonl", "--valid_manifest", "v.jsonl", *GUIDE_FLAGS]
    )
    assert (
        args.batch_size == 2
        and args.gradient_accumulation_steps == 4
        and args.mixed_precision is True
    )
    assert (args.d_model, args.encoder_layers, args.decoder_layers) == (192, 8, 4)
    assert args.resume == "latest" and args.lr == 5e-4 and args.seed == 7
    assert args.n_heads is None  # not given: the preset decides


def test_unknown_flag_wrong_type_and_missing_manifest_are_refused(capsys):
    for argv in (["--train_manifest", "t", "--valid_manifest", "v", "--batch-sise", "2"],
                 ["--train_manifest", "t", "--valid_manifest", "v", "--batch_size", "two"],
                 ["--valid_manifest", "v"]):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
    err = capsys.readouterr().err
    assert (
        "the following arguments are required: --train_manifest (or --train_shards, or "
        "--train_mix) (see --help)" in err
    )
    assert "usage:" not in err  # one line, not the whole usage first


BAD_VALUES = [
    (["--preset", "huge"], "--preset must be one of large, medium, small, tiny, got 'huge'"),
    (["--batch_size", "0"], "--batch_size must be a positive integer, got 0"),
    (["--ctc_weight", "1.5"], "--ctc_weight must be in [0, 1], got 1.5"),
    (["--dropout", "1.2"], "--dropout must be in [0, 1), got 1.2"),
    (
        ["--precision", "fp8"],
        "--precision must be one of fp32, fp16, bf16 (or left out), got 'fp8'",
    ),
    (
        ["--max_batch_frames", "1000", "--max_batch_seconds", "10"],
        "give --max_batch_frames or --max_batch_seconds",
    ),
    (
        ["--max_batch_frames", "1000", "--max_batch_seconds", "10", "--auto_batch"],
        "give --max_batch_frames or --max_batch_seconds",
    ),
    (["--resume", "latest", "--overwrite"], "give --resume or --overwrite, not both"),
    (["--tokenizer", "missing.model"], "--tokenizer missing.model: file not found"),
    (["--resume", "nowhere.pt"], "--resume nowhere.pt: file not found"),
    (
        ["--d_model", "50", "--n_heads", "4"],
        "--d_model 50 must split into --n_heads 4 heads of even width",
    ),
    (["--dynamic_chunk", "--max_chunk", "0"], "--max_chunk must be a positive integer, got 0"),
    (
        ["--strategy", "fsdp", "--optimizer", "adamw_8bit"],
        "--strategy fsdp shards AdamW's states itself",
    ),
    (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["--offload_activations", "--device", "cpu"], "--offload_activations needs a CUDA device"),
    (["--ema_decay", "1"], "--ema_decay must be in [0, 1) (0: off), got 1.0"),
    (
        ["--strategy", "fsdp", "--ema_decay", "0.999"],
        "--ema_decay keeps a whole copy of the weights in every process",
    ),
    (["--init_from", "nowhere.pt"], "--init_from nowhere.pt: file not found"),
    (
        ["--init_modules", "encoder,joiner"],
        "--init_modules 'encoder,joiner': give a comma list of encoder, decoder, ctc_head",
    ),
    (["--freeze_encoder_steps", "-1"], "--freeze_encoder_steps must be 0 or more, got -1"),
    (["--lr_schedule", "cosine"], "--lr_schedule must be noam or eden, got 'cosine'"),
    (["--eden_steps", "0"], "--eden_steps must be a positive integer, got 0"),
    (["--eden_epochs", "0"], "--eden_epochs must be a positive number, got 0.0"),
    (["--length_curriculum_epochs", "-1"], "--length_curriculum_epochs must be 0 or more, got -1"),
    (["--ctc_weight_from", "1.5"], "--ctc_weight_from must be in [0, 1] (or -1: off), got 1.5"),
    (["--label_smoothing_from", "1"],
     "--label_smoothing_from must be in [0, 1) (or -1: off), got 1.0"),
    (["--loss_ramp_steps", "-3"], "--loss_ramp_steps must be 0 or more, got -3"),
    (["--ctc_weight_from", "0.9"], "--ctc_weight_from needs --loss_ramp_steps, the steps its ramp "
                                   "takes"),
    (["--spec_time_ratio", "0"], "--spec_time_ratio must be in (0, 1], got 0.0"),
    (["--spec_freq_masks", "-1"], "--spec_freq_masks must be 0 or more, got -1"),
    (["--spec_freq_width", "81"], "--spec_freq_width 81: a mask wider than the model's 80 mel "
     "bins would blank whole utterances"),
    (["--self_condition_layer", "2", "--preset", "tiny"], "--self_condition_layer 2: want a "
     "block from 1 to 1 (the last one is the CTC head's own)"),
    (["--optimizer", "sgd"], "--optimizer must be adamw, adamw_8bit or scaled_adam, got 'sgd'"),
    (["--strategy", "fsdp", "--optimizer", "scaled_adam"],
     "--strategy fsdp shards AdamW's states itself; use --optimizer adamw with it"),
    (
        ["--time_reduce_layer", "3", "--preset", "tiny"],
        "want 1 <= reduce < recover <= --encoder_layers 2",
    ),
    (
        ["--keep_init_cmvn"],
        "--keep_init_cmvn keeps the CMVN statistics of --init_from: give --init_from too",
    ),
    (["--noise_prob", "1.5"], "--noise_prob must be in [0, 1], got 1.5"),
    (["--reverb_prob", "-0.1"], "--reverb_prob must be in [0, 1], got -0.1"),
    (["--vtlp_prob", "2"], "--vtlp_prob must be in [0, 1], got 2.0"),
    (
        ["--noise_snr_low_db", "20", "--noise_snr_high_db", "5"],
        "--noise_snr_low_db 20 is above --noise_snr_high_db 5",
    ),
    (["--noise_snr_high_db", "nan"], "--noise_snr_high_db must be a number of dB, got nan"),
    (["--noise_dir", "no/such/folder"], "--noise_dir no/such/folder: folder not found"),
    (["--rir_dir", "no/rirs"], "--rir_dir no/rirs: folder not found"),
]


@pytest.mark.parametrize("flags,message", BAD_VALUES, ids=[" ".join(f) for f, _ in BAD_VALUES])
def test_bad_values_are_one_line_and_exit_2_before_any_work(flags, message, tmp_path, caplog):
    """Checked before the tokenizer, the features or the output directory are touched."""
    train_manifest, valid_manifest = tmp_path / "t.jsonl", tmp_path / "v.jsonl"
    train_manifest.write_text("")
    valid_manifest.write_text("")
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "--train_manifest",
                str(train_manifest),
                "--valid_manifest",
                str(valid_manifest),
                "--output_dir",
                str(out),
                *flags,
            ]
        )
        == 2
    )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and len(errors[0].splitlines()) == 1 and message in errors[0], errors
    assert not out.exists()


def test_a_missing_manifest_is_named_before_any_work(tmp_path, caplog):
    valid = tmp_path / "v.jsonl"
    valid.write_text("")
    assert (
        cli.main(
            [
                "--train_manifest",
                str(tmp_path / "nope.jsonl"),
                "--valid_manifest",
                str(valid),
                "--output_dir",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert f"--train_manifest {tmp_path / 'nope.jsonl'}: file not found" in caplog.text
    assert not (tmp_path / "out").exists()


MISSING_DEVICES = [
    ("cuda", 0, "--device cuda: CUDA is not available on this machine (use --device cpu)"),
    ("cuda:0", 0, "--device cuda:0: CUDA is not available on this machine (use --device cpu)"),
    ("cuda:2", 1, "--device cuda:2: this machine has 1 CUDA device (cuda:0)"),
    ("cuda:4", 2, "--device cuda:4: this machine has 2 CUDA devices (cuda:0 to cuda:1)"),
    (
        "mps",
        0,
        "--device mps: MPS (Apple silicon) is not available on this machine (use --device cpu)",
    ),
]


@pytest.mark.parametrize(
    "device,gpus,message", MISSING_DEVICES, ids=[d for d, _, _ in MISSING_DEVICES]
)
def test_a_device_this_machine_lacks_is_one_line_and_exit_2(
    device, gpus, message, tmp_path, caplog, monkeypatch
):
    """The same on a machine with GPUs as without: the GPUs are counted by a stand-in."""
    import torch

    from konkanivani.training.precision import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "--train_manifest",
                str(manifest),
                "--valid_manifest",
                str(manifest),
                "--output_dir",
                str(out),
                "--device",
                device,
            ]
        )
        == 2
    )
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [message]
    assert not out.exists()
    # what transcribe, evaluate and train-lm catch
    with pytest.raises(RuntimeError, match="--device"):
        resolve_device(device)


def test_an_output_under_a_file_is_one_line_for_average_and_export(tmp_path, capsys):
    """A folder that cannot be made (a file is in the way, which stops root too): exit 2, no
    traceback."""
    import dataclasses

    from konkanivani.checkpoint import save_checkpoint
    from konkanivani.cli import average, export
    from konkanivani.config import model_config_from_preset
    from konkanivani.data.tokenizer import train_tokenizer
    from konkanivani.model.asr import ASRModel

    tokenizer = train_tokenizer(["हांव घरा वता", "तूं कितें करता"] * 20, 30, "char")
    cfg = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size)
    checkpoint = save_checkpoint(
        {
            "model_config": dataclasses.asdict(cfg),
            "model": ASRModel(cfg).state_dict(),
            "tokenizer": tokenizer.model_proto,
        },
        tmp_path / "model.pt",
    )
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert (
        average.main(
            ["--inputs", str(checkpoint), str(checkpoint), "--output", str(blocker / "avg.pt")]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    # refused before any checkpoint is read (datatools.outputs.check_outputs)
    assert err == [f"error: --output {blocker / 'avg.pt'} cannot be written: {blocker} is not a "
                   "folder"], err
    status = 0
    try:
        export.main([str(checkpoint), "--format", "torchscript", "--output_dir",
                     str(blocker / "out")])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    written = blocker / "out" / "model.torchscript.pt"
    assert f"--output_dir {written} cannot be written: {blocker} is not a folder" in err[0]


RECIPE_SCRIPT = "run_training_memory_optimized.sh"
# the recipe script made tiny by extra flags that pass through and override its recipe
TINY_RECIPE = ["--preset", "tiny", "--d_model", "48", "--encoder_layers", "2", "--decoder_layers",
               "1", "--vocab_size", "48", "--max_steps", "3", "--num_workers", "0", "--no_progress"]
CPU_RECIPE_LINE = (
    "no CUDA GPU: training the CPU recipe (configs/cpu_small.yaml; what it reaches in 30 minutes:"
    " docs/results.md) for 30 minutes unless --max_time is given, into {}, not the T4 recipe, which"
    " is for a GPU: KONKANIVANI_RECIPE=t4 trains that one here"
)
T4_BATCHES = "8 utterances per update (batch 2 x 4 accumulation steps)"
CPU_BATCHES = "16 utterances per update (batch 16 x 1 accumulation steps)"
NO_CUDA = not torch.cuda.is_available()


def _recipe_script(script: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(script), *TINY_RECIPE, *flags], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _said(result: subprocess.CompletedProcess, start: str) -> list[str]:
    """The lines of the script's own (not the trainer's, which begin with the time) that begin with
    ``start``."""
    return [line for line in result.stderr.splitlines() if line.startswith(start)]


@pytest.mark.parametrize("data", ["manifest", "shards"])
def test_the_recipe_script_trains_the_recipe_of_the_machine(tiny_corpus, tmp_path, data):
    """The recipe script itself, on a manifest (TRAIN_MANIFEST) or on shards (TRAIN_SHARDS, as for
    data on a Drive mount): without a CUDA GPU the CPU recipe (configs/cpu_small.yaml, its batches
    of 16, its 30 minutes, which --max_steps comes before; on shards without its length
    curriculum), said in one line; with one the T4 recipe. The run resumes as it was started."""
    if data == "shards":
        from konkanivani.datatools.shard_writer import write_shards
        write_shards(
            tiny_corpus / "train.jsonl", tmp_path / "shards", shard_size=20, progress=False
        )
        train = {"TRAIN_SHARDS": str(tmp_path / "shards" / "shards.json")}
    else:
        train = {"TRAIN_MANIFEST": str(tiny_corpus / "train.jsonl")}
    out = tmp_path / "run"
    env = dict(os.environ, PYTHON=sys.executable, **train,
               VALID_MANIFEST=str(tiny_corpus / "valid.jsonl"), OUTPUT_DIR=str(out))
    env.pop("KONKANIVANI_RECIPE", None)
    result = _recipe_script(ROOT / RECIPE_SCRIPT, env)
    assert ("train shards" in result.stderr) == (data == "shards")
    assert load_checkpoint(out / "latest.pt")["step"] == 3
    if not NO_CUDA:
        assert not _said(result, "no CUDA GPU")
        return
    assert _said(result, "no CUDA GPU") == [CPU_RECIPE_LINE.format(out)]
    assert CPU_BATCHES in result.stderr and T4_BATCHES not in result.stderr
    config = load_config_file(out / "config.yaml")
    assert (config["max_time"], config["noise_prob"], config["batch_size"]) == (1800, 0.3, 16)
    # shards are read as they were written: the first epoch is not ordered shortest first
    assert config["length_curriculum_epochs"] == (0 if data == "shards" else 1)
    if data == "manifest":
        resumed = _recipe_script(ROOT / RECIPE_SCRIPT, env, "--resume", "latest", "--max_steps",
                                 "4")
        assert _said(resumed, "no CUDA GPU") == [CPU_RECIPE_LINE.format(out)]
        assert load_checkpoint(out / "latest.pt")["step"] == 4


@pytest.mark.skipif(not NO_CUDA, reason="what the recipe script does without a CUDA GPU")
def test_the_recipe_script_forced_to_t4_and_its_run_resumed_on_a_cpu(tiny_corpus, tmp_path):
    """KONKANIVANI_RECIPE=t4 trains the T4 recipe on a CPU (the script as it was) into its folder;
    --resume without it goes on with that run, saying so in one line, where the CPU recipe's folder
    holds none; a fresh run trains the CPU recipe into its own folder; another recipe's name is one
    line, exit 2, before any work. The script in a copy of the checkout, whose checkpoints/ these
    folders are."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy2(ROOT / RECIPE_SCRIPT, repo)
    for name in ("configs", "training_scripts", "konkanivani"):
        (repo / name).symlink_to(ROOT / name)
    script = repo / RECIPE_SCRIPT
    t4, cpu = repo / "checkpoints" / "konkanivani_t4", repo / "checkpoints" / "cpu_small"
    env = dict(os.environ, PYTHON=sys.executable, TRAIN_MANIFEST=str(tiny_corpus / "train.jsonl"),
               VALID_MANIFEST=str(tiny_corpus / "valid.jsonl"))
    env.pop("OUTPUT_DIR", None)
    forced = _recipe_script(script, dict(env, KONKANIVANI_RECIPE="t4"))
    assert T4_BATCHES in forced.stderr and not _said(forced, "no CUDA GPU")
    assert load_checkpoint(t4 / "latest.pt")["step"] == 3 and not cpu.exists()

    env.pop("KONKANIVANI_RECIPE", None)
    resumed = _recipe_script(script, env, "--resume", "latest", "--max_steps", "4")
    assert _said(resumed, "no CUDA GPU") == [
        "no CUDA GPU: --resume goes on with the T4 recipe's run in checkpoints/konkanivani_t4"
        " (KONKANIVANI_RECIPE=cpu_small for the CPU recipe, configs/cpu_small.yaml)"]
    assert T4_BATCHES in resumed.stderr
    assert load_checkpoint(t4 / "latest.pt")["step"] == 4 and not cpu.exists()

    fresh = _recipe_script(script, env)
    assert _said(fresh, "no CUDA GPU") == [CPU_RECIPE_LINE.format("checkpoints/cpu_small")]
    assert CPU_BATCHES in fresh.stderr and load_checkpoint(cpu / "latest.pt")["step"] == 3
    assert load_checkpoint(t4 / "latest.pt")["step"] == 4

    def files():  # the copy's files, not those its links point at
        return sorted(os.path.join(top, name) for top, folders, names in os.walk(repo)
                      for name in folders + names)

    before = files()
    wrong = subprocess.run([str(script)], env=dict(env, KONKANIVANI_RECIPE="gpu"),
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and not wrong.stdout
    assert wrong.stderr == (
        "error: KONKANIVANI_RECIPE=gpu: give t4 (configs/t4.yaml) or cpu_small"
        " (configs/cpu_small.yaml), or leave it unset for the one that fits this machine\n")
    assert files() == before


def _other_tools():
    from konkanivani.cli import average, demo_corpus, evaluate, plan_memory, transcribe, validate
    return {
        "transcribe": transcribe,
        "evaluate": evaluate,
        "average": average,
        "validate": validate,
        "plan_memory": plan_memory,
        "demo_corpus": demo_corpus,
    }


OTHER_BAD_VALUES = [
    ("transcribe", ["missing.pt", "a.wav"], "checkpoint missing.pt: file not found"),
    (
        "transcribe",
        ["{ckpt}", "a.wav", "--beam_size", "0"],
        "--beam_size must be a positive integer",
    ),
    (
        "transcribe",
        ["{ckpt}", "a.wav", "--decode_ctc_weight", "2"],
        "--decode_ctc_weight must be in [0, 1], got 2.0",
    ),
    (
        "transcribe",
        ["{ckpt}", "a.wav", "--method", "viterbi"],
        "argument --method: invalid choice: 'viterbi'",
    ),
    ("evaluate", ["{ckpt}", "missing.jsonl"], "manifest missing.jsonl: file not found"),
    ("average", ["--last", "0", "{dir}"], "--last must be at least 1, got 0"),
    ("average", ["--inputs", "a.pt", "b.pt"], "--inputs a.pt: file not found"),
    ("validate", ["missing.jsonl"], "manifest missing.jsonl: file not found"),
    ("validate", ["{manifest}", "--vocab_size", "0"], "--vocab_size must be a positive integer"),
    (
        "plan_memory",
        ["--preset", "huge", "--gpu_gb", "8"],
        "argument --preset: invalid choice: 'huge'",
    ),
    ("plan_memory", ["--gpu_gb", "0"], "--gpu_gb must be a positive number, got 0.0"),
    ("plan_memory", ["--gpu_gb", "8", "--margin", "1.5"], "--margin must be in [0, 1), got 1.5"),
    (
        "demo_corpus",
        ["--output_dir", "{dir}", "--num_utterances", "0"],
        "--num_utterances must be a positive integer, got 0",
    ),
    (
        "demo_corpus",
        ["--output_dir", "{dir}", "--festival_share", "1.5"],
        "--festival_share must be between 0 and 1, got 1.5",
    ),
]


@pytest.mark.parametrize(
    "tool,argv,message",
    OTHER_BAD_VALUES,
    ids=[f"{t} {' '.join(a)}" for t, a, _ in OTHER_BAD_VALUES],
)
def test_every_tool_says_a_bad_value_in_one_line_with_exit_2(tool, argv, message, tmp_path, capsys):
    ckpt, manifest = tmp_path / "c.pt", tmp_path / "m.jsonl"
    ckpt.write_bytes(b"not read: the flags are checked first")
    manifest.write_text("")
    argv = [a.format(ckpt=ckpt, dir=tmp_path, manifest=manifest) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        _other_tools()[tool].main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].endswith("(see --help)"), err


MODEL_FOLDER_TOOLS = [
    ("transcribe", ["{run}", "a.wav"], "checkpoint {run}"),
    ("evaluate", ["{run}", "{manifest}"], "checkpoint {run}"),
    ("average", ["--inputs", "{run}", "{run}/best.pt"], "--inputs {run}"),
    ("export", ["{run}"], "checkpoint {run}"),
    ("train", ["--init_from", "{run}"], "--init_from {run}"),
    ("train", ["--resume", "{run}"], "--resume {run}"),
]


@pytest.mark.parametrize("tool,argv,named", MODEL_FOLDER_TOOLS,
                         ids=[f"{t} {a[0]}" for t, a, _ in MODEL_FOLDER_TOOLS])
def test_a_model_folder_given_for_a_checkpoint_is_named_as_a_folder(tool, argv, named, tmp_path,
                                                                    capsys, caplog):
    """It said "file not found" of a folder that exists: now one line saying it is a folder and
    which checkpoint in it to give, exit 2, and nothing in it changed."""
    import hashlib

    from konkanivani.checkpoint import CheckpointError, save_checkpoint
    from konkanivani.cli import export

    run = tmp_path / "run"
    for name in ("latest.pt", "best.pt", "step_0000002.pt"):
        save_checkpoint({"step": 2}, run / name)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir()}
    argv = [a.format(run=run, manifest=manifest) for a in argv]
    tools = {**_other_tools(), "export": export}
    if tool == "train":
        argv = ["--train_manifest", str(manifest), "--valid_manifest", str(manifest),
                "--output_dir", str(tmp_path / "out"), *argv]
        with caplog.at_level(logging.ERROR, logger="konkanivani"):
            assert cli.main(argv) == 2
        err = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    else:
        with pytest.raises(SystemExit) as exit_:
            tools[tool].main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (f"{named.format(run=run)} is a folder, not a checkpoint file: give a checkpoint file "
            f"in it, such as {run / 'best.pt'}") in err[0]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.iterdir()} == before
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=f"checkpoint {run} is a folder, not a checkpoint"):
        load_checkpoint(run)


def test_validate_on_a_csv_says_what_a_manifest_is_once(tmp_path, capsys):
    from konkanivani.cli import validate
    from konkanivani.data.tokenizer import train_tokenizer

    csv = tmp_path / "data.csv"
    csv.write_text(
        "audio_filepath,text\n" + "".join(f"wavs/{i}.wav,हांव घरा वता {i}\n" for i in range(120))
    )
    tokenizer = tmp_path / "t.model"
    train_tokenizer(["हांव घरा वता", "तूं कितें करता"] * 20, 30, "char").save(tokenizer)
    for extra in ([], ["--tokenizer", str(tokenizer)]):
        assert validate.main([str(csv), *extra]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and captured.out == "", err
        assert f"{csv}: none of its 121 lines is a JSON object (line 1:" in err[0]
        assert '{"audio_filepath": ..., "duration": ..., "text": ...}' in err[0]
        assert "transcript" not in err[0]


def test_validate_counts_lines_that_are_not_json_once(tmp_path, capsys):
    from konkanivani.cli import validate
    from konkanivani.data.tokenizer import train_tokenizer

    manifest = tmp_path / "m.jsonl"
    manifest.write_text('a,b\n{"audio_filepath": "x.wav", "text": "हांव"}\nc,d\n')
    tokenizer = tmp_path / "t.model"
    train_tokenizer(["हांव घरा वता", "तूं कितें करता"] * 20, 30, "char").save(tokenizer)
    assert validate.main([str(manifest), "--tokenizer", str(tokenizer)]) == 1
    out = capsys.readouterr().out
    assert out.count("not JSON objects") == 1
    assert f"ERROR {manifest}: 2 of 3 lines not JSON objects (lines 1, 3)" in out
    assert "       2 error: not a JSON object line" in out


def test_a_vocabulary_too_small_for_the_text_is_one_line(tiny_corpus, tmp_path, caplog):
    from tiny_args import tiny_args

    args = tiny_args(tiny_corpus, tmp_path / "run")
    args[args.index("--vocab_size") + 1] = "10"
    assert cli.main(args) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot train a unigram tokenizer of 10 pieces" in errors[0]
    assert "--tokenizer_type char" in errors[0] and len(errors[0].splitlines()) == 1


def test_the_flags_page_lists_every_flag_and_which_are_required():
    import dataclasses
    import re

    from konkanivani.config import ModelConfig, TrainConfig

    flags = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    table = flags.split("## konkanivani-train\n")[1].split("\n## ")[0]
    rows = {
        m.group(1): m.group(2) for m in re.finditer(r"^\| `--(\w+)`[^|]*\| ([^|]+) \|", table, re.M)
    }
    fields = [f for f in dataclasses.fields(TrainConfig)] + [
        f for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"
    ]
    assert set(rows) == {f.name for f in fields} | {"config"}
    assert {name for name, default in rows.items() if default == "required"} == {"valid_manifest"}
    assert "(required, or --train_shards)" in table.split("`--train_manifest`")[1].split("\n")[0]


def _refused(main, argv, capsys) -> str:
    """The one line ``main(argv)`` is refused with, exit 2."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("tool, argv, line", [
    ("transcribe", ["{m}", "a.wav", "--ctc_weight", "0.5"],
     "error: --ctc_weight is now spelled --decode_ctc_weight"),
    ("prepare", ["folder", "{clips}", "{out}"], "error: the output folder is now given as "
     "--output_dir {out}"),
    ("prepare", ["folder", "{clips}", "--output_dir", "{out}", "--no-progress"],
     "error: --no-progress is now spelled --no_progress"),
    ("export", ["{m}", "-o", "{out}"], "error: -o is now spelled --output_dir"),
    ("export", ["{m}", "--output", "{out}"], "error: --output is now spelled --output_dir"),
    ("train", ["--train_manifest", "t", "--valid_manifest", "v", "--no-spec_augment"],
     "error: --no-spec_augment is now spelled --no_spec_augment"),
])
def test_a_removed_spelling_is_refused_in_one_line_naming_the_flag(tool, argv, line, tmp_path,
                                                                   capsys):
    """The spellings CHANGELOG.md lists as removed: exit 2, one line, the flag to use."""
    import importlib

    (tmp_path / "m.pt").write_bytes(b"")
    (tmp_path / "clips").mkdir()
    names = {"m": tmp_path / "m.pt", "clips": tmp_path / "clips", "out": tmp_path / "out"}
    main = importlib.import_module(f"konkanivani.cli.{tool}")
    main = main.parse_args if tool == "train" else main.main
    err = _refused(main, [a.format(**names) for a in argv], capsys)
    assert line.format(**names) in err and not (tmp_path / "out").exists()


def test_switches_are_spelled_with_an_underscore(capsys):
    from konkanivani.cli import train

    args = train.parse_args(["--train_manifest", "t", "--valid_manifest", "v", "--no_spec_augment",
                             "--no_progress"])
    assert args.spec_augment is False and args.progress is False
    assert capsys.readouterr().err == ""
    assert train.parse_args(
        ["--train_manifest", "t", "--valid_manifest", "v", "--spec_augment"]
    ).spec_augment
