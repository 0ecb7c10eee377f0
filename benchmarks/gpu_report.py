#!/usr/bin/env python3
"""Everything that needs a CUDA GPU, in one command and one Markdown report.

    python3 benchmarks/gpu_report.py              # -> benchmarks/results/gpu/<YYYY-MM-DD>-<gpu>.md
    python3 benchmarks/gpu_report.py --dry_run    # the plan: each part's command, budget and time limit
    python3 benchmarks/gpu_report.py --parts pytest,recipe --out /tmp/report

The parts, in this order, each in a process group of its own that is killed at its time limit, all
of them under --total_timeout (570 s: the whole report costs under 10 minutes of GPU time):

* ``pytest``: ``python -m pytest -m gpu`` (tests/test_gpu.py: fp16 autocast with a GradScaler, a
  non-finite step skipped and counted, empty_cache every N batches, a real CUDA out-of-memory split
  and retried, the --auto_batch probe, --offload_activations, FSDP2 with CPU offload, 8-bit AdamW,
  and NCCL DDP/FSDP where there are 2 GPUs), each test's outcome and time;
* ``recipe``: the T4 recipe (run_training_memory_optimized.sh, configs/t4.yaml: medium model, fp16
  with a GradScaler, batches of 2 accumulated 4 times) for --recipe_steps steps on the demo corpus
  (data/demo when it is there, else a small one made with konkanivani-demo-corpus, or, without
  espeak-ng, synthetic tone sequences, which the report says): its losses, speed, memory, scores;
* ``memory``: rows of benchmarks/memory.py on CUDA (each memory option alone and combined, the
  --offload_activations rows included), each row a fresh process: peak memory, estimate, step time;
* ``gpu_throughput``: the models of benchmarks/throughput.py (ours, torchaudio's Conformer) timed
  on the GPU in fp32, bf16 and fp16, with the FLOP rate;
* ``cpu_throughput``: benchmarks/throughput.py itself, which measures the CPU only (it has no
  --device), on the GPU machine's CPU.

A part that fails or runs out of time does not stop the others; the report gives its table, or
its failure and the end of its output. Exit status: 0 when every part passed, 1 when one did not
(the report is written all the same), 2 for bad flags or on a machine without a CUDA GPU.
"""

import argparse
import contextlib
import datetime
import functools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # this checkout's package, installed or not (the parts get it through PYTHONPATH)
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
SENTENCES = ROOT / "konkanivani" / "resources" / "demo_sentences_kok.txt"

PARTS = ("pytest", "recipe", "memory", "gpu_throughput", "cpu_throughput")
# Seconds each part may take at most. They add up to the --total_timeout default, which keeps the
# whole report under 10 minutes of GPU time; the recipe's limit includes making the corpus.
TIMEOUTS = {"pytest": 180, "recipe": 170, "memory": 120, "gpu_throughput": 60, "cpu_throughput": 40}
TOTAL_TIMEOUT = 570
CORPUS_TIMEOUT = 60  # of the recipe's limit, at most this much for making the demo corpus
TAIL_LINES = 40  # of a failed part's output, in the report


