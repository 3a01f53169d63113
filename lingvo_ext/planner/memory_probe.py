"""The memory model's constants, measured on this machine and cached (TF).

`Get(num_devices)` reads `$XDG_CACHE_HOME/lingvo_ext/memory_model.json`
(default ~/.cache), keyed by the machine (CPU model, cores, TensorFlow
version, oneDNN setting: jit_choice.Machine) and the device count; on a miss
it runs the probe (three trainer runs, each a fresh process: its peak RSS its
own; one per core at once; some seconds to minutes, by the load),
writes the entry and returns it. Processes probing at once probe once (a
lock file).
Deleting the file, or `python -m lingvo_ext.tools.memory_probe
--num_devices=N --force`, measures again.

The probe trains three models with the trainer on N CPU devices, a few
steps each, reading each process's peak RSS (VmHWM): lm.TransformerLmTiny
(a few MB of model: mostly the runtime's own), the same with its cells
copied per micro-batch (a graph of thousands of ops), and lm.TransformerLm
at batch PROBE_BATCH (hundreds of MB of kept activations). The three peaks
fix `Constants.runtime_bytes`, `bytes_per_op` and `activation_factor`
(PROBE_RUNS, Measure); the graph's figure is per node of each run's
training graph as built (tree_memory.TrainingGraphNodes), the unit the
memory model's graph term counts in. An entry of an older model
(MODEL_VERSION) is not read: it is measured again.
"""

import json
import os
import subprocess
import sys

from lingvo_ext import cache_files
from lingvo_ext.planner import memory_model

_CACHE_FILE = 'memory_model.json'
_LOCK_WAIT_S = 600
_PROBE_TIMEOUT_S = 900
PROBE_STEPS = 3
# Set in the probe's trainer runs: their start check predicts nothing (no
# constants yet).
_IN_PROBE = 'LINGVO_EXT_IN_MEMORY_PROBE'

# The model the cached constants belong to: entries of another are measured
# again (the graph's constant was per counted op, now per graph node).
MODEL_VERSION = 2
PROBE_BATCH = 64
# (experiment, override): the runtime's own peak (a few MB of model); a
# graph of many ops (each cell copied per micro-batch) and few activations;
# hundreds of MB of activations.
PROBE_RUNS = (
    ('lm.TransformerLmTiny', ''),
    ('lm.TransformerLmTiny', 'task.cell_functions:False; '
     'task.num_micro_batches:8; task.num_layers:4'),
    ('lm.TransformerLm', f'input.batch_size:{PROBE_BATCH}'),
)
# Bounds of the fitted activation factor: beyond them the probe measured
# something else (another process's pages, a failed step).
FACTOR_RANGE = (0.25, 4.)


def CachePath() -> str:
  from lingvo_ext import xla_cache  # pylint: disable=g-import-not-at-top
  return os.path.join(xla_cache.CacheRoot(), _CACHE_FILE)


def Key(num_devices: int) -> str:
  from lingvo_ext.core import jit_choice  # pylint: disable=g-import-not-at-top
  return '%s, %d device(s), model %d' % (jit_choice.Machine(), num_devices,
                                         MODEL_VERSION)


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
  entry = None if force else cache_files.Read(path).get(key)
  if entry is not None:
    return _Constants(entry, key)
  with cache_files.Lock(path + '.lock', _LOCK_WAIT_S):
    entry = None if force else cache_files.Read(path).get(key)
    if entry is None:
      # Once per machine: the first run would seem to hang without a word.
      runs = len(PROBE_RUNS)
      print(f'memory model: measuring this machine\'s constants for '
            f'{num_devices} device(s), once ({runs} short trainer runs, '
            f'{min(runs, os.cpu_count() or 1)} at a time; cached in '
            f'{path}; `.venv/bin/python -m lingvo_ext.tools.memory_probe '
            f'--num_devices={num_devices}` does it ahead).', file=sys.stderr,
            flush=True)
      entry = Measure(num_devices)
      cache_files.Add(path, key, entry)
  return _Constants(entry, key)


def Seed(num_devices: int, entry) -> None:
  """Caches `entry` (Measure's fields) for `num_devices` unless an entry is
  there (a test suite's known constants)."""
  path, key = CachePath(), Key(num_devices)
  with cache_files.Lock(path + '.lock', _LOCK_WAIT_S):
    if key not in cache_files.Read(path):
      cache_files.Add(path, key, entry)


def InProbe() -> bool:
  """Whether this process is one of the probe's trainer runs."""
  return bool(os.environ.get(_IN_PROBE))


