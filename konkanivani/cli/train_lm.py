"""Train a language model on text alone for shallow fusion (``konkanivani-train-lm``).

    konkanivani-train-lm corpus.txt more.txt --tokenizer checkpoints/run/best.pt \\
        --output_dir checkpoints/lm --valid_text valid.txt --max_steps 20000

One sentence a line, normalized as transcripts are (``normalize_text``) and tokenized with the
ASR checkpoint's own tokenizer (or a ``.model`` file), which the LM checkpoint then carries:
decoding refuses an LM whose pieces differ from the recognizer's. Blank lines are skipped and
counted. Without ``--valid_text`` a small held-out fraction of the text measures validation
perplexity. Checkpoints are written atomically to ``OUTPUT_DIR`` (``step_*.pt``, ``latest.pt``,
``best.pt`` by validation perplexity, ``metrics.jsonl``); ``--resume latest`` goes on exactly where
a run stopped (``--max_time``, Ctrl-C, a kill), giving the losses an unbroken run gives.
"""
from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from . import Parser, fail, setup_logging, tool
from ..config import DEFAULT_SEED
from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..training.metrics_log import MetricsLog
from ..training.state import capture_rng, restore_rng
from ..training.rundir import claim_output_dir, hold_run_directory, load_resume_checkpoint, point_to, prune_checkpoints, step_checkpoint_name
from ..model.lm import LMConfig, TransformerLM
from ..training.optim import adamw
from ..training.precision import resolve_device
from ..training.signals import StopRequest
from ..data.tokenizer import UNK_ID, Tokenizer, normalize_text
from ..training.optim import lr_factor

log = logging.getLogger("konkanivani")


KEPT_ON_RESUME = ("seed", "batch_size", "valid_fraction")  # a resumed run takes these from its checkpoint


