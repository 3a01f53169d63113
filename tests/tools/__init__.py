"""Tests of lingvo_ext/tools/: the command-line programs."""
