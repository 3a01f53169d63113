"""Tests of lingvo_ext/tasks/: the tasks and the experiments on them."""
