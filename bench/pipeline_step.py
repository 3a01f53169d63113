"""bench/pipeline.py's models and their timed step: the FC stacks
(homogeneous and heterogeneous), the three builds (lingvo.core.gpipe,
lingvo_ext, the plain stack), a step's timing round-robin and its peak RSS.
"""

import importlib
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

import lingvo.compat as tf
from lingvo.core import base_layer
from lingvo.core import builder_layers
from lingvo.core import cluster_factory
from lingvo.core import gpipe as lingvo_gpipe
from lingvo.core import layers
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from bench import torch_common  # pylint: disable=g-import-not-at-top
from lingvo_ext.core import gpipe as ext_gpipe
from lingvo_ext.core import precision
from lingvo_ext.pipeline import records

IMPLS = ('lingvo', 'lingvo_ext', 'plain')


# lingvo_ext schedule variants timed beside the default ('lingvo_ext', the
# default params: 'unrolled'), each as impl 'lingvo_ext/<variant>'.
EXT_VARIANTS = ('unrolled+recompute', '1f1b', 'recurrent')


MODELS = ('homogeneous', 'heterogeneous')


NUM_DEVICES = 2


NUM_LAYERS = 8


# Layer widths of the heterogeneous model, as multiples of --width: per-layer
# FLOPs differ by up to 16x, so cells cannot be balanced exactly.
HETERO_WIDTHS = (1, 2, 0.5, 0.25, 1, 2, 1, 0.25, 1)


LEARNING_RATE = 1e-6


def Log(msg: str) -> None:
  print('[bench] ' + msg, file=sys.stderr, flush=True)


def Widths(model: str, width: int) -> List[int]:
  """The NUM_LAYERS + 1 activation widths of a model."""
  if model == 'homogeneous':
    return [width] * (NUM_LAYERS + 1)
  if model == 'heterogeneous':
    return [max(1, int(round(width * m))) for m in HETERO_WIDTHS]
  raise ValueError('Unknown model %r; use one of %s.' % (model, MODELS))


def LayerParams(model: str, width: int) -> List:
  """FC layer params with explicit per-layer seeds: equal weights anywhere."""
  widths = Widths(model, width)
  return [
      layers.FCLayer.Params().Set(
          name='fc%d' % i, input_dim=a, output_dim=b,
          params_init=py_utils.WeightInit.Gaussian(1.0 / np.sqrt(a),
                                                   seed=i + 1))
      for i, (a, b) in enumerate(zip(widths, widths[1:]))
  ]


class PerExampleLoss(base_layer.BaseLayer):
  """[batch, d] -> [batch]: each example's sum of squares, its loss."""

  def FProp(self, theta, x):
    del theta
    return tf.reduce_sum(tf.square(x), axis=-1)

  @classmethod
  def FPropMeta(cls, p, x):
    return py_utils.NestedMap(
        flops=2 * x.num_elements(),
        out_shapes=(tshape.Shape(x.ToTensorShape().as_list()[:-1]),))


def Cells(model: str, width: int, batch: int, num_cells: int,
          per_example_loss: bool = False) -> List:
  """lingvo_ext FeatureExtractionLayer params: min-max FLOPs partition.

  With `per_example_loss`, a `PerExampleLoss` layer ends the last cell.
  """
  shape = tshape.Shape([batch, Widths(model, width)[0]])
  layer_params = LayerParams(model, width)
  if per_example_loss:
    layer_params.append(PerExampleLoss.Params().Set(name='loss'))
  return ext_gpipe.PartitionSequentialLayers(layer_params, num_cells, shape)


def CellFlops(cells: Sequence, model: str, width: int, batch: int) -> List[int]:
  shape = tshape.Shape([batch, Widths(model, width)[0]])
  out = []
  for c in cells:
    meta = c.cls.FPropMeta(c, shape)
    out.append(int(meta.flops))
    shape = meta.out_shapes[0]
  return out


def SlowestToMean(cell_flops: Sequence[int]) -> float:
  return float(max(cell_flops) / np.mean(cell_flops))


def IdealMs(plain_ms: float, num_cells: int, num_micro: int) -> float:
  """plain x (M+K-1)/(M K) x 4/3 (bubble and recompute); plain for K=1."""
  if num_cells == 1:
    return plain_ms
  return (plain_ms * (num_micro + num_cells - 1) / (num_micro * num_cells) *
          4.0 / 3.0)


INTER_OP_THREADS, INTRA_OP_THREADS = 2, 1


