"""Tests of lingvo_ext/tracing/."""
