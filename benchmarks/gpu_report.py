#!/usr/bin/env python3
"""Everything that needs a CUDA GPU, in two commands of 10 minutes, a Markdown report each.

On the GPU machine, two calls one after the other (its device tool: carry ``data/gpu_corpus``
and ``benchmarks/wheels``, timeout_s 600; the machine has no network and no espeak-ng)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site benchmarks/wheels/*.whl && export PYTHONPATH=/tmp/site && \
        python3 benchmarks/gpu_report.py --corpus data/gpu_corpus --out $OUT/gpu
    # the same, then: ... --out $OUT/gpu --parts recipe      (its report: <date>-<gpu>-recipe.md)

Before that call, on a machine with espeak-ng and a network (both folders are ignored by git)::

    python3 benchmarks/gpu_report.py --make_corpus data/gpu_corpus   # the demo corpus, Opus
    python3 benchmarks/gpu_report.py --make_wheels benchmarks/wheels  # what the GPU image lacks

``--make_corpus`` synthesizes the demo corpus (``konkanivani-demo-corpus --num_utterances
--corpus_utterances``), writes its training split as tar shards (``konkanivani-prepare shards``:
``shards/shards.json``) and its validation split as files with ``valid.jsonl``, all in Opus (or
FLAC, ``--corpus_format``: Opus lets the whole demo corpus travel in one call), and prints its size.
``--make_wheels`` downloads (``pip download``, for CPython 3.12 on x86-64 Linux) the package's
dependencies the GPU image lacks, pinned in WHEELS (jiwer with rapidfuzz, soundfile with cffi and
pycparser, braceexpand, webvtt-py, bitsandbytes) and SOURCE_WHEELS (srt, built here into a wheel),
bitsandbytes kept to the CUDA libraries of --wheel_cuda (130: the image's torch is built with CUDA
13.0), which take it from 41 to ~4 MiB.

The parts, in this order, each in a process group of its own that is killed at its time limit,
all of a call's within --total_timeout (590 s): the first five by default, the recipe in the second
call; ``--dry_run`` prints each part's command, budget and limit and their total:

* ``pytest``: ``python -m pytest -m gpu`` (tests/test_gpu.py), each test's outcome and time;
* ``memory``: rows of benchmarks/memory.py on CUDA (--memory_rows of its configurations, each a
  fresh process): peak memory, the estimator's figure, step time;
* ``batch_scaling``: benchmarks/throughput.py's models (ours encoder + CTC, ours full: CTC +
  attention decoder, torchaudio's Conformer + CTC) trained at 8/64/256/1,024 utterances x 4 s in
  --scaling_precisions (bf16; fp16 and fp32 when asked): step time, audio seconds a second, FLOP
  rate (torch.utils.flop_counter) and its share of the matmul peak measured here, speed against
  torchaudio, peak memory; a batch that runs out of memory is a row saying so (and the larger ones
  of that model are skipped);
* ``compile``: ours full and ours encoder + CTC with their layers compiled
  (konkanivani/training/compile.py, as the trainer's --compile), bf16, at 256 and 1,024 x 4 s;
* ``trainer``: konkanivani-train end to end (large, bf16, 2 data workers) at --max_batch_seconds
  1,024 (the audio of 256 x 4 s) on the corpus: utterances and audio seconds a second, the share
  of the time it waited for data, peak memory, and its share of the model-only rate measured by
  batch_scaling at the same batch;
* ``recipe``: the T4 recipe as shipped (run_training_memory_optimized.sh, configs/t4.yaml) capped
  to 15 GB (GPU_MEMORY_GB=15 and --gpu_memory_gb 15) for --recipe_seconds (--max_time): its
  losses, speed, memory against the cap, and the validation CER it reached (latest.pt scored by
  konkanivani-evaluate, greedy CTC as the trainer's validation);
* ``cpu_throughput`` (only when named in --parts): benchmarks/throughput.py on the GPU
  machine's CPU.

The report opens with issue 34's targets (what / measured / target / met?) on the card it names,
then the parts' summary, then each part's tables. It is written again after each part (a call cut
short keeps what was measured), with a JSON file of every row beside it. A part that fails or runs
out of time does not stop the others. Exit status: 0 when every part passed, 1 when one did not,
2 for bad flags, on a machine without a CUDA GPU, or when a preparation mode cannot do its work.
"""

import argparse
import contextlib
import datetime
import functools
import gc
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
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
# This checkout's package, installed or not (the parts get it through PYTHONPATH).
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
SENTENCES = ROOT / "konkanivani" / "resources" / "demo_sentences_kok.txt"

PARTS = ("pytest", "memory", "batch_scaling", "compile", "trainer", "recipe", "cpu_throughput")
# Two calls of the GPU machine measure issue 34's targets: the default parts, then the recipe alone
# (SECOND_CALL), each within TOTAL_TIMEOUT. The GPU machine's CPU says nothing about the targets:
# cpu_throughput runs only when asked for.
DEFAULT_PARTS = ("pytest", "memory", "batch_scaling", "compile", "trainer")
SECOND_CALL = ("recipe",)
# Seconds each part may take at most. The trainer's is TRAINER_SECONDS a run (a batch budget at
# a --pad_to_frames), the
# recipe's --recipe_seconds plus RECIPE_OVERHEAD. Sized from the H200's call of 2026-12-04
# (results/gpu/README.md), which ran all six parts in one call under the limits of then (65, 40,
# 60, 60, 30 and 325 s): the GPU tests take ~110 s (11 of 18 ended in 65 s), the memory row 19 s,
# the batch scaling's 12 points 29 s, the compile part made no row in 60 s (compiling ours full
# at 256 x 4 s alone took 42 s on 2026-11-27), the trainer's 12 steps and save ~32 s, and the
# recipe, started twice (imports, then its --max_time clock), trained past 310 s and left its
# scoring no time. The default parts add up to 420 s (the trainer twice: --pad_to_frames 0 and
# 100) and the recipe alone to 375 s: both within TOTAL_TIMEOUT, with the wheels' install within
# a call's 600 s.
LIMITS = {"pytest": 125, "memory": 30, "batch_scaling": 45, "compile": 130, "cpu_throughput": 40}
TRAINER_SECONDS = 45
# The recipe's imports before its --max_time clock starts (twice: the script checks them first),
# its last step and save, and scoring latest.pt.
RECIPE_OVERHEAD = 75
EVALUATE_SECONDS = 30  # of the recipe's limit, kept for scoring latest.pt
TOTAL_TIMEOUT = 590
DEVICE_LIMIT = 600  # one call of the GPU machine (timeout_s), the wheels' install included
CORPUS_TIMEOUT = 60  # making a small demo corpus on the GPU machine when none was given
TAIL_LINES = 40  # of a failed part's output, in the report
GIB = 2 ** 30
MIB = 2 ** 20
CARRY_LIMIT_MIB = 64  # what one call of the GPU machine carries: the checkout and the carried paths

CORPUS = "data/gpu_corpus"
CODEC_NAMES = {"opus": "Opus", "flac": "FLAC"}  # --corpus_format's, as tables write them
WHEEL_DIR = "benchmarks/wheels"
DEVICE_CARRY = (CORPUS, WHEEL_DIR)
# The package's dependencies the GPU image (CPython 3.12, torch 2.11+cu130) lacks, with theirs,
# as tested; bitsandbytes for the 8-bit AdamW test and memory rows.
WHEELS = {"jiwer": "4.0.0", "rapidfuzz": "3.14.6", "soundfile": "0.14.0", "cffi": "2.1.1",
          "pycparser": "3.12", "braceexpand": "0.1.7", "webvtt-py": "0.6.0",
          "bitsandbytes": "0.50.2"}
# Pure-Python dependencies published as source alone: built into a wheel here (py3-none-any).
SOURCE_WHEELS = {"srt": "3.5.3"}
# The package's dependencies the GPU image holds already (its package list); every other one of
# pyproject.toml's is in WHEELS or SOURCE_WHEELS (tests/test_gpu.py checks), or test modules and
# the package's CLIs fail to import there.
IMAGE_HAS = ("torch", "torchaudio", "sentencepiece", "numpy", "tqdm", "pyyaml")
WHEEL_PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                   "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                   "manylinux1_x86_64")
SHARD_SIZE = 50  # utterances per shard of the corpus: ~10 shards for 2 data workers to share

# Issue 34's targets.
T4_CAP_GB = 15.0
T4_UTT_PER_S = 1000.0
T4_MEMORY_SHARE = 0.60
T4_CER = 0.08
T4_CER_SECONDS = 300
TRAINER_SHARE = 0.85
TRAINER_DATA_WAIT = 0.05
ENC_CTC_SPEEDUP = 1.3
FULL_AUDIO_S_PER_S = 25000.0
ESTIMATE_RANGE = (0.75, 1.25)
CPU_SPEEDUP = 1.1
SECONDS_EACH = 4.0  # the batch scaling's utterances
# The trainer's first steps (its workers starting, the allocator growing): not rated.
TRAINER_WARMUP_STEPS = 4


def device_command(corpus: str = CORPUS, wheels: str = WHEEL_DIR,
                   parts: tuple[str, ...] = ()) -> str:
    """A command the GPU machine runs: the wheels installed, then the report of ``parts`` (the
    default ones when empty)."""
    chosen = f" --parts {','.join(parts)}" if parts else ""
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
            f"--target /tmp/site {wheels}/*.whl && export PYTHONPATH=/tmp/site && "
            f"python3 benchmarks/gpu_report.py --corpus {corpus} --out $OUT/gpu{chosen}")


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


def _int_list(text: str) -> list[int]:
    values = [_positive_int(item.strip()) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"give a comma list of positive integers, got {text!r}")
    return values


def _pad_list(text: str) -> list[int]:
    values = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        if not item.isdigit():
            raise argparse.ArgumentTypeError(f"give a comma list of frame counts (0: off), got "
                                             f"{text!r}")
        values.append(int(item))
    if not values:
        raise argparse.ArgumentTypeError(f"give a comma list of frame counts, got {text!r}")
    return values


def _parts(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(PARTS)}")
    return [name for name in PARTS if name in names]  # always in the report's order


