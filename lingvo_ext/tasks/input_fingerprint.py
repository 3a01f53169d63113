"""What a logdir trains on: its input files and vocab, recorded and compared.

At a logdir's first start the trainer records each training input file's
size, mtime and a hash of a few sampled blocks (not the whole file: bounded
time), and each vocab file's hash, in LOGDIR/train/input_fingerprint.json.
On resume, a changed input file is one warning line (`Compare`); a changed
vocab is a refusal: the checkpoints' embeddings are indexed by it. The
files are those of Lingvo's `file_pattern`, lingvo_ext's LmInput
`text_file`, the tokenizers' vocab files and LmInput's vocab.json.
"""

import hashlib
import json
import os
import time

import lingvo.compat as tf

from lingvo_ext.tasks import input_files

FILENAME = 'input_fingerprint.json'
# Blocks hashed per input file (the first, the last, evenly between), bytes.
SAMPLE_BLOCKS = 4
BLOCK_BYTES = 1 << 14
# Bytes of a vocab file hashed whole; a larger one is sampled as inputs are.
VOCAB_WHOLE_BYTES = 1 << 26


def _SampleHash(path, size):
  """sha256 of SAMPLE_BLOCKS blocks of `path` (all of it when small)."""
  digest = hashlib.sha256(str(size).encode())
  with open(path, 'rb') as f:
    if size <= SAMPLE_BLOCKS * BLOCK_BYTES:
      digest.update(f.read())
    else:
      last = size - BLOCK_BYTES
      for i in range(SAMPLE_BLOCKS):
        f.seek(last * i // (SAMPLE_BLOCKS - 1))
        digest.update(f.read(BLOCK_BYTES))
  return digest.hexdigest()


def _FileEntry(path):
  st = os.stat(path)
  return {'size': st.st_size, 'mtime_ns': st.st_mtime_ns,
          'sample_sha256': _SampleHash(path, st.st_size)}


def InputFiles(input_params):
  """The local files a training input reads, sorted."""
  if input_params is None:
    return []
  found = set()
  if 'text_file' in input_params and input_params.text_file:
    found.add(os.path.abspath(input_params.text_file))
  if 'file_pattern' in input_params:
    pattern = input_params.file_pattern
    if not (isinstance(pattern, str) and pattern.startswith('iota:')):
      for glob in input_files.Patterns(pattern):
        if '://' not in glob:
          found.update(os.path.abspath(f) for f in tf.io.gfile.glob(glob))
  return sorted(f for f in found if '://' not in f and os.path.isfile(f))


def VocabFiles(input_params, logdir):
  """The local vocab files of a training input (LmInput's vocab.json too)."""
  if input_params is None:
    return []
  paths = [path for _, path in input_files.VocabFiles(input_params)]
  if 'vocab_file' in input_params:  # lingvo_ext's LmInput.
    paths.append(input_params.vocab_file or
                 os.path.join(logdir, 'train', 'vocab.json'))
  return sorted({os.path.abspath(p) for p in paths if p and '://' not in p})


def Current(input_params, logdir):
  """The fingerprint of the input and vocab files as they are now."""
  vocab = {}
  for path in VocabFiles(input_params, logdir):
    if os.path.isfile(path):
      size = os.path.getsize(path)
      with open(path, 'rb') as f:
        vocab[path] = (hashlib.sha256(f.read()).hexdigest()
                       if size <= VOCAB_WHOLE_BYTES else
                       _SampleHash(path, size))
    else:
      vocab[path] = None  # Built by the run (LmInput), recorded next start.
  return {'files': {p: _FileEntry(p) for p in InputFiles(input_params)},
          'vocab': vocab}


def Read(train_dir):
  """The recorded fingerprint, or None."""
  try:
    with open(os.path.join(train_dir, FILENAME)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def Write(train_dir, fingerprint):
  path = os.path.join(train_dir, FILENAME)
  temp = f'{path}.tmp{os.getpid()}'
  with open(temp, 'w') as f:
    json.dump(fingerprint, f, indent=1, sort_keys=True)
  os.replace(temp, path)


def _When(ns):
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ns / 1e9))


def _Changes(old, new):
  """What changed between two file entries: size, mtime, content."""
  parts = []
  if old['size'] != new['size']:
    parts.append(f'size {old["size"]} -> {new["size"]} bytes')
  if old['mtime_ns'] != new['mtime_ns']:
    parts.append(f'mtime {_When(old["mtime_ns"])} -> '
                 f'{_When(new["mtime_ns"])}')
  if old['sample_sha256'] != new['sample_sha256']:
    parts.append('content (sampled blocks) differs')
  return ', '.join(parts)


def Compare(recorded, current):
  """(the warning about changed input files or None, the vocab refusal or
  None) of `current` against `recorded` (Current's)."""
  old, new = recorded.get('files', {}), current['files']
  changed = []
  for path in sorted(set(old) | set(new)):
    if path not in new:
      changed.append(f'{path}: gone')
    elif path not in old:
      changed.append(f'{path}: new')
    else:
      what = _Changes(old[path], new[path])
      if what:
        changed.append(f'{path}: {what}')
  warning = None
  if changed:
    more = (f' (and {len(changed) - 1} other file(s))' if len(changed) > 1
            else '')
    warning = (f'the training input changed since this logdir\'s first '
               f'start: {changed[0]}{more}; training goes on with it as it '
               'is now (--accept_changed_input records it and silences '
               'this).')
  refusal = None
  for path, digest in sorted(current['vocab'].items()):
    was = recorded.get('vocab', {}).get(path)
    if digest and was and digest != was:
      refusal = (f'the vocab {path} changed since this logdir\'s first start '
                 '(its hash differs): the checkpoints\' embeddings are '
                 'indexed by the old one. Put it back, or train with a fresh '
                 '--logdir.')
      break
  return warning, refusal


def Updated(recorded, current, accept):
  """The fingerprint to record: the current files when accepted (or
  unchanged, or first), else the recorded ones; the vocab files as now."""
  files = current['files'] if accept or recorded is None else recorded.get(
      'files', {})
  # A vocab deleted (LmInput rebuilds it) is recorded at the next start.
  return {'files': files, 'vocab': dict(current['vocab'])}
