"""The training machinery both trainers share (the ASR model's ``loop`` and the LM's
``lm_training``): the run's files, checkpoint state, stopping, precision, memory, distributed data
parallelism, the optimizer and its schedule, EMA, fine-tuning and the logs."""
