"""Tests of lingvo_ext/runtime/."""
