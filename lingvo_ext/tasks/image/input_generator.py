"""Image-classification input: scikit-learn's digits, or a user's .npz.

The default data is the 1797 8x8 grey-scale handwritten digits that ship
inside the scikit-learn wheel (`sklearn.datasets.load_digits`, no download).
A user's data is an .npz holding an image array ([N, H, W] or [N, H, W, C],
any numeric dtype) and an integer label array ([N]).

The split is deterministic: example i is in dev iff i % dev_every == 0 (so
both splits see every class in proportion), the rest is train. Pixels are
scaled to [0, 1] by a fixed per-dataset scale (255 for uint8, otherwise the
largest pixel of the whole file), so both splits share it.
"""

import functools

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np

from lingvo_ext.tasks import in_memory_input

SPLITS = ('train', 'dev', 'all')


@functools.lru_cache(maxsize=4)
def LoadImages(npz_file=None, image_key='images', label_key='labels'):
  """Returns (images float32 [N, H, W, C] in [0, 1], labels int32 [N])."""
  if not npz_file:
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
    digits = datasets.load_digits()
    images, labels, scale = digits.images, digits.target, 16.0
  else:
    if not tf.io.gfile.exists(npz_file):
      raise ValueError(f'npz_file={npz_file!r} does not exist; point '
                       'npz_file at an .npz of images and labels, or leave '
                       'it empty for the default (scikit-learn digits).')
    with tf.io.gfile.GFile(npz_file, 'rb') as f:
      with np.load(f) as data:
        missing = [k for k in (image_key, label_key) if k not in data.files]
        if missing:
          raise ValueError(
              f'{npz_file} has no array named {missing}; it holds '
              f'{sorted(data.files)}. Set image_key / label_key to the '
              'names of the image and label arrays.')
        images, labels = data[image_key], data[label_key]
    if images.dtype == np.uint8:
      scale = 255.0
    else:
      scale = float(np.max(np.abs(images))) or 1.0
  images = np.asarray(images)
  if images.ndim == 3:
    images = images[..., None]
  if images.ndim != 4:
    raise ValueError(f'Images must be [N, H, W] or [N, H, W, C]; got shape '
                     f'{images.shape}.')
  labels = np.asarray(labels).reshape([-1])
  if labels.shape[0] != images.shape[0]:
    raise ValueError(f'{images.shape[0]} images but {labels.shape[0]} '
                     'labels.')
  if not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f'Labels must be integers, got {labels.dtype}.')
  return (images.astype(np.float32) / np.float32(scale),
          labels.astype(np.int32))


def SplitIndices(n, split, dev_every):
  """Indices of `split` among n examples: dev is every dev_every-th one."""
  idx = np.arange(n)
  if split == 'all':
    return idx
  is_dev = idx % dev_every == 0
  return idx[is_dev] if split == 'dev' else idx[~is_dev]


class ImageInput(in_memory_input.InMemoryInput):
  """Images and labels of one split.

  | Batch (B: batch_size):
  |   data: float32 [B, H, W, C] in [0, 1].
  |   label: int32 [B].
  |   weight: float32 [B], 1 for real examples, 0 for padding.
  |   example_ids: int32 [B], the example's index in the file, -1 if padding.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'npz_file', '', 'An .npz holding images and labels. Empty: '
        'scikit-learn\'s 8x8 digits.')
    p.Define('image_key', 'images', 'Name of the image array in npz_file.')
    p.Define('label_key', 'labels', 'Name of the label array in npz_file.')
    p.Define('split', 'train', 'Which split to read: train, dev or all.')
    p.Define(
        'dev_every', 5, 'Example i is in the dev split iff i % dev_every == '
        '0.')
    p.Define(
        'data_shape', (8, 8, 1), '(height, width, channels) the model '
        'expects; checked against the data.')
    p.Define('num_classes', 10, 'Labels must be in [0, num_classes).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.split not in SPLITS:
      raise ValueError(f'{p.name}: split={p.split!r}; set split to one of '
                       f'{SPLITS}.')
    if p.dev_every < 2:
      raise ValueError(f'{p.name}: dev_every={p.dev_every} must be >= 2.')

  def _LoadExamples(self):
    p = self.params
    images, labels = LoadImages(p.npz_file or None, p.image_key, p.label_key)
    shape = tuple(images.shape[1:])
    if shape != tuple(p.data_shape):
      raise ValueError(
          f'The images are {shape} but data_shape={tuple(p.data_shape)}; set '
          'the input\'s data_shape to the images\' (height, width, channels), '
          f'e.g. --model_params_override=\'input.data_shape:{shape}\'.')
    if labels.min() < 0 or labels.max() >= p.num_classes:
      raise ValueError(
          f'Labels span [{labels.min()}, {labels.max()}] but num_classes='
          f'{p.num_classes}; set num_classes of the input and the task to at '
          f'least {labels.max() + 1}, e.g. --model_params_override='
          f'\'input.num_classes:{labels.max() + 1}; '
          f'task.num_classes:{labels.max() + 1}\'.')
    idx = SplitIndices(len(labels), p.split, p.dev_every)
    tf.logging.info('%s: %s split, %d images.', p.name, p.split, len(idx))
    ex = py_utils.NestedMap(
        data=images[idx],
        label=labels[idx],
        weight=np.ones([len(idx)], np.float32))
    # Keep ids relative to the file, so a test can check coverage.
    self._file_ids = idx.astype(np.int32)
    return ex

  def _Gather(self, idx):
    batch = super()._Gather(idx)  # Loads the examples, so _file_ids is set.
    ids = batch.example_ids
    batch.example_ids = np.where(ids >= 0, self._file_ids[np.maximum(ids, 0)],
                                 -1).astype(np.int32)
    return batch
