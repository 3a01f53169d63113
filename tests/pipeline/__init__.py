"""Tests of lingvo_ext/pipeline/."""
