#!/usr/bin/env python3
"""Hotwords: recall of rare names with and without boosting them, and what boosting costs on
sentences without them.

Sixty-four Konkani sentences, each with one to three proper names (people, villages, rivers, a
waterfall) that are absent from the training text (no word of train.jsonl or text.txt starts with
one: checked, else refused), are read by the demo corpus's test voices (espeak-ng, through
``datatools.corpus.synthesize``: the same voices, speeds, pitches, gains and noise as the test
split), ``--voices`` readings each. The names are the hotword list (``hotwords.txt``). A control
set is the first ``--control`` utterances of the corpus's test split, which hold none of them.

For each method (``beam``, ``rescore``, ``joint``, and ``stream``: a ``Recognizer.stream`` in chunks
of ``--chunk_size`` frames, rescored) and each boost of ``--boosts`` (0: no hotwords at all) it
decodes both sets with the whole list and reports:

- recall: the share of the names said that the hypothesis holds as whole words;
- false names: names in a hypothesis that its reference does not hold (on both sets);
- CER on the name sentences and on the control set.

Writes ``results.csv`` and ``results.md`` (the table, the CPU, the model's step and validation CER)
to ``--out``; the audio and manifests go to ``--work``.

    python benchmarks/hotwords.py checkpoints/streaming_small/best.pt \\
        --corpus data/demo --out benchmarks/results/hotwords
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

from konkanivani.checkpoint import SaveRecord, load_checkpoint
from konkanivani.data.audio import load_audio
from konkanivani.data.tokenizer import normalize_text
from konkanivani.datatools import corpus
from konkanivani.datatools.outputs import write_output
from konkanivani.decoding.evaluation import evaluate_manifest
from konkanivani.decoding.metrics import ErrorCounts, score
from konkanivani.decoding.recognizer import Recognizer
from konkanivani.training.curves import write_csv

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "hotwords"
log = logging.getLogger("konkanivani")

# Each sentence with the names it holds, as they are said (no case ending on them).
SENTENCES: list[tuple[str, tuple[str, ...]]] = [
    ("शांताराम आयज सकाळीं बाजारांत गेलो।", ("शांताराम",)),
    ("धारबांदोडा गांवांत एक व्हड देवूळ आसा।", ("धारबांदोडा",)),
    ("तिलारी न्हंयेचें उदक खूब थंड आसता।", ("तिलारी",)),
    ("सुधाकर आनी गोपिका मांद्रे गांवांत रावतात।", ("सुधाकर", "गोपिका", "मांद्रे")),
    ("रघुनाथ दर दिसा पैंगीण गांवांत वता।", ("रघुनाथ", "पैंगीण")),
    ("जुवारी न्हंयेर एक नवो पूल बांदला।", ("जुवारी",)),
    ("सुनंदा शाळेंत कोंकणी शिकयता।", ("सुनंदा",)),
    ("लोलये गांवांत पावसाळ्यांत खूब पावस पडटा।", ("लोलये",)),
    ("वसुंधरा आपल्या आवयक फोन करता।", ("वसुंधरा",)),
    ("खोतीगांव रानांत खूब जनावरां आसात।", ("खोतीगांव",)),
    ("दामोदर बशीन नेत्रावळी गेलो।", ("दामोदर", "नेत्रावळी")),
    ("मुचकुंदी न्हंयेंत होडयो चलतात।", ("मुचकुंदी",)),
    ("गजानन आमच्या घरा जेवपाक आयलो।", ("गजानन",)),
    ("साकोर्डे गांवच्या लोकांनी नवें इस्पितळ मागलें।", ("साकोर्डे",)),
    ("अनसूया फाल्यां उसगांव वतली।", ("अनसूया", "उसगांव")),
    ("वशिष्ठी न्हंयेलागीं एक पोरनो कोट आसा।", ("वशिष्ठी",)),
    ("शिवराम शेतांत काम करता।", ("शिवराम",)),
    ("शिरोडा गांवांत दर वर्सा जात्रा जाता।", ("शिरोडा",)),
    ("यशोदा बाजारांतल्यान आंबे हाडटा।", ("यशोदा",)),
    ("पणसुले गांवचीं भुरगीं मडगांवां शिकपाक वतात।", ("पणसुले",)),
    ("पांडुरंग आनी मुकुंद दोगूय इश्ट आसात।", ("पांडुरंग", "मुकुंद")),
    ("तळपण न्हंयेचेर सांजे सुंदर दिसता।", ("तळपण",)),
    ("सदानंद गुळेली गांवांत दुकान चलयता।", ("सदानंद", "गुळेली")),
    ("कुशावती न्हंय केपें वाटेन व्हांवता।", ("कुशावती",)),
    ("रत्नाकर पिसुर्ले बाजारांत भाजी विकता।", ("रत्नाकर", "पिसुर्ले")),
    ("विश्वनाथ दोतोर इस्पितळांत काम करता।", ("विश्वनाथ",)),
    ("रगाडा न्हंयेंत पावसाळ्यांत खूब उदक आसता।", ("रगाडा",)),
    ("उमाकांत केरी गांवांत रावता।", ("उमाकांत", "केरी")),
    ("हेमलता आयतारा पर्ये गांवांत गेली।", ("हेमलता", "पर्ये")),
    ("वाळवंटी न्हंयेचें उदक निवळ आसा।", ("वाळवंटी",)),
    ("प्रमिला मोर्ले गांवच्या शाळेंत शिकयता।", ("प्रमिला", "मोर्ले")),
    ("भालचंद्र दर सकाळीं धांवपाक वता।", ("भालचंद्र",)),
    ("हळदोणे गांवांत एक पोरनी इगर्ज आसा।", ("हळदोणे",)),
    ("चंद्रकांत गालजीबाग दर्यादेगेर गेलो।", ("चंद्रकांत", "गालजीबाग")),
    ("श्रीधर आनी सुलोचना लग्नाक आयलीं।", ("श्रीधर", "सुलोचना")),
    ("कांदोळी दर्यादेगेर खूब लोक येतात।", ("कांदोळी",)),
    ("मनोहर शिवोली गांवांत घर बांदता।", ("मनोहर", "शिवोली")),
    ("खांडेपार न्हंयेर एक पोरनो पूल आसा।", ("खांडेपार",)),
    ("जयवंत हरमल दर्यादेगेर नुस्तें धरता।", ("जयवंत", "हरमल")),
    ("लक्ष्मीकांत आयज कचेरेंत उशीरा पावलो।", ("लक्ष्मीकांत",)),
    ("मोरजी गांवांत कासवां येतात।", ("मोरजी",)),
    ("धोंडू आनी सखाराम शेतांत वावर करतात।", ("धोंडू", "सखाराम")),
    ("पालये गांवचो रस्तो बंद आसा।", ("पालये",)),
    ("कळणा न्हंयेलागीं एक ल्हान गांव आसा।", ("कळणा",)),
    ("इंदुमती मयडे गांवांत शिकयता।", ("इंदुमती", "मयडे")),
    ("शारदा आनी मृणालिनी भयणी आसात।", ("शारदा", "मृणालिनी")),
    ("वागातोर दर्यादेगेर वचपाक बस जाय।", ("वागातोर",)),
    ("कुडतरी गांवांत फेस्त आसा।", ("कुडतरी",)),
    ("गोविंदराव लोटली गांवचो सरपंच आसा।", ("गोविंदराव", "लोटली")),
    ("सावर्डे गांवांत एक नवें दुकान उगडलें।", ("सावर्डे",)),
    ("कुंकळ्ळी शारांत खूब कारखाने आसात।", ("कुंकळ्ळी",)),
    ("बेतुल बंदरार खूब होडयो आसात।", ("बेतुल",)),
    ("आगोंद दर्यादेगेर आमी आयतारा गेले।", ("आगोंद",)),
    ("गांवडोंगरी गांवांत रान खूब आसा।", ("गांवडोंगरी",)),
    ("कोलवाळ गांवचे लोक मेळून काम करतात।", ("कोलवाळ",)),
    ("करमळी स्टेशनार रेल उशीरा आयली।", ("करमळी",)),
    ("अस्नोडा गांवांत एक ल्हान न्हंय आसा।", ("अस्नोडा",)),
    ("वेळ्ळी गांवांत म्हज्या मावशीचें घर आसा।", ("वेळ्ळी",)),
    ("नेत्रावती न्हंय कर्नाटकांत व्हांवता।", ("नेत्रावती",)),
    ("शरावती न्हंयेचेर एक व्हड धबधबो आसा।", ("शरावती",)),
    ("विठ्ठलदास आमच्या गांवचो शिक्षक आसा।", ("विठ्ठलदास",)),
    ("कमलाक्षी म्हापशाच्या बाजारांत फुलां विकता।", ("कमलाक्षी",)),
    ("सुर्ला गांवांत पावसाळ्यांत धबधबे व्हांवतात।", ("सुर्ला",)),
    ("दूधसागर धबधबो पळोवंक लोक येतात।", ("दूधसागर",)),
]
METHODS = ("beam", "rescore", "joint", "stream")
SPLIT = "hotwords"  # the wavs' names: wavs/hotwords_00000.wav ...


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def names() -> list[str]:
    """Every name of ``SENTENCES`` once, in order: the hotword list."""
    return list(dict.fromkeys(n for _, ns in SENTENCES for n in ns))


def seen_names(corpus_dir: Path) -> dict[str, str]:
    """The names that a word of the training text (``train.jsonl``, ``text.txt``) starts with,
    each with that word."""
    words: set[str] = set()
    train = corpus_dir / "train.jsonl"
    with train.open(encoding="utf-8") as f:
        for line in f:
            words.update(normalize_text(json.loads(line)["text"]).split())
    text = corpus_dir / "text.txt"
    if text.is_file():
        words.update(normalize_text(text.read_text(encoding="utf-8")).split())
    return {n: w for n in names() for w in words if w.startswith(n)}


def plan(voices: int, seed: int) -> list[tuple[corpus.PlannedUtterance, tuple[str, ...]]]:
    """Each sentence read by ``voices`` of the corpus's test voices, with the acoustics its test
    split draws (``corpus.plan_corpus``'s ranges), from one seeded RNG."""
    rng = random.Random(seed)
    pool = corpus.speaker_pools()["test"]
    out = []
    for text, ns in SENTENCES:
        for speaker in rng.sample(pool, voices):
            snr = rng.uniform(*corpus.SNR_RANGE_DB) if rng.random() < corpus.NOISE_PROB else None
            utt = corpus.PlannedUtterance(
                split=SPLIT, index=len(out), text=text, speaker=speaker,
                speed=rng.randint(*corpus.SPEED_RANGE), pitch=rng.randint(*corpus.PITCH_RANGE),
                peak=round(rng.uniform(*corpus.PEAK_RANGE), 4),
                snr_db=None if snr is None else round(snr, 2), noise_seed=rng.randrange(2**31))
            out.append((utt, ns))
    return out


def synthesize(work: Path, voices: int, seed: int) -> Path:
    """The name sentences' audio and manifest in ``work`` (kept: made again only when missing)."""
    manifest = work / f"{SPLIT}.jsonl"
    (work / "wavs").mkdir(parents=True, exist_ok=True)
    rows = []
    for utt, ns in plan(voices, seed):
        wav = work / utt.rel_path
        if not wav.is_file():
            corpus.synthesize(utt, str(work))
        rows.append({"audio_filepath": utt.rel_path, "text": utt.text, "names": list(ns),
                     "speaker": utt.speaker, "speed": utt.speed, "pitch": utt.pitch,
                     "duration": round(len(load_audio(wav)) / 16000, 3)})
    write_output(manifest, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return manifest


def control_set(corpus_dir: Path, work: Path, count: int) -> Path:
    """The first ``count`` rows of the corpus's test split, as a manifest in ``work`` (its audio
    paths absolute); ``SystemExit`` if one holds a name."""
    rows = []
    test = corpus_dir / "test.jsonl"
    with test.open(encoding="utf-8") as f:
        for line in f:
            if len(rows) == count:
                break
            row = json.loads(line)
            row["audio_filepath"] = str((corpus_dir / row["audio_filepath"]).resolve())
            rows.append(row)
    found = [(r["text"], n) for r in rows for n in _found(names(), r["text"])]
    if found:
        raise SystemExit(f"{test}: the control set holds hotwords: {found[:3]}")
    manifest = work / "control.jsonl"
    write_output(manifest, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return manifest


def _found(wanted: list[str], text: str) -> list[str]:
    """Those of ``wanted`` that ``text`` holds as whole words (each once)."""
    words = f" {normalize_text(text)} "
    return [n for n in wanted if f" {normalize_text(n)} " in words]


def _decode(rec: Recognizer, manifest: Path, method: str, boost: float, hotwords: tuple[str, ...],
            chunk_size: int, beam_size: int) -> tuple[list[tuple[str, str]], float]:
    """(reference, hypothesis) per row of ``manifest``, and the seconds it took."""
    settings = {"hotwords": hotwords if boost else (), "hotword_boost": boost,
                "beam_size": beam_size}
    start = time.perf_counter()
    if method != "stream":
        result = evaluate_manifest(rec, manifest, method=method, **settings)
        if result.failed:
            raise SystemExit(f"{manifest}: {len(result.failed)} rows not decoded: "
                             f"{result.failed[0]}")
        pairs = [(u.reference, u.hypothesis) for u in result.utterances]
    else:
        pairs = []
        with manifest.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        for row in rows:
            wav = load_audio(_audio(manifest, row["audio_filepath"]))
            stream = rec.stream(chunk_size=chunk_size, method="rescore", **settings)
            results = stream.accept(wav) + stream.finish()
            text = " ".join(r.text for r in results if r.is_final and r.text)
            pairs.append((row["text"], text))
    return pairs, time.perf_counter() - start


def _audio(manifest: Path, path: str) -> Path:
    return Path(path) if Path(path).is_absolute() else manifest.parent / path


def measure(pairs: list[tuple[str, str]], wanted: list[str], with_names: bool) -> dict:
    """Recall of the names the references hold, false names, CER."""
    chars, said, heard, false = ErrorCounts(), 0, 0, 0
    for ref, hyp in pairs:
        chars += score(ref, hyp)[1]
        in_ref, in_hyp = set(_found(wanted, ref)), set(_found(wanted, hyp))
        said += len(in_ref)
        heard += len(in_ref & in_hyp)
        false += len(in_hyp - in_ref)
    prefix = "names" if with_names else "control"
    out = {f"{prefix}_cer": round(100 * chars.rate, 2), f"{prefix}_false": false}
    if with_names:
        out["recall"] = round(100 * heard / said, 1) if said else float("nan")
        out["names_said"] = said
    return out


def cpu_name() -> str:
    """The CPU's model name, with AMX when it has it (from /proc/cpuinfo)."""
    name, flags = "unknown CPU", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
    return name + (" (AMX)" if "amx_tile" in flags else "")


def model_note(checkpoint: Path) -> str:
    """The checkpoint's step and validation CER, as its run recorded them."""
    record = SaveRecord.of(load_checkpoint(checkpoint))
    cer = record.valid_metrics.get("cer", record.best_cer)
    valid = f", validation CER {100 * cer:.1f}%" if isinstance(cer, float) else ""
    return f"step {'?' if record.step is None else record.step}{valid}"


def table(rows: list[dict]) -> list[str]:
    lines = ["| method | boost | recall of the names % | false names (name sentences / control)"
             " | CER name sentences % | CER control % | control CER change |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = {r["method"]: r for r in rows if r["boost"] == 0}
    for r in rows:
        b = base.get(r["method"])
        change = (f"{100 * (r['control_cer'] - b['control_cer']) / b['control_cer']:+.1f}%"
                  if b and b["control_cer"] else "—")
        lines.append(f"| {r['method']} | {r['boost']:g} | {r['recall']:.1f} | "
                     f"{r['names_false']} / {r['control_false']} | {r['names_cer']:.2f} | "
                     f"{r['control_cer']:.2f} | {change if r['boost'] else '—'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "demo",
                        help="the demo corpus: its training text, test split and voices")
    parser.add_argument("--methods", default="beam,rescore,stream",
                        help=f"any of {', '.join(METHODS)}")
    parser.add_argument("--boosts", type=_floats, default=_floats("0,1,1.5,2,3"),
                        help="per token; 0: without hotwords")
    parser.add_argument("--voices", type=int, default=2, help="readings of each sentence")
    parser.add_argument("--control", type=int, default=150,
                        help="utterances of the test split without the names")
    parser.add_argument("--sentences", type=int, default=len(SENTENCES),
                        help="the first this many name sentences (a short run)")
    parser.add_argument("--chunk_size", type=int, default=16, help="the stream's chunk")
    parser.add_argument("--beam_size", type=int, default=10)
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--work", type=Path, default=OUT / "run",
                        help="the synthesized audio and the manifests")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        parser.error(f"--methods {','.join(unknown)}: choose from {', '.join(METHODS)}")
    for path in (args.checkpoint, args.corpus / "train.jsonl", args.corpus / "test.jsonl"):
        if not path.is_file():
            parser.error(f"{path}: file not found")
    if seen := seen_names(args.corpus):
        parser.error("names in the training text: "
                     + ", ".join(f"{n} ({w})" for n, w in list(seen.items())[:5]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    SENTENCES[:] = SENTENCES[:args.sentences]
    args.out.mkdir(parents=True, exist_ok=True)
    hotwords = tuple(names())
    write_output(args.out / "hotwords.txt", "".join(n + "\n" for n in hotwords))
    named = synthesize(args.work, args.voices, args.seed)
    control = control_set(args.corpus, args.work, args.control)
    rec = Recognizer.from_checkpoint(args.checkpoint, "cpu")
    log.info("%d hotwords; %s; %s", len(hotwords), named, control)

    rows = []
    for method in methods:
        for boost in args.boosts:
            named_pairs, t1 = _decode(rec, named, method, boost, hotwords, args.chunk_size,
                                      args.beam_size)
            control_pairs, t2 = _decode(rec, control, method, boost, hotwords, args.chunk_size,
                                        args.beam_size)
            row = {"method": method, "boost": boost, **measure(named_pairs, list(hotwords), True),
                   **measure(control_pairs, list(hotwords), False),
                   "seconds": round(t1 + t2, 1)}
            log.info("%s", row)
            rows.append(row)
            write_csv(args.out / "results.csv", rows)
    note = (f"`{args.checkpoint}` ({model_note(args.checkpoint)}), {cpu_name()}, "
            f"{args.threads} thread(s); {len(SENTENCES)} sentences x {args.voices} voices "
            f"({rows[0]['names_said']} names said), {args.control} control utterances, "
            f"{len(hotwords)} hotwords, beam {args.beam_size}, stream chunk {args.chunk_size}.")
    write_output(args.out / "results.md", "\n".join([note, "", *table(rows)]) + "\n")
    print(note, *table(rows), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