def _limit(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in PARTS or not seconds:
        raise argparse.ArgumentTypeError(f"give PART=SECONDS with a part of {', '.join(PARTS)}, "
                                         f"got {text!r}")
    return name, _positive_float(seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="parts: " + ", ".join(PARTS))
    add = parser.add_argument
    add("--worker", nargs=2, metavar=("KIND", "JSON"), help=argparse.SUPPRESS)
    add("--parts", type=_parts, default=list(DEFAULT_PARTS),
        help=f"comma list of the parts to run (default: {','.join(DEFAULT_PARTS)})")
    add("--out", type=Path, default=RESULTS, help=f"folder of the report (default: {RESULTS})")
    add("--total_timeout", type=_positive_float, default=float(TOTAL_TIMEOUT),
        help="seconds for all parts together; a part gets what is left if that is less than its "
             f"own limit (default: {TOTAL_TIMEOUT})")
    add("--limit", type=_limit, action="append", default=[], metavar="PART=SECONDS",
        help="another time limit for a part (repeatable), e.g. --limit pytest=90")
    add("--corpus", type=Path, default=None,
        help="the corpus of the trainer and the recipe: a folder from --make_corpus "
             "(shards/shards.json and valid.jsonl), or one with train.jsonl and valid.jsonl "
             f"(default: {CORPUS} or data/demo when complete, else a small one made here)")
    add("--make_corpus", type=Path, metavar="DIR",
        help="make the corpus in DIR (needs espeak-ng; no GPU) and exit")
    add("--from_demo", type=Path, metavar="DIR", default=None,
        help="with --make_corpus: take the demo corpus already made in DIR "
             "(konkanivani-demo-corpus --output_dir DIR, of --corpus_utterances) rather than "
             "synthesizing it again")
    add("--corpus_utterances", type=_positive_int, default=4800,
        help="utterances of the demo corpus --make_corpus makes (default: 4,800, the demo "
             "corpus's own: 3,840 train, 388 valid)")
    add("--corpus_format", choices=("opus", "flac"), default="opus",
        help="the audio of --make_corpus's shards and valid files (default: opus, about a tenth "
             "of FLAC's bytes)")
    add("--make_wheels", type=Path, metavar="DIR",
        help="download the wheels the GPU machine lacks into DIR (needs a network) and exit")
    add("--wheel_cuda", default="130",
        help="CUDA versions whose bitsandbytes libraries --make_wheels keeps, a comma list "
             "(default: 130)")
    add("--recipe_seconds", type=_positive_int, default=T4_CER_SECONDS,
        help=f"the T4 recipe's --max_time (default: {T4_CER_SECONDS}; issue 34's CER target is "
             "after 5 minutes)")
    add("--gpu_memory_gb", type=_positive_float, default=T4_CAP_GB,
        help=f"the recipe's cap, as a T4 has (default: {T4_CAP_GB:g})")
    add("--memory_presets", default="large",
        help="comma list of presets for the memory rows (default: large)")
    add("--memory_rows", type=_int_list, default=[1],
        help="benchmarks/memory.py's configurations on CUDA to measure, numbered from 1 in its "
             "order (default: 1, the baseline; 1,6,9 adds all combined and "
             "--offload_activations, with --limit memory=110)")
    add("--memory_seconds", type=_positive_float, default=15.0,
        help="utterance length of the memory rows (2 per step; default: 15)")
    add("--scaling_presets", default="large",
        help="comma list of presets of the batch scaling and compile parts (default: large)")
    add("--scaling_utterances", type=_int_list, default=[8, 64, 256, 1024],
        help="batches of the batch scaling, in utterances of 4 s (default: 8,64,256,1024)")
    add("--scaling_precisions", default="bf16",
        help="precisions of the batch scaling, in this order (default: bf16, the targets'; "
             "bf16,fp16,fp32 with --limit batch_scaling=130)")
    add("--scaling_rounds", type=_positive_int, default=3,
        help="timed steps of each model at each point, after a warm-up step (default: 3)")
    add("--compile_utterances", type=_int_list, default=[256],
        help="batches of the compiled models, bf16 (default: 256; 256,1024 with --limit "
             "compile=220)")
    add("--trainer_batch_seconds", type=_int_list, default=[1024],
        help="--max_batch_seconds of the trainer's runs, one run each (default: 1024: the audio "
             "of 256 x 4 s)")
    add("--trainer_pad_to_frames", type=_pad_list, default=[0, 100],
        help="the trainer's --pad_to_frames, a run each at each batch budget (default: 0,100: "
             "batches of any shape, then of a few; the H200 call of 2026-12-04 ran at 12%% of "
             "the model alone, whose batches all have one shape)")
    add("--trainer_steps", type=_positive_int, default=12,
        help="optimizer steps of each trainer run; the rates leave out the first "
             f"{TRAINER_WARMUP_STEPS} (default: 12)")
    add("--trainer_workers", type=_positive_int, default=2,
        help="the trainer's --num_workers (default: 2, as on a Colab T4)")
    add("--trainer_preset", default="large", help="the trainer's preset (default: large)")
    add("--trainer_precision", default="bf16", help="the trainer's precision (default: bf16)")
    add("--cpu_rounds", type=_positive_int, default=3,
        help="rounds of benchmarks/throughput.py on the CPU, preset small (default: 3)")
    add("--dry_run", action="store_true",
        help="print the plan (each part's command, budget and time limit, their total and the "
             "device command) and exit; needs no GPU")
    return parser


PRESETS = ("tiny", "small", "medium", "large")
PRECISIONS = ("fp32", "bf16", "fp16")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, known in (("memory_presets", PRESETS), ("scaling_presets", PRESETS),
                        ("scaling_precisions", PRECISIONS)):
        items = [p.strip() for p in getattr(args, flag).split(",") if p.strip()]
        if not items or any(p not in known for p in items):
            parser.error(f"--{flag} {getattr(args, flag)!r}: give a comma list of "
                         f"{', '.join(known)}")
        setattr(args, flag, items)
    for flag, known in (("trainer_preset", PRESETS), ("trainer_precision", PRECISIONS)):
        if getattr(args, flag) not in known:
            parser.error(f"--{flag} {getattr(args, flag)!r}: choose from {', '.join(known)}")
    args.limit = dict(args.limit)
    return args


def part_limits(args: argparse.Namespace) -> dict[str, float]:
    """Each part's time limit: its default (the trainer's per batch budget, the recipe's after
    --recipe_seconds) or --limit's."""
    limits = {**LIMITS, "trainer": TRAINER_SECONDS * len(args.trainer_batch_seconds)
              * len(args.trainer_pad_to_frames),
              "recipe": args.recipe_seconds + RECIPE_OVERHEAD}
    limits.update(args.limit)
    return {name: float(limits[name]) for name in PARTS}


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
    ``timeout`` seconds the whole group (the benchmarks' worker processes, the data loader's
    workers) is sent SIGTERM, then SIGKILL 10 s later."""
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
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
    output = log.read_text(encoding="utf-8", errors="replace")
    return Finished(returncode, time.monotonic() - start, output)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "```\n" + "\n".join(line[:300] for line in kept) + "\n```"


@dataclass
class Outcome:
    status: str  # passed, failed, timed out, not run
    seconds: float
    body: str  # Markdown
    summary: str = ""  # one line for the summary table
    data: dict = field(default_factory=dict)  # the measured rows, for the targets and the JSON


def _failure(finished: Finished, limit: float, what: str) -> Outcome:
    if finished.timed_out:
        return Outcome("timed out", finished.seconds,
                       f"Killed at its time limit of {limit:.0f} s. The end of its output:\n\n"
                       f"{tail(finished.output)}", f"{what}: killed at {limit:.0f} s")
    return Outcome("failed", finished.seconds,
                   f"Exit status {finished.returncode}. The end of its output:\n\n"
                   f"{tail(finished.output)}", f"{what}: exit status {finished.returncode}")


def _num(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _cell(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


# ---- part: pytest -m gpu ----------------------------------------------------------------------

def pytest_command(xml: Path) -> list[str]:
    # the project's addopts left out: no worker processes on one card (nor xdist installed there);
    # gpu_pytest_rows (this folder's) writes each test's row as it ends, for a run killed early
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-v", "-rA",
            "-p", "no:cacheprovider", "-p", "gpu_pytest_rows",
            "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1"]


def pytest_env(rows: Path) -> dict[str, str]:
    """The pytest part's environment: the plugin importable, the file of its rows named."""
    env = child_env(KONKANIVANI_PYTEST_ROWS=str(rows))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), env["PYTHONPATH"]])
    return env


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
                    # A test module that did not import: say why.
                    outcome = "collection error"
                    lines = reversed((child.text or "").splitlines())
                    message = next((line[1:].strip() for line in lines if line.startswith("E ")),
                                   message)
                break
        first = next((line.strip() for line in message.splitlines() if line.strip()), "")
        rows.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0.0),
                     "message": first[:240]})
    return rows


_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_RUNNING_LINE = re.compile(r"^(\S+::\S+)\s*$")


def verbose_outcomes(output: str) -> list[dict[str, Any]]:
    """The outcomes pytest -v printed, for a run killed before it wrote its XML report; the test
    it was running then (its name printed, no outcome yet) as "killed"."""
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
             "XFAIL": "xfailed", "XPASS": "xpassed"}
    lines = output.rstrip().splitlines()
    rows = [{"test": m.group(1), "outcome": names[m.group(2)], "seconds": float("nan"),
             "message": ""} for m in map(_VERBOSE_LINE.match, lines) if m]
    running = _RUNNING_LINE.match(lines[-1]) if lines else None
    if running:
        rows.append({"test": running.group(1), "outcome": "killed", "seconds": float("nan"),
                     "message": "running when the part's time limit was reached"})
    return rows


def streamed_outcomes(rows_file: Path, output: str) -> list[dict[str, Any]]:
    """A killed run's rows: gpu_pytest_rows' lines (outcome, seconds, message) for the tests
    that ended, then what pytest -v printed of the others (the one it was running)."""
    rows = []
    if rows_file.is_file():
        for line in rows_file.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # the line being written when the run was killed
    seen = {r["test"] for r in rows}
    return rows + [r for r in verbose_outcomes(output) if r["test"] not in seen]


def pytest_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| test | outcome | seconds | message |", "| --- | --- | --- | --- |"]
    for r in rows:
        seconds = "" if math.isnan(r["seconds"]) else f"{r['seconds']:.1f}"
        lines.append(f"| `{r['test']}` | {r['outcome']} | {seconds} | {_cell(r['message'])} |")
    return "\n".join(lines)


