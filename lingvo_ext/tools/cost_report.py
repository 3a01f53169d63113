r"""Per-layer cost report of a registered pipelined model.

  .venv/bin/python -m lingvo_ext.tools.cost_report --model=lm.TransformerLm \
      --num_partitions=2 [--cost=flops|params|time] [--json] [--verify] \
      [--plot=cells.png]

Takes the model's flat layer stack (`task.cls.LayerStack(task_params)`),
partitions it as the task does (`FlattenSequentialLayers`, `LayerCosts`,
`MinMaxPartition`) and prints every layer (name, class, output shape, FLOPs,
parameters, activation bytes, cell), the per-cell totals and the ratio of the
costliest cell to the mean. An experiment that holds its pipelines already
cut (Lingvo's task code, e.g. a GPipeTransformerStack in an MT task) gets each
pipeline's cells as it cuts them, profiled as the planner does.

  --json     The same as JSON: keys `layers` (each with name, cls, flops,
             params, out_shapes, partition, ...), `partitions` (each with
             flops, ...), `total_flops` and `bottleneck_over_mean`.
  --verify   Adds each layer's TensorFlow profiler count, tf_profiler_flops.
  --plot F   Draws per-cell cost as bars stacked by layer into F (PNG).
  --split_size N
             Devices in the model split (as the trainer's --worker_split_size;
             default: the number of cells), used to show where the shards of
             partitioned variables go.

Layers with partitioned variables (EmbeddingLayer / SoftmaxLayer with a
`partitioner`) list each shard (variable, shape, bytes, device) under
`param_shards` in JSON and in a table of parameter shards, with the shard
bytes per device.

Other flags (e.g. --model_params_override) go to Lingvo's flag parser.
"""

import argparse
import json
import statistics
import sys
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

from lingvo_ext import entry_point  # pylint: disable=g-bad-import-order

# isort: split
import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import tshape
import numpy as np
import sympy

from lingvo_ext.core import gpipe
from lingvo_ext.pipeline import cost as cost_lib
from lingvo_ext.pipeline import partitioning


def _Dim(d):
  d = sympy.sympify(d)
  return int(d) if d.is_number else str(d)


def _ShapeList(s) -> Optional[List[Any]]:
  if s is None:
    return None
  return [_Dim(s[i]) for i in range(s.rank)]