class TextError(ValueError):
    """Text that cannot be used; the message names the file (and line)."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an ASR checkpoint, or a SentencePiece ``.model`` file."""
    path = Path(path)
    if not path.is_file():
        raise TextError(f"--tokenizer {path}: file not found")
    try:
        if path.suffix == ".model":
            return Tokenizer.load(path)
        return Tokenizer(load_checkpoint(path)["tokenizer"])
    except KeyError:
        raise TextError(f"--tokenizer {path}: the checkpoint carries no tokenizer") from None
    except (RuntimeError, ValueError, OSError) as e:
        raise TextError(f"--tokenizer {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def read_sentences(paths: list[str | Path], tokenizer: Tokenizer) -> tuple[list[list[int]], int]:
    """Token ids of every non-blank line of ``paths`` (after normalization), and how many lines were
    blank. ``TextError`` naming the file and line for text that is not UTF-8."""
    sentences: list[list[int]] = []
    blank = 0
    for path in map(Path, paths):
        if not path.is_file():
            raise TextError(f"{path}: file not found")
        with open(path, "rb") as f:  # bytes, decoded line by line, so that an error names its line
            for line_no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TextError(f"{path}:{line_no}: not UTF-8 text") from None
                ids = tokenizer.encode(line) if normalize_text(line) else []
                if ids:
                    sentences.append(ids)
                else:
                    blank += 1
    return sentences, blank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", nargs="+", type=Path, help="text files, one sentence a line")
    p.add_argument("--tokenizer", type=Path, required=True, help="the ASR checkpoint the LM will serve, or a .model")
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--valid_text", type=Path, help="held-out text for validation perplexity")
    p.add_argument("--valid_fraction", type=float, default=0.05,
                   help="without --valid_text, this share of the sentences is held out (default: %(default)s)")
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--ffn_dim", type=int, default=0, help="default: 4 x d_model")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch_size", type=int, default=64, help="sentences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup_steps", type=int, default=500, help="then 1/sqrt decay, as konkanivani-train")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max_steps", type=int, default=0, help="stop after this many steps (0: --epochs decides)")
    p.add_argument("--valid_every", type=int, default=500, help="validate and save every N steps, and each epoch")
    p.add_argument("--keep_checkpoints", type=int, default=3)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="default: %(default)s")
    p.add_argument("--max_time", type=float, default=0.0, help="seconds; then save and stop (0: no limit)")
    p.add_argument("--resume", default="", help="latest, or a checkpoint path")
    p.add_argument("--overwrite", action="store_true", help="move an earlier run in --output_dir aside")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    positive = ("d_model", "layers", "n_heads", "batch_size", "epochs", "valid_every", "keep_checkpoints")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer")
    if args.d_model % args.n_heads or (args.d_model // args.n_heads) % 2:
        p.error(f"--d_model {args.d_model} must split into --n_heads {args.n_heads} heads of even width")
    if not 0.0 < args.valid_fraction < 1.0:
        p.error("--valid_fraction must be in (0, 1)")
    if args.lr <= 0 or not 0.0 <= args.dropout < 1.0:
        p.error("--lr must be positive and --dropout in [0, 1)")
    args.ffn_dim = args.ffn_dim or 4 * args.d_model
    return args


def _split(sentences: list[list[int]], fraction: float, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """A held-out share of the sentences, the same for a given seed (a resumed run sees the same split)."""
    order = torch.randperm(len(sentences), generator=torch.Generator().manual_seed(seed)).tolist()
    n_valid = max(1, round(fraction * len(sentences))) if len(sentences) > 1 else 0
    return [sentences[i] for i in order[n_valid:]], [sentences[i] for i in order[:n_valid]]


@torch.inference_mode()
def perplexity(model: TransformerLM, sentences: list[list[int]], batch_size: int, device: torch.device) -> float:
    """exp(mean negative log-likelihood per predicted token, end symbols included)."""
    model.eval()
    nll, tokens = 0.0, 0
    for start in range(0, len(sentences), batch_size):
        loss, n = model.loss(sentences[start:start + batch_size], device)
        nll, tokens = nll + float(loss), tokens + n
    return math.exp(nll / tokens) if tokens else math.nan


def _read_text(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list, list, list]:
    """All sentences, the training set and the validation set (``TextError`` for an empty one). What was
    read is logged here; the split is logged by the caller, after a resume has redone it."""
    sentences, blank = read_sentences(args.text, tokenizer)
    if not sentences:
        raise TextError(f"no sentence in {', '.join(map(str, args.text))} ({blank} blank lines)")
    if args.valid_text:
        train_set, (valid_set, valid_blank) = sentences, read_sentences([args.valid_text], tokenizer)
    else:
        (train_set, valid_set), valid_blank = _split(sentences, args.valid_fraction, args.seed), 0
    if not valid_set or not train_set:
        raise TextError(f"no sentence left for {'validation' if not valid_set else 'training'} "
                        f"({args.valid_text or f'--valid_fraction {args.valid_fraction} of {len(sentences)}'})")
    n_tokens = sum(map(len, sentences))
    unk = sum(s.count(UNK_ID) for s in sentences)
    log.info("%d sentences (%d tokens, %d <unk>), %d blank lines skipped%s", len(sentences), n_tokens, unk, blank,
             f"; validation on {args.valid_text} ({valid_blank} blank lines skipped)" if args.valid_text else "")
    return sentences, train_set, valid_set


def _resumed_settings(args: argparse.Namespace, state: dict[str, Any], tokenizer: Tokenizer) -> None:
    """A resumed run's tokenizer must be the checkpoint's, and it keeps the settings that decide its batches."""
    if bytes(state["tokenizer"]) != tokenizer.model_proto:
        raise CheckpointError(f"--resume {args.resume}: the checkpoint's tokenizer differs from --tokenizer "
                              f"{args.tokenizer}")
    for name in KEPT_ON_RESUME:
        if getattr(args, name) != state["train_config"][name]:
            log.warning("on resume, --%s %s as in the checkpoint (it decides the batches)", name,
                        state["train_config"][name])
            setattr(args, name, state["train_config"][name])


def _train_step(model: TransformerLM, optimizer: torch.optim.Optimizer, batch: list[list[int]], lr: float,
                device: torch.device) -> float:
    """One update at learning rate ``lr``; the batch's mean loss per token."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    nll, n = model.loss(batch, device)
    (nll / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(nll.detach()) / n


def train_lm(args: argparse.Namespace) -> dict[str, Any]:
    """The training loop; returns the final step, validation perplexity and what stopped it."""
    tokenizer = load_tokenizer(args.tokenizer)
    sentences, train_set, valid_set = _read_text(args, tokenizer)
    device = resolve_device(args.device)
    out = Path(args.output_dir)
    with hold_run_directory(out), StopRequest(args.max_time) as stop_request:
        claim_output_dir(out, args.resume, args.overwrite)
        state = load_resume_checkpoint(args.resume, out)[0] if args.resume else None
        if state is not None:
            _resumed_settings(args, state, tokenizer)
            if not args.valid_text:
                train_set, valid_set = _split(sentences, args.valid_fraction, args.seed)
        log.info("%d sentences for training, %d for validation", len(train_set), len(valid_set))
        cfg = (LMConfig(**state["lm_config"]) if state else
               LMConfig(tokenizer.vocab_size, args.d_model, args.n_heads, args.ffn_dim, args.layers, args.dropout))
        torch.manual_seed(args.seed)
        model = TransformerLM(cfg).to(device)
        optimizer = adamw(list(model.parameters()), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
        step = epoch = batches_done = 0
        best = last_ppl = math.inf
        saved_step = -1
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            restore_rng(state["rng"])
            step, epoch, batches_done = state["step"], state["epoch"], state["batches_done"]
            best = state["best_valid_ppl"]
            log.info("resumed at step %d (epoch %d, batch %d)", step, epoch + 1, batches_done)
        metrics = MetricsLog(out / "metrics.jsonl")
        metrics.truncate(step)
        log.info("LM: %s, %.2fM parameters", cfg, sum(p.numel() for p in model.parameters()) / 1e6)

        def save(valid_ppl: float) -> None:
            nonlocal best, last_ppl, saved_step
            last_ppl, saved_step = valid_ppl, step
            is_best = valid_ppl < best
            best = min(best, valid_ppl)
            path = save_checkpoint({
                "lm_config": cfg.to_dict(), "train_config": {k: str(v) if isinstance(v, Path) else v
                                                             for k, v in vars(args).items() if k != "text"},
                "tokenizer": tokenizer.model_proto, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "epoch": epoch, "batches_done": batches_done, "rng": capture_rng(),
                "valid_ppl": valid_ppl, "best_valid_ppl": best}, out / step_checkpoint_name(step))
            point_to(path, out / "latest.pt")
            if is_best:
                point_to(path, out / "best.pt")
            prune_checkpoints(out, args.keep_checkpoints)
            metrics.write("valid", step, epoch, ppl=valid_ppl)
            log.info("step %d: validation perplexity %.2f%s; saved %s", step, valid_ppl,
                     " (best)" if is_best else "", path.name)

        stop = "max_steps" if 0 < args.max_steps <= step else None
        while epoch < args.epochs and stop is None:
            order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed * 100_003 + epoch))
            batches = [order[i:i + args.batch_size].tolist() for i in range(0, len(train_set), args.batch_size)]
            losses = []
            for i in range(batches_done, len(batches)):
                model.train()
                lr = args.lr * lr_factor(step, args.warmup_steps)
                losses.append(_train_step(model, optimizer, [train_set[j] for j in batches[i]], lr, device))
                step, batches_done = step + 1, i + 1
                metrics.write("train", step, epoch, loss=losses[-1], lr=lr)
                if 0 < args.max_steps <= step:
                    stop = "max_steps"
                elif (reason := stop_request.reason()) is not None:
                    stop = reason
                if stop is not None:
                    break
                if step % args.valid_every == 0:
                    save(perplexity(model, valid_set, args.batch_size, device))
            else:
                epoch, batches_done = epoch + 1, 0
            if losses:
                log.info("step %d (%d epochs done): mean training loss %.3f over the last %d steps", step, epoch,
                         sum(losses) / len(losses), len(losses))
            if saved_step != step:  # not saved by --valid_every at this very step
                save(perplexity(model, valid_set, args.batch_size, device))
    return {"step": step, "epoch": epoch, "valid_ppl": last_ppl, "best_ppl": best, "stopped_by": stop}


@tool
def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = parse_args(argv)
    try:
        summary = train_lm(args)
    except (TextError, CheckpointError, RuntimeError) as e:
        return fail(str(e))
    print(f"step {summary['step']}: validation perplexity {summary['valid_ppl']:.2f} (best {summary['best_ppl']:.2f}); "
          f"checkpoints in {args.output_dir}"
          + (f"; stopped by {summary['stopped_by']}, continue with --resume latest"
             if summary["stopped_by"] not in (None, "max_steps") else ""))
    stopped = summary["stopped_by"]
    return 128 + signal.Signals[stopped] if stopped in ("SIGINT", "SIGTERM") else 0


if __name__ == "__main__":
    sys.exit(main())
