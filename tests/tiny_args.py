"""The training flags the end-to-end and fault tests share: the tiny preset, a few seconds a run."""


def tiny_args(corpus, out, *extra):
    return [
        "--train_manifest",
        str(corpus / "train.jsonl"),
        "--valid_manifest",
        str(corpus / "valid.jsonl"),
        "--output_dir",
        str(out),
        "--preset",
        "tiny",
        "--vocab_size",
        "48",
        "--batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--lr",
        "2e-3",
        "--warmup_steps",
        "8",
        "--epochs",
        "100",
        "--log_every",
        "1",
        "--num_workers",
        "0",
        "--no_progress",
        "--seed",
        "5",
        *extra,
    ]