# ---- flags ------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _parts(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part {', '.join(unknown) or '(none given)'}; choose from "
                                         f"{', '.join(PARTS)}")
    return [name for name in PARTS if name in names]  # always in the report's order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="parts: " + ", ".join(PARTS))
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--parts", type=_parts, default=list(PARTS),
                        help=f"comma list of the parts to run (default: all: {','.join(PARTS)})")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder of the report (default: {RESULTS})")
    parser.add_argument("--total_timeout", type=_positive_float, default=float(TOTAL_TIMEOUT),
                        help=f"seconds for all parts together; a part gets what is left if that is less than "
                             f"its own limit (default: {TOTAL_TIMEOUT})")
    parser.add_argument("--recipe_steps", type=_positive_int, default=300,
                        help="optimizer steps of the T4 recipe (default: 300; it validates at step 200 and at the end)")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="folder holding train.jsonl and valid.jsonl for the recipe (default: data/demo when "
                             "complete, else a small demo corpus made in the temporary folder)")
    parser.add_argument("--corpus_utterances", type=_positive_int, default=400,
                        help="utterances of the demo corpus made when there is none (default: 400)")
    parser.add_argument("--memory_presets", default="large",
                        help="comma list of presets for the memory rows (default: large)")
    parser.add_argument("--memory_rows", type=_positive_int, default=10,
                        help="configurations of benchmarks/memory.py per preset, in its order (default: 10, all of "
                             "them on CUDA)")
    parser.add_argument("--memory_seconds", type=_positive_float, default=15.0,
                        help="utterance length of the memory rows (2 per step; default: 15)")
    parser.add_argument("--throughput_presets", default="small,medium,large",
                        help="comma list of presets timed on the GPU (default: small,medium,large)")
    parser.add_argument("--throughput_rounds", type=_positive_int, default=10,
                        help="timed steps of each model on the GPU, after 3 warm-up steps (default: 10)")
    parser.add_argument("--cpu_rounds", type=_positive_int, default=3,
                        help="rounds of benchmarks/throughput.py on the CPU, preset small (default: 3)")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the plan (each part's command, budget and time limit) and exit; needs no GPU")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("memory_presets", "throughput_presets"):
        presets = [p.strip() for p in getattr(args, flag).split(",") if p.strip()]
        known = ("tiny", "small", "medium", "large")
        if not presets or any(p not in known for p in presets):
            parser.error(f"--{flag} {getattr(args, flag)!r}: give a comma list of {', '.join(known)}")
        setattr(args, flag, presets)
    return args


# ---- running a part ---------------------------------------------------------------------------

def child_env(**extra: str) -> dict[str, str]:
    """The environment of every process a part starts: this checkout importable (installed or
    not), Python's output unbuffered (a part killed at its limit still shows how far it came)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class Finished:
    returncode: Optional[int]  # None: killed at its time limit
    seconds: float
    output: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_limited(cmd: list[str], timeout: float, log: Path, env: Optional[dict[str, str]] = None,
                cwd: Path = ROOT) -> Finished:
    """Run ``cmd`` in a process group of its own, its output (stdout and stderr) to ``log``; at
    ``timeout`` seconds the whole group (the benchmarks' worker processes, torchrun's ranks) is
    sent SIGTERM, then SIGKILL 10 s later."""
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode: Optional[int] = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            returncode = None
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return Finished(returncode, time.monotonic() - start, log.read_text(encoding="utf-8", errors="replace"))


def tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "```\n" + "\n".join(line[:300] for line in kept) + "\n```"


@dataclass
class Outcome:
    status: str  # passed, failed, timed out, not run
    seconds: float
    body: str  # Markdown
    summary: str = ""  # one line for the summary table


def _failure(finished: Finished, limit: float, what: str) -> Outcome:
    if finished.timed_out:
        return Outcome("timed out", finished.seconds,
                       f"Killed at its time limit of {limit:.0f} s. The end of its output:\n\n{tail(finished.output)}",
                       f"{what}: killed at {limit:.0f} s")
    return Outcome("failed", finished.seconds,
                   f"Exit status {finished.returncode}. The end of its output:\n\n{tail(finished.output)}",
                   f"{what}: exit status {finished.returncode}")


# ---- part 1: pytest -m gpu --------------------------------------------------------------------

def pytest_command(xml: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider",
            "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1"]


def junit_outcomes(xml_text: str) -> list[dict[str, Any]]:
    """Each test case of a JUnit XML report: its name, outcome (passed, failed, error, skipped,
    xfailed), seconds and the first line of its message."""
    rows = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        name = re.sub(r"^tests\.", "", f"{cls}::{name}" if cls else name)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = child.get("message") or (child.text or "")
                outcome = {"failure": "failed", "error": "error"}.get(child.tag, "skipped")
                if child.tag == "skipped" and child.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                if child.tag == "error" and child.get("message") == "collection failure":
                    outcome = "collection error"  # a test module that did not import: say why
                    message = next((line[1:].strip() for line in reversed((child.text or "").splitlines())
                                    if line.startswith("E ")), message)
                break
        first = next((line.strip() for line in message.splitlines() if line.strip()), "")
        rows.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0.0),
                     "message": first[:240]})
    return rows


_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def verbose_outcomes(output: str) -> list[dict[str, Any]]:
    """The outcomes pytest -v printed, for a run killed before it wrote its XML report."""
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed",
             "XPASS": "xpassed"}
    return [{"test": m.group(1), "outcome": names[m.group(2)], "seconds": float("nan"), "message": ""}
            for m in map(_VERBOSE_LINE.match, output.splitlines()) if m]


def pytest_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| test | outcome | seconds | message |", "| --- | --- | --- | --- |"]
    for r in rows:
        seconds = "" if math.isnan(r["seconds"]) else f"{r['seconds']:.1f}"
        lines.append(f"| `{r['test']}` | {r['outcome']} | {seconds} | {r['message'].replace('|', '/')} |")
    return "\n".join(lines)


def _count(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no test ran"


def run_pytest(args: argparse.Namespace, limit: float, work: Path) -> Outcome:
    """Passed when every selected test passed, was skipped or failed as expected (xfail). A test
    module that does not import here (a dependency of a CPU test missing on the GPU machine) is
    listed as a collection error, and fails the part only when no GPU test ran."""
    xml = work / "pytest.xml"
    finished = run_limited(pytest_command(xml), limit, work / "pytest.log")
    rows = junit_outcomes(xml.read_text(encoding="utf-8")) if xml.is_file() else verbose_outcomes(finished.output)
    table = pytest_table(rows) if rows else "No test outcome was reported."
    tests = [r for r in rows if r["outcome"] != "collection error"]
    bad = [r for r in tests if r["outcome"] in ("failed", "error")]
    ok = (not finished.timed_out and tests and not bad
          and (finished.returncode == 0 or len(tests) < len(rows)))
    summary = _count(rows)
    if ok:
        return Outcome("passed", finished.seconds, f"{summary}.\n\n{table}", summary)
    failure = _failure(finished, limit, summary)
    return Outcome(failure.status, finished.seconds, f"{summary}.\n\n{table}\n\n{failure.body}", failure.summary)


# ---- part 2: the T4 recipe --------------------------------------------------------------------

def write_tone_corpus(out: Path, train: int = 48, valid: int = 8, seed: int = 3, sentences: int = 24,
                      sample_rate: int = 16000) -> Path:
    """A corpus that needs no speech synthesizer: each transcript (a Konkani demo sentence) read as
    one 80 ms tone per character, its pitch set by the character, in faint noise; manifests
    ``train.jsonl`` and ``valid.jsonl`` as the demo corpus has them. A model can learn it, but it
    is no speech: it exercises training, it measures nothing about recognition."""
    import random

    import numpy as np
    import soundfile as sf

    texts = [line.strip() for line in SENTENCES.read_text(encoding="utf-8").splitlines() if line.strip()]
    random.Random(seed).shuffle(texts)
    texts = texts[:sentences]
    rng = np.random.default_rng(seed)
    (out / "wavs").mkdir(parents=True, exist_ok=True)
    per_char = int(0.08 * sample_rate)
    ramp = np.minimum(1.0, np.minimum(np.arange(per_char), np.arange(per_char)[::-1]) / (0.01 * sample_rate))
    for split, count in (("train", train), ("valid", valid)):
        rows = []
        for i in range(count):
            text = texts[i % len(texts)] if split == "train" else texts[(i * 7 + 3) % len(texts)]
            pieces = [np.zeros(int(0.15 * sample_rate))]
            for ch in text:
                if ch.isspace():
                    pieces.append(np.zeros(per_char))
                    continue
                freq = 150.0 + (ord(ch) * 97) % 3200
                t = np.arange(per_char) / sample_rate
                pieces.append(0.3 * ramp * np.sin(2 * np.pi * freq * (1 + 0.02 * rng.standard_normal()) * t))
            pieces.append(np.zeros(int(0.15 * sample_rate)))
            wav = np.concatenate(pieces) + 0.003 * rng.standard_normal(sum(len(p) for p in pieces))
            name = f"wavs/{split}_{i:04d}.wav"
            sf.write(out / name, wav.astype(np.float32), sample_rate, subtype="PCM_16")
            rows.append({"audio_filepath": name, "duration": round(len(wav) / sample_rate, 4), "text": text})
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return out


def _has_manifests(folder: Path) -> bool:
    return (folder / "train.jsonl").is_file() and (folder / "valid.jsonl").is_file()


def recipe_corpus(args: argparse.Namespace, limit: float, work: Path) -> tuple[Optional[Path], str, Optional[Outcome]]:
    """The corpus the recipe trains on and a sentence saying which; or an ``Outcome`` when there is none."""
    if args.corpus is not None:
        if not _has_manifests(args.corpus):
            return None, "", Outcome("failed", 0.0, f"--corpus {args.corpus}: no train.jsonl and valid.jsonl there.",
                                     "no corpus")
        return args.corpus, f"the corpus in `{args.corpus}`", None
    if _has_manifests(ROOT / "data" / "demo"):
        return ROOT / "data" / "demo", "the demo corpus in `data/demo`", None
    folder = Path(tempfile.gettempdir()) / f"konkanivani-gpu-report-demo-{args.corpus_utterances}"
    if shutil.which("espeak-ng") is None:
        tones = folder.with_name(folder.name + "-tones")
        if not _has_manifests(tones):
            write_tone_corpus(tones, train=args.corpus_utterances * 9 // 10, valid=max(8, args.corpus_utterances // 10),
                              sentences=200)
        return tones, (f"**synthetic tone sequences** ({args.corpus_utterances} utterances in `{tones}`): espeak-ng is "
                       "not installed here, so there is no demo corpus; the recipe's losses and speed are real, its "
                       "scores say nothing about speech"), None
    jobs = str(min(16, os.cpu_count() or 2))
    cmd = [sys.executable, "-m", "konkanivani.cli.demo_corpus", "--output_dir", str(folder), "--num_utterances",
           str(args.corpus_utterances), "--jobs", jobs]
    finished = run_limited(cmd, min(CORPUS_TIMEOUT, limit), work / "corpus.log")
    if finished.returncode != 0 or not _has_manifests(folder):
        failure = _failure(finished, min(CORPUS_TIMEOUT, limit), "making the demo corpus")
        return None, "", Outcome(failure.status, finished.seconds, "Making the demo corpus failed: " + failure.body,
                                 failure.summary)
    return folder, (f"a small demo corpus made with `konkanivani-demo-corpus --output_dir {folder} --num_utterances "
                    f"{args.corpus_utterances}` in {finished.seconds:.0f} s"), None


def recipe_command(args: argparse.Namespace) -> list[str]:
    """The T4 recipe as its script runs it, with a step budget; the manifests and output folder
    come through its environment variables (``recipe_env``)."""
    return ["bash", str(ROOT / "run_training_memory_optimized.sh"), "--max_steps", str(args.recipe_steps),
            "--log_every", str(max(1, args.recipe_steps // 12)), "--no_progress", "--no_tensorboard"]


def recipe_env(corpus: Path, out_dir: Path) -> dict[str, str]:
    return child_env(PYTHON=sys.executable, TRAIN_MANIFEST=str(corpus / "train.jsonl"),
                     VALID_MANIFEST=str(corpus / "valid.jsonl"), OUTPUT_DIR=str(out_dir))


def _rows(metrics: Path) -> tuple[list[dict], list[dict]]:
    rows = []
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return [r for r in rows if r.get("kind") == "train"], [r for r in rows if r.get("kind") == "valid"]


def _num(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def recipe_tables(train_rows: list[dict], valid_rows: list[dict]) -> str:
    lines = ["| step | epoch | loss | CTC | attention | grad norm | lr | utt/s | data wait | GiB now | GiB peak |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in train_rows:
        lines.append(f"| {r['step']} | {r.get('epoch', '')} | {_num(r.get('loss'), '.3f')} | {_num(r.get('ctc'), '.3f')} | "
                     f"{_num(r.get('attention'), '.3f')} | {_num(r.get('grad_norm'), '.2f')} | {_num(r.get('lr'), '.2e')} | "
                     f"{_num(r.get('utt_per_s'), '.1f')} | {_num(r.get('data_wait'), '.0%')} | "
                     f"{_num(r.get('mem_gb'), '.2f')} | {_num(r.get('peak_gb'), '.2f')} |")
    if valid_rows:
        lines += ["", "| validation at step | loss | CER | WER |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['step']} | {_num(r.get('loss'), '.3f')} | {_num(r.get('cer'), '.2%')} | {_num(r.get('wer'), '.2%')} |"
                  for r in valid_rows]
    return "\n".join(lines)


def run_recipe(args: argparse.Namespace, limit: float, work: Path) -> Outcome:
    start = time.monotonic()
    corpus, which, problem = recipe_corpus(args, limit, work)
    if problem is not None:
        return problem
    out_dir = work / "t4_run"
    cmd = recipe_command(args)
    finished = run_limited(cmd, limit - (time.monotonic() - start), work / "recipe.log", env=recipe_env(corpus, out_dir))
    train_rows, valid_rows = _rows(out_dir / "metrics.jsonl")
    log = (out_dir / "train.log").read_text(encoding="utf-8", errors="replace") if (out_dir / "train.log").is_file() else ""
    skipped = len(re.findall(r"non-finite (?:gradients|loss), update skipped", log))
    splits = len(re.findall(r"out of memory on a micro-batch", log))
    precision = next((line.split("INFO ", 1)[-1] for line in log.splitlines() if "precision:" in line), "not logged")
    last = train_rows[-1] if train_rows else {}
    saved = sorted(p.name for p in out_dir.glob("*.pt")) if out_dir.is_dir() else []
    facts = [f"Trained on {which}.",
             f"Command: `TRAIN_MANIFEST=... VALID_MANIFEST=... OUTPUT_DIR=... {shlex.join(['bash', 'run_training_memory_optimized.sh', *cmd[2:]])}`",
             f"{precision}; {last.get('step', 0)} of {args.recipe_steps} steps in {time.monotonic() - start:.0f} s "
             f"(startup and validation included); {skipped} updates skipped for non-finite gradients (fp16's "
             f"GradScaler finding its scale); {splits} micro-batches split after running out of memory; "
             f"checkpoints: {', '.join(saved) or 'none'}."]
    body = "\n\n".join(facts + [recipe_tables(train_rows, valid_rows)])
    loss = last.get("loss")
    summary = (f"{last.get('step', 0)}/{args.recipe_steps} steps, final loss {_num(loss, '.3f')}, "
               f"{_num(last.get('utt_per_s'), '.1f')} utt/s, peak {_num(last.get('peak_gb'), '.2f')} GiB"
               + (f", CER {valid_rows[-1]['cer']:.1%}" if valid_rows and valid_rows[-1].get("cer") is not None else ""))
    seconds = time.monotonic() - start  # the corpus included
    if finished.returncode == 0 and last.get("step") == args.recipe_steps and loss is not None and math.isfinite(loss):
        return Outcome("passed", seconds, body, summary)
    failure = _failure(finished, limit, summary)
    if finished.returncode == 0:  # it ended well, short of its steps or with a loss that is not finite
        failure = Outcome("failed", seconds, f"It ended at step {last.get('step', 0)} with loss "
                          f"{_num(loss, '.3f')}.\n\n{tail(finished.output)}", summary)
    return Outcome(failure.status, seconds, body + "\n\n" + failure.body, failure.summary)


# ---- workers: processes of this script that print one JSON line per row -------------------------

@functools.lru_cache(maxsize=None)
def _load(name: str) -> Any:
    """A script of benchmarks/ as a module (they are not a package); loaded once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def memory_worker(options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """benchmarks/memory.py's configurations on CUDA, each measured in a fresh process by its own
    ``measure``, one row at a time (so that a part killed at its limit keeps the rows done)."""
    memory = _load("memory")
    configs = memory.configurations(options["half"], cuda=True)[:options["rows"]]
    frames, tokens = int(options["seconds"] * 100), int(options["seconds"] * 5)
    for preset in options["presets"]:
        for name, config in configs:
            spec = {"device": "cuda", "preset": preset, "utterances": 2, "frames": frames, "tokens": tokens,
                    "steps": options["steps"], **config}
            try:
                emit({"preset": preset, "configuration": name, "wanted_optimizer": config["optimizer"],
                      **memory.measure(spec)})
            except RuntimeError as e:
                emit({"preset": preset, "configuration": name, "error": str(e).strip().splitlines()[-1][:300]})


def memory_table(rows: list[dict]) -> str:
    lines = ["| preset | configuration | peak MiB | vs baseline | estimate MiB | estimate / peak | step s | vs baseline |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base: dict[str, dict] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['configuration']} | failed: {r['error'].replace('|', '/')} | | | | | |")
            continue
        b = base.setdefault(r["preset"], r)
        note = "" if r.get("optimizer") == r.get("wanted_optimizer") else f" (ran {r.get('optimizer')})"
        lines.append(f"| {r['preset']} | {r['configuration']}{note} | {r['peak_mib']:.0f} | "
                     f"{r['peak_mib'] / b['peak_mib']:.2f}x | {r['estimate_mib']:.0f} | "
                     f"{r['estimate_mib'] / r['peak_mib']:.2f} | {r['step_s']:.3f} | {r['step_s'] / b['step_s']:.2f}x |")
    return "\n".join(lines)


def gpu_throughput_worker(options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """benchmarks/throughput.py's models (its batch: utterances x seconds, tokens, vocabulary) on
    CUDA: a training step (forward, backward, AdamW) in fp32, bf16 and fp16 autocast (fp16 with a
    GradScaler), the models' steps interleaved round by round as throughput.py does."""
    import torch

    from konkanivani.config import model_config_from_preset
    from konkanivani.training.optim import build_optimizer
    from konkanivani.training.precision import Precision

    tp = _load("throughput")
    device = torch.device("cuda")
    peaks = {name: _matmul_tflops(dtype) for name, dtype in
             (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    emit({"matmul_peak_tflops": peaks, "tf32": torch.backends.cuda.matmul.allow_tf32})
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    for preset in options["presets"]:
        cfg = model_config_from_preset(preset, vocab_size=256, conv_kernel=31)
        batch = tuple(t.to(device) for t in tp.make_batch(cfg, options["utterances"], options["seconds"], 20))
        audio = options["utterances"] * options["seconds"]
        for pname, dtype in dtypes.items():
            built = {}
            for name, cls in tp.MODELS.items():
                torch.manual_seed(0)
                model = cls(cfg).to(device).train()
                optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if name == "torchaudio"
                             else build_optimizer("adamw", model.parameters(), device, 1e-4, 0.01)[0])
                scaler = torch.amp.GradScaler("cuda", enabled=dtype is torch.float16)
                try:
                    flops = tp.count_flops(model, batch, Precision(None, False, ""))
                except Exception:  # noqa: BLE001 (the FLOP rate is a nicety; the time is the row)
                    flops = 0
                built[name] = (model, optimizer, scaler, flops)
                for _ in range(3):
                    _cuda_step(model, optimizer, scaler, batch, dtype)
            times: dict[str, list[float]] = {name: [] for name in built}
            for _ in range(options["rounds"]):
                for name, (model, optimizer, scaler, _) in built.items():
                    times[name].append(_cuda_step(model, optimizer, scaler, batch, dtype))
            for name, (model, _, _, flops) in built.items():
                median = statistics.median(times[name])
                emit({"preset": preset, "precision": pname, "model": name,
                      "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                      "step_ms": round(1000 * median, 2), "audio_s_per_s": round(audio / median, 1),
                      "gflop_per_step": round(flops / 1e9, 1), "tflop_s": round(flops / median / 1e12, 2),
                      "utilization": round(flops / median / 1e12 / peaks[pname], 3) if flops else None,
                      "speedup_vs_torchaudio": (round(statistics.median(a / b for a, b in zip(times["torchaudio"],
                                                                                                times[name])), 2)
                                                if name != "torchaudio" else None)})
            del built
            torch.cuda.empty_cache()


def _cuda_step(model: Any, optimizer: Any, scaler: Any, batch: tuple, dtype: Any) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
        loss = model(*batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _matmul_tflops(dtype: Any, size: int = 8192, repeats: int = 5) -> float:
    """Best TFLOP/s of a ``size``-cubed matmul in ``dtype`` on the GPU (fp32 as torch runs it by
    default: TF32 off)."""
    import torch

    a, b = torch.randn(size, size, device="cuda", dtype=dtype), torch.randn(size, size, device="cuda", dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return round(2 * size ** 3 / best / 1e12, 1)


def gpu_throughput_table(rows: list[dict]) -> str:
    head = next((r for r in rows if "matmul_peak_tflops" in r), None)
    lines = []
    if head:
        lines.append("Matmul peak measured here (8192 cubed): " + ", ".join(
            f"{k} {v:g} TFLOP/s" for k, v in head["matmul_peak_tflops"].items())
            + f" (fp32 matrix products with TF32 {'on' if head['tf32'] else 'off'}: torch's default, which "
              "training keeps).\n")
    lines += ["| preset | precision | model | params M | step ms | audio s/s | GFLOP/step | TFLOP/s | of matmul peak | "
              "speedup vs torchaudio |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "model" not in r:
            continue
        lines.append(f"| {r['preset']} | {r['precision']} | {r['model']} | {r['params_m']} | {r['step_ms']} | "
                     f"{r['audio_s_per_s']} | {r['gflop_per_step']} | {r['tflop_s']} | "
                     f"{'' if r['utilization'] is None else format(r['utilization'], '.1%')} | "
                     f"{'' if r['speedup_vs_torchaudio'] is None else r['speedup_vs_torchaudio']} |")
    return "\n".join(lines)


def worker_rows(output: str) -> list[dict]:
    """The JSON rows a worker printed (lines starting ``ROW ``), however far it came."""
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("ROW ")]


def _emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)


def worker_command(kind: str, options: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, json.dumps(options)]


def memory_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"presets": args.memory_presets, "rows": args.memory_rows, "seconds": args.memory_seconds, "steps": 3,
            "half": "fp16"}


def gpu_throughput_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"presets": args.throughput_presets, "rounds": args.throughput_rounds, "utterances": 8, "seconds": 4.0}


def _run_worker(kind: str, options: dict[str, Any], table: Callable[[list[dict]], str], what: str,
                limit: float, work: Path) -> Outcome:
    finished = run_limited(worker_command(kind, options), limit, work / f"{kind}.log")
    rows = worker_rows(finished.output)
    body = table(rows) if rows else "No row was measured."
    errors = [r for r in rows if "error" in r]
    done = len([r for r in rows if "error" not in r and ("model" in r or "peak_mib" in r)])
    summary = f"{done} {what}" + (f", {len(errors)} failed" if errors else "")
    if finished.returncode == 0 and not errors:
        return Outcome("passed", finished.seconds, body, summary)
    failure = _failure(finished, limit, summary)
    if finished.returncode == 0:
        failure = Outcome("failed", finished.seconds, "", summary)
    return Outcome(failure.status, finished.seconds, body + ("\n\n" + failure.body if failure.body else ""),
                   failure.summary)


def run_memory(args: argparse.Namespace, limit: float, work: Path) -> Outcome:
    outcome = _run_worker("memory", memory_options(args), memory_table, "rows", limit, work)
    outcome.body = (f"benchmarks/memory.py's configurations on CUDA, each a fresh process: 2 utterances of "
                    f"{args.memory_seconds:g} s per optimizer step, 3 steps (the first not timed), peak = "
                    "`torch.cuda.max_memory_allocated` above the process's start; the estimate is "
                    "`MemoryEstimator`'s, calibrated on CPUs.\n\n" + outcome.body)
    return outcome


def run_gpu_throughput(args: argparse.Namespace, limit: float, work: Path) -> Outcome:
    outcome = _run_worker("gpu_throughput", gpu_throughput_options(args), gpu_throughput_table, "rows", limit, work)
    outcome.body = ("benchmarks/throughput.py's models and batch (8 utterances x 4 s, 20 tokens each, vocabulary "
                    f"256) on the GPU: median of {args.throughput_rounds} training steps after 3 warm-up steps, the "
                    "models interleaved; FLOPs counted by `torch.utils.flop_counter`.\n\n" + outcome.body)
    return outcome


# ---- part 5: benchmarks/throughput.py on the CPU ----------------------------------------------

def cpu_throughput_command(args: argparse.Namespace) -> list[str]:
    threads = str(min(16, os.cpu_count() or 2))
    return [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--preset", "small", "--rounds",
            str(args.cpu_rounds), "--warmup", "1", "--threads", threads, "--json"]


def cpu_throughput_result(output: str) -> Optional[dict]:
    """The JSON line ``throughput.py --json`` prints last."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def cpu_throughput_table(result: dict) -> str:
    header = ["preset", "precision", "model", "params_m", "step_s", "audio_s_per_s", "gflop_per_step", "gflop_s",
              "utilization", "speedup_vs_torchaudio"]
    lines = [f"CPU: {result.get('cpu', 'unknown')}; {result.get('threads')} threads; matmul peak "
             + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in result.get("matmul_peak_gflop_s", {}).items()) + "\n",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(row.get(h, "")) for h in header) + " |" for row in result.get("rows", [])]
    return "\n".join(lines)


def run_cpu_throughput(args: argparse.Namespace, limit: float, work: Path) -> Outcome:
    finished = run_limited(cpu_throughput_command(args), limit, work / "cpu_throughput.log")
    result = cpu_throughput_result(finished.output)
    note = ("benchmarks/throughput.py measures the CPU only (it has no --device flag): these rows are the GPU "
            "machine's CPU, preset small, for comparison with the CPU tables in the README.\n\n")
    if finished.returncode == 0 and result:
        rows = result.get("rows", [])
        return Outcome("passed", finished.seconds, note + cpu_throughput_table(result), f"{len(rows)} CPU rows")
    failure = _failure(finished, limit, "CPU throughput")
    return Outcome(failure.status, finished.seconds, note + failure.body, failure.summary)


RUNNERS: dict[str, Callable[[argparse.Namespace, float, Path], Outcome]] = {
    "pytest": run_pytest, "recipe": run_recipe, "memory": run_memory, "gpu_throughput": run_gpu_throughput,
    "cpu_throughput": run_cpu_throughput}
TITLES = {"pytest": "GPU tests (pytest -m gpu)", "recipe": "T4 recipe (run_training_memory_optimized.sh)",
          "memory": "Memory options (benchmarks/memory.py)", "gpu_throughput": "Training throughput on the GPU",
          "cpu_throughput": "Training throughput on the CPU (benchmarks/throughput.py)"}


def budgets(args: argparse.Namespace) -> dict[str, str]:
    """What each part runs, as a budget of tests, steps or rows."""
    return {
        "pytest": "every test marked gpu (each bounded by steps)",
        "recipe": f"{args.recipe_steps} optimizer steps (x 4 micro-batches of 2), validation "
                  + ("every 200 steps and " if args.recipe_steps > 200 else "") + "at the end",
        "memory": f"{args.memory_rows} configurations x {len(args.memory_presets)} preset(s) "
                  f"({', '.join(args.memory_presets)}), 3 steps each",
        "gpu_throughput": f"{len(args.throughput_presets)} presets x 3 precisions x 3 models, "
                          f"{args.throughput_rounds} + 3 steps each",
        "cpu_throughput": f"preset small, 3 models, {args.cpu_rounds} rounds + 1 warm-up step, fp32 (and bf16 "
                          "where the CPU is fast at it)",
    }


def commands(args: argparse.Namespace) -> dict[str, str]:
    xml = Path("<work>") / "pytest.xml"
    return {
        "pytest": shlex.join(pytest_command(xml)),
        "recipe": "TRAIN_MANIFEST=<corpus>/train.jsonl VALID_MANIFEST=<corpus>/valid.jsonl OUTPUT_DIR=<work>/t4_run "
                  + shlex.join(recipe_command(args)),
        "memory": shlex.join(worker_command("memory", memory_options(args))),
        "gpu_throughput": shlex.join(worker_command("gpu_throughput", gpu_throughput_options(args))),
        "cpu_throughput": shlex.join(cpu_throughput_command(args)),
    }


# ---- the report -------------------------------------------------------------------------------

def _command_output(cmd: list[str]) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""


def environment() -> dict[str, str]:
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 (a build without NCCL)
        nccl = "none"
    try:
        from konkanivani.training.precision import cpu_description
        cpu = cpu_description()
    except Exception:  # noqa: BLE001 (the package does not import: the parts will say why)
        cpu = platform.processor() or platform.machine()
    try:
        imports = subprocess.run([sys.executable, "-c", "import konkanivani.training.loop, konkanivani.cli.train"],
                                 capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=120)
        why = "" if imports.returncode == 0 else (imports.stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired:
        why = "importing it took over 120 s"
    package = f"DOES NOT IMPORT: {why} (install its dependencies)" if why else "imports"
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"])
    dirty = bool(_command_output(["git", "status", "--porcelain", "--untracked-files=no"]))
    return {
        "GPU": f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()} ({props.total_memory / 2 ** 30:.1f} GiB, "
               f"compute capability {props.major}.{props.minor}, {props.multi_processor_count} SMs)",
        "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0]
        or "unknown (no nvidia-smi)",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl})",
        "Python": f"{platform.python_version()} on {platform.platform()}",
        "CPU": f"{cpu}; {os.cpu_count()} cores",
        "konkanivani": package,
        "espeak-ng": shutil.which("espeak-ng") or "not installed (the recipe then trains on tone sequences)",
        "commit": (commit + (" with uncommitted changes" if dirty else "")) if commit else "unknown (no git here)",
    }


def report_path(out: Path, gpu_name: str, today: datetime.date) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
    return out / f"{today.isoformat()}-{slug}.md"


def render(env: dict[str, str], started: datetime.datetime, command: str, results: dict[str, Outcome],
           limits: dict[str, float], plan: dict[str, str]) -> str:
    total = sum(o.seconds for o in results.values())
    lines = [f"# GPU report: {env['GPU'].split(' x ')[0]}", "",
             f"{started.strftime('%Y-%m-%d %H:%M')} UTC, `{command}`; {total:.0f} s in all.", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += ["", "| part | status | seconds | limit | budget | result |", "| --- | --- | --- | --- | --- | --- |"]
    for name, o in results.items():
        lines.append(f"| {name} | {o.status} | {o.seconds:.0f} | {limits.get(name, 0):.0f} | {plan[name]} | "
                     f"{o.summary.replace('|', '/')} |")
    for name, o in results.items():
        lines += ["", f"## {TITLES[name]}", "", f"Status: **{o.status}** in {o.seconds:.0f} s.", "", o.body.rstrip()]
    return "\n".join(lines) + "\n"


def print_plan(args: argparse.Namespace) -> None:
    plan, cmds = budgets(args), commands(args)
    print(f"gpu_report plan: {len(args.parts)} parts within {args.total_timeout:.0f} s")
    for name in args.parts:
        print(f"- {name}: at most {min(TIMEOUTS[name], args.total_timeout):.0f} s; {plan[name]}\n    {cmds[name]}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        kind, options = args.worker[0], json.loads(args.worker[1])
        {"memory": memory_worker, "gpu_throughput": gpu_throughput_worker}[kind](options, _emit)
        return 0
    if args.dry_run:
        print_plan(args)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_report: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing to measure",
              file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    deadline = time.monotonic() + args.total_timeout  # from here: the report's own checks count too
    env = environment()
    if env["konkanivani"] != "imports":
        print(f"gpu_report: konkanivani {env['konkanivani']}; every part will fail", file=sys.stderr, flush=True)
    path = report_path(args.out, torch.cuda.get_device_name(0), started.date())
    results: dict[str, Outcome] = {}
    limits: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_report_") as tmp:
        work = Path(tmp)
        for name in args.parts:
            left = deadline - time.monotonic()
            limits[name] = min(TIMEOUTS[name], left)
            if limits[name] < 10:
                results[name] = Outcome("not run", 0.0, f"Not run: {left:.0f} s of --total_timeout were left.",
                                        "no time left")
                continue
            print(f"gpu_report: {name} (at most {limits[name]:.0f} s) ...", file=sys.stderr, flush=True)
            try:
                results[name] = RUNNERS[name](args, limits[name], work)
            except Exception as e:  # noqa: BLE001 (one part's bug must not cost the others' results)
                results[name] = Outcome("failed", 0.0, f"The report's own code failed: `{type(e).__name__}: {e}`",
                                        f"{type(e).__name__}")
            print(f"gpu_report: {name}: {results[name].status} in {results[name].seconds:.0f} s", file=sys.stderr,
                  flush=True)
    command = shlex.join(["python3", "benchmarks/gpu_report.py", *(sys.argv[1:] if argv is None else argv)])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(env, started, command, results, limits, budgets(args)), encoding="utf-8")
    print(path)
    return 0 if all(o.status == "passed" for o in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
