"""Tests of lingvo_ext/checkpoints/."""
