"""Language-model input: a text file cut into fixed-length token windows.

The default corpus is the English text of `pydoc_data.topics` (it ships with
CPython), the topics joined in sorted order. Any UTF-8 text file can be given
instead with `text_file`. The text is split once, deterministically: the
first (1 - dev_fraction) of the characters, up to the next newline, is the
train split; the rest is dev.

Each split's token ids are cut into windows of seq_len + 1 tokens that
overlap by one: ids = window[:-1], labels = window[1:]. Every token of the
split after the first is a label exactly once; the last window is padded,
with weight 0 on the padding.

The vocabulary is built from the train split only (see tokenizer.py) and
saved as <logdir>/train/vocab.json, next to the checkpoints, with the name of
the text it was built from; a job that finds that file (a resumed trainer, an
evaler) checks it against the data (same text, no train token missing) and
loads it instead of rebuilding. A mismatch is an error.
"""

import functools
import os

import lingvo.compat as tf
from lingvo.core import py_utils
import numpy as np

from lingvo_ext.tasks import in_memory_input
from lingvo_ext.tasks.lm import tokenizer

VOCAB_FILENAME = 'vocab.json'
DEFAULT_SOURCE = 'pydoc_data.topics'
SPLITS = ('train', 'dev')


@functools.lru_cache(maxsize=4)
def ReadCorpus(text_file=None):
  """Returns the whole corpus as a str: `text_file`, or pydoc's topics."""
  if not text_file:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    return '\n'.join(topics.topics[k] for k in sorted(topics.topics))
  if not tf.io.gfile.exists(text_file):
    raise ValueError(f'text_file={text_file!r} does not exist; point '
                     'text_file at a UTF-8 text file, or leave it empty for '
                     'the default corpus (pydoc_data.topics).')
  with tf.io.gfile.GFile(text_file, 'rb') as f:
    data = f.read()
  try:
    return data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise ValueError(
        f'text_file={text_file!r} is not UTF-8 text (byte '
        f'{data[e.start]:#04x} at offset {e.start}); point text_file at a '
        'UTF-8 text file.') from None


def SplitCorpus(text, dev_fraction):
  """Splits `text` into (train, dev) at the first newline past the cut."""
  if not 0.0 <= dev_fraction < 1.0:
    raise ValueError(f'dev_fraction={dev_fraction} must be in [0, 1).')
  cut = int(len(text) * (1.0 - dev_fraction))
  if cut < len(text):
    nl = text.find('\n', cut)
    cut = len(text) if nl < 0 else nl + 1
  return text[:cut], text[cut:]


