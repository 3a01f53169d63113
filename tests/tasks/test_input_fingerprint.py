"""The input fingerprint (tasks/input_fingerprint.py, runtime/input_guard.py):
a changed training input is one warning line on resume, a changed vocab a
refusal."""

import json
import os
import re

from lingvo.tasks.lm import input_generator as lingvo_lm_input
import pytest

from lingvo_ext.tasks import input_fingerprint
from lingvo_ext.tasks.lm import input_generator
from tests.support import user_path_testlib as lib

MODEL = '--model=lm.TransformerLmTiny'
# pylint: disable=protected-access
_When = input_fingerprint._When
_SampleHash = input_fingerprint._SampleHash


def _Text(path, n=400):
  with open(path, 'w') as f:
    for i in range(n):
      f.write(f'the cat sat on the mat, number {i}.\n')


def _Warnings(err):
  return [l for l in err.splitlines() if l.startswith('warning:')]


def _Errors(err):
  return [l for l in err.splitlines() if l.startswith('error:')]


def testAFileIsNamedWithWhatChanged(tmp_path):
  data = str(tmp_path / 'a.txt')
  _Text(data)
  p = lingvo_lm_input.LmInput.Params()
  p.file_pattern = f'text:{tmp_path}/*.txt'
  first = input_fingerprint.Current(p, str(tmp_path))
  assert list(first['files']) == [data]
  assert input_fingerprint.Compare(first, first) == (None, None)
  with open(data) as f:
    piece = f.read()[:2048]
  with open(data, 'w') as f:
    f.write(piece)
  now = input_fingerprint.Current(p, str(tmp_path))
  old, new = first['files'][data], now['files'][data]
  warning, refusal = input_fingerprint.Compare(first, now)
  assert refusal is None
  assert warning == (
      "the training input changed since this logdir's first start: "
      f'{data}: size {old["size"]} -> 2048 bytes, mtime '
      f'{_When(old["mtime_ns"])} -> {_When(new["mtime_ns"])}, content '
      '(sampled blocks) '
      'differs; training goes on with it as it is now (--accept_changed_input '
      'records it and silences this).')
  # Same size and mtime, other bytes: the sampled blocks tell.
  os.utime(data, ns=(old['mtime_ns'], old['mtime_ns']))
  first['files'][data] = dict(new, mtime_ns=old['mtime_ns'])
  with open(data, 'r+') as f:
    f.write('X')
  os.utime(data, ns=(old['mtime_ns'], old['mtime_ns']))
  warning, _ = input_fingerprint.Compare(
      first, input_fingerprint.Current(p, str(tmp_path)))
  assert warning.startswith("the training input changed since this logdir's "
                            f'first start: {data}: content (sampled blocks) '
                            'differs;'), warning


