"""Whole-command runs: the trainer, the launcher, the docs examples."""