def SessionConfig():
  return tf.config_pb2.ConfigProto(
      device_count={'CPU': NUM_DEVICES},
      inter_op_parallelism_threads=INTER_OP_THREADS,
      intra_op_parallelism_threads=INTRA_OP_THREADS)


def PinThreadPools() -> None:
  """Gives TensorFlow's process-wide pools SessionConfig's thread counts.

  Call before building any graph. lingvo_ext's cell functions are
  tf.functions, and defining one starts TensorFlow's eager context, whose
  pools (TensorFlow's defaults: a thread per core) every later session then
  shares, whatever its config says; Lingvo's pipeline defines none. Without
  this, which pools a session got depended on which implementation a
  process built first.
  """
  try:
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
  except RuntimeError as e:  # The eager context already started.
    Log('WARNING thread pools not pinned: %s' % e)


def BuildPipeline(gpipe_module, cells: Sequence, num_micro_batches: int,
                   **params):
  """`gpipe_module.PipeliningLayer` over `cells`, other params default."""
  cell_tpl = [
      gpipe_module.FeatureExtractionLayer.Params().Set(
          name=c.name, sub=[s.Copy() for s in c.sub]) for c in cells
  ]
  return gpipe_module.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cell_tpl, num_micro_batches=num_micro_batches,
      **params).Instantiate()


def VariantParams(variant: str) -> Dict:
  """'<schedule>[+recompute][+functions|+inline][+jit]' -> layer params."""
  schedule, *extras = variant.split('+')
  flags = {'recompute': ('recompute', True),
           'functions': ('cell_functions', True),
           'inline': ('cell_functions', False), 'jit': ('jit_compile', True)}
  if schedule not in records.NAMES or not set(
      extras) <= set(flags):
    raise ValueError('Unknown lingvo_ext variant %r; use <schedule> with '
                     'optional +recompute, +functions (cell_functions, the '
                     'default), +inline (cell_functions=False) or +jit '
                     '(jit_compile), schedule one of %s.' %
                     (variant, records.NAMES))
  params = dict(schedule=schedule)
  for extra in extras:
    name, value = flags[extra]
    params[name] = value
  return params


def OneDnnEnabled() -> bool:
  """Whether TensorFlow runs oneDNN kernels here (TF_ENABLE_ONEDNN_OPTS)."""
  from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
  return bool(_pywrap_util_port.IsMklEnabled())


def ExtOnlyParams() -> Dict[str, str]:
  """lingvo_ext PipeliningLayer params Lingvo lacks, at their defaults."""
  ext = ext_gpipe.PipeliningLayer.Params()
  ours = dict(ext.IterParams())
  theirs = dict(lingvo_gpipe.PipeliningLayer.Params().IterParams())
  return {k: repr(v) for k, v in sorted(ours.items()) if k not in theirs}


class Step:
  """One implementation's training step in its own graph and session."""

  def __init__(self, impl: str, model: str, width: int, batch: int,
               num_cells: int, num_micro: int, colocate: bool = False,
               dtype: str = 'float32', num_devices: Optional[int] = None):
    """`num_devices`: the pipelines' devices (default one per cell; fewer
    put the cells on them round robin). `dtype` 'bfloat16': fprop_dtype=tf.bfloat16 (Lingvo's mixed
    precision: float32 variables and updates, bfloat16 cells, activations
    and their gradients between cells); the input is cast to it."""
    self.impl = impl
    # With fprop_dtype the micro-batch steps (the first input's dtype
    # otherwise) stay float32.
    bf16 = dict(fprop_dtype=tf.bfloat16) if dtype == 'bfloat16' else {}
    ext_bf16 = dict(bf16, state_dtype=tf.float32) if bf16 else {}
    cells = Cells(model, width, batch, num_cells, per_example_loss=True)
    graph = tf.Graph()
    num_split = 1 if impl == 'plain' else min(num_cells,
                                              num_devices or num_cells)
    with graph.as_default(), cluster_factory.ForTestingWorker(
        mode='sync', job='trainer_client', cpus=num_split,
        split_size=num_split):
      tf.random.set_seed(1)
      py_utils.GetOrCreateGlobalStepVar()
      x = tf.constant(
          np.random.RandomState(0).randn(batch, Widths(model, width)[0]),
          dtype=tf.float32)
      x = tf.cast(x, dtype)
      if impl == 'plain':
        net = builder_layers.SequentialLayer.Params().Set(
            name='plain', sub=[s.Copy() for c in cells for s in c.sub],
            **bf16).Instantiate()
      elif impl == 'lingvo':
        net = BuildPipeline(lingvo_gpipe, cells, num_micro, **bf16)
      elif impl == 'lingvo_ext':
        net = BuildPipeline(ext_gpipe, cells, num_micro, **ext_bf16)
      elif impl.startswith('lingvo_ext/'):
        net = BuildPipeline(ext_gpipe, cells, num_micro,
                             **VariantParams(impl[len('lingvo_ext/'):]),
                             **ext_bf16)
      else:
        raise ValueError('Unknown impl %r; use one of %s.' % (impl, IMPLS))
      y = net.FPropDefaultTheta(x)
      # Per-example losses from the last cell, summed: linear in y.
      self.loss = tf.reduce_sum(tf.cast(y, tf.float32))
      variables = net.vars.Flatten()
      self.variables = variables
      grads = tf.gradients(self.loss, variables,
                           colocate_gradients_with_ops=colocate)
      self.train = tf.group(*[
          tf.assign_sub(v, LEARNING_RATE * g)
          for v, g in zip(variables, grads)
      ])
      init = tf.global_variables_initializer()
    # Bytes of the activations and gradients sent between the cells'
    # devices per step (from the graph's static shapes).
    self.cross_bytes, self.cross_bytes_by_dtype = precision.CrossDeviceBytes(
        graph)
    graph.finalize()
    self.sess = tf.Session(graph=graph, config=SessionConfig())
    self.sess.run(init)

  def FirstLoss(self) -> float:
    return float(self.sess.run(self.loss))

  def Run(self) -> float:
    t = time.perf_counter()
    self.sess.run(self.train)
    return time.perf_counter() - t

  def Close(self) -> None:
    self.sess.close()


