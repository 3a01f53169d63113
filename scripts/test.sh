#!/usr/bin/env bash
# Runs the test suite in parallel (installs .venv first when needed).
#   bash scripts/test.sh            every test
#   bash scripts/test.sh --quick    all but the end-to-end tests and the
#                                   numerics cases beyond the quick tier's
#                                   share (markers e2e, slow; pytest.ini)
# Other args go to pytest, e.g. bash scripts/test.sh tests/tasks/test_lm.py
# TEST_JOBS sets the number of pytest-xdist workers (0: no workers).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/venv.sh"
cd "$root"
# Each worker, forked-run server and fresh interpreter would otherwise compile
# this checkout's modules again and re-rewrite the test modules' asserts
# (1.7 of a worker's 7 CPU-seconds of collection); the caches are gitignored.
unset PYTHONDONTWRITEBYTECODE
args=()
# One more worker than cores: the end-to-end tests spend much of their time
# waiting on their subprocesses. The quick tier does not wait: one per core
# (each worker first spends seconds importing TensorFlow).
spare=1
for a in "$@"; do
  if [ "$a" = --quick ]; then
    args+=(-m "not e2e and not slow")
    spare=0
  else
    args+=("$a")
  fi
done
jobs="${TEST_JOBS:-$(( $(nproc) + spare ))}"
# One test at a time to whichever worker is free, in the order conftest.py
# sorts them (longest first, by last run's times): a long test does not wait
# in one worker's queue while the others run out of work (pytest-xdist's
# 'load' and 'worksteal' first hand each worker a contiguous share of the
# list, so the long tests sorted first all landed on one worker).
exec "$root/.venv/bin/python" -m pytest -n "$jobs" --dist load \
  --maxschedchunk 1 ${args[@]+"${args[@]}"}
