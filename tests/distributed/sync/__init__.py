"""Tests of lingvo_ext/distributed/sync/."""