def MakeWindows(ids, seq_len):
  """Cuts a 1-D id array into LM examples of seq_len tokens.

  Args:
    ids: int32 [L] token ids.
    seq_len: Tokens per example.

  Returns:
    A NestedMap of [N, seq_len] arrays: ids (int32), labels (int32), weights
    (float32; 0 on padding), where N = ceil((L - 1) / seq_len).
  """
  n_targets = len(ids) - 1
  if n_targets < 1:
    raise ValueError(f'The text has {len(ids)} tokens; an LM needs at least '
                     '2.')
  n = -(-n_targets // seq_len)
  padded = np.zeros([n * seq_len + 1], np.int32)
  padded[:len(ids)] = ids
  weights = np.zeros([n * seq_len], np.float32)
  weights[:n_targets] = 1.0
  starts = np.arange(n)[:, None] * seq_len + np.arange(seq_len)[None, :]
  return py_utils.NestedMap(
      ids=padded[starts],
      labels=padded[starts + 1],
      weights=weights[starts])


class LmInput(in_memory_input.InMemoryInput):
  """Token windows of one split of a text corpus.

  | Batch (B: batch_size, T: seq_len):
  |   ids: int32 [B, T] input token ids.
  |   labels: int32 [B, T] next-token ids.
  |   weights: float32 [B, T], 1 for real targets, 0 for padding.
  |   example_ids: int32 [B], the window's index in the split, -1 if padding.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
        'text_file', '', 'UTF-8 text file holding the whole corpus (both '
        'splits). Empty: the English text of pydoc_data.topics.')
    p.Define('split', 'train', 'Which split to read: train or dev.')
    p.Define(
        'dev_fraction', 0.1, 'Fraction of the corpus (by characters, cut at '
        'a newline) held out as the dev split, taken from the end.')
    p.Define('seq_len', 64, 'Tokens per example.')
    p.Define('unit', 'char', 'Tokenizer unit: char or word.')
    p.Define(
        'vocab_size', 128, 'Vocabulary size, including <pad> and <unk>; '
        'must equal the model\'s. The commonest vocab_size - 2 train tokens '
        'are kept; rarer ones map to <unk>.')
    p.Define(
        'vocab_file', '', 'An existing vocab.json to use. Empty: load '
        '<logdir>/train/vocab.json if it exists, else build the vocabulary '
        'from the train split and save it there.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.split not in SPLITS:
      raise ValueError(f'{p.name}: split={p.split!r}; set split to one of '
                       f'{SPLITS}.')
    if p.seq_len < 1:
      raise ValueError(f'{p.name}: seq_len={p.seq_len} must be positive.')
    tokenizer.Tokenize('', p.unit)  # Validates p.unit early.
    self._vocab = None
    # The job's logdir, while its cluster is current (the vocabulary may be
    # loaded later, outside the cluster's scope).
    self._logdir = self.cluster.logdir

  def VocabPath(self):
    """Where this job's vocabulary lives ('' when there is no logdir)."""
    p = self.params
    if p.vocab_file:
      return p.vocab_file
    logdir = self._logdir
    return os.path.join(logdir, 'train', VOCAB_FILENAME) if logdir else ''

  @property
  def vocab(self):
    """The tokenizer.Vocab, loaded from or saved to VocabPath()."""
    if self._vocab is None:
      p = self.params
      path = self.VocabPath()
      if path and tf.io.gfile.exists(path):
        vocab = tokenizer.Vocab.Load(path)
        if (vocab.unit, vocab.vocab_size) != (p.unit, p.vocab_size):
          raise ValueError(
              f'{path} holds a unit={vocab.unit!r}, vocab_size='
              f'{vocab.vocab_size} vocabulary but the params say unit='
              f'{p.unit!r}, vocab_size={p.vocab_size}; use a fresh logdir '
              'or matching params.')
        if not p.vocab_file:
          self._CheckVocabMatchesData(vocab, path)
      elif p.vocab_file:
        raise ValueError(f'vocab_file={p.vocab_file!r} does not exist; fix '
                         'the path or leave vocab_file empty to build one.')
      else:
        vocab = self._BuildVocab()
        if path:
          vocab.Save(path)
          tf.logging.info('Wrote the vocabulary (%d tokens) to %s',
                          len(vocab.tokens), path)
      self._vocab = vocab
    return self._vocab

  def TextSource(self):
    """The corpus's name: text_file's absolute path, or pydoc_data.topics."""
    p = self.params
    return os.path.abspath(p.text_file) if p.text_file else DEFAULT_SOURCE

  def _BuildVocab(self):
    p = self.params
    return tokenizer.Vocab.Build(self.SplitText('train'), p.unit, p.vocab_size,
                                 source=self.TextSource())

  def _CheckVocabMatchesData(self, vocab, path):
    """Raises if the logdir's vocabulary was built from other data."""
    source = self.TextSource()
    fix = (f'Delete {path} (or use a fresh --logdir) to build the vocabulary '
           'of this text')
    if vocab.source and vocab.source != source:
      raise ValueError(
          f'{path} was built from {vocab.source}, but the data is {source}. '
          f'{fix}, or set input.text_file back to {vocab.source}.')
    missing = vocab.Missing(self._BuildVocab())
    if missing:
      shown = ', '.join(repr(t) for t in missing[:5])
      raise ValueError(
          f'{path} does not match the data {source}: {len(missing)} of the '
          f'data\'s commonest train tokens are missing from it ({shown}...), so '
          f'they would all be <unk>. {fix}.')

  def SplitText(self, split=None):
    """The text of `split` (default: this generator's split)."""
    p = self.params
    train, dev = SplitCorpus(ReadCorpus(p.text_file or None), p.dev_fraction)
    return train if (split or p.split) == 'train' else dev

  def _LoadExamples(self):
    p = self.params
    ids = self.vocab.Encode(self.SplitText())
    tf.logging.info('%s: %s split, %d tokens.', p.name, p.split, len(ids))
    return MakeWindows(ids, p.seq_len)
