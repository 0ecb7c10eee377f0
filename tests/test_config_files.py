"""YAML recipes: the shipped configs, --config with flags over it, the errors of a bad file, and
the resolved config.yaml a run writes (loaded again, it runs the same run)."""
import dataclasses
import json
import logging
from pathlib import Path

import pytest
import yaml

from konkanivani.cli import train as cli
from konkanivani.config import (
    ModelConfig,
    TrainConfig,
    check_config,
    dataclass_from_args,
    model_config_from_preset,
    parse_mix,
    resolve_model_config,
)
from konkanivani.config_file import (
    SECTION_OF,
    SECTIONS,
    load_config_file,
    resolved_config,
    write_config_file,
)
from konkanivani.data.frames import frames_of
from konkanivani.training.memory import GIB, MemoryEstimator

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _resolve(argv):
    """The TrainConfig and ModelConfig the trainer's flags give (the vocabulary 0 until the
    tokenizer decides it)."""
    args = cli.parse_args(argv)
    cfg = dataclass_from_args(TrainConfig, args)
    return cfg, resolve_model_config(cfg, cli.model_flags(args))


def _manifests(tmp_path):
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("")
    valid.write_text("")
    return ["--train_manifest", str(train), "--valid_manifest", str(valid)]


def test_every_flag_has_one_section_and_every_section_its_fields():
    flags = {f.name for f in dataclasses.fields(TrainConfig)} | {
        f.name for f in dataclasses.fields(ModelConfig)
    }
    # ModelConfig.vocab_size shares its name with the data section's
    assert set(SECTION_OF) == flags
    assert set(SECTION_OF.values()) == set(SECTIONS)
    assert {SECTION_OF[k] for k in ("preset", "d_model", "subsampling")} == {"model"}
    assert {
        SECTION_OF[k]
        for k in (
            "train_manifest",
            "tokenizer",
            "vocab_size",
            "num_workers",
            "max_duration",
            "batch_size",
            "max_batch_frames",
        )
    } == {"data"}
    assert {
        SECTION_OF[k] for k in ("lr", "epochs", "gradient_accumulation_steps", "output_dir")
    } == {"training"}
    assert {SECTION_OF[k] for k in ("init_from", "init_modules", "keep_init_cmvn")} == {"init"}


def test_the_four_recipes_are_shipped():
    assert [p.name for p in CONFIGS] == ["cpu_small.yaml", "large_16gb.yaml",
                                         "multilingual_base.yaml", "t4.yaml"]


def test_the_multilingual_base_mixes_every_training_language_and_the_demo_corpus():
    values = load_config_file(ROOT / "configs" / "multilingual_base.yaml")
    entries = parse_mix(values["train_mix"])
    names = [e.name for e in entries]
    assert names == ["be", "bg", "ca", "da", "el", "en", "fr", "ro", "ru", "demo"]
    assert "es" not in names  # Spanish is the yardstick's evaluation language alone
    assert all(Path(e.path).name == "train.jsonl" for e in entries)
    assert {e.weight for e in entries[:-1]} == {1.0} and entries[-1].weight == 4.0
    # the same model and levers as the CPU recipe its fine-tunes run
    small = load_config_file(ROOT / "configs" / "cpu_small.yaml")
    for key in ("preset", "frontend", "cmvn", "tokenizer_type", "lr", "ctc_weight", "ema_decay"):
        assert values[key] == small[key], key


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_resolves_to_valid_configs(path, tmp_path):
    values = load_config_file(path)
    assert values and set(values) <= set(SECTION_OF)
    # a whole recipe alone
    assert {"preset", "valid_manifest", "output_dir"} <= set(values)
    assert "train_manifest" in values or "train_mix" in values
    # (the mix's manifests are the yardstick's, built by a benchmark: a manifest here instead)
    no_mix = ["--train_mix", ""] if "train_mix" in values else []
    args = cli.parse_args(["--config", str(path), *_manifests(tmp_path), *no_mix])
    cfg = dataclass_from_args(TrainConfig, args)
    check_config(cfg)
    resolve_model_config(cfg, cli.model_flags(args))
    for key, value in values.items():
        if key not in ("train_manifest", "valid_manifest", "train_mix"):
            assert getattr(cfg, key, None) == value or getattr(args, key) == value, key


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_trains_a_step_of_the_tiny_model(path, tiny_corpus, tmp_path):
    out = tmp_path / "run"
    train = tiny_corpus / "train.jsonl"
    # a recipe of several sets mixes the tiny corpus with itself in its place
    mix = (["--train_mix", f"{train}:1:one,{train}:4:two"]
           if "train_mix" in load_config_file(path) else [])
    assert (
        cli.main(
            [
                "--config",
                str(path),
                "--train_manifest",
                str(tiny_corpus / "train.jsonl"),
                "--valid_manifest",
                str(tiny_corpus / "valid.jsonl"),
                "--output_dir",
                str(out),
                "--preset",
                "tiny",
                "--max_steps",
                "1",
                "--num_workers",
                "0",
                "--device",
                "cpu",
                "--no_progress",
                *mix,
            ]
        )
        == 0
    )
    assert load_config_file(out / "config.yaml")["max_steps"] == 1