def _count(rows: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no test ran"


def run_pytest(args: argparse.Namespace, limit: float, work: Path,
               done: dict[str, Outcome]) -> Outcome:
    """Passed when every selected test passed, was skipped or failed as expected (xfail). A test
    module that does not import here (a dependency of a CPU test missing on the GPU machine) is
    listed as a collection error, and fails the part only when no GPU test ran."""
    xml, streamed = work / "pytest.xml", work / "pytest_rows.jsonl"
    finished = run_limited(pytest_command(xml), limit, work / "pytest.log",
                           env=pytest_env(streamed))
    rows = (junit_outcomes(xml.read_text(encoding="utf-8")) if xml.is_file()
            else streamed_outcomes(streamed, finished.output))
    table = pytest_table(rows) if rows else "No test outcome was reported."
    tests = [r for r in rows if r["outcome"] != "collection error"]
    bad = [r for r in tests if r["outcome"] in ("failed", "error")]
    ok = (not finished.timed_out and tests and not bad
          and (finished.returncode == 0 or len(tests) < len(rows)))
    summary = _count(rows)
    data = {"rows": rows}
    if ok:
        return Outcome("passed", finished.seconds, f"{summary}.\n\n{table}", summary, data)
    failure = _failure(finished, limit, summary)
    return Outcome(failure.status, finished.seconds, f"{summary}.\n\n{table}\n\n{failure.body}",
                   failure.summary, data)


# ---- the corpus -------------------------------------------------------------------------------

def write_tone_corpus(out: Path, train: int = 48, valid: int = 8, seed: int = 3,
                      sentences: int = 24, sample_rate: int = 16000) -> Path:
    """A corpus that needs no speech synthesizer: each transcript (a Konkani demo sentence) read as
    one 80 ms tone per character, its pitch set by the character, in faint noise; manifests
    ``train.jsonl`` and ``valid.jsonl`` as the demo corpus has them. A model can learn it, but it
    is no speech: it exercises training, it measures nothing about recognition."""
    import random

    import numpy as np
    import soundfile as sf

    lines = SENTENCES.read_text(encoding="utf-8").splitlines()
    texts = [line.strip() for line in lines if line.strip()]
    random.Random(seed).shuffle(texts)
    texts = texts[:sentences]
    rng = np.random.default_rng(seed)
    (out / "wavs").mkdir(parents=True, exist_ok=True)
    per_char = int(0.08 * sample_rate)
    edges = np.minimum(np.arange(per_char), np.arange(per_char)[::-1])
    ramp = np.minimum(1.0, edges / (0.01 * sample_rate))
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
                wobble = 1 + 0.02 * rng.standard_normal()
                pieces.append(0.3 * ramp * np.sin(2 * np.pi * freq * wobble * t))
            pieces.append(np.zeros(int(0.15 * sample_rate)))
            wav = np.concatenate(pieces)
            wav = wav + 0.003 * rng.standard_normal(len(wav))
            name = f"wavs/{split}_{i:04d}.wav"
            sf.write(out / name, wav.astype(np.float32), sample_rate, subtype="PCM_16")
            rows.append({"audio_filepath": name, "duration": round(len(wav) / sample_rate, 4),
                         "text": text})
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return out


@dataclass
class Corpus:
    """What the trainer and the recipe train on: training shards or a training manifest, and a
    validation manifest."""

    valid: Path
    about: str  # a sentence for the report
    train_shards: Optional[Path] = None  # a shards.json
    train_manifest: Optional[Path] = None

    def durations(self) -> list[float]:
        if self.train_shards is not None:
            listing = json.loads(self.train_shards.read_text(encoding="utf-8"))
            return [float(d) for shard in listing["shards"] for d in shard["durations"]]
        return [float(row["duration"]) for row in _manifest_rows(self.train_manifest)]


def _manifest_rows(path: Path) -> list[dict]:
    """A manifest's rows, each audio path made absolute (manifests name them relative to their
    folder)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            row["audio_filepath"] = str((path.parent / row["audio_filepath"]).resolve())
            rows.append(row)
    return rows


def _has_manifests(folder: Path) -> bool:
    return (folder / "train.jsonl").is_file() and (folder / "valid.jsonl").is_file()


def _is_gpu_corpus(folder: Path) -> bool:
    return (folder / "shards" / "shards.json").is_file() and (folder / "valid.jsonl").is_file()


def open_corpus(folder: Path) -> Optional[Corpus]:
    """The corpus in ``folder``: --make_corpus's layout, or train.jsonl and valid.jsonl; None
    when it holds neither."""
    if _is_gpu_corpus(folder):
        info = folder / "corpus.json"
        made = json.loads(info.read_text(encoding="utf-8")) if info.is_file() else {}
        codec = CODEC_NAMES[made.get("audio_format", "flac")]  # made before the choice: FLAC
        what = (f"the demo corpus in `{folder}` ({made['train']} training utterances in {codec} "
                f"shards, {made['valid']} validation utterances; made with "
                f"`{made['command']}`)" if made else f"the shard corpus in `{folder}`")
        return Corpus(folder / "valid.jsonl", what, train_shards=folder / "shards" / "shards.json")
    if _has_manifests(folder):
        return Corpus(folder / "valid.jsonl", f"the corpus in `{folder}`",
                      train_manifest=folder / "train.jsonl")
    return None


def resolve_corpus(args: argparse.Namespace, limit: float,
                   work: Path) -> tuple[Optional[Corpus], Optional[Outcome]]:
    """The corpus the trainer and the recipe use, or an ``Outcome`` saying why there is none;
    found or made once a report (kept in ``args``)."""
    if getattr(args, "resolved_corpus", None) is not None:
        return args.resolved_corpus, None
    corpus = None
    if args.corpus is not None:
        corpus = open_corpus(args.corpus)
        if corpus is None:
            why = (f"--corpus {args.corpus}: neither shards/shards.json with valid.jsonl "
                   "(--make_corpus) nor train.jsonl with valid.jsonl there.")
            return None, Outcome("failed", 0.0, why, "no corpus")
    else:
        corpus = open_corpus(ROOT / CORPUS) or open_corpus(ROOT / "data" / "demo")
    if corpus is None:
        corpus, problem = _small_corpus(args, limit, work)
        if problem is not None:
            return None, problem
    args.resolved_corpus = corpus
    return corpus, None


def _small_corpus(args: argparse.Namespace, limit: float,
                  work: Path) -> tuple[Optional[Corpus], Optional[Outcome]]:
    """Where no corpus was given or found: a small demo corpus made here with espeak-ng, or
    without it synthetic tone sequences."""
    folder = Path(tempfile.gettempdir()) / f"konkanivani-gpu-report-demo-{args.corpus_utterances}"
    if shutil.which("espeak-ng") is None:
        tones = folder.with_name(folder.name + "-tones")
        if not _has_manifests(tones):
            write_tone_corpus(tones, train=args.corpus_utterances * 9 // 10,
                              valid=max(8, args.corpus_utterances // 10), sentences=200)
        return Corpus(tones / "valid.jsonl",
                      f"**synthetic tone sequences** ({args.corpus_utterances} utterances in "
                      f"`{tones}`): espeak-ng is not installed here and no corpus was given, so "
                      "the speeds are real but the scores say nothing about speech",
                      train_manifest=tones / "train.jsonl"), None
    cmd = [sys.executable, "-m", "konkanivani.cli.demo_corpus", "--output_dir", str(folder),
           "--num_utterances", str(args.corpus_utterances), "--jobs",
           str(min(16, os.cpu_count() or 2))]
    finished = run_limited(cmd, min(CORPUS_TIMEOUT, limit), work / "corpus.log")
    if finished.returncode != 0 or not _has_manifests(folder):
        failure = _failure(finished, min(CORPUS_TIMEOUT, limit), "making the demo corpus")
        return None, Outcome(failure.status, finished.seconds,
                             "Making the demo corpus failed: " + failure.body, failure.summary)
    return Corpus(folder / "valid.jsonl",
                  f"a demo corpus made here with `{shlex.join(cmd[2:])}` in "
                  f"{finished.seconds:.0f} s", train_manifest=folder / "train.jsonl"), None


def corpus_rows(corpus: Corpus, work: Path) -> list[dict]:
    """The corpus's training utterances as manifest rows with absolute paths; shards are unpacked
    into ``work`` once (FLAC or Opus files as they are in the shards)."""
    if corpus.train_manifest is not None:
        return _manifest_rows(corpus.train_manifest)
    from konkanivani.data.shards import META_MEMBER, audio_member, iter_shard, read_shard_list

    folder = work / "train_flac"
    done = folder / "rows.json"
    if done.is_file():
        return json.loads(done.read_text(encoding="utf-8"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in read_shard_list(corpus.train_shards).shards:
        for key, files in iter_shard(shard.path):
            meta = json.loads(files[META_MEMBER].decode("utf-8"))
            member = audio_member(files)
            audio = folder / f"{key}.{member}"
            audio.write_bytes(files[member])
            rows.append({"audio_filepath": str(audio), "duration": meta["duration"],
                         "text": meta["text"]})
    done.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return rows


def write_repeated_manifest(rows: list[dict], path: Path, audio_seconds: float) -> int:
    """``rows`` repeated until they hold ``audio_seconds`` of audio (a trainer's steps then stay
    inside one epoch: no epoch's end validates and saves among the steps measured); the repeats."""
    total = sum(float(r["duration"]) for r in rows)
    repeats = max(1, math.ceil(audio_seconds / max(total, 1e-9)))
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(repeats):
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return repeats


# ---- preparation: the corpus and the wheels (on a machine with espeak-ng and a network) --------

class PreparationError(Exception):
    """A preparation mode cannot do its work: one line, exit status 2."""


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def checkout_bytes() -> int:
    """Bytes of what a call of the GPU machine sends besides the carried paths: tracked files and
    untracked files git does not ignore."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    names = [ROOT / name for name in listed.decode("utf-8", "replace").split("\0") if name]
    return sum(p.stat().st_size for p in names if p.is_file())


def _run_checked(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise PreparationError(f"{what} failed (exit status {result.returncode}): {last}")


def audio_manifest(manifest: Path, out: Path, folder: str = "valid",
                   audio_format: str = "opus") -> list[dict]:
    """``manifest``'s audio as files of ``audio_format`` in ``out/folder`` (16-bit FLAC, lossless
    for 16-bit sources; or Opus, as ``konkanivani-prepare shards --audio_format`` writes it) and its
    rows, paths relative to ``out``, in ``out/<manifest's name>``."""
    import soundfile as sf

    from konkanivani.datatools.shard_writer import AUDIO_WRITE

    (out / folder).mkdir(parents=True, exist_ok=True)
    rows = []
    for row in _manifest_rows(manifest):
        source = Path(row["audio_filepath"])
        audio, rate = sf.read(source, dtype="int16")
        name = f"{folder}/{source.stem}.{audio_format}"
        sf.write(out / name, audio, rate, **AUDIO_WRITE[audio_format])
        rows.append({**row, "audio_filepath": name})
    with open(out / manifest.name, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return rows


def _demo_of_size(demo: Path, utterances: int) -> None:
    """Refuse ``demo`` unless it is a whole demo corpus of ``utterances``."""
    info_file = demo / "corpus_info.json"
    try:
        made = json.loads(info_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PreparationError(f"{info_file}: not a demo corpus's record ({e})") from None
    if made.get("num_utterances") != utterances:
        raise PreparationError(f"{info_file}: a corpus of {made.get('num_utterances')} "
                               f"utterances, not --corpus_utterances {utterances}")
    for name in ("train.jsonl", "valid.jsonl"):
        if not (demo / name).is_file():
            raise PreparationError(f"{demo / name}: missing; the demo corpus is not whole")


def make_corpus(out: Path, utterances: int, jobs: int, audio_format: str = "opus",
                demo: Optional[Path] = None) -> dict[str, Any]:
    """The demo corpus of ``utterances`` as the GPU machine takes it: training split as tar shards
    (``konkanivani-prepare shards``), validation split as files and valid.jsonl, in
    ``audio_format``, and corpus.json saying how it was made. The corpus is synthesized unless
    ``demo`` names one already made of that size (``konkanivani-demo-corpus``'s folder). Written
    beside ``out`` and renamed into place when whole, so a killed run leaves no corpus that looks
    complete; ``out`` must not hold anything else."""
    if (out / "corpus.json").is_file():
        made = json.loads((out / "corpus.json").read_text(encoding="utf-8"))
        return {**made, "already_there": True}
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PreparationError(f"{out}: exists and holds something else; give an empty or new "
                               "folder")
    if demo is not None:
        _demo_of_size(demo, utterances)
    elif shutil.which("espeak-ng") is None:
        raise PreparationError("espeak-ng is not installed here: the demo corpus is synthesized "
                               "with it (apt-get install espeak-ng)")
    start = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's folder is its owner's alone; a corpus is for everyone to read
    command = ["konkanivani-demo-corpus", "--num_utterances", str(utterances)]
    with tempfile.TemporaryDirectory(prefix="gpu_corpus_") as tmp:
        if demo is None:
            demo = Path(tmp) / "demo"
            _run_checked([sys.executable, "-m", "konkanivani.cli.demo_corpus", "--output_dir",
                          str(demo), "--num_utterances", str(utterances), "--jobs", str(jobs)],
                         "konkanivani-demo-corpus")
        _run_checked([sys.executable, "-m", "konkanivani.cli.prepare", "shards",
                      str(demo / "train.jsonl"), "--output_dir", str(staging / "shards"),
                      "--shard_size", str(SHARD_SIZE), "--audio_format", audio_format,
                      "--no_progress"],
                     "konkanivani-prepare shards")
        valid = audio_manifest(demo / "valid.jsonl", staging, audio_format=audio_format)
    listing = json.loads((staging / "shards" / "shards.json").read_text(encoding="utf-8"))
    info = {"command": shlex.join(command), "audio_format": audio_format,
            "train": listing["utterances"],
            "train_hours": listing["hours"], "shards": len(listing["shards"]),
            "valid": len(valid), "valid_hours": round(sum(r["duration"] for r in valid) / 3600, 6),
            "seconds": round(time.monotonic() - start, 1),
            "made": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    (staging / "corpus.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    if out.is_dir():
        out.rmdir()  # empty (checked above)
    os.replace(staging, out)
    return {**info, "bytes": folder_bytes(out)}


def _carry_line(paths: dict[str, int]) -> str:
    total = sum(paths.values())
    parts = ", ".join(f"{name} {size / MIB:.1f} MiB" for name, size in paths.items())
    verdict = "fits" if total <= CARRY_LIMIT_MIB * MIB else "DOES NOT FIT"
    return (f"a call of the GPU machine carries {total / MIB:.1f} MiB ({parts}): {verdict} in its "
            f"{CARRY_LIMIT_MIB} MiB")


def _carried_sizes(corpus: Optional[Path], wheels: Optional[Path]) -> dict[str, int]:
    """Bytes of the checkout and of the corpus and wheels folders (these or the default ones)."""
    sizes = {"the checkout": checkout_bytes()}
    for given, default in ((corpus, CORPUS), (wheels, WHEEL_DIR)):
        folder = given if given is not None else ROOT / default
        sizes[str(given or default)] = folder_bytes(folder) if folder.is_dir() else 0
    return sizes


def trim_wheel(path: Path, keep_cuda: list[str]) -> int:
    """bitsandbytes' wheel without the GPU libraries of other CUDA versions, ROCm and XPU (it
    picks the one matching torch's CUDA at import), its RECORD to match; the bytes it has now."""
    dropped = re.compile(r"^bitsandbytes/libbitsandbytes_(cuda(\d+)|rocm\d+|xpu\d+)\.so$")

    def drop(name: str) -> bool:
        m = dropped.match(name)
        return bool(m) and not (m.group(2) and m.group(2) in keep_cuda)

    trimmed = path.with_name(path.name + ".part")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if drop(item.filename):
                continue
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode("utf-8").splitlines()
                data = "".join(line + "\n" for line in lines if not drop(line.split(",", 1)[0]))
                data = data.encode("utf-8")
            dst.writestr(item, data)
    os.replace(trimmed, path)
    return path.stat().st_size


def make_wheels(out: Path, cuda: list[str]) -> dict[str, int]:
    """WHEELS downloaded for CPython 3.12 on x86-64 Linux (the GPU image) into ``out``,
    SOURCE_WHEELS built there from their sources; bitsandbytes trimmed to ``cuda``'s libraries.
    Their bytes by file name."""
    out.mkdir(parents=True, exist_ok=True)
    platforms = [flag for name in WHEEL_PLATFORMS for flag in ("--platform", name)]
    specs = [f"{name}=={version}" for name, version in WHEELS.items()]
    _run_checked([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                  "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(out),
                  *specs], "pip download")
    _run_checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                  *(f"{name}=={version}" for name, version in SOURCE_WHEELS.items())],
                 "pip wheel")
    for wheel in out.glob("bitsandbytes-*.whl"):
        trim_wheel(wheel, cuda)
    return {p.name: p.stat().st_size for p in sorted(out.glob("*.whl"))}


# ---- workers: processes of this script that print one JSON line per row -------------------------

@functools.lru_cache(maxsize=None)
def _load(name: str) -> Any:
    """A script of benchmarks/ as a module (they are not a package); loaded once."""
    import importlib.util

    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_rows(output: str) -> list[dict]:
    """The JSON rows a worker printed (lines starting ``ROW ``), however far it came."""
    rows = []
    for line in output.splitlines():
        if line.startswith("ROW "):
            try:
                rows.append(json.loads(line[4:]))
            except json.JSONDecodeError:  # the last line of a worker killed while printing it
                continue
    return rows


def _emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)


def worker_command(kind: str, options: dict[str, Any]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, json.dumps(options)]


def _run_worker(kind: str, options: dict[str, Any], table: Callable[[list[dict]], str],
                counted: Callable[[dict], bool], what: str, limit: float, work: Path) -> Outcome:
    finished = run_limited(worker_command(kind, options), limit, work / f"{kind}.log")
    rows = worker_rows(finished.output)
    body = table(rows) if rows else "No row was measured."
    errors = [r for r in rows if "error" in r]
    summary = f"{len([r for r in rows if counted(r)])} {what}" + (
        f", {len(errors)} failed" if errors else "")
    data = {"rows": rows}
    if finished.returncode == 0 and not errors:
        return Outcome("passed", finished.seconds, body, summary, data)
    failure = _failure(finished, limit, summary)
    if finished.returncode == 0:
        failure = Outcome("failed", finished.seconds, "", summary)
    return Outcome(failure.status, finished.seconds,
                   body + ("\n\n" + failure.body if failure.body else ""), failure.summary, data)


# ---- part: memory rows ------------------------------------------------------------------------

def memory_worker(options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """benchmarks/memory.py's configurations on CUDA, each measured in a fresh process by its own
    ``measure``, one row at a time (so that a part killed at its limit keeps the rows done)."""
    memory = _load("memory")
    configs = memory.configurations(options["half"], cuda=True)
    frames, tokens = int(options["seconds"] * 100), int(options["seconds"] * 5)
    for preset in options["presets"]:
        for number in options["rows"]:
            if number > len(configs):
                emit({"preset": preset, "configuration": f"row {number}",
                      "error": f"benchmarks/memory.py has {len(configs)} configurations on CUDA"})
                continue
            name, config = configs[number - 1]
            spec = {"device": "cuda", "preset": preset, "utterances": 2, "frames": frames,
                    "tokens": tokens, "steps": options["steps"], **config}
            try:
                emit({"preset": preset, "configuration": name,
                      "wanted_optimizer": config["optimizer"], **memory.measure(spec)})
            except RuntimeError as e:
                last = str(e).strip().splitlines()[-1][:300]
                emit({"preset": preset, "configuration": name, "error": last})


def memory_table(rows: list[dict]) -> str:
    lines = ["| preset | configuration | peak MiB | vs baseline | estimate MiB | estimate / peak "
             "| step s | vs baseline |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base: dict[str, dict] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['configuration']} | failed: {_cell(r['error'])} "
                         "| | | | | |")
            continue
        b = base.setdefault(r["preset"], r)
        note = ("" if r.get("optimizer") == r.get("wanted_optimizer")
                else f" (ran {r.get('optimizer')})")
        lines.append(f"| {r['preset']} | {r['configuration']}{note} | {r['peak_mib']:.0f} | "
                     f"{r['peak_mib'] / b['peak_mib']:.2f}x | {r['estimate_mib']:.0f} | "
                     f"{r['estimate_mib'] / r['peak_mib']:.2f} | {r['step_s']:.3f} | "
                     f"{r['step_s'] / b['step_s']:.2f}x |")
    return "\n".join(lines)


def memory_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"presets": args.memory_presets, "rows": args.memory_rows,
            "seconds": args.memory_seconds, "steps": 3, "half": "fp16"}


def run_memory(args: argparse.Namespace, limit: float, work: Path,
               done: dict[str, Outcome]) -> Outcome:
    outcome = _run_worker("memory", memory_options(args), memory_table,
                          lambda r: "peak_mib" in r, "rows", limit, work)
    outcome.body = (f"benchmarks/memory.py's configurations {args.memory_rows} on CUDA, each a "
                    f"fresh process: 2 utterances of {args.memory_seconds:g} s per optimizer "
                    "step, 3 steps (the first not timed), peak = `torch.cuda.max_memory_allocated`"
                    " above the process's start; the estimate is `MemoryEstimator`'s for the "
                    "device measured.\n\n" + outcome.body)
    return outcome


# ---- parts: batch scaling and compile (the models alone) ---------------------------------------

_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
# Where the workers train (the tests run their code on the CPU).
DEVICE = "cuda"


def _dtype(name: str) -> Any:
    import torch

    return None if _DTYPES[name] is None else getattr(torch, _DTYPES[name])


def _matmul_tflops(dtype: Any, size: int = 8192, repeats: int = 5) -> float:
    """Best TFLOP/s of a ``size``-cubed matmul in ``dtype`` on the GPU (fp32 as torch runs it by
    default: TF32 off)."""
    import torch

    a = torch.randn(size, size, device=DEVICE, dtype=dtype)
    b = torch.randn(size, size, device=DEVICE, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return round(2 * size ** 3 / best / 1e12, 1)


def _cuda_step(forward: Callable, optimizer: Any, scaler: Any, batch: tuple,
               dtype: Any) -> tuple[float, float]:
    """One training step (forward, backward, optimizer): its seconds and peak GiB."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autocast(DEVICE, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        loss = forward(*batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() / GIB


def _try_step(forward: Callable, optimizer: Any, scaler: Any, batch: tuple,
              dtype: Any) -> Optional[tuple[float, float]]:
    """``_cuda_step``, or None when it ran out of memory (its memory released first)."""
    import torch

    try:
        return _cuda_step(forward, optimizer, scaler, batch, dtype)
    except torch.cuda.OutOfMemoryError:
        pass  # released outside the handler: its traceback holds the step's tensors
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return None


def _build(name: str, cfg: Any) -> tuple[Any, Any, float]:
    """A model of benchmarks/throughput.py on CUDA, its optimizer (ours: the trainer's fused
    AdamW; torchaudio: torch's default AdamW, as throughput.py), and its FLOPs per utterance of
    4 s (counted on a batch of 8)."""
    import torch

    from konkanivani.training.optim import build_optimizer
    from konkanivani.training.precision import Precision

    tp = _load("throughput")
    device = torch.device(DEVICE)
    torch.manual_seed(0)
    model = tp.MODELS[name](cfg).to(device).train()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if name == "torchaudio"
                 else build_optimizer("adamw", model.parameters(), device, 1e-4, 0.01)[0])
    batch = tuple(t.to(device) for t in tp.make_batch(cfg, 8, SECONDS_EACH, 20))
    try:
        flops = tp.count_flops(model, batch, Precision(None, False, "")) / 8
    except Exception:  # noqa: BLE001 (the FLOP rate is a nicety; the time is the row)
        flops = 0.0
    return model, optimizer, flops


def _row(preset: str, precision: str, name: str, n: int, model: Any, times: list[float],
         peak: float, flops_each: float, matmul_peak: float) -> dict[str, Any]:
    median = statistics.median(times)
    flops = flops_each * n
    return {"preset": preset, "precision": precision, "model": name, "utterances": n,
            "seconds_each": SECONDS_EACH,
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "step_ms": round(1000 * median, 2),
            "audio_s_per_s": round(n * SECONDS_EACH / median, 1),
            "gflop_per_step": round(flops / 1e9, 2), "tflop_s": round(flops / median / 1e12, 2),
            "utilization": round(flops / median / 1e12 / matmul_peak, 4) if flops else None,
            "peak_gib": round(peak, 2)}


def batch_scaling_worker(options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """The three models of benchmarks/throughput.py (its batch: N utterances x 4 s, 20 tokens,
    vocabulary 256) trained on CUDA at each batch and precision: a warm-up step, then
    ``rounds`` steps of each, the models taken in turn round by round (as throughput.py does);
    a model that runs out of memory gets a row saying so and is skipped at the larger batches."""
    import torch

    from konkanivani.config import model_config_from_preset

    tp = _load("throughput")
    peaks = {p: _matmul_tflops(_dtype(p) or torch.float32) for p in options["precisions"]}
    emit({"matmul_peak_tflops": peaks, "tf32": torch.backends.cuda.matmul.allow_tf32})
    for preset in options["presets"]:
        cfg = model_config_from_preset(preset, vocab_size=256, conv_kernel=31)
        built = {name: _build(name, cfg) for name in tp.MODELS}
        for pname in options["precisions"]:
            dtype, out_of_memory = _dtype(pname), {}
            scalers = {name: torch.amp.GradScaler(DEVICE, enabled=pname == "fp16")
                       for name in built}
            for n in options["utterances"]:
                batch = tuple(t.to(DEVICE) for t in tp.make_batch(cfg, n, SECONDS_EACH, 20))
                times: dict[str, list[float]] = {name: [] for name in built}
                peak = dict.fromkeys(built, 0.0)
                for round_ in range(options["rounds"] + 1):  # the first: warm-up
                    for name, (model, optimizer, _) in built.items():
                        if name in out_of_memory:
                            continue
                        result = _try_step(model, optimizer, scalers[name], batch, dtype)
                        if result is None:
                            out_of_memory[name] = n
                            emit({"preset": preset, "precision": pname, "model": name,
                                  "utterances": n, "error": "out of memory"})
                        elif round_:
                            times[name].append(result[0])
                            peak[name] = max(peak[name], result[1])
                for name, (model, _, flops) in built.items():
                    if len(times[name]) != options["rounds"]:
                        if out_of_memory.get(name, n) < n:
                            emit({"preset": preset, "precision": pname, "model": name,
                                  "utterances": n,
                                  "skipped": f"out of memory at {out_of_memory[name]}"})
                        continue
                    row = _row(preset, pname, name, n, model, times[name], peak[name], flops,
                               peaks[pname])
                    if name != "torchaudio" and len(times["torchaudio"]) == len(times[name]):
                        row["speedup_vs_torchaudio"] = round(statistics.median(
                            a / b for a, b in zip(times["torchaudio"], times[name])), 3)
                    emit(row)
                del batch
                torch.cuda.empty_cache()


def compile_worker(options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """Ours full, then ours encoder + CTC, with their layers compiled by ``compiled`` (as
    --compile does), trained in bf16 at each batch: the first step (compiling) timed alone, then a
    warm-up step and ``rounds`` timed steps. A model that fell back to eager says so."""
    import torch

    from konkanivani.config import model_config_from_preset
    from konkanivani.training.compile import compiled, compiled_layers

    tp = _load("throughput")
    peak_tflops = _matmul_tflops(torch.bfloat16)
    emit({"matmul_peak_tflops": {"bf16": peak_tflops}})
    dtype = torch.bfloat16
    for preset in options["presets"]:
        cfg = model_config_from_preset(preset, vocab_size=256, conv_kernel=31)
        for name in ("ours full", "ours enc+CTC"):
            model, optimizer, flops = _build(name, cfg)
            forward = compiled(model)
            scaler = torch.amp.GradScaler(DEVICE, enabled=False)
            first = True
            for n in options["utterances"]:
                batch = tuple(t.to(DEVICE) for t in tp.make_batch(cfg, n, SECONDS_EACH, 20))
                start = time.perf_counter()
                results = [_try_step(forward, optimizer, scaler, batch, dtype)
                           for _ in range(options["rounds"] + 1)]
                if any(r is None for r in results):
                    emit({"preset": preset, "precision": "bf16", "model": name + ", compiled",
                          "utterances": n, "error": "out of memory"})
                    break
                row = _row(preset, "bf16", name + ", compiled", n, model,
                           [r[0] for r in results[1:]], max(r[1] for r in results[1:]), flops,
                           peak_tflops)
                if first:
                    row["first_step_s"] = round(results[0][0], 1)  # compiling, mostly
                    first = False
                row["eager_fallback"] = not any("forward" in layer.__dict__
                                                for layer in compiled_layers(model))
                row["seconds_incl_compile"] = round(time.perf_counter() - start, 1)
                emit(row)
                del batch
            del model, optimizer, forward
            gc.collect()
            torch.cuda.empty_cache()


def _scaling_rows(done: dict[str, Outcome]) -> list[dict]:
    outcome = done.get("batch_scaling")
    return [r for r in (outcome.data.get("rows", []) if outcome else []) if "step_ms" in r]


def _find(rows: list[dict], **keys: Any) -> Optional[dict]:
    return next((r for r in rows if all(r.get(k) == v for k, v in keys.items())), None)


def _peak_line(rows: list[dict]) -> str:
    head = next((r for r in rows if "matmul_peak_tflops" in r), None)
    if head is None:
        return ""
    tf32 = head.get("tf32")
    note = ("" if tf32 is None else f" (fp32 matrix products with TF32 {'on' if tf32 else 'off'}:"
            " torch's default, which training keeps)")
    return ("Matmul peak measured here (8192 cubed): " + ", ".join(
        f"{k} {v:g} TFLOP/s" for k, v in head["matmul_peak_tflops"].items()) + note + ".\n\n")


def batch_scaling_table(rows: list[dict]) -> str:
    lines = [_peak_line(rows) + "| preset | precision | batch | model | step ms | audio s/s | "
             "TFLOP/s | of matmul peak | vs torchaudio | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "model" not in r:
            continue
        batch = f"{r['utterances']} x {SECONDS_EACH:g} s"
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['preset']} | {r['precision']} | {batch} | {r['model']} | "
                         f"{_cell(why)} | | | | | |")
            continue
        lines.append(f"| {r['preset']} | {r['precision']} | {batch} | {r['model']} | "
                     f"{r['step_ms']:.1f} | {r['audio_s_per_s']:,.0f} | {r['tflop_s']:.1f} | "
                     f"{_num(r['utilization'], '.1%')} | "
                     f"{_num(r.get('speedup_vs_torchaudio'), '.2f')} | {r['peak_gib']:.2f} |")
    return "\n".join(lines)


def compile_table(rows: list[dict], eager: list[dict]) -> str:
    """The compiled models beside the eager ones of the batch scaling (``eager``: its rows, on
    the same card)."""
    lines = [_peak_line(rows) + "| preset | batch | model | first step s | step ms | eager ms | "
             "vs eager | vs torchaudio eager | audio s/s | TFLOP/s | of matmul peak | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "model" not in r:
            continue
        batch = f"{r['utterances']} x {SECONDS_EACH:g} s"
        if "error" in r:
            lines.append(f"| {r['preset']} | {batch} | {r['model']} | {_cell(r['error'])} |"
                         + " |" * 8)
            continue
        base = r["model"].replace(", compiled", "")
        keys = {"preset": r["preset"], "precision": "bf16", "utterances": r["utterances"]}
        own, peer = _find(eager, model=base, **keys), _find(eager, model="torchaudio", **keys)
        model = r["model"] + (" (fell back to eager)" if r.get("eager_fallback") else "")
        lines.append(
            f"| {r['preset']} | {batch} | {model} | {_num(r.get('first_step_s'), '.1f')} | "
            f"{r['step_ms']:.1f} | {_num(own and own['step_ms'], '.1f')} | "
            f"{_num(own and own['step_ms'] / r['step_ms'], '.2f')} | "
            f"{_num(peer and peer['step_ms'] / r['step_ms'], '.2f')} | "
            f"{r['audio_s_per_s']:,.0f} | {r['tflop_s']:.1f} | {_num(r['utilization'], '.1%')} | "
            f"{r['peak_gib']:.2f} |")
    return "\n".join(lines)


def batch_scaling_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"presets": args.scaling_presets, "utterances": args.scaling_utterances,
            "precisions": args.scaling_precisions, "rounds": args.scaling_rounds}


def compile_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"presets": args.scaling_presets, "utterances": args.compile_utterances,
            "rounds": args.scaling_rounds}


def run_batch_scaling(args: argparse.Namespace, limit: float, work: Path,
                      done: dict[str, Outcome]) -> Outcome:
    outcome = _run_worker("batch_scaling", batch_scaling_options(args), batch_scaling_table,
                          lambda r: "step_ms" in r, "rows", limit, work)
    outcome.body = (
        "benchmarks/throughput.py's models (`ours enc+CTC`: our front-end, encoder and CTC head; "
        "`torchaudio`: torchaudio's Conformer of the same size behind the same front-end, CTC; "
        "`ours full`: ASRModel, CTC + attention decoder, SpecAugment off) trained on N random "
        f"utterances x {SECONDS_EACH:g} s (20 tokens each, vocabulary 256), AdamW: the median of "
        f"{args.scaling_rounds} steps after a warm-up step, the models in turn round by round. "
        "FLOPs counted by `torch.utils.flop_counter` on 8 utterances (as benchmarks/throughput.py "
        "counts), times N / 8; `vs torchaudio`: the median of the rounds' time ratios; peak: "
        "`torch.cuda.max_memory_allocated` in the model's steps (the three models' weights and "
        "optimizer states included).\n\n" + outcome.body)
    return outcome


def run_compile(args: argparse.Namespace, limit: float, work: Path,
                done: dict[str, Outcome]) -> Outcome:
    eager = _scaling_rows(done)
    outcome = _run_worker("compile", compile_options(args), lambda rows: compile_table(rows, eager),
                          lambda r: "step_ms" in r, "rows", limit, work)
    outcome.body = (
        "Ours with each Conformer block and decoder layer compiled "
        "(`konkanivani.training.compile.compiled`, as the trainer's --compile: regional, dynamic "
        f"shapes), bf16 autocast, the batch scaling's batches: the first step (which compiles) "
        f"timed alone, then the median of {args.scaling_rounds} steps after a warm-up step. "
        "`eager ms` and `vs torchaudio eager` come from the batch scaling part on the same "
        "card.\n\n"
        + outcome.body)
    return outcome


# ---- part: the trainer end to end -------------------------------------------------------------

def trainer_command(args: argparse.Namespace, train: Path, valid: Path, out: Path,
                    batch_seconds: int, pad_to_frames: int = 0) -> list[str]:
    """konkanivani-train at a batch budget (its batches padded to a multiple of
    ``pad_to_frames``), validating only at its end, a summary line (and a metrics row) every 2
    steps."""
    return [sys.executable, str(ROOT / "training_scripts" / "train_konkanivani_asr.py"),
            "--train_manifest", str(train), "--valid_manifest", str(valid), "--output_dir",
            str(out), "--preset", args.trainer_preset, "--precision", args.trainer_precision,
            "--tokenizer_type", "char", "--max_batch_seconds", str(batch_seconds),
            "--gradient_accumulation_steps", "1", "--num_workers", str(args.trainer_workers),
            "--max_steps", str(args.trainer_steps), "--log_every", "2", "--validate_every_steps",
            "0", "--keep_checkpoints", "1", "--no_progress", "--no_tensorboard",
            *(["--pad_to_frames", str(pad_to_frames)] if pad_to_frames else [])]


def trainer_summary(train_rows: list[dict], mean_duration: float) -> dict[str, Any]:
    """A trainer run's rates from its metrics rows: utterances a second and the share of the time
    waiting for data, averaged over the rows after its first TRAINER_WARMUP_STEPS steps (each row
    covers the steps since the one before), audio seconds a second at the corpus's mean
    duration, and the peak memory of the whole run."""
    steady = [r for r in train_rows if r.get("step", 0) > TRAINER_WARMUP_STEPS
              and r.get("utt_per_s") is not None]
    peaks = [r["peak_gb"] for r in train_rows if r.get("peak_gb") is not None]
    summary: dict[str, Any] = {"steps": max((r.get("step", 0) for r in train_rows), default=0),
                               "rated_steps": None, "peak_gib": round(max(peaks), 2) if peaks
                               else None}
    if steady:
        # A row covers the steps since the row before it.
        first = max((r.get("step", 0) for r in train_rows
                     if r.get("step", 0) <= TRAINER_WARMUP_STEPS), default=0)
        summary["rated_steps"] = f"{first + 1}-{steady[-1]['step']}"
        utt = statistics.fmean(r["utt_per_s"] for r in steady)
        waits = [r["data_wait"] for r in steady if r.get("data_wait") is not None]
        summary.update(utt_per_s=round(utt, 1), audio_s_per_s=round(utt * mean_duration, 1),
                       data_wait=round(statistics.fmean(waits), 4) if waits else None)
    return summary


def model_only(rows: list[dict], args: argparse.Namespace, batch_seconds: float) -> Optional[dict]:
    """The batch scaling's row of ours full at the trainer's preset and precision whose batch
    holds ``batch_seconds`` of audio."""
    n = batch_seconds / SECONDS_EACH
    return _find(rows, model="ours full", preset=args.trainer_preset,
                 precision=args.trainer_precision, utterances=int(n)) if n == int(n) else None


def trainer_table(rows: list[dict], scaling: list[dict], args: argparse.Namespace) -> str:
    lines = ["| --max_batch_seconds | --pad_to_frames | steps | rated | utt/s | audio s/s | "
             "data wait | peak GiB | model-only audio s/s | of model-only |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ref = model_only(scaling, args, r["batch_seconds"])
        share = (r["audio_s_per_s"] / ref["audio_s_per_s"]
                 if ref and r.get("audio_s_per_s") else None)
        lines.append(f"| {r['batch_seconds']} | {r.get('pad_to_frames') or 'off'} | "
                     f"{r['steps']} | {r['rated_steps'] or 'none'} | "
                     f"{_num(r.get('utt_per_s'), ',.1f')} | {_num(r.get('audio_s_per_s'), ',.0f')}"
                     f" | {_num(r.get('data_wait'), '.1%')} | {_num(r.get('peak_gib'), '.2f')} | "
                     f"{_num(ref and ref['audio_s_per_s'], ',.0f')} | {_num(share, '.0%')} |")
    return "\n".join(lines)


def run_trainer(args: argparse.Namespace, limit: float, work: Path,
                done: dict[str, Outcome]) -> Outcome:
    start = time.monotonic()
    corpus, problem = resolve_corpus(args, limit, work)
    if problem is not None:
        return problem
    rows = corpus_rows(corpus, work)
    mean = statistics.fmean(float(r["duration"]) for r in rows)
    valid = work / "valid_16.jsonl"  # validation is not what this part measures: 16 utterances
    with open(valid, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n"
                     for r in _manifest_rows(corpus.valid)[:16])
    results, failures, budgets = [], [], args.trainer_batch_seconds
    # Each budget's manifest, written once for its runs at each --pad_to_frames: enough audio for
    # every step and two more batches, so that a run stays in its first epoch.
    manifests = {}
    for seconds in budgets:
        train = work / f"trainer_{seconds}.jsonl"
        manifests[seconds] = train, write_repeated_manifest(rows, train,
                                                            (args.trainer_steps + 2) * seconds)
    runs = [(seconds, pad) for seconds in budgets for pad in args.trainer_pad_to_frames]
    for i, (seconds, pad) in enumerate(runs):
        left = limit - (time.monotonic() - start)
        train, repeats = manifests[seconds]
        out = work / f"trainer_{seconds}_pad{pad}"
        finished = run_limited(trainer_command(args, train, valid, out, seconds, pad),
                               left / (len(runs) - i), work / f"trainer_{seconds}_pad{pad}.log")
        summary = {"batch_seconds": seconds, "pad_to_frames": pad, "repeats": repeats,
                   "seconds": round(finished.seconds, 1), **trainer_summary(_rows(out)[0], mean)}
        results.append(summary)
        if finished.returncode != 0 or summary["steps"] < args.trainer_steps:
            failures.append(_failure(finished, left / (len(runs) - i),
                                     f"--max_batch_seconds {seconds} --pad_to_frames {pad}"))
    scaling = _scaling_rows(done)
    body = (f"konkanivani-train on the training utterances of {corpus.about} (mean "
            f"{mean:.2f} s), repeated in one manifest so that the steps stay in one epoch: preset "
            f"{args.trainer_preset}, {args.trainer_precision}, {args.trainer_workers} data workers,"
            f" {args.trainer_steps} optimizer steps, no accumulation, a metrics row every 2 steps, "
            f"a run at each --pad_to_frames ({', '.join(map(str, args.trainer_pad_to_frames))}; "
            "0: off), "
            "validation only at the end (16 utterances). Rates: the mean of the rows after step "
            f"{TRAINER_WARMUP_STEPS}; audio s/s = utt/s x the mean duration; model-only: the batch "
            "scaling's ours full on the same card at the batch of the same audio seconds "
            f"(N x {SECONDS_EACH:g} s, no padding, no data loading).\n\nCommand: `"
            + shlex.join(["konkanivani-train", *trainer_command(args, Path("<train.jsonl>"),
                                                                Path("<valid.jsonl>"),
                                                                Path("<work>/trainer_B"),
                                                                budgets[0])[2:]])
            + "`\n\n" + trainer_table(results, scaling, args))
    data = {"rows": results, "mean_duration": mean}
    summary = "; ".join(f"{r['batch_seconds']} s batches, pad {r['pad_to_frames'] or 'off'}: "
                        f"{_num(r.get('utt_per_s'), ',.0f')} utt/s, data wait "
                        f"{_num(r.get('data_wait'), '.0%')}" for r in results)
    seconds = time.monotonic() - start
    if not failures:
        return Outcome("passed", seconds, body, summary, data)
    worst = failures[0]
    return Outcome(worst.status, seconds, body + "\n\n" + "\n\n".join(f.body for f in failures),
                   worst.summary, data)


# ---- part: the T4 recipe ----------------------------------------------------------------------

def recipe_command(args: argparse.Namespace) -> list[str]:
    """The T4 recipe as its script runs it, capped and with a time budget; the data and the
    output folder come through its environment variables (``recipe_env``)."""
    return ["bash", str(ROOT / "run_training_memory_optimized.sh"), "--max_time",
            str(args.recipe_seconds), "--gpu_memory_gb", f"{args.gpu_memory_gb:g}", "--log_every",
            "10", "--no_progress", "--no_tensorboard"]


def recipe_env(corpus: Corpus, out_dir: Path, cap_gb: float = T4_CAP_GB) -> dict[str, str]:
    data = ({"TRAIN_SHARDS": str(corpus.train_shards)} if corpus.train_shards is not None
            else {"TRAIN_MANIFEST": str(corpus.train_manifest)})
    return child_env(PYTHON=sys.executable, VALID_MANIFEST=str(corpus.valid),
                     OUTPUT_DIR=str(out_dir), GPU_MEMORY_GB=f"{cap_gb:g}", **data)


def evaluate_command(checkpoint: Path, manifest: Path) -> list[str]:
    """Scores as the trainer's validation does: greedy CTC."""
    return [sys.executable, "-m", "konkanivani.cli.evaluate", str(checkpoint), str(manifest),
            "--method", "greedy", "--batch_size", "16", "--worst", "0"]


def evaluate_result(output: str) -> dict[str, float]:
    """CER and WER (fractions) from konkanivani-evaluate's output."""
    found = {}
    for name in ("cer", "wer"):
        m = re.search(rf"^{name.upper()} ([0-9.]+)% \(", output, re.MULTILINE)
        if m:
            found[name] = float(m.group(1)) / 100
    return found


def _rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """A run's logged training and validation rows (none before its metrics file exists)."""
    from konkanivani.checkpoint import METRICS_FILE
    from konkanivani.training.metrics_log import read_metrics
    rows = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else {}
    return rows.get("train", []), rows.get("valid", [])


def _spread(rows: list[dict], most: int) -> list[dict]:
    """At most ``most`` of ``rows``, evenly spread, the last kept."""
    if len(rows) <= most:
        return rows
    picks = {round(i * (len(rows) - 1) / (most - 1)) for i in range(most)}
    return [rows[i] for i in sorted(picks)]


def recipe_tables(train_rows: list[dict], valid_rows: list[dict], most: int = 12) -> str:
    lines = ["| step | epoch | loss | CTC | attention | grad norm | lr | utt/s | data wait | "
             "GiB now | GiB peak |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- |"]
    for r in _spread(train_rows, most):
        lines.append(f"| {r['step']} | {r.get('epoch', '')} | {_num(r.get('loss'), '.3f')} | "
                     f"{_num(r.get('ctc'), '.3f')} | {_num(r.get('attention'), '.3f')} | "
                     f"{_num(r.get('grad_norm'), '.2f')} | {_num(r.get('lr'), '.2e')} | "
                     f"{_num(r.get('utt_per_s'), '.1f')} | {_num(r.get('data_wait'), '.0%')} | "
                     f"{_num(r.get('mem_gb'), '.2f')} | {_num(r.get('peak_gb'), '.2f')} |")
    if valid_rows:
        lines += ["", "| validation at step | loss | CER | WER |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['step']} | {_num(r.get('loss'), '.3f')} | {_num(r.get('cer'), '.2%')} | "
                  f"{_num(r.get('wer'), '.2%')} |" for r in _spread(valid_rows, most)]
    return "\n".join(lines)


def recipe_facts(train_rows: list[dict], log: str) -> dict[str, Any]:
    """The recipe's speed (the median of its logged rates after the first), data wait, peak
    memory, and the updates fp16's GradScaler skipped and micro-batches split for memory."""
    rated = [r for r in train_rows[1:] if r.get("utt_per_s") is not None]
    waits = [r["data_wait"] for r in rated if r.get("data_wait") is not None]
    peaks = [r["peak_gb"] for r in train_rows if r.get("peak_gb") is not None]
    return {"steps": train_rows[-1]["step"] if train_rows else 0,
            "utt_per_s": round(statistics.median(r["utt_per_s"] for r in rated), 1) if rated
            else None,
            "data_wait": round(statistics.fmean(waits), 4) if waits else None,
            "peak_gib": round(max(peaks), 3) if peaks else None,
            "skipped": len(re.findall(r"non-finite (?:gradients|loss), update skipped", log)),
            "oom_splits": len(re.findall(r"out of memory on a micro-batch", log)),
            # A run that stopped for memory (the splits' warnings name no CUDA error).
            "out_of_memory": bool(re.search(r"OutOfMemoryError|CUDA out of memory|does not fit "
                                            r"in cuda memory", log))}


def run_recipe(args: argparse.Namespace, limit: float, work: Path,
               done: dict[str, Outcome]) -> Outcome:
    start = time.monotonic()
    corpus, problem = resolve_corpus(args, limit, work)
    if problem is not None:
        return problem
    out_dir = work / "t4_run"
    cmd = recipe_command(args)
    train_limit = limit - (time.monotonic() - start) - EVALUATE_SECONDS
    finished = run_limited(cmd, train_limit, work / "recipe.log",
                           env=recipe_env(corpus, out_dir, args.gpu_memory_gb))
    train_rows, valid_rows = _rows(out_dir)
    log_path = out_dir / "train.log"
    log = log_path.read_text(encoding="utf-8", errors="replace") if log_path.is_file() else ""
    facts = recipe_facts(train_rows, log + finished.output)
    trained = time.monotonic() - start
    scored: dict[str, float] = {}
    evaluation = "not scored: the run left no latest.pt"
    if (out_dir / "latest.pt").exists():
        scoring = run_limited(evaluate_command(out_dir / "latest.pt", corpus.valid),
                              max(limit - (time.monotonic() - start), 5.0), work / "evaluate.log")
        scored = evaluate_result(scoring.output)
        evaluation = (f"CER {scored['cer']:.2%}, WER {scored.get('wer', float('nan')):.2%} "
                      f"(latest.pt, greedy CTC, scored in {scoring.seconds:.0f} s)"
                      if "cer" in scored else "scoring failed:\n\n" + tail(scoring.output, 10))
    facts.update(scored, recipe_seconds=args.recipe_seconds, cap_gb=args.gpu_memory_gb)
    precision = next((line.split("INFO ", 1)[-1] for line in log.splitlines()
                      if "precision:" in line), "not logged")
    batch = next((line.split("INFO ", 1)[-1] for line in log.splitlines()
                  if "utterances per update" in line), "not logged")
    shown = ["bash", "run_training_memory_optimized.sh", *cmd[2:]]
    data_var = "TRAIN_SHARDS" if corpus.train_shards is not None else "TRAIN_MANIFEST"
    share = facts["peak_gib"] / args.gpu_memory_gb if facts["peak_gib"] is not None else None
    text = [f"Trained on {corpus.about}.",
            f"Command: `GPU_MEMORY_GB={args.gpu_memory_gb:g} {data_var}=... VALID_MANIFEST=... "
            f"OUTPUT_DIR=... {shlex.join(shown)}`",
            f"{precision}; {batch}; {facts['steps']} steps in {trained:.0f} s (start-up and "
            f"validations included); median {_num(facts['utt_per_s'], ',.1f')} utt/s after the "
            f"first row, data wait {_num(facts['data_wait'], '.1%')}; peak "
            f"{_num(facts['peak_gib'], '.2f')} GiB ({_num(share, '.0%')} of the "
            f"{args.gpu_memory_gb:g} GB cap); {facts['skipped']} updates skipped for non-finite "
            f"gradients; {facts['oom_splits']} micro-batches split after running out of memory.",
            f"At the end of its {args.recipe_seconds} s: {evaluation}."]
    body = "\n\n".join(text + [recipe_tables(train_rows, valid_rows)])
    summary = (f"{facts['steps']} steps in {args.recipe_seconds} s, "
               f"{_num(facts['utt_per_s'], ',.0f')} utt/s, peak "
               f"{_num(facts['peak_gib'], '.2f')} GiB, CER {_num(scored.get('cer'), '.1%')}")
    seconds = time.monotonic() - start
    last_loss = train_rows[-1].get("loss") if train_rows else None
    ok = (finished.returncode == 0 and "cer" in scored and last_loss is not None
          and math.isfinite(last_loss))
    if ok:
        return Outcome("passed", seconds, body, summary, facts)
    failure = _failure(finished, train_limit, summary)
    if finished.returncode == 0:
        failure = Outcome("failed", seconds, f"It ended at step {facts['steps']} with loss "
                          f"{_num(last_loss, '.3f')}.\n\n{tail(finished.output)}", summary)
    return Outcome(failure.status, seconds, body + "\n\n" + failure.body, failure.summary, facts)


# ---- part: benchmarks/throughput.py on the CPU ------------------------------------------------

def cpu_throughput_command(args: argparse.Namespace) -> list[str]:
    threads = str(min(16, os.cpu_count() or 2))
    return [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--preset", "small",
            "--rounds", str(args.cpu_rounds), "--warmup", "1", "--threads", threads, "--json"]


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
    header = ["preset", "precision", "model", "params_m", "step_s", "audio_s_per_s",
              "gflop_per_step", "gflop_s", "utilization", "speedup_vs_torchaudio"]
    peaks = result.get("matmul_peak_gflop_s", {}).items()
    lines = [f"CPU: {result.get('cpu', 'unknown')}; {result.get('threads')} threads; matmul peak "
             + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks) + "\n",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(row.get(h, "")) for h in header) + " |"
              for row in result.get("rows", [])]
    return "\n".join(lines)


def run_cpu_throughput(args: argparse.Namespace, limit: float, work: Path,
                       done: dict[str, Outcome]) -> Outcome:
    finished = run_limited(cpu_throughput_command(args), limit, work / "cpu_throughput.log")
    result = cpu_throughput_result(finished.output)
    note = ("benchmarks/throughput.py measures the CPU only (it has no --device flag): these rows "
            "are the GPU machine's CPU, preset small.\n\n")
    if finished.returncode == 0 and result:
        rows = result.get("rows", [])
        return Outcome("passed", finished.seconds, note + cpu_throughput_table(result),
                       f"{len(rows)} CPU rows", {"rows": rows})
    failure = _failure(finished, limit, "CPU throughput")
    return Outcome(failure.status, finished.seconds, note + failure.body, failure.summary)


RUNNERS: dict[str, Callable[[argparse.Namespace, float, Path, dict[str, Outcome]], Outcome]] = {
    "pytest": run_pytest, "memory": run_memory, "batch_scaling": run_batch_scaling,
    "compile": run_compile, "trainer": run_trainer, "recipe": run_recipe,
    "cpu_throughput": run_cpu_throughput}
TITLES = {"pytest": "GPU tests (pytest -m gpu)", "memory": "Memory options (benchmarks/memory.py)",
          "batch_scaling": "Batch scaling: the models alone",
          "compile": "Compiled layers (--compile)",
          "trainer": "The trainer end to end",
          "recipe": "T4 recipe (run_training_memory_optimized.sh), capped to 15 GB",
          "cpu_throughput": "Training throughput on the CPU (benchmarks/throughput.py)"}


# ---- the plan ---------------------------------------------------------------------------------

def budgets(args: argparse.Namespace) -> dict[str, str]:
    """What each part runs, as a budget of tests, steps, rows or seconds."""
    points = len(args.scaling_utterances) * len(args.scaling_precisions)
    n = ",".join(map(str, args.scaling_utterances))
    return {
        "pytest": "every test marked gpu (each bounded by steps)",
        "memory": f"configurations {','.join(map(str, args.memory_rows))} of benchmarks/memory.py"
                  f" x {len(args.memory_presets)} preset(s) ({', '.join(args.memory_presets)}), "
                  "3 steps each, a process each",
        "batch_scaling": f"{', '.join(args.scaling_presets)}: 3 models x {n} x 4 s x "
                         f"{'/'.join(args.scaling_precisions)} ({points} points), 1 + "
                         f"{args.scaling_rounds} steps each",
        "compile": f"{', '.join(args.scaling_presets)}: ours full and enc+CTC compiled, bf16, "
                   f"{','.join(map(str, args.compile_utterances))} x 4 s, compile + 1 + "
                   f"{args.scaling_rounds} steps each",
        "trainer": f"{args.trainer_preset} {args.trainer_precision}, --max_batch_seconds "
                   f"{','.join(map(str, args.trainer_batch_seconds))} x --pad_to_frames "
                   f"{','.join(map(str, args.trainer_pad_to_frames))}, {args.trainer_workers} "
                   f"workers, {args.trainer_steps} steps each",
        "recipe": f"--max_time {args.recipe_seconds} s capped to {args.gpu_memory_gb:g} GB, then "
                  "latest.pt scored on the validation set",
        "cpu_throughput": f"preset small, 3 models, {args.cpu_rounds} rounds + 1 warm-up step",
    }


def commands(args: argparse.Namespace) -> dict[str, str]:
    work = Path("<work>")
    corpus = Corpus(Path("<corpus>/valid.jsonl"), "", train_shards=Path("<corpus>/shards.json"))
    env = recipe_env(corpus, work / "t4_run", args.gpu_memory_gb)
    shown_env = " ".join(f"{k}={env[k]}" for k in ("GPU_MEMORY_GB", "TRAIN_SHARDS",
                                                   "VALID_MANIFEST", "OUTPUT_DIR"))
    recipe = shlex.join(recipe_command(args))
    return {
        "pytest": shlex.join(pytest_command(work / "pytest.xml")),
        "memory": shlex.join(worker_command("memory", memory_options(args))),
        "batch_scaling": shlex.join(worker_command("batch_scaling", batch_scaling_options(args))),
        "compile": shlex.join(worker_command("compile", compile_options(args))),
        "trainer": shlex.join(trainer_command(args, work / "trainer_B.jsonl",
                                              work / "valid_16.jsonl", work / "trainer_B",
                                              args.trainer_batch_seconds[0])),
        "recipe": f"{shown_env} {recipe}; then "
                  + shlex.join(evaluate_command(work / "t4_run" / "latest.pt",
                                                Path("<corpus>/valid.jsonl"))),
        "cpu_throughput": shlex.join(cpu_throughput_command(args)),
    }


def print_plan(args: argparse.Namespace) -> bool:
    """The plan, and whether the parts' limits fit in --total_timeout."""
    plan, cmds, limits = budgets(args), commands(args), part_limits(args)
    total = sum(min(limits[name], args.total_timeout) for name in args.parts)
    fits = total <= args.total_timeout
    print(f"gpu_report plan: {len(args.parts)} parts, limits adding up to {total:.0f} s within "
          f"--total_timeout {args.total_timeout:.0f} s")
    for name in args.parts:
        print(f"- {name}: at most {min(limits[name], args.total_timeout):.0f} s; {plan[name]}\n"
              f"    {cmds[name]}")
    if fits:
        print(f"total: {total:.0f} s of parts, {args.total_timeout - total:.0f} s left of "
              f"--total_timeout for the report's own checks")
    else:
        print(f"total: {total:.0f} s of parts DOES NOT FIT in --total_timeout "
              f"{args.total_timeout:.0f} s: the last parts would get what is left")
    carry = f"carry {' and '.join(DEVICE_CARRY)}, timeout_s {DEVICE_LIMIT}"
    if tuple(args.parts) == DEFAULT_PARTS:
        second = sum(limits[name] for name in SECOND_CALL)
        print(f"device commands (two calls, one after the other while the machine is warm; each: "
              f"{carry}):\n    {device_command()}\n    {device_command(parts=SECOND_CALL)}"
              f"    # {second:.0f} s")
    else:
        print(f"device command ({carry}):\n    {device_command(parts=tuple(args.parts))}")
    return fits


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
        imports = subprocess.run([sys.executable, "-c",
                                  "import konkanivani.training.loop, konkanivani.cli.train"],
                                 capture_output=True, text=True, cwd=ROOT, env=child_env(),
                                 timeout=120)
        why = "" if imports.returncode == 0 else (imports.stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired:
        why = "importing it took over 120 s"
    package = f"DOES NOT IMPORT: {why} (install its dependencies)" if why else "imports"
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"])
    dirty = bool(_command_output(["git", "status", "--porcelain", "--untracked-files=no"]))
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"]).split("\n")[0]
    return {
        "GPU": f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()} "
               f"({props.total_memory / GIB:.1f} GiB, compute capability {props.major}."
               f"{props.minor}, {props.multi_processor_count} SMs)",
        "driver": driver or "unknown (no nvidia-smi)",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
                 f"{torch.backends.cudnn.version()}, NCCL {nccl})",
        "Python": f"{platform.python_version()} on {platform.platform()}",
        "CPU": f"{cpu}; {os.cpu_count()} cores",
        "konkanivani": package,
        "espeak-ng": shutil.which("espeak-ng") or "not installed",
        "commit": (commit + (" with uncommitted changes" if dirty else "")) if commit
        else "unknown (no git here)",
    }


def report_path(out: Path, gpu_name: str, today: datetime.date,
                parts: tuple[str, ...] = DEFAULT_PARTS) -> Path:
    """``<date>-<gpu>.md``, with the parts' names after it when they are not the default ones
    (``-recipe`` for the second call), so that one day's calls do not write over each other."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "gpu"
    chosen = "" if tuple(parts) == DEFAULT_PARTS else "-" + "-".join(parts).replace("_", "-")
    return out / f"{today.isoformat()}-{slug}{chosen}.md"


def _met(ok: Optional[bool]) -> str:
    return "not measured" if ok is None else "**yes**" if ok else "**no**"


def target_rows(results: dict[str, Outcome], args: argparse.Namespace) -> list[tuple[str, ...]]:
    """Issue 34's targets: (what, measured, target, met?), from the parts' data."""
    rows = []
    recipe = results["recipe"].data if "recipe" in results else {}
    cap = args.gpu_memory_gb
    if recipe.get("utt_per_s") is not None and recipe.get("peak_gib") is not None:
        share = recipe["peak_gib"] / cap
        oom = recipe.get("oom_splits", 0) or recipe.get("out_of_memory")
        rows.append((f"T4 recipe as shipped, {cap:g} GB cap", f"{recipe['utt_per_s']:,.0f} utt/s, "
                     f"peak {recipe['peak_gib']:.2f} GiB ({share:.0%} of {cap:g} GB), "
                     + ("out of memory" if oom else "no OOM"),
                     f"≥ {T4_UTT_PER_S:,.0f} utt/s, ≥ {T4_MEMORY_SHARE:.0%} of {cap:g} GB, no OOM",
                     _met(recipe["utt_per_s"] >= T4_UTT_PER_S and share >= T4_MEMORY_SHARE
                          and not oom)))
    else:
        rows.append((f"T4 recipe as shipped, {cap:g} GB cap", "not measured",
                     f"≥ {T4_UTT_PER_S:,.0f} utt/s, ≥ {T4_MEMORY_SHARE:.0%} of {cap:g} GB, no OOM",
                     _met(None)))
    cer_target = f"≤ {T4_CER:.0%} after {T4_CER_SECONDS} s"
    if recipe.get("cer") is not None:
        seconds = recipe["recipe_seconds"]
        met = recipe["cer"] <= T4_CER if seconds <= T4_CER_SECONDS else None
        rows.append(("T4 recipe, valid CER after 5 minutes on the demo corpus",
                     f"{recipe['cer']:.1%} after {seconds} s", cer_target, _met(met)))
    else:
        rows.append(("T4 recipe, valid CER after 5 minutes on the demo corpus", "not measured",
                     cer_target, _met(None)))
    rows.append(_trainer_target(results, args))
    scaling = _scaling_rows(results)
    compiled = results["compile"].data.get("rows", []) if "compile" in results else []
    compiled = [r for r in compiled if "step_ms" in r and not r.get("eager_fallback")]
    preset = args.scaling_presets[0]
    keys = {"preset": preset, "precision": "bf16", "utterances": 256}
    peer = _find(scaling, model="torchaudio", **keys)
    eager = _find(scaling, model="ours enc+CTC", **keys)
    comp = _find(compiled, model="ours enc+CTC, compiled", **keys)
    ratios = {"eager": eager and eager.get("speedup_vs_torchaudio"),
              "compiled": peer and comp and round(peer["step_ms"] / comp["step_ms"], 3)}
    found = {k: v for k, v in ratios.items() if v is not None}
    rows.append((f"ours encoder + CTC vs torchaudio, bf16, 256 x 4 s ({preset})",
                 ", ".join(f"{k} {v:.2f}x" for k, v in found.items()) or "not measured",
                 f"≥ {ENC_CTC_SPEEDUP}x",
                 _met(max(found.values()) >= ENC_CTC_SPEEDUP if found else None)))
    keys = {"preset": "large", "precision": "bf16", "utterances": 1024}
    eager = _find(scaling, model="ours full", **keys)
    comp = _find(compiled, model="ours full, compiled", **keys)
    found = {k: r for k, r in (("eager", eager), ("compiled", comp)) if r is not None}
    rows.append(("ours full, large, bf16, 1,024 x 4 s",
                 ", ".join(f"{k} {r['audio_s_per_s']:,.0f} audio s/s "
                           f"({_num(r['utilization'], '.1%')} of peak)" for k, r in found.items())
                 or "not measured", f"≥ {FULL_AUDIO_S_PER_S:,.0f} audio s/s",
                 _met(max(r["audio_s_per_s"] for r in found.values()) >= FULL_AUDIO_S_PER_S
                      if found else None)))
    memory = results["memory"].data.get("rows", []) if "memory" in results else []
    ratios_m = [r["estimate_mib"] / r["peak_mib"] for r in memory if "peak_mib" in r]
    failed = len([r for r in memory if "error" in r])
    rows.append(("memory estimate / peak on CUDA",
                 (f"{min(ratios_m):.2f}-{max(ratios_m):.2f} over {len(ratios_m)} rows"
                  + (f" ({failed} failed)" if failed else "")) if ratios_m else "not measured",
                 f"{ESTIMATE_RANGE[0]}-{ESTIMATE_RANGE[1]}",
                 _met(all(ESTIMATE_RANGE[0] <= x <= ESTIMATE_RANGE[1] for x in ratios_m)
                      and not failed if ratios_m else None)))
    cpu = results["cpu_throughput"].data.get("rows", []) if "cpu_throughput" in results else []
    speedups = [r["speedup_vs_torchaudio"] for r in cpu
                if r.get("model") == "ours enc+CTC" and r.get("speedup_vs_torchaudio")]
    rows.append(("CPU speed, benchmarks/throughput.py (ours enc+CTC vs torchaudio)",
                 f"{min(speedups):.2f}-{max(speedups):.2f}x on this machine's CPU" if speedups
                 else "not measured here (the CPU machines measure it)", f"≥ {CPU_SPEEDUP}x",
                 _met(min(speedups) >= CPU_SPEEDUP if speedups else None)))
    return rows


def _trainer_target(results: dict[str, Outcome], args: argparse.Namespace) -> tuple[str, ...]:
    what = (f"trainer vs model-only throughput at the same batch, {args.trainer_workers} data "
            "workers")
    target = f"≥ {TRAINER_SHARE:.0%}, data wait ≤ {TRAINER_DATA_WAIT:.0%}"
    trainer = results["trainer"].data.get("rows", []) if "trainer" in results else []
    scaling = _scaling_rows(results)
    measured, verdicts = [], []
    for r in trainer:
        ref = model_only(scaling, args, r["batch_seconds"])
        if r.get("audio_s_per_s") is None:
            continue
        wait = r.get("data_wait")
        share = r["audio_s_per_s"] / ref["audio_s_per_s"] if ref else None
        pad = r.get("pad_to_frames") or 0
        measured.append(f"{_num(share, '.0%')} of model-only at {r['batch_seconds']} s batches "
                        f"({args.trainer_preset}, {args.trainer_precision}"
                        + (f", --pad_to_frames {pad}" if pad else "") + "), data wait "
                        f"{_num(wait, '.1%')}")
        if share is not None and wait is not None:
            verdicts.append(share >= TRAINER_SHARE and wait <= TRAINER_DATA_WAIT)
    # Met when one of the trainer's settings meets it (the report names which).
    return (what, "; ".join(measured) or "not measured", target,
            _met(any(verdicts) if verdicts else None))


def targets_table(rows: list[tuple[str, ...]]) -> str:
    lines = ["| what | measured | target | met? |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render(env: dict[str, str], started: datetime.datetime, command: str,
           results: dict[str, Outcome], limits: dict[str, float], plan: dict[str, str],
           args: argparse.Namespace) -> str:
    total = sum(o.seconds for o in results.values())
    card = env["GPU"].split(" x ")[0]
    lines = [f"# GPU report: {card}", "",
             f"{started.strftime('%Y-%m-%d %H:%M')} UTC, `{command}`; {total:.0f} s in all.", "",
             f"## Issue 34's targets on {card}", "", targets_table(target_rows(results, args)),
             ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += ["", "| part | status | seconds | limit | budget | result |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, o in results.items():
        lines.append(f"| {name} | {o.status} | {o.seconds:.0f} | {limits.get(name, 0):.0f} | "
                     f"{plan[name]} | {_cell(o.summary)} |")
    for name, o in results.items():
        lines += ["", f"## {TITLES[name]}", "", f"Status: **{o.status}** in {o.seconds:.0f} s.",
                  "", o.body.rstrip()]
    return "\n".join(lines) + "\n"


def write_report(path: Path, text: str, results: dict[str, Outcome]) -> None:
    """The Markdown report and, beside it, every part's rows as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    data = {name: {"status": o.status, "seconds": round(o.seconds, 1), "summary": o.summary,
                   "data": o.data} for name, o in results.items()}
    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n",
                                         encoding="utf-8")


