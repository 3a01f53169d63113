"""A deterministic character- or word-level tokenizer for the LM task.

The vocabulary is a pure function of the training text: tokens are ranked by
(-count, token), so two builds from the same text always agree. It is saved as
JSON (tokens may be spaces or newlines, which a one-token-per-line file would
mangle) so that a resumed or evaluating job reuses exactly the same ids.
"""

import collections
import json
import os
import re
import tempfile

import numpy as np

PAD = '<pad>'
UNK = '<unk>'
PAD_ID = 0
UNK_ID = 1
_RESERVED = (PAD, UNK)

_FORMAT = 'lingvo_ext.vocab.v1'
UNITS = ('char', 'word')
# Words and single punctuation marks; whitespace other than newlines is
# dropped (word-level decoding joins with spaces).
_WORD_RE = re.compile(r'\w+|[^\w\s]|\n')


def Tokenize(text, unit):
  """Splits `text` into a list of string tokens for `unit` ('char'/'word')."""
  if unit == 'char':
    return list(text)
  if unit == 'word':
    return _WORD_RE.findall(text)
  raise ValueError(f'Unknown tokenizer unit {unit!r}; set unit to one of '
                   f'{UNITS}.')


class Vocab:
  """Maps tokens to ids: 0 is <pad>, 1 is <unk>, then tokens by frequency."""

  def __init__(self, tokens, unit, vocab_size, source=''):
    """Constructor.

    Args:
      tokens: The list of ordinary tokens, most frequent first (no reserved
        tokens).
      unit: 'char' or 'word'.
      vocab_size: The model's vocabulary size; ids are in [0, vocab_size).
      source: What the vocabulary was built from (e.g. the text file's path),
        saved with it so that a mismatch can name it.
    """
    if unit not in UNITS:
      raise ValueError(f'Unknown tokenizer unit {unit!r}; set unit to one of '
                       f'{UNITS}.')
    if len(tokens) + len(_RESERVED) > vocab_size:
      raise ValueError(
          f'The vocabulary has {len(tokens)} tokens plus {len(_RESERVED)} '
          f'reserved ids, more than vocab_size={vocab_size}; raise vocab_size '
          'or build the vocabulary again.')
    self.unit = unit
    self.vocab_size = vocab_size
    self.source = source
    self.tokens = list(_RESERVED) + list(tokens)
    self._ids = {t: i for i, t in enumerate(self.tokens)}

  @classmethod
  def Build(cls, text, unit, vocab_size, source=''):
    """Builds the vocabulary of `text`, keeping the vocab_size - 2 commonest."""
    if vocab_size <= len(_RESERVED):
      raise ValueError(f'vocab_size={vocab_size} leaves no room for tokens '
                       f'besides {_RESERVED}; raise vocab_size.')
    counts = collections.Counter(Tokenize(text, unit))
    for t in _RESERVED:
      counts.pop(t, None)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = [t for t, _ in ranked[:vocab_size - len(_RESERVED)]]
    return cls(keep, unit, vocab_size, source)

  def Missing(self, other):
    """The tokens of Vocab `other` that this one lacks, in `other`'s order."""
    return [t for t in other.tokens if t not in self._ids]

  def Encode(self, text):
    """Returns the int32 ids of `text`; unknown tokens map to UNK_ID."""
    get = self._ids.get
    return np.array([get(t, UNK_ID) for t in Tokenize(text, self.unit)],
                    dtype=np.int32)

  def Decode(self, ids):
    """Returns the text of `ids`, skipping padding."""
    toks = [self.tokens[i] if i < len(self.tokens) else UNK
            for i in np.asarray(ids).reshape([-1]).tolist()
            if i != PAD_ID]
    return ('' if self.unit == 'char' else ' ').join(toks)

  def ToJson(self):
    return json.dumps(
        {
            'format': _FORMAT,
            'unit': self.unit,
            'vocab_size': self.vocab_size,
            'source': self.source,
            'tokens': self.tokens[len(_RESERVED):],
        },
        ensure_ascii=False,
        indent=0)

  def Save(self, path):
    """Writes the vocabulary to `path` atomically (jobs may race to it)."""
    dirname = os.path.dirname(path) or '.'
    os.makedirs(dirname, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dirname, prefix='.vocab.')
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      f.write(self.ToJson())
    os.replace(tmp, path)

  @classmethod
  def Load(cls, path):
    with open(path, encoding='utf-8') as f:
      try:
        d = json.load(f)
      except ValueError as e:
        raise ValueError(f'{path} is not a vocabulary written by '
                         f'lingvo_ext ({e}).') from e
    if d.get('format') != _FORMAT:
      raise ValueError(f'{path} is not a {_FORMAT} vocabulary file.')
    return cls(d['tokens'], d['unit'], d['vocab_size'], d.get('source', ''))

  def __eq__(self, other):
    return (isinstance(other, Vocab) and self.unit == other.unit and
            self.vocab_size == other.vocab_size and self.tokens == other.tokens)