def test_t4_config_is_the_recipe_the_script_passed_as_flags():
    """The flags run_training_memory_optimized.sh gave before it used configs/t4.yaml, and
    --gpu_memory_gb 15, which changes nothing on a CPU."""
    script_flags = [
        "--preset",
        "medium",
        "--d_model",
        "192",
        "--encoder_layers",
        "8",
        "--decoder_layers",
        "4",
        "--tokenizer_type",
        "char",
        "--batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--mixed_precision",
        "--empty_cache_every",
        "50",
        "--num_workers",
        "2",
        "--validate_every_steps",
        "200",
        "--seed",
        "1234",  # the default seed then
        # since: batches that fill a GPU's 15 GB (no effect on a CPU)
        "--gpu_memory_gb",
        "15",
        # since: intermediate CTC (benchmarks/results/recipe_levers)
        "--inter_ctc_weight",
        "0.3",
    ]
    given = ["--train_manifest", "t.jsonl", "--valid_manifest", "v.jsonl", "--output_dir", "out"]
    assert _resolve([*given, *script_flags]) == _resolve(
        ["--config", str(ROOT / "configs" / "t4.yaml"), *given]
    )
    assert "--config configs/t4.yaml" in (ROOT / "run_training_memory_optimized.sh").read_text()


def test_cpu_small_config_is_the_learning_curve_recipe():
    """The trainer flags the learning-curve benchmark used (the curves of docs/results.md) before it
    read the file."""
    from benchmark_modules import load

    recipe = [
        "--preset",
        "small",
        "--tokenizer_type",
        "char",
        "--batch_size",
        "16",
        "--lr",
        "2e-3",
        "--warmup_steps",
        "200",
        "--epochs",
        "1000",
        "--mixed_precision",
        "--num_workers",
        "1",
        "--keep_checkpoints",
        "10",
        "--no_progress",
        "--log_every",
        "20",
        "--validate_every_steps",
        "500",
        "--ema_decay",
        "0.998",
        # the default seed then
        "--subsampling_channels",
        "32",
        "--cmvn",
        "utterance",
        "--seed",
        "1234",
        # since: intermediate CTC (benchmarks/results/recipe_levers)
        "--inter_ctc_weight",
        "0.3",
        # since: a higher peak over a longer warm-up (benchmarks/results/recipe_levers)
        "--lr",
        "4e-3",
        "--warmup_steps",
        "400",
        # since: Kaldi filterbanks, sherpa-onnx's features (benchmarks/results/recipe_levers)
        "--frontend",
        "kaldi_fbank",
        # since: the CTC loss weighted 0.5 (benchmarks/results/recipe_levers)
        "--ctc_weight",
        "0.5",
        # since: a length curriculum in the first epoch (benchmarks/results/recipe_levers)
        "--length_curriculum_epochs",
        "1",
        # since: the CTC weight ramped down from 0.9 (benchmarks/results/recipe_levers)
        "--ctc_weight_from",
        "0.9",
        "--loss_ramp_steps",
        "1000",
        # since: noise on 30% of the utterances, over two epochs (benchmarks/results/recipe_levers)
        "--noise_prob",
        "0.3",
        "--augment_ramp_epochs",
        "2",
    ]
    given = ["--train_manifest", "t.jsonl", "--valid_manifest", "v.jsonl", "--output_dir", "out"]
    assert _resolve([*given, *recipe]) == _resolve([*given, *load("learning_curve").RECIPE])


