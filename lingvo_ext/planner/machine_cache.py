"""Calibrated machines, cached per model shape, machine and TF version.

A calibration (calibration.Calibrate, tree_calibration.Calibrate) times the
model's real cells at the run's shapes: seconds to a minute. Its result, the
fitted `Machine`, is kept in `$XDG_CACHE_HOME/lingvo_ext/calibration.json`
(default ~/.cache), keyed by the model's profile (its cells' FLOPs, ops and
bytes at the batch and sequence length planned), the reference plans timed,
the devices and the machine (CPU model and instruction set, TF version), as
the jit choices are (core/jit_choice.py). `lingvo_ext.tools.plan
--recalibrate` times them again. docs/performance.md, "The plan check".
"""

import dataclasses
import hashlib
import os
from typing import Callable
from typing import Optional
from typing import Sequence

from lingvo_ext import cache_files
from lingvo_ext import xla_cache
from lingvo_ext.planner.model_profile import Machine
from lingvo_ext.planner.model_profile import ModelProfile

CACHE_FILE = 'calibration.json'
# What the fit takes of its timings, in the key: a change invalidates the
# entries fitted otherwise.
FIT = 'median of rounds; loop'


def CachePath() -> str:
  """Where the calibrated machines are kept."""
  return os.path.join(xla_cache.CacheRoot(), CACHE_FILE)


def Key(profile: ModelProfile, devices: int, refs: Sequence[object],
        host: str) -> str:
  """The cache key of a calibration of `profile` on `refs` (Plans)."""
  layers = [dataclasses.astuple(l)[1:] for l in profile.layers]  # No names.
  text = '\n'.join([repr(layers), repr((profile.batch, profile.in_bytes,
                                        profile.optimizer_slots,
                                        profile.cell_functions)),
                    repr([r.Key() for r in refs]), 'devices=%d' % devices,
                    host, FIT])
  return hashlib.sha256(text.encode()).hexdigest()[:24]


def Host() -> str:
  """What a calibration depends on besides the model (TF imported)."""
  from lingvo_ext.core import jit_choice  # pylint: disable=g-import-not-at-top
  return jit_choice.Machine()


def Read(key: str, path: Optional[str] = None) -> Optional[Machine]:
  """The cached Machine of `key`, or None."""
  entry = cache_files.Read(path or CachePath()).get(key)
  if not isinstance(entry, dict):
    return None
  fields = {f.name for f in dataclasses.fields(Machine)}
  try:
    return Machine(**{k: v for k, v in entry.items() if k in fields})
  except TypeError:
    return None


def Write(key: str, machine: Machine, path: Optional[str] = None) -> None:
  """Adds the entry, atomically (several processes may calibrate at once)."""
  try:
    cache_files.Add(path or CachePath(), key, dataclasses.asdict(machine))
  except OSError:
    pass  # A cache that cannot be written calibrates again next time.


def Cached(key: str, calibrate: Callable[[], Machine],
           recalibrate: bool = False,
           path: Optional[str] = None) -> Machine:
  """The cached machine of `key`, else calibrate() (then cached)."""
  if not recalibrate:
    got = Read(key, path)
    if got is not None:
      return got
  machine = calibrate()
  Write(key, machine, path)
  return machine