def TimeRoundRobin(steps: Dict[str, Step], num_steps: int,
                   warmup: int) -> Dict[str, List[float]]:
  """Warms each step up, then times them interleaved; seconds per impl.

  The order rotates every round so no implementation always runs right after
  the same other one.
  """
  for s in steps.values():
    for _ in range(warmup):
      s.Run()
  names = list(steps)
  times = {n: [] for n in names}
  for r in range(num_steps):
    k = r % len(names)
    for n in names[k:] + names[:k]:
      times[n].append(steps[n].Run())
  return times


# One reader of /proc/self/status for both benches (torch_baselines imports
# only the standard library and numpy at module level).
RssMb = torch_common.RssMb


def ChildPeakRss(job: Dict) -> Dict:
  """Runs in the child: builds one step, runs it, returns its peak RSS (MB).

  Args:
    job: impl, model, width, batch, K, M, steps.

  Returns:
    peak_rss_mb (the process's peak resident set, VmHWM or ru_maxrss) and
    base_rss_mb (resident set before the graph was built).
  """
  PinThreadPools()
  base = RssMb('VmRSS')
  s = Step(job['impl'], job['model'], job['width'], job['batch'], job['K'],
           job['M'], job.get('colocate', False),
           num_devices=job.get('devices'))
  for _ in range(job['steps']):
    s.Run()
  s.Close()
  peak = RssMb('VmHWM')
  if peak is None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
  return dict(peak_rss_mb=peak, base_rss_mb=base)


class RssMeter:
  """Measures peak RSS per job in fresh processes.

  'fork': children forked from a server process that has only imported TF,
  Lingvo and this module (multiprocessing's forkserver), so no import cost
  per child. 'spawn': a new interpreter per job (`--_child`), which pays
  those imports each time. 'none': no measurement.
  """

  def __init__(self, mode: str, timeout_s: float = 600):
    self.mode = mode
    self.timeout_s = timeout_s
    self._ctx = None
    if mode == 'fork':
      self._ctx = multiprocessing.get_context('forkserver')
      self._ctx.set_forkserver_preload(['bench.pipeline_step'])
      # Pickled by module path so the forkserver child can find it.
      self._fn = importlib.import_module('bench.pipeline_step').ChildPeakRss

  def Measure(self, job: Dict) -> Dict:
    if self.mode == 'none':
      return dict(peak_rss_mb=None, base_rss_mb=None)
    try:
      if self.mode == 'fork':
        with self._ctx.Pool(1, maxtasksperchild=1) as pool:
          return pool.apply_async(self._fn, (job,)).get(self.timeout_s)
      out = subprocess.run(
          [sys.executable, os.path.join(os.path.dirname(os.path.abspath(
              __file__)), 'pipeline.py'), '--_child',
           json.dumps(job)], capture_output=True, text=True,
          timeout=self.timeout_s, check=True).stdout
      return json.loads(out.strip().splitlines()[-1])
    except Exception as e:  # pylint: disable=broad-except
      Log('peak RSS of %s failed: %r' % (job, e))
      return dict(peak_rss_mb=None, base_rss_mb=None)
