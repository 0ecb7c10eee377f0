#!/usr/bin/env python3
"""Leave one language out on the real-speech yardstick: a base trained on human speech of the
other languages, fine-tuned on the left-out language's 15 minutes, against training on those 15
minutes from scratch, at the same step budget.

    python3 benchmarks/real_speech.py                     # the yardstick, once
    python3 benchmarks/real_speech_transfer.py --languages fr,ru,bg --seeds 1234,1235 \\
        --out benchmarks/results/real_speech_transfer

For each language L and seed, with the CPU recipe (configs/cpu_small.yaml) and any further
trainer flags given after the known ones:

- ``base_without_L``: every other training language of the yardstick (``--train_mix``, weight 1
  each; Spanish is never a training language), validated on their valid splits, ``--base_steps``
  (with ``--base_seed S`` one base, of seed S, serves every seed's fine-tuning);
- ``scratch_L``: L's ``train_15min.jsonl`` from scratch, validated on L's valid split, ``--steps``;
- ``tuned_L``: the same from the base's best.pt (``--init_from``: its vocabulary rows matched by
  token), ``--steps``;
- with ``--demo_model CKPT`` (the Konkani demo model, e.g. the CPU recipe's on the demo corpus),
  ``from_demo_L``: the same from that checkpoint.

With ``--demo DIR`` the base hears the demo corpus's training split as well, at ``--demo_weight``
against weight 1 for each human language (``base_demo_without_L``): the synthesized Konkani hours
beside the human ones, as ``configs/multilingual_base.yaml`` trains them. With ``--base_init CKPT``
the base starts from that checkpoint (``--init_from``; e.g. the demo model, which has learned to
align) instead of from scratch (``..._from_init``).

With ``--pretrain_steps N`` the encoder is pretrained by masked prediction (``--pretrain``, more
flags in ``--pretrain_flags``) for N steps on the audio of every training language of the
yardstick, L's 15 minutes among them, their text unread (``pretrained``, one a seed, validated by
its masked loss on their valid splits), and ``pretrained_L`` is the same as ``scratch_L`` from its
best.pt: what audio without transcripts gives a language of 15 minutes. ``--base_steps 0`` trains
no base (nor ``tuned_L``).

Each model's best.pt is scored on L's test split (greedy CTC and joint CTC/attention decoding);
``table.md`` and ``table.csv`` hold every run, ``summary.md`` the means over seeds and the relative
gain. A run cut short is resumed by the same command; a finished one is kept.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from konkanivani.cli.train import model_flags, parse_args  # noqa: E402
from konkanivani.config import TrainConfig, dataclass_from_args  # noqa: E402
from konkanivani.decoding.evaluation import evaluate_manifest  # noqa: E402
from konkanivani.decoding.recognizer import Recognizer  # noqa: E402
from konkanivani.training.loop import train  # noqa: E402

RECIPE = ["--config", str(ROOT / "configs" / "cpu_small.yaml")]
METHODS = ("greedy", "joint")


def training_languages(yardstick: Path) -> list[str]:
    summary = json.loads((yardstick / "yardstick.json").read_text(encoding="utf-8"))
    return [lang for lang in summary["languages"] if lang not in summary["settings"]["eval_only"]]


def _absolute(manifest: Path) -> list[dict]:
    rows = [json.loads(line) for line in manifest.read_text(encoding="utf-8").splitlines()]
    return [{**r, "audio_filepath": str((manifest.parent / r["audio_filepath"]).resolve())}
            for r in rows]


def _write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _copy(yardstick: Path, data: Path, lang: str, name: str) -> Path:
    """``lang``'s manifest ``name`` of the yardstick, with absolute audio paths, in ``data``."""
    return _write(data / lang / name, _absolute(yardstick / lang / name))


