"""The memory model's constants, measured on this machine and cached (TF).

`Get(num_devices)` reads `$XDG_CACHE_HOME/lingvo_ext/memory_model.json`
(default ~/.cache), keyed by the machine (CPU model, cores, TensorFlow
version, oneDNN setting: jit_choice.Machine) and the device count; on a miss
it runs the probe in a fresh process (its peak RSS its own), writes the
entry and returns it. Processes probing at once probe once (a lock file).
Deleting the file, or `python -m lingvo_ext.planner.memory_probe
--num_devices=N --force`, measures again.

The probe trains two models on N CPU devices, a few steps each, reading its
peak RSS (VmHWM) after each: lm.TransformerLmTiny (its model bytes a few MB:
the peak is the runtime's own, `Constants.runtime_bytes`), then
lm.TransformerLm at batch PROBE_BATCH, whose kept activations are hundreds
of MB: the growth beyond its predicted parameters, graph and input, per byte
of its predicted kept and transient activations, is
`Constants.activation_factor`.
"""

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time

from lingvo_ext.planner import memory_model

_CACHE_FILE = 'memory_model.json'
_LOCK_WAIT_S = 600
_PROBE_TIMEOUT_S = 600
PROBE_STEPS = 3
PROBE_BATCH = 64
SMALL_MODEL = 'lm.TransformerLmTiny'
LARGE_MODEL = 'lm.TransformerLm'


def CachePath() -> str:
  from lingvo_ext import xla_cache  # pylint: disable=g-import-not-at-top
  return os.path.join(xla_cache.CacheRoot(), _CACHE_FILE)


def Key(num_devices: int) -> str:
  from lingvo_ext.core import jit_choice  # pylint: disable=g-import-not-at-top
  return '%s, %d device(s)' % (jit_choice.Machine(), num_devices)


def _Read(path):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _Write(path, key, entry):
  """Adds an entry, atomically."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  cache = _Read(path)
  cache[key] = entry
  tmp = '%s.%d.tmp' % (path, os.getpid())
  with open(tmp, 'w') as f:
    json.dump(cache, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


@contextlib.contextmanager
def _Lock(path):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + '.lock', 'a') as f:
    deadline = time.monotonic() + _LOCK_WAIT_S
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


def _Constants(entry, key) -> memory_model.Constants:
  return memory_model.Constants(
      runtime_bytes=float(entry['runtime_bytes']),
      activation_factor=float(entry['activation_factor']),
      bytes_per_op=float(entry['bytes_per_op']), source=key)


def Get(num_devices: int, force: bool = False) -> memory_model.Constants:
  """This machine's Constants for `num_devices` CPU devices: cached, else
  probed now (a fresh process, some seconds) and cached.

  Raises:
    RuntimeError: the probe failed (its last line).
  """
  path, key = CachePath(), Key(num_devices)
  entry = None if force else _Read(path).get(key)
  if entry is not None:
    return _Constants(entry, key)
  with _Lock(path):
    entry = None if force else _Read(path).get(key)
    if entry is None:
      entry = _RunProbe(num_devices)
      _Write(path, key, entry)
  return _Constants(entry, key)


def _RunProbe(num_devices: int):
  """The probe's entry, from a fresh process."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  try:
    out = subprocess.run(
        [sys.executable, '-m', 'lingvo_ext.planner.memory_probe',
         f'--num_devices={num_devices}', '--measure_only'],
        env=env, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
        check=False)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError('the memory probe did not finish in '
                       f'{_PROBE_TIMEOUT_S} s') from e
  lines = [l for l in out.stdout.splitlines() if l.startswith('{')]
  if out.returncode or not lines:
    tail = (out.stderr.strip().splitlines() or ['no output'])[-1]
    raise RuntimeError(f'the memory probe failed (exit {out.returncode}): '
                       f'{tail}')
  return json.loads(lines[-1])


def _Plan(profile, num_devices: int):
  """One replica over the devices, its layers cut evenly, one micro-batch."""
  from lingvo_ext.core import partitioning  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner.plans import Plan  # pylint: disable=g-import-not-at-top
  k = min(num_devices, len(profile.layers))
  sizes = tuple(partitioning.MinMaxPartition(
      [l.flops for l in profile.layers], k))
  return Plan(num_cells=k, sizes=sizes, devices_per_replica=k,
              num_micro_batches=1, schedule='unrolled', recompute=False,
              replicas=1, gradient_sync='shared', global_batch=profile.batch)


def _Measure(model: str, overrides: str, num_devices: int):
  """(model terms, peak RSS bytes) after PROBE_STEPS steps of `model`."""
  from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
  cfg = tf_profiling.ExperimentParams(model, overrides=overrides)
  profile = tf_profiling.ProfileExperiment(cfg)
  plan = _Plan(profile, num_devices)
  sess, train_op = tf_profiling.BuildExperimentStep(model, plan, overrides)
  for _ in range(PROBE_STEPS):
    sess.run(train_op)
  sess.close()
  return memory_model.ModelTerms(profile, plan), tf_profiling.RssBytes()


def Measure(num_devices: int):
  """The probe's cache entry (TF; run in a fresh process)."""
  from lingvo_ext.planner import calibration  # pylint: disable=g-import-not-at-top
  per_op = calibration.DEFAULT_BYTES_PER_OP
  small, r_small = _Measure(SMALL_MODEL, '', num_devices)
  large, r_large = _Measure(LARGE_MODEL, f'input.batch_size:{PROBE_BATCH}',
                            num_devices)

  def Fixed(m):
    return (m['params'] + m['gradients'] + m['optimizer_slots'] +
            m['input_pipeline'] + m['ops'] * per_op)

  def Kept(m):
    return m['activations'] + m['transient']

  factor = max(((r_large - Fixed(large)) - (r_small - Fixed(small))) /
               max(Kept(large) - Kept(small), 1.), 1.)
  runtime = r_small - Fixed(small) - factor * Kept(small)
  return dict(runtime_bytes=runtime, activation_factor=factor,
              bytes_per_op=per_op, small_rss_bytes=r_small,
              large_rss_bytes=r_large, probe=f'{SMALL_MODEL}, {LARGE_MODEL} '
              f'at batch {PROBE_BATCH}, {num_devices} device(s)')


def main(argv):
  import argparse  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(prog='python -m lingvo_ext.planner.memory_probe',
                               description=__doc__.splitlines()[0])
  ap.add_argument('--num_devices', type=int, default=1,
                  help='CPU devices of the runs to predict.')
  ap.add_argument('--force', action='store_true',
                  help='Measure again and replace the cached entry.')
  ap.add_argument('--measure_only', action='store_true',
                  help='Print the entry as JSON; write no cache.')
  args = ap.parse_args(argv)
  if args.num_devices < 1:
    print('error: --num_devices must be at least 1.', file=sys.stderr)
    return 2
  if args.measure_only:
    print(json.dumps(Measure(args.num_devices)), flush=True)
    return 0
  c = Get(args.num_devices, force=args.force)
  print(json.dumps(dict(c.ToDict(), cache=CachePath()), indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
