"""A 3-cell GPipe pipeline on 2 logical CPU devices, checked against sequential.

An FC stack of uneven widths is cut into cells by FLOPs with
`PartitionSequentialLayers`, run as a pipeline over micro-batches, and
compared with the same model run sequentially on the same weights.

  .venv/bin/python -m lingvo_ext.examples.gpipe_example [--num_cells=3] [--num_devices=2]
"""

import argparse
import sys

from lingvo_ext import entry_point  # pylint: disable=unused-import,g-bad-import-order

# isort: split
import lingvo.compat as tf
from lingvo.core import cluster_factory
from lingvo.core import layers
from lingvo.core import py_utils
from lingvo.core import tshape
import numpy as np

from lingvo_ext.core import gpipe

WIDTHS = (64, 256, 256, 64, 128, 512, 64, 32)


def Run(num_cells=3, num_devices=2, num_micro_batches=4, batch=16):
  """Builds and runs the example; returns per-cell FLOPs and max differences."""
  subs = [
      layers.FCLayer.Params().Set(
          name='fc%d' % i, input_dim=a, output_dim=b, activation='TANH',
          params_init=py_utils.WeightInit.Gaussian(1.0 / np.sqrt(a), seed=i))
      for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))
  ]
  in_shape = tshape.Shape([batch, WIDTHS[0]])
  cells = gpipe.PartitionSequentialLayers(subs, num_cells, in_shape)
  cell_flops, shape = [], in_shape
  for c in cells:
    meta = c.cls.FPropMeta(c, shape)
    cell_flops.append(int(meta.flops))
    shape = meta.out_shapes[0]

  g = tf.Graph()
  with g.as_default(), cluster_factory.ForTestingWorker(
      mode='sync', job='trainer_client', cpus=num_devices,
      split_size=num_devices):
    py_utils.GetOrCreateGlobalStepVar()
    net = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=cells,
        num_micro_batches=num_micro_batches).Instantiate()
    x = tf.constant(np.random.RandomState(0).randn(batch, WIDTHS[0]),
                    dtype=tf.float32)
    pipe = net.FPropDefaultTheta(x)
    seq = net.FPropSequential(net.theta, x)
    variables = net.vars.Flatten()
    pipe_grads = tf.gradients(tf.reduce_sum(tf.square(pipe)), variables)
    seq_grads = tf.gradients(tf.reduce_sum(tf.square(seq)), variables)
    init = tf.global_variables_initializer()
  config = tf.config_pb2.ConfigProto(device_count={'CPU': num_devices})
  with tf.Session(graph=g, config=config) as sess:
    sess.run(init)
    pipe, seq, pipe_grads, seq_grads = sess.run(
        [pipe, seq, pipe_grads, seq_grads])
  return dict(
      layers_per_cell=[len(c.sub) for c in cells],
      cell_flops=cell_flops,
      max_abs_output_diff=float(np.max(np.abs(pipe - seq))),
      max_abs_grad_diff=float(
          max(np.max(np.abs(a - b)) for a, b in zip(pipe_grads, seq_grads))))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--num_cells', type=int, default=3)
  parser.add_argument('--num_devices', type=int, default=2)
  parser.add_argument('--num_micro_batches', type=int, default=4)
  args = parser.parse_args(argv)
  r = Run(args.num_cells, args.num_devices, args.num_micro_batches)
  print('%d cells on %d logical CPU devices, %d micro-batches' %
        (args.num_cells, args.num_devices, args.num_micro_batches))
  for i, (n, f) in enumerate(zip(r['layers_per_cell'], r['cell_flops'])):
    print('  cell %d (device %d): %d layers, %12d FLOPs' %
          (i, i % args.num_devices, n, f))
  print('slowest cell / mean: %.3f' %
        (max(r['cell_flops']) / np.mean(r['cell_flops'])))
  print('max |pipeline - sequential| output: %.3g' % r['max_abs_output_diff'])
  print('max |pipeline - sequential| gradient: %.3g' % r['max_abs_grad_diff'])
  return 0


if __name__ == '__main__':
  sys.exit(main())