def BuildReport(layer_params: Sequence[Any],
                shapes: Sequence[tshape.Shape],
                num_partitions: int,
                cost: str = 'flops',
                verify: bool = False,
                cell_devices: Optional[Sequence[str]] = None,
                **cost_kwargs) -> Dict[str, Any]:
  """Costs, cells and totals of a sequential layer stack.

  Args:
    layer_params: Layer params (nested Sequential/FeatureExtraction layers are
      flattened, as PartitionSequentialLayers does).
    shapes: tshape.Shapes of the inputs of the first layer.
    num_partitions: Number of pipeline cells.
    cost: What the partition balances: 'flops', 'params' or 'time'.
    verify: Whether to add each layer's TF profiler FLOPs.
    cell_devices: Where each cell's variables live when they are colocated
      with the cell (gpipe.CellVariableDevices); the device shown for a
      variable of a layer without a partitioner. None or '': as FPropMeta
      says.
    **cost_kwargs: Passed to cost.LayerCosts (e.g. device, num_repeats).

  Returns:
    A JSON-able dict; see the module docstring.
  """
  if cost not in cost_lib.COST_CHOICES:
    raise ValueError('cost=%r is not a known cost; choose one of %s.' %
                     (cost, ', '.join(cost_lib.COST_CHOICES)))
  subs = gpipe.FlattenSequentialLayers(list(layer_params))
  for i, s in enumerate(subs):
    if not s.name:
      s.name = 'layer_%03d' % i
  metas = cost_lib.LayerMetas(subs, *shapes)
  if cost == 'flops':
    costs = [float(m.flops) for m in metas]
  else:
    costs = cost_lib.LayerCosts(subs, *shapes, cost=cost, **cost_kwargs)
  sizes = partitioning.MinMaxPartition(costs, num_partitions)

  layers, start = [], 0
  for cell, size in enumerate(sizes):
    for i in range(start, start + size):
      p, m = subs[i], metas[i]
      dtype = p.dtype if hasattr(p, 'dtype') else tf.float32
      variables = cost_lib.LayerVariables(p)
      # A layer without a partitioner creates its variables in the cell's
      # device scope: they live with the cell (PipeliningLayer's
      # colocate_cell_variables), not where FPropMeta's one shard says.
      colocated = (cell_devices[cell] if cell_devices and
                   getattr(p, 'partitioner', None) is None else '')
      entry = {
          'index': i,
          'name': p.name,
          'cls': p.cls.__name__,
          'in_shapes': [_ShapeList(s) for s in m.in_shapes],
          'out_shapes': [_ShapeList(s) for s in m.out_shapes],
          'flops': int(m.flops),
          'params': sum(int(np.prod(v[1])) for v in variables),
          'param_bytes': sum(int(np.prod(v[1])) * v[2].size
                             for v in variables),
          'activation_bytes': cost_lib.ActivationBytes(m.out_shapes, dtype),
          'cost': costs[i],
          'partition': cell,
          'param_shards': [{
              'var': sh.var,
              'shard': sh.shard,
              'shape': list(sh.shape),
              'bytes': int(sh.bytes),
              'device': colocated or sh.device,
          } for sh in m.param_shards],
      }
      if verify:
        entry['tf_profiler_flops'] = cost_lib.TfProfilerFlops(p, *m.in_shapes)
      layers.append(entry)
    start += size

  partitions = []
  for cell, size in enumerate(sizes):
    members = [l for l in layers if l['partition'] == cell]
    part = {
        'index': cell,
        'num_layers': size,
        'layers': [l['name'] for l in members],
        'flops': sum(l['flops'] for l in members),
        'params': sum(l['params'] for l in members),
        'param_bytes': sum(l['param_bytes'] for l in members),
        'activation_bytes': sum(l['activation_bytes'] for l in members),
        'cost': sum(l['cost'] for l in members),
    }
    if verify:
      part['tf_profiler_flops'] = sum(l['tf_profiler_flops'] for l in members)
    partitions.append(part)

  def _OverMean(values):
    mean = statistics.mean(values)
    return max(values) / mean if mean else 1.0

  shard_bytes = {}
  for l in layers:
    for sh in l['param_shards']:
      shard_bytes[sh['device']] = shard_bytes.get(sh['device'], 0) + sh['bytes']
  report = {
      # Bytes of partitioned-variable shards per device ('' = unplaced).
      'shard_bytes_by_device': shard_bytes,
      'cost': cost,
      'num_partitions': num_partitions,
      'input_shapes': [_ShapeList(s) for s in shapes],
      'layers': layers,
      'partitions': partitions,
      'total_flops': sum(l['flops'] for l in layers),
      'total_params': sum(l['params'] for l in layers),
      'total_param_bytes': sum(l['param_bytes'] for l in layers),
      # The costliest cell over the mean cell, in the balanced cost.
      'bottleneck_over_mean': _OverMean([p['cost'] for p in partitions]),
      'flops_bottleneck_over_mean': _OverMean(
          [p['flops'] for p in partitions]),
  }
  if verify:
    report['total_tf_profiler_flops'] = sum(
        l['tf_profiler_flops'] for l in layers)
  return report


