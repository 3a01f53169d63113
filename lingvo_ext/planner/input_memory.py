"""The input's record buffer, predicted from its params (pure Python).

Lingvo's record input (`file_pattern`, `file_buffer_size`) shuffles its
records in a buffer of up to `file_buffer_size` of them, and starts an epoch
only once the last epoch's records are consumed (its record yielder): the
buffer holds min(file_buffer_size, the files' records) records. Each takes
its bytes (the files' mean record) and RECORD_OVERHEAD of its own. The
files are read only as far as needed to count the records a full buffer
holds (at most SCAN_BYTES; beyond, the mean so far stands for the rest).
docs/faults.md, "Memory".
"""

import glob
import os
import re
from typing import List
from typing import Tuple

# A buffered record's own bytes beside its value: the string, its slot in
# the buffer, the allocator's rounding.
RECORD_OVERHEAD = 64
# The most bytes of the files read to count their records.
SCAN_BYTES = 64 * 2**20
_CHUNK = 2**20
# tfrecord framing: a length (8 bytes) and its CRC (4), the data's CRC (4).
_TFRECORD_HEADER = 12
_TFRECORD_FOOTER = 4


def Files(file_pattern: str) -> Tuple[str, List[str]]:
  """(record type, the files) of a Lingvo file pattern: 'type:' prefix
  ('text', 'tfrecord', ...), ',' or ';' between globs, 'name@N' shards."""
  kind = ''
  m = re.match(r'^([a-z_]+):', file_pattern)
  if m:
    kind, file_pattern = m.group(1), file_pattern[m.end():]
  paths = []
  for pattern in re.split('[,;]', file_pattern):
    shard = re.match(r'^(.*)@(\d+|\*)$', pattern)
    if shard:
      n = shard.group(2)
      pattern = (f'{shard.group(1)}-?????-of-?????' if n == '*' else
                 f'{shard.group(1)}-?????-of-{int(n):05d}')
    paths.extend(sorted(glob.glob(pattern)))
  return kind, paths


def _TextRecords(path: str, budget: int) -> Tuple[int, int]:
  """(lines, bytes read) of a text file, reading at most `budget` bytes."""
  lines = read = 0
  with open(path, 'rb') as f:
    while read < budget:
      chunk = f.read(min(_CHUNK, budget - read))
      if not chunk:
        break
      lines += chunk.count(b'\n')
      read += len(chunk)
      last = chunk[-1:]
  if read and last != b'\n' and read == os.path.getsize(path):
    lines += 1  # A last line without its newline.
  return lines, read


def _TfRecords(path: str, budget: int) -> Tuple[int, int]:
  """(records, their data bytes) of a tfrecord file, reading only its
  headers, at most `budget` bytes of the file."""
  records = data = pos = 0
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    while pos < min(size, budget):
      header = f.read(_TFRECORD_HEADER)
      if len(header) < _TFRECORD_HEADER:
        break
      n = int.from_bytes(header[:8], 'little')
      pos += _TFRECORD_HEADER + n + _TFRECORD_FOOTER
      f.seek(pos)
      records += 1
      data += n
  return records, data


def BufferBytes(input_params) -> float:
  """The bytes of the records the input's buffer holds at its fullest; 0
  for an input with no record files (a synthetic or in-memory one)."""
  if 'file_pattern' not in input_params or 'file_buffer_size' not in (
      input_params):
    return 0.
  pattern, size = input_params.file_pattern, input_params.file_buffer_size
  if not isinstance(pattern, str) or not pattern or not size:
    return 0.
  kind, paths = Files(pattern)
  # The mean record of the files read, counted until a full buffer's worth.
  records = value_bytes = 0
  total_bytes = sum(os.path.getsize(p) for p in paths)
  budget = SCAN_BYTES
  for path in paths:
    if records >= size or budget <= 0:
      break
    if kind == 'text':
      n, b = _TextRecords(path, budget)
      budget -= b
      b -= n  # The newlines are not in the records.
    elif kind.startswith('tfrecord') and not kind.endswith('gzip'):
      n, b = _TfRecords(path, budget)
      budget -= b + n * (_TFRECORD_HEADER + _TFRECORD_FOOTER)
    else:
      return float(total_bytes)  # Records not countable: the files' bytes.
    records += n
    value_bytes += b
  if not records:
    return 0.
  mean = value_bytes / records
  # The records of all the files, the unread ones at the mean so far.
  read = value_bytes + records * (1 if kind == 'text' else
                                  _TFRECORD_HEADER + _TFRECORD_FOOTER)
  all_records = records * max(1., total_bytes / max(read, 1))
  return float(min(size, all_records) * (mean + RECORD_OVERHEAD))


def RunBufferBytes(model_params) -> float:
  """BufferBytes of an experiment's input params, 0 without any: the memory
  model's input_buffer term, the same for every plan (the start check's and
  --plan=auto's)."""
  if 'input' not in model_params or model_params.input is None:
    return 0.
  return BufferBytes(model_params.input)