def test_large_16gb_fits_the_plan_it_was_sized_by():
    """Its longest micro-batch, estimated, stays under 75% of 15 GiB (a 16 GB card): the 16
    utterances of 30 s that konkanivani-plan-memory --utterances_per_update 16 recommends."""
    cfg, model_cfg = _resolve(["--config", str(ROOT / "configs" / "large_16gb.yaml")])
    model_cfg = model_config_from_preset(cfg.preset, vocab_size=128)
    longest = frames_of(cfg.max_duration)
    per_batch = cfg.max_batch_frames // longest
    assert per_batch == 16 and cfg.precision == "fp16" and not cfg.gradient_checkpointing
    estimator = MemoryEstimator(model_cfg, "fp16", cfg.optimizer, cfg.gradient_checkpointing)
    assert estimator.peak_bytes(per_batch, longest) <= 0.75 * 15 * GIB
    assert estimator.peak_bytes(per_batch + 2, longest) > 0.75 * 15 * GIB  # about the most that fit


def _write(tmp_path, text, name="x.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_flags_override_the_file_and_model_fields_the_preset(tmp_path):
    path = _write(tmp_path, "model:\n  preset: small\n  d_model: 96\ndata:\n  batch_size: 3\n"
                            "training:\n  lr: 2e-3\n  mixed_precision: true\n")
    cfg, model_cfg = _resolve(["--config", str(path), *_manifests(tmp_path)])
    assert (cfg.preset, model_cfg.d_model, model_cfg.encoder_layers) == ("small", 96, 6)
    # 2e-3: a string to YAML, a float here
    assert (cfg.batch_size, cfg.lr, cfg.mixed_precision) == (3, 2e-3, True)
    cfg, model_cfg = _resolve(
        [
            "--config",
            str(path),
            *_manifests(tmp_path),
            "--batch_size",
            "5",
            "--d_model",
            "64",
            "--no_mixed_precision",
            "--preset",
            "tiny",
        ]
    )
    assert (cfg.preset, model_cfg.d_model, model_cfg.encoder_layers) == ("tiny", 64, 2)
    assert (cfg.batch_size, cfg.lr, cfg.mixed_precision) == (5, 2e-3, False)


def test_required_manifests_may_come_from_the_file(tmp_path, capsys):
    path = _write(tmp_path, "data:\n  train_manifest: t.jsonl\n  valid_manifest: v.jsonl\n")
    args = cli.parse_args(["--config", str(path)])
    assert (args.train_manifest, args.valid_manifest) == ("t.jsonl", "v.jsonl")
    with pytest.raises(SystemExit):
        cli.parse_args(
            ["--config", str(_write(tmp_path, "data:\n  train_manifest: t.jsonl\n", "y.yaml"))]
        )
    assert "the following arguments are required: --valid_manifest" in capsys.readouterr().err


BAD_FILES = [
    ("training:\n  lerning_rate: 0.1\n", "unknown key training.lerning_rate (did you mean lr?)"),
    ("data:\n  batchsize: 4\n", "unknown key data.batchsize (did you mean batch_size?)"),
    (
        "training:\n  batchsize: 4\n",
        "unknown key training.batchsize (did you mean data.batch_size?)",
    ),
    (
        "training:\n  zzzz: 4\n",
        "unknown key training.zzzz (not a field of TrainConfig or ModelConfig",
    ),
    (
        "training:\n  batch_size: 4\n",
        "training.batch_size belongs in the data section (data.batch_size)",
    ),
    ("data:\n  d_model: 96\n", "data.d_model belongs in the model section (model.d_model)"),
    ("training:\n  preset: tiny\n", "training.preset belongs in the model section (model.preset)"),
    ("lr: 0.1\n", "key lr outside a section (it belongs in training:)"),
    ("trainig:\n  lr: 0.1\n", "unknown section trainig (did you mean training?)"),
    ("training:\n  epochs: abc\n", "training.epochs must be an integer, got 'abc'"),
    ("training:\n  epochs: 2.5\n", "training.epochs must be an integer, got 2.5"),
    ("training:\n  lr: fast\n", "training.lr must be a number, got 'fast'"),
    ("training:\n  mixed_precision: 1\n", "training.mixed_precision must be true or false, got 1"),
    ("model:\n  subsampling: 2\n", "model.subsampling must be a string, got 2"),
    ("training:\n  lr:\n", "training.lr has no value"),
    ("training: [lr]\n", "section training must be a mapping"),
    ("- lr\n", "a config is a mapping of the sections model, init, data, training"),
    (
        "training:\n  init_from: x.pt\n",
        "training.init_from belongs in the init section (init.init_from)",
    ),
    ("data:\n  keep_init_cmvn: true\n", "data.keep_init_cmvn belongs in the init section"),
    ("training:\n  lr: [1\n", "not valid YAML ("),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_a_bad_file_is_one_line_naming_file_and_key_with_exit_2(text, message, tmp_path, caplog):
    path = _write(tmp_path, text)
    out = tmp_path / "out"
    assert cli.main(["--config", str(path), *_manifests(tmp_path), "--output_dir", str(out)]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and len(errors[0].splitlines()) == 1, errors
    assert errors[0].startswith(f"{path}: ") and message in errors[0], errors
    assert not out.exists()


def test_a_missing_config_file_is_named(tmp_path, caplog):
    assert cli.main(["--config", str(tmp_path / "nope.yaml"), *_manifests(tmp_path)]) == 2
    assert f"--config {tmp_path / 'nope.yaml'}: file not found" in caplog.text


def test_an_empty_file_changes_nothing(tmp_path):
    given = _manifests(tmp_path)
    assert _resolve(
        ["--config", str(_write(tmp_path, "# nothing yet\nmodel:\n")), *given]
    ) == _resolve(given)


def test_resolved_config_has_every_value_but_how_the_command_started():
    cfg, model_cfg = TrainConfig(train_manifest="t", valid_manifest="v"), model_config_from_preset(
        "tiny", vocab_size=9
    )
    sections = resolved_config(cfg, model_cfg)
    assert list(sections) == list(SECTIONS)
    written = {k: v for section in sections.values() for k, v in section.items()}
    assert set(written) == set(SECTION_OF) - {"resume", "overwrite"}
    assert all(SECTION_OF[k] == name for name, section in sections.items() for k in section)
    assert written["vocab_size"] == cfg.vocab_size and written["d_model"] == model_cfg.d_model


def _train_rows(out):
    """The rows of metrics.jsonl without the machine's figures (speed, data wait, memory)."""
    machine = (
        "utt_per_s",
        "data_wait",
        "rss_gb",
        "peak_rss_gb",
        "mem_gb",
        "peak_gb",
        "reserved_gb",
        "elapsed_s",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in machine} for r in rows]


@pytest.mark.slow
def test_a_run_writes_its_config_and_the_file_runs_it_again(tiny_corpus, tmp_path):
    from tiny_args import tiny_args

    first, again = tmp_path / "first", tmp_path / "again"
    assert (
        cli.main(
            tiny_args(
                tiny_corpus, first, "--max_steps", "2", "--ctc_weight", "0.5", "--d_model", "32"
            )
        )
        == 0
    )
    written = yaml.safe_load((first / "config.yaml").read_text())
    assert list(written) == list(SECTIONS)
    assert written["model"]["preset"] == "tiny" and written["model"]["d_model"] == 32
    assert written["data"]["batch_size"] == 4 and written["training"]["ctc_weight"] == 0.5
    assert written["training"]["max_steps"] == 2 and written["training"]["output_dir"] == str(first)

    assert cli.main(["--config", str(first / "config.yaml"), "--output_dir", str(again)]) == 0
    assert _train_rows(again) == _train_rows(first)  # the same run: same losses, step by step
    assert load_config_file(again / "config.yaml") == {**load_config_file(first / "config.yaml"),
                                                       "output_dir": str(again)}

    # Resumed, it is written again with the values the run goes on with (the batch size the
    # checkpoint keeps, not the flag's).
    assert (
        cli.main(
            [
                "--config",
                str(first / "config.yaml"),
                "--resume",
                "latest",
                "--max_steps",
                "3",
                "--batch_size",
                "8",
            ]
        )
        == 0
    )
    text = (first / "config.yaml").read_text()
    assert "at step 2" in text.splitlines()[0]
    resumed = yaml.safe_load(text)
    assert resumed["training"]["max_steps"] == 3 and resumed["data"]["batch_size"] == 4
    assert "resume" not in resumed["training"] and "overwrite" not in resumed["training"]


# ---- the layout: where each key lives, and the layout before init: --------------------------

def test_the_model_section_holds_the_model_alone():
    model_keys = {k for k, section in SECTION_OF.items() if section == "model"}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"vocab_size"}
    assert model_keys == {"preset"} | model_fields


def _layout_before_init(sections):
    """``sections`` (a config.yaml's) as a run wrote them before the init section: its keys under
    model."""
    old = {name: dict(keys) for name, keys in sections.items() if name != "init"}
    old["model"].update(sections["init"])
    return old


def test_a_written_config_round_trips_and_one_of_the_layout_before_loads_the_same(tmp_path, caplog):
    cfg = TrainConfig(train_manifest="t.jsonl", valid_manifest="v.jsonl", init_from="big/best.pt",
                      init_modules="encoder", keep_init_cmvn=True, lr=2e-3, batch_size=3)
    model_cfg = model_config_from_preset("tiny", vocab_size=9, d_model=32)
    written = write_config_file(tmp_path / "config.yaml", cfg, model_cfg)
    sections = yaml.safe_load(written.read_text())
    assert list(sections) == ["model", "init", "data", "training"]
    assert sections["init"] == {"init_from": "big/best.pt", "init_modules": "encoder",
                                "keep_init_cmvn": True}
    assert "init_from" not in sections["model"] and sections["model"]["d_model"] == 32
    values = load_config_file(written)
    expected = {**dataclasses.asdict(cfg), **dataclasses.asdict(model_cfg),
                "vocab_size": cfg.vocab_size}
    assert values == {k: v for k, v in expected.items() if k not in ("resume", "overwrite")}

    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(_layout_before_init(sections), sort_keys=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        assert load_config_file(old) == values
    notes = [r for r in caplog.records if "note:" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert notes[0].getMessage() == (f"{old}: note: model.init_from, model.init_modules, "
                                     "model.keep_init_cmvn now belong in the init section; the "
                                     "file loads as it is")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="konkanivani"):
        load_config_file(written)
    assert "note:" not in caplog.text  # the layout of now says nothing


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_shipped_recipe_in_the_layout_before_init_loads_the_same(path, tmp_path):
    sections = yaml.safe_load(path.read_text())
    old = tmp_path / path.name
    with_init = {"init": {"init_modules": "encoder"}, **sections}
    old.write_text(yaml.safe_dump(_layout_before_init(with_init), sort_keys=False))
    assert load_config_file(old) == {**load_config_file(path), "init_modules": "encoder"}