def _Si(x) -> str:
  """1234567 -> '1.23M'."""
  x = float(x)
  for unit, scale in (('T', 1e12), ('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(x) >= scale:
      return '%.3g%s' % (x / scale, unit)
  return '%.3g' % x


def _CostStr(report, value) -> str:
  if report['cost'] == 'time':
    return '%.3gms' % (value * 1e3)
  if report['cost'] == 'params':
    return _Si(value) + 'B'
  return _Si(value)


def _Table(rows: List[List[str]], right: Sequence[bool]) -> str:
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = []
  for n, r in enumerate(rows):
    cells = [
        r[c].rjust(widths[c]) if right[c] else r[c].ljust(widths[c])
        for c in range(len(r))
    ]
    lines.append('  '.join(cells).rstrip())
    if n == 0:
      lines.append('  '.join('-' * w for w in widths))
  return '\n'.join(lines)


def FormatReport(report: Dict[str, Any], title: str = '') -> str:
  """The report as text tables."""
  verify = any('tf_profiler_flops' in l for l in report['layers'])
  head = ['#', 'name', 'class', 'output shape', 'FLOPs', 'params',
          'act bytes', 'cell']
  right = [True, False, False, False, True, True, True, True]
  if report['cost'] != 'flops':
    head.append(report['cost'])
    right.append(True)
  if verify:
    head.append('TF profiler FLOPs')
    right.append(True)
  rows = [head]
  for l in report['layers']:
    shapes = ' '.join(
        'x'.join(str(d) for d in s) if s is not None else '-'
        for s in l['out_shapes'])
    row = [
        str(l['index']), l['name'], l['cls'], shapes, _Si(l['flops']),
        _Si(l['params']), _Si(l['activation_bytes']) + 'B',
        str(l['partition'])
    ]
    if report['cost'] != 'flops':
      row.append(_CostStr(report, l['cost']))
    if verify:
      row.append(_Si(l['tf_profiler_flops']))
    rows.append(row)
  out = []
  if title:
    out.append(title)
  out.append(
      'input shapes: %s; %d cells balanced by %s' %
      (report['input_shapes'], report['num_partitions'], report['cost']))
  out += ['', _Table(rows, right), '']

  total_cost = sum(p['cost'] for p in report['partitions']) or 1.0
  head = ['cell', 'layers', 'FLOPs', 'params', 'act bytes', report['cost'],
          'share']
  rows = [head]
  for p in report['partitions']:
    rows.append([
        str(p['index']),
        str(p['num_layers']),
        _Si(p['flops']),
        _Si(p['params']),
        _Si(p['activation_bytes']) + 'B',
        _CostStr(report, p['cost']),
        '%.1f%%' % (100.0 * p['cost'] / total_cost),
    ])
  out += [_Table(rows, [True] * len(head)), '']
  out.append('total FLOPs: %s (%d)' % (_Si(report['total_flops']),
                                      report['total_flops']))
  if verify:
    out.append('total TF profiler FLOPs: %s (%d)' %
               (_Si(report['total_tf_profiler_flops']),
                report['total_tf_profiler_flops']))
  shard_rows = [['layer', 'variable', 'shard', 'shape', 'bytes', 'device']]
  for l in report['layers']:
    for sh in l['param_shards']:
      shard_rows.append([
          l['name'], sh['var'],
          str(sh['shard']), 'x'.join(str(d) for d in sh['shape']),
          _Si(sh['bytes']) + 'B', sh['device'] or '-'
      ])
  if len(shard_rows) > 1:
    out += ['parameter shards:', _Table(shard_rows, [False, False, True,
                                                     False, True, False])]
    for device, n in sorted(report['shard_bytes_by_device'].items()):
      out.append('shard bytes on %s: %s' % (device or '-', _Si(n) + 'B'))
    out.append('')
  out.append('total params: %s (%s bytes)' %
             (_Si(report['total_params']), _Si(report['total_param_bytes'])))
  out.append('slowest cell / mean (%s): %.3f' %
             (report['cost'], report['bottleneck_over_mean']))
  if report['cost'] != 'flops':
    out.append('slowest cell / mean (flops): %.3f' %
               report['flops_bottleneck_over_mean'])
  return '\n'.join(out)


def PlotReport(report: Dict[str, Any], path: str, title: str = '') -> None:
  """Per-cell cost as bars, each split into its layers, saved to path."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  key = report['cost']
  num = len(report['partitions'])
  fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * num + 2), 4.5))
  cmap = plt.get_cmap('tab20')
  bottoms = [0.0] * num
  scale = 1e3 if key == 'time' else 1.0
  for l in report['layers']:
    cell = l['partition']
    value = l['cost'] * scale
    ax.bar(cell, value, bottom=bottoms[cell], color=cmap(l['index'] % 20),
           edgecolor='white', linewidth=0.5)
    if value > 0.04 * max(p['cost'] * scale for p in report['partitions']):
      ax.text(cell, bottoms[cell] + value / 2, l['name'], ha='center',
              va='center', fontsize=7)
    bottoms[cell] += value
  mean = statistics.mean(bottoms)
  ax.axhline(mean, color='gray', linestyle='--', linewidth=1,
             label='mean cell')
  ax.set_xticks(range(num))
  ax.set_xticklabels(['cell %d' % i for i in range(num)])
  ax.set_ylabel({'flops': 'forward FLOPs', 'params': 'parameter bytes',
                 'time': 'fwd+bwd time (ms)'}[key])
  ax.set_title((title + '\n' if title else '') +
               'slowest / mean = %.3f' % report['bottleneck_over_mean'])
  ax.legend(loc='upper right', fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def ModelLayerStack(model: str, dataset: str = 'Train', overrides: str = ''):
  """(task params, layer params, input shapes) of a registered model.

  `overrides` is a --model_params_override text.
  """
  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  try:
    mp = experiment_params.GetParams(model, dataset, overrides)
  except LookupError as e:
    raise ValueError(str(e)) from None
  task = mp.task.Copy()
  # SingleTaskModel hands the input to its task only when instantiated.
  if getattr(task, 'input', None) is None and getattr(mp, 'input', None):
    task.input = mp.input.Copy()
  if not hasattr(task.cls, 'LayerStack'):
    raise ValueError(
        '--model=%s: its task %s has no LayerStack(task_params) classmethod; '
        'only pipelined tasks can be reported.' % (model, task.cls.__name__))
  stack, shapes = task.cls.LayerStack(task)
  return task, stack, tuple(shapes)


def TreeReport(cfg, model: str) -> Dict[str, Any]:
  """Each pipeline's cells, of an experiment that holds its pipelines cut
  (Lingvo's task code, `pipeline_tree.IsCut`): the planner's profile of each
  cell (planner/tree.py), per example, JSON-able."""
  from lingvo_ext.planner import tree  # pylint: disable=g-import-not-at-top
  pipes = []
  for pipe in tree.ProfileTree(cfg, model):
    cells = [dict(name=l.name, flops=l.flops, params_bytes=l.param_bytes,
                  num_vars=l.num_vars, out_bytes=l.out_bytes,
                  kept_bytes=l.kept_bytes) for l in pipe.profile.layers]
    flops = [c['flops'] for c in cells]
    pipes.append(dict(
        path=pipe.path, cls=pipe.cls_name, batch=pipe.profile.batch,
        cells=cells, total_flops=sum(flops),
        bottleneck_over_mean=max(flops) / (statistics.mean(flops) or 1)))
  return dict(model=model, pipelines=pipes)


def FormatTreeReport(report: Dict[str, Any]) -> str:
  out = ['model: %s' % report['model']]
  for pipe in report['pipelines']:
    out.append('%s (%s): %d cells as the experiment cuts them, per example '
               'of a batch of %d' % (pipe['path'], pipe['cls'],
                                     len(pipe['cells']), pipe['batch']))
    rows = [['cell', 'FLOPs', 'params', 'out bytes', 'kept bytes']] + [
        [c['name'], _Si(c['flops']), _Si(c['params_bytes']) + 'B',
         _Si(c['out_bytes']) + 'B', _Si(c['kept_bytes']) + 'B']
        for c in pipe['cells']]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out += ['  ' + '  '.join(v.rjust(w) if i else v.ljust(w)
                             for i, (v, w) in enumerate(zip(r, widths)))
            for r in rows]
    out.append('  total %s FLOPs; costliest cell / mean: %.2f' % (
        _Si(pipe['total_flops']), pipe['bottleneck_over_mean']))
  return '\n'.join(out)


def _ParseArgs(argv):
  parser = argparse.ArgumentParser(
      prog='.venv/bin/python -m lingvo_ext.tools.cost_report',
      description=__doc__.splitlines()[0])
  parser.add_argument('--model', required=True,
                      help='Registered model, e.g. lm.TransformerLm.')
  parser.add_argument('--num_partitions', type=int, default=None,
                      help='Number of cells K (default: the task\'s '
                      'num_partitions, else 1).')
  parser.add_argument('--cost', default=None, choices=cost_lib.COST_CHOICES,
                      help='What to balance (default: the task\'s '
                      'partition_cost, else flops).')
  parser.add_argument('--dataset', default='Train',
                      help='Dataset whose input shapes are used.')
  parser.add_argument('--json', action='store_true', help='Print JSON.')
  parser.add_argument('--verify', action='store_true',
                      help='Add TF profiler FLOPs of each layer.')
  parser.add_argument('--plot', default='', metavar='FILE.png',
                      help='Draw per-cell cost split by layer to this file.')
  parser.add_argument('--device', default=None,
                      help='For --cost=time: device to time on, e.g. /gpu:0.')
  parser.add_argument('--num_repeats', type=int, default=5,
                      help='For --cost=time: timed runs per layer (median).')
  parser.add_argument('--split_size', type=int, default=None,
                      help='Devices in the model split, where the shards of '
                      'partitioned variables go (default: the number of '
                      'cells).')
  return parser.parse_known_args(argv)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args, rest = _ParseArgs(argv)
  error = entry_point.ParseFlags(rest)  # E.g. --model_params_override.
  if error:
    print(f'error: {error}', file=sys.stderr)
    return 2
  flags = tf.flags.FLAGS
  try:
    from lingvo_ext.planner import tf_profiling  # pylint: disable=g-import-not-at-top
    from lingvo_ext.tasks import pipeline_tree  # pylint: disable=g-import-not-at-top
    cfg = tf_profiling.ExperimentParams(args.model, args.dataset,
                                        flags.model_params_override)
    if pipeline_tree.IsCut(cfg):  # Lingvo's task code: its cells as cut.
      report = TreeReport(cfg, args.model)
      print(json.dumps(report, indent=1) if args.json else
            FormatTreeReport(report))
      return 0
    task, stack, shapes = ModelLayerStack(args.model, args.dataset,
                                         flags.model_params_override)
  except ValueError as e:  # A bad --model or param: one message, no trace.
    print(f'error: {e}', file=sys.stderr)
    return 2
  num_partitions = args.num_partitions
  if num_partitions is None:
    num_partitions = getattr(task, 'num_partitions', None) or 1
  cost = args.cost or getattr(task, 'partition_cost', None) or 'flops'
  kwargs = {}
  if cost == 'time':
    kwargs = dict(device=args.device, num_repeats=args.num_repeats)
  split_size = args.split_size or num_partitions
  if split_size < 1:
    raise ValueError('--split_size=%d must be positive.' % split_size)
  cluster = cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=split_size,
      split_size=split_size)
  # The trainer's local cluster: the ps job is the worker's devices (sync
  # mode), which is where variables and shards go.
  cluster.params.ps.cpus_per_replica = split_size
  with cluster_factory.Cluster(cluster.params):
    cell_devices = None
    # As PipelinedTask: the ps strategies leave placement to their placer.
    if getattr(task, 'gradient_sync', 'shared') not in ('parameter_server',
                                                        'hybrid'):
      cell_devices = gpipe.CellVariableDevices(cluster_factory.Current(),
                                               num_partitions)
    report = BuildReport(stack, shapes, num_partitions, cost=cost,
                         verify=args.verify, cell_devices=cell_devices,
                         **kwargs)
  report['model'] = args.model
  if args.plot:
    PlotReport(report, args.plot, title=args.model)
  if args.json:
    print(json.dumps(report, indent=1))
  else:
    print(FormatReport(report, title='model: %s' % args.model))
    if args.plot:
      print('plot: %s' % args.plot)
  return 0


if __name__ == '__main__':
  sys.exit(main())
