import os
import subprocess
import sys
from pathlib import Path

import pytest

from konkanivani.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training_scripts"))
import train_konkanivani_asr as cli  # noqa: E402

GUIDE_FLAGS = ["--batch_size", "2", "--gradient_accumulation_steps", "4", "--mixed_precision", "--device", "cpu",
               "--d_model", "192", "--encoder_layers", "8", "--decoder_layers", "4", "--resume", "latest",
               "--num_workers", "2", "--preset", "medium", "--epochs", "3", "--max_steps", "10", "--lr", "5e-4",
               "--output_dir", "x", "--empty_cache_every", "50", "--save_every_steps", "100",
               "--keep_checkpoints", "2", "--seed", "7"]


def test_flags_people_already_type_are_accepted():
    args = cli.parse_args(["--train_manifest", "t.jsonl", "--valid_manifest", "v.jsonl", *GUIDE_FLAGS])
    assert args.batch_size == 2 and args.gradient_accumulation_steps == 4 and args.mixed_precision is True
    assert (args.d_model, args.encoder_layers, args.decoder_layers) == (192, 8, 4)
    assert args.resume == "latest" and args.lr == 5e-4 and args.seed == 7
    assert args.n_heads is None  # not given: the preset decides


def test_unknown_flag_wrong_type_and_missing_manifest_are_refused(capsys):
    for argv in (["--train_manifest", "t", "--valid_manifest", "v", "--batch-sise", "2"],
                 ["--train_manifest", "t", "--valid_manifest", "v", "--batch_size", "two"],
                 ["--valid_manifest", "v"]):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
    assert "--train_manifest is required" in capsys.readouterr().err


def test_t4_recipe_script_runs_on_cpu(tiny_corpus, tmp_path):
    """The recipe script itself, made tiny by extra flags that pass through and override it."""
    env = dict(os.environ, PYTHON=sys.executable, TRAIN_MANIFEST=str(tiny_corpus / "train.jsonl"),
               VALID_MANIFEST=str(tiny_corpus / "valid.jsonl"), OUTPUT_DIR=str(tmp_path / "t4"))
    result = subprocess.run(
        [str(ROOT / "run_training_memory_optimized.sh"), "--preset", "tiny", "--d_model", "48", "--encoder_layers", "2",
         "--decoder_layers", "1", "--vocab_size", "48", "--max_steps", "3", "--num_workers", "0", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 utterances per update (batch 2 x 4 accumulation steps)" in result.stderr
    assert load_checkpoint(tmp_path / "t4" / "latest.pt")["step"] == 3
