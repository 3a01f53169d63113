"""The JSON files lingvo_ext keeps per machine under its cache folder.

jit_compile='auto''s choices (core/jit_choice.py), the memory model's
constants (planner/memory_probe.py) and the calibrated machines of the plan
check (planner/machine_cache.py) are each one JSON object of entries, in
xla_cache.CacheRoot(). Several processes may add to one at once: an entry is
added by writing the whole object to a file of this process's and renaming
it over the old one; `Lock` keeps two processes from measuring the same
entry at once. Pure Python: no TensorFlow import.
"""

import contextlib
import fcntl
import json
import os
import time


def Read(path: str) -> dict:
  """The file's entries; {} when it is missing, unreadable or not an object."""
  try:
    with open(path) as f:
      entries = json.load(f)
  except (OSError, ValueError):
    return {}
  return entries if isinstance(entries, dict) else {}


def Add(path: str, key: str, entry) -> None:
  """Adds (or replaces) one entry, atomically."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  entries = Read(path)
  entries[key] = entry
  tmp = '%s.%d.tmp' % (path, os.getpid())
  with open(tmp, 'w') as f:
    json.dump(entries, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


@contextlib.contextmanager
def Lock(path: str, wait_s: float):
  """Holds the lock file `path` (made if missing) while a process reads an
  entry and maybe measures it: the others wait, then read it. Waits at most
  wait_s, then goes on without the lock (a measurement twice, not a hang)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'a') as f:
    deadline = time.monotonic() + wait_s
    locked = False
    while not locked:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
      except OSError:
        if time.monotonic() > deadline:
          break
        time.sleep(0.2)
    try:
      yield
    finally:
      if locked:
        fcntl.flock(f, fcntl.LOCK_UN)
