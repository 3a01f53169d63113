"""What the tasks' decoders (--job=decoder_dev) report: text and confusion.

Lingvo's Decoder runner calls a task's `Decode` (graph), then per batch
`PostProcessDecodeOut` (numpy, updating the metrics of
`CreateDecoderMetrics`), writes each metric's `Summary` to TensorBoard and
calls `DecodeFinalize` with the decoder's output path. These are the pieces
the LM and image tasks share.
"""

import os
import re

import lingvo.compat as tf
from lingvo.core import metrics
import numpy as np


def TextSummary(tag, text):
  """A tf.Summary holding `text` for TensorBoard's Text tab."""
  summary = tf.Summary()
  value = summary.value.add(tag=tag)
  value.metadata.plugin_data.plugin_name = 'text'
  value.tensor.CopyFrom(tf.make_tensor_proto(text))
  return summary


def OutputPath(decode_out_path, name):
  """<decoder dir>/<name>-<step>.txt, next to Lingvo's decoder_out file."""
  step = int(re.search(r'(\d+)$', decode_out_path).group(1))
  return os.path.join(
      os.path.dirname(decode_out_path), '%s-%08d.txt' % (name, step))


def WriteText(path, text):
  """Writes `path` whole or not at all (a temporary file, then a rename)."""
  tf.io.gfile.makedirs(os.path.dirname(path))
  temp = f'{path}.tmp{os.getpid()}'
  with tf.io.gfile.GFile(temp, 'w') as f:
    f.write(text)
  tf.io.gfile.rename(temp, path, overwrite=True)
  tf.logging.info('Wrote %s', path)


class ConfusionMetric(metrics.BaseMetric):
  """A confusion matrix; its value is the accuracy.

  Its Summary has the accuracy, each class's accuracy (recall) as scalars
  `<name>/class_<i>`, and the matrix as text.
  """

  def __init__(self, num_classes):
    self.matrix = np.zeros([num_classes, num_classes], np.int64)

  def Update(self, labels, predictions):
    """Counts (label, prediction) pairs of the real examples."""
    np.add.at(self.matrix, (np.asarray(labels), np.asarray(predictions)), 1)

  @property
  def value(self):
    total = self.matrix.sum()
    return float(np.trace(self.matrix) / total) if total else 0.0

  def PerClassAccuracy(self):
    """[num_classes]: correct / examples of each true class (NaN if none)."""
    counts = self.matrix.sum(axis=1)
    with np.errstate(invalid='ignore', divide='ignore'):
      return np.diag(self.matrix) / counts

  def Text(self):
    """The matrix (rows: true class, columns: predicted) and accuracies."""
    n = len(self.matrix)
    width = max(5, len(str(self.matrix.max())) + 1)
    lines = ['confusion matrix (rows: true class, columns: predicted)',
             'true\\pred' + ''.join(f'{j:>{width}d}' for j in range(n))]
    for i in range(n):
      lines.append(f'{i:>9d}' + ''.join(
          f'{self.matrix[i, j]:>{width}d}' for j in range(n)))
    lines += ['', 'class  examples  accuracy']
    for i, acc in enumerate(self.PerClassAccuracy()):
      lines.append(f'{i:>5d}  {self.matrix[i].sum():>8d}  {acc:8.4f}')
    lines.append(f'  all  {self.matrix.sum():>8d}  {self.value:8.4f}')
    return '\n'.join(lines) + '\n'

  def Summary(self, name):
    summary = metrics.CreateScalarSummary(name, self.value)
    for i, acc in enumerate(self.PerClassAccuracy()):
      if np.isfinite(acc):
        summary.value.add(tag=f'{name}/class_{i}', simple_value=float(acc))
    text = TextSummary(f'{name}/matrix', '    ' + self.Text().replace(
        '\n', '\n    '))  # Indented: Markdown shows it preformatted.
    summary.value.extend(text.value)
    return summary
