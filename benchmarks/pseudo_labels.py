#!/usr/bin/env python3
"""Learning from audio without transcripts, measured: a share of the demo corpus's training set
transcribed and the rest given as audio alone, pseudo-labelled in rounds, against the same recipe
trained on the transcribed share alone and on all of it with its real transcripts.

    python benchmarks/pseudo_labels.py --budget_steps 1500 --seed 1234 --rounds 2 \\
        --full benchmarks/runs/full/seed-1234 --out /tmp/pseudo_labels

Every training run is one run of ``benchmarks/learning_curve.py`` (through
``recipe_levers.run_one``: the recipe, ``configs/cpu_small.yaml``, at ``--budget_steps``, its final
weights scored on test, the held-out voice and the noisy test split, greedy and joint), into
``OUT/NAME/seed-S/``; a run whose ``final.csv`` exists is not run again, nor a labelling whose
``pseudo.jsonl`` exists, so a killed benchmark goes on where it stopped.

1. ``OUT/split/``: a seeded ``--labelled_share`` of ``train.jsonl`` kept with its text
   (``labelled.jsonl``), the rest without (``audio_only.jsonl``).
2. ``teacher``: the recipe on the labelled share alone (``--teacher DIR`` reuses one trained on
   the same share elsewhere: ``benchmarks/pretrain.py``'s ``OUT/tuned/seed-S``, its pretrained
   encoder fine-tuned, for pretraining and pseudo-labels together). With ``--lm``, an LM
   (``konkanivani-train-lm``, ``OUT/lm``) on the corpus's text-only set and the labelled share's
   transcripts, for ``{lm}`` in the labelling flags; each ``--label_variant NAME=FLAGS`` labels the
   audio-only share with the teacher those ways (``labels_1_NAME``), a row of labels alone, or
   with ``--variant_student NAME`` its labels' student too (``round_1_NAME``);
   ``--variant_weights NAME=FILE`` labels that variant with ``FILE`` of the teacher's run folder
   (``latest_training_weights.pt``: the training weights, not the EMA's).
3. Each round R: ``konkanivani-pseudolabel`` labels the audio-only share with the last model (its
   EMA weights; the threshold chosen on ``valid.jsonl`` for ``--target_label_cer``), timed for its
   real-time factor; ``round_R`` trains the recipe from scratch on the labelled share and those
   labels (``--pseudo_noise_prob``: the noisy student), or with ``--keep_pool`` on every round's
   labels so far, each utterance's latest.
4. ``full``: the recipe on all of ``train.jsonl`` with its transcripts (``--full DIR`` reuses a
   ``recipe_levers`` run of the recipe with the same seed and budget).
5. With ``--adapt N``: N sentences of the corpus's text-only set read by the held-out voice
   (festival's Marathi voice; none of them a test sentence) are labelled by the full model (with
   ``--lm``, an LM of the same text and its tokenizer, ``OUT/lm_full``), which is then fine-tuned
   ``--adapt_steps`` on the training set with (``adapt``; ``--adapt_variant NAME=FLAGS``, with
   more flags: ``adapt_NAME``) and without (``adapt_control``) those labels: what the voice's
   audio alone is worth on its test split.

``OUT/table.md`` (each stage's CER on every split, the labels kept and their threshold, the share
of the test-CER gap between teacher and full model each round recovers) and ``OUT/pseudo.png`` are
written and the table printed.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import recipe_levers  # noqa: E402

from konkanivani.cli.pseudolabel import write_pool  # noqa: E402
from konkanivani.data.manifest import read_manifest  # noqa: E402
from konkanivani.data.tokenizer import normalize_text  # noqa: E402
from konkanivani.training.precision import cpu_description  # noqa: E402

SPLITS = ("test", "heldout", "test_noisy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=1234, help="training seed of every run")
    p.add_argument("--split_seed", type=int, default=0)
    p.add_argument("--labelled_share", type=float, default=0.1)
    p.add_argument("--budget_steps", type=int, default=1500)
    p.add_argument("--eval_every_steps", type=int, default=250)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--target_label_cer", type=float, default=10.0)
    p.add_argument("--label_flags", default="--jobs 2",
                   help="more konkanivani-pseudolabel flags, one string")
    p.add_argument("--student_flags", default="--pseudo_noise_prob 0.5",
                   help="more trainer flags for each student, one string")
    p.add_argument("--full", type=Path,
                   help="a recipe_levers run dir (with final.csv and run/latest.pt) of the recipe "
                        "on all of train.jsonl at the same seed and budget, instead of training it")
    p.add_argument("--teacher", type=Path,
                   help="a recipe_levers run dir (with final.csv and run/latest.pt) of a teacher "
                        "trained on the labelled share, instead of training it: "
                        "benchmarks/pretrain.py's OUT/tuned/seed-S (the pretrained encoder "
                        "fine-tuned on the share), say")
    p.add_argument("--adapt", type=int, default=0,
                   help="held-out-voice sentences to synthesize as audio alone (0: no adaptation)")
    p.add_argument("--adapt_steps", type=int, default=500)
    p.add_argument("--adapt_variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another adaptation with these more trainer flags (adapt_NAME: "
                        "--pseudo_weight 4, say); repeatable")
    p.add_argument("--lm", action="store_true",
                   help="train a konkanivani-train-lm LM on the corpus's text.txt and the labelled "
                        "share's transcripts (OUT/lm), the teacher's tokenizer; '{lm}' in "
                        "--label_flags and --label_variant stands for its best.pt")
    p.add_argument("--lm_flags", default="--d_model 128 --layers 2 --epochs 30 --seed 0",
                   help="konkanivani-train-lm flags of --lm, one string")
    p.add_argument("--label_variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="label the audio with the teacher again, --label_flags and these flags "
                        "(labels_1_NAME): the labels' row alone, no student; repeatable")
    p.add_argument("--variant_student", action="append", default=[], metavar="NAME",
                   help="train a student on --label_variant NAME's labels too (round_1_NAME), "
                        "as round 1's on its own; repeatable")
    p.add_argument("--variant_weights", action="append", default=[], metavar="NAME=FILE",
                   help="label --label_variant NAME with this file of the teacher's run folder "
                        "instead of latest.pt (latest_training_weights.pt: the training weights)")
    p.add_argument("--student_variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="another student of round 1's labels with these more trainer flags "
                        "(student_NAME; '{teacher}' stands for the teacher's latest.pt); "
                        "repeatable")
    p.add_argument("--keep_pool", action="store_true",
                   help="each student after the first trains on the labels of every round so far "
                        "(an utterance with the last round's label that kept it), as "
                        "konkanivani-pseudolabel --keep_pool")
    args = p.parse_args(argv)
    if unknown := set(args.variant_student) - {v.partition("=")[0] for v in args.label_variant}:
        p.error(f"--variant_student {', '.join(sorted(unknown))}: no such --label_variant")
    args.variant_weights = dict(v.partition("=")[::2] for v in args.variant_weights)
    if unknown := set(args.variant_weights) - {v.partition("=")[0] for v in args.label_variant}:
        p.error(f"--variant_weights {', '.join(sorted(unknown))}: no such --label_variant")
    if args.student_variant and args.rounds < 1:
        p.error("--student_variant: a student of round 1's labels needs --rounds 1 or more")
    return args


def _rows(path: Path) -> list[dict]:
    return [row for _, row in read_manifest(path)]


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
    tmp.replace(path)


def split_corpus(corpus: Path, out: Path, share: float, seed: int) -> tuple[Path, Path]:
    """The labelled share (with text) and the rest (audio alone), audio paths made absolute."""
    labelled, audio_only = out / "labelled.jsonl", out / "audio_only.jsonl"
    if labelled.is_file() and audio_only.is_file():
        return labelled, audio_only
    rows = _rows(corpus / "train.jsonl")
    for r in rows:
        r["audio_filepath"] = str((corpus / r["audio_filepath"]).resolve())
    chosen = set(random.Random(seed).sample(range(len(rows)), round(share * len(rows))))
    _write_rows(labelled, [r for i, r in enumerate(rows) if i in chosen])
    _write_rows(audio_only, [{k: v for k, v in r.items() if k != "text"}
                             for i, r in enumerate(rows) if i not in chosen])
    return labelled, audio_only


def train_lm(args: argparse.Namespace, teacher: Path, labelled: Path, name: str = "lm") -> Path:
    """``--lm``: the LM on the corpus's text and the labelled share's transcripts (none of them a
    test sentence, nor the audio-only share's), with ``teacher``'s tokenizer, trained once into
    ``OUT/name``; its best.pt."""
    out = args.out / name
    if (out / "best.pt").is_file() and (out / "done").is_file():
        return out / "best.pt"
    text = args.out / "split" / "lm_text.txt"
    lines = [line.strip() for line in (args.corpus / "text.txt").read_text(
        encoding="utf-8").splitlines() if line.strip()]
    text.write_text("\n".join(lines + [r["text"] for r in _rows(labelled)]) + "\n",
                    encoding="utf-8")
    cmd = [sys.executable, "-m", "konkanivani.cli.train_lm", str(text), "--tokenizer",
           str(teacher), "--output_dir", str(out), "--overwrite", *args.lm_flags.split()]
    print(" ".join(cmd[2:]), flush=True)
    with open(args.out / f"{name}.log", "w", encoding="utf-8") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"training the LM: exit status {code}; see {args.out / f'{name}.log'}")
    (out / "done").write_text("")
    return out / "best.pt"


def pool(args: argparse.Namespace, last: int) -> Path:
    """``--keep_pool``: the kept labels of rounds 1 to ``last``, each utterance once, with the
    label of the last round that kept it (konkanivani-pseudolabel's pool)."""
    return write_pool([args.out / f"labels_{r}" / "pseudo.jsonl" for r in range(1, last + 1)],
                      args.out / f"labels_{last}" / "pool.jsonl")


def label(args: argparse.Namespace, teacher: Path, audio: Path, out: Path,
          flags: str | None = None) -> dict:
    """Pseudo-label ``audio`` with ``teacher`` into ``out`` (``flags``, else ``--label_flags``),
    timed once (a rerun keeps the time)."""
    timing = out / "timing.json"
    if (out / "pseudo.jsonl").is_file() and timing.is_file():
        return json.loads(timing.read_text())
    cmd = [sys.executable, "-m", "konkanivani.cli.pseudolabel", str(teacher), str(audio),
           "--choose_threshold_on", str(args.corpus / "valid.jsonl"),
           "--target_label_cer", f"{args.target_label_cer:g}", "--output_dir", str(out),
           "--teacher", teacher.parent.parent.name,
           *(args.label_flags if flags is None else flags).format(lm=args.lm_path).split()]
    print(" ".join(cmd[2:]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w", encoding="utf-8") as log:
        # from the checkout, so that -m finds the package installed or not
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"labelling {out}: exit status {code}")
    if timing.is_file():  # labels decoded before, the threshold chosen again: the first timing
        return json.loads(timing.read_text())
    audio_s = sum(r.get("duration", 0.0) for r in _rows(audio))
    info = {"seconds": round(seconds, 1), "audio_seconds": round(audio_s, 1),
            "real_time": round(audio_s / seconds, 1)}
    timing.write_text(json.dumps(info) + "\n")
    return info


def synthesize_adapt(corpus: Path, out: Path, n: int, seed: int) -> Path:
    """``n`` text-only sentences read by the held-out voice, as a manifest without text."""
    from konkanivani.datatools import corpus as c

    manifest = out / "audio_only.jsonl"
    if manifest.is_file():
        return manifest
    rng = random.Random(seed)
    texts = c.load_sentences(corpus / "text.txt")
    texts = rng.sample(texts, min(n, len(texts)))
    (out / "wavs").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, text in enumerate(texts):
        snr = rng.uniform(*c.SNR_RANGE_DB) if rng.random() < c.NOISE_PROB else None
        utt = c.PlannedUtterance(
            split="adapt", index=i, text=text, speaker=c.FESTIVAL_SPEAKER,
            speed=round(100 * rng.uniform(*c.FESTIVAL_STRETCH_RANGE)),
            pitch=rng.randint(*c.FESTIVAL_F0_RANGE), peak=round(rng.uniform(*c.PEAK_RANGE), 4),
            snr_db=None if snr is None else round(snr, 2), noise_seed=rng.randrange(2**31))
        _, _, duration = c.synthesize(utt, str(out))
        rows.append({"audio_filepath": str((out / utt.rel_path).resolve()), "duration": duration})
    _write_rows(manifest, rows)
    return manifest


def levers_args(args: argparse.Namespace, steps: int) -> argparse.Namespace:
    return recipe_levers.parse_args(
        ["--variant", "x=", "--budget_steps", str(steps), "--eval_every_steps",
         str(args.eval_every_steps), "--corpus", str(args.corpus), "--out", str(args.out),
         "--splits", ",".join(SPLITS)])


def final_cers(run: Path) -> dict[str, float]:
    with open(run / "final.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return {f"{r['split']}_{r['method']}": float(r["cer"]) for r in rows
            if r["weights"].startswith("final")}


def kept(out: Path, truth: dict[str, str]) -> dict:
    """How many labels the threshold kept, and their CER against the real transcripts (which the
    benchmark has and a user would not), both normalized as evaluation normalizes them: no
    punctuation, which the labels never hold."""
    import jiwer

    report = json.loads((out / "report.json").read_text())
    rows = [r for r in _rows(out / "pseudo.jsonl") if r["audio_filepath"] in truth]
    cer = (100 * jiwer.cer([normalize_text(truth[r["audio_filepath"]]) for r in rows],
                           [normalize_text(r["text"]) for r in rows]) if rows else None)
    return {"kept": report["kept"], "of": report["utterances"], "threshold": report["threshold"],
            "label_cer": cer}


def run_all(args: argparse.Namespace) -> list[dict]:
    labelled, audio_only = split_corpus(args.corpus, args.out / "split", args.labelled_share,
                                        args.split_seed)
    la = levers_args(args, args.budget_steps)
    stages = []
    teacher = args.teacher or recipe_levers.run_one(la, "teacher", ["--train_manifest",
                                                                     str(labelled)], args.seed)
    stages.append({"stage": "teacher", "dir": teacher})
    model = teacher / "run" / "latest.pt"
    args.lm_path = train_lm(args, model, labelled) if args.lm else None
    for variant in args.label_variant:
        name, _, flags = variant.partition("=")
        labels = args.out / f"labels_1_{name}"
        weights = model.parent / args.variant_weights.get(name, model.name)
        stage = {"stage": f"labels_1_{name}", "labels": labels,
                 **label(args, weights, audio_only, labels, f"{args.label_flags} {flags}")}
        if name in args.variant_student:
            stage["stage"] = f"round_1_{name}"
            stage["dir"] = recipe_levers.run_one(
                la, stage["stage"], ["--train_manifest", str(labelled), "--pseudo_manifest",
                                     str(labels / "pseudo.jsonl"), *args.student_flags.split()],
                args.seed)
        stages.append(stage)
    for r in range(1, args.rounds + 1):
        labels = args.out / f"labels_{r}"
        timing = label(args, model, audio_only, labels)
        pooled = args.keep_pool and r > 1
        pseudo = pool(args, r) if pooled else labels / "pseudo.jsonl"
        student = recipe_levers.run_one(
            la, f"round_{r}", ["--train_manifest", str(labelled), "--pseudo_manifest",
                               str(pseudo), *args.student_flags.split()], args.seed)
        stages.append({"stage": f"round_{r}", "dir": student, "labels": labels, **timing,
                       **({"pool": len(_rows(pseudo))} if pooled else {})})
        if r == 1:
            for variant in args.student_variant:
                name, _, flags = variant.partition("=")
                stages.append({"stage": f"student_{name}", "labels": labels, **timing,
                               "dir": recipe_levers.run_one(
                    la, f"student_{name}", ["--train_manifest", str(labelled),
                                            "--pseudo_manifest", str(pseudo),
                                            *args.student_flags.split(),
                                            *flags.format(teacher=teacher / "run" / "latest.pt")
                                            .split()], args.seed)})
        model = student / "run" / "latest.pt"
    if args.full is None:
        args.full = recipe_levers.run_one(la, "full", [], args.seed)
    stages.append({"stage": "full", "dir": args.full})
    if args.adapt:
        adapt_audio = synthesize_adapt(args.corpus, args.out / "adapt_audio", args.adapt,
                                       args.split_seed)
        labels = args.out / "labels_adapt"
        full = args.full / "run" / "latest.pt"
        # the full model's vocabulary may differ from the teacher's: an LM of its own tokenizer
        lm = train_lm(args, full, labelled, "lm_full") if args.lm else None
        timing = label(args, full, adapt_audio, labels,
                       args.label_flags.replace("{lm}", str(lm)))
        short = levers_args(args, args.adapt_steps)
        init = ["--init_from", str(args.full / "run" / "latest.pt"), "--keep_init_cmvn"]
        control = recipe_levers.run_one(short, "adapt_control", init, args.seed)
        adapted = recipe_levers.run_one(
            short, "adapt", [*init, "--pseudo_manifest", str(labels / "pseudo.jsonl"),
                             *args.student_flags.split()], args.seed)
        stages.append({"stage": "adapt_control", "dir": control})
        stages.append({"stage": "adapt", "dir": adapted, "labels": labels, **timing})
        for variant in args.adapt_variant:
            name, _, flags = variant.partition("=")
            stages.append({"stage": f"adapt_{name}", "labels": labels, **timing,
                           "dir": recipe_levers.run_one(
                short, f"adapt_{name}", [*init, "--pseudo_manifest", str(labels / "pseudo.jsonl"),
                                         *args.student_flags.split(), *flags.split()],
                args.seed)})
    return stages


def table(args: argparse.Namespace, stages: list[dict]) -> str:
    truth = {str((args.corpus / r["audio_filepath"]).resolve()): r["text"]
             for r in _rows(args.corpus / "train.jsonl")}
    for s in stages:
        if "dir" in s:  # a --label_variant's row has labels and no student
            s.update(final_cers(Path(s["dir"])))
        if "labels" in s:
            s.update(kept(Path(s["labels"]), truth))
    by = {s["stage"]: s for s in stages}
    gap = by["teacher"]["test_joint"] - by["full"]["test_joint"]
    head = ["stage", "test", "heldout", "test_noisy", "test greedy", "gap recovered",
            "labels kept", "threshold", "labels' CER", "labelling x real time"]
    lines = [f"{args.budget_steps} steps a run (adaptation: {args.adapt_steps}), seed {args.seed}, "
             f"final weights (EMA), joint decoding unless said; CPU: {cpu_description()}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in stages:
        rec = ""
        if s["stage"].startswith(("round_", "student_")) and gap > 0:
            rec = f"{100 * (by['teacher']['test_joint'] - s['test_joint']) / gap:.0f}%"
        cer = [f"{s[f'{k}_joint']:.2f}" if "dir" in s else "" for k in SPLITS]
        lines.append("| " + " | ".join([
            s["stage"], *cer, f"{s['test_greedy']:.2f}" if "dir" in s else "", rec,
            (f"{s['kept']} of {s['of']}" if "kept" in s else "")
            + (f"; pool {s['pool']}" if "pool" in s else ""),
            f"{s['threshold']:.3f}" if s.get("threshold") is not None else "",
            f"{s['label_cer']:.2f}" if s.get("label_cer") is not None else "",
            f"{s['real_time']}x" if "real_time" in s else ""]) + " |")
    if "adapt" in by:
        c = by["adapt_control"]["heldout_joint"]
        for name in [n for n in by if n.startswith("adapt") and n != "adapt_control"]:
            a, more = by[name]["heldout_joint"], name.partition("_")[2]
            lines += ["", f"Held-out voice: {c:.2f}% fine-tuned on the training set alone, "
                          f"{a:.2f}% with its own audio pseudo-labelled"
                          + (f" ({more})" if more else "") + f": {100 * (c - a) / c:.1f}% "
                          "relative."]
    return "\n".join(lines) + "\n"


def plot(stages: list[dict], path: Path) -> None:
    import matplotlib

    stages = [s for s in stages if "dir" in s]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for s in stages:
        curve = Path(s["dir"]) / "curve.csv"
        if curve.is_file() and not s["stage"].startswith("adapt"):
            with open(curve, encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            left.plot([int(r["step"]) for r in rows], [float(r["cer"]) for r in rows],
                      marker="o", label=s["stage"])
    left.set(xlabel="step", ylabel="test CER % (greedy)", title="learning curves")
    left.legend()
    names = [s["stage"] for s in stages]
    width = 0.27
    for i, split in enumerate(SPLITS):
        right.bar([x + (i - 1) * width for x in range(len(names))],
                  [s[f"{split}_joint"] for s in stages], width, label=split)
    right.set_xticks(range(len(names)), names, rotation=20)
    right.set(ylabel="CER % (joint, final weights)", title="each stage")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stages = run_all(args)
    text = table(args, stages)
    (args.out / "table.md").write_text(text, encoding="utf-8")
    plot(stages, args.out / "pseudo.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