# ---- main -------------------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> int:
    """--make_corpus and --make_wheels; 2 when one cannot do its work (one line says why)."""
    try:
        if args.make_wheels is not None:
            sizes = make_wheels(args.make_wheels, [v.strip() for v in args.wheel_cuda.split(",")])
            total = sum(sizes.values())
            print(f"{args.make_wheels}: {len(sizes)} wheels, {total / MIB:.1f} MiB: "
                  + ", ".join(f"{name} ({size / MIB:.1f} MiB)" for name, size in sizes.items()))
        if args.make_corpus is not None:
            jobs = min(16, os.cpu_count() or 2)
            info = make_corpus(args.make_corpus, args.corpus_utterances, jobs, args.corpus_format,
                               demo=args.from_demo)
            size = folder_bytes(args.make_corpus)
            codec = CODEC_NAMES[info.get("audio_format", "flac")]
            print(f"{args.make_corpus}: {info['train']} training utterances "
                  f"({info['train_hours'] * 60:.1f} min) in {info['shards']} {codec} shards, "
                  f"{info['valid']} validation utterances "
                  f"({info['valid_hours'] * 60:.1f} min) in {codec}; {size / MIB:.1f} MiB; "
                  + ("made before" if info.get("already_there") else
                     f"made in {info['seconds']:.0f} s"))
        print(_carry_line(_carried_sizes(args.make_corpus, args.make_wheels)))
    except (PreparationError, OSError) as e:
        print(f"gpu_report: {e}", file=sys.stderr)
        return 2
    return 0


