"""Tests of lingvo_ext/planner/."""