def TrainerPeak(model: str, overrides: str, num_devices: int,
                steps: int) -> float:
  """The peak RSS (its own VmHWM: child_peak.py) of the trainer training
  `model` for `steps` steps on `num_devices` CPU devices, in a fresh
  process."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from lingvo_ext import child_peak  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory(prefix='lingvo_ext_memory_probe_') as d:
    args = [f'--model={model}', f'--logdir={d}',
            f'--num_cpu_devices={num_devices}',
            f'--worker_split_size={num_devices}', f'--max_steps={steps}',
            f'--model_params_override={overrides}']
    env = dict(os.environ, **{_IN_PROBE: '1'})
    with open(os.path.join(d, 'stderr.txt'), 'w+') as err:
      try:
        code, peak = child_peak.Run('lingvo_ext.trainer', args, env=env,
                                    stdout=subprocess.DEVNULL, stderr=err,
                                    timeout_s=_PROBE_TIMEOUT_S)
      except TimeoutError:
        raise RuntimeError(f'the memory probe ({model}) did not finish in '
                           f'{_PROBE_TIMEOUT_S} s') from None
      if code or peak is None:
        err.seek(0)
        tail = (err.read().strip().splitlines() or ['no output'])[-1]
        raise RuntimeError(f'the memory probe ({model}) failed (exit '
                           f'{code}): {tail}')
  return float(peak)


def Measure(num_devices: int, parallel: int = 0):
  """The probe's cache entry: three trainer runs, each a fresh process.

  Each run's peak RSS is runtime + its predicted fixed bytes (parameters,
  gradients, slots, input) + factor x its predicted activation bytes
  (memory_model.SCALED_TERMS) + bytes_per_op x its training graph's nodes
  (built, tree_memory.TrainingGraphNodes): three
  equations in the three constants. The runs go `parallel` at a time (0:
  one per core, at most all): each reads its own process's peak, so they do
  not disturb each other's figure; their predictions are made meanwhile.
  """
  import concurrent.futures  # pylint: disable=g-import-not-at-top

  import numpy as np  # pylint: disable=g-import-not-at-top

  from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
  from lingvo_ext.planner import tree_memory  # pylint: disable=g-import-not-at-top
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  base = memory_model.Constants(runtime_bytes=0., activation_factor=0.,
                                bytes_per_op=0.)
  workers = parallel or min(len(PROBE_RUNS), os.cpu_count() or 1)
  rows, fixed, graph_nodes = [], [], []
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    # The longest run first: the others fit in its time.
    peaks = {i: pool.submit(TrainerPeak, model, over, num_devices,
                            PROBE_STEPS)
             for i, (model, over) in reversed(list(enumerate(PROBE_RUNS)))}
    for model, over in PROBE_RUNS:
      cfg = experiment_params.GetParams(model, 'Train', over)
      # As the trainer's start check predicts the run (start_memory).
      profile = tf_profiling.ProfileExperiment(cfg)
      plan = memory_model.PlanOfParams(profile, cfg.task, num_devices,
                                       num_devices)
      m = memory_model.ModelTerms(profile, plan)
      fixed.append(memory_model.Predict(profile, plan, base).rss_bytes)
      nodes = tree_memory.TrainingGraphNodes(cfg, num_devices, num_devices)
      rows.append([1., sum(m[n] for n in memory_model.SCALED_TERMS), nodes])
      graph_nodes.append(nodes)
    rhs = [peaks[i].result() - fixed[i] for i in range(len(PROBE_RUNS))]
  runtime, factor, per_op = np.linalg.solve(np.array(rows), np.array(rhs))
  if not (FACTOR_RANGE[0] <= factor <= FACTOR_RANGE[1] and per_op >= 0 and
          runtime > 0):
    raise RuntimeError(
        f'the memory probe fitted runtime {runtime / 2**20:.0f} MB, factor '
        f'{factor:.2f}, {per_op:.0f} bytes per op: out of bounds (another '
        'process\'s pages?); run it again on a quieter machine.')
  return dict(runtime_bytes=float(runtime), activation_factor=float(factor),
              bytes_per_op=float(per_op), graph_nodes=graph_nodes,
              peaks=[peaks[i].result() for i in range(len(PROBE_RUNS))],
              probe='; '.join(f'{m} {o}'.strip() for m, o in PROBE_RUNS) +
              f', the trainer on {num_devices} device(s), {PROBE_STEPS} '
              f'steps each, {workers} at a time')


def main(argv):
  import argparse  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(prog='python -m lingvo_ext.tools.memory_probe',
                               description=__doc__.splitlines()[0])
  ap.add_argument('--num_devices', type=int, default=1,
                  help='CPU devices of the runs to predict.')
  ap.add_argument('--force', action='store_true',
                  help='Measure again and replace the cached entry.')
  args = ap.parse_args(argv)
  if args.num_devices < 1:
    print('error: --num_devices must be at least 1.', file=sys.stderr)
    return 2
  c = Get(args.num_devices, force=args.force)
  print(json.dumps(dict(c.ToDict(), cache=CachePath()), indent=1))
  return 0

