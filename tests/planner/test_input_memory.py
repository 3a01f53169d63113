"""The input's record buffer (planner/input_memory.py): its formula."""

import os
import struct

from lingvo.core import hyperparams

from lingvo_ext.planner import input_memory


def _Input(pattern, size):
  p = hyperparams.Params()
  p.Define('file_pattern', pattern, '')
  p.Define('file_buffer_size', size, '')
  return p


def _Text(path, lines):
  with open(path, 'w') as f:
    f.write(''.join(line + '\n' for line in lines))


def testATextBufferHoldsAllRecordsOfAnEpochAtMost(tmp_path):
  # 30 records of 9 bytes (10 with their newline) in two files.
  for i in range(2):
    _Text(tmp_path / f'a-{i}', ['x' * 9] * 15)
  pattern = 'text:' + str(tmp_path / 'a-*')
  per = 9 + input_memory.RECORD_OVERHEAD
  # A buffer larger than an epoch holds the epoch's 30 records.
  assert input_memory.BufferBytes(_Input(pattern, 10**7)) == 30 * per
  # A smaller one, its own size.
  assert input_memory.BufferBytes(_Input(pattern, 7)) == 7 * per
  kind, paths = input_memory.Files(pattern)
  assert kind == 'text' and len(paths) == 2


def testATfRecordBufferReadsTheRecordsFraming(tmp_path):
  with open(tmp_path / 'r.tfrecords', 'wb') as f:
    for n in (100, 300):  # Mean 200 bytes.
      f.write(struct.pack('<Q', n) + b'\0' * 4 + b'y' * n + b'\0' * 4)
  pattern = 'tfrecord:' + str(tmp_path / 'r.tfrecords')
  per = 200 + input_memory.RECORD_OVERHEAD
  assert input_memory.BufferBytes(_Input(pattern, 1000)) == 2 * per
  assert input_memory.BufferBytes(_Input(pattern, 1)) == 1 * per


def testShardedPatternsAndInputsWithoutFiles(tmp_path):
  for i in range(3):
    _Text(tmp_path / f'b-{i:05d}-of-00003', ['z'])
  kind, paths = input_memory.Files('text:' + str(tmp_path / 'b') + '@3')
  assert kind == 'text' and len(paths) == 3
  assert input_memory.BufferBytes(hyperparams.Params()) == 0.
  assert input_memory.BufferBytes(_Input('', 100)) == 0.
  assert not os.path.exists(tmp_path / 'none')
  assert input_memory.BufferBytes(
      _Input('text:' + str(tmp_path / 'none'), 100)) == 0.
