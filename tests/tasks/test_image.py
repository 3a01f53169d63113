"""Tests of the image task's input generator and layer stack."""

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np
import pytest

from lingvo_ext.core import gpipe
from lingvo_ext.tasks.image import input_generator
from lingvo_ext.tasks.image import model
from lingvo_ext.tasks.in_memory_input import InMemoryInput

BATCH = 16


def _InputParams(split='train', **kwargs):
  p = input_generator.ImageInput.Params().Set(
      split=split, batch_size=BATCH, **kwargs)
  if split != 'train':
    InMemoryInput.SetOnePass(p)
  return p


def _Instantiate(p):
  with tf.Graph().as_default():
    return p.Instantiate()


def _DevIds(inp):
  inp.Reset()
  ids = []
  while True:
    try:
      batch = inp.NextEvalBatchNp()
    except StopIteration:
      return np.concatenate(ids)
    assert batch.data.shape == (BATCH,) + tuple(inp.params.data_shape)
    np.testing.assert_array_equal(batch.weight, batch.example_ids >= 0)
    ids.append(batch.example_ids[batch.example_ids >= 0])


def testDigitsSplitsAreDisjointAndCoverTheSet():
  images, labels = input_generator.LoadImages()
  assert images.shape == (1797, 8, 8, 1)
  assert 0.0 <= images.min() and images.max() == 1.0
  assert sorted(set(labels.tolist())) == list(range(10))
  train = _Instantiate(_InputParams('train'))
  dev = _Instantiate(_InputParams('dev'))
  dev_ids = _DevIds(dev)
  steps = -(-train.num_examples // BATCH)
  train_ids = np.concatenate(
      [train.TrainBatchNp(s).example_ids for s in range(steps)])
  assert set(train_ids.tolist()) | set(dev_ids.tolist()) == set(range(1797))
  assert not set(train_ids.tolist()) & set(dev_ids.tolist())
  assert len(dev_ids) == len(set(dev_ids.tolist())) == 360
  np.testing.assert_array_equal(_DevIds(dev), dev_ids)  # After Reset().


def testTrainBatchesAreDeterministic():
  a = _Instantiate(_InputParams('train'))
  b = _Instantiate(_InputParams('train'))
  for step in (0, 7, 1000):
    x, y = a.TrainBatchNp(step), b.TrainBatchNp(step)
    np.testing.assert_array_equal(x.data, y.data)
    np.testing.assert_array_equal(x.label, y.label)
  assert not np.array_equal(a.TrainBatchNp(0).label, a.TrainBatchNp(1).label)


def testReadsAUsersNpz(tmp_path):
  rng = np.random.RandomState(0)
  images = rng.randint(0, 256, size=[23, 5, 6], dtype=np.uint8)
  labels = np.arange(23) % 3
  path = str(tmp_path / 'data.npz')
  np.savez(path, x=images, y=labels)
  p = _InputParams(
      'dev',
      npz_file=path,
      image_key='x',
      label_key='y',
      data_shape=(5, 6, 1),
      num_classes=3)
  inp = _Instantiate(p)
  ids = _DevIds(inp)
  np.testing.assert_array_equal(ids, np.arange(0, 23, 5))
  inp.Reset()
  batch = inp.NextEvalBatchNp()
  np.testing.assert_allclose(batch.data[0, ..., 0], images[0] / 255.0)
  np.testing.assert_array_equal(batch.label[:5], labels[ids])

  with pytest.raises(ValueError, match='image_key'):
    _Instantiate(_InputParams(npz_file=path)).Examples()
  with pytest.raises(ValueError, match='data_shape'):
    _Instantiate(
        _InputParams(npz_file=path, image_key='x', label_key='y',
                     num_classes=3)).Examples()
  with pytest.raises(ValueError, match='num_classes'):
    _Instantiate(
        _InputParams(npz_file=path, image_key='x', label_key='y',
                     data_shape=(5, 6, 1), num_classes=2)).Examples()
  with pytest.raises(ValueError, match='npz_file'):
    _Instantiate(_InputParams(npz_file=str(tmp_path / 'none.npz'))).Examples()


def testOnePassNeedsResettable():
  p = _InputParams('dev')
  p.resettable = False
  with pytest.raises(ValueError, match='resettable'):
    _Instantiate(p)


def testInputBatchInGraph():
  inp_p = _InputParams('train')
  with tf.Graph().as_default():
    step = py_utils.GetOrCreateGlobalStepVar()
    inp = inp_p.Instantiate()
    batch = inp.GetPreprocessedInputBatch()
    assert batch.data.shape.as_list() == [BATCH, 8, 8, 1]
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      got = sess.run(batch)
      sess.run(tf.assign_add(step, 3))
      got3 = sess.run(batch)
  np.testing.assert_array_equal(got.example_ids, inp.TrainBatchNp(0).example_ids)
  np.testing.assert_array_equal(got3.example_ids,
                                inp.TrainBatchNp(3).example_ids)


def testLayerStackContractAndUnevenCells():
  from params import image  # pylint: disable=g-import-not-at-top
  task = image.ConvClassifierGPipe().Task()
  task.input = image.ConvClassifierGPipe().Train()
  layers, shapes = model.ConvClassifier.LayerStack(task)
  names = [l.name for l in layers]
  assert names[0] == 'stem' and names[-1] == 'head'
  assert [s.ToTensorShape().as_list() for s in shapes] == [[32, 8, 8, 1]]
  flops, x = [], shapes
  for l in layers:
    meta = l.cls.FPropMeta(l, *x)
    flops.append(meta.flops)
    x = meta.out_shapes
  assert [int(d) for d in x[0]] == [32, 10]
  # Uneven layers: the widest conv costs far more than the stem.
  assert max(flops) > 10 * flops[0]
  cells = gpipe.PartitionSequentialLayers(layers, task.num_partitions, *shapes)
  assert len(cells) == 2
  assert sum(len(c.sub) for c in cells) == len(layers)
  task.head_pooling = 'AVG'
  layers, _ = model.ConvClassifier.LayerStack(task)
  assert layers[-2].name == 'global_pool'
  task.head_pooling = 'SUM'
  with pytest.raises(ValueError, match='head_pooling'):
    model.ConvClassifier.LayerStack(task)
