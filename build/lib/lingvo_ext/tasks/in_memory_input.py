"""A Lingvo input generator over a small data set held in host memory.

Both tasks' data sets (a text corpus, an image set) fit in memory, so the
examples live in numpy and each batch is cut by a `tf.numpy_function`: the
graph stays small (no multi-MB constants in every checkpoint's meta graph and
graph.pbtxt), and the batching logic is plain numpy that tests can call.

Two ways through the data:

- repeat=True (training): batch k holds the examples at positions
  [k * B, (k + 1) * B) (mod N) of one fixed, seeded permutation, where k is
  the global step. The batch is a function of the step alone, so a job that
  is killed and resumed sees exactly the batches it would have seen, and
  every ceil(N / B) steps cover every example.
- repeat=False (evaluation): one pass in order; the last batch is padded with
  all-zero examples (so their weights are 0) and example id -1, then the op
  raises OutOfRangeError. Reset() starts over, so Lingvo's evaler
  (eval_samples_per_summary=0) scores the whole split exactly once.
"""

import threading

import lingvo.compat as tf
from lingvo.core import base_input_generator
from lingvo.core import py_utils
import numpy as np


class InMemoryInput(base_input_generator.BaseInputGenerator):
  """Batches a NestedMap of numpy arrays that share a leading example axis.

  Subclasses implement `_LoadExamples()`. Batches hold those fields plus
  `example_ids` ([B] int32, -1 for padding).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'repeat', True, 'If True, cycle through the data forever, the batch '
        'being a function of the global step (training). If False, make one '
        'ordered pass, padding the last batch, then raise OutOfRangeError '
        '(evaluation).')
    p.Define(
        'shuffle_seed', 301, 'Seed of the fixed permutation of examples used '
        'when repeat=True; None keeps the file order.')
    p.batch_size = 8
    return p

  @staticmethod
  def SetOnePass(p):
    """Sets `p` (an InMemoryInput's params) to one whole ordered pass."""
    p.repeat = False
    p.resettable = True
    p.eval_samples_per_summary = 0
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.batch_size <= 0:
      raise ValueError(f'{p.name}: batch_size={p.batch_size}; set '
                       'batch_size to a positive number of examples.')
    if not p.repeat and not p.resettable:
      # The task reads these params before building its input, so they must
      # be set in the params: Lingvo's evaler resets a resettable input
      # before each checkpoint and, with eval_samples_per_summary=0, reads it
      # until OutOfRangeError.
      raise ValueError(
          f'{p.name}: repeat=False needs resettable=True (and '
          'eval_samples_per_summary=0 to score the whole split); use '
          'InMemoryInput.SetOnePass(params).')
    self._examples = None
    self._order = None
    self._cursor = 0
    self._lock = threading.Lock()
    # Fixed when the graph is built: numpy_function runs on TF's threads,
    # where the cluster (which scales the batch size) is not current.
    self._batch_size = None

  def _LoadExamples(self):
    """Returns a NestedMap of numpy arrays, each [N, ...]."""
    raise NotImplementedError('Abstract method')

  def Examples(self):
    """The split's examples (loaded once), a NestedMap of [N, ...] arrays."""
    if self._examples is None:
      ex = self._LoadExamples()
      sizes = {k: v.shape[0] for k, v in ex.FlattenItems()}
      if len(set(sizes.values())) != 1:
        raise ValueError(f'{self.params.name}: fields disagree on the number '
                         f'of examples: {sizes}.')
      if not list(sizes.values())[0]:
        raise ValueError(f'{self.params.name}: the data split is empty; check '
                         'the data file and dev_fraction.')
      self._examples = ex
    return self._examples

  @property
  def num_examples(self):
    return self.Examples().Flatten()[0].shape[0]

  def _Order(self):
    if self._order is None:
      n = self.num_examples
      seed = self.params.shuffle_seed
      self._order = (
          np.arange(n) if seed is None else
          np.random.RandomState(seed).permutation(n))
    return self._order

  def _Gather(self, idx):
    """Gathers examples `idx` (int array, -1 = padding) into a batch."""
    valid = idx >= 0
    safe = np.where(valid, idx, 0)

    def Take(a):
      out = a[safe]
      out[~valid] = 0
      return out

    batch = self.Examples().Transform(Take)
    batch.example_ids = np.where(valid, idx, -1).astype(np.int32)
    return batch

  def _BatchSize(self):
    if self._batch_size is None:
      self._batch_size = self.InfeedBatchSize()
    return self._batch_size

  def TrainBatchNp(self, step):
    """The numpy batch of global step `step` (repeat=True)."""
    b = self._BatchSize()
    pos = (int(step) * b + np.arange(b)) % self.num_examples
    return self._Gather(self._Order()[pos])

  def NextEvalBatchNp(self):
    """The next numpy batch of the ordered pass; StopIteration at the end."""
    b = self._BatchSize()
    with self._lock:
      start = self._cursor
      if start >= self.num_examples:
        raise StopIteration  # numpy_function turns it into OutOfRangeError.
      self._cursor = start + b
    idx = np.arange(start, start + b)
    idx[idx >= self.num_examples] = -1
    return self._Gather(idx)

  def Reset(self, sess=None):
    del sess
    with self._lock:
      self._cursor = 0

  def _InputBatch(self):
    p = self.params
    self._batch_size = self.InfeedBatchSize()
    template = self._Gather(np.zeros([self._batch_size], np.int64))
    dtypes = [tf.as_dtype(v.dtype) for _, v in template.FlattenItems()]

    def ToList(batch):
      return [np.asarray(v) for _, v in batch.FlattenItems()]

    if p.repeat:
      step = py_utils.GetOrCreateGlobalStepVar()
      step = tf.cast(tf.convert_to_tensor(step), tf.int64)
      flat = tf.numpy_function(
          lambda s: ToList(self.TrainBatchNp(s)), [step],
          dtypes,
          stateful=True,
          name='train_batch')
    else:
      flat = tf.numpy_function(
          lambda: ToList(self.NextEvalBatchNp()), [],
          dtypes,
          stateful=True,
          name='eval_batch')
    for t, (_, v) in zip(flat, template.FlattenItems()):
      t.set_shape(v.shape)
    return template.Pack(flat)
