"""A sequence input's lengths against its buckets, before anything is written.

Lingvo's bucketing (`bucket_upper_bound`) drops every example longer than
the last bound without a word: an input none of whose examples fits makes
its reader wait forever, and the trainer hangs with nothing printed. And
`NmtInput` with `pad_to_max_seq_length` pads each batch to
`source_max_length`/`target_max_length`: a bound above them lets a longer
pair in, whose batch fails ('Paddings must be non-negative') and is retried
silently. `Check` finds both (one-line ValueError); `SampleLengths` reads the
lengths of a sample of the input's tf.Example records, bounded in examples
and time, and `Check` says once how many of them the buckets drop.
"""

import sys
import time

# The sample: at most this many records, for at most this long.
SAMPLE_RECORDS = 2000
SAMPLE_SECONDS = 5.0
# Features whose length is an example's, as NmtInput's bucket key counts it:
# the unpadded steps of its paddings, else its ids.
_LENGTH_FEATURES = (('source_padding', 'source_id'),
                    ('target_padding', 'target_id'))

_said = set()  # The notes printed in this process (each said once).


def _IsNmtInput(input_params):
  try:
    from lingvo.tasks.mt import input_generator  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return isinstance(input_params.cls, type) and issubclass(
      input_params.cls, input_generator.NmtInput)


def _Length(example):
  """An example's bucket key (NmtInput's): its longest side, or None."""
  features = example.features.feature
  lengths = []
  for paddings, ids in _LENGTH_FEATURES:
    if paddings in features and features[paddings].float_list.value:
      lengths.append(int(round(sum(
          1.0 - v for v in features[paddings].float_list.value))))
    elif ids in features:
      lengths.append(len(features[ids].int64_list.value))
  return max(lengths) if lengths else None


def SampleLengths(file_pattern, records=SAMPLE_RECORDS,
                  seconds=SAMPLE_SECONDS):
  """Lengths of up to `records` tf.Example records of a 'tfrecord:' pattern,
  read for at most `seconds`; [] for other patterns or other records."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  from lingvo_ext.tasks import input_files  # pylint: disable=g-import-not-at-top
  if not (isinstance(file_pattern, str) and
          file_pattern.startswith('tfrecord:')):
    return []
  files = []
  for glob in input_files.Patterns(file_pattern):
    if '://' not in glob:
      files += sorted(tf.io.gfile.glob(glob))
  lengths, start = [], time.monotonic()
  for path in files:
    try:
      for record in tf.compat.v1.io.tf_record_iterator(path):
        length = _Length(tf.train.Example.FromString(record))
        if length is None:
          return []  # Not a sequence example.
        lengths.append(length)
        if (len(lengths) >= records or
            time.monotonic() - start > seconds):
          return lengths
    except Exception:  # pylint: disable=broad-except
      return []  # Not tf.Example records: left to the reader.
  return lengths


def Check(input_params, where):
  """Raises ValueError (one line) for buckets no sampled example fits, or
  a bucket bound beyond NmtInput's padded lengths; says once how many
  sampled examples the buckets drop (stderr)."""
  p = input_params
  if p is None or 'bucket_upper_bound' not in p or not p.bucket_upper_bound:
    return
  bounds = list(p.bucket_upper_bound)
  last = max(bounds)
  if _IsNmtInput(p) and p.pad_to_max_seq_length:
    for key in ('source_max_length', 'target_max_length'):
      limit = p.Get(key)
      if limit and last > limit:
        raise ValueError(
            f'{where}: input.bucket_upper_bound ends at {last}, above '
            f'input.{key}={limit}: with pad_to_max_seq_length NmtInput pads '
            f'each batch to {key}, so a pair longer than {limit} fails its '
            'batch (Paddings must be non-negative) and Lingvo retries it '
            f'silently; set input.source_max_length and '
            f'input.target_max_length to {last}, or the last bound to {limit}.')
  lengths = SampleLengths(p.Get('file_pattern'))
  if not lengths:
    return
  dropped = [n for n in lengths if n > last]
  if len(dropped) == len(lengths):
    raise ValueError(
        f'{where}: input.bucket_upper_bound={bounds}: none of the '
        f'{len(lengths)} examples sampled from input.file_pattern fits '
        f'(lengths {min(lengths)}..{max(lengths)}, the last bound {last}); '
        "Lingvo's bucketing drops them all and its reader would wait "
        f'forever. Raise the last bound to {max(lengths)} (and '
        'input.source_max_length/target_max_length with it).')
  note = (f'note: {where}: {len(dropped)} of the {len(lengths)} examples '
          f'sampled from its files ({100.0 * len(dropped) / len(lengths):.0f}%)'
          f' are longer than input.bucket_upper_bound\'s last bound {last} '
          f'(up to {max(lengths)}): Lingvo\'s bucketing drops them.')
  if dropped and note not in _said:
    _said.add(note)
    print(note, file=sys.stderr)