def fit(out: Path, data: list[str], valid: Path, steps: int, seed: int, extra: list[str]) -> Path:
    """Train into ``out`` for ``steps`` steps (resumed where it stopped); its best.pt."""
    if not (out / "done").is_file():
        resume = ["--resume", "latest"] if (out / "latest.pt").is_file() else []
        ns = parse_args([*RECIPE, *data, "--valid_manifest", str(valid), "--output_dir", str(out),
                         "--max_steps", str(steps), "--seed", str(seed), *extra, *resume])
        summary = train(dataclass_from_args(TrainConfig, ns), model_flags(ns))
        if summary.get("stopped_by"):  # a signal or --max_time: the same command resumes it
            raise SystemExit(f"{out}: stopped by {summary['stopped_by']} before step {steps}")
        (out / "done").write_text("")
    return out / "best.pt"


def score(checkpoint: Path, test: Path) -> dict[str, float]:
    recognizer = Recognizer.from_checkpoint(checkpoint)
    return {method: round(100 * evaluate_manifest(recognizer, test, method=method).chars.rate, 2)
            for method in METHODS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--yardstick", type=Path, default=ROOT / "data" / "real_speech")
    parser.add_argument("--languages", default="fr", help="the languages left out, one at a time")
    parser.add_argument("--seeds", default="1234")
    parser.add_argument("--base_steps", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--demo", type=Path, help="the demo corpus: its train split in the base")
    parser.add_argument("--demo_weight", type=float, default=4.0)
    parser.add_argument("--demo_model", type=Path,
                        help="a demo-corpus checkpoint to fine-tune from as well")
    parser.add_argument("--base_init", type=Path,
                        help="a checkpoint the base starts from (--init_from) instead of scratch")
    parser.add_argument("--base_seed", type=int,
                        help="train one base, with this seed, for every seed's fine-tuning "
                             "(default: a base of each seed's own)")
    parser.add_argument("--pretrain_steps", type=int, default=0,
                        help="pretrain an encoder on every training language's audio (0: none)")
    parser.add_argument("--pretrain_flags", default="--mask_prob 0.02",
                        help="more flags of the pretraining run, one string")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "real_speech_transfer")
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    every = ["--validate_every_steps", str(max(100, args.steps // 5))]  # (the base's too)
    langs = training_languages(args.yardstick)
    rows = []
    data = args.out / "run" / "data"
    every_audio = ",".join(f"{_copy(args.yardstick, data, o, 'train.jsonl')}:1:{o}" for o in langs)
    all_valid = _write(data / "valid_all.jsonl", [
        r for o in langs for r in _absolute(args.yardstick / o / "valid.jsonl")])
    for lang in args.languages.split(","):
        if lang not in langs:
            parser.error(f"--languages {lang}: not a training language of the yardstick "
                         f"({', '.join(langs)})")
        others = [o for o in langs if o != lang]
        mix = ",".join(f"{_copy(args.yardstick, data, o, 'train.jsonl')}:1:{o}" for o in others)
        base_name = f"base_without_{lang}"
        if args.demo:
            demo = _write(data / "demo_train.jsonl", _absolute(args.demo / "train.jsonl"))
            mix += f",{demo}:{args.demo_weight:g}:demo"
            base_name = f"base_demo_without_{lang}"
        base_init = []
        if args.base_init:
            base_init, base_name = ["--init_from", str(args.base_init)], f"{base_name}_from_init"
        base_valid = _write(data / f"valid_without_{lang}.jsonl", [
            r for o in others for r in _absolute(args.yardstick / o / "valid.jsonl")])
        own_train, own_valid, test = (_copy(args.yardstick, data, lang, name) for name in (
            "train_15min.jsonl", "valid.jsonl", "test.jsonl"))
        for seed in map(int, args.seeds.split(",")):
            run = args.out / "run" / f"seed{seed}"
            base_data = (["--train_mix", mix] if "," in mix
                         else ["--train_manifest", mix.rsplit(":", 2)[0]])
            base_seed = seed if args.base_seed is None else args.base_seed
            own = ["--train_manifest", str(own_train)]
            scratch = fit(run / f"scratch_{lang}", own, own_valid, args.steps, seed,
                          [*every, *extra])
            models = [("from scratch", scratch)]
            if args.base_steps:
                base = fit(args.out / "run" / f"seed{base_seed}" / base_name,
                           [*base_data, *base_init], base_valid, args.base_steps, base_seed,
                           [*every, *extra])
                tuned = fit(run / f"tuned_{lang}", [*own, "--init_from", str(base)], own_valid,
                            args.steps, seed, [*every, *extra])
                models = [("base (never heard it)", base), *models,
                          ("fine-tuned from the base", tuned)]
            if args.pretrain_steps:
                encoder = fit(run / "pretrained", [
                    "--pretrain", "--train_mix", every_audio, "--inter_ctc_weight", "0",
                    *args.pretrain_flags.split()], all_valid, args.pretrain_steps, seed,
                    [*every, *extra])
                models.append(("fine-tuned from the pretrained encoder", fit(
                    run / f"pretrained_{lang}", [*own, "--init_from", str(encoder)], own_valid,
                    args.steps, seed, [*every, *extra])))
            if args.demo_model:
                models.append(("fine-tuned from the demo model", fit(
                    run / f"from_demo_{lang}", [*own, "--init_from", str(args.demo_model)],
                    own_valid, args.steps, seed, [*every, *extra])))
            for name, checkpoint in models:
                rows.append({"language": lang, "seed": seed, "model": name,
                             **{f"test_{m}": v for m, v in score(checkpoint, test).items()}})
                print(rows[-1], flush=True)
    write_tables(args.out, rows, args)
    return 0


def write_tables(out: Path, rows: list[dict], args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| language | seed | model | test CER greedy | test CER joint |",
             "|---|---|---|---:|---:|"]
    lines += [f"| {r['language']} | {r['seed']} | {r['model']} | {r['test_greedy']:.2f} | "
              f"{r['test_joint']:.2f} |" for r in rows]
    tuned_models = [m for m in ("fine-tuned from the base", "fine-tuned from the demo model",
                                "fine-tuned from the pretrained encoder")
                    if any(r["model"] == m for r in rows)]
    means = ["| language | from scratch (joint) | "
             + " | ".join(f"{m} (joint) | relative" for m in tuned_models) + " |",
             "|---|---:|" + "---:|---:|" * len(tuned_models)]
    for lang in dict.fromkeys(r["language"] for r in rows):
        def mean(model: str) -> float:
            values = [r["test_joint"] for r in rows if r["language"] == lang
                      and r["model"] == model]
            return sum(values) / len(values)
        scratch = mean("from scratch")
        means.append(f"| {lang} | {scratch:.2f} | " + " | ".join(
            f"{mean(m):.2f} | {100 * (mean(m) - scratch) / scratch:+.1f}%" for m in tuned_models)
            + " |")
    command = (f"python3 benchmarks/real_speech_transfer.py --languages {args.languages} --seeds "
               f"{args.seeds} --base_steps {args.base_steps} --steps {args.steps}"
               + (f" --demo {args.demo} --demo_weight {args.demo_weight:g}" if args.demo else "")
               + (f" --demo_model {args.demo_model}" if args.demo_model else "")
               + (f" --base_init {args.base_init}" if args.base_init else "")
               + (f" --base_seed {args.base_seed}" if args.base_seed is not None else "")
               + (f" --pretrain_steps {args.pretrain_steps} --pretrain_flags "
                  f"'{args.pretrain_flags}'" if args.pretrain_steps else ""))
    (out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(f"    {command}\n\n" + "\n".join(means) + "\n",
                                    encoding="utf-8")
    print("\n".join(lines + [""] + means))


if __name__ == "__main__":
    sys.exit(main())