def testTheHashReadsAFewBlocksNotTheWholeFile(tmp_path):
  big = tmp_path / 'big.txt'
  size = 64 * input_fingerprint.BLOCK_BYTES
  big.write_bytes(b'a' * size)
  before = _SampleHash(str(big), size)
  with open(big, 'r+b') as f:  # Between two sampled blocks: not seen.
    f.seek(size // 6)
    f.write(b'b')
  assert _SampleHash(str(big), size) == before
  with open(big, 'r+b') as f:  # In the last block.
    f.seek(size - 1)
    f.write(b'b')
  assert _SampleHash(str(big), size) != before


def testAVocabThatChangedIsARefusal(tmp_path):
  p = input_generator.LmInput.Params()
  vocab = tmp_path / 'train' / 'vocab.json'
  first = input_fingerprint.Current(p, str(tmp_path))
  assert first['vocab'] == {str(vocab): None}  # The run builds it.
  vocab.parent.mkdir()
  vocab.write_text('{"tokens": ["a", "b"]}')
  second = input_fingerprint.Current(p, str(tmp_path))
  assert input_fingerprint.Compare(first, second) == (None, None)
  vocab.write_text('{"tokens": ["b", "a"]}')
  _, refusal = input_fingerprint.Compare(second, input_fingerprint.Current(
      p, str(tmp_path)))
  assert refusal == (
      f"the vocab {vocab} changed since this logdir's first start (its hash "
      "differs): the checkpoints' embeddings are indexed by the old one. Put "
      'it back, or train with a fresh --logdir.')


@pytest.mark.e2e
def testAResumeOnChangedInputWarnsOnceTheFlagSilencesAVocabChangeRefuses(
    tmp_path):
  data = str(tmp_path / 'data.txt')
  _Text(data)
  logdir = str(tmp_path / 'log')
  flags = [MODEL, f'--logdir={logdir}',
           f'--model_params_override=input.text_file:"{data}"']
  rc, _, err = lib.Train(*flags, '--max_steps=2')
  assert rc == 0, err[-3000:]
  record = os.path.join(logdir, 'train', input_fingerprint.FILENAME)
  with open(record) as f:
    assert list(json.load(f)['files']) == [data]
  # Unchanged: no line.
  rc, _, err = lib.Train(*flags, '--max_steps=3')
  assert rc == 0, err[-3000:]
  assert not _Warnings(err), err[-3000:]
  # The text replaced at its path by a 2 KB piece of itself.
  old = os.stat(data)
  with open(data) as f:
    piece = f.read()[:2048]
  with open(data, 'w') as f:
    f.write(piece)
  new = os.stat(data)
  rc, _, err = lib.Train(*flags, '--max_steps=4')
  assert rc == 0, err[-3000:]
  assert _Warnings(err) == [
      "warning: the training input changed since this logdir's first start: "
      f'{data}: size {old.st_size} -> 2048 bytes, mtime '
      f'{_When(old.st_mtime_ns)} -> {_When(new.st_mtime_ns)}, content (sampled '
      'blocks) differs; training goes on with it as it is now '
      '(--accept_changed_input records it and silences this).'], err[-3000:]
  # The flag: silent, and the file recorded as it is now.
  rc, _, err = lib.Train(*flags, '--max_steps=5', '--accept_changed_input')
  assert rc == 0, err[-3000:]
  assert not _Warnings(err), err[-3000:]
  with open(record) as f:
    assert json.load(f)['files'][data] == input_fingerprint._FileEntry(data)
  # A text with tokens its vocab lacks: the vocab's refusal, as before.
  with open(data, 'w') as f:
    f.write('QZXJKV WQY 0123456789 {}[]<>\n' * 50)
  rc, _, err = lib.Train(*flags, '--max_steps=6', '--accept_changed_input')
  assert rc == 2, err[-3000:]
  vocab = os.path.join(logdir, 'train', input_generator.VOCAB_FILENAME)
  assert len(_Errors(err)) == 1, err[-3000:]
  assert re.match(rf'error: {re.escape(vocab)} does not match the data '
                  rf'{re.escape(data)}: \d+ of the data\'s commonest train '
                  'tokens are missing from it', _Errors(err)[0]), err[-3000:]
  # The vocab itself changed (its tokens reordered): refused, before
  # anything is written.
  _Text(data)
  with open(vocab) as f:
    saved = json.load(f)
  saved['tokens'][2:] = saved['tokens'][:1:-1]
  with open(vocab, 'w') as f:
    json.dump(saved, f)
  before = os.listdir(os.path.join(logdir, 'train'))
  rc, out, err = lib.Train(*flags, '--max_steps=6', '--accept_changed_input')
  assert rc == 2, err[-3000:]
  assert _Errors(err) == [
      f"error: the vocab {vocab} changed since this logdir's first start (its "
      "hash differs): the checkpoints' embeddings are indexed by the old one. "
      'Put it back, or train with a fresh --logdir.'], err[-3000:]
  assert not lib.Losses(out)
  assert os.listdir(os.path.join(logdir, 'train')) == before
