"""Experiments over training runs: size sweeps (a grid of trials) and Optuna searches."""
