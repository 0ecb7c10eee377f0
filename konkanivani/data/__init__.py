"""Everything between audio files on disk and padded batches: reading audio and log-mel features,
the tokenizer, manifests and their row checks, the dataset with CMVN, the batch samplers and online
augmentation. It knows nothing of the model (docs/architecture.md)."""
