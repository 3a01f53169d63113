"""Tests of lingvo_ext/core/."""
