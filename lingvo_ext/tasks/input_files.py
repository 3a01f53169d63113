"""Checks the files of Lingvo's record-based inputs before a graph is built.

Lingvo's record inputs (`LmInput` and every input with a `file_pattern`, read
by `generic_input.GenericInput`'s record yielder) fail badly on missing or
empty data: an empty text file crashes the trainer (a segfault, no message)
and loops forever standalone; a pattern that matches nothing waits or fails
deep in the input op. `CheckFilePattern` says so in one line first.
"""

import os

import lingvo.compat as tf


def _Patterns(file_pattern):
  """The globs of a Lingvo file_pattern ('type:glob,glob', or a list)."""
  if isinstance(file_pattern, (list, tuple)):
    globs = []
    for item in file_pattern:
      # Weighted mixes: [(pattern, weight), ...] or [pattern, ...].
      globs += _Patterns(item[0] if isinstance(item, (list, tuple)) else item)
    return globs
  if not isinstance(file_pattern, str) or not file_pattern:
    return []
  kind, sep, rest = file_pattern.partition(':')
  if sep and '/' not in kind and '://' not in file_pattern[:len(kind) + 3]:
    file_pattern = rest  # 'text:', 'tfrecord:', 'iota:'... record type.
  return [g for g in file_pattern.split(',') if g]


def _Empty(path, text):
  """Whether a file has no record: no bytes (text: only whitespace)."""
  size = os.path.getsize(path)
  if size == 0 or not text or size > 1 << 20:
    return size == 0
  with open(path, 'rb') as f:
    return not f.read().strip()


def CheckFilePattern(input_params, name='input'):
  """Raises ValueError if an input's files are missing or all empty.

  Args:
    input_params: An input generator's params; those without a
      `file_pattern` (or a remote one) are not checked.
    name: The params' override path, for the message.
  """
  if input_params is None or 'file_pattern' not in input_params:
    return
  pattern = input_params.file_pattern
  if isinstance(pattern, str) and pattern.startswith('iota:'):
    return  # Lingvo's synthetic records.
  globs = _Patterns(pattern)
  if not globs and not pattern:
    return  # No files: the input makes its own data (or says so itself).
  for glob in globs:
    if '://' in glob:
      continue  # A remote file system: left to its reader.
    files = tf.io.gfile.glob(glob)
    if not files:
      raise ValueError(
          f'{name}.file_pattern={pattern!r}: no file matches {glob!r}; '
          f'point {name}.file_pattern at your data (e.g. '
          "--model_params_override='input.file_pattern:\"text:/path/*.txt\"').")
    text = isinstance(pattern, str) and pattern.startswith('text:')
    if all(_Empty(f, text) for f in files if os.path.isfile(f)):
      raise ValueError(
          f'{name}.file_pattern={pattern!r}: every file matching {glob!r} is '
          f'empty or blank ({", ".join(files[:3])}{"..." if len(files) > 3 else ""}); '
          'Lingvo\'s record reader would crash or wait forever on it. Put '
          'data in it or point the pattern at other files.')
