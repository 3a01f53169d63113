"""Checks the files of Lingvo's record-based inputs before a graph is built.

Lingvo's record inputs (`LmInput` and every input with a `file_pattern`, read
by `generic_input.GenericInput`'s record yielder) fail badly on missing or
empty data: an empty text file crashes the trainer (a segfault, no message)
and loops forever standalone; a pattern that matches nothing waits or fails
deep in the input op. `CheckFilePattern` says so in one line first.
"""

import ctypes
import os
import select
import threading
import time

import lingvo.compat as tf


def Patterns(file_pattern):
  """The globs of a Lingvo file_pattern ('type:glob,glob', or a list)."""
  if isinstance(file_pattern, (list, tuple)):
    globs = []
    for item in file_pattern:
      # Weighted mixes: [(pattern, weight), ...] or [pattern, ...].
      globs += Patterns(item[0] if isinstance(item, (list, tuple)) else item)
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
  globs = Patterns(pattern)
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


# --- Files that change during a run ------------------------------------------

# Bytes of a changed text file read to tell text from binary data.
_SNIFF_BYTES = 1 << 16


def _LocalFiles(input_params):
  """{path: (inode, size, mtime)} of an input's local record files."""
  if input_params is None or 'file_pattern' not in input_params:
    return {}, False
  pattern = input_params.file_pattern
  if isinstance(pattern, str) and pattern.startswith('iota:'):
    return {}, False
  text = isinstance(pattern, str) and pattern.startswith('text:')
  files = {}
  for glob in Patterns(pattern):
    if '://' in glob:
      continue
    for f in tf.io.gfile.glob(glob):
      try:
        st = os.stat(f)
      except OSError:
        continue
      if os.path.isfile(f):
        files[f] = (st.st_ino, st.st_size, st.st_mtime_ns)
  return files, text


def _NotText(path):
  """Why the start of `path` is not text (NUL bytes, not UTF-8), or None."""
  try:
    with open(path, 'rb') as f:
      data = f.read(_SNIFF_BYTES)
  except OSError as e:
    return f'cannot be read ({e.strerror})'
  if b'\0' in data:
    return 'holds binary data (NUL bytes)'
  try:
    data.decode('utf-8')
  except UnicodeDecodeError as e:
    if e.start < len(data) - 4:  # Not a character cut by the sniff's end.
      return f'is not UTF-8 text (byte {data[e.start]:#04x} at {e.start})'
  return None


class FileWatch:
  """Watches the record files of a Lingvo input during a run.

  Lingvo's record yielder reads the files again at each pass over the data:
  a file deleted or emptied during the run makes it wait forever for a
  record (or crash), and binary data written over a text file is read as
  text. `Problem` says, in one line, which file changed how; a file that
  only grew or shrank (still text) is fine.
  """

  def __init__(self, input_params, name='input'):
    self._name = name
    self._pattern = (input_params.file_pattern if input_params is not None and
                     'file_pattern' in input_params else None)
    self._files, self._text = _LocalFiles(input_params)

  @property
  def files(self):
    return sorted(self._files)

  def Problem(self):
    """One line naming a file that broke since the start, or None."""
    where = f'{self._name}.file_pattern={self._pattern!r}'
    for path, (ino, size, mtime) in sorted(self._files.items()):
      try:
        st = os.stat(path)
      except FileNotFoundError:
        return f'{where}: {path} was deleted during the run'
      except OSError as e:
        return f'{where}: {path} cannot be read any more ({e.strerror})'
      if (st.st_ino, st.st_size, st.st_mtime_ns) == (ino, size, mtime):
        continue
      if _Empty(path, self._text):
        return f'{where}: {path} became empty during the run (was {size} bytes)'
      if self._text:
        why = _NotText(path)
        if why:
          return f'{where}: {path} changed during the run and now {why}'
      self._files[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return None


# EX_DATAERR of sysexits.h: the input data was bad.
EXIT_INPUT_BROKE = 65


# inotify(7) events on a watched file: unlinked (its link count changes),
# moved, deleted, written.
_IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE = 0x2, 0x4, 0x8
_IN_MOVE_SELF, _IN_DELETE_SELF = 0x800, 0x400
_IN_CLOEXEC = 0o2000000


def _Inotify(paths):
  """An inotify fd watching `paths` (Linux), or None where there is none."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(_IN_CLOEXEC)
  except (OSError, AttributeError):
    return None
  if fd < 0:
    return None
  mask = (_IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVE_SELF |
          _IN_DELETE_SELF)
  for path in paths:
    if libc.inotify_add_watch(fd, path.encode(), mask) < 0:
      os.close(fd)
      return None
  return fd


def StartWatch(input_params, stop, interval_s=1.0, name='input'):
  """Checks the input's files as they change, in a thread.

  Lingvo's reader opens a deleted file's path at its next pass and aborts
  (a CHECK in its record yielder): an inotify(7) event on each file wakes
  the check at once; every interval_s seconds it looks anyway.

  Args:
    input_params: The training input's params (no files: no thread).
    stop: Called with the one-line problem (FileWatch.Problem); it ends the
      process.
    interval_s: Seconds between two looks without an event.
    name: The params' override path, for the message.

  Returns:
    The FileWatch, or None when the input has no local record files.
  """
  watch = FileWatch(input_params, name)
  if not watch.files:
    return None
  fd = _Inotify(watch.files)

  def Loop():
    while True:
      if fd is None:
        time.sleep(interval_s)
      elif select.select([fd], [], [], interval_s)[0]:
        os.read(fd, 1 << 16)
        if all(os.path.exists(f) for f in watch.files):
          time.sleep(0.2)  # A file being rewritten: let the writer finish.
      problem = watch.Problem()
      if problem:
        stop(problem)
        return

  threading.Thread(target=Loop, daemon=True, name='FileWatch').start()
  return watch


def Tokenizers(input_params):
  """[(override path, tokenizer params)] of an input's tokenizers."""
  found = []
  if 'tokenizer' in input_params and input_params.tokenizer is not None:
    found.append(('input.tokenizer', input_params.tokenizer))
  if 'tokenizer_dict' in input_params:
    for key, p in sorted((input_params.tokenizer_dict or {}).items()):
      if p is not None:
        found.append((f'input.tokenizer_dict[{key!r}]', p))
  return found


VOCAB_KEYS = ('token_vocab_filepath', 'ngram_vocab_filepath', 'spm_model')


def VocabFiles(input_params):
  """[(override path, file)] of the vocab files an input's tokenizers read."""
  return [(f'{path_key}.{key}', tok.Get(key))
          for path_key, tok in Tokenizers(input_params)
          for key in VOCAB_KEYS if key in tok and tok.Get(key)]