WORKERS = {"memory": memory_worker, "batch_scaling": batch_scaling_worker,
           "compile": compile_worker}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        kind, options = args.worker[0], json.loads(args.worker[1])
        WORKERS[kind](options, _emit)
        return 0
    if args.make_corpus is not None or args.make_wheels is not None:
        return prepare(args)
    if args.dry_run:
        return 0 if print_plan(args) else 1
    import torch

    if not torch.cuda.is_available():
        print("gpu_report: no CUDA GPU on this machine (torch.cuda.is_available() is False); "
              "nothing to measure", file=sys.stderr)
        return 2
    started = datetime.datetime.now(datetime.timezone.utc)
    deadline = time.monotonic() + args.total_timeout  # from here: the report's checks count too
    env = environment()
    if env["konkanivani"] != "imports":
        print(f"gpu_report: konkanivani {env['konkanivani']}; every part will fail",
              file=sys.stderr, flush=True)
    path = report_path(args.out, torch.cuda.get_device_name(0), started.date(),
                       tuple(args.parts))
    command = shlex.join(["python3", "benchmarks/gpu_report.py",
                          *(sys.argv[1:] if argv is None else argv)])
    results: dict[str, Outcome] = {}
    limits: dict[str, float] = {}
    own = part_limits(args)
    with tempfile.TemporaryDirectory(prefix="gpu_report_") as tmp:
        work = Path(tmp)
        for name in args.parts:
            left = deadline - time.monotonic()
            limits[name] = min(own[name], left)
            if limits[name] < 10:
                results[name] = Outcome("not run", 0.0,
                                        f"Not run: {left:.0f} s of --total_timeout were left.",
                                        "no time left")
                continue
            print(f"gpu_report: {name} (at most {limits[name]:.0f} s) ...", file=sys.stderr,
                  flush=True)
            try:
                results[name] = RUNNERS[name](args, limits[name], work, results)
            # One part's bug must not cost the others' results.
            except Exception as e:  # noqa: BLE001
                results[name] = Outcome("failed", 0.0, "The report's own code failed: "
                                        f"`{type(e).__name__}: {e}`", f"{type(e).__name__}")
            print(f"gpu_report: {name}: {results[name].status} in {results[name].seconds:.0f} s",
                  file=sys.stderr, flush=True)
            # Written after every part: a call cut short keeps what was measured.
            write_report(path, render(env, started, command, results, limits, budgets(args), args),
                         results)
    print(path)
    return 0 if all(o.status == "passed" for o in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
